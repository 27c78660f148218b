/*
 * The paged-attention kernel's path for query tiles: up to TILE_MAX_ROWS query rows (a run of
 * consecutive tokens of one request, times the heads of one GQA group) against every key they
 * may see, read tile by tile straight from the paged cache. Included only by paged_attention.c,
 * once per row-vector width (8 floats, and 16 where AVX-512 has them): see the part below the
 * shared definitions.
 *
 * The rows are the vector lanes: queries are packed transposed once per item (qt[d] holds row
 * vectors), so a score tile is a small matrix product in which one key element, broadcast,
 * multiplies a vector of rows, with SCORE_KEYS x row-vector accumulators held in registers; the
 * weighted values likewise broadcast one value element against a vector of weights into a
 * transposed output (ot[d]). The online softmax then runs on row vectors too: a tile's max, the
 * rescale and the exp are vector operations per key, not per (row, key). Nothing larger than a
 * tile of scores (WIDE_TILE_KEYS x rows) is ever held, and K/V are never copied.
 *
 * Causal masking, sliding windows, sinks and the soft-cap follow the short path's rules
 * (short_queries.h); masking costs a compare per key only on the tiles a row's window edge or
 * the diagonal crosses.
 */
#ifndef CONVEYOR_QUERY_TILES_H
#define CONVEYOR_QUERY_TILES_H

#include "amx_tiles.h"
#include "paged_kv.h"
#include "vector_math.h"

#define QT_JOIN_(a, b) a##b
#define QT_JOIN(a, b) QT_JOIN_(a, b)

/* Rows of one query tile at most (conveyor_tile_max_rows, which the planner in
 * worker/attention/cpu_kernel.py reads; an item may hold two tiles, paged_attention.c). A query
 * tile streams every key its rows see from L2/L3 once, so more rows per tile mean fewer passes
 * over a long prefix: with AVX-512's 32 registers four 16-float row vectors (64 rows) keep the
 * products' operands in registers and long prompt chunks ran ~5-10 % faster than at 32 rows.
 * AVX2's 16 registers stay at 32 rows. */
#if defined(__AVX512F__)
#define TILE_MAX_ROWS 64
#else
#define TILE_MAX_ROWS 32
#endif
/* Keys per softmax update: its rescale of the output is amortised over this many keys, and the
 * tile's K/V rows (16 KiB at head_dim 64) stay in L1 between the two products. */
#define WIDE_TILE_KEYS 32
/* Register blocking of the two products: accumulators held in registers. On 8 floats, with 32
 * vector registers (AVX-512VL, NEON) 4 keys x up to 4 row vectors for the scores and 24 for the
 * values fit, leaving room for the operands, with 16 (AVX2) fewer (below); on 16 floats (AVX-512,
 * 32 registers) 16 keys x 1, 8 x 2 or 4 x 3-4 row vectors, and 24. SCORE_KEYS_<lanes>(row
 * vectors): keys scored per step; VALUE_DIMS_<lanes>(row vectors): output dims held per pass. */
#if defined(__AVX512VL__) || defined(__aarch64__)
#define SCORE_KEYS_8(NRV) 4
#define VALUE_DIMS_8(NRV) VALUE_DIMS_OF_24(NRV)
#else
/* AVX2's 16 registers hold the accumulators, the NRV operand row vectors (query or weight rows,
 * loaded once and reused by every key or dim) and a broadcast: keys x NRV + NRV + 1 <= 16. Left
 * to itself the compiler folds the row vectors into the multiply-adds as memory operands, 5 loads
 * per 4 multiply-adds, more than the 2 loads per cycle beside 2 multiply-adds; in registers it is
 * 3 loads per 4. Powers of two so that a 32-key tile leaves no remainder keys. */
