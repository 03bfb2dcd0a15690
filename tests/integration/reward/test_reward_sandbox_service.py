"""The code sandbox as the chart deploys it: `relayrl-sandbox` in a container of its own (root
with only the capabilities the sandbox needs, no secrets) and the reward-service beside it as a
non-root uid with every capability dropped, talking over a unix socket.

Both run as real processes under `setpriv` with exactly those credentials. The reward-service
runs under Debian's /usr/bin/python3.11 because the venv's interpreter lives under /root,
which another uid cannot enter (in the image the interpreter is world-readable)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.core.service_process import ServiceProcess, console_script
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2
from relayrl.reward.items import InfraError, RewardItem
from relayrl.reward.managers.sandbox_remote import RemoteSandboxConfig
from relayrl.reward.sandbox_service import MAX_REQUEST_BYTES
from relayrl_testkit.helpers.fuzz import fuzz_sandbox
from relayrl_testkit.helpers.reward import RewardProcess
from relayrl_testkit.helpers.sandbox import DEBIAN_PYTHON
from relayrl_testkit.helpers.sandbox import start_sandbox as start_sandbox_as_deployed
from relayrl_testkit.helpers.trust import knock_on_sandbox

REWARD_UID = 10001
TOKEN = "team-a-token-0123456789abcdef"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not Path(DEBIAN_PYTHON).exists(),
    reason="needs root (to start both sides with their own credentials), setpriv and "
    f"{DEBIAN_PYTHON}",
)


def reward_argv() -> list[str]:
    """The reward-service as the chart runs it: uid/gid 10001, no capabilities, no way back."""
    return [
        "setpriv",
        f"--reuid={REWARD_UID}",
        f"--regid={REWARD_UID}",
        "--clear-groups",
        "--bounding-set=-all",
        "--inh-caps=-all",
        "--no-new-privs",
        DEBIAN_PYTHON,
        "-c",
        "import sys; from relayrl.reward.cli import main; sys.exit(main())",
    ]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory both uids can reach (pytest's tmp_path is under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="relayrl-sandbox-pod-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start_sandbox(shared: Path, **sandbox: Any) -> ServiceProcess:
    (shared / "sock").mkdir(mode=0o755, exist_ok=True)
    socket_path = shared / "sock" / "sandbox.sock"
    return start_sandbox_as_deployed(
        shared / "sandbox", socket_path, [REWARD_UID], time_limit_s=5.0, **sandbox
    )


def start_reward(shared: Path) -> RewardProcess:
    workdir = shared / "reward"
    workdir.mkdir()
    os.chown(workdir, REWARD_UID, REWARD_UID)
    tokens = workdir / "tenants.yaml"
    tokens.write_text(f"team-a: {TOKEN}\n", encoding="utf-8")
    os.chown(tokens, REWARD_UID, REWARD_UID)
    tokens.chmod(0o600)
    config = {
        "auth": {"type": "static_token", "tokens_file": str(tokens)},
        "managers": {
            "code": {"type": "sandbox_remote", "socket": str(shared / "sock" / "sandbox.sock")}
        },
        "default_manager": "code",
    }
    site = Path(sys.executable).parent.parent / "lib/python3.11/site-packages"
    services = Path(__file__).resolve().parents[3] / "services"
    env = {"PYTHONPATH": f"{services}:{site}", "HOME": str(workdir)}
    return RewardProcess(workdir, config, env=env, argv=reward_argv()).start()


def code_item(item_id: str, code: str, tests: str) -> common_pb2.RewardItem:
    return common_pb2.RewardItem(
        item_id=item_id, data_source="code", response=f"```python\n{code}\n```", ground_truth=tests
    )


async def score(reward: RewardProcess, *items: common_pb2.RewardItem) -> list[Any]:
    channel, stub = reward.stub(TOKEN)
    async with channel:
        response = await stub.Score(reward_pb2.ScoreRequest(items=items))
    return list(response.results)


def test_candidate_code_from_a_non_root_reward_pod_runs_isolated_in_the_sandbox(
    shared: Path,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    # audit_guard off: the OS layers alone must hold (the candidate's attempts are not
    # blocked in-process, they fail in the kernel)
    sandbox = start_sandbox(shared, audit_guard=False)
    reward = None
    try:
        ready = json.loads(sandbox.ready_file.read_text())
        layers = set(ready["layers"])
        assert {"netns", "nproc"} <= layers and any(x.startswith("uid:6000") for x in layers)
        reward = start_reward(shared)
        assert reward.process is not None
        status = Path(f"/proc/{reward.process.pid}/status").read_text()
        assert f"Uid:\t{REWARD_UID}" in status and "CapEff:\t0000000000000000" in status

        secrets = shared / "reward" / "tenants.yaml"
        escape = f"""
import os, socket
try:
    open({str(secrets)!r}).read()
    read_secret = True
except PermissionError:
    read_secret = False
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    reached = True
except OSError:
    reached = False
