# cython: language_level=3
# distutils: language = c++
"""r2comm's engine: runs one rank's part of a schedule over every rail to every peer.

One progress thread (started from Python, it drops the GIL at once) drives an epoll loop over the
rail and control connections. Messages are cut into chunks; each chunk is sent on whichever rail of
the pair has room in its window (rails that drain faster take more), acknowledged by the receiver,
and kept by the sender until acknowledged. When a rail fails (socket error, missing acks past the
deadline, a malformed frame, or the peer's notice) its unacknowledged chunks go back to the front of
the pair's queue and leave on the surviving rails; the receiver drops duplicates by chunk identity,
so nothing is written or reduced twice. Missing acks are judged from the kernel's view of the
connection first (TCP_INFO, see judge_rail): a peer whose kernel still acknowledges is a stalled
process, not a dead NIC, and its rails are held until it resumes. All engine state is guarded
by one mutex; Python threads post operations and wait on a condition variable, both without the
GIL. With R2COMM_INTEGRITY=mac every frame ends in a Poly1305 tag (r2_mac.h) keyed per
connection, direction and frame counter; a frame is acted on only once its tag verifies, and one
that does not fails its rail like any other malformed frame.
"""
import os
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t, intptr_t
from libc.stdlib cimport malloc, free, calloc
from libc.string cimport memcpy, memset, memmove
from libc.math cimport fabs
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.map cimport map as cmap
from libcpp.string cimport string
from libcpp.utility cimport pair
from cython.operator cimport dereference as deref, preincrement as inc
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC, CLOCK_REALTIME

from r2comm._core.wire cimport (r2_hdr, hdr_encode, hdr_validate, HDR_SIZE, MAX_CTRL_PAYLOAD, FL_P2P,
                                F_DATA, F_ACK, F_RAIL_DOWN, F_RAIL_DOWN_ACK, F_ABORT, FL_LAZY_ACK,
                                FL_VOID, FL_VERDICT)
from r2comm._core.transport cimport (iovec, Transport, T_EOF, TDone, tdone_push, tdone_take,
                                     iov_total, tp_reg_none, tp_dereg_none, TPF_SIDE_SOCKET,
                                     TPF_WAKE_OUT, TPF_POLLED, TPF_NO_NIC,
                                     TPF_LATE_READ)
# Every transport is reached through its transport.pxd table: TCP's (the default, tcp.pxd) here,
# the others' by address (attach_transport: shm_segments.pyx, verbs.pyx); the health checks use
# a connection's OS socket (the table's os_fd)
from r2comm._core.tcp cimport tcp_transport, MSG_NOSIGNAL, MSG_DONTWAIT

cdef extern from "<sys/socket.h>" nogil:
    ssize_t sock_send "send"(int fd, const void* buf, size_t n, int flags)

cdef extern from "r2_reduce.h" namespace "r2" nogil:
    int reduce_into(void* d, const void* s, size_t nbytes, int dt, int op, int rev)
    int reduce3(void* d, const void* a, const void* b, size_t nbytes, int dt, int op)
    int itemsize(int dt)

cdef extern from "r2_health.h" nogil:
    cdef struct r2_tcpsnap:
        int ok, has_acked, has_wnd
        unsigned state, unacked, probes, backoff, retransmits, total_retrans, snd_mss
        unsigned last_ack_ms, notsent
        unsigned long long bytes_acked, snd_wnd
    int r2_tcp_snap(int fd, r2_tcpsnap* s)
    int r2_local_nic(int fd, char* name, size_t n)
    int r2_addr_state(const char* addr, char* name, size_t n)
    int r2_peer_local(int fd)
    int r2_drop_input(int fd)

cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void* ptr
        int fd
        uint32_t u32
        uint64_t u64
    cdef struct epoll_event:
        uint32_t events
        epoll_data_t data
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event* ev)
    int epoll_wait(int epfd, epoll_event* evs, int maxevents, int timeout)
    enum: EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP, EPOLL_CTL_ADD, EPOLL_CTL_MOD, EPOLL_CTL_DEL, EPOLL_CLOEXEC

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    enum: EFD_NONBLOCK, EFD_CLOEXEC

cdef extern from "<unistd.h>" nogil:
    ssize_t read(int fd, void* buf, size_t n)
    ssize_t write(int fd, const void* buf, size_t n)
    int close(int fd)


