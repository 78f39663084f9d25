# The verbs rail transport (transport.pxd's interface on an RC queue pair), included into
# verbs.pyx so that only this extension links libibverbs: the engine gets the table's address
# (transport_address()) and a connected VConn (VerbsConn.handover()) and calls through them.
#
# Design: a reliable byte stream over RC SEND/RECV with registered bounce slots, the shape of a
# kernel socket buffer. isend copies the gather list into free send slots (a prefix when the
# slots run out: stream semantics) and posts one signalled SEND per slot; the engine's memory is
# free when isend returns, so the post completes inside it like TCP's (the cookie goes into
# TDone at once) and the engine's one-DATA-frame-per-rail rule costs nothing: up to conn_cap
# slots are on the wire. A slot goes back when its send completion comes (RC completes in
# posting order). irecv copies out of completed receive slots in order (RC delivers in order and
# the connection's own receive CQ completes in that order, so the engine's frame parser is
# unchanged) and re-posts each drained slot. A receiver that falls behind makes the sender's HCA
# retry on receiver-not-ready (rnr_retry 7: forever), which is flow control, not an error.
#
# Pinned memory per device, not per connection (issue 31): every slot lives in one registered
# pool per device (VDev): nrecv receive slots posted to the device's shared receive queue (SRQ),
# which every QP of the device is created with, and nsend send slots on a free stack, of which
# one connection holds at most conn_cap (R2COMM_VERBS_RECV_SLOTS, _SEND_SLOTS, _CONN_SEND_SLOTS),
# so a rank pins (nrecv + nsend) x 64 KiB per device whatever the number of peers.
#   Receive slots: a SEND on any QP takes the next slot of the SRQ; its completion (on that
# connection's receive CQ, wr_id = the slot) appends the slot to the connection's ring of
# completed slots; irecv drains them in order and posts each back to the SRQ. Why one slow
# connection cannot starve the others for good: the engine reads every connection whenever it
# has data, whatever operation the data belongs to (unexpected messages go to the bounded
# unexpected store, and exceeding that fails the peer instead of waiting), so a completed slot
# goes back to the SRQ within one progress pass of its arrival; a SEND that finds the SRQ empty
# meanwhile is RNR-retried by the sender's HCA until a slot is posted again. Only a process that
# stops progressing holds its slots, and it stops receiving on every connection anyway. (The
# SRQ-limit event would tell the same thing late; re-posting at once needs no event. r_low
# counts how low the SRQ ran.)
#   Failed connections give their slots back: error (flush) completions on a connection's
# receive CQ re-post their slot, and closing a connection re-posts the slots it held completed
# and undrained (pool_stats: recv_posted + recv_held == recv_slots once quiet).
#   Send slots: a connection that finds the stack empty is a waiter; whoever frees a slot while
# waiters exist writes the device's wake eventfd (in every connection's epoll set), which stays
# readable only while there are both waiters and free slots, so a waiter with nothing of its
# own in flight (no completion of its own to wake it) is woken, and nobody spins.
#
# Failures, all turned into a failed connection at once (-errno from isend/irecv, so the engine
# fails the rail and re-sends its unacknowledged chunks elsewhere): an error completion
# (RETRY_EXC_ERR, flush, ...), an async QP_FATAL / QP_REQ_ERR / QP_ACCESS_ERR for this QP,
# IBV_EVENT_PORT_ERR on the device port, and EOF or an error on the companion socket.
#
# The companion socket is the rail's authenticated TCP connection, kept open on the same NIC
# after the QP exchange (os_fd, TPF_SIDE_SOCKET): the peer shutting a failed rail down closes it,
# so both ends learn of a failure at once; its TCP_INFO is what tells a stalled peer process
# (its kernel acknowledges the engine's probe byte) from a dead NIC or path (nothing comes
# back), exactly as on a TCP rail; and the engine's NIC checks read its interface. Probe bytes
# arriving on it are discarded here.
#
# event_fd is an epoll set of the completion channel (both CQs), the companion socket and the
# device's async-event fd, so one fd wakes the engine for received data, freed send slots
# (TPF_WAKE_OUT) and failures.
#
# Zero-copy sends from registered user memory (the registration cache). The Communicator
# registers the memory of large user buffers with every rail device (r2comm/transport/regcache.py: an
# entry lives exactly as long as the numpy array that owns the memory, so a freed and re-used
# address can never meet a stale registration). isend looks each large gather entry up in its
# device's table (VReg, under the device's mutex): an entry inside a registered region is
# posted as SENDs straight from the user's pages (<= VT_SLOT each, the receiver's slot size);
# anything else is copied into slots as before (the bounce path). Every SEND takes a place in
# the work-request ring (VT_NWR: slot or region), which is what keeps up to 4 MiB per
# connection on the wire: a zero-copy post completes for the engine as soon as all of it is
# posted, like a copied one, although its SENDs still read the user's pages. That is safe by
# the engine's own rule: a chunk's source region is written again (a dependent step, the
# operation's completion) only after the peer acknowledged the chunk, and a peer acknowledges
# only a frame that arrived whole, so the NIC has read it. That holds only while a chunk has one
# copy on the wire: the transport is TPF_LATE_READ, so the engine sends no hedge copy of a chunk
# over a verbs rail nor of a chunk on one (scheduler.pxi's hedge_tail), and re-sends a chunk
# only after its connection (and QP) is closed. Independently of the sender, the receiver reads
# any other copy of a chunk it already applied into nothing (rx.pxi's discard_other_copies),
# even one whose header it parsed first, so a late copy never writes the user's buffer.
# Measured on soft-RoCE: completing at the last SEND instead, one chunk per rail in flight,
# cost 13-20% of the throughput. A region's registration is kept while its SENDs are
# outstanding (inflight); an owner that goes away meanwhile only marks it dead, and it is
# deregistered at the last completion: the pages stay pinned until then, so no SEND ever reads
# memory that was handed back to the system.
from libc.errno cimport EAGAIN as _EAGAIN

cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union vt_epoll_data "epoll_data_t":
        uint64_t u64
    cdef struct vt_epoll_event "epoll_event":
        uint32_t events
        vt_epoll_data data
    int vt_epoll_create1 "epoll_create1"(int flags)
    int vt_epoll_ctl "epoll_ctl"(int epfd, int op, int fd, vt_epoll_event* ev)
    enum:
        VT_EPOLLIN "EPOLLIN"
        VT_EPOLL_CTL_ADD "EPOLL_CTL_ADD"
        VT_EPOLL_CLOEXEC "EPOLL_CLOEXEC"

cdef extern from "<sys/socket.h>" nogil:
    ssize_t vt_recv "recv"(int fd, void* buf, size_t n, int flags)
    int vt_sock_shutdown "shutdown"(int fd, int how)
    enum:
        VT_MSG_DONTWAIT "MSG_DONTWAIT"
        VT_SHUT_RDWR "SHUT_RDWR"

cdef extern from "<unistd.h>" nogil:
    int vt_fd_close "close"(int fd)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct vt_mutex_t "pthread_mutex_t":
        pass
    int vt_mutex_init "pthread_mutex_init"(vt_mutex_t*, void*)
    int vt_lock "pthread_mutex_lock"(vt_mutex_t*)
    int vt_unlock "pthread_mutex_unlock"(vt_mutex_t*)

cdef extern from "<sys/eventfd.h>" nogil:
    int vt_eventfd "eventfd"(unsigned int initval, int flags)
    enum:
        VT_EFD_NONBLOCK "EFD_NONBLOCK"
        VT_EFD_CLOEXEC "EFD_CLOEXEC"

cdef extern from "<unistd.h>" nogil:
    ssize_t vt_fd_read "read"(int fd, void* buf, size_t n)
    ssize_t vt_fd_write "write"(int fd, const void* buf, size_t n)

cdef enum:
    VT_SLOT = 65536          # bytes per send or receive slot (one SEND each)
    VT_NWR = 64              # send work requests outstanding per connection (slots + zero-copy)
    VT_ZC_MIN = 16384        # gather entries at least this long are looked up for zero-copy
    VT_RECV_SLOTS = 64       # defaults of a device's pool (R2COMM_VERBS_RECV_SLOTS, ...):
    VT_SEND_SLOTS = 32       #   receive slots in the SRQ, send slots,
    VT_CONN_SEND_SLOTS = 16  #   and the send slots one connection may hold (1 MiB on the wire)
    VT_ENETDOWN = 100
    VT_EIO = 5
    VT_ECONNRESET = 104

cdef struct VReg:
    char* base               # a registered user region (r2comm/transport/regcache.py)
    size_t len
    ibv_mr* mr
    int inflight             # zero-copy SENDs from it posted and not yet completed
    int dead                 # its owner let go: deregistered when inflight reaches 0
    VReg* next

cdef struct VDev:
    ibv_context* ctx
    ibv_pd* pd
    int port
    int port_down            # IBV_EVENT_PORT_ERR seen, no PORT_ACTIVE since
    uint32_t port_gen        # PORT_ERR events so far: a connection older than one fails
    vt_mutex_t mu            # guards regs and every VReg's inflight/dead
    VReg* regs               # live registrations (dead ones leave the list)
    int zcopy                # 0: every byte goes through the slots (R2COMM_VERBS_ZCOPY=0)
    uint64_t zc_bytes, zc_posts, copy_bytes, regs_made, regs_freed
    # the slot pool (mu guards the counters and the free stack)
    ibv_srq* srq
    ibv_mr* pool_mr
    char* pool               # nrecv receive slots, then nsend send slots
    int nrecv, nsend, conn_cap
    int r_posted, r_held     # receive slots in the SRQ / completed on a connection, not drained
    int r_low                # fewest receive slots the SRQ held after a completion
    uint64_t r_returned      # slots given back by error completions and closed connections
    int* s_free              # free send slots (a stack)
    int s_nfree, s_waiters   # how many free; connections that found none
    uint64_t s_waits         # times a connection found none (became a waiter)
    int wake_fd, wake_set    # eventfd: readable while there are waiters and free slots
    int nconns

cdef struct VConn:
    VDev* dev
    ibv_comp_channel* ch
    ibv_cq* scq
    ibv_cq* rcq
    ibv_qp* qp
    int counted              # counted in dev.nconns
    int epfd
    int side                 # companion socket (os_fd); -1 once closed
    int failed               # 0, or the -errno every later call returns
    int eof                  # the companion socket reached EOF (the peer closed the rail)
    uint32_t port_gen0
    unsigned s_unacked, r_unacked    # CQ events taken but not yet acknowledged
    int s_used               # send slots outstanding (at most dev.conn_cap)
    int waiting              # found the device's free send slots empty (a waiter)
    int w_head, w_used       # send work requests (slot or region), in posting order
    VReg* w_reg[VT_NWR]      # NULL: a slot's SEND; else the region a zero-copy SEND reads
    int w_slot[VT_NWR]       # the pool send slot of a slot's SEND
    int zc_out               # zero-copy SENDs outstanding
    int r_head, r_ready      # completed receive slots (a ring of dev.nrecv): oldest, how many
    uint32_t r_off           # bytes of the head slot already copied out
    int* r_slot              # the ring: pool receive slot, bytes received
    uint32_t* r_len
    int last_status          # the first error completion's status (for the reason)
    uint64_t posts, rposts
    TDone done

