"""Wrapper and composite managers (rate_limited, dapo, gdpo), user plug-ins by dotted path
(their contract is pinned here), the manager table, quotas and token buckets."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from relayrl.core.dotted import import_object
from relayrl.reward.config import RewardConfig
from relayrl.reward.items import InfraError, RewardItem, Status, Verdict, token_level_scores
from relayrl.reward.limits import TokenBucket
from relayrl.reward.managers.base import Outcome, RewardManager, call_batch
from relayrl.reward.managers.custom import CustomConfig
from relayrl.reward.managers.table import build_managers
from relayrl.reward.metrics import RewardMetrics
from relayrl.reward.tenants import QuotaExceeded, Tenants

# A user's plug-ins, installed as a package and named by dotted path.
EXAMPLE = "relayrl_testkit.helpers.reward_plugin_example"


class Fixed(RewardManager):
    """Scores from a table item_id -> score (or error)."""

    def __init__(self, name: str, table: dict[str, float | Exception]) -> None:
        super().__init__(name)
        self.table = table
        self.num_calls = 0

    async def score(self, item: RewardItem) -> Verdict:
        self.num_calls += 1
        value = self.table[item.item_id]
        if isinstance(value, Exception):
            raise value
        return Verdict(value)


def build(managers: dict, extra: dict[str, RewardManager] | None = None) -> dict:
    config = RewardConfig.model_validate(
        {"managers": managers, "default_manager": next(iter(managers))}
    )
    return build_managers(config.managers, CollectorRegistry())


# --- dapo ------------------------------------------------------------------------------------


def test_dapo_penalises_only_the_overlong_tail_linearly() -> None:
    managers = build(
        {
            "base": {"type": "custom", "path": f"{EXAMPLE}:length_score"},
            "dapo": {
                "type": "dapo",
                "inner": "base",
                "max_response_length": 10,
                "overlong_buffer_length": 4,
            },
        }
    )
    dapo = managers["dapo"]

    def item(num_tokens: int) -> RewardItem:
        return RewardItem(f"n{num_tokens}", response="ab", response_token_ids=(1,) * num_tokens)

    outcomes = asyncio.run(call_batch(dapo, [item(6), item(8), item(10), item(20)]))
    assert [o.score for o in outcomes] == pytest.approx([2.0, 1.5, 1.0, 1.0])
    assert outcomes[1].components == {"base": 2.0, "overlong_penalty": -0.5}
    with pytest.raises(Exception, match="needs response_token_ids"):
        dapo.validate(RewardItem("x", response="ab"))


def test_dapo_config_checks_the_buffer_fits() -> None:
    with pytest.raises(ValidationError, match="must not exceed max_response_length"):
        build(
            {
                "b": {"type": "naive"},
                "d": {
                    "type": "dapo",
                    "inner": "b",
                    "max_response_length": 4,
                    "overlong_buffer_length": 8,
                },
            }
        )


# --- rate_limited ----------------------------------------------------------------------------


def test_rate_limited_refuses_beyond_its_budget_with_a_retry_hint() -> None:
    managers = build(
        {
            "base": {"type": "custom", "path": f"{EXAMPLE}:length_score"},
            "limited": {
                "type": "rate_limited",
                "inner": "base",
                "requests_per_minute": 2,
                "max_wait_s": 0.05,
            },
        }
    )
    items = [RewardItem(f"i{k}", response="abc") for k in range(3)]
    outcomes = asyncio.run(call_batch(managers["limited"], items))
    statuses = sorted(o.status.name for o in outcomes)
    assert statuses == ["OK", "OK", "RATE_LIMITED"]
    refused = next(o for o in outcomes if o.status is Status.RATE_LIMITED)
    assert "retry in" in refused.message and refused.retry_after_s > 20


def test_rate_limited_waits_when_the_budget_refills_in_time() -> None:
    managers = build(
        {
            "base": {"type": "custom", "path": f"{EXAMPLE}:length_score"},
            "limited": {
                "type": "rate_limited",
                "inner": "base",
                "requests_per_minute": 600,  # one every 0.1 s once the burst is spent
                "max_wait_s": 5,
            },
        }
    )
    limited = managers["limited"]
    limited._requests._level = 0.0  # the burst is spent

    async def main() -> list[Outcome]:
        return await call_batch(limited, [RewardItem("a", response="x")])

    (outcome,) = asyncio.run(main())
    assert outcome.status is Status.OK


def test_rate_limited_timeout_is_timeout_not_zero() -> None:
    class Slow(RewardManager):
        async def score(self, item: RewardItem) -> Verdict:
            await asyncio.sleep(5)
            return Verdict(1.0)

    from relayrl.reward.managers.wrappers import RateLimitedConfig, RateLimitedManager

    config = RateLimitedConfig(
        type="rate_limited", inner="slow", requests_per_minute=100, call_timeout_s=0.05
    )
    manager = RateLimitedManager("limited", Slow("slow"), config)
    (outcome,) = asyncio.run(call_batch(manager, [RewardItem("a")]))
    assert outcome.status is Status.TIMEOUT


# --- gdpo ------------------------------------------------------------------------------------


def test_gdpo_normalises_each_component_within_its_group_and_skips_failures() -> None:
    from relayrl.reward.managers.gdpo import GdpoConfig, GdpoManager

    correct = Fixed("correct", {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "x": 5.0, "y": 5.0})
    length = Fixed(
        "length",
        {"a": 100.0, "b": 300.0, "c": 200.0, "d": InfraError("down"), "x": 1.0, "y": 3.0},
    )
    config = GdpoConfig(
        type="gdpo",
        components={
            "correct": {"manager": "correct"},
            "length": {"manager": "length", "weight": 0.5},
        },
    )
    gdpo = GdpoManager("g", {"correct": (correct, 1.0), "length": (length, 0.5)}, config)
    items = [RewardItem(k, group_id="g1") for k in "abcd"] + [
        RewardItem(k, group_id="g2") for k in "xy"
    ]
    outcomes = asyncio.run(call_batch(gdpo, items))
    a, b, _, d, x, y = outcomes
    assert d.status is Status.INFRA_ERROR  # kept out of g1's baseline
    # correct over {a,b,c} = [1,0,1]: mean 2/3, std 0.4714
    assert a.components["correct/normalized"] == pytest.approx(0.7071, abs=1e-3)
    assert b.components["correct/normalized"] == pytest.approx(-1.4142, abs=1e-3)
    assert a.components["length/normalized"] == pytest.approx(-1.2247, abs=1e-3)
    assert a.score == pytest.approx(0.7071 - 0.5 * 1.2247, abs=1e-3)
    assert x.components["correct/normalized"] == 0.0  # zero std: no signal
    assert x.components["length"] == 1.0 and y.components["length/normalized"] > 0


# --- custom plug-ins -------------------------------------------------------------------------


def test_plugin_contract_is_pinned() -> None:
    """User managers written against this contract must keep working; changing any of these
    signatures is a breaking change for every team's plug-in."""
    assert list(inspect.signature(RewardManager.__init__).parameters) == [
        "self",
        "name",
        "max_concurrent",
    ]
    assert list(inspect.signature(RewardManager.score).parameters) == ["self", "item"]
    assert list(inspect.signature(RewardManager.score_batch).parameters) == ["self", "items"]
    assert list(inspect.signature(RewardManager.validate).parameters) == ["self", "item"]
    assert inspect.iscoroutinefunction(RewardManager.score)
    assert inspect.iscoroutinefunction(RewardManager.score_batch)
    assert inspect.iscoroutinefunction(RewardManager.close)
    fields = [f for f in RewardItem.__dataclass_fields__]
    # fields are only ever appended, with a default: a plug-in's positional RewardItem(...)
    # keeps its meaning
    assert fields == [
        "item_id", "data_source", "prompt", "response", "ground_truth",
        "response_token_ids", "response_mask", "group_id", "extra", "env_reward",
    ]  # fmt: skip
    assert RewardItem.__dataclass_fields__["env_reward"].default is None
    assert list(Verdict.__dataclass_fields__) == ["score", "status", "components", "message"]


