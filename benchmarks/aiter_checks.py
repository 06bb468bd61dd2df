"""The op-by-op part of benchmarks/validate_rocm.py: each op of the aiter kernel backend, as `registry.resolve`
gives it for this GPU (an op AITER declines is its fallback's, as in a real run), against the torch reference
backend on the same random inputs; the attention backend through a sequence of steps over one paged cache.

Outputs are compared by their relative L2 error (|got - reference| / |reference|) under a tolerance per number
format. Quantized ops must also be no further from the exact product (unquantized activations, the stored
weights) than 1.3 times the reference is, plus a quarter of the tolerance: rounding activations otherwise than
the reference is allowed, rounding them worse is not. Routing must choose the reference's experts (near-ties
aside), sampling the reference's tokens exactly.
"""
from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

import torch

from engine.kernels import registry
from engine.kernels.attention import CommonAttentionMetadata, KVCacheQuant
from engine.kernels.quant import QuantScheme, dequantize_weight, quantize_weight
from engine.kernels.sampling import SamplingTensors

BF16 = 1e-2          # bf16 outputs of the same maths, accumulated in another order
FLOAT32 = 1e-4
ATTENTION = 2e-2     # bf16, softmax accumulated in another order
# Quantized activations rounded by another kernel (another scale rule: AITER's MXFP4 rounds the shared exponent
# up from a mantissa of 1.5; per-tensor expert inputs scaled over all tokens rather than each expert's; the
# e4m3fnuz grid on gfx942) differ from the reference's by about sqrt(2) times the format's own error.
FP8 = 0.1
MXFP4 = 0.4
WORSE_THAN_REFERENCE = 1.3  # times the reference's distance from the exact product, at most
ROUTING_NEAR_TIES = 0.01    # share of tokens whose chosen experts may differ


@dataclass
class Row:
    section: str              # "op" | "attention" | "model"
    op: str
    implementation: str
    shape: str
    max_abs: float | None     # of the output against the reference
    rel_l2: float | None      # ditto; for models the share of tokens that differ
    tolerance: float | None
    ok: bool
    note: str = ""


class Report:
    COLUMNS = f"{'op':<28} {'implementation':<58} {'shape':<32} {'max abs':>9} {'rel L2':>9}  result"

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def print_header(self) -> None:
        print(f"{self.COLUMNS}\n{'-' * len(self.COLUMNS)}", flush=True)

    def add(self, section: str, op: str, implementation: str, shape: str, max_abs: float | None,
            rel_l2: float | None, tolerance: float, ok: bool = True, note: str = "") -> None:
        ok = ok and rel_l2 is not None and rel_l2 <= tolerance  # a NaN fails too
        self._append(Row(section, op, implementation, shape, max_abs, rel_l2, tolerance, ok, note))

    def failed(self, section: str, op: str, exc: BaseException, implementation: str = "-", shape: str = "-") -> None:
        traceback.print_exc(file=sys.stderr)
        self._append(Row(section, op, implementation, shape, None, None, None, False, f"{type(exc).__name__}: {exc}"))

    def _append(self, row: Row) -> None:
        self.rows.append(row)
        implementation = row.implementation if len(row.implementation) <= 58 else row.implementation[:55] + "..."
        number = lambda value: "-" if value is None else f"{value:9.2e}"  # noqa: E731
        print(f"{row.op:<28} {implementation:<58} {row.shape:<32} {number(row.max_abs):>9} {number(row.rel_l2):>9}  "
              f"{'PASS' if row.ok else 'FAIL'}{'  ' + row.note if row.note else ''}", flush=True)


