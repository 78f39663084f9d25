# cython: language_level=3
"""libibverbs for r2comm: devices and ports, protection domains, memory registration, completion
queues with a completion channel, RC queue pairs (INIT -> RTR -> RTS from a peer's address
bytes), posting sends / RDMA writes with immediate / receives, polling completions (errors
included) and async events.  Every verbs call runs without the GIL.

Object lifetimes follow the verbs rules: an MR and a QP keep their PD, a QP its CQs, a PD and a
CQ their Context alive, so Python's reference counting destroys them child first
(QP, MR -> CQ, PD -> device).  ``close()`` does it at once, and refuses (VerbsError, EBUSY) to
close a parent whose children are still open.

The cdef functions of verbs.pxd (vb_post_send, vb_post_recv, vb_poll, vb_poll_wait) are the
engine's hot path; stream_send / stream_recv below are the same loops for benchmarks and tests.
"""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from libc.errno cimport errno, EAGAIN
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t, intptr_t
from libc.string cimport memset, memcpy
from libc.stdlib cimport malloc, calloc, free
from r2comm._core.transport cimport (iovec, Transport, T_EOF, TDone, tdone_push, tdone_take,
                                     iov_total, tp_reg_none, tp_dereg_none, TPF_SIDE_SOCKET,
                                     TPF_WAKE_OUT, TPF_LATE_READ)

import os

from .verbs_common import (QpAddress, RegionDesc, VerbsError, MTU_BYTES, PORT_STATES,
                           declared_gbps, gid_str)

cdef extern from "<poll.h>" nogil:
    cdef struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    enum:
        POLLIN

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFL
        F_SETFL
        O_NONBLOCK

cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    enum:
        CLOCK_MONOTONIC

cdef inline double now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

# Python-visible constants
ACCESS_LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = IBV_ACCESS_REMOTE_READ
WR_SEND = IBV_WR_SEND
WR_SEND_WITH_IMM = IBV_WR_SEND_WITH_IMM
WR_RDMA_WRITE = IBV_WR_RDMA_WRITE
WR_RDMA_WRITE_WITH_IMM = IBV_WR_RDMA_WRITE_WITH_IMM
WC_SUCCESS = IBV_WC_SUCCESS
WC_RETRY_EXC_ERR = IBV_WC_RETRY_EXC_ERR
WC_WR_FLUSH_ERR = IBV_WC_WR_FLUSH_ERR
WC_RNR_RETRY_EXC_ERR = IBV_WC_RNR_RETRY_EXC_ERR
WC_SEND = IBV_WC_SEND
WC_RDMA_WRITE = IBV_WC_RDMA_WRITE
WC_RECV = IBV_WC_RECV
WC_RECV_RDMA_WITH_IMM = IBV_WC_RECV_RDMA_WITH_IMM
QPS_RESET = IBV_QPS_RESET
QPS_INIT = IBV_QPS_INIT
QPS_RTR = IBV_QPS_RTR
QPS_RTS = IBV_QPS_RTS
QPS_ERR = IBV_QPS_ERR
EVENT_QP_FATAL = IBV_EVENT_QP_FATAL
EVENT_PORT_ACTIVE = IBV_EVENT_PORT_ACTIVE
EVENT_PORT_ERR = IBV_EVENT_PORT_ERR
# rxe under TCG needs >= 17 (4.096 us * 2^17 = 0.54 s): shorter retransmit timers fire while
# the emulated CPU is starved and the QP dies of RETRY_EXC_ERR with a healthy link
DEFAULT_QP_TIMEOUT = 17
DEFAULT_RETRY_CNT = 7
DEFAULT_RNR_RETRY = 7        # 7 = retry forever on receiver-not-ready


def status_str(int status):
    return r2v_wc_status_str(status).decode()


def event_str(int event):
    return r2v_event_str(event).decode()


def _err(what, int rc):
    return VerbsError(f"{what}: {os.strerror(rc) if rc > 0 else rc} (errno {rc})")


def device_names():
    """Names of the RDMA devices libibverbs sees (empty list when none or no RDMA stack)."""
    cdef int n = 0
    cdef ibv_device** lst
    with nogil:
        lst = ibv_get_device_list(&n)
    if lst == NULL:
        return []
    try:
        return [ibv_get_device_name(lst[i]).decode() for i in range(n)]
    finally:
        ibv_free_device_list(lst)


