"""Turns the last hidden state's logits into tokens: structured-output token masks, penalties, min-tokens
suppression, the backend's sampling kernel, and logprobs of the model's distribution (after the token masks,
as vLLM's: a constrained row's logprobs are those of the tokens its grammar allows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.core.scheduler_output import LogprobsLists
from engine.kernels import ops
from engine.kernels.sampling import SamplingTensors, apply_token_bitmask
from engine.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """One row per request that samples this step."""
    params: list[SamplingParams]
    step_seeds: list[int]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    suppressed_token_ids: list[list[int]]  # EOS and stop ids while min_tokens is not reached
    # Structured output: the allowed-token bitmasks [M, ceil(V / 32)] int32 (host) of the rows listed.
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None


MASKED_LOGPROB = -9999.0


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, LogprobsLists | None]:
        raw = logits.float()
        if batch.token_bitmask is not None:
            apply_bitmask(raw, *batch.token_bitmask)
        logits = raw
        if any(p.has_penalties for p in batch.params) or any(batch.suppressed_token_ids):
            logits = raw.clone()
            apply_penalties(logits, batch)
        sampled = ops.sample(logits, sampling_tensors(batch, logits.device))
        num_logprobs = [p.logprobs for p in batch.params if p.logprobs is not None]
        logprobs = compute_logprobs(raw, sampled, max(num_logprobs)) if num_logprobs else None
        return sampled, logprobs


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: the disallowed tokens of `rows` (bitmask row i for logits row rows[i]) to -inf. One op over the
    span of rows they cover; the free rows inside it get all-ones masks and keep their logits to the bit."""
    first, last = min(rows), max(rows)
    if rows != list(range(first, last + 1)):
        span = torch.full((last + 1 - first, bitmask.shape[1]), -1, dtype=torch.int32)
        span[torch.tensor(rows) - first] = bitmask
        bitmask = span
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    apply_token_bitmask(logits[first:last + 1], bitmask)


def sampling_tensors(batch: SamplingBatch, device: torch.device) -> SamplingTensors:
    params = batch.params
    if all(p.temperature == 0 for p in params):  # greedy: the kernels need nothing but the logits
        return SamplingTensors(None, None, None, None, None, batch.step_seeds, True, False, False, False)
    temperature = [p.temperature for p in params]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    sampling_rows = [t > 0 for t in temperature]
    # Two host-to-device copies for the five per-row inputs: the float32 ones, then the int64 ones.
    floats = torch.tensor([temperature, top_p, min_p], dtype=torch.float32)
    ints = torch.tensor([top_k, batch.step_seeds], dtype=torch.int64)
    if device.type == "cuda":
        floats, ints = (t.pin_memory().to(device, non_blocking=True) for t in (floats, ints))
    return SamplingTensors(
        temperature=floats[0],
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        seeds=ints[1],
        seeds_cpu=batch.step_seeds,
        all_greedy=not any(sampling_rows),
        any_top_k=any(k > 0 and s for k, s in zip(top_k, sampling_rows)),
        any_top_p=any(p < 1.0 and s for p, s in zip(top_p, sampling_rows)),
        any_min_p=any(m > 0.0 and s for m, s in zip(min_p, sampling_rows)),
    )


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place. Repetition penalty (Hugging Face's rule) over prompt and output tokens; presence and
    frequency penalties (OpenAI's rule) over output tokens; suppressed ids set to -inf."""
    vocab_size = logits.shape[-1]
    for row, params in enumerate(batch.params):
        if batch.suppressed_token_ids[row]:
            logits[row, batch.suppressed_token_ids[row]] = float("-inf")
        if not params.has_penalties:
            continue
        output_ids = torch.tensor(batch.output_token_ids[row], dtype=torch.int64, device=logits.device)
        counts = torch.bincount(output_ids, minlength=vocab_size)[:vocab_size].to(logits.dtype)
        if params.repetition_penalty != 1.0:
            prompt_ids = torch.tensor(batch.prompt_token_ids[row], dtype=torch.int64, device=logits.device)
            seen = torch.unique(torch.cat((prompt_ids, output_ids)))
            values = logits[row, seen]
            penalty = params.repetition_penalty
            logits[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if params.frequency_penalty or params.presence_penalty:
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> LogprobsLists:
    """Log-softmax of `logits` [N, V]: for each row the chosen token, its rank, and the top `num_top`."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen.view(-1, 1))
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    token_ids, values = chosen.view(-1, 1), chosen_logprobs
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        # A token a grammar forbids has no probability: OpenAI writes -9999.0 there, not -inf (which JSON lacks).
        top_values = top_values.clamp(min=MASKED_LOGPROB)
        token_ids = torch.cat((token_ids, top_ids), dim=1)
        values = torch.cat((values, top_values), dim=1)
    return LogprobsLists(token_ids.tolist(), values.tolist(), ranks.tolist())
