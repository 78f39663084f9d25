# Reliability: a sender keeps each chunk until its ack (on_ack, ack_chunk); a failed rail's
# unacknowledged chunks go back to the front of the pair's queue and the peer is told
# (fail_rail, notify_peer); a failed operation is purged and its peers get an ABORT (fail_op);
# a peer with no rail left is lost (peer_lost).

cdef void on_ack(State* e, PairRail* r) noexcept nogil:
    cdef r2_hdr* h = &r.rh
    cdef Key k = mkey(r.peer, h.comm, h.flags, h.step, h.seq)
    cdef double now = mono(), gap
    if not r.inflight.empty():
        # how long a busy rail goes between acks (as TCP keeps its round-trip time): acks ride
        # behind the peer's data on the same connection, so under load in both directions the
        # gaps grow with the queues, and a fixed threshold took healthy rails for stalled ones
        gap = now - r.last_progress
        if r.gap_avg == 0:
            r.gap_avg = gap
            r.gap_var = gap / 2
        else:
            r.gap_var = 0.75 * r.gap_var + 0.25 * fabs(gap - r.gap_avg)
            r.gap_avg = 0.875 * r.gap_avg + 0.125 * gap
    r.last_progress = now
    r.last_ack = now
    r.ghosts = 0
    it = e.smap.find(k)
    if it == e.smap.end():
        return
    ack_chunk(e, <SendMsg*>deref(it).second, h.chunk, r)

cdef int drop_inflight(PairRail* r, SendMsg* m, uint32_t c) noexcept nogil:
    """Remove chunk c of m from r's in-flight list; 1 if it was there."""
    cdef size_t i
    cdef CRef ref
    for i in range(r.inflight.size()):
        ref = r.inflight[i]
        if ref.m == <void*>m and ref.c == c:
            erase_at(r.inflight, i)
            untrack(r, m, chunk_len(m.total, m.cs, c))
            return 1
    return 0

cdef void forget_copies(State* e, Peer* p, SendMsg* m, uint32_t c, PairRail* via) noexcept nogil:
    """A hedged chunk is delivered (its ack came on `via`): drop it from every rail, and give
    a copy still being written its own bytes (the user's buffer may be reused once the
    operation ends). The other rail's copy becomes a ghost there: if that rail never answers,
    its deadline still fires."""
    cdef int k
    cdef PairRail* t
    for k in range(p.nrails):
        t = p.rails[k]
        if drop_inflight(t, m, c) and t != via:
            t.ghosts += 1
        if t.tx_busy and t.tx_ref.m == <void*>m and t.tx_ref.c == c and t.tx_orphan == NULL:
            t.tx_orphan = <char*>malloc(t.tx_plen if t.tx_plen else 1)
            if t.tx_plen:
                memcpy(t.tx_orphan, t.tx_payload, t.tx_plen)
            t.tx_payload = t.tx_orphan

