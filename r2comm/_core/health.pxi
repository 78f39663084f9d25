# Judging rails and the engine's timers: a rail whose acks are late is judged from its TCP
# connection's kernel view (judge_rail) before it fails, telling a stalled peer process from a
# dead NIC or path; check_timers also repeats unacknowledged rail-down notices, loses peers with
# no rail left and fails operations past their deadline. Deadlines count this process's running
# time: a gap between timer checks (its own pause) moves them on (self_paused), and a rail that
# trails its peer's other rails just after the peer resumed gets a fresh deadline (note_resume).

cdef double NIC_CHECK_AFTER = 0.02   # s without an ack before a busy rail's own NIC is looked at
cdef double NIC_CHECK_EVERY = 0.01   # s between looks at one quiet rail's NIC
cdef double NIC_IDLE_EVERY = 0.1     # s between looks at every rail's local NIC, busy or not

cdef double FAST_PROBE_S = 1.0         # s after a rail failure with fail-back probes back to back
cdef double FAST_PROBE_GAP = 0.02      # s between those probes
cdef double FAST_PROBE_TIMEOUT = 0.06  # s each of them may take to connect (a SYN into a dead
                                       # link is lost: a new attempt beats waiting for it)

cdef double SELF_PAUSE_S = 0.05     # s between two timer checks (normally <= 20 ms) that mean
                                   # this process did not run: stopped, or starved of CPU
cdef double RESUME_GAP_ROUNDS = 0.5  # a peer silent on every rail this many rounds, then
                                     # acknowledging again, has resumed (fresh rail deadlines)

cdef inline int fast_probing(State* e, PairRail* r, double now) noexcept nogil:
    """The rail failed under FAST_PROBE_S ago and not as a flap (its back-off is the first)."""
    return r.state == R_DOWN and r.fail_time > 0 and now - r.fail_time < FAST_PROBE_S and \
        r.backoff <= e.probe_base

cdef inline int rail_idle(PairRail* r) noexcept nogil:
    """Never connected and never failed: a connection made on first use that no schedule
    needed yet (issue 31, r2comm/control/links.py); not judged, not probed, counted usable."""
    return r.state != R_UP and r.gen == 0 and r.fail_count == 0

cdef inline int peer_idle(Peer* p) noexcept nogil:
    """Every data rail to the peer is idle (rail_idle): no rail can be lost to it yet."""
    cdef int k
    for k in range(p.nrails):
        if not rail_idle(p.rails[k]):
            return 0
    return 1

cdef inline double hc_round(State* e) noexcept nogil:
    """A health-check round: long enough for the peer's kernel to acknowledge a segment
    (delayed acks wait 40 ms, at most 200 ms), at most half the rail deadline; 250 ms for
    deadlines up to a second, a quarter of a longer one (a deadline raised for slow hosts,
    such as emulated guests whose kernels answer late, gets rounds to match)."""
    cdef double v = 0.5 * e.rail_timeout
    cdef double cap = 0.25 if e.rail_timeout <= 1.0 else 0.25 * e.rail_timeout
    return cap if v > cap else v

cdef inline int rail_late(State* e, PairRail* r, double now, double rnd) noexcept nogil:
    """The rail has chunks out and its acks are near (within a round) or past its deadline."""
    return not e.noack and (not r.inflight.empty() or r.ghosts > 0) and \
        now - r.last_progress > e.rail_timeout - rnd

