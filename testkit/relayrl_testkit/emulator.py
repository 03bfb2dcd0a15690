"""An engine emulator: a LOAD GENERATOR FOR THE PIPELINE BENCHMARK ONLY, never an inference
engine. It lets 64 concurrent episodes run on a 2-core machine by replacing the model with a
clock.

It speaks the subset of vLLM's HTTP API that relayrl uses (`VllmEngineClient` is the
contract): the scale-out generate endpoint, the dev-mode RL endpoints (pause, resume, weight
version, abort), /collective_rpc with relayrl's worker-extension methods, /health and /metrics.

Generation. The i-th generate request to ARRIVE (a valid body, in the order the server parses
them) gets episode i of `EpisodeStream(EpisodeModel(), seed)`: it lasts that episode's duration
times `time_scale` of running wall time and returns min(episode tokens, max_tokens)
pseudo-random token ids (a function of seed and index, below `vocab_size`, never a stop token
except as the last token of a "stop" finish, as vLLM includes the stop token it ended on),
each with a negative log-prob. The index is drawn at arrival even when the engine is paused,
so the arrival order alone decides which request gets which episode.

Pausing works like vLLM's: `keep` freezes in-flight requests (their remaining time stops: the
emulator runs a virtual clock that stands still while frozen), `abort` ends them (and any still
waiting for /resume) at once with the tokens so far, `wait` returns once they have finished
(requests frozen by an earlier `keep` run on to finish). While paused, arriving requests wait
for /resume and then start in arrival order. A weight-version change while a request is in
flight splits its `weight_versions` at the token position proportional to the part of its
duration already run.

Weight sync. `relayrl_receive` really receives the version as a worker does
(`relayrl.dataplane.receiver`: the plan from the weight-sync service, its digest, every
bucket pulled over gRPC and checked against its sha256), discards the tensors instead of
loading them, sleeps `sync_time_s * time_scale`, and answers what a worker answers. Only the
gRPC data plane is emulated.

    python -m relayrl_testkit.emulator --port 0 --ready-file ready.json --time-scale 0.01 \\
        --seed 0 --vocab-size 512 --log requests.jsonl
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from relayrl_testkit.emulator_config import PROG, EmulatorConfig, parse_config

if TYPE_CHECKING:  # imported when serving, after the command line parsed
    from aiohttp import web
    from prometheus_client import CollectorRegistry

logger = logging.getLogger("relayrl_testkit.emulator")

PAUSE_MODES = ("abort", "keep", "wait")
RPC_METHODS = ("relayrl_ping", "relayrl_weight_info", "relayrl_receive")
_TOKEN_STREAM = 0x70C5  # keeps token draws apart from the episode model's generators
MAX_BODY_BYTES = 64 * 1024 * 1024


class BadRequest(ValueError):
    """The caller's mistake (HTTP 400); the message says what to change."""


# --- generated tokens and version spans (pure) ----------------------------------------------


def emitted_tokens(
    seed: int,
    index: int,
    num_tokens: int,
    vocab_size: int,
    stop_token_ids: Sequence[int] = (),
    *,
    end_with_stop: bool = False,
) -> tuple[list[int], list[float]]:
    """Token ids and log-probs of episode `index`: pseudo-random ids in [0, vocab_size) that
    avoid `stop_token_ids`, except that `end_with_stop` makes the last one the first stop
    token; log-probs are negative. A function of its arguments only."""
    import numpy as np

    rng = np.random.default_rng([seed, index, _TOKEN_STREAM])
    drawn = rng.integers(0, vocab_size, num_tokens)
    logprobs = [-(float(x) + 1e-3) for x in rng.exponential(1.0, num_tokens)]
    stops = {t for t in stop_token_ids if 0 <= t < vocab_size}
    token_ids = [_avoid(int(t), stops, vocab_size) for t in drawn]
    if end_with_stop and stop_token_ids and token_ids:
        token_ids[-1] = int(stop_token_ids[0])
    return token_ids, logprobs


def _avoid(token: int, stops: set[int], vocab_size: int) -> int:
    while token in stops:  # terminates: callers check that not every id is a stop token
        token = (token + 1) % vocab_size
    return token


