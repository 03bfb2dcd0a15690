"""The same multi-turn tool task rolled out by the gateway's built-in `tool_agent` loop and by
external agent processes through its agent endpoint, side by side in one run: a private
redis-server, one real vLLM engine serving the tiny model briefly warm-started on `lookup`
(cached in runs/cache as `relayrl up` caches it) and one relayrl-gateway process.

One round = `--groups` lookup prompt groups of `--samples` samples for each side (the same
prompts, temperature 1). A side's clock runs from put_groups to the moment every trajectory
of its groups is in the TransferQueue; its rate is the generated (mask 1) tokens over that
time. The sides:

    builtin   agent `tool_agent`: the gateway's own loop (tools run in the gateway)
    external  examples/agents/http_tool_agent.py as a served agent (`serve: true`): one
              process, started once, takes every sample's task with its session's URL and
              token; it sends chat completions over HTTP, runs the tools itself and closes
              each session
    process   the same program, one process per sample (Python starts every time)
    openai    the same agent written with the `openai` client (examples/agents/
              openai_tool_agent.py), one process per sample: importing `openai` costs about a
              CPU-second per process, which here competes with the engine for two cores
    sdk       the same agent written with the OpenAI Agents SDK (examples/agents/
              agents_sdk_agent.py, in the SDK's virtual environment) on the Responses API,
              served
    sdk-chat  the same SDK agent on chat completions (`--chat-completions`), served
    langchain LangChain's classic ReAct agent (examples/agents/langchain_react_agent.py, in the
              frameworks' virtual environment), served: text actions, a segment per turn
    langgraph a LangGraph graph whose nodes bind different tools (langgraph_agent.py), served
    pydantic  a pydantic-ai Agent with a tool (pydantic_ai_agent.py), served
The framework agents are not the same program as the others (their prompts and turns are
their framework's), so their rows compare what a user of each gets, not the gateway's cost.

The agents send the same tools as the built-in loop, so the prompts are the same tokens. The
turns differ: when the policy writes a malformed tool call, the built-in loop answers with an
error and gives it another turn, while an OpenAI client gets the text as the answer and stops.

Rounds rotate the order of the sides; round 0 warms up and is not counted; each side's
result is the median over `--runs` rounds. `cpu` is the CPU seconds of the gateway process and
of the agent processes it started: what the side costs besides the engine.

The last line is exactly:
    agents-bench: external/builtin=<tokens/s ratio> sessions_per_s=<external sessions/s>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer
from relayrl.trainer.feeder import PromptRecord
from relayrl_testkit.helpers.signals import raise_on_sigterm

PARTITION = "train"
ROUND_TIMEOUT_S = 600.0
# Enough SFT for the policy to call the lookup tool (the tests' short warm start, ~1 min here).
WARM_START = {"examples": 300, "epochs": 1}
AGENTS = Path(__file__).resolve().parents[1] / "examples" / "agents"
SIDES = {
    "builtin": "tool_agent",
    "external": "served",
    "process": "process",
    "openai": "openai",
    "sdk": "sdk",
    "sdk-chat": "sdk-chat",
    "langchain": "langchain",
    "langgraph": "langgraph",
    "pydantic": "pydantic",
}
FRAMEWORKS_PYTHON = (
    AGENTS.parents[1] / ".venv" / "share" / "venvs" / "frameworks" / "bin" / "python"
)
SDK_PYTHON = AGENTS.parents[1] / ".venv" / "share" / "venvs" / "agents-sdk" / "bin" / "python"


@dataclass
class Result:
    tokens: int
    seconds: float
    sessions: int
    turns: int
    infra: list[str]
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> str:
        return (
            f"{self.tokens} tok {self.seconds:5.2f} s {self.rate:5.0f} tok/s "
            f"{self.turns / max(self.sessions, 1):.2f} turns/sample cpu {self.cpu_s:5.2f}"
            + (f" infra {len(self.infra)}" if self.infra else "")
        )


def warm_lookup_model(runs_dir: Path, workdir: Path) -> tuple[Path, list[PromptRecord]]:
    """The tiny model warm-started on `lookup` (cached in runs_dir/cache) and the run's lookup
    prompts, read as the trainer's feeder reads them."""
    from relayrl.trainer.feeder import load_prompts
    from relayrl.up.config import UpConfig
    from relayrl.up.prepare import RunFiles, base_model, warm_start, write_task_files
    from relayrl.up.workload import load_workload

    config = UpConfig.model_validate(
        {"runs_dir": str(runs_dir), "task": {"name": "lookup"}, "warm_start": WARM_START}
    )
    workload = load_workload(config)
    workdir.mkdir(parents=True, exist_ok=True)
    files: RunFiles = write_task_files(workload, config, workdir)
    model = base_model(config, print)
    warm = warm_start(config, model, files, workdir / "sft.log", print)
    return warm, load_prompts(files.prompts)


