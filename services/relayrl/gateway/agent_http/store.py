"""The agent sessions' side of the TransferQueue: checking a caller's claim on a group, putting
and claiming ad-hoc groups, renewing leases and putting trajectories, with the TransferQueue's
failures told apart as the session logic needs them (`AgentError` kinds).

An ad-hoc group is put and claimed in one atomic step (the TransferQueue's put_and_claim), so
it is never pending for another claimer and no other group is claimed on the way. Ad-hoc
groups name the agent loop "agent_http", which no rollout loop has: if one ever returns to
pending (a gateway crashed), a rollout worker fails it as infra instead of rolling it out with
another loop."""

from __future__ import annotations

from collections.abc import Callable

from relayrl.gateway.agent_http.domain import SessionSpec
from relayrl.gateway.agent_http.errors import AgentError, ErrorKind
from relayrl.inference.client import SamplingOptions
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import AsyncTransferQueue, TrajectoryPut
from relayrl.tq.errors import (
    ConflictError,
    InvalidInputError,
    StaleClaimError,
    TQError,
    UnknownKeyError,
)

AGENT_LOOP_NAME = "agent_http"


class TrajectoryRefused(AgentError):
    """The TransferQueue will never take this trajectory: another claimer owns the group, the
    key holds another trajectory, or the trajectory itself is refused (e.g. too large)."""


class AgentGroupStore:
    """Claims, leases and puts of the groups and trajectories agent sessions write."""

    def __init__(
        self,
        tq: AsyncTransferQueue,
        *,
        claimer: str,
        lease_s: float,
        max_response_tokens: int,
        policy_step: Callable[[], int],
    ) -> None:
        self._tq = tq
        self._claimer = claimer
        self.lease_s = lease_s
        self._max_response_tokens = max_response_tokens
        self._policy_step = policy_step

    async def create_partition(self, partition: str) -> None:
        await self._tq.create_partition(partition)

    async def claimed_group(self, spec: SessionSpec) -> common_pb2.PromptGroup:
        """The claimed group of `spec`, once its claim is known to hold (it is renewed on the
        way) and its sample is still to be rolled out."""
        where = f"{spec.partition}/{spec.uid}"
        try:
            (entry,) = await self._tq.get_groups(spec.partition, [spec.uid])
            await self._tq.renew_leases(spec.partition, {spec.uid: spec.claim_id}, self.lease_s)
        except UnknownKeyError as exc:
            raise AgentError(ErrorKind.NOT_FOUND, str(exc), param="uid") from None
        except InvalidInputError as exc:  # unknown partition
            raise AgentError(ErrorKind.INVALID, str(exc), param="partition") from None
        except StaleClaimError:
            raise AgentError(
                ErrorKind.CONFLICT,
                f"{where}: claim {spec.claim_id!r} is not the group's current claim "
                "(released, expired, or another claimer's)",
                param="claim_id",
            ) from None
        except TQError as exc:
            raise AgentError(ErrorKind.UNAVAILABLE, f"TransferQueue: {exc}") from None
        group = entry.group
        if spec.index >= group.num_samples:
            raise AgentError(
                ErrorKind.INVALID,
                f"{where} has {group.num_samples} samples; index {spec.index} is out of range",
                param="index",
            )
        if any(t.index == spec.index for t in entry.trajectories):
            raise AgentError(
                ErrorKind.CONFLICT, f"{where}: sample {spec.index} already has a trajectory"
            )
        return group

    def adhoc_group(
        self, spec: SessionSpec, prompt_token_ids: list[int], sampling: SamplingOptions
    ) -> common_pb2.PromptGroup:
        """The group of one sample a session without a claimed group rolls out: its first
        prompt, what the open call named, the trainer's current step."""
        return common_pb2.PromptGroup(
            uid=spec.uid,
            partition=spec.partition,
            prompt_step=self._policy_step(),
            num_samples=1,
            prompt_token_ids=prompt_token_ids,
            data_source=spec.data_source,
            ground_truth=spec.ground_truth,
            agent=AGENT_LOOP_NAME,
            labels=dict(spec.labels),
            sampling=common_pb2.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),
                max_response_tokens=self._max_response_tokens,
            ),
        )

    async def claim_adhoc(self, group: common_pb2.PromptGroup) -> str:
        """Put `group` and claim it in one atomic step (no other group is claimed on the way,
        and it is never pending for another claimer); returns the claim id."""
        where = f"agent group {group.partition}/{group.uid}"
        try:
            result = await self._tq.put_and_claim_groups(
                group.partition,
                [group],
                claimer=self._claimer,
                lease_s=self.lease_s,
            )
        except ConflictError:
            raise AgentError(
                ErrorKind.CONFLICT, f"{where} already exists with other content"
            ) from None
        except TQError as exc:
            raise AgentError(
                ErrorKind.UNAVAILABLE,
                f"TransferQueue: {exc}; nothing was recorded, send the request again",
            ) from None
        if not result.claimed:
            why = result.not_claimed.get(group.uid, "unknown")
            raise AgentError(ErrorKind.CONFLICT, f"{where} cannot be claimed: it is {why}")
        return result.claimed[0].claim_id

    async def renew(self, partition: str, uid: str, claim_id: str) -> bool:
        """Renew a claim's lease; False when the claim is lost. Other TransferQueue failures
        raise (TQError): the next renewal may work."""
        try:
            await self._tq.renew_leases(partition, {uid: claim_id}, self.lease_s)
        except StaleClaimError:
            return False
        return True

    async def put(
        self, partition: str, trajectory: common_pb2.Trajectory, claim_id: str, *, failed: bool
    ) -> None:
        """Put the trajectory (finished, or failed as infra). TrajectoryRefused when it never
        will be written; AgentError(UNAVAILABLE) when the TransferQueue may take it later."""
        put = TrajectoryPut(trajectory, claim_id, failed=failed)
        try:
            await self._tq.put_trajectories(partition, [put])
        except (StaleClaimError, ConflictError, InvalidInputError) as exc:
            kind = ErrorKind.INVALID if isinstance(exc, InvalidInputError) else ErrorKind.CONFLICT
            raise TrajectoryRefused(kind, f"the trajectory could not be written: {exc}") from None
        except TQError as exc:
            raise AgentError(
                ErrorKind.UNAVAILABLE, f"TransferQueue: {exc}; the session stays, retry"
            ) from None
