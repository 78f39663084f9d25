# EngineTuning, an Engine's tuning (Engine.tuning): the waiters' spin policy (the SpinState that
# spin_policy.pxi's wait_op_c reads: knobs and counters) and the setters world.py applies from
# the configuration before and after the connections are made (frame integrity, acks, rail
# windows, tail hedging, rail weights and seeded rates). Included into engine.pyx after the
# Engine class (Cython takes no include inside a class).


cdef class EngineTuning(EnginePart):
    """An Engine's spin policy and tuning (Engine.tuning; C fields: engine.pxd)."""

    # -- the waiters' spin policy and counters (SpinState: wait_op_c reads them without the GIL) --
    @property
    def spin(self):
        """Seconds a waiter busy-polls before blocking in epoll."""
        return self.h.sp.spin

    @spin.setter
    def spin(self, double v):
        self.h.sp.spin = v

    @property
    def spin_short_left(self):
        """Waits left that spin only SPIN_CONTENDED (spin_policy.pxi)."""
        return self.h.sp.spin_short_left

    @spin_short_left.setter
    def spin_short_left(self, int v):
        self.h.sp.spin_short_left = v

    @property
    def spin_adapt(self):
        """Shorten the spin after preempted ones (default on)."""
        return self.h.sp.spin_adapt

    @spin_adapt.setter
    def spin_adapt(self, bint v):
        self.h.sp.spin_adapt = v

    @property
    def spin_extend(self):
        """Keep spinning while the sockets are busy (default on)."""
        return self.h.sp.spin_extend

    @spin_extend.setter
    def spin_extend(self, bint v):
        self.h.sp.spin_extend = v

    @property
    def spin_yield(self):
        """Empty polls between sched_yield() calls in a spin; 0 never."""
        return self.h.sp.spin_yield

    @spin_yield.setter
    def spin_yield(self, int v):
        self.h.sp.spin_yield = v

    @property
    def spin_yields(self):
        """sched_yield() calls made by spinning waiters."""
        return self.h.sp.spin_yields

    @property
    def spin_extended(self):
        """Waits that spun past their spin because sockets were busy."""
        return self.h.sp.spin_extended

    @property
    def spin_preempted(self):
        """Waits whose spin was preempted (contended)."""
        return self.h.sp.spin_preempted

    # -- settings --------------------------------------------------------------------------------
    def set_integrity(self, bint mac):
        """R2COMM_INTEGRITY: False, frames carry a header checksum (catches accidents in the
        header); True, every frame carries a Poly1305 tag over header and payload under a
        one-time key derived (keyed BLAKE2s) from the connection's key for that direction and
        the frame's counter in it (catches any change, replay or reordering in the stream).
        Set before the first attach; every rank of the job must agree."""
        cdef State* e = self._live()
        cdef Peer* p
        cdef PairRail* r
        cdef int i, k
        for i in range(e.nranks):
            p = e.peers[i]
            if p == NULL:
                continue
            for k in range(p.nrails + 1):
                r = p.rails[k]
                if r.fd >= 0:
                    raise RuntimeError("set_integrity after a connection was attached")
        e.mac = mac                    # (each rail's frame buffer comes with its connection)

    def set_noack(self, bint on):
        """Benchmark-only: trust TCP, count a chunk done once written (measures what the
        acknowledgement machinery costs; a rail failure can then lose data)."""
        self._live().noack = on

    def set_window_time(self, double seconds):
        """A rail's window in seconds of its measured throughput (default 0.15)."""
        if not seconds > 0:
            raise ValueError(f"window time must be > 0 s, not {seconds}")
        self._live().win_s = seconds

    def set_hedge(self, int mode):
        """Tail copies on another rail: 0 never; 1 (HEDGE_LATE) for a rail that has gone quiet;
        2 (HEDGE_SLOW, the default) also for one measured at under half an idle rail's rate."""
        if mode < 0 or mode > HEDGE_SLOW:
            raise ValueError(f"hedge mode {mode}: 0, 1 or 2")
        self._live().hedge = mode

    def set_weights(self, list weights):
        """Rail weights (relative bandwidth): each rail's window is scaled by its weight."""
        cdef State* e = self._live()
        cdef double wmax = max(weights) if weights else 1.0
        cdef int i, k
        cdef Peer* p
        with nogil:
            pthread_mutex_lock(&e.mu)
        try:
            for i in range(e.nranks):
                p = e.peers[i]
                if p == NULL:
                    continue
                for k in range(min(p.nrails, len(weights))):
                    p.rails[k].weight = weights[k]
                    p.rails[k].window = max(<uint64_t>(e.window * weights[k] / wmax), <uint64_t>e.cs)
        finally:
            pthread_mutex_unlock(&e.mu)

    def set_rail_rate(self, int peer, int rail, double rate):
        """Seed the measured throughput (bytes/s) of one rail to `peer`, e.g. from a start-up
        probe; acknowledged traffic keeps refining it (measure_rate's moving average)."""
        cdef State* e = self._live()
        if rate < 0:
            raise ValueError("rate must be >= 0")
        with nogil:
            pthread_mutex_lock(&e.mu)
        try:
            if peer < 0 or peer >= e.nranks or e.peers[peer] == NULL:
                raise ValueError(f"no peer {peer}")
            if rail < 0 or rail >= e.peers[peer].nrails:
                raise ValueError(f"no rail {rail} to peer {peer}")
            e.peers[peer].rails[rail].rate = rate
        finally:
            pthread_mutex_unlock(&e.mu)