@dataclass(frozen=True)
class Shapes:
    tokens: tuple[int, ...]                # activation rows: decode batches and a prefill
    gemms: tuple[tuple[int, int], ...]     # weights (N, K)
    hidden: int
    intermediate: int
    heads: tuple[int, int, int]            # query heads, KV heads, head size
    experts: tuple[int, int, int, int]     # experts, per token, hidden, intermediate
    grouped: tuple[int, int, int, int]     # experts, per token, groups, groups kept
    vocab: int
    prompts: tuple[int, int]               # the attention steps' two first prompts
    chunks: tuple[int, int]                # and the third prompt's two chunks
    mla_heads: tuple[int, ...]             # MLA query heads per rank (DeepSeek-V3: 128 at TP 1, 16 at TP 8)
    mla_sparse: tuple[int, int]            # sparse MLA query rows, selected entries per row (V3.2: 2048)

    @classmethod
    def full(cls) -> "Shapes":
        """Llama-3.1-8B's GEMMs and attention, Qwen3-30B-A3B's experts, DeepSeek-V3's grouped routing and
        latent attention."""
        return cls(tokens=(1, 32, 512), gemms=((6144, 4096), (4096, 4096), (4096, 14336)), hidden=4096,
                   intermediate=14336, heads=(32, 8, 128), experts=(128, 8, 2048, 768), grouped=(256, 8, 8, 4),
                   vocab=128256, prompts=(700, 33), chunks=(512, 300), mla_heads=(128, 16), mla_sparse=(64, 2048))

    @classmethod
    def quick(cls) -> "Shapes":
        return cls(tokens=(1, 7, 40), gemms=((256, 256), (384, 512)), hidden=512, intermediate=256,
                   heads=(8, 2, 128), experts=(8, 2, 256, 128), grouped=(16, 4, 4, 2), vocab=1000,
                   prompts=(37, 5), chunks=(20, 13), mla_heads=(16,), mla_sparse=(5, 40))


def relative_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)).item()