cdef void ack_chunk(State* e, SendMsg* m, uint32_t c, PairRail* r) noexcept nogil:
    """Chunk c of m is safe at the receiver: forget it, release what waited on it."""
    cdef Key k = mkey(m.peer, m.comm, m.flags, m.step, m.seq)
    cdef PairRail* pr
    cdef size_t i
    cdef CRef ref
    cdef uint8_t st
    cdef uint32_t ln
    if c >= m.nchunks:
        return
    st = m.cstate[c]
    if (st & C_STATE) != C_INFLIGHT:
        # acked already, or never sent (gated, or queued: the ready queue still holds it, and
        # counting this ack could complete and free the message under that queue entry)
        return
    if tx_mid(e, r) and r.tx_ref.m == <void*>m and r.tx_ref.c == c and r.tx_orphan == NULL:
        return                          # this rail is still writing that chunk: not received
    if m.crail[c] >= 0 and not (st & C_HEDGED):
        pr = e.peers[m.peer].rails[m.crail[c]]
        if tx_mid(e, pr) and pr.tx_ref.m == <void*>m and pr.tx_ref.c == c and pr.tx_orphan == NULL:
            return                      # nor is its only copy, still written on another rail
    if m.crail[c] >= 0:
        pr = e.peers[m.peer].rails[m.crail[c]]
        if st & C_HEDGED:
            # the first copy through wins: credit the rail that delivered it, forget both
            if r.index < e.peers[m.peer].nrails:
                pr = r
            forget_copies(e, e.peers[m.peer], m, c, r)
        else:
            drop_inflight(pr, m, c)
        ln = chunk_len(m.total, m.cs, c)
        if rate_chunk(m, ln):
            measure_rate(pr, ln)
    if (st & C_RESENT) and e.awaiting_redelivery:
        e.awaiting_redelivery = 0
        add_event(e, EV_REDELIVERED, m.peer, r.index, e.me, chunk_len(m.total, m.cs, c),
                  wall() - e.fault_time if e.fault_time else 0, "first migrated chunk acknowledged")
    m.cstate[c] = C_ACKED
    m.nacked += 1
    if not m.owned:
        for i in range(m.succ.size()):
            gate_release(e, m.succ[i], c)
    if m.nacked == m.nchunks and not m.done:
        m.done = 1
        e.smap.erase(k)
        if m.owned and (m.op == NULL or m.op.state != ST_ACTIVE):
            if m.op == NULL:
                free_send(m)
        elif not m.owned:
            op_msg_done(e, m.op)

cdef void on_abort(State* e, PairRail* r, const char* text, uint32_t n) noexcept nogil:
    cdef r2_hdr* h = &r.rh
    cdef string msg = string(text, n)
    cdef Op* op = NULL
    cdef SendMsg* sm
    if h.aux == <uint32_t>E_REVOKED and not (h.flags & (FL_VERDICT | FL_P2P)):
        revoke_comm(e, h.comm, msg.c_str(), r.peer)     # issue 44 (any seq: it names no call)
        return
    if h.flags & FL_VERDICT:
        add_event(e, EV_ABORT, r.peer, r.index, r.peer, 0, 0, msg.c_str())
        if not (h.flags & FL_P2P):
            on_verdict(e, r, msg)
        return
    if h.flags & FL_P2P:
        it = e.smap.find(mkey(r.peer, h.comm, FL_P2P, 0, h.seq))
        if it != e.smap.end():
            sm = <SendMsg*>deref(it).second
            op = sm.op
    else:
        ita = e.active.find(CS(h.comm, h.seq))
        if ita != e.active.end():
            op = deref(ita).second
        elif not seq_is_past(e, h.comm, h.seq):
            # for a call not posted here yet (bounded: a peer may name any communicator)
            if e.aborted.size() >= ABORTED_MAX and e.aborted.count(CS(h.comm, h.seq)) == 0:
                e.aborted.erase(e.aborted.begin())
            e.aborted[CS(h.comm, h.seq)] = pair[int, string](<int>h.aux, msg)
    add_event(e, EV_ABORT, r.peer, r.index, r.peer, 0, 0, msg.c_str())
    if op != NULL and op.state == ST_ACTIVE:
        fail_op(e, op, <int>h.aux, msg.c_str(), 0)
        relay_abort(e, op, <int>h.aux, msg.c_str(), r.peer)

cdef void revoke_comm(State* e, uint32_t comm, const char* msg, int skip) noexcept nogil:
    """Issue 44: communicator `comm` is revoked on this rank (Engine.revoke, or a peer's ABORT
    with code E_REVOKED): every active operation of it fails with E_REVOKED, every later post
    fails at once (post_op), and the revocation goes on, once, to every peer this rank holds a
    working connection to but `skip` (the ring neighbours and the plans' peers: O(connections)
    frames per rank, as an abort travels; a rank that is no member just passes it on)."""
    cdef vector[Op*] victims
    cdef Op* op
    cdef size_t i
    cdef int q
    if e.revoked.count(comm):
        return
    if e.revoked.size() >= REVOKED_MAX:
        e.revoked.erase(e.revoked.begin())
    e.revoked[comm] = 1
    add_event(e, EV_ABORT, skip, -1, skip if skip >= 0 else e.me, 0, 0, msg)
    it = e.ops.begin()
    while it != e.ops.end():
        op = deref(it).second
        if op.state == ST_ACTIVE and op.comm == comm:
            victims.push_back(op)
        inc(it)
    for i in range(victims.size()):
        fail_op(e, victims[i], E_REVOKED, msg, 0)
    for q in range(e.nranks):
        if q != e.me and q != skip and e.peers[q] != NULL and not e.peers[q].lost:
            send_abort(e, q, 0, comm, 0, E_REVOKED, msg)
    e.signal = 1