cdef class Context:
    """An open RDMA device (one port of it): port state, speed, GID table, async events."""

    def __cinit__(self):
        self.ctx = NULL

    def __init__(self, name, int port=1):
        cdef int n = 0, i, flags
        cdef ibv_device** lst
        cdef bytes bname = name.encode()
        with nogil:
            lst = ibv_get_device_list(&n)
        if lst == NULL:
            raise VerbsError(f"no RDMA devices (ibv_get_device_list: errno {errno}); "
                             f"cannot open {name!r}")
        try:
            for i in range(n):
                if ibv_get_device_name(lst[i]) == bname:
                    with nogil:
                        self.ctx = ibv_open_device(lst[i])
                    break
            else:
                raise VerbsError(f"no RDMA device {name!r} (have {device_names()})")
        finally:
            ibv_free_device_list(lst)
        if self.ctx == NULL:
            raise _err(f"ibv_open_device({name})", errno)
        self.name, self.port = name, port
        # async events are read without blocking (the fd can sit in an epoll set)
        flags = fcntl(self.ctx.async_fd, F_GETFL)
        fcntl(self.ctx.async_fd, F_SETFL, flags | O_NONBLOCK)

    def __dealloc__(self):
        if self.ctx != NULL:
            ibv_close_device(self.ctx)

    cdef int _check(self) except -1:
        if self.ctx == NULL:
            raise VerbsError(f"device {self.name!r} is closed")
        return 0

    def close(self):
        cdef int rc
        if self.ctx != NULL:
            rc = ibv_close_device(self.ctx)
            self.ctx = NULL
            if rc:
                raise _err(f"ibv_close_device({self.name})", rc)

    @property
    def async_fd(self):
        self._check()
        return self.ctx.async_fd

    def query_port(self):
        """dict: state (name and number), active MTU (bytes and enum), speed, width, declared
        bandwidth in Gbit/s, link layer (1 IB, 2 Ethernet), LID, GID table length."""
        cdef ibv_port_attr a
        cdef int rc
        self._check()
        memset(&a, 0, sizeof(a))
        with nogil:
            rc = ibv_query_port(self.ctx, <uint8_t>self.port, &a)
        if rc:
            raise _err(f"ibv_query_port({self.name}, {self.port})", rc)
        return {"state": PORT_STATES.get(a.state, str(a.state)), "state_num": a.state,
                "active_mtu": MTU_BYTES.get(a.active_mtu, 0), "mtu_enum": a.active_mtu,
                "active_speed": a.active_speed, "active_width": a.active_width,
                "declared_gbps": declared_gbps(a.active_speed, a.active_width),
                "link_layer": a.link_layer, "lid": a.lid, "gid_tbl_len": a.gid_tbl_len,
                "max_msg_sz": a.max_msg_sz}

    def gid(self, int index):
        """(gid bytes, type) of entry INDEX: type 0 IB, 1 RoCE v1, 2 RoCE v2; None if empty."""
        cdef ibv_gid_entry e
        cdef int rc
        self._check()
        with nogil:
            rc = ibv_query_gid_ex(self.ctx, self.port, index, &e, 0)
        if rc:
            return None
        return bytes(e.gid.raw[:16]), e.gid_type

    def gids(self):
        """Non-empty GID entries: list of (index, gid string, type)."""
        out = []
        for i in range(self.query_port()["gid_tbl_len"]):
            g = self.gid(i)
            if g is not None and any(g[0]):
                out.append((i, gid_str(g[0]), g[1]))
        return out

    def roce_v2_ipv4_index(self, ipv4=None):
        """Index of the RoCE v2 GID of an IPv4 address (::ffff:a.b.c.d), that of IPV4 if
        given; None if there is none (no IPv4 address on the netdev, or an IB port)."""
        want = None
        if ipv4 is not None:
            want = bytes(10) + b"\xff\xff" + bytes(int(x) for x in ipv4.split("."))
        for i in range(self.query_port()["gid_tbl_len"]):
            g = self.gid(i)
            if g is None or g[1] != IBV_GID_TYPE_ROCE_V2:
                continue
            raw = g[0]
            if raw[:12] == bytes(10) + b"\xff\xff" and (want is None or raw == want):
                return i
        return None

    def read_async_events(self):
        """Every async event pending now (never blocks): list of dicts with type (number),
        name, qp_num (QP events) and port (port events).  Each is acknowledged."""
        cdef ibv_async_event ev
        cdef int rc, typ, port
        cdef int64_t qpn
        self._check()
        out = []
        while True:
            with nogil:
                rc = ibv_get_async_event(self.ctx, &ev)
            if rc:
                break              # EAGAIN: nothing more
            r2v_event_info(&ev, &typ, &qpn, &port)
            ibv_ack_async_event(&ev)
            out.append({"type": typ, "name": event_str(typ), "qp_num": qpn, "port": port})
        return out


