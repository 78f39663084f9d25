# Sending: the emulated NIC in front of the transport (injected faults), a DATA frame sealed
# into its place in the stream (with its MAC in mac mode), rail_write (control frames, then
# the current chunk, across partial writes), and delayed acks that ride with the next frame.

cdef void queue_ctrl(State* e, PairRail* r, uint8_t type, uint8_t flags, uint32_t comm, uint32_t seq,
                     uint32_t step, uint32_t chunk, uint32_t aux, const char* payload,
                     uint32_t plen) noexcept nogil:
    """Append a small frame (ack or control) to the rail's small-frame queue."""
    cdef r2_hdr h
    if r.state != R_UP:
        return
    hdr_encode(&h, type, flags, 0, 0, comm, seq, step, 0, chunk, plen, 0, aux)
    r.txq.append(<const char*>&h, HDR_SIZE)
    if plen:
        r.txq.append(payload, plen)
    if e.mac:
        txq_tag(r, &h, payload, plen)

cdef void txq_tag(PairRail* r, r2_hdr* h, const char* payload, uint32_t plen) noexcept nogil:
    """Append the MAC of a frame just queued: txq is written in order, so the frame's counter
    in this direction is the next one."""
    cdef uint8_t tag[16]
    frame_mac(&r.tx_key, h, HDR_SIZE, payload, plen, r.tx_ctr, tag)
    r.tx_ctr += 1
    r.txq.append(<const char*>tag, MAC_LEN)

cdef void queue_lazy_ack(State* e, PairRail* r, r2_hdr* d) noexcept nogil:
    """Acknowledge a DATA frame whose sender does not wait for it (a copied, eager send): the
    ack goes out with the next frame this rank writes on the rail, or after DACK_DELAY, which
    saves a write and a wake-up per small message. The echoed flags drop FL_LAZY_ACK, so the
    ack names the message exactly as the sender keyed it."""
    cdef r2_hdr h
    if r.state != R_UP:
        return
    hdr_encode(&h, F_ACK, d.flags & ~FL_LAZY_ACK, 0, 0, d.comm, d.seq, d.step, 0, d.chunk, 0, 0, 0)
    if r.dackq.empty():
        r.dack_t = mono()
        e.dack_rails += 1
        if not r.dack_listed:
            r.dack_listed = 1
            e.dack_list.push_back(r)
    r.dackq.append(<const char*>&h, HDR_SIZE)
    if r.dackq.size() >= DACK_MAX * HDR_SIZE:
        flush_lazy_acks(e, r)

cdef void flush_lazy_acks(State* e, PairRail* r) noexcept nogil:
    """Move the rail's delayed acks into its send queue (the caller writes it)."""
    cdef size_t i = 0
    if r.dackq.empty():
        return
    if e.mac:
        while i < r.dackq.size():
            r.txq.append(r.dackq.data() + i, HDR_SIZE)
            txq_tag(r, <r2_hdr*>(r.dackq.data() + i), NULL, 0)
            i += HDR_SIZE
    else:
        r.txq.append(r.dackq)
    r.dackq.clear()
    e.dack_rails -= 1

cdef void drop_lazy_acks(State* e, PairRail* r) noexcept nogil:
    if not r.dackq.empty():
        r.dackq.clear()
        e.dack_rails -= 1

cdef void lazy_ack_timer(State* e, double now) noexcept nogil:
    """Send the delayed acks that have waited DACK_DELAY. Only the listed rails are looked at;
    a rail whose acks have gone (with a frame, or dropped by a failure) leaves the list."""
    cdef size_t i, kept = 0
    cdef PairRail* r
    for i in range(e.dack_list.size()):
        r = e.dack_list[i]
        if not r.dackq.empty() and now - r.dack_t >= DACK_DELAY:
            flush_lazy_acks(e, r)
            if r.state == R_UP:
                rail_write(e, r)
        if r.dackq.empty():
            r.dack_listed = 0
        else:
            e.dack_list[kept] = r
            kept += 1
    e.dack_list.resize(kept)

