"""Prometheus metrics of the server (served on /metrics).

Four sources:
  * engine state (running / waiting requests, KV usage, prefix-cache hits, preemptions) is
    read from the engine's latest `EngineStats` snapshot when Prometheus scrapes, by a
    custom collector: nothing has to keep gauges up to date, and a scrape never touches the
    engine thread;
  * per-request numbers (token counts, time to first token, time per output token, the gaps
    between a request's outputs, latency) are observed by the HTTP handlers, with the server's
    clock: TTFT is what the client waits, queueing included;
  * the interval between engine steps' outputs reaching this process (AsyncLLM's
    `on_step_interval`): set beside the inter-token gaps, it says whether a long gap was a
    long step or time spent after the step, in this process or on the way to the client;
  * the host time the engine took to hand each step to its runner (AsyncLLM's `on_step_dispatch`):
    an interval that ends with one step's outputs also holds the hand-over of the next step; and of
    that time, how long the engine's thread was off the CPU (a late hand-over that waited, not worked)
    and how long it was inside the compiled calls (XLA's side, against the runner's Python).

Each app has its own registry, so several servers in one process (tests) do not collide. With
several API server processes (`--api-server-count`), the request metrics live in
prometheus-client's multi-process files (PROMETHEUS_MULTIPROC_DIR, set by `serve` before any
process imports prometheus_client), and every process's /metrics adds up all of them; the engine's
numbers are the same in every process (each gets the engine's counters).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from mrv2_jax import envs
from mrv2_jax.async_llm import AsyncLLM
from mrv2_jax.engine.hand_over import Dispatch
from mrv2_jax.engine.output import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# A step's hand-over to the runner: fine buckets below a millisecond (a small step's call), coarser above.
_DISPATCH_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0008, 0.001, 0.0012, 0.0015, 0.002, 0.0025,
                     0.003, 0.004, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 1.0)
# A message's delivery from the engine process: as fine below 10 ms, and up to seconds for a reader far behind.
_DELIVERY_BUCKETS = _DISPATCH_BUCKETS[:-1] + (0.2, 0.5, 1.0, 2.0, 5.0, 30.0)
# Fine in 1-20 ms, where decode steps and their tails lie, so that a P99 can be read from them.
_GAP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009,
                0.01, 0.012, 0.014, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 5.0)


class _EngineCollector:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s, label = self.engine.stats, [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("mrv2_num_requests_running", "Requests being scheduled (prefill or decode).", s.num_running_reqs)
        yield gauge("mrv2_num_requests_waiting", "Requests queued for admission.", s.num_waiting_reqs)
        yield gauge("mrv2_kv_cache_usage_ratio", "Fraction of KV blocks held by requests (0..1).",
                    s.kv_cache_usage)
        yield gauge("mrv2_kv_cache_free_blocks", "KV blocks not held by any request.", s.num_free_blocks)
        yield gauge("mrv2_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                    "prompt tokens admitted, since start.", s.prefix_cache_hit_rate)
        yield counter("mrv2_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("mrv2_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("mrv2_num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions)
        yield counter("mrv2_requests_aborted", "Requests aborted (client gone).", s.num_aborted_reqs)
        yield counter("mrv2_fused_decode_calls", "Runner calls that ran several decode steps.", s.num_fused_calls)
        yield gauge("mrv2_step_programs_pending", "Step programs not compiled yet (compile mode background: "
                    "compiling beside the engine; lazy: at first use); a step that needs one waits for it.",
                    s.num_programs_pending)
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s.spec_decode, label, counter)
        yield gauge("mrv2_engine_healthy", "1 while the engine thread runs, 0 once it stopped.",
                    1.0 if self.engine.is_healthy else 0.0)


def _spec_decode_metrics(spec, label, counter):
    """vLLM's spec-decode counters; rates follow from them (accepted / draft tokens)."""
    yield counter("mrv2_spec_decode_num_drafts", "Rows verified with drafts.", spec.num_drafts)
    yield counter("mrv2_spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
    yield counter("mrv2_spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)
    per_position = CounterMetricFamily("mrv2_spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by position in the draft.",
                                       labels=["model_name", "position"])
    for position, n in enumerate(spec.accepted_per_position):
        per_position.add_metric([*label, str(position)], n)
    yield per_position


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter("mrv2_prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("mrv2_generation_tokens", "Generated tokens sent to clients.",
                                         labels, registry=reg).labels(model_name)
        self.requests = Counter("mrv2_requests", "Requests that ended, by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("mrv2_time_to_first_token_seconds", "Request received -> first token out.",
                              labels, buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram("mrv2_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a request.", labels, buckets=_TPOT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("mrv2_inter_token_latency_seconds", "Time between two outputs of a request that "
                             "bring tokens (for a streamed request: between its chunks).", labels,
                             buckets=_GAP_BUCKETS, registry=reg).labels(model_name)
        step_interval = Histogram("mrv2_step_output_interval_seconds", "Time between two engine steps' outputs "
                                  "reaching this API process, while requests ran (with several engine replicas: any "
                                  "replica's), by whether the later step computed prompt tokens (step=prefill) or "
                                  "only decode rows (step=decode).", labels + ["step"],
                                  buckets=_GAP_BUCKETS, registry=reg)
        self.step_interval = {kind: step_interval.labels(model_name, kind) for kind in ("decode", "prefill")}
        engine.on_step_interval = self._observe_step_interval
        dispatch = Histogram("mrv2_step_dispatch_seconds", "Host time the engine took to hand one step to its "
                             "runner (input preparation and the compiled program's call, which returns before the "
                             "device has run it), by whether that step computes prompt tokens (step=prefill) or only "
                             "decode rows (step=decode).", labels + ["step"], buckets=_DISPATCH_BUCKETS, registry=reg)
        self.step_dispatch = {kind: dispatch.labels(model_name, kind) for kind in ("decode", "prefill")}
        off_cpu = Histogram("mrv2_step_dispatch_off_cpu_seconds", "Of mrv2_step_dispatch_seconds, the time the "
                            "engine's thread was not on a CPU (waiting for one, for a page, for a lock), by the "
                            "step's kind.", labels + ["step"], buckets=_DISPATCH_BUCKETS, registry=reg)
        self.step_dispatch_off_cpu = {kind: off_cpu.labels(model_name, kind) for kind in ("decode", "prefill")}
        in_calls = Histogram("mrv2_step_dispatch_call_seconds", "Of mrv2_step_dispatch_seconds, the time inside the "
                             "runner's compiled step calls (XLA's side of a call: arguments, the input's copy, the "
                             "launch; the rest is the runner's Python), by the step's kind.", labels + ["step"],
                             buckets=_DISPATCH_BUCKETS, registry=reg)
        self.step_dispatch_call = {kind: in_calls.labels(model_name, kind) for kind in ("decode", "prefill")}
        engine.on_step_dispatch = self._observe_step_dispatch
        engine_interval = Histogram("mrv2_engine_step_interval_seconds", "Time between two engine steps' outputs "
                                    "leaving the engine process, while requests ran, for the steps with outputs of "
                                    "this API process's requests, by the later step's kind (engine in its own "
                                    "process only).", labels + ["step"], buckets=_GAP_BUCKETS,
                                    registry=reg)
        self.engine_step_interval = {kind: engine_interval.labels(model_name, kind) for kind in ("decode", "prefill")}
        delivery = Histogram("mrv2_step_output_delivery_seconds", "Time from a step's outputs leaving the engine "
                             "process to their reaching their streams in this API process (transport, "
                             "detokenization), for the steps with outputs of its requests, by the step's kind "
                             "(engine in its own process only).",
                             labels + ["step"], buckets=_DELIVERY_BUCKETS, registry=reg)
        self.step_delivery = {kind: delivery.labels(model_name, kind) for kind in ("decode", "prefill")}
        engine.on_engine_step = self._observe_engine_step
        self.e2e = Histogram("mrv2_e2e_request_latency_seconds", "Request received -> last token out.",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self._engine_collector = _EngineCollector(engine, model_name)
        self.registry.register(self._engine_collector)
        self._shared_dir = envs.prometheus_multiproc_dir()

    def _observe_step_interval(self, seconds: float, prefilled: bool) -> None:
        self.step_interval["prefill" if prefilled else "decode"].observe(seconds)

    def _observe_step_dispatch(self, dispatch: Dispatch) -> None:
        kind = "prefill" if dispatch.prefill_tokens else "decode"
        self.step_dispatch[kind].observe(dispatch.seconds)
        self.step_dispatch_off_cpu[kind].observe(max(0.0, dispatch.seconds - max(dispatch.cpu_s, 0.0)))
        self.step_dispatch_call[kind].observe(max(0.0, dispatch.call_s))

    def _observe_engine_step(self, since_s: float | None, delivery_s: float, prefilled: bool) -> None:
        kind = "prefill" if prefilled else "decode"
        if since_s is not None:
            self.engine_step_interval[kind].observe(since_s)
        self.step_delivery[kind].observe(delivery_s)

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> tuple[bytes, str]:
        if not self._shared_dir:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        # Every API process's request metrics, read from the shared files, and this engine's numbers.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._shared_dir)
        registry.register(self._engine_collector)
        return generate_latest(registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """One request's timings; `observe` each output, then `finish` once (idempotent)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.last: RequestOutput | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        num_tokens = len(out.outputs[0].token_ids)
        if num_tokens > self.num_tokens:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last_token)
            self.last_token, self.num_tokens = now, num_tokens
        self.last = out

    def finish(self, reason: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        m, end = self.metrics, time.monotonic()
        if self.last is not None:
            num_out = len(self.last.outputs[0].token_ids)
            m.prompt_tokens.inc(len(self.last.prompt_token_ids))
            m.generation_tokens.inc(num_out)
            reason = reason or self.last.outputs[0].finish_reason
            if self.first_token is not None and num_out > 1:
                m.tpot.observe((end - self.first_token) / (num_out - 1))
        m.e2e.observe(end - self.start)
        m.requests.labels(m.model_name, reason or "abort").inc()