cdef class PD:
    """A protection domain: registrations and QPs of one device."""

    def __cinit__(self):
        self.pd = NULL

    def __init__(self, Context context not None):
        context._check()
        self.context = context
        with nogil:
            self.pd = ibv_alloc_pd(context.ctx)
        if self.pd == NULL:
            raise _err(f"ibv_alloc_pd({context.name})", errno)

    def __dealloc__(self):
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)

    def close(self):
        cdef int rc
        if self.pd != NULL:
            rc = ibv_dealloc_pd(self.pd)
            if rc:
                raise _err("ibv_dealloc_pd (deregister its MRs and destroy its QPs first)", rc)
            self.pd = NULL

    def register(self, obj, int access=IBV_ACCESS_LOCAL_WRITE):
        """Register OBJ's buffer: an MR that holds the buffer export until closed."""
        return MR(self, obj, access)


cdef class MR:
    """A registered buffer.  Holds a buffer export of the object for its whole life, so the
    memory can be neither freed nor resized while the registration exists."""

    def __cinit__(self):
        self.mr = NULL
        self.has_view = False

    def __init__(self, PD pd not None, obj, int access=IBV_ACCESS_LOCAL_WRITE):
        cdef int flags = PyBUF_SIMPLE
        if pd.pd == NULL:
            raise VerbsError("protection domain is closed")
        if access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE):
            flags |= PyBUF_WRITABLE
        PyObject_GetBuffer(obj, &self.view, flags)
        self.has_view = True
        if self.view.len == 0:
            self._release()
            raise VerbsError("cannot register an empty buffer")
        self.pd = pd
        with nogil:
            self.mr = ibv_reg_mr(pd.pd, self.view.buf, <size_t>self.view.len, access)
        if self.mr == NULL:
            rc = errno
            self._release()
            raise _err(f"ibv_reg_mr of {self.view.len} bytes", rc)
        self.addr = <uint64_t>self.view.buf
        self.length = <size_t>self.view.len
        self.lkey, self.rkey, self.access = self.mr.lkey, self.mr.rkey, access

    cdef void _release(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False

    def __dealloc__(self):
        if self.mr != NULL:
            ibv_dereg_mr(self.mr)
            self.mr = NULL
        self._release()

    def close(self):
        """Deregister, then release the buffer."""
        cdef int rc = 0
        if self.mr != NULL:
            with nogil:
                rc = ibv_dereg_mr(self.mr)
            self.mr = NULL
        self._release()
        if rc:
            raise _err("ibv_dereg_mr", rc)

    @property
    def closed(self):
        return self.mr == NULL

    def region(self):
        """This MR as a RegionDesc a peer can write into (needs ACCESS_REMOTE_WRITE)."""
        return RegionDesc(self.addr, self.length, self.rkey)


cdef class CQ:
    """A completion queue with its own completion channel (an fd for poll/epoll)."""

    def __cinit__(self):
        self.cq = NULL
        self.channel = NULL
        self.unacked = 0

    def __init__(self, Context context not None, int depth=256):
        cdef int flags
        context._check()
        self.context, self.depth = context, depth
        with nogil:
            self.channel = ibv_create_comp_channel(context.ctx)
        if self.channel == NULL:
            raise _err("ibv_create_comp_channel", errno)
        flags = fcntl(self.channel.fd, F_GETFL)
        fcntl(self.channel.fd, F_SETFL, flags | O_NONBLOCK)
        with nogil:
            self.cq = ibv_create_cq(context.ctx, depth, NULL, self.channel, 0)
        if self.cq == NULL:
            raise _err(f"ibv_create_cq({depth})", errno)

    cdef void _destroy(self):
        if self.cq != NULL:
            if self.unacked:
                ibv_ack_cq_events(self.cq, self.unacked)
                self.unacked = 0
            ibv_destroy_cq(self.cq)
            self.cq = NULL
        if self.channel != NULL:
            ibv_destroy_comp_channel(self.channel)
            self.channel = NULL

    def __dealloc__(self):
        self._destroy()

    def close(self):
        self._destroy()

    @property
    def fd(self):
        return self.channel.fd if self.channel != NULL else -1

    def poll(self, int max_entries=64, double timeout=0.0):
        """Completions as tuples (wr_id, status, opcode, byte_len, imm or None, qp_num,
        vendor_err); waits up to TIMEOUT s for the first when none is ready.  Errors are
        completions too (status != WC_SUCCESS: see status_str)."""
        cdef r2v_wc* wc
        cdef int n, i, ms = <int>(timeout * 1000)
        if self.cq == NULL:
            raise VerbsError("completion queue is closed")
        if max_entries < 1:
            return []
        wc = <r2v_wc*>malloc(max_entries * sizeof(r2v_wc))
        if wc == NULL:
            raise MemoryError()
        try:
            with nogil:
                n = vb_poll_wait(self, wc, max_entries, ms) if ms > 0 else vb_poll(self, wc, max_entries)
            if n < 0:
                raise VerbsError(f"ibv_poll_cq failed ({n})")
            return [(wc[i].wr_id, wc[i].status, wc[i].opcode, wc[i].byte_len,
                     wc[i].imm if wc[i].has_imm else None, wc[i].qp_num, wc[i].vendor_err)
                    for i in range(n)]
        finally:
            free(wc)


cdef int vb_poll(CQ c, r2v_wc* out, int n) noexcept nogil:
    return r2v_poll(c.cq, out, n)


cdef int vb_poll_wait(CQ c, r2v_wc* out, int n, int timeout_ms) noexcept nogil:
    cdef int got = r2v_poll(c.cq, out, n)
    cdef pollfd pfd
    cdef ibv_cq* ev_cq
    cdef void* ev_ctx
    if got != 0 or timeout_ms <= 0:
        return got
    if ibv_req_notify_cq(c.cq, 0) != 0:
        return -1
    got = r2v_poll(c.cq, out, n)         # one may have arrived before the CQ was armed
    if got != 0:
        return got
    pfd.fd = c.channel.fd
    pfd.events = POLLIN
    pfd.revents = 0
    if poll(&pfd, 1, timeout_ms) > 0:
        while ibv_get_cq_event(c.channel, &ev_cq, &ev_ctx) == 0:
            c.unacked += 1
        if c.unacked >= 64:
            ibv_ack_cq_events(c.cq, c.unacked)
            c.unacked = 0
    return r2v_poll(c.cq, out, n)


cdef class QP:
    """An RC queue pair.  Created in INIT; ``connect(peer_address_bytes)`` moves it to RTR and
    RTS.  ``address()`` is what the peer needs (QpAddress bytes)."""

    def __cinit__(self):
        self.qp = NULL

    def __init__(self, PD pd not None, CQ send_cq not None, CQ recv_cq not None, *,
                 int max_send=128, int max_recv=128, int max_sge=2, gid_index=None,
                 int timeout=DEFAULT_QP_TIMEOUT, int retry_cnt=DEFAULT_RETRY_CNT,
                 int rnr_retry=DEFAULT_RNR_RETRY, int min_rnr_timer=12,
                 int access=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE):
        cdef ibv_qp_init_attr ia
        cdef int rc
        if not 0 <= timeout <= 31 or not 0 <= retry_cnt <= 7 or not 0 <= rnr_retry <= 7:
            raise VerbsError(f"bad QP timeout {timeout} (0..31), retry_cnt {retry_cnt} or "
                             f"rnr_retry {rnr_retry} (0..7)")
        if pd.pd == NULL or send_cq.cq == NULL or recv_cq.cq == NULL:
            raise VerbsError("PD or CQ is closed")
        self.pd, self.send_cq, self.recv_cq = pd, send_cq, recv_cq
        ctx = pd.context
        if gid_index is None:
            gid_index = ctx.roce_v2_ipv4_index()
            if gid_index is None:
                gid_index = -1 if ctx.query_port()["link_layer"] == 1 else 0
        self.gid_index = gid_index
        self.timeout, self.retry_cnt, self.rnr_retry = timeout, retry_cnt, rnr_retry
        self.min_rnr_timer, self.max_send, self.max_recv = min_rnr_timer, max_send, max_recv
        self.psn = int.from_bytes(os.urandom(3), "little")
        memset(&ia, 0, sizeof(ia))
        ia.send_cq = send_cq.cq
        ia.recv_cq = recv_cq.cq
        ia.cap.max_send_wr = max_send
        ia.cap.max_recv_wr = max_recv
        ia.cap.max_send_sge = max_sge
        ia.cap.max_recv_sge = 1
        r2v_set_rc(&ia)
        ia.sq_sig_all = 0
        with nogil:
            self.qp = ibv_create_qp(pd.pd, &ia)
        if self.qp == NULL:
            raise _err(f"ibv_create_qp (send {max_send}, recv {max_recv})", errno)
        rc = r2v_qp_to_init(self.qp, ctx.port, access)
        if rc:
            raise _err("QP to INIT", rc)

    def __dealloc__(self):
        if self.qp != NULL:
            ibv_destroy_qp(self.qp)
            self.qp = NULL

    def close(self):
        """Destroy the QP (pending work requests are gone; their buffers are free again)."""
        cdef int rc
        if self.qp != NULL:
            rc = ibv_destroy_qp(self.qp)
            self.qp = NULL
            if rc:
                raise _err("ibv_destroy_qp", rc)

    cdef int _check(self) except -1:
        if self.qp == NULL:
            raise VerbsError("queue pair is closed")
        return 0

    @property
    def qp_num(self):
        self._check()
        return self.qp.qp_num

    @property
    def state(self):
        """enum ibv_qp_state (QPS_RTS when connected, QPS_ERR after an error completion)."""
        self._check()
        return r2v_qp_state(self.qp)

    def address(self):
        """This QP's connection address, as bytes (QpAddress)."""
        self._check()
        ctx = self.pd.context
        port = ctx.query_port()
        gid = bytes(16)
        if self.gid_index >= 0:
            g = ctx.gid(self.gid_index)
            if g is None:
                raise VerbsError(f"{ctx.name}: no GID at index {self.gid_index}")
            gid = g[0]
        return QpAddress(self.qp.qp_num, self.psn, gid, port["lid"], ctx.port,
                         max(self.gid_index, 0), port["mtu_enum"] or 5).encode()

    def connect(self, peer):
        """Move to RTR then RTS towards PEER (its address() bytes)."""
        cdef int rc, mtu, port
        cdef uint8_t dgid[16]
        self._check()
        if self.connected:
            raise VerbsError("QP already connected (create a new one to reconnect)")
        addr = QpAddress.decode(peer)
        ctx = self.pd.context
        mtu = min(addr.mtu, ctx.query_port()["mtu_enum"] or 5)
        memcpy(dgid, <const char*>addr.gid, 16)
        port = ctx.port
        rc = r2v_qp_to_rtr(self.qp, port, mtu, addr.qpn, addr.psn, dgid, self.gid_index,
                           addr.lid, self.min_rnr_timer)
        if rc:
            raise _err(f"QP to RTR (peer {addr})", rc)
        rc = r2v_qp_to_rts(self.qp, self.psn, self.timeout, self.retry_cnt, self.rnr_retry)
        if rc:
            raise _err("QP to RTS", rc)
        self.connected = True

    def to_error(self):
        """Move the QP to ERR: outstanding work requests complete with WR_FLUSH_ERR."""
        self._check()
        rc = r2v_qp_to_error(self.qp)
        if rc:
            raise _err("QP to ERR", rc)

    def post_send(self, MR mr not None, size_t offset, size_t length, uint64_t wr_id=0, *,
                  int opcode=IBV_WR_SEND, imm=None, remote=None, size_t remote_offset=0,
                  bint signaled=True):
        """Post LENGTH bytes of MR at OFFSET: SEND (opcode WR_SEND, or WR_SEND_WITH_IMM), or an
        RDMA write (WR_RDMA_WRITE[_WITH_IMM]) to REMOTE (RegionDesc) at REMOTE_OFFSET."""
        cdef ibv_sge sge
        cdef int rc
        cdef uint64_t raddr = 0
        cdef uint32_t rkey = 0, cimm = 0
        self._check()
        if mr.mr == NULL or offset + length > mr.length:
            raise VerbsError(f"send of {length} bytes at {offset} outside the MR "
                             f"({mr.length} bytes) or MR closed")
        if opcode in (IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM):
            if remote is None:
                raise VerbsError("an RDMA write needs the remote region (RegionDesc)")
            remote.check(remote_offset, length)
            raddr, rkey = remote.addr + remote_offset, remote.rkey
        elif opcode not in (IBV_WR_SEND, IBV_WR_SEND_WITH_IMM):
            raise VerbsError(f"unsupported opcode {opcode}")
        if imm is not None:
            cimm = imm
        sge.addr = mr.addr + offset
        sge.length = <uint32_t>length
        sge.lkey = mr.lkey
        with nogil:
            rc = r2v_post_send(self.qp, wr_id, &sge, 1 if length else 0, opcode, cimm, raddr, rkey,
                               IBV_SEND_SIGNALED if signaled else 0)
        if rc:
            raise _err("ibv_post_send", rc)

    def post_recv(self, MR mr, size_t offset=0, size_t length=0, uint64_t wr_id=0):
        """Post a receive into MR[offset:offset+length] (MR None / length 0: a receive that
        only takes an RDMA write's immediate)."""
        cdef int rc
        cdef uint64_t addr = 0
        cdef uint32_t lkey = 0
        self._check()
        if mr is not None and length:
            if mr.mr == NULL or offset + length > mr.length:
                raise VerbsError("receive outside the MR or MR closed")
            addr, lkey = mr.addr + offset, mr.lkey
        else:
            length = 0
        with nogil:
            rc = r2v_post_recv(self.qp, wr_id, addr, <uint32_t>length, lkey)
        if rc:
            raise _err("ibv_post_recv", rc)


cdef int vb_post_send(QP q, uint64_t wr_id, ibv_sge* sge, int nsge, int opcode, uint32_t imm,
                      uint64_t raddr, uint32_t rkey) noexcept nogil:
    if q.qp == NULL:
        return 9    # EBADF
    return r2v_post_send(q.qp, wr_id, sge, nsge, opcode, imm, raddr, rkey, IBV_SEND_SIGNALED)


cdef int vb_post_recv(QP q, uint64_t wr_id, uint64_t addr, uint32_t length,
                      uint32_t lkey) noexcept nogil:
    if q.qp == NULL:
        return 9
    return r2v_post_recv(q.qp, wr_id, addr, length, lkey)


# --- streaming loops (benchmarks, tests): what the engine's progress loop will do ----------------
def stream_send(QP qp not None, MR mr not None, size_t size, long count, int depth=32, *,
                int opcode=IBV_WR_SEND, remote=None, double seconds=0.0, double drain_s=10.0):
    """Send COUNT messages of SIZE bytes from the start of MR (RDMA writes with immediate go to
    successive SIZE slots of REMOTE, wrapping; imm = message index), at most DEPTH in flight;
    SECONDS > 0 stops posting after that long.  Stops posting at the first error completion and
    collects the rest (flushes) for up to DRAIN_S s.  All without the GIL.

    Returns a dict: ok, errors, first_error (status), first_error_at (time.monotonic() clock),
    first_error_wr, statuses (count per error status), started, elapsed, bytes."""
    cdef r2v_wc wc[64]
    cdef ibv_sge sge
    cdef long posted = 0, done = 0, ok = 0, nerr = 0, i
    cdef int n, rc = 0, first_err = -1, post_rc = 0
    cdef long first_wr = -1
    cdef double t0, t_end, t_err = 0.0, t_last = 0.0, stop_at = 0.0, drain_until = 0.0
    cdef uint64_t raddr = 0
    cdef uint32_t rkey = 0
    cdef size_t slots = 1
    cdef long[32] errs
    qp._check()
    if size > mr.length or size == 0 or depth < 1 or depth > qp.max_send:
        raise VerbsError(f"bad stream: size {size} (MR {mr.length}), depth {depth} "
                         f"(QP send queue {qp.max_send})")
    if opcode in (IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM):
        if remote is None:
            raise VerbsError("an RDMA write stream needs the remote region")
        raddr, rkey = remote.addr, remote.rkey
        slots = remote.length // size
        if slots == 0:
            raise VerbsError("remote region smaller than one message")
    for i in range(32):
        errs[i] = 0
    sge.addr = mr.addr
    sge.length = <uint32_t>size
    sge.lkey = mr.lkey
    with nogil:
        t0 = now()
        if seconds > 0:
            stop_at = t0 + seconds
        while True:
            while first_err < 0 and post_rc == 0 and posted < count and posted - done < depth:
                if stop_at > 0 and now() > stop_at:
                    count = posted
                    break
                post_rc = r2v_post_send(qp.qp, <uint64_t>posted, &sge, 1, opcode,
                                        <uint32_t>posted, raddr + (posted % slots) * size, rkey,
                                        IBV_SEND_SIGNALED)
                if post_rc == 0:
                    posted += 1
            if done >= posted and (first_err >= 0 or post_rc != 0 or posted >= count):
                break
            if first_err >= 0 and now() > drain_until:
                break
            n = vb_poll_wait(qp.send_cq, wc, 64, 100)
            if n < 0:
                rc = n
                break
            for i in range(n):
                done += 1
                if wc[i].status == IBV_WC_SUCCESS:
                    ok += 1
                    t_last = now()
                else:
                    nerr += 1
                    errs[wc[i].status & 31] += 1
                    if first_err < 0:
                        first_err = wc[i].status
                        first_wr = <long>wc[i].wr_id
                        t_err = now()
                        drain_until = t_err + drain_s
        t_end = now()
    statuses = {status_str(i): errs[i] for i in range(32) if errs[i]}
    end = t_last if ok else t_end
    return {"ok": ok, "errors": nerr, "first_error": None if first_err < 0 else status_str(first_err),
            "first_error_status": first_err, "first_error_at": t_err if first_err >= 0 else None,
            "first_error_wr": first_wr, "statuses": statuses, "posted": posted,
            "post_error": post_rc, "poll_error": rc, "started": t0,
            "elapsed": end - t0, "bytes": ok * size}


def stream_recv(QP qp not None, MR mr, size_t size, long count, int depth=32, *,
                bint prepost=True, double seconds=10.0, bint write_imm=False):
    """Receive up to COUNT messages: DEPTH receives stay posted (slot = wr_id % DEPTH, SIZE
    bytes each in MR; WRITE_IMM: receives without buffer that take write-with-imm
    notifications).  PREPOST posts the DEPTH receives first (once per QP); later calls continue.
    Returns after COUNT messages, SECONDS, or an error completion: a dict ok, errors,
    first_error, bytes, imm_sum, started, elapsed."""
    cdef r2v_wc wc[64]
    cdef long ok = 0, nerr = 0, i, slot
    cdef int n, rc = 0, first_err = -1, post_rc = 0
    cdef double t0, t_first = 0.0, t_last = 0.0, stop_at
    cdef uint64_t nbytes = 0, imm_sum = 0
    cdef uint64_t base = 0
    cdef uint32_t lkey = 0, rlen = 0
    qp._check()
    if depth < 1 or depth > qp.max_recv:
        raise VerbsError(f"bad depth {depth} (QP receive queue {qp.max_recv})")
    if not write_imm:
        if mr is None or size * depth > mr.length:
            raise VerbsError(f"receive slots {depth} x {size} do not fit the MR")
        base, lkey, rlen = mr.addr, mr.lkey, <uint32_t>size
    if prepost:
        for i in range(depth):
            rc = r2v_post_recv(qp.qp, <uint64_t>i, base + i * size if rlen else 0, rlen, lkey)
            if rc:
                raise _err("ibv_post_recv", rc)
    with nogil:
        t0 = now()
        stop_at = t0 + seconds
        while ok < count and now() < stop_at and first_err < 0:
            n = vb_poll_wait(qp.recv_cq, wc, 64, 100)
            if n < 0:
                rc = n
                break
            for i in range(n):
                if wc[i].status != IBV_WC_SUCCESS:
                    nerr += 1
                    if first_err < 0:
                        first_err = wc[i].status
                    continue
                if ok == 0:
                    t_first = now()
                ok += 1
                t_last = now()
                nbytes += wc[i].byte_len
                imm_sum += wc[i].imm
                slot = <long>(wc[i].wr_id % <uint64_t>depth)
                post_rc = r2v_post_recv(qp.qp, wc[i].wr_id, base + slot * size if rlen else 0,
                                        rlen, lkey)
                if post_rc:
                    break
            if post_rc:
                break
    return {"ok": ok, "errors": nerr, "first_error": None if first_err < 0 else status_str(first_err),
            "bytes": nbytes, "imm_sum": imm_sum, "started": t0, "first_at": t_first,
            "elapsed": (t_last - t_first) if ok else 0.0, "post_error": post_rc, "poll_error": rc}


# --- the rail transport the engine runs on (transport.pxd) ---------------------------------------
include "verbs_transport.pxi"
