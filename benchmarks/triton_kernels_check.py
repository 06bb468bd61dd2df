"""Checks every Triton kernel against the torch reference at real model sizes (Llama-3.1-8B shapes by
default) on fresh random inputs, then times both (median of triton.testing.do_bench). Decode attention also
reports the bandwidth it reaches, as a share of a device-to-device copy measured in the same run.

    python benchmarks/triton_kernels_check.py --out triton_kernels.json [--dtype bfloat16] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.kernels.attention import CommonAttentionMetadata  # noqa: E402
from engine.kernels.sampling import SamplingTensors  # noqa: E402
from engine.kernels.torch import ops as reference  # noqa: E402
from engine.kernels.torch.attention import TorchAttentionBackend  # noqa: E402
from engine.kernels.torch.sampling import apply_top_k_top_p_min_p  # noqa: E402
from engine.kernels.torch.sampling import sample as reference_sample  # noqa: E402
from engine.kernels.triton import ops  # noqa: E402
from engine.kernels.triton.attention import TritonAttentionBackend  # noqa: E402
from engine.kernels.triton.sampling import sample  # noqa: E402

DEVICE = "cuda"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class ModelShape:  # Llama-3.1-8B
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    block_size: int = 16


class Report:
    def __init__(self, dtype: torch.dtype) -> None:
        self.rows: list[dict] = []
        self.dtype = dtype
        self.copy_gbps = float("nan")  # measured at start-up: decode bandwidth is stated against it

    def add(self, kernel: str, case: str, error: float | None, triton_ms: float, torch_ms: float | None,
            tolerance: float | None = None, **extra) -> None:
        tolerance = TOLERANCE[self.dtype] if tolerance is None else tolerance
        row = dict(kernel=kernel, case=case, max_rel_error=error, ok=error is None or error <= tolerance,
                   triton_us=triton_ms * 1e3, torch_us=None if torch_ms is None else torch_ms * 1e3,
                   speedup=None if torch_ms is None else torch_ms / triton_ms, **extra)
        self.rows.append(row)
        print(format_row(row), flush=True)

    def failed(self, kernel: str, case: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.rows.append(dict(kernel=kernel, case=case, ok=False, error=f"{type(exc).__name__}: {exc}"))
        print(f"{kernel:<20} {case:<34} FAILED: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()


def format_row(row: dict) -> str:
    def num(value, spec):
        return format(value, spec) if value is not None else "-"
    extra = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                      if k not in ("kernel", "case", "max_rel_error", "ok", "triton_us", "torch_us", "speedup"))
    return (f"{row['kernel']:<20} {row['case']:<34} {num(row['max_rel_error'], '9.2e')} "
            f"{'ok' if row['ok'] else 'BAD':<4} {num(row['triton_us'], '10.1f')} {num(row['torch_us'], '10.1f')} "
            f"{num(row['speedup'], '7.2f')}  {extra}")


def header() -> str:
    return (f"{'kernel':<20} {'case':<34} {'rel.err':>9} {'':<4} {'triton us':>10} {'torch us':>10} "
            f"{'speedup':>7}  extra")


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).abs().max()
    return float(diff / expected.float().abs().max().clamp_min(1e-30))


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB: the practical memory-bandwidth ceiling of this GPU."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


# ---- norms, rotary, activation ------------------------------------------------------------------------

def check_elementwise(report: Report, shape: ModelShape, dtype, token_counts) -> None:
    for tokens in token_counts:
        case = f"T={tokens}"
        x, residual = (torch.randn(tokens, shape.hidden, device=DEVICE, dtype=dtype) for _ in range(2))
        weight = torch.randn(shape.hidden, device=DEVICE, dtype=dtype)
        report.add("rms_norm", case, rel_error(ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5)),
                   bench(lambda: ops.rms_norm(x, weight, 1e-5)), bench(lambda: reference.rms_norm(x, weight, 1e-5)))
        actual, expected = ops.fused_add_rms_norm(x, residual, weight, 1e-5), \
            reference.fused_add_rms_norm(x, residual, weight, 1e-5)
        report.add("fused_add_rms_norm", case, max(rel_error(a, e) for a, e in zip(actual, expected)),
                   bench(lambda: ops.fused_add_rms_norm(x, residual, weight, 1e-5)),
                   bench(lambda: reference.fused_add_rms_norm(x, residual, weight, 1e-5)))

        gate_up = torch.randn(tokens, 2 * shape.intermediate, device=DEVICE, dtype=dtype)
        report.add("silu_and_mul", case, rel_error(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)),
                   bench(lambda: ops.silu_and_mul(gate_up)), bench(lambda: reference.silu_and_mul(gate_up)))

        q_size, kv_size = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
        qkv = torch.randn(tokens, q_size + 2 * kv_size, device=DEVICE, dtype=dtype)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.reshape(tokens, -1, shape.head_size), k.reshape(tokens, -1, shape.head_size)
        positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, shape.head_size, 2, device=DEVICE).float() / shape.head_size))
        freqs = torch.outer(torch.arange(8192, device=DEVICE).float(), inv_freq)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        for is_neox in (True, False):
            expected = reference.rotary_embedding(positions, q.clone(), k.clone(), table, is_neox)
            actual = ops.rotary_embedding(positions, q.clone(), k.clone(), table, is_neox)
            report.add("rotary_embedding", f"{case} {'neox' if is_neox else 'gptj'}",
                       max(rel_error(a, e) for a, e in zip(actual, expected)),
                       bench(lambda: ops.rotary_embedding(positions, q, k, table, is_neox)),
                       bench(lambda: reference.rotary_embedding(positions, q, k, table, is_neox)))
        del x, residual, gate_up, qkv


# ---- attention ----------------------------------------------------------------------------------------

def make_batch(seqs: list[tuple[int, int]], block_size: int) -> tuple[CommonAttentionMetadata, int]:
    """seqs: (cached tokens, new tokens), decodes first; blocks scattered at random over the cache."""
    blocks_per_seq = [-(-(cached + new) // block_size) for cached, new in seqs]
    num_blocks = sum(blocks_per_seq) + 1
    free = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    starts, seq_lens, slots, used = [0], [], [], 0
    for row, ((cached, new), count) in enumerate(zip(seqs, blocks_per_seq)):
        blocks = torch.tensor(free[used:used + count], dtype=torch.int64)
        used += count
        table[row, :count] = blocks.to(torch.int32)
        pos = torch.arange(cached, cached + new)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
    common = CommonAttentionMetadata(
        num_seqs=len(seqs), num_decodes=sum(1 for _, new in seqs if new == 1), num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_table=table.to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE), max_query_len=max(new for _, new in seqs),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=[cached for cached, _ in seqs])
    return common, num_blocks


def check_attention(report: Report, shape: ModelShape, dtype, case: str, seqs, with_cache: bool = True) -> None:
    common, num_blocks = make_batch(seqs, shape.block_size)
    tokens, heads, kv_heads, head_size = common.num_tokens, shape.num_heads, shape.num_kv_heads, shape.head_size
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    q, k, v = (t.reshape(tokens, -1, head_size) for t in (q, k, v))
    cache = None
    if with_cache:
        cache = torch.randn(TritonAttentionBackend.kv_cache_shape(num_blocks, shape.block_size, kv_heads, head_size),
                            device=DEVICE, dtype=dtype)
    scale = head_size ** -0.5
    metadata = TritonAttentionBackend.build_metadata(common, shape.block_size)

    def run_triton():
        return TritonAttentionBackend.forward(q, k, v, cache, metadata, scale, shape.block_size)

    def run_torch():
        return TorchAttentionBackend.forward(q, k, v, cache, common, scale, shape.block_size)

    error = rel_error(run_triton(), run_torch())
    triton_ms = bench(run_triton)
    torch_ms = bench(run_torch)
    extra = {}
    element = torch.tensor([], dtype=dtype).element_size()
    if common.num_decodes == common.num_seqs:
        kv_bytes = sum(common.seq_lens_cpu) * kv_heads * head_size * 2 * element
        extra["GB/s"] = kv_bytes / (triton_ms * 1e-3) / 1e9
        extra["of_copy_bw"] = extra["GB/s"] / report.copy_gbps
        plan = next(iter(metadata._decode_plans.values()), None)
        extra["splits"] = plan[0] if plan else 1
    else:
        # Causal attention FLOPs: each new token attends to its context plus the new tokens up to itself.
        pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in seqs)
        extra["TFLOP/s"] = 4 * pairs * heads * head_size / (triton_ms * 1e-3) / 1e12
    report.add("attention", case, error, triton_ms, torch_ms, **extra)
    del qkv, cache
    torch.cuda.empty_cache()


def attention_cases(quick: bool):
    batches = [1, 16, 64] if quick else [1, 16, 64, 256]
    contexts = [1024, 8192] if quick else [512, 2048, 8192]
    for batch in batches:
        for context in contexts:
            yield f"decode B={batch} ctx={context}", [(context - 1, 1)] * batch, True
    lengths = torch.randint(64, 8192, (64,)).tolist()
    yield "decode B=64 ctx=64..8k", [(n - 1, 1) for n in lengths], True
    yield "prefill 1x8192", [(0, 8192)], True
    yield "prefill 8x1024", [(0, 1024)] * 8, True
    yield "prefill 4096 cached+2048 new", [(4096, 2048)], True
    yield "mixed 64 dec@2k + 2 prefills", [(2047, 1)] * 64 + [(0, 1024), (1024, 1024)], True
    yield "profiling 2x4096 (no cache)", [(0, 4096)] * 2, False


# ---- sampling -----------------------------------------------------------------------------------------

def sampling_tensors(rows: int, temperature: float, top_k=0, top_p=1.0, min_p=0.0) -> SamplingTensors:
    seeds = torch.randint(0, 1 << 62, (rows,)).tolist()

    def tensor(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=DEVICE)

    sampling = temperature > 0
    return SamplingTensors(
        temperature=tensor(temperature, torch.float32), top_k=tensor(top_k, torch.int64),
        top_p=tensor(top_p, torch.float32), min_p=tensor(min_p, torch.float32),
        seeds=torch.tensor(seeds, dtype=torch.int64, device=DEVICE), seeds_cpu=seeds, all_greedy=not sampling,
        any_top_k=sampling and top_k > 0, any_top_p=sampling and top_p < 1, any_min_p=sampling and min_p > 0)


def check_sampling(report: Report, shape: ModelShape, batches) -> None:
    settings = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=0.8),
                "top_k+top_p": dict(temperature=0.8, top_k=50, top_p=0.9), "min_p": dict(temperature=0.8, min_p=0.05)}
    for rows in batches:
        logits = torch.randn(rows, shape.vocab, device=DEVICE) * 4
        for name, setting in settings.items():
            t = sampling_tensors(rows, **setting)
            sampled = sample(logits, t)
            if t.all_greedy:
                # Error = share of rows whose token differs from the reference argmax.
                error = float((sampled != reference_sample(logits, t)).float().mean())
            else:
                # Error = share of rows whose token the reference's filters would have removed.
                allowed = apply_top_k_top_p_min_p(logits / t.temperature.unsqueeze(1), t) > float("-inf")
                error = float((~allowed.gather(1, sampled.unsqueeze(1))).float().mean())
            report.add("sample", f"B={rows} {name}", error, bench(lambda: sample(logits, t)),
                       bench(lambda: reference_sample(logits, t)), tolerance=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this check needs a CUDA or ROCm GPU")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    shape = ModelShape()
    report = Report(dtype)
    report.copy_gbps = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}  "
          f"device copy bandwidth {report.copy_gbps:.0f} GB/s\n{header()}", flush=True)

    sections = [
        ("elementwise", lambda: check_elementwise(report, shape, dtype, [1, 256, 4096] if args.quick
                                                  else [1, 32, 256, 4096, 16384])),
        ("sample", lambda: check_sampling(report, shape, [1, 64] if args.quick else [1, 64, 256])),
    ]
    for name, run in sections:
        try:
            run()
        except Exception as exc:  # keep going: one broken kernel should not hide the others' figures
            report.failed(name, "-", exc)
    for case, seqs, with_cache in attention_cases(args.quick):
        try:
            check_attention(report, shape, dtype, case, seqs, with_cache)
        except Exception as exc:
            report.failed("attention", case, exc)

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   dtype=args.dtype, model_shape=shape.__dict__, copy_bandwidth_gbps=report.copy_gbps,
                   all_ok=all(row["ok"] for row in report.rows), results=report.rows)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{'all kernels match the reference' if results['all_ok'] else 'SOME KERNELS FAILED'}; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
