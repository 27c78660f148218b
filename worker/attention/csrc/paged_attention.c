/*
 * Paged attention for CPU worker processes: causal attention of short query runs (decodes, small
 * prompt chunks) read straight from the paged KV cache through the block table, float32.
 *
 * Built on first use by worker/attention/cpu_kernel.py with the system C compiler and loaded with
 * ctypes; plain C (no torch headers) so it compiles in about a second. The caller guarantees
 * types and shapes; this file checks only what would otherwise read out of bounds.
 *
 * Cache layout (the torch backend's): [2][num_kv_heads][num_blocks][block_size][head_dim], keys
 * then values. One work item is (query tile, kv head): up to MAX_ROWS query rows (the heads of
 * one GQA group, for up to MAX_ROWS / group consecutive tokens of one request) that all read the
 * same keys, so every key and value row loaded from memory serves the whole tile. Softmax is the
 * online (flash) form: one pass over the keys, a running max and sum per row, fp32 throughout.
 * With a sliding window W a row at position p sees keys p - W + 1 .. p only; an item starts at
 * its first row's first visible key, so keys behind every row's window are never read (their
 * blocks may already belong to another request). Attention sinks (a per-head logit that joins
 * every row's softmax denominator with a zero value, gpt-oss) start each row's running max at the
 * sink and its sum at 1: the online softmax then folds the sink in as one more key. A logit
 * soft-cap (Gemma 2) maps every score s to c * tanh(s / c) before the softmax.
 *
 * Arithmetic is on 8-float vectors (GCC/clang vector extensions: AVX on x86 with -march=native,
 * pairs of SSE/NEON registers otherwise), so head_dim must be a multiple of 8. Written out rather
 * than left to the auto-vectoriser, which kept the exp and max loops scalar.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CONVEYOR_ABI_VERSION 6
#define MAX_ROWS 16
#define MAX_HEAD_DIM 256
#define LANES 8
/* Keys scored before each softmax update: enough to amortise the rescale of the accumulators,
 * few enough that the scores stay in L1. A multiple of LANES. */
#define TILE_KEYS 32
#define TILE_VECTORS (TILE_KEYS / LANES)
#define HEAD_VECTORS (MAX_HEAD_DIM / LANES)
#define LOG2E 1.4426950408889634f
#define CACHE_LINE_FLOATS 16

enum { CONVEYOR_OK = 0, CONVEYOR_BAD_SHAPE = -1, CONVEYOR_BAD_BLOCK = -2, CONVEYOR_BAD_SLOT = -3 };

/* A work item, as the planner packs it: int32 [4]. */
enum { ITEM_TABLE_ROW, ITEM_TOKEN_START, ITEM_NUM_QUERIES, ITEM_FIRST_POSITION, ITEM_FIELDS };

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

typedef struct {
    const float *query;
    int64_t query_token_stride, query_head_stride;
    const float *kv_cache;
    int64_t num_blocks;
    int num_kv_heads, block_size, head_dim, num_heads;
    const int32_t *block_table;
    int64_t block_table_stride;
    float scale;
    int window; /* 0: every earlier key */
    const float *sinks; /* per query head, natural-log units; NULL: none */
    float softcap; /* natural-log units; 0: none */
    float *output;
    int64_t output_token_stride;
} attention_args;

int conveyor_abi_version(void) { return CONVEYOR_ABI_VERSION; }

static inline vf8 load(const float *p) {
    vf8 v;
    memcpy(&v, p, sizeof v); /* unaligned load; compiles to one instruction */
    return v;
}

static inline void store(float *p, vf8 v) { memcpy(p, &v, sizeof v); }

static inline vf8 splat(float x) { return (vf8){x, x, x, x, x, x, x, x}; }

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

typedef struct {
    vf8 q[MAX_ROWS][HEAD_VECTORS];   /* queries, pre-scaled to log2 units */
    vf8 acc[MAX_ROWS][HEAD_VECTORS]; /* unnormalised outputs */
    vf8 p[MAX_ROWS][TILE_VECTORS];   /* this tile's scores, then its softmax weights */
    float max[MAX_ROWS], sum[MAX_ROWS];
    int num_visible[MAX_ROWS]; /* keys row r may see end here: its position + 1 */
    int first_visible[MAX_ROWS]; /* and start here: 0, or the start of its sliding window */
} tile_state;

