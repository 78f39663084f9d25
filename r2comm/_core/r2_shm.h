// Shared-memory rail transport (issue 20), the C half: one POSIX shm segment per pair of local
// ranks holding two single-producer/single-consumer byte rings (lower rank -> higher, and
// back), plus a connected socket per pair used only as a doorbell and as the peer's liveness.
//
// Ring protocol (both processes, lock-free):
//   producer  copies bytes at head, publishes head (release) every R2_SHM_PUBLISH bytes, then a
//             full fence and a look at the consumer's rx_sleep flag: set -> take it (exchange)
//             and write one doorbell byte. Space is read from tail (acquire), cached.
//   consumer  reads head (acquire), copies out, publishes tail (release), full fence, and rings
//             the producer if it announced tx_wait (ring was full while it went to sleep).
//   arm       (the engine is about to block in epoll) rx_sleep := 1 (and tx_wait := 1 if the
//             last post was short), full fence, then re-check head/tail: anything there -> do
//             not sleep. Dekker-style: either the producer sees the flag, or we see its bytes.
//   wake      (the doorbell fd is readable) drain the doorbell bytes; EOF / error = the peer's
//             end is gone (its process died, or the connection was shut down): remembered,
//             reported by irecv once the ring is empty (bytes written before death still count).
// No system call on the data path while both ends are awake: doorbells only while one sleeps.
#pragma once
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define R2_SHM_MAGIC 0x3130474e495232ULL      /* "2RING01" */
#define R2_SHM_VERSION 1
#define R2_SHM_PUBLISH (64u << 10)            /* bytes copied between head publications */
#define R2_SHM_HDR 4096                       /* header page; the rings' data follow */
#define R2_SHM_MIN_RING 4096ULL               /* each ring's data size: a power of two ... */
#define R2_SHM_MAX_RING (1ULL << 30)          /* ... in [4 KiB, 1 GiB] (R2COMM_SHM_RING's bounds) */
#define R2_SHM_EBADSEG EPROTO                 /* attach: not the segment the handshake named */
#define R2_SHM_EOWNER EPERM                   /* attach: another user's, or group/other can open it */
#define R2_SHM_EOF (-1000)                    /* == T_EOF of transport.pxd */

struct r2_ring_ctl {                          // one direction's counters, each on its own lines
    alignas(128) uint64_t head;               // written by the producer only
    alignas(128) uint64_t tail;               // written by the consumer only
    alignas(128) uint32_t rx_sleep;           // consumer may sleep: producer rings after a write
    alignas(128) uint32_t tx_wait;            // producer waits for space: consumer rings after a read
};

struct r2_seg_hdr {
    uint64_t magic;
    uint32_t version;
    uint32_t conn_id;                         // the connection id of the authenticated handshake
    uint64_t ring_bytes;                      // each ring's data size (a power of two)
    uint64_t creator_pid;
    char job[8];                              // the job id (hash of the job secret)
    alignas(128) r2_ring_ctl ring[2];         // [0]: creator -> peer, [1]: peer -> creator
};

static_assert(sizeof(r2_seg_hdr) <= R2_SHM_HDR, "shm header fits its page");

struct r2_shm_conn {
    int fd;                                   // doorbell / liveness socket
    int dead;                                 // 0, or R2_SHM_EOF / -errno once the peer's end went
    int armed;                                // rx_sleep (and maybe tx_wait) set since last wake
    int tx_blocked;                           // the last post was refused or cut short: full ring
    char* base;
    size_t map_len;
    uint64_t size, mask;
    r2_ring_ctl* tx;
    char* txd;
    uint64_t tx_head, tx_tail;                // our head; the consumer's tail as last read
    r2_ring_ctl* rx;
    char* rxd;
    uint64_t rx_tail;                         // our tail
    uint64_t bells;                           // doorbells rung (tests / stats)
};

struct r2_shm_setup {                         // what adopt() is handed (by address)
    int fd;
    int side;                                 // 0: creator (lower rank), 1: the peer
    char* base;
    size_t map_len;                           // the mapping's length: the rings' size follows
};

// A ring size this side accepts: a power of two within the bounds (so the segment's length
// below cannot wrap).
static inline int r2_shm_ring_ok(uint64_t ring_bytes) {
    return ring_bytes >= R2_SHM_MIN_RING && ring_bytes <= R2_SHM_MAX_RING &&
           (ring_bytes & (ring_bytes - 1)) == 0;
}

static inline size_t r2_shm_seg_len(uint64_t ring_bytes) {
    return R2_SHM_HDR + 2 * (size_t)ring_bytes;
}

// The rings' size of a mapping of map_len bytes, or 0 if no valid ring size gives that length.
// Adopt takes the size from here (what this process mapped), never from the shared header.
static inline uint64_t r2_shm_ring_of(size_t map_len) {
    if (map_len <= R2_SHM_HDR || (map_len - R2_SHM_HDR) % 2 != 0) return 0;
    uint64_t rb = (uint64_t)(map_len - R2_SHM_HDR) / 2;
    return r2_shm_ring_ok(rb) ? rb : 0;
}

