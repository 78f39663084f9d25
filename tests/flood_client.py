"""An unauthenticated client flooding r2comm listeners (issue 28, item 4): n idle connections
from 127.0.1.1.. (addresses of no rank), spread over the given ports and renewed whenever the
server cuts one, plus one client per port that trickles a plausible HELLO a byte every 0.1 s.
argv: seconds n_idle port... Stops after `seconds` or when its stdin closes, then prints
`FLOOD opened=<connections made>`."""
import socket
import struct
import sys
import threading
import time


def idle(ports, n, stop, opened, seconds=120):
    """n idle connections from 127.0.1.1.. spread over the ports, each renewed when the server
    cuts it; opened[0] counts those made. Until stop is set (at most `seconds`)."""
    socks = [None] * n
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        for i in range(n):
            s = socks[i]
            if s is not None:
                try:
                    if s.recv(1):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                s.close()                        # cut off: connect again
            s = socket.socket()
            try:
                s.bind((f"127.0.1.{1 + i % 250}", 0))
                s.settimeout(0.5)
                s.connect(("127.0.0.1", ports[i % len(ports)]))
                s.setblocking(False)
                socks[i] = s
                opened[0] += 1
            except OSError:
                s.close()
                socks[i] = None
        stop.wait(0.05)
    for s in socks:
        if s is not None:
            s.close()


def trickle(port, stop, seconds=120):
    """A client from 127.0.1.251 that sends a plausible HELLO one byte every 0.1 s, again and
    again, until stop is set (at most `seconds`)."""
    hello = struct.pack("!4sH", b"R2CH", 1) + bytes(38)
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        s = socket.socket()
        try:
            s.bind(("127.0.1.251", 0))
            s.settimeout(0.5)
            s.connect(("127.0.0.1", port))
            for i in range(len(hello)):
                if stop.wait(0.1):
                    break
                s.send(hello[i:i + 1])
        except OSError:
            stop.wait(0.05)
        finally:
            s.close()


def main():
    seconds, n = float(sys.argv[1]), int(sys.argv[2])
    ports = [int(p) for p in sys.argv[3:]]
    stop, opened = threading.Event(), [0]
    ts = [threading.Thread(target=idle, args=(ports, n, stop, opened))]
    ts += [threading.Thread(target=trickle, args=(p, stop)) for p in ports]
    ts.append(threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True))
    for t in ts:
        t.start()
    stop.wait(min(seconds, 120))
    stop.set()
    for t in ts:
        t.join(5)
    print(f"FLOOD opened={opened[0]}", flush=True)


if __name__ == "__main__":
    main()
