/*
 * Vector helpers shared by the paged-attention kernel's two item paths and by the token
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

/* Lane-wise operations for a vector type VF of N floats and its int32 twin VI, their names ending
 * in SUFFIX: instantiated for 8 floats (no suffix) and, where AVX-512 has them, 16 (suffix 16).
 * Written once, as a macro, so both widths compute each lane alike.
 *
 * exp2_nonpositive: 2^x for x <= 0, which every caller guarantees (a score minus a running max
 * at least as large, or a magnitude times a negative factor); for x > 0 the result is garbage,
 * and callers that compute it on lanes they do not use (the short path's lanes past a row's last
 * key) discard it. Clamping x at 0 too cost 2-5 % of a long prompt chunk's attention and never
 * changed a result. x = n + y with integer n and |y| <= 1/2; 2^y = e^(y ln 2) by its Taylor
 * series to degree 7 (coefficients (ln 2)^k / k!, truncation error ~1e-9 relative); 2^n by adding
 * n to the exponent bits. Below 2^-125 the result is a tiny normal rather than 0, which is 0 to
 * any sum it joins.
 *
 * soft_cap: cap * tanh(x / cap), from e = e^(-2|x|/cap) <= 1: tanh|y| = (1 - e) / (1 + e), sign
 * restored. The absolute error stays ~1e-7 * cap (a score's own rounding) at any |x|. */
#define VECTOR_OPS(VF, VI, N, SUFFIX)                                                            \
    /* x - 0 is x for every float, so the subtraction folds away (0 + x would not: -0) */   \
    static inline VF splat##SUFFIX(float x) { return x - (VF){0}; }                             \
    static inline VI splat_int##SUFFIX(int32_t x) { return (VI){0} + x; }                       \
    static inline VF select##SUFFIX(VI mask, VF yes, VF no) {                                   \
        return (VF)((mask & (VI)yes) | (~mask & (VI)no));                                       \
    }                                                                                           \
    static inline VF vmax##SUFFIX(VF a, VF b) { return select##SUFFIX(a > b, a, b); }           \
    static inline int any_lane##SUFFIX(VI mask) {                                               \
        int32_t bits = 0;                                                                       \
        for (int i = 0; i < N; i++) bits |= mask[i];                                            \
        return bits != 0;                                                                       \
    }                                                                                           \
    static inline VF exp2_nonpositive##SUFFIX(VF x) {                                           \
        x = select##SUFFIX(x < -125.0f, splat##SUFFIX(-125.0f), x);                             \
        VI n = __builtin_convertvector(x - 0.5f, VI); /* truncates toward 0: rounds x */        \
        VF y = x - __builtin_convertvector(n, VF);                                              \
        VF p = splat##SUFFIX(1.5252733804059840e-05f);                                          \
        p = p * y + 1.5403530393381609e-04f;                                                    \
        p = p * y + 1.3333558146428443e-03f;                                                    \
        p = p * y + 9.6181291076284772e-03f;                                                    \
        p = p * y + 5.5504108664821580e-02f;                                                    \
        p = p * y + 2.4022650695910071e-01f;                                                    \
        p = p * y + 6.9314718055994531e-01f;                                                    \
        p = p * y + 1.0f;                                                                       \
        return (VF)((VI)p + (n << 23));                                                         \
    }                                                                                           \
    static inline VF soft_cap##SUFFIX(VF x, float cap) {                                       \
        VF magnitude = select##SUFFIX(x < 0.0f, -x, x);                                         \
        VF e = exp2_nonpositive##SUFFIX(magnitude * (-2.0f * LOG2E / cap));                     \
        VF capped = cap * (1.0f - e) / (1.0f + e);                                              \
        return select##SUFFIX(x < 0.0f, -capped, capped);                                       \
    }

VECTOR_OPS(vf8, vi8, 8, )

/* 16-float vectors where AVX-512 has them: the query-tile path's wide rows (query_tiles.h), half
 * the instructions per multiply-add of 8-float vectors. */
#if defined(__AVX512F__)
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
VECTOR_OPS(vf16, vi16, 16, 16)
#endif

