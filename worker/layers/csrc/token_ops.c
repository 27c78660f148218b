/*
 * Token-wise ops of the decoder layers for CPU worker processes: the residual add fused into the
 * RMSNorm that follows it (float32 and bfloat16), and, in float32, the per-head RMSNorm of queries
 * and keys fused with their rotary embedding, SwiGLU's silu(gate) * up, and the linears of one or
 * two rows (a decode step of one or two requests), bound by streaming the weight.
 *
 * Built on first use by worker/layers/cpu_ops.py (through worker/native.py) with the system C
 * compiler and loaded with ctypes; plain C, like the attention kernel, whose vector helpers it
 * shares. In torch the add and the norm are five ops and eight passes over the rows (add, the
 * sum of squares, two scalings, each reading or writing a fresh tensor); here one pass adds,
 * stores the sum and accumulates its squares while the row is in L1, and a second scales it.
 * The caller guarantees float32, dense rows and the sizes.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../../attention/csrc/vector_math.h"

#define CONVEYOR_TOKEN_OPS_ABI_VERSION 6
/* Below this many elements the OpenMP fork costs more than the second thread saves (a decode
 * batch of a few rows). */
#define PARALLEL_MIN_ELEMENTS 16384

int conveyor_token_ops_abi_version(void) { return CONVEYOR_TOKEN_OPS_ABI_VERSION; }

/* Whether this build runs its loops on more than one thread (a compiler without OpenMP gets the
 * fallback flag sets): one thread streaming a weight is slower than oneDNN on all of them. */
int conveyor_token_ops_threaded(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* The sum of squares of row[0:size], summed[0:size] = row + added (when added is not NULL). */
static inline float add_and_square(const float *row, const float *added, float *summed,
                                   int size) {
    vf8 acc0 = splat(0.0f), acc1 = splat(0.0f);
    float tail = 0.0f;
    int i = 0;
    if (added) {
        for (; i + 2 * LANES <= size; i += 2 * LANES) {
            vf8 a = load(row + i) + load(added + i);
            vf8 b = load(row + i + LANES) + load(added + i + LANES);
            store(summed + i, a);
            store(summed + i + LANES, b);
            acc0 += a * a;
            acc1 += b * b;
        }
        for (; i < size; i++) {
            float a = row[i] + added[i];
            summed[i] = a;
            tail += a * a;
        }
    } else {
        for (; i + 2 * LANES <= size; i += 2 * LANES) {
            vf8 a = load(row + i), b = load(row + i + LANES);
            acc0 += a * a;
            acc1 += b * b;
        }
        for (; i < size; i++) tail += row[i] * row[i];
    }
    return hsum(acc0 + acc1) + tail;
}

/* For every row r: s = x[r] + residual[r] (x[r] alone when residual is NULL), then
 * out[r] = (s / sqrt(mean(s^2) + eps)) * weight, and summed[r] = s (when residual is given): the
 * same order of operations as Hugging Face's float32 RMSNorm (normalise, then scale). */
int conveyor_add_rms_norm(const float *x, int64_t x_stride, const float *residual,
                          int64_t residual_stride, const float *weight, int64_t num_rows,
                          int size, float eps, float *out, int64_t out_stride, float *summed,
                          int64_t summed_stride, int num_threads) {
    if (size <= 0 || num_rows < 0 || (residual && !summed)) return -1;
    const int parallel = num_rows * (int64_t)size >= PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = x + r * x_stride;
        const float *added = residual ? residual + r * residual_stride : NULL;
        float *sum_row = residual ? summed + r * summed_stride : NULL;
        const float *normed = residual ? sum_row : row;
        float *dst = out + r * out_stride;
        const float sum_of_squares = add_and_square(row, added, sum_row, size);
        const float inverse_rms = 1.0f / sqrtf(sum_of_squares / (float)size + eps);
        const vf8 scale = splat(inverse_rms);
        int i = 0;
        for (; i + LANES <= size; i += LANES)
            store(dst + i, load(normed + i) * scale * load(weight + i));
        for (; i < size; i++) dst[i] = normed[i] * inverse_rms * weight[i];
    }
    return 0;
}

