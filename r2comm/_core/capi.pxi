# The engine's C-level interface (r2_capi.h): a versioned table of functions that C and C++
# callers (the torch backend, r2comm/torch/_backend.cpp) reach through engine.c_api(), a
# PyCapsule, to post operations and wait for them without Python and without the GIL; and
# ChannelCell, the per-communicator state such a caller needs at each call (r2comm/channel.py).
# Included into engine.pyx after the Engine class.
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport PyObject
from cpython.exc cimport PyErr_SetObject

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int usec)

cdef extern from "<string.h>" nogil:
    size_t strlen(const char* s)


cdef class ChannelCell:
    """What a call on a communicator needs without Python (r2_cell): its id, next sequence
    number (taken atomically), timeout, plans' generation and the flags that send a call
    through Python (R2_CELL_*). One per Channel, which reads and writes it through these."""

    def __cinit__(self, uint32_t comm, double timeout):
        self.c.comm = comm
        r2_cell_set_timeout(&self.c, timeout)

    @property
    def comm(self):
        """The communicator's id."""
        return self.c.comm

    @property
    def seq(self):
        """The next sequence number."""
        return r2_cell_load(&self.c.seq)

    @seq.setter
    def seq(self, uint32_t v):
        r2_cell_store(&self.c.seq, v)

    def take(self):
        """Take the next sequence number (atomically) and return it."""
        return r2_cell_take(&self.c)

    @property
    def timeout(self):
        """Seconds: each operation's bound."""
        return r2_cell_timeout(&self.c)

    @timeout.setter
    def timeout(self, double v):
        r2_cell_set_timeout(&self.c, v)

    @property
    def flags(self):
        """R2_CELL_* bits: any set sends a C-level caller's call through Python."""
        return r2_cell_load(&self.c.flags)

    def set_flag(self, uint32_t bit, bint on):
        """Set (on) or clear one R2_CELL_* bit, atomically."""
        if on:
            r2_cell_or(&self.c.flags, bit)
        else:
            r2_cell_and(&self.c.flags, ~bit)

    @property
    def gen(self):
        """The plans' generation (bump_gen: whenever they change)."""
        return r2_cell_load(&self.c.gen)

    def bump_gen(self):
        """The communicator's plans changed: C-level callers fetch theirs again."""
        r2_cell_store(&self.c.gen, r2_cell_load(&self.c.gen) + 1)


CELL_SWITCH, CELL_EPOCH, CELL_REGMEM, CELL_CLOSED = (R2_CELL_SWITCH, R2_CELL_EPOCH,
                                                     R2_CELL_REGMEM, R2_CELL_CLOSED)
C_API_VERSION = R2_CAPI_VERSION


cdef void engine_unref(EngineRef* h) noexcept nogil:
    """Drop one count of h (the last frees it: the Engine's and every C user's are gone)."""
    if r2_atomic_add(&h.refs, -1) == 0:
        free(h)


cdef inline State* capi_enter(EngineRef* h) noexcept nogil:
    """The engine's state for one C-level call, or NULL once it is closing (then nothing may
    be touched); a non-NULL answer must be paired with capi_leave."""
    r2_atomic_add(&h.users, 1)
    if r2_atomic_get(&h.closing):
        r2_atomic_add(&h.users, -1)
        return NULL
    return h.e


cdef inline void capi_leave(EngineRef* h) noexcept nogil:
    r2_atomic_add(&h.users, -1)


cdef void* capi_engine_ref(void* obj) noexcept:
    """[GIL] A counted handle on Engine `obj`; NULL with a Python error."""
    cdef Engine eng
    o = <object><PyObject*>obj
    if not isinstance(o, Engine):
        from r2comm.errors import R2commArgumentError
        PyErr_SetObject(R2commArgumentError, "engine_ref: not an r2comm Engine")
        return NULL
    eng = <Engine>o
    if eng.e == NULL or eng.h == NULL or r2_atomic_get(&eng.h.closing):
        from r2comm.errors import R2commClosedError
        PyErr_SetObject(R2commClosedError, "engine_ref: the engine is closed")
        return NULL
    r2_atomic_add(&eng.h.refs, 1)
    return eng.h


