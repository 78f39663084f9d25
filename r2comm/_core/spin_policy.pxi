# A waiter's loop and its spin policy. A thread that waits for an operation (Engine.wait and
# run, the C-level capi_wait) drives progress itself (progress_once), so a message completes
# without a hand-off: it busy-polls the sockets for `spin` seconds, then blocks in epoll for at
# most 1 ms at a time. The policy (SpinState: EngineRef.sp, shared by every waiter of one
# engine; its knobs and counters are Engine.tuning's spin* attributes) rests on measurements:
#  1. A wait keeps spinning while its sockets are busy (spin_extend): past `spin` with no socket
#     events it sleeps in epoll. A fixed 1 ms spin handed the rest of a 4 MiB allreduce to
#     interrupt-driven wake-ups, 4-11% slower next to another process's periodic CPU use.
#  2. Busy-polling pays only while the thread has a CPU to itself; next to a CPU hog, spinning
#     delays the very work it waits for (2 cores, 1 MiB allreduce: 1152 us spinning 1 ms,
#     627 us not; unloaded 184 against 222 us). So two spins in a row that were preempted (an
#     involuntary context switch) and got under SPIN_SHARE of a CPU make the next SPIN_BACKOFF
#     waits spin only SPIN_CONTENDED, with no extension; then the full spin is tried again
#     (spin_adapt). Both signals are needed: unloaded, the kernel's softirq thread (this rank's
#     own TCP work) preempts most spins briefly, and its time is not charged to the thread. The
#     baseline is taken SPIN_BASE into a wait, so short waits make no extra system calls.
#  3. While spinning, every SPIN_YIELD empty polls yield the CPU (sched_yield, as MPICH does):
#     the waiter stays runnable, and a peer rank or the kernel's TCP work on its CPU runs
#     meanwhile (next to one hog, 1 MiB allreduce 1010-1094 us -> 374-396 us; unloaded the
#     same).
# Included into engine.pyx after progress.pxi.

cdef double SPIN_BASE = 50e-6     # s: into a wait, the spin's CPU baseline is taken
cdef double SPIN_JUDGE = 200e-6   # s: shortest spin (after SPIN_BASE) that is judged
cdef double SPIN_SHARE = 0.6      # a preempted spin that got less of a CPU than this lost it
cdef double SPIN_CONTENDED = 50e-6    # s: the spin while contended
cdef int SPIN_BACKOFF = 64        # waits to spin short after a contended spin
cdef int SPIN_YIELD = 16          # empty polls in a spin between two sched_yield() calls

cdef extern from "<sched.h>" nogil:
    int sched_yield()

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


cdef void spin_init(SpinState* sp) noexcept nogil:
    """A new engine's spin policy (its counters and strikes start at zero): spin 50 us, adapt
    and extend on, yield every SPIN_YIELD empty polls."""
    sp.spin = 50e-6
    sp.spin_adapt = 1
    sp.spin_extend = 1
    sp.spin_yield = SPIN_YIELD


cdef int wait_op_c(State* e, SpinState* sp, uint64_t oid, double timeout, int* perr,
                   string* pmsg, uint64_t* pnrecv) noexcept nogil:
    """A wait's loop (Engine.wait and run, capi_wait) under the spin policy `sp`: the
    operation's state once it ended or `timeout` passed (ST_ACTIVE), -1 if the engine stopped
    or the operation is unknown."""
    cdef Op* op
    cdef timespec ts
    cdef double until = mono() + timeout, t
    cdef int state = -1, err = 0
    cdef string msg
    cdef uint64_t nrecv = 0
    cdef double w0 = mono(), spin, b0 = 0, c0 = 0
    cdef long pre0 = 0
    cdef int idle, judged = 0
    # the spin of this wait: SPIN_CONTENDED while backing off from a contended CPU (2 above)
    spin = sp.spin
    if sp.spin_short_left > 0:
        sp.spin_short_left -= 1
        if spin > SPIN_CONTENDED:
            spin = SPIN_CONTENDED
    cdef double spin_until = w0 + spin, judge_at = w0 + spin
    cdef bint extend = sp.spin_extend and spin >= sp.spin and spin > 0
    cdef int nev, empty = 0, extended = 0
    cdef double paused0, moved = 0      # this process's own pauses extend the wait too
    pthread_mutex_lock(&e.mu)
    e.waiters += 1
    paused0 = e.self_paused
    pthread_mutex_unlock(&e.mu)
    while True:
        pthread_mutex_lock(&e.mu)
        moved = e.self_paused - paused0
        it = e.ops.find(oid)
        if it == e.ops.end():
            state = -1
            pthread_mutex_unlock(&e.mu)
            break
        op = deref(it).second
        if op.state != ST_ACTIVE and not verdict_pending(e, op):
            state = op.state
            err = op.err
            msg = op.msg
            nrecv = op.nbytes_recv
            if err == E_MISMATCH and not op.p2p:
                clear_mismatch(e, op)
            pthread_mutex_unlock(&e.mu)
            break
        pthread_mutex_unlock(&e.mu)
        t = mono()
        # judging the spin (2 above): baseline SPIN_BASE into the wait, verdict at its end
        if b0 == 0 and t - w0 >= SPIN_BASE and t < judge_at and sp.spin_adapt:
            b0 = t
            c0 = thread_cpu()
            pre0 = preemptions()
        if not judged and b0 > 0 and t >= judge_at:
            judged = 1
            if t - b0 >= SPIN_JUDGE:
                if preemptions() != pre0 and (thread_cpu() - c0) < SPIN_SHARE * (t - b0):
                    sp.spin_preempted += 1
                    sp.spin_strikes += 1
                    if sp.spin_strikes >= 2:
                        sp.spin_strikes = 0
                        sp.spin_short_left = SPIN_BACKOFF
                else:
                    sp.spin_strikes = 0
        if t >= until + moved:
            state = ST_ACTIVE
            break
        # drive progress here: poll briefly, then block in epoll for at most 1 ms
        idle = 0 if t < spin_until else (1 if until + moved - t > 0.001 else 0)
        nev = progress_once(e, idle)
        if nev < 0:
            state = -1
            break
        if nev > 0 and extend and sp.spin_short_left == 0:     # busy sockets (1 above)
            if t + spin > judge_at and not extended:
                extended = 1
                sp.spin_extended += 1
            spin_until = t + spin
        if nev == 0 and idle == 0 and sp.spin_yield > 0:      # yielding (3 above)
            empty += 1
            if empty >= sp.spin_yield:
                empty = 0
                sp.spin_yields += 1
                sched_yield()
    pthread_mutex_lock(&e.mu)
    e.waiters -= 1
    pthread_mutex_unlock(&e.mu)
    perr[0] = err
    pmsg[0] = msg
    pnrecv[0] = nrecv
    return state
