# Receiving: rail_read takes a rail's stream apart, headers are validated (in mac mode nothing
# is acted on before the frame's tag verifies) and dispatched, a DATA payload's place is chosen
# before it is read, then it is acknowledged and copied or reduced into the receive
# (apply_chunk, deliver_chunk). A frame that does not fit is refused and closes its rail.

cdef void discard_other_copies(State* e, RecvMsg* rm, uint32_t c) noexcept nogil:
    """Chunk c of rm is being applied: a rail still reading another copy of it (hedged, or
    re-sent after a failure, its header parsed first) reads the rest of that copy into nothing,
    so no byte of a chunk reaches the user's buffer after the chunk was applied (a zero-copy
    sender may already have rewritten the pages the late copy is read from)."""
    cdef Peer* p = e.peers[rm.peer] if rm.peer >= 0 and rm.peer < e.nranks else NULL
    cdef PairRail* t
    cdef int k
    if p == NULL:
        return
    for k in range(p.nrails):
        t = p.rails[k]
        if t.rstate == 1 and t.rmsg == <void*>rm and t.rh.chunk == c and \
                (t.rkind == K_DIRECT or t.rkind == K_STAGE):
            t.rkind = K_TRASH
            t.rtarget = NULL
            t.rmsg = NULL

cdef void apply_chunk(State* e, RecvMsg* rm, uint32_t c, const char* data) noexcept nogil:
    cdef uint32_t ln = chunk_len(rm.total, rm.cs, c)
    cdef char* dst = rm.base + <uint64_t>c * rm.cs
    cdef size_t i
    discard_other_copies(e, rm, c)
    if data != NULL and ln:
        if rm.mode == M_COPY:
            memcpy(dst, data, ln)
        elif rm.mode == M_REDUCE_SEND:
            reduce3(dst, rm.src + <uint64_t>c * rm.cs, data, ln, rm.dtype, rm.redop)
        elif rm.mode == M_REDUCE_SEND_REV:
            reduce3(dst, data, rm.src + <uint64_t>c * rm.cs, ln, rm.dtype, rm.redop)
        else:
            reduce_into(dst, data, ln, rm.dtype, rm.redop, rm.mode == M_REDUCE_REV)
    rm.cdone[c] = 2
    rm.napplied += 1
    if rm.op != NULL:
        rm.op.nbytes_recv += ln
    for i in range(rm.succ.size()):
        gate_release(e, rm.succ[i], c)
    if rm.napplied == rm.nchunks and not rm.done:
        rm.done = 1
        op_msg_done(e, rm.op)

cdef void deliver_chunk(State* e, RecvMsg* rm, uint32_t c, char* data) noexcept nogil:
    """A whole chunk arrived in a private malloc'd buffer (ownership passes here)."""
    if c >= rm.nchunks or rm.cdone[c] != 0:
        free(data)
        return
    if rm.gate != NULL and rm.gate[c] > 0:
        rm.held[c] = data
        rm.cdone[c] = 1
        return
    apply_chunk(e, rm, c, data)
    free(data)

cdef void rx_refuse(State* e, PairRail* r, const char* why) noexcept nogil:
    """A frame that passed the header check but cannot be taken in (it contradicts the message
    layout, or memory for it ran out): report it and close the connection, like a malformed
    header. Nothing of it is acknowledged, so the sender re-sends on another rail."""
    add_event(e, EV_BAD_FRAME, r.peer, r.index, e.me, r.rh.len, 0, why)
    fail_rail(e, r, "malformed frame", e.me, 1)

cdef void drop_peer_unexpected(State* e, Peer* p) noexcept nogil:
    """Forget every unexpected message of peer p (collective and point-to-point); a pair
    state nothing of this rank waits on goes too."""
    cdef Key lo = mkey(p.rank, 0, 0, 0, 0)
    cdef P2PState* st
    it = e.cunexp.lower_bound(lo)
    while it != e.cunexp.end() and (deref(it).first.first >> 32) == <uint64_t>p.rank:
        free_unexp(e, deref(it).second)
        it = e.cunexp.erase(it)
    itp = p.p2p.begin()
    while itp != p.p2p.end():
        st = deref(itp).second
        itu = st.unexp.begin()
        while itu != st.unexp.end():
            free_unexp(e, deref(itu).second)
            inc(itu)
        st.unexp.clear()
        if st.posted.empty() and st.bound.empty():
            del st
            itp = p.p2p.erase(itp)
        else:
            inc(itp)

