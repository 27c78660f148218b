"""The mixture-of-experts layer and checkpoints: routing, grouped expert execution, sharding,
loading, against a per-token reference and against transformers' own sparse blocks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conveyor.worker.layers import fused_moe
from conveyor.worker.layers.fused_moe import FusedMoE, MoEExperts, select_experts
from conveyor.worker.loader import ModelLoadError, load_model
from conveyor.worker.models.checkpoint import param_name_of

HIDDEN, INTER, NUM_EXPERTS = 16, 8, 6


def _random_moe(top_k: int, renormalize: bool, tp_rank: int = 0, tp_size: int = 1) -> FusedMoE:
    """A layer whose weights are the same for the same arguments, whatever the rank."""
    generator = torch.Generator().manual_seed(0)
    full = {
        "router": torch.randn(NUM_EXPERTS, HIDDEN, generator=generator),
        "gate_up": torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=generator) / 4,
        "down": torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=generator) / 3,
    }
    moe = FusedMoE(NUM_EXPERTS, top_k, HIDDEN, INTER, renormalize, True, tp_rank, tp_size)
    moe.gate.weight.data.copy_(full["router"])
    loader = moe.experts.weight_loader
    for e in range(NUM_EXPERTS):
        gate, up = full["gate_up"][e].chunk(2)
        loader(moe.experts.gate_up_proj, gate, (e, "gate"))
        loader(moe.experts.gate_up_proj, up, (e, "up"))
        loader(moe.experts.down_proj, full["down"][e], (e, "down"))
    moe.full_weights = full  # type: ignore[attr-defined]
    return moe


def _naive(moe: FusedMoE, hidden: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    full = moe.full_weights  # type: ignore[attr-defined]
    out = torch.zeros_like(hidden)
    for t, x in enumerate(hidden):
        probs = torch.softmax(full["router"] @ x, dim=-1)
        weights, ids = probs.topk(moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, ids.tolist()):
            gate, up = (full["gate_up"][e] @ x).chunk(2)
            out[t] += weight * (full["down"][e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_matches_a_per_token_reference(top_k, renormalize):
    moe = _random_moe(top_k, renormalize)
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, ids = select_experts(moe.gate(hidden), top_k, renormalize)
    counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
    assert counts.max() > 1  # several tokens share an expert
    expected = _naive(moe, hidden)
    torch.testing.assert_close(moe(hidden), expected, rtol=1e-5, atol=1e-5)
    # As served: each expert's weights packed for the CPU's small-batch kernel where it has one.
    moe.gate.process_weights_after_loading()
    moe.experts.process_weights_after_loading()
    assert (moe.experts.packed_weights is not None) == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(moe(hidden), expected, rtol=1e-5, atol=1e-5)
    # Renormalised weights add up to one; otherwise they are the raw top-k probabilities.
    weights, _ = select_experts(moe.gate(hidden), top_k, renormalize)
    assert torch.allclose(weights.sum(-1), torch.ones(40)) == (renormalize or top_k == NUM_EXPERTS)


def test_experts_run_only_on_their_tokens_and_idle_experts_cost_nothing(monkeypatch):
    moe = _random_moe(2, True)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    # Experts 1, 3 and 5 get no token; expert 0 serves every token; token 4 is in both its slots'
    # expert runs of expert 0 and 2 in reverse slot order.
    ids = torch.tensor([[0, 2], [0, 4], [2, 0], [0, 2], [2, 0]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.2, 0.8]])
    calls = []
    original = fused_moe.linear  # F.linear, the packed weight or the one-or-two-row kernel

    def counting_linear(x, weight, *args):
        calls.append((x.shape[0], weight.data_ptr()))
        return original(x, weight, *args)

    monkeypatch.setattr(fused_moe, "linear", counting_linear)
    out = moe.experts(hidden, ids, weights)
    monkeypatch.undo()
    full = moe.full_weights  # type: ignore[attr-defined]
    expected = torch.zeros_like(hidden)
    for t in range(5):
        for weight, e in zip(weights[t], ids[t].tolist()):
            gate, up = (full["gate_up"][e] @ hidden[t]).chunk(2)
            expected[t] += weight * (full["down"][e] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # One gate/up and one down matmul per active expert, over all of its rows; none for the rest.
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    assert calls == [
        (rows, weight[e].data_ptr())
        for e, rows in ((0, 5), (2, 4), (4, 1))
        for weight in (gate_up, down)
    ]


def test_no_tokens_gives_an_empty_result():
    moe = _random_moe(2, True)
    assert moe(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def test_select_experts_matches_transformers_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(3))
    for norm in (True, False):
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN, num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=norm
        )
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        logits, hf_weights, hf_ids = router(hidden)
        weights, ids = select_experts(logits, 2, norm)
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    router = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=NUM_EXPERTS))
    torch.nn.init.normal_(router.weight)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, 2, True)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bfloat16_rounds_as_transformers_does(family):
    """Bit for bit in bfloat16 against transformers' sparse block (its default grouped-matmul
    experts): the routing weights' dtype and the order of the sums are each family's."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(4)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=INTER,
            norm_topk_prob=True,
        )
        hf = Qwen3MoeSparseMoeBlock(config)
    else:
        hf = MixtralSparseMoeBlock(
            MixtralConfig(
                hidden_size=HIDDEN,
                num_local_experts=NUM_EXPERTS,
                num_experts_per_tok=2,
                intermediate_size=INTER,
            )
        )
    hf.experts.config._experts_implementation = "grouped_mm"
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.3)
    ours = FusedMoE(NUM_EXPERTS, 2, HIDDEN, INTER, True, family == "qwen3_moe")
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        ours.get_parameter(name).data.copy_(hf.get_parameter(name))
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    hidden = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = hf(hidden.unsqueeze(0))[0]
        assert torch.equal(ours(hidden), expected)


