// r2comm verbs helpers: the libibverbs calls whose arguments are unions and nested structs
// (work requests, QP attributes, async events), kept in C so verbs.pyx stays plain.
// Every function here is a few stores plus one verbs call: safe without the GIL.
#pragma once
#include <cstdint>
#include <cstring>
#include <arpa/inet.h>
#include <infiniband/verbs.h>

// One completion, as r2comm reads it (imm in host order).
struct r2v_wc {
    uint64_t wr_id;
    int32_t status;      // enum ibv_wc_status
    int32_t opcode;      // enum ibv_wc_opcode
    uint32_t byte_len;
    uint32_t imm;        // valid when has_imm
    uint32_t qp_num;
    uint32_t vendor_err;
    int32_t has_imm;
};

// Post one work request from NSGE scatter entries. OPCODE: IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
// IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM (RADDR/RKEY for the writes). 0 or an errno.
static inline int r2v_post_send(struct ibv_qp* qp, uint64_t wr_id, struct ibv_sge* sge, int nsge,
                                int opcode, uint32_t imm, uint64_t raddr, uint32_t rkey,
                                unsigned flags) {
    struct ibv_send_wr wr, *bad = nullptr;
    std::memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = sge;
    wr.num_sge = nsge;
    wr.opcode = (enum ibv_wr_opcode)opcode;
    wr.send_flags = flags;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &wr, &bad);
}

// Fill WR (and SGE) for one receive of LEN bytes at ADDR (LEN 0: no scatter entry).
static inline void r2v_recv_wr(struct ibv_recv_wr* wr, struct ibv_sge* sge, uint64_t wr_id,
                               uint64_t addr, uint32_t len, uint32_t lkey) {
    std::memset(wr, 0, sizeof(*wr));
    sge->addr = addr;
    sge->length = len;
    sge->lkey = lkey;
    wr->wr_id = wr_id;
    wr->sg_list = len ? sge : nullptr;
    wr->num_sge = len ? 1 : 0;
}

// Post one receive of LEN bytes at ADDR (LEN 0: no scatter entry, for RDMA write with imm).
static inline int r2v_post_recv(struct ibv_qp* qp, uint64_t wr_id, uint64_t addr, uint32_t len,
                                uint32_t lkey) {
    struct ibv_sge sge;
    struct ibv_recv_wr wr, *bad = nullptr;
    r2v_recv_wr(&wr, &sge, wr_id, addr, len, lkey);
    return ibv_post_recv(qp, &wr, &bad);
}

// Post one receive of LEN bytes at ADDR to a shared receive queue. 0 or an errno.
static inline int r2v_post_srq_recv(struct ibv_srq* srq, uint64_t wr_id, uint64_t addr,
                                    uint32_t len, uint32_t lkey) {
    struct ibv_sge sge;
    struct ibv_recv_wr wr, *bad = nullptr;
    r2v_recv_wr(&wr, &sge, wr_id, addr, len, lkey);
    return ibv_post_srq_recv(srq, &wr, &bad);
}

// Poll up to N completions into OUT; returns how many, or < 0 if polling failed.
static inline int r2v_poll(struct ibv_cq* cq, struct r2v_wc* out, int n) {
    struct ibv_wc wc[32];
    int total = 0;
    while (total < n) {
        int want = n - total < 32 ? n - total : 32;
        int got = ibv_poll_cq(cq, want, wc);
        if (got < 0)
            return total ? total : got;
        for (int i = 0; i < got; i++) {
            struct r2v_wc* o = &out[total + i];
            o->wr_id = wc[i].wr_id;
            o->status = wc[i].status;
            o->opcode = wc[i].opcode;
            o->byte_len = wc[i].byte_len;
            o->has_imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? 1 : 0;
            o->imm = o->has_imm ? ntohl(wc[i].imm_data) : 0;
            o->qp_num = wc[i].qp_num;
            o->vendor_err = wc[i].vendor_err;
        }
        total += got;
        if (got < want)
            break;
    }
    return total;
}

static inline int r2v_qp_to_init(struct ibv_qp* qp, int port, unsigned access) {
    struct ibv_qp_attr a;
    std::memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = (uint8_t)port;
    a.qp_access_flags = access;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                         IBV_QP_ACCESS_FLAGS);
}

// RoCE: the path is the peer's GID (is_global), reached from our SGID_INDEX.
static inline int r2v_qp_to_rtr(struct ibv_qp* qp, int port, int mtu, uint32_t dest_qpn,
                                uint32_t rq_psn, const uint8_t* dgid, int sgid_index,
                                uint16_t dlid, int min_rnr_timer) {
    struct ibv_qp_attr a;
    std::memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)mtu;
    a.dest_qp_num = dest_qpn;
    a.rq_psn = rq_psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = (uint8_t)min_rnr_timer;
    a.ah_attr.port_num = (uint8_t)port;
    a.ah_attr.dlid = dlid;
    if (sgid_index >= 0) {
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.grh.sgid_index = (uint8_t)sgid_index;
        std::memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
    }
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static inline int r2v_qp_to_rts(struct ibv_qp* qp, uint32_t sq_psn, int timeout, int retry_cnt,
                                int rnr_retry) {
    struct ibv_qp_attr a;
    std::memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = sq_psn;
    a.timeout = (uint8_t)timeout;
    a.retry_cnt = (uint8_t)retry_cnt;
    a.rnr_retry = (uint8_t)rnr_retry;
    a.max_rd_atomic = 1;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                         IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

static inline int r2v_qp_to_error(struct ibv_qp* qp) {
    struct ibv_qp_attr a;
    std::memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

// The QP's current state (enum ibv_qp_state), or -errno.
static inline int r2v_qp_state(struct ibv_qp* qp) {
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    int rc = ibv_query_qp(qp, &a, IBV_QP_STATE, &ia);
    return rc ? -rc : (int)a.qp_state;
}

static inline const char* r2v_wc_status_str(int s) { return ibv_wc_status_str((enum ibv_wc_status)s); }
static inline const char* r2v_event_str(int e) { return ibv_event_type_str((enum ibv_event_type)e); }
static inline void r2v_set_rc(struct ibv_qp_init_attr* ia) { ia->qp_type = IBV_QPT_RC; }

// Split an async event: its type, the QP number (QP events) and the port (port events).
static inline void r2v_event_info(struct ibv_async_event* ev, int* type, int64_t* qpn,
                                  int* port) {
    *type = ev->event_type;
    *qpn = -1;
    *port = -1;
    switch (ev->event_type) {
    case IBV_EVENT_QP_FATAL: case IBV_EVENT_QP_REQ_ERR: case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST: case IBV_EVENT_SQ_DRAINED: case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR: case IBV_EVENT_QP_LAST_WQE_REACHED:
        *qpn = ev->element.qp ? (int64_t)ev->element.qp->qp_num : -1;
        break;
    case IBV_EVENT_PORT_ACTIVE: case IBV_EVENT_PORT_ERR: case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE: case IBV_EVENT_SM_CHANGE: case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
        *port = ev->element.port_num;
        break;
    default:
        break;
    }
}

// The qp_context of the QP an async event names (NULL for port and device events).
static inline void* r2v_event_qp_context(struct ibv_async_event* ev) {
    switch (ev->event_type) {
    case IBV_EVENT_QP_FATAL: case IBV_EVENT_QP_REQ_ERR: case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_PATH_MIG_ERR:
        return ev->element.qp ? ev->element.qp->qp_context : nullptr;
    default:
        return nullptr;
    }
}
