"""Wire fuzzer for r2comm: frames into a real Engine's rails, and the TCP handshake.

Frames: each input builds a fresh Engine (rank 0 of 2, two rails and the control connection to
rank 1, all on the in-memory fuzz transport: r2comm._core.testing.fuzz_attach / fuzz_feed) with
operations posted (a collective receive that forwards what it gets, a receive gated on a send's
acks, a reducing receive, two point-to-point receives, an eager Isend already released and a
plain Isend), then feeds it segments of frames built from the input: mostly valid-looking frames
(fields drawn from the posted operations, checksum recomputed, so the fuzzer gets past hdr_check
into the DATA, ack, abort and rail-down paths), some with one field or the checksum broken,
truncated payloads, huge totals, short chunks, raw bytes, and read sizes from 1 byte up.
Half the inputs run the engine in mac mode (R2COMM_INTEGRITY=mac): the harness holds each
connection's frame keys and seals its frames (testing.frame_tag with the connection's receive key
and frame counter), so most frames verify and reach the DATA, ack and abort paths, and some get
a wrong, truncated, missing or doubled tag, a tag for another counter (replayed, reordered) or
key (reflected, an earlier connection), a header or payload changed after sealing (checksum
fixed up), or are an earlier frame replayed whole.
Checked after every input:
  - nothing crashed or hung (each input has a time bound);
  - a segment whose frames reach a malformed header closes that rail with a bad_frame event;
  - a rail only goes down with a reason recorded (bad_frame, or the peer's rail-down notice);
  - every byte of every user receive buffer is either untouched (0xEE) or the byte at that
    offset of the payload of a well-formed DATA frame for that chunk (nothing from outside a
    frame's payload, no heap bytes, nothing from a refused frame's layout lie); in mac mode
    only frames whose tag verifies count (the harness parses the stream as a correct receiver
    would: header form, then the tag at the connection's counter);
  - what the engine writes parses as well-formed frames (read back per rail, partial writes
    included), in mac mode each with the right tag for its connection's send counter;
  - mac mode: a segment that reaches a malformed header or a tag that does not verify closes
    the rail with a bad_frame; a "MAC mismatch" is reported only for a tag that does not
    verify (never for a correctly sealed frame).
Handshake: tcp.accept on one end of a socketpair, fed raw bytes or a HELLO built from the input
with a correct or wrong MAC (the other side played in a thread); tcp.connect against a loopback
listener that answers with fuzzed or correct replies. Every outcome must be exactly the expected
one: accepted (right tag, rank, admission and MAC) or HandshakeError, never another exception.

Run: python tests/fuzz_wire.py frames|handshake [libFuzzer args] (atheris, coverage guided over
this harness and the engine outcomes it branches on); tests/test_fuzz.py runs a fixed-seed
random batch in CI and the atheris runs as a slow test.
"""
import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time

import numpy as np

from r2comm._core import engine as eng, testing
from r2comm.transport import tcp

CS = 4096                      # engine chunk size for the fuzzed engine
MAX_MESSAGE = 1 << 40
F_DATA, F_ACK, F_RAIL_DOWN, F_RAIL_DOWN_ACK, F_ABORT = 1, 2, 3, 4, 5
FL_P2P, FL_LAZY, FL_VERDICT = 1, 2, 8
U8 = 4
SENT = 0xEE
HDR = struct.Struct("<IBBBBIIIIIIQII")
MAC_LEN = 16
STATS = {"inputs": 0, "frames": 0, "segments": 0, "refused": 0, "bad_frames": 0,
         "delivered_ops": 0, "handshakes": 0, "hs_accepted": 0, "hs_refused": 0,
         "mac_inputs": 0, "mac_frames": 0, "mac_verified": 0, "mac_refused": 0,
         "mac_bad_tags": 0, "tx_frames": 0}


class Provider:
    """Draws values from the fuzz input (zeros once it runs out)."""

    def __init__(self, data):
        self.d = data
        self.i = 0

    def left(self):
        return len(self.d) - self.i

    def byte(self):
        if self.i >= len(self.d):
            return 0
        self.i += 1
        return self.d[self.i - 1]

    def int(self, nbytes):
        v = 0
        for _ in range(nbytes):
            v = (v << 8) | self.byte()
        return v

    def pick(self, seq):
        return seq[self.byte() % len(seq)]

    def bytes(self, n):
        b = self.d[self.i:self.i + n]
        self.i += len(b)
        return b


def chunk_len(total, c):
    off = c * CS
    return 0 if off >= total else min(total - off, CS)


