# Which posted receive an arriving message belongs to. Collectives: a frame carries its sender's
# call, compared with this rank's; a mismatch names both calls and fails the communicator's later
# calls until reported. Point-to-point: MPI's in-order matching by tag. Messages no receive
# wants yet wait as unexpected and are bound when one is posted.

# -- naming a collective call from its descriptor (the header's count, aux, dtype, redop; the
# encoding is plans.py's: aux = kind & 7 | non-blocking << 3 | root << 4 | (kind >> 3) << 20
# | plan hash << 22,
# count = element count) -------------------------------------------------------------------------
cdef extern from "<string.h>" nogil:
    int strcmp(const char*, const char*)

cdef double VERDICT_WAIT = 2.0      # s: longest a failed call waits for the judge's verdict
cdef enum:
    POISON_TEXT = 4600              # a poisoned call's message: the quoted report and more

cdef const char* dtype_name(uint8_t d) noexcept nogil:
    if d == 0: return "int8"
    if d == 1: return "int16"
    if d == 2: return "int32"
    if d == 3: return "int64"
    if d == 4: return "uint8"
    if d == 5: return "uint16"
    if d == 6: return "uint32"
    if d == 7: return "uint64"
    if d == 8: return "float16"
    if d == 9: return "float32"
    if d == 10: return "float64"
    if d == 11: return "complex64"
    if d == 12: return "complex128"
    if d == 13: return "bool"
    return "unknown dtype"

cdef const char* op_name(uint8_t o) noexcept nogil:
    if o == 0: return "SUM"
    if o == 1: return "PROD"
    if o == 2: return "MIN"
    if o == 3: return "MAX"
    return "unknown op"

cdef const char* kind_name(uint32_t k, uint32_t nb) noexcept nogil:
    if k == 1: return "Iallreduce" if nb else "Allreduce"
    if k == 2: return "Ireduce" if nb else "Reduce"
    if k == 3: return "Ibcast" if nb else "Bcast"
    if k == 4: return "Iallgather" if nb else "Allgather"
    if k == 5: return "Ireduce_scatter_block" if nb else "Reduce_scatter_block"
    if k == 6: return "Ialltoall" if nb else "Alltoall"
    if k == 7: return "Ibarrier" if nb else "Barrier"
    if k == 8: return "Igather" if nb else "Gather"
    if k == 9: return "Iscatter" if nb else "Scatter"
    if k == 10: return "Igatherv" if nb else "Gatherv"
    if k == 11: return "Iscatterv" if nb else "Scatterv"
    if k == 12: return "Iallgatherv" if nb else "Allgatherv"
    if k == 13: return "Ialltoallv" if nb else "Alltoallv"
    if k == 14: return "Ireduce_scatter" if nb else "Reduce_scatter"
    if k == 15: return "Iscan" if nb else "Scan"
    if k == 16: return "Iexscan" if nb else "Exscan"
    return "a collective"

cdef void describe_call(char* out, size_t n, uint32_t desc, uint32_t count, uint8_t dtype,
                        uint8_t redop) noexcept nogil:
    """e.g. "Allreduce(float32 x 2, SUM)", "Ibcast(int32 x 100, root=1)"."""
    cdef uint32_t k = (desc & 7) | (((desc >> 20) & 3) << 3), nb = (desc >> 3) & 1
    cdef uint32_t root = (desc >> 4) & 0xFFFF
    cdef char rs[24]
    if root == 0xFFFF:
        snprintf(rs, 24, ">=65535")
    else:
        snprintf(rs, 24, "%u", root)
    if k == 7:
        snprintf(out, n, "%s()", kind_name(k, nb))
    elif k == 1:
        snprintf(out, n, "%s(%s x %u, %s)", kind_name(k, nb), dtype_name(dtype), count,
                 op_name(redop))
    elif k == 2:
        snprintf(out, n, "%s(%s x %u, %s, root=%s)", kind_name(k, nb), dtype_name(dtype), count,
                 op_name(redop), rs)
    elif k == 3:
        snprintf(out, n, "%s(%s x %u, root=%s)", kind_name(k, nb), dtype_name(dtype), count, rs)
    elif k == 5:
        snprintf(out, n, "%s(%s x %u per rank, %s)", kind_name(k, nb), dtype_name(dtype), count,
                 op_name(redop))
    elif k == 4 or k == 6:
        snprintf(out, n, "%s(%s x %u per rank)", kind_name(k, nb), dtype_name(dtype), count)
    elif k == 8 or k == 9:
        snprintf(out, n, "%s(%s x %u per rank, root=%s)", kind_name(k, nb), dtype_name(dtype),
                 count, rs)
    elif k == 10 or k == 11:
        snprintf(out, n, "%s(%s, root=%s)", kind_name(k, nb), dtype_name(dtype), rs)
    elif k == 12 or k == 13:
        snprintf(out, n, "%s(%s)", kind_name(k, nb), dtype_name(dtype))
    elif k >= 14 and k <= 16:
        snprintf(out, n, "%s(%s x %u, %s)", kind_name(k, nb), dtype_name(dtype), count,
                 op_name(redop))
    else:
        snprintf(out, n, "a collective (%s, signature %08x/%08x)", dtype_name(dtype), desc, count)

