"""Model-judged rewards over HTTP: an LLM judge behind an OpenAI-compatible chat API
(`remote`), a generative reward model served by vLLM's completions API (`genrm`), and a
discriminative reward model served by vLLM's classify/pooling API (`disrm`).

The three share one HTTP client (`JudgeClient`): one aiohttp session per manager, created in
the service's event loop on first use and closed by `close()`; at most `max_concurrent`
requests at once; retries of the failures that a second try can fix (connection errors, 5xx,
429 within `retry_after_cap_s`) with jittered exponential backoff; `timeout_s` per HTTP
request, not retried (a hung judge tends to stay hung, and the caller's deadline is running).
A failure is never a score. What each failure becomes:

    connection refused/reset, DNS, 5xx after retries,    INFRA_ERROR
    body not JSON, wrong or missing choices, 4xx
    429 after retries (or Retry-After beyond the cap)    RATE_LIMITED (retry_after_s: header)
    no answer within timeout_s                           TIMEOUT
    400 saying the prompt is too long                    INVALID_INPUT (that item only: a
                                                         batch is bisected to find it)
    a judge text with no verdict in it                   INFRA_ERROR (the judge's failure)

`base_url` is the server root (`http://judge:8000`); `path` is appended, so a hosted API under
a prefix is `base_url: https://api.example.com`, `path: /openai/v1/chat/completions`.

This module imports aiohttp only when a manager first sends a request, so importing the
configs stays cheap.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import email.utils
import json
import logging
import math
import os
import random
import re
import string
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from relayrl.core.config import HttpLinkConfig, StrictModel
from relayrl.reward.items import (
    InfraError,
    InvalidItem,
    RateLimited,
    RewardItem,
    ScoringError,
    ScoringTimeout,
    Status,
    Verdict,
)
from relayrl.reward.managers.base import (
    ManagerConfigBase,
    ManagerContext,
    Outcome,
    RewardManager,
)

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

PLACEHOLDERS = ("prompt", "response", "ground_truth")
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# How servers word "the prompt does not fit the model" (vLLM, OpenAI, TGI, llama.cpp).
_TOO_LONG = re.compile(
    r"maximum context length|context_length_exceeded|maximum model length|max_model_len|"
    r"too long|exceeds the (?:model's )?(?:maximum|context)",
    re.IGNORECASE,
)
_EXCERPT_CHARS = 160
_MESSAGE_CHARS = 1000

DEFAULT_SYSTEM_PROMPT = (
    "You are a strict grader. Compare the submitted answer with the reference answer. "
    "Reason briefly, then end with exactly one line: 'Verdict: Correct' or 'Verdict: Incorrect'."
)
DEFAULT_USER_TEMPLATE = "QUESTION: {prompt}\nANSWER: {response}\nREFERENCE: {ground_truth}"
DEFAULT_GENRM_TEMPLATE = (
    "Grade the answer against the reference. Reason step by step, then end with exactly one "
    "line: 'Verdict: Correct' or 'Verdict: Incorrect'.\n\n"
    "QUESTION: {prompt}\nANSWER: {response}\nREFERENCE: {ground_truth}\n\nGrading:"
)
DEFAULT_DISRM_TEMPLATE = "{prompt}\nANSWER: {response}"


# -- templates ------------------------------------------------------------------------------


def template_fields(template: str) -> frozenset[str]:
    """The placeholders `template` uses; ValueError for any other, for positional `{}`, for a
    format spec or conversion, and for unbalanced braces (write `{{`/`}}` for literal ones)."""
    known = ", ".join("{" + name + "}" for name in PLACEHOLDERS)
    fields: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{exc} (write {{{{ and }}}} for literal braces)") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS:
            raise ValueError(
                f"unknown placeholder {{{name}}} (known: {known}; write {{{{ and }}}} for "
                "literal braces)"
            )
        if spec or conversion:
            raise ValueError(f"placeholder {{{name}}} takes no format spec or conversion")
        fields.add(name)
    return frozenset(fields)


def render(template: str, item: RewardItem) -> str:
    return template.format_map(
        {"prompt": item.prompt, "response": item.response, "ground_truth": item.ground_truth}
    )


def _check_template(template: str, *, needs_response: bool = True) -> str:
    fields = template_fields(template)
    if needs_response and "response" not in fields:
        raise ValueError("the template must contain {response}: the judge has to see the answer")
    return template


# -- verdicts -------------------------------------------------------------------------------


class VerdictConfig(StrictModel):
    """How a judge's text becomes a Verdict (`verdict:` of a remote or genrm manager). The
    last match in the text wins, because judges reason (and may quote verdicts) before they
    conclude."""

    mode: Literal["label", "score"] = Field(
        "label",
        description="label: correct_pattern gives 1.0 (OK), incorrect_pattern 0.0 "
        "(POLICY_FAIL); score: the number captured by score_pattern.",
    )
    correct_pattern: str = Field(
        r"verdict\s*:\s*\**\s*correct\b",
        min_length=1,
        max_length=1000,
        description="Regex of a 'correct' verdict (label mode).",
    )
    incorrect_pattern: str = Field(
        r"verdict\s*:\s*\**\s*incorrect\b",
        min_length=1,
        max_length=1000,
        description="Regex of an 'incorrect' verdict (label mode).",
    )
    score_pattern: str = Field(
        r"score\s*:\s*\**\s*([-+]?\d+(?:\.\d+)?)",
        min_length=1,
        max_length=1000,
        description="Regex with exactly one group capturing the score (score mode).",
    )
    ignore_case: bool = Field(True, description="Match the patterns case-insensitively.")
    score_range: tuple[float, float] | None = Field(
        (0.0, 1.0),
        description="[lo, hi] of the judge's scale, mapped to [0, 1]; a score outside it is the "
        "judge failing (INFRA_ERROR). null: keep the raw score.",
    )
    fail_below: float | None = Field(
        None,
        ge=-1e9,
        le=1e9,
        description="Score mode: a (mapped) score below this is POLICY_FAIL; null: always OK.",
    )

    @field_validator("correct_pattern", "incorrect_pattern", "score_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a valid regex: {exc}") from None
        return pattern

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        groups = re.compile(pattern).groups
        if groups != 1:
            raise ValueError(f"needs exactly one capturing group, has {groups}")
        return pattern

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None:
            lo, hi = value
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(f"needs finite lo < hi, got [{lo}, {hi}]")
        return value


class VerdictParser:
    """A VerdictConfig with its patterns compiled once."""

    def __init__(self, config: VerdictConfig) -> None:
        flags = re.IGNORECASE if config.ignore_case else 0
        self.config = config
        self._correct = re.compile(config.correct_pattern, flags)
        self._incorrect = re.compile(config.incorrect_pattern, flags)
        self._score = re.compile(config.score_pattern, flags)

    def parse(self, text: str, finish_reason: str | None = None) -> Verdict:
        """The verdict in `text`; InfraError when there is none (never a 0 score)."""
        if self.config.mode == "score":
            return self._parse_score(text, finish_reason)
        best: tuple[int, int, bool] | None = None  # (end, -start, correct)
        for pattern, correct in ((self._correct, True), (self._incorrect, False)):
            for match in pattern.finditer(text):
                # Latest end wins; on a tie the longer match ("incorrect" over "correct").
                key = (match.end(), -match.start(), correct)
                if best is None or key[:2] > best[:2]:
                    best = key
        if best is None:
            raise self._unparseable(text, finish_reason, "correct_pattern or incorrect_pattern")
        if best[2]:
            return Verdict(1.0, Status.OK, message="judge: correct")
        return Verdict(0.0, Status.POLICY_FAIL, message="judge: incorrect")

    def _parse_score(self, text: str, finish_reason: str | None) -> Verdict:
        matches = list(self._score.finditer(text))
        if not matches:
            raise self._unparseable(text, finish_reason, "score_pattern")
        captured = matches[-1].group(1)
        try:
            raw = float(captured)
        except (TypeError, ValueError):
            raise InfraError(
                f"judge verdict unparseable: score {captured!r} is not a number"
            ) from None
        if not math.isfinite(raw):
            raise InfraError(f"judge verdict unparseable: score {captured!r} is not finite")
        score = raw
        if self.config.score_range is not None:
            lo, hi = self.config.score_range
            if not lo <= raw <= hi:
                raise InfraError(f"judge score {raw:g} is outside score_range [{lo:g}, {hi:g}]")
            score = (raw - lo) / (hi - lo)
        fail_below = self.config.fail_below
        status = Status.POLICY_FAIL if fail_below is not None and score < fail_below else Status.OK
        return Verdict(score, status, components={"judge_raw_score": raw})

    @staticmethod
    def _unparseable(text: str, finish_reason: str | None, what: str) -> InfraError:
        tail = text[-_EXCERPT_CHARS:]
        hint = ""
        if finish_reason == "length":
            hint = " (the judge stopped at max_tokens: raise max_tokens)"
        return InfraError(
            f"judge verdict unparseable: no match for {what} in {len(text)} characters{hint}; "
            f"text ends {tail!r}"
        )


# -- the HTTP client ------------------------------------------------------------------------


class HttpJudgeConfigBase(ManagerConfigBase):
    """Fields of every judge reached over HTTP."""

    base_url: str = Field(
        ...,
        min_length=8,
        max_length=2000,
        description="Server root, e.g. http://judge:8000 (path is appended).",
    )
    model: str = Field(..., min_length=1, max_length=500, description="Model name to request.")
    api_key_env: str | None = Field(
        None,
        pattern=_ENV_NAME,
        description="Name of the environment variable holding the API key (sent as a Bearer "
        "token); never the key itself. null: no Authorization header.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="Extra HTTP headers sent with every request."
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra JSON fields of every request body (seed, top_p, ...); the "
        "manager's own fields (model, prompt, max_tokens, ...) take precedence.",
    )
    require_ground_truth: bool = Field(
        True,
        description="Reject items without ground_truth (INVALID_INPUT) when the template uses "
        "{ground_truth}.",
    )
    max_concurrent: int = Field(
        64, ge=1, le=4096, description="Most HTTP requests of this manager in flight at once."
    )
    http: HttpLinkConfig = Field(
        default_factory=HttpLinkConfig,
        description="How a silent judge is noticed: the connect deadline, and TCP keepalive "
        "under every request (timeout_s, when set, bounds the request itself).",
    )
    max_retries: int = Field(
        2,
        ge=0,
        le=20,
        description="Retries of a retriable failure (connection error, 5xx, 429).",
    )
    backoff_initial_s: float = Field(
        0.5, ge=0.0, le=600.0, description="Backoff before the first retry; doubles each retry."
    )
    backoff_max_s: float = Field(10.0, ge=0.0, le=3600.0, description="Longest backoff.")
    retry_after_cap_s: float = Field(
        30.0,
        ge=0.0,
        le=3600.0,
        description="Longest Retry-After (of a 429) worth waiting for; a longer one ends the "
        "call at once as RATE_LIMITED, so the caller can decide.",
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s?#]+(/[^\s?#]*)?$", url):
            raise ValueError(f"needs an http:// or https:// URL without query, got {url!r}")
        return url.rstrip("/")

    @field_validator("headers")
    @classmethod
    def _no_auth_header(cls, headers: dict[str, str]) -> dict[str, str]:
        if any(name.lower() == "authorization" for name in headers):
            raise ValueError("put the key in an environment variable and name it in api_key_env")
        return headers

    @model_validator(mode="after")
    def _backoff_order(self) -> HttpJudgeConfigBase:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        return self

    def api_key(self) -> str | None:
        """The key from `api_key_env`; ValueError when the variable is named but not set."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(
                f"api_key_env names {self.api_key_env}, which is not set in the environment"
            )
        return key


