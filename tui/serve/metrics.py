"""`/metrics`: the engine's figures in Prometheus format under vLLM V1's metric names, buckets and
labels (`model_name`, `engine`), so a Grafana dashboard made for vLLM works unchanged.

Exposition is prometheus-client's. Gauges and counters are read from the engine when scraped (a
custom collector); histograms are accumulated as the server learns each request's token times,
with NumPy (a step of 500 decodes is one `observe` of 500 values, not 500 calls).
"""

from __future__ import annotations

import bisect

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Bucket counts and a sum, filled in bulk."""

    def __init__(self, name: str, doc: str, buckets) -> None:
        self.name, self.doc = name, doc
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self._bounds = tuple(self.bounds.tolist())
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)  # the last is +Inf
        self.sum = 0.0

    def observe(self, values) -> None:
        """Add one value or an array of them."""
        if isinstance(values, (int, float)):  # (a request's figures: ~20x cheaper than NumPy's)
            self.counts[bisect.bisect_left(self._bounds, values)] += 1
            self.sum += values
            return
        v = np.atleast_1d(np.asarray(values, dtype=np.float64))
        if not len(v):
            return
        # A value equal to a bound falls in that bound's bucket (le: less than or equal).
        self.counts += np.bincount(np.searchsorted(self.bounds, v, side="left"),
                                   minlength=len(self.counts))
        self.sum += float(v.sum())

    def family(self, labels: list[str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=["model_name", "engine"])
        cum = np.cumsum(self.counts).tolist()
        buckets = [(repr(float(b)), c) for b, c in zip(self.bounds.tolist(), cum)]
        buckets.append(("+Inf", cum[-1]))
        fam.add_metric(labels, buckets, sum_value=self.sum)
        return fam


class ServeMetrics:
    """The registry `/metrics` renders. `read()` is called at scrape time under the engine lock
    and returns the engine's current gauges and counters."""

    def __init__(self, model_name: str, max_model_len: int, read) -> None:
        self.labels = [model_name, "0"]
        self.read = read
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        tokens = buckets_1_2_5(max_model_len or 1 << 20)
        h = Histogram
        self.ttft = h("vllm:time_to_first_token_seconds",
                      "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds",
                     "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        # The name vLLM used for the same figure before ITL; older dashboards read it.
        self.tpot = h("vllm:time_per_output_token_seconds",
                      "Histogram of time per output token in seconds.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds",
                     "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds",
                       "Histogram of time spent in WAITING phase for request.",
                       REQUEST_LATENCY_BUCKETS)
        self.inference = h("vllm:request_inference_time_seconds",
                           "Histogram of time spent in RUNNING phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds",
                         "Histogram of time spent in PREFILL phase for request.",
                         REQUEST_LATENCY_BUCKETS)
        self.decode = h("vllm:request_decode_time_seconds",
                        "Histogram of time spent in DECODE phase for request.",
                        REQUEST_LATENCY_BUCKETS)
        self.prompt_len = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                            tokens)
        self.output_len = h("vllm:request_generation_tokens",
                            "Number of generation tokens processed.", tokens)
        self.histograms = [self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.inference,
                           self.prefill, self.decode, self.prompt_len, self.output_len]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe_itl(self, gaps) -> None:
        self.itl.observe(gaps)
        self.tpot.observe(gaps)

    def observe_finished(self, reason: str, arrival: float, admitted: float | None,
                         first: float | None, end: float, prompt_len: int, n_out: int) -> None:
        """A request that ended (finished, or cancelled: `reason` "abort")."""
        self.finished[reason] += 1
        if reason == "abort":
            return  # vLLM times only the requests that completed
        self.e2e.observe(end - arrival)
        if admitted is not None:
            self.queue.observe(admitted - arrival)
            self.inference.observe(end - admitted)
            if first is not None:
                self.prefill.observe(first - admitted)
        if first is not None:
            self.decode.observe(end - first)
        self.prompt_len.observe(prompt_len)
        self.output_len.observe(n_out)

    # --- prometheus-client collector -----------------------------------------------------------
    def collect(self):
        labels = ["model_name", "engine"]
        v = self.read()
        gauges = (("vllm:num_requests_running", "Number of requests in model execution batches.",
                   v["running"]),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   v["waiting"]),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   v["kv_usage"]))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(self.labels, value)
            yield g
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", v["prefix_queries"]),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             v["prefix_hits"]),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             v["preemptions"]),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", v["prompt_tokens"]),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             v["generation_tokens"]),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(self.labels, value)
            yield c
        c = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                "requests.", labels=[*labels, "finished_reason"])
        for reason, n in self.finished.items():
            c.add_metric([*self.labels, reason], n)
        yield c
        for h in self.histograms:
            yield h.family(self.labels)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