def version_spans(
    version_start: str,
    changes: Sequence[tuple[float, str]],
    num_planned: int,
    num_returned: int,
) -> list[dict[str, Any]]:
    """[{version, start, end}] covering tokens [0, num_returned): a change made when a fraction
    `f` of the request's duration had run takes effect at token floor(f * num_planned). Empty
    spans are dropped and neighbours of one version merged."""
    spans: list[dict[str, Any]] = []
    boundaries = [(0, version_start)]
    for fraction, version in changes:
        position = min(num_returned, math.floor(min(max(fraction, 0.0), 1.0) * num_planned))
        boundaries.append((max(position, boundaries[-1][0]), version))
    boundaries.append((num_returned, ""))
    for (start, version), (end, _) in itertools.pairwise(boundaries):
        if end <= start:
            continue
        if spans and spans[-1]["version"] == version and spans[-1]["end"] == start:
            spans[-1]["end"] = end
        else:
            spans.append({"version": version, "start": start, "end": end})
    return spans


# --- the generate body -----------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateBody:
    """A validated /inference/v1/generate body (the fields the emulator uses)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int | None
    want_logprobs: bool
    stop_token_ids: tuple[int, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_generate_body(body: Any, vocab_size: int) -> GenerateBody:
    """Check a generate body as vLLM would; BadRequest says which field is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    request_id = body.get("request_id")
    if request_id is None:
        request_id = f"emulator-{os.urandom(8).hex()}"
    elif not isinstance(request_id, str) or not request_id:
        raise BadRequest("request_id must be a non-empty string")
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise BadRequest("token_ids must be a non-empty list of prompt token ids")
    if not all(_is_int(t) and 0 <= t < vocab_size for t in token_ids):
        raise BadRequest(f"token_ids must be integers in [0, {vocab_size}) (the vocabulary)")
    params = body.get("sampling_params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise BadRequest(f"sampling_params.max_tokens must be an integer >= 1, got {max_tokens!r}")
    temperature = params.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise BadRequest(f"sampling_params.temperature must be a number, got {temperature!r}")
    if temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {temperature}")
    logprobs = params.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs < 0):
        raise BadRequest(f"sampling_params.logprobs must be an integer >= 0, got {logprobs!r}")
    seed = params.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"sampling_params.seed must be an integer, got {seed!r}")
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) and t >= 0 for t in stops):
        raise BadRequest("sampling_params.stop_token_ids must be a list of token ids")
    if len({t for t in stops if t < vocab_size}) >= vocab_size:
        raise BadRequest("sampling_params.stop_token_ids covers the whole vocabulary")
    if not isinstance(params.get("ignore_eos", False), bool):
        raise BadRequest("sampling_params.ignore_eos must be a boolean")
    return GenerateBody(
        request_id=request_id,
        num_prompt_tokens=len(token_ids),
        max_tokens=max_tokens,
        want_logprobs=logprobs is not None,
        stop_token_ids=tuple(stops),
    )


# --- metrics and the request log -------------------------------------------------------------


