# The engine's vocabulary beside engine.pxd (which declares the constants, and the structs and
# C++ classes of its state: an operation, its send and receive messages, a rail, a peer, the
# engine's State, a compiled plan): the constants' Python names, the limits, making a rail and the
# State, and small helpers (clocks, message keys, chunk arithmetic, events). The other parts all
# use these and none of them holds policy, so this file is included first.

# ---------------------------------------------------------------------------------------------
# Constants shared with Python (mirrored in r2comm/_core/__init__.py docs and errors.py codes)

CAUSE_NAMES = {CAUSE_LOCAL_NIC: "local_nic", CAUSE_REMOTE_NIC: "remote_nic",
               CAUSE_PEER_PROCESS: "peer_process", CAUSE_CLOSED: "connection_closed"}

EVENT_NAMES = {EV_RAIL_NEVER_UP: "rail_never_up", EV_RAIL_FAILED: "rail_failed", EV_NOTIFY_SENT: "notify_sent",
               EV_NOTIFY_ACKED: "notify_acked", EV_MIGRATED: "migrated",
               EV_REDELIVERED: "redelivered", EV_RAIL_RESTORED: "rail_restored",
               EV_PEER_LOST: "peer_lost", EV_BAD_FRAME: "bad_frame", EV_NOTIFIED: "peer_notified",
               EV_ABORT: "abort", EV_PEER_STALLED: "peer_stalled", EV_PEER_RESUMED: "peer_resumed",
               EV_LINK_ERROR: "link_error", EV_NIC_DOWN: "nic_down", EV_NIC_UP: "nic_up",
               EV_PAIR_DOWN: "pair_down", EV_PAIR_UP: "pair_up", EV_REPLANNED: "replanned",
               EV_FAULT_STRUCK: "fault_struck"}
NOTED_EVENTS = {"nic_down": EV_NIC_DOWN, "nic_up": EV_NIC_UP, "pair_down": EV_PAIR_DOWN,
                "pair_up": EV_PAIR_UP, "replanned": EV_REPLANNED}
ERR_TIMEOUT, ERR_NETWORK, ERR_MISMATCH, ERR_TRUNCATE, ERR_PROTOCOL, ERR_CLOSED = (
    E_TIMEOUT, E_NETWORK, E_MISMATCH, E_TRUNCATE, E_PROTOCOL, E_CLOSED)
ERR_REVOKED = E_REVOKED
MODE_COPY, MODE_REDUCE, MODE_REDUCE_REV, MODE_REDUCE_SEND, MODE_REDUCE_SEND_REV = (
    M_COPY, M_REDUCE, M_REDUCE_REV, M_REDUCE_SEND, M_REDUCE_SEND_REV)

# What a peer's frames can make this rank keep is bounded (issue 28): the events (an abort's
# text is up to 4 KiB) keep the last EVENTS_KEEP to 2 * EVENTS_KEEP, the aborts of operations
# not posted yet ABORTED_MAX (over it, the one with the lowest (comm, seq) goes), as the
# mismatch verdicts (matching.pxi; a call's goes when the call is released), and the
# unexpected messages (collective and point-to-point, for any communicator id) UNEXP_MAX_MSGS
# entries and UNEXP_MAX_BYTES of payload by default
# (R2COMM_UNEXPECTED_BYTES / R2COMM_UNEXPECTED_MSGS; testing.set_unexpected_limit in tests).
cdef size_t EVENTS_KEEP = 1024
cdef size_t ABORTED_MAX = 1024
cdef size_t REVOKED_MAX = 4096    # revoked communicator ids kept (over it the lowest goes)
cdef uint64_t UNEXP_MAX_BYTES = (<uint64_t>1) << 30
cdef uint32_t UNEXP_MAX_MSGS = 65536
DACK_DELAY = 0.0005     # s: longest a delayed ack waits for a frame to ride with (engine.pxd)
# Largest message a frame may announce (1 TiB). A peer's `total` sizes the unexpected-message
# table before any receive vouches for it: beyond this the frame is refused as malformed.
cdef uint64_t MAX_MESSAGE = (<uint64_t>1) << 40
# (the spin policy's constants: spin_policy.pxi)

# ---------------------------------------------------------------------------------------------
# Making a rail and the State: r2_new zeroes every field; these are the defaults that are not zero

cdef PairRail* new_rail() noexcept nogil:
    cdef PairRail* r = r2_new[PairRail]()
    if r != NULL:
        r.fd = -1                # no connection
        r.weight = 1.0
        r.fault_at = -1          # no injected fault due
    return r

