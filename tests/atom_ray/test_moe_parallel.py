"""Mixture of experts across Ray rank actors on CPU (gloo): expert parallelism inside a TP group, tensor
parallelism of the experts, and data-parallel attention whose MoE layers form one EP group. Each gives the
single-process engine's greedy tokens; the DP coordinator spreads requests, keeps repeated prefixes on the
rank that caches them, and an abort on one DP rank leaves the other's request alone."""
from __future__ import annotations

import asyncio

import pytest

import atom_ray
from engine import LLM, SamplingParams
from engine.config import ConfigError

PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 67)), [100] * 9 + [200]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3_moe"]), dtype="float32", show_progress=False)
    return {tuple(prompt): output.token_ids for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


@pytest.fixture(scope="module")
def dp_engine(ray_cluster, tiny_model_dirs):
    """DP=2, each rank one TP rank, experts split over both (EP=2)."""
    engine = atom_ray.start(str(tiny_model_dirs["qwen3_moe"]), data_parallel_size=2, enable_expert_parallel=True,
                            dtype="float32")
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=2)], ids=["ep2", "tp2"])
def test_moe_over_two_ranks_matches_single_process(ray_cluster, tiny_model_dirs, expected, layout):
    engine = atom_ray.start(str(tiny_model_dirs["qwen3_moe"]), dtype="float32", **layout)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [expected[tuple(p)] for p in PROMPTS]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "glm4_moe", "minimax_m2"])
def test_other_moe_families_at_tp2_with_expert_parallelism_match_single_process(ray_cluster, tiny_model_dirs, arch):
    """GLM-4.5's shared experts (reduced apart from the routed ones under EP) and MiniMax-M2's QK norm over
    all heads (its sum of squares all-reduced across the TP group)."""
    folder = str(tiny_model_dirs[arch])
    reference = [o.token_ids for o in LLM(folder, dtype="float32", show_progress=False).generate(PROMPTS, GREEDY)]
    engine = atom_ray.start(folder, tensor_parallel_size=2, enable_expert_parallel=True, dtype="float32")
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    finally:
        engine.shutdown()


def test_dp2_ep2_matches_single_process_with_one_rank_idle_at_first(dp_engine, expected):
    # One request alone: one DP rank runs it while the other runs empty steps through the expert exchange.
    alone = dp_engine.generate([PROMPTS[1]], GREEDY)[0]
    assert alone.token_ids == expected[tuple(PROMPTS[1])]
    outputs = dp_engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [expected[tuple(p)] for p in PROMPTS]
    ranks = dp_engine.stats()["dp_ranks"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert all(r["routed_requests"] > 0 for r in ranks)  # both ranks served requests
    assert all(r["num_running"] == 0 and r["kv_cache_usage"] == 0 for r in ranks)


def test_dp2_ep2_matches_single_process_with_very_different_batches(dp_engine, tiny_model_dirs):
    """Six prompts with a shared prefix pile onto one DP rank (prefix affinity), one short prompt goes to the
    other: the ranks' steps differ in size every step, and their exchanges pad to the larger."""
    shared = list(range(300, 348))
    prompts = [shared + [i] for i in range(6)] + [[7, 8, 9]]
    reference = LLM(str(tiny_model_dirs["qwen3_moe"]), dtype="float32", show_progress=False).generate(prompts, GREEDY)
    before = [r["routed_requests"] for r in dp_engine.stats()["dp_ranks"]]
    outputs = dp_engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    routed = sorted(r["routed_requests"] - b for r, b in zip(dp_engine.stats()["dp_ranks"], before))
    assert routed[1] - routed[0] >= 3, routed


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2), dict(tensor_parallel_size=2)],
                         ids=["dp2_ep2", "tp2_ep"])
def test_the_padded_all_to_all_form_matches_single_process(ray_cluster, tiny_model_dirs, expected, layout):
    engine = atom_ray.start(str(tiny_model_dirs["qwen3_moe"]), dtype="float32", enable_expert_parallel=True,
                            expert_exchange="all_to_all", **layout)
    try:
        alone = engine.generate([PROMPTS[1]], GREEDY)[0]  # under DP: one rank idle
        assert alone.token_ids == expected[tuple(PROMPTS[1])]
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [expected[tuple(p)] for p in PROMPTS]
    finally:
        engine.shutdown()


