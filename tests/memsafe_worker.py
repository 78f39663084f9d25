"""Child process for tests/test_memsafe.py: one Engine (rank 0 of 2, one rail to rank 1 on a
socketpair); this script plays rank 1 on the other end with hand-made frames. Prints
"RESULT {json}" at the end. Usage: memsafe_worker.py <scenario>."""
import json
import socket
import struct
import sys
import time

import numpy as np

from r2comm._core import engine as eng, testing

F_DATA, F_ACK = 1, 2
FL_P2P = 1
U8 = 4                         # r2::Dtype code of uint8


def hdr(type_, flags=0, dtype=U8, comm=3, seq=0, step=0, count=0, chunk=0, length=0, total=0,
        aux=0):
    return testing.encode_header(type_, flags, dtype, 0, comm, seq, step, count, chunk, length, total,
                             aux)


def new_engine(cs=65536, window=1 << 20):
    e = eng.Engine(0, 2, [0, 1], cs, 5.0, 10.0, window)
    e.start()
    return e


def pair(e, rail=0, conn=7):
    a, b = socket.socketpair()
    a.setblocking(False)
    e.links.attach(1, rail, a.detach(), conn)
    b.settimeout(5.0)
    return b


def kinds(e):
    return [ev["kind"] for ev in e.events_since(0)]


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def rail_state(e):
    return e.rail_stats()[1][0][0]


def closed(b):
    b.settimeout(2.0)
    try:
        while True:
            d = b.recv(65536)
            if not d:
                return True
    except ConnectionResetError:            # closed with our unread bytes still in its buffer
        return True
    except (socket.timeout, OSError):
        return False


def recv_op(e, buf, nbytes, comm=3, seq=0, count=0x1234, p2p=0, tag=0, timeout=1.0):
    plan = eng.Plan([("recv", 1, 0, 0, 0, nbytes, 0, False)], [], "test")
    b = eng.Buffer(buf, True)
    oid = e.post(plan, b.ptr, 0, 0, U8, 0, comm, seq, count, timeout, [0, 1], p2p, tag, nbytes)
    st, err, msg, n = e.wait(oid, timeout + 2.0)
    e.release(oid)
    b.release()
    return {0: "active", 1: "done", 2: "error"}.get(st, str(st)), msg


def scen_huge_total():
    cs = 65536
    e = new_engine(cs)
    b = pair(e)
    # chunk 0 of a message of 0xFFFFFFF0 chunks: its unexpected table would be ~32 GiB
    b.sendall(hdr(F_DATA, count=0x1234, chunk=0, length=cs, total=cs * 0xFFFFFFF0) + b"x" * cs)
    wait_for(lambda: rail_state(e) == "down", 3.0)
    res = {"rail": rail_state(e), "kinds": kinds(e), "closed": closed(b)}
    # the engine still works: a new connection, a valid 1000-byte message, delivered exactly
    b2 = pair(e, conn=8)
    data = np.arange(1000, dtype=np.uint8)
    b2.sendall(hdr(F_DATA, seq=5, count=0x1234, chunk=0, length=1000, total=1000) + data.tobytes())
    out = np.zeros(1000, np.uint8)
    st, msg = recv_op(e, out, 1000, seq=5, timeout=3.0)
    res["alive_after"] = st == "done" and bool((out == data).all())
    res["after"] = [st, msg]
    e.close()
    return res


def scen_short_chunk(p2p=False):
    e = new_engine()
    b = pair(e)
    flags = FL_P2P if p2p else 0
    # 1000-byte message in one chunk (chunk size 64 KiB), but the frame carries only 10 bytes
    b.sendall(hdr(F_DATA, flags=flags, count=0x1234, chunk=0, length=10, total=1000, aux=7)
              + b"A" * 10)
    # wait until the engine has taken the frame in: buffered (old engine) or refused
    wait_for(lambda: rail_state(e) == "down" or e.rail_stats()[1][0][2] >= 58, 3.0)
    time.sleep(0.1)
    buf = np.full(1000, 0xEE, np.uint8)
    st, msg = recv_op(e, buf, 1000, p2p=1 if p2p else 0, tag=7)
    res = {"rail": rail_state(e), "kinds": kinds(e), "state": st, "msg": msg,
           "untouched": bool((buf == 0xEE).all()),
           "written": int((buf != 0xEE).sum())}
    e.close()
    return res


def read_frame(b):
    h = b""
    while len(h) < 48:
        d = b.recv(48 - len(h))
        if not d:
            raise EOFError
        h += d
    (magic, type_, flags, dtype, redop, comm, seq, step, count, chunk, ln, total, aux,
     check) = struct.unpack("<IBBBBIIIIIIQII", h)
    p = b""
    while len(p) < ln:
        d = b.recv(ln - len(p))
        if not d:
            raise EOFError
        p += d
    return type_, flags, comm, seq, step, chunk, p


def scen_ack_queued():
    cs, n = 4096, 4
    e = new_engine(cs, window=cs)           # one chunk in flight: the others wait in the queue
    b = pair(e)
    src = (np.arange(n * cs) % 251).astype(np.uint8)
    plan = eng.Plan([("send", 1, 0, 0, 0, n * cs, 0, True)], [], "p2p")   # owned: eager
    buf = eng.Buffer(src, False)
    oid = e.post(plan, buf.ptr, 0, 0, U8, 0, 3, 0, 0, 5.0, [1], 1, 9, n * cs)
    st = e.wait(oid, 2.0)[0]
    e.release(oid)                          # an eager Isend completes at once; the engine keeps it
    buf.release()
    src_copy = src.copy()
    src[:] = 0                              # the user reuses the buffer: the engine has its copy
    got = {}
    t, fl, comm, seq, step, c, p = read_frame(b)
    got[c] = p
    # acks for the chunks still queued (never sent), then the real ack for the one in flight
    b.sendall(b"".join(hdr(F_ACK, flags=FL_P2P, dtype=0, comm=comm, seq=seq, step=step, chunk=k)
                       for k in range(1, n)))
    b.sendall(hdr(F_ACK, flags=FL_P2P, dtype=0, comm=comm, seq=seq, step=step, chunk=c))
    b.settimeout(5.0)                       # (the old engine never sends the rest)
    try:
        while len(got) < n:
            t, fl, comm, seq, step, c, p = read_frame(b)
            if t == F_DATA:
                got[c] = p
                b.sendall(hdr(F_ACK, flags=FL_P2P, dtype=0, comm=comm, seq=seq, step=step,
                              chunk=c))
    except (socket.timeout, EOFError, OSError):
        pass
    ok = all(got.get(k) == src_copy[k * cs:(k + 1) * cs].tobytes() for k in range(n))
    res = {"post_state": st, "chunks": len(got), "nchunks": n, "payload_ok": ok,
           "drained": e.drain(2.0), "kinds": kinds(e)}
    e.close()
    return res


SCENARIOS = {"huge_total": scen_huge_total, "short_chunk": scen_short_chunk,
             "short_chunk_p2p": lambda: scen_short_chunk(True), "ack_queued": scen_ack_queued}

if __name__ == "__main__":
    res = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(res), flush=True)
