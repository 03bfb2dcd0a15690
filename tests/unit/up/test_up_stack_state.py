"""stack.json is one typed object (relayrl.up.stack_state): written by the supervisor, read by
status, the CLI, the test kit and the benches; a file that is not a stack's state is one
error naming the file and the field, never a KeyError in a reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.up.stack_state import ChildState, HostsState, PartHost, StackState, StackStateError


def state(**changes: object) -> StackState:
    fields = {
        "redis_url": "redis://127.0.0.1:6390/0",
        "namespace": "relayrl",
        "partition": "train",
        "engines": ["http://127.0.0.1:8100"],
        "children": {
            "redis": ChildState(pid=11, url="redis://127.0.0.1:6390/0"),
            "trainer": ChildState(pid=12, restarts=2, target="127.0.0.1:7001"),
            "engine-0": ChildState(pid=None, url="http://127.0.0.1:8100"),
        },
        "written": 1765000000.0,
    }
    return StackState.model_validate(fields | changes)


def test_what_is_written_is_what_is_read(tmp_path: Path) -> None:
    hosts = HostsState(
        tag="rr1",
        subnet="10.77.0.0/24",
        bridge="rr1-br",
        bridge_address="10.77.0.1",
        parts={"trainer": PartHost(netns="rr1-trainer", address="10.77.0.5", veth="rr1-v5")},
    )
    written = state(hosts=hosts)
    written.write(tmp_path)
    read = StackState.read(tmp_path)
    assert read == written
    assert (read.pid("trainer"), read.pid("engine-0"), read.pid("gateway")) == (12, None, None)
    assert read.pids() == [11, 12]


def test_a_run_without_a_stack_yet_has_none(tmp_path: Path) -> None:
    assert StackState.read_if_any(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        StackState.read(tmp_path)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"children": {"trainer": {"pid": "twelve"}}}, "children.trainer.pid: Input should be"),
        ({"children": {"trainer": {"pid": 1, "port": 5}}}, "children.trainer.port: Extra"),
        ({"engines": None}, "engines: Input should be a valid list"),
    ],
)
def test_a_wrong_shaped_file_is_one_error_naming_the_field(
    tmp_path: Path, broken: dict, message: str
) -> None:
    data = json.loads(state().model_dump_json()) | broken
    (tmp_path / "stack.json").write_text(json.dumps(data))
    with pytest.raises(StackStateError) as raised:
        StackState.read(tmp_path)
    assert str(raised.value).startswith(f"{tmp_path / 'stack.json'}: {message}"), raised.value


def test_a_torn_file_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text('{"redis_url": ')
    with pytest.raises(StackStateError, match=r"stack\.json: Expecting value"):
        StackState.read(tmp_path)
