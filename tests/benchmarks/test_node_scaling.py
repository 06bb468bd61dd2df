"""benchmarks/node_scaling.py's plan, decided without a GPU: how many layers of each shape fit hosts of 4 and
8 GPUs of 80 GiB, the same layers and workload on every layout of a model, the dry run, the serve config and
the report's ratios (each against its stated baseline)."""
from __future__ import annotations

import sys

import pytest

from benchmarks import node_plan
from benchmarks.node_plan import GiB, WEIGHT_FRACTION, dense_plans, layout_sizes, moe_plans, spec_config, weight_bytes


@pytest.fixture(scope="module")
def plans():
    return {n: {p.name: p for p in moe_plans(n, 80) + dense_plans(n, 80)} for n in (4, 8)}


@pytest.mark.parametrize("n", [4, 8])
def test_each_shape_runs_the_most_layers_that_fit_every_layout(plans, n):
    budget = WEIGHT_FRACTION * 80 * GiB
    for plan in plans[n].values():
        weights = weight_bytes(spec_config(plan.spec))
        sizes = [layout_sizes(layout) for layout in plan.layouts.values()]
        assert all(weights.per_rank(plan.layers, tp, ep) <= budget for tp, ep in sizes), plan.name
        if plan.layers < plan.full_layers:  # one more layer would not fit some layout
            assert any(weights.per_rank(plan.layers + 1, tp, ep) > budget for tp, ep in sizes), plan.name


def test_the_moe_shapes_are_cut_to_fit_and_the_dense_ones_whole(plans):
    for n in (4, 8):
        qwen, deepseek, fp8 = (plans[n][name] for name in ("qwen3-235b-a22b", "deepseek-v3", "deepseek-v3-fp8"))
        assert qwen.full_layers == 94 and 94 // 3 < qwen.layers < 94
        assert deepseek.full_layers == 61 and 4 <= deepseek.layers < fp8.layers < 61  # FP8 blocks: ~half the bytes
        assert plans[n]["llama-3.1-70b"].layers == 80 and plans[n]["llama-3.1-8b"].layers == 32
    assert plans[8]["qwen3-235b-a22b"].layers > plans[4]["qwen3-235b-a22b"].layers
    assert "71 of 94 layers" in plans[8]["qwen3-235b-a22b"].shape  # 8 x 80 GiB: 51.8 GiB a rank under DP + EP
    assert "17 of 61 layers" in plans[8]["deepseek-v3"].shape


def test_every_layout_of_a_model_gets_the_same_layers(plans):
    for plan in plans[8].values():
        overrides = [layout.get("hf_overrides", {}) for layout in plan.layouts.values()]
        assert all(o == plan.overrides for o in overrides), plan.name
    deepseek = plans[8]["deepseek-v3"]
    assert deepseek.overrides == {"num_hidden_layers": deepseek.layers, "first_k_dense_replace": 3}
    assert plans[8]["deepseek-v3-fp8"].overrides["quantization_config"]["weight_block_size"] == [128, 128]
    assert list(plans[8]["qwen3-235b-a22b"].layouts) == ["DP=8 + EP=8", "TP=8"]
    assert plans[8]["qwen3-235b-a22b"].layouts["DP=8 + EP=8"] == {
        "data_parallel_size": 8, "enable_expert_parallel": True, "hf_overrides": {"num_hidden_layers": 71}}
    assert list(plans[8]["llama-3.1-8b"].layouts) == ["TP=1", "TP=2", "TP=4", "TP=8"]
    assert list(plans[4]["llama-3.1-8b"].layouts) == ["TP=1", "TP=2", "TP=4"]
    assert (list(plans[8]["llama-3.1-70b"].layouts), plans[8]["llama-3.1-70b"].baseline) == (["TP=8", "TP=4"], "TP=4")


def test_the_workload_is_the_prefix_of_gpu_perfs_with_outputs_capped():
    from benchmarks.gpu_perf import throughput_workload
    prompts, lens = throughput_workload(128256)
    some, capped = node_plan.workload(128256, 100, 128)
    assert some == prompts[:100] and capped == [min(n, 128) for n in lens[:100]]


def test_the_roofline_counts_one_gpus_share_of_weights_and_kv_heads():
    config = spec_config(node_plan.DENSE_MODELS["llama-3.1-70b"])
    one, eight = (node_plan.decode_roofline(config, tp, 3e12, 256) for tp in (1, 8))
    assert 135e9 < one["bytes_per_gpu_step"] < 145e9  # bf16 70B without the embedding table, + 80 MB of KV
    assert eight["bytes_per_gpu_step"] == pytest.approx(one["bytes_per_gpu_step"] / 8)
    assert eight["roofline_tok_s"] == pytest.approx(3e12 / eight["bytes_per_gpu_step"])


def test_the_serve_config_keeps_auth_on_and_binds_loopback():
    from benchmarks.node_serving import engine_args_for, serve_config
    args = engine_args_for({"tensor_parallel_size": 8})
    config = serve_config("/tmp/model", args, 8766)
    app = config["applications"][0]["args"]
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8766}
    assert app["require_api_key"] is True and "api_key" not in app and "accelerator_type" not in app
    assert app["deployment_config"]["num_replicas"] == 1 and "autoscaling_config" not in app["deployment_config"]
    assert app["engine_args"]["tensor_parallel_size"] == 8 and app["engine_args"]["load_format"] == "dummy"


@pytest.mark.parametrize("gpus", [4, 8])
def test_the_dry_run_prints_the_plan(monkeypatch, capsys, gpus):
    from benchmarks import node_scaling
    monkeypatch.setattr(sys, "argv", ["node_scaling", "--part", "moe", "--dry-run", "--gpus", str(gpus)])
    node_scaling.main()
    out = capsys.readouterr().out
    assert f"{gpus} GPU(s) of 80 GiB" in out
    assert f"DP={gpus} + EP={gpus}" in out and f"TP={gpus}" in out
    assert "of 94" in out and "of 61" in out and "256" in out


def test_the_report_states_each_ratio_against_its_baseline(plans, capsys):
    from benchmarks.node_scaling import report
    plan = plans[8]["qwen3-235b-a22b"]
    streamed = {"ttft_s": {"p50": 0.1, "p99": 0.2}, "itl_s": {"p50": 0.02, "p99": 0.05}}
    load = {"tokens_per_rank": [10] * 8, "rank_imbalance": 1.0}
    record = {"environment": {"date": "2026-11-27 12:00 UTC", "commit": "abc", "device": "H100"}, "part": "moe",
              "num_requests": 256, "results": {plan.name: {
                  "DP=8 + EP=8": {"offline_tok_s": 3000.0, "decode_tok_s": 50.0, "streamed": streamed,
                                  "per_dp_rank": [{"routed_requests": 37}] * 8, "expert_load_per_rank": load},
                  "TP=8": {"offline_tok_s": 2000.0, "decode_tok_s": 40.0, "streamed": streamed}}}}
    report(record, [plan], 8)
    out = capsys.readouterr().out
    assert "1.50x TP=8" in out and "1.25x TP=8" in out and "71 of 94 layers" in out
    assert "yes" in out  # 1.5x >= the 1.3x target
    assert record["ratios"] == [{"shape": plan.shape, "layout": "DP=8 + EP=8", "against": "TP=8",
                                 "offline_ratio": 1.5, "decode_b1_ratio": 1.25}]
