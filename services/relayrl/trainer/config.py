"""Configuration of relayrl-trainer.

One `TrainerConfig` describes a training job: the model and its parallel layout, the optimiser,
the algorithm (mode, batch sizes, off-policy correction, loss), where prompts come from, the
staleness gate, checkpoints and where new weights go. Cross-field rules that would otherwise
surface hours into a run (train_batch not divisible, a mode that cannot honour eta) are checked
here, at start, with one line that says what to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, model_validator

from relayrl.core.config import (
    ClientCredentialsConfig,
    GrpcClientConfig,
    GrpcKeepaliveConfig,
    ServiceConfig,
    StrictModel,
)
from relayrl.core.rollout_shape import RolloutShape
from relayrl.tq.config import TQConfig
from relayrl.trainer.advantages import AdvantageConfig
from relayrl.trainer.curriculum import CurriculumConfig, RetryConfig
from relayrl.trainer.loss_config import LossConfig
from relayrl.trainer.progress import ProgressConfig

if TYPE_CHECKING:  # the builders import their components when called, not the config
    from relayrl.tq import TransferQueue
    from relayrl.trainer.feeder import PromptFeeder
    from relayrl.trainer.loop import Control, Leader, Status, TrainingLoop
    from relayrl.trainer.metrics import TrainerMetrics
    from relayrl.trainer.modes import TrainerMode
    from relayrl.trainer.progress import ProgressWatch
    from relayrl.trainer.publish import WeightPublisher
    from relayrl.trainer.replay import ReplaySampler
    from relayrl.trainer.rollout_link import GatewayLink
    from relayrl.trainer.runtime import LRScheduler, Policy, PolicyModel, PolicyOptimizer
    from relayrl.trainer.step import DataParallel, Updater

MODES = ("sync", "colocate_async", "separate_async")


class ModelConfig(StrictModel):
    """The policy: an HF folder (Qwen2/Llama architecture) and its megatron layout."""

    hf_dir: Path = Field(
        Path("models/tiny"),
        description="Hugging Face folder (config.json, model.safetensors, tokenizer) the policy "
        "starts from; `relayrl model init` makes the tiny default.",
    )
    tensor_parallel: int = Field(1, ge=1, le=64, description="Tensor-parallel size.")
    data_parallel: int = Field(
        1, ge=1, le=4096, description="Data-parallel size; world size = tensor x data parallel."
    )
    params_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter dtype (bfloat16 needs hardware that has it)."
    )
    seed: int = Field(0, ge=0, description="Seed of every RNG the trainer owns.")
    max_seq_len: int = Field(
        2048,
        ge=8,
        le=1 << 20,
        description="Longest prompt+response row trained on; longer trajectories are "
        "truncated (their cut tokens masked out), counted in a metric.",
    )


class OptimizerConfig(StrictModel):
    """Adam through megatron's optimizer (distributed optimizer selectable); the one optimizer
    settings type of the trainer and of `relayrl-trainer sft`.

        optimizer = settings.build(model)
        scheduler = settings.build_scheduler(optimizer, num_updates=total_steps * k)
    """

    lr: float = Field(1e-5, gt=0, le=1.0, description="Peak learning rate.")
    min_lr: float = Field(0.0, ge=0, description="Floor of the schedule.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warm-up, over every local update of the run."
    )
    warmup_updates: int = Field(0, ge=0, description="Linear warm-up, in optimizer updates.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 disables.")
    use_distributed_optimizer: bool = Field(
        False, description="Shard optimizer state across data-parallel ranks (ZeRO-1)."
    )

    @model_validator(mode="after")
    def _floor_below_peak(self) -> OptimizerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) must be <= optim.lr ({self.lr})")
        return self

    def build(self, model: PolicyModel) -> PolicyOptimizer:
        """megatron's Adam over `model` (see `relayrl.trainer.model.build_optimizer`)."""
        from relayrl.trainer.model import build_optimizer

        return build_optimizer(model, self)

    def build_scheduler(self, optimizer: PolicyOptimizer, num_updates: int) -> LRScheduler:
        """The learning-rate schedule over the run's `num_updates` local optimizer updates:
        linear warm-up from 0 (when warmup_updates > 0), then `schedule` down to min_lr."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        num_updates = max(1, num_updates)
        return OptimizerParamScheduler(
            optimizer,
            init_lr=self.lr if self.warmup_updates == 0 else 0.0,
            max_lr=self.lr,
            min_lr=self.min_lr if self.schedule != "constant" else self.lr,
            lr_warmup_steps=min(self.warmup_updates, num_updates - 1),
            lr_decay_steps=num_updates,
            lr_decay_style=self.schedule,
            start_wd=self.weight_decay,
            end_wd=self.weight_decay,
            wd_incr_steps=num_updates,
            wd_incr_style="constant",
        )


class StalenessConfig(StrictModel):
    """The replay-buffer gate (docs/staleness.md#consumption-gate):
    staleness = step - prompt_step + 1."""

    policy: Literal["drop", "wait"] = Field(
        "drop",
        description="drop: evict finished groups whose staleness is > threshold (and refill); "
        "wait: block sampling while an in-flight group's staleness is >= threshold.",
    )
    threshold: int | None = Field(
        None,
        ge=1,
        description="Staleness bound; null takes the mode's bound (1 for sync, 2 for "
        "colocate_async, eta + parameter_sync_step for separate_async).",
    )


class AlgorithmConfig(StrictModel):
    """What one step does, and how steps relate to rollout."""

    renamed_keys = {
        "eta": "/rollout_shape.eta",
        "train_batch_groups": "/rollout_shape.batch_groups",
    }

    mode: Literal["sync", "colocate_async", "separate_async"] = Field(
        "sync",
        description="sync: rollout and training alternate on one version; colocate_async: "
        "they share devices with staleness <= 1; separate_async: separate devices, eta "
        "versions of look-ahead and parameter_sync_step local updates per version.",
    )
    parameter_sync_step: int = Field(
        1,
        ge=1,
        le=64,
        description="Local optimizer updates per published version (k); pi_old is held at "
        "the step's starting weights for all k.",
    )
    mini_batch_groups: int | None = Field(
        None,
        ge=1,
        description="Prompt groups per optimizer update; null: rollout_shape.batch_groups / k.",
    )
    micro_batch_size: int = Field(
        4, ge=1, description="Rows (trajectories) per forward/backward micro-batch per rank."
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="At most this many tokens (rows x the longest row) per micro-batch; a "
        "longer row goes alone. Activations grow with these tokens: this bounds the "
        "trainer's memory whatever the responses' lengths. null: rows only.",
    )
    old_logprobs: Literal["recompute", "bypass"] = Field(
        "recompute",
        description="recompute: pi_old by a forward-only pass on the step's weights; bypass: "
        "use the rollout log-probs as pi_old (then mismatch metrics are not reported: they "
        "would compare mu with itself, docs/algorithms.md#bypass).",
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of the rollout; log-probs use it."
    )
    dapo_filter: bool = Field(
        True, description="Skip groups without signal (no/one valid member, zero reward std)."
    )
    filter_budget: float | None = Field(
        4.0,
        ge=1.0,
        le=1000.0,
        description="A step that has consumed this many times its batch and kept at least one "
        "group trains on what it kept (and says so) instead of waiting for a full batch "
        "(docs/algorithms.md#filter-budget); null: wait for a full batch.",
    )
    refill_per_filtered: int = Field(
        1,
        ge=1,
        le=2,
        description="Prompts issued at once for each group without signal. 1 replaces it; 2 is "
        "DAPO's refill credit (docs/algorithms.md#refill-credit), which runs away while half "
        "or more of the groups have no signal (each filtered group then begets more than one "
        "filtered group on average).",
    )
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)

    def build_mode(self) -> TrainerMode:
        """The strategy object of `mode`, from the one table in `relayrl.trainer.modes`."""
        from relayrl.trainer.modes import mode_for

        return mode_for(self.mode)


def default_staleness_bound(mode: str, eta: int, k: int) -> int:
    """The largest staleness the mode produces when nothing goes wrong."""
    return {"sync": 1, "colocate_async": 2}.get(mode, eta + k)


class PromptDataConfig(StrictModel):
    """Where the trainer's prompt feeder takes prompt groups from."""

    renamed_keys = {
        "samples_per_prompt": "/rollout_shape.samples_per_prompt",
        "max_tokens": "/rollout_shape.max_tokens",
    }

    prompts_file: Path | None = Field(
        None,
        description="JSONL of prompts ({prompt | messages, ground_truth, data_source, agent?, "
        "labels?}); null (and no train_files): someone else feeds the partition and the "
        "trainer only consumes.",
    )
    train_files: list[Path] = Field(
        default_factory=list,
        description="A user's dataset instead of prompts_file: .jsonl or .parquet in verl's "
        "layout or the flat one (docs/datasets.md); the trainer feeds its training split.",
    )
    heldout_files: list[Path] = Field(
        default_factory=list,
        description="Held-out files of the dataset: prompts in them are never fed.",
    )
    heldout_fraction: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="Without heldout_files, prompts hashing below this share are held out "
        "(the same split `relayrl up` evaluates on).",
    )
    partition: str = Field("train", min_length=1, description="TransferQueue partition.")
    shuffle_seed: int = Field(0, ge=0, description="Order of prompts in every epoch.")
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig,
        description="Which prompt comes next: every prompt once per epoch, plus replays of "
        "prompts that still have signal (docs/algorithms.md#curriculum).",
    )
    retry: RetryConfig = Field(
        default_factory=RetryConfig,
        description="A group that cannot be trained for a reason outside the policy (no valid "
        "member, one valid member, too stale) is re-issued with its prompt, within a budget "
        "(docs/algorithms.md#retries).",
    )
    run_id: str = Field(
        "run",
        pattern=r"^[A-Za-z0-9.-]{1,40}$",
        description="Prefix of group uids, so resumed feeding reuses (never duplicates) uids.",
    )
    sampling_temperature: float | None = Field(
        None, gt=0, description="Rollout temperature; null: algorithm.temperature."
    )
    agent: str = Field("", description="Agent loop for prompts that name none (gateway default).")
    poll_interval_s: float = Field(
        0.2, gt=0, le=60, description="How often to look for scored groups while waiting."
    )

    @model_validator(mode="after")
    def _one_source(self) -> PromptDataConfig:
        if self.prompts_file is not None and self.train_files:
            raise ValueError("give prompts_file or train_files, not both")
        if self.heldout_files and not self.train_files:
            raise ValueError("heldout_files needs train_files")
        return self


