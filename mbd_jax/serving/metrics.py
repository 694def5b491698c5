"""Prometheus metrics of the service (names prefixed mbd_), on their own registry."""

from __future__ import annotations

import os

import jax
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from mbd_jax import compile_stats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


class _ReadCounters(Collector):
    """Counters whose values are read when scraped from counts kept elsewhere (the prefix store,
    the offloader, the compile log): they only grow, so they are counters, not gauges."""

    def __init__(self) -> None:
        self.counters: list[tuple[str, str, object]] = []

    def add(self, name: str, doc: str, read) -> None:
        self.counters.append((name, doc, read))

    def collect(self):
        for name, doc, read in self.counters:
            yield CounterMetricFamily(name, doc, value=read())


def _memory_stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without the call, or one that fails it
        return None


class Metrics:
    def __init__(self, engine=None) -> None:
        prometheus_client.disable_created_metrics()  # no *_created series
        r = self.registry = CollectorRegistry()
        self._read = _ReadCounters()
        r.register(self._read)
        self.requests = Counter("mbd_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.queue_wait = Histogram("mbd_queue_wait_seconds", "Time from arrival to a free row, "
                                    "per queue (normal, thinking)", ["queue"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.first_block = Histogram("mbd_first_block_seconds", "Time from arrival to the first "
                                     "committed block", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("mbd_request_seconds", "Time from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.inter_block = Histogram("mbd_inter_block_seconds", "Time between a request's "
                                     "successive committed blocks", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.generated_tokens = Counter("mbd_generated_tokens", "Tokens returned", registry=r)
        self.prompt_tokens = Counter("mbd_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.finished = Counter("mbd_finished_requests", "Finished requests by finish reason "
                                "(stop, length, max_nfe)", ["finish_reason"], registry=r)
        self.nfe = Counter("mbd_decode_forwards", "Decode forwards spent on requests", registry=r)
        self.tpf = Histogram("mbd_tokens_per_forward", "Tokens per forward of finished requests",
                             buckets=(0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.queue_length = Gauge("mbd_queue_length", "Requests waiting for a row", registry=r)
        self.busy_rows = Gauge("mbd_busy_rows", "Rows decoding a request", registry=r)
        self.kv_usage = Gauge("mbd_kv_buffer_usage_ratio", "Share of the KV pool's pages held "
                              "by requests (each holds pages for every position it can write)", registry=r)
        self.empty = Counter("mbd_empty_responses", "Requests that returned no token", registry=r)
        self.rate_limited = Counter("mbd_rate_limited", "Requests refused by the rate limit",
                                    registry=r)
        self.rejected = Counter("mbd_requests_rejected", "Requests refused or ended before "
                                "running, by reason (queue_full, queue_timeout, draining, loading, "
                                "engine_down, rate_limit, token_budget, auth, auth_failures, "
                                "scope, drain_timeout)",
                                ["reason"], registry=r)
        self.engine_failures = Counter("mbd_engine_failures", "Engine steps that raised (their "
                                       "requests got 500; the engine recovered)", registry=r)
        self.connections_refused = Counter("mbd_connections_refused", "Connections closed at "
                                           "once: max_connections reached", registry=r)
        self.connections_timed_out = Counter("mbd_connections_timed_out", "Connections closed "
                                             "for sending no request headers in header_timeout_s",
                                             registry=r)
        self._read.add("mbd_compilations", "XLA compilations in this process",
                       compile_stats.compiles)
        # Startup and step costs, and what the alert rules (deploy/prometheus) compare against.
        self.model_load = Gauge("mbd_model_load_seconds", "Seconds to load the model and build "
                                "the engine at startup", registry=r)
        self.warmup = Gauge("mbd_warmup_seconds", "Seconds to compile (or read back) every "
                            "program before the service turned ready", registry=r)
        self.decode_step = Histogram("mbd_decode_step_seconds", "Denoising step time: each "
                                     "decode call's seconds per forward", buckets=STEP_BUCKETS,
                                     registry=r)
        self.model_info = Gauge("mbd_model_info", "1 for the model being served: its name, "
                                "directory (or preset file) and version (the v<N> directory, "
                                "'' for none), and the code serving it (package version, "
                                "+g<commit> from a checkout)",
                                ["name", "path", "version", "code_version"], registry=r)
        self.queue_limit = Gauge("mbd_queue_limit", "Waiting requests the queue holds before "
                                 "429 (server.queue_size)", registry=r)
        self._process_and_devices()
        if engine is not None:
            self._engine(engine)
        if engine is not None and engine.prefix_cache:
            self._prefix_cache(engine.stats)

    def _process_and_devices(self) -> None:
        """The process's CPU, memory and file descriptors, its cores, each device's memory, and
        the Kubernetes pod it runs as (POD_NAME / POD_NAMESPACE from the downward API)."""
        r = self.registry
        pod = Gauge("mbd_pod_info", "1 for the pod this process runs as (for joins on instance: "
                    "deploy/prometheus/adapter.yaml)", ["namespace", "pod"], registry=r)
        if os.environ.get("POD_NAME"):
            pod.labels(os.environ.get("POD_NAMESPACE", ""), os.environ["POD_NAME"]).set(1)
        prometheus_client.ProcessCollector(registry=r)  # process_cpu_seconds_total, memory, fds
        Gauge("mbd_cpu_cores", "CPU cores this process may run on (CPU use = rate of "
              "process_cpu_seconds_total / this)", registry=r).set(len(os.sched_getaffinity(0)))
        memory = Gauge("mbd_device_memory_bytes", "Accelerator memory per local device (where "
                       "the backend reports it: not on CPU)", ["device", "kind"], registry=r)
        for dev in jax.local_devices():
            if _memory_stats(dev) is not None:
                for kind, key in (("in_use", "bytes_in_use"), ("limit", "bytes_limit")):
                    memory.labels(device=str(dev.id), kind=kind).set_function(
                        lambda dev=dev, key=key: (_memory_stats(dev) or {}).get(key, 0))

    def _engine(self, engine) -> None:
        """What is read from the engine when scraped: KV pool use, device busy time, the
        compiled prefill chunk, pool prefix reuse."""
        r = self.registry
        self.kv_usage.set_function(engine.kv_usage)  # as the pool is when scraped
        self._read.add("mbd_device_busy_seconds", "Seconds inside decode calls, which wait "
                       "for the device (the prefill calls dispatched before them included): "
                       "its rate is the share of wall time the device is busy",
                       lambda: engine.stats().decode_seconds)
        Gauge("mbd_prefill_chunk_ready_tokens", "The longest prefill chunk compiled: it grows "
              "to server.prefill_chunk as the background warm-up compiles the larger "
              "buckets after the service turned ready", registry=r).set_function(
            lambda: engine.prefill_ready)
        self._read.add("mbd_kv_pool_prefix_tokens", "Prompt tokens mapped from prefix pages "
                       "another request left in the KV pool (neither prefilled nor loaded)",
                       lambda: engine.stats().pool_hit_tokens)

    def request_done(self, result, seconds: float) -> None:
        """A request's result was sent (`seconds` after it arrived)."""
        self.latency.observe(seconds)
        self.generated_tokens.inc(len(result.token_ids))
        self.prompt_tokens.inc(result.prompt_tokens)
        self.finished.labels(result.finish_reason).inc()
        self.nfe.inc(result.nfe)
        self.tpf.observe(result.tpf)
        if not result.token_ids:
            self.empty.inc()

    def _prefix_cache(self, stats) -> None:
        """Counters and gauges read from the engine's statistics snapshot (`stats()`: the prefix
        store's and the offloader's counters) when scraped."""
        r = self.registry
        hit_ratio = lambda st: st.hits / max(st.hits + st.misses, 1)  # noqa: E731
        metrics = [  # (counter or gauge, name, help, the value from one snapshot)
            ("counter", "mbd_prefix_cache_hit_blocks", "Prompt blocks served from the prefix store "
             "(the blocks past what the KV pool maps)", lambda s: s.store.hits),
            ("counter", "mbd_prefix_cache_miss_blocks", "Prompt blocks looked up and not found",
             lambda s: s.store.misses),
            ("gauge", "mbd_prefix_cache_hit_ratio", "hit / (hit + miss) blocks",
             lambda s: hit_ratio(s.store)),
            ("counter", "mbd_prefix_cache_evictions", "Entries evicted (RAM LRU, disk capacity or "
             "TTL)", lambda s: s.store.evictions),
            ("counter", "mbd_prefix_cache_corrupt_entries", "Disk entries that failed their "
             "checksum", lambda s: s.store.corrupt),
            ("gauge", "mbd_kv_offload_queue_depth", "Staged KV buffers waiting for the host drain",
             lambda s: s.offload.queue_depth),
            ("counter", "mbd_kv_offload_blocking_waits", "Times the engine thread waited on a host "
             "copy", lambda s: s.offload.blocking_waits),
            ("counter", "mbd_kv_offload_deferred_calls", "Decode calls that staged nothing because "
             "both staging buffers were still draining (their blocks wait for a later call)",
             lambda s: s.offload.deferred_calls),
            ("counter", "mbd_kv_offload_settle_waits", "Prefix lookups that waited for a staged KV "
             "buffer holding blocks they asked for (not yet drained to the store)",
             lambda s: s.offload.settle_waits),
            ("counter", "mbd_prefix_cache_disk_dropped", "Blocks not written to disk: the write "
             "queue was full", lambda s: s.store.disk_dropped),
            ("counter", "mbd_prefix_cache_disk_write_errors", "Disk tier writes that failed "
             "(unwritable directory, full disk): those blocks live in RAM only",
             lambda s: s.store.disk_errors),
            ("gauge", "mbd_prefix_cache_disk_entries", "Entries in the disk tier",
             lambda s: s.store.disk_entries),
            ("counter", "mbd_prefix_cache_seconds_saved", "Prefill time saved by hits (hit tokens "
             "x the measured prefill seconds per token)",
             lambda s: s.prefix_hit_tokens * s.prefill_seconds_per_token),
        ]
        for kind, name, doc, value in metrics:
            read = lambda value=value: value(stats())  # noqa: E731
            if kind == "counter":
                self._read.add(name, doc, read)
            else:
                Gauge(name, doc, registry=r).set_function(read)
        tiers = Gauge("mbd_prefix_cache_bytes", "Bytes held per tier", ["tier"], registry=r)
        tiers.labels(tier="ram").set_function(lambda: stats().store.ram_bytes)
        tiers.labels(tier="disk").set_function(lambda: stats().store.disk_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