/* e^x for x <= 0 to within about an ulp, as torch's exp is: x = n ln 2 + y with integer n and
 * |y| <= ln(2) / 2, ln 2 split in two parts (Cody and Waite) so that y keeps x's precision;
 * e^y by its Taylor series to degree 7 (truncation ~6e-9 relative), 2^n into the exponent bits.
 * (The attention kernel's exp2 of x * log2(e) loses |x| * 6e-8 of relative precision to the
 * rounding of that product: harmless for softmax weights, 8 ulps of a silu at |x| = 16.) Below
 * -87 the result is 0 (where torch's would be subnormal, below 1.2e-38). */
#define EXP_NONPOSITIVE(VF, VI, SUFFIX)                                                            \
    static inline VF exp_nonpositive##SUFFIX(VF x) {                                               \
        VI underflow = x < -87.0f; /* e^x below float32 normals: 0 */                              \
        x = select##SUFFIX(underflow, splat##SUFFIX(-87.0f), x);                                   \
        VI n = __builtin_convertvector(x * LOG2E - 0.5f, VI); /* truncates toward 0: rounds */     \
        VF nf = __builtin_convertvector(n, VF);                                                    \
        VF y = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;                        \
        VF p = splat##SUFFIX(1.0f / 5040.0f);                                                      \
        p = p * y + 1.0f / 720.0f;                                                                 \
        p = p * y + 1.0f / 120.0f;                                                                 \
        p = p * y + 1.0f / 24.0f;                                                                  \
        p = p * y + 1.0f / 6.0f;                                                                   \
        p = p * y + 0.5f;                                                                          \
        p = p * y + 1.0f;                                                                          \
        p = p * y + 1.0f;                                                                          \
        return select##SUFFIX(underflow, splat##SUFFIX(0.0f), (VF)((VI)p + (n << 23)));            \
    }                                                                                              \
    /* silu(g) * u = g * sigmoid(g) * u, sigmoid from e = exp(-|g|) <= 1 (never overflows). */     \
    static inline VF silu_times##SUFFIX(VF g, VF u) {                                              \
        VF e = exp_nonpositive##SUFFIX(select##SUFFIX(g < 0.0f, g, -g));                           \
        VF sigmoid = select##SUFFIX(g < 0.0f, e, splat##SUFFIX(1.0f)) / (1.0f + e);                \
        return (g * sigmoid) * u;                                                                  \
    }

EXP_NONPOSITIVE(vf8, vi8, )
#if defined(__AVX512F__)
EXP_NONPOSITIVE(vf16, vi16, 16)
#endif

/* bfloat16 steps of the ops below over one vector of N lanes, written once and instantiated for
 * 16 lanes (AVX-512) and 8 (every host, and the 8-wide tail of a 16-lane loop): every lane rounds
 * where the torch ops round, whatever its width (flushing float32 subnormals to zero where the
 * CPU's own conversion does: vector_math.h's _ftz forms). A value both stored and used again is
 * narrowed once and widened back (exact). BF: the suffix of the bf16 helpers, V: of the vector
 * ops. */