cdef extern from *:
    """
    #include <map>
    #include <deque>
    #include <vector>
    template <class It> static inline auto& r2_second(It it) { return it->second; }
    template <class It> static inline auto r2_first(It it) { return it->first; }
    template <class It> static inline void r2_inc(It& it) { ++it; }
    template <class T> static inline T* r2_new() noexcept { return new T(); }
    template <class C> static inline void r2_erase_at(C& c, size_t i) { c.erase(c.begin() + i); }
    """
    void erase_at "r2_erase_at"[C](C& c, size_t i) nogil
    T* r2_new[T]() nogil

cdef extern from "<stdio.h>" nogil:
    int snprintf(char* s, size_t n, const char* fmt, ...)

# ---------------------------------------------------------------------------------------------
# The engine's parts, included as text into this one extension (one C++ translation unit: the
# same code as when they were one file, inlined across parts alike). They share the declarations
# above and engine.pxd's; engine_state.pxi comes first.
#   engine.pxd          (read first, by Cython) constants, structs and C++ classes (Op, SendMsg,
#                       RecvMsg, PairRail, Peer, State, PlanC), Plan's and Engine's C fields
#   engine_state.pxi    constants' Python names, limits, making a PairRail and the State, small
#                       helpers (clocks, keys, chunk sizes, events)
#   op_life.pxi         an operation's life: posted from a Plan, counted done, freed
#   scheduler.pxi       the chunk scheduler: ready queues, rail windows and rates, striping,
#                       chunk-level dependencies, tail hedging
#   tx.pxi              sending: emulated NIC (injected faults), framing and MACs, rail_write
#                       (posts through transport.pxd's interface, reaps completions),
#                       control frames, delayed acks
#   rx.pxi              receiving: rail_read, header checks, where a payload goes, delivery
#   matching.pxi        matching messages to receives: call descriptors and mismatches (one
#                       report on every rank: the judge's verdict), point-to-point order,
#                       unexpected messages
#   failover.pxi        acks, failing a rail and re-queueing its chunks, aborts, lost peers
#   health.pxi          late rails judged by TCP_INFO; the timers (check_timers)
#   progress.pxi        the epoll progress loop
#   spin_policy.pxi     a waiter's loop (wait_op_c): drives progress itself, spins or sleeps in
#                       epoll by the spin policy (SpinState), which adapts to a contended CPU
# Here, after them: Plan, Buffer and the Engine class: the data path (start, close, drain; post,
# run, wait, test, cancel, release, point-to-point queries; events). Its cold-path faces are
# classes of their own, in parts included after it (Cython takes no include inside a class):
#   engine_links.pxi    EngineLinks (Engine.links): attaching connections, fail-back probes,
#                       link states, lost peers, NIC facts (control/links.py, liveness, nicwatch)
#   engine_tuning.pxi   EngineTuning (Engine.tuning): the spin policy's attributes and the
#                       tuning setters (integrity, windows, hedging, weights, rates: world.py)
#   engine_faults.pxi   EngineFaults (Engine.faults): injected NIC faults
#   capi.pxi            the C-level interface (engine.c_api()) and ChannelCell
# The declarations they share with other extensions (the state's types, the classes' C fields)
# are in engine.pxd; the test hooks (fuzz and fake transports, wire and crypto helpers, ShmEnd,
# the engine's debug views) are a separate extension, r2comm/_core/testing.pyx, built only for
# tests.
include "engine_state.pxi"
include "op_life.pxi"
include "scheduler.pxi"
include "tx.pxi"
include "rx.pxi"
include "matching.pxi"
include "failover.pxi"
include "health.pxi"
include "progress.pxi"
include "spin_policy.pxi"

cdef Transport TCP_TP                 # the production transport (tcp.pxd)
tcp_transport(&TCP_TP)

# ---------------------------------------------------------------------------------------------
# Python-facing objects

def nic_states(addrs):
    """The kernel's word on the interface holding each IPv4 address of `addrs`: 1 up with
    carrier, 0 down or without carrier, -1 not an address of this host (one getifaddrs
    each; some 50 us)."""
    cdef char name[64]
    cdef bytes b
    cdef const char* c
    cdef int res
    out = []
    for a in addrs:
        b = str(a).encode("ascii", "replace")[:63]
        c = b
        with nogil:
            res = r2_addr_state(c, name, sizeof(name))
        out.append(res)
    return out


