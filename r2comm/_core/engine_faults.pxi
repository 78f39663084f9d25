# EngineFaults, an Engine's injected NIC faults (Engine.faults): what comm.fail_rail and
# R2COMM_FAULT (world.py) and the tests use to fail a rail for real (hard: the connection is shut
# down) or silently (the emulated NIC in front of the transport, tx.pxi, drops everything). The
# data path acts on a rail's own marks (inject_now; PairRail.fault_at, struck in tx.pxi); the
# slots per rail index (State.inj_mode, inj_peer) are the cold path's, read by fault_injected:
# here, and in the fail-back probes' schedule (EngineLinks.reconnect_due).
# Included into engine.pyx after the Engine class (Cython takes no include inside a class).


cdef inline int fault_injected(State* e, int rail, int peer) noexcept nogil:
    """An injected fault holds rail `rail` towards `peer` (never a shared-memory peer's)."""
    if rail >= <int>e.inj_mode.size():
        return 0
    if 0 <= peer < e.nranks and e.peers[peer] != NULL and e.peers[peer].shm:
        return 0              # shared memory: no NIC to fail
    return e.inj_mode[rail] != INJ_NONE and (e.inj_peer[rail] < 0 or e.inj_peer[rail] == peer)


cdef class EngineFaults(EnginePart):
    """An Engine's fault injection (Engine.faults; C fields: engine.pxd)."""

    def inject(self, int rail, int mode, int peer=-1, int64_t after_bytes=-1):
        """Fail rail `rail` (to `peer`, or to all peers): mode 1 hard (the connection is shut
        down for real), 2 silent (the emulated NIC drops everything in both directions). With
        after_bytes >= 0 the fault strikes once that many more bytes have left on the rail."""
        cdef State* e = self._live()
        cdef int i
        cdef PairRail* r
        if rail < 0 or rail >= <int>e.inj_mode.size():
            raise ValueError(f"rail index {rail} out of range (0..{e.inj_mode.size() - 1})")
        with nogil:
            pthread_mutex_lock(&e.mu)
            e.inj_mode[rail] = mode
            e.inj_peer[rail] = peer
            for i in range(e.nranks):
                if e.peers[i] == NULL or (peer >= 0 and i != peer) or rail >= e.peers[i].nrails \
                        or e.peers[i].shm:
                    continue
                r = e.peers[i].rails[rail]
                if r.state != R_UP:
                    continue
                if after_bytes >= 0:
                    r.fault_at = <int64_t>r.bytes_sent + after_bytes
                    r.fault_mode = mode
                else:
                    inject_now(e, r, mode)
            pthread_mutex_unlock(&e.mu)
        self._wake()

    def clear_injection(self, int rail):
        cdef State* e = self._live()
        cdef int i
        if rail < 0 or rail >= <int>e.inj_mode.size():
            raise ValueError(f"rail index {rail} out of range")
        with nogil:
            pthread_mutex_lock(&e.mu)
            e.inj_mode[rail] = INJ_NONE
            e.inj_peer[rail] = -1
            for i in range(e.nranks):
                if e.peers[i] != NULL and rail < e.peers[i].nrails:
                    e.peers[i].rails[rail].fault_at = -1
                    e.peers[i].rails[rail].next_probe = 0
            pthread_mutex_unlock(&e.mu)

    def injected(self, int rail, int peer):
        """An injected fault holds rail `rail` towards `peer` (the emulated NIC is dark there)."""
        return bool(fault_injected(self._live(), rail, peer))

    def nic_injected(self, int rail):
        """An injected fault holds rail `rail` towards every peer (the emulated NIC is dark)."""
        cdef State* e = self._live()
        return 0 <= rail < <int>e.inj_mode.size() and e.inj_mode[rail] != INJ_NONE and \
            e.inj_peer[rail] < 0
