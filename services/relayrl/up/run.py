"""`relayrl up`: one training run on the local stack, from an empty folder to a report.

    prepare    task files, the tiny model, the warm start (cached)
    start      redis-server, reward-service, engine, gateway, weight-sync (each ready in turn)
    evaluate   held-out accuracy of the warm start (version 0)
    train      the trainer, supervised with the rest; progress every step (and every 30 s
               of a step that waits), held-out accuracy after the first update (version 1)
               and every `eval.interval_steps`; a stop rule ends the run with exit code 3
    finish     final held-out accuracy, reward timing from the TransferQueue, report.html,
               the summary paragraph; everything stopped

Ctrl-C or SIGTERM stops the run cleanly at any point: the trainer finishes its step and
checkpoints, every child is stopped by PID, Redis flushes its AOF; `relayrl up --resume
runs/<id>` continues from there (a second Ctrl-C stops at once, without the checkpoint).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relayrl.core.records import EvalRecord, StepRecord, append_record, read_records
from relayrl.trainer.progress import EXIT_NO_PROGRESS as TRAINER_NO_PROGRESS
from relayrl.up.config import UpConfig
from relayrl.up.evaluate import Evaluator
from relayrl.up.hosts import HostsError
from relayrl.up.prepare import RunFiles, base_model, max_tokens, warm_start, write_task_files
from relayrl.up.progress import Progress
from relayrl.up.run_state import RunState
from relayrl.up.secrets import operator_identity
from relayrl.up.supervisor import ORDER, ChildStartError, Event, Supervisor
from relayrl.up.workload import Workload, load_workload

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
EXIT_NO_PROGRESS = 3  # a stop rule fired (relayrl.trainer.progress): the cause is one line
EVAL_ATTEMPTS = 2
EVAL_RETRY_S = 10.0


class Interrupted(Exception):
    """Ctrl-C or SIGTERM while starting: unwind and stop what was started."""


@dataclass
class Signals:
    """SIGINT/SIGTERM: the first asks the run to stop (raising `Interrupted` while `raising`);
    the second stops at once."""

    stop: threading.Event = field(default_factory=threading.Event)
    raising: bool = True
    count: int = 0

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.stop.set()
        if self.raising or self.count > 1:
            self.raising = False  # raise once: the unwinding itself must not be interrupted
            raise Interrupted(signal.Signals(signum).name)


def new_run_dir(runs_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = runs_dir / f"r-{stamp}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = runs_dir / f"r-{stamp}-{n}"
    return run_dir


def load_run_config(run_dir: Path) -> UpConfig:
    path = run_dir / "config.yaml"
    if not path.exists():
        raise ValueError(f"{run_dir} is not a relayrl run (no config.yaml)")
    return UpConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))


class Run:
    def __init__(
        self,
        config: UpConfig,
        run_dir: Path,
        *,
        resume: bool = False,
        workload: Workload | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.workload = workload
        self.run_dir = run_dir
        self.resume = resume
        self.say = say
        self.signals = Signals()
        self.supervisor: Supervisor | None = None
        self.evaluator: Evaluator | None = None
        self._eval_thread: threading.Thread | None = None
        self.eval_log = run_dir / "eval.jsonl"
        self.state: RunState | None = None  # run.json, from the start of `main`

    # -- run.json ---------------------------------------------------------------------------

    def _update_state(self, **changes: Any) -> None:
        if self.state is None:  # stopped before run.json was written: nothing to update
            return
        self.state = self.state.but(**changes)
        self.state.write(self.run_dir)

    # -- the run ----------------------------------------------------------------------------

    def main(self) -> int:
        self.signals.install()
        try:
            return self._main()
        except Interrupted as exc:
            self.say(f"relayrl up: {exc}: stopping")
            self._shutdown("stopped")
            return EXIT_INTERRUPTED
        except (ChildStartError, HostsError) as exc:  # one line: a log has the rest
            self.say(f"relayrl up: {exc}")
            if self.supervisor is not None:
                self.supervisor.stop(say=lambda line: None)
            self._update_state(state="failed", error=str(exc))
            return EXIT_FAILED
        finally:
            if self.supervisor is not None:  # whatever happened: no child, no host left
                self.supervisor.stop(say=lambda line: None)
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_DFL)

    def _main(self) -> int:
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        started = time.time()
        if self.resume:
            self.say(f"relayrl up: resuming {self.run_dir}")
            self.state = RunState.read(self.run_dir)
            self._update_state(state="starting", resumed=[*self.state.resumed, started])
        else:
            self.say(f"relayrl up: run {self.run_dir.name} in {self.run_dir}")
            (self.run_dir / "config.yaml").write_text(
                yaml.safe_dump(c.model_dump(mode="json"), sort_keys=False)
            )
            self.state = RunState(
                run_id=self.run_dir.name,
                task=c.task_label,
                mode=c.train.mode,
                eta=c.train.effective_eta,
                steps=c.train.steps,
                warm_started=c.warm_start_enabled,
                model_kind=c.model_kind,
                training=c.training,
                started=started,
                state="preparing",
            )
            self.state.write(self.run_dir)
        self.say(c.training.describe())
        workload = self.workload or load_workload(c)
        files = RunFiles.in_dir(self.run_dir / "data")
        if not (self.resume and files.prompts.exists()):
            files = write_task_files(workload, c, self.run_dir / "data")
        model = base_model(c, self.say)
        warm = warm_start(c, model, files, self.run_dir / "logs" / "sft.log", self.say)
        self._update_state(model_dir=str(model), warm_start_dir=str(warm))

        self.say(c.placement.describe())
        self.supervisor = Supervisor(c, self.run_dir, warm, files, on_event=self._on_event)
        if self.supervisor.network is not None:
            self.say(self.supervisor.network.describe())
        self.say("starting the stack:")
        self.supervisor.build()
        self.supervisor.start(ORDER[:-1], say=self.say)
        if workload.heldout:
            self.evaluator = Evaluator(
                workload.judge,
                files.heldout,
                warm,
                max_tokens=max_tokens(c),
                temperature=c.training.temperature,
                sampled=c.training.eval_sampled,
                engine_token=operator_identity(self.run_dir).token,
                responses_dir=self.run_dir / "eval",
            )
        else:
            self.say("  held-out evaluation: off (the agent's environment scores every answer)")
        if not self._evaluated("warm_start"):
            self._evaluate("warm_start", 0)
        self.supervisor.start(("trainer",), say=self.say)
        self.supervisor.supervise()
        self._update_state(state="training", training_started=time.time())
        self.signals.raising = False
        outcome = self._train()
        if outcome == "completed":
            self._update_state(training_finished=time.time())
            self._evaluate("final", c.train.steps)
        self._shutdown(outcome)
        exits = {"completed": EXIT_OK, "stopped": EXIT_INTERRUPTED, "no_progress": EXIT_NO_PROGRESS}
        return exits.get(outcome, EXIT_FAILED)

    def _train(self) -> str:
        """Watches the trainer until it completes, the run is stopped, or a child gives up."""
        assert self.supervisor is not None
        c = self.config
        progress = Progress(self.run_dir, self.supervisor, c.train.steps, self.say)
        trainer = self.supervisor.children["trainer"]
        interval = c.eval.interval_steps
        next_eval = interval if interval else None
        # version 1 is evaluated at once: a policy broken by its first update shows there
        first_update = c.train.steps > 1 and not self._evaluated("first_update")
        while True:
            if self.signals.stop.wait(1.0):
                return "stopped"
            before, step = progress.completed, progress.poll()
            if step > before:  # the trainer exits when done: keep its last scrape
                self.supervisor.snapshot_metrics(self.run_dir / "metrics", ("trainer",))
            if self.supervisor.failed:
                self.say(f"relayrl up: {self.supervisor.failure}")
                return "failed"
            if not trainer.alive() and trainer.exit_code() == 0:
                progress.poll()
                self._join_eval()
                return "completed"
            if not trainer.alive() and trainer.exit_code() == TRAINER_NO_PROGRESS:
                progress.poll()
                cause = progress.stopped.line() if progress.stopped else "no progress"
                self.say(f"relayrl up: {cause} (see {self.run_dir / 'logs' / 'trainer.log'})")
                self._update_state(error=cause)
                return "no_progress"
            evaluating = self._eval_thread is not None and self._eval_thread.is_alive()
            if evaluating or not 1 <= step < c.train.steps:
                continue
            if first_update:
                self._start_eval("first_update", step)
                first_update = False
            elif next_eval is not None and next_eval <= step:
                self._start_eval("periodic", step)
                next_eval = (step // interval + 1) * interval

    def _evaluated(self, kind: str) -> bool:
        """Whether this run (before a resume, too) has a good evaluation of `kind`."""
        return any(r.kind == kind and not r.failed for r in read_records(self.eval_log, EvalRecord))

    def _start_eval(self, kind: str, step: int) -> None:
        """An evaluation beside training (it talks to the engine alongside rollouts)."""
        self._eval_thread = threading.Thread(target=self._evaluate, args=(kind, step), daemon=True)
        self._eval_thread.start()

    def _join_eval(self) -> None:
        if self._eval_thread is not None:  # bounded: each of its requests has a deadline
            self._eval_thread.join()

    def _evaluate(self, kind: str, step: int) -> EvalRecord | None:
        """One evaluation, tried EVAL_ATTEMPTS times; a failure is recorded and said as such
        (never shown as the last good accuracy)."""
        assert self.supervisor is not None
        if self.evaluator is None:
            return None
        started = time.monotonic()
        label = kind.replace("_", " ")
        if kind == "warm_start" and not self.config.warm_start_enabled:
            label = "start"  # version 0 is the model as given
        error = ""
        for attempt in range(1, EVAL_ATTEMPTS + 1):
            try:
                # The evaluation talks to the engine itself: only once the gateway would route
                # to it (it holds the committed version), not while it restarts or loads.
                self.supervisor.wait_for_routing(self.config.supervision.start_timeout_s)
                record = self.evaluator.run(self.supervisor.engine_url, kind, step)
                break
            except Exception as exc:  # an engine restarting, a deadline: try once more
                if isinstance(exc, ExceptionGroup):
                    exc = exc.exceptions[0]
                error = f"{type(exc).__name__}: {exc}".rstrip(": ")
                if attempt < EVAL_ATTEMPTS:
                    self.say(f"  held-out evaluation ({label}) failed ({error}); retrying")
                    time.sleep(EVAL_RETRY_S)
        else:
            append_record(
                self.eval_log,
                EvalRecord.failure(kind, step, error, time.monotonic() - started),
            )
            self.say(f"  held-out evaluation ({label}) FAILED {EVAL_ATTEMPTS} times: {error}")
            return None
        append_record(self.eval_log, record)
        sampled = (
            f", sampled {record.sampled_accuracy:.1%}"
            if record.sampled_accuracy is not None
            else ""
        )
        self.say(
            f"  held-out accuracy ({label}, version {record.version}): "
            f"{record.accuracy:.1%} greedy{sampled} on {record.n} questions "
            f"({record.seconds:.0f} s)"
        )
        return record

    def _on_event(self, event: Event) -> None:
        if event.kind in ("exited", "restarted", "gave_up", "restart_failed"):
            self.say(f"  supervisor: {event.child} {event.kind} {event.detail}".rstrip())

    def _shutdown(self, outcome: str) -> None:
        """Stops the stack, then writes what the run produced (also for a stopped run)."""
        supervisor = self.supervisor
        timing_error = None
        if supervisor is not None:
            self.say("stopping the stack...")
            try:
                self._reward_timing(supervisor)
            except Exception as exc:  # Redis gone: the report goes without it
                timing_error = exc
            supervisor.snapshot_metrics(self.run_dir / "metrics")
            supervisor.stop(say=self.say)
        self._update_state(state=outcome, finished=time.time() if outcome == "completed" else None)
        if timing_error is not None:
            self.say(f"  reward timing unavailable: {timing_error}")
        self._report(outcome)
        if outcome != "completed":
            self.say(f"resume with: relayrl up --resume {self.run_dir}")

    def _reward_timing(self, supervisor: Supervisor) -> None:
        from relayrl.tq import TQConfig, TransferQueue
        from relayrl.up.secrets import with_redis_password
        from relayrl.up.supervisor import NAMESPACE
        from relayrl.up.timing import reward_timing, write_reward_timing

        records = read_records(self.run_dir / "trainer" / "steps.jsonl", StepRecord)
        steps = [(r.step, r.uids) for r in records]
        if not steps or not supervisor.children["redis"].alive():
            return
        url = with_redis_password(supervisor.redis_url, self.run_dir)
        tq = TransferQueue.from_config(TQConfig(url=url, namespace=NAMESPACE, partitions=[]))
        try:
            timings = reward_timing(tq, "train", steps)
        finally:
            tq.close()
        write_reward_timing(self.run_dir, timings)

    def _report(self, outcome: str) -> None:
        try:
            from relayrl.up.report import summary_text, write_report

            report = write_report(self.run_dir)
        except Exception as exc:
            self.say(f"report: failed ({exc}); the raw records are in {self.run_dir}")
            return
        self.say(f"report: {self.run_dir / 'report.html'}")
        self.say("")
        self.say(summary_text(report))
