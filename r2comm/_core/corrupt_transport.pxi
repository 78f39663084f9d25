# The corrupting transport (part of the test extension, testing.pyx; testing.corrupt_next): put in
# front of one live connection (the rail's transport table and connection swapped under the
# engine's mutex, which every transport call is made under), it hands everything to the
# connection's own transport, except that the next DATA frame posted has one payload byte
# flipped on its way out: a middlebox writing into the stream. The engine's memory is never
# written (the flipped byte is posted from here), and the frame's MAC was computed by the engine
# before the post, so in mac mode the peer refuses the frame; with the checksum only it goes
# undetected. Its state goes with the connection; its table (one per wrapped transport, the
# wrapped one's flags and name) stays, as the engine reads a rail's table after a close.

cdef enum:
    CR_TABLES = 8            # transports (tables) the corrupting one can wrap

cdef Transport cr_tables[CR_TABLES]
cdef Transport* cr_wrapped[CR_TABLES]

cdef struct Corrupting:
    Transport* inner         # the connection's own transport, and its state
    void* conn
    PairRail* rail               # the engine's rail: which DATA frame is on it (tx_payload, tx_plen)
    uint64_t skip            # a frame already under way when the hook was set: left alone
    uint64_t cookie          # the frame being altered (0: none chosen yet)
    int done                 # its flipped byte was posted
    char flipped             # that byte, as posted

cdef inline Corrupting* cr_of(void* conn) noexcept nogil:
    return <Corrupting*>conn

cdef int64_t cr_isend(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    cdef Corrupting* c = cr_of(conn)
    cdef PairRail* r = c.rail
    cdef iovec out[12]
    cdef char* base
    cdef char* target
    cdef int i, k = 0, hit = 0
    cdef int64_t at = 0, n
    if c.done or cookie == 0 or cookie == c.skip or r.tx_plen == 0 or niov > 8 or \
            (c.cookie != 0 and cookie != c.cookie):
        return c.inner.isend(c.conn, iov, niov, cookie)
    c.cookie = cookie
    target = r.tx_payload + r.tx_plen // 2         # the byte the engine's hook used to flip
    for i in range(niov):
        base = <char*>iov[i].iov_base
        if not hit and base <= target < base + iov[i].iov_len:
            hit = 1
            at += target - base
            c.flipped = target[0] ^ 0x10
            if target > base:
                out[k].iov_base = base
                out[k].iov_len = <size_t>(target - base)
                k += 1
            out[k].iov_base = &c.flipped
            out[k].iov_len = 1
            k += 1
            if target + 1 < base + iov[i].iov_len:
                out[k].iov_base = target + 1
                out[k].iov_len = <size_t>(base + iov[i].iov_len - target - 1)
                k += 1
        else:
            if not hit:
                at += <int64_t>iov[i].iov_len
            out[k] = iov[i]
            k += 1
    n = c.inner.isend(c.conn, out, k, cookie)
    if hit and n > at:
        c.done = 1                                   # the flipped byte went out
    return n

cdef int cr_event_fd(void* conn) noexcept nogil:
    return cr_of(conn).inner.event_fd(cr_of(conn).conn)

cdef int cr_test(void* conn, uint64_t* out, int max) noexcept nogil:
    return cr_of(conn).inner.test(cr_of(conn).conn, out, max)

cdef int64_t cr_irecv(void* conn, void* buf, size_t n) noexcept nogil:
    return cr_of(conn).inner.irecv(cr_of(conn).conn, buf, n)

cdef int cr_reg_mr(void* conn, void* base, size_t n, void** mr) noexcept nogil:
    return cr_of(conn).inner.reg_mr(cr_of(conn).conn, base, n, mr)

cdef void cr_dereg_mr(void* conn, void* mr) noexcept nogil:
    cr_of(conn).inner.dereg_mr(cr_of(conn).conn, mr)

cdef int cr_os_fd(void* conn) noexcept nogil:
    return cr_of(conn).inner.os_fd(cr_of(conn).conn)

cdef void cr_shutdown(void* conn) noexcept nogil:
    cr_of(conn).inner.shutdown(cr_of(conn).conn)

cdef void cr_close(void* conn) noexcept nogil:
    cr_of(conn).inner.close(cr_of(conn).conn)
    free(conn)

cdef int cr_arm(void* conn) noexcept nogil:
    return cr_of(conn).inner.arm(cr_of(conn).conn)

cdef int cr_wake(void* conn) noexcept nogil:
    return cr_of(conn).inner.wake(cr_of(conn).conn)

cdef Transport* cr_table(Transport* inner) noexcept nogil:
    """The corrupting table in front of `inner` (made on first use); NULL if all are taken."""
    cdef int i
    cdef Transport* t
    for i in range(CR_TABLES):
        if cr_wrapped[i] == inner:
            return &cr_tables[i]
        if cr_wrapped[i] == NULL:
            cr_wrapped[i] = inner
            t = &cr_tables[i]
            t.name = inner.name
            t.flags = inner.flags
            t.adopt = NULL                          # wraps a live connection only
            t.event_fd, t.isend, t.test = cr_event_fd, cr_isend, cr_test
            t.irecv, t.reg_mr, t.dereg_mr = cr_irecv, cr_reg_mr, cr_dereg_mr
            t.os_fd, t.shutdown, t.close = cr_os_fd, cr_shutdown, cr_close
            t.arm = NULL                            # (zeroed: NULL for fd-driven ones)
            t.wake = NULL
            if inner.arm != NULL:
                t.arm = cr_arm
            if inner.wake != NULL:
                t.wake = cr_wake
            return t
    return NULL

cdef int corrupt_rail(PairRail* r) noexcept nogil:
    """Under the engine's mutex: the next DATA frame that starts on r's connection has a byte
    flipped (re-armed if r already has this transport). 0 if r has no live connection, 1 set,
    -1 out of memory."""
    cdef Corrupting* c
    if r.state != R_UP or r.conn == NULL:
        return 0
    cdef Transport* t
    if r.tp.isend == cr_isend:
        c = cr_of(r.conn)
    else:
        t = cr_table(r.tp)
        c = <Corrupting*>calloc(1, sizeof(Corrupting)) if t != NULL else NULL
        if c == NULL:
            return -1
        c.inner, c.conn, c.rail = r.tp, r.conn, r
        r.tp = t
        r.conn = c
    c.skip = r.tx_id if r.tx_busy and r.tx_sealed else 0
    c.cookie = 0
    c.done = 0
    return 1
