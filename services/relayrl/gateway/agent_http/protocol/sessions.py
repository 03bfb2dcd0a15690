"""The session routes' JSON (POST /sessions, GET /sessions/{id}, close, abort) and the model
list of GET /v1/models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.core.env_reward import EnvReward
from relayrl.gateway.agent_http.domain import SessionEnd, SessionSpec
from relayrl.gateway.agent_http.errors import invalid
from relayrl.gateway.agent_http.protocol import checks
from relayrl.gateway.agent_http.protocol.base import Answer, OpenAIRequest, Text, checked, reject


class OpenSessionRequest(BaseModel):
    """A claimed group's sample (partition, uid, index, claim_id), or an ad-hoc group (uid
    empty) with what the reward-service needs to score it. All fields are the gateway's own:
    an unknown one is an error. Checked in this order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    labels: Annotated[dict[str, str], checked(checks.check_labels)] = Field(default_factory=dict)
    partition: Text = ""
    uid: Text = ""
    claim_id: Text = ""
    data_source: Text = ""
    ground_truth: Text = ""
    index: Annotated[int | None, checked(checks.number(0, 2**31 - 1, integer=True))] = 0

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, body: Any) -> Any:
        unknown = sorted(set(body) - set(cls.model_fields)) if isinstance(body, dict) else []
        if unknown:
            known = ", ".join(sorted(cls.model_fields))
            reject(invalid(f"unknown fields {unknown}; known: {known}"))
        return body

    def to_domain(self) -> SessionSpec:
        return SessionSpec(
            partition=self.partition,
            uid=self.uid,
            index=self.index or 0,
            claim_id=self.claim_id,
            data_source=self.data_source,
            ground_truth=self.ground_truth,
            labels=self.labels,
        )


class CloseSessionRequest(BaseModel):
    """The body is optional. `env_reward`: the environment's own reward for the trajectory
    (`{"status": "ok" | "fail" | "error", "score": number, "message": string}`), used by the
    reward-service's `env` manager where the group's data_source is routed to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env_reward: Annotated[EnvReward | None, checked(checks.check_env_reward)] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, body: Any) -> Any:
        unknown = sorted(set(body) - set(cls.model_fields)) if isinstance(body, dict) else []
        if unknown:
            reject(invalid(f"unknown fields {unknown}; known: env_reward"))
        return body


class AbortSessionRequest(OpenAIRequest):
    """The body is optional."""

    reason: Text = ""


class SessionOpened(Answer):
    object: Literal["agent.session"] = "agent.session"
    session_id: str
    partition: str
    uid: str
    index: int
    base_path: str
    token: str | None = None  # the session's own bearer token (when the gateway authenticates)


class SessionState(Answer):
    object: Literal["agent.session"] = "agent.session"
    session_id: str
    partition: str
    uid: str
    index: int
    kind: str | None
    num_turns: int
    num_prompt_tokens: int
    num_response_tokens: int
    replica: str
    busy: bool


class SessionEnded(Answer):
    """How a session ended (close and abort; again when asked again)."""

    session_id: str
    outcome: str
    trajectory_key: str
    num_turns: int
    num_prompt_tokens: int
    num_response_tokens: int
    reason: str

    @classmethod
    def of(cls, end: SessionEnd) -> SessionEnded:
        return cls(
            session_id=end.session_id,
            outcome=end.outcome,
            trajectory_key=end.trajectory_key,
            num_turns=end.num_turns,
            num_prompt_tokens=end.num_prompt_tokens,
            num_response_tokens=end.num_response_tokens,
            reason=end.reason,
        )


class ModelCard(Answer):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "relayrl"


class ModelList(Answer):
    object: Literal["list"] = "list"
    data: list[ModelCard]
