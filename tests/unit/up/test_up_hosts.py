"""`hosts.isolate`: off, every part of a local run is on loopback exactly as before; on, each
part gets an address of its own on a private /24 (never the bridge's), every bind address,
URL and target of the composition follows, agents are started on their own host, the names
fit Linux's interface names, and `relayrl up` refuses in one line where it cannot make them.
Nothing is made here (the plan is pure); tests/integration/up/test_up_netfault.py makes real
ones."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl import cli
from relayrl.stack import SERVICES
from relayrl.stack.local import AGENTS, PARTS, LocalPorts
from relayrl.up import hosts
from relayrl.up.config import UpConfig
from relayrl.up.hosts import IFNAMSIZ, HostNetwork, free_subnet, tag_of
from relayrl.up.prepare import RunFiles
from relayrl.up.stack_state import StackState
from relayrl.up.supervisor import Supervisor

AGENT = ["python3", "agent.py"]


def a_stack(tmp_path: Path, **hosts_section: Any) -> Supervisor:
    config = UpConfig.model_validate(
        {"placement": {"auto": False}, "hosts": hosts_section, "agent": {"command": AGENT}}
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    stack = Supervisor(
        config, run_dir, tmp_path / "model", RunFiles.in_dir(tmp_path), LocalPorts.placeholder()
    )
    if stack.network is not None:
        stack.network.create = lambda: None  # type: ignore[method-assign] (nothing is made)
    stack.build()
    return stack


def addresses_of(stack: Supervisor) -> dict[str, Any]:
    """Every address the run's parts bind or dial, by where it is configured."""
    files = stack.service_configs()
    found: dict[str, Any] = {
        "redis": stack.children["redis"].host,  # type: ignore[attr-defined]
        "redis_url": stack.redis_url,
        "engine": stack.engine_config().host,
        "engine_url": stack.engine_url,
        "agent_http": files["gateway"]["agent_http"]["host"],
        "gateway.engines": files["gateway"]["engines"]["urls"],
        "agent": files["gateway"]["agents"]["external"]["external"]["command"],
    }
    for name in SERVICES:
        found[f"{name}.grpc"] = files[name]["grpc"]["host"]
        found[f"{name}.metrics"] = files[name]["metrics"]["host"]
        found[f"{name}.target"] = stack.target(name)
        found[f"{name}.metrics_url"] = stack.metrics_url(name)
    for name in ("reward", "gateway", "trainer"):
        found[f"{name}.tq"] = files[name]["tq"]["url"]
    found["trainer.publish"] = files["trainer"]["publish"]["target"]
    found["gateway.weightsync"] = files["gateway"]["weightsync"]["target"]
    found["weightsync.advertise"] = files["weightsync"]["advertise_target"]
    return found


def test_without_hosts_every_part_is_on_loopback_as_before(tmp_path: Path) -> None:
    stack = a_stack(tmp_path)
    p = stack.ports
    assert stack.network is None and p.addresses == {}
    found = addresses_of(stack)
    expected: dict[str, Any] = {
        "redis": "127.0.0.1",
        "redis_url": f"redis://127.0.0.1:{p.redis}/0",
        "engine": "127.0.0.1",
        "engine_url": f"http://127.0.0.1:{p.engine}",
        "agent_http": "127.0.0.1",
        "gateway.engines": [f"http://127.0.0.1:{p.engine}"],
        "agent": AGENT,  # as given: no launcher
        "trainer.publish": f"127.0.0.1:{p.grpc['weightsync']}",
        "gateway.weightsync": f"127.0.0.1:{p.grpc['weightsync']}",
        "weightsync.advertise": f"127.0.0.1:{p.grpc['weightsync']}",
    }
    for name in SERVICES:
        expected |= {
            f"{name}.grpc": "127.0.0.1",
            f"{name}.metrics": "127.0.0.1",
            f"{name}.target": f"127.0.0.1:{p.grpc[name]}",
            f"{name}.metrics_url": f"http://127.0.0.1:{p.metrics[name]}/metrics",
        }
    for name in ("reward", "gateway", "trainer"):
        expected[f"{name}.tq"] = f"redis://127.0.0.1:{p.redis}/0"
    assert found == expected
    stack.write_state()
    assert StackState.read(stack.run_dir).hosts is None