class CheckpointConfig(StrictModel):
    """dist_checkpointing snapshots: model, optimizer, RNG, data and TransferQueue cursors."""

    dir: Path | None = Field(None, description="Root folder; null disables checkpoints.")
    interval_steps: int = Field(1, ge=1, description="Save after every this many steps.")
    keep: int = Field(2, ge=1, description="Snapshots kept (oldest deleted first).")
    resume: bool = Field(True, description="Continue from the latest snapshot in dir.")


class NoPublishConfig(StrictModel):
    """New weights stay in the trainer (tests, offline runs)."""

    type: Literal["none"] = "none"


class HfDirPublishConfig(StrictModel):
    """Each published version is written as an HF folder `<dir>/v<version>` (engines or
    weight-sync can load it from a shared volume)."""

    type: Literal["hf_dir"]
    dir: Path = Field(description="Folder that receives one HF folder per version.")
    keep: int = Field(2, ge=1, description="Versions kept on disk.")


class WeightSyncPublishConfig(ClientCredentialsConfig):
    """Each version goes to the weight-sync service, which switches every engine to it (with
    this section's `tls` and token, when weight-sync authenticates its callers)."""

    type: Literal["weightsync"]
    target: str = Field(min_length=1, description="gRPC target of relayrl-weightsync.")
    quantization: Literal["none", "fp8_per_tensor", "fp8_block_128"] = Field(
        "none", description="On the wire: bf16 (none) or FP8 e4m3 with scales."
    )
    quantize_embeddings: bool = Field(
        False,
        description="With FP8: quantise embeddings and lm_head too (FP8 as pure wire "
        "compression, about 3 % fewer bytes on a Qwen2-shaped model); off: they go in bf16, as "
        "in vLLM's FP8 checkpoints.",
    )
    wait_for_commit: bool = Field(
        True,
        description="Block the step until every live replica holds the version (needed for "
        "sync mode; async modes may overlap the switch with the next step).",
    )
    timeout_s: float = Field(600.0, gt=0, description="Deadline for publish and commit.")
    keepalive: GrpcKeepaliveConfig = Field(
        default_factory=GrpcKeepaliveConfig,
        description="Pings that notice a silent weight-sync within the long publish and "
        "commit calls (their deadline is timeout_s); keepalive.time_s must be >= "
        "weight-sync's grpc.min_ping_interval_s.",
    )
    delta: bool = Field(
        True,
        description="Send each bucket as what changed since the last version where weight-sync "
        "still holds that version and the delta is smaller (docs/weightsync.md#delta-versions); "
        "each rank keeps its share of the last version's buckets in host memory for it.",
    )


