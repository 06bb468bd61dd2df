"""What the structured-output unit tests share: a manager over the packaged SmolLM2's vocabulary (module
fixture: import it into a test module) and a compiled matcher for a constraint."""
from __future__ import annotations

import pytest

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.manager import StructuredOutputManager


@pytest.fixture(scope="module")
def manager(smollm2):
    engine = smollm2.engine
    manager = StructuredOutputManager(engine.tokenizer, engine.source.hf_config.vocab_size, engine.eos_token_ids)
    yield manager
    manager.shutdown()


def compiled(manager, **constraint):
    grammar = manager.request(StructuredOutputsParams(**constraint))
    grammar._future.result(timeout=60)
    assert grammar.compiled and grammar.error is None, grammar.error
    return grammar.matcher
