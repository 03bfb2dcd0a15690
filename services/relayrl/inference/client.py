"""The seam between the gateway and an inference engine: `EngineClient`, and its real
implementation over a vLLM server's HTTP API (`VllmEngineClient`).

Token ids in, token ids out: the gateway never re-tokenises an engine's text, so multi-turn
prompts stay byte-identical prefixes and the trainer sees exactly the tokens that were
sampled, with their log-probs and the weight version that sampled each span.
"""

from __future__ import annotations

import abc
import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from relayrl.inference.config import EngineHttpConfig

if TYPE_CHECKING:
    import aiohttp

PauseMode = Literal["abort", "keep", "wait"]


# --- domain ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings, matched by the engine on the detokenised text; the tokens stay in the
    # generation (the text is cut by whoever decodes it: `text_before_stop`).
    stop: tuple[str, ...] = ()
    # Alternatives per generated token to return besides the sampled token's log-prob.
    top_logprobs: int = 0
    # Generate max_tokens whatever the model says (benchmarks, tests of long rollouts).
    ignore_eos: bool = False
    # An engine-side constraint on the sampled text, in vLLM's `structured_outputs` form
    # ({"regex": ...}, {"json": schema}, {"choice": [...]}, ...); agents steer tool calls with it.
    structured_outputs: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"temperature must be in [0, 100] and top_p in (0, 1], got "
                f"{self.temperature}, {self.top_p}"
            )


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if not self.request_id:
            raise ValueError("request_id must be non-empty (it routes and aborts the request)")


@dataclass(frozen=True)
class VersionSpan:
    """Generated tokens [start, end) were sampled by weights labelled `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class Generation:
    request_id: str
    token_ids: tuple[int, ...]
    # Log-prob of each sampled token under the engine's weights (the rollout log-probs).
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop", "length", "abort"
    version_spans: tuple[VersionSpan, ...]
    # The stop string that ended the generation (None: EOS, a stop token, the length).
    stop_string: str | None = None
    # Per token, the engine's most likely alternatives as (token id, log-prob), best first
    # (SamplingOptions.top_logprobs of them); empty unless asked for.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


def text_before_stop(text: str, stop_string: str | None, include_stop: bool) -> tuple[str, str]:
    """A generation's decoded `text` cut where vLLM cuts it for the stop string that ended it:
    before the stop string (after it with `include_stop`); returns (kept, cut off). What the
    last token decodes to beyond the stop string is cut off too. A stop string the full
    decoding does not contain (it decodes differently from the engine's incremental one)
    cuts nothing."""
    at = text.find(stop_string) if stop_string else -1
    if at < 0:
        return text, ""
    end = at + len(stop_string) if include_stop and stop_string else at
    return text[:end], text[end:]


class EngineError(Exception):
    """The engine could not serve the call."""


class EngineUnavailable(EngineError):
    """Unreachable, dead, or failing (5xx): an infrastructure failure, never the policy's."""


class EngineRejected(EngineError):
    """The engine refused the request as malformed (4xx): the caller's mistake."""


# --- the seam --------------------------------------------------------------------------------


class EngineClient(abc.ABC):
    """What the gateway needs from one engine replica."""

    name: str

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> Generation:
        """Sample a continuation of `request.prompt_token_ids`."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine answers its health check."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode) -> None:
        """Stop generating: abort in-flight requests, keep them frozen, or wait for them."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def is_paused(self) -> bool: ...

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop cached KV (it was computed by the old weights)."""

    @abc.abstractmethod
    async def weight_version(self) -> str: ...

    @abc.abstractmethod
    async def set_weight_version(self, version: str) -> None:
        """Label the weights now loaded; spans sampled from now on carry this version."""

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None: ...

    @abc.abstractmethod
    async def worker_rpc(self, method: str, payload: dict[str, Any]) -> list[Any]:
        """Call a relayrl worker-extension method on every worker; one answer per worker."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""


# --- vLLM over HTTP --------------------------------------------------------------------------


# How long an idle connection to an engine is kept for reuse: below the engine's own keep-alive
# (vLLM's uvicorn closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s). aiohttp's
# default, 15 s, could reuse a connection the engine was closing at that moment; the request then
# failed with ServerDisconnectedError and its rollout failed as infra (seen in bench-agents after
# a pause between rounds).
KEEPALIVE_S = 3.0


class VllmEngineClient(EngineClient):
    """A vLLM server started by `relayrl engine` (dev-mode RL endpoints, scale-out generate
    endpoint, relayrl's worker extension)."""

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        http: EngineHttpConfig | None = None,
        request_timeout_s: float = 600.0,
        rpc_timeout_s: float | None = None,
        token: str | None = None,
    ) -> None:
        """`http`: the connection's bounds, and those of control calls and health checks
        (EngineHttpConfig's defaults when None); `request_timeout_s`: the deadline of a
        generation (and of a pause that waits for generations); `rpc_timeout_s`: of a worker
        RPC, e.g. a weight load (None: a control call's); `token`: sent as
        `Authorization: Bearer` to an engine that checks its callers (relayrl.engine.guard)."""
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.name = name or self.base_url
        self.bounds = http or EngineHttpConfig()
        self._request_timeout_s = request_timeout_s
        self._rpc_timeout_s = rpc_timeout_s or self.bounds.control_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        import aiohttp

        from relayrl.core.sockets import keepalive_socket_factory

        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=0,
                keepalive_timeout=KEEPALIVE_S,
                socket_factory=keepalive_socket_factory(self.bounds.tcp_keepalive),
            )
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, headers=self._headers
            )
        return self._session

    def call_timeout(self, total_s: float | None = None) -> aiohttp.ClientTimeout:
        """The bounds of one call: `total_s` (a control call's deadline when None), and the
        connection's own."""
        import aiohttp

        return aiohttp.ClientTimeout(
            total=total_s or self.bounds.control_timeout_s,
            sock_connect=self.bounds.connect_timeout_s,
        )

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        import aiohttp

        timeout = self.call_timeout(timeout_s)
        url = self.base_url + path
        try:
            async with self._http().request(
                method, url, json=body, params=params, timeout=timeout
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"engine {self.name}: {method} {path} failed: {exc!r}") from exc
        if status >= 500:
            raise EngineUnavailable(f"engine {self.name}: {path} answered {status}: {_detail(raw)}")
        if status >= 400:
            raise EngineRejected(f"engine {self.name}: {path} answered {status}: {_detail(raw)}")
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise EngineUnavailable(f"engine {self.name}: {path} answered invalid JSON") from exc

    async def generate(self, request: GenerateRequest) -> Generation:
        sampling = request.sampling
        params: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            # the sampled token's own log-prob, and as many alternatives as asked for
            "logprobs": sampling.top_logprobs,
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.ignore_eos:
            params["ignore_eos"] = True
        if sampling.structured_outputs:
            params["structured_outputs"] = dict(sampling.structured_outputs)
        body = {
            "request_id": request.request_id,
            "token_ids": list(request.prompt_token_ids),
            "sampling_params": params,
        }
        answer = await self._call(
            "POST", "/inference/v1/generate", body=body, timeout_s=self._request_timeout_s
        )
        return _generation(request.request_id, answer, self.name, sampling.top_logprobs)

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=self.bounds.health_timeout_s)
        except EngineError:
            return False
        return True

    async def pause(self, mode: PauseMode) -> None:
        # `wait` lasts until the generations in flight end: their deadline, not a control call's
        timeout_s = self._request_timeout_s if mode == "wait" else None
        await self._call("POST", "/pause", params={"mode": mode}, timeout_s=timeout_s)

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def reset_prefix_cache(self) -> None:
        await self._call("POST", "/reset_prefix_cache")

    async def weight_version(self) -> str:
        return str((await self._call("GET", "/weight_info"))["weight_version"])

    async def set_weight_version(self, version: str) -> None:
        await self._call("POST", "/update_weight_version", body={"new_version": version})

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._call("POST", "/abort_requests", body={"request_ids": list(request_ids)})

    async def worker_rpc(self, method: str, payload: dict[str, Any]) -> list[Any]:
        if not method.startswith("relayrl_"):
            raise ValueError(f"{method!r} is not a relayrl worker-extension method")
        body = {"method": method, "args": [json.dumps(payload)]}
        answer = await self._call(
            "POST", "/collective_rpc", body=body, timeout_s=self._rpc_timeout_s
        )
        return list(answer["results"]) if answer else []

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            # aiohttp closes connections on the next loop iteration.
            await asyncio.sleep(0)