#define BF16_STEPS(VF, BITS, BF, V)                                                                \
    /* s = bf16(x + added) stored to sum (or x alone); returns acc + s^2 */                        \
    static inline VF bf16_sum_step##BF(const uint16_t *x, const uint16_t *added, uint16_t *sum,    \
                                      VF acc) {                                                    \
        VF s = load_bf16##BF(x);                                                                   \
        if (added) {                                                                               \
            BITS bits = narrow_bf16_ftz##BF(s + load_bf16##BF(added));                             \
            store_bf16_bits##BF(sum, bits);                                                        \
            s = widen_bf16##BF(bits);                                                              \
        }                                                                                          \
        return acc + s * s;                                                                        \
    }                                                                                              \
    static inline VF bf16_square_step##BF(const uint16_t *x, VF acc) {                             \
        VF v = load_bf16##BF(x);                                                                   \
        return acc + v * v;                                                                        \
    }                                                                                              \
    /* dst = bf16(weight * bf16(x * scale)): normalised in float32, cast, then scaled */           \
    static inline void bf16_scale_step##BF(uint16_t *dst, const uint16_t *x,                       \
                                           const uint16_t *weight, VF scale) {                     \
        VF normed = round_to_bf16_ftz##BF(load_bf16##BF(x) * scale);                               \
        store_bf16_ftz##BF(dst, load_bf16##BF(weight) * normed);                                   \
    }                                                                                              \
    /* dst = bf16(bf16(silu(gate)) * up): torch's silu rounds, then the product */                 \
    static inline void bf16_silu_step##BF(uint16_t *dst, const uint16_t *gate,                     \
                                          const uint16_t *up) {                                    \
        VF silu = round_to_bf16_ftz##BF(silu_times##V(load_bf16##BF(gate), splat##V(1.0f)));       \
        store_bf16_ftz##BF(dst, silu * load_bf16##BF(up));                                         \
    }                                                                                              \
    /* One pair of a head's halves: normalised (x = bf16(w * bf16(x * scale)), when w1 is not      \
     * NULL), then the torch ops' rotation (worker/layers/rotary.py rotate_): x1 sin, then         \
     * x1 cos - x2 sin and x2 cos + x1 sin, each op rounded. A product of two bfloat16 values is   \
     * exact in float32, so only the roundings matter, not whether a multiply-add is fused. */     \
    static inline void bf16_norm_rotate_step##BF(uint16_t *h1, uint16_t *h2, const uint16_t *w1,   \
                                                 const uint16_t *w2, VF scale,                     \
                                                 const uint16_t *cos, const uint16_t *sin) {       \
        VF x1 = load_bf16##BF(h1), x2 = load_bf16##BF(h2);                                         \
        if (w1) {                                                                                  \
            x1 = round_to_bf16_ftz##BF(load_bf16##BF(w1) * round_to_bf16_ftz##BF(x1 * scale));     \
            x2 = round_to_bf16_ftz##BF(load_bf16##BF(w2) * round_to_bf16_ftz##BF(x2 * scale));     \
        }                                                                                          \
        VF c = load_bf16##BF(cos), s = load_bf16##BF(sin);                                         \
        VF x1_sin = round_to_bf16_ftz##BF(x1 * s);                                                 \
        store_bf16_ftz##BF(h1, round_to_bf16_ftz##BF(x1 * c) - x2 * s);                            \
        store_bf16_ftz##BF(h2, round_to_bf16_ftz##BF(x2 * c) + x1_sin);                            \
    }

BF16_STEPS(vf8, vu16x8, , )
#if defined(__AVX512F__)
BF16_STEPS(vf16, vu16x16, _16, 16)
#endif

/* The bfloat16 form, rounding where Hugging Face's bfloat16 model rounds: s = bf16(x + residual)
 * (stored to summed), n = bf16(s / sqrt(mean(s^2) + eps)) with the mean in float32, then
 * out = bf16(weight * n). size must be a multiple of 8. */
int conveyor_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                               int64_t residual_stride, const uint16_t *weight,
                               int64_t num_rows, int size, float eps, uint16_t *out,
                               int64_t out_stride, uint16_t *summed, int64_t summed_stride,
                               int num_threads) {
    if (size <= 0 || size % LANES || num_rows < 0 || (residual && !summed)) return -1;
    const int parallel = num_rows * (int64_t)size >= PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *row = x + r * x_stride;
        const uint16_t *added = residual ? residual + r * residual_stride : NULL;
        uint16_t *sum_row = residual ? summed + r * summed_stride : NULL;
        const uint16_t *normed = residual ? sum_row : row;
        uint16_t *dst = out + r * out_stride;
        float sum_of_squares = 0.0f;
        int i = 0;
#if defined(__AVX512F__)
        vf16 wide = splat16(0.0f);
        for (; i + 16 <= size; i += 16)
            wide = bf16_sum_step_16(row + i, added ? added + i : NULL, added ? sum_row + i : NULL,
                                    wide);
        sum_of_squares = hsum16(wide);
#endif
        vf8 acc = splat(0.0f);
        for (; i < size; i += LANES)
            acc = bf16_sum_step(row + i, added ? added + i : NULL, added ? sum_row + i : NULL, acc);
        sum_of_squares += hsum(acc);
        const float scale = 1.0f / sqrtf(sum_of_squares / (float)size + eps);
        i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= size; i += 16)
            bf16_scale_step_16(dst + i, normed + i, weight + i, splat16(scale));
