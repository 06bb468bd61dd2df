"""The MORI expert exchange (engine/parallel/mori_all_to_all.py) on the MORI double (tests/mori_double):
a FusedMoE gives the same output through it as through GatherScatterExchange, on one CPU rank and on two (gloo),
and make_all_to_all takes it only where MORI fits, saying why not otherwise."""
from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import engine.kernels
import mori_double
from gloo_ranks import run_two_ranks
from engine.forward_context import MoEStep, forward_context
from engine.kernels.torch import moe as torch_moe
from engine.layers.fused_moe import FusedMoE, RouterConfig
from engine.parallel import all_to_all, mori_all_to_all
from engine.parallel import state as parallel_state
from engine.parallel.all_to_all import ExchangeLayout, ExpertPlacement, GatherScatterExchange, make_all_to_all
from engine.parallel.mori_all_to_all import MoriAllToAll

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, MAX_TOKENS = 8, 24, 16, 3, 16


@pytest.fixture(autouse=True)
def torch_kernels():
    """The layers' ops from the torch reference, whatever backend an earlier test left active."""
    engine.kernels.activate("torch", torch.device("cpu"))


def _whole_layer() -> dict[str, torch.Tensor]:
    """Every expert's weights and the gate, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return {"w13": torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2,
            "w2": torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.2,
            "gate": torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)}


def _layer(rank: int, ranks: int, group, whole: dict) -> FusedMoE:
    parallel_state._state = parallel_state.ParallelState(ep_rank=rank, ep_size=ranks, ep_group=group,
                                                         host_collectives=True, max_num_batched_tokens=MAX_TOKENS)
    layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTERMEDIATE, RouterConfig("softmax_topk", TOP_K))
    local = slice(layer.expert_start, layer.expert_start + layer.num_local_experts)
    layer.w13.data.copy_(whole["w13"][local])
    layer.w2.data.copy_(whole["w2"][local])
    layer.gate.weight.data.copy_(whole["gate"])
    return layer


def _layout(num_experts: int = NUM_EXPERTS, dtype: torch.dtype = torch.float32) -> ExchangeLayout:
    return ExchangeLayout(num_experts, HIDDEN, TOP_K, MAX_TOKENS, dtype)


def _placement(num_experts: int = NUM_EXPERTS, ranks: int = 1, rank: int = 0) -> ExpertPlacement:
    base, extra = divmod(num_experts, ranks)
    return ExpertPlacement(tuple((r * base + min(r, extra), base + (r < extra)) for r in range(ranks)), rank)


def _forward(layer: FusedMoE, exchange, x: torch.Tensor, routing=None, padded: int = 0) -> torch.Tensor:
    """The layer's output through `exchange`, routed by its router or as `routing` (weights, ids) says, in a
    step whose exchanges pad to `padded` tokens (the largest rank's: every rank's exchanges have one shape)."""
    layer._all_to_all = exchange
    layer.__dict__.pop("_route", None)
    if routing is not None:
        layer._route = lambda tokens, expert_ids=None: (_rows(routing[0], padded), _rows(routing[1], padded))
    with forward_context(None, 16, MoEStep(padded)):
        return layer(x)


def _rows(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """`tensor` padded with zero rows to `count` rows (the padding is routed nowhere by the layer)."""
    return torch.cat((tensor, tensor.new_zeros((max(0, count - tensor.shape[0]), *tensor.shape[1:]))))


def _dense(whole: dict, x: torch.Tensor, routing) -> torch.Tensor:
    return torch_moe.fused_experts(x, whole["w13"], whole["w2"], *routing)


def _static_exchange(layer: FusedMoE, dtype: torch.dtype):
    layer._all_to_all = None
    return layer._exchange(dtype)  # host collectives on CPU: never MORI


# ---------------------------------------------------------------------------------- two gloo ranks

# Top-k ids per rank for the crafted case: experts 0-3 live on rank 0, 4-7 on rank 1. Each rank's second
# token reaches no expert of its own rank; [0, 5, 3] goes to rank 0 once for two of its experts.
CRAFTED_IDS = ([[0, 1, 2], [4, 5, 6], [0, 5, 3]], [[7, 6, 4], [1, 2, 3], [2, 7, 0]])
TOKENS_PER_RANK = {"random": (7, 3), "one_rank_idle": (5, 0), "crafted": (3, 3)}


def _two_rank_worker(rank: int, init_method: str, out_dir: str) -> None:
    """Both exchanges on one layer, per case; results go to out_dir/rank<r>.pt for the tests to read."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    messages = []
    logger = logging.getLogger(all_to_all.__name__)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler := logging.Handler())
    handler.emit = lambda record: messages.append(record.getMessage())
    whole, results = _whole_layer(), {}
    with mori_double.activate():
        layer = _layer(rank, 2, dist.group.WORLD, whole)
        mori = MoriAllToAll(dist.group.WORLD, _layout())
        for case, counts in TOKENS_PER_RANK.items():
            x = torch.randn(counts[rank], HIDDEN, generator=torch.Generator().manual_seed(10 * rank + len(case)))
            routing = layer.gate.route(x, layer.router)
            if case == "crafted":
                weights = torch.rand(3, TOP_K, generator=torch.Generator().manual_seed(rank))
                routing = (weights, torch.tensor(CRAFTED_IDS[rank], dtype=torch.int32))
            padded = max(TOKENS_PER_RANK[case])
            results[case] = {"mori": _forward(layer, mori, x, routing, padded),
                             "torch": _forward(layer, _static_exchange(layer, x.dtype), x, routing, padded),
                             "dense": _dense(whole, x, routing)}
        first = results["crafted"]["mori"]
        kept = first.clone()
        results["crafted"]["mori_again"] = _forward(layer, mori, x, routing, padded)
        results["crafted"]["first_kept"] = torch.equal(first, kept)
        sent = mori.dispatch(x, *routing)
        results["dispatched"] = {"local_ids": sent.local_ids.clone(), "weights": sent.weights.clone()}
        mori.combine(torch.zeros_like(sent.hidden), sent.handle)
        uneven = make_all_to_all(dist.group.WORLD, _placement(7, 2, rank), host_collectives=False, form="mori",
                                 layout=_layout(num_experts=7))
        results["uneven_experts"] = {"exchange": type(uneven).__name__, "messages": messages}
        mori_all_to_all.shutdown()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_two_ranks(_two_rank_worker, tmp_path_factory.mktemp("mori-two-ranks"))


