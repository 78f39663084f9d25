# EngineLinks, an Engine's link administration (Engine.links): connections handed to the engine
# (attach, attach_transport: control/links.py and the transports' kinds), the fail-back probes'
# schedule (reconnect_due, probe_timeout, probe_failed, mark_unconnected), link states and
# errors, the failure detector's dead peers (peer_dead: control/liveness.py) and the NIC facts
# (set_nic_off and what nicwatch reads: control/nicwatch.py). None of it is on the data path:
# each takes the engine's mutex and leaves the moving of chunks to the progress loop. Included
# into engine.pyx after the Engine class (Cython takes no include inside a class).


cdef class EngineLinks(EnginePart):
    """An Engine's connections and links (Engine.links; C fields: engine.pxd)."""

    # -- connections ---------------------------------------------------------------------------
    def attach(self, int peer, int rail, int fd, uint32_t conn_id, bytes tx_key=b"",
               bytes rx_key=b""):
        """Hand an authenticated, non-blocking connection to the engine as (peer, rail). In
        mac mode (Engine.tuning.set_integrity) tx_key / rx_key are the connection's 32-byte frame keys of each
        direction (tcp.take_keys)."""
        self._attach(peer, rail, self._live().tp, <intptr_t>fd, conn_id, tx_key, rx_key)

    def attach_transport(self, int peer, int rail, uint64_t transport, uint64_t handle,
                         uint32_t conn_id, bytes tx_key=b"", bytes rx_key=b""):
        """As attach, for a connection of another transport: `transport` is the address of
        its transport.pxd table (e.g. r2comm._core.verbs.transport_address()), `handle` what
        its adopt takes (a connected verbs connection, which the engine then owns: closed by
        the engine on failure or close, never by the caller; for shared memory the address of
        a set-up that adopt copies during this call: shm_segments.attach)."""
        if transport == 0 or handle == 0:
            raise ValueError("attach_transport needs a transport table and a connection handle")
        self._attach(peer, rail, <Transport*><intptr_t>transport, <intptr_t>handle, conn_id,
                     tx_key, rx_key)

    def set_shm_peer(self, int peer, bint on=True):
        """`peer` is on this host and its data rail is shared memory: NIC faults
        (Engine.faults.inject, R2COMM_FAULT) do not apply to it. Set before its connections are attached."""
        cdef State* e = self._live()
        if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL:
            raise ValueError(f"no such peer {peer}")
        e.peers[peer].shm = on

    def transports(self):
        """Per peer: the transport name of each data rail's current connection ('' for none
        yet), e.g. {1: ['verbs', 'verbs']}."""
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
                out[i] = [(<bytes>e.peers[i].rails[k].tp.name).decode()
                          if e.peers[i].rails[k].tp != NULL else ""
                          for k in range(e.peers[i].nrails)]
        finally:
            pthread_mutex_unlock(&e.mu)
        return out

    cdef _attach(self, int peer, int rail, Transport* tp, intptr_t handle, uint32_t conn_id,
                 bytes tx_key, bytes rx_key):
        cdef State* e = self._live()
        cdef PairRail* r
        cdef epoll_event ev
        cdef int restored
        cdef const char* tk = tx_key
        cdef const char* rk = rx_key
        cdef void* conn
        if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL or rail < 0 or rail > e.peers[peer].nrails:
            raise ValueError(f"no such peer/rail {peer}/{rail}")
        if e.mac and (len(tx_key) != MAC_KEY_LEN or len(rx_key) != MAC_KEY_LEN):
            raise ValueError(f"integrity mode mac needs {MAC_KEY_LEN}-byte frame keys")
        with nogil:
            pthread_mutex_lock(&e.mu)
            r = e.peers[peer].rails[rail]
            if rail_buffers(e, r, rail < e.peers[peer].nrails) != 0:
                pthread_mutex_unlock(&e.mu)
                with gil:
                    raise MemoryError("no memory for a connection's read and staging buffers")
            if r.state == R_UP:
                fail_rail(e, r, "replaced by a new connection", e.me, 0)
            restored = r.fail_count > 0
            conn = tp.adopt(handle)
            if conn == NULL:
                pthread_mutex_unlock(&e.mu)
                with gil:
                    raise MemoryError("no memory for a connection's transport state")
            r.tp = tp
            r.conn = conn
            r.fd = tp.event_fd(conn)
            r.conn_id = conn_id
            if (tp.flags & TPF_POLLED) and not r.polled_listed:
                r.polled_listed = 1
                e.polled.push_back(r)
                e.npolled = <int>e.polled.size()
            if e.mac:
                b2s_init(&r.tx_key, 32, tk, MAC_KEY_LEN)
                b2s_prepare_more(&r.tx_key)
                b2s_init(&r.rx_key, 32, rk, MAC_KEY_LEN)
                b2s_prepare_more(&r.rx_key)
            r.tx_ctr = 0
            r.rx_ctr = 0
            r.tx_sealed = 0
            r.txq_lim = 0
            r.gen += 1
            r.state = R_UP
            r.want_out = 0
            r.rstate = 0
            r.rpos = 0
            r.rlen = 0
            r.restore_time = mono()
            r.last_progress = r.restore_time
            r.fail_cause = CAUSE_NONE
            r.hc_t = 0
            r.stalled = 0
            ev.events = EPOLLIN
            ev.data.u64 = (<uint64_t>r.gen << 32) | (<uint64_t>peer << 8) | <uint64_t>rail
            if r.fd >= 0:
                epoll_ctl(e.epfd, EPOLL_CTL_ADD, r.fd, &ev)
            e.peers[peer].all_down_since = 0
            e.peers[peer].lost = 0
            if restored and rail < e.peers[peer].nrails:
                add_event(e, EV_RAIL_RESTORED, peer, rail, e.me, 0, 0, "rail re-admitted")
            pump_peer(e, e.peers[peer])
            pthread_mutex_unlock(&e.mu)

    def reconnect_due(self):
        """(peer, rail) pairs that are down and due for a probe, with no injected fault on them."""
        cdef State* e = self._live()
        cdef list out = []
        cdef double now = mono()
        cdef int i, k
        cdef Peer* p
        cdef PairRail* r
        with nogil:
            pthread_mutex_lock(&e.mu)
        try:
            for i in range(e.nranks):
                p = e.peers[i]
                if p == NULL:
                    continue
                for k in range(p.nrails):
                    r = p.rails[k]
                    if r.state == R_DOWN and r.fail_count > 0 and now >= r.next_probe and \
                            not r.nic_off and not fault_injected(e, k, i):
                        out.append((i, k))
        finally:
            pthread_mutex_unlock(&e.mu)
        return out

    def probe_timeout(self, int peer, int rail):
        """How long a fail-back probe of (peer, rail) may take to connect: FAST_PROBE_TIMEOUT
        while the rail is in its fast-probe second (see probe_failed), else 0.3 s."""
        cdef State* e = self._live()
        cdef PairRail* r
        cdef double t = 0.3
        with nogil:
            pthread_mutex_lock(&e.mu)
            r = e.peers[peer].rails[rail]
            if fast_probing(e, r, mono()):
                t = FAST_PROBE_TIMEOUT
            pthread_mutex_unlock(&e.mu)
        return t

    def probe_failed(self, int peer, int rail):
        """A fail-back probe of (peer, rail) did not connect (or this rank waits for the lower
        rank's). In the first FAST_PROBE_S after a failure that is not a flap (the rail was not
        restored just before: its back-off is still the first), the next probe follows at
        once (FAST_PROBE_GAP, no doubling): a NIC that flapped for 0.3 s is back while its
        probes would still be doubling, and a blind probe's SYN into a dead link is lost, so
        only a fresh attempt connects soon after the link returns. Then doubling from
        probe_base (R2COMM_PROBE_MS) up to probe_max as before."""
        cdef State* e = self._live()
        cdef PairRail* r
        cdef double now
        with nogil:
            pthread_mutex_lock(&e.mu)
            r = e.peers[peer].rails[rail]
            now = mono()
            if fast_probing(e, r, now):
                r.next_probe = now + FAST_PROBE_GAP
            else:
                r.backoff = r.backoff * 2 if r.backoff > 0 else e.probe_base
                if r.backoff > e.probe_max:
                    r.backoff = e.probe_max
                r.next_probe = now + r.backoff
            pthread_mutex_unlock(&e.mu)

    def mark_unconnected(self, int peer, int rail, str reason):
        """A data rail that did not connect at start-up (Links.settle): DOWN for this pair,
        event rail_never_up with the reason, and due for fail-back probes from now on exactly
        like a rail that failed later (reconnect_due). A connection this side has although the
        other did not finish is failed. With no data rail up to the peer, the peer is lost
        (peer_lost) until a rail to it comes back: the plans route around it."""
        cdef State* e = self._live()
        cdef bytes msg = reason.encode("utf-8", "replace")
        cdef const char* cmsg = msg
        cdef Peer* p
        cdef PairRail* r
        cdef int k, up = 0
        cdef double now
        if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL or rail < 0 or \
                rail >= e.peers[peer].nrails:
            raise ValueError(f"no such peer/data rail {peer}/{rail}")
        with nogil:
            pthread_mutex_lock(&e.mu)
            p = e.peers[peer]
            r = p.rails[rail]
            now = mono()
            if r.state == R_UP:
                fail_rail(e, r, cmsg, e.me, 0)
            else:
                r.fail_count += 1
                r.fail_time = now
                r.backoff = e.probe_base
                r.next_probe = now + r.backoff
            add_event(e, EV_RAIL_NEVER_UP, peer, rail, e.me, 0, 0, cmsg)
            for k in range(p.nrails):
                if p.rails[k].state == R_UP:
                    up += 1
            if up == 0 and not p.lost:
                if p.all_down_since == 0:
                    p.all_down_since = now
                peer_lost(e, p)
            e.signal = 1
            pthread_mutex_unlock(&e.mu)

    # -- observation ---------------------------------------------------------------------------
    def note_link_error(self, int peer, int rail, str info):
        """Record a `link_error` event: the links thread caught an error of one connection
        (peer -1 when not known) and closed that connection (r2comm/control/links.py)."""
        cdef State* e = self._live()
        cdef bytes text = info.encode("utf-8", "replace")[:1024]
        cdef const char* c = text
        with nogil:
            pthread_mutex_lock(&e.mu)
            add_event(e, EV_LINK_ERROR, peer, rail, 0, 0, 0.0, c)
            pthread_mutex_unlock(&e.mu)

    # -- failure detector (r2comm/control/liveness.py; issue 31) --------------------------------
    def peer_dead(self, int peer, str reason, bint process=True):
        """The failure detector confirmed rank `peer` dead: it is lost exactly as when every rail
        to it failed (peer_lost: event peer_lost, its operations fail with E_NETWORK, later ones
        at their start), with `reason` as the message; cause peer_process (`process`: its
        process is gone or frozen) or remote_nic (its host answers nothing). True if it was
        not lost yet."""
        cdef State* e = self._live()
        cdef bytes text = reason.encode("utf-8", "replace")[:1000]
        cdef const char* c = text
        cdef Peer* p
        cdef bint fresh = False
        cdef uint64_t one = 1
        if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL:
            raise ValueError(f"no such peer {peer}")
        with nogil:
            pthread_mutex_lock(&e.mu)
            p = e.peers[peer]
            if not p.lost:
                fresh = True
                if p.all_down_since == 0:
                    p.all_down_since = mono()
                peer_lost_why(e, p, CAUSE_PEER_PROCESS if process else CAUSE_REMOTE_NIC, c)
                e.signal = 1
            pthread_mutex_unlock(&e.mu)
            write(e.evfd, &one, 8)          # a waiter asleep in epoll looks again
        return fresh

    def link_state(self, int peer, int rail):
        """One connection's state: "up", "down" (failed, or did not connect), "idle" (never
        connected: made on first use, r2comm/control/links.py) or "off" (not up, and a NIC
        under it is announced down: set_nic_off); rail == nrails(peer) is the control
        connection."""
        cdef State* e = self._live()
        cdef PairRail* r
        cdef int st
        if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL or rail < 0 or \
                rail > e.peers[peer].nrails:
            raise ValueError(f"no such peer/rail {peer}/{rail}")
        with nogil:
            pthread_mutex_lock(&e.mu)
            r = e.peers[peer].rails[rail]
            st = 2 if r.state == R_UP else (3 if r.nic_off else (1 if rail_idle(r) else 0))
            pthread_mutex_unlock(&e.mu)
        return ("down", "idle", "up", "off")[st]

    # -- NIC facts (r2comm/control/facts.py, control/nicwatch.py; issue 39) ----------------------
    def set_nic_off(self, peers, int rail, bint off, str reason, bint fail_up=True,
                    bint cause_local=False, bint idle_only=False):
        """A NIC under rail `rail` towards each of `peers` (global ranks) is announced down
        (off) or up again. Off: the rail is counted down whether it was ever connected or not,
        never connected on first use, not probed; with fail_up, one that is up is failed now
        (its chunks move to the other rails; the peer is told), with `reason` and cause
        local_nic (cause_local) or remote_nic. Up again: the mark goes, and a rail that failed
        is probed at once. idle_only: only rails never connected are marked (this rank's own
        NIC: its failed rails stay probed, which is how it sees the NIC work again). Shared-
        memory peers have no NIC and are skipped. Returns the number of rails whose mark
        changed."""
        cdef State* e = self._live()
        cdef bytes msg = reason.encode("utf-8", "replace")[:1000]
        cdef const char* cmsg = msg
        cdef vector[int] ids
        cdef Peer* p
        cdef PairRail* r
        cdef size_t i
        cdef int changed = 0
        cdef double now
        for x in peers:
            if 0 <= x < e.nranks and x != e.me:
                ids.push_back(<int>x)
        with nogil:
            pthread_mutex_lock(&e.mu)
            now = mono()
            for i in range(ids.size()):
                p = e.peers[ids[i]]
                if p == NULL or p.shm or rail < 0 or rail >= p.nrails:
                    continue
                r = p.rails[rail]
                if (r.nic_off != 0) == off or (off and idle_only and not rail_idle(r)):
                    continue
                changed += 1
                r.nic_off = 1 if off else 0
                if off and fail_up and r.state == R_UP:
                    r.fail_cause = CAUSE_LOCAL_NIC if cause_local else CAUSE_REMOTE_NIC
                    fail_rail(e, r, cmsg, e.me, 1)
                elif not off and r.state == R_DOWN and r.fail_count > 0:
                    r.backoff = e.probe_base
                    r.next_probe = now
            e.signal = 1
            pthread_mutex_unlock(&e.mu)
        self._wake()
        return changed

    def rails_to(self, int peer):
        """The data rails this rank has towards `peer` (0 for itself)."""
        cdef State* e = self._live()
        if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL:
            return 0
        return e.peers[peer].nrails

    def set_same_host(self, peers):
        """The peers (global ranks) on this rank's host: their rails' rates are not a NIC's."""
        cdef State* e = self._live()
        cdef int i
        mine = set(int(x) for x in peers)
        with nogil:
            pthread_mutex_lock(&e.mu)
        try:
            for i in range(e.nranks):
                if e.peers[i] != NULL:
                    e.peers[i].same_host = 1 if i in mine else 0
        finally:
            pthread_mutex_unlock(&e.mu)

    def down_rails(self):
        """The data rails to peers with a NIC (not shared memory) that are down after having
        been tried (connected and failed, or marked unconnected): [(peer, rail, seconds since
        it failed, nic_off)]. O(peers x rails) in C; only the failures become Python objects."""
        cdef State* e = self._live()
        cdef vector[int] ps, ks, offs
        cdef vector[double] ages
        cdef Peer* p
        cdef PairRail* r
        cdef int i, k
        cdef double now
        with nogil:
            pthread_mutex_lock(&e.mu)
            now = mono()
            for i in range(e.nranks):
                p = e.peers[i]
                if p == NULL or p.shm or p.lost:
                    continue
                for k in range(p.nrails):
                    r = p.rails[k]
                    if r.state == R_DOWN and r.fail_count > 0:
                        ps.push_back(i)
                        ks.push_back(k)
                        ages.push_back(now - r.fail_time if r.fail_time > 0 else 0.0)
                        offs.push_back(r.nic_off)
            pthread_mutex_unlock(&e.mu)
        return [(ps[i], ks[i], ages[i], bool(offs[i])) for i in range(<int>ps.size())]

    def nic_rates(self, int nrails):
        """Per rail index: the best measured rate (bytes/s, 0: none) of an up rail towards a
        peer on another host (not same_host, not shared memory): what this host's NIC moves."""
        cdef State* e = self._live()
        cdef vector[double] best
        cdef Peer* p
        cdef PairRail* r
        cdef int i, k
        best.resize(nrails if nrails > 0 else 0, 0.0)
        with nogil:
            pthread_mutex_lock(&e.mu)
            for i in range(e.nranks):
                p = e.peers[i]
                if p == NULL or p.shm or p.same_host:
                    continue
                for k in range(p.nrails):
                    if k < nrails:
                        r = p.rails[k]
                        if r.state == R_UP and r.rate > best[k]:
                            best[k] = r.rate
            pthread_mutex_unlock(&e.mu)
        return [best[k] for k in range(best.size())]

    def peer_ok(self, int peer):
        cdef State* e = self._live()
        return e.peers[peer] != NULL and not e.peers[peer].lost
