# cython: language_level=3
# distutils: language = c++
"""r2comm's test hooks, outside the production engine: the fuzz and fake transports, the wire and
crypto helpers, ShmEnd, and hooks into a live engine (a corrupted frame, point-to-point sequences
near the wrap, the unexpected-message limits, the engine's table counts, shm doorbells). Built
only for test installs (R2COMM_TEST_HOOKS=1, or an in-place / editable build: setup.py); a wheel
of the library leaves it out. It drives the engine through engine.pxd (the engine's types and
functions), the same code the engine runs.

Every hook that takes an engine takes an r2comm._core.engine.Engine first."""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t, intptr_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset, strcmp
from libcpp.string cimport string
from cython.operator cimport dereference as deref

from r2comm._core.wire cimport r2_hdr, hdr_encode, hdr_validate, HDR_SIZE
from r2comm._core.transport cimport (iovec, Transport, TDone, tdone_push, tdone_take, iov_total,
                                     tp_reg_none, tp_dereg_none, TPF_LATE_READ)
from r2comm._core.shm cimport (ShmConn, r2_shm_setup, shm_setup, r2_shm_conn, r2_shm_ring_of, r2_shm_adopt,
                               r2_shm_write, r2_shm_read, r2_shm_arm, r2_shm_wake, r2_shm_close)
from r2comm._core.tcp cimport tcp_sendv, tcp_recv1, close, SHUT_RDWR
from r2comm._core.tcp cimport shutdown as sock_shutdown
from r2comm._core.engine cimport (Engine, Plan, State, Peer, PairRail, R_UP, MAC_LEN, DACK_DELAY, mono,
                                  rail_window, rail_read, pump_peer, lazy_ack_timer, p2p_state,
                                  pthread_mutex_lock, pthread_mutex_unlock, b2s_state, b2s_init,
                                  b2s_update, b2s_final, b2s_prepare_more, p1305_state,
                                  p1305_init, p1305_update, p1305_final, frame_mac)

cdef extern from "r2_reduce.h" namespace "r2" nogil:
    int reduce_into(void* d, const void* s, size_t nbytes, int dt, int op, int rev)

# the transports: fuzz and fake (one configuration per process each), corrupting (per connection)
include "fuzz_transport.pxi"
include "fake_transport.pxi"
include "corrupt_transport.pxi"

# ---------------------------------------------------------------------------------------------
# The wire and crypto helpers (tests/test_units.py, test_integrity.py, fuzz_wire.py)

def validate_header(bytes frame, uint32_t max_chunk):
    """The wire validator on raw bytes: 0 if the 48-byte header is well formed, else < 0."""
    cdef r2_hdr h
    if len(frame) < HDR_SIZE:
        return -5
    memcpy(&h, <const char*>frame, HDR_SIZE)
    return hdr_validate(&h, max_chunk)



def encode_header(int type, int flags, int dtype, int redop, uint32_t comm, uint32_t seq,
                  uint32_t step, uint32_t count, uint32_t chunk, uint32_t length, uint64_t total,
                  uint32_t aux):
    """The wire encoder (for tests and fuzzing): 48 header bytes."""
    cdef r2_hdr h
    hdr_encode(&h, type, flags, dtype, redop, comm, seq, step, count, chunk, length, total, aux)
    return (<char*>&h)[:HDR_SIZE]



def reduce_local(uint64_t dst, uint64_t src, uint64_t nbytes, int dtype, int redop, int rev=0):
    """dst op= src with the engine's kernels (used for local steps and by the tests)."""
    cdef int rc
    with nogil:
        rc = reduce_into(<void*>dst, <const void*>src, nbytes, dtype, redop, rev)
    if rc != 0:
        raise ValueError("unknown dtype or op code")


def blake2s(bytes data, bytes key=b"", int digest_size=32):
    """The engine's BLAKE2s (RFC 7693), for tests against hashlib.blake2s."""
    cdef b2s_state st
    cdef uint8_t out[32]
    if not 1 <= digest_size <= 32 or len(key) > 32:
        raise ValueError("digest_size 1..32, key at most 32 bytes")
    b2s_init(&st, digest_size, <const char*>key, len(key))
    b2s_update(&st, <const char*>data, len(data))
    b2s_final(&st, out)
    return bytes(out[:digest_size])


def poly1305(bytes key, bytes data):
    """The engine's Poly1305 (RFC 8439), for tests."""
    cdef p1305_state st
    cdef uint8_t tag[16]
    if len(key) != 32:
        raise ValueError("a Poly1305 key is 32 bytes")
    p1305_init(&st, <const uint8_t*><const char*>key)
    p1305_update(&st, <const char*>data, len(data))
    p1305_final(&st, tag)
    return bytes(tag[:16])


