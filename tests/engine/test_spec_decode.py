"""Speculative decoding (engine/spec_decode): the n-gram drafter, which drafts are kept, that the kept tokens
have the target's distribution (a statistical test with negative controls), and that a speculating engine
gives the tokens of one that does not: greedy and seeded requests, penalties, min_tokens, stop strings,
max_tokens cuts, logprobs, n > 1, requests joining mid-flight, chunked prefill, preemption and abort, with no
KV block left behind. The engine runs in float32: in 16-bit dtypes a verify step (several query tokens) and a
decode step round differently, so near-ties may go either way (as in every engine)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.spec_decode_bench import RecordedSpeculator  # a recorded run's tokens, each right w.p. p
from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.kernels.sampling import step_seed
from engine.layers.sampler import Sampler, SamplingBatch
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.verify import emitted_tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


# ---- the n-gram drafter ------------------------------------------------------------------------------------

def ngram(tokens, min_n=2, max_n=4, k=3):
    return propose_ngram(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_ngram_proposes_what_followed_the_longest_matching_suffix():
    # suffix (7, 8, 9) occurred once, followed by 1, 2, 3; the shorter (8, 9) also occurred after 5.
    assert ngram([7, 8, 9, 1, 2, 3, 4, 5, 8, 9, 6, 0, 7, 8, 9]) == [1, 2, 3]


def test_ngram_takes_the_latest_of_equally_long_matches_and_stops_at_k_or_the_end():
    assert ngram([1, 2, 10, 11, 1, 2, 20, 21, 1, 2]) == [20, 21, 1]
    assert ngram([1, 2, 10, 1, 2], k=5) == [10, 1, 2]  # what followed runs into the suffix itself


def test_ngram_proposes_nothing_below_min_n():
    assert ngram([5, 9, 1, 2, 9], min_n=2) == []  # only the last token (1 < min_n) matches
    assert ngram([5, 9, 1, 2, 9], min_n=1) == [1, 2, 9]
    assert ngram([3]) == [] and ngram([]) == [] and ngram([1, 2, 1, 2], k=0) == []


# ---- which drafts are kept, and their distribution -----------------------------------------------------------

def test_emitted_tokens_are_the_agreeing_drafts_then_the_targets_token():
    assert emitted_tokens([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, plus the bonus
    assert emitted_tokens([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the target's token where it disagrees
    assert emitted_tokens([1], []) == [1]


VOCAB = 6
LOGITS = torch.tensor([[2.0, 1.5, 0.2, -1.0, 0.9, -0.5], [0.3, -0.2, 1.1, 0.0, 2.2, -1.5]])


def target_probs(row: int, params: SamplingParams) -> np.ndarray:
    """The distribution a step without speculation samples from (temperature, then top-k)."""
    logits = LOGITS[row].double() / params.temperature
    if params.top_k:
        cut = logits.topk(params.top_k).values[-1]
        logits = torch.where(logits >= cut, logits, torch.tensor(float("-inf"), dtype=torch.float64))
    return logits.softmax(-1).numpy()


def verify_draws(params: SamplingParams, draft: int, num_draws: int, verify=emitted_tokens) -> list[list[int]]:
    """`num_draws` requests (seeds 0..) verifying the one draft `draft`: two sampled rows each, sampled by the
    engine's sampler with the seeds of output positions 0 and 1."""
    rows = num_draws * 2
    logits = LOGITS.repeat(num_draws, 1)
    seeds = [step_seed(seed, position) for seed in range(num_draws) for position in (0, 1)]
    batch = SamplingBatch([params] * rows, seeds, [[]] * rows, [[]] * rows, [[]] * rows)
    sampled, _ = Sampler()(logits, batch)
    pairs = sampled.view(num_draws, 2).tolist()
    return [verify(pair, [draft]) for pair in pairs]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 1e-4 (a fixed-seed test: these are margins, not flakiness budgets)
CRITICAL = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5, 5: 25.7}