cdef void relay_abort(State* e, Op* op, int code, const char* msg, int skip) noexcept nogil:
    """Pass a peer's abort of a collective on to the op's other members, as it came (issue
    31: with connections made on first use a rank may hold none to the rank that detected the
    failure, so the news travels along the connections the plans made; a rank relays once,
    when its op fails; a member it holds no connection to is skipped, see send_abort)."""
    cdef size_t i
    if op.p2p:
        return
    for i in range(op.members.size()):
        if op.members[i] != e.me and op.members[i] != skip:
            send_abort(e, op.members[i], 0, op.comm, op.seq, code, msg)

cdef void on_rail_down(State* e, PairRail* r) noexcept nogil:
    cdef r2_hdr* h = &r.rh
    cdef Peer* p = e.peers[r.peer]
    cdef PairRail* t
    queue_ctrl(e, r, F_RAIL_DOWN_ACK, 0, 0, h.seq, 0, 0, h.aux, NULL, 0)
    if h.aux < <uint32_t>p.nrails:
        t = p.rails[h.aux]
        if t.state == R_UP and t.conn_id == h.seq:
            add_event(e, EV_NOTIFIED, r.peer, h.aux, r.peer, 0, 0, "peer reported the rail dead")
            fail_rail(e, t, "reported by peer", r.peer, 0)

cdef void on_rail_down_ack(State* e, PairRail* r) noexcept nogil:
    cdef r2_hdr* h = &r.rh
    cdef size_t i
    for i in range(e.notices.size()):
        if e.notices[i].peer == r.peer and e.notices[i].rail == <int>h.aux and \
                e.notices[i].conn_id == h.seq:
            add_event(e, EV_NOTIFY_ACKED, r.peer, <int>h.aux, e.me, 0, 0, "peer acknowledged")
            erase_at(e.notices, i)
            return

cdef void notify_peer(State* e, Peer* p, int rail, uint32_t conn_id) noexcept nogil:
    """Tell the peer over the control connection and a surviving rail; repeated until acked."""
    cdef int k
    cdef int sent = 0
    cdef PairRail* t
    for k in range(p.nrails, -1, -1):
        t = p.rails[k]
        if k != rail and t.state == R_UP:
            queue_ctrl(e, t, F_RAIL_DOWN, 0, 0, conn_id, 0, 0, <uint32_t>rail, NULL, 0)
            rail_write(e, t)
            sent += 1
            if sent == 2:
                break
    return

cdef extern from "<string.h>" nogil:
    char* strerror(int errnum)

cdef extern from "<errno.h>" nogil:
    enum: ECONNRESET, EPIPE, ETIMEDOUT, EHOSTUNREACH, ENETUNREACH, ENETDOWN

cdef void fail_io(State* e, PairRail* r, int64_t n, const char* what) noexcept nogil:
    """A rail's socket reported end of stream or an error: fail it, saying which end is to
    blame. A close or reset comes from the other end (its process exited, or its engine
    failed the rail); the kernel's own time-outs and unreachable routes point at the path."""
    cdef char buf[160]
    cdef int err = <int>(-n) if n != T_EOF else 0
    if r.fail_cause == CAUSE_LOCAL_NIC:     # set by an injected hard fault
        snprintf(buf, sizeof(buf), "%s: connection shut down (injected hard fault on rank %d's "
                 "NIC)", what, e.me)
    elif n == T_EOF:
        r.fail_cause = CAUSE_CLOSED
        snprintf(buf, sizeof(buf), "connection closed by rank %d's end", r.peer)
    else:
        if err == ECONNRESET or err == EPIPE:
            r.fail_cause = CAUSE_CLOSED
        elif err == ENETDOWN:
            r.fail_cause = CAUSE_LOCAL_NIC
        elif err == ETIMEDOUT or err == EHOSTUNREACH or err == ENETUNREACH:
            r.fail_cause = CAUSE_REMOTE_NIC
        snprintf(buf, sizeof(buf), "%s error: %s", what, strerror(err))
    fail_rail(e, r, buf, e.me, 1)

