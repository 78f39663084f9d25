# The fake transport (part of the test extension, testing.pyx; testing.use_fake_transport,
# R2COMM_TEST_TRANSPORT, read by tests/fake_transport.py): transport.pxd's interface over real TCP sockets with seeded faults, so
# multi-rank collectives run on it under mpiexec: posts refused (would block) or accepted in
# part, short reads, send completions held back and handed over late and shuffled, some lost,
# and connections that fail at a random byte (the socket is shut down there: both ends lose it
# and what was in flight). One configuration per process (fk), as the fuzz transport's.

cdef enum:
    FK_HELD = 16              # completions a connection holds back

cdef struct FakeCfg:
    uint64_t seed
    double p_block, p_short, p_delay, p_lose, p_fail
    int64_t fail_bytes        # a failing connection dies within its first fail_bytes bytes sent
    int fails_left            # connections that may still be given a failure point
    uint64_t conns
    uint64_t blocked, shorts, delayed, reordered, lost, failed, completed

cdef struct FakeConn:
    int fd
    int dead
    uint64_t rng
    int64_t sent
    int64_t fail_at           # -1: never
    int nheld
    uint64_t held[FK_HELD]

cdef FakeCfg fk
cdef Transport FAKE_TP

cdef inline uint64_t fk_next(uint64_t* s) noexcept nogil:
    """splitmix64"""
    cdef uint64_t z
    s[0] += <uint64_t>0x9E3779B97F4A7C15
    z = s[0]
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)

cdef inline double fk_unit(FakeConn* c) noexcept nogil:
    return <double>(fk_next(&c.rng) >> 11) * (1.0 / 9007199254740992.0)

cdef void* fk_adopt(intptr_t fd) noexcept nogil:
    cdef FakeConn* c = <FakeConn*>malloc(sizeof(FakeConn))
    if c == NULL:
        return NULL
    fk.conns += 1
    c.fd = <int>fd
    c.dead = 0
    c.rng = fk.seed * <uint64_t>0x100000001B3 + fk.conns
    fk_next(&c.rng)
    c.sent = 0
    c.fail_at = -1
    c.nheld = 0
    if fk.fails_left > 0 and fk.fail_bytes > 0 and fk_unit(c) < fk.p_fail:
        fk.fails_left -= 1
        c.fail_at = <int64_t>(fk_next(&c.rng) % <uint64_t>fk.fail_bytes)
    return c

cdef int fk_event_fd(void* conn) noexcept nogil:
    return (<FakeConn*>conn).fd

cdef void fk_die(FakeConn* c) noexcept nogil:
    if not c.dead:
        c.dead = 1
        c.nheld = 0               # what was not completed is lost with the connection
        fk.failed += 1
        sock_shutdown(c.fd, SHUT_RDWR)

cdef int64_t fk_isend(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    cdef FakeConn* c = <FakeConn*>conn
    cdef iovec part[8]
    cdef int64_t total = iov_total(iov, niov), lim, n, left
    cdef int i, k = 0
    if c.dead:
        return -104               # ECONNRESET
    if c.fail_at >= 0 and c.sent >= c.fail_at:
        fk_die(c)
        return -104
    if fk_unit(c) < fk.p_block:
        fk.blocked += 1
        return 0
    lim = total
    if total > 1 and fk_unit(c) < fk.p_short:
        lim = 1 + <int64_t>(fk_next(&c.rng) % <uint64_t>(total - 1))
        fk.shorts += 1
    if c.fail_at >= 0 and lim > c.fail_at - c.sent:
        lim = c.fail_at - c.sent          # the connection dies at that byte: the next post
    if lim < total and niov <= 8:
        left = lim
        for i in range(niov):
            if left <= 0:
                break
            part[k].iov_base = iov[i].iov_base
            part[k].iov_len = iov[i].iov_len if <int64_t>iov[i].iov_len < left else <size_t>left
            left -= <int64_t>part[k].iov_len
            k += 1
        n = tcp_sendv(c.fd, part, k)
    else:
        n = tcp_sendv(c.fd, iov, niov)
    if n > 0:
        c.sent += n
        if cookie != 0 and n == total:
            if fk_unit(c) < fk.p_lose:
                fk.lost += 1
            elif c.nheld < FK_HELD:
                c.held[c.nheld] = cookie
                c.nheld += 1
    return n

cdef int fk_test(void* conn, uint64_t* out, int max) noexcept nogil:
    """Hand over some of the held completions (each with probability 1 - p_delay), shuffled."""
    cdef FakeConn* c = <FakeConn*>conn
    cdef int i, j, k = 0, kept = 0
    cdef uint64_t t
    for i in range(c.nheld):
        if k < max and fk_unit(c) >= fk.p_delay:
            out[k] = c.held[i]
            k += 1
        else:
            c.held[kept] = c.held[i]
            kept += 1
            fk.delayed += 1
    c.nheld = kept
    for i in range(k - 1, 0, -1):
        j = <int>(fk_next(&c.rng) % <uint64_t>(i + 1))
        if j != i:
            t = out[i]
            out[i] = out[j]
            out[j] = t
            fk.reordered += 1
    fk.completed += k
    return k

cdef int64_t fk_irecv(void* conn, void* buf, size_t n) noexcept nogil:
    cdef FakeConn* c = <FakeConn*>conn
    if c.dead:
        return -104
    if n > 1 and fk_unit(c) < fk.p_short:
        n = 1 + <size_t>(fk_next(&c.rng) % <uint64_t>(n - 1))
    return tcp_recv1(c.fd, buf, n)

cdef void fk_shutdown(void* conn) noexcept nogil:
    sock_shutdown((<FakeConn*>conn).fd, SHUT_RDWR)

cdef void fk_close(void* conn) noexcept nogil:
    close((<FakeConn*>conn).fd)
    free(conn)

cdef Transport* fake_transport() noexcept nogil:
    FAKE_TP.flags = 0
    FAKE_TP.name = "fake"
    FAKE_TP.adopt = fk_adopt
    FAKE_TP.event_fd = fk_event_fd
    FAKE_TP.isend = fk_isend
    FAKE_TP.test = fk_test
    FAKE_TP.irecv = fk_irecv
    FAKE_TP.reg_mr = tp_reg_none
    FAKE_TP.dereg_mr = tp_dereg_none
    FAKE_TP.os_fd = fk_event_fd
    FAKE_TP.shutdown = fk_shutdown
    FAKE_TP.close = fk_close
    return &FAKE_TP