def test_expert_load_is_reported_per_expert_and_per_ep_rank(dp_engine):
    """Over a window of steps, every DP rank reports the whole EP group's routing (top_k pairs per token)."""
    dp_engine.generate([list(range(10, 40))] * 2, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    ranks = dp_engine.stats()["dp_ranks"]
    load = ranks[0]["expert_load"]
    assert load["window_steps"] == 64
    assert len(load["tokens_per_expert"]) == 8 and len(load["tokens_per_ep_rank"]) == 2
    assert sum(load["tokens_per_expert"]) == sum(load["tokens_per_ep_rank"]) == load["tokens"] > 0
    assert load["tokens"] % 2 == 0  # 2 of 8 experts per token (the tiny model's top_k), in every layer
    assert load["ep_rank_imbalance"] >= 1.0
    assert ranks[0]["lockstep_votes"] > 0 and ranks[0]["lockstep_vote_us_mean"] > 0


def test_repeated_prefixes_go_to_the_rank_that_caches_them(dp_engine):
    shared = list(range(100, 180))  # five full 16-token blocks
    before = dp_engine.stats()["dp_ranks"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for suffix in range(4):  # one at a time: each time both ranks are idle, so only the prefix decides
        dp_engine.generate([shared + [7, suffix]], params)
    after = dp_engine.stats()["dp_ranks"]
    routed = [a["routed_requests"] - b["routed_requests"] for a, b in zip(after, before)]
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 4]  # all four on one rank
    owner = routed.index(4)
    assert hits[owner] >= 3 * 5 and hits[1 - owner] == 0  # the last three found the shared blocks cached


def test_an_abort_on_one_dp_rank_leaves_the_other_alone(dp_engine, expected):
    long_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    before = [r["routed_requests"] for r in dp_engine.stats()["dp_ranks"]]

    async def run():
        aborted = dp_engine.stream(list(range(200, 260)), long_params)
        first = await anext(aborted)  # running on one rank
        assert not first.finished
        # Shorter than a block (no prefix to follow): it goes to the less busy rank, the other one.
        kept = asyncio.ensure_future(_final(dp_engine.stream(PROMPTS[0], GREEDY)))
        await asyncio.sleep(0.2)
        await aborted.aclose()  # the client gives up: the request is aborted on its rank
        return await kept

    output = asyncio.run(run())
    assert output.token_ids == expected[tuple(PROMPTS[0])]
    routed = [r["routed_requests"] - b for r, b in zip(dp_engine.stats()["dp_ranks"], before)]
    assert routed == [1, 1]  # one request on each rank
    for _ in range(50):  # the abort reaches its rank within a step or two
        if all(r["num_running"] == 0 for r in dp_engine.stats()["dp_ranks"]):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert all(r["num_running"] == 0 and r["kv_cache_usage"] == 0 for r in dp_engine.stats()["dp_ranks"])


async def _final(stream):
    output = None
    async for output in stream:
        pass
    return output


def test_expert_parallel_on_a_dense_model_is_refused_naming_the_field(ray_cluster, tiny_model_dirs):
    with pytest.raises(ConfigError, match="enable_expert_parallel=True, but LlamaForCausalLM has no experts"):
        atom_ray.start(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        LLM(str(tiny_model_dirs["llama"]), enable_expert_parallel=True, show_progress=False)


def test_a_layout_larger_than_the_cluster_is_refused_naming_the_fields(ray_cluster, tiny_model_dirs):
    with pytest.raises(RuntimeError, match=r"data_parallel_size=4 x tensor_parallel_size=4 = 16 ranks .* needs 16 CPUs"):
        atom_ray.start(str(tiny_model_dirs["qwen3_moe"]), data_parallel_size=4, tensor_parallel_size=4,
                       enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="data_parallel_size > 1 needs Ray"):
        LLM(str(tiny_model_dirs["qwen3_moe"]), data_parallel_size=2, show_progress=False)


def test_prometheus_metrics_report_each_dp_rank(dp_engine):
    from prometheus_client.parser import text_string_to_metric_families

    from deployments.openai.metrics import AppMetrics
    stats = dp_engine.stats()
    text, _ = AppMetrics().render(stats)
    samples = {(s.name, s.labels.get("dp_rank")): s.value
               for family in text_string_to_metric_families(text.decode()) for s in family.samples}
    for rank in stats["dp_ranks"]:
        dp = str(rank["dp_rank"])
        assert samples[("atom_ray:dp_num_requests_running", dp)] == rank["num_running"]
        assert samples[("atom_ray:dp_num_requests_waiting", dp)] == rank["num_waiting"]
        assert samples[("atom_ray:dp_kv_cache_usage_perc", dp)] == rank["kv_cache_usage"]
        assert samples[("atom_ray:dp_prefix_cache_hits_total", dp)] == rank["prefix_cache_hits"]
        assert samples[("atom_ray:dp_routed_requests_total", dp)] == rank["routed_requests"] > 0
    assert samples[("atom_ray:prompt_tokens_total", None)] == sum(r["prompt_tokens"] for r in stats["dp_ranks"])
    load = stats["expert_load"]  # DP rank 0's: it counts the whole EP group's routing
    assert samples[("atom_ray:ep_rank_load_imbalance", None)] == load["ep_rank_imbalance"]
    per_rank = {s.labels["ep_rank"]: s.value for family in text_string_to_metric_families(text.decode())
                for s in family.samples if s.name == "atom_ray:ep_rank_load_tokens"}
    assert per_rank == {str(r): float(v) for r, v in enumerate(load["tokens_per_ep_rank"])}


def test_the_openai_app_serves_a_dp_engine_and_reports_each_rank(dp_engine):
    """The HTTP surface on a data-parallel engine: completions (also streamed) through the DP coordinator,
    and /metrics with each DP rank's gauges."""
    from starlette.testclient import TestClient

    from deployments.openai import build_openai_app
    with TestClient(build_openai_app(dp_engine.client, "moe")) as http:
        body = {"model": "moe", "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 24
        streamed = http.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        metrics = http.get("/metrics").text
    for dp in (0, 1):
        assert f'atom_ray:dp_num_requests_running{{dp_rank="{dp}"}}' in metrics
        assert f'atom_ray:dp_routed_requests_total{{dp_rank="{dp}"}}' in metrics


def test_a_bad_request_to_a_dp_engine_is_refused_alone(dp_engine, expected):
    from engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        dp_engine.generate([[10**6]], GREEDY)
    with pytest.raises(InvalidRequestError, match="context length"):
        dp_engine.generate([[5] * 600], GREEDY)
    assert dp_engine.generate([PROMPTS[2]], GREEDY)[0].token_ids == expected[tuple(PROMPTS[2])]
    assert all(r["num_running"] == 0 and r["outstanding_requests"] == 0 for r in dp_engine.stats()["dp_ranks"])


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=2)], ids=["dp2_ep2", "tp2"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_deepseek_over_two_ranks_matches_single_process(ray_cluster, tiny_model_dirs, tmp_path, layout, arch):
    """Multi-head latent attention (its latent cache replicated, not split, across TP ranks) with DeepSeek-V3's
    grouped, biased routing and shared experts; DeepSeek-V4's window and compressed cache groups, its
    compressors' per-request state and hash-routed experts: data-parallel attention with expert-parallel
    MoE, the serving default for these models, and plain TP=2."""
    if arch == "deepseek_v4":
        from tiny_models import make_tiny_v4_model
        folder = str(make_tiny_v4_model(tmp_path / "v4"))
    else:
        folder = str(tiny_model_dirs[arch])
    reference = [o.token_ids for o in LLM(folder, dtype="float32", show_progress=False).generate(PROMPTS, GREEDY)]
    engine = atom_ray.start(folder, dtype="float32", **layout)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    finally:
        engine.shutdown()


def test_independent_dp_ranks_expert_loads_add_up():
    """Without expert parallelism each DP rank counts only its own tokens: the router sums them."""
    from atom_ray.dp_coordinator import merge_expert_loads
    loads = [{"window_steps": 64, "tokens_per_expert": [3, 1, 0, 0]}, {"window_steps": 60, "tokens_per_expert": [1, 1, 2, 0]}]
    merged = merge_expert_loads(loads)
    assert merged["tokens_per_expert"] == [4, 2, 2, 0] and merged["tokens"] == 8 and merged["window_steps"] == 60
    assert merged["expert_imbalance"] == 4 * 4 / 8


# New families over two ranks: gpt-oss's per-head sinks split with the heads, the q/k/v biases with their
# heads, the o and expert down biases added once (by one TP rank, or the expert's EP rank), the window group on
# both ranks; Qwen3-Next's Gated DeltaNet heads (and their conv channels and recurrent states) split in whole
# key-head groups at TP=2, and at DP=2 + EP=2 each rank keeps its own requests' states while the experts are
# shared.
@pytest.mark.parametrize("family,layout", [
    ("gpt_oss", dict(tensor_parallel_size=2)),
    ("gpt_oss", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen3_next", dict(tensor_parallel_size=2)),
    ("qwen3_next", dict(data_parallel_size=2, enable_expert_parallel=True)),
], ids=["gpt_oss-tp2", "gpt_oss-tp2-ep", "qwen3_next-tp2", "qwen3_next-dp2-ep2"])
def test_new_families_over_two_ranks_match_single_process(ray_cluster, tmp_path_factory, family, layout):
    import tiny_models
    folder = str(getattr(tiny_models, f"make_tiny_{family}")(tmp_path_factory.mktemp(family)))
    prompts = PROMPTS + [list(range(3, 40))]  # longer than gpt-oss's window
    reference = [o.token_ids for o in LLM(folder, dtype="float32", show_progress=False).generate(prompts, GREEDY)]
    engine = atom_ray.start(folder, dtype="float32", **layout)
    try:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference
    finally:
        engine.shutdown()
