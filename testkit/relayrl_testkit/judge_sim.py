"""A simulated LLM judge server: an OpenAI/vLLM-compatible HTTP API whose latency follows a
continuously batching engine, so the judge managers, their tests and the reward benchmarks can
run against something that behaves like a vLLM judge without a GPU.

    python -m relayrl_testkit.judge_sim --host 127.0.0.1 --port 0 [--time-scale 0.1] [...]

With `--port 0` the first (and only) line on stdout is `judge_sim listening on http://HOST:PORT`
once the server accepts connections; logs go to stderr.

Endpoints: GET /health, GET /v1/models, POST /v1/completions (`prompt`: a string or a list,
one sequence per prompt), POST /v1/chat/completions, POST /classify, POST /pooling; and for
tests GET /stats, POST /stats/reset, POST /control (below).

Timing model (modelled on a vLLM judge's measurements; every duration is multiplied by
`--time-scale`):
- a request first pays prefill (`--prefill-s`, default 0.3 s), once per request however many
  prompts it carries; prefills of different requests overlap;
- its sequences (one per prompt, times `n`) then join ONE global decode batch. Each decode step
  advances every active sequence by one token and costs
  `step_s * (1 + step_growth * (k - 1))` for k active sequences (defaults 0.025 s and 0.047:
  16 sequences cost ~1.7x one). At most `--max-num-seqs` decode at once; the rest wait;
- a sequence decodes `--verdict-tokens` tokens (default 200), capped by the request's
  `max_tokens`; a request answers when all of its sequences are done;
- a classify/pooling request costs only its prefill (one forward, no decode).

Verdicts are deterministic functions of the prompt text (a "token" is a word here):
- the last line `ANSWER: <x>` and the last line `REFERENCE: <y>` are compared after strip();
- label mode (default): the text ends with `Verdict: Correct` or `Verdict: Incorrect`;
- score mode: the text ends with `Score: <s>`, s = 1.00 on a match, else the word-set overlap
  (Jaccard) of x and y, two decimals;
- with no ANSWER or no REFERENCE line, the text ends without any verdict (unparseable);
- everything before the verdict is reasoning-like filler, so the whole text has
  `verdict_tokens` words, and a `max_tokens` below that cuts the verdict off
  (finish_reason "length"), as a real judge would.
Directive lines anywhere in a prompt, chat message or classify input override per text:
  `SIM_MODE: label|score|garbage` (garbage: no verdict), `SIM_SCORE: 7.5` (score mode, that
  exact score; classify: probability of class 1), `SIM_TOKENS: 12` (words to decode),
  `SIM_FAULT: <kind>` (fault for the whole request, see below).
Classify (`POST /classify`) returns two classes; P(class 1) is 0.92 on an ANSWER/REFERENCE
match, 0.08 on a mismatch, SIM_SCORE when given, else a value hashed from the text.
`POST /pooling` returns the logit of that probability as a one-element `data` list.

Prompts longer than `--max-model-len` tokens (estimated as characters / 4) get vLLM's HTTP 400
"This model's maximum context length is ..." answer; a request naming another model gets 404.

Fault injection, for the scoring endpoints only. The first that applies wins: the header
`X-Sim-Fault: <kind>`, a `SIM_FAULT: <kind>` line in any text of the request, then the server's
plan (`--fault KIND [--fault-count N]` at start, or `POST /control {"fault": KIND, "count": N,
"retry_after_s": S}` later; count 0 means every request until `{"fault": null}`). Kinds:
  a status code (`500`, `503`, `429`, `400`, ...): that status with a vLLM-style error body;
      429 carries `Retry-After: <retry_after_s * time_scale>` (`--retry-after-s`, default 1);
  `hang`: never answers (the handler is cancelled when the client goes away);
  `malformed`: HTTP 200 with a truncated JSON body;
  `close`: closes the connection without answering;
  `drop`: answers normally but leaves out the last choice / data entry;
  `shuffle`: answers normally with choices / data entries in reverse order.

`GET /stats` returns counters, `POST /stats/reset` zeroes them:
  {"requests": scoring requests received (faulted ones included),
   "items": prompts/inputs they carried, "request_items": [items of each request, in order],
   "by_endpoint": {"/v1/completions": n, ...}, "faults": {"500": n, ...},
   "completed": requests answered 200, "inflight": now, "inflight_max": most at once,
   "active_seqs_max": most sequences in one decode step, "decode_steps": n,
   "decode_tokens": sequence-steps decoded, "decode_busy_s": modelled decode seconds (the
   step costs summed, time_scale applied),
   "request_log": [one entry per scoring request, in arrival order (the latest
   REQUEST_LOG_MAX): {"endpoint", "start_s": when its handler began, "end_s": when its answer
   was ready (null while in flight, and for one cancelled by its client's leaving), "status":
   the HTTP status answered (null: none), "items": prompts/inputs it carried, "tags": per
   prompt the value of its last `ITEM: <tag>` line (up to 64 characters; null without one)}],
   times in seconds of time.monotonic(), the system-wide clock that a benchmark on the same
   machine reads too, so it can line judge requests up with its own timeline;
   "options": the server's timing options}
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

logger = logging.getLogger("relayrl_testkit.judge_sim")

FAULT_HEADER = "X-Sim-Fault"
BODY_FAULTS = ("hang", "malformed", "close", "drop", "shuffle")
SCORING_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/classify", "/pooling")
REQUEST_LOG_MAX = 10_000
TAG_CHARS = 64

_DIRECTIVE = re.compile(r"^[ \t]*SIM_([A-Z_]+)[ \t]*:[ \t]*(.*?)[ \t]*$", re.MULTILINE)
_ANSWER = re.compile(r"^[ \t]*ANSWER:(.*)$", re.MULTILINE)
_REFERENCE = re.compile(r"^[ \t]*REFERENCE:(.*)$", re.MULTILINE)
_ITEM_TAG = re.compile(r"^[ \t]*ITEM:[ \t]*(\S+)", re.MULTILINE)
_FILLER_TEXT = (
    "Let me compare the submitted answer with the reference step by step. First I restate "
    "what the question asks and which quantity the final answer must give. Then I check the "
    "units, the sign and the simplification, because equivalent forms count as the same "
    "answer. I ignore the reasoning style and look only at the final result."
)
_FILLER = tuple(_FILLER_TEXT.split())
_NO_VERDICT_TEXT = "I could not find both an answer and a reference to compare ."
MATCH_PROB = 0.92


def is_fault_kind(kind: str) -> bool:
    return kind in BODY_FAULTS or (kind.isdigit() and 400 <= int(kind) <= 599)


@dataclass(frozen=True)
class SimOptions:
    """The server's timing model and defaults (see the module docstring)."""

    model: str = "judge"
    step_s: float = 0.025
    step_growth: float = 0.047
    prefill_s: float = 0.3
    verdict_tokens: int = 200
    time_scale: float = 1.0
    max_num_seqs: int = 256
    max_model_len: int = 8192
    verdict_mode: str = "label"
    retry_after_s: float = 1.0

    def step_cost(self, active: int) -> float:
        """Seconds one decode step takes with `active` sequences in it."""
        return self.step_s * (1.0 + self.step_growth * (active - 1)) * self.time_scale

    def prefill_cost(self) -> float:
        return self.prefill_s * self.time_scale