cdef void fail_mismatch(State* e, Op* op, int peer, uint32_t desc, uint32_t count, uint8_t dtype,
                        uint8_t redop) noexcept nogil:
    """Fail this rank's collective `op` because `peer` sent a frame of another call (its
    descriptor from the frame's header), naming both calls; every peer is told."""
    cdef char mine[200]
    cdef char theirs[200]
    cdef char buf[700]
    cdef const char* first = mine
    cdef const char* second = theirs
    cdef int r1 = e.me, r2 = peer
    describe_call(mine, 200, op.desc, op.count, op.dtype, op.redop)
    describe_call(theirs, 200, desc, count, dtype, redop)
    if peer < e.me:                      # lower rank first
        first, second, r1, r2 = theirs, mine, peer, e.me
    snprintf(buf, 700, "collective calls differ between ranks (call #%u on communicator %u): "
             "rank %d called %s, rank %d called %s%s", op.seq, op.comm, r1, first, r2, second,
             "; the same arguments, but different schedules (R2COMM_ALGO, R2COMM_EAGER, "
             "R2COMM_CHUNK_SIZE or the rail state differ between ranks)"
             if strcmp(mine, theirs) == 0 else "")
    fail_op(e, op, E_MISMATCH, buf, 1)

cdef int check_match(State* e, RecvMsg* rm, uint32_t count, uint64_t total, uint8_t dtype,
                     int peer, uint32_t aux, uint8_t redop) noexcept nogil:
    """Compare an arriving message with what this rank posted; fail the op on a mismatch.
    A collective's frame carries its sender's whole call (count, kind, blocking or not, root,
    dtype, op, plan hash): integer compares here, and a mismatch names both calls."""
    cdef char buf[400]
    if rm.op == NULL or rm.op.state != ST_ACTIVE:
        return 0
    if rm.flags & FL_P2P:
        if total > rm.cap:
            snprintf(buf, 400, "message truncated: rank %d sent %llu bytes, rank %d posted a receive "
                     "buffer of %llu bytes", peer, <unsigned long long>total, e.me,
                     <unsigned long long>rm.cap)
            fail_op(e, rm.op, E_TRUNCATE, buf, 1)
            return -1
        if dtype != rm.dtype:
            snprintf(buf, 400, "datatype mismatch: rank %d sent %s, rank %d receives %s", peer,
                     dtype_name(dtype), e.me, dtype_name(rm.dtype))
            fail_op(e, rm.op, E_MISMATCH, buf, 1)
            return -1
        return 0
    if count != rm.count or aux != rm.aux or dtype != rm.dtype or redop != rm.redop or \
            total != rm.total:
        fail_mismatch(e, rm.op, peer, aux, count, dtype, redop)
        return -1
    return 0

