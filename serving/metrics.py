"""Prometheus metrics of one HTTP server, in its own CollectorRegistry (two apps in one process do not clash).

Latencies are observed by the engine thread as tokens come out; engine state (queues, blocks, token counts) is
read at scrape time from the snapshot that thread leaves after each step, never from the engine itself, which
only its own thread may touch.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: a compiled decode step of a tiny model on a CPU takes ~1 ms, a first token behind a compile many seconds
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        kw = {"registry": self.registry, "buckets": BUCKETS}
        self.ttft = Histogram("jaxmodels_time_to_first_token_seconds", "Arrival to first generated token.", **kw)
        self.itl = Histogram("jaxmodels_inter_token_latency_seconds", "Between two outputs of one request.", **kw)
        self.e2e = Histogram("jaxmodels_e2e_request_latency_seconds", "Arrival to the last output.", **kw)
        self.finished = Counter("jaxmodels_requests_finished", "Engine requests finished, by finish_reason "
                                "(stop, length, abort: the client left, error: the engine failed).",
                                ["finish_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("jaxmodels_num_requests_running", "Requests holding a batch row.", s["running"])
        yield GaugeMetricFamily("jaxmodels_num_requests_waiting", "Requests queued for a row.", s["waiting"])
        yield GaugeMetricFamily("jaxmodels_kv_blocks_total", "KV-cache blocks per pool.", s["blocks"])
        used = GaugeMetricFamily("jaxmodels_kv_blocks_used", "KV-cache blocks held by sequences, per cache group.",
                                 labels=["group"])
        hits = GaugeMetricFamily("jaxmodels_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache, "
                                 "per cache group.", labels=["group"])
        for group, n in s["blocks_used"].items():
            used.add_metric([group], n)
        for group, rate in s["prefix_hit_rate"].items():
            hits.add_metric([group], rate)
        yield used
        yield hits
        for name, doc in (("prompt_tokens", "Prompt tokens prefilled or served from the prefix cache."),
                          ("generation_tokens", "Tokens generated."),
                          ("cached_prompt_tokens", "Prompt tokens served by the prefix cache."),
                          ("preemptions", "Requests preempted for lack of KV blocks.")):
            yield CounterMetricFamily(f"jaxmodels_{name}", doc, s[name])
        # speculative decoding (zero without it), as vLLM's spec_decode counters
        for name, doc in (("steps", "Speculative decode steps, counted per request."),
                          ("draft_tokens", "Draft tokens proposed."),
                          ("accepted_tokens", "Draft tokens the acceptance rule kept."),
                          ("emitted_tokens", "Tokens speculative steps gave their requests.")):
            yield CounterMetricFamily(f"jaxmodels_spec_decode_{name}", doc, s[f"spec_{name}"])
        proposed, steps = s["spec_draft_tokens"], s["spec_steps"]
        yield GaugeMetricFamily("jaxmodels_spec_decode_acceptance_rate", "Draft tokens accepted / proposed, since "
                                "the start.", s["spec_accepted_tokens"] / proposed if proposed else 0.0)
        yield GaugeMetricFamily("jaxmodels_spec_decode_tokens_per_step", "Tokens a request took per speculative "
                                "step, since the start.", s["spec_emitted_tokens"] / steps if steps else 0.0)