#define SCORE_KEYS_8(NRV) ((NRV) >= 3 ? 2 : (NRV) == 2 ? 4 : 8)
#define VALUE_DIMS_8(NRV) ((NRV) >= 4 ? 2 : (NRV) == 3 ? 3 : (NRV) == 2 ? 6 : 8)
#endif
/* 16 keys x 1, 8 x 2, and 4 keys x 3 or 4 row vectors: at most 16 accumulators, and a whole
 * number of steps in a 32-key tile. */
#define SCORE_KEYS_16(NRV) ((NRV) >= 3 ? 4 : 16 / (NRV))
#define VALUE_DIMS_16(NRV) VALUE_DIMS_OF_24(NRV)
#define SCORE_MAX_KEYS 16
/* Value dims per pass over a tile's keys: more gained nothing on AVX-512. */
#define VALUE_MAX_DIMS 8
/* With 32 registers: 24 output vectors per pass, at most VALUE_MAX_DIMS dims. */
#define VALUE_DIMS_OF_24(NRV) (24 / (NRV) > VALUE_MAX_DIMS ? VALUE_MAX_DIMS : 24 / (NRV))

/* Keep a row vector in a register for every use that follows, rather than let the compiler fold
 * it into each multiply-add as a memory operand (on x86: an empty asm that needs it in one; a
 * build without AVX has no register an 8-float vector fits in). GCC's folding is what was
 * measured; other compilers get the plain loads. */
#if defined(__x86_64__) && defined(__AVX__) && defined(__GNUC__) && !defined(__clang__)
#define HOLD_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define HOLD_IN_REGISTER(x) ((void)0)
#endif

#endif /* the part shared by every width */

/* Everything below is instantiated once per row-vector width: the includer defines QT_LANES (8
 * or 16) and QT_OPS_SUFFIX (the suffix of that width's vector_math.h operations: empty for 8),
 * and every name gets the suffix _QT_LANES. */
#define QT_VF QT_JOIN(vf, QT_LANES)
#define QT_VI QT_JOIN(vi, QT_LANES)
#define QT_OP(name) QT_JOIN(name, QT_OPS_SUFFIX)
#define QT_FN(name) QT_JOIN(name##_, QT_LANES)
#define QT_MAX_NRV (TILE_MAX_ROWS / QT_LANES)

typedef struct {
    QT_VF qt[MAX_HEAD_DIM][QT_MAX_NRV]; /* queries transposed, in log2 units; pad rows 0 */
    QT_VF ot[MAX_HEAD_DIM][QT_MAX_NRV]; /* unnormalised outputs, transposed */
    QT_VF s[WIDE_TILE_KEYS][QT_MAX_NRV]; /* this tile's scores, then its weights */
    QT_VF max[QT_MAX_NRV], sum[QT_MAX_NRV];
    QT_VI first_visible[QT_MAX_NRV], num_visible[QT_MAX_NRV]; /* per row, as in paged_kv.h */
    const kv_t *keys[WIDE_TILE_KEYS], *values[WIDE_TILE_KEYS];
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
    int amx;       /* this tile's products run on AMX tiles (amx_tiles.h) */
    float q_scale; /* the scores' scale, applied after the tile product of unscaled queries */
    /* Q^T as B operands: [32-dim chunk][row vector][dim pair][row, pair element] */
    uint16_t qb[MAX_HEAD_DIM / 32][QT_MAX_NRV][16][32] __attribute__((aligned(64)));
    /* P^T as B operands: [row vector][key pair][row, pair element] */
    uint16_t pb[QT_MAX_NRV][16][32] __attribute__((aligned(64)));
    /* V^T as A operands: [16-dim chunk][dim][key] */
    uint16_t vt[MAX_HEAD_DIM / 16][16][WIDE_TILE_KEYS] __attribute__((aligned(64)));
    /* 16 keys copied where they are not 16 consecutive rows of the cache */
    uint16_t ks[16][MAX_HEAD_DIM] __attribute__((aligned(64)));
#endif
} QT_FN(query_tile);

