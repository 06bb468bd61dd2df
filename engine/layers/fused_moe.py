"""Mixture-of-experts layer: a router (engine/layers/moe_router.py), the routed experts in the fused layout,
optional shared experts.

Expert weights are held fused, as transformers 5 holds them in memory: `w13` [E_local, 2I, H] (gate rows,
then up rows) and `w2` [E_local, H, I]. They are split one of two ways:
- tensor parallel (the default): every rank holds every expert with its slice of I; the partial outputs
  are summed across the TP group, as a row-parallel linear's are;
- expert parallel (`enable_expert_parallel`): each of the EP group's dp_size x tp_size ranks holds whole
  experts, a contiguous range of them (uneven counts allowed: the first ranks take one more). Tokens go to
  their experts' ranks and back through `engine.parallel.all_to_all`, in buffers sized by the step's
  padded token count (engine.forward_context.MoEStep); ranks of one TP group each send a slice of the
  (replicated) tokens and gather the results, so no expert work is done twice.

Checkpoints may name experts one by one (`experts.<e>.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) or
fused (`experts.gate_up_proj`, `experts.down_proj`); `FusedMoE.checkpoint_target` maps either to the
parameter and shard. Routing, the expert GEMMs and the exchange are each behind a dispatch point
(`engine.kernels.ops`, `make_all_to_all`), where the Triton, AITER and MORI versions plug in.
"""
from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

from engine.forward_context import MoEStep, current_moe_step
from engine.kernels import ops
from engine.kernels.quant import QuantizedWeight, QuantScheme
from engine.kernels.registry import prepare_quantized
from engine.layers.linear import ReplicatedLinear, shard_range
from engine.layers.quantization import (aligned_narrow, building_experts_scheme, new_param,
                                        requantize_to_max_scale, unit_size)
