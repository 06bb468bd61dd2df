"""The DPCoordinator's bookkeeping for failover, without Ray: what a request's journal keeps from its outputs
and the continuation it builds from them, how a continuation's outputs are rewritten into one stream, and
how the router moves requests off a failed rank."""
from __future__ import annotations

from atom_ray.coordinator import CompletionDelta, OutputDelta
from atom_ray.dp_router import DETACHED, DPRouter
from atom_ray.request_journal import RequestRecord
from engine.outputs import RequestMetrics
from engine.resume import ResumedSample, ResumeState
from engine.sampling_params import SamplingParams


def delta(new: dict[int, tuple[list[int], str]], finished_samples=(), first=False, finished=False,
          cached=0, metrics=None) -> OutputDelta:
    completions = [CompletionDelta(index, text, tokens, None, "length" if index in finished_samples else None, None)
                   for index, (tokens, text) in new.items()]
    return OutputDelta("r", completions, finished, cached, prompt_token_ids=[1, 2, 3] if first else None,
                       prompt_logprobs=[None, {}] if first else None, metrics=metrics)


def test_before_its_first_output_a_request_is_sent_again_as_it_came():
    params = SamplingParams(max_tokens=8)
    record = RequestRecord.new("some text", params)
    assert record.continuation() == ("some text", params, None)


def test_a_continuation_carries_each_unfinished_sample_with_what_it_delivered():
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10, prompt_logprobs=1)
    record = RequestRecord.new("text", params)
    record.record(delta({0: ([5, 6], "ab"), 1: ([7], "c"), 2: ([8], "")}, first=True), now=1.0)
    record.record(delta({0: ([9], "de"), 1: ([10], "f")}, finished_samples={1}), now=2.0)
    prompt, resumed_params, resume = record.continuation()
    assert prompt == [1, 2, 3]  # the engine's token ids, not the text again
    assert resume == ResumeState((ResumedSample(0, (5, 6, 9), 4), ResumedSample(2, (8,), 0)))
    assert resumed_params.prompt_logprobs is None  # delivered with the first output already
    assert (resumed_params.seed, resumed_params.n, resumed_params.max_tokens) == (4, 3, 10)  # the rest unchanged


def test_a_continuation_s_outputs_read_as_one_stream():
    record = RequestRecord.new([1, 2, 3], SamplingParams())
    first_metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0)
    record.record(delta({0: ([5], "a")}, first=True, cached=16, metrics=first_metrics), now=50.0)
    record.num_resumes = 1
    # The continuation's first output: its own prompt, cache hit and (other clock's) metrics are not the client's.
    again = record.record(delta({0: ([6], "b")}, first=True, cached=32,
                                metrics=RequestMetrics(arrival_time=9.0, first_token_time=9.5)), now=53.0)
    assert again.prompt_token_ids is None and again.prompt_logprobs is None
    assert again.num_cached_tokens == 16 and again.metrics is None
    last = record.record(delta({0: ([7], "c")}, finished=True, cached=32,
                               metrics=RequestMetrics(arrival_time=9.0, first_token_time=9.5, last_token_time=12.0,
                                                      finished_time=12.0, num_preemptions=2)), now=54.0)
    assert last.metrics.arrival_time == 100.0 and last.metrics.first_token_time == 101.0
    assert last.metrics.last_token_time == 105.0  # 4 s after the first token, as this actor saw it
    assert last.metrics.num_preemptions == 2 and last.num_cached_tokens == 16
    assert record.samples[0].token_ids == [5, 6, 7]


def test_a_request_that_cannot_resume_ends_its_unfinished_samples_with_an_error():
    record = RequestRecord.new([1], SamplingParams(n=2))
    record.record(delta({0: ([5], "a"), 1: ([6], "b")}, finished_samples={0}, first=True, cached=16), now=1.0)
    failure = record.failure("r", "the request could not be resumed: too long")
    assert failure.finished and failure.error == "the request could not be resumed: too long"
    assert [(c.index, c.finish_reason) for c in failure.completions] == [(1, "error")]


def test_a_request_that_arrives_resumed_continues_from_what_was_delivered_before_it_came():
    """A continuation from a Serve replica whose engine failed: if its DP rank fails too, the next
    continuation carries the tokens delivered before it came and since; a sample it did not list had finished."""
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10)
    arrived = ResumeState((ResumedSample(0, (5, 6), 3), ResumedSample(2, (8,), 1)))
    record = RequestRecord.new([1, 2, 3], params, arrived)
    assert record.continuation() == ([1, 2, 3], params, arrived)  # failed before its first output here
    record.record(delta({0: ([9], "d")}, first=True), now=1.0)
    assert record.continuation()[2] == ResumeState((ResumedSample(0, (5, 6, 9), 4), ResumedSample(2, (8,), 1)))


def test_the_router_moves_requests_off_a_failed_rank_and_routes_around_it():
    router = DPRouter(2, block_size=4)
    prefix = list(range(16))
    first = router.route(prefix, [True, True])
    router.assign("a", first, 16)
    router.assign("b", 1 - first, 8)
    assert router.detach(first) == ["a"]
    assert router.rank_of["a"] == DETACHED and router.outstanding[first] == 0
    # The failed rank gets nothing, not even a prompt it had cached; nothing at all while no rank serves.
    serving = [dp != first for dp in range(2)]
    assert router.route(prefix, serving) == 1 - first
    assert router.route(prefix, [False, False]) is None
    router.assign("a", 1 - first, 20)
    assert router.outstanding[1 - first] == 2 and router.outstanding_tokens[1 - first] == 28
    router.release("a")
    router.release("b")
    assert router.outstanding == [0, 0] and router.outstanding_tokens == [0, 0] and not router.rank_of
