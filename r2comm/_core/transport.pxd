# The rail transport interface (issue 19), in the spirit of NCCL's ncclNet_t: the engine moves
# bytes on a rail only through these calls, on an opaque per-connection state, without the GIL.
#
# Design
# ------
# The engine owns reliability: chunk identity, acks, re-sending on another rail, hedging,
# dedup, deadlines. A transport only moves frames on one connection and reports what it has
# finished with; it never sees a failure policy. The calls, and why each exists:
#
#   adopt(handle) -> conn     Wrap an established, authenticated connection (set-up is cold
#                             path, in Python: each kind's object, r2comm/transport/kind.py,
#                             dials and attaches; listen/connect/accept and the handshake live in
#                             r2comm/transport/tcp.py; a verbs set-up hands over a connected QP).
#                             NULL on failure. conn is opaque to the engine.
#   event_fd(conn)            The fd the progress loop's epoll waits on: readable when irecv may
#                             return bytes or test may return completions, writable after a
#                             would-block isend (-1: none; the engine then polls on its timer).
#   isend(conn, iov, niov, cookie)
#                             Post the gather list (small frames queued for the rail, then the
#                             DATA frame's header, payload and tag). Returns the bytes accepted
#                             (> 0), 0 if it would block (retry on writability), -errno if the
#                             connection failed. A stream transport may accept a prefix: the
#                             engine re-posts the rest (same cookie). A message transport
#                             accepts all or nothing.
#                             Memory contract: every entry is valid only during the call (the
#                             transport copies headers, control frames and tags it needs later)
#                             except the DATA payload, which comes from a registered region and
#                             stays valid until the post completes. cookie != 0 names that DATA
#                             frame; 0: the post holds only small frames, no completion wanted.
#   test(conn, out, max)      Completed posts: writes up to max cookies, returns how many. A
#                             cookie completes once all of its bytes were accepted and the
#                             transport no longer reads its payload. Completions may come late
#                             and in any order; a connection that fails reports none (the engine
#                             re-sends from its own state, so losing them is safe).
#   irecv(conn, buf, n)       Received bytes, in order: up to n into buf (a staging buffer, or the
#                             destination itself for a large payload whose place is known). Bytes
#                             read, 0 if none yet, -errno on failure, T_EOF when the peer closed.
#   reg_mr / dereg_mr         Register a region the engine sends from / receives into (an
#                             operation's buffers); the handle goes with the post. TCP: no-op.
#                             (The engine does not call them: every table here leaves them
#                             tp_reg_none; a verbs connection registers its own slots, and user
#                             memory goes through the verbs kind's cache, r2comm/transport/
#                             regcache.py.)
#   flags                     TPF_SIDE_SOCKET, TPF_WAKE_OUT, TPF_POLLED, TPF_NO_NIC (below); 0
#                             for a socket transport.
#   os_fd(conn)               The OS socket under the connection (-1: none). Only for the health
#                             checks (TCP_INFO tells a stalled peer process from a dead path) and
#                             the injected silent fault; never on the data path.
#   shutdown(conn)            Make the connection unusable at once, both directions (a failed
#                             rail: the peer must see it die too).
#   close(conn)               Release it; after close the transport touches no posted memory.
#   arm / wake, flags         TPF_POLLED: the event fd does not report every arrival (shared
#                             memory: bytes land without a system call). The engine then calls
#                             irecv/isend on the connection in every progress round, arm(conn)
#                             before it blocks in epoll (1: something is there already, do not
#                             block; 0: the transport will make event_fd readable when bytes or
#                             space arrive; writability is reported as readability too, so the
#                             engine never asks epoll for EPOLLOUT on it), and wake(conn) when
#                             event_fd fired (consume the notification; a dead peer is noticed
#                             there and reported by irecv/isend). TPF_NO_NIC: no NIC under the
#                             connection: injected NIC faults do not apply, and acks that are
#                             late mean a stalled peer process (its end is still open), never a
#                             dead path. Transports without them leave arm/wake NULL (a
#                             zero-initialised Transport is an fd-driven one).
#
# "Written on rail r" for the engine: a DATA frame occupies its rail (r.tx_busy) from begin_tx
# until its completion; an ack from the peer is accepted once every byte was posted (the peer
# cannot acknowledge bytes the NIC has not read), and the frame's payload is released (orphan
# copy freed, benchmark-only noack mode counts it delivered) at its completion. A completion that
# has not come a rail deadline after the engine's timer first saw the frame posted fails the
# rail (the transport lost it). Chunks in flight on a failed rail are re-queued from the
# engine's own records, whatever the transport completed. Today the engine keeps at most one
# DATA post per rail outstanding (and small frames need no completion), so completions of one
# connection cannot overtake each other yet (the fake transport's shuffling has nothing to
# reorder); pipelining several DATA posts per rail, as verbs wants, needs a per-rail table of
# posted frames keyed by cookie in place of rail_reap's match on the current one.
#
# TCP (tcp.pxd): a byte stream. isend is one non-blocking sendmsg (prefixes accepted); the
# kernel copies everything, so a post completes when its last byte is accepted, inside the
# isend call (test only hands the cookie over: no syscall). irecv is recv; event_fd and os_fd
# are the socket.
#
# verbs (verbs_transport.pxi, inside the verbs extension; the engine gets its table by address,
# Engine.links.attach_transport): an RC queue pair used as a byte stream. isend copies the gather
# list into registered send slots (a prefix when they run out) and posts one SEND per slot, so
# like TCP a post completes inside isend and the slots play the socket buffer; irecv copies out
# of pre-posted receive slots in order and re-posts them. event_fd is an epoll set of the
# completion channel, the companion socket and the device's async fd (TPF_WAKE_OUT); os_fd is
# the companion socket, the rail's authenticated TCP connection kept open on the same NIC
# (TPF_SIDE_SOCKET): failure notice, health probe, NIC checks. A payload inside user memory
# that r2comm/transport/regcache.py registered goes zero-copy (SENDs from the user's pages). Such a post
# also completes inside isend, before the NIC has read the pages: the one exception to the
# memory contract above, safe because the engine writes a chunk's region again only after the
# peer acknowledged the chunk (verbs_transport.pxi's header has the argument), and because the
# registration keeps the pages pinned until the SENDs complete (TPF_LATE_READ: no hedge copies). Registration is per device and
# owned by the cache, not by the engine (reg_mr stays unused).
#
# shm (shm.pxd, r2_shm.h; the table and the segments in shm_segments.pyx, its own extension that
# hands a connection to the engine by address as verbs does; set-up in r2comm/transport/shm.py):
# a pair of single-producer/single-consumer byte rings in one POSIX shm segment per pair of local
# ranks, and a connected socket used as doorbell and liveness (TPF_POLLED | TPF_WAKE_OUT |
# TPF_NO_NIC). A stream, like TCP: isend copies a prefix into the ring and completes inside the
# call; irecv copies out. os_fd is -1 (no TCP_INFO).
#
# Each kind's cold half (offer, dial/attach, fds per rail, deadline floor, registration cache)
# is one Python object, r2comm/transport/<kind>.py's TRANSPORT (kind.Transport): a new
# transport is its table here (a .pxd/.pxi) plus that one module, listed in KINDS.
#
# Implementations: tcp.pxd and verbs_transport.pxi (production), shm.pxd (local peers), and in
# the test extension (testing.pyx, not in the production engine) fuzz_transport.pxi (in-memory,
# the wire fuzzer) and fake_transport.pxi (TCP underneath, seeded faults: short and refused
# posts, delayed, reordered and lost completions, a connection failing at a random byte).
from libc.stdint cimport int64_t, uint64_t, intptr_t

