"""One rank's model runner: loads the model shard, owns the KV cache, keeps per-request state between
steps, turns a step plan into model inputs, runs the model and samples.

`execute_async` launches a step and returns at once with a PendingOutput; the sampled ids travel to the
host in the background, so the caller can plan (and launch) the next step before they arrive.
"""
from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from engine import kernels
from engine.config import ConfigError, EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.forward_context import MoEStep, forward_context
from engine.kernels.attention import CommonAttentionMetadata, KVCacheQuant
from engine.kv_cache_spec import FULL_GROUP, CacheGroupMetadata, CacheLayout, PagedSpec, StateSpec
from engine.layers.attention import Attention, KVCacheLayer
from engine.layers.fused_moe import uncapturable_exchanges
from engine.layers.sampler import Sampler, compute_logprobs
from engine.lockstep import DECODE_GRAPH, EAGER, PROMPT_GRAPHS
from engine.loader import ModelSource, build_model
from engine.parallel import enable_fused_all_reduce_norm, get_parallel_state
from engine.runner.cuda_graphs import (DecodeGraphs, capture_sizes, padded_step_tokens, step_path,
                                       uncapturable_layers)
from engine.runner.expert_load import expert_load_tracker
from engine.runner.device import resolve_dtype, resolve_residual_dtype
from engine.runner.input_batch import HostInputs, RunnerRequest, prepare_host_inputs, sampling_batch
from engine.runner.kv_cache import CachePools, kv_cache_budget_bytes
from engine.runner.drafting import make_draft_runner
from engine.runner.model_facts import format_op_table, model_facts
from engine.runner.pending_output import PendingOutput
from engine.runner.prompt_graphs import PromptGraphs, capture_prompt_graphs

