# The engine's vocabulary: the constants it shares with Python, the structs and C++ classes of
# its state (an operation, its send and receive messages, a rail, a peer, the engine's State, a
# compiled plan) and small helpers (clocks, message keys, chunk arithmetic, events). The other
# parts all use these and none of them holds policy, so this file is included first.

# ---------------------------------------------------------------------------------------------
# Constants shared with Python (mirrored in r2comm/_core/__init__.py docs and errors.py codes)
cdef enum:
    ST_ACTIVE = 0
    ST_DONE = 1
    ST_ERROR = 2

cdef enum:
    E_NONE = 0
    E_TIMEOUT = 1
    E_NETWORK = 2
    E_MISMATCH = 3
    E_TRUNCATE = 4
    E_PROTOCOL = 5
    E_CLOSED = 6
    E_PEER_ARG = 7      # a peer's own arguments were bad (its 'error' stand-in's ABORT)

cdef enum:
    C_GATED = 0
    C_QUEUED = 1
    C_INFLIGHT = 2
    C_ACKED = 3
    C_HEDGED = 0x40       # flag: a copy is also in flight on a second (faster) rail
    C_RESENT = 0x80       # flag: this chunk was migrated off a failed rail
    C_STATE = 0x3F        # the state bits

cdef enum:
    ANY_PEER = -1        # a p2p receive's peer in a Plan: any source (bound on its match)

cdef enum:
    M_COPY = 0
    M_REDUCE = 1
    M_REDUCE_REV = 2
    M_REDUCE_SEND = 3       # dst = send buffer (same offset) op incoming: no pre-copy needed
    M_REDUCE_SEND_REV = 4   # dst = incoming op send buffer

cdef enum:
    R_DOWN = 0
    R_UP = 1

cdef enum:
    K_NONE = 0
    K_DIRECT = 1     # payload read straight into the destination (copy mode, chunk not gated)
    K_STAGE = 2      # into the rail's staging buffer, reduced on arrival
    K_BUF = 3        # into a private buffer: gated, unexpected; delivered by key on arrival
    K_TRASH = 4      # duplicate or stale: read and dropped (still acknowledged)
    K_CTRL = 5       # control payload (abort text)

cdef enum:
    EV_RAIL_FAILED = 1
    EV_NOTIFY_SENT = 2
    EV_NOTIFY_ACKED = 3
    EV_MIGRATED = 4
    EV_REDELIVERED = 5
    EV_RAIL_RESTORED = 6
    EV_PEER_LOST = 7
    EV_BAD_FRAME = 8
    EV_NOTIFIED = 9
    EV_ABORT = 10
    EV_RAIL_NEVER_UP = 11
    EV_PEER_STALLED = 12
    EV_PEER_RESUMED = 13
    EV_LINK_ERROR = 14      # the links thread caught an error of one connection (links.py)

cdef enum:
    # where the engine located a failure (the events' 'cause')
    CAUSE_NONE = 0
    CAUSE_LOCAL_NIC = 1       # this rank's NIC: down, no carrier, or an injected silent fault
    CAUSE_REMOTE_NIC = 2      # the peer's NIC or the path to it: its kernel acknowledges nothing
    CAUSE_PEER_PROCESS = 3    # the peer's process: stalled (its kernel still acknowledges TCP),
                              # or gone (every connection to it closed or reset)
    CAUSE_CLOSED = 4          # the connection was closed or reset by its other end

CAUSE_NAMES = {CAUSE_LOCAL_NIC: "local_nic", CAUSE_REMOTE_NIC: "remote_nic",
               CAUSE_PEER_PROCESS: "peer_process", CAUSE_CLOSED: "connection_closed"}

EVENT_NAMES = {EV_RAIL_NEVER_UP: "rail_never_up", EV_RAIL_FAILED: "rail_failed", EV_NOTIFY_SENT: "notify_sent",
               EV_NOTIFY_ACKED: "notify_acked", EV_MIGRATED: "migrated",
               EV_REDELIVERED: "redelivered", EV_RAIL_RESTORED: "rail_restored",
               EV_PEER_LOST: "peer_lost", EV_BAD_FRAME: "bad_frame", EV_NOTIFIED: "peer_notified",
               EV_ABORT: "abort", EV_PEER_STALLED: "peer_stalled", EV_PEER_RESUMED: "peer_resumed",
               EV_LINK_ERROR: "link_error"}