// -- cold path: segments ------------------------------------------------------------------------
// Create name (O_EXCL, 0600), size it, map it, fill the header. NULL and *err = errno on failure
// (the name is unlinked again then).
static inline char* r2_shm_create(const char* name, uint64_t ring_bytes, uint32_t conn_id,
                                  const char* job, uint64_t pid, size_t* len, int* err) {
    if (!r2_shm_ring_ok(ring_bytes)) { *err = EINVAL; return NULL; }
    size_t n = r2_shm_seg_len(ring_bytes);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) { *err = errno; return NULL; }
    if (ftruncate(fd, (off_t)n) != 0) { *err = errno; close(fd); shm_unlink(name); return NULL; }
    // reserve the pages now: a full /dev/shm (a container's 64 MiB) is an error here, at
    // set-up, instead of a SIGBUS in the middle of a copy later
    int rc = posix_fallocate(fd, 0, (off_t)n);
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
        *err = rc; close(fd); shm_unlink(name); return NULL;
    }
    void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) { *err = e; shm_unlink(name); return NULL; }
    r2_seg_hdr* h = (r2_seg_hdr*)p;           // fresh pages are zero: counters and flags are 0
    h->version = R2_SHM_VERSION;
    h->conn_id = conn_id;
    h->ring_bytes = ring_bytes;
    h->creator_pid = pid;
    memcpy(h->job, job, 8);
    __atomic_store_n(&h->magic, (uint64_t)R2_SHM_MAGIC, __ATOMIC_RELEASE);
    *len = n;
    return (char*)p;
}

// Map an existing segment and check it is the one the handshake named and that nobody else
// can open it: a regular file of this user with no group/other permission bits (else *err =
// R2_SHM_EOWNER), then magic, version, job, connection id, a valid ring size read once and a
// length that matches it exactly (else R2_SHM_EBADSEG). NULL and *err on failure. The mapping is
// HDR + 2 * ring bytes long; adopt works from that length, not from the header (which whoever
// holds the segment can still rewrite).
static inline char* r2_shm_attach(const char* name, uint32_t conn_id, const char* job,
                                  size_t* len, int* err) {
    struct stat st;
    int fd = shm_open(name, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) { *err = errno; return NULL; }
    if (fstat(fd, &st) != 0) { *err = errno; close(fd); return NULL; }
    if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
        *err = R2_SHM_EOWNER; close(fd); return NULL;
    }
    if (st.st_size < (off_t)R2_SHM_HDR || r2_shm_ring_of((size_t)st.st_size) == 0) {
        *err = R2_SHM_EBADSEG; close(fd); return NULL;
    }
    size_t n = (size_t)st.st_size;
    void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) { *err = e; return NULL; }
    r2_seg_hdr* h = (r2_seg_hdr*)p;
    int ok = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == R2_SHM_MAGIC;   // then the rest
    uint64_t rb = __atomic_load_n(&h->ring_bytes, __ATOMIC_RELAXED);         // read once
    if (!ok || h->version != R2_SHM_VERSION || h->conn_id != conn_id ||
            memcmp(h->job, job, 8) != 0 || !r2_shm_ring_ok(rb) || r2_shm_seg_len(rb) != n) {
        munmap(p, n);
        *err = R2_SHM_EBADSEG;
        return NULL;
    }
    *len = n;
    return (char*)p;
}

// -- the connection -----------------------------------------------------------------------------
// Take over a mapped segment (create's or attach's). Nothing is read from the segment: the
// rings' size comes from the mapping's length (NULL if that is not a valid segment length) and
// every counter starts at 0, as create wrote them; what the other side publishes later is
// bounds-checked on every read (r2_shm_write, r2_shm_read).
static inline r2_shm_conn* r2_shm_adopt(const r2_shm_setup* s) {
    uint64_t rb = r2_shm_ring_of(s->map_len);
    if (rb == 0 || (s->side != 0 && s->side != 1) || s->base == NULL) return NULL;
    r2_shm_conn* c = (r2_shm_conn*)calloc(1, sizeof(r2_shm_conn));
    if (c == NULL) return NULL;
    r2_seg_hdr* h = (r2_seg_hdr*)s->base;
    c->fd = s->fd;
    c->base = s->base;
    c->map_len = s->map_len;
    c->size = rb;
    c->mask = rb - 1;
    int t = s->side, r = 1 - s->side;
    c->tx = &h->ring[t];
    c->txd = s->base + R2_SHM_HDR + (size_t)t * rb;
    c->rx = &h->ring[r];
    c->rxd = s->base + R2_SHM_HDR + (size_t)r * rb;
    c->tx_head = 0;                           // a segment is adopted once per side, fresh
    c->tx_tail = 0;
    c->rx_tail = 0;
    return c;
}