#endif
        for (; i < size; i += LANES) bf16_scale_step(dst + i, normed + i, weight + i, splat(scale));
    }
    return 0;
}

/* Where a * b + c * d must round both products before the sum, as torch's separate ops do: GCC
 * contracts across statements into a fused multiply-add by default, clang only within one. */
#if defined(__clang__) || !defined(__GNUC__)
#define SEPARATE_PRODUCTS
#else
#define SEPARATE_PRODUCTS __attribute__((optimize("fp-contract=off")))
#endif

/* Rotate one head in place (neox style, the first 2 * half dims in two halves), as Hugging Face
 * computes it: x * cos + rotate_half(x) * sin, each product rounded. */
static SEPARATE_PRODUCTS void rotate_head(float *h, const float *cos, const float *sin,
                                          int half) {
    int i = 0;
    for (; i + LANES <= half; i += LANES) {
        vf8 x1 = load(h + i), x2 = load(h + half + i), c = load(cos + i), s = load(sin + i);
        vf8 first_cos = x1 * c, first_sin = x2 * s, second_cos = x2 * c, second_sin = x1 * s;
        store(h + i, first_cos - first_sin);
        store(h + half + i, second_cos + second_sin);
    }
    for (; i < half; i++) {
        float x1 = h[i], x2 = h[half + i];
        float first_cos = x1 * cos[i], first_sin = x2 * sin[i];
        float second_cos = x2 * cos[i], second_sin = x1 * sin[i];
        h[i] = first_cos - first_sin;
        h[half + i] = second_cos + second_sin;
    }
}

/* The sum of squares of row[0:size] in the order torch's CPU sum reduces a dense float row
 * (measured on torch 2.13): each square rounded (Hugging Face's x.pow(2)), four 8-float
 * accumulators taking 8-float chunks in turn, added in order, their lanes summed in order, then
 * the tail in order. For sizes that are a multiple of 32 (head dims 64, 128, 256) this is
 * Hugging Face's sum bit for bit, so the norm rounds exactly as theirs; elsewhere it is within an
 * ulp or two. (A q/k norm summed as add_and_square sums, just as accurate, moved the tiny Qwen3's
 * logits up to 1.1e-4 from Hugging Face's, against 6e-5 for torch's own ops: a dozen layers of
 * attention turn any change in rounding into differences that size.) */
static SEPARATE_PRODUCTS float sum_of_squares_as_torch(const float *row, int size) {
    vf8 acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    int i = 0;
    for (; i + 4 * LANES <= size; i += 4 * LANES) {
        for (int k = 0; k < 4; k++) {
            vf8 v = load(row + i + k * LANES), square = v * v;
            acc[k] += square;
        }
    }
    vf8 all = ((acc[0] + acc[1]) + acc[2]) + acc[3];
    float total = all[0];
    for (int lane = 1; lane < LANES; lane++) total += all[lane];
    for (; i < size; i++) {
        float square = row[i] * row[i];
        total += square;
    }
    return total;
}

/* In place, for every token t and head h of x (rows of head_dim floats, heads side by side,
 * tokens token_stride apart): with weight (float32 [num_heads][head_dim]), the head's RMSNorm,
 * (x / sqrt(mean(x^2) + eps)) * weight as Hugging Face's float32 RMSNorm orders it; then, with
 * cos and sin ([num_tokens][half] each, rows angle_stride apart), its rotary embedding over the
 * first 2 * half dims. The queries and keys of a fused qkv projection, in one pass instead of
 * a dozen torch ops. */