# Point-to-point matching: messages of a pair are matched in sequence order (MPI's non-overtaking
# rule); a message whose tag no posted receive wants waits as unexpected. Any-source receives
# wait on their communicator's list (State.any_posted): a message goes to the earlier-posted of
# the pair's first taker and that list's first taker. A message becomes matchable once every
# earlier one of its pair was seen; stored ones are then numbered in that order (their arrival)
# and indexed by (comm, arrival) in State.any_unexp, which an any-source receive searches.
# A message its sender gave up (a failed send) comes as a void (p2p_void) and counts as seen,
# so the pair's later messages never wait for it, also after the pair failed and recovered.

cdef P2PState* p2p_state(Peer* p, uint32_t comm) noexcept nogil:
    cdef P2PState* st
    it = p.p2p.find(comm)
    if it != p.p2p.end():
        return deref(it).second
    st = r2_new[P2PState]()
    p.p2p[comm] = st
    return st


cdef int alloc_recv_arrays(RecvMsg* rm) noexcept nogil:
    """Per-chunk arrays of a receive; -1 (and none of them) if memory ran out."""
    rm.nchunks = nchunks_of(rm.total, rm.cs)
    rm.cdone = <uint8_t*>calloc(rm.nchunks, 1)
    rm.held = <char**>calloc(rm.nchunks, sizeof(char*))
    if rm.gate == NULL:
        rm.gate = <int32_t*>calloc(rm.nchunks, sizeof(int32_t))
    if rm.cdone == NULL or rm.held == NULL or rm.gate == NULL:
        free(rm.cdone)
        free(rm.held)
        free(rm.gate)
        rm.cdone = NULL
        rm.held = NULL
        rm.gate = NULL
        rm.nchunks = 0
        return -1
    return 0

cdef void bind_unexp(State* e, RecvMsg* rm, Unexp* u, int peer) noexcept nogil:
    """Hand the chunks that arrived before the receive was posted to the receive."""
    cdef uint32_t c
    if check_match(e, rm, u.count, u.total, u.dtype, peer, u.aux, u.redop) != 0:
        free_unexp(e, u)
        return
    if u.cs != rm.cs and rm.op != NULL:
        # the buffered chunks were cut at another size than this receive's: never copy them
        fail_op(e, rm.op, E_PROTOCOL, "chunk boundaries differ between ranks (R2COMM_CHUNK_SIZE "
                "must be the same on every rank)", 1)
        free_unexp(e, u)
        return
    if rm.nchunks == 0 and alloc_recv_arrays(rm) != 0:
        if rm.op != NULL:
            fail_op(e, rm.op, E_PROTOCOL, "out of memory for the chunk table of a received "
                    "message", 1)
        free_unexp(e, u)
        return
    if u.cs == rm.cs and (rm.op == NULL or rm.op.state == ST_ACTIVE):
        it = u.chunks.begin()
        while it != u.chunks.end():
            deliver_chunk(e, rm, deref(it).first, deref(it).second)
            inc(it)
        u.chunks.clear()
    free_unexp(e, u)

cdef void free_unexp(State* e, Unexp* u) noexcept nogil:
    """Drop an unexpected message (and the chunks it still holds) from the bounded store."""
    it = u.chunks.begin()
    while it != u.chunks.end():
        free(deref(it).second)
        inc(it)
    e.unexp_bytes -= u.nbytes
    e.unexp_msgs -= 1
    if u.arrival != 0:
        e.any_unexp.erase(CA(u.comm, u.arrival))
    del u

cdef Unexp* new_unexp(State* e, r2_hdr* h, uint32_t cs) noexcept nogil:
    """A new unexpected message (counted in the bounded store; see unexp_room)."""
    cdef Unexp* u = r2_new[Unexp]()
    if u == NULL:
        return NULL
    e.unexp_msgs += 1
    u.count = h.count
    u.aux = h.aux
    u.flags = h.flags
    u.dtype = h.dtype
    u.redop = h.redop
    u.total = h.total
    u.comm = h.comm
    u.seq = h.seq
    u.peer = -1
    u.cs = cs
    u.nchunks = nchunks_of(h.total, cs)
    return u

cdef inline bint tag_wanted(RecvMsg* rm, uint32_t tag) noexcept nogil:
    return <int32_t>rm.aux == -1 or rm.aux == tag

