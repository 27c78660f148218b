"""Our models against Hugging Face transformers on the same weights, as one flat token stream."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.loader import load_model
from conveyor.worker.models.decoder import DecoderForCausalLM

CPU = torch.device("cpu")
ATOL = 1e-4


class DenseAttention(AttentionBackend):
    """Causal attention over each request's rows of this step only: whole prompts, no cache.

    Written out here so the model tests do not depend on the paged backends being right.
    """

    name = "dense-test"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        return (0,)

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        metadata,
        scale,
        sliding_window=None,
        sinks=None,
        softcap=None,
    ):
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        group = query.shape[1] // key.shape[1]
        for i in range(metadata.num_reqs):
            s, e = int(starts[i]), int(starts[i + 1])
            assert metadata.seq_lens_cpu[i] == e - s, "dense test backend needs whole prompts"
            q = query[s:e].transpose(0, 1)
            k = key[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
            v = value[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
            scores = (q @ k.transpose(1, 2)) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            hidden = torch.ones(e - s, e - s, dtype=torch.bool).triu(1)
            if sliding_window is not None:
                hidden |= torch.ones(e - s, e - s, dtype=torch.bool).tril(-sliding_window)
            scores = scores.masked_fill(hidden, float("-inf"))
            if sinks is not None:  # one more logit per head, with a zero value
                sink = sinks.view(-1, 1, 1).expand(-1, e - s, 1).to(scores.dtype)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            output[s:e] = (probs @ v).transpose(0, 1)
        return output


def bind(model: DecoderForCausalLM, backend: AttentionBackend, caches: list[torch.Tensor]) -> None:
    for layer, cache in zip(model.attention_layers(), caches):
        layer.backend, layer.kv_cache = backend, cache


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def run_step(model, tokens, num_computed, block_table, block_size):
    """One forward of the flat stream: tokens[i] are request i's new tokens after num_computed[i]."""
    metadata, positions = build_attention_metadata(
        np.array([len(t) for t in tokens]), np.array(num_computed), block_table, block_size, CPU
    )
    input_ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64)
    with torch.inference_mode():
        hidden = model(input_ids, torch.from_numpy(positions), metadata)
        return model.compute_logits(hidden)


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0].float()


def dense_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    bind(model, DenseAttention(), [torch.empty(0)] * len(model.attention_layers()))
    table = np.zeros((len(prompts), 64), dtype=np.int32)  # slots unused by the dense backend
    logits = run_step(model, prompts, [0] * len(prompts), table, block_size=16)
    return list(logits.split([len(p) for p in prompts]))


def test_logits_match_hf_on_a_flat_batch(tiny_model_dir_each: Path, hf_model):
    model = load_model(tiny_model_dir_each, torch.float32, CPU)
    hf = hf_model(tiny_model_dir_each)
    prompts = random_prompts(model.config.vocab_size, [7, 1, 33, 19])
    ours = dense_logits(model, prompts)
    for prompt, logits in zip(prompts, ours):
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_through_the_paged_torch_backend(
    tiny_model_dir_each: Path, hf_model
):
    """Prompts split across steps, mixed with decodes, through a real paged KV cache."""
    model = load_model(tiny_model_dir_each, torch.float32, CPU)
    hf = hf_model(tiny_model_dir_each)
    block_size, blocks_per_req = 4, 16
    layer = model.attention_layers()[0]
    backend = TorchAttentionBackend()
    shape = backend.kv_cache_shape(64, block_size, layer.num_kv_heads, layer.head_dim)
    bind(model, backend, [torch.zeros(shape) for _ in model.attention_layers()])
    # Requests get interleaved, non-contiguous blocks so a block-table mistake shows.
    table = np.arange(64, dtype=np.int32).reshape(blocks_per_req, 4).T.copy()[:3]
    sequences = random_prompts(model.config.vocab_size, [23, 11, 30], seed=1)
    steps = [[10, 9, 3], [12, 1, 20], [1, 1, 7]]  # tokens per request per step
    computed = [0, 0, 0]
    for step in steps:
        tokens = [seq[c : c + n] for seq, c, n in zip(sequences, computed, step)]
        logits = run_step(model, tokens, computed, table, block_size).split(step)
        for seq, c, n, ours in zip(sequences, computed, step, logits):
            expected = hf_logits(hf, seq[: c + n])[c:]
            torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
        computed = [c + n for c, n in zip(computed, step)]


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
    ids=lambda s: s.get("rope_type") or s["type"],
)
def test_rope_scaled_configs_match_hf(tiny_model_dirs, tmp_path: Path, hf_model, rope_scaling):
    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(rope_scaling=rope_scaling, rope_theta=50000.0)
    (model_dir / "config.json").write_text(json.dumps(config))
    model = load_model(model_dir, torch.float32, CPU)
    assert model.model.layers[0].self_attn.rotary_emb.rope_type == (
        rope_scaling.get("rope_type") or rope_scaling["type"]
    )
    hf = hf_model(model_dir)
    prompts = random_prompts(config["vocab_size"], [40, 3])
    for prompt, logits in zip(prompts, dense_logits(model, prompts)):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_output_rows_give_those_rows_of_the_full_forward(tiny_model_dir_each: Path):
    """The last layer finishes only the rows asked for; they must not change."""
    model = load_model(tiny_model_dir_each, torch.float32, CPU)
    bind(model, DenseAttention(), [torch.empty(0)] * len(model.attention_layers()))
    prompts = random_prompts(model.config.vocab_size, [6, 1, 13])
    metadata, positions = build_attention_metadata(
        np.array([len(p) for p in prompts]),
        np.zeros(3, np.int64),
        np.zeros((3, 4), np.int32),
        16,
        CPU,
    )
    input_ids = torch.tensor([t for p in prompts for t in p])
    rows = torch.tensor([5, 6, 19, 0])  # each request's last token, and one more
    with torch.inference_mode():
        full = model(input_ids, torch.from_numpy(positions), metadata)
        some = model(input_ids, torch.from_numpy(positions), metadata, rows)
    assert some.shape == (len(rows), model.config.hidden_size)
    torch.testing.assert_close(some, full[rows], atol=1e-5, rtol=0)


