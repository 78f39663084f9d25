# The fuzz transport (part of the test extension, testing.pyx): an in-memory implementation of
# transport.pxd's interface (testing.fuzz_attach / fuzz_feed) that feeds a rail bytes from a
# buffer and keeps what the engine writes, so tests/fuzz_wire.py drives the receive path with any
# frames, without sockets or a progress thread. A connection's state names its rail (slot);
# posts complete inside isend, as TCP's.

cdef enum:
    FZ_RAILS = 4              # rails the fuzz transport keeps what the engine wrote for

cdef struct FuzzFeed:
    const char* src
    size_t n, pos
    uint32_t step, send_step
    int block
    uint64_t sent
    string out[FZ_RAILS]        # what the engine wrote, per rail (handle -2 - rail)

cdef FuzzFeed fz      # the in-memory transport of fuzz_attach / fuzz_feed (one at a time)
cdef bint fz_late_read = 0   # flag the transport TPF_LATE_READ (as verbs zero-copy): tests

cdef struct FuzzConn:
    int slot                    # the rail, or -1: what is written there is counted, not kept
    TDone done

cdef Transport FUZZ_TP

cdef void* fz_adopt(intptr_t handle) noexcept nogil:
    cdef FuzzConn* c = <FuzzConn*>malloc(sizeof(FuzzConn))
    if c != NULL:
        c.slot = <int>(-2 - handle)
        if c.slot >= FZ_RAILS:
            c.slot = -1
        c.done.n = 0
    return c

cdef int fz_event_fd(void* conn) noexcept nogil:
    return -1

cdef int64_t fz_isend(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    cdef FuzzConn* fc = <FuzzConn*>conn
    cdef int64_t total = iov_total(iov, niov), whole
    cdef int i
    cdef int64_t take
    if fz.block:
        return 0
    whole = total
    if fz.send_step > 0 and total > fz.send_step:
        total = fz.send_step
    if fc.slot >= 0:
        take = total
        for i in range(niov):
            if take <= 0:
                break
            fz.out[fc.slot].append(<const char*>iov[i].iov_base,
                                   <size_t>(take if take < <int64_t>iov[i].iov_len else iov[i].iov_len))
            take -= <int64_t>iov[i].iov_len
    fz.sent += total
    if total == whole:
        tdone_push(&fc.done, cookie)
    return total

cdef int fz_test(void* conn, uint64_t* out, int max) noexcept nogil:
    return tdone_take(&(<FuzzConn*>conn).done, out, max)

cdef int64_t fz_irecv(void* conn, void* buf, size_t n) noexcept nogil:
    cdef size_t k
    if fz.src == NULL or fz.pos >= fz.n or n == 0:
        return 0
    k = fz.n - fz.pos
    if k > n:
        k = n
    if fz.step > 0 and k > fz.step:
        k = fz.step
    memcpy(buf, fz.src + fz.pos, k)
    fz.pos += k
    return <int64_t>k

cdef void fz_shutdown(void* conn) noexcept nogil:
    pass

cdef void fz_close(void* conn) noexcept nogil:
    free(conn)

cdef Transport* fuzz_transport() noexcept nogil:
    FUZZ_TP.flags = TPF_LATE_READ if fz_late_read else 0
    FUZZ_TP.name = "fuzz"
    FUZZ_TP.adopt = fz_adopt
    FUZZ_TP.event_fd = fz_event_fd
    FUZZ_TP.isend = fz_isend
    FUZZ_TP.test = fz_test
    FUZZ_TP.irecv = fz_irecv
    FUZZ_TP.reg_mr = tp_reg_none
    FUZZ_TP.dereg_mr = tp_dereg_none
    FUZZ_TP.os_fd = fz_event_fd
    FUZZ_TP.shutdown = fz_shutdown
    FUZZ_TP.close = fz_close
    return &FUZZ_TP
