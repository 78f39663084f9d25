# The chunk scheduler: which chunk leaves next, and on which rail. A pair's ready queue (hot
# chunks, released by a dependency, ahead of bulk ones), each rail's window and measured rate,
# striping over the rails (pump_peer) and tail copies on a faster rail (hedge_tail). Policy
# only: tx.pxi writes the bytes, and the acks that free window room arrive in failover.pxi.

cdef inline void ready_pop(Peer* p) noexcept nogil:
    p.ready.pop_front()
    if p.nhot > 0:
        p.nhot -= 1

cdef inline void ready_push(Peer* p, CRef ref, int hot) noexcept nogil:
    """Queue a chunk for its peer. A hot chunk (one a dependency just released: the next stage
    of a pipeline) goes ahead of the bulk chunks that were ready when their operation was
    posted, after the hot ones already queued. Without this a pipelined schedule runs
    breadth-first: a ring's later steps, or a degraded host's folded blocks, wait behind all of
    a first step's bytes, and the pipeline's fill and drain grow with the message."""
    if hot:
        p.ready.insert(p.ready.begin() + p.nhot, ref)
        p.nhot += 1
    else:
        p.ready.push_back(ref)

cdef void send_chunk_ready(State* e, SendMsg* sm, uint32_t c, int hot) noexcept nogil:
    """Chunk c of sm has nothing left to wait for: queue it (hot: a dependency released it).
    An owned send copies the chunk now, and from then on its source region is free, so what
    waited on it may go ahead."""
    cdef CRef ref
    cdef size_t i
    cdef uint64_t off = <uint64_t>c * sm.cs
    sm.cstate[c] = C_QUEUED
    ref.m = <void*>sm
    ref.c = c
    ready_push(e.peers[sm.peer], ref, hot)
    if sm.owned:
        if sm.total:                    # (an empty message may have no buffer: memcpy(NULL) is UB)
            memcpy(sm.base + off, sm.src + off, chunk_len(sm.total, sm.cs, c))
        for i in range(sm.succ.size()):
            gate_release(e, sm.succ[i], c)

cdef void gate_release(State* e, Dep d, uint32_t c) noexcept nogil:
    cdef SendMsg* sm
    cdef RecvMsg* rm
    cdef char* data
    cdef CRef ref
    if d.is_send:
        sm = <SendMsg*>d.m
        sm.gate[c] -= 1
        if sm.gate[c] == 0 and sm.cstate[c] == C_GATED:
            send_chunk_ready(e, sm, c, 1)
    else:
        rm = <RecvMsg*>d.m
        rm.gate[c] -= 1
        if rm.gate[c] == 0 and rm.cdone[c] == 1:
            data = rm.held[c]
            rm.held[c] = NULL
            apply_chunk(e, rm, c, data)
            free(data)

cdef inline double max_d(double a, double b) noexcept nogil:
    return a if a > b else b

cdef inline double min_d(double a, double b) noexcept nogil:
    return a if a < b else b

cdef double SLOW_RAIL = 0.25   # a rail this much slower than a busy one does not take its chunks

cdef inline bint rate_chunk(SendMsg* m, uint32_t ln) noexcept nogil:
    """Whether a chunk counts for its rail's measured rate. Small ones do not: their time is
    latency, not bandwidth, and delayed acks keep them outstanding across the idle gaps
    between operations, so an 8-byte allreduce loop read as a rail of a few MB/s. Rates
    measured that way, alike on healthy rails, made the tail hedge copy 512 KiB chunks onto
    the other rail of a 1 MiB allreduce (0.7x the time without hedging on loopback)."""
    return ln > LAZY_ACK_MAX or (m.total > m.cs and ln == m.cs)

cdef inline void untrack(PairRail* r, SendMsg* m, uint32_t ln) noexcept nogil:
    """A chunk left r's in-flight list (acknowledged, delivered elsewhere, or purged)."""
    r.inflight_bytes -= ln
    if rate_chunk(m, ln):
        r.meas_inflight -= ln if r.meas_inflight >= ln else r.meas_inflight