/* Pack the item's rows: transposed, scaled queries; running max and sum; visible key ranges.
 * Pad rows (up to whole vectors) see every key with zero queries, and are never written out. */
static inline __attribute__((always_inline)) void QT_FN(start_tile)(
    QT_FN(query_tile) *st, const attention_args *a, const int32_t *item, int kv_head, const int NRV,
    const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    const int num_rows = item[ITEM_NUM_QUERIES] * group;
    const float q_scale = a->scale * LOG2E; /* scores come out in log2 units: exp2 only */
    for (int d = 0; d < D; d++)
        for (int v = 0; v < NRV; v++) st->qt[d][v] = st->ot[d][v] = QT_OP(splat)(0.0f);
    for (int v = 0; v < NRV; v++) {
        st->max[v] = QT_OP(splat)(-INFINITY);
        st->sum[v] = QT_OP(splat)(0.0f);
        st->first_visible[v] = QT_OP(splat_int)(0);
        st->num_visible[v] = QT_OP(splat_int)(INT32_MAX);
    }
    for (int r = 0; r < num_rows; r++) {
        const int qi = r / group, head = kv_head * group + r % group;
        const int v = r / QT_LANES, l = r % QT_LANES;
        const io_t *src = a->query + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->query_token_stride
                            + (int64_t)head * a->query_head_stride;
        for (int d = 0; d < D; d++) st->qt[d][v][l] = io_to_float(src[d]) * q_scale;
        if (a->sinks != NULL) { /* the sink as a key seen first: weight exp(0) = 1, value 0 */
            st->max[v][l] = a->sinks[head] * LOG2E;
            st->sum[v][l] = 1.0f;
        }
        st->num_visible[v][l] = row_num_visible(item, qi);
        st->first_visible[v][l] = row_first_visible(a, st->num_visible[v][l]);
    }
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
    st->amx = amx_ready && D % 32 == 0;
    if (st->amx) {
        st->q_scale = q_scale;
        memset(st->qb, 0, sizeof st->qb[0] * (size_t)(D / 32));
        for (int r = 0; r < num_rows; r++) {
            const int qi = r / group, head = kv_head * group + r % group;
            const int v = r / QT_LANES, l = r % QT_LANES;
            const io_t *src = a->query
                              + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->query_token_stride
                              + (int64_t)head * a->query_head_stride;
            for (int d = 0; d < D; d++) st->qb[d / 32][v][d % 32 / 2][2 * l + d % 2] = src[d];
        }
        amx_configure();
    }
#endif
}

/* Pointers to the K/V rows of keys pos .. pos + n - 1; false if a block id is out of range. */
static inline __attribute__((always_inline)) int QT_FN(locate_tile)(
    QT_FN(query_tile) *st, const attention_args *a, const int32_t *blocks, int kv_head, int pos,
    int n, const int D) {
    for (int t = 0; t < n;) {
        const kv_t *keys, *values;
        if (!locate_keys(a, blocks, kv_head, pos + t, D, &keys, &values)) return 0;
        int run = a->block_size - (pos + t) % a->block_size; /* rows left in this block */
        for (int i = 0; i < run && t < n; i++, t++) {
            st->keys[t] = keys + (int64_t)i * D;
            st->values[t] = values + (int64_t)i * D;
        }
    }
    return 1;
}

/* s[t] = qt^T . key t for the tile's n keys: SCORE_KEYS_<lanes>(NRV) keys x NRV row vectors per
 * step. */
