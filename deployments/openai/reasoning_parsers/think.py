"""The `<think>` families (agentic_and_spec_formats.md Part A, each family's "Reasoning" line)."""
from __future__ import annotations

from .base import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: its template (and its README) start the output inside `<think>`; an output that never
    closes it is all reasoning (A.4)."""
    name = "deepseek_r1"
    starts_in_reasoning = True


class DeepSeekV3ReasoningParser(ThinkReasoningParser):
    """DeepSeek-V3.1/V3.2/V4: the prompt ends `<think>` with thinking on, `</think>` with it off (A.5)."""
    name = "deepseek_v3"


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 (hybrid: the model writes `<think>`; `enable_thinking=False` closes it in the prompt), Qwen3.5
    and the Thinking-2507 models (the prompt opens it). A `<tool_call>` before `</think>` ends the reasoning,
    as vLLM's qwen3 parser reads Qwen3.5 (A.2, A.3)."""
    name = "qwen3"
    implicit_ends = ("<tool_call>",)


class Glm45ReasoningParser(ThinkReasoningParser):
    """GLM-4.5/4.6 (the model writes `<think>`), GLM-4.7 and GLM-5 (the prompt opens it) (A.7)."""
    name = "glm45"


class MiniMaxM2ReasoningParser(ThinkReasoningParser):
    """MiniMax-M2: the prompt ends `<think>\\n`, so only `</think>` is generated (A.8)."""
    name = "minimax_m2"
    starts_in_reasoning = True


class KimiK2ReasoningParser(ThinkReasoningParser):
    """Kimi-K2-Thinking (the model writes `<think>`) and K2.5 (the prompt opens it; `thinking: false` closes
    it). `<think>`, not Kimi-VL's `◁think▷`. A tool-call section ends the reasoning (A.6)."""
    name = "kimi_k2"
    implicit_ends = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
