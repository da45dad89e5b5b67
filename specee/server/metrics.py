"""Prometheus metrics with vLLM's meanings under specee's prefix (`vllm:x` -> `specee:x`).

Each app has its own registry, so several servers (tests) in one process do not collide."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.sequence import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Metrics:
    def __init__(self, model_name: str, running: Callable[[], int], waiting: Callable[[], int],
                 parked: Callable[[], int], num_layers: int = 0, prefix_caching: Callable[[], bool] = lambda: True):
        """prefix_caching: whether the engine looks prompts up in its prefix cache now (as vLLM's, the
        queries counter stays at zero where it does not)."""
        self.registry = r = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": r}
        self.model_name, self.prefix_caching = model_name, prefix_caching
        self.running = Gauge("specee:num_requests_running", "Requests the engine decodes now (at most --max-num-seqs)",
                             **label)
        self.running.labels(model_name).set_function(running)
        self.waiting = Gauge("specee:num_requests_waiting", "Requests waiting for one of those places", **label)
        self.waiting.labels(model_name).set_function(waiting)
        self.swapped = Gauge("specee:num_requests_swapped", "Requests parked out of the KV cache until it has room: "
                             "their rows in host memory beyond --kv-cache-memory (counted as waiting too)", **label)
        self.swapped.labels(model_name).set_function(parked)
        self.prompt_tokens = Counter("specee:prompt_tokens", "Prefill tokens processed", **label)
        self.generation_tokens = Counter("specee:generation_tokens", "Generated tokens", **label)
        self.prefix_queries = Counter("specee:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      **label)
        self.prefix_hits = Counter("specee:prefix_cache_hits", "Prompt tokens the prefix cache held (not prefilled)",
                                   **label)
        self.success = Counter("specee:request_success", "Finished requests, by finish reason",
                               labelnames=["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("specee:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              **label)
        self.itl = Histogram("specee:inter_token_latency_seconds", "Time between generated tokens",
                             buckets=LATENCY_BUCKETS, **label)
        self.e2e = Histogram("specee:e2e_request_latency_seconds", "Arrival to finish", buckets=REQUEST_BUCKETS,
                             **label)
        self.queue = Histogram("specee:request_queue_time_seconds", "Arrival to admission", buckets=REQUEST_BUCKETS,
                               **label)
        self.drafts = Counter("specee:spec_decode_num_drafts", "Speculative draft-verify rounds", **label)
        self.draft_tokens = Counter("specee:spec_decode_num_draft_tokens", "Draft tokens proposed", **label)
        self.accepted = Counter("specee:spec_decode_num_accepted_tokens", "Draft tokens accepted", **label)
        self.accepted_per_pos = Counter("specee:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position",
                                        labelnames=["model_name", "position"], registry=r)
        buckets = tuple(range(1, num_layers + 1)) or (1.0,)
        self.exit_layer = Histogram("specee:early_exit_layer", "Layers run per early-exit decode step",
                                    buckets=buckets, **label)
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits, self.ttft, self.itl, self.e2e, self.queue,
                       self.drafts, self.draft_tokens, self.accepted, self.exit_layer):
            metric.labels(model_name)  # every series shows from the start, at zero

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def token_gap(self, seconds: float, tokens: int) -> None:
        """`tokens` arrived `seconds` after the previous ones (a speculative round brings several)."""
        for _ in range(tokens):
            self.itl.labels(self.model_name).observe(seconds / tokens)

    def finished(self, out: RequestOutput) -> None:
        m, st = self.model_name, out.stats
        self.success.labels(m, out.finish_reason).inc()
        if st.scheduled_time is not None:  # its prefill ran (not one refused or aborted while it waited)
            self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
            if self.prefix_caching():
                self.prefix_queries.labels(m).inc(len(out.prompt_token_ids))
            self.prefix_hits.labels(m).inc(st.cached_tokens)
        self.generation_tokens.labels(m).inc(len(out.token_ids))
        if st.time_to_first_token is not None:
            self.ttft.labels(m).observe(st.time_to_first_token)
        if st.finish_time is not None:
            self.e2e.labels(m).observe(st.finish_time - st.arrival_time)
        if st.queue_seconds is not None:
            self.queue.labels(m).observe(st.queue_seconds)
        if sp := st.speculative:
            self.drafts.labels(m).inc(sp.get("drafts", 0))
            self.draft_tokens.labels(m).inc(sp.get("draft_tokens", 0))
            self.accepted.labels(m).inc(sp.get("accepted_tokens", 0))
            for pos, rate in enumerate(sp.get("acceptance_rate_per_position", [])):
                self.accepted_per_pos.labels(m, str(pos)).inc(round(rate * sp.get("drafts", 0)))
        if ee := st.early_exit:
            for layer, count in enumerate(ee.get("exit_histogram", [])):
                for _ in range(count):
                    self.exit_layer.labels(m).observe(layer + 1)
