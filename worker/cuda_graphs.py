"""CUDA graphs for decode-only steps: captured at start-up per batch size, replayed in pieces.

Runs in worker processes, on CUDA only (a CPU runner never builds one, and ``--enforce-eager``
turns them off). A decode step of a small model launches about a thousand kernels of a few
microseconds each, so the GPU waits on the host's Python and driver work; replaying a captured
graph launches a whole stretch of them with one call.

What is captured is the model's forward for a batch of B tokens, cut at every attention call into
pieces (vLLM's "piecewise" graphs, cut here by hand at the attention layer rather than by
torch.compile). Attention runs eagerly between the pieces, reading the pieces' query, key and
value outputs and writing into a buffer the next piece reads, because it is the one op that
depends on the step's requests (context lengths, block tables). With it outside, a graph depends
only on B, every attention backend works unchanged, and no graph touches the KV cache: graphs are
captured during memory profiling, before the cache exists, and their memory is counted there.

A step of n decodes replays the graphs of the smallest captured size B >= n. Rows n .. B-1 are
padding: they compute throwaway values from whatever the input buffers hold past n (earlier
steps' tokens and positions, always valid), attention gives them zeros, and nobody reads them.

Whole-forward graphs: with a backend whose decode attention launches from fixed device buffers
alone (``full_decode_graphs``: the Triton kernel, one program per request), the pieces and the
attention calls between them, 88 launches a step for a 28-layer model, become one graph (vLLM's
"full decode-only" graphs). Such a graph bakes in the KV cache's address, so it is captured once
the cache exists, replacing the piecewise graphs the memory profile measured (the same sizes, the
same activations); the runner pads each replayed step in the fixed buffers (a padding row's
request has no context and slot -1: its attention reads no key, writes nothing to the cache and
gives zeros, as with the pieces).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from conveyor.worker.attention.backend import AttentionMetadata
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.layers.attention import Attention

# Above this many requests a decode step is GPU-bound anyway, and every size costs capture time
# and graph memory (vLLM stops at 512 too).
MAX_CAPTURE_SIZE = 512
# Small batches are where launches dominate, so they get exact sizes; from 8 on, a step pads by at
# most 7 rows, a few percent of its work.
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def capture_sizes(
    max_num_seqs: int, max_num_tokens: int, limit: int = MAX_CAPTURE_SIZE
) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, then the largest decode step."""
    top = min(max_num_seqs, max_num_tokens, limit)
    sizes = {size for size in _SMALL_SIZES if size <= top}
    sizes.update(range(_SIZE_STEP, top + 1, _SIZE_STEP))
    if top >= 1:
        sizes.add(top)  # so every decode step up to the cap has a graph
    return sorted(sizes)


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_tokens``, or None (too many, or none)."""
    index = bisect.bisect_left(sizes, num_tokens)
    if num_tokens < 1 or index == len(sizes):
        return None
    return sizes[index]


@dataclass
class _AttentionCall:
    """One attention layer's call between two pieces, on the tensors captured around it."""

    layer: Attention
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor

    def run(self, metadata: AttentionMetadata) -> None:
        self.layer.attend(self.query, self.key, self.value, metadata, out=self.output)


class PiecewiseGraph:
    """One batch size's forward: piece i runs up to attention call i, the last piece to the end."""

    def __init__(
        self, graphs: list[torch.cuda.CUDAGraph], calls: list[_AttentionCall], output: torch.Tensor
    ) -> None:
        if len(graphs) != len(calls) + 1:
            raise ValueError(f"{len(graphs)} pieces around {len(calls)} attention calls")
        self.graphs = graphs
        self.calls = calls
        self.output = output

    def replay(self, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] of the tokens now in the input buffers."""
        for graph, call in zip(self.graphs, self.calls):
            graph.replay()
            call.run(metadata)
        self.graphs[-1].replay()
        return self.output


class WholeGraph:
    """One batch size's whole forward, attention included, in one graph: its attention reads the
    step from the runner's fixed buffers (``StepInputBuffers.prepare`` pads them), so replay
    takes no metadata."""

    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph = graph
        self.output = output

    def replay(self, metadata: AttentionMetadata) -> torch.Tensor:
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """The captured batch sizes of one runner; ``whole``: one graph per size, attention in it
    (else pieces around eager attention calls)."""

    def __init__(
        self, graphs: dict[int, PiecewiseGraph] | dict[int, WholeGraph], whole: bool = False
    ) -> None:
        self.graphs = graphs
        self.sizes = sorted(graphs)
        self.whole = whole

    def padded_size(self, num_tokens: int) -> int | None:
        return padded_size(num_tokens, self.sizes)

    def run(self, num_tokens: int, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a decode-only step (``padded_size`` not None)."""
        size = self.padded_size(num_tokens)
        if size is None:
            raise ValueError(f"no graph holds {num_tokens} tokens (sizes up to {self.sizes[-1]})")
        return self.graphs[size].replay(metadata)[:num_tokens]