@dataclass
class SimStats:
    """Counters behind GET /stats: what tests and benchmarks assert on."""

    requests: int = 0
    items: int = 0
    request_items: list[int] = field(default_factory=list)
    by_endpoint: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    inflight: int = 0
    inflight_max: int = 0
    active_seqs_max: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_busy_s: float = 0.0
    request_log: list[dict[str, Any]] = field(default_factory=list)

    def log_request(self, endpoint: str) -> dict[str, Any]:
        """A new request_log entry (filled in by the request's handler as it goes)."""
        entry: dict[str, Any] = {
            "endpoint": endpoint,
            "start_s": time.monotonic(),
            "end_s": None,
            "status": None,
            "items": 0,
            "tags": [],
        }
        self.request_log.append(entry)
        if len(self.request_log) > REQUEST_LOG_MAX:
            del self.request_log[: len(self.request_log) - REQUEST_LOG_MAX]
        return entry

    def reset(self) -> None:
        inflight = self.inflight
        fresh = SimStats()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))
        self.inflight = self.inflight_max = inflight


@dataclass
class FaultPlan:
    """The server-wide fault: `kind` for the next `remaining` requests (None: all of them)."""

    kind: str | None = None
    remaining: int | None = None

    def take(self) -> str | None:
        if self.kind is None:
            return None
        kind = self.kind
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.kind, self.remaining = None, None
        return kind


