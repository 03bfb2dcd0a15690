"""The typed composition of the system (relayrl.stack): one wiring derived into the four
services, overrides checked by field before anything starts, and the services held to
agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.core.rollout_shape import RolloutShape
from relayrl.stack import SERVICES, EngineDiscovery, StackConfig, StackError, Wiring
from relayrl.stack.local import LocalPorts
from relayrl.tq.config import TQConfig
from relayrl.up.config import UpConfig
from relayrl.up.wiring import up_stack


def wiring(ports: LocalPorts, **rollout: int) -> Wiring:
    return Wiring(
        tq=TQConfig(url=ports.redis_url, namespace="t", partitions=["train"]),
        model_path=Path("/models/policy"),
        rollout_shape=RolloutShape(
            **{"eta": 2, "batch_groups": 6, "samples_per_prompt": 4, "max_tokens": 32} | rollout
        ),
        endpoints=ports.endpoints(),
        engines=EngineDiscovery(urls=[ports.engine_url]),
    )


def test_every_shared_value_reaches_every_service_from_one_place() -> None:
    ports = LocalPorts.placeholder()
    stack = StackConfig.compose(wiring(ports))
    r, g, w, t = stack.reward, stack.gateway, stack.weightsync, stack.trainer
    assert {c.tq.url for c in (r, g, t)} == {ports.redis_url}
    assert {c.tq.namespace for c in (r, g, t)} == {"t"}
    # one model, embedded unchanged: the same names and types in both services
    shape = RolloutShape(eta=2, batch_groups=6, samples_per_prompt=4, max_tokens=32)
    assert g.rollout_shape == t.rollout_shape == shape
    assert t.algorithm.mini_batch_groups == 6
    assert g.tokenizer == t.model.hf_dir == Path("/models/policy")
    assert g.engines.urls == [ports.engine_url]
    weightsync_target = f"127.0.0.1:{ports.grpc['weightsync']}"
    gateway_target = f"127.0.0.1:{ports.grpc['gateway']}"
    assert g.weightsync is not None and g.weightsync.target == weightsync_target
    assert t.publish.type == "weightsync" and t.publish.target == weightsync_target
    assert t.gateway is not None and t.gateway.target == gateway_target
    assert w.gateway is not None and w.gateway.target == gateway_target
    assert w.advertise_target == weightsync_target
    for name in SERVICES:
        config = getattr(stack, name)
        assert (config.grpc.port, config.metrics.port) == (ports.grpc[name], ports.metrics[name])
        # what the process is given is what was validated
        assert type(config).model_validate(stack.service_file(name)) == config


def test_own_settings_and_overrides_merge_over_the_wiring_in_that_order() -> None:
    stack = StackConfig.compose(
        wiring(LocalPorts.placeholder()),
        own={"weightsync": {"pause_mode": "abort", "bucket_size_bytes": 1 << 20}},
        overrides={"weightsync": {"pause_mode": "keep"}},
    )
    assert stack.weightsync.pause_mode == "keep"
    assert stack.weightsync.bucket_size_bytes == 1 << 20
    assert stack.service_file("weightsync")["pause_mode"] == "keep"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"trainer": {"algorithm": {"no_such": 1}}},
            "services.trainer.algorithm.no_such: Extra inputs are not permitted",
        ),
        ({"reward": {"grpc": {"port": 70000}}}, "services.reward.grpc.port: Input should be"),
        (
            {"trainer": {"rollout_shape": {"eta": 3}}},
            "services.trainer.rollout_shape.eta is 3 but the stack's rollout_shape.eta is 2; "
            "change it there, for every service at once",
        ),
        (
            {"trainer": {"algorithm": {"eta": 3}}},
            "services.trainer.algorithm.eta: moved to rollout_shape.eta",
        ),
        (
            {"gateway": {"rollout": {"max_response_tokens": 3}}},
            "services.gateway.rollout.max_response_tokens: moved to rollout_shape.max_tokens",
        ),
        (
            {"gateway": {"tq": {"namespace": "other"}}},
            "services.gateway.tq.namespace is 'other' but the stack's tq.namespace is 't'",
        ),
        (
            {"gateway": {"rollout": {"partitions": ["val"]}}},
            "services.gateway.rollout.partitions is ['val'] but the stack's partition 'train' "
            "is not in it",
        ),
        ({"engine": {}}, "services.engine: not a service of"),
    ],
)
def test_a_bad_override_names_its_field(overrides: dict, message: str) -> None:
    with pytest.raises(StackError) as caught:
        StackConfig.compose(wiring(LocalPorts.placeholder()), overrides=overrides)
    assert str(caught.value).startswith(message), caught.value


def test_a_deployment_says_what_to_set_instead() -> None:
    with pytest.raises(StackError, match=r"set train\.eta instead"):
        StackConfig.compose(
            wiring(LocalPorts.placeholder()),
            overrides={"gateway": {"rollout_shape": {"eta": 5}}},
            hints={"rollout_shape.eta": "set train.eta instead"},
        )


def test_configs_written_by_hand_are_held_to_the_wiring() -> None:
    ports = LocalPorts.placeholder()
    stack = StackConfig.compose(wiring(ports))
    files = {name: stack.service_file(name) for name in SERVICES}
    again = StackConfig.model_validate({"wiring": stack.wiring, **files})
    assert all(getattr(again, name) == getattr(stack, name) for name in SERVICES)
    files["trainer"] = {**files["trainer"], "gateway": {"target": "127.0.0.1:1"}}
    with pytest.raises(
        ValueError, match=r"trainer\.gateway\.target is '127\.0\.0\.1:1' but the stack's"
    ):
        StackConfig.model_validate({"wiring": stack.wiring, **files})


def test_relayrl_up_checks_its_services_section_when_the_config_is_read() -> None:
    with pytest.raises(ValueError, match=r"services\.reward\.no_such_field: Extra inputs"):
        UpConfig.model_validate({"services": {"reward": {"no_such_field": 1}}})
    with pytest.raises(
        ValueError, match=r"services\.trainer\.rollout_shape\.eta is 3 .* set it in train:"
    ):
        UpConfig.model_validate({"services": {"trainer": {"rollout_shape": {"eta": 3}}}})
    config = UpConfig.model_validate(
        {"services": {"trainer": {"algorithm": {"dapo_filter": False}}}}
    )
    assert config.services.trainer == {"algorithm": {"dapo_filter": False}}


def test_relayrl_up_runs_from_its_composition(tmp_path: Path) -> None:
    config = UpConfig.model_validate({"train": {"mode": "sync", "batch_groups": 3}})
    ports = LocalPorts.choose()
    stack = up_stack(config, tmp_path / "r-1", tmp_path / "m", tmp_path / "p.jsonl", ports)
    assert (stack.gateway.rollout_shape.eta, stack.trainer.algorithm.mode) == (0, "sync")
    assert stack.trainer.checkpoint.dir == tmp_path / "r-1" / "trainer" / "checkpoints"
    assert stack.trainer.data.run_id == "r-1"
    assert stack.weightsync.state_dir == tmp_path / "r-1" / "weightsync" / "state"
    assert stack.gateway.agent_http.port == ports.agent_http
