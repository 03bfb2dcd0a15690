"""Reward timing (t_collect, overlap ratio) read back from a real TransferQueue's event stream:
trajectories are put and scored with known sleeps in between, and the computed numbers match
the times the test saw around each call (Redis stamps events with the same clock)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.core.records import RecordError
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TrajectoryPut, TransferQueue
from relayrl.up.timing import (
    REWARD_TIMING_FILE,
    RewardTiming,
    collect_reward_timing,
    read_reward_timing,
    reward_timing,
    step_timing,
    write_reward_timing,
)

P = "train"
# Event times have ms resolution; the window the test measures around a call is widened by this.
SLACK_S = 0.002


def group(uid: str, n: int = 2) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(uid=uid, num_samples=n, prompt_step=0, prompt_token_ids=[1, 2])


def trajectory(uid: str, index: int) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2],
        response_token_ids=[7, 8],
        response_mask=b"\x01\x01",
        rollout_logprobs=[-0.5, -0.25],
        spans=[common_pb2.GenerationSpan(start=0, end=2, policy_version=0)],
    )


class Clock:
    """Times the test's TransferQueue calls: the (before, after) wall-clock window of each."""

    def __init__(self) -> None:
        self.windows: dict[str, tuple[float, float]] = {}

    def __call__(self, name: str, call: Callable[[], object]) -> None:
        before = time.time()
        call()
        self.windows[name] = (before - SLACK_S, time.time() + SLACK_S)

    def between(self, start: str, end: str) -> tuple[float, float]:
        """Bounds of (time of `end`'s event - time of `start`'s event)."""
        return (
            self.windows[end][0] - self.windows[start][1],
            self.windows[end][1] - self.windows[start][0],
        )


def put(tq: TransferQueue, claims: dict[str, str], *keys: str, failed: bool = False) -> None:
    puts = []
    for key in keys:
        uid, _, index = key.rpartition("_")
        puts.append(TrajectoryPut(trajectory(uid, int(index)), claims[uid], failed=failed))
    tq.put_trajectories(P, puts)


def score(tq: TransferQueue, *keys: str) -> None:
    ok = common_pb2.RewardResult(status=common_pb2.REWARD_STATUS_OK, score=1.0)
    tq.score_trajectories(P, dict.fromkeys(keys, ok))


@pytest.fixture
def timed_run(tq: TransferQueue) -> Clock:
    """Step 0 trains groups a and b (reward overlaps rollout, then runs 0.3 s past it); step 1
    trains c (one trajectory failed, the other scored 0.2 s after its put); step 2 trains d,
    whose failed trajectory ends rollout after its other one was scored. Group z is in the
    stream but trained by no step; `ab` shares a prefix with a."""
    tq.put_groups(P, [group(u) for u in ("a", "b", "c", "d", "z", "ab")])
    claimed = tq.claim_groups(P, max_groups=10, claimer="test", lease_s=600).claimed
    claims = {c.group.uid: c.claim_id for c in claimed}
    clock = Clock()
    clock("a_0 put", lambda: put(tq, claims, "a_0"))
    time.sleep(0.2)
    clock("a_0 scored", lambda: score(tq, "a_0"))
    clock("a_1 b_0 put", lambda: put(tq, claims, "a_1", "b_0"))
    time.sleep(0.2)
    clock("b_1 put", lambda: put(tq, claims, "b_1"))
    put(tq, claims, "z_0", "z_1", "ab_0", "ab_1")  # other groups' events, interleaved
    time.sleep(0.3)
    clock("a b scored", lambda: score(tq, "a_1", "b_0", "b_1"))
    score(tq, "z_0", "z_1", "ab_0", "ab_1")

    clock("c_0 failed", lambda: put(tq, claims, "c_0", failed=True))
    time.sleep(0.2)
    clock("c_1 put", lambda: put(tq, claims, "c_1"))
    time.sleep(0.2)
    clock("c_1 scored", lambda: score(tq, "c_1"))

    clock("d_0 put", lambda: put(tq, claims, "d_0"))
    time.sleep(0.1)
    clock("d_0 scored", lambda: score(tq, "d_0"))
    time.sleep(0.1)
    clock("d_1 failed", lambda: put(tq, claims, "d_1", failed=True))
    return clock


STEPS = [(0, ["a", "b"]), (1, ["c"]), (2, ["d"]), (3, ["ghost"]), (4, [])]


def assert_within(value: float | None, bounds: tuple[float, float]) -> None:
    assert value is not None
    assert bounds[0] <= value <= bounds[1], (value, bounds)