static inline __attribute__((always_inline)) void QT_FN(score_tile)(
    QT_FN(query_tile) *st, int n, const int NRV, const int D) {
    const int KEYS = QT_JOIN(SCORE_KEYS_, QT_LANES)(NRV);
    int t = 0;
    for (; t + KEYS <= n; t += KEYS) {
        QT_VF acc[SCORE_MAX_KEYS][QT_MAX_NRV];
        const kv_t *k[SCORE_MAX_KEYS];
        for (int i = 0; i < KEYS; i++) {
            k[i] = st->keys[t + i];
            for (int v = 0; v < NRV; v++) acc[i][v] = QT_OP(splat)(0.0f);
        }
        for (int d = 0; d < D; d++) {
            QT_VF q[QT_MAX_NRV];
            for (int v = 0; v < NRV; v++) {
                q[v] = st->qt[d][v];
                HOLD_IN_REGISTER(q[v]);
            }
            for (int i = 0; i < KEYS; i++) {
                const QT_VF key = QT_OP(splat)(kv_to_float(k[i][d]));
                for (int v = 0; v < NRV; v++) acc[i][v] += key * q[v];
            }
        }
        for (int i = 0; i < KEYS; i++)
            for (int v = 0; v < NRV; v++) st->s[t + i][v] = acc[i][v];
    }
    for (; t < n; t++) {
        QT_VF acc[QT_MAX_NRV];
        for (int v = 0; v < NRV; v++) acc[v] = QT_OP(splat)(0.0f);
        for (int d = 0; d < D; d++)
            for (int v = 0; v < NRV; v++)
                acc[v] += QT_OP(splat)(kv_to_float(st->keys[t][d])) * st->qt[d][v];
        for (int v = 0; v < NRV; v++) st->s[t][v] = acc[v];
    }
}

#if QT_LANES == 16 && defined(CONVEYOR_AMX)
/* s[t][v] = the tile's scores (amx_tiles.h): per half of 16 keys, C tile v = K . Q^T over the
 * head dim's 32-dim chunks, then scaled as the FMA path's prescaled queries scale them. */
