"""The RolloutGateway gRPC control plane: status, replicas, the trainer's step for the
throttle, the pause/resume/drain boundaries weight-sync drives, and the lifecycle of black-box
agent sessions (whose requests the agent HTTP endpoint serves)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from relayrl.core import env_reward
from relayrl.core.interceptors import current_principal
from relayrl.gateway.agent_http import (
    AgentError,
    AgentSessions,
    ErrorKind,
    SessionEnd,
    SessionSpec,
)
from relayrl.gateway.replicas import Replica, ReplicaPool, ReplicaState
from relayrl.gateway.rollout import RolloutWorker
from relayrl.inference.client import EngineError
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc

_STATES = {
    ReplicaState.SERVING: rollout_pb2.REPLICA_STATE_SERVING,
    ReplicaState.PAUSED: rollout_pb2.REPLICA_STATE_PAUSED,
    ReplicaState.LOADING: rollout_pb2.REPLICA_STATE_LOADING,
    ReplicaState.DRAINED: rollout_pb2.REPLICA_STATE_DRAINED,
    ReplicaState.UNHEALTHY: rollout_pb2.REPLICA_STATE_UNHEALTHY,
}
_SESSION_CODES = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.ENDED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.TOO_MANY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.ENGINE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
_OUTCOMES = {
    "finished": rollout_pb2.SESSION_OUTCOME_FINISHED,
    "failed": rollout_pb2.SESSION_OUTCOME_FAILED,
    "discarded": rollout_pb2.SESSION_OUTCOME_DISCARDED,
}
_PAUSE_MODES = {
    rollout_pb2.PAUSE_MODE_ABORT: "abort",
    rollout_pb2.PAUSE_MODE_KEEP: "keep",
    rollout_pb2.PAUSE_MODE_WAIT: "wait",
}


def replica_to_proto(replica: Replica) -> rollout_pb2.Replica:
    version = int(replica.weight_version) if replica.weight_version.isdigit() else 0
    return rollout_pb2.Replica(
        replica_id=replica.replica_id,
        url=getattr(replica.client, "base_url", ""),
        state=_STATES[replica.state],
        weight_version=common_pb2.WeightVersion(version=version),
        num_inflight=replica.num_inflight,
        source=replica.source,
        last_error=replica.last_error,
    )


def session_end_to_proto(end: SessionEnd) -> rollout_pb2.SessionEnd:
    return rollout_pb2.SessionEnd(
        outcome=_OUTCOMES[end.outcome],
        trajectory_key=end.trajectory_key,
        num_turns=end.num_turns,
        num_prompt_tokens=end.num_prompt_tokens,
        num_response_tokens=end.num_response_tokens,
        reason=end.reason,
    )


# policy_step, batch_size, refill_groups: (policy_step + 1 + eta) * batch_size + refill_groups
# stays far inside an int64 (the reply's fields).
_POLICY_STEP_LIMITS = (2**40, 2**20, 2**40)


class RolloutGatewayServicer(rollout_pb2_grpc.RolloutGatewayServicer):
    def __init__(
        self,
        pool: ReplicaPool,
        workers: list[RolloutWorker],
        sessions: AgentSessions | None = None,
        *,
        agent_http_port: Callable[[], int] = lambda: 0,
    ) -> None:
        self._pool = pool
        self._workers = workers
        self._sessions = sessions
        self._agent_http_port = agent_http_port

    async def GetStatus(
        self, request: rollout_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetStatusResponse:
        throttle = self._workers[0].throttle if self._workers else None
        return rollout_pb2.GetStatusResponse(
            policy_step=throttle.policy_step if throttle else 0,
            batch_size=throttle.batch_size if throttle else 0,
            eta=throttle.eta if throttle else 0.0,
            num_launched=sum(w.num_launched for w in self._workers),
            num_inflight=sum(w.num_inflight_groups for w in self._workers),
            replicas=[replica_to_proto(r) for r in self._pool.replicas],
        )

    async def ListReplicas(
        self, request: rollout_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ListReplicasResponse:
        return rollout_pb2.ListReplicasResponse(
            replicas=[replica_to_proto(r) for r in self._pool.replicas]
        )

    async def UpdatePolicyStep(
        self, request: rollout_pb2.UpdatePolicyStepRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdatePolicyStepResponse:
        values = (request.policy_step, request.batch_size, request.refill_groups)
        if not all(0 <= v <= limit for v, limit in zip(values, _POLICY_STEP_LIMITS, strict=True)):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "policy_step, batch_size and refill_groups must be in [0, 2^40], [0, 2^20] and "
                f"[0, 2^40] (the throttle's product must fit an int64), got "
                f"{request.policy_step}, {request.batch_size}, {request.refill_groups}",
            )
        for worker in self._workers:
            worker.update_policy_step(
                request.policy_step, request.batch_size or None, request.refill_groups
            )
        launched = sum(w.num_launched for w in self._workers)
        cap = self._workers[0].throttle.max_launched if self._workers else 0
        return rollout_pb2.UpdatePolicyStepResponse(
            num_launched=launched, num_launchable=max(0, cap - launched)
        )

    async def PauseReplicas(
        self, request: rollout_pb2.PauseReplicasRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseReplicasResponse:
        mode = _PAUSE_MODES.get(request.mode)
        if mode is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "mode: set PAUSE_MODE_ABORT, PAUSE_MODE_KEEP or PAUSE_MODE_WAIT",
            )
        replicas = await self._select(request.replica_ids, context)
        try:
            paused = await self._pool.pause(replicas, mode)  # type: ignore[arg-type]
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pausing failed: {exc}")
        return rollout_pb2.PauseReplicasResponse(paused_replica_ids=[r.replica_id for r in paused])

    async def ResumeReplicas(
        self, request: rollout_pb2.ResumeReplicasRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeReplicasResponse:
        replicas = await self._select(request.replica_ids, context)
        version = str(request.version.version) if request.HasField("version") else None
        try:
            resumed = await self._pool.resume(replicas, version)
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"resuming failed: {exc}")
        return rollout_pb2.ResumeReplicasResponse(
            resumed_replica_ids=[r.replica_id for r in resumed]
        )

    async def DrainReplica(
        self, request: rollout_pb2.DrainReplicaRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.DrainReplicaResponse:
        (replica,) = await self._select([request.replica_id], context)
        moved = self._pool.drain(
            replica, request.reason or "drained by request", until_loaded=request.until_loaded
        )
        return rollout_pb2.DrainReplicaResponse(num_requeued=moved)

    async def OpenSession(
        self, request: rollout_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.OpenSessionResponse:
        sessions = await self._agent_sessions(context)
        spec = SessionSpec(
            partition=request.partition,
            uid=request.uid,
            index=request.index,
            claim_id=request.claim_id,
            data_source=request.data_source,
            ground_truth=request.ground_truth,
            labels=dict(request.labels),
        )
        try:
            session = await sessions.open_for_caller(spec)
        except AgentError as exc:
            await context.abort(_SESSION_CODES[exc.kind], exc.message)
        return rollout_pb2.OpenSessionResponse(
            session_id=session.session_id,
            partition=session.partition,
            uid=session.uid,
            index=session.index,
            base_path=f"/sessions/{session.session_id}/v1",
            agent_http_port=self._agent_http_port(),
            token=sessions.tokens.mint(session.session_id, principal.name)
            if (principal := current_principal()) is not None
            else "",
        )

    async def CloseSession(
        self, request: rollout_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.CloseSessionResponse:
        sessions = await self._agent_sessions(context, request.session_id)
        try:
            env = _env_reward(request.env_reward) if request.HasField("env_reward") else None
            end = await sessions.close_session(request.session_id, env_reward=env)
        except AgentError as exc:
            await context.abort(_SESSION_CODES[exc.kind], exc.message)
        return rollout_pb2.CloseSessionResponse(end=session_end_to_proto(end))

    async def AbortSession(
        self, request: rollout_pb2.AbortSessionRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortSessionResponse:
        sessions = await self._agent_sessions(context, request.session_id)
        try:
            end = await sessions.abort(request.session_id, request.reason)
        except AgentError as exc:
            await context.abort(_SESSION_CODES[exc.kind], exc.message)
        return rollout_pb2.AbortSessionResponse(end=session_end_to_proto(end))

    async def _agent_sessions(
        self, context: grpc.aio.ServicerContext, session_id: str | None = None
    ) -> AgentSessions:
        if self._sessions is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "agent sessions are off on this gateway (agent_http.enabled: false)",
            )
        if session_id is not None and not session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        assert self._sessions is not None
        return self._sessions

    async def _select(
        self, replica_ids: list[str], context: grpc.aio.ServicerContext
    ) -> list[Replica]:
        try:
            return self._pool.select(list(replica_ids))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            raise  # not reached: abort raises


def _env_reward(reported: rollout_pb2.EnvReward) -> env_reward.EnvReward:
    """The close's environment reward; AgentError(INVALID) saying what is wrong."""
    try:
        return env_reward.from_proto(reported)
    except ValueError as exc:
        raise AgentError(ErrorKind.INVALID, f"env_reward: {exc}", param="env_reward") from None