cdef int first_wanted(deque[void*]& posted, uint32_t tag) noexcept nogil:
    """Index of the earliest-posted receive in `posted` that takes `tag`; -1 if none."""
    cdef size_t i
    for i in range(posted.size()):
        if tag_wanted(<RecvMsg*>posted[i], tag):
            return <int>i
    return -1

cdef RecvMsg* p2p_take_receive(State* e, P2PState* st, uint32_t comm, uint32_t tag) noexcept nogil:
    """The receive a matchable message with `tag` goes to: the earlier-posted of the pair's
    first taker and the communicator's first any-source taker (taken off its list); or NULL."""
    cdef int i = first_wanted(st.posted, tag), j = -1
    cdef RecvMsg* rm
    ita = e.any_posted.find(comm)
    if ita != e.any_posted.end():
        j = first_wanted(deref(ita).second, tag)
    if j >= 0 and (i < 0 or (<RecvMsg*>deref(ita).second[j]).posted_no <
                   (<RecvMsg*>st.posted[i]).posted_no):
        rm = <RecvMsg*>deref(ita).second[j]
        erase_at(deref(ita).second, j)
        if deref(ita).second.empty():
            e.any_posted.erase(ita)
        return rm
    if i >= 0:
        rm = <RecvMsg*>st.posted[i]
        erase_at(st.posted, i)
        return rm
    return NULL

cdef void p2p_try_match(State* e, Peer* p, P2PState* st, uint32_t comm) noexcept nogil:
    cdef Unexp* u
    cdef RecvMsg* rm
    cdef bint wrapped = 0
    # in sequence order modulo 2**32: from the oldest a pair can hold (2**31 before seen_upto),
    # round the end of the map to its start (a pair's p2p sequence wraps after 2**32 messages)
    cdef uint32_t oldest = st.seen_upto + <uint32_t>0x80000000
    it = st.unexp.lower_bound(oldest)
    while True:
        if it == st.unexp.end():
            if wrapped or oldest == 0:
                break
            wrapped = 1
            it = st.unexp.begin()
            continue                    # (begin may be the end: nothing there)
        if wrapped and deref(it).first >= oldest:
            break
        if not seq_before(deref(it).first, st.seen_upto):
            break
        u = deref(it).second
        if u.flags & FL_VOID:           # a message its sender gave up: nothing to match
            free_unexp(e, u)
            it = st.unexp.erase(it)
            continue
        rm = p2p_take_receive(e, st, comm, u.aux)
        if rm != NULL:
            p2p_bind(e, p, st, rm, deref(it).first, u)
            it = st.unexp.erase(it)
        else:
            inc(it)

cdef void p2p_index_ready(State* e, P2PState* st, uint32_t upto_before) noexcept nogil:
    """Messages of the pair from `upto_before` to seen_upto just became matchable (every
    earlier one of the pair was seen): number the unexpected ones in that (sequence) order
    and index them for any-source receives."""
    cdef uint32_t s = upto_before
    cdef Unexp* u
    while s != st.seen_upto:
        itu = st.unexp.find(s)
        if itu != st.unexp.end() and deref(itu).second.arrival == 0 and \
                not (deref(itu).second.flags & FL_VOID):
            u = deref(itu).second
            e.p2p_arrivals += 1
            u.arrival = e.p2p_arrivals
            e.any_unexp[CA(u.comm, u.arrival)] = u
        s += 1

cdef size_t p2p_states_held(State* e) noexcept nogil:
    """Pair states this rank holds (every peer, every communicator id)."""
    cdef size_t n = 0
    cdef int i
    for i in range(e.nranks):
        if e.peers[i] != NULL:
            n += e.peers[i].p2p.size()
    return n