cdef inline void measure_rate(PairRail* r, uint32_t nbytes) noexcept nogil:
    """Throughput of a busy rail: acknowledged bytes over time with data outstanding,
    smoothed (EWMA), sampled once two chunks (of the size just acknowledged) were
    acknowledged over >= 5 ms, or all that was out (a lone chunk: the only measurement a
    rail that the striping avoids gets), or any over >= 50 ms, or four chunks and 1 MiB within 0.5 ms
    (a fast rail adapts quickly). A slow or degraded rail shows up within a few chunks, and
    the striping then gives it less. Acks come a chunk at a time and in bursts (behind the
    other direction's data): samples of one chunk, or 1 MiB of acks bunched in 0.5 ms, read
    equal 500 Mbit/s rails (62.5 MB/s) at 36 to 977 MB/s (bench/testbed_flap.py)."""
    cdef double now = mono(), dt
    r.meas_bytes += nbytes
    dt = now - r.meas_t0
    if r.meas_bytes > 0 and ((dt >= 0.005 and (r.meas_bytes >= 2 * <uint64_t>nbytes or
                                                r.meas_inflight == 0)) or dt >= 0.05
                             or (r.meas_bytes >= (1 << 20) and r.meas_bytes >= 4 * <uint64_t>nbytes
                                 and dt >= 0.0005)):
        sample = r.meas_bytes / dt
        r.rate = sample if r.rate == 0 else 0.7 * r.rate + 0.3 * sample
        r.meas_t0 = now
        r.meas_bytes = 0

cdef int start_chunk(State* e, Peer* p, PairRail* r) noexcept nogil:
    """Take the next queued chunk of this pair for rail r, if its window has room."""
    cdef CRef ref
    cdef SendMsg* m
    cdef uint32_t ln
    while not p.ready.empty():
        ref = p.ready.front()
        m = <SendMsg*>ref.m
        if (m.cstate[ref.c] & C_STATE) != C_QUEUED:
            ready_pop(p)
            continue
        ln = chunk_len(m.total, m.cs, ref.c)
        if r.inflight_bytes > 0 and r.inflight_bytes + ln > rail_window(e, r):
            return 0
        ready_pop(p)
        m.cstate[ref.c] = C_INFLIGHT | (m.cstate[ref.c] & C_RESENT)
        m.crail[ref.c] = <int8_t>r.index
        begin_tx(r, ref, ln, mono())
        return 1
    return 0

cdef void begin_tx(PairRail* r, CRef ref, uint32_t ln, double now) noexcept nogil:
    """Put chunk ref on rail r: count it in flight there and make it the frame being written."""
    cdef SendMsg* m = <SendMsg*>ref.m
    if r.inflight.empty() and r.ghosts == 0:
        r.last_progress = now
    if rate_chunk(m, ln):
        if r.meas_inflight == 0:
            r.meas_t0 = now                  # idle time is not counted against the rate
            r.meas_bytes = 0
        r.meas_inflight += ln
    r.inflight.push_back(ref)
    r.inflight_bytes += ln
    hdr_encode(&r.tx_hdr, F_DATA, m.flags | (FL_LAZY_ACK if m.owned and ln <= LAZY_ACK_MAX else 0),
               m.dtype, m.redop, m.comm, m.seq, m.step, m.count, ref.c, ln, m.total, m.aux)
    r.tx_payload = m.base + <uint64_t>ref.c * m.cs
    r.tx_ref = ref
    r.tx_plen = ln
    r.tx_done = 0
    r.tx_busy = 1
    r.tx_id += 1
    r.tx_posted = 0
    r.tx_post_t = 0
    r.tx_sealed = 0

cdef PairRail* declared_rail(Peer* p, SendMsg* m, uint32_t ln) noexcept nogil:
    """The up rail a message with declared rail shares (the plan's rail weights) owes the next
    chunk: the one furthest behind its share, (bytes put on it + ln) / share smallest; NULL
    when no rail with a share is up (the measured striping then takes over, as it does while
    the rail chosen here has chunks out and its acks are late: pump_peer)."""
    cdef int k
    cdef PairRail* r
    cdef PairRail* best = NULL
    cdef double score, best_score = 0
    for k in range(p.nrails):
        if <size_t>k >= m.rw.size():
            break
        r = p.rails[k]
        if r.state != R_UP or m.rw[k] <= 0:
            continue
        score = (m.rw_sent[k] + ln) / m.rw[k]
        if best == NULL or score < best_score:
            best = r
            best_score = score
    return best