cdef void self_paused(State* e, double lost, double now) noexcept nogil:
    """This process did not run for `lost` s (SIGSTOP, a debugger, a VM or CPU starvation): no
    timer was checked and no socket read meanwhile, so that time counts against no peer. Every
    deadline moves on by it instead of firing at the resume: each rail's quiet time and send
    completion timer (a health-check round that spanned the pause is void), each peer's
    all-rails-down timer, each operation's timeout."""
    cdef int i
    cdef size_t k
    cdef Peer* p
    cdef PairRail* r
    cdef Op* op
    e.self_paused += lost
    for i in range(e.nranks):
        p = e.peers[i]
        if p == NULL:
            continue
        for k in range(p.rails.size()):
            r = p.rails[k]
            if r == NULL:
                continue
            if r.last_progress > 0:
                r.last_progress = min_d(now, r.last_progress + lost)
            if r.tx_post_t > 0:
                r.tx_post_t = min_d(now, r.tx_post_t + lost)
            r.hc_t = 0
        if p.all_down_since > 0:
            p.all_down_since = min_d(now, p.all_down_since + lost)
    it = e.ops.begin()
    while it != e.ops.end():
        op = deref(it).second
        if op.state == ST_ACTIVE:
            op.deadline += lost
        if op.hold:
            op.hold_until += lost
        inc(it)

cdef void note_resume(State* e, Peer* p, double rnd) noexcept nogil:
    """Track the peer's latest acknowledgement on any rail; one that ends a silence on every
    rail of over RESUME_GAP_ROUNDS rounds marks a resume (its process was stopped, or this one
    was): p.resume_t."""
    cdef int k
    cdef double latest = 0
    for k in range(p.nrails):
        if p.rails[k].last_ack > latest:
            latest = p.rails[k].last_ack
    if latest > p.ack_seen:
        if latest - p.ack_seen > RESUME_GAP_ROUNDS * rnd:
            p.resume_t = latest
        p.ack_seen = latest

cdef void hc_begin(State* e, PairRail* r, r2_tcpsnap* s, double now) noexcept nogil:
    """Start a round: remember what the peer's kernel has acknowledged so far, and if the
    connection has nothing outstanding for it to acknowledge, give it something: a frame the
    peer ignores (a rail-down ack that names no notice; no wire change), which its kernel
    acknowledges even while its process is stopped. Not on a rail whose window is shut."""
    cdef char poke = 0
    r.hc_t = now
    r.hc_acked = s.bytes_acked
    if r.tp.flags & TPF_SIDE_SOCKET:
        # the frames go elsewhere (verbs): a byte on the rail's companion socket, which the
        # peer's transport discards, is what its kernel acknowledges
        if s.ok and s.unacked == 0 and s.notsent == 0 and not r.blackhole:
            sock_send(r.tp.os_fd(r.conn), &poke, 1, MSG_NOSIGNAL | MSG_DONTWAIT)
        return
    if s.ok and s.unacked == 0 and s.notsent == 0 and not r.tx_busy and \
            r.txq.size() == r.txq_pos and not r.blackhole:
        queue_ctrl(e, r, F_RAIL_DOWN_ACK, 0, 0, 0, 0, 0, 0xFFFFFFFF, NULL, 0)
        rail_write(e, r)