from engine.parallel import get_parallel_state, tensor_parallel_all_gather, tensor_parallel_all_reduce
# Routing lives in moe_router; its names stay importable from here, where models and tests look for them.
from engine.layers.moe_router import ROUTERS, Router, RouterConfig, check_router  # noqa: F401
from engine.parallel.all_to_all import ExchangeLayout, ExpertAllToAll, ExpertPlacement, make_all_to_all


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, router: RouterConfig,
                 shared_experts: nn.Module | None = None, shared_expert_gate: bool = False,
                 router_dtype: torch.dtype | None = None, swiglu_limit: float | None = None,
                 expert_bias: bool = False, oai_alpha: float | None = None, router_bias: bool = False,
                 checkpoint_layout: str = "halves", gelu: bool = False) -> None:
        """`shared_experts`: an MLP run on every token beside the routed experts, built with an unreduced
        row-parallel down projection (its partial sum is reduced together with the routed experts').
        `swiglu_limit`: the routed experts clamp gate <= limit and up to [-limit, limit] before silu(gate) * up
        (DeepSeek-V4), full-precision or quantized.
        gpt-oss: `expert_bias` (w13_bias [E, 2I], w2_bias [E, H]), `oai_alpha` (the activation
        (up + 1) * gate * sigmoid(alpha * gate)), `router_bias` (a biased router), and
        `checkpoint_layout="gpt_oss"`: fused gate/up tensors interleave gate and up rows (gate 2j, up 2j + 1),
        and unquantized fused tensors are stored [E, in, out] (transposed). `gelu`: the experts' activation is
        gelu_tanh(gate) * up (Gemma 4)."""
        super().__init__()
        check_router(router, num_experts)
        state = get_parallel_state()
        self.router = router
        self.swiglu_limit = swiglu_limit
        self.oai_alpha = oai_alpha
        self.gelu = gelu
        if checkpoint_layout not in ("halves", "gpt_oss"):
            raise ValueError(f"unknown fused-experts checkpoint layout {checkpoint_layout!r}")
        self.checkpoint_layout = checkpoint_layout
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.expert_parallel = state.expert_parallel
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        if self.expert_parallel:
            self.ep_rank, self.ep_size = state.ep_rank, state.ep_size
            self.expert_start, self.num_local_experts = shard_range(num_experts, self.ep_size, self.ep_rank)
            self.i_start, self.local_intermediate = 0, intermediate_size
        else:
            self.expert_start, self.num_local_experts = 0, num_experts
            self.i_start, self.local_intermediate = shard_range(intermediate_size, self.tp_size, self.tp_rank)
        self.gate = Router(num_experts, hidden_size, router.correction_bias, router_dtype, logit_bias=router_bias)
        self.set_quant_scheme(building_experts_scheme())
        if expert_bias:
            self.w13_bias = new_param((self.num_local_experts, 2 * self.local_intermediate), fill=0.0)
            # The down projection's bias is added once: by the rank holding the expert's output sum.
            self.w2_bias = new_param((self.num_local_experts, hidden_size), fill=0.0)
            for param in (self.w13_bias, self.w2_bias):
                param.weight_loader = self.expert_weight_loader
                param.check_loaded = self._missing_experts
        else:
            self.register_parameter("w13_bias", None)
            self.register_parameter("w2_bias", None)
        self.shared_experts = shared_experts
        # Qwen2-MoE style: sigmoid(x . g) scales the shared experts' output.
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert_gate else None
        self._all_to_all = None
        # Tokens routed to each expert since start, on the device ([E + 1]: the last counts padding and
        # empty slots), from the whole EP group's routing; the runner reads it every few steps
        # (engine/runner/expert_load.py). None: not counted.
        self.load_counts: torch.Tensor | None = None

    # ---- weights and loading ------------------------------------------------------------------------
    def set_quant_scheme(self, scheme: QuantScheme | None) -> None:
        """(Re)create the expert parameters: full precision, or quantized per `scheme` (engine/kernels/quant.py
        formats with a leading expert dimension; per-tensor FP8 keeps a gate and an up scale per expert until
        `finish_loading` merges them)."""
        self.quant_scheme, self.q13, self.q2 = scheme, None, None
        E, I, H = self.num_local_experts, self.local_intermediate, self.hidden_size
        names = ("w13", "w2", "w13_scale", "w2_scale", "w13_input_scale", "w2_input_scale")
        if scheme is None:
            self.w13 = new_param((E, 2 * I, H))
            self.w2 = new_param((E, H, I))
            for name in names[2:]:
                self.register_parameter(name, None)
        else:
            if scheme.method == "fp8_block" and I % scheme.block[0]:
                raise ValueError(f"FP8 block-quantized experts need each rank's slice of the intermediate size "
                                 f"({I}) to be a multiple of the block ({scheme.block[0]})")
            if scheme.method == "int4_group" and I % scheme.block[1]:  # w2's input: packed and scaled in groups
                raise ValueError(f"int4 experts quantized in groups of {scheme.block[1]} need each rank's slice of "
                                 f"the intermediate size to be whole groups; {self.intermediate_size} split over "
                                 f"tensor_parallel_size {self.tp_size} gives {I} on rank {self.tp_rank}: choose a "
                                 f"tensor-parallel size that divides {self.intermediate_size // scheme.block[1]} "
                                 f"groups, or expert parallelism")
            self.w13 = new_param((E, *scheme.weight_shape(2 * I, H)), scheme.weight_dtype)
            self.w2 = new_param((E, *scheme.weight_shape(H, I)), scheme.weight_dtype)
            if scheme.method == "fp8_tensor":
                self.w13_scale, self.w2_scale = new_param((E, 2), torch.float32), new_param((E,), torch.float32)
            else:
                self.w13_scale = new_param((E, *scheme.scale_shape(2 * I, H)), scheme.scale_dtype)
                self.w2_scale = new_param((E, *scheme.scale_shape(H, I)), scheme.scale_dtype)
            if scheme.activation == "static":  # one scale for all experts: the checkpoint's largest
                self.w13_input_scale = new_param((1,), torch.float32, fill=0.0)
                self.w2_input_scale = new_param((1,), torch.float32, fill=0.0)
            else:
                self.register_parameter("w13_input_scale", None)
                self.register_parameter("w2_input_scale", None)
        for name in names:
            param = getattr(self, name)
            if param is not None:
                param.weight_loader = self.expert_weight_loader
                param.check_loaded = self._missing_input_scales if "input" in name else self._missing_experts

    EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
                             r"(weight|weight_scale|weight_scale_inv|input_scale)$")
    FUSED_NAME = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_scale_inv|_bias)?$")
    PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
    ROLE = {"weight": "", "weight_scale": "_scale", "weight_scale_inv": "_scale", "input_scale": "_input_scale",
            None: "", "_blocks": "", "_scales": "_scale", "_scale_inv": "_scale", "_bias": "_bias"}

    @classmethod
    def checkpoint_target(cls, name: str) -> tuple[str, tuple] | None:
        """(parameter name, shard) for a checkpoint tensor of routed experts, or None for any other tensor:
        `<layer>.mlp.experts.3.up_proj.weight` -> (`<layer>.mlp.w13`, (3, 'up'));
        `<layer>.mlp.experts.3.up_proj.weight_scale_inv` -> (`<layer>.mlp.w13_scale`, (3, 'up'));
        `<layer>.mlp.experts.gate_up_proj` -> (`<layer>.mlp.w13`, ('fused',)) (the FusedMoE sits at `mlp`);
        gpt-oss MXFP4 `<layer>.mlp.experts.gate_up_proj_blocks` / `_scales` -> w13 / w13_scale, ('fused',);
        transformers' FP8/FP4 experts (FP8Experts) `<layer>.mlp.experts.gate_up_proj_scale_inv` -> w13_scale."""
        match = cls.EXPERT_NAME.search(name)
        if match:
            part = cls.PART[match.group(2)]
            prefix = name[:match.start()]
            base = "w2" if part == "down" else "w13"
            return f"{prefix}.{base}{cls.ROLE[match.group(3)]}", (int(match.group(1)), part)
        match = cls.FUSED_NAME.search(name)
        if match:
            prefix = name[:match.start()]
            base = "w13" if match.group(1) == "gate_up_proj" else "w2"
            return f"{prefix}.{base}{cls.ROLE[match.group(2)]}", ("fused",)
        return None

    def _i_units(self, param: nn.Parameter) -> int:
        """Intermediate-size rows (w13) or columns (w2) per stored element of `param`."""
        scheme = self.quant_scheme
        if scheme is None:
            return 1
        block = scheme.scale_block
        if param is self.w13_scale:
            return block[0] if block else 1
        if param is self.w2_scale:
            return block[1] if block else 1
        return scheme.packed if param is self.w2 else 1

    def expert_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        if param is self.w13_input_scale or param is self.w2_input_scale:
            param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1)))
            return
        per_tensor = self.quant_scheme is not None and self.quant_scheme.method == "fp8_tensor"
        is_scale = param is self.w13_scale or param is self.w2_scale
        if param is self.w13_scale and self.quant_scheme.method == "fp8_channel" or \
                param is self.w2_scale and self.quant_scheme.method == "fp8_channel":
            loaded = loaded.reshape(*loaded.shape[:-2], -1) if loaded.shape[-1:] == (1,) else loaded
        local = slice(self.expert_start, self.expert_start + self.num_local_experts)
        if param is self.w13_bias or param is self.w2_bias:
            self._load_biases(param, loaded, shard)
            return
        if shard[0] == "fused":
            if per_tensor and is_scale:  # one scale per expert ([E]), for gate and up alike
                _check_shape(loaded, (self.num_experts,), "fused per-tensor expert scales")
                param.data.copy_(loaded[local].float().view(-1, *([1] * (param.dim() - 1))).expand_as(param))
                return
            if loaded.dim() == 4:  # gpt-oss MXFP4 blocks [E, rows, groups, 16] -> [E, rows, K/2]
                loaded = loaded.flatten(2)
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"fused experts have {loaded.shape[0]} experts, expected {self.num_experts}")
            gpt_oss = self.checkpoint_layout == "gpt_oss"
            for e in range(self.num_local_experts):
                expert = loaded[self.expert_start + e]
                if gpt_oss and self.quant_scheme is None and (param is self.w13 or param is self.w2):
                    expert = expert.t()  # stored [in, out]
                if param is self.w13 or param is self.w13_scale:
                    gate, up = self._gate_and_up(expert)
                    self._load_expert_part(param, e, "gate", gate)
                    self._load_expert_part(param, e, "up", up)
                else:
                    self._load_expert_part(param, e, "down", expert)
            return
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside [0, {self.num_experts})")
        if not local.start <= expert < local.stop:
            return  # held by another EP rank
        e = expert - self.expert_start
        if per_tensor and is_scale:
            column = 0 if part in ("gate", "down") else 1
            target = param.data[e] if param is self.w2_scale else param.data[e, column]
            target.copy_(loaded.float().reshape(()))
            return
        self._load_expert_part(param, e, part, loaded)

    def full_precision_rows(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """A full-precision fused expert tensor with its output rows first ([E, out, in]), as quantizing it
        online needs: gpt-oss stores its unquantized experts [E, in, out]."""
        if self.checkpoint_layout == "gpt_oss" and leaf in ("w13", "w2") and tensor.dim() == 3:
            return tensor.transpose(1, 2)
        return tensor

    def _gate_and_up(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert's fused gate/up rows split: gate rows then up rows, or (gpt-oss) interleaved."""
        if self.checkpoint_layout == "gpt_oss":
            return fused[0::2], fused[1::2]
        half = fused.shape[0] // 2
        return fused[:half], fused[half:]

    def _load_biases(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        """gpt-oss's fused expert biases: gate_up_proj_bias [E, 2I] (this rank's intermediate slice of gate and
        of up) and down_proj_bias [E, H] (kept by one TP rank only: the partial sums are reduced)."""
        if shard[0] != "fused":
            raise ValueError("expert biases are read from fused [experts, ...] tensors only")
        width = 2 * self.intermediate_size if param is self.w13_bias else self.hidden_size
        _check_shape(loaded, (self.num_experts, width), "fused expert biases")
        for e in range(self.num_local_experts):
            expert = loaded[self.expert_start + e]
            if param is self.w13_bias:
                I, start = self.local_intermediate, self.i_start
                gate, up = self._gate_and_up(expert)
                param.data[e, :I].copy_(gate[start:start + I])
                param.data[e, I:].copy_(up[start:start + I])
            elif self.expert_parallel or self.tp_rank == 0:
                param.data[e].copy_(expert)

    def _load_expert_part(self, param: nn.Parameter, e: int, part: str, loaded: torch.Tensor) -> None:
        """One expert's gate, up or down tensor (full intermediate size) -> this rank's slice of it."""
        is_scale = param is self.w13_scale or param is self.w2_scale
        what = f"expert {self.expert_start + e} {part}{' scale' if is_scale else ''}"
        units = self._i_units(param)
        local_units = unit_size(self.local_intermediate, units, what, exact=True)
        if part == "down":
            if loaded.dim() == 1 or param is self.w2_scale and self.quant_scheme.method == "fp8_channel":
                _check_shape(loaded, param.shape[1:], what)  # per output row: nothing to split
                param.data[e].copy_(loaded)
                return
            full = (param.shape[1], unit_size(self.intermediate_size, units, what, exact=False))
            _check_shape(loaded, full, what)
            sliced = aligned_narrow(loaded, 1, self.i_start, local_units, units, what)
            _check_shape(sliced, param.shape[1:], what)
            param.data[e].copy_(sliced)
            return
        offset = 0 if part == "gate" else local_units
        _check_shape(loaded, (unit_size(self.intermediate_size, units, what, exact=False), *param.shape[2:]), what)
        sliced = aligned_narrow(loaded, 0, self.i_start, local_units, units, what)
        param.data[e, offset:offset + local_units].copy_(sliced)

    @staticmethod
    def _missing_input_scales(param: nn.Parameter, shards: set) -> str | None:
        """Static activations take the largest expert's input scale: any expert may lack one, not all (the
        scale would stay 0 and every output NaN)."""
        return None if shards else "no routed expert has an input_scale, which static activations need"

    def _missing_experts(self, param: nn.Parameter, shards: set) -> str | None:
        """What the checkpoint did not provide for `param`, or None."""
        if ("fused",) in shards:
            return None
        parts = ("down",) if param is self.w2 or param is self.w2_scale else ("gate", "up")
        missing = [f"{e}.{p}" for e in range(self.num_experts) for p in parts if (e, p) not in shards]
        if not missing:
            return None
        return f"experts {missing[:6]}{' ...' if len(missing) > 6 else ''} ({len(missing)} tensors)"

    def finish_loading(self) -> None:
        """After every tensor arrived: merge per-tensor gate/up scales, build the kernel's views, prepare."""
        scheme = self.quant_scheme
        if scheme is None:  # a backend whose expert kernel reads another layout rewrites the weights once
            prepare = getattr(ops.fused_experts, "prepare_weights", None)
            if prepare is not None:
                prepare(self.w13.data, self.w2.data)
            return
        scale13, scale2 = self.w13_scale.data, self.w2_scale.data
        if scheme.method == "fp8_tensor":
            I = self.local_intermediate
            scale13 = torch.cat([requantize_to_max_scale(self.w13.data[e], scale13[e], [I, I])
                                 for e in range(self.num_local_experts)]) if self.num_local_experts else scale13[:, 0]
        inputs = [None if p is None else p.data for p in (self.w13_input_scale, self.w2_input_scale)]
        self.q13 = QuantizedWeight(scheme, self.w13.data, scale13, inputs[0])
        self.q2 = QuantizedWeight(scheme, self.w2.data, scale2, inputs[1])
        op = getattr(ops, scheme.moe_op)
        prepare_quantized(op, self.q13)
        prepare_quantized(op, self.q2)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        op, w13, w2 = ((getattr(ops, self.quant_scheme.moe_op), self.q13, self.q2) if self.q13 is not None
                       else (ops.fused_experts, self.w13, self.w2))
        extra = {}  # only what is set: backends without a feature decline such models at start-up
        if self.swiglu_limit is not None:
            extra["swiglu_limit"] = self.swiglu_limit
        if self.w13_bias is not None:
            extra.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        if self.oai_alpha is not None:
            extra["oai_alpha"] = self.oai_alpha
        if self.gelu:
            extra["gelu"] = True
        return op(x, w13, w2, weights, ids, **extra)

    def count_expert_load(self, enabled: bool = True) -> None:
        self.load_counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=self.w13.device) \
            if enabled else None

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor | None = None,
                route_input: torch.Tensor | None = None) -> torch.Tensor:
        """`expert_ids` [T, k]: experts chosen outside the router (hash routing), weighted by the router.
        `route_input` [T, H]: what the router reads, where it is not the experts' input (Gemma 4 routes the
        residual stream and feeds the experts its normalised form)."""
        step = current_moe_step()
        if self.expert_parallel:
            out = self._forward_expert_parallel(x, expert_ids, step, route_input)
        else:  # a partial sum over this rank's slice of every expert
            weights, ids = self._route(x if route_input is None else route_input, expert_ids)
            valid = step.valid_tokens if step is not None else None
            if valid is not None or self.load_counts is not None:  # every rank routes every token: counts all
                weights, ids = ops.moe_route_mask(weights, ids, 0, valid, self.load_counts)
            out = self._experts(x, weights, ids)
        if self.shared_experts is not None:
            # Built with an unreduced row-parallel down projection: a partial sum too.
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            if self.expert_parallel and self.tp_size > 1:
                shared = tensor_parallel_all_reduce(shared)
            out = out + shared
        if not self.expert_parallel and self.tp_size > 1:
            out = tensor_parallel_all_reduce(out)  # one reduction for the routed and shared experts
        return out

    def _route(self, x: torch.Tensor, expert_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate.route(x, self.router, expert_ids)

    def _forward_expert_parallel(self, x: torch.Tensor, expert_ids: torch.Tensor | None,
                                 step: MoEStep | None, route_input: torch.Tensor | None = None) -> torch.Tensor:
        """Every EP rank sends a chunk of `rows` tokens, the same count on every rank (the step's padded
        token count over the TP ranks of a DP rank, which hold the same tokens and send a slice each), so
        that the exchange's shapes depend on the step only. Rows past the real tokens route nowhere."""
        num_tokens = x.shape[0]
        padded = -(-max(step.padded_tokens if step is not None else 0, num_tokens) // self.tp_size) * self.tp_size
        rows = padded // self.tp_size
        first = self.tp_rank * rows
        chunk = _rows(x, first, rows)
        ids_chunk = None if expert_ids is None else _rows(expert_ids, first, rows, fill=0)
        valid = num_tokens if step is None or step.valid_tokens is None else step.valid_tokens
        routed = chunk if route_input is None else _rows(route_input, first, rows)
        weights, ids = ops.moe_route_mask(*self._route(routed, ids_chunk), first, valid)
        exchange = self._exchange(x.dtype)
        sent = exchange.dispatch(chunk, weights, ids, self.load_counts)
        expert_out = self._experts(sent.hidden, sent.weights, sent.local_ids)
        out = None
        if self.tp_size > 1:
            out = exchange.combine_tp_group(expert_out, sent.handle, self.tp_size, self.tp_rank)
        if out is None:
            out = exchange.combine(expert_out, sent.handle)
            if self.tp_size > 1:
                out = tensor_parallel_all_gather(out, dim=0)
        return out if padded == num_tokens else out[:num_tokens]

    def _exchange(self, dtype: torch.dtype) -> ExpertAllToAll:
        if self._all_to_all is None:
            state = get_parallel_state()
            device = self.w13.device
            placement = ExpertPlacement(tuple(shard_range(self.num_experts, self.ep_size, rank)
                                              for rank in range(self.ep_size)), self.ep_rank)
            # The most rows a rank sends: a step's tokens padded as engine.runner.cuda_graphs.padded_step_tokens
            # pads them (to a multiple of 64 above the graphs), a slice per TP rank.
            most = -(-state.max_num_batched_tokens // 64) * 64
            layout = ExchangeLayout(self.num_experts, self.hidden_size, self.router.top_k,
                                    -(-most // self.tp_size), dtype)
            self._all_to_all = make_all_to_all(state.ep_group, placement,
                                               host_collectives=state.host_collectives or device.type == "cpu",
                                               form=state.expert_exchange, layout=layout, device=device,
                                               small_all_reduce=state.ep_small_all_reduce)
        return self._all_to_all


def _rows(x: torch.Tensor, first: int, count: int, fill: float | None = None) -> torch.Tensor:
    """Rows [first, first + count) of `x`, padded past its end (with `fill`, else left uninitialised: padding
    rows are routed nowhere, so nothing reads them)."""
    if first + count <= x.shape[0]:
        return x[first:first + count]
    out = x.new_empty((count, *x.shape[1:])) if fill is None else x.new_full((count, *x.shape[1:]), fill)
    have = max(0, x.shape[0] - first)
    if have:
        out[:have] = x[first:first + have]
    return out


def uncapturable_exchanges(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """The names of the model's expert-parallel exchanges that cannot be captured in a CUDA graph."""
    return sorted({type(m._exchange(dtype)).__name__ for m in model.modules()
                   if isinstance(m, FusedMoE) and m.expert_parallel and not m._exchange(dtype).capturable})


def _check_shape(tensor: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def num_routed_experts(hf_config) -> int:
    """The routed experts of a model config, whatever the family calls them (0: not a MoE model)."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


def experts_per_rank(num_experts: int, ep_size: int) -> Counter:
    """How many experts each EP rank holds (for logs and benchmark tables)."""
    return Counter({rank: shard_range(num_experts, ep_size, rank)[1] for rank in range(ep_size)})
