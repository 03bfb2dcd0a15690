"""One trajectory's engine session, and the trajectory record it becomes.

`StickySession` keeps every turn of a trajectory on the replica the pool picked for it and
carries a generation across a weight update's pause; `trajectory_of` and `failed_trajectory`
write what the gateway puts into the TransferQueue. Both the rollout loop and the agent
endpoint's sessions use them, so they sit below both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from relayrl.gateway.agents import Rollout
from relayrl.gateway.replicas import ReplicaPool
from relayrl.inference.client import (
    EngineUnavailable,
    GenerateRequest,
    Generation,
    SamplingOptions,
    VersionSpan,
)
from relayrl.proto.common.v1 import common_pb2

logger = logging.getLogger(__name__)


class EngineTimeout(Exception):
    """A generate call ran past the gateway's request timeout."""


class StickySession:
    """The EngineSession of one trajectory: every turn goes to the replica the pool picked for
    the session, while that replica serves.

    Partial rollout across a weight update: when a pause in `abort` mode cuts a generation
    short (finish_reason "abort"), the session waits for the replicas to resume and sends the
    prompt plus the tokens kept so far, asking only for the rest of the budget; the caller
    gets one Generation whose version spans show which weights sampled which tokens. In `keep`
    mode the engine itself continues the frozen request under the new version."""

    def __init__(self, pool: ReplicaPool, session_id: str, request_timeout_s: float) -> None:
        self._pool = pool
        self._session_id = session_id
        self._request_timeout_s = request_timeout_s
        self._num_requests = 0
        self.replica_id = ""

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions
    ) -> Generation:
        prompt = tuple(prompt_token_ids)
        token_ids: list[int] = []
        logprobs: list[float] = []
        alternatives: list[tuple[tuple[int, float], ...]] = []
        spans: list[VersionSpan] = []
        while True:
            remaining = sampling.max_tokens - len(token_ids)
            part = await self._generate_once(
                prompt + tuple(token_ids), dataclasses.replace(sampling, max_tokens=remaining)
            )
            offset = len(token_ids)
            spans += [
                VersionSpan(s.version, s.start + offset, s.end + offset) for s in part.version_spans
            ]
            token_ids += part.token_ids
            logprobs += part.logprobs
            alternatives += part.top_logprobs
            finish_reason = part.finish_reason
            if finish_reason != "abort":
                break
            if len(token_ids) >= sampling.max_tokens:
                finish_reason = "length"
                break
            logger.debug(
                "%s: aborted by a pause after %d tokens; resubmitting",
                self._session_id,
                len(token_ids),
            )
        return Generation(
            part.request_id,
            tuple(token_ids),
            tuple(logprobs),
            finish_reason,
            tuple(_merge(spans)),
            stop_string=part.stop_string,
            top_logprobs=tuple(alternatives),
        )

    async def _generate_once(
        self, prompt_token_ids: tuple[int, ...], sampling: SamplingOptions
    ) -> Generation:
        await self._pool.wait_routable(self._request_timeout_s)
        replica = self._pool.pick(self._session_id)
        self.replica_id = replica.replica_id
        request_id = f"{self._session_id}-r{self._num_requests}"
        self._num_requests += 1
        request = GenerateRequest(request_id, prompt_token_ids, sampling)
        metrics, name = self._pool.metrics, replica.replica_id
        started = time.monotonic()
        outcome = "error"
        async with self._pool.request(replica):
            try:
                async with asyncio.timeout(self._request_timeout_s):
                    generation = await replica.client.generate(request)
                outcome = "aborted" if generation.finish_reason == "abort" else "ok"
                metrics.engine_tokens.labels(replica=name).inc(len(generation.token_ids))
                return generation
            except TimeoutError:
                raise EngineTimeout(
                    f"replica {name} did not answer in {self._request_timeout_s} s"
                ) from None
            except EngineUnavailable as exc:
                self._pool.mark_unhealthy(replica, str(exc))
                raise
            finally:
                metrics.engine_requests.labels(replica=name, outcome=outcome).inc()
                metrics.engine_request_duration.labels(replica=name).observe(
                    time.monotonic() - started
                )


def _merge(spans: list[VersionSpan]) -> list[VersionSpan]:
    """Adjacent spans of the same version as one (a resubmission under unchanged weights)."""
    merged: list[VersionSpan] = []
    for span in spans:
        if span.start == span.end:
            continue
        if merged and merged[-1].version == span.version and merged[-1].end == span.start:
            merged[-1] = VersionSpan(span.version, merged[-1].start, span.end)
        else:
            merged.append(span)
    return merged


def trajectory_of(
    group: common_pb2.PromptGroup, index: int, rollout: Rollout, started_at: float
) -> common_pb2.Trajectory:
    """`started_at`: wall-clock time (time.time()) the rollout began."""
    trajectory = common_pb2.Trajectory(
        uid=group.uid,
        index=index,
        partition=group.partition,
        prompt_token_ids=rollout.prompt_token_ids,
        response_token_ids=rollout.response_token_ids,
        rollout_logprobs=rollout.rollout_logprobs,
        spans=rollout.spans,
        finish_reason=rollout.finish_reason,
        labels=dict(group.labels),
        response_text=rollout.response_text,
    )
    trajectory.response_mask = bytes(rollout.response_mask)
    timings = trajectory.timings
    timings.started_at.FromNanoseconds(int(started_at * 1e9))
    timings.finished_at.GetCurrentTime()
    timings.generate_s = rollout.generate_s
    timings.tool_s = rollout.tool_s
    return trajectory


def failed_trajectory(
    group: common_pb2.PromptGroup, index: int, reason: str
) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        uid=group.uid,
        index=index,
        partition=group.partition,
        prompt_token_ids=list(group.prompt_token_ids),
        finish_reason="error",
        error=reason[:2000],
        labels=dict(group.labels),
    )
