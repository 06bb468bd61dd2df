"""Prompt-step graphs (engine/runner/prompt_graphs.py): what can be checked without a GPU, the token buckets
and the non-owning views that let one chain's graphs share memory. Replay itself: tests/engine/test_gpu.py."""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.forward_context import get_forward_context
from engine.runner.prompt_graphs import non_owning, prompt_buckets


def test_buckets_are_fine_and_end_at_the_step_budget_rounded_to_the_exchange_multiple():
    buckets = prompt_buckets(8192)
    assert buckets[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 768] and buckets[-2:] == [7936, 8192]
    assert all(b - a <= 256 for a, b in zip(buckets, buckets[1:]))  # a large step pads by a few per cent
    assert prompt_buckets(2000)[-3:] == [1536, 1792, 2048]
    assert prompt_buckets(100) == [64, 128]
    assert prompt_buckets(16384)[-1] == 16384


def test_a_non_owning_view_reads_the_same_elements_with_the_same_layout():
    base = torch.arange(60.0).view(6, 10)
    view = base[1:5, 2:8]
    weak = non_owning(view)
    assert weak.shape == view.shape and weak.stride() == view.stride()
    assert weak.data_ptr() == view.data_ptr()
    assert torch.equal(weak, view)
    base[2, 3] = -1.0  # the same memory, not a copy
    assert weak[1, 1].item() == -1.0


def test_the_switch_takes_auto_on_or_off():
    assert EngineConfig(model="m").cuda_graph_prompt_steps == "auto"
    assert EngineConfig(model="m", cuda_graph_prompt_steps="off").cuda_graph_prompt_steps == "off"
    for wrong in ("no", False, None):
        with pytest.raises(ConfigError, match="cuda_graph_prompt_steps"):
            EngineConfig(model="m", cuda_graph_prompt_steps=wrong)


class _Graphs:
    """Decode graphs up to 256 rows (sizes as capture_sizes gives them)."""
    max_batch = 256

    @staticmethod
    def padded_size(tokens):
        from engine.runner.cuda_graphs import capture_sizes, padded_step_tokens
        return padded_step_tokens(tokens, capture_sizes(256))


class _Buckets:
    sizes = prompt_buckets(8192)

    def bucket(self, tokens):
        return next((size for size in self.sizes if size >= tokens), None)


def test_every_lockstep_rank_takes_the_agreed_path_with_the_same_exchange_size():
    """Under lockstep the agreed mode and token count alone decide how a step runs, so a busy rank (its own
    step decode-only or not) and an idle rank (no step of its own) replay the same decode graph size or prompt
    bucket, or pad their eager exchanges alike; without lockstep the rank's own step decides."""
    from engine.lockstep import DECODE_GRAPH, EAGER, PROMPT_GRAPHS
    from engine.runner.cuda_graphs import capture_sizes
    from engine.runner.cuda_graphs import step_path
    graphs, prompt, buckets = _Graphs(), _Buckets(), capture_sizes(256)
    for mode, tokens, expected in [(DECODE_GRAPH, 7, ("decode", 8)), (DECODE_GRAPH, 200, ("decode", 208)),
                                   (PROMPT_GRAPHS, 7, ("prompt", 64)), (PROMPT_GRAPHS, 600, ("prompt", 768)),
                                   (PROMPT_GRAPHS, 8192, ("prompt", 8192)), (EAGER, 600, ("eager", 640)),
                                   (EAGER, 7, ("eager", 8))]:
        paths = {step_path(mode, tokens, decode_only, graphs, prompt, buckets) for decode_only in (True, False)}
        assert paths == {expected}, (mode, tokens)
    # a rank without prompt-step graphs (lockstep makes the group run such a step eagerly: engine/lockstep.py)
    assert step_path(EAGER, 600, False, graphs, None, buckets) == ("eager", 640)
    # without lockstep
    assert step_path(None, 7, True, graphs, prompt, buckets) == ("decode", 8)
    assert step_path(None, 300, True, graphs, prompt, buckets) == ("prompt", 320)  # above the decode graphs
    assert step_path(None, 7, False, graphs, prompt, buckets) == ("prompt", 64)
    assert step_path(None, 7, False, graphs, None, buckets) == ("eager", 8)
    assert step_path(None, 7, True, None, None, buckets) == ("eager", 8)


def test_a_rank_without_prompt_graphs_turns_the_groups_prompt_graph_step_eager(monkeypatch):
    from engine import parallel
    from engine.lockstep import DECODE_GRAPH, EAGER, PROMPT_GRAPHS, Lockstep
    votes = []

    def max_of_both(values):  # the other DP rank voted PROMPT_GRAPHS and has its graphs
        votes.append(values)
        return [max(a, b) for a, b in zip(values, [1, 300, PROMPT_GRAPHS, 0])]
    monkeypatch.setattr(parallel, "dp_agree", max_of_both)
    lockstep = Lockstep()
    assert lockstep.agree(1, 4, DECODE_GRAPH).mode == PROMPT_GRAPHS
    assert lockstep.agree(1, 4, DECODE_GRAPH, without_prompt_graphs=True).mode == EAGER
    assert votes[-1] == [1, 4, DECODE_GRAPH, 1]


def test_an_idle_rank_replays_its_bucket_with_no_real_row(monkeypatch):
    """run_dummy replays every graph of the bucket's chain and runs each attention call between them on one
    row with no metadata, with valid_tokens 0 (the MoE layers route nothing)."""
    from engine.runner import prompt_graphs as module
    chains = module.PromptGraphs.__new__(module.PromptGraphs)
    chains.block_size, chains.valid_tokens = 16, torch.tensor([5])
    seen = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            seen.append((self.name, int(chains.valid_tokens), get_forward_context().attn_metadata))

    def call(rows):
        seen.append(("attention", rows, get_forward_context().moe.padded_tokens))
    chains.chains = {128: module._Pieces(graphs=[Graph("g0"), Graph("g1")], calls=[call])}
    chains.run_dummy(128)
    assert seen == [("g0", 0, None), ("attention", 1, 128), ("g1", 0, None)]
