"""The building blocks: RoPE variants against transformers, tensor-parallel slicing, and the CPU
fast paths (packed small-batch weights, in-place rotation, per-head norms) against plain torch."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conveyor.worker.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    rms_normalize,
    rotate_,
)
from conveyor.worker.layers.gemm import PACKED_MAX_ROWS, pack_weight, packed_row_limit

HEAD_DIM = 32
MAX_POSITIONS = 2048
ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
}


def llama_config(rope_scaling) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
    )


def hf_cos_sin(config: LlamaConfig, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # A fresh module per call: HF's dynamic RoPE keeps state from the longest sequence seen.
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions]))
    return cos[0], sin[0]


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_rotary_tables_and_rotation_match_hf(name: str):
    config = llama_config(ROPE_SCALINGS[name])
    ours = RotaryEmbedding.from_config(config, HEAD_DIM)
    positions = [0, 1, 2, 17, 511, 512, 1000, 2047]
    cos, sin = hf_cos_sin(config, positions)
    assert torch.equal(cos[:, : HEAD_DIM // 2], cos[:, HEAD_DIM // 2 :])
    our_cos, our_sin = ours.cos_sin(torch.tensor(positions))
    torch.testing.assert_close(our_cos, cos[:, : HEAD_DIM // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(our_sin, sin[:, : HEAD_DIM // 2], atol=1e-6, rtol=0)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=gen)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=gen)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    # Ours takes the flat [T, heads * head_dim] layout the projections produce.
    our_q, our_k = ours(torch.tensor(positions), q.flatten(1), k.flatten(1))
    torch.testing.assert_close(our_q.view_as(q), expected_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_k.view_as(k), expected_k, atol=1e-5, rtol=0)


def test_dynamic_ntk_past_the_original_context_matches_hf_token_by_token_decoding():
    config = llama_config(ROPE_SCALINGS["dynamic"])
    ours = RotaryEmbedding.from_config(config, HEAD_DIM)
    assert ours.num_positions == 2 * MAX_POSITIONS
    for position in (MAX_POSITIONS, MAX_POSITIONS + 1, 3000, 2 * MAX_POSITIONS - 1):
        # HF decoding one token at `position` scales the base for a context of position + 1.
        cos, sin = hf_cos_sin(config, [position])
        our_cos, our_sin = ours.cos_sin(torch.tensor([position]))
        # Per-position bases vs HF's scalar one: float32 rounding, amplified by angles of
        # thousands of radians (measured 4e-6 at position 4095).
        torch.testing.assert_close(our_cos, cos[:, : HEAD_DIM // 2], atol=2e-5, rtol=0)
        torch.testing.assert_close(our_sin, sin[:, : HEAD_DIM // 2], atol=2e-5, rtol=0)
    # Below the original context, dynamic is the default RoPE exactly.
    default = RotaryEmbedding.from_config(llama_config(None), HEAD_DIM)
    low = torch.arange(MAX_POSITIONS)
    torch.testing.assert_close(ours.cos_sin_cache[low], default.cos_sin_cache[low])


def test_yarn_table_covers_the_stretched_context():
    config = llama_config({"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024})
    assert RotaryEmbedding.from_config(config, HEAD_DIM).num_positions == 8 * 1024


def test_unsupported_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: default, linear, dynamic, llama3, yarn"):
        RotaryEmbedding(HEAD_DIM, 128, {"rope_type": "proportional", "rope_theta": 1e4})


def test_rms_norm_with_residual_adds_then_normalizes():
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = torch.linspace(0.5, 2.0, 8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    s = x + residual
    torch.testing.assert_close(
        out, norm.weight * s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    )


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_in_place_rotation_of_a_strided_view_matches_the_out_of_place_one():
    """The model rotates q and k where the qkv projection left them: a view with a wide stride."""
    config = llama_config(None)
    rope = RotaryEmbedding.from_config(config, HEAD_DIM)
    positions = torch.tensor([3, 0, 700, 2047, 5])
    qkv = torch.randn(len(positions), 7 * HEAD_DIM)  # 4 query heads, 1 key head, 2 value heads
    q, k = qkv[:, : 4 * HEAD_DIM].clone(), qkv[:, 4 * HEAD_DIM : 5 * HEAD_DIM].clone()
    expected_q, expected_k = rope(positions, q, k)
    assert torch.equal(q, qkv[:, : 4 * HEAD_DIM]), "forward must not modify its inputs"
    untouched = qkv[:, 5 * HEAD_DIM :].clone()
    qk = qkv[:, : 5 * HEAD_DIM].view(len(positions), 5, HEAD_DIM)
    rotate_(qk, rope.angles(positions, torch.float32))
    torch.testing.assert_close(qkv[:, : 4 * HEAD_DIM], expected_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(qkv[:, 4 * HEAD_DIM : 5 * HEAD_DIM], expected_k, atol=1e-6, rtol=0)
    assert torch.equal(qkv[:, 5 * HEAD_DIM :], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_weights_match_one_rms_norm_per_part(dtype):
    """q and k heads normalised in one call with a [heads, head_dim] weight, HF's rounding."""
    generator = torch.Generator().manual_seed(8)
    q_norm, k_norm = RMSNorm(8), RMSNorm(8)
    q_norm.weight.data = torch.rand(8, generator=generator) + 0.5
    k_norm.weight.data = torch.rand(8, generator=generator) + 0.5
    qk = torch.randn(5, 3 + 2, 8, generator=generator).to(dtype)  # 3 query heads, 2 key heads
    weight = torch.cat([q_norm.weight.expand(3, 8), k_norm.weight.expand(2, 8)]).to(dtype)
    ours = rms_normalize(qk, weight, 1e-6)

    def hf(x, w):  # transformers' Qwen3RMSNorm, op by op
        x32 = x.float()
        return w.to(dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    assert ours.dtype == dtype
    torch.testing.assert_close(ours[:, :3], hf(qk[:, :3], q_norm.weight), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, 3:], hf(qk[:, 3:], k_norm.weight), atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_rows", [1, 7, 64, PACKED_MAX_ROWS + 1, 2048])
def test_packed_bfloat16_weights_give_the_plain_result_at_every_size(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    layer = RowParallelLinear(40, 48, bias=True).bfloat16()
    _load(layer, layer.weight, weight.bfloat16()), _load(layer, layer.bias, bias.bfloat16())
    x = torch.randn(2 * num_rows, 40, generator=gen)[::2].bfloat16()  # strided rows
    plain = layer(x)
    layer.process_weights_after_loading()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    assert layer.packed_weight is not None
    packed = layer(x)
    assert packed.dtype == torch.bfloat16
    # Both sum in float32 and round once; their summation orders may differ by a rounding step.
    torch.testing.assert_close(packed, plain, atol=0.0625, rtol=2**-7)


@pytest.mark.parametrize("num_rows", [1, 7, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 600])
def test_packed_small_batch_weights_give_the_plain_result(num_rows):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    layer = RowParallelLinear(40, 48, bias=True)
    _load(layer, layer.weight, weight), _load(layer, layer.bias, bias)
    x = torch.randn(2 * num_rows, 40, generator=gen)[::2]  # strided rows, like a sliced input
    plain = layer(x)
    layer.process_weights_after_loading()
    if torch.backends.mkldnn.is_available():
        assert layer.packed_weight is not None
    torch.testing.assert_close(layer(x), plain, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(plain, x @ weight.T + bias, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "capability,limit", [("AVX512", None), ("AVX2", PACKED_MAX_ROWS), ("DEFAULT", PACKED_MAX_ROWS)]
)
def test_every_batch_takes_the_packed_weight_only_where_torch_runs_avx512(
    monkeypatch, capability, limit
):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert packed_row_limit() == limit


def test_packed_weights_only_for_float32_and_bfloat16_and_dropped_when_the_weight_reloads():
    assert pack_weight(torch.randn(8, 4).half()) is None
    assert pack_weight(torch.randn(8, 4).double()) is None
    layer = ColumnParallelLinear(4, 8)
    _load(layer, layer.weight, torch.randn(8, 4))
    layer.process_weights_after_loading()
    new_weight = torch.randn(8, 4)
    _load(layer, layer.weight, new_weight)
    assert layer.packed_weight is None  # a stale copy would silently use the old weight
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), x @ new_weight.T)


def test_lm_head_packs_a_tied_weight_without_replacing_it():
    table = torch.randn(10, 4)
    embedding, head = VocabParallelEmbedding(10, 4), ParallelLMHead(10, 4)
    _load(embedding, embedding.weight, table)
    head.weight = embedding.weight
    head.process_weights_after_loading()
    assert head.weight is embedding.weight
    hidden = torch.randn(3, 4)
    torch.testing.assert_close(head(hidden), hidden @ table.T, atol=1e-5, rtol=0)


def _load(layer, param, full, shard_id=None):
    param.weight_loader(param, full, shard_id) if shard_id is not None else param.weight_loader(
        param, full
    )
    return layer


def test_column_and_row_parallel_shards_recombine_to_the_full_layer():
    gen = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(12, 6, generator=gen), torch.randn(12, generator=gen)
    w2, b2 = torch.randn(6, 12, generator=gen), torch.randn(6, generator=gen)
    x = torch.randn(5, 6, generator=gen)
    full_out = (x @ w1.T + b1) @ w2.T + b2
    total = torch.zeros_like(full_out)
    for rank in range(3):
        col = ColumnParallelLinear(6, 12, bias=True, tp_rank=rank, tp_size=3)
        _load(col, col.weight, w1), _load(col, col.bias, b1)
        row = RowParallelLinear(12, 6, bias=True, tp_rank=rank, tp_size=3)
        _load(row, row.weight, w2), _load(row, row.bias, b2)
        row.all_reduce = lambda partial: partial  # summed below instead of by a process group
        total += row(col(x))
    torch.testing.assert_close(total, full_out)


def test_qkv_shards_replicate_kv_heads_when_ranks_outnumber_them():
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 3, 5
    gen = torch.Generator().manual_seed(0)
    wq = torch.randn(num_heads * head_dim, hidden, generator=gen)
    wk = torch.randn(num_kv_heads * head_dim, hidden, generator=gen)
    wv = torch.randn(num_kv_heads * head_dim, hidden, generator=gen)
    x = torch.randn(7, hidden, generator=gen)
    for rank in range(4):
        qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, tp_rank=rank, tp_size=4)
        for shard_id, w in (("q", wq), ("k", wk), ("v", wv)):
            _load(qkv, qkv.weight, w, shard_id)
        q, k, v = qkv.split(qkv(x))
        kv_head = rank // 2  # ranks 0, 1 share KV head 0; ranks 2, 3 share KV head 1
        torch.testing.assert_close(q, x @ wq[rank * head_dim : (rank + 1) * head_dim].T)
        torch.testing.assert_close(k, x @ wk[kv_head * head_dim : (kv_head + 1) * head_dim].T)
        torch.testing.assert_close(v, x @ wv[kv_head * head_dim : (kv_head + 1) * head_dim].T)