def check_distribution(draws: list[list[int]], params: SamplingParams, draft: int) -> tuple[float, float]:
    """Chi-square of (the first emitted token) against the target's first-position distribution, and of (the
    second token, where the draft was kept) against the second position's."""
    p0, p1 = target_probs(0, params), target_probs(1, params)
    first = np.bincount([d[0] for d in draws], minlength=VOCAB)
    second = np.bincount([d[1] for d in draws if len(d) == 2], minlength=VOCAB)
    return chi_square(first, p0), chi_square(second, p1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["plain", "top_k"])
@pytest.mark.parametrize("draft", [0, 3])  # the likeliest token, and an unlikely one
def test_kept_tokens_have_the_targets_distribution(params, draft):
    draws = verify_draws(params, draft, 20000)
    first, second = check_distribution(draws, params, draft)
    support0 = int((target_probs(0, params) > 0).sum()) - 1
    support1 = int((target_probs(1, params) > 0).sum()) - 1
    assert first < CRITICAL[support0], first
    assert second < CRITICAL[support1], second
    kept = sum(len(d) == 2 for d in draws) / len(draws)
    assert abs(kept - target_probs(0, params)[draft]) < 0.02  # a draft is kept with probability p(draft)


def always_keep(sampled, drafts):
    return list(drafts) + sampled[len(drafts):]


def keep_then_resample_anything(sampled, drafts):
    """Keeps the draft with probability p(draft) but, when it rejects, redraws from all of p (the draft
    included): the classic mistake, which over-weights the draft."""
    if sampled[0] == drafts[0]:
        return sampled
    redraw = int(np.random.default_rng(sampled[0] * 7919 + sampled[1]).choice(VOCAB, p=target_probs(0, PLAIN)))
    return [redraw]


PLAIN = SamplingParams(temperature=1.0)


@pytest.mark.parametrize("biased", [always_keep, keep_then_resample_anything])
def test_negative_controls_fail_the_distribution_test(biased):
    draws = verify_draws(PLAIN, 0, 20000, verify=biased)
    first, _ = check_distribution(draws, PLAIN, 0)
    assert first > CRITICAL[VOCAB - 1] * 2, first


# ---- the engine ----------------------------------------------------------------------------------------------

PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello, my name is",
]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0),
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.05, frequency_penalty=0.1),
    SamplingParams(max_tokens=40, temperature=0.6, seed=3, min_tokens=30, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0, stop=["date", "mul"]),
    SamplingParams(max_tokens=9, temperature=0),
    SamplingParams(max_tokens=30, temperature=0.9, seed=5, n=2),
]


@pytest.fixture(scope="module")
def engines():
    plain = LLM("smollm2-135m", show_progress=False, dtype="float32")
    spec = LLM("smollm2-135m", show_progress=False, dtype="float32", speculative_config=NGRAM)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def same_outputs(a, b):
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for u, v in zip(x.outputs, y.outputs):
            assert u.token_ids == v.token_ids, (u.text, v.text)
            assert u.text == v.text and u.finish_reason == v.finish_reason and u.stop_reason == v.stop_reason
            if u.logprobs is not None:
                assert len(u.logprobs) == len(v.logprobs) == len(u.token_ids)
                for p, q in zip(u.logprobs, v.logprobs):
                    assert p.keys() == q.keys()
                    for token_id in p:
                        assert math.isclose(p[token_id].logprob, q[token_id].logprob, abs_tol=1e-3)
                        assert p[token_id].rank == q[token_id].rank


@pytest.mark.parametrize("index", range(len(PARAMS)))
def test_speculating_engine_gives_the_tokens_of_one_that_does_not(engines, index):
    plain, spec = engines
    before = spec.engine.stats()["spec_draft_tokens"]
    expected = plain.generate(PROMPTS, PARAMS[index])
    got = spec.generate(PROMPTS, PARAMS[index])
    same_outputs(expected, got)
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] > before  # it did speculate
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if PARAMS[index].max_tokens == 9:
        assert all(o.finish_reason == "length" and len(o.token_ids) == 9 for r in got for o in r.outputs)


