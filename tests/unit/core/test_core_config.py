"""Config loading: YAML, environment overrides, and one-line ConfigErrors naming the source and
the field path for every kind of user mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from relayrl.core.config import (
    ConfigError,
    GrpcClientConfig,
    GrpcKeepaliveConfig,
    GrpcServerConfig,
    LoggingConfig,
    MetricsConfig,
    NoAuthConfig,
    ServiceConfig,
    StaticTokenAuthConfig,
    StrictModel,
    dump_config,
    load_config,
)

PREFIX = "RELAYRL_TEST"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str | None, env: dict[str, str] | None = None) -> str:
    path = write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as raised:
        load_config(ServiceConfig, path, PREFIX, env or {})
    message = str(raised.value)
    assert "\n" not in message
    return message


# --- defaults and YAML -------------------------------------------------------------------------


@pytest.mark.parametrize("path", [None, ""])
def test_no_path_gives_defaults(path: str | None) -> None:
    assert load_config(ServiceConfig, path, PREFIX, {}) == ServiceConfig()


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(ServiceConfig, write(tmp_path, ""), PREFIX, {}) == ServiceConfig()


def test_defaults_are_safe_for_a_local_run() -> None:
    config = ServiceConfig()
    assert config.grpc.host == "127.0.0.1"
    assert config.grpc.port == 0
    assert config.grpc.max_message_bytes == 64 * 1024 * 1024
    assert isinstance(config.auth, NoAuthConfig)


def test_yaml_values_are_loaded(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "grpc:\n  port: 50051\n  grace_s: 2.5\n  max_concurrent_rpcs: 64\n"
        "metrics:\n  enabled: false\n"
        "logging:\n  level: debug\n  json: true\n",
    )
    config = load_config(ServiceConfig, str(path), PREFIX, {})
    assert config.grpc.port == 50051
    assert config.grpc.grace_s == 2.5
    assert config.grpc.max_concurrent_rpcs == 64
    assert config.metrics.enabled is False
    assert config.logging.level == "DEBUG"
    assert config.logging.json_lines is True


def test_static_token_auth_is_selected_by_type(tmp_path: Path) -> None:
    path = write(tmp_path, "auth:\n  type: static_token\n  tokens_file: /run/secrets/tokens\n")
    auth = load_config(ServiceConfig, path, PREFIX, {}).auth
    assert isinstance(auth, StaticTokenAuthConfig)
    assert auth.tokens_file == Path("/run/secrets/tokens")
    assert "/grpc.health.v1.Health/Check" in auth.exempt_methods


# --- environment overrides -----------------------------------------------------------------------


def test_env_overrides_file_and_nests_with_double_underscores(tmp_path: Path) -> None:
    path = write(tmp_path, "grpc:\n  port: 50051\n  grace_s: 3\n")
    env = {f"{PREFIX}__GRPC__PORT": "6000", "UNRELATED__GRPC__PORT": "1"}
    config = load_config(ServiceConfig, path, PREFIX, env)
    assert config.grpc.port == 6000
    assert config.grpc.grace_s == 3


def test_env_field_names_are_case_insensitive() -> None:
    env = {f"{PREFIX}__Grpc__Keepalive__Time_S": "12.5", f"{PREFIX}__logging__LEVEL": "warning"}
    config = load_config(ServiceConfig, None, PREFIX, env)
    assert config.grpc.keepalive.time_s == 12.5
    assert config.logging.level == "WARNING"


def test_env_values_are_yaml_scalars() -> None:
    env = {
        f"{PREFIX}__METRICS__ENABLED": "false",
        f"{PREFIX}__LOGGING__JSON": "true",
        f"{PREFIX}__AUTH__TYPE": "static_token",
        f"{PREFIX}__AUTH__TOKENS_ENV": "TOKENS",
        f"{PREFIX}__AUTH__EXEMPT_METHODS": "[/a.B/C, /a.B/*]",
        f"{PREFIX}__GRPC__MAX_CONCURRENT_RPCS": "null",
    }
    config = load_config(ServiceConfig, None, PREFIX, env)
    assert config.metrics.enabled is False
    assert config.logging.json_lines is True
    assert isinstance(config.auth, StaticTokenAuthConfig)
    assert config.auth.tokens_env == "TOKENS"
    assert config.auth.exempt_methods == ["/a.B/C", "/a.B/*"]
    assert config.grpc.max_concurrent_rpcs is None


def test_env_keeps_raw_text_for_string_fields() -> None:
    """YAML would read `0123` as a number; a string field must get the text as written."""
    config = load_config(ServiceConfig, None, PREFIX, {f"{PREFIX}__GRPC__HOST": "0123"})
    assert config.grpc.host == "0123"


def test_env_sets_mapping_entries() -> None:
    env = {
        f"{PREFIX}__AUTH__TYPE": "static_token",
        f"{PREFIX}__AUTH__TOKENS__alice": "alice-token-0123456789",
    }
    auth = load_config(ServiceConfig, None, PREFIX, env).auth
    assert isinstance(auth, StaticTokenAuthConfig)
    assert auth.tokens is not None
    assert auth.tokens["alice"].get_secret_value() == "alice-token-0123456789"


class _PeerConfig(ServiceConfig):
    """A service's own config: the shared sections plus its own."""

    peer: GrpcClientConfig = Field(
        default_factory=lambda: GrpcClientConfig(target="127.0.0.1:1"), description="A peer."
    )


def test_service_specific_sections_get_the_same_treatment(tmp_path: Path) -> None:
    path = write(tmp_path, "peer:\n  target: dns:///peer:50051\n")
    env = {f"{PREFIX}__PEER__DEFAULT_TIMEOUT_S": "5"}
    config = load_config(_PeerConfig, path, PREFIX, env)
    assert config.peer.target == "dns:///peer:50051"
    assert config.peer.default_timeout_s == 5


