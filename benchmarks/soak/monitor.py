"""What the soak watches while it runs: the daemon's memory and CPU (psutil), its
/metrics, Redis (INFO: memory, commands, keys; its process), and the machine's load.
One sample every few seconds, kept whole; the report derives everything from them."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from typing import Any

import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families

# The daemon's own series the soak reads from /metrics.
DECISION_LATENCY = "kvtether_decision_latency_seconds"
COUNTERS = {
    "kvtether_step_reports": "step_reports",
    "kvtether_store_errors": "store_errors",
    "kvtether_store_writes_dropped": "store_writes_dropped",
    "kvtether_resyncs_requested": "resyncs_requested",
    "kvtether_invalid_reports": "invalid_reports",
}


def scrape_metrics(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    found: dict[str, Any] = {"decision_latency_buckets": {}}
    for family in text_string_to_metric_families(text):
        if family.name in COUNTERS:
            found[COUNTERS[family.name]] = sum(
                s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == DECISION_LATENCY:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    found["decision_latency_buckets"][sample.labels["le"]] = sample.value
                elif sample.name.endswith("_count"):
                    found["decision_latency_count"] = sample.value
                elif sample.name.endswith("_sum"):
                    found["decision_latency_sum_s"] = sample.value
        elif family.name == "kvtether_store_write_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    found["store_writes"] = sample.value
                elif sample.name.endswith("_sum"):
                    found["store_write_s"] = sample.value
    return found


def redis_stats(client: redis.Redis) -> dict[str, Any]:
    info = client.info("all")
    commands = {name.removeprefix("cmdstat_"): int(value["calls"])
                for name, value in info.items() if name.startswith("cmdstat_")}
    keys = sum(int(db["keys"]) for name, db in info.items()
               if name.startswith("db") and isinstance(db, dict))
    return {"used_memory": int(info["used_memory"]),
            "used_memory_rss": int(info["used_memory_rss"]),
            "total_commands_processed": int(info["total_commands_processed"]),
            "instantaneous_ops_per_sec": int(info["instantaneous_ops_per_sec"]),
            "keys": keys, "commandstats": commands}


class Monitor(threading.Thread):
    def __init__(self, daemon_pid: int, metrics_url: str, redis_url: str,
                 redis_pid: int | None, sample_s: float) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.daemon_process = psutil.Process(daemon_pid)
        self.redis_process = psutil.Process(redis_pid) if redis_pid else None
        self.metrics_url = metrics_url
        self.redis = redis.Redis.from_url(redis_url)
        self.sample_s = sample_s
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.origin = time.monotonic()
        self._stop_event = threading.Event()

    def sample(self) -> dict[str, Any]:
        try:
            return self._sample()
        except psutil.Error as error:  # the daemon or Redis died: the soak reports it
            self.errors.append(f"{time.monotonic() - self.origin:.0f}s process: {error}")
            return {}

    def _sample(self) -> dict[str, Any]:
        cpu = self.daemon_process.cpu_times()
        entry: dict[str, Any] = {
            "t_s": time.monotonic() - self.origin,
            "daemon_rss_bytes": self.daemon_process.memory_info().rss,
            "daemon_cpu_s": cpu.user + cpu.system,
            "loadavg": list(os.getloadavg()),
        }
        if self.redis_process is not None:
            redis_cpu = self.redis_process.cpu_times()
            entry["redis_rss_bytes"] = self.redis_process.memory_info().rss
            entry["redis_cpu_s"] = redis_cpu.user + redis_cpu.system
        try:
            entry["redis"] = redis_stats(self.redis)
        except redis.RedisError as error:
            self.errors.append(f"{entry['t_s']:.0f}s redis INFO: {error}")
        try:
            entry["metrics"] = scrape_metrics(self.metrics_url)
        except OSError as error:
            self.errors.append(f"{entry['t_s']:.0f}s /metrics: {error}")
        self.samples.append(entry)
        return entry

    def run(self) -> None:
        next_at = time.monotonic()
        while not self._stop_event.is_set():
            self.sample()
            next_at += self.sample_s
            self._stop_event.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)
        self.sample()  # the final state