logger = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _granularities(layer: KVCacheLayer) -> tuple[str, ...]:
    """The FP8 KV-scale granularities a cache layer can keep (MHA: both; MLA's latent cache: "tensor")."""
    return layer.fp8_kv_scale_granularities


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), show_progress: bool = True) -> None:
        self.config = config
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_size = config.block_size
        self.dtype = resolve_dtype(config.dtype, source.hf_config, device)
        self.kernel_backend = kernels.activate(config.kernel_backend, device,
                                               model_facts(source.hf_config, config, self.dtype))
        self.attn_backend = self.kernel_backend.attention
        if (config.fp8_kv_cache and self.attn_backend.name == "triton" and not torch.version.hip
                and torch.cuda.get_device_capability(device) < (8, 9)):
            raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs FP8 support in the GPU "
                              f"(compute capability 8.9 or newer; this one is "
                              f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})")
        torch.manual_seed(config.seed)
        self.residual_dtype = resolve_residual_dtype(config.residual_dtype, self.dtype)
        spec = config.speculative_config
        self.model = build_model(source, self.dtype, device, config.seed, show_progress, self.residual_dtype,
                                 config.quantization, mtp=spec is not None and spec.method == "mtp")
        self.drafter = make_draft_runner(self, config, device, show_progress)  # speculative decoding's model drafter
        if self.uses_cuda:  # every TP rank builds its runner at once: a collective set-up
            text = getattr(source.hf_config, "text_config", None) or source.hf_config
            enable_fused_all_reduce_norm(int(text.hidden_size), device)
        # Every layer with entries in the paged cache (MHA and MLA); each FP8 one owns its KV scales.
        self.cache_layers = [m for m in self.model.modules() if isinstance(m, KVCacheLayer)]
        self.attention_layers = [m for m in self.cache_layers if isinstance(m, Attention)]
        no_fp8 = sorted({type(m).__name__ for m in self.cache_layers if not m.supports_fp8_kv_cache})
        if config.fp8_kv_cache and no_fp8:
            raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported for this model: "
                              f"its {', '.join(no_fp8)} layers keep a full-precision cache only; "
                              f"use kv_cache_dtype='auto'")
        tensor_only = sorted({type(m).__name__ for m in self.cache_layers if "token" not in _granularities(m)})
        if config.fp8_kv_cache and config.kv_cache_scales == "token" and tensor_only:
            raise ConfigError(f"kv_cache_scales='token' is not supported for this model: its "
                              f"{', '.join(tensor_only)} layers keep an FP8 latent cache with one per-tensor "
                              f"scale per layer; use kv_cache_scales='tensor' or 'auto'")
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequest] = {}
        self.is_driver = get_parallel_state().tp_rank == 0
        self.num_kv_blocks = 0
        self.layout: CacheLayout | None = None
        self.state_tensors: list[torch.Tensor] = []
        self._group_keys = self.cache_group_keys() or [FULL_GROUP]
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        # The token counts MoE exchanges pad steps to (those of the decode graphs, captured or not: the same
        # on every rank of the EP group, which share one configuration).
        self.step_buckets = capture_sizes(config.max_num_seqs)
        self.expert_load = expert_load_tracker(self.model, config.expert_load_window)
        self._last_sampled: torch.Tensor | None = None  # device ids of the latest step, for pending tokens
        self._step = 0
        self.last_step_replayed = False  # whether the last forward pass was a decode-graph replay (diagnostics)
        self._unresolved: deque[PendingOutput] = deque()  # launched steps whose ids are not recorded yet
        logger.info("model loaded: %s, dtype %s (residual stream %s), device %s, kernels %s",
                    type(self.model).__name__, self.dtype, self.residual_dtype, device, self.kernel_backend.name)
        if self.kernel_backend.name != "torch":
            logger.info("kernel table:\n%s", format_op_table(self.kernel_backend))

    @property
    def uses_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- KV cache and graphs ------------------------------------------------------------------------
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.attn_backend.kv_fp8_dtype() if self.config.fp8_kv_cache else self.dtype

    @property
    def kv_scale_granularity(self) -> str | None:
        """None (no FP8 cache), "tensor" or "token" (KVCacheQuant); "auto" takes the checkpoint's per-tensor
        scales where every attention layer has them, else per-token scales; per-tensor scales (the
        checkpoint's or 1.0) where a layer takes no others (MLA's latent caches)."""
        if not self.config.fp8_kv_cache:
            return None
        if self.config.kv_cache_scales != "auto":
            return self.config.kv_cache_scales
        if any("token" not in _granularities(layer) for layer in self.cache_layers if layer.supports_fp8_kv_cache):
            return "tensor"
        with_scales = [layer.checkpoint_kv_scales for layer in self.attention_layers]
        use_tensor = with_scales and all(with_scales) and "tensor" in self.attn_backend.kv_scale_granularities
        return "tensor" if use_tensor else "token"

    def _spec_dtype(self, name: str, spec) -> torch.dtype:
        """A cache's dtype: its spec's, else the KV dtype for the "kv" caches (FP8 where asked), else the model's."""
        return spec.dtype or (self.kv_cache_dtype if name == "kv" else self.dtype)

    def cache_pools(self) -> CachePools:
        """The sizing of both cache pools from this model's layers (engine/runner/kv_cache.py)."""
        return CachePools(self.cache_layers, self.block_size, self._spec_dtype, self.kv_scale_granularity == "token",
                          self.config.max_num_seqs, self.config.max_num_batched_tokens or 8192)

    def cache_group_keys(self) -> list[tuple[int, int | None]]:
        return self.cache_pools().group_keys()

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block in every paged group together."""
        return sum(self.cache_pools().group_bytes_per_block().values())

    def cache_layout(self, num_token_blocks: int) -> CacheLayout:
        return self.cache_pools().layout(num_token_blocks)

    def determine_num_kv_blocks(self) -> int:
        """How many blocks' worth of tokens this rank can cache (the full group's blocks; the other groups
        are sized from it, see `cache_layout`): `num_kv_blocks` if given, else the most whose pools (state
        slots included) fit the memory budget, capped at what max_num_seqs full-length sequences could use."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.uses_cuda and self.config.kv_cache_memory_bytes is None:
            self.profile_run()
        budget = kv_cache_budget_bytes(self.config, self.device, get_parallel_state().ranks_on_device)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        return self.cache_pools().most_blocks_within(budget, blocks_per_seq * self.config.max_num_seqs + 1)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass over a worst-case batch (no cache yet), so that the activation peak is known."""
        num_tokens = min(self.config.max_num_batched_tokens or 8192, self.max_model_len * self.config.max_num_seqs)
        num_seqs = max(1, min(self.config.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        starts = np.concatenate(([0], np.cumsum(lens))).tolist()
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        keys = self.cache_group_keys() or [FULL_GROUP]
        metadata = self._attention_metadata(0, starts, lens, [0] * num_seqs,
                                            [np.zeros((num_seqs, 1), np.int32)] * len(keys),
                                            [np.zeros(num_tokens, np.int64)] * len(keys), [-1] * num_seqs, keys)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with forward_context(metadata, self.block_size, MoEStep(padded_step_tokens(num_tokens, self.step_buckets))):
            hidden = self.model(input_ids, positions)
        self.model.compute_logits(hidden[torch.tensor(starts[1:], device=self.device) - 1])
        del hidden
        torch.cuda.synchronize(self.device)

    def initialize_kv_cache(self, num_blocks: int) -> CacheLayout:
        """Allocate both pools for `num_blocks` blocks' worth of tokens, bind every layer's caches, and
        return the layout (the scheduler's block managers and state slots follow it)."""
        self.num_kv_blocks = num_blocks
        self.layout = layout = self.cache_layout(num_blocks)
        blocks = {group.key: group.num_blocks for group in layout.groups}
        self.state_tensors = []
        for layer in self.cache_layers:
            caches = {}
            for name, spec in layer.cache_specs().items():
                dtype = self._spec_dtype(name, spec)
                shape = (spec.shape(blocks[spec.group], self.block_size) if isinstance(spec, PagedSpec)
                         else (layout.num_state_slots, *spec.shape))
                # Zeroed: masked-out slots are multiplied by zero probabilities, and garbage could be NaN.
                # Written, not calloc'ed: on CPU, torch.zeros maps pages that become resident only when first
                # written, so the process would grow by up to the whole cache while serving (and could be
                # killed for it then).
                caches[name] = torch.empty(shape, dtype=dtype, device=self.device).zero_()
                if isinstance(spec, StateSpec):
                    self.state_tensors.append(caches[name])
            layer.bind_caches(caches)
            if "kv" in caches and layer.supports_fp8_kv_cache:
                layer.kv_quant = self._kv_quant(layer, blocks[layer.cache_specs()["kv"].group])
        logger.info("KV cache: %.2f GiB; %s%s", layout.total_bytes / 2**30, "; ".join(
            f"{'/'.join(g.kinds) or 'attention'} ({'every' if g.ratio == 1 else f'1 per {g.ratio}'} token"
            f"{f', window {g.window}' if g.window else ''}): {g.num_blocks} blocks = "
            f"{g.num_blocks * self.block_size * g.ratio} tokens" for g in layout.groups),
            f"; state pool: {layout.num_state_slots} slots of {layout.state_bytes_per_slot} bytes"
            if layout.num_state_slots else "")
        blocker = layout.prefix_caching_blocker
        if blocker and self.config.enable_prefix_caching:
            logger.info("prefix caching is off for this model: %s", blocker)
        if self.config.fp8_kv_cache:
            logger.info("KV cache: %s with %s scales", self.kv_cache_dtype, self.kv_scale_granularity)
        state = get_parallel_state()
        uncapturable = uncapturable_exchanges(self.model, self.dtype) if state.expert_parallel else []
        if uncapturable and self.uses_cuda and not self.config.enforce_eager:
            logger.info("expert parallelism: decode steps run eagerly (the %s exchange keeps its own "
                        "device-side counts and is not captured in CUDA graphs)", uncapturable[0])
        eager_layers = uncapturable_layers(self.cache_layers, layout)
        if eager_layers and self.uses_cuda and not self.config.enforce_eager:
            logger.info("decode steps run eagerly: %s layers cannot be captured in a CUDA graph yet",
                        ", ".join(eager_layers))
        eager_drafter = self.drafter is not None and self.drafter.needs_eager_target
        if eager_drafter and self.uses_cuda and not self.config.enforce_eager:
            logger.info("decode steps run eagerly: the EAGLE3 drafter reads the target's layer inputs, which "
                        "decode graphs do not keep")
        if (self.uses_cuda and not self.config.enforce_eager and self.attn_backend.supports_cuda_graphs
                and not eager_layers and not eager_drafter
                and not state.host_collectives  # gloo's collectives cannot be captured
                and not uncapturable):
            # Every rank of an EP group captures the same sizes in the same order: their warm-up passes'
            # exchanges match.
            graphs = DecodeGraphs(self.model, self.attn_backend, self.block_size, self.max_model_len,
                                  self.config.max_num_seqs, self.device, self._group_keys)
            try:
                graphs.capture()
                self.graphs = graphs
            except RuntimeError as exc:  # e.g. a collective library that cannot be captured
                logger.warning("decode graph capture failed, running eagerly: %s", exc)
                torch.cuda.synchronize(self.device)
        if self.graphs is not None and self.config.cuda_graph_prompt_steps != "off":
            self.prompt_graphs = capture_prompt_graphs(self.model, self.cache_layers, self.block_size,
                                                       self.config.max_num_batched_tokens or 8192, self.dtype,
                                                       self.config.cuda_graph_prompt_steps)
        if self.expert_load is not None:
            self.expert_load.reset()
        return layout

    def _kv_quant(self, layer: KVCacheLayer, num_blocks: int) -> KVCacheQuant | None:
        granularity = self.kv_scale_granularity
        if granularity is None:
            return None
        if granularity == "tensor":
            return KVCacheQuant("tensor", layer.k_scale.data, layer.v_scale.data)
        shape = layer.kv_scale_shape(num_blocks, self.block_size)
        return KVCacheQuant("token", torch.ones(shape, dtype=torch.float32, device=self.device),
                            torch.ones(shape, dtype=torch.float32, device=self.device))

    # ---- one step -------------------------------------------------------------------------------------
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput | None:
        return self.execute_async(scheduled).result()

    @torch.inference_mode()
    def execute_async(self, scheduled: SchedulerOutput, before_sampling=None) -> PendingOutput:
        """Launch a step, possibly before earlier steps' ids reached the host. Earlier steps are waited
        for only where this one needs them: a request with penalties (token history on the host), or
        whose newest pending token is older than the latest step (its input can only come from there); and
        all of them around a verify step: drafts follow a request's newest token on the host, and how many an
        earlier verify step kept moves the cache positions that this plan's counts already follow (a TP peer
        launches a plan before recording the previous step). `before_sampling`: run between the forward pass's
        launch and the sampling inputs (the engine collects the previous step there, for the grammar masks)."""
        if scheduled.spec_token_ids or any(pending.verifies for pending in self._unresolved):
            self.resolve_until(self._step)
        self._update_states(scheduled)
        self._step += 1
        if scheduled.is_empty:
            if scheduled.dummy:
                self._dummy_forward(scheduled)
                if self.drafter is not None:
                    self.drafter.empty_passes(scheduled)
            return self._track(PendingOutput(self, self._step, RunnerOutput(), [], None, None))
        needed = 0
        for request_id in scheduled.num_scheduled_tokens:
            request = self.requests[request_id]
            if request.num_pending and (request.params.has_penalties or request.pending_step != self._step - 1):
                needed = max(needed, request.pending_step)
        if needed:
            self.resolve_until(needed)
        host = prepare_host_inputs(self.requests, scheduled.num_scheduled_tokens, self.block_size,
                                   tuple(key[0] for key in self._group_keys))
        grammar = scheduled.structured_output
        if grammar is not None and before_sampling is None:  # its token masks fill during the forward pass
            grammar.start()
        hidden = self._forward(host, scheduled)
        if before_sampling is not None:
            before_sampling()
        if self.expert_load is not None:
            self.expert_load.step()
        output = RunnerOutput()
        sampled_host, event = None, None
        if host.sampling_requests:
            rows, selected = host.logits_indices, hidden
            if len(rows) < hidden.shape[0] or rows[-1] != len(rows) - 1:  # else every row, in order
                selected = hidden[self._to_device(np.asarray(rows))]
            logits = self.model.compute_logits(selected)
            batch = sampling_batch(host.sampling_requests, host.sampling_rows, self.eos_token_ids, grammar)
            sampled, logprobs = self.sampler(logits, batch)
            self._last_sampled = sampled
            first = 0
            for request, rows in zip(host.sampling_requests, host.sampling_rows):
                request.num_pending += 1
                # (a verify step's pending token is not one row: the engine collects such steps before the next)
                request.pending_row, request.pending_step = (first if rows == 1 else -1), self._step
                output.request_ids.append(request.request_id)
                first += rows
            sampled_host, event = self._to_host(sampled)
        for request_id, (rows, targets) in host.prompt_logprob_rows.items():
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            num_top = self.requests[request_id].params.prompt_logprobs
            output.prompt_logprobs[request_id] = compute_logprobs(
                logits, torch.tensor(targets, device=self.device), num_top)
        pending = self._track(PendingOutput(self, self._step, output, host.sampling_requests, sampled_host, event,
                                            host.sampling_rows, logprobs if host.sampling_requests else None))
        if self.drafter is not None:  # the drafts follow the tokens this step keeps: wait for them
            self.resolve_until(self._step)
            output.draft_token_ids = self.drafter.draft(host, hidden, scheduled)
        return pending

    def _track(self, pending: PendingOutput) -> PendingOutput:
        self._unresolved.append(pending)
        return pending

    def resolve_until(self, step: int) -> None:
        """Record the sampled ids of every launched step up to `step`, oldest first."""
        while self._unresolved and self._unresolved[0].step <= step:
            self._unresolved.popleft()._record()

    def step_mode(self, scheduled: SchedulerOutput) -> tuple[int, bool]:
        """This rank's lockstep vote on `scheduled` (before it is launched; every DP rank runs the step the one
        way all can, engine/lockstep.py): DECODE_GRAPH, PROMPT_GRAPHS or EAGER, and whether it has no
        prompt-step graphs. A rank with nothing to run can follow the others in any way it has graphs for."""
        return self._mode(scheduled), self.prompt_graphs is None

    def _mode(self, scheduled: SchedulerOutput) -> int:
        if scheduled.is_empty:
            return DECODE_GRAPH if self.graphs is not None else PROMPT_GRAPHS if self.prompt_graphs else EAGER
        if self.graphs is not None and self.graphs.can_replay(scheduled, self.requests):
            return DECODE_GRAPH
        if self.prompt_graphs is not None and self.prompt_graphs.bucket(scheduled.total_num_scheduled_tokens):
            return PROMPT_GRAPHS
        return EAGER

    def _step_tokens(self, scheduled: SchedulerOutput) -> int:
        """The most tokens of this step on any rank of the EP group: every rank's MoE exchanges pad to it."""
        return max(scheduled.ep_num_tokens, scheduled.total_num_scheduled_tokens, 1)

    def _step_path(self, scheduled: SchedulerOutput, host: HostInputs | None) -> tuple[str, int]:
        decode_only = host is not None and host.is_decode_only
        path = step_path(scheduled.ep_mode, self._step_tokens(scheduled), decode_only, self.graphs,
                         self.prompt_graphs, self.step_buckets)
        if path[0] == "eager" and self.graphs is not None and decode_only:
            _log_once("a decode step ran eagerly: its EP group's largest batch is above the decode graphs' "
                      f"{self.graphs.max_batch} rows, or another DP rank in lockstep ran its step eagerly")
        return path

    def _dummy_forward(self, scheduled: SchedulerOutput) -> None:
        """The forward pass of a lockstep step on a DP rank that has nothing to run: only padding rows, no
        cache writes, no sampling; its MoE layers join the other ranks' exchanges, padded as theirs are."""
        kind, size = self._step_path(scheduled, None)
        self.last_step_replayed = kind != "eager"
        if kind == "decode":
            self.graphs.run_dummy(size)
        elif kind == "prompt":
            self.prompt_graphs.run_dummy(size)
        else:
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
            with forward_context(None, self.block_size, MoEStep(size, valid_tokens=0)):  # attention skips it
                self.model(token, token)
        if self.expert_load is not None:
            self.expert_load.step()

    def _forward(self, host: HostInputs, scheduled: SchedulerOutput) -> torch.Tensor:
        kind, size = self._step_path(scheduled, host)
        self.last_step_replayed = kind == "decode"
        if kind == "decode":
            return self.graphs.run(host, self._last_sampled, size)
        input_ids = self._to_device(host.input_ids)
        if host.pending_positions:
            assert self._last_sampled is not None
            input_ids[self._to_device(np.asarray(host.pending_positions))] = \
                self._last_sampled[self._to_device(np.asarray(host.pending_rows))]
        positions = self._to_device(host.positions)
        metadata = self._attention_metadata(host.num_decodes, host.query_start_loc, host.seq_lens,
                                            host.num_computed, [host.block_table, *host.group_tables],
                                            [host.slot_mapping, *host.group_slot_mappings], host.state_slots,
                                            self._group_keys)
        verify = (tuple(index for index, request in enumerate(host.requests) if request.spec_token_ids)
                  if scheduled.spec_token_ids else ())
        if kind == "prompt":
            return self.prompt_graphs.run(input_ids, positions, metadata, size, verify)
        with forward_context(metadata, self.block_size, MoEStep(size), verify):
            return self.model(input_ids, positions)

    def keep_verified(self, slot: int, num_kept: int) -> None:
        """A verify step on state slot `slot` kept `num_kept` tokens: every stateful layer's state follows."""
        for layer in self.cache_layers:
            keep = getattr(layer, "keep_verified", None)
            if keep is not None:
                keep(slot, num_kept)

    def _update_states(self, scheduled: SchedulerOutput) -> None:
        for request_id in scheduled.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduled.new_requests:
            self.requests[new.request_id] = RunnerRequest(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens,
                group_block_ids=[list(b) for b in new.group_block_ids], state_slot=new.state_slot)
            if new.state_slot >= 0:  # a fresh state: admitted, or re-admitted after a preemption
                for tensor in self.state_tensors:
                    tensor[new.state_slot].zero_()
        for request_id, drafts in scheduled.spec_token_ids.items():
            self.requests[request_id].spec_token_ids = list(drafts)
        for cached in scheduled.cached_requests:
            request = self.requests[cached.request_id]
            assert request.num_computed_tokens == cached.num_computed_tokens, (
                f"runner and scheduler disagree on {cached.request_id}: "
                f"{request.num_computed_tokens} != {cached.num_computed_tokens}")
            request.block_ids.extend(cached.new_block_ids)
            for blocks, new_blocks in zip(request.group_block_ids, cached.new_group_block_ids):
                blocks.extend(new_blocks)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.uses_cuda:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _to_host(self, tensor: torch.Tensor):
        """A pinned host copy that completes in the background, and the event marking its completion."""
        if not self.uses_cuda:
            return tensor, None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _attention_metadata(self, num_decodes, starts, seq_lens, computed, tables: list[np.ndarray],
                            slot_mappings: list[np.ndarray], state_slots: list[int], keys: list):
        """The step's metadata: `tables` / `slot_mappings` per paged group (`keys`, the first group's are
        also the metadata's own), `state_slots` per sequence."""
        block_table, slot_mapping = self._to_device(tables[0]), self._to_device(slot_mappings[0])
        groups = {}
        for index, key in enumerate(keys):
            table = block_table if index == 0 else self._to_device(tables[index])
            slots = slot_mapping if index == 0 else self._to_device(slot_mappings[index])
            groups[key] = CacheGroupMetadata(key[0], key[1], self.block_size, table, slots, tables[index])
        common = CommonAttentionMetadata(
            num_seqs=len(seq_lens),
            num_decodes=num_decodes,
            num_tokens=starts[-1],
            query_start_loc=self._to_device(np.asarray(starts, dtype=np.int32)),
            seq_lens=self._to_device(np.asarray(seq_lens, dtype=np.int32)),
            block_table=block_table,
            slot_mapping=slot_mapping,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=computed,
            groups=groups,
            state_slots=(self._to_device(np.asarray(state_slots, dtype=np.int64))
                         if self.layout is not None and self.layout.num_state_slots else None),
            state_slots_cpu=list(state_slots),
        )
        return self.attn_backend.build_metadata(common, self.block_size)

    def release(self) -> None:
        """Let go of everything this runner holds on its device: the decode graphs, the caches (unbound from
        the layers too, which reference cycles inside the model may keep alive until the next garbage
        collection) and the model. Their memory returns once the caller collects garbage; the runner
        cannot run another step. Calling it again does nothing."""
        self._unresolved.clear()  # launched steps refer back to the runner
        self.requests.clear()
        self._last_sampled = None
        if self.graphs is not None:
            self.graphs.outputs.clear()  # in the graphs' memory pool, which goes with the last graph
            self.graphs.graphs.clear()
            self.graphs = None
        if self.prompt_graphs is not None:
            self.prompt_graphs.release()
            self.prompt_graphs = None
        for layer in self.cache_layers:
            layer.bind_caches({})
            layer.kv_quant = None
        self.state_tensors = []
        self.layout, self.num_kv_blocks = None, 0
        self.cache_layers, self.attention_layers = [], []
        self.expert_load = None  # it holds the MoE layers
        self.model = None