cdef void fail_rail(State* e, PairRail* r, const char* reason, int detector, int notify) noexcept nogil:
    cdef Peer* p = e.peers[r.peer]
    cdef vector[CRef] back
    cdef CRef ref
    cdef SendMsg* m
    cdef uint64_t nbytes = 0
    cdef size_t i, j
    cdef Notice nt
    cdef double now = mono()
    cdef int k, up = 0
    cdef uint32_t old_conn = r.conn_id
    if r.state != R_UP:
        return
    r.state = R_DOWN
    if r.fd >= 0:
        epoll_ctl(e.epfd, EPOLL_CTL_DEL, r.fd, NULL)
    r.fd = -1
    if r.conn != NULL:
        r.tp.shutdown(r.conn)
        r.tp.close(r.conn)          # the transport touches no posted memory after this
        r.conn = NULL
    r.want_out = 0
    r.blackhole = 0
    r.fault_at = -1
    r.hc_t = 0
    r.stalled = 0
    for i in range(r.inflight.size()):
        ref = r.inflight[i]
        m = <SendMsg*>ref.m
        if (m.cstate[ref.c] & C_STATE) != C_INFLIGHT:
            continue
        if m.cstate[ref.c] & C_HEDGED:
            # the other copy carries on alone, on whichever rail it is
            m.cstate[ref.c] &= ~C_HEDGED
            if m.crail[ref.c] == r.index:
                for k in range(p.nrails):
                    if k != r.index and p.rails[k].state == R_UP:
                        for j in range(p.rails[k].inflight.size()):
                            if p.rails[k].inflight[j].m == ref.m and p.rails[k].inflight[j].c == ref.c:
                                m.crail[ref.c] = <int8_t>k
                                break
                if m.crail[ref.c] != r.index:
                    continue
            else:
                continue
        if m.crail[ref.c] == r.index:
            m.cstate[ref.c] = C_QUEUED | C_RESENT
            m.crail[ref.c] = -1
            nbytes += chunk_len(m.total, m.cs, ref.c)
            back.push_back(ref)
    for i in range(back.size()):
        p.ready.push_front(back[back.size() - 1 - i])
    p.nhot += back.size()                # resent chunks go first
    r.inflight.clear()
    r.inflight_bytes = 0
    r.meas_inflight = 0
    r.ghosts = 0
    r.tx_busy = 0
    r.tx_posted = 0
    r.tx_post_t = 0
    r.tx_sealed = 0
    if r.tx_orphan != NULL:
        free(r.tx_orphan)
        r.tx_orphan = NULL
    r.txq.clear()
    r.txq_pos = 0
    r.txq_lim = 0
    drop_lazy_acks(e, r)
    if r.rtarget != NULL and (r.rkind == K_BUF or r.rkind == K_CTRL):
        free(r.rtarget)
    r.rtarget = NULL
    r.rkind = K_NONE
    r.rmsg = NULL
    r.rstate = 0
    r.rpos = 0
    r.rlen = 0
    r.rgot = 0
    r.bytes_resent += nbytes
    # flapping: a rail that fails soon after coming back waits longer before the next probe.
    # Soon: up for less than twice as long as it had been down before (at most 2 s), so a
    # link that keeps bouncing backs off, but a second short flap a second or so after the
    # first (issue 18's torch bench: 1.4 s) is not taken for one: its doubled first probe
    # kept the rail down 1 s after a 0.3 s flap (bench/testbed_flap.py)
    if r.restore_time > 0 and now - r.restore_time < \
            min(2.0, 2.0 * (r.restore_time - r.fail_time if r.fail_time > 0 else 1.0)):
        r.backoff = r.backoff * 2 if r.backoff > 0 else e.probe_base
        if r.backoff > e.probe_max:
            r.backoff = e.probe_max
    else:
        r.backoff = e.probe_base
    r.fail_time = now
    r.fail_count += 1
    r.rate = 0
    r.next_probe = now + r.backoff
    if r.index < p.nrails:
        if e.fault_time == 0:
            e.fault_time = wall()
        add_event_c(e, EV_RAIL_FAILED, r.peer, r.index, detector, nbytes, 0, reason, r.fail_cause)
        if nbytes:
            e.awaiting_redelivery = 1
            add_event(e, EV_MIGRATED, r.peer, r.index, e.me, nbytes, 0,
                      "unacknowledged chunks re-queued on surviving rails")
        if notify:
            nt.peer = r.peer
            nt.rail = r.index
            nt.conn_id = old_conn
            nt.next_send = now + 0.05
            nt.tries = 0
            e.notices.push_back(nt)
            notify_peer(e, p, r.index, old_conn)
            add_event(e, EV_NOTIFY_SENT, r.peer, r.index, e.me, 0, 0, "rail failure sent to peer")
        for k in range(p.nrails):
            if p.rails[k].state == R_UP:
                up += 1
        if up == 0 and p.all_down_since == 0:
            p.all_down_since = now
        pump_peer(e, p)
    e.signal = 1