cdef void unexp_overflow(State* e, PairRail* r) noexcept nogil:
    """Peer r.peer sent more unexpected data (messages no receive here wants yet) than this
    rank keeps: its unexpected messages are dropped, every operation of this rank with it
    fails with the reason (its own calls get the abort), and the frame is refused."""
    cdef char buf[400]
    cdef Peer* p = e.peers[r.peer]
    snprintf(buf, 400, "rank %d sent more unexpected data (messages no receive on rank %d wants "
             "yet) than rank %d keeps: %u messages / %llu bytes held, at most %u / %llu "
             "(R2COMM_UNEXPECTED_MSGS / R2COMM_UNEXPECTED_BYTES); its unexpected messages were "
             "dropped", r.peer, e.me, e.me, e.unexp_msgs, <unsigned long long>e.unexp_bytes,
             e.unexp_max_msgs, <unsigned long long>e.unexp_max_bytes)
    drop_peer_unexpected(e, p)
    fail_peer_ops(e, p, E_PROTOCOL, buf)
    rx_refuse(e, r, buf)

cdef inline bint unexp_room(State* e, uint32_t nmsgs, uint64_t nbytes) noexcept nogil:
    """The unexpected-message store can take nmsgs more messages and nbytes more payload."""
    return e.unexp_msgs + <uint64_t>nmsgs <= e.unexp_max_msgs and \
        e.unexp_bytes + nbytes <= e.unexp_max_bytes

cdef int rx_unexp_target(State* e, PairRail* r, Unexp* u) noexcept nogil:
    """Buffer a DATA payload for an unexpected message: only a chunk that fits the message the
    first frame announced (same total, in range, exactly its length), so a buffered chunk is
    never shorter than what is later copied out of it. -1 if the frame was refused."""
    cdef r2_hdr* h = &r.rh
    if h.total != u.total or h.chunk >= u.nchunks or h.len != chunk_len(u.total, u.cs, h.chunk):
        rx_refuse(e, r, "DATA frame does not fit the message its first chunk announced "
                  "(total, chunk index or length): connection closed")
        return -1
    if u.chunks.count(h.chunk) == 0:
        if not unexp_room(e, 0, h.len):
            unexp_overflow(e, r)
            return -1
        r.rtarget = <char*>malloc(h.len if h.len else 1)
        if r.rtarget == NULL:
            rx_refuse(e, r, "out of memory for an unexpected chunk: connection closed")
            return -1
        r.rkind = K_BUF
    return 0

