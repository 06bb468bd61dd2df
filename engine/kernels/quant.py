"""Quantized weights as the kernels see them: the schemes, the in-memory form every backend starts from, and
the reference (de)quantization maths that the torch backend runs and the other backends are tested against.

Schemes (`QuantScheme.method`), each with its GEMM op `gemm_<method>` and MoE op `fused_experts_<family>`:

| method        | weight                 | weight scale (fp32 unless noted)        | activations                         |
|---------------|------------------------|-----------------------------------------|-------------------------------------|
| `fp8_tensor`  | fp8 e4m3fn [N, K]      | [1]                                     | per-tensor: static `input_scale` [1] or dynamic |
| `fp8_channel` | fp8 e4m3fn [N, K]      | [N]                                     | dynamic per token                   |
| `fp8_block`   | fp8 e4m3fn [N, K]      | [ceil(N/bn), ceil(K/bk)] (bn, bk = block) | dynamic per token and K-block of bk |
| `mxfp4`       | uint8 [N, K/2]: two e2m1 codes per byte, even k in the low nibble | uint8 e8m0 [N, K/32]: 2^(e - 127) | "none": unquantized (w4a16); "mxfp4": dynamic per 1x32 |
| `int4_group`  | uint8 [N, K/2]: two codes q + 8 per byte (q in [-8, 7]), even k in the low nibble | [N, K/g] in the model's dtype (g = block[1]) | "none": unquantized (w4a16) |

Checkpoints store some of these under other dtypes, converted on load (engine/loader/quant_plan.py
`stored_form`): power-of-two (ue8m0) fp8_block scales as float8_e8m0fnu or exponent bytes, and DeepSeek-V4's
FP4 experts (mxfp4 exactly, the codes as int8, the scales as float8_e8m0fnu), and compressed-tensors'
pack-quantized int4 (int4_group exactly: its int32 words [N, K/8] read as little-endian bytes).

MoE experts add a leading expert dimension E to the weight and scale (per-tensor: [E]). A scale multiplies:
W = weight.float() * scale (broadcast per block / row / group). Activations, where quantized, are quantized
to the same format with dynamic scales, s = amax / fp8_max over their group, and the GEMM is exactly the
matmul of the two dequantized operands accumulated in float32 (what an FP8 tensor-core GEMM computes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_DTYPE = torch.float8_e4m3fn
METHODS = ("fp8_tensor", "fp8_channel", "fp8_block", "mxfp4", "int4_group")
MXFP4_GROUP = 32
INT4_OFFSET = 8  # an int4_group code is the signed value q (-8..7) plus 8: an unsigned nibble
# e2m1 code -> value (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QuantScheme:
    """How one layer's weights and activations are quantized."""
    method: str                       # one of METHODS
    activation: str = "dynamic"       # "dynamic" | "static" (fp8_tensor with a checkpoint input_scale) |
                                      # "none" (weight-only: mxfp4 w4a16, int4_group) | "mxfp4" (mxfp4 w4a4)
    block: tuple[int, int] = (128, 128)  # fp8_block: (rows, columns) of weight per scale; int4_group: (1, g)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; known: {METHODS}")
        allowed = {"fp8_tensor": ("dynamic", "static"), "fp8_channel": ("dynamic",),
                   "fp8_block": ("dynamic",), "mxfp4": ("none", "mxfp4"), "int4_group": ("none",)}[self.method]
        if self.activation not in allowed:
            raise ValueError(f"{self.method} weights take activations {allowed}, not {self.activation!r}")
        # whole int32 words of the checkpoint per group: a tensor-parallel slice of whole groups is whole bytes
        if self.method == "int4_group" and (self.block[0] != 1 or self.block[1] <= 0 or self.block[1] % 8):
            raise ValueError(f"int4_group takes block (1, group size), the group a multiple of 8, not {self.block}")

    def describe(self) -> str:
        """E.g. "fp8_block 128x128, dynamic activations", "int4_group 32, unquantized activations"."""
        block = {"fp8_block": f" {self.block[0]}x{self.block[1]}",
                 "int4_group": f" {self.block[1]}"}.get(self.method, "")
        activations = "unquantized activations" if self.activation == "none" else f"{self.activation} activations"
        return f"{self.method}{block}, {activations}"

    @property
    def gemm_op(self) -> str:
        return f"gemm_{self.method}"

    @property
    def moe_op(self) -> str:
        return {"mxfp4": "fused_experts_mxfp4", "int4_group": "fused_experts_int4"}.get(self.method,
                                                                                       "fused_experts_fp8")

    @property
    def packed(self) -> int:
        """Weight values per stored element along K: two 4-bit codes per byte, else one."""
        return 2 if self.method in ("mxfp4", "int4_group") else 1

    @property
    def scale_block(self) -> tuple[int, int] | None:
        """(rows, columns) of weight under one scale where scales tile the weight in blocks or groups; None for
        one scale per tensor or per row."""
        if self.method in ("fp8_block", "int4_group"):
            return self.block
        return (1, MXFP4_GROUP) if self.method == "mxfp4" else None

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.uint8 if self.packed == 2 else FP8_DTYPE

    def weight_shape(self, n: int, k: int) -> tuple[int, int]:
        return (n, k // self.packed)

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.method == "fp8_tensor":
            return (1,)
        if self.method == "fp8_channel":
            return (n,)
        rows, columns = self.scale_block
        return (-(-n // rows), -(-k // columns))

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """None: the model's dtype (what new parameters get), as int4 checkpoints' bf16/fp16 scales load."""
        return {"mxfp4": torch.uint8, "int4_group": None}.get(self.method, torch.float32)


@dataclass
class QuantizedWeight:
    """A quantized [N, K] weight (or [E, N, K] experts) in the form of the table above. `prepared` holds what
    a backend derived from it once, after loading (shuffled layouts, other FP8 formats): the op's `prepare`
    fills it and the same op reads it."""
    scheme: QuantScheme
    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None  # fp8_tensor with static activations: [1] float32
    prepared: dict = field(default_factory=dict)

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * self.scheme.packed


# ---- reference maths (float32, any device) --------------------------------------------------------------

def fp8_max(dtype: torch.dtype = FP8_DTYPE) -> float:
    return float(torch.finfo(dtype).max)


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device (CUDA torch multiplies by the reciprocal when the
    divisor is a Python number, which is off by an ulp at times: kernels divide, so the reference must)."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., ceil(n/bn), ceil(k/bk)] -> [..., n, k]."""
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K] (even k in the low nibble)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    return torch.stack((table[low], table[high]), dim=-1).flatten(-2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K/2] -> float32 signed values q [..., K] (even k in the low nibble, q = code - 8)."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return codes.float() - INT4_OFFSET


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2^(e - 127) (255, NaN in the format, is not produced here)."""
    return torch.exp2(scale.float() - 127.0)


def dequantize_weight(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 [.., N, K] weight a quantized one stands for."""
    method, w, s = qw.scheme.method, qw.weight, qw.scale.float()
    if method == "mxfp4":
        values = unpack_e2m1(w)
        return values * e8m0_to_float(qw.scale).repeat_interleave(MXFP4_GROUP, dim=-1)
    if method == "int4_group":
        return unpack_int4(w) * s.repeat_interleave(qw.scheme.block[1], dim=-1)
    values = w.float()
    n, k = values.shape[-2:]
    if method == "fp8_tensor":
        return values * s.view(*s.shape, *([1] * 2)) if values.dim() == 3 else values * s
    if method == "fp8_channel":
        return values * s[..., None]
    return values * expand_block_scale(s, n, k, qw.scheme.block)


def fake_quantize_fp8(x: torch.Tensor, group: int | None, dtype: torch.dtype = FP8_DTYPE,
                      static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] through FP8 and back, float32: with `static_scale`, else with dynamic scales over the whole
    tensor (group None), per row (group = K) or per 1 x group."""
    limit = fp8_max(dtype)
    xf = x.float()
    if static_scale is not None:
        return (xf / static_scale).clamp(-limit, limit).to(dtype).float() * static_scale
    m, k = xf.shape
    if group is None:
        scale = divide(xf.abs().amax(), limit).clamp(min=1e-12)
        return (xf / scale).clamp(-limit, limit).to(dtype).float() * scale
    padded = -(-k // group) * group
    grouped = torch.nn.functional.pad(xf, (0, padded - k)).view(m, padded // group, group)
    scale = divide(grouped.abs().amax(dim=-1, keepdim=True), limit).clamp(min=1e-12)
    out = (grouped / scale).clamp(-limit, limit).to(dtype).float() * scale
    return out.view(m, padded)[:, :k]


def quantize_e2m1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] (K % 32 == 0) -> (packed uint8 [..., K/2], e8m0 uint8 [..., K/32]): the OCP MX rule,
    shared exponent floor(log2(amax)) - 2 per 32 values, each value rounded to the nearest e2m1 (ties to
    the even code) and saturated at 6."""
    *lead, k = x.shape
    groups = x.float().reshape(*lead, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -127))) - 2,
                           torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent)).reshape(*lead, k)
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    distance = (scaled.abs()[..., None] - magnitudes).abs()
    # nearest magnitude; on ties the even code (lower index with an even mantissa bit) wins
    codes = torch.argmin(distance + (torch.arange(8, device=x.device) % 2) * 1e-6, dim=-1)
    codes = codes | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent.squeeze(-1) + 127).to(torch.uint8)