def frame_tag(bytes key, bytes header, bytes payload, uint64_t counter):
    """The MAC the engine puts after a frame (mac mode), for tests."""
    cdef b2s_state st
    cdef uint8_t tag[16]
    b2s_init(&st, 32, <const char*>key, len(key))
    b2s_prepare_more(&st)
    frame_mac(&st, <const char*>header, len(header), <const char*>payload, len(payload), counter, tag)
    return bytes(tag[:MAC_LEN])


# ---------------------------------------------------------------------------------------------
# One end of a shared-memory link outside an engine (tests/test_shm.py)

cdef class ShmEnd:
    """One end of a shared-memory link outside an engine (the ring unit tests): the same
    r2_shm.h code the transport runs, driven from Python."""
    cdef r2_shm_conn* c

    def __cinit__(self, int fd, uint64_t base, uint64_t map_len, int side):
        cdef r2_shm_setup st
        shm_setup(&st, fd, base, map_len, side, "ShmEnd")
        self.c = r2_shm_adopt(&st)
        if self.c == NULL:
            raise MemoryError()

    cdef r2_shm_conn* _c(self) except NULL:
        if self.c == NULL:
            raise ValueError("ShmEnd is closed")
        return self.c

    def send(self, const unsigned char[:] data, int pieces=1):
        """Post data as a gather list of `pieces` parts: bytes accepted (a prefix), 0 if full,
        < 0 failed."""
        cdef iovec iov[8]
        cdef r2_shm_conn* c = self._c()
        cdef Py_ssize_t n = data.shape[0], step, off = 0
        cdef int k = 0
        if pieces < 1 or pieces > 8:
            raise ValueError("1..8 pieces")
        if n == 0:
            return 0
        step = max(1, n // pieces)
        while off < n and k < pieces:
            iov[k].iov_base = <void*>&data[off]
            iov[k].iov_len = (n - off) if k == pieces - 1 else min(step, n - off)
            off += iov[k].iov_len
            k += 1
        return r2_shm_write(c, iov, k)

    def recv(self, size_t n):
        """Up to n bytes (b"" if none); an int < 0 once the ring is empty and the peer is gone."""
        cdef bytearray out = bytearray(n)
        cdef char* p = out
        cdef int64_t got = r2_shm_read(self._c(), p, n)
        if got < 0:
            return got
        return bytes(out[:got])

    def arm(self):
        return r2_shm_arm(self._c())

    def wake(self):
        return r2_shm_wake(self._c())

    def fileno(self):
        return self._c().fd

    @property
    def dead(self):
        return self._c().dead

    @property
    def bells(self):
        return self._c().bells

    def close(self):
        if self.c != NULL:
            r2_shm_close(self.c)
            self.c = NULL

    def __dealloc__(self):
        self.close()


# ---------------------------------------------------------------------------------------------
# Hooks into a live engine (tests/fault_worker.py, shm_worker.py, test_engine_limits.py, ...)

def corrupt_next(Engine engine, int peer, int rail):
    """Flip one payload byte of the next DATA frame to `peer` on `rail` as it goes on the wire,
    after its MAC (if any) was computed: a middlebox writing into the stream (the corrupting
    transport, corrupt_transport.pxi, in front of the rail's connection). Not a user fault
    mode: with the checksum only, the change goes undetected. False if the rail has no live
    connection (nothing is set then)."""
    cdef State* e = engine._live()
    cdef int rc
    if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL or rail < 0 or \
            rail >= e.peers[peer].nrails:
        raise ValueError(f"no such peer/rail {peer}/{rail}")
    with nogil:
        pthread_mutex_lock(&e.mu)
        rc = corrupt_rail(e.peers[peer].rails[rail])
        pthread_mutex_unlock(&e.mu)
    if rc < 0:
        raise MemoryError("corrupt_next: no memory, or too many transports wrapped")
    return rc == 1


def p2p_start(Engine engine, int peer, uint32_t comm, uint32_t seq):
    """The point-to-point sequences of (peer, comm), both ways, start at seq (nothing sent or
    received on them yet): tests of the wrap at 2**32."""
    cdef State* e = engine._live()
    if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL:
        raise ValueError(f"no such peer {peer}")
    with nogil:
        pthread_mutex_lock(&e.mu)
        e.peers[peer].p2p_send_seq[comm] = seq
        p2p_state(e.peers[peer], comm).seen_upto = seq
        pthread_mutex_unlock(&e.mu)


def debug_state(Engine engine):
    """Counts of the engine's tables (for tests and debugging)."""
    cdef State* e = engine._live()
    cdef dict out
    cdef size_t np2p = 0
    cdef int i
    with nogil:
        pthread_mutex_lock(&e.mu)
    try:
        for i in range(e.nranks):
            if e.peers[i] != NULL:
                np2p += e.peers[i].p2p.size()
        out = {"ops": e.ops.size(), "sends": e.smap.size(), "recvs": e.rmap.size(),
               "unexpected": e.cunexp.size(), "notices": e.notices.size(),
               # what a peer's frames can grow, each bounded (issue 28)
               "unexpected_msgs": e.unexp_msgs, "unexpected_bytes": e.unexp_bytes,
               "aborted": e.aborted.size(), "verdicts": e.verdicts.size() + e.early_verdicts.size(),
               "next_seq": e.next_seq.size(),
               "p2p_states": np2p, "events_kept": e.events.size(),
               "events_total": e.events_base + e.events.size(),
               "ready": {i: e.peers[i].ready.size() for i in range(e.nranks) if e.peers[i] != NULL},
               "inflight": {i: [e.peers[i].rails[k].inflight.size() for k in range(e.peers[i].nrails)]
                            for i in range(e.nranks) if e.peers[i] != NULL},
               # per connection (rails, then control): state, unwritten frame bytes, a chunk
               # being written, delayed acks waiting
               "unsent": {i: [(e.peers[i].rails[k].state,
                               e.peers[i].rails[k].txq.size() - e.peers[i].rails[k].txq_pos,
                               e.peers[i].rails[k].tx_busy,
                               e.peers[i].rails[k].dackq.size() // HDR_SIZE)
                              for k in range(e.peers[i].nrails + 1)]
                          for i in range(e.nranks) if e.peers[i] != NULL},
               # what the chunk scheduler sees of each rail: measured rate (B/s), bytes in
               # flight, its window, a frame being written, posted, s since last progress
               "sched": {i: [(round(e.peers[i].rails[k].rate),
                              e.peers[i].rails[k].inflight_bytes,
                              rail_window(e, e.peers[i].rails[k]),
                              e.peers[i].rails[k].tx_busy, e.peers[i].rails[k].tx_posted,
                              round(mono() - e.peers[i].rails[k].last_progress, 3),
                              e.peers[i].rails[k].ghosts)
                             for k in range(e.peers[i].nrails)]
                         for i in range(e.nranks) if e.peers[i] != NULL}}
    finally:
        pthread_mutex_unlock(&e.mu)
    return out


def set_unexpected_limit(Engine engine, uint64_t max_bytes, uint32_t max_msgs):
    """Most payload bytes and messages the engine keeps for messages no receive wants yet (every
    peer together; a peer that sends more fails its operations with this rank): what
    R2COMM_UNEXPECTED_BYTES / R2COMM_UNEXPECTED_MSGS set when the engine is made."""
    cdef State* e = engine._live()
    with nogil:
        pthread_mutex_lock(&e.mu)
        e.unexp_max_bytes = max_bytes
        e.unexp_max_msgs = max_msgs
        pthread_mutex_unlock(&e.mu)


def shm_bells(Engine engine):
    """Per peer with a live shared-memory link: doorbells this rank has rung on it (a doorbell is
    a system call: only towards a peer that announced it sleeps)."""
    cdef State* e = engine._live()
    cdef dict out = {}
    cdef int i
    cdef PairRail* r
    with nogil:
        pthread_mutex_lock(&e.mu)
    try:
        for i in range(e.nranks):
            if e.peers[i] == NULL or e.peers[i].nrails < 1:
                continue
            r = e.peers[i].rails[0]
            if r.state == R_UP and r.conn != NULL and strcmp(r.tp.name, "shm") == 0:
                out[i] = (<ShmConn*>r.conn).c.bells
    finally:
        pthread_mutex_unlock(&e.mu)
    return out


def plan_messages(Plan plan):
    """A Plan's compiled messages, as the tuples it was made from (owned as a bool)."""
    return [("send" if plan.c.kind[i] else "recv", plan.c.peer[i], plan.c.step[i],
             plan.c.buf[i], plan.c.off[i], plan.c.nbytes[i], plan.c.mode[i],
             bool(plan.c.owned[i])) for i in range(plan.c.kind.size())]


# ---------------------------------------------------------------------------------------------
# Wire fuzzing (tests/fuzz_wire.py): the fuzz transport (fuzz_transport.pxi) under an engine

def fuzz_attach(Engine engine, int peer, int rail, uint32_t conn_id, bytes tx_key=b"",
                bytes rx_key=b"", bint late_read=False):
    """Switch the engine (no progress thread) to the in-memory fuzz transport and bring up
    (peer, rail) on it (in mac mode with the connection's frame keys, as attach). What
    fuzz_feed() gives is then what the rail reads; what the engine writes is accepted (and
    counted, and kept per rail for fuzz_sent) or, with block_send, left unwritten.
    late_read: the transport is TPF_LATE_READ, as verbs zero-copy (no hedge copies)."""
    global fz_late_read
    cdef State* e = engine._live()
    if engine.started:
        raise RuntimeError("fuzz transport: the engine must not have a progress thread")
    fz_late_read = late_read
    e.tp = fuzz_transport()
    if 0 <= rail < FZ_RAILS:
        fz.out[rail].clear()        # what the previous connection wrote is gone with it
    # (a negative fd, as closed to the engine, that names the rail to fz_post_send)
    engine.links.attach(peer, rail, -2 - rail, conn_id, tx_key, rx_key)

def fuzz_sent(Engine engine, int rail):
    """The bytes the engine (fuzz_attach) wrote on `rail` since the last call or its
    fuzz_attach (one fuzz transport per process: the engine only names it)."""
    cdef bytes out
    if rail < 0 or rail >= FZ_RAILS:
        raise ValueError(f"fuzz transport keeps rails 0..{FZ_RAILS - 1}")
    out = fz.out[rail]
    fz.out[rail].clear()
    return out

def fuzz_feed(Engine engine, int peer, int rail, const unsigned char[:] data, uint32_t step=0,
              bint block_send=False, uint32_t send_step=0):
    """The rail reads `data` (in reads of at most `step` bytes; 0: as much as it asks for),
    then the engine sends what it has to (acks, chunks, notices) as its progress loop would
    (sends take at most `send_step` bytes each: partial writes; 0: all). Returns (bytes
    consumed, rail still up, bytes the engine wrote)."""
    cdef State* e = engine._live()
    cdef PairRail* r
    cdef size_t before
    cdef int i, guard = 0
    cdef uint64_t sent0
    if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL or rail < 0 or rail > e.peers[peer].nrails:
        raise ValueError(f"no such peer/rail {peer}/{rail}")
    if e.tp != fuzz_transport():
        raise RuntimeError("fuzz_feed needs fuzz_attach first")
    with nogil:
        pthread_mutex_lock(&e.mu)
        r = e.peers[peer].rails[rail]
        fz.src = <const char*>&data[0] if data.shape[0] > 0 else NULL
        fz.n = data.shape[0]
        fz.pos = 0
        fz.step = step
        fz.block = block_send
        fz.send_step = send_step
        sent0 = fz.sent
        # each round consumes input or stops: bounded by the input size
        while r.state == R_UP and fz.pos < fz.n and guard <= <int>fz.n + 2:
            guard += 1
            before = fz.pos
            rail_read(e, r)
            if fz.pos == before:
                break
        for i in range(e.nranks):
            if e.peers[i] != NULL:
                pump_peer(e, e.peers[i])
        if e.dack_rails > 0:
            lazy_ack_timer(e, mono() + DACK_DELAY)
        fz.src = NULL
        pthread_mutex_unlock(&e.mu)
    return fz.pos, r.state == R_UP, fz.sent - sent0

# ---------------------------------------------------------------------------------------------
# The fake transport (fake_transport.pxi; tests/test_transport_iface.py, R2COMM_TEST_TRANSPORT)

def use_fake_transport(Engine engine, uint64_t seed, double block=0.0, double short=0.0,
                       double delay=0.0, double lose=0.0, double fail=0.0,
                       int64_t fail_bytes=0, int max_fails=0):
    """Connections the engine attaches from now on use the fake transport (fake_transport.pxi):
    TCP underneath, with faults drawn from `seed`: a post refused (would block) with
    probability `block`, a post or read accepted in part with `short`, a completion held back
    at each test with `delay` (then handed over shuffled) or lost with `lose`, and a
    connection, with probability `fail` (at most `max_fails` of them), shut down at a random
    byte within its first `fail_bytes` sent."""
    cdef State* e = engine._live()
    memset(&fk, 0, sizeof(fk))
    fk.seed = seed
    fk.p_block, fk.p_short, fk.p_delay, fk.p_lose, fk.p_fail = block, short, delay, lose, fail
    fk.fail_bytes = fail_bytes
    fk.fails_left = max_fails
    with nogil:
        pthread_mutex_lock(&e.mu)
        e.tp = fake_transport()
        pthread_mutex_unlock(&e.mu)

def transport_stats(Engine engine):
    """The transport new connections use, and the fake transport's counts of what it did."""
    cdef State* e = engine._live()
    return {"transport": (<bytes>e.tp.name).decode(), "conns": fk.conns,
            "blocked": fk.blocked, "shorts": fk.shorts, "delayed": fk.delayed,
            "reordered": fk.reordered, "lost": fk.lost, "failed": fk.failed,
            "completed": fk.completed}

