# The engine's declarations, shared with the extensions that cimport it (r2comm/_core/testing.pyx,
# the test hooks, built only for test installs: setup.py): the constants, the structs and C++
# classes of the engine's state, the engine's functions those hooks drive, and the Python-facing
# classes' C fields. engine.pyx and its parts (*.pxi) see all of it as their own declarations.
#
# The C++ classes have no constructors: the engine makes them with r2_new (value-initialised:
# every field zero) and sets the few non-zero defaults where it makes them (engine_state.pxi's
# new_rail, new_state).
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t, intptr_t
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.map cimport map as cmap
from libcpp.string cimport string
from libcpp.utility cimport pair
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from r2comm._core.wire cimport r2_hdr
from r2comm._core.transport cimport Transport

cdef extern from "r2_mac.h" namespace "r2" nogil:
    cdef struct b2s_state:
        uint32_t buflen
    void b2s_init(b2s_state* s, uint32_t outlen, const void* key, uint32_t keylen)
    void b2s_update(b2s_state* s, const void* data, size_t n)
    void b2s_final(b2s_state* s, uint8_t* out)
    void b2s_prepare_more(b2s_state* s)
    cdef struct p1305_state:
        uint32_t buflen
    void p1305_init(p1305_state* st, const uint8_t* key)
    void p1305_update(p1305_state* st, const void* data, size_t n)
    void p1305_final(p1305_state* st, uint8_t* tag)
    void frame_mac(const b2s_state* keyed, const void* hdr, size_t hlen, const void* payload,
                   size_t plen, uint64_t counter, uint8_t* tag)
    int tag_equal(const uint8_t* a, const uint8_t* b, size_t n)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_condattr_init(pthread_condattr_t*)
    int pthread_condattr_setclock(pthread_condattr_t*, int)
    int pthread_cond_init(pthread_cond_t*, pthread_condattr_t*)
    int pthread_cond_timedwait(pthread_cond_t*, pthread_mutex_t*, const timespec*)
    int pthread_cond_broadcast(pthread_cond_t*)
    int pthread_cond_destroy(pthread_cond_t*)

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
    E_REVOKED = 8       # the communicator was revoked (issue 44: an ABORT with this code revokes)

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
    EV_NIC_DOWN = 15        # a NIC announced down or slow (facts.py: peer = the announcer)
    EV_NIC_UP = 16          # a NIC announced up at its full rate again
    EV_PAIR_DOWN = 17       # a pair's rail announced down (an exception: neither NIC explains it)
    EV_PAIR_UP = 18         # that exception lifted
    EV_REPLANNED = 19       # a communicator's plans switched to a new agreed epoch (replan.py)
    EV_FAULT_STRUCK = 20    # an injected fault (fail_rail) struck: nbytes = bytes sent on the rail

cdef enum:
    # where the engine located a failure (the events' 'cause')
    CAUSE_NONE = 0
    CAUSE_LOCAL_NIC = 1       # this rank's NIC: down, no carrier, or an injected silent fault
    CAUSE_REMOTE_NIC = 2      # the peer's NIC or the path to it: its kernel acknowledges nothing
    CAUSE_PEER_PROCESS = 3    # the peer's process: stalled (its kernel still acknowledges TCP),
                              # or gone (every connection to it closed or reset)
    CAUSE_CLOSED = 4          # the connection was closed or reset by its other end

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
    uint32_t count, desc       # a collective's descriptor (count, kind/root/plan hash), as in
    uint8_t dtype, redop     # its frames' headers: names this rank's call in mismatch errors
    int p2p
    vector[void*] sends
    vector[void*] recvs
    vector[int] members
    uint64_t nbytes_recv
    int hold                 # a collective failed with a mismatch: its error waits for the
    uint32_t vseq            # judge's verdict on call vseq (its own, or the earlier call that
    double hold_until        # poisoned it), at most until hold_until (matching.pxi)

cdef cppclass SendMsg:
    Op* op
    int peer
    int owned
    int done
    int pin              # rail index this message must use while that rail is up (-1: any)
    vector[double] rw    # declared share of each rail (the plan's rail weights; empty: striped
                         # as the rails' measured rates)
    vector[uint64_t] rw_sent   # bytes put on each rail so far under those shares
    uint32_t comm, seq, step, count, aux, cs, nchunks, nacked
    uint8_t flags, dtype, redop
    char* base           # bytes on the wire: the user's buffer, or the engine's copy if owned
    char* src            # the user's buffer (owned sends copy a chunk from here once it is ready)
    uint64_t total
    uint8_t* cstate
    int8_t* crail
    int32_t* gate
    vector[Dep] succ