class JudgeClient:
    """One judge server: an aiohttp session made on first use, the concurrency limit, retries
    and the mapping of HTTP failures to ScoringErrors."""

    def __init__(self, config: HttpJudgeConfigBase, path: str) -> None:
        self._config = config
        self.url = config.base_url + path
        self._headers = {"Content-Type": "application/json", **config.headers}
        if (key := config.api_key()) is not None:
            self._headers["Authorization"] = f"Bearer {key}"
        self._session: aiohttp.ClientSession | None = None
        self._semaphore = asyncio.Semaphore(config.max_concurrent)
        self._random = random.Random()
        self.requests_sent = 0

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        from relayrl.core.sockets import keepalive_socket_factory

        if self._session is None or self._session.closed:
            http = self._config.http
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._config.max_concurrent,
                    socket_factory=keepalive_socket_factory(http.tcp_keepalive),
                ),
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=self._config.timeout_s, sock_connect=http.connect_timeout_s
                ),
            )
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def _backoff(self, attempt: int) -> float:
        config = self._config
        delay = min(config.backoff_max_s, config.backoff_initial_s * 2**attempt)
        return delay * self._random.uniform(0.5, 1.0)

    async def post(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """POST `payload` (JSON) and return the JSON object answered, or raise the
        ScoringError the failure maps to."""
        import aiohttp

        config = self._config
        body = json.dumps(payload).encode()
        attempts = config.max_retries + 1
        for attempt in range(attempts):
            retry_after: float | None = None
            try:
                status, headers, raw = await self._send(body)
            except TimeoutError:
                raise ScoringTimeout(
                    f"judge {self.url} did not answer within timeout_s={config.timeout_s}s"
                ) from None
            except aiohttp.ClientError as exc:
                failure: ScoringError = InfraError(
                    f"judge {self.url} unreachable: {type(exc).__name__}: {exc}"
                )
            else:
                if status == 200:
                    return self._json(raw)
                message = _error_message(raw)
                if status == 429:
                    retry_after = _retry_after(headers.get("Retry-After"))
                    failure = RateLimited(
                        f"judge {self.url} rate-limited the call (HTTP 429): {message}",
                        retry_after_s=retry_after or 0.0,
                    )
                    if retry_after is not None and retry_after > config.retry_after_cap_s:
                        raise failure
                elif status >= 500:
                    failure = InfraError(f"judge {self.url} answered HTTP {status}: {message}")
                elif status in (400, 413, 422) and _TOO_LONG.search(message):
                    raise InvalidItem(f"judge refused the prompt as too long: {message}")
                else:
                    raise InfraError(
                        f"judge {self.url} answered HTTP {status}: {message}{_hint(status)}"
                    )
            if attempt + 1 == attempts:
                if attempts > 1:
                    failure.message += f" (after {attempts} attempts)"
                    failure.args = (failure.message,)
                raise failure
            delay = retry_after if retry_after is not None else self._backoff(attempt)
            logger.debug("retrying %s in %.2fs: %s", self.url, delay, failure.message)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _send(self, body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        async with self._semaphore:
            session = self._open()
            self.requests_sent += 1
            async with session.post(self.url, data=body) as response:
                return response.status, response.headers, await response.read()

    def _json(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InfraError(
                f"judge {self.url} answered HTTP 200 with a body that is not JSON: "
                f"{raw[:_EXCERPT_CHARS]!r}"
            ) from None
        if not isinstance(body, dict):
            raise InfraError(
                f"judge {self.url} answered a JSON {type(body).__name__}, not an object"
            )
        return body


def _error_message(raw: bytes) -> str:
    """The error text of an OpenAI-shaped (`{"error": {"message"}}`) or vLLM-shaped
    (`{"message"}`) error body, else the start of the body."""
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:_EXCERPT_CHARS].strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:_MESSAGE_CHARS]
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return body[key][:_MESSAGE_CHARS]
    return text[:_EXCERPT_CHARS]


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _hint(status: int) -> str:
    if status in (401, 403):
        return " (check the key in api_key_env)"
    if status == 404:
        return " (check base_url, which is the server root, path and model)"
    return ""


def _by_index(entries: Any, count: int, what: str, url: str) -> list[dict[str, Any] | ScoringError]:
    """Map a batched answer's entries (each with `index`) back to the `count` inputs, whatever
    their order. An input without an entry gets an InfraError; an entry with a bad, duplicate or
    out-of-range index makes the whole mapping untrustworthy, so every input gets one."""
    if not isinstance(entries, list):
        error = InfraError(f"judge {url} answered without a {what} list")
        return [copy.copy(error) for _ in range(count)]
    found: dict[int, dict[str, Any]] = {}
    for entry in entries:
        index = entry.get("index") if isinstance(entry, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            problem = f"an entry with index {index!r}"
        elif index in found:
            problem = f"two entries for index {index}"
        else:
            found[index] = entry  # type: ignore[assignment]
            continue
        error = InfraError(
            f"judge {url} answered {problem} ({len(entries)} {what} for {count} inputs)"
        )
        return [copy.copy(error) for _ in range(count)]
    return [
        found[i]
        if i in found
        else InfraError(
            f"judge {url} answered no {what} entry for input {i} "
            f"({len(entries)} {what} for {count} inputs)"
        )
        for i in range(count)
    ]


class _HttpJudgeManager(RewardManager):
    """What the three judge managers share: the client, ground-truth checks, close()."""

    def __init__(
        self,
        name: str,
        config: HttpJudgeConfigBase,
        path: str,
        template: str,
        other_templates: Sequence[str] = (),
    ) -> None:
        super().__init__(name, max_concurrent=config.max_concurrent)
        self.config = config
        self.client = JudgeClient(config, path)
        self._template = template
        self._needs_ground_truth = any(
            "ground_truth" in template_fields(t) for t in (template, *other_templates)
        )

    def validate(self, item: RewardItem) -> None:
        needs = self._needs_ground_truth and self.config.require_ground_truth
        if needs and not item.ground_truth:
            raise InvalidItem(
                f"item {item.item_id!r}: manager {self.name!r} compares with the ground "
                "truth, and the item has none"
            )

    async def close(self) -> None:
        await self.client.close()


class _BatchJudgeManager(_HttpJudgeManager, abc.ABC):
    """A judge whose API takes many inputs in one request (completions, classify): one
    request per batch, answers matched back to items by their index."""

    supports_batch: ClassVar[bool] = True

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        if not items:
            return []
        return await self._batched(items, [render(self._template, item) for item in items])

    async def _batched(self, items: Sequence[RewardItem], texts: list[str]) -> list[Outcome]:
        """One request for all items; a too-long refusal is bisected down to the item(s) that
        caused it, so the others are still scored."""
        try:
            body = await self.client.post(self._payload(texts))
        except InvalidItem as exc:
            if len(items) == 1:
                return [exc]
            half = len(items) // 2
            first, second = await asyncio.gather(
                self._batched(items[:half], texts[:half]),
                self._batched(items[half:], texts[half:]),
            )
            return first + second
        except ScoringError as exc:
            return [copy.copy(exc) for _ in items]
        return self._outcomes(body, len(items))

    @abc.abstractmethod
    def _payload(self, texts: list[str]) -> dict[str, Any]:
        """The request body carrying every text."""

    @abc.abstractmethod
    def _outcomes(self, body: dict[str, Any], count: int) -> list[Outcome]:
        """One outcome per input, in input order, from the response body."""


# -- remote: a chat-completions judge -------------------------------------------------------


class RemoteConfig(HttpJudgeConfigBase):
    """An LLM judge behind an OpenAI-compatible chat-completions API (a hosted judge, or any
    vLLM/TGI server). One HTTP request per item: chat APIs take one conversation a request."""

    type: Literal["remote"] = Field("remote", description="Manager type.")
    path: str = Field(
        "/v1/chat/completions",
        pattern=r"^/",
        max_length=500,
        description="Appended to base_url.",
    )
    system_prompt: str = Field(
        DEFAULT_SYSTEM_PROMPT,
        max_length=100_000,
        description="The system message; empty: none is sent.",
    )
    user_template: str = Field(
        DEFAULT_USER_TEMPLATE,
        min_length=1,
        max_length=100_000,
        description="The user message, with {prompt} {response} {ground_truth} filled in "
        "({{ and }} for literal braces).",
    )
    max_tokens: int = Field(1024, ge=1, le=1_000_000, description="Judge's max_tokens.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Judge's sampling temperature.")
    verdict: VerdictConfig = Field(
        default_factory=VerdictConfig, description="How the judge's text becomes a verdict."
    )

    @field_validator("user_template")
    @classmethod
    def _template_fields(cls, template: str) -> str:
        return _check_template(template)

    @field_validator("system_prompt")
    @classmethod
    def _plain_system(cls, value: str) -> str:
        template_fields(value)  # the system prompt is filled in too: same rules
        return value

    def build(self, name: str, context: ManagerContext) -> RemoteManager:
        return RemoteManager(name, self)


class RemoteManager(_HttpJudgeManager):
    """Scores each item with one chat-completions request to the judge."""

    supports_batch: ClassVar[bool] = False
    type_name: ClassVar[str] = "remote"

    def __init__(self, name: str, config: RemoteConfig) -> None:
        super().__init__(name, config, config.path, config.user_template, [config.system_prompt])
        self.config: RemoteConfig = config
        self._parser = VerdictParser(config.verdict)

    async def score(self, item: RewardItem) -> Verdict:
        config = self.config
        messages = []
        if config.system_prompt:
            messages.append({"role": "system", "content": render(config.system_prompt, item)})
        messages.append({"role": "user", "content": render(config.user_template, item)})
        payload = {
            **config.extra_body,
            "model": config.model,
            "messages": messages,
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
        }
        body = await self.client.post(payload)
        choices = body.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            count = len(choices) if isinstance(choices, list) else "no"
            raise InfraError(f"judge {self.client.url} answered {count} choices, expected 1")
        choice = choices[0]
        message = choice.get("message") if isinstance(choice, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            raise InfraError(f"judge {self.client.url} answered a choice without text content")
        return self._parser.parse(content, choice.get("finish_reason"))


# -- genrm: a generative reward model on vLLM's completions API -----------------------------


class GenRMConfig(HttpJudgeConfigBase):
    """A generative reward model served by vLLM: `score_batch` sends ONE /v1/completions
    request whose `prompt` is the list of every item's prompt, so vLLM batches them."""

    type: Literal["genrm"] = Field("genrm", description="Manager type.")
    path: str = Field(
        "/v1/completions", pattern=r"^/", max_length=500, description="Appended to base_url."
    )
    prompt_template: str = Field(
        DEFAULT_GENRM_TEMPLATE,
        min_length=1,
        max_length=100_000,
        description="The whole prompt (chat template already applied, if the model needs one), "
        "with {prompt} {response} {ground_truth} filled in ({{ and }} for literal braces).",
    )
    max_tokens: int = Field(1024, ge=1, le=1_000_000, description="Tokens per verdict, at most.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature.")
    verdict: VerdictConfig = Field(
        default_factory=VerdictConfig, description="How the model's text becomes a verdict."
    )
    max_concurrent: int = Field(
        16, ge=1, le=4096, description="Most batch requests of this manager in flight at once."
    )

    @field_validator("prompt_template")
    @classmethod
    def _template_fields(cls, template: str) -> str:
        return _check_template(template)

    def build(self, name: str, context: ManagerContext) -> GenRMManager:
        return GenRMManager(name, self)


class GenRMManager(_BatchJudgeManager):
    """One completions request per batch; choices are matched to items by their `index`."""

    supports_batch: ClassVar[bool] = True
    type_name: ClassVar[str] = "genrm"

    def __init__(self, name: str, config: GenRMConfig) -> None:
        super().__init__(name, config, config.path, config.prompt_template)
        self.config: GenRMConfig = config
        self._parser = VerdictParser(config.verdict)

    def _payload(self, texts: list[str]) -> dict[str, Any]:
        config = self.config
        return {
            **config.extra_body,
            "model": config.model,
            "prompt": texts,
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
            "n": 1,
        }

    def _outcomes(self, body: dict[str, Any], count: int) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for entry in _by_index(body.get("choices"), count, "choices", self.client.url):
            if isinstance(entry, ScoringError):
                outcomes.append(entry)
                continue
            text = entry.get("text")
            if not isinstance(text, str):
                outcomes.append(
                    InfraError(f"judge {self.client.url} answered a choice without text")
                )
                continue
            try:
                outcomes.append(self._parser.parse(text, entry.get("finish_reason")))
            except ScoringError as exc:
                outcomes.append(exc)
        return outcomes


# -- disrm: a discriminative reward model on vLLM's classify / pooling API ------------------


class DisRMConfig(HttpJudgeConfigBase):
    """A discriminative reward model (a classifier or value head) served by vLLM: one forward
    per item, all items of a batch in ONE request (`input` is a list)."""

    type: Literal["disrm"] = Field("disrm", description="Manager type.")
    api: Literal["classify", "pooling"] = Field(
        "classify",
        description="classify: POST /classify, score = probs[label_index] (the only value of a "
        "one-class head); pooling: POST /pooling, score = the last value of the pooled output "
        "(a reward head's raw value).",
    )
    path: str | None = Field(
        None,
        pattern=r"^/",
        max_length=500,
        description="Appended to base_url; null: /classify or /pooling, after api.",
    )
    input_template: str = Field(
        DEFAULT_DISRM_TEMPLATE,
        min_length=1,
        max_length=100_000,
        description="The text classified, with {prompt} {response} {ground_truth} filled in "
        "({{ and }} for literal braces).",
    )
    label_index: int = Field(
        1, ge=0, le=100_000, description="Class whose probability is the score (classify)."
    )
    fail_below: float | None = Field(
        None,
        ge=-1e9,
        le=1e9,
        description="A score below this is POLICY_FAIL; null: every score is OK.",
    )
    max_concurrent: int = Field(
        16, ge=1, le=4096, description="Most batch requests of this manager in flight at once."
    )

    @field_validator("input_template")
    @classmethod
    def _template_fields(cls, template: str) -> str:
        return _check_template(template)

    def build(self, name: str, context: ManagerContext) -> DisRMManager:
        return DisRMManager(name, self)


class DisRMManager(_BatchJudgeManager):
    """One classify (or pooling) request per batch; entries matched to items by `index`."""

    supports_batch: ClassVar[bool] = True
    type_name: ClassVar[str] = "disrm"

    def __init__(self, name: str, config: DisRMConfig) -> None:
        path = config.path or ("/classify" if config.api == "classify" else "/pooling")
        super().__init__(name, config, path, config.input_template)
        self.config: DisRMConfig = config

    def _payload(self, texts: list[str]) -> dict[str, Any]:
        return {**self.config.extra_body, "model": self.config.model, "input": texts}

    def _outcomes(self, body: dict[str, Any], count: int) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for entry in _by_index(body.get("data"), count, "data", self.client.url):
            if isinstance(entry, ScoringError):
                outcomes.append(entry)
                continue
            try:
                score = self._value(entry)
            except InfraError as exc:
                outcomes.append(exc)
                continue
            fail_below = self.config.fail_below
            failed = fail_below is not None and score < fail_below
            outcomes.append(Verdict(score, Status.POLICY_FAIL if failed else Status.OK))
        return outcomes

    def _value(self, entry: dict[str, Any]) -> float:
        if self.config.api == "classify":
            values = entry.get("probs")
            if not isinstance(values, list) or not values:
                raise InfraError(f"judge {self.client.url} answered an entry without probs")
            if len(values) == 1:
                value = values[0]
            elif self.config.label_index < len(values):
                value = values[self.config.label_index]
            else:
                raise InfraError(
                    f"label_index {self.config.label_index} is beyond the judge's "
                    f"{len(values)} classes"
                )
        else:
            value = _last_number(entry.get("data"))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InfraError(f"judge {self.client.url} answered a non-numeric score {value!r}")
        if not math.isfinite(value):
            raise InfraError(f"judge {self.client.url} answered a non-finite score {value!r}")
        return float(value)


def _last_number(data: Any) -> Any:
    """The last element of a (possibly nested) pooled output: a sequence-level value, or the
    reward at the last token of a token-level one."""
    while isinstance(data, list) and data:
        data = data[-1]
    return data