PublishConfig = Annotated[
    NoPublishConfig | HfDirPublishConfig | WeightSyncPublishConfig,
    Field(discriminator="type"),
]


class ResearchConfig(StrictModel):
    """Knobs that make the trainer an instrument for benchmarks and experiments (`research:`).
    A run that trains a model leaves them off."""

    emulated_update_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="BENCHMARK ONLY (`make bench-pipeline`): replace the policy update "
        "(forward, backward, optimizer) by a sleep of this many seconds; the weights stay as "
        "built and are still published every step. null: the real update.",
    )
    policy_lag: int = Field(
        0,
        ge=0,
        le=64,
        description="RESEARCH ONLY (`make bench-staleness`, docs/staleness.md#controlled-lag): "
        "rollout samples from weights exactly this many versions behind the trainer (on top of "
        "the mode's own lag), to measure what staleness costs and what the corrections win "
        "back. Needs publish type weightsync; the trainer keeps this many + 1 host copies of "
        "the model. 0: off.",
    )

    @model_validator(mode="after")
    def _one_at_a_time(self) -> ResearchConfig:
        if self.policy_lag and self.emulated_update_s is not None:
            raise ValueError(
                "policy_lag needs the real update (emulated_update_s leaves the weights as "
                "built, so every version would be the same): drop one of them"
            )
        return self