cdef void pump_peer(State* e, Peer* p) noexcept nogil:
    """Flush what each connection holds, then stripe queued chunks: each goes to the rail with
    window room and an idle socket on which it would be through soonest (unacknowledged bytes
    plus the chunk, over measured rate times weight), or waits for a busy rail that is much
    sooner. A slow or stalled rail keeps its bytes unacknowledged and so gets fewer chunks."""
    cdef int k
    cdef PairRail* r
    cdef PairRail* best
    cdef PairRail* busy
    cdef double score, best_score, rate, best_rate, busy_score, busy_speed = 0, best_speed = 0
    cdef bint best_stale = 0
    cdef double now = mono()
    cdef CRef ref
    cdef SendMsg* m
    cdef uint32_t ln
    for k in range(p.nrails + 1):
        r = p.rails[k]
        if r.state == R_UP and (r.tx_busy or r.txq.size() > r.txq_pos):
            rail_write(e, r)
    best_rate = 0
    for k in range(p.nrails):
        if p.rails[k].state == R_UP and p.rails[k].rate > best_rate:
            best_rate = p.rails[k].rate
    while not p.ready.empty():
        best = NULL
        best_score = 0
        # a message pinned to one rail (bandwidth probes) waits for that rail while it is up
        ref = p.ready.front()
        m = <SendMsg*>ref.m
        if (m.cstate[ref.c] & C_STATE) != C_QUEUED:
            ready_pop(p)
            continue
        if m.pin >= 0 and m.pin < p.nrails and p.rails[m.pin].state == R_UP:
            r = p.rails[m.pin]
            if r.tx_busy or not start_chunk(e, p, r):     # busy, or its window is full
                return
            rail_write(e, r)
            continue
        if m.rw.size() > 0 and m.pin < 0:
            # declared shares (the planner's rail weights for this pair): the chunk waits for
            # the rail its share says is next, as a pinned message waits for its rail, unless
            # that rail's acks are late (then the measured striping below passes it by)
            ln = chunk_len(m.total, m.cs, ref.c)
            r = declared_rail(p, m, ln)
            if r != NULL and (e.noack or r.inflight_bytes == 0 or
                              now - r.last_progress <= quiet_limit(e, r, r.rate)):
                if r.tx_busy or not start_chunk(e, p, r):
                    return
                m.rw_sent[r.index] += ln
                rail_write(e, r)
                continue
        busy = NULL
        busy_score = 0
        for k in range(p.nrails):
            r = p.rails[k]
            if r.state != R_UP:
                continue
            if r.inflight_bytes > 0 and r.inflight_bytes + e.cs > rail_window(e, r):
                continue
            # when would this chunk be through? (a rail not measured yet is taken as fast as
            # the best one, so it gets tried; declared weights scale the measurement)
            rate = r.rate if r.rate > 0 else (best_rate if best_rate > 0 else 1.0)
            score = (r.inflight_bytes + e.cs) / (rate * r.weight)
            if r.tx_busy:
                if e.noack or now - r.last_progress > quiet_limit(e, r, r.rate):
                    continue      # its socket is full and its acks are late: not worth waiting for
                if busy == NULL or score < busy_score:
                    busy = r
                    busy_score = score
                    busy_speed = rate * r.weight
            elif best == NULL or score < best_score:
                best = r
                best_score = score
                best_speed = rate * r.weight
                # idle for 4 of its chunk times (50 ms at least): its rate is stale, and only
                # a chunk can measure it again (a NIC back at its rate after a degradation)
                # (at most 1 s: a rail measured at a crawl, e.g. just after its re-admission
                # under load, otherwise waited 4 of its slow chunk times, many seconds, before
                # a busy faster rail let it have a chunk and be measured again. A stream of
                # single-chunk messages with the faster rail idle still never tries it: each
                # goes where it is through soonest, which is right for latency)
                best_stale = r.inflight.empty() and r.ghosts == 0 and \
                    now - r.last_progress > max_d(0.05, min_d(4.0 * e.cs / rate, 1.0))
        # The chunk goes to the idle rail it would be through soonest on, unless that rail is
        # slow (under a quarter of the speed of a rail whose socket is still busy with a
        # frame) and the busy rail would have it through sooner: then it waits for that rail
        # (an ack or room in its socket pumps again). Without the wait a fast rail, which
        # keeps its socket full under a stream, lost a chunk to a rail at 1/10 of its rate
        # each time that one went idle: 512 KiB, 84 ms at 50 Mbit/s against 8 ms on the fast
        # rail, an eighth of every 4 MiB allreduce, and each op waited for it
        # (bench/testbed_slow_rail.py: 85-109 ms against 68 ms on NIC 0 alone). Rails of about
        # the same speed keep taking whichever is free, as before: their measured rates swing
        # with bursts of acks (36 to 175 MB/s, once 977, on equal 500 Mbit/s rails after a
        # reconnect), and at "under half" the waits on those swings made a flap's ops slower
        # (bench/testbed_flap.py: 320-415 against 255-385 ms lost per flap). A slow rail idle
        # for a while still takes a chunk (its tail hedge bounds what that costs): with no
        # chunk it was never measured again, and a NIC restored to its rate after a
        # degradation stayed at the slow rate in the striping (issue 18's torch bench: steps
        # after the repair 180 ms against 112 ms with no wait at all).
        if busy != NULL and (best == NULL or (busy_score < best_score and not best_stale and
                                              best_speed < SLOW_RAIL * busy_speed)):
            return
        if best == NULL or not start_chunk(e, p, best):
            return
        rail_write(e, best)
    hedge_tail(e, p)