cdef inline char* vt_sslot(VDev* d, int i) noexcept nogil:
    return d.pool + <size_t>(d.nrecv + i) * VT_SLOT

cdef inline char* vt_rslot(VDev* d, int i) noexcept nogil:
    return d.pool + <size_t>i * VT_SLOT

cdef int vt_srq_post(VDev* d, int i) noexcept nogil:
    """Under d.mu: receive slot i back into the SRQ (0, or the post's error)."""
    cdef int rc = r2v_post_srq_recv(d.srq, <uint64_t>i, <uint64_t>vt_rslot(d, i), VT_SLOT,
                                    d.pool_mr.lkey)
    if rc == 0:
        d.r_posted += 1
    return rc

cdef int vt_recv_repost(VDev* d, int i, int returned) noexcept nogil:
    """A held receive slot (drained, or given back by a failed or closed connection) goes back
    into the SRQ."""
    cdef int rc
    vt_lock(&d.mu)
    d.r_held -= 1
    d.r_returned += returned
    rc = vt_srq_post(d, i)
    vt_unlock(&d.mu)
    return rc

cdef void vt_wake_clear(VDev* d) noexcept nogil:
    """Under d.mu: the wake eventfd no longer readable."""
    cdef uint64_t v
    if d.wake_set:
        vt_fd_read(d.wake_fd, &v, 8)
        d.wake_set = 0

cdef int vt_slot_take(VConn* c) noexcept nogil:
    """A free send slot of the device's pool for c, or -1 (then c is a waiter)."""
    cdef VDev* d = c.dev
    cdef int s = -1
    vt_lock(&d.mu)
    if d.s_nfree > 0:
        d.s_nfree -= 1
        s = d.s_free[d.s_nfree]
        if c.waiting:
            c.waiting = 0
            d.s_waiters -= 1
        if d.s_nfree == 0 or d.s_waiters == 0:
            vt_wake_clear(d)
    elif not c.waiting:
        c.waiting = 1
        d.s_waiters += 1
        d.s_waits += 1
    vt_unlock(&d.mu)
    return s

cdef void vt_slot_give(VDev* d, int s) noexcept nogil:
    """Send slot s is free again; waiters are woken."""
    cdef uint64_t one = 1
    vt_lock(&d.mu)
    d.s_free[d.s_nfree] = s
    d.s_nfree += 1
    if d.s_waiters > 0 and not d.wake_set:
        vt_fd_write(d.wake_fd, &one, 8)
        d.wake_set = 1
    vt_unlock(&d.mu)

cdef void vt_unwait(VConn* c) noexcept nogil:
    """c waits for free send slots no longer (its own completions wake it, or it is closing)."""
    cdef VDev* d = c.dev
    if not c.waiting:
        return
    vt_lock(&d.mu)
    c.waiting = 0
    d.s_waiters -= 1
    if d.s_waiters == 0:
        vt_wake_clear(d)
    vt_unlock(&d.mu)

cdef void vt_fail(VConn* c, int err) noexcept nogil:
    if c.failed == 0:
        c.failed = -err

cdef void vt_async(VConn* c) noexcept nogil:
    """Read the device's pending async events (any connection of the device may take them):
    port errors mark the device port down for every connection on it, QP errors fail the QP's
    own connection (its qp_context)."""
    cdef ibv_async_event ev
    cdef int typ, port
    cdef int64_t qpn
    cdef VConn* owner
    while ibv_get_async_event(c.dev.ctx, &ev) == 0:
        r2v_event_info(&ev, &typ, &qpn, &port)
        owner = <VConn*>r2v_event_qp_context(&ev)
        if typ == IBV_EVENT_PORT_ERR and port == c.dev.port:
            c.dev.port_down = 1
            c.dev.port_gen += 1
        elif typ == IBV_EVENT_PORT_ACTIVE and port == c.dev.port:
            c.dev.port_down = 0
        elif owner != NULL:
            vt_fail(owner, VT_EIO)
        # acknowledged only now: ibv_destroy_qp waits for its QP's events to be acknowledged,
        # so the owner cannot be freed while it is marked
        ibv_ack_async_event(&ev)
    if c.dev.port_gen != c.port_gen0:
        vt_fail(c, VT_ENETDOWN)

cdef void vreg_release(VDev* d, VReg* g) noexcept nogil:
    """One zero-copy SEND from g is over (completed, or its QP destroyed): a dead region whose
    last SEND this was is deregistered now."""
    cdef int gone
    vt_lock(&d.mu)
    g.inflight -= 1
    gone = g.dead and g.inflight == 0
    vt_unlock(&d.mu)
    if gone:
        ibv_dereg_mr(g.mr)
        free(g)

cdef void vreg_settle(VDev* d, VReg* g, int nz) noexcept nogil:
    """vreg_find counted one SEND from g; nz were posted: one inflight count per SEND (the
    engine thread polls completions only after isend returns, so they are settled in time)."""
    if nz == 0:
        vreg_release(d, g)
    elif nz > 1:
        vt_lock(&d.mu)
        g.inflight += nz - 1
        vt_unlock(&d.mu)