# --- errors --------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_config(ServiceConfig, path, PREFIX, {})


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    message = config_error(tmp_path, "grpc:\n  port: [1\n")
    assert message.startswith(f"{tmp_path / 'config.yaml'}: invalid YAML at line 3")


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert "top level must be a mapping" in config_error(tmp_path, "- grpc\n")


def test_unknown_field_in_file_lists_known_fields(tmp_path: Path) -> None:
    message = config_error(tmp_path, "grpc:\n  prot: 1\n")
    assert message.startswith(f"{tmp_path / 'config.yaml'}: grpc.prot: Extra inputs")
    assert "known: host, port," in message


def test_wrong_type(tmp_path: Path) -> None:
    message = config_error(tmp_path, "metrics:\n  port: eighty\n")
    assert message.startswith(f"{tmp_path / 'config.yaml'}: metrics.port: Input should be")


def test_out_of_bounds_matches_documented_message(tmp_path: Path) -> None:
    message = config_error(tmp_path, "grpc:\n  port: 70000\n")
    expected = f"{tmp_path / 'config.yaml'}: grpc.port: Input should be less than or equal to 65535"
    assert message == expected


def test_union_member_errors_use_yaml_paths_without_tags(tmp_path: Path) -> None:
    message = config_error(tmp_path, "auth:\n  type: static_token\n  tokens_file: [1]\n")
    assert ": auth.tokens_file: " in message


def test_unknown_auth_type(tmp_path: Path) -> None:
    message = config_error(tmp_path, "auth:\n  type: oauth\n")
    assert "auth: " in message and "'none', 'static_token'" in message


def test_static_token_needs_exactly_one_source(tmp_path: Path) -> None:
    message = config_error(tmp_path, "auth:\n  type: static_token\n")
    assert message.endswith("auth: set exactly one of tokens_file, tokens_env or tokens (got none)")


def test_exempt_methods_must_be_full_method_names(tmp_path: Path) -> None:
    text = "auth:\n  type: static_token\n  tokens_env: T\n  exempt_methods: [Check]\n"
    assert "auth.exempt_methods: 'Check' is not a full method name" in config_error(tmp_path, text)


def test_cross_field_port_clash(tmp_path: Path) -> None:
    message = config_error(tmp_path, "grpc:\n  port: 9000\nmetrics:\n  port: 9000\n")
    assert "give them different ports" in message


def test_env_error_names_the_variable(tmp_path: Path) -> None:
    message = config_error(tmp_path, "grpc:\n  port: 1\n", {f"{PREFIX}__GRPC__PORT": "-1"})
    assert message.startswith(f"env {PREFIX}__GRPC__PORT: grpc.port: Input should be greater")


def test_unknown_env_path_names_variable_and_known_fields() -> None:
    message = config_error(None, None, {f"{PREFIX}__GRPC__PROT": "1"})
    assert message.startswith(f"env {PREFIX}__GRPC__PROT: unknown field grpc.prot (known: host")


def test_env_path_below_a_scalar_field() -> None:
    message = config_error(None, None, {f"{PREFIX}__GRPC__PORT__X": "1"})
    assert message == f"env {PREFIX}__GRPC__PORT__X: grpc.port has no sub-field 'x'"


def test_invalid_yaml_in_env_value() -> None:
    message = config_error(None, None, {f"{PREFIX}__AUTH__EXEMPT_METHODS": "[a"})
    assert message.startswith(f"env {PREFIX}__AUTH__EXEMPT_METHODS: invalid YAML")


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_env_prefix_must_be_usable() -> None:
    with pytest.raises(ValueError, match="env_prefix"):
        load_config(ServiceConfig, None, "", {})


# --- dump and schema -----------------------------------------------------------------------------


def test_dump_round_trips(tmp_path: Path) -> None:
    config = load_config(
        ServiceConfig,
        None,
        PREFIX,
        {
            f"{PREFIX}__GRPC__PORT": "7000",
            f"{PREFIX}__LOGGING__JSON": "true",
            f"{PREFIX}__AUTH__TYPE": "static_token",
            f"{PREFIX}__AUTH__TOKENS_FILE": "/run/tokens.yaml",
        },
    )
    dumped = dump_config(config)
    assert "json: true" in dumped
    assert load_config(ServiceConfig, write(tmp_path, dumped), PREFIX, {}) == config


def test_dump_masks_inline_secrets() -> None:
    config = ServiceConfig.model_validate(
        {"auth": {"type": "static_token", "tokens": {"alice": "alice-token-0123456789"}}}
    )
    assert "alice-token" not in dump_config(config)


@pytest.mark.parametrize(
    "model",
    [
        ServiceConfig,
        GrpcServerConfig,
        GrpcClientConfig,
        GrpcKeepaliveConfig,
        MetricsConfig,
        NoAuthConfig,
        StaticTokenAuthConfig,
        LoggingConfig,
    ],
)
def test_every_field_is_documented_and_extra_keys_are_forbidden(
    model: type[StrictModel],
) -> None:
    assert model.model_config.get("extra") == "forbid"
    for name, info in model.model_fields.items():
        assert info.description, f"{model.__name__}.{name} has no description"


def test_a_renamed_key_is_refused_naming_its_new_place(tmp_path: Path) -> None:
    message = config_error(tmp_path, "grpc:\n  keepalive_time_s: 10\n")
    assert (
        message
        == f"{tmp_path / 'config.yaml'}: grpc.keepalive_time_s: renamed to grpc.keepalive.time_s"
    )
