"""Who may call the agent endpoint (when the gateway authenticates its callers, `auth:`).

Opening a session (POST /sessions, or OpenSession over gRPC) needs the token of a principal in
the `agent` role, from the gateway's tokens file. The answer carries a token made for that
session alone: an agent passes it as its OpenAI API key, and it is good for that session's
routes only (its turns, its state, its close and abort), so an agent program can be handed it
without being able to touch any other session or open new ones. The principal that opened a
session may also call its routes with its own token. /v1/models answers any valid token.

A call without a valid token is 401, a call with another session's token 403, both in
OpenAI's error shape (relayrl.gateway.agent_http.router).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from relayrl.core.access import AGENT
from relayrl.core.interceptors import AUTHORIZATION_KEY, Authenticator, bearer_token, token_digest

MAX_SESSION_TOKENS = 100_000  # oldest first out; a session lives far shorter than that many opens


@dataclass(frozen=True)
class Refusal:
    status: int  # 401 or 403
    message: str


class SessionTokens:
    """The tokens made for sessions: digest -> session id, and who opened each session."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, str] = OrderedDict()  # token digest -> session id
        self._openers: dict[str, str] = {}  # session id -> principal that opened it

    def mint(self, session_id: str, opener: str | None) -> str:
        token = secrets.token_urlsafe(32)
        self._sessions[token_digest(token)] = session_id
        if opener is not None:
            self._openers[session_id] = opener
        while len(self._sessions) > MAX_SESSION_TOKENS:
            _, forgotten = self._sessions.popitem(last=False)
            self._openers.pop(forgotten, None)
        return token

    def session_of(self, token: str) -> str | None:
        return self._sessions.get(token_digest(token))

    def opener_of(self, session_id: str) -> str | None:
        return self._openers.get(session_id)


class AgentAccess:
    """The decision for one agent endpoint request."""

    def __init__(
        self,
        authenticator: Authenticator,
        tokens: SessionTokens,
        roles_of: Callable[[str], frozenset[str]],
    ) -> None:
        """`roles_of`: the gateway's `auth:` view of a principal (`roles_function`)."""
        self._authenticator = authenticator
        self._tokens = tokens
        self._roles_of = roles_of

    def _principal(self, authorization: str | None) -> str | None:
        metadata = [(AUTHORIZATION_KEY, authorization)] if authorization else []
        principal = self._authenticator.authenticate("agent_http", metadata)
        return principal.name if principal is not None else None

    def opener(self, authorization: str | None) -> str | Refusal:
        """The principal allowed to open a session, or why not."""
        principal = self._principal(authorization)
        if principal is None:
            return Refusal(401, "opening a session needs 'Authorization: Bearer <agent token>'")
        if AGENT not in self._roles_of(principal):
            return Refusal(
                403, f"opening a session is for the agent role; {principal!r} is not one"
            )
        return principal

    def check(self, authorization: str | None, session_id: str | None) -> Refusal | None:
        """None when the request may go on to `session_id`'s routes (None: a route of no
        session), else why not."""
        token = bearer_token([(AUTHORIZATION_KEY, authorization)] if authorization else [])
        if token is None:
            return Refusal(401, "send the session's token: 'Authorization: Bearer <token>'")
        owned = self._tokens.session_of(token)
        if owned is not None:
            if session_id is None or owned == session_id:
                return None
            return Refusal(403, f"this token is for another session, not {session_id}")
        principal = self._principal(authorization)
        if principal is None:
            return Refusal(401, "the token is not valid here")
        if session_id is None:
            return None if AGENT in self._roles_of(principal) else Refusal(403, "for agents only")
        if self._tokens.opener_of(session_id) == principal:
            return None
        return Refusal(403, f"{principal!r} did not open session {session_id}")
