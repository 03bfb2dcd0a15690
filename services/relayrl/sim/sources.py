"""Where the simulator's rollout durations come from: the episode model (durations.py), a file
of measured durations, or the gateway's whole-rollout duration histogram in Prometheus.

Every source is addressed like the model: `durations(count, seed)` returns rollouts
0 .. count - 1 of `seed`, and a longer call starts with the same numbers (each block of BLOCK
draws has its own generator), so a simulation that needs more durations can ask again.
A measured set shorter than the simulation is extended by a bootstrap resample of itself.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from relayrl.sim.durations import BLOCK, EpisodeModel
from relayrl.sim.pipeline import DurationsExhausted, PipelineConfig, SimResult, simulate

PROMETHEUS_METRIC = "relayrl_gateway_rollout_duration_seconds"
"""The gateway's histogram of whole-rollout durations (seconds)."""
PROMETHEUS_QUERY = "sum by (le) (increase(" + PROMETHEUS_METRIC + "_bucket[{window}]))"
MAX_DISCARD_FACTOR = 100
"""simulate_source gives up past this many times the durations a run without discards needs."""
_SALT = 0xD0A7  # keeps resampling streams apart from EpisodeModel's default_rng([seed, block])
_WINDOW = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def _blockwise(count: int, seed: int, draw) -> np.ndarray:
    """draw(rng, n) per block of BLOCK, each block from its own generator: prefix-stable."""
    blocks = [
        draw(np.random.default_rng([_SALT, seed, block]), BLOCK)
        for block in range(math.ceil(count / BLOCK))
    ]
    return np.concatenate(blocks)[:count] if blocks else np.zeros(0)


class DurationSource(ABC):
    """Rollout durations in launch order."""

    @abstractmethod
    def durations(self, count: int, seed: int) -> np.ndarray:
        """Durations (seconds) of rollouts 0 .. count - 1 of `seed`."""

    @abstractmethod
    def describe(self) -> str:
        """One line: what the durations are."""

    def notes(self) -> list[str]:
        """What the output should say about how the durations were made."""
        return []


@dataclass(frozen=True)
class ModelSource(DurationSource):
    model: EpisodeModel

    def durations(self, count: int, seed: int) -> np.ndarray:
        return self.model.durations(seed, count)

    def describe(self) -> str:
        default = EpisodeModel()
        changed = [
            f"{f.name}={getattr(self.model, f.name)}"
            for f in fields(EpisodeModel)
            if getattr(self.model, f.name) != getattr(default, f.name)
        ]
        return f"EpisodeModel({', '.join(changed)})"


@dataclass(frozen=True, eq=False)  # arrays: no field-wise ==
class MeasuredSource(DurationSource):
    """Measured durations, replayed in their order; past their end, a bootstrap resample."""

    values: np.ndarray
    origin: str

    def __post_init__(self) -> None:
        if self.values.ndim != 1 or self.values.size == 0:
            raise ValueError(f"{self.origin} holds no durations")

    def durations(self, count: int, seed: int) -> np.ndarray:
        n = self.values.size
        if count <= n:
            return self.values[:count].copy()
        extra = _blockwise(count - n, seed, lambda rng, k: rng.integers(0, n, k))
        return np.concatenate([self.values, self.values[extra]])

    def describe(self) -> str:
        return (
            f"{self.values.size} measured durations from {self.origin} "
            f"(mean {self.values.mean():.1f} s, median {np.median(self.values):.1f} s)"
        )

    def notes(self) -> list[str]:
        return [
            f"a run that needs more than the {self.values.size} measured durations continues "
            "with a bootstrap resample of them (seeded by --seed)"
        ]


@dataclass(frozen=True, eq=False)
class HistogramSource(DurationSource):
    """Durations drawn by inverse-CDF sampling from a cumulative histogram, linear inside
    each bucket (the first bucket starts at 0 s); a draw in the +Inf bucket takes the last
    finite bound."""

    upper_bounds_s: np.ndarray  # finite, increasing
    cumulative: np.ndarray  # counts <= each bound, then the total (+Inf); len(bounds) + 1
    origin: str

    def __post_init__(self) -> None:
        bounds, cumulative = self.upper_bounds_s, self.cumulative
        if bounds.size == 0 or cumulative.size != bounds.size + 1:
            raise ValueError(f"{self.origin}: need finite buckets and a +Inf bucket")
        if np.any(np.diff(bounds) <= 0) or bounds[0] < 0:
            raise ValueError(f"{self.origin}: bucket bounds must be >= 0 and increasing")
        if np.any(np.diff(cumulative) < 0) or cumulative[0] < 0:
            raise ValueError(f"{self.origin}: bucket counts must be cumulative")
        if cumulative[-1] <= 0:
            raise ValueError(f"{self.origin}: the histogram holds no observations")

    @property
    def total(self) -> float:
        return float(self.cumulative[-1])

    def quantile(self, u: np.ndarray) -> np.ndarray:
        """The inverse CDF at u in [0, 1)."""
        bounds, cumulative = self.upper_bounds_s, self.cumulative
        lower_edges = np.concatenate([[0.0], bounds])
        upper_edges = np.concatenate([bounds, [bounds[-1]]])  # +Inf: the last finite bound
        below = np.concatenate([[0.0], cumulative[:-1]])
        target = np.asarray(u) * self.total
        bucket = np.searchsorted(cumulative, target, side="right")
        bucket = np.minimum(bucket, cumulative.size - 1)
        width = cumulative[bucket] - below[bucket]
        share = np.where(width > 0, (target - below[bucket]) / np.where(width > 0, width, 1), 0)
        return lower_edges[bucket] + share * (upper_edges[bucket] - lower_edges[bucket])

    def durations(self, count: int, seed: int) -> np.ndarray:
        return self.quantile(_blockwise(count, seed, lambda rng, k: rng.random(k)))

    def describe(self) -> str:
        return (
            f"{self.total:.0f} rollouts in a {self.upper_bounds_s.size + 1}-bucket histogram "
            f"from {self.origin} (inverse-CDF sampling, linear inside buckets)"
        )

    def notes(self) -> list[str]:
        above = self.total - float(self.cumulative[-2])
        if above <= 0:
            return []
        last = self.upper_bounds_s[-1]
        return [
            f"{above:.0f} of {self.total:.0f} rollouts ({above / self.total:.1%}) lie in the "
            f"+Inf bucket, above the last finite bound {last:g} s: they are sampled as {last:g} s "
            "(so long rollouts are underestimated)"
        ]


