"""From scored TransferQueue groups to the padded tensors one training step works on.

A row is one trajectory: prompt + response tokens, with the response mask, the rollout
log-probs (mu) and the reward placed at the response's positions in the full sequence, so that
`logp_BT[b, t]` (the log-prob of token t given tokens < t) lines up with all of them.
Observation tokens (tool output) stay in the row as context with mask 0.

A trajectory with segments (an agent that started a new conversation in its session:
docs/architecture.md#segments) is one sample and several rows: its own fields are one, each
segment another. The group's advantages are computed over samples; every row of a sample
takes the sample's advantage, and the loss counts every row's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq.model import GroupWithTrajectories

# A member counts towards its group's baseline only with one of these reward statuses;
# infrastructure failures (and items the scorer could not read) carry no information about the
# policy and are kept out (docs/algorithms.md#valid-members).
VALID_REWARD_STATUSES = frozenset(
    {common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_POLICY_FAIL}
)


@dataclass
class Row:
    """One trajectory, ready to be padded into a batch."""

    uid: str
    index: int
    input_ids: np.ndarray  # int64 [prompt_len + response_len]
    prompt_len: int
    mask: np.ndarray  # float32 [len(input_ids)], 1 on trained (generated) response tokens
    rollout_logp: np.ndarray  # float32 [len(input_ids)], mu at the masked positions
    reward: float
    valid: bool  # counts in the baseline and is trained on
    staleness: int
    min_policy_version: int
    max_policy_version: int
    truncated: bool = False
    advantage: float = 0.0
    segment: int = 0  # 0: the trajectory's own fields; k: its (k-1)-th segment
    segments: list[Row] = field(default_factory=list)  # the sample's other rows

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def key(self) -> str:
        return f"{self.uid}_{self.index}" + (f"/{self.segment}" if self.segment else "")

    def sample_rows(self) -> list[Row]:
        """Every row of this sample: its own, then its segments'."""
        return [self, *self.segments]


def is_valid(trajectory: common_pb2.Trajectory) -> bool:
    return (
        not trajectory.tags.is_infra
        and trajectory.tags.status == common_pb2.TRAJECTORY_STATUS_SCORED
        and trajectory.reward.status in VALID_REWARD_STATUSES
    )


def row_from_trajectory(
    trajectory: common_pb2.Trajectory, step: int, prompt_step: int, max_seq_len: int
) -> Row:
    """The trajectory's row, with a row per segment in its `segments`."""
    row = _row(trajectory, trajectory, step, prompt_step, max_seq_len)
    for k, segment in enumerate(trajectory.segments, start=1):
        segment_row = _row(trajectory, segment, step, prompt_step, max_seq_len)
        segment_row.segment = k
        row.segments.append(segment_row)
    return row


def _row(
    trajectory: common_pb2.Trajectory,
    tokens: common_pb2.Trajectory | common_pb2.TrajectorySegment,
    step: int,
    prompt_step: int,
    max_seq_len: int,
) -> Row:
    """A row of `tokens` (the trajectory itself, or one of its segments), with the
    trajectory's reward, validity and versions."""
    prompt = np.asarray(tokens.prompt_token_ids, dtype=np.int64)
    response = np.asarray(tokens.response_token_ids, dtype=np.int64)
    valid = is_valid(trajectory)
    response_mask = np.frombuffer(tokens.response_mask, dtype=np.uint8).astype(np.float32)
    logp = np.asarray(tokens.rollout_logprobs, dtype=np.float32)
    if valid and (len(response_mask) != len(response) or len(logp) != len(response)):
        raise ValueError(
            f"trajectory {trajectory.uid}_{trajectory.index}: {len(response)} response tokens "
            f"but {len(response_mask)} mask bytes and {len(logp)} log-probs"
        )
    if not valid:  # failed rollouts may carry partial data: they are never trained on
        response_mask = np.zeros(len(response), dtype=np.float32)
        logp = np.zeros(len(response), dtype=np.float32)
    input_ids = np.concatenate([prompt, response])
    mask = np.concatenate([np.zeros(len(prompt), np.float32), response_mask])
    rollout_logp = np.concatenate([np.zeros(len(prompt), np.float32), logp])
    truncated = len(input_ids) > max_seq_len
    if truncated:
        input_ids, mask, rollout_logp = (
            input_ids[:max_seq_len],
            mask[:max_seq_len],
            rollout_logp[:max_seq_len],
        )
    return Row(
        uid=trajectory.uid,
        index=trajectory.index,
        input_ids=input_ids,
        prompt_len=min(len(prompt), max_seq_len),
        mask=mask,
        rollout_logp=rollout_logp,
        reward=float(trajectory.reward.score) if valid else 0.0,
        valid=valid,
        staleness=step - prompt_step + 1,
        min_policy_version=trajectory.tags.min_policy_version,
        max_policy_version=trajectory.tags.max_policy_version,
        truncated=truncated,
    )