cdef void purge_send(State* e, SendMsg* m) noexcept nogil:
    """Remove every reference the rails and queues hold to m's chunks; an unfinished
    point-to-point message leaves a void in its place (send_void)."""
    cdef Peer* p = e.peers[m.peer]
    cdef PairRail* r
    cdef size_t i
    cdef int k
    cdef deque[CRef] keep
    cdef CRef ref
    cdef size_t hot
    cdef bint abandoned = not m.done and (m.flags & (FL_P2P | FL_VOID)) == FL_P2P
    if not m.done:
        e.smap.erase(mkey(m.peer, m.comm, m.flags, m.step, m.seq))
        m.done = 1
    hot = 0
    for i in range(p.ready.size()):
        ref = p.ready[i]
        if ref.m != <void*>m:
            keep.push_back(ref)
            if i < p.nhot:
                hot += 1
    p.ready.swap(keep)
    p.nhot = hot
    for k in range(p.nrails):
        r = p.rails[k]
        keep.clear()
        for i in range(r.inflight.size()):
            ref = r.inflight[i]
            if ref.m != <void*>m:
                keep.push_back(ref)
            else:
                untrack(r, m, chunk_len(m.total, m.cs, ref.c))
        r.inflight.swap(keep)
        if r.tx_busy and r.tx_payload >= m.base and r.tx_payload < m.base + m.total + 1 \
                and r.tx_orphan == NULL:
            # the frame on the wire must complete: keep its bytes in a private copy
            r.tx_orphan = <char*>malloc(r.tx_plen if r.tx_plen else 1)
            if r.tx_plen:
                memcpy(r.tx_orphan, r.tx_payload, r.tx_plen)
            r.tx_payload = r.tx_orphan
    for i in range(m.nchunks):
        if (m.cstate[i] & C_STATE) != C_ACKED:
            m.cstate[i] = C_ACKED
    if abandoned:
        send_void(e, m)