int conveyor_qk_norm_rope(float *x, int64_t token_stride, int64_t num_tokens, int num_heads,
                          int head_dim, const float *weight, float eps, const float *cos,
                          const float *sin, int64_t angle_stride, int half, int num_threads) {
    if (head_dim <= 0 || num_heads <= 0 || num_tokens < 0 || half < 0 || 2 * half > head_dim
        || (half > 0 && (cos == NULL || sin == NULL)))
        return -1;
    const int parallel =
        num_tokens * num_heads * (int64_t)head_dim >= PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int h = 0; h < num_heads; h++) {
            float *row = x + t * token_stride + (int64_t)h * head_dim;
            if (weight != NULL) {
                const float *w = weight + (int64_t)h * head_dim;
                const float sum_of_squares = sum_of_squares_as_torch(row, head_dim);
                const float inverse_rms = 1.0f / sqrtf(sum_of_squares / (float)head_dim + eps);
                const vf8 scale = splat(inverse_rms);
                int i = 0;
                for (; i + LANES <= head_dim; i += LANES)
                    store(row + i, load(row + i) * scale * load(w + i));
                for (; i < head_dim; i++) row[i] = row[i] * inverse_rms * w[i];
            }
            if (half > 0) rotate_head(row, cos + t * angle_stride, sin + t * angle_stride, half);
        }
    }
    return 0;
}

/* One bfloat16 head's steps over n elements (n any size: whole vectors, then a padded copy of
 * the rest, so every element rounds alike). */
static inline float bf16_head_squares(const uint16_t *h, int n) {
    float total = 0.0f;
    int i = 0;
#if defined(__AVX512F__)
    vf16 wide = splat16(0.0f);
    for (; i + 16 <= n; i += 16) wide = bf16_square_step_16(h + i, wide);
    total = hsum16(wide);
#endif
    vf8 acc = splat(0.0f);
    for (; i + LANES <= n; i += LANES) acc = bf16_square_step(h + i, acc);
    total += hsum(acc);
    for (; i < n; i++) total += bf16_to_float(h[i]) * bf16_to_float(h[i]);
    return total;
}

static inline void bf16_head_scale(uint16_t *h, const uint16_t *w, float scale, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) bf16_scale_step_16(h + i, h + i, w + i, splat16(scale));
#endif
    for (; i + LANES <= n; i += LANES) bf16_scale_step(h + i, h + i, w + i, splat(scale));
    if (i < n) {
        uint16_t x[LANES] = {0}, weight[LANES] = {0};
        memcpy(x, h + i, (size_t)(n - i) * sizeof *x);
        memcpy(weight, w + i, (size_t)(n - i) * sizeof *weight);
        bf16_scale_step(x, x, weight, splat(scale));
        memcpy(h + i, x, (size_t)(n - i) * sizeof *x);
    }
}

/* The head's first 2 * half dims normalised (w not NULL) and rotated in one pass. */
static inline void bf16_head_norm_rotate(uint16_t *h, const uint16_t *w, float scale,
                                         const uint16_t *cos, const uint16_t *sin, int half) {
    const uint16_t *w2 = w ? w + half : NULL;
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= half; i += 16)
        bf16_norm_rotate_step_16(h + i, h + half + i, w ? w + i : NULL, w ? w2 + i : NULL,
                                 splat16(scale), cos + i, sin + i);
