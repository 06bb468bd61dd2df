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