@pytest.mark.parametrize("case", ["random", "one_rank_idle", "crafted"])
def test_mori_exchange_gives_the_static_exchange_output_on_two_ranks(two_ranks, case):
    for rank in range(2):
        outputs = two_ranks[rank][case]
        assert outputs["mori"].shape == (TOKENS_PER_RANK[case][rank], HIDDEN)
        torch.testing.assert_close(outputs["mori"], outputs["torch"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outputs["mori"], outputs["dense"], atol=1e-5, rtol=1e-5)


def test_a_combined_output_survives_the_next_layers_exchange(two_ranks):
    for rank in range(2):
        crafted = two_ranks[rank]["crafted"]
        assert crafted["first_kept"]
        torch.testing.assert_close(crafted["mori_again"], crafted["mori"])


def test_dispatch_marks_other_ranks_experts_and_rows_past_the_received_as_none(two_ranks):
    # Rank 0 holds experts 0-3: it receives its own tokens [0,1,2], [0,5,3] and rank 1's [1,2,3], [2,7,0].
    # Rank 1 holds 4-7 (local 0-3): it receives [4,5,6], [0,5,3] and its own [7,6,4], [2,7,0].
    expected = {0: [[0, 1, 2], [0, -1, 3], [1, 2, 3], [2, -1, 0]],
                1: [[0, 1, 2], [-1, 1, -1], [3, 2, 0], [-1, 3, -1]]}
    for rank in range(2):
        ids, weights = two_ranks[rank]["dispatched"]["local_ids"], two_ranks[rank]["dispatched"]["weights"]
        assert ids.dtype == torch.int32 and ids.shape == weights.shape == (2 * MAX_TOKENS, TOP_K)
        assert sorted(ids[:4].tolist()) == sorted(expected[rank])
        assert ids[4:].eq(-1).all()
        assert weights[ids == -1].eq(0).all() and weights[ids != -1].gt(0).all()


def test_make_all_to_all_takes_torch_when_experts_do_not_divide_evenly(two_ranks):
    for rank in range(2):
        uneven = two_ranks[rank]["uneven_experts"]
        assert uneven["exchange"] == "GatherScatterExchange"
        assert [m for m in uneven["messages"] if "MORI" in m] == ["expert exchange: MORI not used, torch.distributed instead: "
                                      "7 experts do not divide evenly over 2 EP ranks"]


# ------------------------------------------------------------------------------------- one rank

@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A gloo group of one rank in this process."""
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    monkeypatch.setattr(all_to_all, "_logged", set())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def with_double(one_rank):
    with mori_double.activate():
        try:
            yield one_rank
        finally:
            mori_all_to_all.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mori_exchange_gives_the_static_exchange_output_on_one_rank(with_double, dtype):
    whole = _whole_layer()
    layer = _layer(0, 1, with_double, whole).to(dtype)
    x = torch.randn(9, HIDDEN).to(dtype)
    mori = _forward(layer, MoriAllToAll(with_double, _layout(dtype=dtype)), x)
    reference = _forward(layer, _static_exchange(layer, dtype), x)
    assert mori.dtype == dtype and mori.shape == (9, HIDDEN)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mori, reference, atol=tolerance, rtol=tolerance)


def test_make_all_to_all_takes_mori_with_the_aiter_backend(with_double, monkeypatch):
    monkeypatch.setattr(engine.kernels, "active_backend", lambda: SimpleNamespace(name="aiter"))
    assert isinstance(make_all_to_all(with_double, _placement(), False, layout=_layout()), MoriAllToAll)
    assert isinstance(make_all_to_all(with_double, _placement(), False, form="allgather", layout=_layout()),
                      GatherScatterExchange)


def test_make_all_to_all_takes_torch_with_other_kernel_backends(with_double):
    assert engine.kernels.active_backend().name != "aiter"
    assert isinstance(make_all_to_all(with_double, _placement(), False, layout=_layout()), GatherScatterExchange)


@pytest.mark.parametrize("layout, host_collectives, reason", [
    (_layout(dtype=torch.float16), False, "MORI's kernels take torch.bfloat16, torch.float32, the hidden states "
                                          "are torch.float16"),
    (ExchangeLayout(NUM_EXPERTS, HIDDEN, TOP_K, 0, torch.float32), False,
     "the most tokens a rank sends per step (max_num_batched_tokens) is unknown"),
    (_layout(), True, "the EP ranks do not each have a GPU of their own (collectives go through host memory)"),
    (None, False, "the layer did not give its layout"),
])
def test_make_all_to_all_says_once_why_mori_does_not_fit(with_double, monkeypatch, caplog, layout,
                                                          host_collectives, reason):
    monkeypatch.setattr(engine.kernels, "active_backend", lambda: SimpleNamespace(name="aiter"))
    with caplog.at_level(logging.INFO, logger=all_to_all.__name__):
        for _ in range(2):
            assert isinstance(make_all_to_all(with_double, _placement(), host_collectives, layout=layout),
                              GatherScatterExchange)
    assert caplog.messages == [f"expert exchange: MORI not used, torch.distributed instead: {reason}"]


def test_make_all_to_all_says_when_mori_is_not_installed(one_rank, monkeypatch, caplog):
    monkeypatch.setattr(engine.kernels, "active_backend", lambda: SimpleNamespace(name="aiter"))
    monkeypatch.setitem(sys.modules, "mori", None)  # `import mori` raises ImportError
    with caplog.at_level(logging.INFO, logger=all_to_all.__name__):
        exchange = make_all_to_all(one_rank, _placement(), False, layout=_layout())
    assert isinstance(exchange, GatherScatterExchange)
    assert caplog.messages[0].startswith("expert exchange: MORI not used, torch.distributed instead: "
                                         "`import mori` failed")
