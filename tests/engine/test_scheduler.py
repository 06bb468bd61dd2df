"""Scheduler: token budget, chunked prefill, mixed steps, admission limits, preemption order."""
from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.scheduler_output import RunnerOutput
from engine.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True, max_model_len=256,
                   long_prefill_token_threshold=None):
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked, long_prefill_token_threshold)
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def add(scheduler, request_id, num_prompt_tokens, max_tokens=100):
    request = Request(request_id, list(range(1, num_prompt_tokens + 1)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)
    scheduler.add_request(request)
    return request


def step(scheduler, token=7):
    """One schedule + a runner that samples `token` for every request that reached its last token."""
    scheduled = scheduler.schedule()
    sampled = [rid for rid in scheduled.num_scheduled_tokens
               if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens]
    scheduler.update_from_output(scheduled, RunnerOutput(sampled, [[token]] * len(sampled)))
    return scheduled


def test_first_step_prefills_whole_prompts_within_budget():
    scheduler = make_scheduler(budget=32)
    add(scheduler, "a", 10)
    add(scheduler, "b", 12)
    scheduled = step(scheduler)
    assert scheduled.num_scheduled_tokens == {"a": 10, "b": 12}
    assert [r.request_id for r in scheduled.new_requests] == ["a", "b"]


def test_long_prompt_is_chunked_over_steps_and_decodes_share_the_step():
    scheduler = make_scheduler(budget=16)
    add(scheduler, "short", 4)
    step(scheduler)  # short prefilled, one token sampled
    add(scheduler, "long", 40)
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 15}
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 15}
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 10}
    assert scheduler.requests["long"].num_output_tokens == 1  # sampled only once its prompt was done
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 1}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=16, chunked=False)
    add(scheduler, "short", 4)
    step(scheduler)
    add(scheduler, "fits-later", 16)
    assert step(scheduler).num_scheduled_tokens == {"short": 1}  # 15 tokens left: not enough
    scheduler.abort_requests(["short"])
    assert step(scheduler).num_scheduled_tokens == {"fits-later": 16}


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 3)
    assert set(step(scheduler).num_scheduled_tokens) == {"a", "b"}
    assert scheduler.num_waiting == 1


def test_newest_running_request_is_preempted_first():
    # 6 blocks of 4: a, b, c hold 2 each after prefill; each then needs a third block.
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    for name in "abc":
        add(scheduler, name, 8)
    step(scheduler)
    scheduled = step(scheduler)
    assert scheduled.finished_request_ids == {"c"}
    assert scheduled.num_scheduled_tokens == {"a": 1, "b": 1}
    assert scheduler.requests["c"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_goes_on_until_the_older_requests_fit_and_victims_resume_oldest_first():
    # 3 blocks of 4: one block each after prefill; every request then needs a second one.
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=64)
    for name in "abc":
        add(scheduler, name, 4)
    step(scheduler)
    scheduled = step(scheduler)
    assert scheduled.finished_request_ids == {"b", "c"}
    assert scheduled.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_preemptions == 2


def test_preempted_request_is_recomputed_with_its_generated_tokens():
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=64)
    add(scheduler, "a", 4, max_tokens=2)
    add(scheduler, "b", 4)
    add(scheduler, "c", 4)
    step(scheduler)
    step(scheduler)  # b and c preempted; a reaches max_tokens and frees its blocks
    resumed = step(scheduler)
    assert [r.request_id for r in resumed.new_requests] == ["b"]
    b = resumed.new_requests[0]
    assert b.token_ids == [1, 2, 3, 4, 7] and b.num_prompt_tokens == 4 and b.num_computed_tokens == 0
    assert resumed.num_scheduled_tokens == {"b": 5}
    assert scheduler.requests["b"].num_preemptions == 1


def test_finished_requests_free_blocks_and_are_forgotten_by_runners():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=2)
    step(scheduler)
    step(scheduler)
    assert scheduler.requests == {} and scheduler.block_manager.num_free_blocks == 64
    assert step(scheduler).finished_request_ids == {"a"}


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "running", 10)
    add(scheduler, "waiting", 10)
    step(scheduler)
    scheduler.abort_requests(["running", "waiting", "unknown"])
    assert not scheduler.has_unfinished and scheduler.block_manager.num_free_blocks == 64


# ---- fairness: decodes first, short prefills before long ones, a long prefill keeps its share ----------
def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_is_prefilled():
    scheduler = make_scheduler(num_blocks=128, budget=16)
    add(scheduler, "stream", 4)
    step(scheduler)
    add(scheduler, "long", 100)
    steps = 0
    while scheduler.requests["long"].num_output_tokens == 0:
        scheduled = step(scheduler)
        steps += 1
        assert scheduled.num_scheduled_tokens["stream"] == 1  # the stream's gap is one step, every step
        assert scheduled.total_num_scheduled_tokens <= 16
    assert steps == -(-100 // 15)  # the long prompt took the rest of each step's budget


def test_a_short_prompt_is_not_stuck_behind_long_ones():
    scheduler = make_scheduler(num_blocks=128, budget=16)  # long: more than 8 tokens left
    for name in ("long-1", "long-2", "long-3"):
        add(scheduler, name, 60)
    step(scheduler)
    add(scheduler, "short", 5)
    scheduled = step(scheduler)
    assert scheduled.num_scheduled_tokens == {"short": 5, "long-1": 11}  # a second long waits its turn
    assert [r.request_id for r in scheduler.waiting] == ["long-2", "long-3"]


def test_a_long_prefill_keeps_its_share_against_a_flood_of_short_prompts():
    scheduler = make_scheduler(num_blocks=256, budget=16, max_num_seqs=64, long_prefill_token_threshold=6)
    add(scheduler, "long", 60)
    step(scheduler)
    for index in range(6):
        for k in range(3):
            add(scheduler, f"short-{index}-{k}", 5)
        scheduled = step(scheduler)
        assert scheduled.num_scheduled_tokens["long"] >= 6 or scheduler.requests["long"].num_output_tokens


def test_a_long_prefill_alone_uses_the_whole_budget():
    scheduler = make_scheduler(num_blocks=128, budget=16, long_prefill_token_threshold=4)
    add(scheduler, "long", 40)
    assert step(scheduler).num_scheduled_tokens == {"long": 16}
    assert step(scheduler).num_scheduled_tokens == {"long": 16}