try:
    child = os.fork()
except OSError:
    child = None
if child == 0:
    os._exit(0)
"""
        tests = (
            "assert not read_secret\n"
            "assert not reached\n"
            "assert child is None\n"
            "assert os.getuid() >= 60000 and os.getuid() != 10001\n"
        )
        results = asyncio.run(
            score(
                reward,
                code_item("good", "def double(x):\n    return 2 * x", "assert double(21) == 42"),
                code_item("wrong", "def double(x):\n    return x", "assert double(21) == 42"),
                code_item("escape", escape, tests),
            )
        )
        by_id = {r.item_id: r for r in results}
        assert by_id["good"].status == common_pb2.REWARD_STATUS_OK, by_id["good"]
        assert by_id["good"].score == 1.0
        assert by_id["wrong"].status == common_pb2.REWARD_STATUS_POLICY_FAIL, by_id["wrong"]
        assert "test 1 failed" in by_id["wrong"].message
        # every escape failed in the kernel, and the candidate could tell
        assert by_id["escape"].status == common_pb2.REWARD_STATUS_OK, by_id["escape"].message
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected

        # the sandbox gone: the item is an infrastructure failure, never a reward of 0
        sandbox.stop()
        (result,) = asyncio.run(score(reward, code_item("late", "x = 1", "assert x == 1")))
        assert result.status == common_pb2.REWARD_STATUS_INFRA_ERROR, result
        assert "not reachable" in result.message and "relayrl-sandbox" in result.message
        assert reward.alive()
    finally:
        listener.close()
        sandbox.stop()
        if reward is not None:
            reward.stop()


def test_only_the_allowed_uid_may_submit_code(shared: Path) -> None:
    sandbox = start_sandbox(shared)
    try:
        path = shared / "sock" / "sandbox.sock"
        mode = path.stat()
        assert (mode.st_uid, mode.st_mode & 0o777) == (REWARD_UID, 0o600)
        # this test runs as root: the file mode lets it connect, the peer check does not
        manager = RemoteSandboxConfig(type="sandbox_remote", socket=str(path)).build("code", None)  # type: ignore[arg-type]
        item = RewardItem(
            item_id="x", data_source="code", prompt="", response="x = 1", ground_truth="assert x"
        )
        with pytest.raises(InfraError, match=r"uid 0 \(this service's own\) may only ping"):
            asyncio.run(manager.score(item))
        # ... which is what the container's probe does
        probe = [sys.executable, "-m", "relayrl.core.healthcheck", "sandbox", str(path)]
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    finally:
        sandbox.stop()
    result = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "unreachable" in result.stderr


def test_a_uid_neither_allowed_nor_its_own_is_refused(shared: Path) -> None:
    sandbox = start_sandbox(shared)
    try:
        path = shared / "sock" / "sandbox.sock"
        path.chmod(0o666)  # past the file mode: the peer check alone must refuse
        report = knock_on_sandbox(path, [60005, 10002])
        assert [k.status for k in report.knocks] == ["PERMISSION_DENIED"] * 2
        assert report.unauth_accepted == []
        assert "refused a caller with uid 60005" in sandbox.log()
    finally:
        sandbox.stop()


def test_start_up_mistakes_are_one_line(shared: Path) -> None:
    (shared / "not-a-socket").write_text("x")
    cases = {
        # candidate code could submit code of its own
        "allow_uids [60000] are sandbox slot uids": (
            {"socket": str(shared / "s.sock"), "allow_uids": [60000]},
            2,
        ),
        "exists and is not a socket": (
            {"socket": str(shared / "not-a-socket"), "allow_uids": [REWARD_UID]},
            1,
        ),
    }
    for expected, (config, code) in cases.items():
        path = shared / "config.yaml"
        path.write_text(json.dumps(config))
        result = subprocess.run(
            [console_script("relayrl-sandbox"), "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code and len(lines) == 1, result.stderr
        assert expected in lines[0] and "Traceback" not in result.stderr


def test_bad_input_on_the_socket_never_crashes_it(shared: Path) -> None:
    # allow_uids [0]: this (root) test process is the caller, so every case reaches the parser
    (shared / "sock").mkdir(mode=0o755)
    socket_path = shared / "sock" / "sandbox.sock"
    sandbox = start_sandbox_as_deployed(shared / "sandbox", socket_path, [0])
    try:
        report = fuzz_sandbox(
            str(socket_path), cases=210, seed=20, max_request_bytes=MAX_REQUEST_BYTES
        )
        assert report.crashes == [], report.crashes
        assert report.cases == 210 and sandbox.alive()
        # every kind of answer came back, judged answers included
        assert {"INVALID_INPUT", "OK", "POLICY_FAIL", "closed"} <= set(report.statuses)
        probe = [sys.executable, "-m", "relayrl.core.healthcheck", "sandbox", str(socket_path)]
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
        assert "Traceback" not in sandbox.log()
    finally:
        sandbox.stop()
