"""Host-side step inputs when sampled tokens are still on the device (steps launched ahead)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.runner.input_batch import RunnerRequest, prepare_host_inputs


def request(num_known: int, num_computed: int, num_pending: int, pending_row: int = 0) -> RunnerRequest:
    return RunnerRequest("r", list(range(100, 100 + num_known)), 8, SamplingParams(), [3, 7],
                         num_computed, num_pending, pending_row, 1)


@pytest.mark.parametrize("num_pending", [1, 2])
def test_decode_input_comes_from_the_newest_pending_token(num_pending):
    # 10 known tokens; the pending ones were sampled by the last `num_pending` launched steps, and all but
    # the newest were already inputs of a launched step (their KV is written).
    r = request(num_known=10, num_computed=10 + num_pending - 1, num_pending=num_pending, pending_row=3)
    host = prepare_host_inputs({"r": r}, {"r": 1}, block_size=16)
    position = 10 + num_pending - 1
    assert host.pending_positions == [0] and host.pending_rows == [3]
    assert host.positions.tolist() == [position]
    assert host.slot_mapping.tolist() == [3 * 16 + position]
    assert host.logits_indices == [0] and host.sampling_requests == [r]
    assert r.num_computed_tokens == position + 1


def test_known_tokens_are_taken_from_the_host():
    r = request(num_known=12, num_computed=10, num_pending=0)
    host = prepare_host_inputs({"r": r}, {"r": 2}, block_size=8)
    assert host.input_ids.tolist() == [110, 111] and host.pending_positions == []
    assert host.positions.tolist() == [10, 11]
    assert host.slot_mapping.tolist() == [7 * 8 + 2, 7 * 8 + 3]


def test_a_chunk_missing_more_than_its_last_token_is_refused():
    r = request(num_known=10, num_computed=10, num_pending=2)
    with pytest.raises(AssertionError):
        prepare_host_inputs({"r": r}, {"r": 2}, block_size=16)


# ---- decode-graph input buffers (engine/runner/cuda_graphs.py): their host side runs anywhere ------------

def decode_batch(pending: list[bool]):
    """A decode step of len(pending) requests with 20 known tokens each (block size 16, blocks 2r+1, 2r+2);
    request r's newest token is pending (sampled on row 5 - r of the last step) where pending[r]."""
    requests = {}
    for r, is_pending in enumerate(pending):
        computed = 20 if is_pending else 19
        requests[f"r{r}"] = RunnerRequest(f"r{r}", list(range(100 * r, 100 * r + 20)), 8, SamplingParams(),
                                          [2 * r + 1, 2 * r + 2], computed, int(is_pending), 5 - r, 1)
    return prepare_host_inputs(requests, {name: 1 for name in requests}, block_size=16)


def two_group_batch():
    """The decode step of decode_batch([True, False, True]) with a second (sliding-window) cache group whose
    blocks are 40 + 2r + 1, 40 + 2r + 2."""
    requests = {}
    for r, is_pending in enumerate([True, False, True]):
        computed = 20 if is_pending else 19
        requests[f"r{r}"] = RunnerRequest(f"r{r}", list(range(100 * r, 100 * r + 20)), 8, SamplingParams(),
                                          [2 * r + 1, 2 * r + 2], computed, int(is_pending), 5 - r, 1,
                                          group_block_ids=[[41 + 2 * r, 42 + 2 * r]])
    return prepare_host_inputs(requests, {name: 1 for name in requests}, block_size=16, group_ratios=(1, 1))


def test_graph_token_buffer_pads_rows_and_marks_pending_sources():
    import numpy as np

    from engine.runner.cuda_graphs import pack_tokens
    host = decode_batch([True, False, True])
    tokens = pack_tokens(host, 4)
    assert tokens.dtype == np.int64 and tokens.shape == (4, 4)
    assert tokens[0].tolist() == [0, 119, 0, 0], "pending ids are filled on the device"
    assert tokens[1].tolist() == [20, 19, 20, 0]
    assert tokens[2].tolist() == [2 * 16 + 4, 4 * 16 + 3, 6 * 16 + 4, -1], "the padding row stores nothing"
    assert tokens[3].tolist() == [5, -1, 3, -1], "a known id has no source row"


