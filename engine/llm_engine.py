"""The engine loop for one engine instance: requests in, step plans to the executor, outputs out.

The executor runs the plans: in-process here (one ModelRunner), or on Ray rank actors (atom_ray).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import Protocol

from engine.config import ConfigError, EngineConfig
from engine.core.block_manager import KVCacheManager
from engine.core.output_processor import OutputProcessor
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.errors import InvalidRequestError
from engine.kv_cache_spec import CacheLayout
from engine.lockstep import BUSY, IDLE, STOP, Lockstep
from engine.loader import ModelSource, resolve_model
from engine.outputs import RequestOutput
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams
from engine.spec_decode.speculator import DrafterSpeculator, NgramSpeculator, Speculator
from engine.structured_output.manager import StructuredOutputManager, wait_for
from engine.tokenizer import Tokenizer, eos_ids_from_config

logger = logging.getLogger(__name__)

# A grammar that is not cached compiles in a pool while its request waits. The next step waits this long at
# most for it (once), so that a grammar that compiles quickly (most: under a millisecond) makes that step rather
# than the one after; an engine with nothing else to run waits for one up to IDLE_GRAMMAR_WAIT_S at a time.
NEW_GRAMMAR_WAIT_S = 0.005
IDLE_GRAMMAR_WAIT_S = 0.01
# Tokens per step by device. A step's time is what every running stream waits between two tokens while a
# prompt is prefilled: on a CPU, 512 prompt tokens of SmolLM2-135M take 1-7 s (longer contexts cost more).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}


class Executor(Protocol):
    def determine_num_kv_blocks(self) -> int: ...
    def initialize_kv_cache(self, num_blocks: int) -> "CacheLayout | None": ...
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput: ...
    # in-process: has .result(); Ray: an ObjectRef. `before_sampling` (only where `samples_after_forward`):
    # called between the launch of the forward pass and the building of the sampling inputs.
    def execute_async(self, scheduled: SchedulerOutput, before_sampling=None): ...
    @property
    def samples_after_forward(self) -> bool: ...
    # (this rank's lockstep vote: engine/lockstep.py's mode for its step, and whether it has no prompt graphs)
    def step_mode(self, scheduled: SchedulerOutput) -> tuple[int, bool]: ...
    def expert_load(self) -> dict | None: ...
    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One ModelRunner in this process (tensor_parallel_size=1)."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 eos_token_ids: frozenset[int], show_progress: bool = True) -> None:
        from engine.runner.device import resolve_device
        from engine.runner.model_runner import ModelRunner
        if config.tensor_parallel_size != 1 or config.data_parallel_size != 1:
            raise ConfigError("tensor_parallel_size > 1 or data_parallel_size > 1 needs Ray rank actors: use "
                              "atom_ray.start(...) or `atom-ray serve` instead of engine.LLM")
        self.runner = ModelRunner(config, source, resolve_device(config.device), max_model_len,
                                  eos_token_ids, show_progress)

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> CacheLayout:
        return self.runner.initialize_kv_cache(num_blocks)

    @property
    def runs_asynchronously(self) -> bool:
        """Whether launching a step returns before it finishes (a GPU), so running ahead pays."""
        return self.runner.uses_cuda

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(scheduled)

    def execute_async(self, scheduled: SchedulerOutput, before_sampling=None):
        return self.runner.execute_async(scheduled, before_sampling)

    @property
    def samples_after_forward(self) -> bool:
        """Whether `execute_async` can call back between the forward pass and sampling (one rank: no peer
        needs the plan, structured-output masks included, before the launch)."""
        return True

    def step_mode(self, scheduled: SchedulerOutput) -> tuple[int, bool]:
        return self.runner.step_mode(scheduled)

    def expert_load(self) -> dict | None:
        return self.runner.expert_load.report() if self.runner.expert_load is not None else None

    def shutdown(self) -> None:
        """Give the model's memory back (weights, KV cache, graphs), so that another engine in this process
        can have it. Idempotent. (It joined no process group: tensor_parallel_size is 1.)"""
        import gc

        import torch
        if self.runner.uses_cuda:
            torch.cuda.synchronize(self.runner.device)  # a step launched ahead may still read the caches
        self.runner.release()
        gc.collect()  # the model's modules refer to each other (weight loaders are bound methods)
        if self.runner.uses_cuda:
            torch.cuda.empty_cache()
            # The next engine's profiling pass reads its activation peak off this counter (kv_cache.py).
            torch.cuda.reset_peak_memory_stats(self.runner.device)


def default_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The step budget for this device (at least max_num_seqs, so every running sequence decodes each step;
    without chunked prefill, at least a whole prompt)."""
    from engine.runner.device import resolve_device
    budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS[resolve_device(config.device).type], config.max_num_seqs)
    return budget if config.enable_chunked_prefill else max(budget, max_model_len)