class EmulatorMetrics:
    """The emulator's own Prometheus metrics, in a registry it is given."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Gauge

        from relayrl.core.metrics import metric_name

        def name(quantity: str, unit: str) -> str:
            return metric_name("emulator", quantity, unit)

        self.requests = Counter(
            name("requests", "total"),
            "Finished generate requests by finish reason (stop, length, abort).",
            ["finish_reason"],
            registry=registry,
        )
        self.tokens = Counter(
            name("generated_tokens", "total"), "Token ids returned.", registry=registry
        )
        self.inflight = Gauge(
            name("inflight", "requests"), "Generate requests running or frozen.", registry=registry
        )
        self.queued = Gauge(
            name("queued", "requests"),
            "Generate requests that arrived while paused and wait for /resume.",
            registry=registry,
        )
        self.paused = Gauge(name("paused", "bool"), "1 while paused.", registry=registry)
        self.weight_version = Gauge(
            name("weight", "version"),
            "The weight-version label as an integer (-1 while it is not one, e.g. 'default').",
            registry=registry,
        )
        self.loads = Counter(
            name("weight_loads", "total"),
            "relayrl_receive calls by outcome (ok, failed).",
            ["outcome"],
            registry=registry,
        )
        self.received = Counter(
            name("received", "bytes"), "Bucket bytes received and discarded.", registry=registry
        )
        self.prefix_cache_resets = Counter(
            name("prefix_cache_resets", "total"), "/reset_prefix_cache calls.", registry=registry
        )
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        for outcome in ("ok", "failed"):
            self.loads.labels(outcome)

    def set_version(self, version: str) -> None:
        self.weight_version.set(int(version) if version.lstrip("-").isdigit() else -1)


class RequestLog:
    """One JSON line per finished generate request, flushed as written (None: no log)."""

    def __init__(self, path: Path | None) -> None:
        self._file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --- the engine ------------------------------------------------------------------------------


class VirtualClock:
    """The loop's time minus the time spent frozen: requests run on it, so that a keep-pause
    stops every in-flight request's remaining time at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._frozen_at: float | None = None
        self._frozen_s = 0.0

    @property
    def frozen(self) -> bool:
        return self._frozen_at is not None

    def now(self) -> float:
        wall = self._frozen_at if self._frozen_at is not None else self._loop.time()
        return wall - self._frozen_s

    def frozen_s(self) -> float:
        """Loop seconds spent frozen so far (a freeze in progress included)."""
        current = self._loop.time() - self._frozen_at if self._frozen_at is not None else 0.0
        return self._frozen_s + current

    def loop_time_at(self, virtual: float) -> float:
        """When the loop's clock will read `virtual` if nothing freezes meanwhile."""
        return virtual + self._frozen_s

    def freeze(self) -> bool:
        """Stop the clock; whether it was running."""
        if self._frozen_at is not None:
            return False
        self._frozen_at = self._loop.time()
        return True

    def thaw(self) -> bool:
        """Run the clock again; whether it was frozen."""
        if self._frozen_at is None:
            return False
        self._frozen_s += self._loop.time() - self._frozen_at
        self._frozen_at = None
        return True


@dataclass(frozen=True)
class Finished:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    stop_reason: int | None
    spans: list[dict[str, Any]]
    num_prompt_tokens: int


