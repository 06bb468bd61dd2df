"""Reference sampling: temperature, top-k, top-p, min-p (in Hugging Face's order), then an exponential
race (Gumbel-max) whose noise comes from each row's own seeded generator."""
from __future__ import annotations

import torch

from engine.kernels.sampling import SamplingTensors


def apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.any_top_k or t.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if t.any_top_k:
            k = torch.where(t.top_k > 0, t.top_k, logits.shape[-1]).unsqueeze(1)
            remove |= ranks >= k
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        if t.any_top_p:
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= (mass_before > t.top_p.unsqueeze(1)) & (ranks > 0)
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if t.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = t.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def exponential_noise(like: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    noise = torch.ones_like(like)
    generator = torch.Generator(device=like.device)
    temperatures = t.temperature.tolist()
    for row, seed in enumerate(t.seeds_cpu):
        if temperatures[row] > 0:
            generator.manual_seed(seed)
            noise[row].exponential_(generator=generator)
    return noise


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0).unsqueeze(1)
    logits = apply_top_k_top_p_min_p(logits / temperature, t)
    probs = logits.softmax(dim=-1)
    sampled = (probs / exponential_noise(probs, t)).argmax(dim=-1)
    return torch.where(t.temperature > 0, sampled, greedy)