cdef void rx_data_header(State* e, PairRail* r) noexcept nogil:
    """Decide where the payload of a DATA frame goes before reading it."""
    cdef r2_hdr* h = &r.rh
    cdef Peer* p = e.peers[r.peer]
    cdef RecvMsg* rm = NULL
    cdef Unexp* u
    cdef P2PState* st
    cdef Key k
    cdef uint32_t upto
    cdef uint32_t c = h.chunk
    r.rmsg = NULL
    r.rkind = K_TRASH
    r.rtarget = NULL
    if h.total > MAX_MESSAGE:
        rx_refuse(e, r, "DATA frame announces a message over 1 TiB: connection closed")
        return
    if h.flags & FL_VOID:
        if not (h.flags & FL_P2P) or h.total != 0:
            rx_refuse(e, r, "void frame that is not an empty point-to-point frame: connection "
                      "closed")
            return
        p2p_void(e, r)                  # (acknowledged like any DATA frame)
        return
    if h.flags & FL_P2P:
        if p.p2p.count(h.comm) == 0 and not unexp_room(e, 1, 0):
            unexp_overflow(e, r)        # (a pair state for an id nobody here used)
            return
        st = p2p_state(p, h.comm)
        itb = st.bound.find(h.seq)
        itu0 = st.unexp.find(h.seq)
        if itb != st.bound.end():
            rm = <RecvMsg*>deref(itb).second
        elif itu0 != st.unexp.end():
            if deref(itu0).second.flags & FL_VOID:
                return                  # stale: its sender gave that message up
        elif p2p_seen(st, h.seq):
            return                      # stale: that message completed already
        else:
            if not unexp_room(e, 1, 0):
                unexp_overflow(e, r)
                return
            u = new_unexp(e, h, e.cs)
            if u == NULL:
                rx_refuse(e, r, "out of memory for an unexpected message: connection closed")
                return
            u.peer = p.rank
            st.unexp[h.seq] = u
            upto = st.seen_upto
            p2p_mark_seen(st, h.seq)
            p2p_index_ready(e, st, upto)
            p2p_try_match(e, p, st, h.comm)
            itb = st.bound.find(h.seq)
            if itb != st.bound.end():
                rm = <RecvMsg*>deref(itb).second
    else:
        k = mkey(r.peer, h.comm, 0, h.step, h.seq)
        itr = e.rmap.find(k)
        if itr != e.rmap.end():
            rm = <RecvMsg*>deref(itr).second
            if check_match(e, rm, h.count, h.total, h.dtype, r.peer, h.aux, h.redop) != 0:
                return
        else:
            if seq_is_past(e, h.comm, h.seq):
                ita = e.active.find(CS(h.comm, h.seq))
                if ita != e.active.end() and deref(ita).second.state == ST_ACTIVE:
                    # a frame this rank's schedule does not contain: another call
                    fail_mismatch(e, deref(ita).second, r.peer, h.aux, h.count, h.dtype, h.redop)
                return                  # stale (completed or failed operation)
            itu = e.cunexp.find(k)
            if itu == e.cunexp.end():
                if not unexp_room(e, 1, 0):
                    unexp_overflow(e, r)
                    return
                u = new_unexp(e, h, e.cs)
                if u == NULL:
                    rx_refuse(e, r, "out of memory for an unexpected message: connection closed")
                    return
                e.cunexp[k] = u
            else:
                u = deref(itu).second
            rx_unexp_target(e, r, u)
            return
    if rm == NULL:
        # p2p message that nobody has asked for yet, or whose match just failed (truncation,
        # dtype): then the unexpected entry is gone and the payload is dropped
        itu3 = st.unexp.find(h.seq)
        if itu3 == st.unexp.end():
            return
        rx_unexp_target(e, r, deref(itu3).second)
        return
    if rm.op == NULL or rm.op.state != ST_ACTIVE:
        return
    if c >= rm.nchunks or h.len != chunk_len(rm.total, rm.cs, c):
        fail_op(e, rm.op, E_PROTOCOL, "chunk boundaries differ between ranks (R2COMM_CHUNK_SIZE "
                "must be the same on every rank)", 1)
        return
    if rm.cdone[c] != 0:
        return                          # duplicate: already delivered
    r.rmsg = <void*>rm
    if rm.gate[c] > 0:
        r.rtarget = <char*>malloc(h.len if h.len else 1)
        if r.rtarget == NULL:
            rx_refuse(e, r, "out of memory for a gated chunk: connection closed")
            return
        r.rkind = K_BUF
    elif rm.mode == M_COPY:
        r.rkind = K_DIRECT
        r.rtarget = rm.base + <uint64_t>c * rm.cs
    else:
        r.rkind = K_STAGE
        r.rtarget = r.stage

