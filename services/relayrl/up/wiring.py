"""`relayrl up`'s composition of the system: the shared wiring from the run's config, the
settings that are each local service's own (paths in the run folder, timeouts suited to one
machine), then the user's `services:` overrides -- all checked before any process starts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.core.config import LoggingConfig
from relayrl.core.rollout_shape import RolloutShape
from relayrl.stack import EngineDiscovery, Identities, StackConfig, Wiring
from relayrl.stack.local import LocalPorts
from relayrl.tq.config import TQConfig
from relayrl.up.config import EXTERNAL_AGENT, UpConfig
from relayrl.up.prepare import max_tokens
from relayrl.up.secrets import REDIS_PASSWORD_ENV, run_identities

NAMESPACE = "relayrl"
PARTITION = "train"
# What a `services:` override of a shared field should be instead.
HINTS = {
    "rollout_shape": "set it in train: instead",  # train: has the shape's own keys
    "mode": "set train.mode instead",
    "parameter_sync_step": "relayrl up runs one update per version",
    "tq": "relayrl up runs its own Redis: remove the override",
    "partition": "remove the override",
    "model_path": "the model is the run's warm start: remove the override",
    "endpoints": "relayrl up chooses ports and addresses: remove the override",
}


def up_wiring(
    config: UpConfig, model_dir: Path, ports: LocalPorts, identities: Identities | None = None
) -> Wiring:
    """`identities`: the run's tokens (relayrl.up.secrets), when it authenticates."""
    train = config.train
    return Wiring(
        tq=TQConfig(
            url=ports.redis_url,
            password_env=REDIS_PASSWORD_ENV if config.security.authenticate else None,
            namespace=NAMESPACE,
            partitions=[PARTITION],
        ),
        partition=PARTITION,
        model_path=model_dir,
        mode=train.mode,
        rollout_shape=RolloutShape(
            eta=train.effective_eta,
            batch_groups=train.batch_groups,
            samples_per_prompt=train.samples_per_prompt,
            max_tokens=max_tokens(config),
        ),
        endpoints=ports.endpoints(),
        engines=EngineDiscovery(urls=[ports.engine_url]),
        logging=LoggingConfig(json=True),
        identities=identities if config.security.authenticate else None,
    )


def progress_log(run_dir: Path) -> Path:
    """Where the trainer writes its progress records (relayrl.trainer.progress)."""
    return run_dir / "trainer" / "progress.jsonl"