cdef inline double quiet_limit(State* e, PairRail* r, double rate) noexcept nogil:
    """How long a rail with chunks out may go without an ack before it counts as late: 5 ms
    plus four chunk times at its rate (20 ms if unmeasured), plus its usual gap between acks
    and four mean deviations of it."""
    return (0.005 + 4.0 * e.cs / rate if rate > 0 else 0.02) + r.gap_avg + 4.0 * r.gap_var

cdef void hedge_tail(State* e, Peer* p) noexcept nogil:
    """Nothing is left to queue for this peer, but another rail still holds chunks that a
    rail with room would deliver much sooner: send copies of them there, the chunk that would
    arrive last first. Whichever copy is acknowledged first completes the chunk; the receiver
    applies the first complete copy and reads the rest of any other into nothing, even one
    whose header came first (rx.pxi: discard_other_copies). Never over a TPF_LATE_READ
    connection (verbs zero-copy), where an ack may let the pages change under the other copy.
    Two cases: a rail that is late (no ack for several times its usual chunk time: stalled or
    suddenly slower than measured) is hedged while the other rail's window has room, so a
    silent failure costs milliseconds rather than the whole rail deadline (which still runs:
    copies delivered elsewhere stay counted as ghosts); a rail that is merely slow (measured
    at under half the other's rate) only when the faster rail has nothing outstanding, since
    then the copies take no bandwidth anything else needed."""
    cdef int kf, ks
    cdef PairRail* f
    cdef PairRail* sl
    cdef CRef ref
    cdef SendMsg* m
    cdef uint32_t ln
    cdef uint64_t after
    cdef double now, t_s, t_f, fr, sr
    cdef Py_ssize_t i
    cdef int sent = 1, late
    if not e.hedge or e.noack or not p.ready.empty():
        return
    now = mono()
    while sent:
        sent = 0
        for kf in range(p.nrails):
            f = p.rails[kf]
            if f.state != R_UP or f.tx_busy or (f.tp.flags & TPF_LATE_READ):
                continue
            fr = f.rate if f.rate > 0 else 1e9    # not measured yet: taken as fast
            if not f.inflight.empty() and now - f.last_progress > quiet_limit(e, f, fr):
                continue                          # late itself: no help
            for ks in range(p.nrails):
                sl = p.rails[ks]
                if ks == kf or sl.state != R_UP or sl.inflight.empty() or \
                        (sl.tp.flags & TPF_LATE_READ):
                    continue
                sr = sl.rate if sl.rate > 0 else 0.0
                late = now - sl.last_progress > quiet_limit(e, sl, sr)
                if not late and (e.hedge < HEDGE_SLOW or sr <= 0 or f.rate <= 0
                                 or sr >= 0.5 * f.rate or f.inflight_bytes > 0):
                    continue
                after = 0
                i = <Py_ssize_t>sl.inflight.size() - 1
                while i >= 0:
                    ref = sl.inflight[i]
                    m = <SendMsg*>ref.m
                    ln = chunk_len(m.total, m.cs, ref.c)
                    t_s = (sl.inflight_bytes - after) / sr if sr > 0 else 1e9
                    after += ln
                    i -= 1
                    if (m.cstate[ref.c] & C_STATE) != C_INFLIGHT or (m.cstate[ref.c] & C_HEDGED) \
                            or m.crail[ref.c] != ks or m.pin >= 0:
                        continue                  # (a pinned message measures its own rail)
                    t_f = (f.inflight_bytes + ln) / fr
                    if not late and t_s < 2.0 * t_f + 0.002:
                        break                     # the earlier ones are even sooner: done
                    if f.inflight_bytes > 0 and f.inflight_bytes + ln > rail_window(e, f):
                        break
                    m.cstate[ref.c] |= C_HEDGED
                    f.bytes_hedged += ln
                    begin_tx(f, ref, ln, now)
                    rail_write(e, f)
                    sent = 1
                    break
                if f.tx_busy or f.state != R_UP:
                    break
