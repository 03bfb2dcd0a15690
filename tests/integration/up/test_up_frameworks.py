"""Agent frameworks train unchanged through `relayrl up --agent`, each served from the
frameworks' virtual environment that `make setup` builds, on the `lookup` task through the
real stack (redis-server, the four services, a real vLLM engine):

- LangChain's classic ReAct agent (examples/agents/langchain_react_agent.py) rewrites its one
  prompt message every turn and stops on "\\nObservation": its turns are segments;
- a LangGraph graph whose nodes bind different tools (examples/agents/langgraph_agent.py):
  the second node's request starts a segment of its own, every time;
- a pydantic-ai `Agent` with a tool (examples/agents/pydantic_ai_agent.py): one conversation,
  with a turn per tool call.

Every step trains its groups; every trajectory is the gateway's record of its session (the
segments' tokens included, spans versioned), none an infrastructure failure, and no agent
process outlives the run."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from relayrl_testkit.helpers.up import (
    SHORT_RUN,
    UpProcess,
    audit_queue,
    check_exactly_once,
    deep_update,
    processes_of,
    service_warnings,
    sharing_cache,
    steps_logged,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
AGENTS = REPO / "examples" / "agents"
PYTHON = REPO / ".venv" / "share" / "venvs" / "frameworks" / "bin" / "python"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory, up_cache: Path) -> Path:
    return sharing_cache(tmp_path_factory.mktemp("runs"), up_cache)


def alive(agent: Path) -> list[str]:
    return [
        f"{p.info['pid']}: {' '.join(p.info['cmdline'])}"
        for p in psutil.process_iter(["pid", "cmdline"])
        if str(agent) in " ".join(p.info["cmdline"] or ())
    ]


def segments_of(trajectory) -> list:  # type: ignore[no-untyped-def]
    """The trajectory's own tokens and each segment's, as (response ids, mask, log-probs,
    spans)."""
    parts = [trajectory, *trajectory.segments]
    return [
        (list(p.response_token_ids), bytes(p.response_mask), list(p.rollout_logprobs), p.spans)
        for p in parts
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("script", "segmented"),
    [
        ("langchain_react_agent.py", "some"),
        ("langgraph_agent.py", "all"),
        ("pydantic_ai_agent.py", "none"),
    ],
)
def test_an_agent_framework_trains_unchanged(runs_dir: Path, script: str, segmented: str) -> None:
    assert PYTHON.exists(), f"{PYTHON}: run make setup"
    agent = AGENTS / script
    config = deep_update(SHORT_RUN, {"task": {"name": "lookup"}, "agent": {"serve": True}})
    steps, n = config["train"]["steps"], config["train"]["samples_per_prompt"]
    up = UpProcess.start(runs_dir, config, "--agent", f"{PYTHON} {agent} --serve")
    try:
        assert up.wait(800) == 0, up.output()
        run_dir, output = up.run_dir, up.output()
    finally:
        up.stop()
    assert f"trained lookup for {steps} steps" in output, output

    records = steps_logged(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    assert all(len(r["uids"]) == config["train"]["batch_groups"] for r in records), records
    audit = audit_queue(run_dir)
    check_exactly_once(run_dir, audit)
    infra = audit.infra_trajectories()
    assert infra == [], "\n".join([*infra, service_warnings(run_dir)])
    counts = []
    for uid in {uid for record in records for uid in record["uids"]}:
        entry = audit.groups[uid]
        assert entry.group.agent == "external"
        assert sorted(t.index for t in entry.trajectories) == list(range(n)), uid
        for trajectory in entry.trajectories:
            assert trajectory.labels["agent_session"], trajectory.labels
            for response, mask, logprobs, spans in segments_of(trajectory):
                assert len(mask) == len(response) == len(logprobs) > 0
                generated = [s for s in spans if s.generated]
                assert generated and all(s.policy_version >= 0 for s in generated)
                assert sum(s.end - s.start for s in generated) == sum(mask)
            counts.append(len(trajectory.segments))
    if segmented == "all":
        assert min(counts) >= 1, counts
    elif segmented == "some":
        assert max(counts) >= 1, counts
    else:
        assert max(counts) == 0, counts
    assert processes_of(run_dir) == [] and alive(agent) == []
