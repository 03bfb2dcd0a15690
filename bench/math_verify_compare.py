"""The `math` rule scorer next to Hugging Face's math-verify used on its own, on every case of
the math rule tests (tests/unit/reward/test_reward_rules.py): which side reaches the verdict
the test asks for.

The cases are read from the test module's `pytest.mark.parametrize` tables, so the two cannot
drift; each becomes one (response, ground truth, expected verdict, time budget) item:

    equal       test_math_equal: `\\boxed{predicted}` against `expected`, right
    not-equal   test_math_not_equal: the same, wrong
    normalise   test_normalize_math_answer: `\\boxed{raw}` against its normal form, right
    extract     test_extract_math_answer: the response against the answer it holds, right
    score       test_score_math_correct (right) and the wrong and missing answers of
                test_score_math_wrong_and_missing_answers
    injection   test_math_injection_is_never_evaluated: the payload boxed, against 0, wrong
    hostile     test_math_hostile_answers_fail_fast: each answer boxed against each ground
                truth, wrong within 1 s
    huge        test_math_huge_response_is_linear: wrong within 2 s

`relayrl` is `score_math` (an OK verdict is "right"): math-verify itself since the scorer
adopted it, with our answer extraction, cheap comparisons, the rules math-verify gets wrong and
the limits around it (docs/rewards.md#math); so the table shows what those add. `math-verify`
is the library as its
README and verl use it: the ground truth wrapped in `\\boxed{}` unless it has one, both sides
through `parse` (LaTeX and plain-expression extraction, its defaults) and `verify`, here in
the main thread so that its SIGALRM timeouts work, set to `--timeout-s`. A side gets a case
right when its verdict is the expected one within the case's time budget.

The table counts the cases both sides get right, only one, or neither, per group and in all;
every case where the sides differ is listed. The last line is exactly:
    math-verify-compare: both=<n> only_relayrl=<n> only_math_verify=<n> neither=<n>
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.reward.items import RewardItem, Status
from relayrl.reward.managers.rules import score_math

TESTS = Path(__file__).resolve().parents[1] / "tests/unit/reward/test_reward_rules.py"
# The budgets of the tests that time the scorer; other cases have the default.
DEFAULT_BUDGET_S = 5.0
HOSTILE_BUDGET_S = 1.0
HUGE_BUDGET_S = 2.0
HOSTILE_GROUND_TRUTHS = ("1", "x+1", r"\sin(2)")  # as test_math_hostile_answers_fail_fast
GROUPS = ("equal", "not-equal", "normalise", "extract", "score", "injection", "hostile", "huge")


@dataclass(frozen=True)
class Case:
    group: str
    response: str
    ground_truth: str
    right: bool
    budget_s: float = DEFAULT_BUDGET_S


def _parametrized(module: Any, test_name: str) -> list[Any]:
    """The value list of a test's (single) parametrize mark."""
    marks = [m for m in getattr(module, test_name).pytestmark if m.name == "parametrize"]
    assert len(marks) == 1, f"{test_name}: expected one parametrize mark"
    return list(marks[0].args[1])


