"""Piecewise CUDA graphs for steps with prompt tokens (prefill, mixed prefill + decode, speculative verify).

A decode graph holds a whole forward pass; a step with prompt tokens cannot, because its attention depends on
every sequence's query length. Here the forward pass is captured once per token bucket as a chain of graphs
that break at each attention layer: graph 0 (embedding to the first layer's q/k/v), the first attention run
eagerly over the step's real metadata, graph 1 (its output projection, MLP or MoE, the next layer's q/k/v),
and so on. A step of n tokens pads to the smallest bucket >= n, copies its ids and positions into that
bucket's buffers and alternates replays with eager attention calls over its first n rows. Everything between
two attention layers (GEMMs, norms, the MoE layers with their routing and exchanges, TP all-reduces) then
costs one graph launch instead of dozens of kernel launches from Python, which is what bounds such steps
once TP has halved their kernels.

Padding rows: their ids and positions are whatever the buffers held (valid ids), their attention output is
whatever the shared output buffer held (finite: zeros at first, real outputs after); the MoE layers read how
many rows are real (`MoEStep.valid_tokens`), so padding reaches no expert; callers read only the first n rows.

Memory: the tensors an attention call reads (q, k, v, the rope positions) live in the graph before it. They
are kept as non-owning views, so the next graph's capture may reuse their memory: at replay that graph runs
only after the attention call has read them (one stream). Every layer writes into one shared output buffer,
and each chain's output (the hidden states) is a non-owning view too, read before any other replay: all the
chains together hold about the largest one's activations.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.forward_context import MoEStep, forward_context
from engine.layers.attention import Attention
from engine.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)

# Token buckets of prompt steps: every 64 tokens up to 512, every 256 above, so that padding costs at most
# a few per cent of a large step (whose dense GEMMs compute every padded row).
_FINE_UP_TO, _FINE_STEP, _COARSE_STEP = 512, 64, 256


def prompt_buckets(max_num_batched_tokens: int) -> list[int]:
    """The token counts prompt steps pad to, up to the step budget rounded up to a multiple of 64 (the
    largest step an expert-parallel exchange is sized for)."""
    top = -(-max_num_batched_tokens // 64) * 64
    sizes = list(range(_FINE_STEP, _FINE_UP_TO + 1, _FINE_STEP)) + list(
        range(_FINE_UP_TO + _COARSE_STEP, top + 1, _COARSE_STEP))
    return sorted({size for size in sizes if size < top} | {top})


def non_owning(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor`'s memory that does not keep it allocated (its storage may be reused later)."""
    storage = tensor.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        weak, tensor.storage_offset(), tensor.shape, tensor.stride())


@dataclass
class _AttentionCall:
    """One attention layer's eager call between two graphs: its inputs (non-owning views into the graph
    before it) and the output rows the graph after it reads."""
    layer: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    rope: tuple | None
    out: torch.Tensor

    def __call__(self, rows: int) -> None:
        rope = None if self.rope is None else (self.rope[0][:rows], *self.rope[1:])
        result = self.layer(self.query[:rows], self.key[:rows], self.value[:rows], rope=rope)
        self.out[:rows].copy_(result)


@dataclass
class _Pieces:
    graphs: list = field(default_factory=list)
    calls: list[_AttentionCall] = field(default_factory=list)
    output: torch.Tensor | None = None


class _Recorder:
    """Captures one bucket's chain: `split` ends the current graph at an attention layer, notes the call and
    starts the next graph. Set as the forward context's `pieces` during capture only."""

    def __init__(self, pool, out_buffer: torch.Tensor) -> None:
        self.pool, self.out_buffer = pool, out_buffer
        self.pieces = _Pieces()
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self._graph.capture_end()
        self.pieces.graphs.append(self._graph)
        self._graph = None

    def abort(self) -> None:
        """After a failed capture: end the open one, if any, so the stream leaves capture mode."""
        if self._graph is not None:
            try:
                self._graph.capture_end()
            except RuntimeError:
                pass
            self._graph = None

    def split(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rope) -> torch.Tensor:
        self.end()
        width = layer.num_heads * layer.head_size
        out = self.out_buffer[:query.shape[0] * width].view(query.shape[0], width)
        rope = None if rope is None else tuple(non_owning(x) if isinstance(x, torch.Tensor) else x for x in rope)
        self.pieces.calls.append(_AttentionCall(layer, non_owning(query), non_owning(key), non_owning(value),
                                                rope, out))
        self.begin()
        return out


