"""The Triton paged-attention kernel itself (worker/attention/triton_backend.py says what it does).

A module of its own so that importing the backend never needs Triton: this one is imported on the
first forward. Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) patches ``tl`` in the
kernel's module globals, so the kernel must live at a module's top level.
"""

import triton
import triton.language as tl


@triton.jit
def _key_tile(
    q,
    m_i,
    l_i,
    acc,
    key_start,
    end,
    position,
    req,
    k_ptr,
    v_ptr,
    block_table_ptr,
    head_offset,
    stride_bt,
    stride_kb,
    stride_ks,
    scale,
    softcap,
    window,
    dims,
    dim_ok,
    KEYS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One tile of KEYS keys from ``key_start`` into the online softmax: the new running max,
    sum and output. Unmasked (MASKED False) only where every key is below ``end`` and visible
    to every row: the same numbers, without the compares."""
    keys = key_start + tl.arange(0, KEYS)
    key_ok = keys < end
    if MASKED:
        block = tl.load(
            block_table_ptr + req * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
    else:
        block = tl.load(block_table_ptr + req * stride_bt + keys // BLOCK_SIZE).to(tl.int64)
    offset = head_offset + block * stride_kb + (keys % BLOCK_SIZE) * stride_ks
    if MASKED:
        k_mask = key_ok[None, :] & dim_ok[:, None]
        v_mask = key_ok[:, None] & dim_ok[None, :]
    else:
        k_mask = (keys[None, :] >= 0) & dim_ok[:, None]
        v_mask = (keys[:, None] >= 0) & dim_ok[None, :]
    k = tl.load(k_ptr + offset[None, :] + dims[:, None], mask=k_mask, other=0.0)
    scores = tl.dot(q, k, input_precision=PRECISION) * scale
    if USE_SOFTCAP:
        # c * tanh(s / c), tanh through exp (portable across Triton versions).
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    if MASKED:
        visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
        if USE_WINDOW:
            visible = visible & (position[:, None] - keys[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no visible key yet keeps -inf: shift by 0 instead (no NaN).
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + offset[:, None] + dims[None, :], mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_req_ptr,
    tile_start_ptr,
    sinks_ptr,
    part_ptr,
    ml_ptr,
    scale,
    softcap,
    window,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_bt,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    KEYS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    SEGMENTS: tl.constexpr = 1,
):
    """One tile of a request's queries against its keys, for one KV head. With SEGMENTS > 1
    (decode steps of few requests: split-K), program (tile, kv_head, s) takes the s-th of
    SEGMENTS equal runs of the keys and leaves its unnormalised output, running max and sum in
    the float32 workspaces ``part_ptr`` [tokens, heads, SEGMENTS, HEAD_DIM] and ``ml_ptr``
    [tokens, heads, SEGMENTS, 2] for ``reduce_segments``; sinks are that kernel's."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    first = tl.load(tile_start_ptr + tile)  # the tile's first query, counted in its request
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    context = tl.load(seq_lens_ptr + req) - q_len  # keys cached before this step's queries

    # Row r: query token first + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, ROWS)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < (ROWS // GROUP) * GROUP) & (token < q_len)
    position = context + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    last_token = tl.minimum(first + ROWS // GROUP, q_len) - 1
    end = context + last_token + 1  # keys past the tile's last query are never visible
    start = 0
    if USE_WINDOW:
        start = tl.maximum(context + first - window + 1, 0)
        start = (start // KEYS) * KEYS
    head_offset = kv_head.to(tl.int64) * stride_kh  # a layer's cache can pass 2**31 elements
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    lo, hi = start, end
    if SEGMENTS > 1:
        # Equal runs of whole key tiles; a run past the keys is empty (max -inf, sum 0).
        per = tl.cdiv(tl.cdiv(end - start, SEGMENTS), KEYS) * KEYS
        lo = start + tl.program_id(2) * per
        hi = tl.minimum(lo + per, end)
    # Key tiles wholly before the tile's first query position are visible to every row: no
    # causal mask there (nor a bound check: they end before ``end``). The rest take the masks.
    # A window masks from the other side, so with one every tile takes them.
    mid = lo
    if not USE_WINDOW:
        mid = tl.minimum(tl.maximum((context + first + 1) // KEYS * KEYS, lo), hi)
    for masked in tl.static_range(2):  # the unmasked tiles, then the masked ones
        if masked == 0:
            first_key, last_key = lo, mid
        else:
            first_key, last_key = mid, hi
        for key_start in range(first_key, last_key, KEYS):
            m_i, l_i, acc = _key_tile(
                q, m_i, l_i, acc, key_start, end, position, req, k_ptr, v_ptr,
                block_table_ptr, head_offset, stride_bt, stride_kb, stride_ks, scale, softcap,
                window, dims, dim_ok, KEYS, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, PRECISION,
                masked == 1,
            )  # fmt: skip
    if SEGMENTS > 1:
        at = ((q_begin + token).to(tl.int64) * num_heads + head) * SEGMENTS + tl.program_id(2)
        tl.store(
            part_ptr + at[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(ml_ptr + 2 * at, m_i, mask=row_ok)
        tl.store(ml_ptr + 2 * at + 1, l_i, mask=row_ok)
    else:
        if USE_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
            m_end = tl.maximum(m_i, sink)
            shift = tl.where(m_end == float("-inf"), 0.0, m_end)
            alpha = tl.exp(m_i - shift)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - shift)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + (q_begin + token)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def reduce_segments(
    part_ptr,
    ml_ptr,
    out_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    SEGMENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """One query head of one decode token: its SEGMENTS partial outputs (paged_attention with
    SEGMENTS > 1) merged by their running maxima, the head's sink logit added to the sum, and
    divided once. A token with no keys at all (a graph's padding row) gets zeros."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    segs = tl.arange(0, SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    at = (token.to(tl.int64) * num_heads + head) * SEGMENTS + segs
    maxima = tl.load(ml_ptr + 2 * at)
    sums = tl.load(ml_ptr + 2 * at + 1)
    m_max = tl.max(maxima, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp(maxima - shift)
    acc = tl.load(
        part_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :], other=0.0
    )
    total = tl.sum(acc * weight[:, None], 0)
    denominator = tl.sum(sums * weight, 0)
    if USE_SINKS:
        denominator += tl.exp(sink - shift)
    out = total / tl.where(denominator == 0.0, 1.0, denominator)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@triton.jit
def store_kv(
    key_ptr,
    value_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One token's key and value for one KV head into the cache at its slot (block * size +
    offset): K and V in one launch, where two index copies took two. A negative slot writes
    nothing: the padding rows of a CUDA graph's decode step."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # No dims stored for a negative slot (a scalar-by-vector mask, as the interpreter takes it).
    dim_ok = dims < HEAD_DIM * (slot >= 0).to(tl.int32)
    key = tl.load(key_ptr + token * stride_kt + kv_head * stride_kh + dims, mask=dim_ok)
    value = tl.load(value_ptr + token * stride_vt + kv_head * stride_vh + dims, mask=dim_ok)
    where = (
        kv_head.to(tl.int64) * stride_ch
        + (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + dims
    )
    tl.store(k_ptr + where, key.to(k_ptr.dtype.element_ty), mask=dim_ok)
    tl.store(v_ptr + where, value.to(v_ptr.dtype.element_ty), mask=dim_ok)
