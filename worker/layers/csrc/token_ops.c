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

#define CONVEYOR_TOKEN_OPS_ABI_VERSION 4
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
        vf8 acc = splat(0.0f);
        for (int i = 0; i < size; i += LANES) {
            vf8 s = load_bf16(row + i);
            if (added) {
                s = round_to_bf16(s + load_bf16(added + i));
                store_bf16(sum_row + i, s);
            }
            acc += s * s;
        }
        const vf8 scale = splat(1.0f / sqrtf(hsum(acc) / (float)size + eps));
        for (int i = 0; i < size; i += LANES)
            store_bf16(dst + i, load_bf16(weight + i) * round_to_bf16(load_bf16(normed + i) * scale));
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

/* ---- y = x W^T + b for one or two rows (a decode step of one or two requests) ----
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
#define SMALL_LINEAR_MAX_ROWS 2
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

/* Outputs n0 .. n1-1 of ROWS input rows (a constant where it is called, so each count gets its
 * own unrolled loop). */
static inline __attribute__((always_inline)) void small_linear_outputs(
    const float *x, int64_t x_stride, const int rows, const float *w, int64_t in,
    const float *bias, float *y, int64_t y_stride, int64_t n0, int64_t n1) {
    const int64_t vector_end = in - in % ROW_LANES;
    int64_t n = n0;
    for (; n + WEIGHT_GROUP <= n1; n += WEIGHT_GROUP) {
        const float *group = w + n * in;
        vrow acc[SMALL_LINEAR_MAX_ROWS][WEIGHT_GROUP];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < WEIGHT_GROUP; g++) acc[m][g] = (vrow){0};
        for (int64_t k = 0; k < vector_end; k += ROW_LANES) {
            vrow weights[WEIGHT_GROUP];
            for (int g = 0; g < WEIGHT_GROUP; g++) weights[g] = load_lanes(group + g * in + k);
            for (int m = 0; m < rows; m++) {
                vrow input = load_lanes(x + m * x_stride + k);
                for (int g = 0; g < WEIGHT_GROUP; g++) acc[m][g] += weights[g] * input;
            }
        }
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < WEIGHT_GROUP; g++)
                y[m * y_stride + n + g] = finish_output(acc[m][g], group + g * in,
                                                        x + m * x_stride, vector_end, in, bias,
                                                        n + g);
    }
    for (; n < n1; n++) { /* the last few outputs, one weight row at a time */
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
            if (rows == 1)
                small_linear_outputs(x, x_stride, 1, w, in, bias, y, y_stride, n0, n1);
            else
                small_linear_outputs(x, x_stride, 2, w, in, bias, y, y_stride, n0, n1);
        }
    }
    return 0;
}