cdef void capi_engine_unref(void* h) noexcept nogil:
    if h != NULL:
        engine_unref(<EngineRef*>h)


cdef r2_cell* capi_cell(void* obj) noexcept:
    """[GIL] The r2_cell of ChannelCell `obj`; NULL with a Python error."""
    o = <object><PyObject*>obj
    if not isinstance(o, ChannelCell):
        PyErr_SetObject(TypeError, "cell: not a ChannelCell")
        return NULL
    return &(<ChannelCell>o).c


cdef void* capi_plan(void* obj) noexcept:
    """[GIL] The PlanC of Plan `obj`; NULL with a Python error."""
    o = <object><PyObject*>obj
    if not isinstance(o, Plan):
        PyErr_SetObject(TypeError, "plan: not a Plan")
        return NULL
    return (<Plan>o).c


cdef uint64_t capi_post(void* hp, void* plan, const uint64_t* bufs, int dtype, int redop,
                        uint32_t comm, uint32_t seq, uint32_t count, double timeout,
                        const int* members, int nmembers, int p2p, int64_t key,
                        uint64_t cap) noexcept nogil:
    """Engine.post_c without Python: the operation's id, or 0 (closed, unknown dtype)."""
    cdef EngineRef* h = <EngineRef*>hp
    cdef State* e
    cdef vector[int] mem
    cdef uint64_t oid
    cdef uint64_t b[3]
    cdef int isz = itemsize(dtype)
    if isz == 0 or plan == NULL or nmembers < 0:
        return 0
    e = capi_enter(h)
    if e == NULL:
        return 0
    b[0] = bufs[0]
    b[1] = bufs[1]
    b[2] = bufs[2]
    mem.assign(members, members + nmembers)
    pthread_mutex_lock(&e.mu)
    oid = post_op(e, <PlanC*>plan, b, dtype, redop, comm, seq, count, timeout, mem, p2p,
                  <int><uint32_t>key, cap, isz, -1)
    pthread_mutex_unlock(&e.mu)
    capi_leave(h)
    return oid


cdef int capi_wait(void* hp, uint64_t oid, double timeout, int* err, char* msg, size_t msglen,
                   uint64_t* nrecv) noexcept nogil:
    """Engine.wait without Python (see r2_capi.h)."""
    cdef EngineRef* h = <EngineRef*>hp
    cdef State* e = capi_enter(h)
    cdef string text
    cdef int state
    cdef size_t n
    err[0] = 0
    nrecv[0] = 0
    if msglen:
        msg[0] = 0
    if e == NULL:
        return -1
    state = wait_op_c(e, &h.sp, oid, timeout, err, &text, nrecv)
    capi_leave(h)
    if msglen:
        n = text.size()
        if n > msglen - 1:
            n = msglen - 1
        memcpy(msg, text.c_str(), n)
        msg[n] = 0
    return state


cdef void capi_cancel(void* hp, uint64_t oid, int code, const char* text) noexcept nogil:
    cdef EngineRef* h = <EngineRef*>hp
    cdef State* e = capi_enter(h)
    if e == NULL:
        return
    pthread_mutex_lock(&e.mu)
    it = e.ops.find(oid)
    if it != e.ops.end() and deref(it).second.state == ST_ACTIVE:
        fail_op(e, deref(it).second, code, text, 1)
        deref(it).second.hold = 0       # its own error: no verdict to wait for
    pthread_mutex_unlock(&e.mu)
    capi_leave(h)


cdef void capi_release(void* hp, uint64_t oid) noexcept nogil:
    cdef EngineRef* h = <EngineRef*>hp
    cdef State* e = capi_enter(h)
    if e == NULL:
        return
    forget_op(e, oid)
    capi_leave(h)


