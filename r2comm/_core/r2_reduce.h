// Reduction kernels for r2comm's engine: dst[i] = a[i] op b[i] (dst may be a or b).
// Plain loops over typed pointers so the compiler vectorises them at -O3; called without the GIL.
// float16 is computed in float32 and rounded back (to nearest even), as numpy does.
// complex64/complex128 reduce with SUM and PROD only, bool with none (MPI defines no MIN/MAX for
// complex numbers, nor SUM/PROD/MIN/MAX for C_BOOL): those only move data; ops.py refuses the rest.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

namespace r2 {

enum Dtype { I8 = 0, I16, I32, I64, U8, U16, U32, U64, F16, F32, F64, C64, C128, BOOL, NDTYPES };
enum Redop { SUM = 0, PROD, MIN, MAX, NOPS };

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  // subnormal: normalise
            int e = -1;
            do { e++; man <<= 1; } while ((man & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f; std::memcpy(&f, &bits, 4); return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) {  // inf or nan
        return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? (0x200u | ((absx >> 13) & 0x3ffu)) : 0));
    }
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to inf
    if (absx < 0x38800000u) {  // subnormal or zero in half
        if (absx < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero
        uint32_t e = absx >> 23, m = (absx & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;  // 14 + (113 - e) - 1
        uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (hm & 1u))) hm++;
        return (uint16_t)(sign | hm);
    }
    uint32_t hb = ((absx - 0x38000000u) >> 13);
    uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (hb & 1u))) hb++;
    return (uint16_t)(sign | hb);
}

template <typename T> static inline T op_apply(int op, T a, T b) {
    switch (op) {
        case SUM: return (T)(a + b);
        case PROD: return (T)(a * b);
        case MIN: return b < a ? b : a;
        default: return b > a ? b : a;
    }
}
template <typename T> static inline T fop_apply(int op, T a, T b) {  // NaN-propagating, like numpy
    switch (op) {
        case SUM: return a + b;
        case PROD: return a * b;
        case MIN: return (std::isnan(a) || a <= b) ? a : b;
        default: return (std::isnan(a) || a >= b) ? a : b;
    }
}

template <typename T, int OP> static void loop_int(T* d, const T* a, const T* b, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = op_apply<T>(OP, a[i], b[i]);
}
template <typename T, int OP> static void loop_flt(T* d, const T* a, const T* b, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = fop_apply<T>(OP, a[i], b[i]);
}
template <int OP> static void loop_half(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = float_to_half(fop_apply<float>(OP, half_to_float(a[i]), half_to_float(b[i])));
}

template <typename T> static void dispatch_int(int op, void* d, const void* a, const void* b, size_t n) {
    switch (op) {
        case SUM: loop_int<T, SUM>((T*)d, (const T*)a, (const T*)b, n); break;
        case PROD: loop_int<T, PROD>((T*)d, (const T*)a, (const T*)b, n); break;
        case MIN: loop_int<T, MIN>((T*)d, (const T*)a, (const T*)b, n); break;
        default: loop_int<T, MAX>((T*)d, (const T*)a, (const T*)b, n); break;
    }
}
template <typename T> static void dispatch_flt(int op, void* d, const void* a, const void* b, size_t n) {
    switch (op) {
        case SUM: loop_flt<T, SUM>((T*)d, (const T*)a, (const T*)b, n); break;
        case PROD: loop_flt<T, PROD>((T*)d, (const T*)a, (const T*)b, n); break;
        case MIN: loop_flt<T, MIN>((T*)d, (const T*)a, (const T*)b, n); break;
        default: loop_flt<T, MAX>((T*)d, (const T*)a, (const T*)b, n); break;
    }
}

// complex: (re, im) pairs of T; SUM adds them, PROD multiplies as complex numbers
template <typename T> static int dispatch_cplx(int op, void* d, const void* a, const void* b, size_t n) {
    T* x = (T*)d; const T* p = (const T*)a; const T* q = (const T*)b;
    if (op == SUM) {
        for (size_t i = 0; i < 2 * n; i++) x[i] = p[i] + q[i];
    } else if (op == PROD) {
        for (size_t i = 0; i < n; i++) {
            T re = p[2 * i] * q[2 * i] - p[2 * i + 1] * q[2 * i + 1];
            T im = p[2 * i] * q[2 * i + 1] + p[2 * i + 1] * q[2 * i];
            x[2 * i] = re; x[2 * i + 1] = im;
        }
    } else {
        return -1;
    }
    return 0;
}

static inline int itemsize(int dt) {
    static const int sz[NDTYPES] = {1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 8, 16, 1};
    return (dt >= 0 && dt < NDTYPES) ? sz[dt] : 0;
}

// d[i] = a[i] op b[i]; d may be a or b (element-wise, so aliasing is safe). The operand order is
// part of the result for floats, so callers fix it from the schedule. Returns 0 on success, -1
// for an unknown dtype/op. nbytes must be a multiple of the item size.
static inline int reduce3(void* d, const void* a, const void* b, size_t nbytes, int dt, int op) {
    if (op < 0 || op >= NOPS) return -1;
    int isz = itemsize(dt);
    if (!isz) return -1;
    size_t n = nbytes / (size_t)isz;
    switch (dt) {
        case I8: dispatch_int<int8_t>(op, d, a, b, n); break;
        case I16: dispatch_int<int16_t>(op, d, a, b, n); break;
        case I32: dispatch_int<int32_t>(op, d, a, b, n); break;
        case I64: dispatch_int<int64_t>(op, d, a, b, n); break;
        case U8: dispatch_int<uint8_t>(op, d, a, b, n); break;
        case U16: dispatch_int<uint16_t>(op, d, a, b, n); break;
        case U32: dispatch_int<uint32_t>(op, d, a, b, n); break;
        case U64: dispatch_int<uint64_t>(op, d, a, b, n); break;
        case F16:
            switch (op) {
                case SUM: loop_half<SUM>((uint16_t*)d, (const uint16_t*)a, (const uint16_t*)b, n); break;
                case PROD: loop_half<PROD>((uint16_t*)d, (const uint16_t*)a, (const uint16_t*)b, n); break;
                case MIN: loop_half<MIN>((uint16_t*)d, (const uint16_t*)a, (const uint16_t*)b, n); break;
                default: loop_half<MAX>((uint16_t*)d, (const uint16_t*)a, (const uint16_t*)b, n); break;
            }
            break;
        case F32: dispatch_flt<float>(op, d, a, b, n); break;
        case F64: dispatch_flt<double>(op, d, a, b, n); break;
        case C64: return dispatch_cplx<float>(op, d, a, b, n);
        case C128: return dispatch_cplx<double>(op, d, a, b, n);
        default: return -1;
    }
    return 0;
}

// dst = dst op src, or src op dst when rev.
static inline int reduce_into(void* d, const void* s, size_t nbytes, int dt, int op, int rev) {
    return rev ? reduce3(d, s, d, nbytes, dt, op) : reduce3(d, d, s, nbytes, dt, op);
}

// Header checksum: FNV-1a over the first 44 bytes of a frame header.
static inline uint32_t hdr_check(const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 16777619u; }
    return h;
}

}  // namespace r2
