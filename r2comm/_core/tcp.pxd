# TCP rail transport, the hot-path half (transport.pxd's interface on an established,
# non-blocking socket): isend is one sendmsg, irecv one recv; the kernel copies what it accepts,
# so a post completes inside the isend that accepts its last byte.
from libc.stdint cimport int64_t, uint64_t, intptr_t
from libc.stdlib cimport malloc, free
from libc.errno cimport errno, EAGAIN, EINTR
from libc.string cimport memset
from r2comm._core.transport cimport (iovec, Transport, T_EOF, TDone, tdone_push, tdone_take,
                                     iov_total, tp_reg_none, tp_dereg_none)

cdef extern from "<sys/socket.h>" nogil:
    cdef struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr* m, int flags)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    int shutdown(int fd, int how)
    enum: MSG_NOSIGNAL, MSG_DONTWAIT, SHUT_RDWR

cdef extern from "<unistd.h>" nogil:
    int close(int fd)

cdef struct TcpConn:
    int fd
    TDone done

cdef inline int64_t tcp_sendv(int fd, iovec* iov, int niov) noexcept nogil:
    """One non-blocking sendmsg: bytes accepted, 0 if it would block, -errno on failure."""
    cdef msghdr m
    cdef ssize_t n
    memset(&m, 0, sizeof(m))
    m.msg_iov = iov
    m.msg_iovlen = niov
    while True:
        n = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT)
        if n >= 0:
            return n
        if errno == EINTR:
            continue
        if errno == EAGAIN:
            return 0
        return -errno

cdef inline int64_t tcp_recv1(int fd, void* buf, size_t n) noexcept nogil:
    cdef ssize_t r
    while True:
        r = recv(fd, buf, n, MSG_DONTWAIT)
        if r > 0:
            return r
        if r == 0:
            return T_EOF
        if errno == EINTR:
            continue
        if errno == EAGAIN:
            return 0
        return -errno

cdef inline void* tcp_adopt(intptr_t fd) noexcept nogil:
    cdef TcpConn* c = <TcpConn*>malloc(sizeof(TcpConn))
    if c != NULL:
        c.fd = <int>fd
        c.done.n = 0
    return c

cdef inline int tcp_event_fd(void* conn) noexcept nogil:
    return (<TcpConn*>conn).fd

cdef inline int64_t tcp_isend(void* conn, iovec* iov, int niov, uint64_t cookie) noexcept nogil:
    cdef TcpConn* c = <TcpConn*>conn
    cdef int64_t n = tcp_sendv(c.fd, iov, niov)
    if cookie != 0 and n > 0 and n == iov_total(iov, niov):
        tdone_push(&c.done, cookie)
    return n

cdef inline int tcp_test(void* conn, uint64_t* out, int max) noexcept nogil:
    return tdone_take(&(<TcpConn*>conn).done, out, max)

cdef inline int64_t tcp_irecv(void* conn, void* buf, size_t n) noexcept nogil:
    return tcp_recv1((<TcpConn*>conn).fd, buf, n)

cdef inline void tcp_shutdown(void* conn) noexcept nogil:
    shutdown((<TcpConn*>conn).fd, SHUT_RDWR)

cdef inline void tcp_close(void* conn) noexcept nogil:
    close((<TcpConn*>conn).fd)
    free(conn)

cdef inline void tcp_transport(Transport* t) noexcept nogil:
    t.name = "tcp"
    t.flags = 0
    t.adopt = tcp_adopt
    t.event_fd = tcp_event_fd
    t.isend = tcp_isend
    t.test = tcp_test
    t.irecv = tcp_irecv
    t.reg_mr = tp_reg_none
    t.dereg_mr = tp_dereg_none
    t.os_fd = tcp_event_fd
    t.shutdown = tcp_shutdown
    t.close = tcp_close