cdef void rx_data_done(State* e, PairRail* r) noexcept nogil:
    """A DATA payload is complete: acknowledge it and deliver it."""
    cdef r2_hdr* h = &r.rh
    cdef RecvMsg* rm
    cdef Unexp* u
    cdef P2PState* st
    cdef Key k
    cdef uint32_t c = h.chunk
    cdef int kr
    cdef Peer* p
    cdef bint placed = r.rkind == K_DIRECT or r.rkind == K_STAGE   # into a posted receive
    rm = <RecvMsg*>r.rmsg if placed else NULL
    if not e.noack:
        if h.flags & FL_LAZY_ACK:
            queue_lazy_ack(e, r, h)
        elif rm != NULL and rm.cdone[c] == 0 and rm.napplied + 1 < rm.nchunks:
            # more of this message is still to come: its ack waits for a frame to ride with
            # (the ring sends both ways) or DACK_DELAY, which saves a write per chunk
            queue_lazy_ack(e, r, h)
        else:
            # the message is complete (or this chunk is a duplicate, or unexpected): the
            # sender's operation waits for these acks, so they all go now, on every rail
            p = e.peers[r.peer]
            for kr in range(p.nrails):
                flush_lazy_acks(e, p.rails[kr])
            queue_ctrl(e, r, F_ACK, h.flags, h.comm, h.seq, h.step, c, 0, NULL, 0)
    if placed:
        if rm != NULL and rm.cdone[c] == 0:
            apply_chunk(e, rm, c, r.rtarget if r.rkind == K_STAGE else NULL)
    elif r.rkind == K_BUF:
        rm = NULL
        u = NULL
        if h.flags & FL_P2P:
            itp = e.peers[r.peer].p2p.find(h.comm)      # (gone if dropped meanwhile)
            if itp != e.peers[r.peer].p2p.end():
                st = deref(itp).second
                itb = st.bound.find(h.seq)
                if itb != st.bound.end():
                    rm = <RecvMsg*>deref(itb).second
                else:
                    itu2 = st.unexp.find(h.seq)
                    if itu2 != st.unexp.end():
                        u = deref(itu2).second
        else:
            k = mkey(r.peer, h.comm, 0, h.step, h.seq)
            itr = e.rmap.find(k)
            if itr != e.rmap.end():
                rm = <RecvMsg*>deref(itr).second
            else:
                itu = e.cunexp.find(k)
                if itu != e.cunexp.end():
                    u = deref(itu).second
        if rm != NULL and rm.op != NULL and rm.op.state == ST_ACTIVE and rm.cdone != NULL \
                and h.len == chunk_len(rm.total, rm.cs, c):
            deliver_chunk(e, rm, c, r.rtarget)
        elif u != NULL and c < u.nchunks and u.chunks.count(c) == 0:
            u.chunks[c] = r.rtarget
            u.nrecv += 1
            u.nbytes += h.len
            e.unexp_bytes += h.len
        else:
            free(r.rtarget)
    r.rtarget = NULL
    r.rmsg = NULL
    r.rkind = K_NONE

cdef int rx_header(State* e, PairRail* r) noexcept nogil:
    """Validate and dispatch a header. Returns -1 if the connection was closed."""
    cdef int bad = hdr_validate(&r.rh, e.cs)
    if bad != 0:
        add_event(e, EV_BAD_FRAME, r.peer, r.index, e.me, 0, 0,
                  "malformed frame (bad magic, checksum, type or length): connection closed")
        fail_rail(e, r, "malformed frame", e.me, 1)
        return -1
    r.rgot = 0
    if r.rh.type == F_DATA:
        if r.index >= e.peers[r.peer].nrails:
            rx_refuse(e, r, "DATA frame on the control connection: connection closed")
            return -1
        rx_data_header(e, r)
        if r.state != R_UP:
            return -1
        r.rstate = 1
        if r.rh.len == 0:
            rx_data_done(e, r)
            r.rstate = 0
    elif r.rh.type == F_ACK:
        on_ack(e, r)
    elif r.rh.type == F_RAIL_DOWN:
        on_rail_down(e, r)
    elif r.rh.type == F_RAIL_DOWN_ACK:
        on_rail_down_ack(e, r)
    elif r.rh.type == F_ABORT:
        r.rtarget = <char*>malloc(r.rh.len + 1)
        if r.rtarget == NULL:
            rx_refuse(e, r, "out of memory for an abort message: connection closed")
            return -1
        r.rkind = K_CTRL
        r.rstate = 1
        if r.rh.len == 0:
            on_abort(e, r, r.rtarget, 0)
            free(r.rtarget)
            r.rtarget = NULL
            r.rstate = 0
    return 0 if r.state == R_UP else -1

cdef int rx_mac_header(State* e, PairRail* r) noexcept nogil:
    """mac mode: check a header's form only; the frame's payload goes to the rail's mbuf and
    nothing acts on it until its tag verifies (rx_mac_done). Returns -1 if closed."""
    if hdr_validate(&r.rh, e.cs) != 0 or r.rh.len > r.mbuf_cap:
        add_event(e, EV_BAD_FRAME, r.peer, r.index, e.me, 0, 0,
                  "malformed frame (bad magic, checksum, type or length): connection closed")
        fail_rail(e, r, "malformed frame", e.me, 1)
        return -1
    r.rgot = 0
    r.rkind = K_NONE
    r.rtarget = r.mbuf
    r.rstate = 1 if r.rh.len > 0 else 2
    return 0

