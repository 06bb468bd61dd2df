"""Prometheus metrics of one app, on its own registry (several apps may share a process): latencies measured
here from output arrival times, and the engine's own gauges and counters read from `client.stats()` at
scrape time."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestMetrics

PREFIX = "atom_ray:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                      0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0)

# (metric name, stats key, help)
_ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Sequences in the engine's running batch."),
    ("num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use (0 to 1), all cache groups."),
    ("state_slot_usage_perc", "state_slot_usage",
     "Fraction of per-request state slots in use (0 to 1; 0 for models without per-request state)."),
    ("spec_decode_acceptance_rate", "spec_acceptance_rate",
     "Draft tokens kept over draft tokens verified, since start (speculative decoding)."),
    ("spec_decode_mean_accepted_length", "spec_mean_accepted_length",
     "Tokens a verify step emits on average: kept drafts + 1, since start (speculative decoding)."),
    ("resume_latency_seconds_max", "resume_latency_s_max",
     "The longest pause of a resumed request: a DP rank's failure to its next output, since start."),
    ("replica_resume_latency_seconds_max", "replica_resume_latency_s_max",
     "The longest pause of a request continued after its engine failed: the failure to its next output."),
)
_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens the engine accepted."),
    ("generation_tokens", "generation_tokens", "Tokens the engine generated."),
    ("num_preemptions", "num_preemptions", "Sequences preempted for lack of KV cache blocks."),
    ("engine_restarts", "engine_restarts", "Times the engine was restarted after a failure."),
    # Failover inside a data-parallel engine (atom_ray/dp_coordinator.py): requests of a failed DP rank
    # continued on another, those that could not be, the seconds from detecting the failure to each resumed
    # request's next output (summed: over resumed_requests, the mean pause), and DP ranks started again.
    ("resumed_requests", "resumed_requests", "Requests of a failed DP rank continued on another."),
    ("failed_resumes", "failed_resumes", "Requests of a failed DP rank that could not be continued (ended with "
                                         "an error)."),
    ("resume_latency_seconds", "resume_latency_s_sum",
     "Seconds from a DP rank's failure to each resumed request's next output, summed."),
    ("dp_rank_restarts", "dp_rank_restarts", "DP ranks started again after a failure."),
    # Failover across Serve replicas (deployments/replica_failover.py), counted by the replica whose engine
    # failed under the requests: those continued on another replica or the restarted engine (at their
    # continuation's first output), those that could not be, and the pauses; and by the replica that ran
    # them, the continuations it took over from others.
    ("replica_resumed_requests", "replica_resumed_requests",
     "Requests whose engine failed under them, continued on another replica or on the restarted engine."),
    ("replica_failed_resumes", "replica_failed_resumes",
     "Requests whose engine failed under them and that could not be continued (ended with an error)."),
    ("replica_resume_latency_seconds", "replica_resume_latency_s_sum",
     "Seconds from an engine's failure to each continued request's next output, summed."),
    ("peer_continuations", "peer_continuations",
     "Requests of other replicas whose engine failed, continued on this replica's engine."),
    # Speculative decoding (vLLM's names): verify rows, drafted tokens they ran, drafts they kept.
    ("spec_decode_num_drafts", "spec_verifies", "Request steps that verified drafts (speculative decoding)."),
    ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens verified (speculative decoding)."),
    ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens kept (speculative decoding)."),
)

# Under data parallelism, each DP rank's own numbers, labelled dp_rank (the families above are their sums).
_DP_RANK_GAUGES = (
    ("dp_num_requests_running", "num_running", "Sequences in this DP rank's running batch."),
    ("dp_num_requests_waiting", "num_waiting", "Sequences waiting in this DP rank's scheduler."),
    ("dp_kv_cache_usage_perc", "kv_cache_usage", "Fraction of this DP rank's KV cache blocks in use."),
    ("dp_state_slot_usage_perc", "state_slot_usage", "Fraction of this DP rank's per-request state slots in use."),
    ("dp_rank_serving", "serving", "1 while this DP rank takes requests; 0 from its failure until it is back."),
)
_DP_RANK_COUNTERS = (
    ("dp_prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in this DP rank's prefix cache."),
    ("dp_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in this DP rank's prefix cache."),
    ("dp_routed_requests", "routed_requests", "Requests the coordinator sent to this DP rank."),
)


# Expert load over the engine's latest window of steps (engine/runner/expert_load.py): (token, expert) pairs
# summed over the MoE layers, per expert and per EP rank, so that an imbalanced deployment shows.
_EXPERT_LOAD_GAUGES = (
    ("expert_load_window_steps", "window_steps", "Steps in the window the expert-load gauges cover."),
    ("ep_rank_load_imbalance", "ep_rank_imbalance",
     "Tokens routed to the busiest EP rank over the mean rank's, in the window (1 = balanced)."),
    ("expert_load_imbalance", "expert_imbalance",
     "Tokens routed to the busiest expert over the mean expert's, in the window (1 = balanced)."),
)
_EXPERT_LOAD_LABELLED = (
    ("expert_load_tokens", "tokens_per_expert", "expert",
     "(token, expert) pairs routed to this expert in the window, summed over the MoE layers."),
    ("ep_rank_load_tokens", "tokens_per_ep_rank", "ep_rank",
     "(token, expert) pairs routed to this EP rank's experts in the window, summed over the MoE layers."),
)


class _EngineStatsCollector:
    """Exposes the latest `client.stats()` snapshot; the engine's counters are cumulative, so they are
    reported as they are rather than incremented here."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        for name, key, help_text in _ENGINE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, help_text)
            if key in self.stats:
                family.add_metric([], float(self.stats[key]))
            yield family
        for name, key, help_text in _ENGINE_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, help_text)
            if key in self.stats:
                family.add_metric([], float(self.stats[key]))
            yield family
        load = self.stats.get("expert_load") or {}
        for name, key, help_text in _EXPERT_LOAD_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, help_text)
            if key in load:
                family.add_metric([], float(load[key]))
            yield family
        for name, key, label, help_text in _EXPERT_LOAD_LABELLED:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=[label])
            for index, value in enumerate(load.get(key, [])):
                family.add_metric([str(index)], float(value))
            yield family
        ranks = self.stats.get("dp_ranks") or []
        for kinds, family_type in ((_DP_RANK_GAUGES, GaugeMetricFamily), (_DP_RANK_COUNTERS, CounterMetricFamily)):
            for name, key, help_text in kinds:
                family = family_type(PREFIX + name, help_text, labels=["dp_rank"])
                for rank in ranks:
                    if key in rank:
                        family.add_metric([str(rank["dp_rank"])], float(rank[key]))
                yield family


class AppMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first output.", _LATENCY_BUCKETS)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between successive outputs of a request.", _TOKEN_GAP_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last output.", _REQUEST_BUCKETS)
        # The engine's own intervals (from its RequestMetrics): what the time to first token spent waiting in
        # the engine and computing the prefill; the rest of that time is outside the engine (HTTP, Ray, ...).
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Time from the engine's arrival of a request to its first scheduling.",
            _LATENCY_BUCKETS)
        self.request_prefill_time = self._histogram(
            "request_prefill_time_seconds", "Time from a request's first scheduling to its first token.",
            _LATENCY_BUCKETS)
        self.request_decode_time = self._histogram(
            "request_decode_time_seconds", "Time from a request's first token to its last.", _REQUEST_BUCKETS)
        # A counter family built by hand, so that finish reasons seen by this app add up across scrapes.
        self._finished: dict[str, int] = {}
        self._engine_stats = _EngineStatsCollector()
        self.registry.register(self._engine_stats)
        self.registry.register(self)

    def track_admission(self, in_flight) -> None:
        """`in_flight()`: the sequences this app has admitted and not yet finished."""
        Gauge(PREFIX + "num_pending_sequences", "Sequences (prompts x n) admitted by this app and not finished.",
              registry=self.registry).set_function(in_flight)

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, help_text, registry=self.registry, buckets=buckets)

    def record_finished(self, finish_reason: str | None) -> None:
        reason = finish_reason or "unknown"
        self._finished[reason] = self._finished.get(reason, 0) + 1

    def collect(self):
        family = CounterMetricFamily(PREFIX + "request_success", "Completions finished, by finish reason.",
                                     labels=["finished_reason"])
        for reason, count in self._finished.items():
            family.add_metric([reason], count)
        yield family

    def render(self, engine_stats: dict) -> tuple[bytes, str]:
        """The exposition text with the engine's numbers from `engine_stats`, and its content type."""
        self._engine_stats.stats = engine_stats
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latencies of one engine request, observed as its outputs arrive."""
    __slots__ = ("metrics", "start", "last")

    def __init__(self, metrics: AppMetrics, arrival_time: float) -> None:
        self.metrics = metrics
        self.start = arrival_time  # time.monotonic() when the HTTP request arrived
        self.last: float | None = None

    def on_output(self, finished: bool, engine: RequestMetrics | None = None) -> None:
        """`engine`: the output's engine-side metrics, where the client passes them on."""
        now = time.monotonic()
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.start)
            if engine is not None and engine.first_scheduled_time is not None and engine.first_token_time is not None:
                self.metrics.request_queue_time.observe(engine.first_scheduled_time - engine.arrival_time)
                self.metrics.request_prefill_time.observe(engine.first_token_time - engine.first_scheduled_time)
        else:
            self.metrics.inter_token_latency.observe(now - self.last)
        self.last = now
        if finished:
            self.metrics.e2e_request_latency.observe(now - self.start)
            if engine is not None and engine.first_token_time is not None and engine.last_token_time is not None:
                self.metrics.request_decode_time.observe(engine.last_token_time - engine.first_token_time)