# -- verdict text ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Judgement:
    """What the simulated judge concludes about one text."""

    words: tuple[str, ...]  # the full completion, one "token" per word
    prob: float  # P(class 1) for classify/pooling
    directives: dict[str, str]


def _directives(text: str) -> dict[str, str]:
    return {key.upper(): value for key, value in _DIRECTIVE.findall(text)}


def _last(pattern: re.Pattern[str], text: str) -> str | None:
    found = pattern.findall(text)
    return found[-1].strip() if found else None


def _hashed_prob(text: str) -> float:
    digest = hashlib.sha256(text.encode()).digest()
    return round(int.from_bytes(digest[:4], "big") / 2**32, 6)


def judge(text: str, options: SimOptions) -> Judgement:
    """The deterministic verdict (and classify probability) for one prompt."""
    directives = _directives(text)
    answer, reference = _last(_ANSWER, text), _last(_REFERENCE, text)
    matched = None if answer is None or reference is None else answer == reference
    mode = directives.get("MODE", options.verdict_mode).lower()
    forced_score = directives.get("SCORE")
    if forced_score is not None:
        mode = "score"

    if mode == "garbage" or (matched is None and forced_score is None):
        verdict = _NO_VERDICT_TEXT.split()
    elif mode == "score":
        if forced_score is not None:
            shown = forced_score
        elif matched:
            shown = "1.00"
        else:
            a, b = set(answer.lower().split()), set(reference.lower().split())  # type: ignore[union-attr]
            shown = f"{len(a & b) / len(a | b) if a | b else 0.0:.2f}"
        verdict = ["Score:", shown]
    else:
        verdict = ["Verdict:", "Correct" if matched else "Incorrect"]

    try:
        tokens = int(directives.get("TOKENS", options.verdict_tokens))
    except ValueError:
        tokens = options.verdict_tokens
    filler = max(0, tokens - len(verdict))
    words = tuple(_FILLER[i % len(_FILLER)] for i in range(filler)) + tuple(verdict)

    if forced_score is not None:
        try:
            prob = min(1.0, max(0.0, float(forced_score)))
        except ValueError:
            prob = _hashed_prob(text)
    elif matched is not None:
        prob = MATCH_PROB if matched else 1.0 - MATCH_PROB
    else:
        prob = _hashed_prob(text)
    return Judgement(words=words, prob=round(prob, 6), directives=directives)


def item_tag(text: str) -> str | None:
    """The value of the last `ITEM: <tag>` line of a prompt (a benchmark's item id)."""
    found = _ITEM_TAG.findall(text)
    return found[-1][:TAG_CHARS] if found else None


def approx_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


# -- the engine -----------------------------------------------------------------------------


class _Pending:
    """One request's sequences in the decode batch."""

    __slots__ = ("cancelled", "future", "left")

    def __init__(self, future: asyncio.Future[None], left: int) -> None:
        self.future = future
        self.left = left
        self.cancelled = False


class _Sequence:
    __slots__ = ("pending", "remaining")

    def __init__(self, remaining: int, pending: _Pending) -> None:
        self.remaining = remaining
        self.pending = pending


