"""`<run_dir>/run.json`: what `relayrl up` records about its run, one typed object.

relayrl.up.run writes it at every change of the run's state; `relayrl status`, `relayrl up
--resume`, the end-of-run report, the test kit and the benches read it. Every reader gets a
`RunState`: each field is there with its type, or the file is not a run's state at all
(`RunStateError`, with the path and what is wrong), so no reader checks a value again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from relayrl.core.atomic import atomic_write_text
from relayrl.up.config import Mode
from relayrl.up.defaults import ModelKind, Training

RUN_FILE = "run.json"

Phase = Literal[
    "preparing", "starting", "training", "completed", "stopped", "failed", "no_progress"
]
ENDED: frozenset[Phase] = frozenset({"completed", "stopped", "failed", "no_progress"})
"""The phases of a run that no process is working on."""


class RunStateError(ValueError):
    """A run.json that cannot be read as a run's state; the message starts with its path."""


class RunState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    run_id: str
    task: str  # the task's name, or `dataset`
    mode: Mode
    eta: int
    steps: int  # configured
    warm_started: bool
    model_kind: ModelKind
    training: Training  # the training settings in effect, each marked as chosen or set
    state: Phase
    started: float  # Unix time of the first start (a resume keeps it)
    finished: float | None = None  # set when the run completed
    resumed: list[float] = []  # Unix time of each resume
    model_dir: str | None = None
    warm_start_dir: str | None = None
    training_started: float | None = None
    training_finished: float | None = None
    error: str | None = None  # why the run failed or could not progress

    @property
    def duration_s(self) -> float | None:
        """First start to completion; None until the run completed."""
        if self.finished is None or self.finished < self.started:
            return None
        return self.finished - self.started

    def but(self, **changes: Any) -> RunState:
        """This state with `changes`, validated as a whole."""
        return RunState.model_validate(self.model_dump() | changes)

    def write(self, run_dir: Path) -> None:
        atomic_write_text(run_dir / RUN_FILE, self.model_dump_json(indent=2) + "\n")

    @staticmethod
    def exists(run_dir: Path) -> bool:
        return (run_dir / RUN_FILE).is_file()

    @classmethod
    def read(cls, run_dir: Path) -> RunState:
        """The run's state; FileNotFoundError when it has none, RunStateError when what is
        there is not one."""
        return read_model(run_dir / RUN_FILE, cls, RunStateError)


ModelT = TypeVar("ModelT", bound=BaseModel)


def read_model(path: Path, model: type[ModelT], error: type[ValueError]) -> ModelT:
    """The JSON object at `path` as `model`; FileNotFoundError when there is none, `error`
    with the path, the first bad field and what is wrong when it is not one."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return model.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        count = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise error(f"{path}: {where}: {first['msg']}{count}") from None