def check_parallel_layout(config: EngineConfig, hf_config) -> None:
    """Refuse, naming the fields, a parallel layout that the model cannot take."""
    from engine.layers.fused_moe import num_routed_experts
    if config.enable_expert_parallel and num_routed_experts(hf_config) == 0:
        architectures = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
        raise ConfigError(f"enable_expert_parallel=True, but {architectures[0]} has no experts (it is not a "
                          "mixture-of-experts model); leave enable_expert_parallel off")


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if limit is None:
            raise ConfigError("the model config has no max_position_embeddings; set max_model_len")
        return int(limit)
    if limit is not None and config.max_model_len > limit:
        raise ConfigError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                          f"max_position_embeddings ({limit})")
    return config.max_model_len


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_factory=InProcessExecutor, show_progress: bool = True) -> None:
        self.config = config
        self.source = resolve_model(config.model, config.load_format, config.hf_overrides)
        check_parallel_layout(config, self.source.hf_config)
        # Lockstep DP ranks agree on each step before launching it (engine/lockstep.py) and one with nothing
        # to run runs a dummy step, so that every rank's MoE layers join the same token exchanges.
        self.lockstep = Lockstep() if config.lockstep else None
        self.stop_requested = False  # lockstep: this rank asks every rank to stop at the next agreement
        self.lockstep_status = BUSY  # lockstep: what the latest agreement decided
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else eos_ids_from_config(self.source))
        self.max_model_len = resolve_max_model_len(config, self.source.hf_config)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_max_num_batched_tokens(
            config, self.max_model_len)
        if self.max_num_batched_tokens < config.max_num_seqs and config.max_num_batched_tokens is not None:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                              f"max_num_seqs ({config.max_num_seqs}) so that every running sequence can decode")
        config = dataclasses.replace(config, max_num_batched_tokens=self.max_num_batched_tokens)
        self.executor = executor_factory(config, self.source, self.max_model_len,
                                         self.eos_token_ids, show_progress=show_progress)
        num_blocks = self.executor.determine_num_kv_blocks()
        needed = -(-self.max_model_len // config.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {config.block_size} tokens, fewer than one sequence "
                f"of max_model_len={self.max_model_len} needs ({needed}); lower max_model_len or give the "
                "cache more memory (num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization)")
        # The pools as the runners allocated them (an executor that reports none has one full group).
        layout = self.executor.initialize_kv_cache(num_blocks) or CacheLayout.single(num_blocks, config.block_size)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.source.hf_config.vocab_size,
                                                         self.eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                            config.enable_chunked_prefill, config.long_prefill_token_threshold,
                            config.speculative_config.lookahead_tokens if config.speculative_config else 0),
            KVCacheManager(layout, config.enable_prefix_caching), self.structured_output)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seed_source = random.Random(config.seed)
        self.speculator = self._speculator(layout)
        # Running a step ahead needs its input before the previous step's tokens are on the host; a
        # speculating step's drafts follow those tokens, so with speculation each step waits for the last,
        # except, with n-gram lookup, while no request can draft (`_speculation_off`).
        asynchronous = getattr(self.executor, "runs_asynchronously", False)
        self._run_ahead = asynchronous and self.speculator is None
        self._run_ahead_when_not_drafting = (asynchronous and self.speculator is not None
                                             and self.speculator.config.method == "ngram")
        self._in_flight = None  # (plan, pending output) of a step launched but not yet collected
        self._ids = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generated_tokens_total = 0

    def _speculator(self, layout: CacheLayout) -> Speculator | None:
        """The drafter of config.speculative_config, or None. A verify step that keeps fewer drafts than it
        ran moves the request's cache position back; the models whose caches cannot move back are refused."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        blockers = []
        movable = {"gdn_conv_state", "gdn_recurrent_state"}  # Gated DeltaNet moves its states back
        other = [kind for kind in layout.state_kinds if kind not in movable]
        if layout.num_state_slots and (other or not layout.state_kinds):
            blockers.append(f"per-request state ({', '.join(other) or 'of an unknown kind'}) that a rejected "
                            "draft would leave advanced")
        if any(group.ratio != 1 for group in layout.groups):
            blockers.append("compressed caches (one entry per several tokens)")
        if blockers:
            raise ConfigError(f"speculative_config: speculative decoding is not supported for this model yet: it "
                              f"has {'; and '.join(blockers)}")
        if spec.method in ("mtp", "eagle3"):  # the runner drafts with the model drafter
            return DrafterSpeculator(spec, self.max_model_len)
        return NgramSpeculator(spec, self.max_model_len)

    def _load_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; a dummy-weight model from a bare config.json runs without one."""
        if (self.config.tokenizer is None and self.source.format == "dummy" and self.source.gguf is None
                and not Tokenizer.has_tokenizer_files(self.source.folder)):
            logger.warning("no tokenizer in %s: prompts must be token ids, outputs have no text", self.source.folder)
            return None
        return Tokenizer.from_source(self.source, self.config.tokenizer)

    # ---- requests ---------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids). Accepts a string, a list of token ids, or a dict with
        'prompt' or 'prompt_token_ids'."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer (dummy weights from a bare config); "
                                          "send prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.source.hf_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, resume: ResumeState | None = None) -> None:
        """Queue a request. `resume`: it continues a request that another engine ran until it failed, with the
        output tokens already delivered (engine/resume.py); only the samples it lists run."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        vocab_size = self.source.hf_config.vocab_size
        params.check_for_model(vocab_size)
        if resume is not None:
            resume.check(params.n, vocab_size)
        if params.top_k >= vocab_size:  # keeps every token: the same as no top-k
            params = dataclasses.replace(params, top_k=0)
        if request_id in self.output_processor.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        self._check_length(len(token_ids), resume.max_num_tokens if resume is not None else 0)
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        resumed = {sample.index: sample for sample in resume.samples} if resume is not None else None
        samples, delivered = {}, {}
        for index in sorted(resumed) if resumed is not None else range(params.n):
            sample_id = request_id if params.n == 1 else f"{request_id}/{index}"
            seed = params.seed + index if params.seed is not None else self._seed_source.getrandbits(63)
            samples[sample_id] = dataclasses.replace(params, seed=seed, n=1)
            if resumed is not None:
                delivered[sample_id] = resumed[index]
        # Each sample its own matcher; the grammar compiles once (cached) while the request waits. A resumed
        # sample's matcher takes its delivered tokens first.
        grammars = {sample_id: self.structured_output.request(
                        params.structured_outputs, delivered[sample_id].token_ids if sample_id in delivered else ())
                    if params.structured_outputs is not None else None for sample_id in samples}
        self.output_processor.add_request(request_id, text, token_ids, samples, arrival_time, delivered or None)
        for sample_id, sample_params in samples.items():
            request = Request(sample_id, token_ids, sample_params, max_tokens, self.eos_token_ids, arrival_time,
                              grammars[sample_id])
            if sample_id in delivered:  # outputs already generated, as after a preemption
                request.token_ids.extend(delivered[sample_id].token_ids)
            self.scheduler.add_request(request)
        self.num_prompt_tokens_total += len(token_ids)

    def _check_length(self, num_prompt_tokens: int, num_resumed_tokens: int) -> None:
        """Refuse a prompt (with the outputs a resumed request already has) that leaves no room to generate, or
        that one step cannot prefill with chunked prefill disabled."""
        total = num_prompt_tokens + num_resumed_tokens
        what = f"the prompt has {num_prompt_tokens} tokens" if not num_resumed_tokens else (
            f"the prompt ({num_prompt_tokens} tokens) and the {num_resumed_tokens} tokens already generated "
            f"make {total}")
        if total >= self.max_model_len:
            raise InvalidRequestError(f"{what} but the context length (max_model_len) is {self.max_model_len}, "
                                      "which leaves no room to generate")
        if not self.config.enable_chunked_prefill and total > self.max_num_batched_tokens:
            raise InvalidRequestError(f"{what}, more than max_num_batched_tokens ({self.max_num_batched_tokens}) "
                                      "with chunked prefill disabled")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; returns its final output (finish_reason 'abort')."""
        sample_ids = self.output_processor.sample_ids(request_id)
        final = self.output_processor.finish_aborted(request_id)
        self.scheduler.abort_requests(sample_ids)
        return final

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    # ---- the loop -----------------------------------------------------------------------------------
    # A step is three phases, so that a distributed coordinator can dispatch step N+1 to the workers
    # before it detokenizes step N: schedule_step -> (executor) -> update_step -> process_step.
    def step(self) -> list[RequestOutput]:
        self._wait_for_new_grammars()
        scheduled = self.schedule_step()
        outputs = self._grammar_failures()
        if scheduled is None and self._in_flight is None:
            compiling = self.scheduler.grammars_compiling()
            if compiling:  # nothing to run until a grammar is ready: wait for one rather than spin
                wait_for(compiling, IDLE_GRAMMAR_WAIT_S, any_of=True)
        # (never a verify step: the plan after it follows how many drafts it kept)
        ahead = self._run_ahead or (self._run_ahead_when_not_drafting and self._speculation_off()
                                    and not (scheduled is not None and scheduled.spec_token_ids))
        if not ahead and self._in_flight is None:
            if scheduled is None:
                return outputs
            if scheduled.dummy:  # nothing of ours to run: only the other DP ranks' exchanges
                self.executor.execute(scheduled)
                return outputs
            output = self.executor.execute(scheduled)
            return outputs + self.process_step(self.update_step(scheduled, output), output)
        # On a GPU: launch step N+1, then collect step N, so the host's work (scheduling, input
        # preparation, detokenization) overlaps the device's. The runner waits for step N first only
        # where step N+1 needs its tokens on the host (penalties). A step with structured-output rows whose
        # previous token is still on its way collects step N once step N+1's forward pass is launched and
        # before its sampling inputs are built: the matchers take that token, the masks start filling in the
        # background, step N is detokenized meanwhile, and only the sampling waits for the masks. (Where the
        # plan goes to TP peers with its masks, step N is collected before the launch.)
        launched = None
        if scheduled is not None:
            grammar = scheduled.structured_output
            collect = grammar is not None and grammar.waits_for_previous_step and self._in_flight is not None
            if collect and not self.executor.samples_after_forward:  # the plan goes to the peers with its masks
                outputs += self._collect()
                collect = False

            def before_sampling() -> None:
                updated, output = self._collect_tokens()
                grammar.start()  # the matchers have step N's tokens: this step's masks can fill
                outputs.extend(self.process_step(updated, output))
            pending = self.executor.execute_async(scheduled, before_sampling=before_sampling if collect else None)
            launched = None if scheduled.dummy else (scheduled, pending)
        if self._in_flight is not None:
            outputs += self._collect()
        self._in_flight = launched
        if not ahead and self._in_flight is not None:  # speculation back on: its drafts need this step's tokens
            outputs += self._collect()
        return outputs

    def _speculation_off(self) -> bool:
        """Whether no running request can draft at its next step: more run than disable_by_batch_size, or
        adaptive speculation has paused every one (then steps may run ahead, as without speculation)."""
        running = self.scheduler.running
        limit = self.speculator.config.disable_by_batch_size
        return limit is not None and len(running) > limit or all(request.spec_paused for request in running)

    def _wait_for_new_grammars(self) -> None:
        fresh = [grammar for grammar in self.scheduler.grammars_compiling() if not grammar.waited]
        if fresh:
            for grammar in fresh:
                grammar.waited = True
            wait_for(fresh, NEW_GRAMMAR_WAIT_S)

    def _collect(self) -> list[RequestOutput]:
        """The outputs of the step in flight (waiting for its tokens)."""
        return self.process_step(*self._collect_tokens())

    def _collect_tokens(self) -> tuple[list[Request], RunnerOutput]:
        """The step in flight's tokens, recorded (update_step), not yet detokenized (process_step)."""
        (scheduled, pending), self._in_flight = self._in_flight, None
        output = pending.result()
        return self.update_step(scheduled, output), output

    def _grammar_failures(self) -> list[RequestOutput]:
        """The final outputs of requests whose grammar could not be compiled."""
        failed = self.scheduler.take_failed()
        return self.process_step(failed, RunnerOutput()) if failed else []

    def schedule_step(self) -> SchedulerOutput | None:
        """The next step plan, or None when there is nothing for the runners to do."""
        scheduled = self.scheduler.schedule()
        if self.lockstep is not None:
            return self._agree(scheduled)
        if scheduled.is_empty and not scheduled.finished_request_ids:
            return None
        return scheduled

    def _agree(self, scheduled: SchedulerOutput) -> SchedulerOutput | None:
        """Lockstep DP: agree with the other DP ranks on this step (engine/lockstep.py). Every rank steps
        when any has work, one without work a dummy step (SchedulerOutput.dummy); None when all are idle or
        some rank stops (`lockstep_status` says which)."""
        busy = not scheduled.is_empty or bool(scheduled.finished_request_ids) or self.has_unfinished_requests()
        status = STOP if self.stop_requested else BUSY if busy else IDLE
        mode, without_prompt_graphs = self.executor.step_mode(scheduled)
        agreed = self.lockstep.agree(status, scheduled.total_num_scheduled_tokens, mode, without_prompt_graphs)
        self.lockstep_status = agreed.status
        if agreed.status != BUSY:
            return None
        scheduled.ep_num_tokens, scheduled.ep_mode = agreed.num_tokens, agreed.mode
        scheduled.dummy = scheduled.is_empty  # runs a forward pass all the same
        return scheduled

    def update_step(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Token-level bookkeeping (new tokens, EOS, lengths, cached blocks); cheap, done before the
        next step is scheduled."""
        self.num_generated_tokens_total += sum(len(tokens) for tokens in output.sampled_token_ids)
        updated = self.scheduler.update_from_output(scheduled, output)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, output)
        return updated

    def process_step(self, updated: list[Request], output: RunnerOutput) -> list[RequestOutput]:
        """Detokenization, stop strings and logprobs; may run while the next step executes."""
        results = self.output_processor.process(updated, output)
        for sample_id, stop in results.stop_hits:
            self.scheduler.finish_request(sample_id, RequestStatus.FINISHED_STOPPED, stop)
        self.scheduler.abort_requests(results.failed_sample_ids)
        return results.outputs

    def stats(self) -> dict:
        block_manager = self.scheduler.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": block_manager.usage,
            "num_kv_blocks": block_manager.num_blocks,
            "num_free_kv_blocks": block_manager.num_free_blocks,
            "prefix_cache_queries": block_manager.prefix_cache_queries,
            "prefix_cache_hits": block_manager.prefix_cache_hits,
            **block_manager.stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens_total,
            "generation_tokens": self.num_generated_tokens_total,
            **(self.lockstep.stats() if self.lockstep is not None else {}),
            **({"expert_load": load} if (load := self.executor.expert_load()) is not None else {}),
            **self.structured_output.stats(),
            **(self.scheduler.spec_stats() if self.speculator is not None else {}),
        }

    def shutdown(self) -> None:
        """Release the executor's devices and memory; the engine cannot step afterwards."""
        self._in_flight = None  # a launched step refers to the runner
        self.structured_output.shutdown()
        self.executor.shutdown()