cdef void send_void(State* e, SendMsg* m) noexcept nogil:
    """Point-to-point message m will never be sent in full (its operation failed or was
    released, and its user was told): its number in the pair's sequence goes to the receiver
    as a void (an empty FL_VOID frame), so the pair's later messages do not wait for it
    there (matching.pxi p2p_void). The void is the engine's own message, sent like an eager
    one: first in the pair's queue, kept until acknowledged, re-sent over the rails that
    survive or come back."""
    cdef SendMsg* v
    cdef Key k = mkey(m.peer, m.comm, FL_P2P | FL_VOID, 0, m.seq)
    if e.smap.count(k):
        return
    v = r2_new[SendMsg]()
    if v == NULL:
        return
    v.peer = m.peer
    v.comm = m.comm
    v.seq = m.seq
    v.flags = FL_P2P | FL_VOID
    v.owned = 1
    v.pin = -1
    v.cs = m.cs
    v.nchunks = 1
    v.base = <char*>malloc(1)
    v.src = v.base
    v.cstate = <uint8_t*>calloc(1, 1)
    v.crail = <int8_t*>malloc(1)
    v.gate = <int32_t*>calloc(1, sizeof(int32_t))
    if v.base == NULL or v.cstate == NULL or v.crail == NULL or v.gate == NULL:
        free_send(v)
        return
    v.crail[0] = -1
    e.smap[k] = <void*>v
    send_chunk_ready(e, v, 0, 1)

cdef bint sends_pending(State* e) noexcept nogil:
    """A send still waits for its acknowledgement from a peer not held lost. A lost peer's
    operations failed (E_NETWORK) and its acknowledgements cannot come while it is lost, so
    Engine.drain does not wait for them: a world closed after a rank died (Free after Shrink)
    used to wait out the drain's 10 s for a dead rank's acks."""
    cdef SendMsg* m
    it = e.smap.begin()
    while it != e.smap.end():
        m = <SendMsg*>deref(it).second
        if not e.peers[m.peer].lost:
            return 1
        inc(it)
    return 0

cdef void unlink_any_source(State* e, RecvMsg* rm) noexcept nogil:
    """Take an unbound any-source receive off its communicator's list."""
    cdef size_t i
    ita = e.any_posted.find(rm.comm)
    if ita == e.any_posted.end():
        return
    for i in range(deref(ita).second.size()):
        if deref(ita).second[i] == <void*>rm:
            erase_at(deref(ita).second, i)
            break
    if deref(ita).second.empty():
        e.any_posted.erase(ita)

cdef void unlink_recv(State* e, RecvMsg* rm) noexcept nogil:
    """Forget a receive: later frames for it are stale; rails reading into it drop the bytes."""
    cdef Peer* p
    cdef PairRail* r
    cdef int k
    cdef P2PState* st
    cdef size_t i
    if rm.peer < 0:
        unlink_any_source(e, rm)        # not bound to a peer: nothing of it is in flight
        return
    p = e.peers[rm.peer]
    if rm.flags & FL_P2P:
        st = p2p_state(p, rm.comm)
        if rm.bound:
            itb = st.bound.find(rm.seq)
            if itb != st.bound.end() and deref(itb).second == <void*>rm:
                st.bound.erase(itb)
        else:
            for i in range(st.posted.size()):
                if st.posted[i] == <void*>rm:
                    erase_at(st.posted, i)
                    break
    else:
        it = e.rmap.find(mkey(rm.peer, rm.comm, 0, rm.step, rm.seq))
        if it != e.rmap.end() and deref(it).second == <void*>rm:
            e.rmap.erase(it)
    for k in range(p.nrails):
        r = p.rails[k]
        if r.rmsg == <void*>rm and (r.rkind == K_DIRECT or r.rkind == K_STAGE):
            r.rkind = K_TRASH
            r.rtarget = NULL
            r.rmsg = NULL

cdef void send_abort(State* e, int peer, uint8_t flags, uint32_t comm, uint32_t seq, int code,
                     const char* msg) noexcept nogil:
    cdef Peer* p = e.peers[peer]
    cdef int k
    cdef uint32_t n = <uint32_t>len_c(msg)
    if p == NULL:
        return
    if n > MAX_CTRL_PAYLOAD:
        n = MAX_CTRL_PAYLOAD
    for k in range(p.nrails, -1, -1):
        if p.rails[k].state == R_UP:
            queue_ctrl(e, p.rails[k], F_ABORT, flags, comm, seq, 0, 0, <uint32_t>code, msg, n)
            rail_write(e, p.rails[k])
            return

cdef extern from "<string.h>" nogil:
    size_t len_c "strlen"(const char*)

