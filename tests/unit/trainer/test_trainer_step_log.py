"""The trainer's step log (`metrics_log`, trainer/steps.jsonl): one StepRecord line per step
with the JSON it always had, and a restarted trainer appends after the last whole line."""

from __future__ import annotations

import json
import math
from pathlib import Path

from prometheus_client import CollectorRegistry

from relayrl.core.records import StepRecord, read_records
from relayrl.trainer.metrics import StepMetrics, TrainerMetrics

SKIPPED = {
    "prompt": 9,
    "uid": "run-000000007",
    "retries": 3,
    "cause": "no_valid",
    "reason": "4 of 4 rollouts failed",
}


def metrics(step: int) -> StepMetrics:
    return StepMetrics(
        step=step,
        values={"reward_mean": 0.25, "loss": math.nan, "rollouts": 8.0, "publish_bytes": 10.0},
        staleness=[1, 2, 1],
        policy_lag=[0, 0, 1],
        trained_lengths=[3, 4],
        row_tokens=[10, 12],
        launched_lengths=[3, 4, 5],
        groups={"keep": 3, "stale": 1},
        no_signal={},
        failures={"EngineUnavailable: down": 2},
        generated_tokens={"keep": 12},
        set_aside=[{"prompt": 4, "epoch": 0, "epochs": 1, "reason": "all scored 1"}],
        retried={"no_valid": 2, "stale": 1},
        skipped=[SKIPPED],
        uids=["a", "b", "c"],
    )


def test_a_step_is_logged_with_the_json_it_always_had(tmp_path: Path) -> None:
    log = tmp_path / "trainer" / "steps.jsonl"
    registry = CollectorRegistry()
    trainer = TrainerMetrics(registry, log)
    trainer.observe(metrics(0), {"wait": 0.5, "update": 1.0})
    trainer.close()
    retried = "relayrl_trainer_retried_groups_total"
    assert registry.get_sample_value(retried, {"cause": "no_valid"}) == 2
    skipped = "relayrl_trainer_skipped_prompts_total"
    assert registry.get_sample_value(skipped, {"cause": "no_valid"}) == 1

    (line,) = log.read_text().splitlines()
    record = json.loads(line)
    assert record.pop("time") > 0
    assert record == {
        "step": 0,
        "reward_mean": 0.25,  # the NaN loss is left out
        "rollouts": 8.0,
        "publish_bytes": 10.0,
        "staleness_histogram": {"1": 2, "2": 1},
        "policy_lag_histogram": {"0": 2, "1": 1},
        "groups": {"keep": 3, "stale": 1},
        "no_signal": {},
        "failures": {"EngineUnavailable: down": 2},
        "generated_tokens": {"keep": 12},
        "set_aside": [{"prompt": 4, "epoch": 0, "epochs": 1, "reason": "all scored 1"}],
        "retried": {"no_valid": 2, "stale": 1},
        "skipped": [SKIPPED],
        "uids": ["a", "b", "c"],
        "row_tokens": [10, 12],
        "phases_s": {"wait": 0.5, "update": 1.0},
    }
    assert list(json.loads(line)) == sorted(json.loads(line))  # sorted keys, as before
    (read,) = read_records(log, StepRecord)
    assert read == metrics(0).record({"wait": 0.5, "update": 1.0}, read.time)


def test_a_restarted_trainer_appends_after_the_last_whole_line(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    first = TrainerMetrics(CollectorRegistry(), log)
    first.observe(metrics(0), {})
    first.close()
    with log.open("a") as f:
        f.write('{"step": 1, "reward_mean": 0.')  # killed in the middle of step 1's line
    second = TrainerMetrics(CollectorRegistry(), log)
    second.observe(metrics(1), {})
    second.close()
    assert [r.step for r in read_records(log, StepRecord)] == [0, 1]
