// Per-frame MACs (R2COMM_INTEGRITY=mac): BLAKE2s (RFC 7693) derives a one-time key per frame,
// Poly1305 (RFC 8439) authenticates the frame under it. Both written from their RFCs.
// BLAKE2s: 32-bit words, 64-byte blocks, 10 rounds of G over a 4x4 state, the SHA-256 IV; a
// keyed state is prepared once per connection and direction (the key block compressed once).
#pragma once
#include <cstdint>
#include <cstring>
#include <cstddef>

namespace r2 {

struct b2s_state {
    uint32_t h[8];
    uint32_t t[2];       // bytes compressed so far (64-bit counter)
    uint8_t buf[64];     // the block not yet compressed (kept until more data or the end)
    uint32_t buflen;
    uint32_t outlen;
};

static const uint32_t B2S_IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                                   0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

static const uint8_t B2S_SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint32_t b2s_rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t b2s_load32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

#define R2_B2S_G(a, b, c, d, x, y)            \
    do {                                      \
        v[a] = v[a] + v[b] + (x);             \
        v[d] = b2s_rotr(v[d] ^ v[a], 16);     \
        v[c] = v[c] + v[d];                   \
        v[b] = b2s_rotr(v[b] ^ v[c], 12);     \
        v[a] = v[a] + v[b] + (y);             \
        v[d] = b2s_rotr(v[d] ^ v[a], 8);      \
        v[c] = v[c] + v[d];                   \
        v[b] = b2s_rotr(v[b] ^ v[c], 7);      \
    } while (0)

// RFC 7693 section 3.2: the compression function F
static inline void b2s_compress(b2s_state* s, const uint8_t* block, int last) {
    uint32_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = b2s_load32(block + 4 * i);
    for (int i = 0; i < 8; i++) { v[i] = s->h[i]; v[i + 8] = B2S_IV[i]; }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
#pragma GCC unroll 10
    for (int r = 0; r < 10; r++) {      // unrolled: the message schedule folds to constants
        const uint8_t* z = B2S_SIGMA[r];
        R2_B2S_G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        R2_B2S_G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        R2_B2S_G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        R2_B2S_G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        R2_B2S_G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        R2_B2S_G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        R2_B2S_G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        R2_B2S_G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}
#undef R2_B2S_G

static inline void b2s_count(b2s_state* s, uint32_t n) {
    s->t[0] += n;
    if (s->t[0] < n) s->t[1]++;
}

static inline void b2s_update(b2s_state* s, const void* data, size_t n) {
    const uint8_t* p = (const uint8_t*)data;
    while (n > 0) {
        if (s->buflen == 64) {          // a full block, and more follows: it is not the last
            b2s_count(s, 64);
            b2s_compress(s, s->buf, 0);
            s->buflen = 0;
        }
        if (s->buflen == 0) {           // whole blocks straight from the input, keeping the
            while (n > 64) {            // final one (it may be the last block of the message)
                b2s_count(s, 64);
                b2s_compress(s, p, 0);
                p += 64;
                n -= 64;
            }
        }
        size_t take = 64 - s->buflen;
        if (take > n) take = n;
        memcpy(s->buf + s->buflen, p, take);
        s->buflen += (uint32_t)take;
        p += take;
        n -= take;
    }
}

// outlen 1..32 bytes of digest, key 0..32 bytes (RFC 7693 section 3.3: parameter block word 0
// is 0x0101kknn; a key is padded to one block and compressed as the first block)
static inline void b2s_init(b2s_state* s, uint32_t outlen, const void* key, uint32_t keylen) {
    for (int i = 0; i < 8; i++) s->h[i] = B2S_IV[i];
    s->h[0] ^= 0x01010000u ^ (keylen << 8) ^ outlen;
    s->t[0] = s->t[1] = 0;
    s->buflen = 0;
    s->outlen = outlen;
    if (keylen > 0) {
        uint8_t block[64];
        memset(block, 0, 64);
        memcpy(block, key, keylen);
        b2s_update(s, block, 64);
        memset(block, 0, 64);
    }
}

// Compress a pending full block now: only valid when more input follows (a frame MAC always
// absorbs a header), so a keyed state can be prepared once with its key block compressed.
static inline void b2s_prepare_more(b2s_state* s) {
    if (s->buflen == 64) {
        b2s_count(s, 64);
        b2s_compress(s, s->buf, 0);
        s->buflen = 0;
    }
}

static inline void b2s_final(b2s_state* s, uint8_t* out) {
    b2s_count(s, s->buflen);
    memset(s->buf + s->buflen, 0, 64 - s->buflen);
    b2s_compress(s, s->buf, 1);
    uint8_t full[32];
    for (int i = 0; i < 8; i++) {
        full[4 * i] = (uint8_t)s->h[i];
        full[4 * i + 1] = (uint8_t)(s->h[i] >> 8);
        full[4 * i + 2] = (uint8_t)(s->h[i] >> 16);
        full[4 * i + 3] = (uint8_t)(s->h[i] >> 24);
    }
    memcpy(out, full, s->outlen);
}

// Poly1305 (RFC 8439, section 2.5), written from the RFC: the accumulator and r in three
// limbs of 44, 44 and 42 bits, products in 128-bit integers, arithmetic mod 2^130 - 5.
struct p1305_state {
    uint64_t r0, r1, r2, s1, s2;     // clamped r, and r1 * 20, r2 * 20 (2^132 = 20 mod p)
    uint64_t q0, q1, q2, t1, t2;     // r^2 mod p, likewise: two blocks per step (see blocks)
    uint64_t h0, h1, h2;
    uint64_t pad[2];                 // s, added at the end
    uint8_t buf[16];
    uint32_t buflen;
};

static const uint64_t P_M44 = 0xFFFFFFFFFFFull, P_M42 = 0x3FFFFFFFFFFull;

static inline uint64_t p_load64(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline void p1305_init(p1305_state* st, const uint8_t key[32]) {
    uint64_t lo = p_load64(key) & 0x0FFFFFFC0FFFFFFFull;       // r &= 0x0ffffffc0ffffffc
    uint64_t hi = p_load64(key + 8) & 0x0FFFFFFC0FFFFFFCull;   //      0ffffffc0fffffff
    st->r0 = lo & P_M44;
    st->r1 = ((lo >> 44) | (hi << 20)) & P_M44;
    st->r2 = hi >> 24;
    st->s1 = st->r1 * 20;
    st->s2 = st->r2 * 20;
    {   // r^2 mod p, reduced to limbs (same arithmetic as a block step)
        typedef unsigned __int128 u128;
        uint64_t r0 = st->r0, r1 = st->r1, r2 = st->r2, c;
        u128 d0 = (u128)r0 * r0 + (u128)r1 * st->s2 + (u128)r2 * st->s1;
        u128 d1 = (u128)r0 * r1 + (u128)r1 * r0 + (u128)r2 * st->s2;
        u128 d2 = (u128)r0 * r2 + (u128)r1 * r1 + (u128)r2 * r0;
        uint64_t a0, a1, a2;
        c = (uint64_t)(d0 >> 44); a0 = (uint64_t)d0 & P_M44;
        d1 += c; c = (uint64_t)(d1 >> 44); a1 = (uint64_t)d1 & P_M44;
        d2 += c; c = (uint64_t)(d2 >> 42); a2 = (uint64_t)d2 & P_M42;
        a0 += c * 5; c = a0 >> 44; a0 &= P_M44;
        a1 += c;
        st->q0 = a0; st->q1 = a1; st->q2 = a2;
        st->t1 = a1 * 20;
        st->t2 = a2 * 20;
    }
    st->h0 = st->h1 = st->h2 = 0;
    st->pad[0] = p_load64(key + 16);
    st->pad[1] = p_load64(key + 24);
    st->buflen = 0;
}

// h = (h + block (+ 2^128 when full)) * r mod p, for each 16-byte block
static inline void p1305_blocks(p1305_state* st, const uint8_t* m, size_t n, uint64_t hibit) {
    typedef unsigned __int128 u128;
    uint64_t r0 = st->r0, r1 = st->r1, r2 = st->r2, s1 = st->s1, s2 = st->s2;
    uint64_t h0 = st->h0, h1 = st->h1, h2 = st->h2, c;
    uint64_t q0 = st->q0, q1 = st->q1, q2 = st->q2, t1 = st->t1, t2 = st->t2;
    while (n >= 32) {
        // ((h + m1) * r + m2) * r = (h + m1) * r^2 + m2 * r: two independent products per
        // step, one carry chain (all six sums of products stay below 2^98)
        uint64_t a0 = p_load64(m), a1 = p_load64(m + 8);
        uint64_t b0 = p_load64(m + 16), b1 = p_load64(m + 24);
        h0 += a0 & P_M44;
        h1 += ((a0 >> 44) | (a1 << 20)) & P_M44;
        h2 += ((a1 >> 24) & P_M42) | hibit;
        uint64_t m0 = b0 & P_M44;
        uint64_t m1 = ((b0 >> 44) | (b1 << 20)) & P_M44;
        uint64_t m2 = ((b1 >> 24) & P_M42) | hibit;
        u128 d0 = (u128)h0 * q0 + (u128)h1 * t2 + (u128)h2 * t1
                + (u128)m0 * r0 + (u128)m1 * s2 + (u128)m2 * s1;
        u128 d1 = (u128)h0 * q1 + (u128)h1 * q0 + (u128)h2 * t2
                + (u128)m0 * r1 + (u128)m1 * r0 + (u128)m2 * s2;
        u128 d2 = (u128)h0 * q2 + (u128)h1 * q1 + (u128)h2 * q0
                + (u128)m0 * r2 + (u128)m1 * r1 + (u128)m2 * r0;
        c = (uint64_t)(d0 >> 44); h0 = (uint64_t)d0 & P_M44;
        d1 += c; c = (uint64_t)(d1 >> 44); h1 = (uint64_t)d1 & P_M44;
        d2 += c; c = (uint64_t)(d2 >> 42); h2 = (uint64_t)d2 & P_M42;
        h0 += c * 5; c = h0 >> 44; h0 &= P_M44;
        h1 += c;
        m += 32;
        n -= 32;
    }
    while (n >= 16) {
        uint64_t t0 = p_load64(m), t1 = p_load64(m + 8);
        h0 += t0 & P_M44;
        h1 += ((t0 >> 44) | (t1 << 20)) & P_M44;
        h2 += ((t1 >> 24) & P_M42) | hibit;
        u128 d0 = (u128)h0 * r0 + (u128)h1 * s2 + (u128)h2 * s1;
        u128 d1 = (u128)h0 * r1 + (u128)h1 * r0 + (u128)h2 * s2;
        u128 d2 = (u128)h0 * r2 + (u128)h1 * r1 + (u128)h2 * r0;
        c = (uint64_t)(d0 >> 44); h0 = (uint64_t)d0 & P_M44;
        d1 += c; c = (uint64_t)(d1 >> 44); h1 = (uint64_t)d1 & P_M44;
        d2 += c; c = (uint64_t)(d2 >> 42); h2 = (uint64_t)d2 & P_M42;
        h0 += c * 5; c = h0 >> 44; h0 &= P_M44;
        h1 += c;
        m += 16;
        n -= 16;
    }
    st->h0 = h0; st->h1 = h1; st->h2 = h2;
}

static inline void p1305_update(p1305_state* st, const void* data, size_t n) {
    const uint8_t* p = (const uint8_t*)data;
    if (st->buflen) {
        size_t take = 16 - st->buflen;
        if (take > n) take = n;
        memcpy(st->buf + st->buflen, p, take);
        st->buflen += (uint32_t)take;
        p += take;
        n -= take;
        if (st->buflen < 16) return;
        p1305_blocks(st, st->buf, 16, 1ull << 40);
        st->buflen = 0;
    }
    size_t whole = n & ~(size_t)15;
    if (whole) p1305_blocks(st, p, whole, 1ull << 40);
    p += whole;
    n -= whole;
    if (n) {
        memcpy(st->buf, p, n);
        st->buflen = (uint32_t)n;
    }
}

static inline void p1305_final(p1305_state* st, uint8_t tag[16]) {
    uint64_t h0, h1, h2, c, g0, g1, g2, mask;
    if (st->buflen) {                   // the last partial block: a 1 byte after it, no 2^128
        st->buf[st->buflen] = 1;
        memset(st->buf + st->buflen + 1, 0, 15 - st->buflen);
        p1305_blocks(st, st->buf, 16, 0);
    }
    h0 = st->h0; h1 = st->h1; h2 = st->h2;
    c = h1 >> 44; h1 &= P_M44; h2 += c;
    c = h2 >> 42; h2 &= P_M42; h0 += c * 5;
    c = h0 >> 44; h0 &= P_M44; h1 += c;
    c = h1 >> 44; h1 &= P_M44; h2 += c;
    c = h2 >> 42; h2 &= P_M42; h0 += c * 5;
    c = h0 >> 44; h0 &= P_M44; h1 += c;
    // h - p = h + 5 - 2^130: take it when it does not go negative (h >= p)
    g0 = h0 + 5; c = g0 >> 44; g0 &= P_M44;
    g1 = h1 + c; c = g1 >> 44; g1 &= P_M44;
    g2 = h2 + c - (1ull << 42);
    mask = (g2 >> 63) - 1;              // all ones if g2 >= 0
    h0 = (h0 & ~mask) | (g0 & mask);
    h1 = (h1 & ~mask) | (g1 & mask);
    h2 = (h2 & ~mask) | (g2 & mask);
    uint64_t lo = h0 | (h1 << 44), hi = (h1 >> 20) | (h2 << 24);
    uint64_t t = lo + st->pad[0];
    hi = hi + st->pad[1] + (t < lo);
    lo = t;
    for (int i = 0; i < 8; i++) { tag[i] = (uint8_t)(lo >> (8 * i)); tag[8 + i] = (uint8_t)(hi >> (8 * i)); }
}

// The tag of one frame: Poly1305 over header and payload, with a one-time key (r, s) that is
// keyed BLAKE2s (the connection's key for this direction, prepared in *keyed with a 32-byte
// output) of the frame's counter in this direction. Every frame gets its own Poly1305 key, as
// RFC 8439 requires; a replayed, reordered or foreign frame is checked under another key.
static inline void frame_mac(const b2s_state* keyed, const void* hdr, size_t hlen,
                             const void* payload, size_t plen, uint64_t counter, uint8_t* tag) {
    b2s_state s = *keyed;
    uint8_t ctr[8], otk[32];
    p1305_state p;
    for (int i = 0; i < 8; i++) ctr[i] = (uint8_t)(counter >> (8 * i));
    b2s_update(&s, ctr, 8);
    b2s_final(&s, otk);
    p1305_init(&p, otk);
    p1305_update(&p, hdr, hlen);
    if (plen) p1305_update(&p, payload, plen);
    p1305_final(&p, tag);
}

// constant-time comparison of two tags
static inline int tag_equal(const uint8_t* a, const uint8_t* b, size_t n) {
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++) d |= a[i] ^ b[i];
    return d == 0;
}

}  // namespace r2
