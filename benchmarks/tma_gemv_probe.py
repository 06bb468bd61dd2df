"""Probe: the skinny GEMM with its weight tiles fetched by the Hopper tensor-memory accelerator (TMA, through
Triton tensor descriptors) instead of per-thread asynchronous copies, against the engine's kernel, in a
decoder layer's chain of GEMMs (QKV, O, gate/up, down over 4 layers' weights, 1 row).

The question it answers: is the engine's GEMM stream (0.91 of the read bandwidth on an H100, 0.82 on an
H200, less at TP=2's half widths) limited by how its loads are issued? No engine code uses it.

    python -m benchmarks.tma_gemv_probe --out tma.json [--tp 1,2]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import environment_record, print_table
from benchmarks.gemm_bench import projection_shapes, read_bandwidth_gbps, time_calls


@triton.jit
def _tma_skinny_kernel(x_ptr, w_desc, y_ptr, M, N, K, stride_xm, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_rows + k + ks[None, :], mask=(rows < M)[:, None], other=0.0)
        w = w_desc.load([n0, k])
        acc += tl.dot(x, tl.trans(w))
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def tma_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, stages: int,
                    num_warps: int = 4, descriptor=None) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = x.shape
    n = weight.shape[0]
    desc = descriptor or TensorDescriptor.from_tensor(weight, [block_n, block_k])
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _tma_skinny_kernel[(triton.cdiv(n, block_n),)](x, desc, y, m, n, k, x.stride(0), y.stride(0),
                                                   BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                                   NUM_STAGES=stages, num_warps=num_warps)
    return y


VARIANTS = [(32, 256, 4), (32, 256, 6), (32, 256, 8), (32, 128, 8), (32, 128, 12), (64, 256, 4), (64, 128, 8),
            (16, 256, 8), (64, 256, 3)]  # (outputs per program, K tile, pipeline stages)


def chain(tp: int, config: dict, read_bw: float) -> list[tuple]:
    from engine.kernels.triton import gemv
    from triton.tools.tensor_descriptor import TensorDescriptor
    shapes = projection_shapes(config, tp)
    names = ("qkv", "o", "gate_up", "down")
    layers = [{name: torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16) for name in names}
              for _ in range(4)]
    layer_bytes = sum(w.numel() * 2 for w in layers[0].values())
    inputs = {name: torch.randn(1, shapes[name][1], device="cuda", dtype=torch.bfloat16) for name in names}
    rows = []
    engine_calls = [lambda w=layer[name], x=inputs[name]: gemv.skinny_gemm(x, w) for layer in layers for name in names]
    timings = {"engine": time_calls(engine_calls) * len(engine_calls) / len(layers)}
    for bn, bk, st in VARIANTS:
        label = f"tma bn{bn} k{bk} s{st}"
        try:
            descs = [{name: TensorDescriptor.from_tensor(layer[name], [bn, bk]) for name in names} for layer in layers]
            for name in names:  # correctness against torch, once per shape
                got = tma_skinny_gemm(inputs[name], layers[0][name], bn, bk, st, descriptor=descs[0][name])
                ref = inputs[name].float() @ layers[0][name].float().T
                assert torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-1), (name, (got.float() - ref).abs().max())
            calls = [lambda w=layer[name], x=inputs[name], d=desc[name]: tma_skinny_gemm(x, w, bn, bk, st, descriptor=d)
                     for layer, desc in zip(layers, descs) for name in names]
            timings[label] = time_calls(calls) * len(calls) / len(layers)
        except Exception as exc:  # a variant this GPU or Triton cannot build: say so and go on
            print(f"  TP={tp} {label}: {type(exc).__name__}: {str(exc)[:160]}")
    timings["engine (again)"] = time_calls(engine_calls) * len(engine_calls) / len(layers)
    for label, us in timings.items():
        gbps = layer_bytes / (us * 1e-6) / 1e9
        rows.append((tp, label, round(us, 1), round(gbps), round(gbps / read_bw, 3), round(timings["engine"] / us, 3)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)
    config = json.loads((Path(args.model) / "config.json").read_text())
    read_bw = read_bandwidth_gbps()
    rows = [row for tp in args.tp.split(",") for row in chain(int(tp), config, read_bw)]
    headers = ["TP", "kernel", "us/layer (4 GEMMs, 1 row)", "GB/s", "of read bw", "vs engine"]
    print(f"read bandwidth {read_bw:.0f} GB/s")
    print_table(headers, rows)
    Path(args.out).write_text(json.dumps({"environment": environment_record(), "read_gbps": read_bw,
                                          "rows": [dict(zip(headers, r)) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