ERR_TIMEOUT, ERR_NETWORK, ERR_MISMATCH, ERR_TRUNCATE, ERR_PROTOCOL, ERR_CLOSED = (
    E_TIMEOUT, E_NETWORK, E_MISMATCH, E_TRUNCATE, E_PROTOCOL, E_CLOSED)
MODE_COPY, MODE_REDUCE, MODE_REDUCE_REV, MODE_REDUCE_SEND, MODE_REDUCE_SEND_REV = (
    M_COPY, M_REDUCE, M_REDUCE_REV, M_REDUCE_SEND, M_REDUCE_SEND_REV)

cdef enum:
    RBUF_SIZE = 262144
    LAZY_ACK_MAX = 65536     # chunks up to this size from an owned (copied) send: ack may wait
    DACK_MAX = 32            # flush a rail's delayed acks once this many are waiting
    RBUF_READ = 8192
    DIRECT_MIN = 4096
    POLL_EPOLL_EVERY = 8     # busy-poll rounds per epoll_wait(0) when shared-memory links exist
    EVFD_TAG = 0xFFFFFFFFFFFFFFFF
    INJ_NONE = 0
    INJ_HARD = 1
    INJ_SILENT = 2
    HEDGE_LATE = 1
    HEDGE_SLOW = 2
    MAC_LEN = 16             # R2COMM_INTEGRITY=mac: a Poly1305 tag after every frame
    MAC_KEY_LEN = 32

# What a peer's frames can make this rank keep is bounded (issue 28): the events (an abort's
# text is up to 4 KiB) keep the last EVENTS_KEEP to 2 * EVENTS_KEEP, the aborts of operations
# not posted yet ABORTED_MAX (over it, the one with the lowest (comm, seq) goes), and the
# unexpected messages (collective and point-to-point, for any communicator id) UNEXP_MAX_MSGS
# entries and UNEXP_MAX_BYTES of payload by default
# (Engine.set_unexpected_limit; R2COMM_UNEXPECTED_BYTES / R2COMM_UNEXPECTED_MSGS).
cdef size_t EVENTS_KEEP = 1024
cdef size_t ABORTED_MAX = 1024
cdef uint64_t UNEXP_MAX_BYTES = (<uint64_t>1) << 30
cdef uint32_t UNEXP_MAX_MSGS = 65536
cdef double DACK_DELAY = 0.0005   # s: longest a delayed ack waits for a frame to ride with
# Largest message a frame may announce (1 TiB). A peer's `total` sizes the unexpected-message
# table before any receive vouches for it: beyond this the frame is refused as malformed.
cdef uint64_t MAX_MESSAGE = (<uint64_t>1) << 40
cdef double SPIN_BASE = 50e-6     # s: into a wait, the spin's CPU baseline is taken
cdef double SPIN_JUDGE = 200e-6   # s: shortest spin (after SPIN_BASE) that is judged
cdef double SPIN_SHARE = 0.6      # a preempted spin that got less of a CPU than this lost it
cdef double SPIN_CONTENDED = 50e-6    # s: the spin while contended
cdef int SPIN_BACKOFF = 64        # waits to spin short after a contended spin
cdef int SPIN_YIELD = 16          # empty polls in a spin between two sched_yield() calls

# ---------------------------------------------------------------------------------------------
# Data structures

cdef struct Dep:
    void* m          # SendMsg* or RecvMsg*
    int is_send

cdef struct CRef:
    void* m          # SendMsg*
    uint32_t c

cdef struct Event:
    double t
    int kind
    int peer
    int rail
    int detector
    uint64_t nbytes
    double dt
    int cause

cdef struct Notice:
    int peer
    int rail
    uint32_t conn_id
    double next_send
    int tries

cdef cppclass Op:
    uint64_t id
    int state
    int err
    string msg
    int pending
    double deadline
    uint32_t comm
    uint32_t seq
    uint32_t sig, desc       # a collective's descriptor (count, kind/root/plan hash), as in
    uint8_t dtype, redop     # its frames' headers: names this rank's call in mismatch errors
    int p2p
    vector[void*] sends
    vector[void*] recvs
    vector[int] members
    uint64_t nbytes_recv
    __init__() noexcept nogil:
        this.state = ST_ACTIVE
        this.err = E_NONE
        this.pending = 0
        this.p2p = 0
        this.nbytes_recv = 0

