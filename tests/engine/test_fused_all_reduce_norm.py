"""The fused all-reduce + residual add + RMSNorm kernel as rank 0 of two, in one process: the peer's buffer and
flags are plain tensors, and what rank 1 would have sent (its rows in rank 0's buffer, its epoch in rank 0's
flags) is written beforehand. Compiled on a CUDA GPU, else under TRITON_INTERPRET=1 on CPU (set before any
kernel module is imported)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from triton_device import DEVICE, ON_GPU  # noqa: E402  (skips the module without Triton)

from engine.kernels.torch import ops as reference  # noqa: E402
from engine.parallel.fused_all_reduce_norm import all_reduce_add_norm, buffer_numel, flags_numel  # noqa: E402

WORLD, RANK, PEER, MAX_ROWS = 2, 0, 1, 8


class FakeGroup:
    """Rank 0's view of a two-rank group: both ranks' buffers and flags, and their address tables."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self.buffers = [torch.zeros(buffer_numel(WORLD, MAX_ROWS, hidden), device=DEVICE) for _ in range(WORLD)]
        self.flags = [torch.zeros(flags_numel(WORLD, MAX_ROWS), dtype=torch.int32, device=DEVICE)
                      for _ in range(WORLD)]
        self.error_flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEVICE)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=DEVICE)

    def slots(self, rank: int) -> torch.Tensor:
        """What `rank` received: [slot, row, source rank, hidden]."""
        return self.buffers[rank].view(2, MAX_ROWS, WORLD, self.hidden)

    def signalled(self, rank: int) -> torch.Tensor:
        """The epoch each source rank signalled to `rank`, per [row, source rank]."""
        return self.flags[rank][:MAX_ROWS * WORLD].view(MAX_ROWS, WORLD)

    def epochs(self, rank: int) -> torch.Tensor:
        """`rank`'s own call count per row."""
        return self.flags[rank][MAX_ROWS * WORLD:]

    def peer_sends(self, rows: torch.Tensor, epoch: int) -> None:
        """Rank 1's part of the protocol for call `epoch`: its rows into rank 0's slot, then its signal."""
        self.slots(RANK)[epoch % 2, :len(rows), PEER] = rows
        self.signalled(RANK)[:len(rows), PEER] = epoch

    def run(self, partial, residual, weight, eps=1e-6, max_spins=2 ** 10):
        return all_reduce_add_norm(partial, residual, weight, eps, self.buffer_ptrs, self.flag_ptrs,
                                   self.error_flag, RANK, MAX_ROWS, max_spins)


def inputs(rows: int, hidden: int, weight_dtype, residual_dtype, on_grid: bool = False):
    """Rank 0's and rank 1's partial sums, the residual and the weight. `on_grid`: multiples of 1/8 small
    enough that every sum is exact in bf16, so no rounding mode matters (the interpreter truncates to bf16
    where the GPU rounds to nearest)."""
    torch.manual_seed(rows * 1000 + hidden)
    if on_grid:
        values = [torch.randint(-32, 33, (rows, hidden), device=DEVICE) / 8 for _ in range(3)]
    else:
        values = [torch.randn(rows, hidden, device=DEVICE) for _ in range(3)]
    own, peer, residual = values
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(weight_dtype)
    return own, peer, residual.to(residual_dtype), weight


def assert_matches_reference(normed, new_residual, own, peer, residual, weight, exact_sum: bool) -> None:
    expected_normed, expected_residual = reference.fused_add_rms_norm(own + peer, residual, weight, 1e-6)
    assert new_residual.dtype == residual.dtype and normed.dtype == weight.dtype
    if exact_sum:
        assert torch.equal(new_residual, expected_residual)
    else:  # within a bf16 rounding of each of the two sums
        bound = 2 * 2 ** -7 * ((own + peer).abs() + residual.float().abs())
        assert ((new_residual.float() - expected_residual.float()).abs() <= bound).all()
    tolerance = dict(rtol=1e-5, atol=1e-5) if weight.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(normed, expected_normed, **tolerance)


CASES = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]
CASE_IDS = ["bf16-weight-fp32-residual", "bf16", "fp32"]