def test_steps_run_ahead_while_speculation_is_off_and_wait_again_once_it_is_on(engines, monkeypatch):
    """On a GPU an n-gram engine launches step N+1 before step N's tokens reach the host while no request can
    draft (more running than disable_by_batch_size, or all paused), and steps one at a time again once one
    can (never launching ahead of a verify step). Forced here on the CPU: the tokens are those of an engine
    without speculation, and both kinds of step happen as the batch shrinks below the limit."""
    plain, _ = engines
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 40, 6, 8)]
    expected = plain.generate(PROMPTS, params)
    spec = LLM("smollm2-135m", show_progress=False, dtype="float32",
               speculative_config={**NGRAM, "disable_by_batch_size": 2})
    try:
        engine = spec.engine
        engine._run_ahead_when_not_drafting = True
        ahead = []
        execute_async = engine.executor.execute_async

        def counting(scheduled, before_sampling=None):  # (synchronous steps go through execute)
            ahead.append(engine._in_flight is not None)
            assert not (ahead[-1] and engine._in_flight[0].spec_token_ids), "a step launched past a verify step"
            return execute_async(scheduled, before_sampling)
        monkeypatch.setattr(engine.executor, "execute_async", counting)
        got = spec.generate(PROMPTS, params)
        same_outputs(expected, got)
        stats = engine.stats()
        assert sum(ahead) > 0 and stats["spec_draft_tokens"] > 0, (ahead, stats["spec_draft_tokens"])
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and not engine.has_unfinished_requests()
    finally:
        spec.shutdown()


COPY_TEXT = ("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
             "quebec romeo sierra tango uniform victor whiskey xray yankee zulu")
COPY_CODE = ("def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"\n    return width * height\n\n\n"
             "def perimeter(width, height):\n    return 2 * (width + height)\n")


def test_copying_answer_keeps_most_drafts(engines):
    """The drafter really drafts: answers that copy their prompt (a list written out again, a module
    repeated) keep more than half the drafts (measured: 41 of 41 and 27 of 33)."""
    _, spec = engines
    before = spec.engine.stats()
    spec.generate([f"Original: {COPY_TEXT}\nCopy: {COPY_TEXT}\nOriginal: {COPY_TEXT}\nCopy:",
                   f"{COPY_CODE}\n# The same module again, unchanged:\n"], SamplingParams(max_tokens=60, temperature=0))
    after = spec.engine.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 40 and kept / drafted > 0.5, (kept, drafted)


def run_engine(llm, prompts, params, abort_at=None):
    """Requests join one per step; `abort_at` (step, index) aborts one mid-flight. Returns final outputs."""
    engine = llm.engine
    finals, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending:
            index, prompt = pending.pop(0)
            engine.add_request(f"r{index}", prompt, params)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        step += 1
        if abort_at is not None and step == abort_at[0]:
            final = engine.abort_request(f"r{abort_at[1]}")
            if final is not None:
                finals[final.request_id] = final
    return finals


def test_mid_flight_joins_chunked_prefill_preemption_and_abort_match_and_free_every_block():
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=32, temperature=0)
    tight = dict(dtype="float32", num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8, block_size=16,
                 max_model_len=128)
    results = []
    for speculative_config in (None, NGRAM):
        llm = LLM("smollm2-135m", show_progress=False, speculative_config=speculative_config, **tight)
        try:
            finals = run_engine(llm, prompts, params, abort_at=(6, 5))
            stats = llm.engine.stats()
            assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            assert stats["num_preemptions"] > 0
            results.append((finals, stats))
        finally:
            llm.shutdown()
    (plain, _), (spec, spec_stats) = results
    assert spec_stats["spec_draft_tokens"] > 0
    assert spec["r5"].outputs[0].finish_reason == "abort"
    for request_id, output in plain.items():
        if request_id != "r5":
            assert output.outputs[0].token_ids == spec[request_id].outputs[0].token_ids, request_id