class DecodeEngine:
    """One global decode loop shared by every request, as in a continuously batching server:
    each step sleeps the cost for the sequences decoding now and advances each by one token."""

    def __init__(self, options: SimOptions, stats: SimStats) -> None:
        self._options = options
        self._stats = stats
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="decode-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def prefill(self) -> None:
        await asyncio.sleep(self._options.prefill_cost())

    async def generate(self, token_counts: Sequence[int]) -> None:
        """Prefill, then decode `token_counts[i]` tokens for each sequence i; returns when all
        are done. Cancelling it (the client went away) aborts its sequences."""
        await self.prefill()
        counts = [n for n in token_counts if n > 0]
        if not counts:
            return
        pending = _Pending(asyncio.get_running_loop().create_future(), len(counts))
        self._waiting.extend(_Sequence(n, pending) for n in counts)
        self._wake.set()
        try:
            await pending.future
        finally:
            pending.cancelled = not pending.future.done()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._options.max_num_seqs:
            seq = self._waiting.popleft()
            if not seq.pending.cancelled:
                self._running.append(seq)

    async def _run(self) -> None:
        try:
            await self._steps()
        except Exception:  # a simulator bug: say so, or every request would just hang
            logger.exception("decode loop failed")
            raise

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        target: float | None = None
        while True:
            self._running = [s for s in self._running if not s.pending.cancelled]
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                target = None
                continue
            active = len(self._running)
            cost = self._options.step_cost(active)
            now = loop.time()
            # Deadline-based steps: sleep overshoot of one step is made up in the next, so a
            # long decode takes its modelled time; a stall longer than a step is not repaid.
            if target is None or target < now - cost:
                target = now
            target += cost
            await asyncio.sleep(max(0.0, target - loop.time()))
            stats = self._stats
            stats.decode_steps += 1
            stats.decode_tokens += active
            stats.decode_busy_s += cost
            stats.active_seqs_max = max(stats.active_seqs_max, active)
            still: list[_Sequence] = []
            for seq in self._running:
                if seq.pending.cancelled:
                    continue
                seq.remaining -= 1
                if seq.remaining > 0:
                    still.append(seq)
                    continue
                seq.pending.left -= 1
                if seq.pending.left == 0 and not seq.pending.future.done():
                    seq.pending.future.set_result(None)
            self._running = still


# -- HTTP -----------------------------------------------------------------------------------