class Target:
    """A receive buffer the fuzzer may write into, and the payloads that may legitimately land
    there per chunk."""

    def __init__(self, name, nbytes):
        self.name = name
        self.buf = np.full(nbytes, SENT, np.uint8)
        self.valid = {}                # chunk -> list of payload arrays of well-formed frames


class World:
    """One fuzzed engine with its posted operations."""
    # message templates: (type-hint, flags, comm, seq, step, count, total, aux)
    A_TOTAL, C_TOTAL, B_TOTAL = 2 * CS + 100, CS + 33, CS
    P_CAP, Q_CAP = 2 * CS + 7, CS

    def __init__(self, window, mac=False):
        e = self.e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, window)
        self.mac = mac
        if mac:
            e.tuning.set_integrity(True)
        self.conn = {0: 6, 1: 7, 2: 8}
        self.keys = {}                 # rail -> (tx key, rx key) of its current connection
        self.ctr = {}                  # rail -> frames the engine has verified on it
        self.history = {}              # rail -> sealed frames sent on the current connection
        self.prev_keys = {}            # rail -> keys of its previous connection
        self.tx = {}                   # rail -> what the engine wrote on it, not yet parsed
        self.txctr = {}                # rail -> frames the engine wrote on its connection
        for k in (0, 1, 2):
            self.attach(k)
        self.keep = []
        self.targets = {}
        A, C, B = self.A_TOTAL, self.C_TOTAL, self.B_TOTAL
        # A: collective (comm 1, seq 0): receive step 0 into ua, forward it as step 1
        ua = self.target("A", A)
        self.oid_a = self.post([("recv", 1, 0, 0, 0, A, 0, False), ("send", 1, 1, 0, 0, A, 0, False)],
                               [(0, 1)], ua.buf, None, 1, 0, 0xA1)
        # B: reducing receive (comm 1, seq 1)
        self.ub = np.ones(B, np.uint8)
        self.oid_b = self.post([("recv", 1, 0, 0, 0, B, 1, False)], [], self.ub, None, 1, 1, 0xB2)
        # C: receive step 1 gated on the acks of send step 0 (comm 1, seq 2)
        uc = self.target("C", C)
        self.sc = (np.arange(C) % 199).astype(np.uint8)
        self.oid_c = self.post([("send", 1, 0, 1, 0, C, 0, False), ("recv", 1, 1, 0, 0, C, 0, False)],
                               [(0, 1)], uc.buf, self.sc, 1, 2, 0xC3)
        # point to point: receives for tag 5 and any tag; an eager Isend (released) and an Isend
        up = self.target("P", self.P_CAP)
        uq = self.target("Q", self.Q_CAP)
        self.oid_p = self.post([("recv", 1, 0, 0, 0, self.P_CAP, 0, False)], [], up.buf, None, 1,
                               0, 0, p2p=1, tag=5, cap=self.P_CAP)
        self.oid_q = self.post([("recv", 1, 0, 0, 0, self.Q_CAP, 0, False)], [], uq.buf, None, 1,
                               0, 0, p2p=1, tag=-1, cap=self.Q_CAP)
        self.se = (np.arange(3 * CS) % 97).astype(np.uint8)
        oid = self.post([("send", 1, 0, 0, 0, 3 * CS, 0, True)], [], self.se, None, 1, 0, 0,
                        p2p=1, tag=5, cap=3 * CS)
        e.release(oid)
        self.sn = (np.arange(2 * CS) % 89).astype(np.uint8)
        self.oid_n = self.post([("send", 1, 0, 0, 0, 2 * CS, 0, False)], [], self.sn, None, 1, 0,
                               0, p2p=1, tag=6, cap=2 * CS)
        # where a DATA frame's key sends it: (flags & P2P, comm, seq, step) -> target
        self.route = {(0, 1, 0, 0): ua, (0, 1, 2, 1): uc}
        # templates for valid-looking frames: (flags, comm, seq, step, count, total, aux)
        self.templates = [(0, 1, 0, 0, 0xA1, A, 0), (0, 1, 2, 1, 0xC3, C, 0),
                          (0, 1, 1, 0, 0xB2, B, 0), (FL_P2P, 1, 0, 0, 0, CS + 5, 5),
                          (FL_P2P, 1, 1, 0, 0, 2 * CS + 7, 5), (FL_P2P, 1, 2, 0, 0, 100, 9),
                          (FL_P2P, 1, 3, 0, 0, 3 * CS, 5), (0, 1, 3, 0, 0, 2 * CS, 0),
                          (0, 2, 0, 0, 0x11, 10, 0)]
        # acks the engine waits for: (flags, comm, seq, step, nchunks)
        self.acks = [(0, 1, 0, 1, 3), (0, 1, 2, 0, 2), (FL_P2P, 1, 0, 0, 3), (FL_P2P, 1, 1, 0, 2)]

    def attach(self, rail):
        """A new connection for `rail` (in mac mode with fresh frame keys)."""
        self.conn[rail] += 1
        cid = self.conn[rail]
        if self.mac:
            old = self.keys.get(rail)
            tk = hashlib.blake2s(b"tx%d/%d" % (rail, cid)).digest()
            rk = hashlib.blake2s(b"rx%d/%d" % (rail, cid)).digest()
            self.keys[rail] = (tk, rk)
            self.prev_keys[rail] = old or (tk, rk)
            testing.fuzz_attach(self.e, 1, rail, cid, tk, rk)
        else:
            testing.fuzz_attach(self.e, 1, rail, cid)
        self.ctr[rail] = 0
        self.history[rail] = []
        self.tx[rail] = bytearray()
        self.txctr[rail] = 0

    def target(self, name, n):
        t = Target(name, n)
        self.targets[name] = t
        return t

    def post(self, msgs, deps, work, send, comm, seq, count, p2p=0, tag=0, cap=0):
        plan = eng.Plan(msgs, deps, "fuzz")
        bw = eng.Buffer(work, True)
        bs = eng.Buffer(send, False) if send is not None else None
        self.keep += [plan, bw, bs]
        return self.e.post(plan, bw.ptr, bs.ptr if bs else 0, 0, U8, 0, comm, seq, count, 5.0,
                           [0, 1], p2p, tag, cap)

    def close(self):
        self.e.close()
        for b in self.keep:
            if isinstance(b, eng.Buffer):
                b.release()


