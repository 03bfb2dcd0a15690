"""What a run trains on, read and checked before any service starts.

A workload is the run's prompt records (training and held-out, relayrl.trainer.feeder's
format), the built-in task whose SFT examples the warm start uses, and how a held-out answer is
judged correct. Three kinds:

    built-in     `task.name` arith or lookup (relayrl.tasks): drawn from a seed, SFT examples
    dataset      `data.train_files`: a user's verl-format or flat files (relayrl.tasks.datasets)
    reasoning    `task.name: reasoning_gym:<dataset>`: drawn from the reasoning-gym package

Correctness is decided by the same scorer the reward-service runs for the row's data_source (a
rule scorer, the reasoning-gym checker, or the user's function), never by a copy, so held-out
accuracy and the training reward cannot disagree.

Every mistake is a `WorkloadError`: one line for `relayrl up` to print with exit code 2 before
anything has started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import shutil
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relayrl.tasks import Task
from relayrl.tasks.datasets import DatasetError, Record, load_dataset
from relayrl.up.config import BUILTIN_TASKS, EXTERNAL_AGENT, UpConfig

if TYPE_CHECKING:
    from relayrl.tasks.reasoning_gym import ReasoningGymTask


class WorkloadError(ValueError):
    """A run that cannot start as configured; the message is one line."""


@dataclass(frozen=True)
class Workload:
    """Its name is `UpConfig.task_label`, its response budget `relayrl.up.prepare.max_tokens`."""

    train: list[Record]
    heldout: list[Record]
    judge: Judge
    task: Task | None = None
    """The built-in task (its SFT examples and knobs), else None."""


class Judge:
    """Whether a response earns the reward, by the scorer of its data_source."""

    def __init__(
        self,
        function: str | None = None,
        function_sources: Collection[str] = (),
        reasoning_gym_source: str | None = None,
        env: bool = False,
    ) -> None:
        self._function = load_user_function(function) if function else None
        self._function_sources = set(function_sources)
        self._reasoning_gym_source = reasoning_gym_source
        self.env = env
        """Every other data_source is scored by its environment (reward.env): no held-out
        answer can be judged here."""

    @classmethod
    def for_run(cls, config: UpConfig) -> Judge:
        """The scorers `relayrl up` configures the reward-service with (relayrl.up.wiring)."""
        reasoning = config.task.name if config.task.reasoning_gym_dataset else None
        return cls(
            config.reward.function, config.reward.data_sources,
            reasoning_gym_source=None if config.data.train_files else reasoning,
            env=config.reward.env,
        )  # fmt: skip

    def _by_function(self, data_source: str) -> bool:
        return self._function is not None and (
            not self._function_sources or data_source in self._function_sources
        )

    def known_sources(self) -> list[str] | None:
        """data_source values this judge scores; None when every one (a catch-all function)."""
        from relayrl.reward.managers.rules import RULE_SCORERS

        if self.env or (self._function is not None and not self._function_sources):
            return None
        extra = [self._reasoning_gym_source] if self._reasoning_gym_source else []
        return sorted({*RULE_SCORERS, *self._function_sources, *extra})

    def ground_truth_problem(self, record: Mapping[str, Any]) -> str | None:
        """Why the rule scorer of a row's data_source cannot read its ground truth; None when
        it can, or when another scorer (the user's function, reasoning-gym, the agent's
        environment) judges the row."""
        from relayrl.reward.items import InvalidItem, RewardItem
        from relayrl.reward.managers.rules import RULE_SCORERS

        source = str(record.get("data_source", ""))
        scorer = RULE_SCORERS.get(source)
        if scorer is None or self.env or self._by_function(source):
            return None
        item = RewardItem(
            item_id="check", data_source=source, response="",
            ground_truth=str(record.get("ground_truth", "")),
        )  # fmt: skip
        try:
            scorer(item)
        except InvalidItem as exc:
            why = str(exc).removeprefix("item 'check': ")
            return f"the {source} rule cannot score this row: {why}"
        return None

    def correct(self, data_source: str, response: str, ground_truth: str) -> bool:
        from relayrl.reward.items import RewardItem, Status, Verdict
        from relayrl.reward.managers.rules import RULE_SCORERS

        item = RewardItem(
            item_id="heldout", data_source=data_source, response=response,
            ground_truth=ground_truth,
        )  # fmt: skip
        if self._by_function(data_source):
            result = self._function(item)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
            if isinstance(result, Verdict):
                return result.status is Status.OK and result.score > 0
            return float(result) > 0
        if data_source == self._reasoning_gym_source:
            from relayrl.reward.managers.reasoning_gym import score_item

            return score_item(item).score >= 1.0
        return RULE_SCORERS[data_source](item).status is Status.OK


async def _await(awaitable: Any) -> Any:
    return await awaitable


def load_user_function(path: str) -> Callable[..., Any]:
    """The user's scoring function, importable from the working directory as from the
    reward-service `relayrl up` starts (it gets the same PYTHONPATH)."""
    from relayrl.core.dotted import import_object

    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        function = import_object(path, "reward.function")
    except Exception as exc:
        raise WorkloadError(f"reward.function: {exc}") from None
    if not callable(function) or inspect.isclass(function):
        raise WorkloadError(f"reward.function: {path} is not a function")
    return function


def load_workload(config: UpConfig) -> Workload:
    """The run's workload; WorkloadError (one line) for any mistake in the task, the data
    files or the reward function. With `agent.command`, every training prompt is rolled out by
    that agent (held-out ones keep the task's loop: evaluation measures the policy)."""
    workload = _task_workload(config)
    if config.agent.command is None:
        return workload
    train = [{**record, "agent": EXTERNAL_AGENT} for record in workload.train]
    return dataclasses.replace(workload, train=train)  # type: ignore[arg-type]


def check_agent_command(command: Sequence[str], cwd: Path | None) -> None:
    """WorkloadError when the agent's program cannot be found."""
    program = command[0]
    if "/" in program:
        found = (cwd or Path.cwd()) / program
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise WorkloadError(f"agent.command: {program} is not an executable file")
    elif shutil.which(program) is None:
        raise WorkloadError(f"agent.command: {program!r} is not on PATH")
    for argument in command[1:]:
        if argument.endswith(".py") and not ((cwd or Path.cwd()) / argument).is_file():
            raise WorkloadError(f"agent.command: no file {argument} (in {cwd or Path.cwd()})")


def _task_workload(config: UpConfig) -> Workload:
    judge = Judge.for_run(config)
    if config.data.train_files:
        return _dataset_workload(config, judge)
    if config.task.reasoning_gym_dataset is None:
        builtin = build_task(config)
        drawn: Task | ReasoningGymTask = builtin
    else:
        from relayrl.tasks.reasoning_gym import ReasoningGymTask

        builtin = None
        try:
            drawn = ReasoningGymTask.create(config.task.reasoning_gym_dataset, config.task.options)
        except ValueError as exc:
            raise WorkloadError(f"task {config.task.name}: {exc}") from None
    task, seed = config.task, config.task.seed
    try:
        train = drawn.prompts("train", task.train_prompts, seed)
        heldout = drawn.prompts("heldout", task.heldout_prompts, seed)
    except ValueError as exc:
        raise WorkloadError(f"task {task.name}: {exc}") from None
    return Workload(train=train, heldout=heldout, judge=judge, task=builtin)


def build_task(config: UpConfig) -> Task:
    """The built-in task with the configured knobs; WorkloadError (one line) for a bad knob."""
    from relayrl.tasks import TASKS

    assert config.task.name in BUILTIN_TASKS, config.task.name
    base = TASKS[config.task.name]
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(config.task.options) - known)
    if unknown:
        raise WorkloadError(
            f"task.options: unknown knob(s) {', '.join(unknown)} for {base.name} "
            f"(known: {', '.join(sorted(known))})"
        )
    try:
        return dataclasses.replace(base, **config.task.options)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"task.options: {exc}") from None


