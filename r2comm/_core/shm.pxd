# Shared-memory rail transport, the hot-path half (transport.pxd's interface): the rings and
# the doorbell live in r2_shm.h; set-up (segment names, handshake, clean-up) in r2comm/transport/shm.py.
# A stream like TCP: isend copies a prefix of the gather list into the ring (completes inside
# the call), irecv copies out. TPF_POLLED: the engine polls it every progress round and arms the
# doorbell before it sleeps. TPF_NO_NIC: injected NIC faults do not apply; a dead peer shows as
# EOF on the doorbell socket.
from libc.stdint cimport int64_t, uint64_t, uint32_t, intptr_t
from libc.stdlib cimport malloc, free
from r2comm._core.transport cimport (iovec, Transport, T_EOF, TDone, tdone_push, tdone_take,
                                     iov_total, tp_reg_none, tp_dereg_none, TPF_POLLED, TPF_WAKE_OUT, TPF_NO_NIC)

cdef extern from "r2_shm.h" nogil:
    cdef struct r2_shm_conn:
        int fd
        int dead
        int armed
        int tx_blocked
        uint64_t size
        uint64_t bells
    cdef struct r2_shm_setup:
        int fd
        int side
        char* base
        size_t map_len
    int r2_shm_ring_ok(uint64_t ring_bytes)
    size_t r2_shm_seg_len(uint64_t ring_bytes)
    uint64_t r2_shm_ring_of(size_t map_len)
    char* r2_shm_create(const char* name, uint64_t ring_bytes, uint32_t conn_id, const char* job,
                        uint64_t pid, size_t* len, int* err)
    char* r2_shm_attach(const char* name, uint32_t conn_id, const char* job, size_t* len,
                        int* err)
    r2_shm_conn* r2_shm_adopt(const r2_shm_setup* s)
    int64_t r2_shm_write(r2_shm_conn* c, const iovec* iov, int niov)
    int64_t r2_shm_read(r2_shm_conn* c, void* buf, size_t n)
    int r2_shm_arm(r2_shm_conn* c)
    int r2_shm_wake(r2_shm_conn* c)
    void r2_shm_shutdown(r2_shm_conn* c)
    void r2_shm_close(r2_shm_conn* c)

cdef inline int shm_setup(r2_shm_setup* st, int fd, uint64_t base, uint64_t map_len, int side,
                          str what) except -1:
    """Fill `st` for r2_shm_adopt, checked: side 0 or 1 and a mapped segment of a valid length
    (ValueError naming `what` otherwise)."""
    if side not in (0, 1) or base == 0 or r2_shm_ring_of(map_len) == 0:
        raise ValueError(f"{what}: side 0 or 1 and a mapped segment of a valid length")
    st.fd = fd
    st.side = side
    st.base = <char*>base
    st.map_len = map_len
    return 0

cdef struct ShmConn:
    r2_shm_conn* c
    TDone done

cdef inline void* shm_adopt(intptr_t handle) noexcept nogil:
    """handle: the address of an r2_shm_setup (a mapped segment and a connected socket)."""
    cdef ShmConn* s = <ShmConn*>malloc(sizeof(ShmConn))
    if s == NULL:
        return NULL
    s.c = r2_shm_adopt(<const r2_shm_setup*>handle)
    if s.c == NULL:
        free(s)
        return NULL
    s.done.n = 0
    return s

cdef inline int shm_event_fd(void* conn) noexcept nogil:
    return (<ShmConn*>conn).c.fd

cdef inline int shm_no_fd(void* conn) noexcept nogil:
    return -1

cdef inline int64_t shm_isend(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    cdef ShmConn* s = <ShmConn*>conn
    cdef int64_t n = r2_shm_write(s.c, iov, niov)
    if cookie != 0 and n > 0 and n == iov_total(iov, niov):
        tdone_push(&s.done, cookie)
    return n

cdef inline int shm_test(void* conn, uint64_t* out, int max) noexcept nogil:
    return tdone_take(&(<ShmConn*>conn).done, out, max)

cdef inline int64_t shm_irecv(void* conn, void* buf, size_t n) noexcept nogil:
    return r2_shm_read((<ShmConn*>conn).c, buf, n)

cdef inline int shm_arm(void* conn) noexcept nogil:
    return r2_shm_arm((<ShmConn*>conn).c)

cdef inline int shm_wake(void* conn) noexcept nogil:
    return r2_shm_wake((<ShmConn*>conn).c)

cdef inline void shm_shutdown(void* conn) noexcept nogil:
    r2_shm_shutdown((<ShmConn*>conn).c)

cdef inline void shm_close(void* conn) noexcept nogil:
    r2_shm_close((<ShmConn*>conn).c)
    free(conn)

cdef inline void shm_transport(Transport* t) noexcept nogil:
    t.name = "shm"
    t.adopt = shm_adopt
    t.event_fd = shm_event_fd
    t.isend = shm_isend
    t.test = shm_test
    t.irecv = shm_irecv
    t.reg_mr = tp_reg_none
    t.dereg_mr = tp_dereg_none
    t.os_fd = shm_no_fd
    t.shutdown = shm_shutdown
    t.close = shm_close
    t.flags = TPF_POLLED | TPF_WAKE_OUT | TPF_NO_NIC
    t.arm = shm_arm
    t.wake = shm_wake