cdef class Plan:
    """One rank's compiled schedule for one (operation, size, dtype, epoch): messages and the
    chunk-level dependencies between them. Buffers are referred to by index (0 work, 1 send,
    2 scratch) and bound at post time, so a Plan is cached and reused (C fields: engine.pxd)."""

    def __cinit__(self, *args, **kwargs):
        self.c = r2_new[PlanC]()

    def __dealloc__(self):
        del self.c

    def __init__(self, msgs, deps, algo="", info=None, weights=None):
        """weights: None, or one entry per message: None or a send's share of each rail
        (Schedule.rail_weights; >= 0, not all 0), which the striping then follows."""
        cdef int kind, peer, step, buf, mode, owned, a, b
        cdef uint64_t off, nbytes
        cdef vector[double] rw
        if weights is not None and len(weights) != len(msgs):
            raise ValueError(f"{len(weights)} rail weight entries for {len(msgs)} messages")
        for i, m in enumerate(msgs):
            # typed locals: Cython mis-compiles a conditional expression passed to push_back
            kind = 1 if m[0] == "send" else 0
            peer, step, buf, off, nbytes, mode = m[1], m[2], m[3], m[4], m[5], m[6]
            if buf < 0 or buf > 2 or mode < M_COPY or mode > M_REDUCE_SEND_REV:
                raise ValueError(f"message {m!r}: buffer index or receive mode out of range")
            owned = 1 if m[7] else 0
            if nbytes > MAX_MESSAGE:
                raise ValueError(f"message of {nbytes} bytes: the engine moves at most 1 TiB "
                                 "per message (peers refuse larger ones)")
            if step < 0 or step >= (1 << 24):
                raise ValueError(f"message step {step} out of range: steps are 0 .. 2**24 - 1 "
                                 "(they share a 64-bit key with the sequence number)")
            self.c.kind.push_back(kind)
            self.c.peer.push_back(peer)
            self.c.step.push_back(step)
            self.c.buf.push_back(buf)
            self.c.off.push_back(off)
            self.c.nbytes.push_back(nbytes)
            self.c.mode.push_back(mode)
            self.c.owned.push_back(owned)
            rw.clear()
            w = weights[i] if weights is not None else None
            if w is not None:
                ws = [float(x) for x in w]
                if kind != 1 or not 0 < len(ws) <= 64 or \
                        not all(0.0 <= x < float("inf") for x in ws) or not sum(ws) > 0:
                    raise ValueError(f"message {m!r}: rail weights {w!r} (a send's shares of "
                                     "its rails: at most 64, >= 0, not all 0)")
                rw = ws
            self.c.rw.push_back(rw)
        for a, b in deps:
            self.c.deps.push_back(pair[int, int](a, b))
        self.algo = algo
        self.info = info