def _detail(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error") or data.get("detail") or data
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:300]
    return str(data)[:300]


def _generation(request_id: str, answer: Any, engine: str, top: int = 0) -> Generation:
    try:
        (choice,) = answer["choices"]
        token_ids = tuple(int(t) for t in choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = tuple(float(entry["logprob"]) for entry in content)
        alternatives = tuple(_alternatives(entry, top) for entry in content) if top else ()
        spans = tuple(
            VersionSpan(str(span["version"]), int(span["start"]), int(span["end"]))
            for span in choice.get("weight_versions") or []
        )
        finish_reason = str(choice.get("finish_reason") or "")
        stop_reason = choice.get("stop_reason")
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineUnavailable(f"engine {engine}: malformed generate answer: {exc!r}") from exc
    if len(logprobs) != len(token_ids) or any(math.isnan(lp) for lp in logprobs):
        raise EngineUnavailable(
            f"engine {engine}: {len(logprobs)} log-probs for {len(token_ids)} tokens"
        )
    stop_string = stop_reason if isinstance(stop_reason, str) and stop_reason else None
    return Generation(
        request_id, token_ids, logprobs, finish_reason, spans, stop_string, alternatives
    )


def _alternatives(entry: Mapping[str, Any], top: int) -> tuple[tuple[int, float], ...]:
    """One position's `top` most likely tokens. The engine lists the sampled token first (it
    may not be among the most likely), then its top candidates."""
    best: dict[int, float] = {}
    for candidate in entry.get("top_logprobs") or ():
        best[int(candidate["token_id"])] = float(candidate["logprob"])
    return tuple(sorted(best.items(), key=lambda item: -item[1])[:top])
