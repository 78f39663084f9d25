"""An unauthenticated client flooding r2comm listeners (issue 28, item 4; issue 40): n idle
connections, spread over the given ports and renewed whenever the server cuts one, plus one
client per port that trickles a plausible HELLO a byte every 0.1 s. Standard library only, so
that another user (tests run it as uid 65534 with setpriv) can run it with the system Python.

argv: seconds n_idle port... [key=value...]
  src=many         the idle connections come from 127.0.1.1..250 (addresses of no rank; default)
  src=ADDRESS      ... all from ADDRESS (a rank's own address: any local user can bind it)
  dst=ADDRESS      the listeners' address (default 127.0.0.1)
  hellos=shm       instead of the trickle: connections from changing 127.x addresses (or src)
                   that send
                   HELLOs built from what a local user can read (the first field of the r2comm
                   segment names in /dev/shm, where the job id was), never proving the secret
  hellos=HEX       ... that replay a HELLO seen on the wire (a network observer)
  from=S to=D rail=K version=V   the HELLOs' fields (hellos=shm)
Stops after `seconds` or when its stdin closes, then prints
`FLOOD hellos=<hellos sent> answered=<hellos the server answered> opened=<connections made>`."""
import os
import shutil
import socket
import struct
import sys
import threading
import time

HELLO = struct.Struct("!4sH8siiHI16s")      # r2comm/transport/tcp.py's
OTHER_UID = 65534                           # nobody


def command(args):
    """The argv that runs this client with `args` as another user (uid 65534, by setpriv) when
    the tests run as root, else as this one; the system Python where there is one (another
    user may not read the virtualenv's interpreter)."""
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    me = [py, "-I", os.path.abspath(__file__), *map(str, args)]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"] + me
    return me


def result(out):
    """{opened, hellos, answered} from the client's last line."""
    line = [ln for ln in out.splitlines() if ln.startswith("FLOOD ")]
    return {k: int(v) for k, v in (f.split("=") for f in line[-1].split()[1:])} if line else {}


def idle(ports, n, stop, opened, seconds=120, src=None, dst="127.0.0.1"):
    """n idle connections from 127.0.1.1.. (or all from `src`) to the ports of `dst`, each
    renewed when the server cuts it; opened[0] counts those made. Until stop is set (at most
    `seconds`)."""
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
                s.bind((src or f"127.0.1.{1 + i % 250}", 0))
                s.settimeout(0.5)
                s.connect((dst, ports[i % len(ports)]))
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


def shm_job_ids(directory="/dev/shm"):
    """The first field of every r2comm segment name this user can list (the job id, before
    issue 40)."""
    out = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if name.startswith("r2comm-"):
            field = name[len("r2comm-"):].split("-")[0]
            try:
                if len(field) == 16:
                    out.add(bytes.fromhex(field))
            except ValueError:
                pass
    return out


def hellos(target, make, stop, counts, seconds=120, src=None, burst=8):
    """Connections from changing 127.x addresses (or all from `src`) to target (address,
    port), each sending one
    HELLO from make() (None: nothing to send yet) and holding it unproven until the server
    closes it or 1.5 s pass; counts: [hellos sent, hellos the server answered]."""
    end = time.monotonic() + seconds
    k = 0
    held = []
    while not stop.is_set() and time.monotonic() < end:
        hello = make()
        if hello is None:
            stop.wait(0.01)
            continue
        for _ in range(burst):
            k += 1
            s = socket.socket()
            try:
                s.bind((src or f"127.{2 + k // 62500 % 200}.{k // 250 % 250}.{1 + k % 250}", 0))
                s.settimeout(0.5)
                s.connect(target)
                s.sendall(hello)
                s.setblocking(False)
                counts[0] += 1
                held.append((time.monotonic(), s, [False]))
            except OSError:
                s.close()
        keep = []
        now = time.monotonic()
        for t0, s, answered in held:
            try:
                data = s.recv(64)
                if data and not answered[0]:
                    answered[0] = True
                    counts[1] += 1
                gone = not data
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone or now - t0 > 1.5:
                s.close()
            else:
                keep.append((t0, s, answered))
        held = keep
        stop.wait(0.02)
    for _, s, _ in held:
        s.close()


def observe_hellos(lst, out, n=1, timeout=5.0):
    """A network observer's view: accept n connections on listener lst and keep the HELLO
    each one sends (appended to out), then close them."""
    for _ in range(n):
        s, _ = lst.accept()
        try:
            s.settimeout(timeout)
            buf = b""
            while len(buf) < HELLO.size:
                part = s.recv(HELLO.size - len(buf))
                if not part:
                    break
                buf += part
            out.append(buf)
        finally:
            s.close()


def main():
    pos = [a for a in sys.argv[1:] if "=" not in a]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    seconds, n = float(pos[0]), int(pos[1])
    ports = [int(p) for p in pos[2:]]
    src = None if opts.get("src", "many") == "many" else opts["src"]
    dst = opts.get("dst", "127.0.0.1")
    stop, opened, counts = threading.Event(), [0], [0, 0]
    ts = [threading.Thread(target=idle, args=(ports, n, stop, opened, seconds, src, dst))]
    if "hellos" not in opts:
        ts += [threading.Thread(target=trickle, args=(p, stop, seconds)) for p in ports]
    else:
        if opts["hellos"] == "shm":
            fields = (int(opts.get("version", 1)), int(opts["from"]), int(opts["to"]),
                      int(opts["rail"]))

            def make():
                ids = shm_job_ids()
                if not ids:
                    return None
                ver, a, b, rail = fields
                return HELLO.pack(b"R2CH", ver, min(ids), a, b, rail, 7, os.urandom(16))
        else:
            raw = bytes.fromhex(opts["hellos"])

            def make():
                return raw
        target = (dst, ports[0])
        ts.append(threading.Thread(target=hellos, args=(target, make, stop, counts, seconds, src)))
    ts.append(threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True))
    for t in ts:
        t.start()
    stop.wait(min(seconds, 120))
    stop.set()
    for t in ts:
        t.join(5)
    print(f"FLOOD hellos={counts[0]} answered={counts[1]} opened={opened[0]}", flush=True)


if __name__ == "__main__":
    main()