def test_weights_processed_after_loading_change_no_logits(tiny_model_dir: Path):
    """The loader packs small-batch weights and stacks the q/k norms: same logits as without."""
    model = load_model(tiny_model_dir, torch.float32, CPU)
    attention = model.model.layers[0].self_attn
    assert attention.qk_norm_weight is not None
    if torch.backends.mkldnn.is_available():
        assert attention.qkv_proj.packed_weight is not None
        assert model.lm_head.packed_weight is not None
    prompts = random_prompts(model.config.vocab_size, [9, 2], seed=3)
    processed = dense_logits(model, prompts)
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = None
        if hasattr(module, "qk_norm_weight"):
            module.qk_norm_weight = None
    for a, b in zip(processed, dense_logits(model, prompts)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)  # float32 sums in another order


def test_request_order_in_the_stream_does_not_change_its_logits(tiny_model_dir: Path):
    model = load_model(tiny_model_dir, torch.float32, CPU)
    prompts = random_prompts(model.config.vocab_size, [5, 12, 8], seed=2)
    forward = dense_logits(model, prompts)
    backward = dense_logits(model, prompts[::-1])[::-1]
    for a, b in zip(forward, backward):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_attention_layers_are_distinct_and_refuse_to_run_unbound(tiny_model_dir: Path):
    model = load_model(tiny_model_dir, torch.float32, CPU)
    layers = model.attention_layers()
    assert len(layers) == model.config.num_hidden_layers
    assert len({id(layer) for layer in layers}) == len(layers)
    assert all(layer.backend is None and layer.kv_cache is None for layer in layers)
    # One RoPE table for the whole model, not one per layer.
    assert len({id(layer.self_attn.rotary_emb) for layer in model.model.layers}) == 1
    with pytest.raises(RuntimeError, match="bound"):
        run_step(model, [[1, 2]], [0], np.zeros((1, 4), dtype=np.int32), 16)


def test_each_layers_window_is_read_as_transformers_reads_it():
    from transformers import MistralConfig, Qwen2Config

    from conveyor.worker.models.decoder import kv_sliding_window, layer_sliding_windows

    # Qwen2: windows only from max_window_layers on, and only with use_sliding_window.
    qwen2 = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2
    )
    assert layer_sliding_windows(qwen2) == [None, None, 64, 64]
    assert kv_sliding_window(layer_sliding_windows(qwen2)) is None  # global layers keep all
    off = Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=64)
    assert layer_sliding_windows(off) == [None, None]
    # Mistral v0.1: every layer, so the cache may free behind the window.
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=4096)
    assert layer_sliding_windows(mistral) == [4096] * 3
    assert kv_sliding_window(layer_sliding_windows(mistral)) == 4096
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [
        None,
        None,
    ]
    assert kv_sliding_window([8, 16, 8]) == 16