def up_own_settings(
    config: UpConfig,
    run_dir: Path,
    prompts_file: Path,
    ports: LocalPorts,
    agent_launcher: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """What each service of a local run sets for itself (nothing another service reads).
    `agent_launcher`: argv the agent's command runs under (into the agents' own host)."""
    train, training = config.train, config.training
    reward = up_reward_settings(config)
    if config.security.authenticate:  # the operator (relayrl up) is the reward API's tenant
        identities = run_identities(run_dir)
        reward["auth"] = {"type": "static_token", "tokens_file": str(identities.tokens_file)}
    gateway: dict[str, Any] = {
        "engines": {"health_interval_s": 1.0},
        "rollout": {"lease_s": 20.0, "claimer": "gateway-0"},
        "agent_http": {
            "enabled": True,
            "host": ports.address("gateway"),
            "port": ports.agent_http,
        },
        "weightsync": {"default_timeout_s": 30},
    }
    agent = config.agent
    if agent.command is not None:
        # the section's fields are ExternalAgentConfig's
        external = agent.model_dump(mode="json")
        external["command"] = [*agent_launcher, *agent.command]
        gateway["agents"] = {"external": {EXTERNAL_AGENT: external}}
    return {
        "reward": reward,
        "gateway": gateway,
        "weightsync": {
            "bucket_size_bytes": 4 * 1024 * 1024,
            "engines": {"load_timeout_s": 120},
            "data_plane": {"transport": config.weightsync.transport, "timeout_s": 60},
            "gateway": {"default_timeout_s": 30},
            "metrics_log": str(run_dir / "weightsync" / "transfers.jsonl"),
            "state_dir": str(run_dir / "weightsync" / "state"),
        },
        "trainer": {
            "model": {"seed": train.seed, "max_seq_len": config.engine.max_model_len},
            "optim": {
                "lr": training.lr,
                "schedule": training.lr_schedule,
                "min_lr": training.min_lr,
                "warmup_updates": training.warmup_steps,
                "clip_grad": training.clip_grad,
            },
            "algorithm": {
                "mini_batch_groups": train.batch_groups,
                "micro_batch_size": training.micro_batch_size,
                "micro_batch_tokens": training.micro_batch_tokens,
                "temperature": training.temperature,
                "loss": {"kl_coef": training.kl_coef},
            },
            "data": {
                "prompts_file": str(prompts_file),
                "shuffle_seed": train.seed,
                "run_id": run_dir.name,
                "poll_interval_s": 0.05,
            },
            "checkpoint": {
                "dir": str(run_dir / "trainer" / "checkpoints"),
                "interval_steps": train.checkpoint_interval_steps,
                "keep": 2,
            },
            "publish": {"wait_for_commit": True},
            "gateway": {"default_timeout_s": 30},
            "progress": {"log": str(progress_log(run_dir))},
            "total_steps": train.steps,
            "metrics_log": str(run_dir / "trainer" / "steps.jsonl"),
        },
    }


USER_MANAGER = "user"
REASONING_GYM_MANAGER = "reasoning_gym"
ENV_MANAGER = "env"


def up_reward_settings(config: UpConfig) -> dict[str, Any]:
    """The reward-service's managers: the rule scorers (the default, or with `reward.env` the
    environment's reported reward), the reasoning-gym checker for a reasoning_gym task, and the
    user's function for its data sources."""
    from relayrl.reward.config import RewardConfig

    managers: dict[str, Any] = {}
    by_source: dict[str, str] = {}
    scorer: dict[str, Any] = {"reclaim_idle_s": 10}
    if config.task.reasoning_gym_dataset is not None and not config.data.train_files:
        managers[REASONING_GYM_MANAGER] = {"type": "reasoning_gym"}
        by_source[config.task.name] = REASONING_GYM_MANAGER
    reward = config.reward
    if reward.env:
        managers[ENV_MANAGER] = {"type": "env"}
        scorer["manager"] = ENV_MANAGER
    if reward.function is not None:
        managers[USER_MANAGER] = {"type": "custom", "path": reward.function}
        by_source |= {source: USER_MANAGER for source in reward.data_sources}
        if not reward.data_sources:
            scorer["manager"] = USER_MANAGER
    if not managers:
        return {"tq_scorer": scorer}
    defaults = RewardConfig.model_fields["managers"].default_factory()
    return {
        "managers": {name: m.model_dump(mode="json") for name, m in defaults.items()} | managers,
        "tq_scorer": scorer | {"managers_by_data_source": by_source},
    }


def up_stack(
    config: UpConfig,
    run_dir: Path,
    model_dir: Path,
    prompts_file: Path,
    ports: LocalPorts,
    agent_launcher: Sequence[str] = (),
) -> StackConfig:
    """The run's four service configs; StackError names a bad field (`services.<svc>...`).
    Reads no file: the run's secrets are made when the services are (relayrl.up.secrets)."""
    return StackConfig.compose(
        up_wiring(config, model_dir, ports, run_identities(run_dir)),
        own=up_own_settings(config, run_dir, prompts_file, ports, agent_launcher),
        overrides=config.services.model_dump(),
        hints=HINTS,
    )


def check_up_stack(config: UpConfig) -> None:
    """Composes the system as `relayrl up` will, with placeholder ports and paths: a bad
    `services:` override is reported before anything is prepared or started."""
    run_dir = config.runs_dir.absolute() / "r-check"
    up_stack(config, run_dir, run_dir / "model", run_dir / "data" / "prompts.jsonl",
             LocalPorts.placeholder())  # fmt: skip