cdef int judge_rail(State* e, Peer* p, PairRail* r, double now, double rnd, int nlate) noexcept nogil:
    """A rail's acks are late: its deadline is a round away or has passed. Before failing it,
    ask its TCP connection (TCP_INFO, only now, never per chunk) who is to blame. The round
    that ends at the deadline tells: if the peer's kernel acknowledged bytes during it, or
    keeps a closed receive window and answers the window probes, the NICs and the path work
    and the peer's *process* is not reading (stopped, paused, swapping): the rail is held
    (peer_stalled) and checked again every round, up to the operation timeout. If nothing
    was acknowledged while something was outstanding, the NIC or the path is dead: the rail
    fails at the deadline as before, blaming this rank's NIC if its interface is down, else
    the peer's NIC or the path. Returns 1 if the rail was failed."""
    cdef r2_tcpsnap s
    cdef char buf[400]
    cdef char why[600]
    cdef char ifname[64]
    cdef int alive = 0, nic, k, other = -1
    cdef double quiet = now - r.last_progress
    if r.hc_t > 0 and now - r.hc_t > 3 * rnd:
        r.hc_t = 0        # the timer itself was held up (this process was stopped): start over
    if r.hc_t > 0 and (now - r.hc_t < rnd or quiet <= e.rail_timeout):
        return 0          # the round runs on
    r2_tcp_snap(r.tp.os_fd(r.conn) if r.conn != NULL else -1, &s)
    if r.hc_t == 0:
        hc_begin(e, r, &s, now)
        return 0
    if r.blackhole:
        r.fail_cause = CAUSE_LOCAL_NIC
        snprintf(buf, sizeof(buf), "no acknowledgement within the rail deadline: injected silent "
                 "fault on this rank's NIC (it drops everything)")
    elif r.tp.flags & TPF_NO_NIC:
        alive = 1             # shared memory: no path to lose, and a dead peer closes its end
        snprintf(buf, sizeof(buf), "its end of the shared-memory link is still open")
    elif not s.ok:
        alive = p.stalled     # no kernel view: trust the peer's other rails, if they showed one
        snprintf(buf, sizeof(buf), "no progress within the rail deadline (silent failure; no "
                 "TCP_INFO)")
    else:
        if s.has_acked and s.bytes_acked > r.hc_acked:
            alive = 1
            snprintf(buf, sizeof(buf), "its kernel acknowledged %llu bytes in the last %.0f ms",
                     s.bytes_acked - r.hc_acked, (now - r.hc_t) * 1e3)
        elif s.unacked == 0 and s.probes < 2 and (
                (s.has_wnd and s.snd_wnd < s.snd_mss) or (not s.has_wnd and s.notsent > 0)):
            alive = 1
            snprintf(buf, sizeof(buf), "its kernel keeps its receive window shut and answers "
                     "window probes (%u bytes wait to be sent)", s.notsent)
        elif not s.has_acked and s.unacked == 0 and s.last_ack_ms < rnd * 1e3:
            alive = 1
            snprintf(buf, sizeof(buf), "its kernel acknowledged a segment %u ms ago",
                     s.last_ack_ms)
        if not alive:
            nic = r2_local_nic(r.tp.os_fd(r.conn) if r.conn != NULL else -1, ifname, sizeof(ifname))
            if nic == 0:
                r.fail_cause = CAUSE_LOCAL_NIC
                snprintf(buf, sizeof(buf), "no acknowledgement within the rail deadline: local "
                         "NIC %s is down or has no carrier", ifname)
            else:
                r.fail_cause = CAUSE_REMOTE_NIC
                snprintf(buf, sizeof(buf), "no acknowledgement within the rail deadline, and no "
                         "TCP acknowledgement from rank %d's kernel for %u ms (%u segments "
                         "unacknowledged, %u retransmissions, %u window probes): its NIC or the "
                         "path to it is down", r.peer, s.last_ack_ms, s.unacked,
                         s.total_retrans, s.probes)
    if alive:
        for k in range(p.nrails):
            if k != r.index and p.rails[k].state == R_UP and p.rails[k].last_ack > r.hc_t:
                other = k
        if other >= 0 and now - p.resume_t < e.rail_timeout:
            # the peer's process acknowledges on another rail, but it resumed (after a stop of
            # its own or of this process) under a rail deadline ago: its acks on this rail may
            # be a moment behind. This rail gets a fresh deadline from the resume, not a verdict
            hc_begin(e, r, &s, now)
            return 0
        if other >= 0:
            # the process is not stalled: it acknowledged on another rail during the round.
            # This connection loses frames above TCP (an application-level black hole)
            alive = 0
            r.fail_cause = CAUSE_REMOTE_NIC
            snprintf(why, sizeof(why), "no acknowledgement within the rail deadline although %s; "
                     "rank %d's process acknowledges on rail %d: frames are lost on this rail's "
                     "path", buf, r.peer, other)
            snprintf(buf, sizeof(buf), "%s", why)
    if not alive:
        fail_rail(e, r, buf, e.me, 1)
        return 1
    r.stalled = 1
    if not p.stalled:
        p.stalled = 1
        p.stall_t = r.last_progress
        snprintf(why, sizeof(why), "rank %d sent no acknowledgement for %.0f ms (late on %d of "
                 "%d rails), but on rail %d %s: its process is stalled, not a NIC; waiting (up to "
                 "the operation timeout)", r.peer, quiet * 1e3, nlate, p.nrails, r.index, buf)
        add_event_c(e, EV_PEER_STALLED, r.peer, r.index, e.me, 0, quiet, why, CAUSE_PEER_PROCESS)
        e.signal = 1
    hc_begin(e, r, &s, now)
    return 0