cdef class Buffer:
    """Holds a buffer export for as long as the engine may touch the memory."""
    cdef Py_buffer view
    cdef int held
    cdef readonly uint64_t ptr
    cdef readonly Py_ssize_t nbytes

    def __cinit__(self, obj, bint writable):
        PyObject_GetBuffer(obj, &self.view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
        self.held = 1
        self.ptr = <uint64_t>self.view.buf
        self.nbytes = self.view.len

    def release(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = 0

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


def _env_uint(str name, uint64_t default):
    """A non-negative integer from the environment (default if unset); R2commArgumentError
    naming the variable if malformed."""
    from r2comm.errors import R2commArgumentError
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0 or n >= 1 << 64:
        raise R2commArgumentError(f"{name}={v!r}: expected a non-negative integer")
    return n


def memcopy(uint64_t dst, uint64_t src, uint64_t n):
    """memcpy between two buffer addresses without the GIL (local copies of a schedule)."""
    if n == 0:
        return
    with nogil:
        memcpy(<void*>dst, <const void*>src, n)


cdef class Engine:
    """The engine of one rank: peers, rails, the progress thread's state (C fields: engine.pxd).
    The data path is here; the cold path is its faces: links (EngineLinks), tuning
    (EngineTuning), faults (EngineFaults), each made once with the engine."""

    def __cinit__(self, int me, int nranks, list nrails_per_peer, uint32_t chunk_size,
                  double rail_timeout, double peer_timeout, uint64_t window,
                  double probe_base=0.1, double probe_max=5.0, int nics=0):
        cdef pthread_condattr_t ca
        cdef Peer* p
        cdef PairRail* r
        cdef int i, k
        cdef epoll_event ev
        # (read before anything is made: a malformed value raises with nothing to undo)
        if chunk_size == 0:
            raise ValueError("Engine: chunk_size must be positive (chunks divide messages)")
        cdef uint64_t max_unexp_bytes = _env_uint("R2COMM_UNEXPECTED_BYTES", UNEXP_MAX_BYTES)
        cdef uint32_t max_unexp_msgs = <uint32_t>min(
            _env_uint("R2COMM_UNEXPECTED_MSGS", UNEXP_MAX_MSGS), 0xFFFFFFFF)
        self.e = new_state()
        e = self.e
        self.h = <EngineRef*>calloc(1, sizeof(EngineRef))
        self.h.e = e
        self.h.refs = 1
        # its cold-path faces, each holding a count of h (engine_links/_tuning/_faults.pxi)
        self.links = EngineLinks.__new__(EngineLinks)
        self.links._bind(self.h)
        self.tuning = EngineTuning.__new__(EngineTuning)
        self.tuning._bind(self.h)
        self.faults = EngineFaults.__new__(EngineFaults)
        self.faults._bind(self.h)
        e.me = me
        e.nranks = nranks
        e.cs = chunk_size
        e.rail_timeout = rail_timeout
        e.peer_timeout = peer_timeout
        e.window = window
        e.win_s = 0.15
        e.probe_base = probe_base
        e.probe_max = probe_max
        e.tp = &TCP_TP
        pthread_mutex_init(&e.mu, NULL)
        pthread_condattr_init(&ca)
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC)
        pthread_cond_init(&e.cv, &ca)
        pthread_cond_init(&e.pcv, &ca)
        e.epfd = epoll_create1(EPOLL_CLOEXEC)
        e.evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        ev.events = EPOLLIN
        ev.data.u64 = EVFD_TAG
        epoll_ctl(e.epfd, EPOLL_CTL_ADD, e.evfd, &ev)
        e.trash = <char*>malloc(chunk_size)
        e.unexp_max_bytes = max_unexp_bytes
        e.unexp_max_msgs = max_unexp_msgs
        for i in range(nranks):
            if i == me:
                e.peers.push_back(NULL)
                continue
            p = r2_new[Peer]()
            p.rank = i
            p.nhot = 0
            p.nrails = nrails_per_peer[i]
            for k in range(p.nrails + 1):
                r = new_rail()
                r.peer = i
                r.index = k
                r.window = window
                # (its read and staging buffers come with its first connection:
                # EngineLinks._attach)
                p.rails.push_back(r)
            e.peers.push_back(p)
        # NIC fault slots: every rail index a peer has, and this rank's NICs (`nics`) even when
        # every peer is local (shared memory, one data rail each)
        nmax = max(max(nrails_per_peer) if nrails_per_peer else 0, nics)
        for k in range(nmax):
            e.inj_mode.push_back(INJ_NONE)
            e.inj_peer.push_back(-1)
        # C fields of a cdef class start at zero (started); h's spin counters and strikes too
        spin_init(&self.h.sp)

    def start(self):
        import threading
        self.thread = threading.Thread(target=self._run, name="r2comm-progress", daemon=True)
        self.thread.start()
        self.started = 1

    def _run(self):
        with nogil:
            progress_loop(self.e)

    def close(self):
        """Stop the progress thread, close every connection, free everything."""
        cdef uint64_t one = 1
        cdef State* e = self.e
        cdef Peer* p
        cdef int i, k
        if e == NULL:
            return
        r2_atomic_set(&self.h.closing, 1)      # no new C-level call gets in (capi_enter)
        with nogil:
            pthread_mutex_lock(&e.mu)
            e.stop = 1
            pthread_cond_broadcast(&e.pcv)
            pthread_mutex_unlock(&e.mu)
            write(e.evfd, &one, 8)
            # the C-level calls inside end soon: a stopping engine ends every wait
            while r2_atomic_get(&self.h.users) > 0:
                usleep(1000)
        if self.started:
            self.thread.join(5.0)
        with nogil:
            # owned sends whose operation was released belong to the engine alone
            it2 = e.smap.begin()
            while it2 != e.smap.end():
                if (<SendMsg*>deref(it2).second).op == NULL:
                    free_send(<SendMsg*>deref(it2).second)
                inc(it2)
            e.smap.clear()
            it = e.ops.begin()
            while it != e.ops.end():
                free_op(e, deref(it).second, 0)
                inc(it)
            e.ops.clear()
            for i in range(e.nranks):
                p = e.peers[i]
                if p == NULL:
                    continue
                for k in range(p.nrails + 1):
                    if p.rails[k].conn != NULL:
                        p.rails[k].tp.close(p.rails[k].conn)
                        p.rails[k].conn = NULL
                    free(p.rails[k].rbuf)
                    free(p.rails[k].stage)
                    if k == p.nrails:
                        free(p.rails[k].mbuf)      # a data rail's mbuf is its stage
                    if p.rails[k].rtarget != NULL and (p.rails[k].rkind == K_BUF or p.rails[k].rkind == K_CTRL):
                        free(p.rails[k].rtarget)
                    del p.rails[k]
                itp = p.p2p.begin()
                while itp != p.p2p.end():
                    free_p2p(e, deref(itp).second)
                    inc(itp)
                del p
            itu = e.cunexp.begin()
            while itu != e.cunexp.end():
                free_unexp(e, deref(itu).second)
                inc(itu)
            close(e.epfd)
            close(e.evfd)
            free(e.trash)
            pthread_cond_destroy(&e.cv)
            pthread_cond_destroy(&e.pcv)
            pthread_mutex_destroy(&e.mu)
        del self.e
        self.e = NULL
        self.h.e = NULL

    def __dealloc__(self):
        if self.e != NULL and not self.started:
            self.close()
        if self.h != NULL:
            if self.e != NULL:
                r2_atomic_set(&self.h.closing, 1)   # a state never freed: not reachable either
            engine_unref(self.h)
            self.h = NULL

    def drain(self, double timeout):
        """Wait until every send was acknowledged and every queued frame written (or timeout);
        returns True if drained (a send to a peer held lost is not waited for). Called before
        close, so a rank that finished first does not take unacknowledged eager data, or the
        acks its peers wait for, down with it."""
        cdef State* e = self._live()
        cdef double until = mono() + timeout, t
        cdef timespec ts
        cdef int done = 0
        with nogil:
            pthread_mutex_lock(&e.mu)
            while True:
                if e.dack_rails > 0:
                    # delayed acks go now: the peers' drains wait for them, and a rank that
                    # closed with some still queued left its peer waiting out the timeout
                    lazy_ack_timer(e, mono() + DACK_DELAY)
                done = not sends_pending(e) and txq_empty(e)
                t = mono()
                if done or t >= until:
                    break
                t = t + 0.002
                ts.tv_sec = <long>t
                ts.tv_nsec = <long>((t - ts.tv_sec) * 1e9)
                pthread_cond_timedwait(&e.cv, &e.mu, &ts)
            pthread_mutex_unlock(&e.mu)
        return bool(done)

    # -- operations ----------------------------------------------------------------------------
    def post(self, Plan plan, uint64_t b0, uint64_t b1, uint64_t b2, int dtype, int redop,
             uint32_t comm, uint32_t seq, uint32_t count, double timeout, members,
             int p2p=0, int64_t key=0, uint64_t cap=0, int rail=-1):
        """Start one operation; returns its id. count: a collective's element count; key: what
        a receiver matches on, a collective's call descriptor or a p2p message's tag. For p2p (a
        single send or receive), seq is assigned here and cap is the message's bytes at most (a
        receive's buffer). rail >= 0 pins every send of the
        operation to that rail while it is up (a bandwidth probe); if it fails, the chunks
        move to the surviving rails as usual."""
        cdef uint64_t bufs[3]
        bufs[0] = b0
        bufs[1] = b1
        bufs[2] = b2
        return self.post_c(plan, bufs, dtype, redop, comm, seq, count, timeout, members, p2p,
                           key, cap, rail)

    cdef uint64_t post_c(self, Plan plan, uint64_t* bufs, int dtype, int redop, uint32_t comm,
                         uint32_t seq, uint32_t count, double timeout, members, int p2p,
                         int64_t key, uint64_t cap, int rail) except 0:
        """post() and run(): the operation posted under the mutex; its id (never 0)."""
        cdef State* e = self._live()
        cdef vector[int] mem
        cdef uint64_t oid
        cdef int isz = itemsize(dtype)
        if isz == 0:
            raise ValueError("unknown dtype code")
        for x in members:
            mem.push_back(x)
        with nogil:
            pthread_mutex_lock(&e.mu)
            oid = post_op(e, plan.c, bufs, dtype, redop, comm, seq, count, timeout, mem, p2p,
                          <int><uint32_t>key, cap, isz, rail)
            pthread_mutex_unlock(&e.mu)
        return oid

    def post_error(self, uint32_t comm, uint32_t seq, members, int code, str message):
        """An 'error' stand-in for collective (comm, seq): this rank's own arguments were bad
        (it raises locally). It takes the sequence number and sends every other member an
        ABORT carrying `message` with error `code`, so their call of (comm, seq) fails too,
        and the next collective on the communicator lines up on every rank."""
        cdef State* e = self._live()
        cdef vector[int] mem
        cdef bytes b = message.encode()[:MAX_CTRL_PAYLOAD - 64]
        cdef const char* m = b
        cdef size_t i
        for x in members:
            mem.push_back(x)
        with nogil:
            pthread_mutex_lock(&e.mu)
            note_posted_seq(e, comm, seq)
            ita = e.aborted.find(CS(comm, seq))
            if ita != e.aborted.end():
                e.aborted.erase(ita)
            e.verdicts.erase(CS(comm, seq))
            drop_early_verdicts(e, comm, seq)
            take_unexpected(e, NULL, comm, seq, mem)
            for i in range(mem.size()):
                if mem[i] != e.me and mem[i] >= 0 and mem[i] < e.nranks and \
                        e.peers[mem[i]] != NULL and not e.peers[mem[i]].lost:
                    send_abort(e, mem[i], 0, comm, seq, code, m)
            pthread_mutex_unlock(&e.mu)
        self._wake()

    def revoke(self, uint32_t comm, str message):
        """Issue 44: revoke communicator `comm` here (revoke_comm, failover.pxi): its active
        operations fail with E_REVOKED, every later post of it fails at once, and the peers
        this rank holds working connections to get it (and pass it on, once each)."""
        cdef State* e = self._live()
        cdef bytes b = message.encode()[:MAX_CTRL_PAYLOAD - 64]
        cdef const char* m = b
        with nogil:
            pthread_mutex_lock(&e.mu)
            revoke_comm(e, comm, m, -1)
            pthread_mutex_unlock(&e.mu)
        self._wake()

    def is_revoked(self, uint32_t comm):
        """True once communicator `comm` was revoked on this rank (here or by a peer)."""
        cdef State* e = self._live()
        cdef bint out
        with nogil:
            pthread_mutex_lock(&e.mu)
            out = e.revoked.count(comm) != 0
            pthread_mutex_unlock(&e.mu)
        return out

    def wait(self, uint64_t oid, double timeout):
        """Block (without the GIL) until the operation ends or `timeout` seconds pass.
        Returns (state, error code, message, bytes received)."""
        cdef State* e = self._live()
        cdef int err = 0, state
        cdef string msg
        cdef uint64_t nrecv = 0
        with nogil:
            state = self.wait_op(e, oid, timeout, &err, &msg, &nrecv)
        cdef bytes bmsg = msg
        return state, err, bmsg.decode("utf-8", "replace"), nrecv

    def run(self, Plan plan, object work, object send, Py_ssize_t nbytes, int dtype, int redop,
            ChannelCell cell, uint32_t count, members, int64_t desc):
        """A blocking collective in one call, for plans that need no scratch and no local
        copies (small allreduces: the front end's fast path): export `work` (writable) and
        `send` (None: in place), take the cell's next sequence number, post (its communicator
        and timeout are the cell's), wait, release. Returns 0 when it ended well (the
        operation is forgotten), else its id: it failed or timed out and is still registered,
        and the caller finishes it through a Request (which raises its error). Buffers it
        refuses raise before a sequence number is taken."""
        cdef State* e = self._live()
        cdef uint32_t comm = cell.c.comm, seq
        cdef double timeout = r2_cell_timeout(&cell.c)
        cdef Py_buffer wv, sv
        cdef uint64_t bufs[3]
        cdef uint64_t oid, nrecv = 0
        cdef int state, err = 0
        cdef string msg
        PyObject_GetBuffer(work, &wv, PyBUF_WRITABLE)
        if send is not None:
            try:
                PyObject_GetBuffer(send, &sv, PyBUF_SIMPLE)
            except BaseException:
                PyBuffer_Release(&wv)
                raise
        try:
            if wv.len != nbytes or (send is not None and sv.len != nbytes):
                raise ValueError(f"buffers of {wv.len} and {sv.len if send is not None else wv.len}"
                                 f" bytes for a plan of {nbytes}")
            if send is not None and <uint64_t>sv.buf < <uint64_t>wv.buf + <uint64_t>nbytes and \
                    <uint64_t>wv.buf < <uint64_t>sv.buf + <uint64_t>nbytes:
                raise ValueError("sendbuf and recvbuf overlap in memory; pass r2comm.IN_PLACE as "
                                 "sendbuf for an in-place call")
            bufs[0] = <uint64_t>wv.buf
            bufs[1] = <uint64_t>(sv.buf if send is not None else wv.buf)
            bufs[2] = 0
            if itemsize(dtype) == 0:
                raise ValueError("unknown dtype code")
            seq = r2_cell_take(&cell.c)
            oid = self.post_c(plan, bufs, dtype, redop, comm, seq, count, timeout, members, 0, desc,
                              0, -1)
            with nogil:
                state = self.wait_op(e, oid, timeout, &err, &msg, &nrecv)
            if state != ST_DONE:
                return oid
            with nogil:
                forget_op(e, oid)
            return 0
        finally:
            if send is not None:
                PyBuffer_Release(&sv)
            PyBuffer_Release(&wv)

    cdef int wait_op(self, State* e, uint64_t oid, double timeout, int* perr, string* pmsg,
                     uint64_t* pnrecv) noexcept nogil:
        """wait()'s loop: spin_policy.pxi's wait_op_c with this engine's spin policy
        (Engine.tuning's spin attributes)."""
        return wait_op_c(e, &self.h.sp, oid, timeout, perr, pmsg, pnrecv)

    def test(self, uint64_t oid):
        return self.wait(oid, 0.0)

    def p2p_matched(self, uint64_t oid):
        """(peer, tag) of the message a p2p receive was matched with; (-1, -1) if none yet."""
        cdef State* e = self._live()
        cdef int peer = -1
        cdef int64_t tag = -1
        cdef RecvMsg* rm
        with nogil:
            pthread_mutex_lock(&e.mu)
            it = e.ops.find(oid)
            if it != e.ops.end() and deref(it).second.p2p and deref(it).second.recvs.size() == 1:
                rm = <RecvMsg*>deref(it).second.recvs[0]
                if rm.bound:
                    peer = rm.peer
                    tag = <int64_t>rm.aux
            pthread_mutex_unlock(&e.mu)
        return peer, tag

    def p2p_probe(self, uint32_t comm, int peer, int64_t tag):
        """(peer, tag, bytes, dtype code) of the message that a receive from global rank `peer`
        (-1: any) with `tag` (-1: any) on communicator `comm` would match now, among those
        here and not matched yet (MPI's probe); None if there is none. Nothing is taken."""
        cdef State* e = self._live()
        cdef Unexp* u
        cdef int fpeer = -1, dt = 0
        cdef int64_t ftag = -1
        cdef uint64_t total = 0
        with nogil:
            pthread_mutex_lock(&e.mu)
            it = e.any_unexp.lower_bound(CA(comm, 0))
            while it != e.any_unexp.end() and deref(it).first.first == comm:
                u = deref(it).second
                if (peer < 0 or u.peer == peer) and (tag < 0 or <int64_t>u.aux == tag):
                    fpeer = u.peer
                    ftag = <int64_t>u.aux
                    total = u.total
                    dt = u.dtype
                    break
                inc(it)
            pthread_mutex_unlock(&e.mu)
        if fpeer < 0:
            return None
        return fpeer, ftag, total, dt

    def cancel(self, uint64_t oid, int code, str message):
        """Fail a still-running operation (used when a wait gives up)."""
        cdef State* e = self._live()
        cdef bytes b = message.encode()
        cdef const char* m = b
        with nogil:
            pthread_mutex_lock(&e.mu)
            it = e.ops.find(oid)
            if it != e.ops.end() and deref(it).second.state == ST_ACTIVE:
                fail_op(e, deref(it).second, code, m, 1)
                deref(it).second.hold = 0       # its own error: no verdict to wait for
            pthread_mutex_unlock(&e.mu)

    def release(self, uint64_t oid):
        """Forget a finished operation (its buffers are the user's again)."""
        cdef State* e = self._live()
        with nogil:
            forget_op(e, oid)

    # -- observation ---------------------------------------------------------------------------
    def note_event(self, str kind, int peer, int rail, str info, double seconds=0.0):
        """Record one of the control plane's events (NOTED_EVENTS: nic_down, nic_up, pair_down,
        pair_up, replanned) in this rank's event list, as the engine's own are."""
        cdef State* e = self._live()
        cdef int ev = NOTED_EVENTS[kind]
        cdef bytes text = info.encode("utf-8", "replace")[:1024]
        cdef const char* c = text
        with nogil:
            pthread_mutex_lock(&e.mu)
            add_event(e, ev, peer, rail, e.me, 0, seconds, c)
            pthread_mutex_unlock(&e.mu)

    def events_since(self, uint64_t start):
        """The events numbered `start` and after (numbers count every event ever recorded;
        each dict's "index"); the engine keeps the last 1,024 to 2,048 of them, so older ones
        may be gone."""
        cdef State* e = self._live()
        cdef list out = []
        cdef size_t i
        cdef bytes info
        with nogil:
            pthread_mutex_lock(&e.mu)
        try:
            for i in range(start - e.events_base if start > e.events_base else 0, e.events.size()):
                ev = e.events[i]
                info = e.event_info[i]
                out.append({"index": e.events_base + i,
                            "t": ev.t, "kind": EVENT_NAMES.get(ev.kind, str(ev.kind)),
                            "rank": e.me, "peer": ev.peer, "rail": ev.rail,
                            "detector": ev.detector, "nbytes": ev.nbytes, "dt": ev.dt,
                            "cause": CAUSE_NAMES.get(ev.cause),
                            "info": info.decode("utf-8", "replace")})
        finally:
            pthread_mutex_unlock(&e.mu)
        return out

    def rail_stats(self):
        """Per peer, per rail: (state, bytes_sent, bytes_recv, bytes_resent, inflight, weight,
        failures, measured bytes/s, bytes sent as hedge copies)."""
        cdef State* e = self._live()
        cdef dict out = {}
        cdef int i, k
        cdef PairRail* r
        with nogil:
            pthread_mutex_lock(&e.mu)
        try:
            for i in range(e.nranks):
                if e.peers[i] == NULL:
                    continue
                rows = []
                for k in range(e.peers[i].nrails):
                    r = e.peers[i].rails[k]
                    # (an idle rail, not connected yet, is connected on first use: usable)
                    rows.append(("up" if r.state == R_UP or (rail_idle(r) and not r.nic_off)
                                 else "down",
                                 r.bytes_sent, r.bytes_recv,
                                 r.bytes_resent, r.inflight_bytes, r.weight, r.fail_count, r.rate,
                                 r.bytes_hedged))
                out[i] = rows
        finally:
            pthread_mutex_unlock(&e.mu)
        return out

    cdef State* _live(self) except NULL:
        if self.e == NULL:
            raise RuntimeError("engine is closed")
        return self.e

    cdef void _wake(self):
        cdef uint64_t one = 1
        write(self.e.evfd, &one, 8)


cdef class EnginePart:
    """One of an Engine's cold-path faces (links, tuning, faults: the classes below). It holds a
    count of the engine's EngineRef, as a C-level user does, and not the Engine: no reference
    cycle, so an Engine still goes (and an unstarted one closes) when its last user lets go. Once
    the engine is closed its methods raise, as the Engine's do (C fields: engine.pxd)."""

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is made by an Engine (Engine.links, .tuning, "
                        ".faults)")

    cdef _bind(self, EngineRef* h):
        r2_atomic_add(&h.refs, 1)
        self.h = h

    def __dealloc__(self):
        if self.h != NULL:
            engine_unref(self.h)
            self.h = NULL

    cdef State* _live(self) except NULL:
        if self.h == NULL or self.h.e == NULL:
            raise RuntimeError("engine is closed")
        return self.h.e

    cdef void _wake(self):
        cdef uint64_t one = 1
        write(self.h.e.evfd, &one, 8)


include "engine_links.pxi"
include "engine_tuning.pxi"
include "engine_faults.pxi"
include "capi.pxi"
