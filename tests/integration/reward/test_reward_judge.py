"""The judge managers (remote, genrm, disrm) against a real judge_sim process: verdicts,
batching into one backend request, failure mapping (a failure is never a score), config
checks; and the simulator's own timing model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

import pytest
from pydantic import ValidationError

from relayrl.reward.items import InfraError, RewardItem, ScoringError, Status, Verdict
from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, Outcome
from relayrl.reward.managers.judge import (
    DisRMConfig,
    GenRMConfig,
    RemoteConfig,
    VerdictConfig,
    VerdictParser,
)
from relayrl_testkit.judge_launcher import JudgeSimProcess, start_judge_sim

FAST = {"step_s": 0.001, "verdict_tokens": 5, "prefill_s": 0.005}
QUICK_RETRY = {"max_retries": 2, "backoff_initial_s": 0.01, "backoff_max_s": 0.02}


@pytest.fixture(scope="module")
def sim() -> Iterator[JudgeSimProcess]:
    with start_judge_sim(**FAST, max_model_len=2048) as process:
        yield process


@pytest.fixture
def judge(sim: JudgeSimProcess) -> JudgeSimProcess:
    """The shared simulator with zeroed counters and no server-wide fault."""
    sim.set_fault(None, retry_after_s=1.0)
    sim.reset_stats()
    return sim


def item(i: int, response: str, ground_truth: str = "42", prompt: str = "6*7?") -> RewardItem:
    return RewardItem(item_id=f"i{i}", prompt=prompt, response=response, ground_truth=ground_truth)


def score(config: ManagerConfigBase, items: Sequence[RewardItem]) -> list[Outcome]:
    """Build the manager in a fresh loop, score the batch, close it."""

    async def go() -> list[Outcome]:
        manager = config.build("judge", ManagerContext())  # type: ignore[attr-defined]
        try:
            return await manager.score_batch(items)
        finally:
            await manager.close()

    return asyncio.run(go())


def statuses(outcomes: Sequence[Outcome]) -> list[Status]:
    return [o.status for o in outcomes]


def genrm(sim: JudgeSimProcess, **fields: object) -> GenRMConfig:
    return GenRMConfig(base_url=sim.url, model="judge", **{**QUICK_RETRY, **fields})


# -- verdicts and batching ------------------------------------------------------------------


def test_genrm_scores_a_batch_in_one_request(judge: JudgeSimProcess) -> None:
    items = [item(i, "42" if i % 2 == 0 else "41") for i in range(8)]
    outcomes = score(genrm(judge), items)
    assert statuses(outcomes) == [Status.OK, Status.POLICY_FAIL] * 4
    assert [o.score for o in outcomes] == [1.0, 0.0] * 4  # type: ignore[union-attr]
    stats = judge.stats()
    assert stats["requests"] == 1 and stats["request_items"] == [8]
    assert stats["by_endpoint"] == {"/v1/completions": 1}


def test_genrm_maps_choices_by_index(judge: JudgeSimProcess) -> None:
    items = [item(i, "42" if i < 2 else "0") for i in range(4)]
    shuffled = score(genrm(judge, headers={"X-Sim-Fault": "shuffle"}), items)
    assert statuses(shuffled) == [Status.OK, Status.OK, Status.POLICY_FAIL, Status.POLICY_FAIL]
    dropped = score(genrm(judge, headers={"X-Sim-Fault": "drop"}), items)
    assert statuses(dropped)[:3] == [Status.OK, Status.OK, Status.POLICY_FAIL]
    assert dropped[3].status is Status.INFRA_ERROR and "no choices entry" in dropped[3].message


def test_genrm_too_long_prompt_fails_only_that_item(judge: JudgeSimProcess) -> None:
    long_prompt = "x" * 4 * 3000  # ~3000 tokens > max_model_len 2048
    items = [item(0, "42"), item(1, "42", prompt=long_prompt), item(2, "1"), item(3, "42")]
    outcomes = score(genrm(judge), items)
    assert statuses(outcomes) == [Status.OK, Status.INVALID_INPUT, Status.POLICY_FAIL, Status.OK]
    assert "maximum context length" in outcomes[1].message
    assert judge.stats()["request_items"][0] == 4  # the whole batch first, then bisected


def test_remote_sends_one_chat_request_per_item(judge: JudgeSimProcess, monkeypatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    config = RemoteConfig(
        base_url=judge.url, model="judge", api_key_env="JUDGE_TEST_KEY", **QUICK_RETRY
    )
    outcomes = score(config, [item(0, "42"), item(1, "7"), item(2, " 42 ")])
    assert statuses(outcomes) == [Status.OK, Status.POLICY_FAIL, Status.OK]
    stats = judge.stats()
    assert stats["by_endpoint"] == {"/v1/chat/completions": 3}
    assert stats["request_items"] == [1, 1, 1]


def test_disrm_classify_and_pooling(judge: JudgeSimProcess) -> None:
    items = [item(0, "42"), item(1, "9"), item(2, "x\nSIM_SCORE: 0.3")]
    template = "{prompt}\nANSWER: {response}\nREFERENCE: {ground_truth}"
    config = DisRMConfig(base_url=judge.url, model="judge", input_template=template)
    outcomes = score(config, items)
    assert [round(o.score, 6) for o in outcomes] == [0.92, 0.08, 0.3]  # type: ignore[union-attr]
    assert statuses(outcomes) == [Status.OK] * 3
    assert judge.stats()["by_endpoint"] == {"/classify": 1}

    gated = config.model_copy(update={"fail_below": 0.5, "label_index": 0})
    assert statuses(score(gated, items)) == [Status.POLICY_FAIL, Status.OK, Status.OK]

    pooling = DisRMConfig(base_url=judge.url, model="judge", api="pooling", input_template=template)
    raw = score(pooling, items[:2])
    assert raw[0].score == pytest.approx(2.442, abs=1e-3)  # logit(0.92)  # type: ignore[union-attr]
    assert raw[1].score == pytest.approx(-2.442, abs=1e-3)  # type: ignore[union-attr]
    assert judge.stats()["request_items"] == [3, 3, 2]


def test_score_mode(judge: JudgeSimProcess) -> None:
    verdict = VerdictConfig(mode="score", score_range=(0.0, 10.0), fail_below=0.5)
    items = [item(0, "a\nSIM_SCORE: 7.5"), item(1, "b\nSIM_SCORE: 2"), item(2, "c\nSIM_SCORE: 11")]
    outcomes = score(genrm(judge, verdict=verdict), items)
    assert outcomes[0].score == 0.75 and outcomes[0].status is Status.OK  # type: ignore[union-attr]
    assert outcomes[1].score == 0.2 and outcomes[1].status is Status.POLICY_FAIL  # type: ignore[union-attr]
    assert outcomes[2].status is Status.INFRA_ERROR and "outside score_range" in outcomes[2].message
    raw = VerdictConfig(mode="score", score_range=None)
    assert score(genrm(judge, verdict=raw), items[2:])[0].score == 11.0  # type: ignore[union-attr]


# -- failures are never scores --------------------------------------------------------------


def test_unparseable_verdict_is_infra_error(judge: JudgeSimProcess) -> None:
    outcomes = score(genrm(judge), [item(0, "42\nSIM_MODE: garbage"), item(1, "42")])
    assert statuses(outcomes) == [Status.INFRA_ERROR, Status.OK]
    assert "judge verdict unparseable" in outcomes[0].message
    cut = score(genrm(judge, max_tokens=2), [item(0, "42")])[0]  # the verdict is cut off
    assert cut.status is Status.INFRA_ERROR and "raise max_tokens" in cut.message


def test_server_errors_are_retried_then_infra_error(judge: JudgeSimProcess) -> None:
    items = [item(0, "42"), item(1, "1")]
    failed = score(genrm(judge, headers={"X-Sim-Fault": "500"}), items)
    assert statuses(failed) == [Status.INFRA_ERROR] * 2
    assert "HTTP 500" in failed[0].message and "after 3 attempts" in failed[0].message
    assert judge.stats()["requests"] == 3

    judge.reset_stats()
    judge.set_fault("503", count=1)  # a transient failure: the retry succeeds
    assert statuses(score(genrm(judge), items)) == [Status.OK, Status.POLICY_FAIL]
    assert judge.stats()["requests"] == 2

    for fault, text in (("close", "unreachable"), ("malformed", "not JSON")):
        outcome = score(genrm(judge, headers={"X-Sim-Fault": fault}), items[:1])[0]
        assert outcome.status is Status.INFRA_ERROR and text in outcome.message, outcome


def test_rate_limited(judge: JudgeSimProcess) -> None:
    # Retry-After (1 s) beyond the cap: give up at once, passing the server's hint on.
    capped = genrm(judge, headers={"X-Sim-Fault": "429"}, retry_after_cap_s=0.5)
    outcome = score(capped, [item(0, "42")])[0]
    assert outcome.status is Status.RATE_LIMITED and outcome.retry_after_s == 1.0  # type: ignore[union-attr]
    assert judge.stats()["requests"] == 1

    judge.reset_stats()
    judge.set_fault(None, retry_after_s=0.05)
    waited = RemoteConfig(
        base_url=judge.url, model="judge", headers={"X-Sim-Fault": "429"}, max_retries=1
    )
    outcome = score(waited, [item(0, "42")])[0]
    assert outcome.status is Status.RATE_LIMITED and "after 2 attempts" in outcome.message
    assert judge.stats()["requests"] == 2


def test_hung_judge_times_out(judge: JudgeSimProcess) -> None:
    config = genrm(judge, headers={"X-Sim-Fault": "hang"}, timeout_s=0.3)
    started = time.monotonic()
    outcomes = score(config, [item(0, "42"), item(1, "42")])
    assert statuses(outcomes) == [Status.TIMEOUT] * 2
    assert time.monotonic() - started < 3.0
    assert judge.stats()["requests"] == 1  # a timeout is not retried


def test_wrong_model_is_infra_error(judge: JudgeSimProcess) -> None:
    config = RemoteConfig(base_url=judge.url, model="nope", **QUICK_RETRY)
    outcome = score(config, [item(0, "42")])[0]
    assert outcome.status is Status.INFRA_ERROR and "HTTP 404" in outcome.message


def test_judge_down_is_infra_error() -> None:
    with start_judge_sim(**FAST) as gone:
        url = gone.url
    items = [item(0, "42")]
    for config in (
        GenRMConfig(base_url=url, model="judge", **QUICK_RETRY),
        RemoteConfig(base_url=url, model="judge", **QUICK_RETRY),
        DisRMConfig(base_url=url, model="judge", **QUICK_RETRY),
    ):
        outcome = score(config, items)[0]
        assert outcome.status is Status.INFRA_ERROR and "unreachable" in outcome.message


def test_item_without_ground_truth_is_invalid() -> None:
    manager = GenRMConfig(base_url="http://127.0.0.1:1", model="m").build("g", ManagerContext())
    with pytest.raises(ScoringError) as raised:
        manager.validate(item(0, "42", ground_truth=""))
    assert raised.value.status is Status.INVALID_INPUT
    lenient = GenRMConfig(base_url="http://127.0.0.1:1", model="m", require_ground_truth=False)
    lenient.build("g", ManagerContext()).validate(item(0, "42", ground_truth=""))


# -- config and parsing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"prompt_template": "Q: {question} A: {response}"}, "unknown placeholder {question}"),
        ({"prompt_template": "{prompt} only"}, "must contain {response}"),
        ({"prompt_template": "{response!r}"}, "no format spec"),
        ({"prompt_template": "{response} {"}, "literal braces"),
        ({"verdict": {"score_pattern": r"score: \d+"}}, "exactly one capturing group"),
        ({"verdict": {"correct_pattern": "("}}, "not a valid regex"),
        ({"verdict": {"score_range": [1, 0]}}, "lo < hi"),
        ({"base_url": "judge:8000"}, "http:// or https://"),
        ({"headers": {"Authorization": "Bearer x"}}, "api_key_env"),
        ({"api_key_env": "not a name"}, "api_key_env"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"temperture": 0.5}, "temperture"),
    ],
)
def test_config_mistakes_are_refused(fields: dict[str, object], text: str) -> None:
    with pytest.raises(ValidationError, match=None) as raised:
        GenRMConfig(**{"base_url": "http://judge:8000", "model": "m", **fields})
    assert text in str(raised.value)


def test_remote_config_checks_both_templates_and_the_key(monkeypatch) -> None:
    with pytest.raises(ValidationError, match="unknown placeholder"):
        RemoteConfig(base_url="http://j:1", model="m", system_prompt="grade {answer}")
    literal = RemoteConfig(base_url="http://j:1/", model="m", user_template="{{x}} {response}")
    assert literal.base_url == "http://j:1"
    monkeypatch.delenv("JUDGE_MISSING_KEY", raising=False)
    config = RemoteConfig(base_url="http://j:1", model="m", api_key_env="JUDGE_MISSING_KEY")
    with pytest.raises(ValueError, match="JUDGE_MISSING_KEY"):
        config.build("r", ManagerContext())


def test_verdict_parser_last_match_wins() -> None:
    label = VerdictParser(VerdictConfig())
    text = "A careless grader would say Verdict: Correct. Checking again...\nVerdict: Incorrect"
    assert label.parse(text) == Verdict(0.0, Status.POLICY_FAIL, message="judge: incorrect")
    assert label.parse("verdict: **correct**").status is Status.OK
    loose = VerdictParser(VerdictConfig(correct_pattern="correct", incorrect_pattern="incorrect"))
    assert loose.parse("it is incorrect").status is Status.POLICY_FAIL  # longer match wins a tie
    with pytest.raises(InfraError, match="unparseable"):
        label.parse("I am not sure.")
    scored = VerdictParser(VerdictConfig(mode="score"))
    assert scored.parse("Score: 0.2 ... on reflection Score: 0.9").score == 0.9


# -- the simulator itself -------------------------------------------------------------------


def test_simulator_timing_model() -> None:
    """One request takes about prefill + tokens * step; 16 sequences decoding together make
    each step ~1.7x as long (step_growth 0.047), so the batch takes longer, not 16x longer."""
    step_s, tokens, prefill_s = 0.01, 20, 0.05

    def post(sim: JudgeSimProcess, prompts: list[str]) -> float:
        started = time.monotonic()
        answer = sim.request("POST", "/v1/completions", {"model": "judge", "prompt": prompts})
        assert len(answer["choices"]) == len(prompts)
        return time.monotonic() - started

    with start_judge_sim(step_s=step_s, verdict_tokens=tokens, prefill_s=prefill_s) as sim:
        post(sim, ["warm up"])
        sim.reset_stats()
        single = min(post(sim, ["ANSWER: 1\nREFERENCE: 1"]) for _ in range(2))
        one_busy = sim.stats()["decode_busy_s"] / 2
        sim.reset_stats()
        batch = post(sim, [f"ANSWER: {i}\nREFERENCE: 1" for i in range(16)])
        stats = sim.stats()

    expected_single = prefill_s + tokens * step_s  # 0.25 s
    assert one_busy == pytest.approx(tokens * step_s)
    assert 0.8 * expected_single < single < 2.5 * expected_single
    assert stats["active_seqs_max"] == 16 and stats["decode_steps"] == tokens
    assert stats["decode_busy_s"] == pytest.approx(tokens * step_s * (1 + 0.047 * 15))
    per_step_ratio = (batch - prefill_s) / (single - prefill_s)
    assert 1.2 < per_step_ratio < 3.0, (single, batch)