cdef cppclass RecvMsg:
    Op* op
    int peer
    int mode
    int done
    int bound
    uint32_t comm, seq, step, count, aux, cs, nchunks, napplied
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

cdef cppclass Unexp:
    uint32_t count, aux, cs, nchunks, nrecv
    uint8_t flags, dtype, redop
    uint64_t total
    uint64_t nbytes                  # payload bytes held in chunks (State.unexp_bytes)
    cmap[uint32_t, char*] chunks     # the chunks that arrived (sparse: a peer's `total` alone
                                     # never sizes an allocation)
    uint64_t arrival                 # p2p: its number in State.any_unexp (0: not matchable yet)
    uint32_t comm, seq               # p2p: where it came from (with peer)
    int peer

cdef cppclass P2PState:
    uint32_t seen_upto
    cmap[uint32_t, int] seen_ahead
    cmap[uint32_t, Unexp*] unexp
    deque[void*] posted
    cmap[uint32_t, void*] bound

# One peer's connection on one rail (a NIC index); r2comm.Rail is a NIC summed over its peers.
cdef cppclass PairRail:
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
    double last_ack          # when the peer's process last acknowledged a chunk here
    double hc_t              # acks late: when the current health-check round began (0: none)
    uint64_t hc_acked        # the kernel's bytes acknowledged by the peer's kernel then
    int stalled              # held: acks late but the peer's kernel alive (process stalled)
    int fail_cause           # CAUSE_* of the failure being recorded
    double nic_check_t       # acks late: when this rank's NIC of the rail was last looked at
    int polled_listed        # in State.polled (a TPF_POLLED transport was attached here once)
    int nic_off              # a NIC under this rail (either end's) is announced down (facts.py):
                             # never connected on first use, counted down, probed only once the
                             # NIC is announced up again (set_nic_off)

cdef cppclass Peer:
    int rank
    int nrails
    vector[PairRail*] rails          # nrails data rails, then the control connection
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
    int same_host                # on this rank's host (set_same_host): its rails' rates say
                                 # nothing about this host's NICs (nic_rates)
    cmap[uint32_t, uint32_t] p2p_send_seq
    cmap[uint32_t, P2PState*] p2p

ctypedef pair[uint64_t, uint64_t] Key
ctypedef pair[uint32_t, uint32_t] CS
ctypedef pair[CS, int] CSR       # (comm, seq, the rank a verdict came from)
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
    cmap[uint32_t, int] revoked     # issue 44: revoked communicator ids (bounded: REVOKED_MAX)
    cmap[CS, pair[int, string]] verdicts   # (comm, seq) -> the judge's verdict on a mismatched
                             # collective posted here (the rank it came from, this one's where
                             # it judged, and the report), taken or published here
    cmap[CSR, string] early_verdicts   # (comm, seq, sender) -> a verdict on a call not posted
                             # here yet, per sender: post_op takes the one that counts
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
    vector[PairRail*] dack_list  # those rails (and some whose acks have gone since), for the timer
    vector[PairRail*] polled     # rails that had a TPF_POLLED connection (shm): polled every round
    int npolled              # polled.size(), read without the mutex (arming before a sleep)
    int poll_turn            # busy-poll rounds since epoll was last asked (progress_once)

cdef cppclass PlanC:
    vector[int] kind, peer, step, buf, mode, owned
    vector[uint64_t] off, nbytes
    vector[vector[double]] rw    # per message: a send's rail shares (empty: none declared)
    vector[pair[int, int]] deps

cdef inline double mono() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

cdef inline uint64_t rail_window(State* e, PairRail* r) noexcept nogil:
    """Outstanding bytes a rail may hold: the configured window, but no more than win_s of
    its measured throughput (at least one chunk), so a slow rail never sits on a backlog that
    the fast ones would have to wait for at the end of an operation. win_s must cover the
    round trip of an ack under load: acks ride behind the other direction's data in the NIC
    queues, and a window shorter than that round trip caps the rail below its rate, which the
    next measurement then confirms (a spiral measured in the testbed at 50 ms)."""
    cdef uint64_t w
    if r.rate <= 0:
        return r.window
    w = <uint64_t>(r.rate * e.win_s)
    if w < <uint64_t>e.cs:
        w = e.cs
    return w if w < r.window else r.window

# ---------------------------------------------------------------------------------------------
# The engine's functions the test hooks drive (defined in its parts)

