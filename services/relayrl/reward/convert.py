"""Protobuf <-> domain objects, at the gRPC edge only."""

from __future__ import annotations

from relayrl.core import env_reward
from relayrl.proto.common.v1 import common_pb2
from relayrl.reward.items import InvalidItem, RewardItem, RewardResult, Status


def reported_reward(
    item_id: str, message: common_pb2.RewardItem | common_pb2.Trajectory
) -> env_reward.EnvReward | None:
    """The environment reward a reward item or a trajectory carries in its `env_reward` field;
    None when unset. InvalidItem when it is malformed: such an item is refused, never scored."""
    if not message.HasField("env_reward"):
        return None
    try:
        return env_reward.from_proto(message.env_reward)
    except ValueError as exc:
        raise InvalidItem(f"item {item_id!r}: malformed environment reward: {exc}") from None


def item_from_proto(message: common_pb2.RewardItem) -> RewardItem:
    """InvalidItem when its environment reward is malformed."""
    return RewardItem(
        item_id=message.item_id,
        data_source=message.data_source,
        prompt=message.prompt,
        response=message.response,
        ground_truth=message.ground_truth,
        response_token_ids=tuple(message.response_token_ids),
        response_mask=bytes(message.response_mask),
        group_id=message.group_id,
        extra=dict(message.extra),
        env_reward=reported_reward(message.item_id, message),
    )


def item_to_proto(item: RewardItem) -> common_pb2.RewardItem:
    return common_pb2.RewardItem(
        item_id=item.item_id,
        data_source=item.data_source,
        prompt=item.prompt,
        response=item.response,
        ground_truth=item.ground_truth,
        response_token_ids=list(item.response_token_ids),
        response_mask=item.response_mask,
        group_id=item.group_id,
        extra=dict(item.extra),
        env_reward=item.env_reward.to_proto() if item.env_reward is not None else None,
    )


def result_to_proto(result: RewardResult) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(
        item_id=result.item_id,
        status=int(result.status),
        score=result.score if result.status.is_reward else 0.0,
        components=dict(result.components),
        message=result.message,
        token_level_scores=list(result.token_level_scores),
        manager=result.manager,
        latency_s=result.latency_s,
        attempts=result.attempts,
    )


def result_from_proto(message: common_pb2.RewardResult) -> RewardResult:
    return RewardResult(
        item_id=message.item_id,
        status=Status(message.status),
        score=message.score,
        components=dict(message.components),
        message=message.message,
        manager=message.manager,
        latency_s=message.latency_s,
        attempts=message.attempts,
        token_level_scores=tuple(message.token_level_scores),
    )