/* exp2_bf16_weights16: 2^x for x <= 0 where the result becomes a bfloat16 softmax weight (the
 * AMX path rounds its weights to bfloat16 for the values' tile product): the degree-5 series
 * (relative error under 2.4e-6, a 1/1,600 of a bfloat16 step) with AVX-512's scalef putting 2^n
 * in (n from a round to nearest, no integer round trip), 9 operations a vector where
 * exp2_nonpositive takes 14. Below 2^-126 a tiny normal, not 0, as exp2_nonpositive; callers
 * zero masked keys themselves. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf16 exp2_bf16_weights16(vf16 x) {
    const __m512 clamped = _mm512_max_ps((__m512)x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf16 y = (vf16)clamped - (vf16)n;
    vf16 p = splat16(1.3333558146428443e-03f);
    p = p * y + 9.6181291076284772e-03f;
    p = p * y + 5.5504108664821580e-02f;
    p = p * y + 2.4022650695910071e-01f;
    p = p * y + 6.9314718055994531e-01f;
    p = p * y + 1.0f;
    return (vf16)_mm512_scalef_ps((__m512)p, n);
}
#endif

static inline float hmax(vf8 v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum(vf8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* bfloat16: the top 16 bits of a float32. Widening is exact; narrowing rounds to the nearest,
 * ties to even, as torch rounds (NaN stays NaN).
 *
 * The _ftz forms (the token ops' activations) narrow with AVX512-BF16's VCVTNEPS2BF16 where the
 * CPU has it (with VL), one instruction for what is otherwise eight: the same bits for every
 * value but those under 2^-126 in magnitude (float32 subnormals), which it flushes to zero where
 * torch keeps them, far below anything a model's activations hold. Elsewhere they are the exact
 * forms. What must match torch bit for bit at every value (the KV cache's writes) uses those. */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#define CONVEYOR_HARDWARE_BF16 1
#endif

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

static inline vf8 widen_bf16(vu16x8 raw) { return (vf8)(__builtin_convertvector(raw, vi8) << 16); }

static inline vf8 load_bf16(const uint16_t *p) {
    vu16x8 raw;
    memcpy(&raw, p, sizeof raw);
    return widen_bf16(raw);
}

/* The bits of v rounded to bfloat16, in the top half of each lane (the low half is zero). */
static inline vu8 round_to_bf16_bits(vf8 v) {
    vu8 bits = (vu8)v;
    vu8 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    vu8 quiet_nan = (bits | 0x00400000u) & 0xffff0000u;
    return (vu8)select(v != v, (vf8)quiet_nan, (vf8)rounded);
}

/* v rounded to bfloat16, as the 16-bit values a bfloat16 tensor holds. */
static inline vu16x8 narrow_bf16(vf8 v) {
    return __builtin_convertvector(round_to_bf16_bits(v) >> 16, vu16x8);
}

/* v rounded to bfloat16 and widened back: what a bfloat16 tensor would hold. */
static inline vf8 round_to_bf16(vf8 v) { return (vf8)round_to_bf16_bits(v); }

static inline void store_bf16_bits(uint16_t *p, vu16x8 bits) { memcpy(p, &bits, sizeof bits); }

static inline void store_bf16(uint16_t *p, vf8 v) { store_bf16_bits(p, narrow_bf16(v)); }

static inline vu16x8 narrow_bf16_ftz(vf8 v) {
#if defined(CONVEYOR_HARDWARE_BF16)
    return (vu16x8)_mm256_cvtneps_pbh((__m256)v);
#else
    return narrow_bf16(v);
#endif
}

static inline vf8 round_to_bf16_ftz(vf8 v) {
#if defined(CONVEYOR_HARDWARE_BF16)
    return widen_bf16(narrow_bf16_ftz(v));
#else
    return round_to_bf16(v);
#endif
}

static inline void store_bf16_ftz(uint16_t *p, vf8 v) { store_bf16_bits(p, narrow_bf16_ftz(v)); }

#if defined(__AVX512F__)
/* The same for 16 floats (the token ops' bfloat16 rows; only _ftz narrowing), in intrinsics:
 * GCC built the generic vectors' 16-lane conversions from pairs of 8-lane halves. */
#include <immintrin.h>
typedef __m256i vu16x16;

static inline vf16 widen_bf16_16(vu16x16 raw) {
    return (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
}

static inline vf16 load_bf16_16(const uint16_t *p) {
    return widen_bf16_16(_mm256_loadu_si256((const __m256i *)p));
}

static inline vu16x16 narrow_bf16_ftz_16(vf16 v) {
#if defined(__AVX512BF16__)
    return (vu16x16)_mm512_cvtneps_pbh((__m512)v);
#else
    const __m512i bits = (__m512i)v;
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

static inline vf16 round_to_bf16_ftz_16(vf16 v) { return widen_bf16_16(narrow_bf16_ftz_16(v)); }

static inline void store_bf16_bits_16(uint16_t *p, vu16x16 bits) {
    _mm256_storeu_si256((__m256i *)p, bits);
}

static inline void store_bf16_ftz_16(uint16_t *p, vf16 v) {
    store_bf16_bits_16(p, narrow_bf16_ftz_16(v));
}

static inline float hsum16(vf16 v) {
    const __m512 wide = (__m512)v;
    const vf8 low = (vf8)_mm512_castps512_ps256(wide);
    const vf8 high = (vf8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide), 1));
    return hsum(low + high);
}
#endif

#endif