/* Scores of num_keys consecutive keys against every row, into st->p. next_keys / next_values
 * (or NULL) are the next tile's rows: fetched while this tile computes, since a tile usually
 * starts a new block, at an address the hardware prefetcher cannot guess. */
static inline __attribute__((always_inline)) void score_keys(
    tile_state *st, int num_rows, const float *keys, int num_keys, const float *next_keys,
    const float *next_values, const float cap, const int D) {
    for (int t = 0; t < num_keys; t++) {
        const float *k = keys + (int64_t)t * D;
        if (next_keys != NULL) {
            for (int c = 0; c < D; c += CACHE_LINE_FLOATS) {
                __builtin_prefetch(next_keys + (int64_t)t * D + c);
                __builtin_prefetch(next_values + (int64_t)t * D + c);
            }
        }
        for (int r = 0; r < num_rows; r++) {
            /* Two partial sums halve the dependency chain of the fused multiply-adds. */
            vf8 even = splat(0.0f), odd = splat(0.0f);
            int j = 0;
            for (; j + 1 < D / LANES; j += 2) {
                even += st->q[r][j] * load(k + j * LANES);
                odd += st->q[r][j + 1] * load(k + (j + 1) * LANES);
            }
            if (j < D / LANES) even += st->q[r][j] * load(k + j * LANES);
            float score = hsum(even + odd);
            /* cap is in the scores' log2 units: c * tanh(s / c) scales with them. */
            if (cap > 0.0f) score = cap * tanhf(score / cap);
            st->p[r][t / LANES][t % LANES] = score;
        }
    }
}

/* Fold row r's scores into its running max and sum; leave its softmax weights in st->p[r]. */
static inline __attribute__((always_inline)) void softmax_row(
    tile_state *st, int r, int num_keys, int key_pos, const int D) {
    int visible = st->num_visible[r] - key_pos;
    visible = visible < num_keys ? visible : num_keys;
    const int hidden = st->first_visible[r] - key_pos; /* keys of this tile before the window */
    const vi8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    vf8 tile_max = splat(-INFINITY);
    for (int i = 0; i * LANES < num_keys; i++) {
        vi8 present = (lane + i * LANES < visible) & (lane + i * LANES >= hidden);
        tile_max = vmax(tile_max, select(present, st->p[r][i], splat(-INFINITY)));
    }
    float new_max = hmax(tile_max);
    if (new_max < st->max[r]) new_max = st->max[r];
    if (new_max == -INFINITY) { /* nothing visible yet: this row's weights are all 0 */
        for (int i = 0; i * LANES < num_keys; i++) st->p[r][i] = splat(0.0f);
        return;
    }
    float alpha = exp2_nonpositive(splat(st->max[r] - new_max))[0];
    if (alpha != 1.0f) {
        for (int j = 0; j < D / LANES; j++) st->acc[r][j] *= alpha;
        st->sum[r] *= alpha;
    }
    vf8 sum = splat(0.0f);
    for (int i = 0; i * LANES < num_keys; i++) {
        vi8 present = (lane + i * LANES < visible) & (lane + i * LANES >= hidden);
        vf8 weight = select(present, exp2_nonpositive(st->p[r][i] - new_max), splat(0.0f));
        st->p[r][i] = weight;
        sum += weight;
    }
    st->sum[r] += hsum(sum);
    st->max[r] = new_max;
}

/* acc[r] += sum over t of p[r][t] * values[t], four vectors of acc held in registers at once. */
static inline __attribute__((always_inline)) void accumulate_values(
    tile_state *st, int num_rows, const float *values, int num_keys, const int D) {
    for (int r = 0; r < num_rows; r++) {
        const float *p = (const float *)st->p[r];
        int j = 0;
        for (; j + 4 <= D / LANES; j += 4) {
            vf8 a0 = st->acc[r][j], a1 = st->acc[r][j + 1];
            vf8 a2 = st->acc[r][j + 2], a3 = st->acc[r][j + 3];
            for (int t = 0; t < num_keys; t++) {
                const float *v = values + (int64_t)t * D + j * LANES;
                vf8 w = splat(p[t]);
                a0 += w * load(v);
                a1 += w * load(v + LANES);
                a2 += w * load(v + 2 * LANES);
                a3 += w * load(v + 3 * LANES);
            }
            st->acc[r][j] = a0, st->acc[r][j + 1] = a1;
            st->acc[r][j + 2] = a2, st->acc[r][j + 3] = a3;
        }
        for (; j < D / LANES; j++) {
            vf8 a = st->acc[r][j];
            for (int t = 0; t < num_keys; t++) a += splat(p[t]) * load(values + (int64_t)t * D + j * LANES);
            st->acc[r][j] = a;
        }
    }
}