def parse_durations_file(path: Path) -> np.ndarray:
    """One duration (seconds) per line (blank lines and # comments skipped), or a JSON list."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of durations in seconds")
        values = [_duration(item, f"{path}: item {i}") for i, item in enumerate(items)]
    else:
        values = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            values.append(_duration(line, f"{path} line {number}"))
    if not values:
        raise ValueError(f"{path} holds no durations")
    return np.asarray(values, dtype=np.float64)


def _duration(item: object, where: str) -> float:
    if isinstance(item, bool) or not isinstance(item, int | float | str):
        raise ValueError(f"{where}: {item!r} is not a duration in seconds")
    try:
        value = float(item)
    except ValueError:
        raise ValueError(f"{where}: {item!r} is not a duration in seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {item!r} is not a finite duration >= 0 seconds")
    return value


def model_with(overrides: list[str]) -> EpisodeModel:
    """EpisodeModel with NAME=VALUE overrides of its fields."""
    types = {f.name: f.type for f in fields(EpisodeModel)}
    given: dict[str, float | int] = {}
    for override in overrides:
        name, sep, raw = override.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(
                f"model parameter {override!r}: give NAME=VALUE, NAME one of {', '.join(types)}"
            )
        try:
            given[name] = int(raw) if types[name] in (int, "int") else float(raw)
        except ValueError:
            raise ValueError(f"model parameter {name}: {raw!r} is not a number") from None
    return EpisodeModel(**given)


def histogram_from_prometheus(url: str, window: str, timeout_s: float = 10.0) -> HistogramSource:
    """The last `window` of the gateway's rollout-duration histogram, from Prometheus' HTTP
    API (/api/v1/query at `url`)."""
    if not _WINDOW.match(window):
        raise ValueError(f"--window {window!r} is not a Prometheus duration (e.g. 30m, 1h, 1d)")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"Prometheus URL {url!r} must start with http:// or https://")
    query = PROMETHEUS_QUERY.format(window=window)
    endpoint = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout_s) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"Prometheus at {url} answered {exc.code}: {_error_of(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"cannot reach Prometheus at {url}: {reason}") from None
    except json.JSONDecodeError:
        raise ValueError(f"{url} did not answer like Prometheus (not JSON)") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise ValueError(f"Prometheus at {url}: query failed: {body}")
    return _histogram(body["data"]["result"], f"Prometheus at {url} over the last {window}")


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)


def _histogram(result: list[dict], origin: str) -> HistogramSource:
    buckets: dict[float, float] = {}
    for series in result:
        le = series.get("metric", {}).get("le")
        if le is None:
            continue
        value = float(series["value"][1])
        buckets[float(le)] = value if math.isfinite(value) else 0.0
    if not buckets:
        raise ValueError(
            f"{origin}: no {PROMETHEUS_METRIC}_bucket samples (is the gateway scraped?)"
        )
    if math.inf not in buckets:
        raise ValueError(f"{origin}: the histogram has no +Inf bucket")
    bounds = np.array(sorted(b for b in buckets if math.isfinite(b)))
    counts = np.array([buckets[b] for b in bounds] + [buckets[math.inf]])
    # increase() extrapolates each series on its own: re-impose cumulative order.
    counts = np.maximum.accumulate(counts)
    if counts[-1] <= 0:
        raise ValueError(f"{origin}: no rollout ended in that window")
    return HistogramSource(bounds, counts, origin)


def simulate_source(config: PipelineConfig, source: DurationSource, seed: int) -> SimResult:
    """simulate() with as many durations of `seed` as the run needs."""
    count = config.durations_needed()
    limit = MAX_DISCARD_FACTOR * count
    if config.discards:
        count = count * 3 // 2 + config.n_slots
    while True:
        try:
            return simulate(config, source.durations(count, seed))
        except DurationsExhausted as exc:
            if count >= limit:
                raise ValueError(
                    f"the run discarded nearly every rollout ({exc.steps_done} of {config.steps} "
                    f"steps done after {count} launches): relax the timeout, failure or stale rules"
                ) from None
            count = min(limit, max(exc.needed, 2 * count))
