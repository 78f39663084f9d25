# The fuzz transport: an in-memory stand-in for TCP (Engine.fuzz_attach / fuzz_feed) that feeds
# a rail bytes from a buffer and keeps what the engine writes, so tests/fuzz_wire.py drives the
# receive path with any frames, without sockets or a progress thread.

cdef enum:
    FZ_RAILS = 4              # rails the fuzz transport keeps what the engine wrote for

cdef struct FuzzFeed:
    const char* src
    size_t n, pos
    uint32_t step, send_step
    int block
    uint64_t sent
    string out[FZ_RAILS]        # what the engine wrote, per rail (fd -2 - rail)

cdef FuzzFeed fz      # the in-memory transport of Engine.fuzz_attach / fuzz_feed (one at a time)

cdef int64_t fz_post_send(int fd, iovec* iov, int niov) noexcept nogil:
    cdef int64_t total = 0
    cdef int i
    cdef int64_t take
    cdef int slot = -2 - fd
    if fz.block:
        return 0
    for i in range(niov):
        total += iov[i].iov_len
    if fz.send_step > 0 and total > fz.send_step:
        total = fz.send_step
    if 0 <= slot < FZ_RAILS:
        take = total
        for i in range(niov):
            if take <= 0:
                break
            fz.out[slot].append(<const char*>iov[i].iov_base,
                                <size_t>(take if take < <int64_t>iov[i].iov_len else iov[i].iov_len))
            take -= <int64_t>iov[i].iov_len
    fz.sent += total
    return total

cdef int64_t fz_post_recv(int fd, void* buf, size_t n) noexcept nogil:
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

cdef void fz_shutdown(int fd) noexcept nogil:
    pass

cdef void fz_close(int fd) noexcept nogil:
    pass