class AttentionOutputs:
    """One buffer per attention layer, [largest size, heads * head_dim], shared by all sizes
    (never two at once); each is what a piece reads where the layer's output would be."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._buffers: dict[Attention, torch.Tensor] = {}

    def of(self, layer: Attention, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(layer)
        if buffer is None:
            width = layer.num_heads * layer.head_dim
            buffer = torch.zeros(self.max_size, width, dtype=like.dtype, device=like.device)
            self._buffers[layer] = buffer
        return buffer[: like.shape[0]]

    def skip(self, layer: Attention, q, k, v, metadata) -> torch.Tensor:
        """Stands in for attention in the warm-up run: no cache is bound yet."""
        return self.of(layer, q)


# () -> (a graph, the context that captures into it): a CUDA graph and torch.cuda.graph on the
# runner's pool and stream; the tests pass stand-ins, so the splitting itself runs on CPU.
OpenCapture = Callable[[], tuple[object, contextlib.AbstractContextManager]]


def _cuda_capture(pool: tuple, stream: torch.cuda.Stream) -> OpenCapture:
    def open_capture() -> tuple[torch.cuda.CUDAGraph, torch.cuda.graph]:
        graph = torch.cuda.CUDAGraph()
        return graph, torch.cuda.graph(graph, pool=pool, stream=stream)

    return open_capture


class PieceSplitter:
    """Every attention layer's ``graph_split`` while one size is captured: ends the running
    piece at the call, records the call, and begins the next piece after it."""

    def __init__(self, outputs: AttentionOutputs, open_capture: OpenCapture) -> None:
        self.outputs = outputs
        self.open_capture = open_capture
        self.graphs: list = []
        self.calls: list[_AttentionCall] = []
        self._capture: contextlib.AbstractContextManager | None = None

    def begin(self) -> None:
        graph, self._capture = self.open_capture()
        # Entered by hand: a piece ends inside the model's forward, at the next attention call.
        self._capture.__enter__()
        self.graphs.append(graph)

    def end(self) -> None:
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.__exit__(None, None, None)

    def abandon(self) -> None:
        """After a failed capture: close it, whatever that raises (the caller re-raises the
        first error, the one that broke the capture)."""
        with contextlib.suppress(Exception):
            self.end()

    def __call__(self, layer: Attention, q, k, v, metadata) -> torch.Tensor:
        self.end()
        output = self.outputs.of(layer, q)
        self.calls.append(_AttentionCall(layer, q, k, v, output))
        self.begin()
        return output


def _set_split(layers: list[Attention], split: Callable[..., torch.Tensor] | None) -> None:
    for layer in layers:
        layer.graph_split = split


def _dummy_metadata(size: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """``size`` one-token requests in the null block; pieces do not read it, attention is cut."""
    ones = np.ones(size, dtype=np.int32)
    table = np.zeros((size, 1), dtype=np.int32)
    metadata, _ = build_attention_metadata(ones, ones * 0, table, block_size, device)
    return metadata


@torch.inference_mode()
def capture_decode_graphs(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    sizes: list[int],
    block_size: int,
) -> DecodeGraphs:
    """Capture ``model.forward`` reading ``input_ids[:B]`` and ``positions[:B]`` for each B.

    The two buffers must be the ones the runner fills every step (their addresses are baked
    into the graphs). Largest first, so the smaller sizes reuse the memory pool it grew.
    """
    layers = model.attention_layers()
    stream = torch.cuda.Stream(device=input_ids.device)
    open_capture = _cuda_capture(torch.cuda.graph_pool_handle(), stream)
    outputs = AttentionOutputs(max(sizes))
    graphs = {}
    try:
        for size in sorted(sizes, reverse=True):
            metadata = _dummy_metadata(size, block_size, input_ids.device)
            ids, pos = input_ids[:size], positions[:size]
            # Warm up on the capture stream first: lazy set-up (cuBLAS workspaces, kernel
            # selection) must not happen inside a capture.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _set_split(layers, outputs.skip)
                model.forward(ids, pos, metadata)
            torch.cuda.current_stream().wait_stream(stream)
            splitter = PieceSplitter(outputs, open_capture)
            graphs[size] = capture_pieces(model, ids, pos, metadata, splitter)
    finally:
        _set_split(layers, None)
    torch.cuda.synchronize(input_ids.device)
    return DecodeGraphs(graphs)


def capture_pieces(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    splitter: PieceSplitter,
) -> PiecewiseGraph:
    """One forward, captured piece by piece around its attention calls; leaves the layers'
    ``graph_split`` unset."""
    layers = model.attention_layers()
    _set_split(layers, splitter)
    splitter.begin()
    try:
        output = model.forward(input_ids, positions, metadata)
        splitter.end()
    except BaseException:
        splitter.abandon()
        raise
    finally:
        _set_split(layers, None)
    return PiecewiseGraph(splitter.graphs, splitter.calls, output)


@torch.inference_mode()
def capture_whole_decode_graphs(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    sizes: list[int],
    graph_metadata: Callable[[int], AttentionMetadata],
) -> DecodeGraphs:
    """Capture ``model.forward`` for each B, attention included (a backend with
    ``full_decode_graphs``, the KV cache bound): one launch replays a decode step.

    ``graph_metadata(B)`` is a step of B padding requests on the runner's fixed buffers (nothing
    read or written in the cache); the warm-up runs it for real, then the capture records it.
    """
    stream = torch.cuda.Stream(device=input_ids.device)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for size in sorted(sizes, reverse=True):
        metadata = graph_metadata(size)
        ids, pos = input_ids[:size], positions[:size]
        # Lazy set-up (cuBLAS workspaces, Triton compiles, the backend's decode tiles) happens
        # here, on the capture stream, not inside the capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model.forward(ids, pos, metadata)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            output = model.forward(ids, pos, metadata)
        graphs[size] = WholeGraph(graph, output)
    torch.cuda.synchronize(input_ids.device)
    return DecodeGraphs(graphs, whole=True)