def test_merged_gate_up_shards_hold_their_slice_of_each_part():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    layer = MergedColumnParallelLinear(3, [8, 8], tp_rank=1, tp_size=2)
    _load(layer, layer.weight, gate, 0), _load(layer, layer.weight, up, 1)
    assert torch.equal(layer.weight, torch.cat([gate[4:], up[4:]]))


def test_vocab_parallel_embedding_and_head_with_padded_last_shard():
    vocab, dim = 10, 4
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 7, 8, 9])
    hidden = torch.randn(2, dim)
    embedded = torch.zeros(len(ids), dim)
    shards = []
    for rank in range(3):  # 4 rows per rank; the last holds 2 real rows and 2 of padding
        embedding = VocabParallelEmbedding(vocab, dim, tp_rank=rank, tp_size=3)
        _load(embedding, embedding.weight, table)
        embedding.all_reduce = lambda partial: partial
        embedded += embedding(ids)
        head = ParallelLMHead(vocab, dim, tp_rank=rank, tp_size=3)
        _load(head, head.weight, table)
        shards.append(hidden @ head.weight.T)
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(shards, dim=-1)[:, :vocab], hidden @ table.T)


def _tensor_parallel_rank(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from conveyor.worker.loader import load_model
    from tests.worker.test_models import dense_logits, random_prompts

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        model = load_model(model_dir, torch.float32, "cpu", tp_rank=rank, tp_size=world_size)
        attention = model.attention_layers()[0]
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1)  # of 4 and 2
        logits = torch.cat(dense_logits(model, random_prompts(model.config.vocab_size, [9, 4])))
        torch.save(logits, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_tensor_parallel_model_matches_one_rank(tiny_model_dirs, tmp_path):
    """Real collectives (gloo): sharded heads, MLP and vocabulary give the one-rank logits.

    Qwen2 for its sharded q/k/v biases; the layers are the same for the other families.
    """
    import socket

    import torch.multiprocessing as mp

    from conveyor.worker.loader import load_model
    from tests.worker.test_models import dense_logits, random_prompts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_dir, out = str(tiny_model_dirs["qwen2"]), str(tmp_path / "logits")
    mp.spawn(_tensor_parallel_rank, args=(2, port, model_dir, out), nprocs=2, join=True)
    model = load_model(model_dir, torch.float32, "cpu")
    expected = torch.cat(dense_logits(model, random_prompts(model.config.vocab_size, [9, 4])))
    for rank in range(2):
        torch.testing.assert_close(torch.load(f"{out}.{rank}"), expected, atol=1e-4, rtol=0)