def max_abs(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0


class OpChecks:
    """Each check runs one op of both tables on the same inputs and adds its rows to the report."""

    def __init__(self, report: Report, device: torch.device, shapes: Shapes) -> None:
        self.report, self.device, self.shapes = report, device, shapes
        head_size = shapes.heads[2]
        facts = registry.ModelFacts(head_sizes=(head_size,), gqa_ratios=(shapes.heads[0] // shapes.heads[1],))
        self.aiter = registry.resolve("aiter", device, facts)
        self.reference = registry.resolve("torch", device, facts)
        self.implementation = dict(self.aiter.table())

    def randn(self, *shape, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=self.device) * scale).to(dtype)

    def compare(self, op: str, shape: str, got, expected, tolerance: float, note: str = "",
                implementation: str | None = None, ok: bool = True) -> None:
        got, expected = _flat(got), _flat(expected)  # ops with two outputs: both
        self.report.add("op", op, implementation or self.implementation[op], shape, max_abs(got, expected),
                        relative_l2(got, expected), tolerance, ok and bool(torch.isfinite(got).all()), note)

    def run(self) -> None:
        for check in (self.dense, self.norms, self.rotary, self.activation, self.gated_delta_net, self.sampling,
                      self.routing, self.routing_bookkeeping, self.experts, self.quantized_gemms,
                      self.quantized_experts):
            try:
                check()
            except Exception as exc:  # keep going: one broken kernel should not hide the others
                self.report.failed("op", check.__name__, exc)

    # ---- dense ------------------------------------------------------------------------------------------
    def dense(self) -> None:
        for (n, k) in self.shapes.gemms:
            weight, bias = self.randn(n, k, scale=k ** -0.5), self.randn(n)
            for m in self.shapes.tokens:
                x = self.randn(m, k)
                shape = f"M={m} N={n} K={k}"
                self.compare("gemm", shape, self.aiter.ops["gemm"](x, weight, None),
                             self.reference.ops["gemm"](x, weight, None), BF16)
                self.compare("gemm_float32", shape, self.aiter.ops["gemm_float32"](x, weight),
                             self.reference.ops["gemm_float32"](x, weight), FLOAT32)
            x = self.randn(self.shapes.tokens[-1], k)
            self.compare("gemm", f"M={x.shape[0]} N={n} K={k} +bias", self.aiter.ops["gemm"](x, weight, bias),
                         self.reference.ops["gemm"](x, weight, bias), BF16)
        hidden, intermediate = self.shapes.hidden, self.shapes.intermediate
        weight = self.randn(2 * intermediate, hidden, scale=hidden ** -0.5)
        for m in self.shapes.tokens:
            x = self.randn(m, hidden)
            self.compare("gated_gemm", f"M={m} 2I={2 * intermediate} K={hidden}",
                         self.aiter.ops["gated_gemm"](x, weight, None),
                         self.reference.ops["gated_gemm"](x, weight, None), BF16)

    def norms(self) -> None:
        hidden = self.shapes.hidden
        weight = (1 + self.randn(hidden, dtype=torch.float32, scale=0.1)).bfloat16()
        for m in self.shapes.tokens:
            x = self.randn(m, hidden)
            self.compare("rms_norm", f"T={m} H={hidden}", self.aiter.ops["rms_norm"](x, weight, 1e-6),
                         self.reference.ops["rms_norm"](x, weight, 1e-6), BF16)
            for residual_dtype in (torch.bfloat16, torch.float32):
                residual = self.randn(m, hidden, dtype=residual_dtype)
                got = self.aiter.ops["fused_add_rms_norm"](x.clone(), residual.clone(), weight, 1e-6)
                expected = self.reference.ops["fused_add_rms_norm"](x.clone(), residual.clone(), weight, 1e-6)
                kind = "" if residual_dtype == torch.bfloat16 else " fp32 residual"
                self.compare("fused_add_rms_norm", f"T={m} H={hidden}{kind}", got, expected, BF16)
            for style in ("offset", "float32", "none"):
                args = (x, None if style == "none" else weight, 1e-6, style)
                self.compare("rms_norm_variant", f"T={m} H={hidden} {style}", self.aiter.ops["rms_norm_variant"](*args),
                             self.reference.ops["rms_norm_variant"](*args), BF16)
                residual = self.randn(m, hidden)
                fused = (x, residual, None if style == "none" else weight, 1e-6, style)
                self.compare("fused_add_rms_norm_variant", f"T={m} H={hidden} {style}",
                             self.aiter.ops["fused_add_rms_norm_variant"](*fused),
                             self.reference.ops["fused_add_rms_norm_variant"](*fused), BF16)
            gate = self.randn(m, hidden)
            self.compare("rms_norm_gated", f"T={m} H={hidden}", self.aiter.ops["rms_norm_gated"](x, gate, weight, 1e-6),
                         self.reference.ops["rms_norm_gated"](x, gate, weight, 1e-6), BF16)

    def rotary(self) -> None:
        num_heads, num_kv_heads, head_size = self.shapes.heads
        for rotary_dim in (head_size, head_size // 2):
            inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=self.device).float() / rotary_dim))
            freqs = torch.outer(torch.arange(4096, device=self.device).float(), inv_freq)
            cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            for is_neox in (True, False):
                for m in self.shapes.tokens:
                    positions = torch.randint(0, 4096, (m,), device=self.device)
                    q, k = self.randn(m, num_heads, head_size), self.randn(m, num_kv_heads, head_size)
                    got = self.aiter.ops["rotary_embedding"](positions, q.clone(), k.clone(), cos_sin_cache, is_neox)
                    expected = self.reference.ops["rotary_embedding"](positions, q.clone(), k.clone(), cos_sin_cache,
                                                                      is_neox)
                    style = "neox" if is_neox else "gpt-j"
                    self.compare("rotary_embedding", f"T={m} {style} rotary {rotary_dim}/{head_size}", got, expected,
                                 BF16)

    def activation(self) -> None:
        for m in self.shapes.tokens:
            x = self.randn(m, 2 * self.shapes.intermediate)
            self.compare("silu_and_mul", f"T={m} 2I={x.shape[1]}", self.aiter.ops["silu_and_mul"](x),
                         self.reference.ops["silu_and_mul"](x), BF16)
            self.compare("gelu_tanh_and_mul", f"T={m} 2I={x.shape[1]}", self.aiter.ops["gelu_tanh_and_mul"](x),
                         self.reference.ops["gelu_tanh_and_mul"](x), BF16)

    def gated_delta_net(self) -> None:
        """Gated DeltaNet's two ops over a decode and a chunked prefill carrying state in slots 2 and 0."""
        channels, heads, dk, dv = 96, 4, 32, 32
        metadata = _metadata([(0, 7, 1), (1, 0, 9)], 1, self.device)
        metadata.state_slots_cpu = [2, 0]
        metadata.state_slots = torch.tensor(metadata.state_slots_cpu, device=self.device)
        tokens = metadata.num_tokens
        x, weight = self.randn(tokens, channels), self.randn(channels, 4, scale=0.5)
        history, outputs = self.randn(channels, 3), []
        for table in (self.aiter, self.reference):
            state = torch.zeros(3, channels, 3, dtype=torch.bfloat16, device=self.device)
            state[2] = history  # the decode's earlier inputs; the prefill's slot starts from zero
            outputs.append((table.ops["causal_conv1d"](x, weight, state, metadata), state))
        self.compare("causal_conv1d", f"T={tokens} C={channels}", outputs[0][0], outputs[1][0], BF16)
        self.compare("causal_conv1d", f"T={tokens} C={channels} state", outputs[0][1], outputs[1][1], BF16)
        q, k = self.randn(tokens, heads, dk), self.randn(tokens, heads, dk)
        v = self.randn(tokens, heads, dv)
        g = -torch.rand(tokens, heads, device=self.device)
        beta = torch.rand(tokens, heads, device=self.device)
        start = torch.randn(3, heads, dk, dv, device=self.device) * 0.1
        results = []
        for table in (self.aiter, self.reference):
            state = start.clone()
            results.append((table.ops["gated_delta_rule"](q, k, v, g, beta, state, metadata), state))
        self.compare("gated_delta_rule", f"T={tokens} H={heads} dk={dk} dv={dv}", results[0][0], results[1][0], BF16)
        self.compare("gated_delta_rule", f"T={tokens} H={heads} state", results[0][1], results[1][1], FLOAT32)

    def sampling(self) -> None:
        rows, vocab = 2 * max(self.shapes.tokens[-1] // 16, 2), self.shapes.vocab
        logits = self.randn(rows, vocab, dtype=torch.float32, scale=3.0)
        for case, temperatures in (("greedy", [0.0] * rows), ("temperature 0.8", [0.8] * rows),
                                   ("greedy + temperature", [0.0, 1.0] * (rows // 2))):
            tensors = _sampling_tensors(temperatures, self.device)
            got = self.aiter.ops["sample"](logits.clone(), tensors)
            expected = self.reference.ops["sample"](logits.clone(), tensors)
            differ = int((got.long() != expected.long()).sum())
            self.report.add("op", "sample", self.implementation["sample"], f"B={rows} V={vocab} {case}", None,
                            differ / rows, 0.0, note=f"{rows - differ}/{rows} tokens identical (seeded)")

    # ---- mixture of experts -----------------------------------------------------------------------------
    def routing(self) -> None:
        experts, top_k = self.shapes.experts[:2]
        for m in self.shapes.tokens:
            logits = self.randn(m, experts, dtype=torch.float32)
            for renormalize in (True, False):
                self._compare_routing("moe_topk_softmax", f"T={m} E={experts} k={top_k} renorm={renormalize}",
                                      (logits, top_k, renormalize))
        experts, top_k, groups, kept = self.shapes.grouped
        bias = self.randn(experts, dtype=torch.float32, scale=0.1)
        for m in self.shapes.tokens:
            logits = self.randn(m, experts, dtype=torch.float32)
            self._compare_routing("moe_grouped_topk", f"T={m} E={experts} sigmoid+bias {kept}/{groups}",
                                  (logits, top_k, True, groups, kept, "sigmoid", bias, 2.5))
            self._compare_routing("moe_grouped_topk", f"T={m} E={experts} softmax {kept}/{groups}",
                                  (logits, top_k, False, groups, kept, "softmax", None, 1.0))

    def routing_bookkeeping(self) -> None:
        """Padding rows masked (and the load counted), and the EP slots of a gathered routing: integers and
        copied weights, so exact."""
        experts, top_k = self.shapes.experts[:2]
        for m in self.shapes.tokens:
            weights, ids = self._route(m, experts, top_k)
            valid = torch.tensor([max(1, m // 2)], device=self.device)
            counts = [torch.zeros(experts + 1, dtype=torch.int64, device=self.device) for _ in range(2)]
            got = self.aiter.ops["moe_route_mask"](weights, ids, 0, valid, counts[0])
            expected = self.reference.ops["moe_route_mask"](weights, ids, 0, valid, counts[1])
            self.compare("moe_route_mask", f"T={m} k={top_k} valid={m // 2 or 1}", (*got, counts[0]),
                         (*expected, counts[1]), 0.0)
            routing = torch.cat((ids.float(), weights), dim=1)
            half = experts // 2
            got = self.aiter.ops["moe_local_slots"](routing, half, half, counts[0])
            expected = self.reference.ops["moe_local_slots"](routing, half, half, counts[1])
            self.compare("moe_local_slots", f"R={m} k={top_k} experts {half}..{experts - 1}", (*got, counts[0]),
                         (*expected, counts[1]), 0.0)

    def _compare_routing(self, op: str, shape: str, args: tuple) -> None:
        """Each token's experts as a set (kernels may order them differently), their weights in expert order."""
        weights, ids = self.aiter.ops[op](*args)
        ref_weights, ref_ids = self.reference.ops[op](*args)
        ids, order = ids.long().sort(dim=-1)
        ref_ids, ref_order = ref_ids.long().sort(dim=-1)
        same = (ids == ref_ids).all(dim=-1)
        differ = int((~same).sum())
        allowed = differ <= ROUTING_NEAR_TIES * len(same)
        self.compare(op, shape, weights.gather(1, order)[same], ref_weights.gather(1, ref_order)[same], FLOAT32 * 10,
                     note=f"experts differ for {differ}/{len(same)} tokens" if differ else "", ok=allowed)

    def _route(self, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.randn(tokens, experts, dtype=torch.float32)
        return self.reference.ops["moe_topk_softmax"](logits, top_k, True)

    def experts(self) -> None:
        experts, top_k, hidden, intermediate = self.shapes.experts
        w13 = self.randn(experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
        w2 = self.randn(experts, hidden, intermediate, scale=intermediate ** -0.5)
        prepared13, prepared2 = w13.clone(), w2.clone()
        prepare = getattr(self.aiter.ops["fused_experts"], "prepare_weights", None)
        if prepare is not None:  # as FusedMoE.finish_loading does, once
            prepare(prepared13, prepared2)
        for m in self.shapes.tokens:
            x = self.randn(m, hidden)
            weights, ids = self._route(m, experts, top_k)
            self.compare("fused_experts", f"T={m} E={experts} k={top_k} H={hidden} I={intermediate}",
                         self.aiter.ops["fused_experts"](x, prepared13, prepared2, weights, ids),
                         self.reference.ops["fused_experts"](x, w13, w2, weights, ids), BF16)

    # ---- quantized weights ------------------------------------------------------------------------------
    QUANTIZED = (("gemm_fp8_tensor", QuantScheme("fp8_tensor"), FP8),
                 ("gemm_fp8_tensor", QuantScheme("fp8_tensor", "static"), FP8),
                 ("gemm_fp8_channel", QuantScheme("fp8_channel"), FP8),
                 ("gemm_fp8_block", QuantScheme("fp8_block"), FP8),
                 ("gemm_mxfp4", QuantScheme("mxfp4", "mxfp4"), MXFP4),
                 ("gemm_mxfp4", QuantScheme("mxfp4", "none"), BF16),
                 ("gemm_int4_group", QuantScheme("int4_group", "none", (1, 32)), BF16))

    def _prepared(self, op: str, weight: torch.Tensor, scheme: QuantScheme, input_scale=None):
        """(the reference's QuantizedWeight, the aiter op's, prepared as a layer prepares it once, and the
        implementation that serves it: the fallback's where preparation declined the weight)."""
        reference, served = quantize_weight(weight, scheme), quantize_weight(weight, scheme)
        reference.input_scale = served.input_scale = input_scale
        registry.prepare_quantized(self.aiter.ops[op], served)
        implementation = self.implementation[op]
        if "aiter" in served.prepared and served.prepared["aiter"] is None:
            implementation = f"fallback (declined at preparation), not {implementation}"
        return reference, served, implementation

    def _compare_quantized(self, op, shape, got, expected, exact, tolerance, implementation) -> None:
        error, reference_error = relative_l2(got, exact), relative_l2(expected, exact)
        ok = error <= WORSE_THAN_REFERENCE * reference_error + tolerance / 4  # a few outputs are a noisy sample
        note = f"vs exact {error:.2e} (reference {reference_error:.2e})"
        self.compare(op, shape, got, expected, tolerance, note, implementation, ok)

    def quantized_gemms(self) -> None:
        for op, scheme, tolerance in self.QUANTIZED:
            try:
                self._quantized_gemm(op, scheme, tolerance)
            except Exception as exc:  # the other schemes still run
                self.report.failed("op", _label(op, scheme), exc, self.implementation[op])

    def _quantized_gemm(self, op: str, scheme: QuantScheme, tolerance: float) -> None:
        for (n, k) in self.shapes.gemms:
            weight = torch.randn(n, k, device=self.device) * k ** -0.5
            for m in self.shapes.tokens:
                x = self.randn(m, k)
                static = scheme.activation == "static"  # a calibrated scale: this input's range
                input_scale = (x.float().abs().amax() / 448.0).reshape(1) if static else None
                reference, served, implementation = self._prepared(op, weight, scheme, input_scale)
                exact = x.float() @ dequantize_weight(reference).t()
                self._compare_quantized(_label(op, scheme), f"M={m} N={n} K={k}", self.aiter.ops[op](x, served),
                                        self.reference.ops[op](x, reference), exact, tolerance, implementation)

    QUANTIZED_EXPERTS = ((QuantScheme("fp8_tensor"), FP8), (QuantScheme("fp8_channel"), FP8),
                         (QuantScheme("fp8_block"), FP8), (QuantScheme("mxfp4", "mxfp4"), MXFP4),
                         (QuantScheme("mxfp4", "none"), BF16), (QuantScheme("int4_group", "none", (1, 32)), BF16))

    def quantized_experts(self) -> None:
        experts, top_k, hidden, intermediate = self.shapes.experts
        w13 = torch.randn(experts, 2 * intermediate, hidden, device=self.device) * hidden ** -0.5
        w2 = torch.randn(experts, hidden, intermediate, device=self.device) * intermediate ** -0.5
        for scheme, tolerance in self.QUANTIZED_EXPERTS:
            try:
                self._quantized_experts(w13, w2, scheme, tolerance)
            except Exception as exc:  # the other schemes still run
                self.report.failed("op", _label(scheme.moe_op, scheme), exc, self.implementation[scheme.moe_op])

    def _quantized_experts(self, w13: torch.Tensor, w2: torch.Tensor, scheme: QuantScheme, tolerance: float) -> None:
        from engine.kernels.torch.moe import fused_experts
        experts, top_k, hidden, intermediate = self.shapes.experts
        op = scheme.moe_op
        ref13, served13, implementation = self._prepared(op, w13, scheme)
        ref2, served2, _ = self._prepared(op, w2, scheme)
        for m in self.shapes.tokens:
            x = self.randn(m, hidden)
            weights, ids = self._route(m, experts, top_k)
            exact = fused_experts(x.float(), dequantize_weight(ref13), dequantize_weight(ref2), weights, ids)
            self._compare_quantized(_label(op, scheme), f"T={m} E={experts} k={top_k} H={hidden} I={intermediate}",
                                    self.aiter.ops[op](x, served13, served2, weights, ids),
                                    self.reference.ops[op](x, ref13, ref2, weights, ids), exact, tolerance,
                                    implementation)


def _label(op: str, scheme: QuantScheme) -> str:
    """gemm_fp8_tensor static, fused_experts_fp8 fp8_block, gemm_mxfp4 w4a16, ..."""
    method = f" {scheme.method}" if op == "fused_experts_fp8" else ""
    return op + method + {"static": " static", "mxfp4": " w4a4", "none": " w4a16"}.get(scheme.activation, "")


def _flat(value) -> torch.Tensor:
    """An op's output, or its outputs concatenated, as one float32 vector."""
    outputs = value if isinstance(value, (tuple, list)) else (value,)
    return torch.cat([t.flatten().float() for t in outputs])


def _sampling_tensors(temperatures: list[float], device: torch.device) -> SamplingTensors:
    rows = len(temperatures)
    seeds = [1000 + row for row in range(rows)]
    return SamplingTensors(
        temperature=torch.tensor(temperatures, device=device),
        top_k=torch.zeros(rows, dtype=torch.int64, device=device), top_p=torch.ones(rows, device=device),
        min_p=torch.zeros(rows, device=device),
        seeds=torch.tensor(seeds, device=device), seeds_cpu=seeds, all_greedy=not any(temperatures),
        any_top_k=False, any_top_p=False, any_min_p=False)


def check_ops(report: Report, device: torch.device, shapes: Shapes) -> None:
    checks = OpChecks(report, device, shapes)
    checks.run()
    for check in (check_mla_attention, check_mla_sparse_attention):
        try:
            check(checks)
        except Exception as exc:
            report.failed("op", check.__name__.removeprefix("check_"), exc)


# ---- attention --------------------------------------------------------------------------------------------

BLOCK_SIZE = 16


def attention_steps(shapes: Shapes) -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(sequence, new tokens)], decodes first): two prompts, their decodes, a third prompt's first chunk
    beside them (mixed), its second chunk over the cached first (chunked), then everyone decodes."""
    (first, second), (chunk1, chunk2) = shapes.prompts, shapes.chunks
    return [("prefill", [(0, first), (1, second)]), ("decode", [(0, 1), (1, 1)]),
            ("mixed", [(0, 1), (1, 1), (2, chunk1)]), ("chunked prefill", [(0, 1), (1, 1), (2, chunk2)]),
            ("decode", [(0, 1), (1, 1), (2, 1)])]


def _metadata(entries: list[tuple[int, int, int]], blocks_per_seq: int, device) -> CommonAttentionMetadata:
    """entries: (sequence, tokens already cached, new tokens); sequence s owns blocks [s * blocks_per_seq, ...)."""
    query_lens = [new for _, _, new in entries]
    seq_lens = [cached + new for _, cached, new in entries]
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    table = [[seq * blocks_per_seq + b for b in range(blocks_per_seq)] for seq, _, _ in entries]
    slots = [table[row][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for row, (_, cached, new) in enumerate(entries) for p in range(cached, cached + new)]
    num_decodes = next((i for i, (_, cached, new) in enumerate(entries) if not (new == 1 and cached)), len(entries))
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    return CommonAttentionMetadata(
        num_seqs=len(entries), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=as_tensor(starts, torch.int32), seq_lens=as_tensor(seq_lens, torch.int32),
        block_table=as_tensor(table, torch.int32), slot_mapping=as_tensor(slots, torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens, num_computed_tokens_cpu=[cached for _, cached, _ in entries])


class _PagedAttention:
    """One attention backend with its own cache (bf16, or FP8 with per-token scales) for three sequences."""

    def __init__(self, backend, shapes: Shapes, blocks_per_seq: int, fp8: bool, device) -> None:
        _, num_kv_heads, head_size = shapes.heads
        num_blocks = 3 * blocks_per_seq
        dtype = backend.kv_fp8_dtype() if fp8 else torch.bfloat16
        self.backend = backend
        self.cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_size), dtype=dtype,
                                 device=device)
        self.kv_quant = None
        if fp8:
            scale_shape = backend.kv_scale_shape(num_blocks, BLOCK_SIZE, num_kv_heads)
            self.kv_quant = KVCacheQuant("token", torch.ones(scale_shape, device=device),
                                         torch.ones(scale_shape, device=device))

    def __call__(self, q, k, v, metadata: CommonAttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.cache, self.backend.build_metadata(metadata, BLOCK_SIZE),
                                    q.shape[-1] ** -0.5, BLOCK_SIZE, None, kv_quant=self.kv_quant)


def check_attention(report: Report, device: torch.device, shapes: Shapes) -> None:
    num_heads, num_kv_heads, head_size = shapes.heads
    longest = max(shapes.prompts[0] + 3, sum(shapes.chunks) + 1)
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    for fp8 in (False, True):
        op = "attention fp8 KV (token)" if fp8 else "attention"
        facts = registry.ModelFacts(head_sizes=(head_size,), gqa_ratios=(num_heads // num_kv_heads,),
                                    fp8_kv_cache=fp8, kv_cache_scales="token")
        served = registry.resolve("aiter", device, facts)
        implementation = dict(served.table())["attention"]
        try:
            got = _PagedAttention(served.attention, shapes, blocks_per_seq, fp8, device)
            expected = _PagedAttention(registry.resolve("torch", device, facts).attention, shapes, blocks_per_seq, fp8,
                                       device)
            cached = [0, 0, 0]
            for name, step in attention_steps(shapes):
                entries = [(seq, cached[seq], new) for seq, new in step]
                metadata = _metadata(entries, blocks_per_seq, device)
                tokens = metadata.num_tokens
                q = torch.randn(tokens, num_heads, head_size, device=device).bfloat16()
                k, v = (torch.randn(tokens, num_kv_heads, head_size, device=device).bfloat16() for _ in range(2))
                out, reference = got(q, k, v, metadata), expected(q, k, v, metadata)
                shape = f"{name}: {len(entries)} seqs, {tokens} tok"
                report.add("attention", op, implementation, shape, max_abs(out, reference), relative_l2(out, reference),
                           FP8 if fp8 else ATTENTION, bool(torch.isfinite(out).all()))
                for seq, new in step:
                    cached[seq] += new
        except Exception as exc:
            report.failed("attention", op, exc, implementation)


# ---- multi-head latent attention (DeepSeek-V3's sizes: latent 512, rope 64, nope 128, v 128) ---------------

MLA_LATENT, MLA_ROPE, MLA_NOPE, MLA_V = 512, 64, 128, 128


def check_mla_attention(checks: OpChecks) -> None:
    """mla_attention through the attention steps (prefill, decode, mixed, chunked prefill over a cached
    prefix, decode), each table's op with its own latent cache [blocks, 16, 576]."""
    from engine.kernels.mla import MLAWeights
    shapes, device = checks.shapes, checks.device
    longest = max(shapes.prompts[0] + 3, sum(shapes.chunks) + 1)
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    for heads in shapes.mla_heads:
        kv_b = checks.randn(heads * (MLA_NOPE + MLA_V), MLA_LATENT, scale=MLA_LATENT ** -0.5)
        per_head = kv_b.view(heads, MLA_NOPE + MLA_V, MLA_LATENT)
        weights = MLAWeights(lambda x: x @ kv_b.T, per_head[:, :MLA_NOPE], per_head[:, MLA_NOPE:])
        caches = [torch.zeros(3 * blocks_per_seq, BLOCK_SIZE, MLA_LATENT + MLA_ROPE, dtype=torch.bfloat16,
                              device=device) for _ in range(2)]
        cached = [0, 0, 0]
        for name, step in attention_steps(shapes):
            metadata = _metadata([(seq, cached[seq], new) for seq, new in step], blocks_per_seq, device)
            tokens = metadata.num_tokens
            inputs = (checks.randn(tokens, heads, MLA_NOPE), checks.randn(tokens, heads, MLA_ROPE),
                      checks.randn(tokens, MLA_LATENT), checks.randn(tokens, MLA_ROPE))
            got, expected = (table.ops["mla_attention"](*inputs, cache, metadata, weights, 0.07, BLOCK_SIZE)
                             for table, cache in zip((checks.aiter, checks.reference), caches))
            checks.compare("mla_attention", f"H={heads} {name}: {metadata.num_seqs} seqs, {tokens} tok", got,
                           expected, ATTENTION)
            for seq, new in step:
                cached[seq] += new


def check_mla_sparse_attention(checks: OpChecks) -> None:
    """mla_sparse_attention over random selected slots of a latent cache: rows with -1 padding and one with
    no entry (zeros and an LSE of -inf); the output and the LSE compared apart."""
    rows, top_k = checks.shapes.mla_sparse
    dim = MLA_LATENT + MLA_ROPE
    num_blocks = -(-4 * top_k // BLOCK_SIZE)
    cache = checks.randn(num_blocks, BLOCK_SIZE, dim)
    for heads in checks.shapes.mla_heads:
        q = checks.randn(rows, heads, dim)
        slots = torch.randint(0, num_blocks * BLOCK_SIZE, (rows, top_k), device=checks.device)
        lengths = torch.randint(1, top_k + 1, (rows,), device=checks.device)
        lengths[0] = 0
        slots[torch.arange(top_k, device=checks.device)[None, :] >= lengths[:, None]] = -1
        (out, lse), (ref_out, ref_lse) = (table.ops["mla_sparse_attention"](q, cache, slots, dim ** -0.5, MLA_LATENT)
                                          for table in (checks.aiter, checks.reference))
        empty_ok = bool((out[0] == 0).all() and torch.isneginf(lse[0]).all())
        shape = f"T={rows} H={heads} top-k {top_k}"
        checks.compare("mla_sparse_attention", shape, out, ref_out, ATTENTION, ok=empty_ok,
                       note="" if empty_ok else "the row with no entry is not zeros / -inf")
        checks.compare("mla_sparse_attention lse", shape, lse[1:], ref_lse[1:], FLOAT32 * 10,
                       implementation=checks.implementation["mla_sparse_attention"])
