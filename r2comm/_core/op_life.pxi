# An operation's life: post_op turns a compiled Plan into send and receive messages with their
# chunk-level dependencies, binds what arrived early and queues what waits on nothing;
# op_msg_done counts its messages done; free_op and its helpers release it. What an operation
# owns, and when it is freed, is read in one place.

cdef void op_msg_done(State* e, Op* op) noexcept nogil:
    if op == NULL:
        return
    op.pending -= 1
    if op.pending <= 0 and op.state == ST_ACTIVE:
        op.state = ST_DONE
        e.signal = 1

cdef void free_send(SendMsg* m) noexcept nogil:
    if m.owned and m.base != NULL:
        free(m.base)
    free(m.cstate)
    free(m.crail)
    free(m.gate)
    del m

cdef void free_recv(RecvMsg* rm) noexcept nogil:
    cdef uint32_t c
    if rm.held != NULL:
        for c in range(rm.nchunks):
            if rm.held[c] != NULL:
                free(rm.held[c])
        free(rm.held)
    free(rm.cdone)
    free(rm.gate)
    del rm

cdef void free_p2p(State* e, P2PState* st) noexcept nogil:
    it = st.unexp.begin()
    while it != st.unexp.end():
        free_unexp(e, deref(it).second)
        inc(it)
    del st

cdef void free_op(State* e, Op* op, int unlink) noexcept nogil:
    cdef size_t i
    cdef SendMsg* sm
    cdef RecvMsg* rm
    for i in range(op.sends.size()):
        sm = <SendMsg*>op.sends[i]
        if sm.owned and not sm.done and unlink:
            sm.op = NULL          # the engine keeps re-sending its own copy until acknowledged
            continue
        if unlink and not sm.done:
            purge_send(e, sm)
        free_send(sm)
    for i in range(op.recvs.size()):
        rm = <RecvMsg*>op.recvs[i]
        if unlink:
            unlink_recv(e, rm)
        free_recv(rm)
    if unlink and not op.p2p:
        ita = e.active.find(CS(op.comm, op.seq))
        if ita != e.active.end() and deref(ita).second == op:
            e.active.erase(ita)
            e.verdicts.erase(CS(op.comm, op.seq))   # (a reused id's call must not find it)
    del op

cdef void forget_op(State* e, uint64_t oid) noexcept nogil:
    """Take the mutex and drop a finished operation (its buffers are the user's again)."""
    pthread_mutex_lock(&e.mu)
    it = e.ops.find(oid)
    if it != e.ops.end():
        free_op(e, deref(it).second, 1)
        e.ops.erase(it)
    pthread_mutex_unlock(&e.mu)