def test_with_hosts_each_part_binds_and_is_dialled_at_its_own_address(tmp_path: Path) -> None:
    stack = a_stack(tmp_path, isolate=True)
    network = stack.network
    assert network is not None and set(network.hosts) == set(PARTS)
    addresses = network.addresses()
    own = {ipaddress.IPv4Address(a) for a in addresses.values()}
    assert len(own) == len(PARTS) and all(a in network.subnet for a in own)
    assert ipaddress.IPv4Address(network.bridge_address) not in own
    assert network.subnet.prefixlen == 24 and network.subnet.is_private

    p, at = stack.ports, addresses
    found = addresses_of(stack)
    assert found["redis"] == at["redis"]
    assert found["redis_url"] == f"redis://{at['redis']}:{p.redis}/0"
    assert found["engine"] == at["engine-0"]
    assert found["gateway.engines"] == [f"http://{at['engine-0']}:{p.engine}"] == [stack.engine_url]
    assert found["agent_http"] == at["gateway"]
    for name in SERVICES:
        assert found[f"{name}.grpc"] == found[f"{name}.metrics"] == at[name]
        assert found[f"{name}.target"] == f"{at[name]}:{p.grpc[name]}"
        assert found[f"{name}.metrics_url"] == f"http://{at[name]}:{p.metrics[name]}/metrics"
    assert found["trainer.publish"] == found["weightsync.advertise"] == stack.target("weightsync")
    # the agents run on their own host: the gateway starts them through nsenter, in place
    launcher = found["agent"][: -len(AGENT)]
    assert found["agent"][-len(AGENT) :] == AGENT
    assert launcher[0].endswith("nsenter") and launcher[1:] == [
        f"--net=/run/netns/{network.hosts[AGENTS].netns}",
        "--",
    ]
    stack.write_state()
    state = StackState.read(stack.run_dir)
    assert state.hosts is not None and state.hosts.parts["gateway"].address == at["gateway"]
    assert state.children["gateway"].netns == network.hosts["gateway"].netns
    line = network.describe()
    assert line.startswith("hosts: redis ") and all(a in line for a in addresses.values())


def test_names_fit_linux_and_follow_the_pid_and_the_subnet_avoids_routes() -> None:
    pid = 4_194_304  # the largest PID Linux hands out
    taken = [ipaddress.IPv4Network("10.0.0.0/9"), ipaddress.IPv4Network("10.128.0.0/10")]
    network = HostNetwork.plan(PARTS, tag=tag_of(pid), taken=taken)
    interfaces = [network.bridge, *(h.veth for h in network.hosts.values())]
    assert all(len(name) <= IFNAMSIZ for name in interfaces), interfaces
    assert all(name.startswith(f"rl{pid}-") for name in interfaces)
    assert all(h.netns == f"rl{pid}-{part}" for part, h in network.hosts.items())
    assert not any(network.subnet.overlaps(route) for route in taken)
    assert HostNetwork.from_state(network.state()) == network  # as a test kit reads it back
    # one tag, one subnet; the next free one where it is taken
    assert HostNetwork.plan(PARTS, tag=tag_of(pid), taken=taken).subnet == network.subnet
    moved = free_subnet(7, [free_subnet(7, [])])
    assert moved != free_subnet(7, []) and moved.prefixlen == 24


def test_relayrl_up_refuses_in_one_line_where_hosts_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hosts, "missing_for_hosts", lambda: "needs root (it makes namespaces)")
    config = tmp_path / "up.yaml"
    config.write_text(yaml.safe_dump({"hosts": {"isolate": True}}))
    code = cli.main(["up", "--config", str(config), "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code != 0 and err == "relayrl up: hosts.isolate needs root (it makes namespaces)\n"
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written
