"""The failover counters reach /metrics: a DPCoordinator's stats (no rank started) after two resumed
requests, one failed resume and a restarted rank; a Serve replica's (deployments/replica_failover.py)
after requests continued on another replica or taken over from one."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from atom_ray.dp_coordinator import DPCoordinator
from deployments.openai.metrics import AppMetrics
from deployments.replica_failover import ReplicaFailover
from engine.config import EngineConfig


def test_resumes_failed_resumes_their_latency_and_rank_restarts_are_exported():
    coordinator = DPCoordinator(EngineConfig.from_kwargs("unused", data_parallel_size=2), None, None)
    coordinator.resumed_requests, coordinator.failed_resumes, coordinator.rank_restarts = 2, 1, 1
    coordinator.resume_latency_s_sum, coordinator.resume_latency_s_max = 1.5, 1.0
    coordinator.serving = [True, False]
    text, _ = AppMetrics().render(coordinator.stats())
    samples = {(s.name, s.labels.get("dp_rank")): s.value
               for family in text_string_to_metric_families(text.decode()) for s in family.samples}
    assert samples[("atom_ray:resumed_requests_total", None)] == 2
    assert samples[("atom_ray:failed_resumes_total", None)] == 1
    assert samples[("atom_ray:resume_latency_seconds_total", None)] == 1.5
    assert samples[("atom_ray:resume_latency_seconds_max", None)] == 1.0
    assert samples[("atom_ray:dp_rank_restarts_total", None)] == 1
    assert samples[("atom_ray:dp_rank_serving", "0")] == 1 and samples[("atom_ray:dp_rank_serving", "1")] == 0


class _Engine:
    tokenizer, max_model_len, is_healthy = None, 64, True

    def stats(self) -> dict:
        return {"num_running": 1}


def test_a_replica_s_continued_requests_failed_ones_their_latency_and_continuations_for_others_are_exported():
    failover = ReplicaFailover(_Engine(), resume_timeout_s=60.0)
    failover.resumed_requests, failover.failed_resumes, failover.peer_continuations = 3, 1, 2
    failover.resume_latency_s_sum, failover.resume_latency_s_max = 0.75, 0.5
    text, _ = AppMetrics().render(failover.stats())
    samples = {s.name: s.value for family in text_string_to_metric_families(text.decode()) for s in family.samples}
    assert samples["atom_ray:replica_resumed_requests_total"] == 3
    assert samples["atom_ray:replica_failed_resumes_total"] == 1
    assert samples["atom_ray:replica_resume_latency_seconds_total"] == 0.75
    assert samples["atom_ray:replica_resume_latency_seconds_max"] == 0.5
    assert samples["atom_ray:peer_continuations_total"] == 2
    assert samples["atom_ray:num_requests_running"] == 1