@pytest.mark.parametrize("width", [None, 2])
def test_graph_table_buffer_holds_seq_lens_then_the_block_table(width):
    from engine.runner.cuda_graphs import pack_tables
    host = decode_batch([True, True])
    max_blocks = 6
    tables = pack_tables(host, 4, width or max_blocks)
    seq_lens, table = tables[:4], tables[4:].reshape(4, width or max_blocks)
    assert seq_lens.tolist() == [21, 21, 1, 1], "padding rows attend to one token"
    assert table[:, :2].tolist() == [[1, 2], [3, 4], [0, 0], [0, 0]] and not table[:, 2:].any()


def test_whole_table_rows_only_while_small_or_mostly_used():
    from engine.runner.cuda_graphs import whole_table_rows
    assert whole_table_rows(8, 3, 256), "8 rows of 256 blocks: 8 KB"
    assert not whole_table_rows(256, 3, 2048), "256 rows of 2048 blocks, 3 used"
    assert whole_table_rows(256, 1500, 2048), "most of each row used"


def test_pending_ids_are_filled_from_the_previous_samples():
    import torch

    from engine.runner.cuda_graphs import fill_pending
    last_sampled = torch.tensor([70, 71, 72, 73, 74, 75])
    ids = torch.tensor([0, 119, 0])
    fill_pending(ids, torch.tensor([5, -1, 3]), last_sampled, all_pending=False)
    assert ids.tolist() == [75, 119, 73]
    ids = torch.zeros(2, dtype=torch.int64)
    fill_pending(ids, torch.tensor([2, 0]), last_sampled, all_pending=True)
    assert ids.tolist() == [72, 70]


@pytest.mark.parametrize("max_model_len", [128, 1 << 20], ids=["whole rows", "used columns"])
def test_graph_run_fills_the_padded_sizes_buffers(max_model_len, monkeypatch):
    """`DecodeGraphs.run` up to the replay, on the CPU (pinned staging is a GPU matter): a 3-request step
    pads to the captured size 4, its inputs land in that size's buffers (block table as whole rows, or as
    its used columns for a long max_model_len), pending ids come from the last samples."""
    import torch

    from engine.runner.cuda_graphs import DecodeGraphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    graphs = DecodeGraphs(None, None, 16, max_model_len, 8, torch.device("cpu"))
    assert graphs.sizes == [1, 2, 4, 8]
    seen = {}

    class Replay:
        def __init__(self, size):
            self.size = size

        def replay(self):
            seen["views"] = [view.clone() for view in graphs._views(self.size)]

    graphs.graphs = {size: Replay(size) for size in graphs.sizes}
    graphs.outputs = {size: torch.arange(size * 2).view(size, 2) for size in graphs.sizes}
    graphs._views(4)[5].fill_(99)  # stale table entries from an earlier step
    host = decode_batch([True, False, True])
    hidden = graphs.run(host, torch.tensor([70, 71, 72, 73, 74, 75]))
    assert hidden.tolist() == [[0, 1], [2, 3], [4, 5]]
    input_ids, positions, slots, sources, seq_lens, table = seen["views"]
    assert input_ids.tolist() == [75, 119, 73, 0] and positions.tolist() == [20, 19, 20, 0]
    assert slots.tolist()[3] == -1 and sources.tolist() == [5, -1, 3, -1]
    assert seq_lens.tolist() == [21, 20, 21, 1]
    assert table[:, :2].tolist() == [[1, 2], [3, 4], [5, 6], [0, 0]]
    whole_rows = max_model_len == 128
    assert bool((table[:, 2:] == 0).all()) == whole_rows, "used columns leave the rest as it was (unread)"


def test_an_ep_step_pads_to_the_groups_size_and_an_idle_rank_replays_padding_only(monkeypatch):
    """Under expert parallelism every rank replays the graph of the largest rank's batch: a 3-request step
    whose group agreed on 7 tokens runs size 8 with 3 real rows; an idle rank's dummy step replays size 8
    with no real row (seq lens 1, no cache slots), and the graphs' MoE layers read those counts."""
    import torch

    from engine.runner.cuda_graphs import DecodeGraphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    graphs = DecodeGraphs(None, None, 16, 128, 8, torch.device("cpu"))
    seen = []

    class Replay:
        def __init__(self, size):
            self.size = size

        def replay(self):
            seen.append((self.size, int(graphs.valid_tokens), [v.clone() for v in graphs._views(self.size)]))

    graphs.graphs = {size: Replay(size) for size in graphs.sizes}
    graphs.outputs = {size: torch.zeros(size, 2) for size in graphs.sizes}
    assert graphs.run(decode_batch([True, False, True]), torch.arange(70, 76), size=8).shape == (3, 2)
    graphs.run_dummy(8)
    (size, valid, views), (dummy_size, dummy_valid, dummy_views) = seen
    assert (size, valid, dummy_size, dummy_valid) == (8, 3, 8, 0)
    assert views[2].tolist()[3:] == [-1] * 5  # padding rows store nothing
    assert dummy_views[2].tolist() == [-1] * 8 and dummy_views[4].tolist() == [1] * 8