#endif
    for (; i + LANES <= half; i += LANES)
        bf16_norm_rotate_step(h + i, h + half + i, w ? w + i : NULL, w ? w2 + i : NULL,
                              splat(scale), cos + i, sin + i);
    if (i < half) {
        const size_t bytes = (size_t)(half - i) * sizeof *h;
        uint16_t x1[LANES] = {0}, x2[LANES] = {0}, c[LANES] = {0}, s[LANES] = {0};
        uint16_t v1[LANES] = {0}, v2[LANES] = {0};
        memcpy(x1, h + i, bytes);
        memcpy(x2, h + half + i, bytes);
        memcpy(c, cos + i, bytes);
        memcpy(s, sin + i, bytes);
        if (w) {
            memcpy(v1, w + i, bytes);
            memcpy(v2, w2 + i, bytes);
        }
        bf16_norm_rotate_step(x1, x2, w ? v1 : NULL, w ? v2 : NULL, splat(scale), c, s);
        memcpy(h + i, x1, bytes);
        memcpy(h + half + i, x2, bytes);
    }
}

/* The bfloat16 form of conveyor_qk_norm_rope, rounding where the torch ops do
 * (worker/layers/rotary.py normalize_and_rotate): n = bf16(x / sqrt(mean(x^2) + eps)) with the
 * mean in float32, x = bf16(weight * n), then the rotation's roundings; weight, cos and sin are
 * bfloat16 too (the angles cast to the activations' dtype, as Hugging Face casts them). A
 * token's heads first get their scales, then each is normalised and rotated in one pass: a
 * head's sum, square root and division are a chain of latencies that the heads' independent
 * chains overlap, where one head after another waited on each (1.3 ns an element against 0.3
 * for the rotation alone, 64-dim heads). */
int conveyor_qk_norm_rope_bf16(uint16_t *x, int64_t token_stride, int64_t num_tokens,
                               int num_heads, int head_dim, const uint16_t *weight, float eps,
                               const uint16_t *cos, const uint16_t *sin, int64_t angle_stride,
                               int half, int num_threads) {
    if (head_dim <= 0 || num_heads <= 0 || num_tokens < 0 || half < 0 || 2 * half > head_dim
        || (half > 0 && (cos == NULL || sin == NULL)))
        return -1;
    const int parallel =
        num_tokens * num_heads * (int64_t)head_dim >= PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t t = 0; t < num_tokens; t++) {
        uint16_t *token = x + t * token_stride;
        float scales[num_heads];
        if (weight != NULL) {
            for (int h = 0; h < num_heads; h++)
                scales[h] = bf16_head_squares(token + (int64_t)h * head_dim, head_dim);
            for (int h = 0; h < num_heads; h++)
                scales[h] = 1.0f / sqrtf(scales[h] / (float)head_dim + eps);
        }
        for (int h = 0; h < num_heads; h++) {
            uint16_t *row = token + (int64_t)h * head_dim;
            const uint16_t *w = weight ? weight + (int64_t)h * head_dim : NULL;
            const float scale = weight ? scales[h] : 1.0f;
            if (half > 0)
                bf16_head_norm_rotate(row, w, scale, cos + t * angle_stride,
                                      sin + t * angle_stride, half);
            if (w && 2 * half < head_dim)  /* partial rotary: the rest is only normalised */
                bf16_head_scale(row + 2 * half, w + 2 * half, scale, head_dim - 2 * half);
        }
    }
    return 0;
}


/* out[r] = silu(x[r][0:size]) * x[r][size:2 size]: SwiGLU's gate and up halves of one fused
 * projection, one pass instead of silu's and the product's. sigmoid(g) is 1 / (1 + e) for g >= 0
 * and e / (1 + e) below, e = exp(-|g|): within a few float32 roundings of torch's
 * g / (1 + exp(-g)) (another exp). */
int conveyor_silu_and_mul(const float *x, int64_t x_stride, int64_t num_rows, int size,
                          float *out, int64_t out_stride, int num_threads) {
    if (size <= 0 || num_rows < 0) return -1;
    const int parallel = num_rows * (int64_t)size >= 4 * PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + size;
        float *dst = out + r * out_stride;
        int i = 0;
#if defined(__AVX512F__)
        /* Twice the lanes per instruction: the exp and the division are the work here. */
        for (; i + 16 <= size; i += 16) {
            vf16 g, u, result;
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
            result = silu_times16(g, u);
            memcpy(dst + i, &result, sizeof result);
        }
#endif
        for (; i + LANES <= size; i += LANES) store(dst + i, silu_times(load(gate + i), load(up + i)));
        for (; i < size; i++) dst[i] = silu_times(splat(gate[i]), splat(up[i]))[0];
    }
    return 0;
}

