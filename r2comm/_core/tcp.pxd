# TCP rail transport: the hot-path half (non-blocking sendmsg/recv on an established socket).
from libc.stdint cimport int64_t
from libc.errno cimport errno, EAGAIN, EINTR
from libc.string cimport memset
from r2comm._core.transport cimport iovec, Transport, T_EOF

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

cdef inline int64_t tcp_post_send(int fd, iovec* iov, int niov) noexcept nogil:
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

cdef inline int64_t tcp_post_recv(int fd, void* buf, size_t n) noexcept nogil:
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

cdef inline void tcp_shutdown(int fd) noexcept nogil:
    shutdown(fd, SHUT_RDWR)

cdef inline void tcp_close(int fd) noexcept nogil:
    close(fd)

cdef inline void tcp_transport(Transport* t) noexcept nogil:
    t.name = "tcp"
    t.post_send = tcp_post_send
    t.post_recv = tcp_post_recv
    t.shutdown = tcp_shutdown
    t.close = tcp_close