cdef cppclass SendMsg:
    Op* op
    int peer
    int owned
    int done
    int pin              # rail index this message must use while that rail is up (-1: any)
    uint32_t comm, seq, step, sig, aux, cs, nchunks, nacked
    uint8_t flags, dtype, redop
    char* base           # bytes on the wire: the user's buffer, or the engine's copy if owned
    char* src            # the user's buffer (owned sends copy a chunk from here once it is ready)
    uint64_t total
    uint8_t* cstate
    int8_t* crail
    int32_t* gate
    vector[Dep] succ
    __init__() noexcept nogil:
        this.op = NULL
        this.owned = 0
        this.done = 0
        this.pin = -1
        this.nacked = 0
        this.base = NULL
        this.cstate = NULL
        this.crail = NULL
        this.gate = NULL

cdef cppclass RecvMsg:
    Op* op
    int peer
    int mode
    int done
    int bound
    uint32_t comm, seq, step, sig, aux, cs, nchunks, napplied
    uint8_t flags, dtype, redop
    char* base
    char* src            # M_REDUCE_SEND*: the other operand (send buffer at the same offset)
    uint64_t total
    uint64_t cap
    uint8_t* cdone
    int32_t* gate
    char** held
    vector[Dep] succ
    uint64_t posted_no   # p2p: when it was posted (State.p2p_posts); orders any-source ones
    __init__() noexcept nogil:
        this.op = NULL
        this.done = 0
        this.bound = 0
        this.posted_no = 0
        this.napplied = 0
        this.nchunks = 0
        this.cdone = NULL
        this.gate = NULL
        this.held = NULL
        this.src = NULL

cdef cppclass Unexp:
    uint32_t sig, aux, cs, nchunks, nrecv
    uint8_t flags, dtype, redop
    uint64_t total
    uint64_t nbytes                  # payload bytes held in chunks (State.unexp_bytes)
    cmap[uint32_t, char*] chunks     # the chunks that arrived (sparse: a peer's `total` alone
                                     # never sizes an allocation)
    uint64_t arrival                 # p2p: its number in State.any_unexp (0: not matchable yet)
    uint32_t comm, seq               # p2p: where it came from (with peer)
    int peer
    __init__() noexcept nogil:
        this.nrecv = 0
        this.nbytes = 0
        this.arrival = 0

cdef cppclass P2PState:
    uint32_t seen_upto
    cmap[uint32_t, int] seen_ahead
    cmap[uint32_t, Unexp*] unexp
    deque[void*] posted
    cmap[uint32_t, void*] bound
    __init__() noexcept nogil:
        this.seen_upto = 0

