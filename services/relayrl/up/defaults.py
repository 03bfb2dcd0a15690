"""Training defaults that follow the model (docs/defaults.md).

The built-in tiny Qwen2 (0.5M parameters, warm-started from random weights) and a user's
pretrained model need different settings: a learning rate that moves the tiny model in a few
hundred steps breaks a pretrained one in its first (the first Adam update moves every weight by
about the learning rate). `relayrl up` therefore resolves every `train:` field left null from
the profile of the model's kind, prints what it chose and where each value came from, and
records it in the run (`run.json` `training`).

pydantic only, like relayrl.up.config: read before anything heavy is imported.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.core.config import StrictModel

ModelKind = Literal["tiny", "pretrained"]
Schedule = Literal["constant", "cosine"]

MAX_LR_FACTOR = 10.0
"""A learning rate above this many times its kind's default is refused."""

# Response budgets of the built-in tasks (all turns). Replies to arith are ~6 tokens; lookup
# carries ~570 tokens of tool schemas and two tool turns.
TASK_MAX_TOKENS = {"arith": 24, "lookup": 128}


class Profile(StrictModel):
    """What one kind of model gets for every `train:` field left null."""

    lr: float = Field(gt=0.0, description="Adam's peak learning rate.")
    lr_schedule: Schedule = Field(description="After the warm-up: constant, or cosine.")
    min_lr_ratio: float = Field(ge=0.0, le=1.0, description="cosine: the last lr, over lr.")
    warmup_steps: int = Field(ge=0, description="Linear warm-up from 0, in steps.")
    clip_grad: float = Field(ge=0.0, description="Global gradient-norm clip.")
    kl_coef: float = Field(ge=0.0, description="KL penalty to the starting policy.")
    temperature: float = Field(gt=0.0, description="Sampling temperature of rollouts.")
    max_tokens: int = Field(ge=1, description="Response budget of a dataset or reasoning task.")
    micro_batch_size: int = Field(ge=1, description="Rows per forward pass of the trainer.")
    micro_batch_tokens: int | None = Field(
        ge=1, description="Tokens per forward pass of the trainer (rows x longest row)."
    )
    eval_sampled: bool = Field(description="Also evaluate at the training temperature.")


PROFILES: dict[ModelKind, Profile] = {
    # The tiny model, measured here: a warm start leaves it answering ~15% of arith when
    # sampled at temperature 1; GRPO at lr 2e-4 cosine and temperature 0.7 gained 18.8 held-out
    # points in 250 steps. 4e-4 lost its first 100 steps to a dip below the start, and
    # temperature 1 gained less (docs/defaults.md#tiny-model).
    "tiny": Profile(
        lr=2e-4, lr_schedule="cosine", min_lr_ratio=0.1, warmup_steps=0, clip_grad=1.0,
        kl_coef=0.0, temperature=0.7, max_tokens=256, micro_batch_size=16,
        micro_batch_tokens=None, eval_sampled=True,
    ),
    # A pretrained LLM, full-parameter RL (docs/defaults.md#pretrained-models): peers' GRPO
    # recipes (verl, TRL, DAPO, prime-rl) and this project's bench on SmolLM2-135M.
    "pretrained": Profile(
        lr=5e-6, lr_schedule="cosine", min_lr_ratio=0.1, warmup_steps=5, clip_grad=1.0,
        kl_coef=0.0, temperature=0.6, max_tokens=256, micro_batch_size=4,
        # activations grow with the tokens of a micro-batch (~2 MB per token for SmolLM2-135M
        # in fp32): this keeps its trainer under 4 GB (docs/defaults.md#trainer-memory)
        micro_batch_tokens=256, eval_sampled=False,
    ),
}  # fmt: skip


class Training(StrictModel):
    """The training settings a run uses: each `train:` field as set, or its profile's."""

    kind: ModelKind
    lr: float
    lr_schedule: Schedule
    min_lr: float
    warmup_steps: int
    clip_grad: float
    kl_coef: float
    temperature: float
    max_tokens: int
    micro_batch_size: int
    micro_batch_tokens: int | None
    eval_sampled: bool
    chosen: list[str] = Field(
        default_factory=list, description="The fields that came from the profile."
    )

    def describe(self) -> str:
        """One line for the console: every value, the profile's marked as defaults."""
        schedule = f"{self.lr:g}"
        if self.warmup_steps:
            schedule += f" after a {self.warmup_steps}-step warm-up"
        if self.lr_schedule == "cosine":
            schedule += f", cosine to {self.min_lr:g}"
        items = [
            ("lr", schedule),
            ("clip_grad", f"{self.clip_grad:g}"),
            ("kl_coef", f"{self.kl_coef:g}"),
            ("temperature", f"{self.temperature:g}"),
            ("max_tokens", str(self.max_tokens)),
            ("micro_batch_size", str(self.micro_batch_size)),
        ]
        if self.micro_batch_tokens is not None:
            items.append(("micro_batch_tokens", str(self.micro_batch_tokens)))
        text = ", ".join(f"{name} {value}" for name, value in items)
        user = sorted(
            {"lr", "clip_grad", "kl_coef", "temperature", "max_tokens"} - set(self.chosen)
        )
        return f"training settings for a {self.kind} model: {text}" + (
            f" (set in the config: {', '.join(user)})" if user else " (all defaults)"
        )


def lr_ceiling(kind: ModelKind) -> float:
    return PROFILES[kind].lr * MAX_LR_FACTOR


def resolve(
    kind: ModelKind,
    values: dict[str, object],
    task_max_tokens: int | None,
    steps: int,
) -> Training:
    """`values`: the `train:` fields as given (None where null); `task_max_tokens`: a built-in
    task's own budget, which comes before the profile's."""
    profile = PROFILES[kind]
    chosen = [name for name in Profile.model_fields if values.get(name) is None]
    own = {name: value for name, value in values.items() if value is not None}
    merged = profile.model_dump() | own
    if "max_tokens" not in own and task_max_tokens is not None:
        merged["max_tokens"] = task_max_tokens
    lr = float(merged["lr"])
    min_lr = own.get("min_lr")
    if min_lr is None:
        cosine = merged["lr_schedule"] == "cosine"
        min_lr = float(f"{lr * profile.min_lr_ratio:.6g}") if cosine else lr  # 5e-07, not ...01
        chosen.append("min_lr")
    warmup = int(merged["warmup_steps"])
    if "warmup_steps" not in own:
        warmup = min(warmup, max(0, steps // 4))  # a short run keeps most of its steps at lr
    return Training(
        kind=kind,
        lr=lr,
        lr_schedule=merged["lr_schedule"],
        min_lr=float(min_lr),
        warmup_steps=warmup,
        clip_grad=float(merged["clip_grad"]),
        kl_coef=float(merged["kl_coef"]),
        temperature=float(merged["temperature"]),
        max_tokens=int(merged["max_tokens"]),
        micro_batch_size=int(merged["micro_batch_size"]),
        micro_batch_tokens=merged["micro_batch_tokens"],
        eval_sampled=bool(merged["eval_sampled"]),
        chosen=sorted(set(chosen) - {"min_lr_ratio"}),
    )