/* Where the key and value of key position pos lie; false if its block id is out of range. */
static inline __attribute__((always_inline)) int locate_keys(
    const attention_args *a, const int32_t *blocks, int kv_head, int pos, const int D,
    const float **keys, const float **values) {
    int32_t block = blocks[pos / a->block_size];
    if (block < 0 || block >= a->num_blocks) return 0;
    int64_t row = ((int64_t)kv_head * a->num_blocks + block) * a->block_size + pos % a->block_size;
    *keys = a->kv_cache + row * D;
    *values = *keys + (int64_t)a->num_kv_heads * a->num_blocks * a->block_size * D;
    return 1;
}

/* Load the item's query rows, (query token qi, head g of the group) -> row qi * group + g. */
static inline __attribute__((always_inline)) void start_rows(
    tile_state *st, const attention_args *a, const int32_t *item, int kv_head, const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    /* Scores come out in log2 units, so the softmax needs exp2 only. */
    const float q_scale = a->scale * LOG2E;
    for (int r = 0; r < item[ITEM_NUM_QUERIES] * group; r++) {
        int qi = r / group, head = kv_head * group + r % group;
        const float *src = a->query + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->query_token_stride
                           + (int64_t)head * a->query_head_stride;
        for (int j = 0; j < D / LANES; j++) {
            st->q[r][j] = load(src + j * LANES) * q_scale;
            st->acc[r][j] = splat(0.0f);
        }
        if (a->sinks != NULL) { /* the sink as a key seen first: weight exp(0) = 1, value 0 */
            st->max[r] = a->sinks[head] * LOG2E;
            st->sum[r] = 1.0f;
        } else {
            st->max[r] = -INFINITY;
            st->sum[r] = 0.0f;
        }
        st->num_visible[r] = item[ITEM_FIRST_POSITION] + qi + 1;
        st->first_visible[r] = a->window > 0 && st->num_visible[r] > a->window
                                   ? st->num_visible[r] - a->window
                                   : 0;
    }
}

static inline __attribute__((always_inline)) void finish_rows(
    const tile_state *st, const attention_args *a, const int32_t *item, int kv_head, const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    for (int r = 0; r < item[ITEM_NUM_QUERIES] * group; r++) {
        int qi = r / group, head = kv_head * group + r % group;
        float *dst = a->output + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->output_token_stride
                     + (int64_t)head * D;
        float inv = 1.0f / st->sum[r];
        for (int j = 0; j < D / LANES; j++) store(dst + j * LANES, st->acc[r][j] * inv);
    }
}

/* One work item: every key its rows may see, tile by tile, never crossing a block. */
static inline __attribute__((always_inline)) int attend_item(
    const attention_args *a, const int32_t *item, int kv_head, const int D) {
    tile_state st;
    const int num_rows = item[ITEM_NUM_QUERIES] * (a->num_heads / a->num_kv_heads);
    const int num_keys = item[ITEM_FIRST_POSITION] + item[ITEM_NUM_QUERIES];
    const int bs = a->block_size;
    const int32_t *blocks = a->block_table + (int64_t)item[ITEM_TABLE_ROW] * a->block_table_stride;
    const float *keys, *values, *next_keys = NULL, *next_values = NULL;
    start_rows(&st, a, item, kv_head, D);
    const int first_key = st.first_visible[0]; /* the item's earliest row sees furthest back */
    if (!locate_keys(a, blocks, kv_head, first_key, D, &keys, &values)) return CONVEYOR_BAD_BLOCK;
    for (int pos = first_key; pos < num_keys;) {
        int num = bs - pos % bs;
        num = num < TILE_KEYS ? num : TILE_KEYS;
        num = num < num_keys - pos ? num : num_keys - pos;
        if (pos + num < num_keys
            && !locate_keys(a, blocks, kv_head, pos + num, D, &next_keys, &next_values))
            return CONVEYOR_BAD_BLOCK;
        score_keys(&st, num_rows, keys, num, next_keys, next_values, a->softcap * LOG2E, D);
        for (int r = 0; r < num_rows; r++) softmax_row(&st, r, num, pos, D);
        accumulate_values(&st, num_rows, values, num, D);
        pos += num;
        keys = next_keys;
        values = next_values;
        next_keys = next_values = NULL;
    }
    finish_rows(&st, a, item, kv_head, D);
    return CONVEYOR_OK;
}