@dataclass(eq=False)
class _Request:
    index: int
    body: GenerateBody
    duration_s: float  # simulated
    run_s: float  # virtual (wall) seconds it runs
    episode_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # when it runs to the end
    arrival_time: float  # time.time()
    arrival_loop_s: float  # loop.time()
    outcome: asyncio.Future[Finished]
    start_v: float | None = None
    start_loop_s: float = 0.0  # loop.time() when it started running
    frozen_at_start_s: float = 0.0  # VirtualClock.frozen_s() then
    version_start: str = ""
    changes: list[tuple[float, str]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None

    def fraction_run(self, now_v: float) -> float:
        if self.start_v is None:
            return 0.0
        return min(max((now_v - self.start_v) / self.run_s, 0.0), 1.0)


class EmulatedEngine:
    """Generation state: the episode stream, the virtual clock, running and queued requests,
    the pause state and the weight-version label."""

    def __init__(self, config: EmulatorConfig, metrics: EmulatorMetrics, log: RequestLog) -> None:
        from relayrl.sim.durations import EpisodeModel, EpisodeStream

        self._config = config
        self._metrics = metrics
        self._log = log
        self._loop = asyncio.get_running_loop()
        self._clock = VirtualClock(self._loop)
        self._stream = EpisodeStream(EpisodeModel(), config.seed)
        self._running: dict[int, _Request] = {}
        self._queued: dict[int, _Request] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.paused = False
        self.weight_version = config.initial_version
        metrics.set_version(self.weight_version)

    # -- generate ------------------------------------------------------------------------

    async def generate(self, body: GenerateBody) -> Finished:
        request = self._arrive(body)
        if self.paused:
            self._queued[request.index] = request
            self._metrics.queued.set(len(self._queued))
        else:
            self._start(request)
        try:
            # shielded: a cancelled handler (the client went away) must not cancel the
            # outcome that _end sets; it aborts the request instead, as vLLM does.
            return await asyncio.shield(request.outcome)
        except asyncio.CancelledError:
            self._end(request, abort=True)
            raise

    def _arrive(self, body: GenerateBody) -> _Request:
        config = self._config
        index, duration_s, episode_tokens = self._stream.next()
        num_tokens = (
            episode_tokens if body.max_tokens is None else min(episode_tokens, body.max_tokens)
        )
        finish = "length" if num_tokens == body.max_tokens else "stop"
        token_ids, logprobs = emitted_tokens(
            config.seed,
            index,
            num_tokens,
            config.vocab_size,
            body.stop_token_ids,
            end_with_stop=finish == "stop",
        )
        return _Request(
            index=index,
            body=body,
            duration_s=duration_s,
            run_s=duration_s * config.time_scale,
            episode_tokens=episode_tokens,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            arrival_time=time.time(),
            arrival_loop_s=self._loop.time(),
            outcome=self._loop.create_future(),
        )

    def _start(self, request: _Request) -> None:
        request.start_v = self._clock.now()
        request.start_loop_s = self._loop.time()
        request.frozen_at_start_s = self._clock.frozen_s()
        request.version_start = self.weight_version
        self._running[request.index] = request
        self._idle.clear()
        self._metrics.inflight.set(len(self._running))
        if not self._clock.frozen:
            self._schedule(request)

    def _schedule(self, request: _Request) -> None:
        assert request.start_v is not None
        when = self._clock.loop_time_at(request.start_v + request.run_s)
        request.timer = self._loop.call_at(when, self._end, request)

    def _end(self, request: _Request, abort: bool = False) -> None:
        """Finish `request` (run to the end, or aborted with the tokens so far), log it and
        answer its handler; a no-op once it has finished."""
        if request.outcome.done():
            return
        if request.timer is not None:
            request.timer.cancel()
        self._running.pop(request.index, None)
        self._queued.pop(request.index, None)
        now_v = self._clock.now()
        if request.start_v is None:  # aborted while waiting for /resume
            request.start_v, request.version_start = now_v, self.weight_version
            request.start_loop_s = self._loop.time()
            request.frozen_at_start_s = self._clock.frozen_s()
        num_planned = len(request.token_ids)
        if abort:
            reason = "abort"
            num_tokens = min(num_planned, math.floor(request.fraction_run(now_v) * num_planned))
        else:
            reason, num_tokens = request.finish_reason, num_planned
        stop_reason = None
        if reason == "stop" and request.body.stop_token_ids:
            stop_reason = request.token_ids[-1]
        finished = Finished(
            request_id=request.body.request_id,
            token_ids=request.token_ids[:num_tokens],
            logprobs=request.logprobs[:num_tokens] if request.body.want_logprobs else None,
            finish_reason=reason,
            stop_reason=stop_reason,
            spans=version_spans(request.version_start, request.changes, num_planned, num_tokens),
            num_prompt_tokens=request.body.num_prompt_tokens,
        )
        self._record(request, finished)
        request.outcome.set_result(finished)
        if not self._running:
            self._idle.set()

    def _record(self, request: _Request, finished: Finished) -> None:
        wall_s = self._loop.time() - request.arrival_loop_s
        # waiting for /resume before it started, then frozen by keep-pauses while it ran
        paused_wall_s = request.start_loop_s - request.arrival_loop_s
        paused_wall_s += self._clock.frozen_s() - request.frozen_at_start_s
        self._log.write(
            {
                "index": request.index,
                "request_id": request.body.request_id,
                "duration_s": request.duration_s,
                "wall_s": round(wall_s, 6),
                "paused_wall_s": round(paused_wall_s, 6),
                "tokens": len(finished.token_ids),
                "episode_tokens": request.episode_tokens,
                "max_tokens": request.body.max_tokens,
                "finish_reason": finished.finish_reason,
                "version_start": request.version_start,
                "version_end": self.weight_version,
                "arrival_time": request.arrival_time,
                "finish_time": time.time(),
            }
        )
        self._metrics.requests.labels(finished.finish_reason).inc()
        self._metrics.tokens.inc(len(finished.token_ids))
        self._metrics.inflight.set(len(self._running))
        self._metrics.queued.set(len(self._queued))

    # -- control -------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused = True
        self._metrics.paused.set(1)
        if mode == "keep":
            self._freeze()
        elif mode == "abort":
            self.abort(())
            self._freeze()
        else:  # wait: in-flight requests (even ones frozen by an earlier keep) run to the end
            self._thaw()
            await self._idle.wait()
            if self.paused:
                self._freeze()

    def resume(self) -> None:
        self.paused = False
        self._metrics.paused.set(0)
        self._thaw()
        queued = [self._queued[index] for index in sorted(self._queued)]
        self._queued.clear()
        self._metrics.queued.set(0)
        for request in queued:  # in arrival order
            self._start(request)

    def _freeze(self) -> None:
        if self._clock.freeze():
            for request in self._running.values():
                if request.timer is not None:
                    request.timer.cancel()
                    request.timer = None

    def _thaw(self) -> None:
        if self._clock.thaw():
            for request in self._running.values():
                self._schedule(request)

    def set_weight_version(self, version: str) -> None:
        if version == self.weight_version:
            return
        now_v = self._clock.now()
        for request in self._running.values():
            request.changes.append((request.fraction_run(now_v), version))
        self.weight_version = version
        self._metrics.set_version(version)

    def abort(self, request_ids: Sequence[str]) -> int:
        """End the requests with these ids (every one, running or queued, when empty) with
        finish reason "abort"; how many."""
        wanted = set(request_ids)
        doomed = [
            r
            for r in [*self._running.values(), *self._queued.values()]
            if not wanted or r.body.request_id in wanted
        ]
        for request in doomed:
            self._end(request, abort=True)
        return len(doomed)


# --- the worker: relayrl's worker-extension methods ------------------------------------------


class EmulatedWorker:
    """The one worker behind /collective_rpc: receives versions for real, loads nothing."""

    def __init__(self, config: EmulatorConfig, metrics: EmulatorMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._lock = asyncio.Lock()  # one version at a time, as a worker loads
        self._num_params = 0
        self._bucket_sha256: list[str] = []
        # As a real worker: "" (its initial weights), a transfer id, None (mid-load or failed)
        self._holds: str | None = ""

    async def call(self, method: str, request: dict[str, Any]) -> dict[str, Any]:
        if method == "relayrl_ping":
            return {"ok": True, "holds": self._holds}
        if method == "relayrl_weight_info":
            return self.weight_info()
        if method == "relayrl_receive":
            return await self.receive(request)
        raise BadRequest(
            f"method {method!r} is not served by the engine emulator (it serves "
            f"{', '.join(RPC_METHODS)})"
        )

    def weight_info(self) -> dict[str, Any]:
        """A worker's answer's fields. There is no model: num_params counts the elements of the
        last version received and digest is over its buckets' sha256 (0 and the digest of
        nothing before any version arrived); no per-tensor digests."""
        digest = hashlib.sha256("".join(self._bucket_sha256).encode()).hexdigest()
        return {"num_params": self._num_params, "digest": digest, "tensors": {}}

    async def receive(self, request: dict[str, Any]) -> dict[str, Any]:
        transport = request.get("transport", "grpc")
        if transport != "grpc":
            raise BadRequest(
                f"the engine emulator receives versions over the grpc data plane only, not "
                f"{transport!r}; set weight-sync's data_plane.transport to grpc"
            )
        missing = [k for k in ("target", "transfer_id", "plan_digest") if not request.get(k)]
        if missing:
            raise BadRequest(f"relayrl_receive request lacks {', '.join(missing)}")
        async with self._lock:
            start = time.monotonic()
            self._holds = None
            try:
                stats, num_params = await _in_daemon_thread(_receive_and_discard, request)
            except Exception:
                self._metrics.loads.labels("failed").inc()
                raise
            self._metrics.received.inc(int(stats.get("bytes", 0)))
            # the load the emulator does not do, at the benchmark's time scale
            await asyncio.sleep(self._config.sync_time_s * self._config.time_scale)
            stats["seconds"] = time.monotonic() - start
            self._num_params, self._bucket_sha256 = num_params, list(stats["bucket_sha256"])
            self._holds = str(request["transfer_id"])
            self._metrics.loads.labels("ok").inc()
        logger.info(
            "received %s: %d buckets, %d bytes",
            request["transfer_id"], len(stats["bucket_sha256"]), stats.get("bytes", 0),
        )  # fmt: skip
        return stats


async def _in_daemon_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a daemon thread: unlike `asyncio.to_thread`, a receive still
    blocked in gRPC when SIGTERM arrives does not hold up the exit (its deadline may be
    minutes away)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting handler was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = function(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine, not swallowed
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="relayrl-emulator-receive", daemon=True).start()
    return await future


def _receive_and_discard(request: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A worker's receive (plan, digest, buckets, checksums) with the tensors dropped as they
    come; the stats a worker answers and the number of elements received. Runs in a thread:
    the gRPC pull blocks."""
    import os

    from relayrl.dataplane.receiver import receive_tensors
    from relayrl.engine.config import weightsync_tls_from_env

    stats: dict[str, Any] = {}
    num_params = 0
    # TLS towards weight-sync as a worker has it: from the engine config, via the launcher's env
    tls = weightsync_tls_from_env(os.environ)
    for _, tensor in receive_tensors(request, stats, tls=tls):
        num_params += tensor.numel()
    return stats, num_params


# --- HTTP ------------------------------------------------------------------------------------


def _answer(body: Any, status: int = 200) -> web.Response:
    from aiohttp import web  # loaded by then: serve() imported it

    return web.json_response(body, status=status)


def _ok() -> web.Response:
    """200 with an empty body, as vLLM answers /health and /reset_prefix_cache."""
    from aiohttp import web

    return web.Response(status=200)


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return _answer({"error": {"message": message, "type": kind, "code": status}}, status)


async def _json_body(request: web.Request, *, required: bool = True) -> Any:
    if not required and not request.can_read_body:
        return {}
    try:
        return await request.json()
    except ValueError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


def generate_answer(finished: Finished, model: str) -> dict[str, Any]:
    """The answer vLLM's scale-out generate endpoint gives (output_mode tokens)."""
    logprobs = None
    if finished.logprobs is not None:
        content = [
            {"token_id": t, "logprob": lp, "rank": None, "top_logprobs": []}
            for t, lp in zip(finished.token_ids, finished.logprobs, strict=True)
        ]
        logprobs = {"content": content}
    num_tokens = len(finished.token_ids)
    return {
        "request_id": finished.request_id,
        "output_mode": "tokens",
        "model": model,
        "created": int(time.time()),
        "choices": [
            {
                "index": 0,
                "finish_reason": finished.finish_reason,
                "stop_reason": finished.stop_reason,
                "token_ids": finished.token_ids,
                "logprobs": logprobs,
                "weight_versions": finished.spans,
            }
        ],
        "usage": {
            "prompt_tokens": finished.num_prompt_tokens,
            "completion_tokens": num_tokens,
            "total_tokens": finished.num_prompt_tokens + num_tokens,
        },
    }


class EmulatorApp:
    """The HTTP routes: each parses its request, calls the engine or the worker, answers."""

    MODEL = "relayrl-engine-emulator"

    def __init__(
        self,
        config: EmulatorConfig,
        engine: EmulatedEngine,
        worker: EmulatedWorker,
        metrics: EmulatorMetrics,
        registry: CollectorRegistry,
    ) -> None:
        self._config = config
        self._engine = engine
        self._worker = worker
        self._metrics = metrics
        self._registry = registry

    def build(self) -> web.Application:
        from aiohttp import web

        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[_make_errors_middleware()]
        )
        app.add_routes(
            [
                web.post("/inference/v1/generate", self.generate),
                web.post("/pause", self.pause),
                web.post("/resume", self.resume),
                web.get("/is_paused", self.is_paused),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.get("/weight_info", self.weight_info),
                web.post("/update_weight_version", self.update_weight_version),
                web.post("/abort_requests", self.abort_requests),
                web.post("/collective_rpc", self.collective_rpc),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
            ]
        )
        return app

    async def generate(self, request: web.Request) -> web.Response:
        body = parse_generate_body(await _json_body(request), self._config.vocab_size)
        finished = await self._engine.generate(body)
        return _answer(generate_answer(finished, self.MODEL))

    async def pause(self, request: web.Request) -> web.Response:
        await self._engine.pause(request.query.get("mode", "abort"))  # vLLM's default
        return _answer({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self._engine.resume()
        return _answer({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return _answer({"is_paused": self._engine.paused})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._metrics.prefix_cache_resets.inc()
        return _ok()

    async def weight_info(self, request: web.Request) -> web.Response:
        return _answer({"weight_version": self._engine.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str) or not version:
            raise BadRequest('the body must be {"new_version": "<non-empty string>"}')
        self._engine.set_weight_version(version)
        return _answer({"success": True, "new_version": version})

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await _json_body(request, required=False)
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        request_ids = body.get("request_ids") or []
        if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
            raise BadRequest("request_ids must be a list of strings")
        aborted = self._engine.abort(request_ids)
        return _answer({"status": "aborted", "aborted": aborted})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("method"), str):
            raise BadRequest('the body must be {"method": "...", "args": ["<json>"]}')
        args = body.get("args") or []
        if not isinstance(args, list) or len(args) > 1 or not all(isinstance(a, str) for a in args):
            raise BadRequest("args must hold at most one JSON string (relayrl's methods take one)")
        try:
            payload = json.loads(args[0]) if args and args[0] else {}
        except ValueError as exc:
            raise BadRequest(f"args[0] is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise BadRequest("args[0] must encode a JSON object")
        answer = await self._worker.call(body["method"], payload)
        return _answer({"results": [answer]})

    async def health(self, request: web.Request) -> web.Response:
        return _ok()

    async def metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        response = web.Response(body=generate_latest(self._registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


def _make_errors_middleware() -> Any:
    from aiohttp import web

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:  # a failed receive: a 500 with its reason, as a worker's
            logger.exception("%s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    return errors


# --- the process -----------------------------------------------------------------------------


class StartupError(Exception):
    """The emulator cannot start as configured (a taken port, an unwritable path)."""


def write_ready_file(path: Path, url: str) -> None:
    """{"url", "pid"}, atomically: a reader never sees a half-written file."""
    from relayrl.core.atomic import atomic_write_text

    atomic_write_text(path, json.dumps({"url": url, "pid": os.getpid()}))


async def serve(config: EmulatorConfig) -> None:
    """Serve until SIGTERM or SIGINT, then abort what is in flight and close."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    # A real engine holds torch before its first version arrives: imported now, the receive
    # path's import (about a second) is not counted against the first sync.
    import relayrl.dataplane.receiver  # noqa: F401

    registry = CollectorRegistry()
    metrics = EmulatorMetrics(registry)
    try:
        log = RequestLog(config.log)
    except OSError as exc:
        raise StartupError(f"cannot write --log {config.log}: {exc.strerror}") from None
    engine = EmulatedEngine(config, metrics, log)
    worker = EmulatedWorker(config, metrics)
    app = EmulatorApp(config, engine, worker, metrics, registry).build()
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=config.shutdown_grace_s
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {config.host}:{config.port} ({exc.strerror}); "
                "choose another --port (0 picks a free one)"
            ) from None
        port = int(runner.addresses[0][1])
        url = f"http://{config.url_host}:{port}"
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if config.ready_file is not None:
            try:
                write_ready_file(config.ready_file, url)
            except OSError as exc:
                raise StartupError(
                    f"cannot write --ready-file {config.ready_file}: {exc.strerror}"
                ) from None
        logger.info(
            "engine emulator (benchmark load generator) on %s: time scale %g, seed %d",
            url, config.time_scale, config.seed,
        )  # fmt: skip
        await stop.wait()
        logger.info("stopping: aborting %d in-flight requests", engine.abort(()))
    finally:
        await runner.cleanup()
        log.close()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)  # before the server's imports: --help and mistakes are instant
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s emulator %(message)s")
    try:
        asyncio.run(serve(config))
    except StartupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