def load_cases() -> list[Case]:
    spec = importlib.util.spec_from_file_location("test_reward_rules", TESTS)
    assert spec is not None and spec.loader is not None
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)

    def boxed(answer: str) -> str:
        return rf"\boxed{{{answer}}}"

    cases = [Case("equal", boxed(p), e, True) for p, e in _parametrized(tests, "test_math_equal")]
    cases += [
        Case("not-equal", boxed(p), e, False)
        for p, e in _parametrized(tests, "test_math_not_equal")
    ]
    cases += [
        Case("normalise", boxed(raw), normal, True)
        for raw, normal in _parametrized(tests, "test_normalize_math_answer")
    ]
    cases += [
        Case("extract", response, answer, True)
        for response, answer in _parametrized(tests, "test_extract_math_answer")
    ]
    cases += [
        Case("score", response, truth, True)
        for response, truth in _parametrized(tests, "test_score_math_correct")
    ]
    # test_score_math_wrong_and_missing_answers is not parametrized: its three items
    cases += [
        Case("score", r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", False),
        Case("score", "I could not solve it.", "5", False),
        Case("score", r"\boxed{}", "5", False),
    ]
    cases += [
        Case("injection", boxed(payload), "0", False)
        for payload in _parametrized(tests, "test_math_injection_is_never_evaluated")
    ]
    cases += [
        Case("hostile", boxed(answer), truth, False, HOSTILE_BUDGET_S)
        for answer in _parametrized(tests, "test_math_hostile_answers_fail_fast")
        for truth in HOSTILE_GROUND_TRUTHS
    ]
    cases += [
        Case("huge", r"\boxed{" * 100_000, "1", False, HUGE_BUDGET_S),
        Case("huge", "answer: " * 50_000, "1", False, HUGE_BUDGET_S),
    ]
    return cases


def relayrl_verdict(case: Case) -> bool:
    item = RewardItem(
        item_id="c", data_source="math", response=case.response, ground_truth=case.ground_truth
    )
    return score_math(item).status is Status.OK


def math_verify_verdict(case: Case, timeout_s: int) -> bool:
    from math_verify import parse, verify

    truth = case.ground_truth
    gold = parse(truth if r"\boxed" in truth else rf"\boxed{{{truth}}}", parsing_timeout=timeout_s)
    answer = parse(case.response, parsing_timeout=timeout_s)
    return bool(gold) and verify(gold, answer, timeout_seconds=timeout_s)


def _clear_parse_caches() -> None:
    """math-verify keeps its last parses; both sides parse the same strings, so without this
    the second side of each case would be timed on the first one's cached parse."""
    from math_verify import parser

    parser.parse_latex_cached.cache_clear()
    parser.extract_latex.cache_clear()


def _short(text: str, limit: int = 48) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeout-s",
        type=int,
        default=2,
        help="math-verify's parsing and comparison timeouts (whole seconds; its default is 5)",
    )
    args = parser.parse_args()
    # math-verify logs every timeout as a warning; the table reports them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    cases = load_cases()
    score_math(RewardItem(item_id="w", data_source="math", response="2x", ground_truth="x+x"))
    math_verify_verdict(Case("warm-up", r"\boxed{\frac{1}{2}}", "0.5", True), args.timeout_s)

    tally: dict[str, Counter[str]] = {group: Counter() for group in GROUPS}
    seconds: dict[str, Counter[str]] = {group: Counter() for group in GROUPS}
    differences: list[str] = []
    for case in cases:
        outcome = {}
        for side, judge in (
            ("relayrl", relayrl_verdict),
            ("math-verify", lambda c: math_verify_verdict(c, args.timeout_s)),
        ):
            _clear_parse_caches()
            start = time.perf_counter()
            verdict = judge(case)
            elapsed = time.perf_counter() - start
            seconds[case.group][side] += elapsed
            in_time = elapsed <= case.budget_s
            outcome[side] = (verdict == case.right and in_time, verdict, elapsed)
        ours, theirs = outcome["relayrl"][0], outcome["math-verify"][0]
        kind = {
            (True, True): "both",
            (True, False): "only_relayrl",
            (False, True): "only_math_verify",
            (False, False): "neither",
        }[ours, theirs]
        tally[case.group][kind] += 1
        if ours != theirs or not ours:
            sides = "  ".join(
                f"{side} {'right' if ok else 'WRONG'} ({'ok' if v else 'fail'}, {t:.2f} s)"
                for side, (ok, v, t) in outcome.items()
            )
            differences.append(
                f"  [{case.group}] {_short(case.response)} vs {_short(case.ground_truth)} "
                f"(expected {'ok' if case.right else 'fail'}): {sides}"
            )

    columns = ("both", "only_relayrl", "only_math_verify", "neither")
    print("cases where a side is wrong:")
    print("\n".join(differences) or "  none")
    print()
    sides = ("relayrl", "math-verify")
    header = " ".join(f"{c:>16}" for c in columns) + "".join(f"{s + '_s':>15}" for s in sides)
    print(f"{'group':<10} {'cases':>5} {header}")
    total = Counter[str]()
    total_s = Counter[str]()
    for group in GROUPS:
        counts = tally[group]
        total.update(counts)
        total_s.update(seconds[group])
        row = " ".join(f"{counts[c]:>16}" for c in columns)
        row += "".join(f"{seconds[group][s]:>15.2f}" for s in sides)
        print(f"{group:<10} {sum(counts.values()):>5} {row}")
    row = " ".join(f"{total[c]:>16}" for c in columns)
    row += "".join(f"{total_s[s]:>15.2f}" for s in sides)
    print(f"{'all':<10} {sum(total.values()):>5} {row}")
    print(
        f"seconds per side summed over the cases; math-verify's timeouts {args.timeout_s} s; "
        f"math-verify/relayrl time {total_s['math-verify'] / total_s['relayrl']:.2f}"
    )
    print("math-verify-compare: " + " ".join(f"{c}={total[c]}" for c in columns))


if __name__ == "__main__":
    main()