cdef void completion_due(State* e, PairRail* r, double now) noexcept nogil:
    """A DATA frame is wholly posted and its completion has not come: collect it (a transport
    without an event fd is polled here), and fail the rail if it is a rail deadline late (the
    transport lost it: the frame's chunk is re-sent on another rail, the peer drops a copy)."""
    rail_reap(e, r)
    if r.state != R_UP or not r.tx_posted:
        return
    if r.tx_post_t == 0:
        r.tx_post_t = now               # (no clock read per frame on the hot path)
    elif now - r.tx_post_t > e.rail_timeout:
        fail_rail(e, r, "no send completion within the rail deadline", e.me, 1)

cdef int local_nic_gone(State* e, PairRail* r, double now) noexcept nogil:
    """A busy rail gone quiet (no ack for NIC_CHECK_AFTER) is failed at once if this rank's own NIC under it is down or has lost its carrier:
    that is certain (not a guess from timing), and waiting for the rail deadline only keeps
    the rail's chunks behind a link that cannot carry them. What it saves is most of a short
    flap (issue 18: `ip link set nic0 down` for 0.3 s): the connection left alone also stays
    stalled well after the link is back, since TCP backs off its retransmissions (200 ms,
    then 400 ms: the rail resumed 0.6 s after a 0.3 s flap, at its 500 ms deadline), while a
    new connection (fail-back probing, links.py) carries traffic as soon as the link is up.
    The interface is looked up (getifaddrs, some 50 us) at most every NIC_CHECK_EVERY per
    quiet rail, never while acks flow; a NIC that is up proves nothing and leaves the rail to
    hedging and its deadline. Returns 1 if the rail was failed."""
    cdef char ifname[64]
    cdef char buf[200]
    cdef double quiet = now - r.last_progress
    if e.noack or r.blackhole or r.conn == NULL or (r.inflight.empty() and r.ghosts == 0):
        return 0
    if quiet < NIC_CHECK_AFTER or now - r.nic_check_t < NIC_CHECK_EVERY:
        return 0
    r.nic_check_t = now
    if r2_local_nic(r.tp.os_fd(r.conn), ifname, sizeof(ifname)) != 0:
        return 0
    r.fail_cause = CAUSE_LOCAL_NIC
    snprintf(buf, sizeof(buf), "no acknowledgement for %.0f ms and local NIC %s is down or has "
             "no carrier", quiet * 1e3, ifname)
    fail_rail(e, r, buf, e.me, 1)
    return 1

cdef void idle_nic_check(State* e, double now) noexcept nogil:
    """Every NIC_IDLE_EVERY, look at this rank's NIC under each rail index (once per index:
    every peer's rail k leaves from the same local address) and fail rail k towards every peer
    if that NIC is down or has lost its carrier, whether or not the rail carries anything.
    Without it a NIC that died while its rail sat idle (between training steps, or under small
    messages that all go to the fastest rail) was noticed only when a chunk next went there,
    and comm.rails showed it up meanwhile; now both ends learn of it within 0.1 s (the peer by
    the failure notice) and the next operation stripes over the surviving rails from its start.
    A peer on this same host (its rail address is local) keeps the rail: those bytes take
    the kernel's local route and never touch the NIC. Costs one getifaddrs per rail index per
    0.1 s, not per peer."""
    cdef int i, k, nr = 0, res
    cdef Peer* p
    cdef PairRail* r
    cdef PairRail* probe
    cdef char ifname[64]
    cdef char buf[200]
    if e.noack or now - e.nic_idle_t < NIC_IDLE_EVERY:
        return
    e.nic_idle_t = now
    for i in range(e.nranks):
        if e.peers[i] != NULL and e.peers[i].nrails > nr:
            nr = e.peers[i].nrails
    for k in range(nr):
        probe = NULL
        for i in range(e.nranks):
            p = e.peers[i]
            if p == NULL or k >= p.nrails:
                continue
            r = p.rails[k]
            if r.state == R_UP and r.conn != NULL and not r.blackhole and \
                    not (r.tp.flags & TPF_NO_NIC) and r.tp.os_fd(r.conn) >= 0:
                probe = r
                break
        if probe == NULL:
            continue
        res = r2_local_nic(probe.tp.os_fd(probe.conn), ifname, sizeof(ifname))
        if res != 0:
            continue                  # up, or not found (-1): proves nothing
        snprintf(buf, sizeof(buf), "local NIC %s is down or has no carrier", ifname)
        for i in range(e.nranks):
            p = e.peers[i]
            if p == NULL or k >= p.nrails:
                continue
            r = p.rails[k]
            if r.state == R_UP and r.conn != NULL and not r.blackhole and \
                    not (r.tp.flags & TPF_NO_NIC) and r2_peer_local(r.tp.os_fd(r.conn)) != 1:
                r.fail_cause = CAUSE_LOCAL_NIC
                fail_rail(e, r, buf, e.me, 1)

