// r2comm wire header: every frame on a rail or control connection starts with these 48 bytes.
// Little-endian host order (all ranks of a job run on one architecture).
#pragma once
#include <cstdint>
#pragma pack(push, 1)
struct r2_hdr {
    uint32_t magic;   // R2_MAGIC (carries the wire version)
    uint8_t type;     // frame type (DATA, ACK, ...)
    uint8_t flags;    // FL_P2P: seq is a point-to-point sequence, aux the tag
    uint8_t dtype;    // element type of the message (r2::Dtype)
    uint8_t redop;    // reduction op of the collective
    uint32_t comm;    // communicator id (agreed at Dup/Split)
    uint32_t seq;     // collective sequence in comm, or p2p sequence of the pair
    uint32_t step;    // message index within one operation between one pair
    uint32_t count;     // collective DATA: the call's element count (low 32 bits); with aux, dtype
                      // and redop the whole call, compared per frame (check_match)
    uint32_t chunk;   // chunk index within the message
    uint32_t len;     // payload bytes that follow the header
    uint64_t total;   // total bytes of the message
    uint32_t aux;     // tag (p2p), error code (ABORT), rail index (control frames); collective
                      // DATA: kind | non-blocking << 3 | root << 4 | plan hash << 20
                      // (r2comm/communicator.py), named in mismatch errors (describe_call)
    uint32_t check;   // FNV-1a of the 44 bytes above
};
#pragma pack(pop)
static_assert(sizeof(r2_hdr) == 48, "r2_hdr must be 48 bytes");