/* Constant head dims let the compiler unroll the inner loops fully. */
static int attend_item_any_dim(const attention_args *a, const int32_t *item, int kv_head) {
    switch (a->head_dim) {
    case 64: return attend_item(a, item, kv_head, 64);
    case 128: return attend_item(a, item, kv_head, 128);
    default: return attend_item(a, item, kv_head, a->head_dim);
    }
}

/* Attend every (item, kv head) pair; items are int32 [num_items][ITEM_FIELDS]. Writes the
 * query heads' outputs to output[token][head][dim]. Returns CONVEYOR_OK or a negative error. */
int conveyor_paged_attention(
    const float *query, int64_t query_token_stride, int64_t query_head_stride,
    const float *kv_cache, int num_kv_heads, int64_t num_blocks, int block_size, int head_dim,
    int num_heads, const int32_t *block_table, int64_t block_table_stride,
    const int32_t *items, int num_items, float scale, int window, const float *sinks,
    float softcap, float *output,
    int64_t output_token_stride, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || head_dim % LANES
        || head_dim > MAX_HEAD_DIM || block_size <= 0 || window < 0 || softcap < 0.0f)
        return CONVEYOR_BAD_SHAPE;
    const int group = num_heads / num_kv_heads;
    for (int i = 0; i < num_items; i++)
        if (items[i * ITEM_FIELDS + ITEM_NUM_QUERIES] * group > MAX_ROWS) return CONVEYOR_BAD_SHAPE;
    attention_args a = {query, query_token_stride, query_head_stride, kv_cache, num_blocks,
                        num_kv_heads, block_size, head_dim, num_heads, block_table,
                        block_table_stride, scale, window, sinks, softcap, output,
                        output_token_stride};
    int status = CONVEYOR_OK;
    const int64_t num_pairs = (int64_t)num_items * num_kv_heads;
    /* Dynamic: pairs differ in context length; the planner puts the longest first. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t pair = 0; pair < num_pairs; pair++) {
        int item = (int)(pair / num_kv_heads), kv_head = (int)(pair % num_kv_heads);
        if (attend_item_any_dim(&a, items + (int64_t)item * ITEM_FIELDS, kv_head) != CONVEYOR_OK) {
#pragma omp atomic write
            status = CONVEYOR_BAD_BLOCK;
        }
    }
    return status;
}

/* Store each token's key and value rows (any token and head strides, dense rows) at its slot,
 * block_id * block_size + offset, for every kv head. A plain copy on the calling thread: a
 * step's few hundred rows are less work than waking the thread pool, and torch's index_copy_
 * costs several times more per call. Slots are checked before anything is written. */
int conveyor_write_kv(
    float *kv_cache, int num_kv_heads, int64_t num_slots, int head_dim, const float *key,
    int64_t key_token_stride, int64_t key_head_stride, const float *value,
    int64_t value_token_stride, int64_t value_head_stride, const int64_t *slot_mapping,
    int num_tokens) {
    for (int i = 0; i < num_tokens; i++)
        if (slot_mapping[i] < 0 || slot_mapping[i] >= num_slots) return CONVEYOR_BAD_SLOT;
    const size_t row_bytes = (size_t)head_dim * sizeof(float);
    for (int h = 0; h < num_kv_heads; h++) {
        float *keys = kv_cache + (int64_t)h * num_slots * head_dim;
        float *values = kv_cache + (int64_t)(num_kv_heads + h) * num_slots * head_dim;
        for (int i = 0; i < num_tokens; i++) {
            int64_t slot = slot_mapping[i];
            memcpy(keys + slot * head_dim, key + i * key_token_stride + h * key_head_stride,
                   row_bytes);
            memcpy(values + slot * head_dim,
                   value + i * value_token_stride + h * value_head_stride, row_bytes);
        }
    }
    return CONVEYOR_OK;
}