cdef cppclass Rail:
    int peer
    int index
    int fd               # the connection's event fd (tp.event_fd), in the epoll set; -1: none
    Transport* tp        # the connection's transport (transport.pxd) and its opaque state
    void* conn           # (NULL: no connection)
    int state
    uint32_t conn_id
    uint32_t gen
    double weight
    uint64_t window
    deque[CRef] inflight
    uint64_t inflight_bytes
    int ghosts           # copies sent here whose chunk another rail delivered first: until an
                         # ack comes back here they keep the stall deadline running
    double last_progress
    double gap_avg, gap_var  # time between a busy rail's acks: smoothed, and its mean deviation
    string txq
    size_t txq_pos
    string dackq         # delayed acks (FL_LAZY_ACK frames): sent with the next frame on this
    double dack_t        # rail, or when the oldest is DACK_DELAY old
    int dack_listed      # in State.dack_list
    int tx_busy          # a DATA frame occupies the rail: from begin_tx to its completion
    uint64_t tx_id       # its cookie (transport.pxd's isend / test); counts up per frame
    int tx_posted        # all its bytes are posted: the rail is free at its completion
    double tx_post_t     # when the timer first saw it posted and not completed (0: not yet)
    r2_hdr tx_hdr
    char* tx_payload
    uint32_t tx_plen
    uint32_t tx_done
    char* tx_orphan
    CRef tx_ref
    int want_out
    char* rbuf
    uint32_t rpos, rlen
    r2_hdr rh
    int rstate
    int rkind
    void* rmsg
    char* rtarget
    uint32_t rgot
    char* stage
    uint64_t bytes_sent, bytes_recv, bytes_resent, bytes_hedged
    int blackhole
    int64_t fault_at
    int fault_mode
    int fail_count
    double fail_time, restore_time, next_probe, backoff
    double rate              # measured throughput (bytes/s, EWMA of acknowledged bytes); 0 unknown
    double meas_t0
    uint64_t meas_bytes
    uint64_t meas_inflight   # bytes in flight of chunks that count for the rate (bulk ones)
    # R2COMM_INTEGRITY=mac: every frame is followed by a tag over header, payload and its
    # counter in that direction, keyed per connection and direction (from the handshake)
    b2s_state tx_key, rx_key
    uint64_t tx_ctr, rx_ctr
    int tx_sealed            # the DATA frame being written has its place in the stream (and tag)
    size_t txq_lim           # while sealed: txq bytes before this offset go ahead of that frame
    uint8_t tx_tag[16]
    uint8_t rx_tag[16]
    char* mbuf               # mac mode: a frame's payload waits here until its tag verifies
    uint32_t mbuf_cap
    int corrupt_next         # test hook: flip a payload byte of the next DATA frame on the wire
    double last_ack          # when the peer's process last acknowledged a chunk here
    double hc_t              # acks late: when the current health-check round began (0: none)
    uint64_t hc_acked        # the kernel's bytes acknowledged by the peer's kernel then
    int stalled              # held: acks late but the peer's kernel alive (process stalled)
    int fail_cause           # CAUSE_* of the failure being recorded
    double nic_check_t       # acks late: when this rank's NIC of the rail was last looked at
    int polled_listed        # in State.polled (a TPF_POLLED transport was attached here once)
    __init__() noexcept nogil:
        this.polled_listed = 0
        this.tx_ctr = 0
        this.rx_ctr = 0
        this.tx_sealed = 0
        this.txq_lim = 0
        this.mbuf = NULL
        this.mbuf_cap = 0
        this.corrupt_next = 0
        this.last_ack = 0
        this.hc_t = 0
        this.nic_check_t = 0
        this.hc_acked = 0
        this.stalled = 0
        this.fail_cause = CAUSE_NONE
        this.rate = 0
        this.meas_t0 = 0
        this.meas_bytes = 0
        this.meas_inflight = 0
        this.fd = -1
        this.tp = NULL
        this.conn = NULL
        this.tx_id = 0
        this.tx_posted = 0
        this.tx_post_t = 0
        this.state = R_DOWN
        this.conn_id = 0
        this.gen = 0
        this.weight = 1.0
        this.inflight_bytes = 0
        this.ghosts = 0
        this.gap_avg = 0
        this.gap_var = 0
        this.txq_pos = 0
        this.dack_t = 0
        this.dack_listed = 0
        this.tx_busy = 0
        this.tx_orphan = NULL
        this.want_out = 0
        this.rbuf = NULL
        this.rpos = 0
        this.rlen = 0
        this.rstate = 0
        this.rkind = K_NONE
        this.rmsg = NULL
        this.rtarget = NULL
        this.stage = NULL
        this.bytes_sent = 0
        this.bytes_recv = 0
        this.bytes_resent = 0
        this.bytes_hedged = 0
        this.blackhole = 0
        this.fault_at = -1
        this.fault_mode = INJ_NONE
        this.fail_count = 0
        this.fail_time = 0
        this.restore_time = 0
        this.next_probe = 0
        this.backoff = 0

cdef cppclass Peer:
    int rank
    int nrails
    vector[Rail*] rails          # nrails data rails, then the control connection
    deque[CRef] ready            # chunks to send, in order: the first nhot are "hot"
    size_t nhot                  # (resent, or released by a dependency), the rest bulk
    double all_down_since
    int lost
    int stalled                  # its process looks stalled (peer_stalled recorded)
    double stall_t               # since when (its rails' last acknowledgement)
    double ack_seen              # its latest acknowledgement on any rail, at the last timer check
    double resume_t              # when its process acknowledged again after a silence on every
                                 # rail (a resume after a stop; judged rails get a fresh deadline)
    int shm                      # a local peer: its data rail is shared memory (no NIC faults)
    cmap[uint32_t, uint32_t] p2p_send_seq
    cmap[uint32_t, P2PState*] p2p
    __init__() noexcept nogil:
        this.shm = 0
        this.all_down_since = 0
        this.lost = 0
        this.stalled = 0
        this.stall_t = 0
        this.ack_seen = 0
        this.resume_t = 0

ctypedef pair[uint64_t, uint64_t] Key
ctypedef pair[uint32_t, uint32_t] CS
ctypedef pair[uint32_t, uint64_t] CA

