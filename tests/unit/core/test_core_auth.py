"""Static-token authentication: where tokens come from, how the header is parsed, and which
calls are exempt."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from relayrl.core.config import (
    DEFAULT_EXEMPT_METHODS,
    ConfigError,
    NoAuthConfig,
    StaticTokenAuthConfig,
    load_static_tokens,
)
from relayrl.core.interceptors import (
    AuthInterceptor,
    Principal,
    StaticTokenAuthenticator,
    bearer_token,
    build_authenticator,
)

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789"


def static(**fields: object) -> StaticTokenAuthConfig:
    return StaticTokenAuthConfig.model_validate({"type": "static_token", **fields})


# --- token sources -------------------------------------------------------------------------------


def test_tokens_from_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"alice: {ALICE}\nbob: '{BOB}'\n")
    assert load_static_tokens(static(tokens_file=path), {}) == {"alice": ALICE, "bob": BOB}


def test_tokens_from_env() -> None:
    config = static(tokens_env="RELAYRL_TOKENS")
    tokens = load_static_tokens(config, {"RELAYRL_TOKENS": f"{{alice: {ALICE}}}"})
    assert tokens == {"alice": ALICE}


def test_tokens_inline() -> None:
    assert load_static_tokens(static(tokens={"alice": ALICE}), {}) == {"alice": ALICE}


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("[a, b]", "expected a non-empty mapping principal -> token"),
        ("{}", "expected a non-empty mapping principal -> token"),
        ("{alice: short}", "must be at least 16 characters"),
        ("{alice: 12345678901234567890}", "must be a string (quote it)"),
        (f"{{alice: {ALICE}, bob: {ALICE}}}", "share a token"),
        ("{alice: [x", "invalid YAML"),
    ],
)
def test_bad_token_mappings_name_the_source(value: str, complaint: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_static_tokens(static(tokens_env="RELAYRL_TOKENS"), {"RELAYRL_TOKENS": value})
    assert str(raised.value).startswith("env RELAYRL_TOKENS (auth.tokens_env): ")
    assert complaint in str(raised.value)


def test_unset_env_variable() -> None:
    with pytest.raises(ConfigError, match=r"env RELAYRL_TOKENS \(auth.tokens_env\): variable is"):
        load_static_tokens(static(tokens_env="RELAYRL_TOKENS"), {})


def test_unreadable_file(tmp_path: Path) -> None:
    config = static(tokens_file=tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"missing\.yaml \(auth.tokens_file\): cannot read"):
        load_static_tokens(config, {})


# --- bearer header -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ([("authorization", f"Bearer {ALICE}")], ALICE),
        ([("authorization", f"bearer   {ALICE} ")], ALICE),
        ([("user-agent", "x"), ("authorization", f"Bearer {ALICE}")], ALICE),
        ([("authorization", f"Basic {ALICE}")], None),
        ([("authorization", "Bearer")], None),
        ([("authorization", "Bearer ")], None),
        ([("x-api-key", ALICE)], None),
        ([], None),
        (None, None),
    ],
)
def test_bearer_token_parsing(metadata: list[tuple[str, str]] | None, token: str | None) -> None:
    assert bearer_token(metadata) == token


def test_authenticator_maps_tokens_to_principals() -> None:
    authenticator = StaticTokenAuthenticator({"alice": ALICE, "bob": BOB})
    method = "/relayrl.reward.v1.RewardService/Score"
    assert authenticator.authenticate(method, [("authorization", f"Bearer {BOB}")]) == Principal(
        "bob"
    )
    assert authenticator.authenticate(method, [("authorization", "Bearer wrong")]) is None
    assert authenticator.authenticate(method, []) is None
    assert "authorization: Bearer <token>" in authenticator.credentials_hint


def test_authenticator_needs_tokens() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StaticTokenAuthenticator({})


# --- building from config and exemptions ---------------------------------------------------------


def test_build_authenticator_for_none_accepts_everyone() -> None:
    assert build_authenticator(NoAuthConfig(), {}) is None


def test_build_authenticator_warns_about_inline_tokens(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        authenticator = build_authenticator(static(tokens={"alice": ALICE}), {})
    assert authenticator is not None
    assert "auth.tokens puts secrets into the config file" in caplog.text


def test_build_authenticator_from_env() -> None:
    authenticator = build_authenticator(static(tokens_env="T"), {"T": f"{{alice: {ALICE}}}"})
    assert authenticator is not None
    principal = authenticator.authenticate("/a.B/C", [("authorization", f"Bearer {ALICE}")])
    assert principal == Principal("alice")


def test_health_and_reflection_are_exempt_by_default() -> None:
    interceptor = AuthInterceptor(StaticTokenAuthenticator({"alice": ALICE}))
    for method in DEFAULT_EXEMPT_METHODS:
        assert interceptor.is_exempt(method)
    assert not interceptor.is_exempt("/relayrl.reward.v1.RewardService/Score")


def test_service_wildcard_exemption() -> None:
    interceptor = AuthInterceptor(
        StaticTokenAuthenticator({"alice": ALICE}), exempt_methods=["/pkg.Public/*"]
    )
    assert interceptor.is_exempt("/pkg.Public/Anything")
    assert not interceptor.is_exempt("/pkg.PublicPlus/Anything")
    assert not interceptor.is_exempt("/grpc.health.v1.Health/Check")
