"""`relayrl up` end to end, as a user runs it: redis-server, the four services and a real vLLM
engine as processes, a warm-started tiny model trained for a few GRPO steps in each trainer
mode, then audited (relayrl_testkit.helpers.up.check_short_run): weight versions reached the
engine, the TransferQueue consumed every trained group exactly once and marked no trajectory as
an infrastructure failure, every service's /metrics served its series, and nothing is left
running. The default mode's run is test_up_hosts.py's, checked the same way.

colocate_async's run covers two more things a user brings, so that the suite starts one stack
for three checks: a reasoning-gym task (an external package's generator and its own reward
manager), and the README's promise that any OpenAI-client program trains unchanged. Its every
sample is rolled out by examples/agents/plain_openai_agent.py, which asks two chat turns with
the plain `openai` client and exits 0 without closing its session: its exit ends the episode,
and every step trains kept groups of its two-turn trajectories, none an infrastructure
failure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relayrl.up.audit import audit_run
from relayrl.up.run_state import RunState
from relayrl_testkit.helpers.trust import ENGINE_PATHS, knock_on_run, service_descriptors
from relayrl_testkit.helpers.up import (
    SHORT_RUN,
    UpProcess,
    audit_queue,
    check_exactly_once,
    check_short_run,
    deep_update,
    pause_trainer,
    processes_of,
    relayrl,
    repository_copy,
    running,
    service_warnings,
    sharing_cache,
    steps_logged,
    wait_for_steps,
)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory, up_cache: Path) -> Path:
    """One runs folder per module; the model and warm start are built once per session
    (runs/cache is the session's)."""
    return sharing_cache(tmp_path_factory.mktemp("runs"), up_cache)


REPO = Path(__file__).resolve().parents[3]
PLAIN_AGENT = REPO / "examples" / "agents" / "plain_openai_agent.py"
# The task each mode's run trains, and colocate_async's agent (see the module's docstring).
TASKS = {"sync": "arith", "colocate_async": "reasoning_gym:leg_counting"}
PLAIN_AGENT_ARGS = ("--agent", f"{sys.executable} {PLAIN_AGENT}")


@pytest.mark.timeout(900)
# separate_async, the default, is checked the same way on the run of test_up_hosts.py, whose
# parts are partitioned from one another while it trains
@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_a_short_run_in_each_mode(
    runs_dir: Path, up_cache: Path, mode: str, tmp_path: Path
) -> None:
    steps, task = SHORT_RUN["train"]["steps"], TASKS[mode]
    if mode == "sync":  # as a newcomer starts it: `make run` in the repository, runs/ relative
        repo = repository_copy(tmp_path / "repo")
        # runs/cache is the session's: the other runs build the model and the warm start
        sharing_cache(repo / "runs", up_cache)
        up = UpProcess.make_run(repo, SHORT_RUN, "--mode", mode)
    else:
        up = UpProcess.start(runs_dir, SHORT_RUN, "--mode", mode, "--task", task, *PLAIN_AGENT_ARGS)
    try:
        assert up.wait(900) == 0, up.output()
        run_dir = up.run_dir
        output = up.output()
    finally:
        up.stop()
    assert f"trained {task} for {steps} steps in {mode}" in output, output
    if mode == "sync":
        assert run_dir.parent == repo / "runs" and (repo / "runs" / "cache").is_dir()
        assert "Traceback" not in output
    else:  # scored by the reasoning-gym manager the task configured
        reward_file = run_dir / "services" / "reward" / "relayrl-reward.yaml"
        managers = yaml.safe_load(reward_file.read_text())["managers"]
        assert managers["reasoning_gym"]["type"] == "reasoning_gym"

    check_short_run(run_dir, mode, steps)
    if mode == "colocate_async":
        check_plain_agent_trained_unchanged(run_dir)


def check_plain_agent_trained_unchanged(run_dir: Path) -> None:
    """Every trained sample is one of the plain program's sessions, ended by its exit: two
    generated turns with the user's follow-up between them, none an infrastructure failure."""
    n, groups = SHORT_RUN["train"]["samples_per_prompt"], SHORT_RUN["train"]["batch_groups"]
    records = steps_logged(run_dir)
    assert all(len(record.uids) == groups for record in records), records  # kept groups
    audit = audit_queue(run_dir)
    infra = audit.infra_trajectories()
    assert infra == [], "\n".join([*infra, service_warnings(run_dir)])
    for uid in {uid for record in records for uid in record.uids}:
        entry = audit.groups[uid]
        assert entry.group.agent == "external"
        assert sorted(t.index for t in entry.trajectories) == list(range(n)), uid
        for trajectory in entry.trajectories:
            assert trajectory.labels["agent_session"] and trajectory.finish_reason != "error"
            mask = bytes(trajectory.response_mask)
            assert mask[0] == 1 and mask[-1] == 1 and 0 in mask, uid
    assert running(PLAIN_AGENT) == []


@pytest.mark.timeout(1200)
def test_ctrl_c_stops_everything_and_resume_finishes_the_run(runs_dir: Path) -> None:
    config = deep_update(SHORT_RUN, {"train": {"steps": 4}})
    up = UpProcess.start(runs_dir, config, "--mode", "separate_async")
    try:
        wait_for_steps(up, 1, 600)
        run_dir = up.run_dir
        # held before its next step: a fast run would otherwise end before the knocks
        pause_trainer(run_dir)
        status = subprocess.run(
            [relayrl(), "status", str(run_dir)], capture_output=True, text=True, timeout=60
        )
        knocks = knock_on_run(run_dir)
        up.interrupt()
        assert up.wait(300) == 130, up.output()
    finally:
        up.stop()
    # the running services refused every call without the run's tokens, and every call made
    # with another role's token (while the run itself, and `relayrl status`, got through)
    assert knocks.unauth_accepted == [], knocks.unauth_accepted
    assert knocks.wrong_role_accepted == [], knocks.wrong_role_accepted
    methods = sum(len(d.methods) for d in service_descriptors().values())
    tried = knocks.methods_tried()
    assert len([m for m in tried if not m.startswith("engine.")]) == methods
    assert len([m for m in tried if m.startswith("engine.")]) == len(ENGINE_PATHS)
    assert len(knocks.of_kind(anonymous=False)) > 0
    secrets = run_dir / "secrets"
    assert oct(secrets.stat().st_mode & 0o777) == "0o700"
    assert {oct(p.stat().st_mode & 0o777) for p in secrets.iterdir()} == {"0o600"}
    # `relayrl status` asked the running stack itself
    assert status.returncode == 0, status.stderr
    lines = status.stdout
    assert "training" in lines.splitlines()[0], lines
    for name in ("redis ok", "reward SERVING", "gateway SERVING", "weightsync SERVING"):
        assert name in lines, lines
    assert "trainer SERVING (step" in lines and "engine-0 ok" in lines, lines
    assert re.search(r"weights:  engine-0 v[1-9]", lines), lines  # the engines got new ones
    assert re.search(r"queue:    groups .*consumed=\d+", lines), lines
    assert "held-out: " in lines, lines
    assert "resume with: relayrl up --resume" in up.output()
    assert processes_of(run_dir) == []
    assert RunState.read(run_dir).state == "stopped"
    stopped_at = {r.step for r in steps_logged(run_dir)}
    assert (run_dir / "redis" / "appendonlydir").is_dir()
    # the clean stop gave the gateway's claims back: the resume waits for no lease
    assert audit_queue(run_dir).statuses["GROUP_STATUS_RUNNING"] == 0

    resumed = UpProcess.resume(run_dir)
    try:
        assert resumed.wait(900) == 0, resumed.output()
    finally:
        resumed.stop()
    assert "trained arith for 4 steps" in resumed.output()
    steps = {r.step for r in steps_logged(run_dir)}
    assert steps == {0, 1, 2, 3} and stopped_at <= steps
    check_exactly_once(run_dir, audit_queue(run_dir))
    # across the stop and the resume, every issue of a prompt is accounted for
    report = audit_run(run_dir)
    assert report.prompts_lost == [], report.summary()
    assert " prompts_skipped=0 prompts_lost=0" in report.summary(), report.summary()
    # the resumed trainer republished its checkpoint's weights before going on
    assert "republished version" in (run_dir / "logs" / "trainer.log").read_text()
    assert processes_of(run_dir) == []


@pytest.mark.timeout(600)
def test_a_child_that_fails_to_start_ends_the_run_with_one_line(runs_dir: Path) -> None:
    # a config that composes, but the reward-service cannot start with: its tokens file is
    # missing (a mistake only the child can see, at start-up)
    missing = runs_dir / "no-such-tokens.yaml"
    auth = {"type": "static_token", "tokens_file": str(missing)}
    config = deep_update(SHORT_RUN, {"services": {"reward": {"auth": auth}}})
    up = UpProcess.start(runs_dir, config)
    try:
        code = up.wait(300)
        run_dir = up.run_dir
    finally:
        up.stop()
    output = up.output()
    assert code == 1, output
    assert "Traceback" not in output, output
    (line,) = [x for x in output.splitlines() if "failed to start" in x]
    assert line.startswith("relayrl up: reward failed to start (relayrl-reward exited "), line
    assert "no-such-tokens.yaml" in line, line
    assert line.endswith(f"see {run_dir / 'logs' / 'reward.log'}"), line
    assert processes_of(run_dir) == []
    assert RunState.read(run_dir).state == "failed"