def groups_for(
    records: list[PromptRecord], tag: str, agent: str, samples: int, max_tokens: int
) -> list[common_pb2.PromptGroup]:
    return [
        common_pb2.PromptGroup(
            uid=f"{tag}-g{g}",
            partition=PARTITION,
            num_samples=samples,
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in record.messages],
            data_source=record.data_source,
            ground_truth=record.ground_truth,
            sampling=common_pb2.SamplingParams(temperature=1.0, max_response_tokens=max_tokens),
            agent=agent,
            labels=dict(record.labels),
        )
        for g, record in enumerate(records)
    ]


def gateway_cpu(gateway: ServiceProcess) -> float:
    """CPU seconds of the gateway, its reaped children and its live ones (a served agent)."""
    process = psutil.Process(gateway.pid)
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in process.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += child_times.user + child_times.system
    return total


def run_side(
    tq: TransferQueue, gateway: ServiceProcess, groups: list[common_pb2.PromptGroup]
) -> Result:
    uids = [g.uid for g in groups]
    cpu0 = gateway_cpu(gateway)
    started = time.perf_counter()
    tq.put_groups(PARTITION, groups)
    deadline = started + ROUND_TIMEOUT_S
    while True:
        entries = tq.get_groups(PARTITION, uids)
        if all(len(e.trajectories) == e.group.num_samples for e in entries):
            break
        if time.perf_counter() > deadline:
            raise RuntimeError(f"round did not finish in {ROUND_TIMEOUT_S} s:\n{gateway.log()}")
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    trajectories = [t for e in entries for t in e.trajectories]
    parts = [part for t in trajectories for part in (t, *t.segments)]  # a sample's segments too
    return Result(
        tokens=sum(sum(bytes(part.response_mask)) for part in parts),
        seconds=seconds,
        sessions=len(trajectories),
        turns=sum(1 for part in parts for span in part.spans if span.generated),
        infra=[f"{t.uid}_{t.index}: {t.error}" for t in trajectories if t.tags.is_infra],
        cpu_s=gateway_cpu(gateway) - cpu0,
    )


def gateway_config(redis_url: str, model_dir: Path, engine_url: str, concurrency: int) -> dict:
    def agent(script: str, serve: bool = False, python: Path | None = None, *more: str) -> dict:
        command = [str(python or sys.executable), str(AGENTS / script), *more]
        return {
            "command": [*command, *(["--serve"] if serve else [])],
            "serve": serve,
            "max_concurrent": concurrency,
            "deadline_s": ROUND_TIMEOUT_S,
        }

    return {
        "tq": {"url": redis_url},
        "tokenizer": str(model_dir),
        "engines": {"urls": [engine_url], "health_interval_s": 1.0, "request_timeout_s": 120},
        # No trainer: the throttle must not hold back any round's groups.
        "rollout": {"partitions": [PARTITION]},
        "rollout_shape": {"batch_groups": 100_000},
        "agent_http": {"max_tokens": 512, "default_max_tokens": 128},
        "agents": {
            "external": {
                "served": agent("http_tool_agent.py", serve=True),
                "process": agent("http_tool_agent.py"),
                "openai": agent("openai_tool_agent.py"),
                "sdk": agent("agents_sdk_agent.py", True, SDK_PYTHON),
                "sdk-chat": agent("agents_sdk_agent.py", True, SDK_PYTHON, "--chat-completions"),
                "langchain": agent("langchain_react_agent.py", True, FRAMEWORKS_PYTHON),
                "langgraph": agent("langgraph_agent.py", True, FRAMEWORKS_PYTHON),
                "pydantic": agent("pydantic_ai_agent.py", True, FRAMEWORKS_PYTHON),
            }
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="prompt groups per side and round")
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=128, help="response budget per sample")
    parser.add_argument("--runs", type=int, default=5, help="counted rounds")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"), help="its cache/ is used")
    args = parser.parse_args()
    raise_on_sigterm()
    try:
        bench(args)
    except KeyboardInterrupt:
        print("interrupted; the child processes are stopped", file=sys.stderr)
        sys.exit(130)


