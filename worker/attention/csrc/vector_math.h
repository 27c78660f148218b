/*
 * 8-float vector helpers shared by the paged-attention kernel's two item paths and by the token
 * ops (worker/layers/csrc/token_ops.c); each library includes its own copy, so everything here is
 * static inline.
 *
 * GCC/clang vector extensions: AVX on x86 with -march=native, pairs of SSE/NEON registers
 * otherwise. Written out rather than left to the auto-vectoriser, which kept the exp and max loops
 * scalar.
 */
#ifndef CONVEYOR_VECTOR_MATH_H
#define CONVEYOR_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define LOG2E 1.4426950408889634f

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline vf8 load(const float *p) {
    vf8 v;
    memcpy(&v, p, sizeof v); /* unaligned load; compiles to one instruction */
    return v;
}

static inline void store(float *p, vf8 v) { memcpy(p, &v, sizeof v); }

static inline vf8 splat(float x) { return (vf8){x, x, x, x, x, x, x, x}; }

static inline vi8 splat_int(int32_t x) { return (vi8){x, x, x, x, x, x, x, x}; }

static inline vf8 select(vi8 mask, vf8 yes, vf8 no) {
    return (vf8)((mask & (vi8)yes) | (~mask & (vi8)no));
}

static inline vf8 vmax(vf8 a, vf8 b) { return select(a > b, a, b); }

static inline float hmax(vf8 v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum(vf8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static inline int any_lane(vi8 mask) {
    int32_t bits = 0;
    for (int i = 0; i < LANES; i++) bits |= mask[i];
    return bits != 0;
}

/* bfloat16: the top 16 bits of a float32. Widening is exact; narrowing rounds to the nearest,
 * ties to even, as torch rounds (NaN stays NaN). */
typedef uint16_t vu16x8 __attribute__((vector_size(16)));
typedef uint32_t vu8 __attribute__((vector_size(32)));

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline vf8 load_bf16(const uint16_t *p) {
    vu16x8 raw;
    memcpy(&raw, p, sizeof raw);
    return (vf8)(__builtin_convertvector(raw, vi8) << 16);
}

/* The bits of v rounded to bfloat16, in the top half of each lane (the low half is zero). */
static inline vu8 round_to_bf16_bits(vf8 v) {
    vu8 bits = (vu8)v;
    vu8 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    vu8 quiet_nan = (bits | 0x00400000u) & 0xffff0000u;
    return (vu8)select(v != v, (vf8)quiet_nan, (vf8)rounded);
}

/* v rounded to bfloat16 and widened back: what a bfloat16 tensor would hold. */
static inline vf8 round_to_bf16(vf8 v) { return (vf8)round_to_bf16_bits(v); }

static inline void store_bf16(uint16_t *p, vf8 v) {
    vu16x8 narrow = __builtin_convertvector(round_to_bf16_bits(v) >> 16, vu16x8);
    memcpy(p, &narrow, sizeof narrow);
}

/* 2^x lane-wise for x <= 0 (larger x is clamped to 0): x = n + y with integer n and
 * |y| <= 1/2; 2^y = e^(y ln 2) by its Taylor series to degree 7 (coefficients (ln 2)^k / k!,
 * truncation error ~1e-9 relative); 2^n by adding n to the exponent bits. Below 2^-125 the result
 * is a tiny normal rather than 0, which is 0 to any sum it joins. */
static inline vf8 exp2_nonpositive(vf8 x) {
    x = select(x > 0.0f, splat(0.0f), x);
    x = select(x < -125.0f, splat(-125.0f), x);
    vi8 n = __builtin_convertvector(x - 0.5f, vi8); /* truncates toward 0: rounds x */
    vf8 y = x - __builtin_convertvector(n, vf8);
    vf8 p = splat(1.5252733804059840e-05f);
    p = p * y + 1.5403530393381609e-04f;
    p = p * y + 1.3333558146428443e-03f;
    p = p * y + 9.6181291076284772e-03f;
    p = p * y + 5.5504108664821580e-02f;
    p = p * y + 2.4022650695910071e-01f;
    p = p * y + 6.9314718055994531e-01f;
    p = p * y + 1.0f;
    return (vf8)((vi8)p + (n << 23));
}

/* cap * tanh(x / cap) lane-wise, from e = e^(-2|x|/cap) <= 1: tanh|y| = (1 - e) / (1 + e), sign
 * restored. The absolute error stays ~1e-7 * cap (a score's own rounding) at any |x|. */
static inline vf8 soft_cap(vf8 x, float cap) {
    vf8 magnitude = select(x < 0.0f, -x, x);
    vf8 e = exp2_nonpositive(magnitude * (-2.0f * LOG2E / cap));
    vf8 capped = cap * (1.0f - e) / (1.0f + e);
    return select(x < 0.0f, -capped, capped);
}

#endif
