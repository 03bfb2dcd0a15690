"""A run that cannot progress says why and ends: `relayrl up` with an agent that fails every
rollout (it exits 1 at once) reports the failures while the step waits, then the trainer's
infrastructure stop rule ends the run with one line naming the cause and exit code 3; the
trainer is not restarted, the report's summary gives the failed rollouts with their reason,
and nothing is left running. Real processes throughout: redis-server, the four services, the
vLLM engine, the agent programs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.up.run_state import RunState
from relayrl_testkit.helpers.up import (
    SHORT_RUN,
    UpProcess,
    deep_update,
    processes_of,
    sharing_cache,
)

pytestmark = pytest.mark.slow

FAILING_AGENT = "python3 -c 'import sys; sys.exit(\"no tools configured\")'"
# The rule's thresholds, shrunk: 32 rollouts failing for 5 s (the defaults: 200, 2 minutes).
PROGRESS = {"infra_window": 32, "infra_grace_s": 5, "report_interval_s": 2}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory, up_cache: Path) -> Path:
    return sharing_cache(tmp_path_factory.mktemp("runs"), up_cache)


@pytest.mark.timeout(900)
def test_an_agent_that_fails_every_rollout_ends_the_run_with_exit_3_and_the_cause(
    runs_dir: Path,
) -> None:
    config = deep_update(SHORT_RUN, {"services": {"trainer": {"progress": PROGRESS}}})
    up = UpProcess.start(runs_dir, config, "--agent", FAILING_AGENT)
    try:
        code = up.wait(600)
        output = up.output()
        assert code == 3, output
    finally:
        up.stop()
    run_dir = up.run_dir
    lines = output.splitlines()
    cause = [line for line in lines if line.startswith("relayrl up: no progress: ")]
    assert len(cause) == 1, output
    assert "rollouts failed as infrastructure (the limit is 95%)" in cause[0]
    assert "agent 'external' exited 1" in cause[0] and "no tools configured" in cause[0]
    # while the step waited, the console said what failed (its first line may come before
    # any rollout has failed)
    waiting = [line for line in lines if line.startswith("  step 0 waiting")]
    assert any("rollouts failed (most common" in line for line in waiting), output
    # not restarted: the trainer exited once, with 3
    supervisor = [
        json.loads(line)
        for line in (run_dir / "logs" / "supervisor.jsonl").read_text().splitlines()
    ]
    assert not [e for e in supervisor if e["child"] == "trainer" and e["kind"] == "restarted"]
    assert "Traceback" not in output
    summary = lines[-2] if lines[-1].startswith("resume with") else lines[-1]
    assert "rollouts failed as infrastructure (agent 'external' exited 1" in output, output
    assert "stopped: " in output and "no group rejected" not in summary
    state = RunState.read(run_dir)
    assert state.state == "no_progress" and "rollouts failed" in (state.error or "")
    assert processes_of(run_dir) == []
