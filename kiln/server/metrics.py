"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters, histograms and gauges under the ``kiln_`` prefix.

    Gauges are set by the engine thread after each step; counters and histograms by the
    event loop (prometheus_client is thread-safe).
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kiln_requests", "Finished HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens processed.",
                                     registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated.",
                                         registry=r)
        self.request_steps = Counter(
            "kiln_request_decode_steps",
            "Engine steps that produced tokens, summed over requests; generation_tokens / this "
            "is the speculative acceptance (tokens per step, 1.0 without speculation).",
            registry=r)
        self.aborted = Counter("kiln_requests_aborted",
                               "Engine requests aborted because the client went away.",
                               registry=r)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kiln_inter_token_latency_seconds",
                             "Gap between successive outputs of one request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("kiln_num_requests_waiting", "Requests waiting for a slot.",
                             registry=r)
        self.running = Gauge("kiln_num_requests_running", "Requests being decoded.", registry=r)
        self.kv_used = Gauge("kiln_kv_blocks_used", "KV cache blocks in use.", registry=r)
        self.kv_total = Gauge("kiln_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.spec_steps = Counter("kiln_spec_decode_steps",
                                  "Speculative steps of finished requests.", registry=r)
        self.spec_tokens = Counter("kiln_spec_decode_tokens",
                                   "Tokens committed by those speculative steps.", registry=r)
        self.spec_acceptance = Gauge(
            "kiln_spec_decode_tokens_per_step",
            "Speculative acceptance: spec_decode_tokens / spec_decode_steps (0 until a "
            "speculative step ran).", registry=r)
        self.startup = Gauge(
            "kiln_startup_seconds",
            "Seconds from the start of engine loading to the server accepting requests "
            "(0 until ready).", registry=r)
        self.startup_phase = Gauge(
            "kiln_startup_phase_seconds",
            "Start-up seconds by phase (load_weights, kv_cache, cuda_graphs, server, ...).",
            ["phase"], registry=r)
        info = Gauge("kiln_model_info", "The served model.", ["model"], registry=r)
        info.labels(model=model_name).set(1)

    def set_startup(self, total_s: float, phases: dict[str, float]) -> None:
        """Record start-up time: ``phases`` maps e.g. ``load_weights_s`` to seconds."""
        self.startup.set(total_s)
        for name, seconds in phases.items():
            self.startup_phase.labels(phase=name.removesuffix("_s")).set(seconds)

    def set_engine_state(self, waiting: int, running: int, kv_used: int, kv_total: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, prompt_tokens: int, output_tokens: int, steps: int,
                         e2e_s: float | None, spec_steps: int = 0, spec_tokens: int = 0) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.request_steps.inc(steps)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if spec_steps:
            self.spec_steps.inc(spec_steps)
            self.spec_tokens.inc(spec_tokens)
            self.spec_acceptance.set(self.spec_tokens._value.get()
                                     / self.spec_steps._value.get())

    def render(self) -> bytes:
        return generate_latest(self.registry)