def build_frame(pv, w, info):
    """One frame (bytes) from the input; records in info what the harness knows about it."""
    kind = pv.byte()
    if kind < 12:                                       # raw bytes: framing is lost after this
        info["raw"] = True
        return pv.bytes(pv.pick((1, 3, 20, 47, 48, 49, 64, 200)))
    t = w.templates
    typ = pv.pick((F_DATA,) * 6 + (F_ACK,) * 3 + (F_RAIL_DOWN, F_RAIL_DOWN_ACK, F_ABORT))
    if typ == F_ACK:
        flags, comm, seq, step, n = pv.pick(w.acks)
        chunk = pv.pick(list(range(n)) + [n, 0xFFFFFFFF])
        h = [F_ACK, flags, 0, 0, comm, seq, step, 0, chunk, 0, 0, 0]
    elif typ in (F_RAIL_DOWN, F_RAIL_DOWN_ACK):
        rail = pv.pick((0, 1, 2, 7, 0xFFFFFFFF))
        seq = pv.pick((7, 8, 9, 1234)) if typ == F_RAIL_DOWN else pv.int(4)
        h = [typ, 0, 0, 0, 0, seq, 0, 0, 0, 0, 0, rail]
    elif typ == F_ABORT:
        flags, comm, seq, step, count, total, aux = pv.pick(t)
        n = pv.pick((0, 5, 40, 4096, 4097))
        flags |= pv.pick((0, 0, 0, FL_VERDICT))      # a judge's verdict (matching.pxi)
        h = [F_ABORT, flags, 0, 0, comm, seq, 0, 0, 0, n, 0, pv.pick((1, 2, 3, 5, 77))]
    else:
        flags, comm, seq, step, count, total, aux = pv.pick(t)
        if pv.byte() < 40:
            total = pv.pick((0, 1, CS - 1, CS, CS + 1, 3 * CS, MAX_MESSAGE, MAX_MESSAGE + 1,
                             CS * 0xFFFFFFF0, (1 << 64) - 1, pv.int(8)))
        nch = max(1, -(-total // CS)) if total < (1 << 62) else 4
        chunk = pv.pick(list(range(min(nch, 4))) + [nch, 0xFFFFFFFF])
        ln = chunk_len(total, chunk)
        m = pv.byte()
        if m < 30:                                    # a chunk that lies about its length
            ln = pv.pick((0, 1, max(ln - 1, 0), ln + 1, 10, CS, CS + 1, pv.int(4)))
        if pv.byte() < 20:
            count = pv.int(4)
        if pv.byte() < 15:
            flags = pv.byte()
        if pv.byte() < 8:
            step = pv.int(3)
        h = [F_DATA, flags, U8 if pv.byte() >= 10 else pv.byte(), 0, comm, seq, step, count,
             chunk & 0xFFFFFFFF,
             ln & 0xFFFFFFFF, total & ((1 << 64) - 1), aux]
    if pv.byte() < 10:                                # any one field set at random
        i = pv.byte() % 12
        h[i] = pv.int(8 if i == 10 else (1 if i < 4 else 4)) & ((1 << 64) - 1 if i == 10 else
                                                               (0xFF if i < 4 else 0xFFFFFFFF))
    head = bytearray(testing.encode_header(*h))           # checksum fixed up
    c = pv.byte()
    if c < 8:                                         # a broken checksum, magic or byte
        head[pv.byte() % 48] ^= (pv.byte() | 1)
    ln = h[9]
    plen = ln if ln <= 4 * CS else 0
    seedb = pv.byte()
    payload = (np.arange(plen, dtype=np.uint32) * (seedb | 1) + pv.byte()).astype(np.uint8).tobytes()
    info["head"] = bytes(head)
    info["payload"] = payload
    return bytes(head) + payload


def seal(pv, w, rail, info, ctr):
    """mac mode: the frame of `info` as it goes on the wire, tag included: mostly sealed right
    (the connection's receive key, the frame's counter), else a wrong, truncated, missing or
    doubled tag, a tag for another counter or key, or a header / payload / length changed after
    sealing (the header checksum fixed up: only the MAC can tell)."""
    head, payload = info["head"], info["payload"]
    tk, rk = w.keys[rail]
    c = pv.byte()
    if c >= 24:
        return head + payload + testing.frame_tag(rk, head, payload, ctr)
    how = c % 11
    if how == 1:                                      # a replayed position / a reordered one
        return head + payload + testing.frame_tag(rk, head, payload, ctr - 1 if ctr else ctr + 2)
    if how == 2:
        return head + payload + testing.frame_tag(rk, head, payload, ctr + 1 + pv.byte())
    if how == 3:                                      # reflected: sealed with the tx key
        return head + payload + testing.frame_tag(tk, head, payload, ctr)
    if how == 4:                                      # from the previous connection
        return head + payload + testing.frame_tag(w.prev_keys[rail][1], head, payload, ctr)
    tag = testing.frame_tag(rk, head, payload, ctr)
    if how == 0:
        t = bytearray(tag)
        t[pv.byte() % MAC_LEN] ^= pv.byte() | 1
        return head + payload + bytes(t)
    if how == 5:                                      # truncated tag
        return head + payload + tag[:pv.byte() % MAC_LEN]
    if how == 6:
        return head + payload
    if how == 7:
        return head + payload + tag + tag
    if how == 8:                                      # a header field rewritten, checksum fixed
        f = list(HDR.unpack(head)[1:13])
        i = pv.pick((1, 4, 5, 6, 7, 8, 10, 11))        # flags comm seq step count chunk total aux
        f[i] = (f[i] ^ (1 << (pv.byte() % (8 if i == 1 else 32)))) & \
            (0xFF if i == 1 else (1 << 64) - 1)
        return testing.encode_header(*f) + payload + tag
    if how == 9 and payload:                          # a payload byte changed after sealing
        pl = bytearray(payload)
        pl[pv.int(2) % len(pl)] ^= pv.byte() | 1
        return head + bytes(pl) + tag
    # a payload shorter or longer than the header (and the tag) says
    k = 1 + pv.byte() % 64
    return head + (payload[:-k] if pv.byte() & 1 else payload + pv.bytes(k)) + tag


def mac_parse(stream, key, ctr):
    """What a correct mac-mode receiver makes of `stream` from frame counter `ctr`: (verdict,
    [(header, payload) of the frames that verify], counter after them). verdict: "clean" (ends
    at a frame boundary), "partial" (ends inside a frame), "bad" (reaches a malformed header),
    "badtag" (reaches a tag that does not verify). The engine's payload bound in mac mode
    (mbuf_cap: CS on a rail, MAX_CTRL_PAYLOAD on the control connection) is CS = 4096 for both
    here, the bound hdr_validate puts on DATA and ABORT."""
    pos, frames = 0, []
    while True:
        if pos == len(stream):
            return "clean", frames, ctr
        if pos + 48 > len(stream):
            return "partial", frames, ctr
        head = stream[pos:pos + 48]
        if testing.validate_header(head, CS) < 0:
            return "bad", frames, ctr
        ln = HDR.unpack(head)[10]
        end = pos + 48 + ln + MAC_LEN
        if end > len(stream):
            return "partial", frames, ctr
        payload = stream[pos + 48:pos + 48 + ln]
        if testing.frame_tag(key, head, payload, ctr) != stream[end - MAC_LEN:end]:
            return "badtag", frames, ctr
        frames.append((head, payload))
        ctr += 1
        pos = end


def _outcome(kinds, all_read, wrote, ds):
    n = 0
    for k in kinds:
        if k == "bad_frame":
            n += 1
        elif k == "rail_failed":
            n += 2
        elif k == "abort":
            n += 4
        elif k == "peer_notified":
            n += 8
        elif k == "notify_acked":
            n += 16
        elif k == "migrated":
            n += 32
        elif k == "redelivered":
            n += 64
    if all_read:
        n += 128
    if wrote:
        n += 256
    if ds["unexpected"]:
        n += 512
    if ds["sends"] < 4:
        n += 1024
    if ds["ready"][1]:
        n += 2048
    return n


def rail_up(e, rail):
    """State of a connection to rank 1 (rails 0, 1 and the control connection, 2)."""
    return testing.debug_state(e)["unsent"][1][rail][0] == 1


def expected_bad(head):
    return testing.validate_header(head, CS) < 0


def note_valid(w, head, payload, complete):
    """Record a DATA payload that may land in a user buffer (well formed and fitting)."""
    if testing.validate_header(head, CS) < 0:
        return
    (magic, typ, flags, dt, ro, comm, seq, step, count, chunk, ln, total, aux, chk) = HDR.unpack(head)
    if typ != F_DATA or total > MAX_MESSAGE or ln != chunk_len(total, chunk):
        return
    if flags & FL_P2P:
        targets = [w.targets["P"], w.targets["Q"]]
    else:
        t = w.route.get((0, comm, seq, step))
        targets = [t] if t is not None else []
    for t in targets:
        t.valid.setdefault(chunk, []).append(np.frombuffer(payload, np.uint8))


def check_sent(w):
    """What the engine wrote on each connection parses as well-formed frames, and in mac mode
    each carries the tag of the connection's send key at its counter (lazy acks, control
    frames and chunks interleaved, partial writes)."""
    for rail in (0, 1, 2):
        buf = w.tx[rail]
        buf += testing.fuzz_sent(w.e, rail)
        pos = 0
        while len(buf) - pos >= 48:
            head = bytes(buf[pos:pos + 48])
            assert testing.validate_header(head, CS) == 0, \
                f"the engine wrote a malformed header on rail {rail}: {HDR.unpack(head)}"
            ln = HDR.unpack(head)[10]
            end = pos + 48 + ln + (MAC_LEN if w.mac else 0)
            if end > len(buf):
                break
            if w.mac:
                want = testing.frame_tag(w.keys[rail][0], head, bytes(buf[pos + 48:pos + 48 + ln]),
                                     w.txctr[rail])
                assert want == bytes(buf[end - MAC_LEN:end]), \
                    f"the engine's frame {w.txctr[rail]} on rail {rail} has a wrong tag"
                w.txctr[rail] += 1
            STATS["tx_frames"] += 1
            pos = end
        del buf[:pos]


def check_buffers(w):
    for t in w.targets.values():
        buf = t.buf
        ok = buf == SENT
        for c, pls in t.valid.items():
            off = c * CS
            if off >= len(buf):
                continue
            reg = buf[off:off + CS]
            for pl in pls:
                n = min(len(pl), len(reg))
                ok[off:off + n] |= reg[:n] == pl[:n]
        if not ok.all():
            bad = np.flatnonzero(~ok)
            raise AssertionError(f"user buffer {t.name}: {len(bad)} bytes from nowhere, first at "
                                 f"offset {bad[0]} (value {buf[bad[0]]:#x})")


def fuzz_frames(data, mac=None):
    """One fuzz input: a fresh engine, segments of frames, the checks. Returns frames fed.
    mac: run the engine in mac mode (None: the input's first byte decides, half and half)."""
    pv = Provider(data)
    t0 = time.monotonic()
    m = pv.byte() & 1
    mac = bool(m) if mac is None else mac
    w = World(window=pv.pick((CS, 2 * CS, 1 << 20)), mac=mac)
    if mac:
        STATS["mac_inputs"] += 1
    nframes = 0
    dirty = {}
    try:
        nseg = 1 + pv.byte() % 4
        for _ in range(nseg):
            if pv.left() <= 0:
                break
            rail = pv.pick((0, 0, 0, 1, 2))
            step = pv.pick((0, 0, 1, 7, 48, 4096))
            block = pv.byte() < 30
            e = w.e
            # a new connection when the rail is down, when the last segment left it mid-frame
            # or out of step (its next bytes would continue a frame the oracle cannot see), or
            # sometimes anyway
            if not rail_up(e, rail) or dirty.get(rail) or pv.byte() < 10:
                w.attach(rail)
            nev = len(e.events_since(0))
            nframes_before = nframes
            stream = bytearray()
            framed = True
            must_refuse = False
            sealed = []
            for _ in range(1 + pv.byte() % 16):
                info = {}
                if mac and w.history[rail] and pv.byte() < 6:
                    fr = pv.pick(w.history[rail])     # an earlier frame replayed whole
                    stream += fr
                    nframes += 1
                    continue
                fr = build_frame(pv, w, info)
                nframes += 1
                if mac:
                    if not info.get("raw"):
                        fr = seal(pv, w, rail, info, w.ctr[rail] + len(sealed))
                        sealed.append(fr)
                    stream += fr
                    continue
                if framed and not info.get("raw"):
                    if expected_bad(info["head"]):
                        must_refuse = True
                        framed = False
                    else:
                        note_valid(w, info["head"], info["payload"], True)
                elif info.get("head"):
                    note_valid(w, info["head"], info["payload"], False)
                if info.get("raw"):
                    framed = False
                stream += fr
            cut = pv.byte()
            if cut < 25 and len(stream) > 1:           # the segment ends mid-frame
                stream = stream[:len(stream) - 1 - pv.int(2) % (len(stream) - 1)]
                if must_refuse:
                    must_refuse = False                # (the bad header may be cut off: see below)
                    must_refuse = _bad_header_within(bytes(stream))
            up_before = rail_up(e, rail)
            if mac:
                verdict, good, ctr_end = mac_parse(bytes(stream), w.keys[rail][1], w.ctr[rail])
                for head, payload in good:
                    note_valid(w, head, payload, True)
                must_refuse = verdict in ("bad", "badtag")
                STATS["mac_frames"] += nframes - nframes_before
                STATS["mac_verified"] += len(good)
                w.history[rail] = (w.history[rail] + sealed)[-8:]
            sstep = pv.pick((0, 0, 0, 0, 1, 5, 48, 64, 1000))
            consumed, up, wrote = testing.fuzz_feed(e, 1, rail, bytes(stream), step, block, sstep)
            check_sent(w)
            dirty[rail] = not framed or cut < 25
            evs = e.events_since(nev)
            kinds = [ev["kind"] for ev in evs]
            STATS["segments"] += 1
            if mac:
                dirty[rail] = not (up and verdict == "clean")
                if not dirty[rail]:
                    w.ctr[rail] = ctr_end
                macbad = [ev for ev in evs if ev["kind"] == "bad_frame" and "MAC" in ev["info"]]
                assert not macbad or verdict == "badtag", \
                    f"a correctly sealed stream refused for its MAC: {verdict} {evs}"
                assert not up or consumed == len(stream), \
                    f"rail up but {consumed} of {len(stream)} bytes read"
                if must_refuse and up_before:
                    STATS["mac_refused"] += 1
                    if macbad:
                        STATS["mac_bad_tags"] += 1
            # outcome feedback for the coverage-guided run: a branch per engine outcome, so an
            # input that makes the engine do something new is new coverage to the fuzzer
            if not up:
                STATS["refused"] += 1
            if "bad_frame" in kinds:
                STATS["bad_frames"] += 1
            _outcome(kinds, consumed == len(stream), wrote, testing.debug_state(e))
            if must_refuse and up_before:
                # (a valid rail-down notice for this very rail may close it first)
                assert not up and ("bad_frame" in kinds or "peer_notified" in kinds), \
                    f"malformed header not refused: up={up} events={kinds}"
            if up_before and not up:
                assert "bad_frame" in kinds or "peer_notified" in kinds, \
                    f"rail {rail} went down without a reason recorded: {evs}"
            check_buffers(w)
        for oid in (w.oid_a, w.oid_b, w.oid_c, w.oid_p, w.oid_q, w.oid_n):
            st = w.e.test(oid)[0]
            if st == 1:
                STATS["delivered_ops"] += 1
        check_buffers(w)
        check_sent(w)
    finally:
        w.close()
    STATS["inputs"] += 1
    STATS["frames"] += nframes
    dt = time.monotonic() - t0
    assert dt < 5.0, f"one input took {dt:.1f} s"
    return nframes


def _bad_header_within(stream):
    """Does a whole malformed header occur in this (cut) stream at a frame boundary?"""
    pos = 0
    while pos + 48 <= len(stream):
        head = stream[pos:pos + 48]
        if testing.validate_header(head, CS) < 0:
            return True
        ln = HDR.unpack(head)[10]
        pos += 48 + ln
    return False


# ---------------------------------------------------------------------------------------------
# Handshake

SECRET = b"s" * 32
ME = 1


class _OneShotListener:
    """Stands in for a listening socket: accept() returns the given connected socket."""

    def __init__(self, sock):
        self.sock = sock

    def accept(self):
        return self.sock, ("fuzz", 0)


def _admit(src, rail):
    return rail != 3


def fuzz_handshake(data):
    """One handshake from the input; returns 1. Raises AssertionError on a wrong outcome."""
    pv = Provider(data)
    mode = pv.byte() % 8
    STATS["handshakes"] += 1
    if mode == 7:
        _fuzz_connect(pv)
        return 1
    a, b = _tcp_pair()
    try:
        a.settimeout(2.0)
        b.settimeout(2.0)
        if mode < 3:                                    # raw bytes, then end of stream
            b.sendall(pv.bytes(pv.pick((0, 1, 20, 47, 48, 49, 80, 200))) if mode else data[1:])
            b.shutdown(socket.SHUT_WR)
            try:
                tcp.accept(_OneShotListener(a), SECRET, ME, 2.0, 500, _admit)
            except tcp.HandshakeError:
                STATS["hs_refused"] += 1
                return 1
            raise AssertionError("raw bytes accepted as a handshake")
        # a HELLO built from the input; the connector side answers in a thread
        magic = b"R2CH" if pv.byte() >= 20 else pv.bytes(4).ljust(4, b"\0")
        ver = tcp.VERSION if pv.byte() >= 20 else pv.int(2)
        good_tag = pv.byte() >= 30
        src = pv.pick((0, 2, 5, -1, 2 ** 31 - 1))
        dst = ME if pv.byte() >= 30 else pv.pick((0, 2, -5))
        rail = pv.pick((0, 1, 2, 3, 0xFFFF))
        cid = pv.int(4)
        fields = tcp.HELLO.unpack(tcp.hello(SECRET, src, dst, rail, cid,
                                            pv.bytes(16).ljust(16, b"\0")))
        tag = fields[2] if good_tag else pv.bytes(8).ljust(8, b"\0")
        good_tag = tag == fields[2]
        hello = tcp.HELLO.pack(magic, ver, tag, *fields[3:])
        good_mac = pv.byte() >= 60
        cut = pv.byte() < 20
        outcome = {}

        def peer():
            try:
                b.sendall(hello[:pv_cut] if cut else hello)
                if cut:
                    b.shutdown(socket.SHUT_WR)
                    return
                reply = b""
                while len(reply) < 48:
                    d = b.recv(48 - len(reply))
                    if not d:
                        return
                    reply += d
                mac = hmac.new(SECRET, b"con" + hello + reply[:16], hashlib.sha256).digest()
                outcome["acc_mac_ok"] = hmac.compare_digest(
                    reply[16:], hmac.new(SECRET, b"acc" + hello + reply[:16],
                                         hashlib.sha256).digest())
                b.sendall(mac if good_mac else bytes(32))
                b.recv(tcp.ACK_LEN)                     # admitted (or closed)
            except OSError:
                pass
        pv_cut = pv.byte() % 48
        th = threading.Thread(target=peer)
        th.start()
        expect_ok = (not cut and magic == b"R2CH" and ver == tcp.VERSION and good_tag and
                     dst == ME and _admit(src, rail) and good_mac)
        try:
            res = tcp.accept(_OneShotListener(a), SECRET, ME, 2.0, 500, _admit)
            ok = True
        except tcp.HandshakeError:
            ok = False
        th.join(5.0)
        assert not th.is_alive(), "handshake peer thread hung"
        if ok:
            STATS["hs_accepted"] += 1
            os.close(res[2])
            assert expect_ok and res[0] == src and res[1] == rail and res[3] == cid, \
                f"accepted a handshake it should have refused: {res}"
            assert outcome.get("acc_mac_ok"), "acceptor's proof did not verify"
        else:
            STATS["hs_refused"] += 1
            assert not expect_ok, "a valid handshake was refused"
        return 1
    finally:
        a.close()
        b.close()


_LST = None
_PAIR_LST = None


def _tcp_pair():
    """A connected pair of loopback TCP sockets (accept tunes TCP options on its side)."""
    global _PAIR_LST
    if _PAIR_LST is None:
        _PAIR_LST = tcp.listen("127.0.0.1")
    b = socket.create_connection(_PAIR_LST.getsockname())
    a, _ = _PAIR_LST.accept()
    return a, b


def _fuzz_connect(pv):
    """tcp.connect against a loopback listener whose reply is fuzzed (or correct)."""
    global _LST
    if _LST is None:
        _LST = tcp.listen("127.0.0.1")
    port = _LST.getsockname()[1]
    how = pv.byte() % 4
    junk = pv.bytes(pv.pick((0, 10, 47, 48, 60)))

    def server():
        s, _ = _LST.accept()
        try:
            s.settimeout(2.0)
            hello = b""
            while len(hello) < tcp.HELLO.size:
                d = s.recv(tcp.HELLO.size - len(hello))
                if not d:
                    return
                hello += d
            if how == 0:                                   # correct proof
                nonce = os.urandom(16)
                s.sendall(nonce + hmac.new(SECRET, b"acc" + hello + nonce, hashlib.sha256).digest())
                s.recv(32)
                s.sendall(hmac.new(SECRET, b"ok" + hello + nonce, hashlib.sha256).digest()[:16])
            else:
                s.sendall(junk)
        except OSError:
            pass
        finally:
            s.close()
    th = threading.Thread(target=server)
    th.start()
    try:
        fd, cid = tcp.connect("127.0.0.1", port, None, SECRET, 0, ME, 0, 2.0, 500)
        os.close(fd)
        ok = True
    except tcp.HandshakeError:
        ok = False
    except socket.timeout:
        ok = None
    th.join(5.0)
    assert not th.is_alive()
    if how == 0:
        assert ok is True, "a correct acceptor was refused"
        STATS["hs_accepted"] += 1
    else:
        assert ok is False, f"connector outcome {ok} on a junk reply of {len(junk)} bytes"
        STATS["hs_refused"] += 1


# ---------------------------------------------------------------------------------------------

def seed_corpus(kind, n, rng):
    return [bytes(rng.integers(0, 256, int(rng.integers(16, 600)), dtype=np.uint8))
            for _ in range(n)]


def random_run(kind, budget_s=None, count=None, seed=0, mac=None):
    """Non-guided batch (CI): random inputs through the same harness (frames: mac forces the
    integrity mode, None lets each input choose)."""
    rng = np.random.default_rng(seed)
    if kind == "frames":
        def fn(d):
            return fuzz_frames(d, mac)
    else:
        fn = fuzz_handshake
    t0 = time.monotonic()
    i = 0
    while (count is None or i < count) and (budget_s is None or time.monotonic() - t0 < budget_s):
        n = int(rng.integers(8, 700))
        fn(bytes(rng.integers(0, 256, n, dtype=np.uint8)))
        i += 1
    return i, time.monotonic() - t0


def main():
    """python tests/fuzz_wire.py frames|handshake [--until=N] [libFuzzer flags] [corpus dir]:
    coverage-guided (atheris); with --until, prints FUZZSTATS and exits 0 once N frames (or
    handshakes) have been fed without a finding. A finding prints its traceback, leaves the
    input in crash-*, and exits non-zero."""
    import json
    import atheris
    kind = sys.argv[1]
    fn = fuzz_frames if kind == "frames" else fuzz_handshake
    key = "frames" if kind == "frames" else "handshakes"
    t0 = time.monotonic()
    until = [a for a in sys.argv[2:] if a.startswith("--until=")]
    args = [a for a in sys.argv[2:] if not a.startswith("--until=")]
    want = int(until[0].split("=")[1]) if until else None

    def one(data):
        fn(data)
        if want is not None and STATS[key] >= want:
            d = dict(STATS, kind=kind, seconds=round(time.monotonic() - t0, 1))
            print("FUZZSTATS " + json.dumps(d), flush=True)
            os._exit(0)
    atheris.Setup([sys.argv[0]] + args, one)
    atheris.Fuzz()


def random_main():
    """python tests/fuzz_wire.py random frames|handshake N [corpus dir...]: replay the corpus
    (e.g. one a guided run saved), then random inputs until N frames (or handshakes): for the
    sanitized build, where atheris gets no coverage from libFuzzer (libasan's coverage hooks
    take precedence over atheris's), so guided fuzzing is done on the normal build."""
    import json
    kind, want = sys.argv[2], int(sys.argv[3])
    fn = fuzz_frames if kind == "frames" else fuzz_handshake
    key = "frames" if kind == "frames" else "handshakes"
    t0 = time.monotonic()
    replayed = 0
    for d in sys.argv[4:]:
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                fn(f.read())
            replayed += 1
    seed = 0
    while STATS[key] < want:
        random_run(kind, count=500, seed=seed)
        seed += 1
    print("FUZZSTATS " + json.dumps(dict(STATS, kind=kind, replayed=replayed,
                                         seconds=round(time.monotonic() - t0, 1))), flush=True)


if __name__ == "__main__" and sys.argv[1] == "random":
    random_main()
elif __name__ == "__main__":
    import atheris
    with atheris.instrument_imports():
        pass
    atheris.instrument_func(fuzz_frames)
    atheris.instrument_func(build_frame)
    atheris.instrument_func(seal)
    atheris.instrument_func(fuzz_handshake)
    atheris.instrument_func(_fuzz_connect)
    # (not the oracle: atheris's comparison tracing keeps the numpy arrays it compares alive,
    # ~120 KB per input, and libFuzzer stops at its 2 GB RSS limit)
    atheris.instrument_func(_outcome)
    main()
