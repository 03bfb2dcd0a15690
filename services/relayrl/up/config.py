"""`relayrl up`'s configuration (`--config FILE`): what to train, how, and on what.

Every field has a default, chosen so that `relayrl up` with no file trains `arith` on this
2-core machine in under 15 minutes. `relayrl up --print-config` shows them all; the
`services:` section passes any field of the four services' own configs through (it is merged
over what `relayrl up` generates, and the service checks it when it starts).

pydantic only: a mistake is reported before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from relayrl.core.config import StrictModel, deep_merge  # noqa: F401 (deep_merge: its old home)
from relayrl.core.dotted import DOTTED_PATH
from relayrl.models.config import TinyModelConfig
from relayrl.up.defaults import (
    MAX_LR_FACTOR,
    PROFILES,
    TASK_MAX_TOKENS,
    ModelKind,
    Profile,
    Training,
    lr_ceiling,
    resolve,
)

Mode = Literal["sync", "colocate_async", "separate_async"]
BUILTIN_TASKS = ("arith", "lookup")
REASONING_GYM_PREFIX = "reasoning_gym:"
Transport = Literal["shm", "grpc", "torch_distributed", "mooncake"]

# eta when the mode is given and eta is not.
DEFAULT_ETA: dict[str, int] = {"sync": 0, "colocate_async": 1, "separate_async": 1}


class TaskSection(StrictModel):
    """The built-in task (`relayrl.tasks`) and how much of it to use."""

    name: str = Field(
        "arith",
        description="arith (single turn), lookup (tool calls), or reasoning_gym:<dataset> (a "
        "procedural task of the reasoning-gym package, e.g. reasoning_gym:leg_counting). "
        "Not used when data.train_files is set: the files are the task.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Knobs of the task: fields of ArithTask / LookupTask (e.g. {max_digits: 1} "
        "for arith), or the reasoning-gym dataset's own config fields.",
    )
    train_prompts: int = Field(
        4000, ge=1, le=1_000_000, description="Distinct training questions (prompts.jsonl)."
    )
    heldout_prompts: int = Field(
        400,
        ge=10,
        le=100_000,
        description="Held-out questions for evaluation; training never sees them.",
    )
    seed: int = Field(0, ge=0, description="Seed of the drawn questions.")

    @field_validator("name")
    @classmethod
    def _known_task(cls, name: str) -> str:
        dataset = name.removeprefix(REASONING_GYM_PREFIX)
        if name in BUILTIN_TASKS or (name.startswith(REASONING_GYM_PREFIX) and dataset):
            return name
        raise ValueError(
            f"unknown task {name!r}: use {', '.join(BUILTIN_TASKS)} or "
            f"{REASONING_GYM_PREFIX}<dataset>"
        )

    @property
    def reasoning_gym_dataset(self) -> str | None:
        """The reasoning-gym dataset name of a `reasoning_gym:` task, else None."""
        if self.name.startswith(REASONING_GYM_PREFIX):
            return self.name.removeprefix(REASONING_GYM_PREFIX)
        return None


class ModelSection(TinyModelConfig):
    """The policy: a local Hugging Face model folder (`path`), or else the tiny Qwen2 that the
    other fields describe, built from its seed."""

    path: Path | None = Field(
        None,
        description="A Hugging Face model folder (config.json, safetensors, tokenizer with a "
        "chat template): Qwen2/Qwen2.5, Llama (also Llama-3 rope scaling), SmolLM2, Qwen3. "
        "`relayrl model import-gguf` makes one from a GGUF file. null: the tiny Qwen2.",
    )


class DataSection(StrictModel):
    """A user's own RL dataset (relayrl.tasks.datasets): .jsonl or .parquet files in verl's
    layout (data_source, prompt messages, reward_model.ground_truth) or a flat one (prompt,
    ground_truth, data_source). When set, the files are the task."""

    train_files: list[Path] = Field(default_factory=list, description="Training files.")
    heldout_files: list[Path] = Field(
        default_factory=list,
        description="Held-out files; none: rows whose prompt hashes below heldout_fraction "
        "are held out (never trained on).",
    )
    heldout_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share held out when no held-out files are given."
    )
    max_heldout: int = Field(
        400, ge=1, le=1_000_000, description="Held-out prompts evaluated (the first ones)."
    )

    @model_validator(mode="after")
    def _train_files_first(self) -> DataSection:
        if self.heldout_files and not self.train_files:
            raise ValueError("heldout_files needs train_files")
        return self


class RewardSection(StrictModel):
    """Rewards: by data_source through the reward-service's rule scorers (gsm8k, math, arith,
    ...) and reasoning-gym checkers; `function` adds a user's own scoring function."""

    function: str | None = Field(
        None,
        pattern=DOTTED_PATH,
        description="`package.module:function` scoring one RewardItem (a float, or a Verdict), "
        "importable in the reward-service's environment (relayrl.reward.managers.custom).",
    )
    data_sources: list[str] = Field(
        default_factory=list,
        description="data_source values `function` scores; empty: all of them.",
    )
    env: bool = Field(
        False,
        description="Score with the reward the agent's environment reports when it closes its "
        "session (the `env` manager; e.g. a verifiers environment, examples/agents/"
        "verifiers_agent.py), every data_source but those `function` scores. Needs an agent; "
        "no held-out evaluation (only the agent's environment can judge).",
    )

    @model_validator(mode="after")
    def _sources_need_function(self) -> RewardSection:
        if self.data_sources and self.function is None:
            raise ValueError("data_sources needs a function")
        if self.env and self.function is not None and not self.data_sources:
            raise ValueError(
                "env and a function without data_sources would both score every data_source; "
                "name the function's data_sources"
            )
        return self