/* The bfloat16 form: out = bf16(bf16(silu(gate)) * up), as torch's bfloat16 silu and product
 * round (each computes in float32 and rounds its result). Any size: the last size % 8 columns go
 * through a padded copy, so they round exactly as the vector lanes do. */
int conveyor_silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, int64_t num_rows, int size,
                               uint16_t *out, int64_t out_stride, int num_threads) {
    if (size <= 0 || num_rows < 0) return -1;
    const int parallel = num_rows * (int64_t)size >= 4 * PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *gate = x + r * x_stride, *up = gate + size;
        uint16_t *dst = out + r * out_stride;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= size; i += 16) bf16_silu_step_16(dst + i, gate + i, up + i);
#endif
        for (; i + LANES <= size; i += LANES) bf16_silu_step(dst + i, gate + i, up + i);
        if (i < size) {
            uint16_t g[LANES] = {0}, u[LANES] = {0}, d[LANES];
            memcpy(g, gate + i, (size_t)(size - i) * sizeof *g);
            memcpy(u, up + i, (size_t)(size - i) * sizeof *u);
            bf16_silu_step(d, g, u);
            memcpy(dst + i, d, (size_t)(size - i) * sizeof *d);
        }
    }
    return 0;
}

/* ---- y = x W^T + b for one to eight rows (a decode step of a few requests, or one request's
 * row with its speculative positions) ----
 *
 * At so few rows a linear reads each weight once for one or two multiply-adds: it is bound by
 * how fast the weight streams from memory, not by arithmetic. Each thread streams its own
 * contiguous run of the weight's rows (output features) front to back, eight rows at a time,
 * where the hardware prefetcher follows it; the inputs stay in L1. oneDNN's packed weight read
 * at ~18-21 GB/s at one row where this reads ~23-27 and a plain sum ~32 (2-core Zen 4, the
 * `bench` model's shapes; docs/performance.md).
 *
 * Every output is summed in one order whatever the thread count, the number of rows and where
 * its weight row falls in a group: a vector of partial sums over the input in order, its lanes
 * summed in a fixed tree, then the input's tail past the last whole vector, then the bias. */
#if defined(__AVX512F__)
typedef vf16 vrow;
#define ROW_LANES 16
static inline float sum_lanes(vrow v) {
    vf8 low, high;
    memcpy(&low, &v, sizeof low);
    memcpy(&high, (const char *)&v + sizeof low, sizeof high);
    return hsum(low + high);
}
#else
typedef vf8 vrow;
#define ROW_LANES LANES
static inline float sum_lanes(vrow v) { return hsum(v); }
#endif
#define SMALL_LINEAR_MAX_ROWS 8
/* One and two rows: eight weight rows at a time (16 accumulators at two rows). Three to eight
 * rows (a decode step's row with its speculative positions, a few requests): all rows at once
 * against four weight rows (three from seven rows on), each weight vector loaded once for every
 * row, so the weight streams from memory once whatever the row count. WEIGHT_GROUP is the most
 * a group holds, and the thread split's unit. */
#define WEIGHT_GROUP 8
/* Below this many weight elements one thread streams the whole weight faster than two can be
 * started (a few microseconds of OpenMP fork and join). */
#define SMALL_LINEAR_PARALLEL_MIN 65536