class JudgeSim:
    """The aiohttp application: endpoints, fault injection and counters."""

    def __init__(self, options: SimOptions, fault: FaultPlan) -> None:
        self.options = options
        self.fault = fault
        self.stats = SimStats()
        self.engine = DecodeEngine(options, self.stats)
        self._ids = 0

    def app(self) -> web.Application:
        from aiohttp import web

        @web.middleware
        async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._timed(request, handler)

        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[timed])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.get_stats)
        app.router.add_post("/stats/reset", self.reset_stats)
        app.router.add_post("/control", self.control)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/classify", self.classify)
        app.router.add_post("/pooling", self.pooling)
        return app

    async def _timed(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp middleware: a request_log entry for each scoring request."""
        if request.path not in SCORING_ENDPOINTS:
            return await handler(request)
        entry = self.stats.log_request(request.path)
        request["sim_log"] = entry
        try:
            response = await handler(request)
            entry["status"] = response.status
            return response
        except Exception as exc:  # aiohttp's HTTPExceptions carry a status
            entry["status"] = getattr(exc, "status", 500)
            raise
        finally:
            if entry["status"] is not None:
                entry["end_s"] = time.monotonic()

    # -- helpers --

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    @staticmethod
    def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        from aiohttp import web

        kinds = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}
        body = {
            "object": "error",
            "message": message,
            "type": kinds.get(status, "InternalServerError" if status >= 500 else "Error"),
            "param": None,
            "code": status,
        }
        return web.json_response(body, status=status, headers=headers)

    @staticmethod
    def _tag(request: web.Request, texts: Sequence[str]) -> None:
        """Record the items and tags of a scoring request in its request_log entry."""
        entry = request.get("sim_log")
        if entry is not None:
            entry["items"] = len(texts)
            entry["tags"] = [item_tag(text) for text in texts]

    def _count(self, endpoint: str, items: int) -> None:
        stats = self.stats
        stats.requests += 1
        stats.items += items
        stats.request_items.append(items)
        stats.by_endpoint[endpoint] = stats.by_endpoint.get(endpoint, 0) + 1

    def _pick_fault(self, request: web.Request, texts: Sequence[str]) -> str | None:
        kind = request.headers.get(FAULT_HEADER)
        if kind is None:
            kind = next((d["FAULT"] for d in map(_directives, texts) if "FAULT" in d), None)
        if kind is None:
            kind = self.fault.take()
        if kind is None:
            return None
        kind = kind.strip().lower()
        if not is_fault_kind(kind):
            logger.warning("ignoring unknown fault %r", kind)
            return None
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1
        return kind

    async def _status_fault(self, request: web.Request, kind: str) -> web.StreamResponse | None:
        """Answer an error/hang/malformed/close fault; None for faults applied to a body."""
        from aiohttp import web

        if kind.isdigit():
            status = int(kind)
            headers = None
            if status == 429:
                retry_after = self.options.retry_after_s * self.options.time_scale
                headers = {"Retry-After": f"{retry_after:g}"}
            return self._error(status, f"simulated fault: HTTP {status}", headers)
        if kind == "hang":
            logger.info("fault hang: %s never answers", request.path)
            await asyncio.get_running_loop().create_future()  # cancelled when the client leaves
        if kind == "malformed":
            return web.Response(
                status=200,
                body=b'{"id": "cmpl-broken", "choices": [{"index": 0, "te',
                content_type="application/json",
            )
        if kind == "close":
            transport = request.transport
            if transport is not None:
                transport.abort()
            raise asyncio.CancelledError  # nothing left to answer on
        return None

    async def _read_json(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return self._refuse(request, 400, f"request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return self._refuse(request, 400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.options.model:
            return self._refuse(request, 404, f"The model `{model}` does not exist.")
        if body.get("stream"):
            return self._refuse(request, 400, "judge_sim does not stream")
        return body

    def _refuse(self, request: web.Request, status: int, message: str) -> web.Response:
        """An error answer to a request refused before its items were read (counted as a
        request carrying 0 items)."""
        if request.path in SCORING_ENDPOINTS:
            self._count(request.path, 0)
        return self._error(status, message)

    def _too_long(self, texts: Sequence[str]) -> web.Response | None:
        for text in texts:
            tokens = approx_tokens(text)
            if tokens >= self.options.max_model_len:
                return self._error(
                    400,
                    f"This model's maximum context length is {self.options.max_model_len} "
                    f"tokens. However, your request has {tokens} input tokens. Please reduce "
                    "the length of the input messages.",
                )
        return None

    @staticmethod
    def _reorder(entries: list[dict[str, Any]], kind: str | None) -> list[dict[str, Any]]:
        if kind == "drop":
            return entries[:-1]
        if kind == "shuffle":
            return entries[::-1]
        return entries

    def _generation_args(self, body: dict[str, Any]) -> tuple[int | None, int] | str:
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        n = body.get("n", 1)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return "max_tokens must be a positive integer"
        if not isinstance(n, int) or n < 1:
            return "n must be a positive integer"
        return max_tokens, n

    async def _generate(
        self, request: web.Request, endpoint: str, texts: list[str], body: dict[str, Any]
    ) -> tuple[list[tuple[int, str, str]], dict[str, int], str | None] | web.StreamResponse:
        """Shared by completions and chat: count, faults, limits, prefill + decode. Returns
        (index, text, finish_reason) per sequence, usage and the body fault, or a response."""
        args = self._generation_args(body)
        self._count(endpoint, len(texts))
        self._tag(request, texts)
        if isinstance(args, str):
            return self._error(400, args)
        max_tokens, n = args
        fault = self._pick_fault(request, texts)
        if fault is not None:
            answered = await self._status_fault(request, fault)
            if answered is not None:
                return answered
        if (too_long := self._too_long(texts)) is not None:
            return too_long
        outputs: list[tuple[int, str, str]] = []
        counts: list[int] = []
        prompt_tokens = 0
        for i, text in enumerate(texts):
            prompt_tokens += approx_tokens(text)
            words = judge(text, self.options).words
            room = self.options.max_model_len - approx_tokens(text)
            cap = min(room, max_tokens) if max_tokens is not None else room
            decoded = words[:cap]
            finish = "stop" if len(decoded) == len(words) else "length"
            for j in range(n):
                outputs.append((i * n + j, " ".join(decoded), finish))
                counts.append(len(decoded))
        await self.engine.generate(counts)
        completion_tokens = sum(counts)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return outputs, usage, fault

    # -- endpoints --

    async def health(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        from aiohttp import web

        model = {
            "id": self.options.model,
            "object": "model",
            "created": 0,
            "owned_by": "judge_sim",
            "max_model_len": self.options.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def get_stats(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response({**asdict(self.stats), "options": asdict(self.options)})

    async def reset_stats(self, request: web.Request) -> web.Response:
        from aiohttp import web

        self.stats.reset()
        return web.json_response({"ok": True})

    async def control(self, request: web.Request) -> web.Response:
        from aiohttp import web

        body = await self._read_json(request)
        if not isinstance(body, dict):
            return body
        kind = body.get("fault")
        count = body.get("count", 0)
        if kind is not None and (not isinstance(kind, str) or not is_fault_kind(kind)):
            return self._error(400, f"unknown fault {kind!r}")
        if not isinstance(count, int) or count < 0:
            return self._error(400, "count must be an integer >= 0")
        self.fault.kind = kind
        self.fault.remaining = count or None
        if "retry_after_s" in body:
            retry_after = body["retry_after_s"]
            if not isinstance(retry_after, int | float) or retry_after < 0:
                return self._error(400, "retry_after_s must be a number >= 0")
            self.options = replace(self.options, retry_after_s=float(retry_after))
        logger.info("fault plan: %s x %s", kind, count or "all")
        return web.json_response({"ok": True})

    async def completions(self, request: web.Request) -> web.StreamResponse:

        body = await self._read_json(request)
        if not isinstance(body, dict):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
        else:
            self._count("/v1/completions", 0)
            return self._error(400, "prompt must be a string or a non-empty list of strings")
        with self._inflight():
            result = await self._generate(request, "/v1/completions", texts, body)
            if not isinstance(result, tuple):
                return result
            outputs, usage, fault = result
            choices = [
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
                for index, text, finish in outputs
            ]
            return self._completion_response("cmpl", "text_completion", choices, usage, fault)

    def _completion_response(
        self,
        id_prefix: str,
        object_name: str,
        choices: list[dict[str, Any]],
        usage: dict[str, Any],
        fault: Any,
    ) -> web.StreamResponse:
        """A 200 answer in the OpenAI shape shared by completions and chat completions."""
        from aiohttp import web

        self.stats.completed += 1
        return web.json_response(
            {
                "id": self._next_id(id_prefix),
                "object": object_name,
                "created": int(time.time()),
                "model": self.options.model,
                "choices": self._reorder(choices, fault),
                "usage": usage,
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:

        body = await self._read_json(request)
        if not isinstance(body, dict):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            self._count("/v1/chat/completions", 0)
            return self._error(400, "messages must be a non-empty list")
        parts: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        text = "\n".join(parts)
        with self._inflight():
            result = await self._generate(request, "/v1/chat/completions", [text], body)
            if not isinstance(result, tuple):
                return result
            outputs, usage, fault = result
            choices = [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                for index, content, finish in outputs
            ]
            return self._completion_response("chatcmpl", "chat.completion", choices, usage, fault)

    async def _forward(
        self, request: web.Request, endpoint: str
    ) -> tuple[list[Judgement], str | None, int] | web.StreamResponse:
        """Shared by classify and pooling: one prefill for the whole batch, no decode."""
        body = await self._read_json(request)
        if not isinstance(body, dict):
            return body
        raw = body.get("input")
        if isinstance(raw, str):
            texts = [raw]
        elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
            texts = list(raw)
        else:
            self._count(endpoint, 0)
            return self._error(400, "input must be a string or a non-empty list of strings")
        self._count(endpoint, len(texts))
        self._tag(request, texts)
        fault = self._pick_fault(request, texts)
        if fault is not None:
            answered = await self._status_fault(request, fault)
            if answered is not None:
                return answered
        if (too_long := self._too_long(texts)) is not None:
            return too_long
        await self.engine.prefill()
        tokens = sum(approx_tokens(t) for t in texts)
        return [judge(t, self.options) for t in texts], fault, tokens

    async def classify(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        with self._inflight():
            result = await self._forward(request, "/classify")
            if not isinstance(result, tuple):
                return result
            judgements, fault, tokens = result
            data = [
                {
                    "index": i,
                    "label": "LABEL_1" if j.prob >= 0.5 else "LABEL_0",
                    "probs": [round(1.0 - j.prob, 6), j.prob],
                    "num_classes": 2,
                }
                for i, j in enumerate(judgements)
            ]
            self.stats.completed += 1
            return web.json_response(
                {
                    "id": self._next_id("classify"),
                    "object": "list",
                    "created": int(time.time()),
                    "model": self.options.model,
                    "data": self._reorder(data, fault),
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

    async def pooling(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        with self._inflight():
            result = await self._forward(request, "/pooling")
            if not isinstance(result, tuple):
                return result
            judgements, fault, tokens = result
            data = []
            for i, j in enumerate(judgements):
                p = min(max(j.prob, 1e-6), 1 - 1e-6)
                data.append({"index": i, "object": "pooling", "data": [math.log(p / (1 - p))]})
            self.stats.completed += 1
            return web.json_response(
                {
                    "id": self._next_id("pool"),
                    "object": "list",
                    "created": int(time.time()),
                    "model": self.options.model,
                    "data": self._reorder(data, fault),
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

    def _inflight(self) -> _Inflight:
        return _Inflight(self.stats)


class _Inflight:
    """Counts a scoring request as in flight for the duration of a `with` block."""

    def __init__(self, stats: SimStats) -> None:
        self._stats = stats

    def __enter__(self) -> None:
        self._stats.inflight += 1
        self._stats.inflight_max = max(self._stats.inflight_max, self._stats.inflight)

    def __exit__(self, *exc: object) -> None:
        self._stats.inflight -= 1


# -- command line ---------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _fault_kind(text: str) -> str:
    kind = text.strip().lower()
    if not is_fault_kind(kind):
        raise argparse.ArgumentTypeError(
            f"unknown fault {text!r} (an HTTP status 400-599, or one of {', '.join(BODY_FAULTS)})"
        )
    return kind


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = SimOptions()
    parser = argparse.ArgumentParser(
        prog="python -m relayrl_testkit.judge_sim",
        description="A simulated vLLM judge (OpenAI-compatible) with continuous-batching "
        "timing and fault injection; see the module docstring for the verdict rules.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind")
    parser.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one")
    parser.add_argument("--model", default=defaults.model, help="the served model name")
    parser.add_argument(
        "--step-s", type=_positive, default=defaults.step_s, help="one decode step, 1 sequence"
    )
    parser.add_argument(
        "--step-growth",
        type=_non_negative,
        default=defaults.step_growth,
        help="extra step cost per additional sequence in the step (fraction of step_s)",
    )
    parser.add_argument(
        "--prefill-s", type=_non_negative, default=defaults.prefill_s, help="prefill per request"
    )
    parser.add_argument(
        "--verdict-tokens",
        type=int,
        default=defaults.verdict_tokens,
        help="words (tokens) each completion decodes",
    )
    parser.add_argument(
        "--time-scale",
        type=_positive,
        default=defaults.time_scale,
        help="multiplies every duration",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="most sequences decoding in one step; the rest wait",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=defaults.max_model_len,
        help="longest prompt in tokens (characters / 4); longer ones get HTTP 400",
    )
    parser.add_argument(
        "--verdict-mode",
        choices=("label", "score"),
        default=defaults.verdict_mode,
        help="label: 'Verdict: Correct|Incorrect'; score: 'Score: <s>'",
    )
    parser.add_argument("--fault", type=_fault_kind, default=None, help="fault for requests")
    parser.add_argument(
        "--fault-count", type=int, default=0, help="requests the fault applies to; 0: all"
    )
    parser.add_argument(
        "--retry-after-s",
        type=_non_negative,
        default=defaults.retry_after_s,
        help="Retry-After of a 429 fault",
    )
    parser.add_argument("--log-level", default="WARNING", help="stderr log level")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    for name in ("verdict_tokens", "max_num_seqs", "max_model_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fault_count < 0:
        parser.error("--fault-count must be >= 0")
    return args


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    options = SimOptions(
        model=args.model,
        step_s=args.step_s,
        step_growth=args.step_growth,
        prefill_s=args.prefill_s,
        verdict_tokens=args.verdict_tokens,
        time_scale=args.time_scale,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        verdict_mode=args.verdict_mode,
        retry_after_s=args.retry_after_s,
    )
    sim = JudgeSim(options, FaultPlan(args.fault, args.fault_count or None))
    access_log = logging.getLogger(f"{logger.name}.access") if args.access_log else None
    runner = web.AppRunner(
        sim.app(),
        handler_cancellation=True,  # vLLM aborts a request whose client went away
        shutdown_timeout=1.0,
        access_log=access_log,
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    sim.engine.start()
    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"judge_sim listening on http://{shown}:{port}", flush=True)
    logger.info("options: %s", options)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sim.engine.stop()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