@dataclass
class ScoredGroup:
    uid: str
    prompt_step: int
    rows: list[Row]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rows]

    @property
    def valid(self) -> list[bool]:
        return [r.valid for r in self.rows]

    def train_rows(self) -> list[Row]:
        """Every row the step trains: each sample's own and its segments'."""
        return [row for sample in self.rows for row in sample.sample_rows()]


def scored_groups(
    groups: list[GroupWithTrajectories], step: int, max_seq_len: int
) -> list[ScoredGroup]:
    out = []
    for g in groups:
        prompt_step = g.group.tags.prompt_step
        rows = [
            row_from_trajectory(t, step, prompt_step, max_seq_len)
            for t in sorted(g.trajectories, key=lambda t: t.index)
        ]
        out.append(ScoredGroup(g.group.uid, prompt_step, rows))
    return out


@dataclass
class TensorBatch:
    """Padded tensors for a list of rows (right padding with token 0 and mask 0)."""

    input_ids_BT: torch.Tensor  # int64
    lengths_B: torch.Tensor  # int64
    mask_BT: torch.Tensor  # float32
    rollout_logp_BT: torch.Tensor  # float32
    advantages_B: torch.Tensor  # float32
    keys: list[str] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids_BT.shape[0])

    def select(self, rows: slice | torch.Tensor) -> TensorBatch:
        keys = self.keys[rows] if isinstance(rows, slice) else [self.keys[i] for i in rows]
        return TensorBatch(
            self.input_ids_BT[rows],
            self.lengths_B[rows],
            self.mask_BT[rows],
            self.rollout_logp_BT[rows],
            self.advantages_B[rows],
            keys,
        )


def collate(
    rows: list[Row], num_rows: int | None = None, seq_len: int | None = None
) -> TensorBatch:
    """Pads `rows` into tensors; `num_rows` adds empty rows (length 1, mask 0) so that every
    data-parallel rank gets the same number of micro-batches, `seq_len` pads every rank's
    batch to one length so that their log-probs can be gathered."""
    num_rows = max(num_rows or 0, len(rows))
    max_len = max([len(r.input_ids) for r in rows] + [seq_len or 1])
    input_ids = torch.zeros(num_rows, max_len, dtype=torch.int64)
    lengths = torch.ones(num_rows, dtype=torch.int64)
    mask = torch.zeros(num_rows, max_len, dtype=torch.float32)
    rollout_logp = torch.zeros(num_rows, max_len, dtype=torch.float32)
    advantages = torch.zeros(num_rows, dtype=torch.float32)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[b, :n] = torch.from_numpy(row.input_ids)
        lengths[b] = n
        mask[b, :n] = torch.from_numpy(row.mask)
        rollout_logp[b, :n] = torch.from_numpy(row.rollout_logp)
        advantages[b] = row.advantage
    keys = [r.key for r in rows] + [""] * (num_rows - len(rows))
    return TensorBatch(input_ids, lengths, mask, rollout_logp, advantages, keys)