def test_custom_managers_and_functions_load_by_dotted_path() -> None:
    managers = build(
        {
            "kw": {
                "type": "custom",
                "path": f"{EXAMPLE}:KeywordManager",
                "options": {"keyword": "ok"},
            },
            "fn": {"type": "custom", "path": f"{EXAMPLE}:length_score"},
            "afn": {"type": "custom", "path": f"{EXAMPLE}:async_verdict"},
            "bad": {"type": "custom", "path": f"{EXAMPLE}:returns_garbage"},
        }
    )
    item = RewardItem("i", response="ok ok", ground_truth="ok ok")
    assert asyncio.run(managers["kw"].score(item)).score == 2.0
    assert asyncio.run(managers["fn"].score(item)).score == 5.0
    assert asyncio.run(managers["afn"].score(item)).score == 1.0
    (garbage,) = asyncio.run(call_batch(managers["bad"], [item]))
    assert garbage.status is Status.INFRA_ERROR and "return a Verdict or a float" in garbage.message


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module"),
        (f"{EXAMPLE}:missing", "has no attribute"),
        (f"{EXAMPLE}:NOT_CALLABLE", "neither a RewardManager subclass nor a function"),
        ("collections:OrderedDict", "not a relayrl RewardManager subclass"),
    ],
)
def test_bad_plugin_paths_fail_at_startup_with_a_reason(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build({"x": {"type": "custom", "path": path}})


def test_dotted_path_syntax_is_checked_by_the_config() -> None:
    with pytest.raises(ValidationError, match="path"):
        CustomConfig(type="custom", path="os.system('x')")
    assert import_object("os.path:join") is not None


def test_manager_without_score_is_refused() -> None:
    class Empty(RewardManager):
        pass

    with pytest.raises(TypeError, match="must override score"):
        Empty("empty")


# --- config references -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"managers": {"a": {"type": "dapo", "inner": "zz", "max_response_length": 4,
                             "overlong_buffer_length": 2}}, "default_manager": "a"},
         "wraps 'zz', which is not configured"),
        ({"managers": {
            "a": {"type": "rate_limited", "inner": "b", "requests_per_minute": 1},
            "b": {"type": "rate_limited", "inner": "a", "requests_per_minute": 1}},
          "default_manager": "a"}, "cycle: a -> b -> a"),
        ({"default_manager": "nope"}, "default_manager names manager 'nope'"),
        ({"tenants": {"t": {"managers": ["judge"]}}}, "tenants.t.managers names manager 'judge'"),
        ({"managers": {"bad name!": {"type": "naive"}}, "default_manager": "bad name!"},
         "manager name"),
    ],
)  # fmt: skip
def test_config_references_are_checked(config: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RewardConfig.model_validate(config)


# --- quotas ----------------------------------------------------------------------------------


def test_token_bucket_refills_continuously() -> None:
    now = [0.0]
    bucket = TokenBucket(60, 60.0, clock=lambda: now[0])
    assert bucket.try_spend(60) == 0.0
    assert bucket.try_spend(1) == pytest.approx(1.0)
    now[0] = 0.5
    assert bucket.try_spend(1) == pytest.approx(0.5)
    now[0] = 1.0
    assert bucket.try_spend(1) == 0.0
    assert bucket.wait_s(61) == float("inf")


def test_tenant_quotas_refuse_with_a_retry_hint_and_take_nothing() -> None:
    config = RewardConfig.model_validate(
        {"tenants": {"team-a": {"requests_per_minute": 2, "tokens_per_minute": 100}}}
    )
    tenants = Tenants(config, RewardMetrics(CollectorRegistry()))

    async def charges() -> None:
        await tenants.charge("team-a", 10)
        await tenants.charge("team-a", 10)
        with pytest.raises(QuotaExceeded, match="over its requests_per_minute quota") as exc:
            await tenants.charge("team-a", 10)
        assert 20 < exc.value.retry_after_s <= 30
        with pytest.raises(QuotaExceeded, match="split it"):
            await tenants.charge("team-a", 1000)
        await tenants.charge("someone-else", 10**9)  # tenant_defaults: unlimited

    asyncio.run(charges())


def test_token_level_scores_need_a_generated_token() -> None:
    with pytest.raises(Exception, match="no generated token"):
        token_level_scores(RewardItem("a", response_token_ids=(1, 2), response_mask=b"\0\0"), 1)
    with pytest.raises(Exception, match="2 bytes for 3"):
        token_level_scores(RewardItem("a", response_token_ids=(1, 2, 3), response_mask=b"\1\1"), 1)
    assert token_level_scores(RewardItem("a", response_token_ids=(1, 2)), 2.0) == (0.0, 2.0)


def test_an_environment_reward_round_trips_through_its_field_and_bad_ones_are_named() -> None:
    from relayrl.core.env_reward import EnvReward, from_proto
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.proto.rollout.v1 import rollout_pb2
    from relayrl.reward.convert import item_from_proto
    from relayrl.reward.items import InvalidItem

    reported = EnvReward("fail", 0.25, "2 of 8 checks")
    assert from_proto(reported.to_proto()) == reported
    # a close's (rollout.v1) has the same fields and numbers as a trajectory's (common.v1)
    close = rollout_pb2.EnvReward(
        status=rollout_pb2.ENV_REWARD_STATUS_FAIL, score=0.25, message="2 of 8 checks"
    )
    assert from_proto(close) == reported
    item = item_from_proto(common_pb2.RewardItem(item_id="a", env_reward=reported.to_proto()))
    assert item.env_reward == reported
    assert item_from_proto(common_pb2.RewardItem(item_id="b")).env_reward is None
    ok = common_pb2.ENV_REWARD_STATUS_OK
    for bad, words in (
        (common_pb2.EnvReward(score=1), "got ENV_REWARD_STATUS_UNSPECIFIED"),
        (common_pb2.EnvReward(status=ok, score=float("nan")), "finite"),
        (common_pb2.EnvReward(status=ok, score=1e7), "finite"),
        (common_pb2.EnvReward(status=ok, message="x" * 1001), "longer than 1000"),
    ):
        with pytest.raises(ValueError, match=words):
            from_proto(bad)
        with pytest.raises(InvalidItem, match=f"malformed environment reward: .*{words}"):
            item_from_proto(common_pb2.RewardItem(item_id="c", env_reward=bad))


def test_labels_never_set_an_environment_reward() -> None:
    """Labels of the reward's old names (a group's, an opener's, a caller's `extra`) are only
    labels: the `env` manager reads the item's field, the TransferQueue front door fills it from
    the trajectory's field alone."""
    from relayrl.core.env_reward import EnvReward
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.reward.items import InvalidItem
    from relayrl.reward.managers.env import EnvManager
    from relayrl.reward.tq_scorer import item_of

    posing = {"env_reward": "1.0", "env_reward_status": "ok"}
    manager = EnvManager("env", None)
    with pytest.raises(InvalidItem, match="reports no environment reward"):
        manager.validate(RewardItem("a", extra=posing))
    reported = RewardItem("b", extra=posing, env_reward=EnvReward("fail", 0.25, "format only"))
    manager.validate(reported)
    verdict = asyncio.run(manager.score(reported))
    assert (verdict.score, verdict.status, verdict.message) == (
        0.25,
        Status.POLICY_FAIL,
        "format only",
    )

    group = common_pb2.PromptGroup(uid="g", num_samples=2, data_source="env", labels=posing)
    silent = common_pb2.Trajectory(uid="g", index=0, labels=posing)
    item = item_of(group, silent)
    assert item.env_reward is None and item.extra["env_reward"] == "1.0"  # a label, kept as one
    closed = common_pb2.Trajectory(
        uid="g", index=1, labels=posing, env_reward=EnvReward("ok", 0.5).to_proto()
    )
    assert item_of(group, closed).env_reward == EnvReward("ok", 0.5)
    malformed = common_pb2.Trajectory(uid="g", index=1, env_reward=common_pb2.EnvReward(score=1))
    with pytest.raises(InvalidItem, match="item 'g_1': malformed environment reward"):
        item_of(group, malformed)


def test_the_env_manager_refuses_to_add_a_group_normalising_manager() -> None:
    config = RewardConfig.model_validate(
        {
            "managers": {
                "rules": {"type": "naive"},
                "gdpo": {"type": "gdpo", "components": {"c": {"manager": "rules"}}},
                "env": {"type": "env", "add": "gdpo"},
            },
            "default_manager": "rules",
        }
    )

    async def build() -> None:
        build_managers(config.managers, CollectorRegistry())

    with pytest.raises(ValueError, match="normalises whole groups"):
        asyncio.run(build())