def test_two_ranks_sum_to_one_rank():
    """Each rank holds half of every expert's intermediate features; the partial outputs (what
    the all-reduce sums) add up to the unsharded layer's."""
    one = _random_moe(2, True)
    halves = [_random_moe(2, True, rank, 2) for rank in range(2)]
    assert halves[0].experts.gate_up_proj.shape == (NUM_EXPERTS, INTER, HIDDEN)
    hidden = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(5))
    weights, ids = select_experts(one.gate(hidden), 2, True)
    partial = [half.experts(hidden, ids, weights) for half in halves]
    torch.testing.assert_close(partial[0] + partial[1], one(hidden), rtol=1e-5, atol=1e-5)


def test_weight_loader_refuses_what_does_not_fit():
    experts = MoEExperts(NUM_EXPERTS, HIDDEN, INTER)
    with pytest.raises(ValueError, match="out of range"):
        experts.weight_loader(experts.down_proj, torch.zeros(HIDDEN, INTER), (NUM_EXPERTS, "down"))
    with pytest.raises(ValueError, match="does not belong"):
        experts.weight_loader(experts.down_proj, torch.zeros(INTER, HIDDEN), (0, "gate"))
    with pytest.raises(ValueError, match="one expert's gate, up or down at a time"):
        experts.weight_loader(experts.down_proj, torch.zeros(NUM_EXPERTS, HIDDEN, INTER), None)
    with pytest.raises(ValueError, match="shape mismatch"):
        experts.weight_loader(experts.gate_up_proj, torch.zeros(INTER, HIDDEN + 1), (0, "up"))


def test_checkpoint_names_map_both_conventions():
    assert param_name_of("model.layers.3.mlp.experts.5.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj",
        (5, "up"),
    )
    assert param_name_of("model.layers.0.block_sparse_moe.experts.7.w2.weight") == (
        "model.layers.0.mlp.experts.down_proj",
        (7, "down"),
    )
    assert param_name_of("model.layers.0.block_sparse_moe.gate.weight") == (
        "model.layers.0.mlp.gate.weight",
        None,
    )
    # A dense MLP in a mixture-of-experts model is the usual fused gate/up.
    assert param_name_of("model.layers.0.mlp.gate_proj.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight",
        0,
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_every_checkpoint_tensor_has_one_home_and_transformers_agrees(
    family, tiny_moe_model_dirs, hf_model
):
    model_dir = tiny_moe_model_dirs[family]
    ours = load_model(model_dir, torch.float32, "cpu")
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        on_disk = set(f.keys())
    # checkpoint_names is the exact inverse of the loading map.
    names = [n for p, _ in ours.named_parameters() for n in ours.checkpoint_names(p)]
    assert sorted(names) == sorted(on_disk)
    # transformers loads the same directory with nothing missing or left over, into the same
    # stacked layout ([gate; up] per expert) as ours.
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info
    hf_params = dict(hf_model(model_dir).named_parameters())
    for name, param in ours.named_parameters():
        if ".experts." in name or name.endswith(".mlp.gate.weight"):
            assert torch.equal(param, hf_params[name]), name


def test_a_missing_expert_is_named(tiny_moe_model_dirs, tmp_path: Path):
    source = tiny_moe_model_dirs["mixtral"]
    target = tmp_path / "model"
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors: .*experts\.6\.w3\.weight$"):
        load_model(target, torch.float32, "cpu")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_generated_models_route_decisively_and_variedly(family, tiny_moe_model_dirs, hf_model):
    """The model maker's routers: a clear favourite per token, but not the same one for every
    token (a router that always picks the same pair would hide a wrong expert order), and the
    output still depends on the whole context (as for the dense models, test_model_maker)."""
    model = hf_model(tiny_moe_model_dirs[family])
    logits = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, out: logits.append(out[0]))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    generator = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, model.config.vocab_size, (1, 64), generator=generator)
    other = torch.cat([torch.randint(3, 2000, (1, 63), generator=generator), prompt[:, -1:]], 1)
    with torch.inference_mode():
        model(prompt)
        for hook in hooks:
            hook.remove()
        continuations = [
            model.generate(p, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 64:].tolist()
            for p in (prompt, other)
        ]
    for layer_logits in logits:
        probs = layer_logits.softmax(-1)
        pairs = {tuple(sorted(ids)) for ids in probs.topk(2).indices.tolist()}
        assert len(pairs) >= 10 and probs.argmax(-1).unique().numel() == probs.shape[1]
        assert 0.35 < probs.max(-1).values.mean() < 0.9
    assert continuations[0] != continuations[1]
