# libibverbs for r2comm: the declarations (cdef extern) and the cdef API the engine calls
# without the GIL. Python-level objects (Context, PD, MR, CQ, QP) are in verbs.pyx; the engine
# keeps their C pointers (QP.qp, CQ.cq, MR.lkey...) and uses only the nogil functions below on
# its hot path. Built only where infiniband/verbs.h and libibverbs exist (setup.py).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t

cdef extern from "<infiniband/verbs.h>" nogil:
    cdef struct ibv_device:
        pass
    cdef struct ibv_context:
        int async_fd
        int num_comp_vectors
    cdef struct ibv_pd:
        pass
    cdef struct ibv_comp_channel:
        int fd
    cdef struct ibv_cq:
        pass
    cdef struct ibv_srq:
        pass
    cdef struct ibv_qp:
        uint32_t qp_num
    cdef struct ibv_mr:
        void* addr
        size_t length
        uint32_t lkey
        uint32_t rkey
    cdef union ibv_gid:
        uint8_t raw[16]
    cdef struct ibv_gid_entry:
        ibv_gid gid
        uint32_t gid_index
        uint32_t port_num
        uint32_t gid_type
        uint32_t ndev_ifindex
    cdef struct ibv_port_attr:
        int state
        int max_mtu
        int active_mtu
        int gid_tbl_len
        uint32_t max_msg_sz
        uint16_t lid
        uint8_t active_width
        uint8_t active_speed
        uint8_t phys_state
        uint8_t link_layer
    cdef struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey
    cdef struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data
    cdef struct ibv_qp_init_attr:
        void* qp_context
        ibv_cq* send_cq
        ibv_cq* recv_cq
        ibv_srq* srq
        ibv_qp_cap cap
        int sq_sig_all
    cdef struct ibv_async_event:
        int event_type
    cdef struct ibv_srq_attr:
        uint32_t max_wr
        uint32_t max_sge
        uint32_t srq_limit
    cdef struct ibv_srq_init_attr:
        void* srq_context
        ibv_srq_attr attr

    ibv_device** ibv_get_device_list(int* num)
    void ibv_free_device_list(ibv_device** lst)
    const char* ibv_get_device_name(ibv_device* dev)
    ibv_context* ibv_open_device(ibv_device* dev)
    int ibv_close_device(ibv_context* ctx)
    int ibv_query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr)
    int ibv_query_gid_ex(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                         uint32_t flags)
    ibv_pd* ibv_alloc_pd(ibv_context* ctx)
    int ibv_dealloc_pd(ibv_pd* pd)
    ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr* mr)
    ibv_comp_channel* ibv_create_comp_channel(ibv_context* ctx)
    int ibv_destroy_comp_channel(ibv_comp_channel* ch)
    ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* ch,
                          int comp_vector)
    int ibv_destroy_cq(ibv_cq* cq)
    int ibv_req_notify_cq(ibv_cq* cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel* ch, ibv_cq** cq, void** cq_context)
    void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents)
    ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr)
    int ibv_destroy_qp(ibv_qp* qp)
    ibv_srq* ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* attr)
    int ibv_destroy_srq(ibv_srq* srq)
    int ibv_get_async_event(ibv_context* ctx, ibv_async_event* ev)
    void ibv_ack_async_event(ibv_async_event* ev)

    enum:
        IBV_QPT_RC
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_WR_RDMA_WRITE
        IBV_WR_RDMA_WRITE_WITH_IMM
        IBV_WR_SEND
        IBV_WR_SEND_WITH_IMM
        IBV_SEND_SIGNALED
        IBV_SEND_INLINE
        IBV_WC_SUCCESS
        IBV_WC_RETRY_EXC_ERR
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_RNR_RETRY_EXC_ERR
        IBV_WC_SEND
        IBV_WC_RDMA_WRITE
        IBV_WC_RECV
        IBV_WC_RECV_RDMA_WITH_IMM
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_ERR
        IBV_PORT_ACTIVE
        IBV_GID_TYPE_ROCE_V2
        IBV_EVENT_QP_FATAL
        IBV_EVENT_PORT_ACTIVE
        IBV_EVENT_PORT_ERR