cdef void fail_op(State* e, Op* op, int code, const char* msg, int propagate) noexcept nogil:
    cdef size_t i
    cdef SendMsg* sm
    cdef RecvMsg* rm
    cdef char buf[4200]
    if op.state != ST_ACTIVE:
        return
    op.state = ST_ERROR
    op.err = code
    op.msg = string(msg)
    for i in range(op.sends.size()):
        purge_send(e, <SendMsg*>op.sends[i])
    for i in range(op.recvs.size()):
        unlink_recv(e, <RecvMsg*>op.recvs[i])
    if propagate:
        snprintf(buf, sizeof(buf), "%s (detected by rank %d)", msg, e.me)
        op.msg = string(<const char*>buf)
        if op.p2p:
            for i in range(op.recvs.size()):
                rm = <RecvMsg*>op.recvs[i]
                if rm.bound:
                    send_abort(e, rm.peer, FL_P2P, rm.comm, rm.seq, code, buf)
        else:
            for i in range(op.members.size()):
                if op.members[i] != e.me:
                    send_abort(e, op.members[i], 0, op.comm, op.seq, code, buf)
    if code == E_MISMATCH:
        if not e.poisoning:
            await_verdict(e, op, op.seq)     # (a poisoned call: poison_op); before the calls
        note_mismatch(e, op)                 # it poisons, which quote its (verdict's) report
    e.signal = 1

cdef void peer_lost(State* e, Peer* p) noexcept nogil:
    cdef char buf[300]
    cdef int k, closed = 0, local = 0, cause
    p.lost = 1
    for k in range(p.nrails):
        if p.rails[k].fail_cause == CAUSE_CLOSED:
            closed += 1
        elif p.rails[k].fail_cause == CAUSE_LOCAL_NIC:
            local += 1
    if closed > 0:
        # a connection is only closed or reset by a live kernel at the other end: the
        # process there exited, was killed, or closed its rails
        cause = CAUSE_PEER_PROCESS
        snprintf(buf, 300, "lost every rail to rank %d: its end closed or reset the connections "
                 "(its process exited or was killed, or its engine failed its rails)", p.rank)
    elif local == p.nrails:
        cause = CAUSE_LOCAL_NIC
        snprintf(buf, 300, "lost every rail to rank %d: every NIC of rank %d is down",
                 p.rank, e.me)
    else:
        cause = CAUSE_REMOTE_NIC
        snprintf(buf, 300, "lost every rail to rank %d (no working NIC path between ranks %d "
                 "and %d: its kernel acknowledges nothing on any rail)", p.rank, e.me, p.rank)
    peer_lost_why(e, p, cause, buf)

cdef void peer_lost_why(State* e, Peer* p, int cause, const char* why) noexcept nogil:
    """Peer p is lost for `why` (peer_lost, or the failure detector: Engine.links.peer_dead): event
    peer_lost, and every active operation that involves it fails with E_NETWORK."""
    p.lost = 1
    add_event_c(e, EV_PEER_LOST, p.rank, -1, e.me, 0, 0, why, cause)
    fail_peer_ops(e, p, E_NETWORK, why)

cdef void fail_peer_ops(State* e, Peer* p, int code, const char* why) noexcept nogil:
    """Fail every active operation of this rank that involves peer p."""
    cdef vector[Op*] victims
    cdef Op* op
    cdef size_t i
    cdef int involved
    it = e.ops.begin()
    while it != e.ops.end():
        op = deref(it).second
        if op.state == ST_ACTIVE:
            involved = 0
            for i in range(op.sends.size()):
                if (<SendMsg*>op.sends[i]).peer == p.rank and not (<SendMsg*>op.sends[i]).done:
                    involved = 1
            for i in range(op.recvs.size()):
                if (<RecvMsg*>op.recvs[i]).peer == p.rank and not (<RecvMsg*>op.recvs[i]).done:
                    involved = 1
            if not op.p2p:
                for i in range(op.members.size()):
                    if op.members[i] == p.rank:
                        involved = 1
            if involved:
                victims.push_back(op)
        inc(it)
    for i in range(victims.size()):
        fail_op(e, victims[i], code, why, 1)
