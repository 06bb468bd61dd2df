"""gpt-oss (vLLM's `openai_gptoss`): the `analysis` channel is the reasoning, `final` (and a commentary
preamble) the answer (agentic_and_spec_formats.md A.9). The harmony reader is the tool parser's
(tool_parsers/harmony.py); calls it finds are not content here: use the `openai` tool parser for them. It names
no reasoning tags: under structured output the constraint holds from the output's first token."""
from __future__ import annotations

from typing import Any

from ..tool_parsers.harmony import HarmonyToolParser
from .base import ReasoningParser


class HarmonyReasoningParser(ReasoningParser):
    name = "openai"

    def __init__(self, prompt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 end_tag_only: bool = False) -> None:
        super().__init__(prompt, chat_template_kwargs, end_tag_only)
        self._reader = HarmonyToolParser()

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._reader.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self._reader.finish())

    @staticmethod
    def _split(deltas) -> tuple[str, str]:
        return ("".join(delta.reasoning_content or "" for delta in deltas),
                "".join(delta.content or "" for delta in deltas))