static inline __attribute__((always_inline)) void QT_FN(amx_score_tile)(
    QT_FN(query_tile) *st, int n, const int NRV, const int D) {
    const int64_t s_stride = sizeof st->s[0];
    for (int t0 = 0; t0 < n; t0 += 16) {
        const uint16_t *rows = st->keys[t0];
        int64_t stride = (int64_t)D * sizeof(kv_t);
        int direct = n - t0 >= 16;
        for (int i = 1; i < 16 && direct; i++) direct = st->keys[t0 + i] == st->keys[t0] + i * D;
        if (!direct) { /* across blocks, or the tile's last keys: copied, the rest zero */
            for (int i = 0; i < 16; i++) {
                if (t0 + i < n) memcpy(st->ks[i], st->keys[t0 + i], (size_t)D * sizeof(kv_t));
                else memset(st->ks[i], 0, (size_t)D * sizeof(kv_t));
            }
            rows = st->ks[0];
            stride = sizeof st->ks[0];
        }
        _tile_zero(0);
        if (NRV > 1) _tile_zero(1);
        if (NRV > 2) _tile_zero(2);
        if (NRV > 3) _tile_zero(3);
        for (int c = 0; c < D / 32; c++) {
            _tile_loadd(4, rows + c * 32, stride);
            _tile_loadd(5, st->qb[c][0], 64);
            _tile_dpbf16ps(0, 4, 5);
            if (NRV > 1) {
                _tile_loadd(5, st->qb[c][1], 64);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (NRV > 2) {
                _tile_loadd(5, st->qb[c][2], 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (NRV > 3) {
                _tile_loadd(5, st->qb[c][3], 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, &st->s[t0][0], s_stride);
        if (NRV > 1) _tile_stored(1, &st->s[t0][1], s_stride);
        if (NRV > 2) _tile_stored(2, &st->s[t0][2], s_stride);
        if (NRV > 3) _tile_stored(3, &st->s[t0][3], s_stride);
    }
    const QT_VF scale = QT_OP(splat)(st->q_scale);
    for (int t = 0; t < n; t++)
        for (int v = 0; v < NRV; v++) st->s[t][v] *= scale;
}

/* V^T of the tile's first n keys into st->vt (amx_tiles.h); the keys past n are zero, never
 * whatever lies beyond the cache's rows (which could be NaN, and 0 * NaN is NaN). */
static inline __attribute__((always_inline)) void QT_FN(amx_transpose_values)(
    QT_FN(query_tile) *st, int n, const int D) {
    const __m256i none = _mm256_setzero_si256();
    for (int e = 0; e < D / 16; e++) {
        __m512i r[16]; /* r[p]: dims 16e.. of keys 2p (low halves) and 2p + 1 (high halves) */
        for (int p = 0; p < 16; p++) {
            const kv_t *lo = st->values[2 * p] + 16 * e, *hi = st->values[2 * p + 1] + 16 * e;
            const __m256i a = 2 * p < n ? _mm256_loadu_si256((const __m256i *)lo) : none;
            const __m256i b = 2 * p + 1 < n ? _mm256_loadu_si256((const __m256i *)hi) : none;
            r[p] = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                   _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        }
        amx_transpose16(r); /* r[i]: dim 16e + i of keys 0..31 */
        for (int i = 0; i < 16; i++) _mm512_store_si512(st->vt[e][i], r[i]);
    }
}

/* ot += V^T . P^T over the tile's n keys, V^T from vt (this tile's, or the other tile's of a
 * pair over the same keys: a key past n weighs 0 here whatever its value). */
static inline __attribute__((always_inline)) void QT_FN(amx_accumulate_tile)(
    QT_FN(query_tile) *st, const uint16_t (*vt)[16][WIDE_TILE_KEYS], int n, const int NRV,
    const int D) {
    const __m512 zero = _mm512_setzero_ps();
    for (int v = 0; v < NRV; v++)
        for (int p = 0; p < 16; p++) {
            const __m512 lo = 2 * p < n ? (__m512)st->s[2 * p][v] : zero;
            const __m512 hi = 2 * p + 1 < n ? (__m512)st->s[2 * p + 1][v] : zero;
            _mm512_store_si512(st->pb[v][p], amx_interleave_bf16(lo, hi));
        }
    const int64_t o_stride = sizeof st->ot[0];
    for (int e = 0; e < D / 16; e++) {
        _tile_loadd(4, vt[e][0], 64);
        _tile_loadd(0, &st->ot[16 * e][0], o_stride);
        _tile_loadd(5, st->pb[0][0], 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_stored(0, &st->ot[16 * e][0], o_stride);
        if (NRV > 1) {
            _tile_loadd(1, &st->ot[16 * e][1], o_stride);
            _tile_loadd(5, st->pb[1][0], 64);
            _tile_dpbf16ps(1, 4, 5);
            _tile_stored(1, &st->ot[16 * e][1], o_stride);
        }
        if (NRV > 2) {
            _tile_loadd(2, &st->ot[16 * e][2], o_stride);
            _tile_loadd(5, st->pb[2][0], 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_stored(2, &st->ot[16 * e][2], o_stride);
        }
        if (NRV > 3) {
            _tile_loadd(3, &st->ot[16 * e][3], o_stride);
            _tile_loadd(5, st->pb[3][0], 64);
            _tile_dpbf16ps(3, 4, 5);
            _tile_stored(3, &st->ot[16 * e][3], o_stride);
        }
    }
}
#endif

/* Fold the tile's scores into each row's running max and sum and leave its weights in s.
 * masked: some row cannot see some key of the tile (diagonal or window edge). */
static inline __attribute__((always_inline)) void QT_FN(softmax_tile)(
    QT_FN(query_tile) *st, int n, int pos, int masked, float cap, const int NRV, const int D) {
    for (int v = 0; v < NRV; v++) {
        QT_VF tile_max = st->max[v];
        for (int t = 0; t < n; t++) {
            QT_VF s = st->s[t][v];
            if (cap > 0.0f) s = QT_OP(soft_cap)(s, cap);
            if (masked) {
                QT_VI key = QT_OP(splat_int)(pos + t);
                s = QT_OP(select)((key >= st->first_visible[v]) & (key < st->num_visible[v]), s,
                           QT_OP(splat)(-INFINITY));
            }
            st->s[t][v] = s;
            tile_max = QT_OP(vmax)(tile_max, s);
        }
        /* A row that has seen no key yet keeps max -inf; subtracting 0 keeps its weights 0. */
        const QT_VF shift = QT_OP(select)(tile_max == -INFINITY, QT_OP(splat)(0.0f), tile_max);
        const QT_VF alpha = QT_OP(exp2_nonpositive)(st->max[v] - shift);
        QT_VF sum = QT_OP(splat)(0.0f);
        for (int t = 0; t < n; t++) {
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
            /* Weights that AMX rounds to bfloat16 need less of exp's precision: a shorter one. */
            QT_VF weight = st->amx ? exp2_bf16_weights16(st->s[t][v] - shift)
                                   : QT_OP(exp2_nonpositive)(st->s[t][v] - shift);
#else
            QT_VF weight = QT_OP(exp2_nonpositive)(st->s[t][v] - shift);
#endif
            if (masked)
                weight = QT_OP(select)(st->s[t][v] == -INFINITY, QT_OP(splat)(0.0f), weight);
            st->s[t][v] = weight;
            sum += weight;
        }
        st->sum[v] = st->sum[v] * alpha + sum;
        st->max[v] = tile_max;
        if (QT_OP(any_lane)(alpha != 1.0f))
            for (int d = 0; d < D; d++) st->ot[d][v] *= alpha;
    }
}

/* ot[d0 .. d0 + DIMS - 1] += sum over the tile's keys t of value t [d] * s[t], with those dims x
 * NRV row vectors of ot in registers for one pass over the keys. DIMS <= VALUE_MAX_DIMS. */
static inline __attribute__((always_inline)) void QT_FN(accumulate_dims)(
    QT_FN(query_tile) *st, int n, int d0, const int DIMS, const int NRV) {
    QT_VF acc[VALUE_MAX_DIMS][QT_MAX_NRV];
    for (int i = 0; i < DIMS; i++)
        for (int v = 0; v < NRV; v++) acc[i][v] = st->ot[d0 + i][v];
    for (int t = 0; t < n; t++) {
        const kv_t *value = st->values[t] + d0;
        QT_VF w[QT_MAX_NRV];
        for (int v = 0; v < NRV; v++) {
            w[v] = st->s[t][v];
            HOLD_IN_REGISTER(w[v]);
        }
        for (int i = 0; i < DIMS; i++) {
            const QT_VF element = QT_OP(splat)(kv_to_float(value[i]));
            for (int v = 0; v < NRV; v++) acc[i][v] += element * w[v];
        }
    }
    for (int i = 0; i < DIMS; i++)
        for (int v = 0; v < NRV; v++) st->ot[d0 + i][v] = acc[i][v];
}

/* ot += values^T . s. VALUE_DIMS_<lanes>(NRV) dims x NRV row vectors of ot in registers per
 * pass: each key's weights (NRV loads) and value elements (one broadcast per dim) then feed
 * dims x NRV multiply-adds. */
static inline __attribute__((always_inline)) void QT_FN(accumulate_tile)(
    QT_FN(query_tile) *st, int n, const int NRV, const int D) {
    const int dims = QT_JOIN(VALUE_DIMS_, QT_LANES)(NRV);
    int d = 0;
    for (; d + dims <= D; d += dims) QT_FN(accumulate_dims)(st, n, d, dims, NRV);
    if (d < D) QT_FN(accumulate_dims)(st, n, d, D - d, NRV);
}

static inline __attribute__((always_inline)) void QT_FN(finish_tile)(
    const QT_FN(query_tile) *st, const attention_args *a, const int32_t *item, int kv_head,
    const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    for (int r = 0; r < item[ITEM_NUM_QUERIES] * group; r++) {
        const int qi = r / group, head = kv_head * group + r % group;
        const int v = r / QT_LANES, l = r % QT_LANES;
        io_t *dst = a->output + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->output_token_stride
                      + (int64_t)head * D;
        const float inv = 1.0f / st->sum[v][l];
        for (int d = 0; d < D; d++) dst[d] = float_to_io(st->ot[d][v][l] * inv);
    }
}

/* The scores of a key tile: on AMX tiles where this tile may, else with FMAs on row vectors. */
static inline __attribute__((always_inline)) void QT_FN(score_keys)(
    QT_FN(query_tile) *st, int n, const int NRV, const int D) {
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
    if (st->amx) {
        QT_FN(amx_score_tile)(st, n, NRV, D);
        return;
    }
#endif
    QT_FN(score_tile)(st, n, NRV, D);
}

/* The weighted values of a key tile. On AMX tiles, ``shared`` (or NULL) is the other tile of a
 * pair whose V^T of these keys is already built. */
static inline __attribute__((always_inline)) void QT_FN(accumulate_keys)(
    QT_FN(query_tile) *st, const QT_FN(query_tile) *shared, int n, const int NRV, const int D) {
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
    if (st->amx) {
        if (shared == NULL) QT_FN(amx_transpose_values)(st, n, D);
        QT_FN(amx_accumulate_tile)(st, shared ? shared->vt : st->vt, n, NRV, D);
        return;
    }
#endif
    (void)shared;
    QT_FN(accumulate_tile)(st, n, NRV, D);
}

/* A query tile of NRV row vectors: every key its rows may see, WIDE_TILE_KEYS at a time. */
static inline __attribute__((always_inline)) int QT_FN(attend_query_tile)(
    const attention_args *a, const int32_t *item, int kv_head, const int NRV, const int D) {
    QT_FN(query_tile) st;
    const int group = a->num_heads / a->num_kv_heads;
    const int last_row = item[ITEM_NUM_QUERIES] * group - 1;
    const int32_t *blocks = a->block_table + (int64_t)item[ITEM_TABLE_ROW] * a->block_table_stride;
    QT_FN(start_tile)(&st, a, item, kv_head, NRV, D);
    /* The first row sees furthest back and least far forward, the last row the opposite: keys
     * in [last row's start, first row's end) are visible to every row, the rest need a mask. */
    const int first_key = st.first_visible[0][0];
    const int end_key = st.num_visible[last_row / QT_LANES][last_row % QT_LANES];
    const int unmasked_from = st.first_visible[last_row / QT_LANES][last_row % QT_LANES];
    const int unmasked_to = st.num_visible[0][0];
    const float cap = a->softcap * LOG2E; /* c * tanh(s / c) scales with the scores' units */
    for (int pos = first_key; pos < end_key; pos += WIDE_TILE_KEYS) {
        const int n = end_key - pos < WIDE_TILE_KEYS ? end_key - pos : WIDE_TILE_KEYS;
        if (!QT_FN(locate_tile)(&st, a, blocks, kv_head, pos, n, D)) return CONVEYOR_BAD_BLOCK;
        /* One row vector (a decode of a GQA group of 8 or 16) does too little work per key to
         * hide the memory; fuller items do enough, and gained nothing from prefetching. */
        const int ahead = pos + LOOKAHEAD_TILES * WIDE_TILE_KEYS;
        if (NRV == 1 && ahead < end_key)
            prefetch_keys(a, blocks, kv_head, ahead,
                          end_key - ahead < WIDE_TILE_KEYS ? end_key - ahead : WIDE_TILE_KEYS, D);
        QT_FN(score_keys)(&st, n, NRV, D);
        const int masked = pos < unmasked_from || pos + n > unmasked_to;
        QT_FN(softmax_tile)(&st, n, pos, masked, cap, NRV, D);
        QT_FN(accumulate_keys)(&st, NULL, n, NRV, D);
    }
    QT_FN(finish_tile)(&st, a, item, kv_head, D);
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
    if (st.amx) _tile_release();
#endif
    return CONVEYOR_OK;
}

/* Two query tiles of one item, its first TILE_MAX_ROWS / group tokens (NRV_A row vectors) and
 * the rest (NRV_B), that share each key tile while it is in L1: a long cached prefix comes from L3
 * or memory once for both where two items would each read it. Each half runs the tiles it would
 * alone (the item has no window, so both start at key 0 on the same grid) and skips those past
 * its last row's keys, which alone it would never see: its outputs are bit for bit its own. */
static inline __attribute__((always_inline)) int QT_FN(attend_query_tile_pair)(
    const attention_args *a, const int32_t *item, int kv_head, const int NRV_A, const int NRV_B,
    const int D) {
    QT_FN(query_tile) st[2];
    const int group = a->num_heads / a->num_kv_heads;
    int32_t halves[2][ITEM_FIELDS];
    split_item(item, TILE_MAX_ROWS / group, halves); /* the first tile: whole groups */
    const int nrv[2] = {NRV_A, NRV_B};
    const int32_t *blocks = a->block_table + (int64_t)item[ITEM_TABLE_ROW] * a->block_table_stride;
    int end_key[2], unmasked_from[2], unmasked_to[2];
    for (int h = 0; h < 2; h++) {
        QT_FN(start_tile)(&st[h], a, halves[h], kv_head, nrv[h], D);
        const int last_row = halves[h][ITEM_NUM_QUERIES] * group - 1;
        end_key[h] = st[h].num_visible[last_row / QT_LANES][last_row % QT_LANES];
        unmasked_from[h] = st[h].first_visible[last_row / QT_LANES][last_row % QT_LANES];
        unmasked_to[h] = st[h].num_visible[0][0];
    }
    const float cap = a->softcap * LOG2E;
    for (int pos = 0; pos < end_key[1]; pos += WIDE_TILE_KEYS) {
        const int n = end_key[1] - pos < WIDE_TILE_KEYS ? end_key[1] - pos : WIDE_TILE_KEYS;
        if (!QT_FN(locate_tile)(&st[1], a, blocks, kv_head, pos, n, D)) return CONVEYOR_BAD_BLOCK;
        /* On AMX tiles both halves take the tile's V^T, built once. */
        int values_ready = 0;
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
        if (st[1].amx && pos < end_key[0]) {
            QT_FN(amx_transpose_values)(&st[1], n, D);
            values_ready = 1;
        }
#endif
        if (pos < end_key[0]) {
            const int na = end_key[0] - pos < n ? end_key[0] - pos : n;
            for (int t = 0; t < na; t++) {
                st[0].keys[t] = st[1].keys[t];
                st[0].values[t] = st[1].values[t];
            }
            QT_FN(score_keys)(&st[0], na, NRV_A, D);
            const int masked = pos < unmasked_from[0] || pos + na > unmasked_to[0];
            QT_FN(softmax_tile)(&st[0], na, pos, masked, cap, NRV_A, D);
            QT_FN(accumulate_keys)(&st[0], values_ready ? &st[1] : NULL, na, NRV_A, D);
        }
        QT_FN(score_keys)(&st[1], n, NRV_B, D);
        const int masked = pos < unmasked_from[1] || pos + n > unmasked_to[1];
        QT_FN(softmax_tile)(&st[1], n, pos, masked, cap, NRV_B, D);
        QT_FN(accumulate_keys)(&st[1], values_ready ? &st[1] : NULL, n, NRV_B, D);
    }
    for (int h = 0; h < 2; h++) QT_FN(finish_tile)(&st[h], a, halves[h], kv_head, D);
#if QT_LANES == 16 && defined(CONVEYOR_AMX)
    if (st[0].amx) _tile_release();
#endif
    return CONVEYOR_OK;
}

#undef QT_VF
#undef QT_VI
#undef QT_OP
#undef QT_FN
#undef QT_MAX_NRV
#undef QT_LANES
#undef QT_OPS_SUFFIX