cdef int rail_buffers(State* e, PairRail* r, int data) noexcept nogil:
    """The buffers a rail needs once it has a connection, made on its first one (a rank holds
    rails to every peer, connected or not: an unconnected one costs its struct only): the read
    buffer, a data rail's staging buffer (a chunk) and, in mac mode, the frame buffer (a data
    rail's is its staging buffer, free between frames). 0, or -1 with no memory."""
    if r.rbuf == NULL:
        r.rbuf = <char*>malloc(RBUF_SIZE)
        if r.rbuf == NULL:
            return -1
    if data and r.stage == NULL:
        r.stage = <char*>malloc(e.cs)
        if r.stage == NULL:
            return -1
    if e.mac and r.mbuf == NULL:
        if data:
            r.mbuf, r.mbuf_cap = r.stage, e.cs
        else:
            r.mbuf = <char*>malloc(MAX_CTRL_PAYLOAD)
            if r.mbuf == NULL:
                return -1
            r.mbuf_cap = MAX_CTRL_PAYLOAD
    return 0

cdef State* new_state() noexcept nogil:
    cdef State* e = r2_new[State]()
    if e != NULL:
        e.next_op = 1            # operation ids are never 0
        e.hedge = HEDGE_SLOW
        e.unexp_max_bytes = UNEXP_MAX_BYTES
        e.unexp_max_msgs = UNEXP_MAX_MSGS
    return e

# ---------------------------------------------------------------------------------------------
# Small helpers

cdef inline double wall() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

cdef inline Key mkey(int peer, uint32_t comm, uint8_t flags, uint32_t step, uint32_t seq) noexcept nogil:
    cdef Key k
    k.first = (<uint64_t>peer << 32) | comm
    k.second = (<uint64_t>flags << 56) | (<uint64_t>(step & 0xFFFFFF) << 32) | seq
    return k

cdef inline uint32_t min_u32(uint32_t a, uint32_t b) noexcept nogil:
    return a if a < b else b

cdef inline uint32_t chunk_len(uint64_t total, uint32_t cs, uint32_t c) noexcept nogil:
    cdef uint64_t off = <uint64_t>c * cs
    if off >= total:
        return 0
    return <uint32_t>(total - off if total - off < cs else cs)

cdef inline uint32_t nchunks_of(uint64_t total, uint32_t cs) noexcept nogil:
    if total == 0:
        return 1
    return <uint32_t>((total + cs - 1) // cs)

cdef void add_event(State* e, int kind, int peer, int rail, int detector, uint64_t nbytes,
                    double dt, const char* info) noexcept nogil:
    add_event_c(e, kind, peer, rail, detector, nbytes, dt, info, CAUSE_NONE)

cdef void add_event_c(State* e, int kind, int peer, int rail, int detector, uint64_t nbytes,
                      double dt, const char* info, int cause) noexcept nogil:
    cdef Event ev
    ev.t = wall()
    ev.kind = kind
    ev.peer = peer
    ev.rail = rail
    ev.detector = detector
    ev.nbytes = nbytes
    ev.dt = dt
    ev.cause = cause
    e.events.push_back(ev)
    e.event_info.push_back(string(info))
    if e.events.size() >= 2 * EVENTS_KEEP:
        # keep the last EVENTS_KEEP (amortised: one erase per EVENTS_KEEP events)
        e.events.erase(e.events.begin(), e.events.begin() + EVENTS_KEEP)
        e.event_info.erase(e.event_info.begin(), e.event_info.begin() + EVENTS_KEEP)
        e.events_base += EVENTS_KEEP

# -- sequence numbers: uint32 on the wire, compared modulo 2**32 (RFC 1982 serial numbers), so a
# communicator's sequence (and a GPU twin's, whose id comes back every 2**30 calls with its
# sequence where it left off) wraps without a frame of the new lap being taken for a stale one.
# Two sequences compared are always within 2**31 of each other (operations in flight).
cdef inline bint seq_before(uint32_t a, uint32_t b) noexcept nogil:
    """a comes before b, modulo 2**32."""
    return <int32_t>(a - b) < 0

cdef inline void note_posted_seq(State* e, uint32_t comm, uint32_t seq) noexcept nogil:
    """Collective (comm, seq) is posted here: frames of earlier sequences are stale from now."""
    it = e.next_seq.find(comm)
    if it == e.next_seq.end() or seq_before(deref(it).second, seq + 1):
        e.next_seq[comm] = seq + 1

cdef inline bint seq_is_past(State* e, uint32_t comm, uint32_t seq) noexcept nogil:
    """(comm, seq) is before every collective of comm this rank posted next (looked up without
    adding an entry: a peer's frames never grow the table)."""
    it = e.next_seq.find(comm)
    return it != e.next_seq.end() and seq_before(seq, deref(it).second)