cdef cppclass State:
    int me
    int nranks
    uint32_t cs
    vector[Peer*] peers
    int epfd
    int evfd
    pthread_mutex_t mu
    pthread_cond_t cv
    pthread_cond_t pcv       # the progress thread parks on this one while a waiter drives I/O
    cmap[Key, void*] smap
    cmap[Key, void*] rmap
    cmap[Key, Unexp*] cunexp
    uint64_t p2p_posts       # p2p receives posted so far (RecvMsg.posted_no)
    uint64_t p2p_arrivals    # p2p messages that became matchable so far (Unexp.arrival)
    cmap[CA, Unexp*] any_unexp   # (comm, arrival) -> matchable unexpected p2p message, any peer
    cmap[uint32_t, deque[void*]] any_posted  # comm -> any-source receives not bound yet
    cmap[uint32_t, uint32_t] next_seq
    cmap[CS, Op*] active
    cmap[CS, pair[int, string]] aborted
    cmap[uint32_t, pair[uint32_t, string]] mismatched  # comm -> (seq, error) of a collective that
                             # failed with a mismatch and that no wait has reported yet
    int poisoning
    cmap[uint64_t, Op*] ops
    uint64_t next_op
    vector[Event] events
    vector[string] event_info
    uint64_t events_base     # events dropped from the front (the first kept one's number)
    uint64_t unexp_bytes     # payload bytes of unexpected messages held (every peer)
    uint32_t unexp_msgs      # unexpected messages held (Unexp entries)
    uint64_t unexp_max_bytes
    uint32_t unexp_max_msgs
    vector[Notice] notices
    double rail_timeout, peer_timeout, probe_base, probe_max
    uint64_t window
    double win_s         # a rail's window: at most this many seconds of its measured rate
    Transport* tp            # the transport new connections are adopted by (attach)
    int stop
    int signal
    char* trash
    vector[int] inj_mode
    vector[int] inj_peer
    double fault_time
    int awaiting_redelivery
    double last_timer        # when check_timers last ran (a long gap: this process did not run)
    double self_paused       # seconds of this process's own pauses taken off the deadlines
    double nic_idle_t        # when the local NICs under the rails were last looked at (idle check)
    int waiters
    int noack
    int mac                  # R2COMM_INTEGRITY=mac: frames carry a MAC (else the checksum only)
    int hedge                # 0 off; 1: late rails only; 2: late, and slow ones (HEDGE_*)
    int dack_rails           # rails with delayed acks waiting
    vector[Rail*] dack_list  # those rails (and some whose acks have gone since), for the timer
    vector[Rail*] polled     # rails that had a TPF_POLLED connection (shm): polled every round
    int npolled              # polled.size(), read without the mutex (arming before a sleep)
    int poll_turn            # busy-poll rounds since epoll was last asked (progress_once)
    __init__() noexcept nogil:
        this.npolled = 0
        this.poll_turn = 0
        this.p2p_posts = 0
        this.p2p_arrivals = 0
        this.events_base = 0
        this.unexp_bytes = 0
        this.unexp_msgs = 0
        this.unexp_max_bytes = UNEXP_MAX_BYTES
        this.unexp_max_msgs = UNEXP_MAX_MSGS
        this.dack_rails = 0
        this.noack = 0
        this.mac = 0
        this.hedge = HEDGE_SLOW
        this.waiters = 0
        this.last_timer = 0
        this.self_paused = 0
        this.nic_idle_t = 0
        this.next_op = 1
        this.stop = 0
        this.signal = 0
        this.trash = NULL
        this.fault_time = 0
        this.awaiting_redelivery = 0
        this.poisoning = 0

cdef cppclass PlanC:
    vector[int] kind, peer, step, buf, mode, owned
    vector[uint64_t] off, nbytes
    vector[pair[int, int]] deps

# ---------------------------------------------------------------------------------------------
# Small helpers

cdef inline double mono() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

cdef extern from "<sys/resource.h>" nogil:
    cdef struct rusage:
        long ru_nivcsw
    int getrusage(int who, rusage* usage)
    enum: RUSAGE_THREAD

cdef extern from "<time.h>" nogil:
    enum: CLOCK_THREAD_CPUTIME_ID

cdef inline double thread_cpu() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

cdef inline long preemptions() noexcept nogil:
    """Involuntary context switches of the calling thread so far."""
    cdef rusage ru
    if getrusage(RUSAGE_THREAD, &ru) != 0:
        return 0
    return ru.ru_nivcsw

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
