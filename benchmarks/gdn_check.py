"""Gated DeltaNet on a GPU: flash-linear-attention's kernels (engine/kernels/triton/gdn.py) against the torch
references at Qwen3-Next-80B-A3B's per-rank shape (TP=1 by default), on fresh random bf16 inputs with float32
states in a state pool: the largest error of the outputs and of the states, and the time per call of both
(CUDA events). A prefill is one sequence continuing from a nonzero state; a decode batch reads and writes
slots out of order. Decode also times FLA's own GDN recurrent kernel over gathered and scattered states, the
alternative the adapter does not take. Exits nonzero when an error exceeds the tolerance or a case fails.

    PYTHONPATH=. python -m benchmarks.gdn_check --out gdn.json   (fla importable: the `gdn` extra)
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import environment_record, print_table  # noqa: E402
from engine.kernels.attention import CommonAttentionMetadata  # noqa: E402
from engine.kernels.torch import gdn as reference  # noqa: E402
from engine.kernels.triton import gdn  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen3-next-80b-a3b" / "config.json"
TOLERANCE = 2e-2  # largest error relative to the reference's largest magnitude, for bf16 inputs
PREFILL_TOKENS, DECODE_BATCHES = (1024, 8192), (1, 64, 256)


# ---- inputs (tests/engine/kernels/test_triton_gdn.py uses these too) ---------------------------------------
def step_metadata(lengths: list[int], slots: list[int], device) -> CommonAttentionMetadata:
    """A step of sequences with `lengths` new tokens each (the one-token ones first, as the runner orders
    them), each in state slot `slots[i]`; the paged-cache fields, which the Gated DeltaNet ops do not read,
    are placeholders."""
    num_decodes = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    assert all(n > 1 for n in lengths[num_decodes:]), "decodes go first"
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return CommonAttentionMetadata(
        num_seqs=len(lengths), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=torch.zeros(len(lengths), 1, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        max_query_len=max(lengths), max_seq_len=max(lengths), query_start_loc_cpu=starts, seq_lens_cpu=list(lengths),
        num_computed_tokens_cpu=[0] * len(lengths),
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device), state_slots_cpu=list(slots))


def delta_rule_inputs(num_tokens: int, heads: int, dk: int, dv: int, device, dtype=torch.bfloat16):
    """q, k [T, H, dk], v [T, H, dv] in `dtype`; g (log decay, float32, as the layer computes it) and beta [T, H].
    The decays are mild (about 0.95 a token), so the states remember far back."""
    q, k = (torch.randn(num_tokens, heads, dk, device=device).to(dtype) for _ in range(2))
    v = torch.randn(num_tokens, heads, dv, device=device).to(dtype)
    g = F.logsigmoid(torch.randn(num_tokens, heads, device=device) + 3)
    beta = torch.rand(num_tokens, heads, device=device).to(dtype)
    return q, k, v, g, beta


def conv_inputs(num_tokens: int, channels: int, width: int, device, dtype=torch.bfloat16):
    """x [T, C] and weight [C, width], scaled so the convolution's output stays near one."""
    x = torch.randn(num_tokens, channels, device=device).to(dtype)
    weight = (torch.randn(channels, width, device=device) / width ** 0.5).to(dtype)
    return x, weight


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error relative to the expected tensor's largest magnitude."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))


# ---- the check ---------------------------------------------------------------------------------------------
def per_rank_shape(config_path: Path, tensor_parallel_size: int) -> dict:
    config = json.loads(config_path.read_text())
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    assert nk % tensor_parallel_size == 0, (nk, tensor_parallel_size)
    nk_local, nv_local = nk // tensor_parallel_size, nv // tensor_parallel_size
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    return dict(heads=nv_local, dk=dk, dv=dv, channels=2 * nk_local * dk + nv_local * dv,
                width=config["linear_conv_kernel_dim"])