# ---- configuration -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "medusa2", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "EAGLE \\(1/2\\) drafters are not built yet"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model is required for method .eagle3."),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max must be an integer >= 3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model is not used"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown speculative_config field"),
    ("ngram", "must be a mapping"),
])
def test_bad_speculative_configs_name_the_field(value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig("smollm2-135m", speculative_config=value)


def test_config_takes_a_mapping_or_the_object():
    config = EngineConfig("m", speculative_config=NGRAM).speculative_config
    assert config == SpeculativeConfig("ngram", 4)
    assert EngineConfig("m", speculative_config=config).speculative_config is config


def test_models_whose_state_cannot_move_back_are_refused(tmp_path):
    from tiny_models import make_tiny_v4_model
    with pytest.raises(ConfigError, match="speculative_config: .*compressed caches"):
        LLM(str(make_tiny_v4_model(tmp_path / "v4")), show_progress=False, speculative_config=NGRAM,
            max_model_len=128)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_gated_deltanet_states_move_back_to_the_kept_drafts(tmp_path, model_type, monkeypatch):
    """Qwen3-Next / Qwen3.5: a verify step advances the recurrent and conv states over every drafted token;
    the states then become those after the tokens kept (from the states before the step and the step's
    inputs). Drafts right with probability 0.6 make verify steps keep every count from none to all; greedy
    and seeded tokens equal a run without speculation, whole and in 8-token chunks with preemption; without
    the move back they do not (negative control)."""
    import tiny_models
    from engine.layers.gated_delta_net import GatedDeltaNet
    folder = str(tiny_models.make_tiny_qwen3_next(tmp_path / model_type, model_type=model_type))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6] * 3, list(range(10, 30)) * 2, [100] * 9 + [200], list(range(3, 40))]
    ngram = {"method": "ngram", "num_speculative_tokens": 3}

    def run(params, speculate, **args):
        llm = LLM(folder, dtype="float32", show_progress=False, speculative_config=ngram if speculate else None, **args)
        try:
            if speculate:
                llm.engine.speculator = RecordedSpeculator(speculate, 3, 0.6, tiny_models.VOCAB_SIZE)
            outputs = [o.token_ids for o in llm.generate(prompts, params)]
            return outputs, llm.engine.stats()
        finally:
            llm.shutdown()

    tight = dict(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=26, block_size=4, max_model_len=96)
    preemptions = 0
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)):
        for args in ({}, tight):
            expected, _ = run(params, None, **args)
            oracle = {tuple(p): e for p, e in zip(prompts, expected)}
            got, stats = run(params, oracle, **args)
            assert got == expected
            kept, drafted = stats["spec_accepted_tokens"], stats["spec_draft_tokens"]
            assert 0.2 * drafted < kept < 0.9 * drafted, stats  # partial keeps, not all or nothing
            assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            preemptions += stats["num_preemptions"]
    assert preemptions > 0
    monkeypatch.setattr(GatedDeltaNet, "keep_verified", lambda self, slot, num_kept: self.spec_stash.pop(slot))
    broken, _ = run(params, oracle, **tight)
    assert broken != expected


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_sliding_window_models_speculate_with_the_tokens_without(tmp_path, family):
    """gpt-oss and Gemma 4 (window groups beside full ones): a verify step's rejected drafts move the
    position back by at most k, and a window's blocks are released from the real position (at the next
    allocation), so nothing the window still reads is gone. Generation runs far past the 8-token windows,
    whole and in 8-token chunks with preemption."""
    import tiny_models
    folder = str(tiny_models.make_tiny_gpt_oss(tmp_path / family) if family == "gpt_oss"
                 else tiny_models.make_tiny_gemma4(tmp_path / family))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6] * 3, list(range(10, 30)) * 2, [100] * 9 + [200], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    preemptions = 0
    for args in ({}, dict(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=40, block_size=4,
                          max_model_len=96)):
        plain = LLM(folder, dtype="float32", show_progress=False, **args)
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        plain.shutdown()
        for oracle in (False, True):  # n-gram's own drafts; drafts right 60 % of the time (partial keeps)
            spec = LLM(folder, dtype="float32", show_progress=False, speculative_config=ngram, **args)
            try:
                if oracle:
                    recorded = {tuple(p): e for p, e in zip(prompts, expected)}
                    spec.engine.speculator = RecordedSpeculator(recorded, 3, 0.6, tiny_models.VOCAB_SIZE)
                assert [o.token_ids for o in spec.generate(prompts, params)] == expected
                stats = spec.engine.stats()
            finally:
                spec.shutdown()
            assert stats["spec_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            preemptions += stats["num_preemptions"]
        assert 0.2 * stats["spec_draft_tokens"] < stats["spec_accepted_tokens"] < 0.9 * stats["spec_draft_tokens"]
    assert preemptions > 0