cdef void vt_wr_done(VConn* c) noexcept nogil:
    """The oldest outstanding send work request completed (RC: in posting order)."""
    cdef int w
    cdef VReg* g
    if c.w_used == 0:
        return
    w = c.w_head
    g = c.w_reg[w]
    if g == NULL:
        c.s_used -= 1
        vt_slot_give(c.dev, c.w_slot[w])
    else:
        c.w_reg[w] = NULL
        c.zc_out -= 1
        vreg_release(c.dev, g)
    c.w_head = (w + 1) % VT_NWR
    c.w_used -= 1

cdef VReg* vreg_find(VDev* d, const char* p, size_t n) noexcept nogil:
    """The live registration holding [p, p+n), its inflight count raised (NULL: none)."""
    cdef VReg* g
    vt_lock(&d.mu)
    g = d.regs
    while g != NULL:
        if p >= g.base and p + n <= g.base + g.len:
            g.inflight += 1
            break
        g = g.next
    vt_unlock(&d.mu)
    return g

cdef void vt_take_recvs(VConn* c) noexcept nogil:
    """Receive completions of c, in arrival order: each slot joins c's ring of completed slots;
    an error (flush) completion's slot goes straight back to the SRQ."""
    cdef VDev* d = c.dev
    cdef r2v_wc wc[32]
    cdef int n, i, k, ok
    cdef uint64_t slot
    while True:
        n = r2v_poll(c.rcq, wc, 32)
        if n < 0:
            vt_fail(c, VT_EIO)
            break
        ok = 0
        for i in range(n):
            slot = wc[i].wr_id
            if slot >= <uint64_t>d.nrecv:
                vt_fail(c, VT_EIO)          # not a slot of ours: never posted by this code
                continue
            if wc[i].status != IBV_WC_SUCCESS:
                if c.last_status == 0:
                    c.last_status = wc[i].status
                vt_fail(c, VT_EIO)
                vt_lock(&d.mu)
                d.r_posted -= 1
                d.r_returned += 1
                vt_srq_post(d, <int>slot)
                vt_unlock(&d.mu)
                continue
            k = (c.r_head + c.r_ready) % d.nrecv
            c.r_slot[k] = <int>slot
            c.r_len[k] = wc[i].byte_len
            c.r_ready += 1
            ok += 1
        if ok:
            vt_lock(&d.mu)
            d.r_posted -= ok
            d.r_held += ok
            if d.r_posted < d.r_low:
                d.r_low = d.r_posted
            vt_unlock(&d.mu)
        if n < 32:
            break

cdef void vt_service(VConn* c) noexcept nogil:
    """Take what the hardware finished: completion-channel events (the CQs re-armed),
    send completions (slots free again), receive completions (in order), async events and
    the companion socket."""
    cdef ibv_cq* cq
    cdef void* ctx
    cdef r2v_wc wc[32]
    cdef int n, i, rearm_s = 0, rearm_r = 0
    cdef char junk[64]
    cdef ssize_t k
    while ibv_get_cq_event(c.ch, &cq, &ctx) == 0:
        if cq == c.scq:
            c.s_unacked += 1
            rearm_s = 1
        else:
            c.r_unacked += 1
            rearm_r = 1
    if c.s_unacked >= 32:
        ibv_ack_cq_events(c.scq, c.s_unacked)
        c.s_unacked = 0
    if c.r_unacked >= 32:
        ibv_ack_cq_events(c.rcq, c.r_unacked)
        c.r_unacked = 0
    # re-arm before polling: a completion that lands after the poll still raises an event
    if rearm_s:
        ibv_req_notify_cq(c.scq, 0)
    if rearm_r:
        ibv_req_notify_cq(c.rcq, 0)
    while True:
        n = r2v_poll(c.scq, wc, 32)
        if n < 0:
            vt_fail(c, VT_EIO)
            break
        for i in range(n):
            if wc[i].status != IBV_WC_SUCCESS:
                if c.last_status == 0:
                    c.last_status = wc[i].status
                vt_fail(c, VT_EIO)
            vt_wr_done(c)
        if n < 32:
            break
    vt_take_recvs(c)
    vt_async(c)
    if c.side >= 0 and not c.eof:
        while True:
            k = vt_recv(c.side, junk, sizeof(junk), VT_MSG_DONTWAIT)
            if k > 0:
                continue                 # the peer's health-check probe bytes
            if k == 0:
                c.eof = 1
            elif errno != _EAGAIN and errno != 4:
                vt_fail(c, errno)
            break

cdef void* vt_adopt(intptr_t handle) noexcept nogil:
    return <void*>handle          # a VConn made and connected by VerbsConn (cold path)

cdef int vt_event_fd(void* conn) noexcept nogil:
    return (<VConn*>conn).epfd

cdef int vt_os_fd(void* conn) noexcept nogil:
    return (<VConn*>conn).side

cdef int vt_post_slot(VConn* c, int slot, uint32_t n) noexcept nogil:
    """Post one filled send slot (0, or the post's error: then the slot is free again)."""
    cdef ibv_sge sge
    cdef int w = (c.w_head + c.w_used) % VT_NWR
    cdef int rc
    sge.addr = <uint64_t>vt_sslot(c.dev, slot)
    sge.length = n
    sge.lkey = c.dev.pool_mr.lkey
    rc = r2v_post_send(c.qp, <uint64_t>w, &sge, 1, IBV_WR_SEND, 0, 0, 0, IBV_SEND_SIGNALED)
    if rc != 0:
        vt_slot_give(c.dev, slot)
        return rc
    c.w_reg[w] = NULL
    c.w_slot[w] = slot
    c.w_used += 1
    c.s_used += 1
    c.posts += 1
    return 0