cdef int64_t rail_send(State* e, PairRail* r, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    """The emulated NIC in front of the transport: applies injected faults, then posts."""
    cdef int64_t total = iov_total(iov, niov), allowed, n
    cdef int i
    if r.blackhole:
        return total          # silently dropped: nothing reaches the peer
    if r.fault_at >= 0:
        allowed = r.fault_at - <int64_t>r.bytes_sent
        if allowed <= 0:
            inject_now(e, r, r.fault_mode)
            return total if r.blackhole else -32
        if allowed < total:
            for i in range(niov):
                if <int64_t>iov[i].iov_len > allowed:
                    iov[i].iov_len = allowed
                allowed -= iov[i].iov_len
    n = r.tp.isend(r.conn, iov, niov, cookie)
    if n > 0:
        r.bytes_sent += n
    return n

cdef void inject_now(State* e, PairRail* r, int mode) noexcept nogil:
    r.fault_at = -1
    add_event_c(e, EV_FAULT_STRUCK, r.peer, r.index, e.me, r.bytes_sent, 0,
                "silent" if mode == INJ_SILENT else "hard", CAUSE_NONE)
    if mode == INJ_SILENT:
        r.blackhole = 1
        # a dead NIC stops the kernel's acknowledgements too: drop every incoming segment
        # before TCP sees it, so neither end's TCP_INFO shows progress (see judge_rail)
        r2_drop_input(r.tp.os_fd(r.conn))
    else:
        r.fail_cause = CAUSE_LOCAL_NIC
        r.tp.shutdown(r.conn)   # a real hard failure: both ends see the connection die
    if e.fault_time == 0:
        e.fault_time = wall()

cdef void seal_frame(State* e, PairRail* r) noexcept nogil:
    """The DATA frame being written takes its place in the stream: after what txq holds now.
    In mac mode its tag is computed here, with the next counter; frames queued later wait
    until it is written (their counters follow its)."""
    r.tx_sealed = 1
    r.txq_lim = r.txq.size()
    if e.mac:
        frame_mac(&r.tx_key, &r.tx_hdr, HDR_SIZE, r.tx_payload, r.tx_plen, r.tx_ctr, r.tx_tag)
        r.tx_ctr += 1

cdef void tx_complete(State* e, PairRail* r) noexcept nogil:
    """The transport is done with the DATA frame (its completion came): the rail is free."""
    cdef Peer* p = e.peers[r.peer]
    r.tx_busy = 0
    r.tx_sealed = 0
    r.tx_posted = 0
    r.tx_post_t = 0
    if r.tx_orphan != NULL:
        free(r.tx_orphan)
        r.tx_orphan = NULL
    elif e.noack and r.index < p.nrails:
        # benchmark-only mode: written counts as delivered (no loss protection)
        ack_chunk(e, <SendMsg*>r.tx_ref.m, r.tx_ref.c, r)

cdef void rail_reap(State* e, PairRail* r) noexcept nogil:
    """Collect the rail's send completions (transport.pxd's test). Only the frame being
    written has a cookie; any other (a frame of an earlier connection's state) is ignored."""
    cdef uint64_t done[8]
    cdef int i, n
    while r.state == R_UP:
        n = r.tp.test(r.conn, done, 8)
        for i in range(n):
            if r.tx_busy and r.tx_posted and done[i] == r.tx_id:
                tx_complete(e, r)
        if n < 8:
            return

cdef inline int tx_mid(State* e, PairRail* r) noexcept nogil:
    """A DATA frame is being posted and some of its bytes are not yet: in a stream nothing else
    may go before them."""
    return r.tx_busy and not r.tx_posted

cdef void rail_write(State* e, PairRail* r) noexcept nogil:
    cdef iovec iov[4]
    cdef int niov, use_q, k, mid
    cdef int64_t n, left
    cdef size_t qrem
    cdef uint64_t cookie
    cdef uint32_t tlen = MAC_LEN if e.mac else 0
    if not r.dackq.empty() and (r.tx_busy or r.txq.size() > r.txq_pos):
        flush_lazy_acks(e, r)           # the delayed acks ride along with this write
    while r.state == R_UP:
        niov = 0
        use_q = 0
        cookie = 0
        mid = tx_mid(e, r)
        if mid and not r.tx_sealed:
            seal_frame(e, r)
        qrem = r.txq.size() - r.txq_pos
        if mid and e.mac:
            qrem = r.txq_lim - r.txq_pos if r.txq_lim > r.txq_pos else 0
        if qrem > 0 and not (mid and r.tx_done > 0):
            iov[0].iov_base = <void*><char*>(r.txq.data() + r.txq_pos)
            iov[0].iov_len = qrem
            niov = 1
            use_q = 1
        if mid:
            cookie = r.tx_id
            if r.tx_done < HDR_SIZE:
                iov[niov].iov_base = (<char*>&r.tx_hdr) + r.tx_done
                iov[niov].iov_len = HDR_SIZE - r.tx_done
                niov += 1
                iov[niov].iov_base = r.tx_payload
                iov[niov].iov_len = r.tx_plen
                niov += 1
            elif r.tx_done < HDR_SIZE + r.tx_plen:
                iov[niov].iov_base = r.tx_payload + (r.tx_done - HDR_SIZE)
                iov[niov].iov_len = r.tx_plen - (r.tx_done - HDR_SIZE)
                niov += 1
            if tlen:
                k = <int>r.tx_done - HDR_SIZE - <int>r.tx_plen     # tag bytes already sent
                iov[niov].iov_base = r.tx_tag + (k if k > 0 else 0)
                iov[niov].iov_len = tlen - (k if k > 0 else 0)
                niov += 1
        if niov == 0:
            set_out(e, r, 0)
            return
        n = rail_send(e, r, iov, niov, cookie)
        if n < 0:
            fail_io(e, r, n, "send")
            return
        if n == 0:
            set_out(e, r, 1)
            return
        left = n
        if use_q:
            if <size_t>left >= qrem:
                left -= qrem
                if r.txq_pos + qrem == r.txq.size():
                    r.txq.clear()
                    r.txq_pos = 0
                    r.txq_lim = 0
                else:                   # mac mode: the rest follows the sealed frame
                    r.txq_pos += qrem
            else:
                r.txq_pos += left
                left = 0
        if mid and left > 0:
            r.tx_done += <uint32_t>left
            if r.tx_done >= HDR_SIZE + r.tx_plen + tlen:
                r.tx_posted = 1             # all posted: the rail is free at its completion
                if r.blackhole:
                    tx_complete(e, r)       # the emulated dead NIC took it: nothing completes it
                else:
                    rail_reap(e, r)         # (TCP's comes inside the isend)
        # loop: more queued frames or chunks may fit

cdef int txq_empty(State* e) noexcept nogil:
    cdef int i, k
    cdef PairRail* r
    for i in range(e.nranks):
        if e.peers[i] == NULL or e.peers[i].lost:
            continue
        for k in range(e.peers[i].nrails + 1):
            r = e.peers[i].rails[k]
            if r.state == R_UP and (r.tx_busy or r.txq.size() > r.txq_pos or not r.dackq.empty()):
                return 0
    return 1