@pytest.mark.parametrize("weight_dtype,residual_dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("hidden", [64, 96])
def test_matches_the_reference_on_the_sum_of_both_ranks(weight_dtype, residual_dtype, rows, hidden):
    own, peer, residual, weight = inputs(rows, hidden, weight_dtype, residual_dtype)
    group = FakeGroup(hidden)
    group.peer_sends(peer, epoch=1)
    normed, new_residual = group.run(own, residual, weight)
    exact = ON_GPU or weight_dtype == torch.float32  # no bf16 rounding on the way, or the GPU's
    assert_matches_reference(normed, new_residual, own, peer, residual, weight, exact_sum=exact)
    assert group.error_flag.item() == 0


@pytest.mark.parametrize("weight_dtype,residual_dtype", CASES, ids=CASE_IDS)
def test_new_residual_is_exactly_the_references_where_sums_are_representable(weight_dtype, residual_dtype):
    own, peer, residual, weight = inputs(5, 96, weight_dtype, residual_dtype, on_grid=True)
    group = FakeGroup(96)
    group.peer_sends(peer, epoch=1)
    normed, new_residual = group.run(own, residual, weight)
    assert_matches_reference(normed, new_residual, own, peer, residual, weight, exact_sum=True)


def test_accepts_a_partial_in_the_activations_dtype():
    own, peer, residual, weight = inputs(3, 64, torch.bfloat16, torch.bfloat16, on_grid=True)
    group = FakeGroup(64)
    group.peer_sends(peer, epoch=1)
    normed, new_residual = group.run(own.to(torch.bfloat16), residual, weight)
    assert_matches_reference(normed, new_residual, own, peer, residual, weight, exact_sum=True)


def test_sends_its_rows_to_the_peer_and_signals_the_epoch():
    rows = 3
    own, peer, residual, weight = inputs(rows, 64, torch.bfloat16, torch.float32)
    group = FakeGroup(64)
    group.peer_sends(peer, epoch=1)
    group.run(own, residual, weight)
    assert torch.equal(group.slots(PEER)[1, :rows, RANK], own)  # epoch 1 goes to slot 1
    assert (group.signalled(PEER)[:rows, RANK] == 1).all() and (group.signalled(PEER)[rows:] == 0).all()
    assert group.epochs(RANK).tolist() == [1] * rows + [0] * (MAX_ROWS - rows)
    assert group.error_flag.item() == 0


def test_consecutive_calls_alternate_slots_and_accept_a_peer_one_epoch_ahead():
    first = inputs(2, 64, torch.float32, torch.float32)
    second = inputs(2, 64, torch.float32, torch.float32, on_grid=True)
    group = FakeGroup(64)
    group.peer_sends(first[1], epoch=1)
    group.peer_sends(second[1], epoch=2)  # rank 1 already finished both calls
    for own, peer, residual, weight in (first, second):
        normed, new_residual = group.run(own, residual, weight)
        assert_matches_reference(normed, new_residual, own, peer, residual, weight, exact_sum=True)
    assert torch.equal(group.slots(PEER)[1, :2, RANK], first[0])  # odd epochs in slot 1, even in slot 0
    assert torch.equal(group.slots(PEER)[0, :2, RANK], second[0])
    assert (group.signalled(PEER)[:2, RANK] == 2).all() and group.error_flag.item() == 0


def test_the_epoch_wraps_around():
    own, peer, residual, weight = inputs(1, 64, torch.float32, torch.float32)
    group = FakeGroup(64)
    group.epochs(RANK)[0] = 2 ** 31 - 1  # the next call is epoch -2**31 in int32
    group.peer_sends(peer, epoch=-2 ** 31)
    normed, new_residual = group.run(own, residual, weight)
    assert_matches_reference(normed, new_residual, own, peer, residual, weight, exact_sum=True)
    assert group.error_flag.item() == 0


def test_a_missing_peer_signal_sets_the_error_flag_instead_of_hanging():
    own, peer, residual, weight = inputs(2, 64, torch.bfloat16, torch.float32)
    group = FakeGroup(64)
    group.slots(RANK)[1, :2, PEER] = peer  # the rows came, the signal did not
    group.run(own, residual, weight, max_spins=4)
    assert group.error_flag.item() == 1


def test_after_a_time_out_later_calls_stop_waiting():
    own, peer, residual, weight = inputs(1, 64, torch.bfloat16, torch.float32)
    group = FakeGroup(64)
    group.run(own, residual, weight, max_spins=4)
    group.run(own, residual, weight, max_spins=2 ** 30)  # would not end in time under the interpreter
    assert group.error_flag.item() == 1


def test_rejects_rows_over_the_one_pass_limit():
    group = FakeGroup(64)
    x = torch.zeros(1, 16384, device=DEVICE)
    with pytest.raises(AssertionError, match="one-pass"):
        group.run(x, x, torch.ones(16384, device=DEVICE))