cdef int rx_mac_done(State* e, PairRail* r) noexcept nogil:
    """mac mode: the tag of the frame in r.rh / r.mbuf has arrived. A frame that does not
    verify (altered, replayed, reordered, or from another connection) closes the connection:
    its payload never reaches a user buffer, and the sender re-sends its unacknowledged chunks
    on the surviving rails. A good one is then handled as if it had just arrived."""
    cdef uint8_t want[16]
    cdef char* held = r.mbuf
    cdef uint32_t n = r.rh.len
    r.rtarget = NULL
    r.rstate = 0
    frame_mac(&r.rx_key, &r.rh, HDR_SIZE, held, n, r.rx_ctr, want)
    if not tag_equal(want, r.rx_tag, MAC_LEN):
        add_event(e, EV_BAD_FRAME, r.peer, r.index, e.me, 0, 0,
                  "frame MAC mismatch (altered, replayed or reordered in the stream): "
                  "connection closed")
        fail_rail(e, r, "frame MAC mismatch", e.me, 1)
        return -1
    r.rx_ctr += 1
    if rx_header(e, r) < 0:
        return -1
    if r.rstate == 1:                   # a payload: into the place the header chose
        if r.rtarget != NULL and r.rtarget != held:
            memcpy(r.rtarget, held, n)
        r.rgot = n
        rx_payload_done(e, r)
    return 0 if r.state == R_UP else -1

cdef inline void rx_payload_end(State* e, PairRail* r) noexcept nogil:
    if e.mac:
        r.rstate = 2                    # its tag comes next
    else:
        rx_payload_done(e, r)

cdef void rx_payload_done(State* e, PairRail* r) noexcept nogil:
    if r.rkind == K_CTRL:
        on_abort(e, r, r.rtarget, r.rh.len)
        free(r.rtarget)
        r.rtarget = NULL
        r.rkind = K_NONE
    else:
        rx_data_done(e, r)
    r.rstate = 0

cdef void rail_read(State* e, PairRail* r) noexcept nogil:
    cdef int64_t n
    cdef uint32_t avail, take, need
    cdef int rounds = 0
    while r.state == R_UP and rounds < 64:
        rounds += 1
        need = r.rh.len - r.rgot
        if r.blackhole:
            n = r.tp.irecv(r.conn, e.trash, e.cs)
            if n == 0:
                return
            if n < 0:
                fail_io(e, r, n, "receive")
                return
            continue
        if r.rstate == 1 and r.rpos == r.rlen and need >= DIRECT_MIN and r.rtarget != NULL:
            n = r.tp.irecv(r.conn, r.rtarget + r.rgot, need)
            if n == 0:
                return
            if n < 0:
                fail_io(e, r, n, "receive")
                return
            r.bytes_recv += n
            r.rgot += <uint32_t>n
            if r.rgot == r.rh.len:
                rx_payload_end(e, r)
            continue
        if r.rpos == r.rlen:
            r.rpos = 0
            r.rlen = 0
        elif r.rpos > 0 and r.rlen > RBUF_SIZE // 2:
            memmove(r.rbuf, r.rbuf + r.rpos, r.rlen - r.rpos)
            r.rlen -= r.rpos
            r.rpos = 0
        # small reads for headers and acks: a large payload then goes straight to its target
        # (one copy, kernel to destination) instead of through this buffer
        n = r.tp.irecv(r.conn, r.rbuf + r.rlen, min_u32(RBUF_SIZE - r.rlen, RBUF_READ))
        if n == 0:
            return
        if n < 0:
            fail_io(e, r, n, "receive")
            return
        r.bytes_recv += n
        r.rlen += <uint32_t>n
        while r.state == R_UP:
            avail = r.rlen - r.rpos
            if r.rstate == 0:
                if avail < HDR_SIZE:
                    break
                memcpy(&r.rh, r.rbuf + r.rpos, HDR_SIZE)
                r.rpos += HDR_SIZE
                if (rx_mac_header(e, r) if e.mac else rx_header(e, r)) < 0:
                    return
            elif r.rstate == 2:
                if avail < MAC_LEN:
                    break
                memcpy(r.rx_tag, r.rbuf + r.rpos, MAC_LEN)
                r.rpos += MAC_LEN
                if rx_mac_done(e, r) < 0:
                    return
            else:
                need = r.rh.len - r.rgot
                take = avail if avail < need else need
                if take == 0:
                    break
                if r.rtarget != NULL:
                    memcpy(r.rtarget + r.rgot, r.rbuf + r.rpos, take)
                r.rpos += take
                r.rgot += take
                if r.rgot == r.rh.len:
                    rx_payload_end(e, r)
                else:
                    break
