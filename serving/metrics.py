"""The gateway's Prometheus metrics, and the per-arm latency quantiles /metrics shows.

Under `tabrl serve --workers N` every process writes its counters and histograms to files in one directory
(prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`, set by `serving.gateway.serve` before the
workers start), and /metrics sums them over the processes, whichever process answers the scrape. The two gauges
computed per process at scrape time cannot be summed, so a multi-process gateway leaves them out; the counters and
the histogram give the same numbers in PromQL:
- the online accept rate of an arm: `tabrl_feedback_total{accepted="true"}` / (`tabrl_completions_total{shown="true"}`
  - `tabrl_not_shown_total`);
- its latency quantiles: `histogram_quantile(0.95, rate(tabrl_completion_latency_seconds_bucket[5m]))`.

Every per-arm series carries the arm's `team` too (`org`: the organisation's arms; tasks/core/teams.py): each team
has its own champion and challenger.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from serving.log import Recorded
from tasks.core.store import Arm

LATENCY_QUANTILES = (0.5, 0.95)  # the per-arm latency quantiles /metrics shows (tabrl_arm_latency_ms)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when it is imported: set before the workers


def multiprocess_dir(state_dir: Path) -> Path:
    """The directory the gateway processes of one `tabrl serve` share their metrics in (PROMETHEUS_MULTIPROC_DIR
    when set, else state_dir/prometheus), emptied of an earlier run's files, which would count again."""
    path = Path(os.environ.get(MULTIPROC_ENV) or Path(state_dir) / "prometheus")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return path


class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process), or of one of the
    processes of a multi-process gateway (PROMETHEUS_MULTIPROC_DIR set: the module's docstring).

    Latency per arm twice: the histogram `tabrl_completion_latency_seconds` (buckets, since start, for
    PromQL's histogram_quantile across replicas) and the gauge `tabrl_arm_latency_ms{arm, quantile}`: p50
    and p95 of the arm's last `latency_window` completions in this process, read directly. The gauge is
    computed when /metrics is read (`render`), so serving a request only appends to a bounded deque. The gauge
    and `tabrl_online_accept_rate` exist in a one-process gateway only."""

    def __init__(self, latency_window: int) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        self.requests = Counter(
            "tabrl_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"], registry=self.registry
        )
        self.completions = Counter(
            "tabrl_completions",
            "Completions served by arm (shown or abstained).",
            ["arm", "team", "shown"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tabrl_completion_latency_seconds",
            "Completion latency in the gateway by arm.",
            ["arm", "team"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.feedback = Counter(
            "tabrl_feedback",
            "Outcomes recorded by arm ('' when unmatched) and answer.",
            ["arm", "team", "accepted"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            "tabrl_cancelled",
            "Completions whose client hung up before the answer was sent, by arm: never shown, in no rate.",
            ["arm", "team"],
            registry=self.registry,
        )
        self.not_shown = Counter(
            "tabrl_not_shown",
            "Outcomes by which a client said it never displayed the suggestion, by arm: in no rate.",
            ["arm", "team"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "tabrl_fallbacks",
            "Requests a failing arm handed to the champion.",
            ["arm", "team"],
            registry=self.registry,
        )
        self.explored = Counter(
            "tabrl_explored",
            "Requests cut at serving.explore_min_logprob, by arm.",
            ["arm", "team"],
            registry=self.registry,
        )
        self.unlogged = Counter("tabrl_unlogged", "Requests served but not logged (opted out).", registry=self.registry)
        self._shown: dict[tuple[str, str], int] = {}  # (arm, team) -> shown suggestions
        self._accepted: dict[tuple[str, str], int] = {}
        self._latency_window = latency_window
        self._recent_ms: dict[tuple[str, str], deque[float]] = {}  # (arm, team) -> its last latencies (ms)
        self._gauges(latency_window)

    def _gauges(self, latency_window: int) -> None:
        """The two gauges computed per process when /metrics is read: registered in a one-process gateway only."""
        per_process = None if self.multiprocess_dir else self.registry
        self.latency_quantiles = Gauge(
            "tabrl_arm_latency_ms",
            f"Completion latency in the gateway by arm, quantile of its last {latency_window} completions "
            "in this process (serving.latency_window), in milliseconds.",
            ["arm", "team", "quantile"],
            registry=per_process,
        )
        self.accept_rate = Gauge(
            "tabrl_online_accept_rate",
            "Accepted / shown suggestions per arm since start.",
            ["arm", "team"],
            registry=per_process,
        )

    def served(self, arm: Arm, shown: bool, seconds: float) -> None:
        key = (arm.name, arm.team)
        self.completions.labels(*key, str(shown).lower()).inc()
        self.latency.labels(*key).observe(seconds)
        recent = self._recent_ms.get(key)
        if recent is None:
            recent = self._recent_ms[key] = deque(maxlen=self._latency_window)
        recent.append(seconds * 1000.0)
        if shown:
            self._shown[key] = self._shown.get(key, 0) + 1

    def recorded(self, rec: Recorded) -> None:
        if rec.status != "recorded":
            return
        key = (rec.arm or "", rec.arm_team or "")  # ('', ''): an outcome for a completion that is not ours
        if rec.shown is False:
            self.not_shown.labels(*key).inc()
            if key in self._shown:  # it was counted as shown when it was served
                self._shown[key] -= 1
            return
        self.feedback.labels(*key, str(rec.accepted).lower()).inc()
        if rec.accepted and rec.arm:
            self._accepted[key] = self._accepted.get(key, 0) + 1

    def render(self) -> bytes:
        if self.multiprocess_dir:  # every process's counters and histograms, summed
            summed = CollectorRegistry()
            MultiProcessCollector(summed, path=self.multiprocess_dir)
            return generate_latest(summed)
        for key, shown in self._shown.items():
            self.accept_rate.labels(*key).set(self._accepted.get(key, 0) / shown if shown else 0.0)
        for key, recent in self._recent_ms.items():
            for q, value in zip(LATENCY_QUANTILES, latency_quantiles(recent, LATENCY_QUANTILES), strict=True):
                self.latency_quantiles.labels(*key, f"{q:g}").set(value)
        return generate_latest(self.registry)


def latency_quantiles(latencies_ms: Iterable[float], quantiles: Sequence[float]) -> list[float]:
    """Quantiles of the latencies, linearly interpolated between the closest ranks (numpy's default, PostgreSQL's
    percentile_cont; `tabrl ab-status` computes the same from the log store). Needs at least one latency."""
    return [float(v) for v in np.quantile(np.fromiter(latencies_ms, dtype=float), quantiles)]
