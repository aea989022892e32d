"""Prometheus metrics of one server, in their own registry (two servers in one process do not mix).

Names follow vLLM's where one exists (`vllm:time_to_first_token_seconds` is
`paradecode_time_to_first_token_seconds` here). prometheus_client's metrics are thread-safe: the
replica workers update them, the event loop renders them.

    paradecode_requests_total{endpoint, outcome}      success, cancelled (client left), timeout,
                                                      rejected (429), invalid (4xx), unavailable, error
    paradecode_prompt_tokens_total / _generation_tokens_total
    paradecode_time_to_first_token_seconds            arrival (queueing included) to the first token
    paradecode_time_per_output_token_seconds          between two verified tokens of a request
    paradecode_request_queue_seconds                  arrival to a replica taking the request
    paradecode_e2e_request_latency_seconds            arrival to the response's last byte
    paradecode_early_exits_total{layer}               early tokens proposed at each exit layer
    paradecode_early_exits_accepted_total{layer}      ... and verified by the final layer
    paradecode_lookup_proposed_tokens_total           tokens prompt lookup proposed (vLLM's spec_decode_num_draft_tokens
                                                      for its n-gram proposer)
    paradecode_lookup_accepted_tokens_total           ... and the final layer verified (spec_decode_num_accepted_tokens)
    paradecode_rollbacks_total                        proposed tokens (of exits or lookup) the final layer rejected,
                                                      discarding what followed
    paradecode_requests_waiting / _requests_running   requests queued past every replica's rows (at most --max-queue),
                                                      and the admitted ones a row holds or is free for
    paradecode_batch_size                             requests in a batch's last step (batching replicas)
    paradecode_batch_steps_total{calls}               batch steps: `alone` (one request, with all of ParaDecode)
                                                      or `together` (every request in one call per segment,
                                                      its lookup proposals verified in it)
    paradecode_replicas
    process_resident_memory_bytes, process_cpu_seconds_total, ...   prometheus_client's process collector
                                                      (Linux; the whole server process, every replica)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from paradecode.runtime.serve.pool import PoolMetrics
from paradecode.runtime.stats import GenerationResult

OUTCOMES = ("success", "cancelled", "timeout", "rejected", "invalid", "unavailable", "error")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics(PoolMetrics):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, replicas: int):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "paradecode_requests", "Requests by endpoint and outcome", ("endpoint", "outcome"), registry=registry
        )
        self.prompt_tokens = Counter("paradecode_prompt_tokens", "Prompt tokens of requests decoded", registry=registry)
        self.generation_tokens = Counter("paradecode_generation_tokens", "Verified tokens generated", registry=registry)
        self.first_token = Histogram(
            "paradecode_time_to_first_token_seconds",
            "Seconds from a request's arrival (queueing included) to its first verified token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.per_token = Histogram(
            "paradecode_time_per_output_token_seconds",
            "Seconds between two verified tokens of one request",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "paradecode_request_queue_seconds",
            "Seconds a request waited for a free replica",
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "paradecode_e2e_request_latency_seconds",
            "Seconds from a request's arrival to the end of its response",
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.exits = Counter(
            "paradecode_early_exits", "Early tokens proposed at each exit layer", ("layer",), registry=registry
        )
        self.accepted = Counter(
            "paradecode_early_exits_accepted",
            "Early tokens the final layer verified, by exit layer",
            ("layer",),
            registry=registry,
        )
        self.lookup_proposed = Counter(
            "paradecode_lookup_proposed_tokens", "Tokens proposed by prompt lookup", registry=registry
        )
        self.lookup_accepted = Counter(
            "paradecode_lookup_accepted_tokens", "Lookup's proposed tokens the final layer verified", registry=registry
        )
        self.rollbacks = Counter(
            "paradecode_rollbacks",
            "Rollbacks: proposed tokens (of exit heads or lookup) the final layer rejected",
            registry=registry,
        )
        self.waiting = Gauge(
            "paradecode_requests_waiting",
            "Requests queued past every replica's rows (at most --max-queue)",
            registry=registry,
        )
        self.running = Gauge(
            "paradecode_requests_running", "Admitted requests a replica's row holds or is free for", registry=registry
        )
        Gauge("paradecode_replicas", "Models loaded in this server", registry=registry).set(replicas)
        self.batch_size = Gauge("paradecode_batch_size", "Requests in a batch's last step", registry=registry)
        self.batch_steps = Counter(
            "paradecode_batch_steps",
            "Batch steps: alone (one request, with all of ParaDecode) or together (one call per segment for every"
            " request, their lookup proposals verified in it)",
            ("calls",),
            registry=registry,
        )
        for calls in ("alone", "together"):
            self.batch_steps.labels(calls)
        ProcessCollector(registry=registry)  # the default registry's RSS, CPU time and open files, in ours
        for endpoint in ("completions", "chat"):  # every series exists from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)

    def declare_exit_layers(self, layers) -> None:
        """Show the export's exit layers at 0 before any request reaches them."""
        for layer in layers:
            self.exits.labels(str(layer))
            self.accepted.labels(str(layer))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- the pool's reports (from its worker threads and the event loop) -------------------------
    def depth(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def started(self, queue_seconds: float) -> None:
        self.queue_time.observe(queue_seconds)

    def token(self, seconds: float, first: bool) -> None:
        (self.first_token if first else self.per_token).observe(seconds)

    def step(self, size: int, alone: bool) -> None:
        self.batch_size.set(size)
        self.batch_steps.labels("alone" if alone else "together").inc()

    def finished(self, result: GenerationResult) -> None:
        stats = result.stats
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        for layer, count in stats.exits_per_layer.items():
            self.exits.labels(str(layer)).inc(count)
        for layer, count in stats.accepted_per_layer.items():
            self.accepted.labels(str(layer)).inc(count)
        self.lookup_proposed.inc(stats.lookup_proposed)
        self.lookup_accepted.inc(stats.lookup_accepted)
        self.rollbacks.inc(stats.rollbacks)

    # --- the app's reports -------------------------------------------------------------------------
    def request(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.requests.labels(endpoint, outcome).inc()
        if outcome == "success":
            self.latency.observe(seconds)
