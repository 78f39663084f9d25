"""Tiny TCP tools the testbed tests run inside the namespaces (stdlib only).

  sink ADDR PORT      accept one connection, read to EOF, print {"bytes", "seconds"}
                      (counted from the first read on, so start-up is left out)
  source ADDR PORT    connect and send zeros for --seconds, then close
  listen ADDR PORT    accept and close connections until --max-seconds pass
  connect ADDR PORT   one connect attempt within --timeout: print ok / fail, exit 0 / 1

Listeners print "ready" once listening, so a test never races the bind.
Every call is bounded by a socket timeout or a deadline.
"""
import argparse
import json
import socket
import sys
import time

CHUNK = bytes(256 * 1024)


def _listener(addr, port, max_seconds):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(16)
    srv.settimeout(max_seconds)
    print("ready", flush=True)
    return srv


def sink(args):
    srv = _listener(args.addr, args.port, args.max_seconds)
    conn, _ = srv.accept()
    conn.settimeout(args.max_seconds)
    first = conn.recv(1 << 20)
    start = last = time.monotonic()
    total = 0  # bytes after the first read, over the time since it: the steady rate
    while first:
        data = conn.recv(1 << 20)
        if not data:
            break
        last = time.monotonic()
        total += len(data)
    print(json.dumps({"bytes": total, "seconds": last - start}), flush=True)


def source(args):
    with socket.create_connection((args.addr, args.port), timeout=5) as conn:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            conn.sendall(CHUNK)


def listen(args):
    srv = _listener(args.addr, args.port, 0.5)
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        try:
            srv.accept()[0].close()
        except socket.timeout:
            pass


def connect(args):
    try:
        socket.create_connection((args.addr, args.port), timeout=args.timeout).close()
    except OSError as exc:
        print(f"fail: {exc}", flush=True)
        sys.exit(1)
    print("ok", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["sink", "source", "listen", "connect"])
    parser.add_argument("addr")
    parser.add_argument("port", type=int)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=1.5)
    args = parser.parse_args()
    {"sink": sink, "source": source, "listen": listen, "connect": connect}[args.mode](args)


if __name__ == "__main__":
    main()