class WarmStartSection(StrictModel):
    """Supervised warm start (`relayrl-trainer sft`): teaches the answer format so GRPO sees a
    reward from its first step. Cached by its inputs under `<runs>/cache/`."""

    enabled: bool | None = Field(
        None,
        description="false: GRPO starts from the model as it is; null: on for the tiny model "
        "with a built-in task, off otherwise (a pretrained model needs none; only built-in "
        "tasks have SFT examples).",
    )
    examples: int = Field(4000, ge=1, le=1_000_000, description="SFT examples drawn.")
    epochs: int = Field(
        12,
        ge=1,
        le=1000,
        description="Passes over the examples (at most, with a target); the schedule's length.",
    )
    lr: float = Field(2e-3, gt=0.0, le=1.0, description="Peak learning rate.")
    warmup_updates: int = Field(
        60, ge=0, le=1_000_000, description="Linear warm-up of the learning rate, in updates."
    )
    schedule: Literal["constant", "cosine"] = Field(
        "cosine",
        description="After the warm-up: constant, or cosine down to lr / 10 at the end of "
        "`epochs` (docs/defaults.md#warm-start: a constant lr left the tiny model's loss "
        "bouncing, and its accuracy short of the target after 20 epochs).",
    )
    batch_size: int = Field(64, ge=1, le=4096, description="Examples per update.")
    max_seq_len: int = Field(
        0, ge=0, le=65_536, description="Longest example in tokens; 0: the task's default."
    )
    seed: int = Field(0, ge=0, description="Seed of the examples and the shuffle.")
    target_accuracy: float | None = Field(
        0.15,
        gt=0.0,
        le=1.0,
        description="Stop after the first epoch at which a sample at temperature 1 answers "
        "this share of held-aside training questions (not the held-out ones); `epochs` is "
        "then the most it runs. Where a tiny model's accuracy jumps after some epochs depends "
        "on the seed: a target lands GRPO's start in the same place. null: always `epochs`.",
    )
    eval_examples: int = Field(
        500, ge=10, le=100_000, description="Held-aside examples the target is measured on."
    )
    eval_every: int = Field(
        4,
        ge=0,
        le=1_000_000,
        description="Updates between checks of the target, besides each epoch's end; 0: at "
        "epoch ends only (docs/defaults.md#warm-start: the tiny model's accuracy can go from "
        "half the target to 1.4x it within one epoch).",
    )