cdef void p2p_void(State* e, PairRail* r) noexcept nogil:
    """A void (FL_VOID frame) for message h.seq of the pair: its sender gave that message up
    (its send failed or was released, and its user was told), so it never comes in full. The
    pair's later messages stop waiting for it: unseen, it counts as seen (held as an empty
    unexpected entry, bounded like any, until every earlier message of the pair was seen, so
    the pair's messages are still matched in the order sent); a part of it stored here is
    dropped; a receive it had matched fails. A repeated or stale void changes nothing."""
    cdef r2_hdr* h = &r.rh
    cdef Peer* p = e.peers[r.peer]
    cdef P2PState* st
    cdef Unexp* u
    cdef RecvMsg* rm
    cdef uint32_t upto
    cdef char buf[200]
    if p.p2p.count(h.comm) == 0 and (not unexp_room(e, 1, 0) or
                                     p2p_states_held(e) >= e.unexp_max_msgs):
        unexp_overflow(e, r)            # (a pair state for an id nobody here used)
        return
    st = p2p_state(p, h.comm)
    itb = st.bound.find(h.seq)
    if itb != st.bound.end():
        rm = <RecvMsg*>deref(itb).second
        if rm.op != NULL and rm.op.state == ST_ACTIVE and not rm.done:
            snprintf(buf, 200, "rank %d's send of the message this receive matched failed "
                     "(its sender was told so): the rest of it will not come", p.rank)
            fail_op(e, rm.op, E_NETWORK, buf, 0)
        return
    itu = st.unexp.find(h.seq)
    if itu != st.unexp.end():
        if not (deref(itu).second.flags & FL_VOID):
            free_unexp(e, deref(itu).second)
            st.unexp.erase(itu)
        return
    if p2p_seen(st, h.seq):
        return
    if not unexp_room(e, 1, 0):
        unexp_overflow(e, r)
        return
    u = new_unexp(e, h, e.cs)
    if u == NULL:
        rx_refuse(e, r, "out of memory for an unexpected message: connection closed")
        return
    u.peer = p.rank
    u.nchunks = 0                       # holds no chunk: a late chunk of it is dropped
    st.unexp[h.seq] = u
    upto = st.seen_upto
    p2p_mark_seen(st, h.seq)
    p2p_index_ready(e, st, upto)
    p2p_try_match(e, p, st, h.comm)

cdef void p2p_post_any(State* e, RecvMsg* rm, uint32_t comm) noexcept nogil:
    """Post an any-source receive: the earliest-arrived matchable message of comm (any peer)
    with a tag it takes, else it waits on the communicator's list."""
    cdef Unexp* u
    cdef Peer* p
    cdef P2PState* st
    it = e.any_unexp.lower_bound(CA(comm, 0))
    while it != e.any_unexp.end() and deref(it).first.first == comm:
        u = deref(it).second
        if tag_wanted(rm, u.aux):
            p = e.peers[u.peer]
            st = p2p_state(p, comm)
            st.unexp.erase(u.seq)
            p2p_bind(e, p, st, rm, u.seq, u)       # (frees u: its index entry goes)
            return
        inc(it)
    e.any_posted[comm].push_back(<void*>rm)


cdef void p2p_bind(State* e, Peer* p, P2PState* st, RecvMsg* rm, uint32_t seq, Unexp* u) noexcept nogil:
    if rm.peer < 0:
        rm.peer = p.rank                # an any-source receive: now bound to this peer
        if rm.op != NULL:
            rm.op.members.push_back(p.rank)
    rm.seq = seq
    rm.bound = 1
    rm.total = u.total
    rm.count = u.count
    rm.aux = u.aux
    st.bound[seq] = <void*>rm
    bind_unexp(e, rm, u, p.rank)

cdef void p2p_mark_seen(P2PState* st, uint32_t seq) noexcept nogil:
    if seq == st.seen_upto:
        st.seen_upto += 1
        while st.seen_ahead.count(st.seen_upto):
            st.seen_ahead.erase(st.seen_upto)
            st.seen_upto += 1
    elif seq_before(st.seen_upto, seq):
        st.seen_ahead[seq] = 1

cdef inline int p2p_seen(P2PState* st, uint32_t seq) noexcept nogil:
    return seq_before(seq, st.seen_upto) or st.seen_ahead.count(seq) > 0