cdef extern from "<sys/uio.h>" nogil:
    cdef struct iovec:
        void* iov_base
        size_t iov_len

cdef struct Transport:
    const char* name
    int flags                 # TPF_*: what the engine must do differently for this transport
    void* (*adopt)(intptr_t handle) noexcept nogil
    int (*event_fd)(void* conn) noexcept nogil
    int64_t (*isend)(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil
    int (*test)(void* conn, uint64_t* out, int max) noexcept nogil
    int64_t (*irecv)(void* conn, void* buf, size_t n) noexcept nogil
    int (*reg_mr)(void* conn, void* base, size_t n, void** mr) noexcept nogil
    void (*dereg_mr)(void* conn, void* mr) noexcept nogil
    int (*os_fd)(void* conn) noexcept nogil
    void (*shutdown)(void* conn) noexcept nogil
    void (*close)(void* conn) noexcept nogil
    int (*arm)(void* conn) noexcept nogil      # TPF_POLLED only (NULL otherwise)
    int (*wake)(void* conn) noexcept nogil     # TPF_POLLED only (NULL otherwise)

cdef enum:
    # os_fd is a companion TCP socket on the rail's NIC that carries no frames (verbs): the
    # health check pokes it with a byte of its own (the peer's kernel acknowledges it even
    # while the peer's process is stopped) instead of queueing a frame on the connection
    TPF_SIDE_SOCKET = 1
    # event_fd never reports EPOLLOUT: room to post again (a send completion) shows as
    # readability, so a rail waiting to write is written on its input events too
    TPF_WAKE_OUT = 2
    # the event fd does not report every arrival (shared memory: bytes land without a system
    # call): the engine polls the connection every progress round and calls arm() before it
    # blocks, wake() when the event fd fired (see "flags" above)
    TPF_POLLED = 4
    # no NIC under the connection (shared memory): injected NIC faults do not apply, and late
    # acks mean a stalled peer process (its end is still open), never a dead path
    TPF_NO_NIC = 8
    # a post may complete before the bytes are read (verbs zero-copy SENDs from the user's
    # pages): the pages may be rewritten once the chunk is acknowledged while a second copy
    # of it is still being read, so the engine never sends a chunk twice at once (no hedge
    # copy) over such a connection; a copy is only re-sent after its connection is closed
    TPF_LATE_READ = 16

cdef enum:
    T_EOF = -1000
    T_DONE_MAX = 16           # completions a connection holds for test() (see TDone)

# A connection's completed cookies, for transports that complete inside isend (TCP, fuzz).
cdef struct TDone:
    int n
    uint64_t q[T_DONE_MAX]

cdef inline void tdone_push(TDone* d, uint64_t cookie) noexcept nogil:
    if cookie != 0 and d.n < T_DONE_MAX:
        d.q[d.n] = cookie
        d.n += 1

cdef inline int tdone_take(TDone* d, uint64_t* out, int max) noexcept nogil:
    cdef int i, k = d.n if d.n < max else max
    for i in range(k):
        out[i] = d.q[i]
    for i in range(k, d.n):
        d.q[i - k] = d.q[i]
    d.n -= k
    return k

cdef inline int64_t iov_total(iovec* iov, int niov) noexcept nogil:
    cdef int64_t t = 0
    cdef int i
    for i in range(niov):
        t += iov[i].iov_len
    return t

cdef inline int tp_reg_none(void* conn, void* base, size_t n, void** mr) noexcept nogil:
    mr[0] = NULL
    return 0

cdef inline void tp_dereg_none(void* conn, void* mr) noexcept nogil:
    pass