class TrainerConfig(ServiceConfig):
    """trainer: samples scored groups from the TransferQueue and trains the policy."""

    renamed_keys = {
        "emulated_update_s": "research.emulated_update_s",
        "research_policy_lag": "research.policy_lag",
    }

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
    rollout_shape: RolloutShape = Field(
        default_factory=RolloutShape,
        description="Groups per step, samples per prompt, response budget and eta: the "
        "gateway's config holds the same model and must hold the same values.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    progress: ProgressConfig = Field(
        default_factory=ProgressConfig,
        description="Reports of a waiting step and the stop rules of a run that cannot "
        "progress (docs/progress.md).",
    )
    publish: PublishConfig = Field(default_factory=NoPublishConfig)
    gateway: GrpcClientConfig | None = Field(
        None,
        description="The rollout-gateway: told the policy step after every published "
        "version, so its throttle lets rollout run ahead by eta.",
    )
    total_steps: int = Field(100, ge=0, description="Steps (published versions) to train.")
    research: ResearchConfig = Field(
        default_factory=ResearchConfig,
        description="Knobs for benchmarks and experiments, not for training a model; off by "
        "default.",
    )
    metrics_log: Path | None = Field(
        None, description="JSONL file that receives every step's metrics."
    )
    outage_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a lost TransferQueue (Redis) or weight-sync is waited out, "
        "retrying with backoff and one log line per outage, before the trainer gives up and "
        "exits (its supervisor restarts it from the last checkpoint).",
    )

    @model_validator(mode="after")
    def _batches(self) -> TrainerConfig:
        algorithm, batch = self.algorithm, self.rollout_shape.batch_groups
        k = algorithm.parameter_sync_step
        mini = algorithm.mini_batch_groups or batch // k
        if mini * k != batch:
            raise ValueError(
                f"rollout_shape.batch_groups ({batch}) must equal algorithm.parameter_sync_step "
                f"({k}) x algorithm.mini_batch_groups ({algorithm.mini_batch_groups or mini}) "
                "— pick a batch_groups divisible by parameter_sync_step"
            )
        algorithm.mini_batch_groups = mini
        return self

    @model_validator(mode="after")
    def _mode_rules(self) -> TrainerConfig:
        self.algorithm.build_mode().check(self)  # the table of modes checks its own rules
        return self

    @model_validator(mode="after")
    def _lag_rules(self) -> TrainerConfig:
        lag = self.research.policy_lag
        if lag and self.publish.type != "weightsync":
            raise ValueError(
                f"research.policy_lag ({lag}) holds rollout back through weight-sync's "
                f"versions; with publish type {self.publish.type} it cannot: set publish.type "
                "weightsync or research.policy_lag 0"
            )
        return self

    # -- the runtime (torchtitan's Config.build()): each builder imports its component when
    # called, so loading a config stays free of torch and megatron. A run builds its mode once
    # and hands that instance to the leader and the loop.

    @property
    def staleness_threshold(self) -> int:
        """The replay gate's bound: algorithm.staleness.threshold, else the mode's own."""
        a = self.algorithm
        return a.staleness.threshold or default_staleness_bound(
            a.mode, self.rollout_shape.eta, a.parameter_sync_step
        )

    def build_mode(self) -> TrainerMode:
        return self.algorithm.build_mode()

    def build_policy(self) -> Policy:
        """Model, optimizer, schedule (and reference model) of this rank; collective."""
        from relayrl.trainer.runtime import build_policy

        return build_policy(self)

    def build_publisher(self) -> WeightPublisher:
        from relayrl.trainer.publish import build_publisher

        return build_publisher(
            self.publish,
            self.model.hf_dir,
            outage_timeout_s=self.outage_timeout_s,
            lag=self.research.policy_lag,
        )

    def build_updater(self, policy: Policy, data_parallel: DataParallel) -> Updater:
        """The step's policy update, or its benchmark stand-in (`research.emulated_update_s`)."""
        from relayrl.trainer.step import EmulatedUpdater, PolicyUpdater

        if self.research.emulated_update_s is not None:
            return EmulatedUpdater(self.research.emulated_update_s)
        return PolicyUpdater(
            self.algorithm,
            policy.model,
            policy.optimizer,
            policy.scheduler,
            ref_model=policy.ref_model,
            data_parallel=data_parallel,
        )

    def build_feeder(self, tq: TransferQueue) -> PromptFeeder | None:
        """The prompt feeder of `data.prompts_file` or of the dataset's training split; None
        when someone else feeds."""
        from relayrl.trainer.curriculum import Curriculum
        from relayrl.trainer.feeder import (
            GroupTemplate,
            PromptFeeder,
            load_dataset_prompts,
            load_prompts,
        )

        data = self.data
        if data.prompts_file is None and not data.train_files:
            return None
        template = GroupTemplate(
            partition=data.partition,
            run_id=data.run_id,
            samples_per_prompt=self.rollout_shape.samples_per_prompt,
            max_tokens=self.rollout_shape.max_tokens,
            temperature=data.sampling_temperature or self.algorithm.temperature,
            default_agent=data.agent,
        )
        if data.prompts_file is not None:
            prompts = load_prompts(data.prompts_file)
        else:
            prompts = load_dataset_prompts(
                data.train_files, data.heldout_files, data.heldout_fraction
            )
        curriculum = Curriculum(len(prompts), data.shuffle_seed, data.curriculum, data.retry)
        return PromptFeeder(tq, prompts, template, curriculum)

    def build_sampler(self, tq: TransferQueue, watch: ProgressWatch) -> ReplaySampler:
        """The staleness gate over `data.partition`, reporting to `watch`."""
        from relayrl.trainer.replay import ReplaySampler

        data, algorithm = self.data, self.algorithm
        return ReplaySampler(
            tq,
            data.partition,
            policy=algorithm.staleness.policy,
            threshold=self.staleness_threshold,
            poll_interval_s=data.poll_interval_s,
            watch=watch,
            refill_per_filtered=algorithm.refill_per_filtered,
            filter_budget=algorithm.filter_budget,
            outage_timeout_s=self.outage_timeout_s,
        )

    def build_gateway_link(self) -> GatewayLink | None:
        from relayrl.trainer.rollout_link import GatewayLink

        if self.gateway is None:
            return None
        return GatewayLink(self.gateway, outage_timeout_s=self.outage_timeout_s)

    def build_leader(self, tq: TransferQueue, mode: TrainerMode) -> Leader:
        """Rank 0's side of every step, over an open TransferQueue."""
        from relayrl.trainer.loop import Leader
        from relayrl.trainer.progress import ProgressWatch

        watch = ProgressWatch(self.progress)
        return Leader(
            self,
            tq,
            mode,
            feeder=self.build_feeder(tq),
            sampler=self.build_sampler(tq, watch),
            watch=watch,
            gateway=self.build_gateway_link(),
        )

    def build_loop(
        self,
        policy: Policy,
        mode: TrainerMode,
        *,
        leader: Leader | None = None,
        metrics: TrainerMetrics | None = None,
        control: Control | None = None,
        status: Status | None = None,
    ) -> TrainingLoop:
        """The training loop of this rank (`leader` only on rank 0, built with the same
        `mode`); needs megatron's process groups (`build_policy`) first."""
        from relayrl.trainer.loop import TrainingLoop, data_parallel_from_megatron

        return TrainingLoop(
            self,
            policy,
            mode=mode,
            publisher=self.build_publisher(),
            updater=self.build_updater(policy, data_parallel_from_megatron()),
            leader=leader,
            metrics=metrics,
            control=control,
            status=status,
        )
