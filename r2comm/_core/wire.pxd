# The wire format in one place: header struct, frame types, one encoder and one validator.
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memset

cdef extern from "r2_reduce.h" namespace "r2" nogil:
    uint32_t hdr_check(const void* p, size_t n)

cdef extern from "r2_wire.h" nogil:
    cdef struct r2_hdr:
        uint32_t magic
        uint8_t type
        uint8_t flags
        uint8_t dtype
        uint8_t redop
        uint32_t comm
        uint32_t seq
        uint32_t step
        uint32_t count
        uint32_t chunk
        uint32_t len
        uint64_t total
        uint32_t aux
        uint32_t check

cdef enum:
    R2_MAGIC = 0x52324302        # "R2C" + wire version 2 (2: FL_VOID frames)
    HDR_SIZE = 48
    MAX_CTRL_PAYLOAD = 4096

cdef enum FrameType:
    F_DATA = 1          # a chunk of a message
    F_ACK = 2           # chunk received (same ids as the DATA frame)
    F_RAIL_DOWN = 3     # "I consider rail aux (connection seq) dead"
    F_RAIL_DOWN_ACK = 4
    F_ABORT = 5         # operation (comm, seq) failed; payload = reason text; aux = error code
    F_LAST = 5

cdef enum:
    FL_P2P = 1
    FL_LAZY_ACK = 2     # the sender holds its own copy and does not wait for this ack: the
                        # receiver may delay it and send it with its next frame on that rail
    FL_VOID = 4         # (with FL_P2P, an empty DATA frame) the pair's message seq will never
                        # come: its send failed and its user was told (matching.pxi p2p_void)
    FL_VERDICT = 8      # (an ABORT of a collective) the judge's report of a mismatch: every
                        # member raises with it (matching.pxi; an older engine takes it for a
                        # plain abort)

cdef inline void hdr_encode(r2_hdr* h, uint8_t type, uint8_t flags, uint8_t dtype, uint8_t redop,
                            uint32_t comm, uint32_t seq, uint32_t step, uint32_t count, uint32_t chunk,
                            uint32_t length, uint64_t total, uint32_t aux) noexcept nogil:
    h.magic = R2_MAGIC
    h.type = type
    h.flags = flags
    h.dtype = dtype
    h.redop = redop
    h.comm = comm
    h.seq = seq
    h.step = step
    h.count = count
    h.chunk = chunk
    h.len = length
    h.total = total
    h.aux = aux
    h.check = hdr_check(h, HDR_SIZE - 4)

cdef inline int hdr_validate(const r2_hdr* h, uint32_t max_chunk) noexcept nogil:
    """0 if the header is well formed, else a negative reason code (see WIRE_ERRORS)."""
    if h.magic != R2_MAGIC:
        return -1
    if h.check != hdr_check(h, HDR_SIZE - 4):
        return -2
    if h.type < 1 or h.type > F_LAST:
        return -3
    if h.type == F_DATA:
        # exact chunk bounds are checked against the posted message on delivery
        if h.len > max_chunk or h.len > h.total:
            return -4
    elif h.type == F_ABORT:
        if h.len > MAX_CTRL_PAYLOAD:
            return -4
    elif h.len != 0:
        return -4
    return 0