cdef void take_unexpected(State* e, Op* op, uint32_t comm, uint32_t seq,
                         vector[int]& members) noexcept nogil:
    """Drop the early frames of collective (comm, seq) that no receive bound; with an op, the
    first of them fails it as a mismatch naming the sender's call (a stand-in passes NULL)."""
    cdef size_t i
    cdef Key lo
    cdef Unexp* u
    cdef int peer
    for i in range(members.size()):
        peer = members[i]
        if peer == e.me:
            continue
        lo = mkey(peer, comm, 0, 0, 0)
        it = e.cunexp.lower_bound(lo)
        while it != e.cunexp.end() and deref(it).first.first == lo.first:
            if <uint32_t>(deref(it).first.second & <uint64_t>0xFFFFFFFF) != seq:
                inc(it)
                continue
            u = deref(it).second
            if op != NULL and op.state == ST_ACTIVE:
                fail_mismatch(e, op, peer, u.aux, u.count, u.dtype, u.redop)
            free_unexp(e, u)
            it = e.cunexp.erase(it)

cdef void poison_text(char* out, size_t n, uint32_t bad_seq, uint32_t seq,
                      const char* why) noexcept nogil:
    snprintf(out, n, "an earlier collective on this communicator (call #%u) did not match, "
             "so this call (#%u) cannot line up: %s", bad_seq, seq, why)

cdef void poison_op(State* e, Op* op, uint32_t bad_seq, string& why) noexcept nogil:
    cdef char buf[POISON_TEXT]
    cdef int was = e.poisoning
    poison_text(buf, POISON_TEXT, bad_seq, op.seq, why.c_str())
    e.poisoning = 1
    fail_op(e, op, E_MISMATCH, buf, 0)
    e.poisoning = was
    await_verdict(e, op, bad_seq)

cdef void note_mismatch(State* e, Op* op) noexcept nogil:
    """A collective failed with a mismatch: ranks may now disagree on which call is which
    (e.g. one issued Iallreduce then Allreduce, the others the other way round), so this
    rank's later collectives on the communicator fail at once instead of waiting for frames
    that never come, until a wait has reported the mismatch (Engine.wait clears it)."""
    cdef vector[Op*] later
    cdef size_t i
    if e.poisoning or op.p2p:
        return
    e.mismatched[op.comm] = pair[uint32_t, string](op.seq, op.msg)
    it = e.active.lower_bound(CS(op.comm, 0))
    while it != e.active.end() and deref(it).first.first == op.comm:
        if deref(it).second.state == ST_ACTIVE and seq_before(op.seq, deref(it).first.second):
            later.push_back(deref(it).second)
        inc(it)
    for i in range(later.size()):
        poison_op(e, later[i], op.seq, op.msg)

cdef void clear_mismatch(State* e, Op* op) noexcept nogil:
    """A wait reported op's mismatch to the caller: later calls may line up again."""
    itm = e.mismatched.find(op.comm)
    if itm != e.mismatched.end() and not seq_before(op.seq, deref(itm).second.first):
        e.mismatched.erase(itm)

# -- one report of a mismatch on every rank -----------------------------------------------------
# Two ranks may detect one mismatch at once (each from its own neighbour's frame: rank 3 calls
# with another count, ranks 2 and 4 both see it), and each relays its own report (failover.pxi
# relay_abort). So that every rank raises with the same report, the communicator's rank 0
# (op.members[0]) is the judge: whatever report fails its call first (its own, or one relayed
# to it) is the verdict, which it sends to the members it holds connections to as an ABORT
# marked FL_VERDICT; every rank passes a verdict on once (relay_verdict), along the connections
# it holds, as it does an abort: O(p) frames per rank. Any other rank whose call failed with a
# mismatch holds the error (Op.hold; Engine.wait does not return it) until the verdict comes,
# then takes the verdict's report: a rank cannot raise before it knows the verdict. The hold is
# bounded: it ends without a verdict after VERDICT_WAIT, or once the judge is lost (then the
# rank raises with its own report). Calls the mismatch poisoned (note_mismatch) wait for the
# verdict on the call that poisoned them (their text quotes it) or on their own call.
# A verdict counts only from the judge, or (from_judge) relayed by a member to a rank that holds
# no connection to the judge (connections are made on first use): never from a rank outside
# the communicator, nor from another member where the judge can tell this rank itself, nor on
# the judge. Those that come before their call is posted are kept per sender (early_verdicts)
# and the one that counts is taken when the call is posted (take_early_verdict); the rest are
# dropped.
cdef int from_judge(State* e, vector[int]& members, int sender) noexcept nogil:
    """A verdict from rank `sender` counts for a call among `members` (see above)."""
    cdef int judge, k
    cdef size_t i
    cdef Peer* p
    if members.empty():
        return 0
    judge = members[0]
    if sender == judge:
        return 1
    if judge == e.me or judge < 0 or judge >= e.nranks:
        return 0
    for i in range(1, members.size()):
        if members[i] == sender:
            break
    else:
        return 0                        # not a member
    p = e.peers[judge]
    if p != NULL:
        for k in range(<int>p.rails.size()):
            if p.rails[k] != NULL and p.rails[k].state == R_UP:
                return 0                # the judge's own verdict comes this way
    return 1
