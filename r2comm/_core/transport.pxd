# The rail transport interface, in the spirit of NCCL's ncclNet_t: the engine moves bytes on a
# rail only through these calls, so a verbs transport can sit under the same engine.
# Connection set-up (listen / connect / accept, with the authenticated handshake) is cold path and
# lives in Python (r2comm/_core/tcp.py); these are the hot-path calls, all without the GIL.
from libc.stdint cimport int64_t

cdef extern from "<sys/uio.h>" nogil:
    cdef struct iovec:
        void* iov_base
        size_t iov_len

cdef struct Transport:
    const char* name
    # Send from up to 3 iovecs; bytes accepted, 0 if it would block, -errno on failure.
    int64_t (*post_send)(int fd, iovec* iov, int niov) noexcept nogil
    # Receive up to n bytes; bytes read, 0 if it would block, -errno on failure or -1000 on EOF.
    int64_t (*post_recv)(int fd, void* buf, size_t n) noexcept nogil
    # Make the connection unusable at once (both directions), then release it.
    void (*shutdown)(int fd) noexcept nogil
    void (*close)(int fd) noexcept nogil

cdef enum:
    T_EOF = -1000
