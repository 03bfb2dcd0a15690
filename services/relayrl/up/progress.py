"""The live progress of a run: one line per trainer step, and what a waiting step has.

    step 12/60  reward 0.41  held-out 38.5%@10  staleness 1.3 (max 2) 312 tok/s  engine-0=v12 2m31s
      step 13 waiting 30s: 5 of 16 groups kept; rejected no_signal 9 (all scored 0 8, ...)

A step that re-issued prompts (groups it could not train for a reason outside the policy) or
gave up on one after its retry budget says so, `retried 3` and `skipped 1`, only then.

Read from what the services already publish: the trainer's step log (`trainer/steps.jsonl`),
its progress records (`trainer/progress.jsonl`, relayrl.trainer.progress), the held-out
evaluations (`eval.jsonl`) and weight-sync's GetVersion (the version each replica holds), so
the display shows what the system did, not what `relayrl up` believes it did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.core.records import EvalRecord, RecordFollower, StepRecord, read_records
from relayrl.trainer.progress import ProgressLog, ProgressRecord
from relayrl.up.wiring import progress_log


def replica_versions(
    target: str, run_dir: Path, timeout_s: float = 2.0
) -> dict[str, tuple[int, bool]] | None:
    """replica id -> (version, live) from weight-sync, asked as the run's operator; None when
    it does not answer."""
    import grpc

    from relayrl.core.grpc_client import sync_channel
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
    from relayrl.up.secrets import operator_identity

    try:
        with sync_channel(target, operator_identity(run_dir), []) as channel:
            reply = weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
                pb.GetVersionRequest(), timeout=timeout_s
            )
    except grpc.RpcError:
        return None
    return {r.replica_id: (r.version, r.live) for r in reply.replicas}


class Progress:
    def __init__(
        self, run_dir: Path, supervisor: Any, total_steps: int, say: Callable[[str], None]
    ) -> None:
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.total_steps = total_steps
        self.say = say
        self.steps = RecordFollower(run_dir / "trainer" / "steps.jsonl", StepRecord)
        self.waits = ProgressLog(progress_log(run_dir))
        self.stopped: ProgressRecord | None = None
        """The trainer's `stopped` record: why the run could not progress."""
        self.completed = 0
        self.started = time.monotonic()
        self.names = {url: name for name, url in _engine_names(supervisor).items()}

    def poll(self) -> int:
        """Prints a line per newly logged step, and the trainer's reports while a step waits;
        the number of steps completed."""
        for wait in self.waits.new_records():
            if wait.kind == "stopped":
                self.stopped = wait
            else:
                self.say(f"  {wait.line()}")
        records = self.steps.new_records()
        if not records:
            return self.completed
        versions = replica_versions(self.supervisor.target("weightsync"), self.supervisor.run_dir)
        evals = read_records(self.run_dir / "eval.jsonl", EvalRecord)
        for record in records:
            self.completed = max(self.completed, record.step + 1)
            self.say(self.line(record, versions, evals[-1] if evals else None))
        return self.completed

    def line(
        self,
        record: StepRecord,
        versions: dict[str, tuple[int, bool]] | None,
        last_eval: EvalRecord | None,
    ) -> str:
        width = len(str(self.total_steps))
        parts = [f"step {record.step + 1:>{width}}/{self.total_steps}"]
        if record.reward_mean is not None:
            parts.append(f"reward {record.reward_mean:.2f}")
        if last_eval is not None and last_eval.accuracy is None:
            parts.append(f"held-out FAILED@{last_eval.step}")
        elif last_eval is not None:
            parts.append(f"held-out {last_eval.accuracy:.1%}@{last_eval.step}")
        if record.staleness_mean is not None:
            worst = record.staleness_max or 0.0
            parts.append(f"staleness {record.staleness_mean:.1f} (max {worst:.0f})")
        if record.tokens_per_s is not None:
            parts.append(f"{record.tokens_per_s:.0f} tok/s")
        retried = sum(record.retried.values())
        if retried:
            parts.append(f"retried {retried}")
        if record.skipped:
            parts.append(f"skipped {len(record.skipped)}")
        if versions is None:
            parts.append("weight-sync ?")
        else:
            parts.append(
                " ".join(
                    f"{self.names.get(rid, rid)}=v{v}{'' if live else '(down)'}"
                    for rid, (v, live) in sorted(versions.items())
                )
            )
        parts.append(_duration(time.monotonic() - self.started))
        return "  ".join(parts)


def _engine_names(supervisor: Any) -> dict[str, str]:
    return {
        name: child.url for name, child in supervisor.children.items() if name.startswith("engine-")
    }


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
