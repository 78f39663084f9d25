/* r2comm's engine, reached from C and C++ (the torch backend, r2comm/torch/_backend.cpp)
 * through a versioned table of functions, as NCCL's net plugins are: engine.c_api() returns a
 * PyCapsule named R2_CAPI_NAME holding a pointer to an r2_capi whose `version` is
 * R2_CAPI_VERSION (a caller checks both, and `size` >= the size it was built with).
 *
 * Threads: the functions marked [GIL] need the GIL; the others run without it, from any thread.
 * An engine is held through a counted handle (engine_ref/engine_unref): once the engine closed,
 * post returns 0 and wait returns R2_GONE, never touching freed memory. A channel cell (one per
 * communicator, r2comm/channel.py) holds what a call needs without Python: the communicator's
 * id, its next sequence number (taken atomically), its timeout, the plans' generation and the
 * flags that send a call through Python (a plan switch being agreed or due, epoch checks,
 * registered memory, a freed communicator). */
#ifndef R2_CAPI_H
#define R2_CAPI_H
#include <stddef.h>
#include <stdint.h>

#define R2_CAPI_NAME "r2comm._core.engine.c_api"
#define R2_CAPI_VERSION 1

/* wait()'s answers: an operation's state (the engine's ST_*), or R2_GONE */
#define R2_ACTIVE 0   /* still running when the timeout passed */
#define R2_DONE 1
#define R2_ERROR 2    /* ended with error code *err, message in msg */
#define R2_GONE -1    /* no such operation, or the engine closed */

/* cell flags: a call takes its sequence number through Python while any is set */
#define R2_CELL_SWITCH 1    /* a plan switch is being agreed or is due (Channel._cross) */
#define R2_CELL_EPOCH 2     /* R2COMM_REPLAN=K: an epoch check every K calls */
#define R2_CELL_REGMEM 4    /* RDMA rails register user buffers (regcache.note) */
#define R2_CELL_CLOSED 8    /* the communicator was freed */

typedef struct r2_cell {
  uint32_t comm;      /* communicator id */
  uint32_t seq;       /* next sequence number (modulo 2**32) */
  uint32_t flags;     /* R2_CELL_* */
  uint32_t gen;       /* +1 whenever the communicator's plans change (a new rail state) */
  double timeout;     /* s: each operation's bound */
} r2_cell;

static inline uint32_t r2_cell_take(r2_cell* c) {
  return __atomic_fetch_add(&c->seq, 1u, __ATOMIC_ACQ_REL);
}
static inline uint32_t r2_cell_load(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void r2_cell_store(uint32_t* p, uint32_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline void r2_cell_or(uint32_t* p, uint32_t v) {
  __atomic_fetch_or(p, v, __ATOMIC_ACQ_REL);
}
static inline void r2_cell_and(uint32_t* p, uint32_t v) {
  __atomic_fetch_and(p, v, __ATOMIC_ACQ_REL);
}
static inline double r2_cell_timeout(r2_cell* c) {
  double t;
  __atomic_load(&c->timeout, &t, __ATOMIC_ACQUIRE);
  return t;
}
static inline void r2_cell_set_timeout(r2_cell* c, double t) {
  __atomic_store(&c->timeout, &t, __ATOMIC_RELEASE);
}
/* the engine's handle counters (engine.pyx) */
static inline int r2_atomic_add(int* p, int v) {
  return __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST);
}
static inline int r2_atomic_get(int* p) {
  return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline void r2_atomic_set(int* p, int v) {
  __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
}

typedef struct r2_capi {
  int version;        /* R2_CAPI_VERSION */
  int size;           /* sizeof(r2_capi) */
  /* [GIL] a counted handle on Engine object `engine`; NULL with a Python error if it is not
     one or is closed */
  void* (*engine_ref)(void* engine);
  /* drop a handle (the last one frees it) */
  void (*engine_unref)(void* h);
  /* [GIL] the cell of a ChannelCell object (valid while the object lives); NULL + error */
  r2_cell* (*cell)(void* cell_object);
  /* [GIL] the compiled plan of a Plan object (valid while the object lives); NULL + error */
  void* (*plan)(void* plan_object);
  /* post one operation: plan, buffers (work, send, scratch), dtype code, reduce op, comm, seq,
     element count, timeout (s), members (world ranks), p2p (0: a collective), key (a
     collective's call descriptor, a message's tag), cap (a receive's bytes) -> its id; 0 when
     the engine closed or the dtype is unknown */
  uint64_t (*post)(void* h, void* plan, const uint64_t* bufs, int dtype, int redop,
                   uint32_t comm, uint32_t seq, uint32_t count, double timeout,
                   const int* members, int nmembers, int p2p, int64_t key, uint64_t cap);
  /* wait up to timeout s (0: a test) for operation oid -> R2_ACTIVE/DONE/ERROR/GONE; on
     R2_ERROR *err and msg (NUL-terminated, at most msglen bytes) say why; *nrecv: bytes
     received */
  int (*wait)(void* h, uint64_t oid, double timeout, int* err, char* msg, size_t msglen,
              uint64_t* nrecv);
  /* fail a running operation with error `code` (a wait that gave up) */
  void (*cancel)(void* h, uint64_t oid, int code, const char* msg);
  /* forget an ended operation (its buffers are the caller's again) */
  void (*release)(void* h, uint64_t oid);
  /* the world rank and tag a p2p receive was matched with: 0, or -1 if none yet */
  int (*p2p_matched)(void* h, uint64_t oid, int* peer, int64_t* tag);
} r2_capi;

#endif