def cuda_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gather_scatter_recurrent(q, k, v, g, beta, state, metadata):
    """The decode path not taken: FLA's GDN recurrent kernel over the decodes' states gathered from the pool
    and scattered back."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    slots = metadata.state_slots
    o, final = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                 initial_state=state.index_select(0, slots), output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    state.index_copy_(0, slots, final)
    return o[:, 0]


class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def case(self, op: str, case: str, run, make_pool, reference_run, slow_reference: bool,
             checked: bool = True) -> None:
        """`run` / `reference_run`: (pool) -> output, updating the pool; both start from a copy of make_pool().
        An unchecked case (a path the engine does not take) is reported but fails nothing."""
        try:
            pool = make_pool()
            ours_pool, reference_pool = pool.clone(), pool.clone()
            ours, expected = run(ours_pool), reference_run(reference_pool)
            torch.cuda.synchronize()
            row = dict(op=op, case=case, checked=checked,
                       out_max_abs_error=float((ours.float() - expected.float()).abs().max()),
                       out_rel_error=relative_error(ours, expected),
                       state_max_abs_error=float((ours_pool.float() - reference_pool.float()).abs().max()),
                       state_rel_error=relative_error(ours_pool, reference_pool))
            row["ok"] = all(error <= TOLERANCE for error in (row["out_rel_error"], row["state_rel_error"]))  # NaN fails
            row["fla_ms"] = cuda_ms(lambda: run(ours_pool), warmup=3, iters=20)
            row["torch_ms"] = cuda_ms(lambda: reference_run(reference_pool), warmup=1,
                                      iters=2 if slow_reference else 10)
            row["speedup"] = row["torch_ms"] / row["fla_ms"]
        except Exception as exc:  # one failing case is reported, and the others still run
            traceback.print_exc()
            row = dict(op=op, case=case, checked=checked, ok=False, error=f"{type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
        self.rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def check(shape: dict, report: Report) -> None:
    device = torch.device("cuda")
    heads, dk, dv, channels, width = (shape[k] for k in ("heads", "dk", "dv", "channels", "width"))
    for tokens in PREFILL_TOKENS:
        slot, pool_slots = 3, 8
        metadata = step_metadata([tokens], [slot], device)
        q, k, v, g, beta = delta_rule_inputs(tokens, heads, dk, dv, device)
        states = torch.randn(pool_slots, heads, dk, dv, device=device)  # a continuing prefill: nonzero
        report.case("gated_delta_rule", f"prefill T={tokens}",
                    lambda pool: gdn.gated_delta_rule(q, k, v, g, beta, pool, metadata), lambda: states,
                    lambda pool: reference.gated_delta_rule(q, k, v, g, beta, pool, metadata), slow_reference=True)
        x, weight = conv_inputs(tokens, channels, width, device)
        conv_states = torch.randn(pool_slots, channels, width - 1, device=device).to(x.dtype)
        report.case("causal_conv1d", f"prefill T={tokens}",
                    lambda pool: gdn.causal_conv1d(x, weight, pool, metadata), lambda: conv_states,
                    lambda pool: reference.causal_conv1d(x, weight, pool, metadata), slow_reference=True)
    for batch in DECODE_BATCHES:
        slots = torch.randperm(2 * batch)[:batch].tolist()  # out of order, half the pool unused
        metadata = step_metadata([1] * batch, slots, device)
        q, k, v, g, beta = delta_rule_inputs(batch, heads, dk, dv, device)
        states = torch.randn(2 * batch, heads, dk, dv, device=device)
        report.case("gated_delta_rule", f"decode B={batch}",
                    lambda pool: gdn.gated_delta_rule(q, k, v, g, beta, pool, metadata), lambda: states,
                    lambda pool: reference.gated_delta_rule(q, k, v, g, beta, pool, metadata), slow_reference=False)
        report.case("gated_delta_rule", f"decode B={batch} (alt: gather/scatter)",
                    lambda pool: gather_scatter_recurrent(q, k, v, g, beta, pool, metadata), lambda: states,
                    lambda pool: reference.gated_delta_rule(q, k, v, g, beta, pool, metadata), slow_reference=False,
                    checked=False)
        x, weight = conv_inputs(batch, channels, width, device)
        conv_states = torch.randn(2 * batch, channels, width - 1, device=device).to(x.dtype)
        report.case("causal_conv1d", f"decode B={batch}",
                    lambda pool: gdn.causal_conv1d(x, weight, pool, metadata), lambda: conv_states,
                    lambda pool: reference.causal_conv1d(x, weight, pool, metadata), slow_reference=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--config", type=Path, default=CONFIG, help="a config.json with the linear_* fields")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="the per-rank share of the heads")
    args = parser.parse_args()
    reason = gdn.unavailable_reason()
    if reason is not None:
        print(f"gdn_check: FLA's kernels cannot run here: {reason}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shape = per_rank_shape(args.config, args.tensor_parallel_size)
    print(f"shape per rank: {shape}; tolerance {TOLERANCE} (error / reference's largest magnitude)", flush=True)
    report = Report()
    check(shape, report)
    print()
    print_table(["op", "case", "out err (abs / rel)", "state err (abs / rel)", "fla ms", "torch ms", "speedup", "ok"],
                [(r["op"], r["case"], *_table_cells(r)) for r in report.rows])
    failed = [f"{r['op']} {r['case']}" for r in report.rows if r["checked"] and not r["ok"]]
    import fla
    record = dict(environment_record(), fla=fla.__version__, config=str(args.config),
                  tensor_parallel_size=args.tensor_parallel_size, shape=shape, tolerance=TOLERANCE,
                  rows=report.rows, failed=failed)
    Path(args.out).write_text(json.dumps(record, indent=2))
    if failed:
        print(f"gdn_check: FAILED (error above {TOLERANCE} or an exception): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _table_cells(row: dict) -> tuple:
    if "error" in row:
        return (row["error"], "", "", "", "", "FAILED" + ("" if row["checked"] else " (not used)"))
    return (f"{row['out_max_abs_error']:.2e} / {row['out_rel_error']:.2e}",
            f"{row['state_max_abs_error']:.2e} / {row['state_rel_error']:.2e}",
            f"{row['fla_ms']:.3f}", f"{row['torch_ms']:.3f}", f"{row['speedup']:.1f}x",
            ("ok" if row["ok"] else "BAD") + ("" if row["checked"] else " (not used)"))


if __name__ == "__main__":
    sys.exit(main())