def fake_quantize_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through MXFP4 (dynamic per 1x32) and back, float32."""
    packed, scale = quantize_e2m1(x)
    return unpack_e2m1(packed) * e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP, dim=-1)


def fake_quantize_activations(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The activations [M, K] exactly as the scheme's GEMM sees them, float32."""
    scheme = qw.scheme
    if scheme.activation == "none":
        return x.float()
    if scheme.method == "mxfp4":
        return fake_quantize_mxfp4(x)
    if scheme.method == "fp8_tensor":
        return fake_quantize_fp8(x, None, static_scale=qw.input_scale if scheme.activation == "static" else None)
    if scheme.method == "fp8_channel":
        return fake_quantize_fp8(x, x.shape[-1])
    return fake_quantize_fp8(x, scheme.block[1])


def quantize_weight(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Quantize a float [N, K] (or [E, N, K]) weight to `scheme` with scales from its own max: what our
    checkpoint writer and dummy FP8 weights use."""
    w = weight.float()
    limit = fp8_max()
    if scheme.method == "mxfp4":
        packed, scale = quantize_e2m1(w)
        return QuantizedWeight(scheme, packed, scale)
    if scheme.method == "int4_group":
        return quantize_int4(w, scheme)
    if scheme.method == "fp8_tensor":
        scale = divide(w.abs().flatten(-2).amax(dim=-1), limit).clamp(min=1e-12)
        shaped = scale[..., None, None]
        return QuantizedWeight(scheme, (w / shaped).clamp(-limit, limit).to(FP8_DTYPE), scale.reshape(-1))
    if scheme.method == "fp8_channel":
        scale = divide(w.abs().amax(dim=-1), limit).clamp(min=1e-12)
        return QuantizedWeight(scheme, (w / scale[..., None]).clamp(-limit, limit).to(FP8_DTYPE), scale)
    bn, bk = scheme.block
    *lead, n, k = w.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n))
    blocks = padded.view(*lead, pn // bn, bn, pk // bk, bk)
    scale = divide(blocks.abs().amax(dim=(-3, -1)), limit).clamp(min=1e-12)  # [..., N/bn, K/bk]
    q = (w / expand_block_scale(scale, n, k, scheme.block)).clamp(-limit, limit).to(FP8_DTYPE)
    return QuantizedWeight(scheme, q, scale)


def quantize_int4(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Symmetric int4 per group of g columns as compressed-tensors' min-max observer makes it: scale = amax / 7.5
    (rounded to bf16, the dtype checkpoints store it in), q = round(w / scale) clamped to [-8, 7]."""
    *lead, k = w.shape
    group = scheme.block[1]
    if k % group:
        raise ValueError(f"int4 groups of {group} columns do not tile {k} columns")
    groups = w.float().reshape(*lead, k // group, group)
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp(min=2.0 ** -100).bfloat16().float()
    q = torch.round(groups / scale[..., None]).clamp(-INT4_OFFSET, INT4_OFFSET - 1).reshape(*lead, k)
    codes = (q + INT4_OFFSET).to(torch.uint8)
    return QuantizedWeight(scheme, codes[..., 0::2] | (codes[..., 1::2] << 4), scale)


def expert_slice(qw: QuantizedWeight, expert: int) -> QuantizedWeight:
    """Expert `expert` of an [E, N, K] quantized weight, as an [N, K] one."""
    scale = qw.scale[expert]
    if qw.scheme.method == "fp8_tensor":
        scale = scale.reshape(1)
    return QuantizedWeight(qw.scheme, qw.weight[expert], scale, qw.input_scale)