def test_only_decode_only_plans_within_the_graphs_can_replay():
    import torch

    from engine.core.scheduler_output import NewRequestData, SchedulerOutput
    from engine.runner.cuda_graphs import DecodeGraphs
    graphs = DecodeGraphs(None, None, 16, 128, 4, torch.device("cpu"))
    running = {f"r{i}": RunnerRequest(f"r{i}", [1, 2, 3], 2, SamplingParams(), [0], 3) for i in range(5)}
    assert graphs.can_replay(SchedulerOutput(num_scheduled_tokens={"r0": 1, "r1": 1}), running)
    assert not graphs.can_replay(SchedulerOutput(num_scheduled_tokens={"r0": 1, "r1": 2}), running)  # a chunk
    assert not graphs.can_replay(SchedulerOutput(num_scheduled_tokens={f"r{i}": 1 for i in range(5)}), running)
    with_logprobs = NewRequestData("new", [4, 5, 6], 3, SamplingParams(prompt_logprobs=1), [1], 2)
    assert graphs.can_replay(SchedulerOutput([with_logprobs], num_scheduled_tokens={"new": 1}), running)
    with_logprobs.num_computed_tokens = 1  # a prompt position still to score
    assert not graphs.can_replay(SchedulerOutput([with_logprobs], num_scheduled_tokens={"new": 1}), running)


@pytest.mark.parametrize("max_model_len", [128, 1 << 20], ids=["whole rows", "used columns"])
def test_graphs_of_two_cache_groups_fill_each_groups_table_and_slots(max_model_len, monkeypatch):
    """A model with a sliding-window group beside the full one (gpt-oss, Gemma 4): each group has its own
    slot-mapping row and block table in the size's buffers, the captured metadata hands each layer its
    group's views (`for_group`), padding rows store nothing in either group, an idle rank's dummy step
    neither."""
    import torch

    from engine.kernels.attention import AttentionBackend
    from engine.runner.cuda_graphs import DecodeGraphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    full, window = (1, None), (1, 8)
    backend = type("Backend", (AttentionBackend,), {"build_metadata": staticmethod(lambda common, size: common)})
    graphs = DecodeGraphs(None, backend, 16, max_model_len, 8, torch.device("cpu"), [full, window])
    seen = []

    class Replay:
        def __init__(self, size):
            self.size = size

        def replay(self):
            seen.append([(t.clone(), s.clone()) for t, s in graphs._group_views(self.size)])

    graphs.graphs = {size: Replay(size) for size in graphs.sizes}
    graphs.outputs = {size: torch.zeros(size, 2) for size in graphs.sizes}
    for table, _ in graphs._group_views(4):
        table.fill_(99)  # stale entries from an earlier step
    host = two_group_batch()
    graphs.run(host, torch.arange(70, 76))
    (full_table, full_slots), (window_table, window_slots) = seen[0]
    assert full_table[:, :2].tolist() == [[1, 2], [3, 4], [5, 6], [0, 0]]
    assert window_table[:, :2].tolist() == [[41, 42], [43, 44], [45, 46], [0, 0]]
    assert full_slots.tolist() == host.slot_mapping.tolist() + [-1]
    assert window_slots.tolist() == host.group_slot_mappings[0].tolist() + [-1]
    assert window_slots.tolist()[:3] == [42 * 16 + 4, 44 * 16 + 3, 46 * 16 + 4], "the window group's own blocks"
    graphs.run_dummy(4)
    assert all(slots.tolist() == [-1] * 4 for _, slots in seen[1]), "an idle rank stores in no group"

    metadata = graphs._metadata(4)
    for key, (table, slots) in zip([full, window], graphs._group_views(4)):
        view = metadata.for_group(key)
        assert view.block_table.data_ptr() == table.data_ptr() and view.slot_mapping.data_ptr() == slots.data_ptr()
    assert metadata.for_group(full) is metadata and metadata.for_group(window) is metadata.for_group(window)