static inline vrow load_lanes(const float *p) {
    vrow v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Finish one output: the lanes, the input's tail, the bias. */
static inline float finish_output(vrow acc, const float *w_row, const float *x_row,
                                  int64_t vector_end, int64_t in, const float *bias, int64_t n) {
    float sum = sum_lanes(acc);
    for (int64_t k = vector_end; k < in; k++) sum += w_row[k] * x_row[k];
    return bias ? sum + bias[n] : sum;
}

/* The last few outputs (fewer than a group), one weight row at a time. */
static inline void small_linear_last_outputs(const float *x, int64_t x_stride, int rows,
                                             const float *w, int64_t in, const float *bias,
                                             float *y, int64_t y_stride, int64_t n, int64_t n1) {
    const int64_t vector_end = in - in % ROW_LANES;
    for (; n < n1; n++) {
        const float *w_row = w + n * in;
        for (int m = 0; m < rows; m++) {
            const float *x_row = x + m * x_stride;
            vrow acc = (vrow){0};
            for (int64_t k = 0; k < vector_end; k += ROW_LANES)
                acc += load_lanes(w_row + k) * load_lanes(x_row + k);
            y[m * y_stride + n] = finish_output(acc, w_row, x_row, vector_end, in, bias, n);
        }
    }
}

/* Outputs n0 .. n1-1 of ROWS input rows, GROUP weight rows at a time (both constants where it
 * is called, so each pair gets its own unrolled loop): ROWS x GROUP accumulators, GROUP weights
 * and one input in the vector registers. */
static inline __attribute__((always_inline)) void small_linear_outputs(
    const float *x, int64_t x_stride, const int rows, const int group_rows, const float *w,
    int64_t in, const float *bias, float *y, int64_t y_stride, int64_t n0, int64_t n1) {
    const int64_t vector_end = in - in % ROW_LANES;
    int64_t n = n0;
    for (; n + group_rows <= n1; n += group_rows) {
        const float *group = w + n * in;
        vrow acc[SMALL_LINEAR_MAX_ROWS][WEIGHT_GROUP];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < group_rows; g++) acc[m][g] = (vrow){0};
        for (int64_t k = 0; k < vector_end; k += ROW_LANES) {
            vrow weights[WEIGHT_GROUP];
            for (int g = 0; g < group_rows; g++) weights[g] = load_lanes(group + g * in + k);
            for (int m = 0; m < rows; m++) {
                vrow input = load_lanes(x + m * x_stride + k);
                for (int g = 0; g < group_rows; g++) acc[m][g] += weights[g] * input;
            }
        }
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < group_rows; g++)
                y[m * y_stride + n + g] = finish_output(acc[m][g], group + g * in,
                                                        x + m * x_stride, vector_end, in, bias,
                                                        n + g);
    }
    small_linear_last_outputs(x, x_stride, rows, w, in, bias, y, y_stride, n, n1);
}

/* y[m] = x[m] W^T (+ bias) for m < rows <= SMALL_LINEAR_MAX_ROWS; W is [out, in], dense. */
int conveyor_small_linear(const float *x, int64_t x_stride, int64_t rows, const float *w,
                          int64_t out, int64_t in, const float *bias, float *y,
                          int64_t y_stride, int num_threads) {
    if (rows < 0 || rows > SMALL_LINEAR_MAX_ROWS || out < 0 || in <= 0) return -1;
    if (rows == 0 || out == 0) return 0;
    const int parallel = out * in >= SMALL_LINEAR_PARALLEL_MIN && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#if defined(_OPENMP)
        const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t thread = 0, threads = 1;
#endif
        /* Contiguous runs of whole groups: each thread's weight rows are one stream. */
        const int64_t groups = (out + WEIGHT_GROUP - 1) / WEIGHT_GROUP;
        const int64_t per_thread = (groups + threads - 1) / threads * WEIGHT_GROUP;
        const int64_t n0 = thread * per_thread;
        const int64_t n1 = n0 + per_thread < out ? n0 + per_thread : out;
        if (n0 < n1) {
            switch (rows) {
#define ROWS(R, G)                                                                              \
    case R: small_linear_outputs(x, x_stride, R, G, w, in, bias, y, y_stride, n0, n1); break;
                ROWS(1, 8) ROWS(2, 8) ROWS(3, 4) ROWS(4, 4) ROWS(5, 4) ROWS(6, 4) ROWS(7, 3)
                ROWS(8, 3)
#undef ROWS
            }
        }
    }
    return 0;
}
