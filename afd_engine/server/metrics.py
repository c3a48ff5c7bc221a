"""Prometheus metrics of the API server, in a registry of its own (no process-global state)."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from afd_engine.control.messages import EngineStats
from afd_engine.eplb.placement import imbalance

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "afd_requests", "HTTP generation requests by endpoint and outcome", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("afd_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("afd_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "afd_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "afd_time_per_output_token_seconds",
            "time between output tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("afd_num_requests_running", "requests in the engine's running batch", registry=r)
        self.waiting = Gauge("afd_num_requests_waiting", "requests waiting for admission", registry=r)
        self.kv_used = Gauge("afd_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_total = Gauge("afd_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.cache_pages = Gauge("afd_prefix_cache_pages", "KV cache pages held by the prefix cache", registry=r)
        self.expert_rank_load = Gauge(
            "afd_expert_rank_load",
            "tokens routed to each expert rank over the load window (all attention ranks)",
            ["rank"],
            registry=r,
        )
        self.expert_imbalance = Gauge(
            "afd_expert_rank_imbalance", "max over mean of the expert ranks' load over the window", registry=r
        )
        self.kv_reserved = Gauge(
            "afd_kv_pages_reserved", "decode instance: KV pages held for requests whose KV is on its way", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "afd_kv_transfer_seconds",
            "decode instance: time the prefill instance spent sending one request's KV pages",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ffn_alive = Gauge(
            "afd_ffn_ranks_alive", "AFD: FFN ranks serving (fewer after a recovery from a lost one)", registry=r
        )
        self.attention_alive = Gauge(
            "afd_attention_ranks_alive",
            "attention ranks serving (fewer once one is lost, with --enable-fault-tolerance)",
            registry=r,
        )
        self.draining = Gauge(
            "afd_draining",
            "1 while the server drains after SIGTERM or SIGINT (new generation requests get 503)",
            registry=r,
        )
        self.engine_counters = _EngineCounters()
        r.register(self.engine_counters)

    def render(self, stats: EngineStats, attention_alive: int, resumed: int) -> bytes:
        """The page, from the deployment's counters, its live attention ranks and the requests it
        resumed on another attention rank (fault tolerance)."""
        self.engine_counters.stats, self.engine_counters.resumed = stats, resumed
        self.attention_alive.set(attention_alive)
        self.cache_pages.set(stats.cache_pages)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(stats.kv_pages_used)
        self.kv_total.set(stats.kv_pages_total)
        self.kv_reserved.set(stats.kv_pages_reserved)
        self.ffn_alive.set(stats.ffn_ranks_alive)
        for rank, load in enumerate(stats.expert_rank_load):
            self.expert_rank_load.labels(rank=str(rank)).set(load)
        if stats.expert_rank_load:
            self.expert_imbalance.set(imbalance(torch.tensor(stats.expert_rank_load)))
        return generate_latest(self.registry)


class _EngineCounters(Collector):
    """Counters the engine keeps since its start (summed over attention ranks), exposed as they are."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.resumed = 0

    def collect(self):
        s = self.stats
        for name, doc, value in (
            (
                "afd_requests_resumed",
                "fault tolerance: requests of a lost attention rank resumed on another from the tokens streamed",
                self.resumed,
            ),
            ("afd_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", self.stats.cache_hit_tokens),
            ("afd_prefix_cache_queried_tokens", "prompt tokens of admitted requests", self.stats.prompt_tokens),
            ("afd_prefix_cache_evicted_pages", "pages evicted from the prefix cache", self.stats.cache_evicted_pages),
            (
                "afd_kv_transfer_bytes",
                "prefill-decode disaggregation: KV bytes sent (prefill) or received (decode)",
                self.stats.kv_transfer_bytes,
            ),
            (
                "afd_ffn_recoveries",
                "AFD with --enable-ffn-fault-tolerance: recoveries from lost FFN ranks",
                self.stats.ffn_recoveries,
            ),
            (
                "afd_ffn_recovery_experts_read",
                "AFD fault tolerance: experts that recoveries read from the checkpoint (none where copies took over)",
                self.stats.ffn_experts_read,
            ),
            (
                "afd_static_decode_batches",
                "decode batches (micro-batches on attention ranks) run on CUDA graph buffers: replays, or "
                "the same static path without capture (--static-decode)",
                self.stats.static_decode_batches,
            ),
            ("afd_spec_verify_steps", "speculative decoding: verifications of drafting requests", s.spec_verifies),
            ("afd_spec_draft_tokens", "speculative decoding: draft tokens proposed", s.spec_drafts),
            ("afd_spec_accepted_tokens", "speculative decoding: draft tokens accepted", s.spec_accepted),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        loaded = CounterMetricFamily(
            "afd_experts_loaded",
            "experts (per MoE layer) that expert ranks loaded for recoveries from lost FFN ranks, admissions of "
            "their replacements and EPLB rebalances, by source: copied from a live peer, or read from the checkpoint",
            labels=["source"],
        )
        loaded.add_metric(["peer"], s.experts_loaded_peer)
        loaded.add_metric(["checkpoint"], s.experts_loaded_checkpoint)
        yield loaded
        mean = 1.0 + s.spec_accepted / s.spec_verifies if s.spec_verifies else 0.0
        yield GaugeMetricFamily(
            "afd_spec_mean_accepted_length",
            "speculative decoding: tokens per verification since start (accepted drafts + the target's own)",
            value=mean,
        )
        cumulative, total = [], 0
        for accepted, count in enumerate(s.spec_accepted_histogram):
            total += count
            cumulative.append((str(float(accepted)), total))
        yield HistogramMetricFamily(
            "afd_spec_accepted_drafts",
            "speculative decoding: draft tokens accepted per verification",
            buckets=cumulative + [("+Inf", total)],
            sum_value=s.spec_accepted,
        )