def _dataset_workload(config: UpConfig, judge: Judge) -> Workload:
    data = config.data
    try:
        dataset = load_dataset(
            data.train_files, data.heldout_files, heldout_fraction=data.heldout_fraction,
            known_sources=judge.known_sources(), hold_out=not judge.env,
            ground_truth_problem=judge.ground_truth_problem,
        )  # fmt: skip
    except DatasetError as exc:
        raise WorkloadError(str(exc)) from None
    return Workload(train=dataset.train, heldout=dataset.heldout[: data.max_heldout], judge=judge)


def check_prompt_lengths(
    records: list[Record], tokenizer_dir: Path, max_model_len: int, max_tokens: int
) -> None:
    """WorkloadError when a prompt, rendered by the model's chat template as the gateway renders
    it, leaves less than `max_tokens` of `max_model_len` for the response: how many and the
    longest."""
    budget = max_model_len - max_tokens
    if budget < 1:
        raise WorkloadError(
            f"train.max_tokens {max_tokens} leaves no room for a prompt in engine.max_model_len "
            f"{max_model_len}"
        )
    from relayrl.conversation.rendering import render

    tokenizer = load_chat_tokenizer(tokenizer_dir)
    lengths = []
    for record in records:  # rendered and encoded as the gateway's single_turn loop does
        text = render(tokenizer, _messages(record), None, add_generation_prompt=True)
        lengths.append(len(tokenizer.encode(text, add_special_tokens=False)))
    over = [n for n in lengths if n > budget]
    if over:
        raise WorkloadError(
            f"{len(over)} of {len(records)} prompts do not fit engine.max_model_len "
            f"{max_model_len} with train.max_tokens {max_tokens} (longest: {max(over)} tokens, "
            f"room: {budget}); raise engine.max_model_len or shorten them"
        )


def _messages(record: Mapping[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return list(record["messages"])
    return [{"role": "user", "content": record["prompt"]}]


def load_chat_tokenizer(model_dir: Path):
    """The model's tokenizer; WorkloadError when it has no chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise WorkloadError(f"{model_dir}: cannot load its tokenizer ({exc})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise WorkloadError(
            f"{model_dir}: the tokenizer has no chat template (tokenizer_config.json "
            "chat_template or chat_template.jinja); relayrl renders prompts with it"
        )
    return tokenizer


def check_model_dir(path: Path) -> str:
    """WorkloadError unless `path` is a Hugging Face folder of a family the trainer maps and
    the engine serves; returns its model_type."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise WorkloadError(f"model.path: {config_file} does not exist; give a model folder")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"{config_file}: not readable JSON ({exc})") from None
    from relayrl.trainer.hf_mapping import ModelSpec

    try:
        ModelSpec.from_hf_config(hf_config)
    except (ValueError, KeyError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise WorkloadError(f"{config_file}: {what}") from None
    if not any(path.glob("*.safetensors")):
        raise WorkloadError(f"model.path: {path} has no *.safetensors weights")
    return str(hf_config["model_type"])