def test_t_collect_and_overlap_match_the_measured_transitions(
    tq: TransferQueue, timed_run: Clock
) -> None:
    clock = timed_run
    step0, step1, step2, ghost, empty = reward_timing(tq, P, STEPS)

    # step 0: rollout from a_0's put to b_1's; reward ends with the last score 0.3 s later.
    assert (step0.num_groups, step0.num_trajectories, step0.num_scored) == (2, 4, 4)
    assert (step0.num_failed, step0.num_groups_without_events) == (0, 0)
    assert_within(step0.first_finished_time, clock.windows["a_0 put"])
    assert_within(step0.last_finished_time, clock.windows["b_1 put"])
    assert_within(step0.last_scored_time, clock.windows["a b scored"])
    assert_within(step0.t_collect_s, clock.between("b_1 put", "a b scored"))
    assert step0.t_collect_s == pytest.approx(0.3, abs=0.15)
    span = step0.last_scored_time - step0.first_finished_time
    assert_within(span, clock.between("a_0 put", "a b scored"))
    assert step0.overlap_ratio == pytest.approx(1 - step0.t_collect_s / span)
    assert step0.overlap_ratio == pytest.approx(1 - 0.3 / 0.7, abs=0.12)

    # step 1: the failed trajectory starts the rollout window and is never scored.
    assert (step1.num_trajectories, step1.num_failed, step1.num_scored) == (2, 1, 1)
    assert_within(step1.first_finished_time, clock.windows["c_0 failed"])
    assert_within(step1.last_finished_time, clock.windows["c_1 put"])
    assert_within(step1.t_collect_s, clock.between("c_1 put", "c_1 scored"))
    assert step1.overlap_ratio == pytest.approx(0.5, abs=0.15)

    # step 2: the last rollout event (a failure) comes after the last score: nothing to wait on.
    assert (step2.num_trajectories, step2.num_failed, step2.num_scored) == (2, 1, 1)
    assert_within(step2.last_finished_time, clock.windows["d_1 failed"])
    assert step2.t_collect_s == 0.0
    assert step2.overlap_ratio == 1.0

    # a group without events, and a step without groups: counted, no numbers.
    assert (ghost.num_groups, ghost.num_groups_without_events, ghost.num_trajectories) == (1, 1, 0)
    assert empty.num_groups == 0
    for timing in (ghost, empty):
        assert timing.first_finished_time is None and timing.last_scored_time is None
        assert timing.t_collect_s is None and timing.overlap_ratio is None


def test_paged_reads_give_the_same_result(tq: TransferQueue, timed_run: Clock) -> None:
    whole = reward_timing(tq, P, STEPS)
    num_events = len(tq.read_events(P, count=100_000))
    assert num_events > 20  # the pages below really split the stream
    assert reward_timing(tq, P, STEPS, page_size=3) == whole
    assert reward_timing(tq, P, STEPS, page_size=num_events) == whole


def test_an_empty_stream_gives_steps_without_numbers(tq: TransferQueue) -> None:
    (timing,) = reward_timing(tq, "val", [(0, ["a"])])
    assert timing.num_groups_without_events == 1 and timing.t_collect_s is None


def test_written_timing_reads_back_and_only_a_torn_last_line_is_left_out(
    tq: TransferQueue, timed_run: Clock, tmp_path: Path
) -> None:
    (tmp_path / "trainer").mkdir()
    steps_log = tmp_path / "trainer" / "steps.jsonl"
    steps_log.write_text(
        "".join(
            json.dumps({"step": s, "uids": u, "reward_mean": 0.5, "time": 0.0}) + "\n"
            for s, u in STEPS
        )
    )
    path = collect_reward_timing(tq, P, tmp_path)
    assert path == tmp_path / REWARD_TIMING_FILE
    timings = read_reward_timing(tmp_path)
    assert timings == reward_timing(tq, P, STEPS)

    with path.open("a") as f:
        f.write('{"step": 9, "t_collect_s": 0.1')  # torn last line
    assert read_reward_timing(tmp_path) == timings
    with path.open("a") as f:
        f.write('\n{"t_collect_s": 0.1}\n')  # no longer the last line; and one without a step
    with pytest.raises(RecordError, match=rf"{REWARD_TIMING_FILE}:{len(timings) + 1}: not JSON"):
        read_reward_timing(tmp_path)


def test_span_of_zero_is_full_overlap() -> None:
    timing = step_timing(5, ["u"], {"u": {"u_0": (100.0, False)}}, {"u": {"u_0": 100.0}})
    assert (timing.t_collect_s, timing.overlap_ratio) == (0.0, 1.0)
    every_failed = step_timing(6, ["u"], {"u": {"u_0": (100.0, True)}}, {})
    assert every_failed.num_failed == 1 and every_failed.t_collect_s is None


def test_record_round_trip(tmp_path: Path) -> None:
    timing = step_timing(
        1, ["u", "v"], {"u": {"u_0": (10.0, False), "u_1": (10.5, False)}}, {"u": {"u_0": 11.0}}
    )
    write_reward_timing(tmp_path, [timing])
    assert read_reward_timing(tmp_path) == [timing]
    assert RewardTiming.model_validate_json(timing.to_line()) == timing
    assert timing.t_collect_s == pytest.approx(0.5)
    assert timing.overlap_ratio == pytest.approx(1 - 0.5 / 1.0)
