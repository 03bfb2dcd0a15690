"""From stored trajectories to rows and padded tensors: the response mask, mu and the reward
line up with the log-prob of the token they belong to; failed members are never trained."""

from __future__ import annotations

import numpy as np
import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.trainer.batch import collate, row_from_trajectory
from relayrl.trainer.step import DataParallel, _mini_batches


def stored(*, infra: bool = False, status=common_pb2.REWARD_STATUS_OK) -> common_pb2.Trajectory:
    t = common_pb2.Trajectory(
        uid="g",
        index=1,
        prompt_token_ids=[1, 5, 6],
        response_token_ids=[7, 8, 9, 2],
        response_mask=bytes([1, 0, 1, 1]),  # token 8 is a tool observation
        rollout_logprobs=[-0.5, 0.0, -1.5, -0.25],
    )
    t.tags.status = common_pb2.TRAJECTORY_STATUS_SCORED
    t.tags.is_infra = infra
    t.reward.status = status
    t.reward.score = 1.0
    return t


def test_rows_place_mask_and_mu_at_the_response_positions() -> None:
    row = row_from_trajectory(stored(), step=5, prompt_step=3, max_seq_len=64)
    assert row.input_ids.tolist() == [1, 5, 6, 7, 8, 9, 2]
    assert row.mask.tolist() == [0, 0, 0, 1, 0, 1, 1]
    assert row.rollout_logp.tolist() == [0, 0, 0, -0.5, 0, -1.5, -0.25]
    assert row.valid and row.reward == 1.0 and row.staleness == 3 and row.key == "g_1"


@pytest.mark.parametrize(
    "trajectory",
    [stored(infra=True), stored(status=common_pb2.REWARD_STATUS_TIMEOUT)],
    ids=["infra", "reward-timeout"],
)
def test_failed_members_are_context_only(trajectory: common_pb2.Trajectory) -> None:
    row = row_from_trajectory(trajectory, step=0, prompt_step=0, max_seq_len=64)
    assert not row.valid and not row.mask.any() and row.reward == 0.0


def test_policy_fail_is_a_valid_member() -> None:
    row = row_from_trajectory(
        stored(status=common_pb2.REWARD_STATUS_POLICY_FAIL), step=0, prompt_step=0, max_seq_len=64
    )
    assert row.valid


def test_truncation_cuts_the_mask_too() -> None:
    row = row_from_trajectory(stored(), step=0, prompt_step=0, max_seq_len=5)
    assert row.truncated and len(row.input_ids) == 5 and row.mask.tolist() == [0, 0, 0, 1, 0]


def test_inconsistent_trajectory_is_refused() -> None:
    t = stored()
    del t.rollout_logprobs[-1]
    with pytest.raises(ValueError, match="4 response tokens but 4 mask bytes and 3 log-probs"):
        row_from_trajectory(t, step=0, prompt_step=0, max_seq_len=64)


def test_collate_pads_rows_and_adds_empty_ones() -> None:
    a = row_from_trajectory(stored(), step=0, prompt_step=0, max_seq_len=64)
    b = row_from_trajectory(stored(), step=0, prompt_step=0, max_seq_len=4)
    a.advantage, b.advantage = 0.5, -0.5
    batch = collate([a, b], num_rows=4)
    assert batch.input_ids_BT.shape == (4, 7)
    assert batch.lengths_B.tolist() == [7, 4, 1, 1]
    assert batch.mask_BT[2:].sum() == 0 and batch.keys == ["g_1", "g_1", "", ""]
    np.testing.assert_array_equal(batch.advantages_B.numpy(), [0.5, -0.5, 0, 0])


def test_data_parallel_shards_are_strided_and_equal_sized() -> None:
    rows, per_rank = DataParallel(rank=1, size=2).shard(num_rows=7, micro_batch_size=2)
    assert rows == [1, 3, 5] and per_rank == 4  # padded to whole micro-batches
    assert DataParallel().shard(num_rows=0, micro_batch_size=2) == ([], 2)


def test_mini_batches_never_split_a_group() -> None:
    groups = [[0, 1], [2, 3, 4], [5], [6, 7]]
    assert _mini_batches(groups, 2) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert _mini_batches(groups, 1) == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_a_trajectorys_segments_are_rows_of_the_same_sample() -> None:
    from relayrl.trainer.batch import ScoredGroup
    from relayrl.trainer.config import AlgorithmConfig
    from relayrl.trainer.step import assign_advantages

    def sample(index: int, reward: float, segments: int) -> common_pb2.Trajectory:
        t = stored()
        t.index, t.reward.score = index, reward
        for k in range(segments):
            t.segments.add(
                prompt_token_ids=[1, 40 + k],
                response_token_ids=[50 + k, 2],
                response_mask=bytes([1, 1]),
                rollout_logprobs=[-0.1, -0.2],
            )
        return t

    rows = [
        row_from_trajectory(sample(0, 1.0, 2), 5, 3, 64),
        row_from_trajectory(sample(1, 0.0, 0), 5, 3, 64),
    ]
    first = rows[0]
    assert [r.key for r in first.sample_rows()] == ["g_0", "g_0/1", "g_0/2"]
    assert first.segments[1].input_ids.tolist() == [1, 41, 51, 2]
    assert first.segments[1].mask.tolist() == [0, 0, 1, 1]
    assert all(r.reward == 1.0 and r.valid and r.staleness == 3 for r in first.segments)
    group = ScoredGroup("g", 3, rows)
    assert group.rewards == [1.0, 0.0]  # the group counts samples, not segments
    assert len(group.train_rows()) == 4
    assign_advantages([group], AlgorithmConfig())
    assert {r.advantage for r in first.sample_rows()} == {first.advantage} and first.advantage > 0
    # a failed sample's segments are context only, like the sample
    failed = stored(infra=True)
    failed.segments.add(prompt_token_ids=[1], response_token_ids=[5], response_mask=b"\x01")
    (segment,) = row_from_trajectory(failed, 0, 0, 64).segments
    assert not segment.valid and not segment.mask.any()