cdef extern from "r2_verbs.h" nogil:
    cdef struct r2v_wc:
        uint64_t wr_id
        int32_t status
        int32_t opcode
        uint32_t byte_len
        uint32_t imm
        uint32_t qp_num
        uint32_t vendor_err
        int32_t has_imm
    int r2v_post_send(ibv_qp* qp, uint64_t wr_id, ibv_sge* sge, int nsge, int opcode,
                      uint32_t imm, uint64_t raddr, uint32_t rkey, unsigned flags)
    int r2v_post_recv(ibv_qp* qp, uint64_t wr_id, uint64_t addr, uint32_t length, uint32_t lkey)
    int r2v_post_srq_recv(ibv_srq* srq, uint64_t wr_id, uint64_t addr, uint32_t length,
                          uint32_t lkey)
    int r2v_poll(ibv_cq* cq, r2v_wc* out, int n)
    int r2v_qp_to_init(ibv_qp* qp, int port, unsigned access)
    int r2v_qp_to_rtr(ibv_qp* qp, int port, int mtu, uint32_t dest_qpn, uint32_t rq_psn,
                      const uint8_t* dgid, int sgid_index, uint16_t dlid, int min_rnr_timer)
    int r2v_qp_to_rts(ibv_qp* qp, uint32_t sq_psn, int timeout, int retry_cnt, int rnr_retry)
    int r2v_qp_to_error(ibv_qp* qp)
    int r2v_qp_state(ibv_qp* qp)
    const char* r2v_wc_status_str(int status)
    const char* r2v_event_str(int event)
    void r2v_set_rc(ibv_qp_init_attr* ia)
    void r2v_event_info(ibv_async_event* ev, int* type, int64_t* qpn, int* port)
    void* r2v_event_qp_context(ibv_async_event* ev)


cdef class Context:
    cdef ibv_context* ctx
    cdef readonly str name
    cdef readonly int port
    cdef int _check(self) except -1

cdef class PD:
    cdef ibv_pd* pd
    cdef readonly Context context

cdef class MR:
    cdef ibv_mr* mr
    cdef Py_buffer view
    cdef bint has_view
    cdef readonly PD pd
    cdef readonly uint64_t addr
    cdef readonly size_t length
    cdef readonly uint32_t lkey
    cdef readonly uint32_t rkey
    cdef readonly int access
    cdef void _release(self)

cdef class CQ:
    cdef ibv_cq* cq
    cdef ibv_comp_channel* channel
    cdef unsigned unacked
    cdef readonly Context context
    cdef readonly int depth
    cdef void _destroy(self)

cdef class QP:
    cdef ibv_qp* qp
    cdef readonly PD pd
    cdef readonly CQ send_cq
    cdef readonly CQ recv_cq
    cdef readonly uint32_t psn
    cdef readonly int gid_index
    cdef readonly int timeout
    cdef readonly int retry_cnt
    cdef readonly int rnr_retry
    cdef readonly int min_rnr_timer
    cdef readonly int max_send
    cdef readonly int max_recv
    cdef readonly bint connected
    cdef int _check(self) except -1

# --- the hot path (no GIL): what the engine's progress loop calls ------------------------------
# Post a send of NSGE entries (header + payload from registered memory). 0 or an errno.
cdef int vb_post_send(QP q, uint64_t wr_id, ibv_sge* sge, int nsge, int opcode, uint32_t imm,
                      uint64_t raddr, uint32_t rkey) noexcept nogil
# Post a receive of LEN bytes at ADDR (LKEY of its registration); LEN 0 for write-with-imm only.
cdef int vb_post_recv(QP q, uint64_t wr_id, uint64_t addr, uint32_t length,
                      uint32_t lkey) noexcept nogil
# Up to N completions into OUT, never blocking. Count, or < 0 if the CQ is broken.
cdef int vb_poll(CQ c, r2v_wc* out, int n) noexcept nogil
# As vb_poll, but when none is ready arm the CQ and sleep on its channel up to TIMEOUT_MS.
cdef int vb_poll_wait(CQ c, r2v_wc* out, int n, int timeout_ms) noexcept nogil