static inline void r2_shm_bell(r2_shm_conn* c) {
    char b = 1;
    c->bells++;
    // a full socket buffer (EAGAIN) means a doorbell is pending already: nothing lost
    (void)send(c->fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static inline void r2_shm_disarm(r2_shm_conn* c) {
    if (c->armed) {
        __atomic_store_n(&c->rx->rx_sleep, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&c->tx->tx_wait, 0, __ATOMIC_RELAXED);
        c->armed = 0;
    }
}

// Copy a prefix of the gather list into the tx ring: bytes accepted, 0 if full, <0 failed.
static inline int64_t r2_shm_write(r2_shm_conn* c, const struct iovec* iov, int niov) {
    if (c->dead) return c->dead;
    uint64_t total = 0;
    for (int i = 0; i < niov; i++) total += iov[i].iov_len;
    if (total == 0) return 0;
    uint64_t head = c->tx_head;
    uint64_t space = c->size - (head - c->tx_tail);
    if (space < total) {
        c->tx_tail = __atomic_load_n(&c->tx->tail, __ATOMIC_ACQUIRE);
        if (head - c->tx_tail > c->size) { c->dead = -EPROTO; return c->dead; }   // corrupt
        space = c->size - (head - c->tx_tail);
    }
    if (space == 0) { c->tx_blocked = 1; return 0; }
    uint64_t n = total < space ? total : space, left = n, since = 0;
    for (int i = 0; i < niov && left > 0; i++) {
        const char* src = (const char*)iov[i].iov_base;
        uint64_t len = iov[i].iov_len < left ? iov[i].iov_len : left;
        while (len > 0) {
            uint64_t pos = head & c->mask;
            uint64_t k = c->size - pos;
            if (k > len) k = len;
            if (k > R2_SHM_PUBLISH) k = R2_SHM_PUBLISH;
            memcpy(c->txd + pos, src, k);
            src += k; len -= k; left -= k; head += k; since += k;
            if (since >= R2_SHM_PUBLISH) {    // let the consumer start on it (pipelined copy)
                __atomic_store_n(&c->tx->head, head, __ATOMIC_RELEASE);
                since = 0;
            }
        }
    }
    __atomic_store_n(&c->tx->head, head, __ATOMIC_RELEASE);
    c->tx_head = head;
    c->tx_blocked = n < total;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->tx->rx_sleep, __ATOMIC_RELAXED) &&
            __atomic_exchange_n(&c->tx->rx_sleep, 0, __ATOMIC_ACQ_REL))
        r2_shm_bell(c);
    return (int64_t)n;
}

// Copy up to n bytes out of the rx ring: bytes read, 0 if none, R2_SHM_EOF / -errno once the
// ring is empty and the peer's end is gone.
static inline int64_t r2_shm_read(r2_shm_conn* c, void* buf, size_t n) {
    r2_shm_disarm(c);
    uint64_t tail = c->rx_tail;
    uint64_t head = __atomic_load_n(&c->rx->head, __ATOMIC_ACQUIRE);
    uint64_t avail = head - tail;
    if (avail == 0) return c->dead;
    if (avail > c->size) { c->dead = -EPROTO; return c->dead; }     // corrupt counters
    if (avail > n) avail = n;
    uint64_t pos = tail & c->mask, k = c->size - pos;
    if (k > avail) k = avail;
    memcpy(buf, c->rxd + pos, k);
    if (avail > k) memcpy((char*)buf + k, c->rxd, avail - k);
    tail += avail;
    __atomic_store_n(&c->rx->tail, tail, __ATOMIC_RELEASE);
    c->rx_tail = tail;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->rx->tx_wait, __ATOMIC_RELAXED) &&
            __atomic_exchange_n(&c->rx->tx_wait, 0, __ATOMIC_ACQ_REL))
        r2_shm_bell(c);
    return (int64_t)avail;
}

// About to sleep: ask for a doorbell. 1: do not sleep (bytes or space are there), 0: armed.
static inline int r2_shm_arm(r2_shm_conn* c) {
    if (c->dead) return 1;
    __atomic_store_n(&c->rx->rx_sleep, 1, __ATOMIC_RELAXED);
    if (c->tx_blocked) __atomic_store_n(&c->tx->tx_wait, 1, __ATOMIC_RELAXED);
    c->armed = 1;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->rx->head, __ATOMIC_ACQUIRE) != c->rx_tail) return 1;
    if (c->tx_blocked && c->tx_head - __atomic_load_n(&c->tx->tail, __ATOMIC_ACQUIRE) < c->size)
        return 1;
    return 0;
}

// The doorbell fd is readable: drain it. A closed or failed socket marks the connection dead
// (irecv reports it once the ring is empty). Returns 0.
static inline int r2_shm_wake(r2_shm_conn* c) {
    char b[256];
    for (int i = 0; i < 64 && !c->dead; i++) {
        ssize_t r = recv(c->fd, b, sizeof(b), MSG_DONTWAIT);
        if (r > 0) { if ((size_t)r < sizeof(b)) break; continue; }
        if (r == 0) { c->dead = R2_SHM_EOF; break; }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        c->dead = -errno;
    }
    r2_shm_disarm(c);
    return 0;
}

static inline void r2_shm_shutdown(r2_shm_conn* c) {
    shutdown(c->fd, SHUT_RDWR);
    if (!c->dead) c->dead = -ECONNRESET;
}

static inline void r2_shm_close(r2_shm_conn* c) {
    munmap(c->base, c->map_len);
    close(c->fd);
    free(c);
}