cdef void check_timers(State* e) noexcept nogil:
    cdef double now = mono()
    cdef double rnd = hc_round(e)
    cdef Peer* p
    cdef PairRail* r
    cdef int i, k, up, nlate, nstalled, fine
    cdef char info[160]
    cdef size_t j
    cdef vector[Op*] late
    cdef Op* op
    cdef char buf[200]
    idle_nic_check(e, now)
    for i in range(e.nranks):
        p = e.peers[i]
        if p == NULL:
            continue
        up = 0
        nlate = 0
        note_resume(e, p, rnd)
        for k in range(p.nrails):
            r = p.rails[k]
            if r.state == R_UP and r.tx_posted:
                completion_due(e, r, now)
            if r.state == R_UP and rail_late(e, r, now, rnd):
                nlate += 1
        nstalled = 0
        fine = 0
        for k in range(p.nrails):
            r = p.rails[k]
            if r.state != R_UP:
                continue
            up += 1
            if local_nic_gone(e, r, now):
                up -= 1
                continue
            if rail_late(e, r, now, rnd):
                if judge_rail(e, p, r, now, rnd, nlate):
                    up -= 1
                    continue
            else:
                r.hc_t = 0            # acks came (or nothing is out): no round, not stalled
                r.stalled = 0
                fine += 1
            nstalled += r.stalled
        if p.stalled and nstalled == 0:
            p.stalled = 0
            if fine > 0:
                snprintf(info, sizeof(info), "rank %d acknowledges again after %.2f s", p.rank,
                         now - p.stall_t)
                add_event_c(e, EV_PEER_RESUMED, p.rank, -1, e.me, 0, now - p.stall_t, info,
                            CAUSE_PEER_PROCESS)
        if up > 0:
            hedge_tail(e, p)                # a rail gone quiet gets its tail copied elsewhere
        if up == 0 and p.nrails > 0 and not peer_idle(p):     # (idle: not connected yet)
            if p.all_down_since == 0:
                p.all_down_since = now
            elif not p.lost and now - p.all_down_since > e.peer_timeout:
                peer_lost(e, p)
        else:
            p.all_down_since = 0
    j = 0
    while j < e.notices.size():
        if now >= e.notices[j].next_send:
            e.notices[j].tries += 1
            if e.notices[j].tries > 20:
                erase_at(e.notices, j)
                continue
            e.notices[j].next_send = now + 0.1
            notify_peer(e, e.peers[e.notices[j].peer], e.notices[j].rail, e.notices[j].conn_id)
        j += 1
    it = e.ops.begin()
    while it != e.ops.end():
        op = deref(it).second
        if op.state == ST_ACTIVE and now > op.deadline:
            late.push_back(op)
        inc(it)
    for j in range(late.size()):
        snprintf(buf, 200, "operation timed out (comm %u, sequence %u): a peer did not take part "
                 "in time", late[j].comm, late[j].seq)
        fail_op(e, late[j], E_TIMEOUT, buf, 1)