cdef int capi_p2p_matched(void* hp, uint64_t oid, int* peer, int64_t* tag) noexcept nogil:
    cdef EngineRef* h = <EngineRef*>hp
    cdef State* e = capi_enter(h)
    cdef RecvMsg* rm
    cdef int found = -1
    peer[0] = -1
    tag[0] = -1
    if e == NULL:
        return -1
    pthread_mutex_lock(&e.mu)
    it = e.ops.find(oid)
    if it != e.ops.end() and deref(it).second.p2p and deref(it).second.recvs.size() == 1:
        rm = <RecvMsg*>deref(it).second.recvs[0]
        if rm.bound:
            peer[0] = rm.peer
            tag[0] = <int64_t>rm.aux
            found = 0
    pthread_mutex_unlock(&e.mu)
    capi_leave(h)
    return found


cdef extern from *:
    """
    typedef void* (*r2_ref_fn)(void*);
    typedef void (*r2_unref_fn)(void*);
    typedef r2_cell* (*r2_cell_fn)(void*);
    typedef void* (*r2_plan_fn)(void*);
    typedef uint64_t (*r2_post_fn)(void*, void*, const uint64_t*, int, int, uint32_t, uint32_t,
                                   uint32_t, double, const int*, int, int, int64_t, uint64_t);
    typedef int (*r2_wait_fn)(void*, uint64_t, double, int*, char*, size_t, uint64_t*);
    typedef void (*r2_cancel_fn)(void*, uint64_t, int, const char*);
    typedef void (*r2_release_fn)(void*, uint64_t);
    typedef int (*r2_matched_fn)(void*, uint64_t, int*, int64_t*);
    static r2_capi r2_the_capi;
    """
    ctypedef void* (*r2_ref_fn)(void*)
    ctypedef void (*r2_unref_fn)(void*)
    ctypedef r2_cell* (*r2_cell_fn)(void*)
    ctypedef void* (*r2_plan_fn)(void*)
    ctypedef uint64_t (*r2_post_fn)(void*, void*, const uint64_t*, int, int, uint32_t, uint32_t,
                                    uint32_t, double, const int*, int, int, int64_t, uint64_t)
    ctypedef int (*r2_wait_fn)(void*, uint64_t, double, int*, char*, size_t, uint64_t*)
    ctypedef void (*r2_cancel_fn)(void*, uint64_t, int, const char*)
    ctypedef void (*r2_release_fn)(void*, uint64_t)
    ctypedef int (*r2_matched_fn)(void*, uint64_t, int*, int64_t*)
    ctypedef struct r2_capi_full "r2_capi":
        int version
        int size
        r2_ref_fn engine_ref
        r2_unref_fn engine_unref
        r2_cell_fn cell
        r2_plan_fn plan
        r2_post_fn post
        r2_wait_fn wait
        r2_cancel_fn cancel
        r2_release_fn release
        r2_matched_fn p2p_matched
    r2_capi_full r2_the_capi


r2_the_capi.version = R2_CAPI_VERSION
r2_the_capi.size = sizeof(r2_capi_full)
r2_the_capi.engine_ref = capi_engine_ref
r2_the_capi.engine_unref = capi_engine_unref
r2_the_capi.cell = capi_cell
r2_the_capi.plan = capi_plan
r2_the_capi.post = capi_post
r2_the_capi.wait = capi_wait
r2_the_capi.cancel = capi_cancel
r2_the_capi.release = capi_release
r2_the_capi.p2p_matched = capi_p2p_matched


def c_api():
    """The engine's C-level interface: a PyCapsule named "r2comm._core.engine.c_api" holding
    an r2_capi* (r2comm/_core/r2_capi.h; its version field: C_API_VERSION)."""
    return PyCapsule_New(&r2_the_capi, R2_CAPI_NAME, NULL)
