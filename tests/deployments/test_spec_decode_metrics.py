"""Speculative decoding's counters reach /metrics under vLLM's names, from a speculating engine's stats."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deployments.openai.metrics import _EngineStatsCollector
from engine import LLM, SamplingParams


def test_a_speculating_engines_counters_are_exported(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    try:
        llm.generate([[5, 6, 7, 5, 6, 7, 5, 6], [100] * 9 + [200]],
                     SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    collector = _EngineStatsCollector()
    collector.stats = stats
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples}
    assert samples["atom_ray:spec_decode_num_draft_tokens_total"] == stats["spec_draft_tokens"] > 0
    assert samples["atom_ray:spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"]
    assert samples["atom_ray:spec_decode_num_drafts_total"] == stats["spec_verifies"] > 0
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    assert abs(samples["atom_ray:spec_decode_acceptance_rate"] - rate) < 1e-9
    assert samples["atom_ray:spec_decode_mean_accepted_length"] >= 1
