"""The static-shape expert exchange (engine/parallel/all_to_all.py) on two gloo ranks: both forms give the
one-process layer's output whatever each rank's batch, padding rows (filled with huge values) reach no
expert, the load counters see the whole group's routing; and the lockstep agreement (engine/lockstep.py):
ranks with different token counts agree on the largest, a rank that stops stops all."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import engine.kernels
from gloo_ranks import run_two_ranks
from engine.forward_context import MoEStep, forward_context
from engine.kernels.torch import moe as torch_moe
from engine.layers.fused_moe import FusedMoE, RouterConfig
from engine.lockstep import BUSY, DECODE_GRAPH, EAGER, IDLE, PROMPT_GRAPHS, STOP, Lockstep
from engine.parallel import state as parallel_state
from engine.parallel.all_to_all import ExpertPlacement, GatherScatterExchange, PaddedAllToAll, StepExchange
from engine.runner.cuda_graphs import capture_sizes, padded_step_tokens

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 24, 16, 3
# (real tokens of rank 0, of rank 1), (rows of rank 0's input, of rank 1's): an eager step has a row per
# token, an idle rank's dummy step one padding row, a CUDA graph's batch padding rows past the real ones.
CASES = {"uneven": ((7, 2), (7, 2)), "one_rank_idle": ((5, 0), (5, 1)), "graph_padding": ((3, 1), (4, 4)),
         "equal": ((4, 4), (4, 4))}
FORMS = ("allgather", "all_to_all", "step")


def _whole_layer() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w13": torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2,
            "w2": torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.2,
            "gate": torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)}


def _layer(rank: int, whole: dict) -> FusedMoE:
    parallel_state._state = parallel_state.ParallelState(ep_rank=rank, ep_size=2, ep_group=dist.group.WORLD,
                                                         host_collectives=True)
    layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTERMEDIATE, RouterConfig("softmax_topk", TOP_K))
    local = slice(layer.expert_start, layer.expert_start + layer.num_local_experts)
    layer.w13.data.copy_(whole["w13"][local])
    layer.w2.data.copy_(whole["w2"][local])
    layer.gate.weight.data.copy_(whole["gate"])
    return layer


def _exchange(form: str, layer: FusedMoE):
    layer._all_to_all = None
    parallel_state._state.expert_exchange = "allgather" if form == "step" else form
    exchange = layer._exchange(torch.float32)
    if form == "step":  # both forms in one layer: the all-gather up to 4 rows per rank, all-to-all above
        padded = PaddedAllToAll(dist.group.WORLD, ExpertPlacement(((0, 4), (4, 4)), layer.ep_rank), True, "cpu")
        exchange = layer._all_to_all = StepExchange(exchange, padded, 4, ("all-gather", "padded all-to-all"))
    return exchange


class GlooOneShot:
    """Stands in for SymmetricAllReduce on CPU: the same sum, through gloo."""
    max_bytes = 1 << 20

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out


def _worker(rank: int, init_method: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    engine.kernels.activate("torch", torch.device("cpu"))
    whole, results = _whole_layer(), {}
    layer = _layer(rank, whole)
    for case, (tokens, rows) in CASES.items():
        real, given = tokens[rank], rows[rank]
        x = torch.randn(given, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + len(case)))
        x[real:] = 1e30  # padding rows: whatever they hold must not reach an expert
        reference = torch_moe.fused_experts(x[:real], whole["w13"], whole["w2"],
                                            *layer.gate.route(x[:real], layer.router))
        padded = max(rows)
        valid = torch.tensor([real]) if given > real else (0 if real == 0 else None)
        for form in FORMS:
            _exchange(form, layer)
            layer.count_expert_load()
            with forward_context(None, 16, MoEStep(padded, valid)):
                out = layer(x)
            results[(case, form)] = {"out": out, "reference": reference, "real": real,
                                     "counts": layer.load_counts.clone()}
    # The one-shot path (a gloo stand-in for the symmetric-memory all-reduce), as EP=2 and as TP=2 + EP (the
    # two ranks hold the same tokens, a chunk each; the TP group's rows come out of the combine whole).
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(77))  # the same on both ranks
    reference = torch_moe.fused_experts(x, whole["w13"], whole["w2"], *layer.gate.route(x, layer.router))
    for tp_size in (1, 2):
        for one_shot in (False, True):
            parallel_state._state.tp_rank, parallel_state._state.tp_size = (rank, 2) if tp_size == 2 else (0, 1)
            parallel_state._state.device_group = dist.group.WORLD
            tp_layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTERMEDIATE, RouterConfig("softmax_topk", TOP_K))
            tp_layer.load_state_dict(layer.state_dict())
            tp_layer._all_to_all = GatherScatterExchange(dist.group.WORLD, ExpertPlacement(((0, 4), (4, 4)), rank),
                                                         True, GlooOneShot() if one_shot else None)
            mine = x if tp_size == 2 else x[:3] if rank == 0 else x[3:]
            with forward_context(None, 16, MoEStep(5 if tp_size == 2 else 3)):
                out = tp_layer(mine)
            expected = reference if tp_size == 2 else reference[:3] if rank == 0 else reference[3:]
            results[("one_shot", tp_size, one_shot)] = (out, expected)
    # The lockstep agreement among the DP leaders.
    parallel_state._state.dp_leaders_group = dist.group.WORLD
    lockstep = Lockstep()
    results["agree"] = [lockstep.agree(BUSY if rank == 0 else IDLE, [13, 2][rank], [DECODE_GRAPH, EAGER][rank]),
                        lockstep.agree(IDLE, 0, DECODE_GRAPH),
                        lockstep.agree(STOP if rank == 1 else BUSY, 1, [PROMPT_GRAPHS, DECODE_GRAPH][rank])]
    results["lockstep_stats"] = lockstep.stats()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_two_ranks(_worker, tmp_path_factory.mktemp("expert-exchange"))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES)
def test_each_form_gives_the_one_process_output_for_any_batches(two_ranks, case, form):
    for rank in range(2):
        result = two_ranks[rank][(case, form)]
        real = result["real"]
        assert result["out"].shape[0] == CASES[case][1][rank]
        torch.testing.assert_close(result["out"][:real], result["reference"], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(result["out"]).all()  # the 1e30 padding rows were never multiplied in


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES)
def test_every_rank_counts_the_whole_groups_routing_and_no_padding(two_ranks, case, form):
    counts = [two_ranks[rank][(case, form)]["counts"] for rank in range(2)]
    real_pairs = TOP_K * sum(CASES[case][0])
    assert torch.equal(counts[0][:NUM_EXPERTS], counts[1][:NUM_EXPERTS])
    assert int(counts[0][:NUM_EXPERTS].sum()) == real_pairs


@pytest.mark.parametrize("one_shot", [False, True], ids=["nccl_form", "one_shot"])
@pytest.mark.parametrize("tp_size", [1, 2], ids=["ep2", "tp2_ep"])
def test_the_all_gather_form_over_one_shot_all_reduces_matches_the_whole_layer(two_ranks, tp_size, one_shot):
    for rank in range(2):
        out, expected = two_ranks[rank][("one_shot", tp_size, one_shot)]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_ranks_agree_on_the_largest_step_and_a_stop_stops_all(two_ranks):
    for rank in range(2):
        busy, idle, stop = two_ranks[rank]["agree"]
        assert (busy.status, busy.num_tokens, busy.mode) == (BUSY, 13, EAGER)  # rank 1 alone must run eagerly
        assert busy.eager and (idle.status, idle.num_tokens, idle.mode) == (IDLE, 0, DECODE_GRAPH)
        assert (stop.status, stop.mode) == (STOP, PROMPT_GRAPHS) and not stop.eager
        assert two_ranks[rank]["lockstep_stats"]["lockstep_votes"] == 3


def test_steps_pad_to_a_graph_size_else_to_a_multiple_of_64():
    sizes = capture_sizes(256)
    assert [padded_step_tokens(n, sizes) for n in (1, 3, 5, 17, 256, 257, 1000)] == [1, 4, 8, 32, 256, 320, 1024]


def test_nccl_graph_mixing_is_off_unless_the_user_set_it():
    """Graph launches that hold collectives must not wait on the host for the previous one (NCCL's graph
    mixing support did, docs/BENCHMARKS.md); a value from the user is kept."""
    from engine.parallel.state import nccl_environment
    environ = {}
    nccl_environment(environ)
    assert environ["NCCL_GRAPH_MIXING_SUPPORT"] == "0"
    environ = {"NCCL_GRAPH_MIXING_SUPPORT": "1"}
    nccl_environment(environ)
    assert environ["NCCL_GRAPH_MIXING_SUPPORT"] == "1"