cdef int64_t vt_isend(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    """Post the gather list as SENDs, a prefix of it when the slots or work requests run out
    (stream semantics). Large entries inside a registered region go zero-copy; the rest is
    copied into send slots, a slot posted when full, before a zero-copy entry, or at the end."""
    cdef VConn* c = <VConn*>conn
    cdef int64_t total = iov_total(iov, niov), accepted = 0
    cdef int i, w, rc
    cdef size_t off, take, fill = 0
    cdef char* dst = NULL
    cdef char* src
    cdef VReg* g
    cdef ibv_sge sge
    cdef int nz, slot = -1
    if c.failed:
        return c.failed
    if c.s_used == c.dev.conn_cap or c.w_used == VT_NWR:
        vt_service(c)
        if c.failed:
            return c.failed
    for i in range(niov):
        src = <char*>iov[i].iov_base
        off = 0
        g = NULL
        if c.dev.zcopy and cookie != 0 and iov[i].iov_len >= VT_ZC_MIN:
            g = vreg_find(c.dev, src, iov[i].iov_len)
        if g != NULL:
            if fill > 0:                         # what the slot holds goes first (order)
                rc = vt_post_slot(c, slot, <uint32_t>fill)
                if rc != 0:
                    vreg_release(c.dev, g)
                    vt_fail(c, rc)
                    return accepted if accepted > 0 else c.failed
                accepted += fill
                fill = 0
                dst = NULL
            nz = 0                               # zero-copy SENDs posted from g for this entry
            while off < iov[i].iov_len and c.w_used < VT_NWR:
                take = iov[i].iov_len - off
                if take > VT_SLOT:
                    take = VT_SLOT
                w = (c.w_head + c.w_used) % VT_NWR
                sge.addr = <uint64_t>(src + off)
                sge.length = <uint32_t>take
                sge.lkey = g.mr.lkey
                rc = r2v_post_send(c.qp, <uint64_t>w, &sge, 1, IBV_WR_SEND, 0, 0, 0,
                                   IBV_SEND_SIGNALED)
                if rc != 0:
                    vreg_settle(c.dev, g, nz)
                    vt_fail(c, rc)
                    return accepted if accepted > 0 else c.failed
                nz += 1
                c.w_reg[w] = g
                c.w_used += 1
                c.zc_out += 1
                c.posts += 1
                c.dev.zc_posts += 1
                c.dev.zc_bytes += take
                off += take
                accepted += take
            vreg_settle(c.dev, g, nz)
            if off < iov[i].iov_len:
                return accepted                  # the rest when completions free requests
            continue
        while off < iov[i].iov_len:
            if dst == NULL or fill == VT_SLOT:
                if fill > 0:
                    rc = vt_post_slot(c, slot, <uint32_t>fill)
                    if rc != 0:
                        vt_fail(c, rc)
                        return accepted if accepted > 0 else c.failed
                    accepted += fill
                    fill = 0
                    dst = NULL
                if c.s_used == c.dev.conn_cap or c.w_used == VT_NWR:
                    vt_unwait(c)                 # its own completions wake it
                    return accepted
                slot = vt_slot_take(c)
                if slot < 0:
                    vt_service(c)                # its own finished SENDs may free some
                    slot = vt_slot_take(c)
                if slot < 0:
                    return accepted              # the device's wake fd tells when one is free
                dst = vt_sslot(c.dev, slot)
            take = iov[i].iov_len - off
            if take > VT_SLOT - fill:
                take = VT_SLOT - fill
            memcpy(dst + fill, src + off, take)
            fill += take
            off += take
            if cookie != 0:
                c.dev.copy_bytes += take
    if fill > 0:
        rc = vt_post_slot(c, slot, <uint32_t>fill)
        if rc != 0:
            vt_fail(c, rc)
            return accepted if accepted > 0 else c.failed
        accepted += fill
    if cookie != 0 and accepted == total:
        # done for the engine, also when SENDs still read user pages (see the header: the
        # engine re-uses a chunk's region only after the peer acknowledged the chunk)
        tdone_push(&c.done, cookie)
    return accepted

cdef int vt_test(void* conn, uint64_t* out, int max) noexcept nogil:
    return tdone_take(&(<VConn*>conn).done, out, max)

cdef int64_t vt_irecv(void* conn, void* buf, size_t n) noexcept nogil:
    cdef VConn* c = <VConn*>conn
    cdef size_t got = 0, take
    cdef uint32_t left
    cdef int rc
    vt_service(c)
    while got < n and c.r_ready > 0:
        left = c.r_len[c.r_head] - c.r_off
        take = n - got if n - got < left else left
        memcpy(<char*>buf + got, vt_rslot(c.dev, c.r_slot[c.r_head]) + c.r_off, take)
        got += take
        c.r_off += <uint32_t>take
        if c.r_off == c.r_len[c.r_head]:
            c.r_off = 0
            c.rposts += 1
            rc = vt_recv_repost(c.dev, c.r_slot[c.r_head], 0)
            if rc != 0:
                vt_fail(c, rc)
            c.r_head = (c.r_head + 1) % c.dev.nrecv
            c.r_ready -= 1
    if got > 0:
        return <int64_t>got     # what arrived before a failure is still in order and whole
    if c.failed:
        return c.failed
    if c.eof:
        return T_EOF
    return 0

cdef void vt_shutdown(void* conn) noexcept nogil:
    cdef VConn* c = <VConn*>conn
    r2v_qp_to_error(c.qp)            # outstanding work flushes; nothing more leaves
    if c.side >= 0:
        vt_sock_shutdown(c.side, VT_SHUT_RDWR)   # the peer sees its companion socket close
    vt_fail(c, VT_ECONNRESET)
    vt_unwait(c)

cdef void vconn_free(VConn* c) noexcept nogil:
    cdef int k, w
    if c == NULL:
        return
    vt_unwait(c)
    if c.qp != NULL:
        # receive slots it took come back: its completions (flushed ones re-posted at once),
        # then what it held undrained
        r2v_qp_to_error(c.qp)
        if c.rcq != NULL and c.r_slot != NULL:
            vt_take_recvs(c)
        ibv_destroy_qp(c.qp)
        if c.rcq != NULL and c.r_slot != NULL:
            vt_take_recvs(c)
    if c.r_slot != NULL:
        while c.r_ready > 0:
            vt_recv_repost(c.dev, c.r_slot[c.r_head], 1)
            c.r_head = (c.r_head + 1) % c.dev.nrecv
            c.r_ready -= 1
    # the QP is gone, so nothing reads the slots and regions of SENDs that never completed
    for k in range(c.w_used):
        w = (c.w_head + k) % VT_NWR
        if c.w_reg[w] != NULL:
            vreg_release(c.dev, c.w_reg[w])
            c.w_reg[w] = NULL
        else:
            vt_slot_give(c.dev, c.w_slot[w])
    c.w_used = 0
    c.s_used = 0
    if c.scq != NULL:
        if c.s_unacked:
            ibv_ack_cq_events(c.scq, c.s_unacked)
        ibv_destroy_cq(c.scq)
    if c.rcq != NULL:
        if c.r_unacked:
            ibv_ack_cq_events(c.rcq, c.r_unacked)
        ibv_destroy_cq(c.rcq)
    if c.ch != NULL:
        ibv_destroy_comp_channel(c.ch)
    free(c.r_slot)
    free(c.r_len)
    if c.counted:
        vt_lock(&c.dev.mu)
        c.dev.nconns -= 1
        vt_unlock(&c.dev.mu)
    if c.epfd >= 0:
        vt_fd_close(c.epfd)
    if c.side >= 0:
        vt_fd_close(c.side)
    free(c)

cdef void vt_close(void* conn) noexcept nogil:
    vconn_free(<VConn*>conn)

cdef Transport VERBS_TP
VERBS_TP.name = "verbs"
VERBS_TP.flags = TPF_SIDE_SOCKET | TPF_WAKE_OUT | TPF_LATE_READ
VERBS_TP.adopt = vt_adopt
VERBS_TP.event_fd = vt_event_fd
VERBS_TP.isend = vt_isend
VERBS_TP.test = vt_test
VERBS_TP.irecv = vt_irecv
VERBS_TP.reg_mr = tp_reg_none
VERBS_TP.dereg_mr = tp_dereg_none
VERBS_TP.os_fd = vt_os_fd
VERBS_TP.shutdown = vt_shutdown
VERBS_TP.close = vt_close


def transport_address():
    """The address of the verbs transport's table, for Engine.links.attach_transport."""
    return <uint64_t><intptr_t>&VERBS_TP


def discard(uint64_t handle):
    """Free a connection that VerbsConn.handover() gave out and no engine adopted (its QP,
    slots, registration and companion socket); never for one an engine took."""
    if handle != 0:
        vconn_free(<VConn*><intptr_t>handle)


def transport_slots():
    """(slot bytes, default receive slots, send slots, send slots one connection may hold) of a
    device's pool."""
    return VT_SLOT, VT_RECV_SLOTS, VT_SEND_SLOTS, VT_CONN_SEND_SLOTS


cdef class RailDevice:
    """One RDMA device port opened for this process's rails (kept for the process's life:
    connections made on it hold its protection domain)."""
    cdef VDev* dev
    cdef readonly Context context
    cdef readonly PD pd
    cdef readonly int gid_index
    cdef readonly str address

    def __init__(self, Context context not None, int gid_index, str address,
                 int recv_slots=VT_RECV_SLOTS, int send_slots=VT_SEND_SLOTS,
                 int conn_send_slots=VT_CONN_SEND_SLOTS):
        cdef VDev* d
        if recv_slots < 2 or send_slots < 1 or not 1 <= conn_send_slots <= send_slots:
            raise ValueError(f"verbs slot pool: recv_slots {recv_slots} (>= 2), send_slots "
                             f"{send_slots} (>= 1), conn_send_slots {conn_send_slots} (1 to "
                             f"send_slots)")
        self.context = context
        self.pd = PD(context)
        self.gid_index = gid_index
        self.address = address
        self.dev = <VDev*>calloc(1, sizeof(VDev))
        if self.dev == NULL:
            raise MemoryError()
        d = self.dev
        d.ctx = context.ctx
        d.pd = self.pd.pd
        d.port = context.port
        d.zcopy = 1
        d.wake_fd = -1
        vt_mutex_init(&d.mu, NULL)
        d.nrecv, d.nsend, d.conn_cap = recv_slots, send_slots, conn_send_slots
        self._make_pool()

    def _make_pool(self):
        """The device's slot pool: one registration, the SRQ with every receive slot posted, the
        free send slots and the wake eventfd (the device is never freed: see below)."""
        cdef VDev* d = self.dev
        cdef size_t nbytes = <size_t>(d.nrecv + d.nsend) * VT_SLOT
        cdef ibv_srq_init_attr sa
        cdef int i, rc
        d.pool = <char*>malloc(nbytes)
        d.s_free = <int*>malloc(d.nsend * sizeof(int))
        if d.pool == NULL or d.s_free == NULL:
            raise MemoryError()
        with nogil:
            d.pool_mr = ibv_reg_mr(d.pd, d.pool, nbytes, IBV_ACCESS_LOCAL_WRITE)
        if d.pool_mr == NULL:
            raise _err(f"ibv_reg_mr of the {nbytes >> 20} MiB slot pool", errno)
        memset(&sa, 0, sizeof(sa))
        sa.attr.max_wr = d.nrecv
        sa.attr.max_sge = 1
        d.srq = ibv_create_srq(d.pd, &sa)
        if d.srq == NULL:
            raise _err(f"ibv_create_srq({d.nrecv}) on {self.describe()}", errno)
        for i in range(d.nsend):
            d.s_free[i] = d.nsend - 1 - i
        d.s_nfree = d.nsend
        d.wake_fd = vt_eventfd(0, VT_EFD_NONBLOCK | VT_EFD_CLOEXEC)
        if d.wake_fd < 0:
            raise _err("eventfd", errno)
        vt_lock(&d.mu)
        for i in range(d.nrecv):
            rc = vt_srq_post(d, i)
            if rc:
                vt_unlock(&d.mu)
                raise _err("ibv_post_srq_recv", rc)
        d.r_low = d.r_posted
        vt_unlock(&d.mu)

    def pool_stats(self):
        """The device's slot pool: its size, pinned bytes, and where every slot is (receive:
        posted in the SRQ or held by a connection; send: free or out), the fewest receive slots
        the SRQ held, slots given back by failed or closed connections, waiters now and so
        far, connections."""
        cdef VDev* d = self.dev
        cdef int nrecv, nsend, cap, posted, held, low, sfree, waiters, conns
        cdef uint64_t returned, waits
        with nogil:
            vt_lock(&d.mu)
            nrecv, nsend, cap, posted, held = d.nrecv, d.nsend, d.conn_cap, d.r_posted, d.r_held
            low, returned, sfree, waiters, conns = (d.r_low, d.r_returned, d.s_nfree,
                                                    d.s_waiters, d.nconns)
            waits = d.s_waits
            vt_unlock(&d.mu)
        return {"slot_bytes": VT_SLOT, "recv_slots": nrecv, "send_slots": nsend,
                "conn_send_slots": cap, "pinned_bytes": (nrecv + nsend) * VT_SLOT,
                "recv_posted": posted, "recv_held": held, "recv_low": low,
                "recv_returned": returned, "send_free": sfree, "send_waiters": waiters, "send_waits": waits,
                "conns": conns}

    def register(self, uint64_t addr, size_t length):
        """Register [addr, addr+length) of user memory for zero-copy sends on this device's
        connections; returns the handle for unregister(). The caller guarantees the memory
        outlives the registration (r2comm/transport/regcache.py ties it to the owning array)."""
        cdef VReg* g = <VReg*>calloc(1, sizeof(VReg))
        cdef ibv_mr* mr
        if g == NULL:
            raise MemoryError()
        with nogil:
            mr = ibv_reg_mr(self.dev.pd, <void*>addr, length, 0)   # local read: sends only
        if mr == NULL:
            free(g)
            raise _err(f"ibv_reg_mr of {length} bytes at {addr:#x}", errno)
        g.base = <char*>addr
        g.len = length
        g.mr = mr
        with nogil:
            vt_lock(&self.dev.mu)
            g.next = self.dev.regs
            self.dev.regs = g
            self.dev.regs_made += 1
            vt_unlock(&self.dev.mu)
        return <uint64_t><intptr_t>g

    def unregister(self, uint64_t handle):
        """Forget a registration: no later send uses it; deregistered now, or at the completion
        of the last zero-copy SEND still reading it."""
        cdef VReg* g = <VReg*><intptr_t>handle
        cdef VReg** pp
        cdef int now_free = 0
        with nogil:
            vt_lock(&self.dev.mu)
            pp = &self.dev.regs
            while pp[0] != NULL and pp[0] != g:
                pp = &pp[0].next
            if pp[0] == g:
                pp[0] = g.next
                g.dead = 1
                now_free = g.inflight == 0
                self.dev.regs_freed += 1
            vt_unlock(&self.dev.mu)
            if now_free:
                ibv_dereg_mr(g.mr)
                free(g)

    property zcopy:
        """Whether large registered gather entries are sent zero-copy (else all via slots)."""
        def __get__(self):
            return bool(self.dev.zcopy)
        def __set__(self, value):
            self.dev.zcopy = 1 if value else 0

    def zcopy_stats(self):
        """Payload bytes sent zero-copy and through the slots, zero-copy SENDs, registrations
        made and dropped, and live ones (with zero-copy SENDs still outstanding on them)."""
        cdef VReg* g
        cdef int live = 0, busy = 0
        with nogil:
            vt_lock(&self.dev.mu)
            g = self.dev.regs
            while g != NULL:
                live += 1
                busy += g.inflight > 0
                g = g.next
            vt_unlock(&self.dev.mu)
        return {"zcopy_bytes": self.dev.zc_bytes, "copy_bytes": self.dev.copy_bytes,
                "zcopy_sends": self.dev.zc_posts, "registered": self.dev.regs_made,
                "deregistered": self.dev.regs_freed, "live": live, "busy": busy}

    @property
    def port_down(self):
        return bool(self.dev.port_down)

    def describe(self):
        return f"{self.context.name}:{self.context.port}"

    # (never freed: connections handed to an engine point at it until they are closed)


cdef class VerbsConn:
    """The cold path of one verbs rail connection: QP, CQs, channel and registered slots made
    on a RailDevice, receives posted, address() for the peer, connect(peer address) to RTS,
    then handover() gives the connected VConn (with the companion socket `side`, which it
    owns from then on) to an engine. Freed here if never handed over."""
    cdef VConn* c
    cdef readonly RailDevice device
    cdef uint32_t psn
    cdef int _timeout, _retry

    def __cinit__(self):
        self.c = NULL

    def __init__(self, RailDevice device not None, int side_fd, int timeout=DEFAULT_QP_TIMEOUT,
                 int retry_cnt=DEFAULT_RETRY_CNT):
        cdef VConn* c
        cdef ibv_qp_init_attr ia
        cdef vt_epoll_event ev
        cdef int i, rc, flags
        self.device = device
        c = <VConn*>calloc(1, sizeof(VConn))
        if c == NULL:
            vt_fd_close(side_fd)
            raise MemoryError()
        self.c = c
        c.dev = device.dev
        c.epfd = -1
        c.side = side_fd           # owned from here on, also if this raises
        c.port_gen0 = device.dev.port_gen
        vt_lock(&c.dev.mu)
        c.dev.nconns += 1
        c.counted = 1
        vt_unlock(&c.dev.mu)
        c.r_slot = <int*>malloc(c.dev.nrecv * sizeof(int))
        c.r_len = <uint32_t*>malloc(c.dev.nrecv * sizeof(uint32_t))
        if c.r_slot == NULL or c.r_len == NULL:
            raise MemoryError()
        c.ch = ibv_create_comp_channel(c.dev.ctx)
        if c.ch == NULL:
            raise _err("ibv_create_comp_channel", errno)
        flags = fcntl(c.ch.fd, F_GETFL)
        fcntl(c.ch.fd, F_SETFL, flags | O_NONBLOCK)
        c.scq = ibv_create_cq(c.dev.ctx, VT_NWR * 2, NULL, c.ch, 0)
        c.rcq = ibv_create_cq(c.dev.ctx, c.dev.nrecv + 8, NULL, c.ch, 0)   # a QP takes <= nrecv
        if c.scq == NULL or c.rcq == NULL:
            raise _err("ibv_create_cq", errno)
        memset(&ia, 0, sizeof(ia))
        ia.qp_context = <void*>c
        ia.send_cq = c.scq
        ia.recv_cq = c.rcq
        ia.srq = c.dev.srq                     # receives come from the device's pool
        ia.cap.max_send_wr = VT_NWR
        ia.cap.max_send_sge = 1
        r2v_set_rc(&ia)
        with nogil:
            c.qp = ibv_create_qp(c.dev.pd, &ia)
        if c.qp == NULL:
            raise _err("ibv_create_qp", errno)
        rc = r2v_qp_to_init(c.qp, c.dev.port, IBV_ACCESS_LOCAL_WRITE)
        if rc:
            raise _err("QP to INIT", rc)
        if ibv_req_notify_cq(c.scq, 0) or ibv_req_notify_cq(c.rcq, 0):
            raise VerbsError("ibv_req_notify_cq failed")
        self.psn = int.from_bytes(os.urandom(3), "little")
        self._timeout, self._retry = timeout, retry_cnt
        c.epfd = vt_epoll_create1(VT_EPOLL_CLOEXEC)
        if c.epfd < 0:
            raise _err("epoll_create1", errno)
        for i in (c.ch.fd, side_fd, c.dev.ctx.async_fd, c.dev.wake_fd):
            ev.events = VT_EPOLLIN
            ev.data.u64 = 0
            if vt_epoll_ctl(c.epfd, VT_EPOLL_CTL_ADD, i, &ev) != 0:
                raise _err("epoll_ctl", errno)

    def __dealloc__(self):
        vconn_free(self.c)
        self.c = NULL

    def address(self):
        """This end's QpAddress bytes."""
        ctx = self.device.context
        port = ctx.query_port()
        g = ctx.gid(self.device.gid_index)
        if g is None:
            raise VerbsError(f"{ctx.name}: no GID at index {self.device.gid_index}")
        return QpAddress(self.c.qp.qp_num, self.psn, g[0], port["lid"], ctx.port,
                         self.device.gid_index, port["mtu_enum"] or 5).encode()

    def connect(self, peer):
        """RTR then RTS towards the peer's address bytes."""
        cdef int rc, mtu
        cdef uint8_t dgid[16]
        addr = QpAddress.decode(peer)
        ctx = self.device.context
        mtu = min(addr.mtu, ctx.query_port()["mtu_enum"] or 5)
        memcpy(dgid, <const char*>addr.gid, 16)
        rc = r2v_qp_to_rtr(self.c.qp, self.c.dev.port, mtu, addr.qpn, addr.psn, dgid,
                           self.device.gid_index, addr.lid, 12)
        if rc:
            raise _err(f"QP to RTR (peer {addr})", rc)
        rc = r2v_qp_to_rts(self.c.qp, self.psn, self._timeout, self._retry, DEFAULT_RNR_RETRY)
        if rc:
            raise _err("QP to RTS", rc)

    def handover(self):
        """The connected VConn's address for Engine.links.attach_transport; this object lets go."""
        cdef VConn* c = self.c
        if c == NULL:
            raise VerbsError("connection already handed over")
        self.c = NULL
        return <uint64_t><intptr_t>c

    def side_fd(self):
        return self.c.side if self.c != NULL else -1