cdef uint64_t post_op(State* e, PlanC* plan, uint64_t* bufs, int dtype, int redop, uint32_t comm,
                      uint32_t seq, uint32_t count, double timeout, vector[int]& members, int p2p,
                      int key, uint64_t cap, int isz, int pin) noexcept nogil:
    # key: what a receiver matches on, a p2p message's tag or a collective's call descriptor
    cdef Op* op = r2_new[Op]()
    cdef size_t i, n = plan.kind.size()
    cdef vector[void*] msgs
    cdef vector[int] is_send
    cdef SendMsg* sm
    cdef RecvMsg* rm
    cdef Peer* p
    cdef P2PState* st
    cdef uint32_t cs = e.cs - (e.cs % <uint32_t>isz)
    cdef uint32_t c, na, nb
    cdef void* a
    cdef void* b
    cdef Dep d
    cdef CRef ref
    cdef char buf[200]
    cdef int bad = 0
    op.id = e.next_op
    e.next_op += 1
    op.deadline = mono() + timeout
    op.comm = comm
    op.seq = seq
    op.p2p = p2p
    op.members = members
    op.count = count
    op.desc = 0 if p2p else <uint32_t>key
    op.dtype = dtype
    op.redop = redop
    e.ops[op.id] = op
    for i in range(n):
        if bufs[1] == 0 and (plan.mode[i] == M_REDUCE_SEND or plan.mode[i] == M_REDUCE_SEND_REV):
            bad = 2
    for i in range(n):
        if bad:
            break
        p = NULL
        if plan.peer[i] != e.me and 0 <= plan.peer[i] < e.nranks:
            p = e.peers[plan.peer[i]]
        if plan.peer[i] == ANY_PEER and p2p and plan.kind[i] == 0 and n == 1:
            p = NULL                    # an any-source receive (bound to a peer on its match)
        elif p == NULL:
            bad = 1
            break
        elif p2p and p.lost:
            bad = 3                     # fails before it takes a number of the pair's sequence
            break
        if plan.kind[i] == 1:
            sm = r2_new[SendMsg]()
            sm.op = op
            sm.peer = plan.peer[i]
            sm.comm = comm
            sm.step = plan.step[i]
            sm.count = count
            sm.dtype = dtype
            sm.redop = redop
            sm.total = plan.nbytes[i]
            sm.cs = cs
            sm.nchunks = nchunks_of(sm.total, cs)
            sm.owned = plan.owned[i]
            sm.pin = pin
            if i < plan.rw.size() and plan.rw[i].size() > 0:
                sm.rw = plan.rw[i]
                sm.rw_sent.assign(sm.rw.size(), 0)
            if p2p:
                sm.flags = FL_P2P
                sm.aux = <uint32_t>key
                sm.seq = p.p2p_send_seq[comm]
                p.p2p_send_seq[comm] = sm.seq + 1
                op.seq = sm.seq
            else:
                sm.flags = 0
                sm.aux = <uint32_t>key     # the collective's descriptor (check_match)
                sm.seq = seq
            sm.src = <char*>bufs[plan.buf[i]] + plan.off[i]
            sm.base = <char*>malloc(sm.total if sm.total else 1) if sm.owned else sm.src
            sm.cstate = <uint8_t*>calloc(sm.nchunks, 1)
            sm.crail = <int8_t*>malloc(sm.nchunks)
            memset(sm.crail, 0xFF, sm.nchunks)
            sm.gate = <int32_t*>calloc(sm.nchunks, sizeof(int32_t))
            e.smap[mkey(sm.peer, comm, sm.flags, sm.step, sm.seq)] = <void*>sm
            op.sends.push_back(<void*>sm)
            if not sm.owned:
                op.pending += 1
            msgs.push_back(<void*>sm)
            is_send.push_back(1)
        else:
            rm = r2_new[RecvMsg]()
            rm.op = op
            rm.peer = plan.peer[i]
            rm.comm = comm
            rm.step = plan.step[i]
            rm.count = count
            rm.dtype = dtype
            rm.redop = redop
            rm.mode = plan.mode[i]
            rm.cs = cs
            rm.base = <char*>bufs[plan.buf[i]] + plan.off[i]
            if rm.mode == M_REDUCE_SEND or rm.mode == M_REDUCE_SEND_REV:
                rm.src = <char*>bufs[1] + plan.off[i]
            rm.total = plan.nbytes[i]
            rm.cap = cap if p2p else rm.total
            if p2p:
                rm.flags = FL_P2P
                rm.aux = <uint32_t>key
            else:
                rm.flags = 0
                rm.aux = <uint32_t>key
                rm.seq = seq
                alloc_recv_arrays(rm)
                e.rmap[mkey(rm.peer, comm, 0, rm.step, seq)] = <void*>rm
            op.recvs.push_back(<void*>rm)
            op.pending += 1
            msgs.push_back(<void*>rm)
            is_send.push_back(0)
    if bad == 3:
        snprintf(buf, 200, "rank %d is unreachable (every rail to it failed earlier)", plan.peer[i])
        fail_op(e, op, E_NETWORK, buf, 1)
        return op.id
    if bad:
        fail_op(e, op, E_PROTOCOL, "schedule names this rank or an unknown rank as a peer"
                if bad == 1 else "schedule reduces from a send buffer the operation lacks", 0)
        return op.id
    if not e.revoked.empty() and e.revoked.count(comm):   # issue 44: revoked: every post fails
        snprintf(buf, 200, "communicator %u was revoked (Revoke)", comm)
        fail_op(e, op, E_REVOKED, buf, 0)
        return op.id
    for i in range(plan.deps.size()):
        a = msgs[plan.deps[i].first]
        b = msgs[plan.deps[i].second]
        na = (<SendMsg*>a).nchunks if is_send[plan.deps[i].first] else (<RecvMsg*>a).nchunks
        nb = (<SendMsg*>b).nchunks if is_send[plan.deps[i].second] else (<RecvMsg*>b).nchunks
        if na != nb:
            fail_op(e, op, E_PROTOCOL, "schedule dependency between messages of different sizes", 0)
            return op.id
        d.m = b
        d.is_send = is_send[plan.deps[i].second]
        if is_send[plan.deps[i].first]:
            (<SendMsg*>a).succ.push_back(d)
        else:
            (<RecvMsg*>a).succ.push_back(d)
        for c in range(nb):
            if d.is_send:
                (<SendMsg*>b).gate[c] += 1
            else:
                (<RecvMsg*>b).gate[c] += 1
    if not p2p:
        note_posted_seq(e, comm, seq)
        e.active[CS(comm, seq)] = op
        if take_early_verdict(e, comm, seq, members):
            # the judge's verdict on this call came first (matching.pxi): it fails with that
            itv = e.verdicts.find(CS(comm, seq))
            e.aborted.erase(CS(comm, seq))
            fail_op(e, op, E_MISMATCH, deref(itv).second.second.c_str(), 0)
            relay_verdict(e, op, -1)
            take_unexpected(e, NULL, comm, seq, members)
            return op.id
        ita = e.aborted.find(CS(comm, seq))
        if ita != e.aborted.end():
            fail_op(e, op, deref(ita).second.first, deref(ita).second.second.c_str(), 0)
            relay_abort(e, op, deref(ita).second.first, deref(ita).second.second.c_str(), -1)
            e.aborted.erase(ita)
            take_unexpected(e, NULL, comm, seq, members)
            return op.id
        itm = e.mismatched.find(comm)
        if itm != e.mismatched.end() and seq_before(deref(itm).second.first, seq):
            poison_op(e, op, deref(itm).second.first, deref(itm).second.second)
            take_unexpected(e, NULL, comm, seq, members)
            return op.id
    for i in range(members.size()):
        if members[i] != e.me and e.peers[members[i]] != NULL and e.peers[members[i]].lost:
            snprintf(buf, 200, "rank %d is unreachable (every rail to it failed earlier)", members[i])
            fail_op(e, op, E_NETWORK, buf, 1)
            return op.id
    # receives: bind what arrived early
    for i in range(op.recvs.size()):
        rm = <RecvMsg*>op.recvs[i]
        if p2p:
            e.p2p_posts += 1
            rm.posted_no = e.p2p_posts
            if rm.peer == ANY_PEER:
                p2p_post_any(e, rm, comm)
            else:
                st = p2p_state(e.peers[rm.peer], comm)
                st.posted.push_back(<void*>rm)
                p2p_try_match(e, e.peers[rm.peer], st, comm)
        else:
            itu = e.cunexp.find(mkey(rm.peer, comm, 0, rm.step, seq))
            if itu != e.cunexp.end():
                u = deref(itu).second
                e.cunexp.erase(itu)
                bind_unexp(e, rm, u, rm.peer)
        if op.state == ST_ERROR:
            return op.id
    if not p2p and not e.cunexp.empty():
        # frames of this sequence number that arrived early and that no receive took: a peer
        # made another call (e.g. every rank a Bcast root, or a Bcast against an Allreduce)
        take_unexpected(e, op, comm, seq, members)
        if op.state == ST_ERROR:
            return op.id
    # sends: queue every chunk that waits on nothing
    for i in range(op.sends.size()):
        sm = <SendMsg*>op.sends[i]
        for c in range(sm.nchunks):
            if sm.gate[c] == 0 and sm.cstate[c] == C_GATED:
                send_chunk_ready(e, sm, c, 0)
    if op.pending <= 0 and op.state == ST_ACTIVE:
        op.state = ST_DONE
    for i in range(op.sends.size()):
        pump_peer(e, e.peers[(<SendMsg*>op.sends[i]).peer])
    return op.id