cdef void rail_read(State* e, PairRail* r) noexcept nogil                   # rx.pxi
cdef void pump_peer(State* e, Peer* p) noexcept nogil                   # scheduler.pxi
cdef void lazy_ack_timer(State* e, double now) noexcept nogil           # tx.pxi
cdef P2PState* p2p_state(Peer* p, uint32_t comm) noexcept nogil         # matching.pxi
cdef double DACK_DELAY     # s: longest a delayed ack waits for a frame to ride with

# ---------------------------------------------------------------------------------------------
# The Python-facing classes' C fields (engine.pyx; the Engine's faces: engine_links.pxi,
# engine_tuning.pxi, engine_faults.pxi; ChannelCell: capi.pxi)

cdef class Plan:
    cdef PlanC* c
    cdef public str algo
    cdef public object info

cdef extern from "r2_capi.h" nogil:
    # the engine's C-level interface (engine.c_api(); the torch backend's C++ uses it)
    cdef struct r2_cell:
        uint32_t comm, seq, flags, gen
        double timeout
    cdef struct r2_capi:
        int version, size
    int R2_CAPI_VERSION, R2_CELL_SWITCH, R2_CELL_EPOCH, R2_CELL_REGMEM, R2_CELL_CLOSED
    const char* R2_CAPI_NAME
    uint32_t r2_cell_take(r2_cell* c)
    uint32_t r2_cell_load(const uint32_t* p)
    void r2_cell_store(uint32_t* p, uint32_t v)
    void r2_cell_or(uint32_t* p, uint32_t v)
    void r2_cell_and(uint32_t* p, uint32_t v)
    double r2_cell_timeout(r2_cell* c)
    void r2_cell_set_timeout(r2_cell* c, double t)
    int r2_atomic_add(int* p, int v)
    int r2_atomic_get(int* p)
    void r2_atomic_set(int* p, int v)

cdef struct SpinState:
    # a waiter's busy-polling policy and its counters (EngineTuning's spin* attributes;
    # spin_policy.pxi's wait_op_c)
    double spin              # seconds a waiter busy-polls before blocking in epoll
    int spin_short_left      # waits left that spin only SPIN_CONTENDED (see wait_op_c)
    bint spin_adapt          # shorten the spin after preempted ones (default on)
    bint spin_extend         # keep spinning while the sockets are busy (default on)
    int spin_yield           # empty polls between sched_yield() calls in a spin; 0 never
    uint64_t spin_yields     # sched_yield() calls made by spinning waiters
    uint64_t spin_extended   # waits that spun past their spin because sockets were busy
    int spin_strikes         # judged spins in a row that were preempted
    uint64_t spin_preempted  # waits whose spin was preempted (contended)

cdef struct EngineRef:
    # the engine as the C-level interface holds it (counted: the Engine, its faces (EnginePart)
    # and each C user); close() sets closing, waits until no C call is inside (users), then
    # frees the state
    State* e
    SpinState sp
    int refs
    int users
    int closing

cdef class ChannelCell:
    cdef r2_cell c

# An Engine's cold-path faces (Engine.links, .tuning, .faults): each holds a counted reference on
# the engine's EngineRef, as a C-level user does, not on the Engine (no reference cycle)
cdef class EnginePart:
    cdef EngineRef* h
    cdef _bind(self, EngineRef* h)
    cdef State* _live(self) except NULL
    cdef void _wake(self)

cdef class EngineLinks(EnginePart):          # engine_links.pxi
    cdef _attach(self, int peer, int rail, Transport* tp, intptr_t handle, uint32_t conn_id,
                 bytes tx_key, bytes rx_key)

cdef class EngineTuning(EnginePart):         # engine_tuning.pxi
    pass

cdef class EngineFaults(EnginePart):         # engine_faults.pxi
    pass

cdef class Engine:
    cdef State* e
    cdef EngineRef* h                # e and the spin policy, as the C-level interface holds them
    cdef int started
    cdef object thread
    cdef readonly EngineLinks links      # link administration (control/links.py, liveness, facts)
    cdef readonly EngineTuning tuning    # the spin policy and the tuning setters (world.py)
    cdef readonly EngineFaults faults    # fault injection
    cdef uint64_t post_c(self, Plan plan, uint64_t* bufs, int dtype, int redop, uint32_t comm,
                         uint32_t seq, uint32_t count, double timeout, members, int p2p,
                         int64_t key, uint64_t cap, int rail) except 0
    cdef int wait_op(self, State* e, uint64_t oid, double timeout, int* perr, string* pmsg,
                     uint64_t* pnrecv) noexcept nogil
    cdef State* _live(self) except NULL
    cdef void _wake(self)