cdef void await_verdict(State* e, Op* op, uint32_t vseq) noexcept nogil:
    """op failed with a mismatch of its own call (vseq == op.seq) or of the earlier call vseq
    that poisoned it: the judge publishes its report; another rank takes the verdict it has
    already, or holds the error until the verdict comes."""
    if op.p2p or op.state != ST_ERROR or op.err != E_MISMATCH or op.members.empty():
        return
    op.vseq = vseq
    if op.members[0] == e.me:
        keep_verdict(e, op.comm, op.seq, e.me, op.msg)
        relay_verdict(e, op, -1)
        return
    itv = e.verdicts.find(CS(op.comm, vseq))
    if itv != e.verdicts.end():
        take_verdict(e, op, vseq, deref(itv).second.second)
        return
    if vseq != op.seq:
        itv = e.verdicts.find(CS(op.comm, op.seq))
        if itv != e.verdicts.end():
            take_verdict(e, op, op.seq, deref(itv).second.second)
            return
        ita = e.active.find(CS(op.comm, vseq))
        if ita == e.active.end() or not verdict_pending(e, deref(ita).second):
            return                      # the call that poisoned it has settled: its text
    op.hold = 1                         # (e.mismatched) is what the verdict made it
    op.hold_until = mono() + VERDICT_WAIT

cdef void keep_verdict(State* e, uint32_t comm, uint32_t seq, int sender,
                       string msg) noexcept nogil:
    """Remember the verdict on (comm, seq) and the rank it came from (this one: the judge's
    own) (bounded like the aborts: ABORTED_MAX)."""
    if e.verdicts.size() >= ABORTED_MAX and e.verdicts.count(CS(comm, seq)) == 0:
        e.verdicts.erase(e.verdicts.begin())
    e.verdicts[CS(comm, seq)] = pair[int, string](sender, msg)

cdef void keep_early_verdict(State* e, uint32_t comm, uint32_t seq, int sender,
                             string& msg) noexcept nogil:
    """A verdict on a call not posted here yet, kept with its sender (one per sender; bounded:
    ABORTED_MAX in all, over it the lowest (comm, seq, sender) goes)."""
    cdef CSR k = CSR(CS(comm, seq), sender)
    if e.early_verdicts.count(k):
        return
    if e.early_verdicts.size() >= ABORTED_MAX:
        e.early_verdicts.erase(e.early_verdicts.begin())
    e.early_verdicts[k] = msg

cdef int take_early_verdict(State* e, uint32_t comm, uint32_t seq,
                            vector[int]& members) noexcept nogil:
    """At the post of call (comm, seq) among `members`: the early verdict that counts (the
    judge's, else a member's relay where from_judge takes it) becomes the call's verdict
    (keep_verdict); every early verdict on the call is dropped. 1 if one counted."""
    cdef int best = -1, sender
    cdef string msg
    it = e.early_verdicts.lower_bound(CSR(CS(comm, seq), -1))
    while it != e.early_verdicts.end() and deref(it).first.first == CS(comm, seq):
        sender = deref(it).first.second
        if (best < 0 or sender == members[0]) and from_judge(e, members, sender):
            best = sender
            msg = deref(it).second
        it = e.early_verdicts.erase(it)
    if best < 0:
        return 0
    keep_verdict(e, comm, seq, best, msg)
    return 1

