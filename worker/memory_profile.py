"""How many bytes of a CUDA device the KV cache may take, measured with a worst-case step.

Runs in worker processes (CUDA only; on CPU the KV budget is a configured byte count). One
forward at the full token budget, split into as many requests as the width cap allows, plus
logits for every request, shows the activation peak; whatever the weights and that peak leave of
this engine's ``gpu_memory_utilization`` of the device goes to KV blocks. What other engines and
processes hold is not counted, but that share must be free when the engine starts (kv_cache.py,
as vLLM does). The decode CUDA graphs are captured right after that step and the memory they
keep is subtracted too: graph memory is never available to anything else. Piecewise graphs never
read the KV cache and stay; whole-forward graphs (attention inside) bake in the cache's address,
so they are measured on a one-block stand-in cache and captured again once the real one exists
(``ModelRunner.capture_cuda_graphs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.kv_cache import engine_peak_bytes, num_blocks_for_cuda

if TYPE_CHECKING:
    from conveyor.worker.model_runner import ModelRunner


def _dummy_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int) -> np.ndarray:
    num_reqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    lengths = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
    lengths[: num_tokens % num_reqs] += 1
    return lengths


@torch.inference_mode()
def run_worst_case_step(runner: ModelRunner) -> None:
    """One forward at the full token budget plus logits for every request, on a temporary cache.

    Leaves the runner without a KV cache (``initialize_cache`` must follow). Device-agnostic, so
    it is tested on CPU; only the memory measurement around it needs CUDA.
    """
    sched = runner.config.scheduler
    block_size = runner.block_size
    lengths = _dummy_lengths(sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len)
    blocks_per_req = int(-(-lengths.max() // block_size))
    # Block 0 stays the null block, as in the real pool.
    runner.initialize_cache(1 + len(lengths) * blocks_per_req)
    block_table = 1 + np.arange(len(lengths) * blocks_per_req, dtype=np.int32)
    metadata, positions = build_attention_metadata(
        lengths,
        np.zeros_like(lengths),
        block_table.reshape(len(lengths), -1),
        block_size,
        runner.device,
    )
    input_ids = torch.zeros(int(lengths.sum()), dtype=torch.int64, device=runner.device)
    positions_tensor = torch.from_numpy(positions.astype(np.int64)).to(runner.device)
    hidden = runner.model.forward(input_ids, positions_tensor, metadata)
    last_tokens = torch.from_numpy(np.cumsum(lengths) - 1).to(runner.device)
    logits = runner.model.compute_logits(hidden[last_tokens])
    # The sampler's widest path sorts the logits once: budget a copy and an index tensor.
    logits.sort(dim=-1)
    for layer in runner.attention_layers:
        layer.kv_cache = None
    runner.num_blocks = None


def profile_num_blocks(runner: ModelRunner, utilization: float) -> int:
    """Run the worst-case step once, capture the decode graphs; the KV blocks that fit in what
    both leave of this engine's share of the device, or those of ``kv_cache_memory`` bytes
    where it is set and fits there (CUDA)."""
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    run_worst_case_step(runner)
    torch.cuda.synchronize(runner.device)
    # The peak includes the temporary cache; it is small (the dummy requests' blocks only).
    peak = engine_peak_bytes(runner.memory_baseline, runner.device)
    torch.cuda.empty_cache()
    # Captured after the peak was read: the graphs' pool is held for good, on top of what a
    # step's activations need, so the two add up.
    graph_bytes = runner.capture_cuda_graphs()
    total = runner.memory_baseline.total
    return num_blocks_for_cuda(
        total,
        peak + graph_bytes,
        utilization,
        runner.bytes_per_block(),
        runner.config.cache.kv_cache_memory,
    )
