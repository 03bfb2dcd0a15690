"""`relayrl up --agent`: a user's agent program rolls out every training sample of a short run
through the real stack (redis-server, the four services and a real vLLM engine). Agent
frameworks, the OpenAI Agents SDK among them, are in test_up_frameworks.py; the plain `openai`
program of examples/agents/plain_openai_agent.py, which never closes its session, rolls out
test_up_e2e.py's colocate_async run.

`relayrl up --data --env-reward --agent` with a verifiers environment (examples/agents/
verifiers_env's vf-arith, exported to a dataset and served by examples/agents/verifiers_agent.py
in the verifiers virtual environment): the reward the trainer trains on is the environment's
rubric, reported with each session's close."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl_testkit.helpers.up import (
    SHORT_RUN,
    UpProcess,
    audit_queue,
    check_exactly_once,
    deep_update,
    processes_of,
    running,
    service_warnings,
    sharing_cache,
    steps_logged,
)

REPO = Path(__file__).resolve().parents[3]
PLAIN_AGENT = REPO / "examples" / "agents" / "plain_openai_agent.py"
VERIFIERS_PYTHON = REPO / ".venv" / "share" / "venvs" / "verifiers" / "bin" / "python"
VERIFIERS_AGENT = REPO / "examples" / "agents" / "verifiers_agent.py"
VERIFIERS_ENV = {"PYTHONPATH": str(REPO / "examples" / "agents" / "verifiers_env")}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory, up_cache: Path) -> Path:
    return sharing_cache(tmp_path_factory.mktemp("runs"), up_cache)


@pytest.mark.timeout(900)
def test_a_verifiers_environment_scores_what_the_trainer_trains_on(
    runs_dir: Path, tmp_path: Path
) -> None:
    assert VERIFIERS_PYTHON.exists(), f"{VERIFIERS_PYTHON}: run make setup"
    data = tmp_path / "vf-arith.jsonl"
    export = [str(VERIFIERS_PYTHON), str(VERIFIERS_AGENT), "export", "--taskset", "vf-arith"]
    rows = subprocess.run(
        export, env=VERIFIERS_ENV, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    data.write_text(rows)
    config = deep_update(SHORT_RUN, {"agent": {"env": VERIFIERS_ENV}})
    steps, n = config["train"]["steps"], config["train"]["samples_per_prompt"]
    agent = f"{VERIFIERS_PYTHON} {VERIFIERS_AGENT} --taskset vf-arith --serve"
    up = UpProcess.start(
        runs_dir, config, "--mode", "sync", "--data", str(data), "--env-reward",
        "--agent-serve", "--agent", agent,
    )  # fmt: skip
    try:
        assert up.wait(900) == 0, up.output()
        run_dir, output = up.run_dir, up.output()
    finally:
        up.stop()
    assert f"trained dataset for {steps} steps in sync" in output, output
    assert "held-out evaluation: off" in output, output  # nothing but the environment can judge

    records = steps_logged(run_dir)
    assert [r.step for r in records] == list(range(steps))
    audit = audit_queue(run_dir)
    check_exactly_once(run_dir, audit)
    infra = audit.infra_trajectories()
    assert infra == [], "\n".join([*infra, service_warnings(run_dir)])
    tasks = {json.dumps(json.loads(row)["prompt"]) for row in rows.splitlines()}
    rewards = []
    for record in records:
        scores = []
        for uid in record.uids:
            entry = audit.groups[uid]
            assert (
                entry.group.agent == "external" and entry.group.data_source == "verifiers/vf-arith"
            )
            assert (
                json.dumps([{"role": m.role, "content": m.content} for m in entry.group.messages])
                in tasks
            )
            assert sorted(t.index for t in entry.trajectories) == list(range(n)), uid
            for trajectory in entry.trajectories:
                assert trajectory.labels["agent_session"], trajectory.labels
                env = trajectory.env_reward
                assert env.status == common_pb2.ENV_REWARD_STATUS_OK, (uid, env)
                # the reward-service's score is the environment's reported rubric
                assert trajectory.reward.status == common_pb2.REWARD_STATUS_OK
                assert trajectory.reward.score == env.score
                scores.append(trajectory.reward.score)
        # the trainer's step trained on exactly those rewards
        assert record.reward_mean == pytest.approx(np.mean(scores), abs=1e-6), record.step
        rewards += scores
    assert max(rewards) > 0.0  # the rubric's brevity term rewards every reply a little
    assert processes_of(run_dir) == [] and running(VERIFIERS_AGENT) == []