cdef void drop_early_verdicts(State* e, uint32_t comm, uint32_t seq) noexcept nogil:
    it = e.early_verdicts.lower_bound(CSR(CS(comm, seq), -1))
    while it != e.early_verdicts.end() and deref(it).first.first == CS(comm, seq):
        it = e.early_verdicts.erase(it)

cdef void relay_verdict(State* e, Op* op, int skip) noexcept nogil:
    """Send the verdict on op's call to its other members (but `skip`, who sent it here)."""
    cdef size_t i
    cdef pair[int, string] v        # a copy: a send that fails a rail may change the table
    itv = e.verdicts.find(CS(op.comm, op.seq))
    if itv == e.verdicts.end():
        return
    v = deref(itv).second
    for i in range(op.members.size()):
        if op.members[i] != e.me and op.members[i] != skip:
            send_abort(e, op.members[i], FL_VERDICT, op.comm, op.seq, E_MISMATCH,
                       v.second.c_str())

cdef void take_verdict(State* e, Op* op, uint32_t vseq, string& report) noexcept nogil:
    """op's error becomes the verdict on call vseq: its own call's report, or quoted as the
    report of the earlier call that poisoned it."""
    cdef char buf[POISON_TEXT]
    if vseq == op.seq:
        op.msg = report
        itm = e.mismatched.find(op.comm)
        if itm != e.mismatched.end() and deref(itm).second.first == op.seq:
            deref(itm).second.second = report      # what later calls it poisons quote
    else:
        poison_text(buf, POISON_TEXT, vseq, op.seq, report.c_str())
        op.msg = string(<const char*>buf)
    op.hold = 0
    e.signal = 1

cdef void on_verdict(State* e, PairRail* r, string& report) noexcept nogil:
    """The judge's verdict on collective (comm, seq), from a peer: fail the call with it if it
    still runs (or when it is posted), pass it on once, and give it to the calls holding
    their error for it; ignored where it does not come from the judge (from_judge)."""
    cdef r2_hdr* h = &r.rh
    cdef Op* op = NULL
    cdef vector[Op*] held
    cdef size_t i
    if h.aux != E_MISMATCH or e.verdicts.count(CS(h.comm, h.seq)):
        return                          # not a mismatch's, or seen already (relayed once)
    ita = e.active.find(CS(h.comm, h.seq))
    if ita != e.active.end():
        op = deref(ita).second
        if not from_judge(e, op.members, r.peer):
            return
        keep_verdict(e, h.comm, h.seq, r.peer, report)
        if op.state == ST_ACTIVE:
            fail_op(e, op, E_MISMATCH, report.c_str(), 0)
        relay_verdict(e, op, r.peer)
    elif not seq_is_past(e, h.comm, h.seq):
        keep_early_verdict(e, h.comm, h.seq, r.peer, report)   # post_op takes it, checked,
        return                                                 # and passes it on then
    it = e.active.lower_bound(CS(h.comm, 0))
    while it != e.active.end() and deref(it).first.first == h.comm:
        if deref(it).second.hold and (deref(it).second.vseq == h.seq or
                                      deref(it).first.second == h.seq) and \
                from_judge(e, deref(it).second.members, r.peer):
            held.push_back(deref(it).second)
        inc(it)
    for i in range(held.size()):
        take_verdict(e, held[i], h.seq, report)     # (h.seq: its own call, or its vseq)

cdef int verdict_pending(State* e, Op* op) noexcept nogil:
    """op's error still waits for the judge's verdict (not past VERDICT_WAIT, the judge not
    lost); a hold that ran out ends here (the rank raises with its own report)."""
    cdef int judge
    cdef Peer* p = NULL
    if not op.hold:
        return 0
    judge = op.members[0]
    if 0 <= judge < e.nranks:
        p = e.peers[judge]
    if mono() < op.hold_until and (p == NULL or not p.lost):
        return 1
    op.hold = 0
    return 0
