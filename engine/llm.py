"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)` and `.chat(...)`.
`shutdown()`, the end of a `with LLM(...) as llm:` block, or dropping the LLM gives its memory back."""
from __future__ import annotations

import weakref
from typing import Sequence

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, show_progress: bool = True, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args), show_progress=show_progress)
        # Runs once: at shutdown(), or when the LLM is dropped (it holds the engine, not the LLM). Not at
        # interpreter exit, where the process gives everything back anyway.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._finalizer.atexit = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Free the model's weights, KV cache and graphs (another LLM in this process can then have the
        memory); generate and chat raise EngineDeadError afterwards. Calling it again does nothing."""
        self._finalizer()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.encode_chat(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if not self._finalizer.alive:
            raise EngineDeadError("this LLM was shut down; create a new LLM to generate")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.new_request_id())
                engine.add_request(ids[-1], prompt, p)
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(ids), desc="Generating", unit="req")
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        failed = [(index, results[request_id].error) for index, request_id in enumerate(ids)
                  if results[request_id].error is not None]
        if failed:
            index, error = failed[0]
            raise RequestFailedError(f"{len(failed)} of {len(ids)} requests failed; the first (prompt {index}): {error}")
        return [results[request_id] for request_id in ids]
