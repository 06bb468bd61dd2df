"""Certifies a ROCm host for kernel_backend="aiter": every op of the backend, as the kernel registry resolves it for
this GPU (fallbacks included), against the torch reference on random bf16 inputs at real model sizes; the
attention backend through decode, prefill, mixed and chunked steps (bf16 and FP8 per-token KV caches), MLA and
sparse MLA at DeepSeek-V3's sizes; then trained tiny models' teacher-forced and greedy tokens on aiter against torch
(a Llama, a Qwen3-MoE, an FP8-block checkpoint, the FP8 KV cache, a DeepSeek-V3 with AITER's latent shape). One row per check; exit status 1 if any fails, 2 if aiter cannot run here.

    python -m benchmarks.validate_rocm [--out report.json] [--quick] [--no-models]
    python -m benchmarks.validate_rocm --double gfx950 --quick    # CPU, against tests/aiter_double

`--double ARCH` runs everything on the CPU against the AITER test double emulating ARCH: CI's proof that this
script works (tests/engine/test_validate_rocm.py). Only a ROCm host proves the kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.append(str(ROOT / "tests"))  # tiny_models and aiter_double

from benchmarks.aiter_checks import Report, Shapes, check_attention, check_ops  # noqa: E402
from benchmarks.common import environment_record  # noqa: E402
from engine.kernels import registry  # noqa: E402

# Tokens that must agree between aiter and torch: teacher-forced choices have the trained model's margins;
# greedy runs compound a flip into what follows it.
TEACHER_FORCED_AGREEMENT = 0.95
GREEDY_AGREEMENT = 0.9
CHUNKED = dict(max_num_batched_tokens=32, max_num_seqs=4)  # prompts in chunks: later ones read the cache


def check_models(report: Report, device: torch.device, models_dir: Path, quick: bool) -> None:
    """Tiny trained models (tests/tiny_models.py: AITER's head size 128, AITER's MLA entry) on
    kernel_backend="aiter" against "torch", both bf16 on this device."""
    from engine.quantization.quantizer import quantize_checkpoint
    from tiny_models import AITER_MLA_SHAPES, AITER_SHAPES, make_trained_tiny_model
    llama = make_trained_tiny_model(models_dir / "llama", "llama", **AITER_SHAPES)
    moe = make_trained_tiny_model(models_dir / "qwen3_moe", "qwen3_moe", **AITER_SHAPES)
    deepseek = make_trained_tiny_model(models_dir / "deepseek_v3", "deepseek_v3", steps=30, **AITER_MLA_SHAPES)
    fp8 = models_dir / "llama-fp8-block"
    if not (fp8 / "config.json").exists():
        quantize_checkpoint(llama, fp8, "fp8-block")
    cases = [("llama", llama, {}), ("qwen3_moe", moe, {}), ("llama fp8-block", fp8, {}),
             ("llama fp8 KV cache", llama, {"kv_cache_dtype": "fp8"}), ("deepseek_v3", deepseek, {})]
    for name, folder, engine_args in cases:
        for mode in ("teacher-forced", "greedy"):
            try:
                aiter, shape = _tokens(folder, "aiter", mode, device, quick, engine_args)
                expected, _ = _tokens(folder, "torch", mode, device, quick, engine_args)
                same = sum(a == b for got, want in zip(aiter, expected) for a, b in zip(got, want))
                total = sum(len(want) for want in expected)
                needed = TEACHER_FORCED_AGREEMENT if mode == "teacher-forced" else GREEDY_AGREEMENT
                report.add("model", name, "kernel_backend aiter vs torch", f"{mode}, {shape}", None,
                           1 - same / total, 1 - needed, note=f"{same}/{total} tokens agree")
            except Exception as exc:  # keep going: one broken path should not hide the others
                report.failed("model", name, exc, shape=mode)


def _tokens(folder: Path, backend: str, mode: str, device: torch.device, quick: bool, engine_args: dict):
    """(token lists, shape text): the top-1 token after each prefix of a stretch of training text, or greedy
    continuations of three prompts."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tiny_models import training_sequence
    llm = LLM(str(folder), kernel_backend=backend, dtype="bfloat16", device=device.type, num_kv_blocks=64,
              show_progress=False, **CHUNKED, **engine_args)
    text = training_sequence(folder, 120)
    if mode == "teacher-forced":
        sequence = text[:64 if quick else 120]
        out = llm.generate([sequence], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        top1 = [min(entry.items(), key=lambda kv: kv[1].rank)[0] for entry in out.prompt_logprobs[1:]]
        return [top1], f"{len(sequence)} tokens"
    prompts = [text[:40], text[50:53], text[60:120]]  # one over a chunk, one of 3 tokens
    new_tokens = 8 if quick else 24
    outputs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs], f"{len(prompts)} prompts x {new_tokens} new"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="small shapes and short sequences (a minute)")
    parser.add_argument("--no-models", action="store_true", help="ops and attention only (no tiny-model parity)")
    parser.add_argument("--double", choices=["gfx942", "gfx950"],
                        help="run on the CPU against the AITER test double emulating this GPU")
    parser.add_argument("--models-dir", type=Path, help="where to keep the trained tiny models (default: a "
                        "temporary folder)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.double else "cuda")
    with contextlib.ExitStack() as stack:
        if args.double:
            import aiter_double
            stack.enter_context(aiter_double.serving(args.double))
        reason = registry.unavailable_reason("aiter", device)
        if reason is not None:
            print(f"kernel_backend='aiter' cannot run on {device}: {reason}", file=sys.stderr)
            return 2
        from engine.kernels.aiter.ops import gfx
        arch = gfx()
        models_dir = args.models_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        report = Report()
        print(f"aiter on {arch}{' (the test double, CPU)' if args.double else ''}; torch {torch.__version__}",
              flush=True)
        report.print_header()
        shapes = Shapes.quick() if args.quick else Shapes.full()
        torch.manual_seed(0)
        check_ops(report, device, shapes)
        check_attention(report, device, shapes)
        if not args.no_models:
            check_models(report, device, models_dir, args.quick)
    passed = all(row.ok for row in report.rows)
    failed = [f"{row.op} [{row.shape}]" for row in report.rows if not row.ok]
    print(f"\n{len(report.rows) - len(failed)}/{len(report.rows)} checks pass" +
          ("" if passed else f"; FAILED: {', '.join(failed)}"), flush=True)
    if args.out:
        results = dict(environment=environment_record(), arch=arch, double=bool(args.double), quick=args.quick,
                       passed=passed, checks=[asdict(row) for row in report.rows])
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
