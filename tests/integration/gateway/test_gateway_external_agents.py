"""External agents run by the gateway for claimed groups, end to end: a real redis-server, the
tiny model on a real vLLM engine, a real relayrl-gateway, and real agent processes (a
plain-`openai` program) that talk to its agent endpoint with their session's URL and token.

A well-behaved agent's trajectories are the gateway's record of its turns (engine token ids,
mask 0 on the user turn between them) and are put as finished, also when it exits 0 without
closing (the exit ends the episode); an agent that crashes, hangs past its deadline or exits 0
having generated nothing gets its trajectories put as failed (is_infra) with the reason, and
leaves no process behind.

A verifiers environment (examples/agents/verifiers_env, served by examples/agents/
verifiers_agent.py in the verifiers virtual environment `make setup` builds) reports its
rubric's reward with the close; an episode the environment failed reports an error, never a
reward; a sample that names no task of the environment fails with the reason."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.process import EngineProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.agents import chat_agent
from relayrl_testkit.helpers.up import running

P = "train"
ENV_OK = common_pb2.ENV_REWARD_STATUS_OK
AGENT = [sys.executable, chat_agent.__file__]
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "agents"
VERIFIERS_PYTHON = (
    EXAMPLES.parents[1] / ".venv" / "share" / "venvs" / "verifiers" / "bin" / "python"
)
VERIFIERS_AGENT = [str(VERIFIERS_PYTHON), str(EXAMPLES / "verifiers_agent.py")]
VERIFIERS_ENV = {"PYTHONPATH": str(EXAMPLES / "verifiers_env")}  # the vf-arith taskset


def verifiers_rows(limit: int) -> list[dict]:
    """The first rows of the vf-arith environment, as `verifiers_agent.py export` writes them."""
    assert VERIFIERS_PYTHON.exists(), f"{VERIFIERS_PYTHON}: run make setup"
    export = [*VERIFIERS_AGENT, "export", "--taskset", "vf-arith", "--limit", str(limit)]
    out = subprocess.run(
        export, env=VERIFIERS_ENV, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


def group(uid: str, agent: str, **labels: str) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid,
        labels=labels,
        num_samples=2,
        prompt_token_ids=[1, 2, 3],
        messages=[common_pb2.ChatMessage(role="user", content="What is 2 + 3?")],
        data_source="arith",
        ground_truth="5",
        agent=agent,
    )


def agents_of(process: ServiceProcess) -> list[str]:
    """The agent processes still alive under the gateway."""
    found = []
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if chat_agent.__file__ in " ".join(child.cmdline()):
                found.append(f"{child.pid}: {' '.join(child.cmdline())}")
        except psutil.NoSuchProcess:
            continue
    return found


def test_external_agents_roll_out_claimed_groups_and_failures_are_infra(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    behaviours = {"good": "well", "crash": "crash", "hang": "hang", "noclose": "noclose"}
    behaviours |= {"nogen": "nogen"}
    commands = {"rewarded": [*AGENT, "--reward", "0.75"]}
    # the example agents of examples/agents/ (plain openai, raw HTTP), tools offered
    examples = Path(__file__).resolve().parents[3] / "examples" / "agents"
    commands |= {
        name: [sys.executable, str(examples / f"{name}_tool_agent.py")]
        for name in ("openai", "http")
    }
    config = {
        "tq": {"url": redis_server.url},
        "tokenizer": str(model_dir),
        "engines": {"urls": [engine.url], "health_interval_s": 0.5, "request_timeout_s": 60},
        "rollout": {"partitions": [P]},
        "rollout_shape": {"batch_groups": 32},
        "agent_http": {"model_name": "policy", "max_tokens": 200, "default_max_tokens": 16},
        "agents": {
            "external": {
                name: {
                    "command": [*AGENT, "--behave", behave],
                    "deadline_s": 4.0 if name == "hang" else 120.0,
                    "env": {"PYTHONPATH": ":".join(sys.path)},
                }
                for name, behave in behaviours.items()
            }
            | {
                name: {"command": command, "env": {"PYTHONPATH": ":".join(sys.path)}}
                for name, command in commands.items()
            }
            # served agents: one process takes every task (a second one dies)
            | {
                name: {
                    "command": [*AGENT, "--serve"],
                    "serve": True,
                    "deadline_s": 120.0,
                    "env": {"PYTHONPATH": ":".join(sys.path)},
                }
                for name in ("served", "served-die")
            }
            # the same agent as a coroutine function, run in the gateway
            | {"fn": {"callable": "relayrl_testkit.agents.chat_agent:agent"}}
            # a verifiers environment, and the same one failing its episodes (too short an
            # episode deadline)
            | {
                name: {
                    "command": [*VERIFIERS_AGENT, "--taskset", "vf-arith", "--serve", *more],
                    "serve": True,
                    "deadline_s": 120.0,
                    "env": VERIFIERS_ENV,
                }
                for name, more in (
                    ("vf", []),
                    ("vf-broken", ["--env-config", '{"timeout": {"episode": 0.000001}}']),
                )
            }
        },
    }
    rows = verifiers_rows(2)
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    with ServiceProcess("relayrl-gateway", config, tmp_path / "gw") as gateway:
        groups_put = [group(f"g-{name}", name) for name in behaviours]
        groups_put += [group("g-fn", "fn"), group("g-fnraise", "fn", behave="raise")]
        groups_put += [group("g-rewarded", "rewarded"), group("g-fnrewarded", "fn", reward="0.5")]
        groups_put += [group("g-openai", "openai"), group("g-http", "http")]
        groups_put += [
            group("g-served", "served"),
            group("g-served-error", "served", behave="error"),
        ]
        groups_put += [group("g-served-noclose", "served", behave="noclose")]
        task_of = [json.dumps(row["extra_info"]) for row in rows]  # as a dataset row's label
        groups_put += [
            group("g-vf", "vf", extra_info=task_of[0]),
            group("g-vf-broken", "vf-broken", extra_info=task_of[1]),
            group("g-vf-unknown", "vf"),  # names no task of the environment
        ]
        groups_put += [group("g-served-die", "served-die", behave="die")]
        # a group label of a reward's old name is only a label: only the close reports one
        groups_put += [group("g-posing", "good", env_reward="1.0", env_reward_status="ok")]
        tq.put_groups(P, groups_put)
        deadline = time.monotonic() + 240
        while True:
            groups = {g.group.uid: g for g in tq.get_groups(P, [g.uid for g in groups_put])}
            if all(len(g.trajectories) == 2 for g in groups.values()):
                break
            assert time.monotonic() < deadline, gateway.log()[-4000:]
            time.sleep(0.5)
        # the served agent that died starts again for the next task
        tq.put_groups(P, [group("g-served-again", "served-die")])
        while len(tq.get_groups(P, ["g-served-again"])[0].trajectories) < 2:
            assert time.monotonic() < deadline, gateway.log()[-4000:]
            time.sleep(0.5)
        groups["g-served-again"] = tq.get_groups(P, ["g-served-again"])[0]
        served = [line for line in agents_of(gateway) if "--serve" in line]
        assert len(served) == 2, served  # the two served chat agents' processes
        time.sleep(1.0)  # the last agents' process groups are reaped
    # the gateway's shutdown stopped the served ones (this module alone runs these two)
    assert running(chat_agent.__file__, VERIFIERS_AGENT[1]) == []

    good = groups["g-good"].trajectories + groups["g-fn"].trajectories
    assert [t.tags.is_infra for t in good] == [False] * 4
    # an agent that exits 0 (or reports success) without closing has ended its episode
    names = ("g-openai", "g-http", "g-served", "g-served-again", "g-noclose", "g-served-noclose")
    for name in names:
        assert [t.tags.is_infra for t in groups[name].trajectories] == [False] * 2, name
        assert all(t.response_token_ids for t in groups[name].trajectories), name
    # the environment's reward rides on the trajectory as reported with the close
    reported = {
        uid: [(t.env_reward.score, t.env_reward.status) if t.HasField("env_reward") else None
              for t in groups[uid].trajectories]
        for uid in ("g-rewarded", "g-fnrewarded", "g-good", "g-posing")
    }  # fmt: skip
    assert reported == {
        "g-rewarded": [(0.75, ENV_OK)] * 2,
        "g-fnrewarded": [(0.5, ENV_OK)] * 2,
        "g-good": [None] * 2,
        "g-posing": [None] * 2,
    }
    assert all(t.labels["env_reward"] == "1.0" for t in groups["g-posing"].trajectories)
    for trajectory in good:
        mask = bytes(trajectory.response_mask)
        # two generated turns, the user's follow-up between them: 1s, then 0s, then 1s
        assert mask[0] == 1 and mask[-1] == 1 and 0 in mask, mask
        assert len(trajectory.spans) >= 2 and trajectory.finish_reason
    # the verifiers environment's rubric (correct + 0.1 answered + 0.1 concise) with the close
    for trajectory in groups["g-vf"].trajectories:
        assert not trajectory.tags.is_infra and trajectory.response_token_ids, trajectory
        assert trajectory.env_reward.status == ENV_OK, trajectory.env_reward
        assert 0.0 < trajectory.env_reward.score <= 1.2, trajectory.env_reward
    expected = {
        "crash": ["exited 3", "boom: the agent fell over"],
        "hang": ["ran past its deadline of 4.0 s"],
        "nogen": ["agent 'nogen' exited 0 with no generation"],
        "fnraise": ["raised RuntimeError: the agent function fell over"],
        "served-error": ["agent 'served' reported: RuntimeError: the environment broke"],
        "served-die": ["agent 'served-die' process exited 5: the served agent fell over"],
        "vf-unknown": ["agent 'vf' reported: ValueError: the sample has no extra_info.verifiers"],
        # an episode the environment failed (here before the first model call) is its error,
        # never a reward
        "vf-broken": ["before any generation", "reported error: TimeoutError: SingleAgentEnv"],
    }
    for name, words in expected.items():
        for trajectory in groups[f"g-{name}"].trajectories:
            assert trajectory.tags.is_infra, (name, trajectory)
            assert all(w in trajectory.error for w in words), (name, trajectory.error)
            assert trajectory.reward.status == common_pb2.REWARD_STATUS_UNSPECIFIED  # no reward
    # the episode ended by the exit is one turn, scored as the policy's answer
    for trajectory in groups["g-noclose"].trajectories + groups["g-served-noclose"].trajectories:
        assert 0 not in bytes(trajectory.response_mask) and trajectory.finish_reason != "error"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"agents": {"external": {"a": {"command": ["x"]}}}, "agent_http": {"enabled": False}},
            "set agent_http.enabled: true",
        ),
        (
            {"agents": {"external": {"a": {"command": ["x"]}}, "loops": {"a": "m:C"}}},
            "agents.external and agents.loops both name ['a']",
        ),
        ({"agents": {"external": {"a": {"command": []}}}}, "command"),
        ({"agents": {"external": {"a": {}}}}, "exactly one of command"),
        (
            {"agents": {"external": {"a": {"command": ["x"], "callable": "m:f"}}}},
            "exactly one of command",
        ),
        (
            {"agents": {"external": {"a": {"callable": "m:f", "env": {"A": "1"}}}}},
            "env and cwd go with command",
        ),
    ],
)
def test_external_agent_config_mistakes_are_named(data: dict, message: str) -> None:
    from pydantic import ValidationError

    from relayrl.gateway.config import GatewayConfig

    with pytest.raises(ValidationError, match=re.escape(message)):
        GatewayConfig.model_validate(data)


def test_an_agent_function_that_does_not_import_stops_the_gateway_with_one_line(
    redis_server: RedisServer, model_dir: Path, tmp_path: Path
) -> None:
    config = {
        "tq": {"url": redis_server.url},
        "tokenizer": str(model_dir),
        "rollout": {"partitions": [P]},
        "agents": {"external": {"a": {"callable": "no_such_package.agents:run"}}},
    }
    process = ServiceProcess("relayrl-gateway", config, tmp_path / "gw")
    with pytest.raises(RuntimeError, match="exited 1") as failure:
        process.start(timeout_s=120)
    log = str(failure.value)
    assert "agents.external.a 'no_such_package.agents:run': cannot import module" in log
    assert "Traceback" not in log