class TrainSection(StrictModel):
    """GRPO through the pipeline. Every other trainer field: `services.trainer`."""

    mode: Mode = Field(
        "separate_async",
        description="sync (rollout waits for every version), colocate_async (rollout paused "
        "during updates, one version ahead), separate_async (rollout runs eta versions ahead).",
    )
    eta: int | None = Field(
        None,
        ge=0,
        le=64,
        description="How many versions rollout may run ahead; null: 0 for sync, 1 otherwise.",
    )
    steps: int = Field(250, ge=1, le=1_000_000, description="Trainer steps (published versions).")
    batch_groups: int = Field(16, ge=1, le=4096, description="Prompt groups per step.")
    samples_per_prompt: int = Field(8, ge=2, le=256, description="Responses per prompt (GRPO).")
    # null: the model's default (relayrl.up.defaults, docs/defaults.md), printed at start
    lr: float | None = Field(None, gt=0.0, le=1.0, description="Adam learning rate (peak).")
    lr_schedule: Literal["constant", "cosine"] | None = Field(
        None, description="After the warm-up: constant, or cosine from lr down to min_lr."
    )
    min_lr: float | None = Field(
        None, ge=0.0, le=1.0, description="Last learning rate (cosine); null: lr / 10."
    )
    warmup_steps: int | None = Field(
        None, ge=0, le=100_000, description="Linear warm-up of the learning rate, in steps."
    )
    clip_grad: float | None = Field(
        None, ge=0.0, le=1e6, description="Global gradient-norm clip; 0 disables."
    )
    kl_coef: float | None = Field(
        None, ge=0.0, le=100.0, description="KL penalty to the starting policy (k3); 0: none."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=65_536, description="Response token budget (all turns)."
    )
    temperature: float | None = Field(
        None, gt=0.0, le=10.0, description="Sampling temperature of rollouts."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, le=4096, description="Rows per forward pass of the trainer."
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Tokens per forward pass of the trainer, counted as rows x the longest "
        "row (a longer row goes alone): what bounds the trainer's memory.",
    )
    checkpoint_interval_steps: int = Field(
        10,
        ge=1,
        le=100_000,
        description="A checkpoint every N steps: the resume point. Any interval keeps every "
        "trajectory trained exactly once (a resumed trainer returns what it consumed after "
        "the checkpoint); a shorter one loses less work to a crash.",
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order and of the trainer.")

    @property
    def effective_eta(self) -> int:
        return DEFAULT_ETA[self.mode] if self.eta is None else self.eta

    @model_validator(mode="after")
    def _eta_fits_mode(self) -> TrainSection:
        eta = self.effective_eta
        if self.mode == "sync" and eta != 0:
            raise ValueError(f"mode sync needs eta 0 (got {eta}); use separate_async to run ahead")
        if self.mode == "colocate_async" and eta > 1:
            raise ValueError(f"mode colocate_async allows eta 0 or 1 (got {eta})")
        return self


class EvalSection(StrictModel):
    """Held-out accuracy: greedy decoding on the engine, scored by the task's rule."""

    interval_steps: int = Field(
        20,
        ge=0,
        le=1_000_000,
        description="Evaluate every N trainer steps; 0: only at start and end.",
    )
    sampled: bool | None = Field(
        None,
        description="Also report accuracy at the training temperature (one sample each); "
        "null: the model's default (on for the tiny model, off for a pretrained one, whose "
        "evaluations cost minutes).",
    )


class EngineSection(StrictModel):
    """The vLLM engine replica."""

    max_model_len: int = Field(1024, ge=64, le=131_072, description="Longest prompt + response.")
    max_num_seqs: int = Field(128, ge=1, le=65_536, description="Sequences decoded at once.")
    kv_cache_gib: int = Field(1, ge=1, le=1024, description="KV cache (VLLM_CPU_KVCACHE_SPACE).")


class WeightSyncSection(StrictModel):
    transport: Transport = Field(
        "shm",
        description="Data plane from the trainer through weight-sync into the engine: shm "
        "(every part of relayrl up shares this host, so each bucket is written once into "
        "shared memory and read by the engine from there; docs/weightsync.md#shared-memory), "
        "grpc, torch_distributed (gloo here) or mooncake (needs a private network namespace "
        "here).",
    )


class SupervisionSection(StrictModel):
    """What `relayrl up` does when one of its children dies."""

    max_restarts: int = Field(
        5, ge=0, le=1000, description="Restarts per child before the run gives up."
    )
    restart_backoff_s: float = Field(
        1.0, ge=0.0, le=600.0, description="Wait before a restart (doubles each time)."
    )
    start_timeout_s: float = Field(
        300.0, gt=0.0, le=3600.0, description="Longest a child may take to become ready."
    )


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0-3,6` -> {0, 1, 2, 3, 6} (the cpu-list format of taskset and cgroups)."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list such as 0 or 0-3,6")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def split_cpus(cpus: Collection[int]) -> tuple[str, str] | None:
    """The first half of `cpus` for the engine, the rest for the trainer (and the services,
    which then share the trainer's: on 2 CPUs nothing is left for a third set); None on one."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return None
    half = len(ordered) // 2
    return ",".join(map(str, ordered[:half])), ",".join(map(str, ordered[half:]))


class PlacementSection(StrictModel):
    """CPU sets (Linux affinity) for the parts of the run, so that on one machine they do not
    compete for the same cores, as they would not on a cluster, where the engine and the
    trainer have their own accelerators. A child inherits its set when it starts, restarts
    included; threads it spawns stay inside it. null: any CPU, unless `auto` chooses."""

    engine: str | None = Field(None, description="The vLLM engine's CPUs, e.g. `0` or `0-3`.")
    trainer: str | None = Field(None, description="The trainer's CPUs.")
    services: str | None = Field(
        None, description="Redis, the gateway, the reward-service and weight-sync."
    )
    auto: bool = Field(
        True,
        description="With none of the three sets given and 2 or more CPUs: the engine gets "
        "the first half of the CPUs relayrl up may use, the trainer and the services the rest "
        "(docs/defaults.md#placement: a step of the default job in about half the time on 2 "
        "cores); false: every child may use any CPU.",
    )

    _auto: tuple[str, str] | None = PrivateAttr(None)

    @field_validator("engine", "trainer", "services")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        if value is None:
            return None
        import os

        cpus = parse_cpu_list(value)
        available = os.sched_getaffinity(0)
        if not cpus <= available:
            raise ValueError(
                f"CPUs {sorted(cpus - available)} of {value!r} are not available here "
                f"(this process may use {sorted(available)})"
            )
        return value

    @model_validator(mode="after")
    def _auto_split(self) -> PlacementSection:
        """Chosen once, here: a child is spawned with this thread pinned to its set, so the
        CPUs this process may use are only read before anything starts."""
        if self.auto and self.engine is None and self.trainer is None and self.services is None:
            import os

            self._auto = split_cpus(os.sched_getaffinity(0))
        return self

    def sets(self) -> dict[str, str | None]:
        """The CPU list of each part in effect: the ones given, else `auto`'s."""
        if self._auto is not None:
            engine, trainer = self._auto
            return {"engine": engine, "trainer": trainer, "services": trainer}
        return {"engine": self.engine, "trainer": self.trainer, "services": self.services}

    def cpus_for(self, child: str) -> frozenset[int] | None:
        """The CPU set of a child of the stack (`engine-0`, `trainer`, `redis`, ...)."""
        if child.startswith("engine"):
            part = "engine"
        elif child == "trainer":
            part = "trainer"
        else:
            part = "services"
        chosen = self.sets()[part]
        return None if chosen is None else parse_cpu_list(chosen)

    def describe(self) -> str:
        """One line for the console: where each part runs, and who chose it."""
        sets = self.sets()
        if all(value is None for value in sets.values()):
            return "placement: every part may use any CPU"
        where = ", ".join(
            f"{part} on CPU {value}" if value is not None else f"{part} on any CPU"
            for part, value in sets.items()
        )
        chosen = " (auto; placement.auto: false to turn off)" if self._auto is not None else ""
        return f"placement: {where}{chosen}"


class HostsSection(StrictModel):
    """Hosts of our own, for the test kit and for research on failures between hosts: each
    part of the run (redis-server, the four services, the engine, the agent programs) in a
    network namespace of its own, joined to the others by a bridge, so that faults can be put
    on the links between them (docs/recovery.md#hosts-of-our-own). Needs root, iproute2 and
    nftables; off, every part is on loopback."""

    isolate: bool = Field(
        False,
        description="Give each part a network namespace and an address of its own on a "
        "private /24 (made when the run starts, removed when it stops); relayrl up refuses "
        "to start without root, `ip`, `nft` or `nsenter`. A test-kit and research option.",
    )


class SecuritySection(StrictModel):
    """Who may call the run's services (docs/security.md)."""

    authenticate: bool = Field(
        True,
        description="Every service authenticates its callers with tokens made for this run "
        "(in <run>/secrets) and allows each only its role's methods; false: any process on "
        "this machine may call every method (a warning is logged).",
    )


EXTERNAL_AGENT = "external"


class AgentSection(StrictModel):
    """Your own agent (`--agent "python my_agent.py"`): a program the gateway starts once per
    training sample, with its session's OpenAI URL and key (OPENAI_BASE_URL, OPENAI_API_KEY)
    and the task as JSON on stdin; it closes its session when done (docs/architecture.md
    #external-agents, examples/agents/). The held-out evaluation still runs the task's built-in
    loop: it measures the policy, not the agent."""

    command: list[str] | None = Field(
        None,
        min_length=1,
        description="argv of the agent; null: the task's built-in agent loop.",
    )
    cwd: Path | None = Field(None, description="Where it runs; null: where relayrl up was started.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Variables added to its environment."
    )
    deadline_s: float = Field(
        300.0, gt=0.0, le=86_400.0, description="Longest one sample's agent may run."
    )
    max_concurrent: int = Field(16, ge=1, le=4096, description="Agents running at once.")
    serve: bool = Field(
        False,
        description="One long-running process takes every sample's task (a JSON line each on "
        "stdin, e.g. examples/agents/http_tool_agent.py --serve) instead of one per sample.",
    )


class ServicesSection(StrictModel):
    """Fields merged over the generated config of each service (deep merge). The composed
    system (relayrl.stack) is checked when this file is read, before anything starts: a field
    a service does not have, a bad value, or an override that breaks what the services share
    (ports, addresses, the queue, eta and batch size set by `relayrl up`) is an error naming
    the field."""

    trainer: dict[str, Any] = Field(default_factory=dict, description="relayrl-trainer fields.")
    gateway: dict[str, Any] = Field(default_factory=dict, description="relayrl-gateway fields.")
    reward: dict[str, Any] = Field(default_factory=dict, description="relayrl-reward fields.")
    weightsync: dict[str, Any] = Field(
        default_factory=dict, description="relayrl-weightsync fields."
    )


class UpConfig(StrictModel):
    runs_dir: Path = Field(Path("runs"), description="Where runs/<id>/ and the model cache live.")
    task: TaskSection = Field(default_factory=TaskSection, description="What to train on.")
    model: ModelSection = Field(
        default_factory=ModelSection, description="The policy: a folder, or the tiny Qwen2."
    )
    data: DataSection = Field(default_factory=DataSection, description="A user's dataset.")
    agent: AgentSection = Field(
        default_factory=AgentSection, description="Your own agent program (else built-in loops)."
    )
    reward: RewardSection = Field(default_factory=RewardSection, description="Rewards.")
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection, description="SFT.")
    train: TrainSection = Field(default_factory=TrainSection, description="GRPO.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out accuracy.")
    engine: EngineSection = Field(default_factory=EngineSection, description="vLLM engine.")
    weightsync: WeightSyncSection = Field(
        default_factory=WeightSyncSection, description="weight-sync."
    )
    supervision: SupervisionSection = Field(
        default_factory=SupervisionSection, description="Restarts."
    )
    placement: PlacementSection = Field(
        default_factory=PlacementSection, description="CPU sets of the engine, trainer, services."
    )
    hosts: HostsSection = Field(
        default_factory=HostsSection,
        description="A network namespace per part (test kit, research); off by default.",
    )
    security: SecuritySection = Field(
        default_factory=SecuritySection, description="Authentication between the services."
    )
    services: ServicesSection = Field(
        default_factory=ServicesSection, description="Pass-through service fields."
    )

    @property
    def task_label(self) -> str:
        """What the run trains on, in a word: the task's name, or `dataset`."""
        return "dataset" if self.data.train_files else self.task.name

    @property
    def model_kind(self) -> ModelKind:
        return "tiny" if self.model.path is None else "pretrained"

    @property
    def training(self) -> Training:
        """The training settings in effect: each null `train:` field from the model's
        profile (relayrl.up.defaults)."""
        t = self.train
        values = t.model_dump(include=set(Profile.model_fields) | {"min_lr"})
        values["eval_sampled"] = self.eval.sampled
        task_budget = TASK_MAX_TOKENS.get(self.task_label)
        return resolve(self.model_kind, values, task_budget, t.steps)

    @property
    def warm_start_enabled(self) -> bool:
        enabled = self.warm_start.enabled
        return (
            self.model.path is None and self.task_label in BUILTIN_TASKS
            if enabled is None
            else enabled
        )

    @model_validator(mode="after")
    def _warm_start_has_examples(self) -> UpConfig:
        if self.warm_start.enabled and self.task_label not in BUILTIN_TASKS:
            raise ValueError(
                f"warm_start.enabled: only the built-in tasks ({', '.join(BUILTIN_TASKS)}) have "
                f"SFT examples, not {self.task_label}; leave it null or false"
            )
        return self

    @model_validator(mode="after")
    def _training_fits_the_model(self) -> UpConfig:
        """The learning rate is refused above MAX_LR_FACTOR x its kind's default; the response
        budget must leave room for a prompt in the engine's context."""
        lr, kind = self.train.lr, self.model_kind
        if lr is not None and lr > lr_ceiling(kind):
            default = PROFILES[kind].lr
            raise ValueError(
                f"train.lr {lr:g} is more than {MAX_LR_FACTOR:g}x the default for a {kind} "
                f"model ({default:g}, docs/defaults.md); leave it null or lower it"
            )
        training = self.training
        if training.lr_schedule == "cosine" and training.min_lr > training.lr:
            raise ValueError(f"train.min_lr ({training.min_lr:g}) must be <= lr ({training.lr:g})")
        if training.max_tokens >= self.engine.max_model_len:
            raise ValueError(
                f"train.max_tokens {training.max_tokens} leaves no room for a prompt in "
                f"engine.max_model_len {self.engine.max_model_len}; raise engine.max_model_len "
                "or lower train.max_tokens"
            )
        return self

    @model_validator(mode="after")
    def _env_reward_has_an_agent(self) -> UpConfig:
        if self.reward.env and self.agent.command is None:
            raise ValueError(
                "reward.env: only an agent reports its environment's reward; give agent.command"
            )
        return self

    @model_validator(mode="after")
    def _services_compose(self) -> UpConfig:
        from relayrl.up.wiring import check_up_stack

        check_up_stack(self)
        return self
