# The progress loop: one epoll wait over every rail and control connection, its events handled
# under the engine's mutex (progress_once), run by the progress thread (progress_loop) or by a
# thread that waits for an operation; set_out asks epoll for writability after a short write.

cdef void set_out(State* e, PairRail* r, int want) noexcept nogil:
    cdef epoll_event ev
    if r.fd < 0 or r.want_out == want:
        return
    r.want_out = want
    if r.tp.flags & TPF_POLLED:
        return      # retried every round (poll_rails); a full ring wakes it through arm/event_fd
    ev.events = EPOLLIN | (EPOLLOUT if want else 0)
    ev.data.u64 = (<uint64_t>r.gen << 32) | (<uint64_t>r.peer << 8) | <uint64_t>r.index
    epoll_ctl(e.epfd, EPOLL_CTL_MOD, r.fd, &ev)

cdef int poll_rails(State* e) noexcept nogil:
    """Under the mutex: one round over the rails of TPF_POLLED transports (shared memory): take
    in what arrived and write what waits for room. No system call unless a doorbell is due.
    Returns how many of them moved bytes."""
    cdef size_t i
    cdef PairRail* r
    cdef uint64_t rb, sb
    cdef int act = 0
    for i in range(e.polled.size()):
        r = e.polled[i]
        if r.state != R_UP:
            continue
        rb = r.bytes_recv
        sb = r.bytes_sent
        rail_read(e, r)
        if r.state == R_UP and (r.want_out or r.txq.size() > r.txq_pos):
            rail_write(e, r)
        if r.bytes_recv != rb or r.bytes_sent != sb:
            act += 1
    return act

cdef int arm_polled(State* e) noexcept nogil:
    """Under the mutex, before blocking in epoll: every polled rail asks its peer for a
    doorbell. Returns 1 if one has bytes or room already (then do not block)."""
    cdef size_t i
    cdef PairRail* r
    for i in range(e.polled.size()):
        r = e.polled[i]
        if r.state == R_UP and r.tp.arm(r.conn) != 0:
            return 1
    return 0

cdef int progress_once(State* e, int tmo) noexcept nogil:
    """Wait up to tmo ms for socket events, then handle them under the mutex. Run by the
    progress thread in a loop and by any thread that waits for an operation, so a message
    completes in the thread that needs it without a hand-off. Returns the number of events,
    or -1 once the engine is stopping."""
    cdef epoll_event evs[64]
    cdef int n, i, pi, ri
    cdef uint64_t tag, drain
    cdef PairRail* r
    cdef Peer* p
    cdef double now
    cdef int act = 0
    if tmo != 0 and e.npolled > 0:
        pthread_mutex_lock(&e.mu)
        if arm_polled(e):
            tmo = 0
        pthread_mutex_unlock(&e.mu)
    if tmo == 0 and e.npolled > 0:
        # busy-polling with shared-memory links: their bytes need no system call, so epoll
        # (sockets: control connections, remote rails, a dead local peer's EOF) is asked only
        # every POLL_EPOLL_EVERY rounds
        e.poll_turn += 1
        if e.poll_turn >= POLL_EPOLL_EVERY:
            e.poll_turn = 0
            n = epoll_wait(e.epfd, evs, 64, 0)
        else:
            n = 0
    else:
        n = epoll_wait(e.epfd, evs, 64, tmo)
    if n < 0:
        n = 0        # EINTR (a signal, e.g. SIGCONT after a stop): no events; -1 means stopped
    pthread_mutex_lock(&e.mu)
    if e.stop:
        pthread_mutex_unlock(&e.mu)
        return -1
    for i in range(n):
        tag = evs[i].data.u64
        if tag == EVFD_TAG:
            read(e.evfd, &drain, 8)
            continue
        pi = <int>((tag >> 8) & 0xFFFFFF)
        ri = <int>(tag & 0xFF)
        if pi >= e.nranks or e.peers[pi] == NULL or ri > e.peers[pi].nrails:
            continue
        r = e.peers[pi].rails[ri]
        if r.state != R_UP or r.gen != <uint32_t>(tag >> 32):
            continue
        if evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP):
            if r.tp.flags & TPF_POLLED:
                r.tp.wake(r.conn)       # the doorbell (or the peer's end closing)
            if r.tx_posted:
                rail_reap(e, r)         # a completion-channel transport signals them here
            rail_read(e, r)
        if r.state == R_UP and (evs[i].events & EPOLLOUT or r.txq.size() > r.txq_pos or
                                (r.want_out and r.tp.flags & TPF_WAKE_OUT)):
            rail_write(e, r)
    if e.npolled > 0:
        act = poll_rails(e)
    for pi in range(e.nranks):
        p = e.peers[pi]
        if p != NULL and (not p.ready.empty() or n > 0 or act > 0):
            pump_peer(e, p)
    now = mono()
    if e.dack_rails > 0:
        lazy_ack_timer(e, now)
    if now - e.last_timer > 0.001:
        if e.last_timer > 0 and now - e.last_timer > SELF_PAUSE_S:
            self_paused(e, now - e.last_timer, now)   # deadlines judge running time only
        e.last_timer = now
        check_timers(e)
    if e.signal:
        e.signal = 0
        pthread_cond_broadcast(&e.cv)
    pthread_mutex_unlock(&e.mu)
    return n + act

cdef void progress_loop(State* e) noexcept nogil:
    """Background progress (acks, retransmissions, deadlines) while nobody waits. When a
    thread waits for an operation it drives the sockets itself and this thread stands aside,
    so the two never race for the same wake-up."""
    cdef int tmo
    cdef timespec ts
    cdef double t
    while True:
        pthread_mutex_lock(&e.mu)
        if e.stop:
            pthread_mutex_unlock(&e.mu)
            break
        if e.waiters > 0:
            t = mono() + 0.005
            ts.tv_sec = <long>t
            ts.tv_nsec = <long>((t - ts.tv_sec) * 1e9)
            pthread_cond_timedwait(&e.pcv, &e.mu, &ts)
            pthread_mutex_unlock(&e.mu)
            continue
        tmo = 2 if (not e.ops.empty() or not e.notices.empty() or not e.smap.empty()) else 20
        if e.dack_rails > 0:
            tmo = 1
        pthread_mutex_unlock(&e.mu)
        if progress_once(e, tmo) < 0:
            break
