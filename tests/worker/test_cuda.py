"""What only a GPU can check: a decode step that never waits on the device (with LoRA adapters
and quantized checkpoints too), CUDA graphs against eager (with LoRA adapters too), CUDA against
CPU (quantized checkpoints too, under graphs and eager), flash-attn against the torch backend at
head_dim 128, memory profiling with a 16k prompt on the torch path, and tensor parallelism over
NCCL.

Skipped unless the run asks for the GPU (CONVEYOR_TEST_DEVICE=cuda, tests/devices.py) on a machine
that has one; ``python -m benchmarks gpu-check`` runs them. The head_dim-128 tests use the random model with
Qwen3-0.6B's shapes (generated once into the model cache, about 1.2 GB).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from conveyor.protocol.config import ConfigError
from conveyor.protocol.lora import LoRALoad, LoRARequest
from conveyor.worker.attention.flash_attn_backend import FlashAttnBackend, flash_attn_import_error
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.model_runner import ModelRunner
from tests.devices import logprob_tolerance, requires_cuda
from tests.worker.test_attention import Request, make_requests, reference_attention, step_inputs

pytestmark = [pytest.mark.cuda, requires_cuda()]

CUDA = torch.device("cuda")
# Two logprobs: where greedy tokens differ, the other run's token is among this run's top two.
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
needs_flash_attn = pytest.mark.skipif(
    flash_attn_import_error() is not None, reason="needs flash_attn (docs/serving.md#cuda)"
)


@pytest.fixture(scope="module")
def qwen3_0_6b_dir():
    from benchmarks.fixtures.model_maker import ensure_model

    return ensure_model("qwen3-0.6b", "qwen3")


def _prompts(num: int, vocab: int = 2000, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(5, 60))).tolist() for _ in range(num)]


def _generate(model_dir, prompts, lora_request=None, **engine_args) -> list:
    engine_args.setdefault("kv_cache_memory", 64 << 20)
    if engine_args["device"] == "cuda":  # a CPU engine refuses a GPU memory share
        engine_args.setdefault("gpu_memory_utilization", 0.3)
    with LLM(str(model_dir), engine="inprocess", seed=0, **engine_args) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_request)
        return [o.outputs[0] for o in outputs]


def _first_difference(a, b) -> int:
    return next(
        (p for p, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids)
    )


def _assert_same_tokens_but_near_ties(
    ours: list, theirs: list, tie: float = 1e-3, tolerance: float | None = None
) -> None:
    """Equal greedy tokens, logprobs within ``tolerance`` (float32's by default) up to where
    they differ, and where they do, the two candidates nearly tie."""
    tolerance = logprob_tolerance("float32") if tolerance is None else tolerance
    for a, b in zip(ours, theirs):
        diverge = _first_difference(a, b)
        for p in range(diverge):
            token = a.token_ids[p]
            assert abs(a.logprobs[p][token] - b.logprobs[p][token]) < tolerance
        if diverge == len(a.token_ids):
            continue
        top = a.logprobs[diverge]
        gap = abs(top[a.token_ids[diverge]] - top.get(b.token_ids[diverge], float("-inf")))
        assert gap < tie, f"tokens differ at {diverge} with a logprob gap of {gap:.3g}"


# ------------------------------------------------------------------ the step itself


@pytest.fixture
def make_runner():
    """``_runner``, with every runner released after the test, passed or not: a failed test's
    runner would otherwise keep its cache until the garbage collector finds it."""
    runners: list[ModelRunner] = []

    def make(model_dir, **engine_args) -> ModelRunner:
        runners.append(_runner(model_dir, **engine_args))
        return runners[-1]

    yield make
    for runner in runners:
        runner.release()


def _runner(model_dir, **engine_args) -> ModelRunner:
    args = dict(max_num_seqs=8, max_model_len=256, block_size=16, device="cuda")
    args["gpu_memory_utilization"] = 0.3
    args.update(engine_args)
    config = EngineArgs(model=str(model_dir), **args).create_engine_config()
    runner = ModelRunner(config, CUDA)
    runner.initialize_cache(runner.determine_num_blocks())  # profiles memory, captures graphs
    return runner


# Every sampling feature on at once: filters, a seed, logprobs, penalties, min_tokens.
EVERY_SAMPLING_FEATURE = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    SamplingParams(temperature=1.0, seed=7, min_p=0.05),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=64, min_tokens=50, stop_token_ids=[5]),
]


def _decode_without_synchronising(
    runner: ModelRunner,
    params: list[SamplingParams],
    lora_ids: list[int] | None = None,
    lora_loads: list | None = None,
) -> None:
    """A prompt step, two decodes that plan and allocate what later ones reuse, then a decode
    under ``set_sync_debug_mode("error")``: any host sync in it raises. ``lora_ids``: each
    request's adapter (0: the base model), ``lora_loads`` the slot fills of the prompt step."""
    prompts = _prompts(len(params))
    lora_ids = lora_ids or [0] * len(params)
    new = [
        NewRequestData(i, prompt, p, list(range(1 + 4 * i, 5 + 4 * i)), 0, len(prompt), lid)
        for i, (prompt, p, lid) in enumerate(zip(prompts, params, lora_ids))
    ]
    runner.execute_model(SchedulerOutput(1, new, lora_loads=lora_loads or []))
    lengths = [len(p) for p in prompts]

    def decode(step: int):
        cached = CachedRequestData(
            req_ids=list(range(len(params))),
            new_block_ids=[[] for _ in params],
            num_computed_tokens=[n + step - 2 for n in lengths],
            num_scheduled_tokens=[1] * len(params),
            resumed_token_ids={},
        )
        return runner.execute_model(SchedulerOutput(step, scheduled_cached_reqs=cached))

    for step in (2, 3):
        decode(step)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = decode(4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(out.sampled_token_ids) == len(params)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_steady_decode_step_never_synchronises_with_the_device(
    make_runner, tiny_model_dir, enforce_eager
):
    runner = make_runner(tiny_model_dir, dtype="float32", enforce_eager=enforce_eager)
    assert (runner.decode_graphs is None) == enforce_eager
    _decode_without_synchronising(runner, EVERY_SAMPLING_FEATURE)


def test_graphs_and_enforce_eager_give_the_same_tokens(tiny_model_dir):
    # 5 and 11 requests: batches that are padded up to a captured size.
    for num in (5, 11):
        prompts = _prompts(num, seed=num)
        graphs = _generate(tiny_model_dir, prompts, device="cuda", dtype="float32")
        eager = _generate(
            tiny_model_dir, prompts, device="cuda", dtype="float32", enforce_eager=True
        )
        assert [g.token_ids for g in graphs] == [e.token_ids for e in eager]


# Two PEFT adapters of the tiny model (benchmarks/fixtures/lora_maker.py) and the engine that
# serves them beside the base model.
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def lora_adapters(tiny_model_dir, tmp_path_factory) -> list:
    pytest.importorskip("peft")
    from benchmarks.fixtures.lora_maker import make_adapter

    folder = tmp_path_factory.mktemp("lora")
    return [
        make_adapter(tiny_model_dir, folder / "a", 8, ["q_proj", "v_proj", "down_proj"], 1),
        make_adapter(tiny_model_dir, folder / "b", 16, ["k_proj", "o_proj", "up_proj"], 2),
    ]


def test_lora_graphs_and_enforce_eager_give_the_same_tokens(tiny_model_dir, lora_adapters):
    # Every batch mixes both adapters and the base model; 5 and 11 requests are padded up to a
    # captured size, and the batch shrinks as requests of different lengths end.
    choices = [None] + [LoRARequest(f"l{i}", i + 1, str(p)) for i, p in enumerate(lora_adapters)]
    for num in (5, 11):
        prompts = _prompts(num, seed=num)
        loras = [choices[i % 3] for i in range(num)]
        runs = [
            _generate(
                tiny_model_dir,
                prompts,
                loras,
                device="cuda",
                dtype="float32",
                enforce_eager=eager,
                **LORA_ENGINE,
            )  # fmt: skip
            for eager in (False, True)
        ]
        _assert_same_tokens_but_near_ties(*runs)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_steady_lora_decode_step_never_synchronises_with_the_device(
    make_runner, tiny_model_dir, lora_adapters, enforce_eager
):
    runner = make_runner(
        tiny_model_dir, dtype="float32", enforce_eager=enforce_eager, **LORA_ENGINE
    )
    # Graphs with LoRA: the Triton LoRA kernels run on this GPU.
    assert (runner.decode_graphs is None) == enforce_eager
    lora_ids = [0, 1, 2, 1, 0, 2]
    loads = [LoRALoad(slot, slot + 1, str(path)) for slot, path in enumerate(lora_adapters)]
    replays = []
    if runner.decode_graphs is not None:
        run = runner.decode_graphs.run
        runner.decode_graphs.run = lambda n, metadata: replays.append(n) or run(n, metadata)
    _decode_without_synchronising(runner, [GREEDY] * len(lora_ids), lora_ids, loads)
    assert replays == ([] if enforce_eager else [len(lora_ids)] * 3)  # every decode replayed


# ------------------------------------------------------------------ quantized checkpoints

# (id, checkpoint format, fixture options, model size): the tiny Qwen3's quantized checkpoints
# (benchmarks/fixtures/quantized_maker.py), one per path of the CUDA kernels
# (worker/layers/quantization/triton_quant.py); FP8's 128 x 128 blocks need the "small" model.
QUANTIZED = [
    ("gptq-w4-zeros-act-order", "gptq", dict(sym=False, desc_act=True), "tiny"),
    ("awq-w4-zeros", "awq", {}, "tiny"),
    ("ct-w4a16-g32", "compressed-tensors", dict(preset="W4A16", group=32), "tiny"),
    ("ct-w8a16-g32", "compressed-tensors", dict(preset="W8A16", group=32), "tiny"),
    ("ct-w8a8-int8", "compressed-tensors", dict(preset="W8A8", group=0), "tiny"),
    ("ct-fp8-static", "compressed-tensors", dict(preset="FP8", group=0), "tiny"),
    ("ct-fp8-dynamic", "compressed-tensors", dict(preset="FP8_DYNAMIC", group=0), "tiny"),
    ("fp8-blocks", "fp8", {}, "small"),
]
# Quantized activations: a value on a rounding boundary of the int8 or FP8 grid moves a whole
# step on one device only (attention and norms sum in other orders), and the random models
# amplify such flips: the tolerance tests/frontend/test_parity_quantized.py takes for them.
ACTIVATION_TOLERANCE = 0.5


@pytest.fixture(scope="module", params=QUANTIZED, ids=[q[0] for q in QUANTIZED])
def quantized_case(request):
    from benchmarks.fixtures.model_maker import ensure_model
    from benchmarks.fixtures.quantized_maker import ensure_quantized

    name, kind, options, size = request.param
    model_dir = ensure_quantized(ensure_model(size, "qwen3"), kind, **options)
    activations = name.startswith(("ct-w8a8", "ct-fp8", "fp8"))
    return model_dir, ACTIVATION_TOLERANCE if activations else None


def test_quantized_checkpoints_give_the_cpu_tokens_with_graphs_and_eager(
    quantized_case, monkeypatch
):
    from conveyor.worker.layers.quantization import triton_quant

    model_dir, tolerance = quantized_case
    tie = 1e-3 if tolerance is None else tolerance
    launches = []
    linear = triton_quant.linear
    monkeypatch.setattr(triton_quant, "linear", lambda *a: launches.append(1) or linear(*a))
    prompts = _prompts(8)
    cpu = _generate(model_dir, prompts, device="cpu", dtype="float32")
    for eager in (False, True):
        cuda = _generate(model_dir, prompts, device="cuda", dtype="float32", enforce_eager=eager)
        _assert_same_tokens_but_near_ties(cuda, cpu, tie=tie, tolerance=tolerance)
    assert launches and triton_quant.failure is None, triton_quant.failure


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize(
    "kind,options",
    [
        ("gptq", dict(sym=False, desc_act=True)),  # act-order: the gathered groups
        ("compressed-tensors", dict(preset="W8A8", group=0)),  # int8 activations per token
        ("compressed-tensors", dict(preset="FP8", group=0)),  # static input scales per part
    ],
    ids=["gptq-act-order", "w8a8-int8", "fp8-static"],
)
def test_a_steady_quantized_decode_step_never_synchronises_with_the_device(
    make_runner, tiny_model_dir, kind, options, enforce_eager
):
    from benchmarks.fixtures.quantized_maker import ensure_quantized
    from conveyor.worker.layers.quantization import triton_quant

    model_dir = ensure_quantized(tiny_model_dir, kind, **options)
    runner = make_runner(model_dir, dtype="float32", enforce_eager=enforce_eager)
    assert (runner.decode_graphs is None) == enforce_eager
    _decode_without_synchronising(runner, EVERY_SAMPLING_FEATURE)
    assert triton_quant.failure is None, triton_quant.failure
    if torch.cuda.get_device_capability() >= triton_quant.FP8_CAPABILITY:
        # FP8 x FP8 ran through torch._scaled_mm, not the kernel it falls back to.
        assert triton_quant.scaled_mm_failure is None, triton_quant.scaled_mm_failure


def test_cuda_float32_tokens_equal_cpu_float32_tokens(tiny_model_dir):
    prompts = _prompts(8)
    cuda = _generate(tiny_model_dir, prompts, device="cuda", dtype="float32")
    cpu = _generate(tiny_model_dir, prompts, device="cpu", dtype="float32")
    _assert_same_tokens_but_near_ties(cuda, cpu)


# ------------------------------------------------------------------ attention at head_dim 128


@needs_flash_attn
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (8, 8)])
def test_bf16_flash_attn_matches_the_torch_backend_at_head_dim_128(num_heads, num_kv_heads):
    head_dim, block_size, dtype = 128, 256, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    pool = np.random.default_rng(0).permutation(16).tolist()
    shapes = [(300, 1), (0, 200), (37, 1), (260, 90), (511, 1)]
    requests = make_requests(
        gen, pool, shapes, block_size, num_heads, num_kv_heads, dtype, head_dim
    )
    outputs = []
    for backend in (FlashAttnBackend(), TorchAttentionBackend()):
        kv_cache = torch.zeros(
            backend.kv_cache_shape(16, block_size, num_kv_heads, head_dim), dtype=dtype, device=CUDA
        )
        # Step 1 writes the cached prefixes through the backend's own forward (its own layout).
        prefixes = [
            Request(0, r.keys[: r.num_computed], r.values[: r.num_computed],
                    torch.zeros(r.num_computed, num_heads, head_dim, dtype=dtype), r.block_ids)
            for r in requests if r.num_computed
        ]  # fmt: skip
        for step in (prefixes, requests):
            metadata, _, query, key, value = step_inputs(step, block_size, CUDA)
            output = backend.forward(query, key, value, kv_cache, metadata, head_dim**-0.5)
        outputs.append(output.float().cpu())
    expected = torch.cat([reference_attention(r, head_dim**-0.5) for r in requests]).float()
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outputs[0], expected, atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def teacher_forced_logprobs(runner, prompts: list[list[int]], next_tokens: list[int]):
    """Full-vocabulary log-probabilities of the runner's model: after each prompt (one prefill
    step) and after ``next_tokens`` appended (one decode step), through the runner's attention
    backend and paged cache. [2, len(prompts), vocab], float32 on the host."""
    device, block_size = runner.device, runner.block_size
    blocks = -(-max(len(p) + 1 for p in prompts) // block_size)
    table = 1 + np.arange(len(prompts) * blocks, dtype=np.int32).reshape(len(prompts), blocks)
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    steps = [
        (lengths, np.zeros_like(lengths), [t for p in prompts for t in p]),
        (np.ones_like(lengths), lengths, list(next_tokens)),
    ]
    out = []
    for scheduled, computed, tokens in steps:
        metadata, positions = build_attention_metadata(
            scheduled, computed, table, block_size, device
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        hidden = runner.model.forward(ids, torch.from_numpy(positions).to(device), metadata)
        last = torch.from_numpy(np.cumsum(scheduled) - 1).to(device)
        logits = runner.model.compute_logits(hidden[last]).float()
        out.append(logits.log_softmax(-1).cpu())
    return torch.stack(out)


def logprob_error(run: torch.Tensor, reference: torch.Tensor, top: int = 20) -> float:
    """Largest |run - reference| over each row's ``top`` most likely tokens of the reference."""
    index = reference.topk(top, dim=-1).indices
    return (run.gather(-1, index) - reference.gather(-1, index)).abs().max().item()


@pytest.mark.parametrize(
    "backend,block_size",
    [
        pytest.param("flash-attn", 256, marks=needs_flash_attn, id="flash-attn"),
        pytest.param("triton", 16, id="triton"),
    ],
)
def test_a_bf16_backend_is_as_close_to_float32_as_the_torch_backend(
    make_runner, qwen3_0_6b_dir, backend, block_size
):
    """The whole Qwen3-0.6B-shaped model, a prefill step and a decode step on the same tokens:
    each bfloat16 run's log-probabilities against the float32 torch run's. bfloat16 rounding
    through 28 layers of random weights moves them by a model-dependent amount, so the bound is
    relative: the backend under test within twice the torch backend's own bfloat16 error (or
    the bfloat16 tolerance, if that is larger)."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = _prompts(4, vocab=8000, seed=3)
    next_tokens = [17, 404, 2048, 7777]
    runs = {}
    for name, dtype in (("torch", "float32"), ("torch", "bfloat16"), (backend, "bfloat16")):
        runner = make_runner(
            qwen3_0_6b_dir, dtype=dtype, attention_backend=name, block_size=block_size
        )
        assert runner.backend.name == name
        runs[name, dtype] = teacher_forced_logprobs(runner, prompts, next_tokens)
        runner.release()
    reference = runs["torch", "float32"]
    torch_error = logprob_error(runs["torch", "bfloat16"], reference)
    backend_error = logprob_error(runs[backend, "bfloat16"], reference)
    print(
        f"bfloat16 vs float32 logprob error: torch {torch_error:.4f}, {backend} {backend_error:.4f}"
    )
    assert np.isfinite(torch_error) and np.isfinite(backend_error)
    assert backend_error <= max(2 * torch_error, logprob_tolerance("bfloat16"))


# ------------------------------------------------------------------ memory


def test_memory_profiling_leaves_room_and_a_16k_prompt_chunk_never_holds_a_score_matrix(
    make_runner, qwen3_0_6b_dir
):
    utilization, prompt_len, chunk = 0.5, 16384, 4096
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(CUDA)
    runner = make_runner(
        qwen3_0_6b_dir,
        dtype="bfloat16",
        attention_backend="torch",
        max_model_len=prompt_len + 64,
        max_num_batched_tokens=chunk,
        max_num_seqs=4,
        gpu_memory_utilization=utilization,
    )
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # This engine's share (what an earlier test left allocated is not part of it).
    assert torch.cuda.memory_reserved(CUDA) - before <= utilization * total + (512 << 20)
    prompt = np.random.default_rng(0).integers(3, 8000, prompt_len).tolist()
    blocks = list(range(1, 1 + -(-(prompt_len + 1) // 16)))
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    out = runner.execute_model(
        SchedulerOutput(1, [NewRequestData(0, prompt, GREEDY, blocks, 0, chunk)])
    )
    for start in range(chunk, prompt_len, chunk):
        cached = CachedRequestData([0], [[]], [start], [chunk], {})
        out = runner.execute_model(
            SchedulerOutput(1 + start // chunk, scheduled_cached_reqs=cached)
        )
    assert len(out.sampled_token_ids) == 1
    # A masked chunk through SDPA's math kernel would hold 16 heads x 4096 x 16384 scores
    # (2 GiB in bfloat16, twice that in float32); chunk activations are ~0.2 GiB.
    assert torch.cuda.max_memory_allocated(CUDA) - baseline < (1 << 30)


def test_the_memory_profile_sets_aside_what_the_whole_graphs_keep(make_runner, tiny_model_dir):
    # Measured on the profile's one-block stand-in cache, captured again on the real one: the
    # same graphs, so about the same bytes (a new capture stream's cuBLAS workspace aside).
    runner = make_runner(tiny_model_dir, dtype="float32", attention_backend="triton")
    assert runner.decode_graphs is not None and runner.decode_graphs.whole
    assert abs(runner.cuda_graph_bytes - runner.profiled_graph_bytes) <= 64 << 20


def test_engines_share_a_device_by_their_own_shares_and_a_closed_one_gives_its_memory_back(
    tiny_model_dir,
):
    prompts = _prompts(4, seed=5)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(CUDA)
    args = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.4, seed=0)
    with (
        LLM(str(tiny_model_dir), engine="inprocess", **args) as first,
        LLM(str(tiny_model_dir), engine="inprocess", **args) as second,
    ):
        # Each holds ~0.4 of the card; a third share does not fit beside them.
        assert torch.cuda.memory_allocated(CUDA) - before > 0.6 * _total()
        with pytest.raises(ConfigError, match="only .* is free"):
            LLM(str(tiny_model_dir), engine="inprocess", **args)
        a = first.generate(prompts, GREEDY, use_tqdm=False)
        b = second.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # What stays is the process's, not the engines': cuBLAS keeps a workspace (32 MiB on Hopper)
    # per stream it ran on; the two 0.4 shares (~110 GiB on an H200) are gone.
    assert torch.cuda.memory_allocated(CUDA) - before < (256 << 20)


def _total() -> int:
    return torch.cuda.get_device_properties(CUDA).total_memory


# ------------------------------------------------------------------ tensor parallel


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_over_nccl_matches_one_gpu(tiny_model_dir):
    prompts = _prompts(6)
    one = _generate(tiny_model_dir, prompts, device="cuda", dtype="float32")
    with LLM(
        str(tiny_model_dir),
        device="cuda",
        dtype="float32",
        tensor_parallel_size=2,
        gpu_memory_utilization=0.3,
        seed=0,
    ) as llm:
        two = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    _assert_same_tokens_but_near_ties(two, one)
