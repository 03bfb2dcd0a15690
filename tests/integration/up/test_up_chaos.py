"""Chaos on the main job, in the suite: `make bench-chaos`'s fixed schedule (bench/chaos_bench.py)
kills every part of one `relayrl up` run while it trains -- the trainer before its first
checkpoint, redis-server, the engine mid-generation, weight-sync mid-transfer, the trainer
after a checkpoint, the gateway and the reward-service together -- and the run completes with
nothing lost, nothing trained twice and no span sampled by weights that were not committed
(`relayrl audit`). The numbers of the bench are not checked here (no timed assertions); what
it claims to have done is."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.core.records import EvalRecord, read_records
from relayrl.proto.common.v1 import common_pb2
from relayrl.up.audit import audit_run
from relayrl_testkit.helpers.up import (
    audit_queue,
    check_exactly_once,
    processes_of,
    sharing_cache,
)

REPO = Path(__file__).parents[3]
LAST_LINE = re.compile(
    r"^chaos-bench: kills=(\d+) runs_completed=(\d+)/(\d+) lost=(\d+) trained_twice=(\d+) "
    r"stale_served=(\d+) prompts_skipped=(\d+) max_recovery_s=(\d+\.\d)$"
)
STEPS = 14

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
def test_every_part_killed_during_a_run_loses_nothing_and_serves_nothing_stale(
    tmp_path: Path, up_cache: Path
) -> None:
    # the bench's runs folder, with the session's cache: the model and warm start built once
    sharing_cache(tmp_path / "fixed", up_cache)
    argv = [sys.executable, str(REPO / "bench" / "chaos_bench.py"), "--rounds", "0",
            "--steps", str(STEPS), "--keep", str(tmp_path)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1700, cwd=REPO)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    match = LAST_LINE.match(result.stdout.strip().splitlines()[-1])
    assert match, out[-3000:]
    counts = tuple(int(g) for g in match.groups()[:7])
    # kills, runs_completed/runs, lost, trained_twice, stale_served, prompts_skipped
    assert counts == (6, 1, 1, 0, 0, 0, 0), out[-3000:]

    (record,) = json.loads((tmp_path / "chaos.json").read_text())
    moments = {k["part"]: k["moment"] for k in record["kills"]}
    assert moments["trainer_early"] == "before its first checkpoint"
    assert moments["trainer"].startswith("after the checkpoint of step")
    # the moments that hurt most were really hit (a miss would say so in its moment)
    assert moments["engine"] == "mid-generation", moments
    assert moments["weightsync"] == "mid-transfer", moments
    assert record["audit"]["num_spans"] > 0
    # every issue of a prompt was trained, judged without signal, skipped by name after its
    # retry budget, or is still in play (the engine kill's failed groups were re-issued)
    assert record["audit"]["prompts_lost"] == [], record["audit"]["summary"]

    (run_dir,) = (tmp_path / "fixed").glob("r-*")
    events = [json.loads(x) for x in (run_dir / "logs/supervisor.jsonl").read_text().splitlines()]
    restarted = sorted(e["child"] for e in events if e["kind"] == "restarted")
    assert restarted == sorted(
        ["trainer", "redis", "engine-0", "weightsync", "trainer", "gateway", "reward"]
    ), events
    # the queue, read independently of `relayrl audit`: every trained group consumed at its
    # step, every trained trajectory scored through the reward-service
    audit = audit_queue(run_dir)
    check_exactly_once(run_dir, audit)
    scored = common_pb2.TRAJECTORY_STATUS_SCORED
    for uid in audit.consumed_at():
        group = audit.groups[uid]
        valid = [t for t in group.trajectories if not t.tags.is_infra]
        assert all(t.tags.status == scored for t in valid), uid
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    # without a checkpoint it republished the initial weights; after one, the checkpoint's
    assert "republished version 0 (the initial weights" in trainer_log
    assert "(the checkpoint's weights" in trainer_log
    # the restarted engine was loaded with the committed version before it served again
    assert "late joiner engine-0 reached version" in (run_dir / "logs/weightsync.log").read_text()
    committed = [
        json.loads(x)
        for x in (run_dir / "weightsync/transfers.jsonl").read_text().splitlines()
        if json.loads(x)["state"] == "committed"
    ]
    assert committed[-1]["version"] == STEPS
    assert processes_of(run_dir) == []

    # and the audit is not blind: the same run with its records doctored fails it
    doctored = tmp_path / "doctored"
    shutil.copytree(run_dir, doctored)
    steps_log = doctored / "trainer" / "steps.jsonl"
    records = [json.loads(x) for x in steps_log.read_text().splitlines() if x.strip()]
    last = {r["step"]: r for r in records}
    twice = last[0]["uids"][0]
    extra = dict(last[STEPS - 1], uids=[*last[STEPS - 1]["uids"], twice])  # trained again
    dropped = last[1]["uids"][0]
    untrained = dict(last[1], uids=last[1]["uids"][1:])  # consumed, usable, never trained
    steps_log.write_text("".join(json.dumps(r) + "\n" for r in [*records, untrained, extra]))
    # a version engines really served, as if it had never committed
    served = {int(v): n for v, n in record["audit"]["spans_by_version"].items()}
    gone = max(served, key=lambda v: (v > 0, served[v]))
    assert gone > 0, served
    transfers = doctored / "weightsync" / "transfers.jsonl"
    kept = [x for x in transfers.read_text().splitlines() if json.loads(x)["version"] != gone]
    transfers.write_text("".join(x + "\n" for x in kept))
    report = audit_run(doctored)
    assert any(
        line.startswith(f"{twice}: trained at steps 0 and {STEPS - 1}")
        for line in report.trained_twice
    )
    assert any(line.startswith(f"{dropped}: consumed at step 1") for line in report.lost)
    # every span sampled by that version is now stale, and so is every held-out evaluation that
    # ran on it (at its start or its end)
    on_gone = sum(
        1
        for e in read_records(doctored / "eval.jsonl", EvalRecord)
        for version in (e.version, e.version_end)
        if version == gone
    )
    assert len(report.stale_served) == served[gone] + on_gone, report.stale_served
    spans = [line for line in report.stale_served if not line.startswith("held-out evaluation")]
    assert len(spans) == served[gone], report.stale_served
    assert all(f" version {gone}, " in line for line in report.stale_served)