class PromptGraphs:
    """The chains of every bucket, captured largest first over fixed-address ids and positions."""

    def __init__(self, model, attention_layers, block_size: int, max_num_batched_tokens: int,
                 dtype: torch.dtype) -> None:
        self.model, self.block_size = model, block_size
        device = next(model.parameters()).device
        self.sizes = prompt_buckets(max_num_batched_tokens)
        self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.valid_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        width = max(layer.num_heads * layer.head_size for layer in attention_layers)
        self.out_buffer = torch.zeros(self.max_tokens * width, dtype=dtype, device=device)
        self.chains: dict[int, _Pieces] = {}
        self.num_replays = 0

    def bucket(self, num_tokens: int) -> int | None:
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.input_ids.device)
        for size in reversed(self.sizes):  # largest first: the smaller chains reuse its memory
            ids, positions = self.input_ids[:size], self.positions[:size]
            self.valid_tokens.fill_(size)
            moe = MoEStep(size, self.valid_tokens)
            with forward_context(None, self.block_size, moe):  # warm-up: compile and tune (attention skipped)
                self.model(ids, positions)
            torch.cuda.synchronize()
            recorder = _Recorder(pool, self.out_buffer)
            stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(stream), forward_context(None, self.block_size, moe) as context:
                    context.pieces = recorder
                    recorder.begin()
                    output = self.model(ids, positions)
                    recorder.end()
            except BaseException:
                recorder.abort()
                raise
            torch.cuda.current_stream().wait_stream(stream)
            # Not kept allocated: a step reads it before the next replay, and the smaller chains reuse it.
            recorder.pieces.output = non_owning(output)
            del output
            self.chains[size] = recorder.pieces
        torch.cuda.synchronize()
        logger.info("captured prompt-step graphs for token buckets %s (%d graphs each)", self.sizes,
                    len(self.chains[self.sizes[-1]].graphs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, size: int,
            verify_seqs: tuple[int, ...] = ()) -> torch.Tensor:
        """Hidden states [n, hidden] of a step of n = len(input_ids) tokens, replayed from bucket `size`."""
        rows = input_ids.shape[0]
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.valid_tokens.fill_(rows)
        chain = self.chains[size]
        self.num_replays += 1
        with forward_context(metadata, self.block_size, MoEStep(size, self.valid_tokens), verify_seqs):
            for graph, call in zip(chain.graphs, chain.calls):
                graph.replay()
                call(rows)
            chain.graphs[-1].replay()
        return chain.output[:rows]

    def run_dummy(self, size: int) -> None:
        """A lockstep DP rank's step with nothing to run, replayed from bucket `size`'s chain as the other
        ranks replay theirs: padding rows only (no attention metadata, so the calls between the graphs give
        zeros for one row; the MoE layers route none of them), so that its exchanges join the others'."""
        self.valid_tokens.fill_(0)
        chain = self.chains[size]
        with forward_context(None, self.block_size, MoEStep(size, self.valid_tokens)):
            for graph, call in zip(chain.graphs, chain.calls):
                graph.replay()
                call(1)
            chain.graphs[-1].replay()

    def release(self) -> None:
        self.chains.clear()



def capture_prompt_graphs(model, cache_layers, block_size: int, max_num_batched_tokens: int, dtype: torch.dtype,
                          mode: str = "auto") -> PromptGraphs | None:
    """The chains for a model whose cache layers are all `Attention` (the layers that split them); with
    `mode` "auto", for mixture-of-experts models only. Every rank of a lockstep DP engine captures the same
    buckets in the same order (their capture passes exchange tokens), and replays one bucket in a step, an
    idle rank its padding rows (`run_dummy`). None, with the reason logged, where steps with prompt tokens
    stay eager."""
    others = sorted({type(m).__name__ for m in cache_layers if not isinstance(m, Attention)})
    dense = mode == "auto" and not any(isinstance(m, FusedMoE) for m in model.modules())
    if others or dense:
        reason = (f"{', '.join(others)} layers do not split prompt-step graphs" if others
                  else "a dense model (cuda_graph_prompt_steps='auto' turns them on for MoE models)")
        logger.info("steps with prompt tokens run eagerly: %s", reason)
        return None
    graphs = PromptGraphs(model, cache_layers, block_size, max_num_batched_tokens, dtype)
    try:
        graphs.capture()
    except RuntimeError as exc:
        logger.warning("prompt-step graph capture failed, running such steps eagerly: %s", exc)
        torch.cuda.synchronize()
        return None
    return graphs