def bench(args: argparse.Namespace) -> None:
    concurrency = args.groups * args.samples
    with tempfile.TemporaryDirectory(prefix="agents-bench-") as tmp:
        root = Path(tmp)
        model_dir, records = warm_lookup_model(args.runs_dir.absolute(), root / "data")
        needed = args.groups * (args.runs + 1)
        if len(records) < needed:
            raise SystemExit(f"agents-bench: {len(records)} lookup prompts, {needed} needed")
        engine = EngineProcess(
            EngineConfig(
                model=model_dir,
                max_model_len=1024,
                max_num_seqs=max(64, concurrency),
                cache_dir=root / "engine" / "cache",
            ),
            root / "engine",
        )
        gateway: ServiceProcess | None = None
        results: dict[str, list[Result]] = {side: [] for side in SIDES}
        with RedisServer(root / "redis") as server:
            try:
                t0 = time.perf_counter()
                engine.start()
                print(f"engine ready in {time.perf_counter() - t0:.0f} s ({model_dir.name})")
                config = gateway_config(server.url, model_dir, engine.url, concurrency)
                gateway = ServiceProcess("relayrl-gateway", config, root / "gateway").start()
                tq = TransferQueue(server.client())
                tq.create_partition(PARTITION)
                order = list(SIDES)
                for run in range(args.runs + 1):  # round 0 warms every side up
                    chunk = records[run * args.groups : (run + 1) * args.groups]
                    line = []
                    for side in order[run % len(order) :] + order[: run % len(order)]:
                        groups = groups_for(
                            chunk, f"r{run}-{side}", SIDES[side], args.samples, args.max_tokens
                        )
                        result = run_side(tq, gateway, groups)
                        if run:
                            results[side].append(result)
                        line.append(f"{side} {result.summary()}")
                    label = "warm-up" if run == 0 else f"round {run}"
                    print(f"{label}: " + " | ".join(line), flush=True)
                tq.close()
            finally:
                if gateway is not None:
                    gateway.stop()
                engine.stop()
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[Result]]) -> None:
    def median(side: str, value) -> float:  # type: ignore[no-untyped-def]
        return statistics.median(value(r) for r in results[side])

    print()
    print(f"{args.groups} groups x {args.samples} samples per side and round, {args.runs} rounds")
    print(f"{'side':10} {'tok/s':>8} {'s/round':>8} {'sessions/s':>10} {'turns':>6} {'cpu s':>6}")
    for side in SIDES:
        rate = median(side, lambda r: r.rate)
        seconds = median(side, lambda r: r.seconds)
        per_s = median(side, lambda r: r.sessions / r.seconds)
        turns = median(side, lambda r: r.turns / r.sessions)
        cpu = median(side, lambda r: r.cpu_s)
        print(f"{side:10} {rate:8.0f} {seconds:8.2f} {per_s:10.2f} {turns:6.2f} {cpu:6.2f}")
    for side in SIDES:
        for line in [line for r in results[side] for line in r.infra][:5]:
            print(f"infrastructure failure ({side}): {line[:300]}")
    builtin = median("builtin", lambda r: r.rate)
    external = median("external", lambda r: r.rate)
    for side in ("process", "openai"):
        print(f"{side}/builtin={median(side, lambda r: r.rate) / builtin:.2f}", end="  ")
    print("(one process per sample)")
    for side in ("sdk", "sdk-chat"):
        print(f"{side}/builtin={median(side, lambda r: r.rate) / builtin:.2f}", end="  ")
    print("(the Agents SDK, served, on the Responses API and on chat completions)")
    for side in ("langchain", "langgraph", "pydantic"):
        print(f"{side}/builtin={median(side, lambda r: r.rate) / builtin:.2f}", end="  ")
    print("(agent frameworks, served)")
    sessions = median("external", lambda r: r.sessions / r.seconds)
    print(f"agents-bench: external/builtin={external / builtin:.2f} sessions_per_s={sessions:.2f}")


if __name__ == "__main__":
    main()
