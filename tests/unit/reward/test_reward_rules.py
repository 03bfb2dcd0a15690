"""Rule scorers (gsm8k, math, arith) and the `naive` manager that dispatches to them."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from relayrl.reward.items import InvalidItem, RewardItem, Status, Verdict
from relayrl.reward.managers.base import ManagerContext, outcome_of
from relayrl.reward.managers.naive import NaiveConfig, NaiveManager
from relayrl.reward.managers.rules import (
    GSM8K_FLEXIBLE_SCORE,
    RULE_SCORERS,
    extract_gsm8k_answer,
    extract_math_answer,
    last_boxed,
    math_equal,
    normalize_math_answer,
    score_arith,
    score_gsm8k,
    score_math,
)


def item(
    response: str, ground_truth: str, data_source: str = "", item_id: str = "i1"
) -> RewardItem:
    return RewardItem(
        item_id=item_id, data_source=data_source, response=response, ground_truth=ground_truth
    )


def assert_correct(verdict: Verdict) -> None:
    assert (verdict.score, verdict.status) == (1.0, Status.OK), verdict.message


def assert_wrong(verdict: Verdict) -> None:
    assert (verdict.score, verdict.status) == (0.0, Status.POLICY_FAIL), verdict.message


# --------------------------------------------------------------------------------------------
# gsm8k
# --------------------------------------------------------------------------------------------

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", GSM8K_SOLUTION),
        ("#### 72", "72"),
        ("so 24 in May, 72 in all", "72"),  # flexible: the last number
        ("The total is $1,234.", "1234"),
        ("#### $1,234", "#### 1,234"),
        ("It loses 5 degrees: -5", "-5"),
        ("The answer is 42.0", "42"),
        ("#### 42.00 dollars", "42"),
        ("Each costs 0.5 dollars", "0.50"),
        ("#### 7\n\nUnrelated: 99", "7"),  # strict wins over a later number
        ("temperature \u22123", "-3"),  # a Unicode minus
        ("The answer is 72.", "#### 72\n"),
    ],
)
def test_gsm8k_correct(response: str, ground_truth: str) -> None:
    verdict = score_gsm8k(item(response, ground_truth, "gsm8k"))
    assert verdict.status is Status.OK, verdict.message
    # the format the prompt asks for earns the full reward; the right last number, half
    assert verdict.score == (1.0 if "(strict)" in verdict.message else GSM8K_FLEXIBLE_SCORE)


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("#### 71", GSM8K_SOLUTION),
        ("72 clips... actually 70", "72"),  # the last number counts
        ("#### 72000", "72"),
        ("#### 1,234", "1235"),
        ("It is 5", "-5"),
        ("pages 10-15", "-15"),  # a hyphen between numbers is not a sign
    ],
)
def test_gsm8k_wrong(response: str, ground_truth: str) -> None:
    verdict = score_gsm8k(item(response, ground_truth, "gsm8k"))
    assert_wrong(verdict)
    assert "extracted" in verdict.message and "expected" in verdict.message


def test_gsm8k_message_says_what_was_extracted_and_how() -> None:
    strict = score_gsm8k(item("#### 70", "72"))
    assert strict.message == "extracted '70' (strict), expected '72'"
    flexible = score_gsm8k(item("I think 70", "72"))
    assert flexible.message == "extracted '70' (flexible), expected '72'"


def test_gsm8k_no_number_is_a_policy_fail() -> None:
    verdict = score_gsm8k(item("I do not know.", "72"))
    assert_wrong(verdict)
    assert verdict.message == "no number found, expected '72'"


def test_gsm8k_mark_without_number_falls_back_to_the_last_number() -> None:
    assert extract_gsm8k_answer("so 12 apples\n####") is not None
    value, strict = extract_gsm8k_answer("so 12 apples\n####")  # type: ignore[misc]
    assert (value, strict) == (12, False)
    assert extract_gsm8k_answer("no digits here") is None


@pytest.mark.parametrize("ground_truth", ["", "   ", "a solution without a final answer"])
def test_gsm8k_bad_ground_truth_is_invalid(ground_truth: str) -> None:
    with pytest.raises(InvalidItem):
        score_gsm8k(item("#### 3", ground_truth))


def test_gsm8k_overlong_numbers_are_no_answer_not_a_crash() -> None:
    # Python refuses int() of over 4300 digits; such a "number" is no answer.
    assert_wrong(score_gsm8k(item("1" * 5000, "1")))
    assert_wrong(score_gsm8k(item("#### " + "9" * 5000, "9")))
    with pytest.raises(InvalidItem):
        score_gsm8k(item("#### 1", "#### " + "1" * 5000))


# --------------------------------------------------------------------------------------------
# math: extraction and normalisation
# --------------------------------------------------------------------------------------------


def test_last_boxed_balances_nested_braces() -> None:
    text = r"First \boxed{1}, then \boxed{\frac{\sqrt{3}}{2}} and done."
    assert last_boxed(text) == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"so \boxed 5$.") == "5"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"\boxed{3} and then \boxed{\frac{1}{2}") is None  # truncated
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"... so $x = \boxed{3}$.", "3"),
        ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", r"\frac{1}{2}"),
        ("The answer is 12.", "12"),
        ("work\nAnswer: 7\n", "7"),
        ("Answer: 3\nAnswer: $4$", "4"),  # the last one counts
    ],
)
def test_extract_math_answer(response: str, answer: str) -> None:
    assert extract_math_answer(response) == answer


def test_extract_math_answer_none() -> None:
    assert extract_math_answer("I am not sure what to answer here") is None


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"\$5.50", "5.50"),
        (r"10\text{ cm}", "10"),
        (r"\text{Monday}", "Monday"),
        (r"\text{(C)}", "C"),
        (r"1{,}000", "1000"),
        ("1,000,000", "1000000"),
        (r"1\,000", "1000"),
        ("x = 3", "3"),
        (r"\theta=\frac{\pi}{2}", r"\frac{\pi}{2}"),
        ("5.", "5"),
        (".5", "0.5"),
        ("3/4", r"\frac{3}{4}"),
        (r"50\%", "50"),
        (r"\pi r^2", r"\pi r^2"),  # the space after a command stays
        ("$\\frac{1}{2}$", r"\frac{1}{2}"),
    ],
)
def test_normalize_math_answer(raw: str, normal: str) -> None:
    assert normalize_math_answer(raw) == normal


# --------------------------------------------------------------------------------------------
# math: equivalence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("predicted", "expected"),
    [
        (r"\frac{1}{2}", "0.5"),
        ("1/2", "0.5"),
        (r"\dfrac{1}{2}", r"\frac12"),
        (r"-\frac{3}{4}", "-0.75"),
        ("0.3333333", r"\frac{1}{3}"),  # within 1e-6 relative
        ("42.0", "42"),
        (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
        (r"\frac{\sqrt2}{2}", r"\frac{1}{\sqrt{2}}"),
        (r"3\sqrt{2}", r"\sqrt{18}"),
        (r"\sqrt[3]{8}", "2"),
        (r"2^{10}", "1024"),
        (r"2\pi", r"\pi \cdot 2"),
        (r"\frac{\pi}{4}", "0.7853981634"),
        (r"e^{i\pi}", "-1"),
        ("x=3", "3"),
        ("y = 2x + 3", "3+2x"),
        ("x^2+2x+1", "(x+1)^2"),
        (r"\frac{x^2-1}{x-1}", "x+1"),
        (r"\sin(x)^2+\cos(x)^2", "1"),
        ("2xy", "2yx"),
        ("(1,2)", "(1, 2)"),
        (r"\left(3, -\frac{1}{2}\right)", "(3,-0.5)"),
        (r"[0, \infty)", r"[0,\infty)"),
        (r"(-\infty, 3] \cup (5, \infty)", r"(-\infty,3]\cup(5,\infty)"),
        ("1, -2", "-2, 1"),  # a bare list of solutions: any order
        (r"\{1, 2\}", "2,1"),
        (r"\text{Monday}", "monday"),
        (r"\text{(C)}", "C"),
        (r"50\%", "50"),
        (r"10\text{ cm}", "10"),
        ("1,000", "1000"),
        (r"\$5.00", "5"),
        (r"90^\circ", "90"),
        (r"10^{400}", r"10^{401}/10"),  # exact, no float overflow
        # forms math-verify's parser reads (our own parser refused them)
        (
            r"\begin{pmatrix} \frac{1}{2} \\ 2 \end{pmatrix}",
            r"\begin{pmatrix} 0.5 \\ 2 \end{pmatrix}",
        ),
        (r"\binom{5}{2}", "10"),
        ("5!", "120"),
        (r"\log_2 8", "3"),
        (r"\arctan 1", r"\frac{\pi}{4}"),
        (r"\lfloor 2.5 \rfloor", "2"),
        ("|-3|", "3"),
        ("a_1 + a_2", "a_2 + a_1"),
        (r"\sin^2 x + \cos^2 x", "1"),
        (r"x \in [1,2]", "[1,2]"),
        (r"\pm 1", "1, -1"),
        (r"x = -1 \text{ or } x = 1", r"\pm 1"),
        ("f(x) = x^2", "x^2"),
        (r"1.5 \text{ m}^2", "1.5"),
        (r"\lim_{x\to 0} \frac{\sin x}{x}", "1"),
        (r"\frac{d}{dx} x^{3}", "3x^{2}"),
        ("i^2", "-1"),
    ],
)
def test_math_equal(predicted: str, expected: str) -> None:
    assert math_equal(predicted, expected)


@pytest.mark.parametrize(
    ("predicted", "expected"),
    [
        (r"\frac{1}{3}", "0.33"),
        ("1000001", "1000000"),  # integers are exact
        ("(1,2)", "(2,1)"),  # tuples are ordered
        ("(1,2)", "[1,2]"),
        (r"(-\infty, 3)", r"(-\infty,3]"),
        ("(1,2)", "1,2"),
        (r"50\%", "0.5"),  # a dropped percent sign: 50% is 50
        ("x^2+2x+1", "(x+1)^3"),
        (r"\sqrt{x^2}", "x"),  # not for negative x
        ("no", "on"),  # words are not products of variables
        (r"\text{Tuesday}", "Monday"),
        ("", "3"),
        ("3", r"\frac{1}{0}"),
        (r"\frac{1}{0}", r"\frac{1}{0}x"),
        (r"\binom{5}{2}", "20"),
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\3\end{pmatrix}"),
    ],
)
def test_math_not_equal(predicted: str, expected: str) -> None:
    assert not math_equal(predicted, expected)


def math_verify_alone(predicted: str, expected: str) -> bool:
    """math-verify as the `math` rule calls it (LaTeX extraction, no timeouts), without our
    rules around it."""
    from math_verify import LatexExtractionConfig, parse, verify

    latex = [LatexExtractionConfig()]
    gold = parse(rf"\boxed{{{expected}}}", extraction_config=latex, parsing_timeout=None)
    answer = parse(rf"\boxed{{{predicted}}}", extraction_config=latex, parsing_timeout=None)
    return verify(gold, answer, timeout_seconds=None)


@pytest.mark.parametrize(
    ("predicted", "expected", "equal"),
    [
        ("no", "on", False),
        ("(1,2)", "1,2", False),
        ("(1,2)", r"\{1,2\}", False),
        (r"50\%", "0.5", False),
        (r"\frac{100}{2}\%", "0.5", False),
        (r"e^{i\pi}", "-1", True),
        (r"1\,000", "1000", True),
        ("5.", "5", True),
    ],
    ids=[
        "a-word-is-not-a-product-of-variables",
        "a-tuple-is-not-a-list-of-solutions",
        "a-tuple-is-not-a-set",
        "a-percent-sign-is-dropped",
        "a-percent-sign-is-dropped-before-math-verify",
        "i-is-the-imaginary-unit",
        "a-thin-space-separates-thousands",
        "a-trailing-period-is-punctuation",
    ],
)
def test_math_keeps_our_rule_where_math_verify_alone_is_wrong(
    predicted: str, expected: str, equal: bool
) -> None:
    # If math-verify starts getting one right, the rule of ours that covers it can go.
    assert math_verify_alone(predicted, expected) is not equal
    assert math_equal(predicted, expected) is equal


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        (r"Therefore $x = \boxed{\dfrac{1}{2}}$.", "0.5"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"The height is $\boxed{\frac{\sqrt3}{2}}$."),
        (r"The area is \boxed{4\pi}.", r"4 \pi"),
        (r"\boxed{(1, 2)}", "(1,2)"),
        ("Final Answer: The final answer is $12$. I hope it is correct.", "12"),
    ],
)
def test_score_math_correct(response: str, ground_truth: str) -> None:
    assert_correct(score_math(item(response, ground_truth, "math")))


def test_score_math_wrong_and_missing_answers() -> None:
    wrong = score_math(item(r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "math"))
    assert_wrong(wrong)
    assert wrong.message == r"extracted '\\frac{1}{3}', expected '\\frac{1}{2}'"
    missing = score_math(item("I could not solve it.", "5", "math"))
    assert_wrong(missing)
    assert missing.message.startswith("no ") and "expected '5'" in missing.message
    assert_wrong(score_math(item(r"\boxed{}", "5", "math")))


@pytest.mark.parametrize("ground_truth", ["", "  ", r"\boxed{}"])
def test_score_math_without_ground_truth_is_invalid(ground_truth: str) -> None:
    with pytest.raises(InvalidItem):
        score_math(item(r"\boxed{5}", ground_truth, "math"))


# sympy's code for a number literal, as its parse_expr builds it from a number token
SYMPY_NUMBER = re.compile(r"(?:Integer|Float) \('?[0-9.E+-]+'? \)")


@pytest.mark.parametrize(
    "payload",
    [
        "__import__('os').system('echo pwned')",
        '__import__("os").system("touch /tmp/relayrl-pwned")',
        "().__class__.__bases__[0].__subclasses__()",
        "eval('1')",
        "lambda: 1",
        "x; import os",
        r"\text{__import__('os')}",
    ],
)
def test_math_injection_is_never_evaluated(
    payload: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # sympy runs code of its own through exec (its imports, helpers it generates) and, when the
    # LaTeX parser hands it a number token, evaluates that literal (`Integer (1 )`): that is
    # all that may reach eval or exec. Refused calls are recorded as well as raised, since a
    # library's `except Exception` would swallow the raise.
    refused: list[str] = []

    def watched(real: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def call(code: object, *args: object, **kwargs: object) -> Any:
            if isinstance(code, str) and (
                payload in code or (kind == "eval" and not SYMPY_NUMBER.fullmatch(code))
            ):
                refused.append(code)
                raise AssertionError(f"the scorer must never {kind} the answer")
            return real(code, *args, **kwargs)

        return call

    import builtins

    monkeypatch.setattr(builtins, "eval", watched(builtins.eval, "eval"))
    monkeypatch.setattr(builtins, "exec", watched(builtins.exec, "exec"))
    verdict = score_math(item(rf"\boxed{{{payload}}}", "0", "math"))
    assert_wrong(verdict)
    assert refused == []
    assert "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9}}",
        "9^{9^{9^{9}}}",
        "(((2^{100})^{100})^{100})^{100}",
        "10^{10^{6}}",
        "x^{10^{9}}",
        "((1+\\sqrt{2})^{64})^{64}",
        "x^{64}x^{64}x^{64}x^{64}",
        "e^{e^{e^{e^{10}}}}",
        "\\exp(\\exp(\\exp(100)))",
        "\\sin(e^{10^{9}})",
        "\\exp(3^{7})",
        "2^{2^{x}}",
        "(" * 300 + "1" + ")" * 300,
        "\\frac{" * 150 + "1" + "}{2}" * 150,
        "1" * 1999,
        "x" * 1000,
    ],
)
def test_math_hostile_answers_fail_fast(answer: str) -> None:
    math_equal("1", "1")  # sympy imported before timing
    for ground_truth in ("1", "x+1", r"\sin(2)"):
        start = time.perf_counter()
        verdict = score_math(item(rf"\boxed{{{answer}}}", ground_truth, "math"))
        assert time.perf_counter() - start < 1.0, (answer, ground_truth)
        assert_wrong(verdict)


def test_math_huge_response_is_linear() -> None:
    start = time.perf_counter()
    assert_wrong(score_math(item(r"\boxed{" * 100_000, "1", "math")))
    assert_wrong(score_math(item("answer: " * 50_000, "1", "math")))
    assert time.perf_counter() - start < 2.0


def test_math_is_deterministic() -> None:
    pairs = [("x^2+2x+1", "(x+1)^2"), (r"\sqrt{x^2}", "x"), (r"\frac{1}{2}", "0.5")]
    first = [math_equal(a, b) for a, b in pairs]
    assert [math_equal(a, b) for a, b in pairs] == first


# --------------------------------------------------------------------------------------------
# arith
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("17 + 25 = 42\nAnswer: 42", "42"),
        ("Answer:42", "42"),
        ("Answer: -7", "-7"),
        ("Answer: +7", "7"),
        ("Answer: 7.", " 7 "),
        ("Answer: 3\nwait, no.\nAnswer: 5", "5"),  # the last occurrence counts
    ],
)
def test_arith_correct(response: str, ground_truth: str) -> None:
    assert_correct(score_arith(item(response, ground_truth, "arith")))


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("Answer: 41", "42"),
        ("Answer: 5\nAnswer: 3", "5"),  # an earlier right answer does not count
        ("42", "42"),  # the format is part of the task
        ("answer: 42", "42"),
        ("Answer: 42.5", "42"),
        ("Answer: 4,200", "4200"),
        ("Answer: forty-two", "42"),
        ("Answer: 42\nAnswer:", "42"),
    ],
)
def test_arith_wrong(response: str, ground_truth: str) -> None:
    verdict = score_arith(item(response, ground_truth, "arith"))
    assert_wrong(verdict)
    assert "expected '" in verdict.message


def test_arith_messages() -> None:
    assert score_arith(item("Answer: 41", "42")).message == "extracted '41', expected '42'"
    assert score_arith(item("42", "42")).message == ("no 'Answer: <integer>' found, expected '42'")


def test_arith_overlong_integer_is_no_answer() -> None:
    assert_wrong(score_arith(item("Answer: " + "9" * 5000, "9")))


@pytest.mark.parametrize("ground_truth", ["", "forty-two", "4.5", "1_000", "9" * 5000])
def test_arith_bad_ground_truth_is_invalid(ground_truth: str) -> None:
    with pytest.raises(InvalidItem):
        score_arith(item("Answer: 4", ground_truth))


def test_rule_table() -> None:
    for source in ("gsm8k", "openai/gsm8k", "math", "lighteval/MATH", "math_dapo", "arith"):
        assert source in RULE_SCORERS
    assert RULE_SCORERS["openai/gsm8k"] is score_gsm8k
    assert RULE_SCORERS["lighteval/MATH"] is score_math
    with pytest.raises(TypeError):
        RULE_SCORERS["mine"] = score_arith  # type: ignore[index]


# --------------------------------------------------------------------------------------------
# naive manager
# --------------------------------------------------------------------------------------------


def naive(**fields: object) -> NaiveManager:
    config = NaiveConfig.model_validate({"type": "naive", **fields})
    return config.build("rules", ManagerContext())


def score(manager: NaiveManager, reward_item: RewardItem) -> Verdict:
    return asyncio.run(manager.score(reward_item))


def test_naive_dispatches_by_data_source() -> None:
    manager = naive()
    assert manager.type_name == "naive"
    assert set(manager.data_sources) == set(RULE_SCORERS)
    assert_correct(score(manager, item("#### 72", GSM8K_SOLUTION, "openai/gsm8k")))
    assert_correct(score(manager, item(r"\boxed{\frac12}", "0.5", "math_dapo")))
    assert_correct(score(manager, item("Answer: 9", "9", "arith")))
    assert_wrong(score(manager, item("Answer: 8", "9", "arith")))
    # the same text is judged by the rules of its source
    assert_wrong(score(manager, item("the result is 9", "9", "arith")))
    flexible = score(manager, item("the result is 9", "9", "gsm8k"))
    assert (flexible.score, flexible.status) == (GSM8K_FLEXIBLE_SCORE, Status.OK)


def test_naive_scores_math_symbolically_off_the_event_loop() -> None:
    # score() runs the math rule in a worker thread (asyncio.to_thread), where math-verify's
    # own SIGALRM timeouts cannot work: the comparison must still run, and be right.
    manager = naive()
    assert_correct(
        score(manager, item(r"\boxed{\frac{\sqrt{3}}{3}}", r"\frac{1}{\sqrt{3}}", "math"))
    )
    assert_wrong(score(manager, item(r"\boxed{(x+1)^3}", "x^2+2x+1", "math")))
    hostile = score(manager, item(r"\boxed{9^{9^{9}}}", "1", "math"))
    assert_wrong(hostile)
    assert "not compared: a power too large to compute" in hostile.message


def test_naive_score_batch_keeps_order_and_isolates_failures() -> None:
    manager = naive(unknown_source="warn")
    items = [
        item("Answer: 1", "1", "arith", "a"),
        item("Answer: 1", "1", "nope", "b"),
        item("#### 2", "3", "gsm8k", "c"),
    ]
    outcomes = asyncio.run(manager.score_batch(items))
    assert isinstance(outcomes[0], Verdict) and outcomes[0].status is Status.OK
    assert isinstance(outcomes[1], InvalidItem) and outcomes[1].status is Status.INVALID_INPUT
    assert isinstance(outcomes[2], Verdict) and outcomes[2].status is Status.POLICY_FAIL


def test_naive_unknown_source_error_mode_rejects_before_queueing() -> None:
    manager = naive()
    bad = item("Answer: 1", "1", "openai/humaneval")
    with pytest.raises(InvalidItem) as caught:
        manager.validate(bad)
    assert "'openai/humaneval'" in caught.value.message
    assert "arith" in caught.value.message and "gsm8k" in caught.value.message
    assert caught.value.status is Status.INVALID_INPUT
    with pytest.raises(InvalidItem):  # score() on its own does not score it 0 either
        score(manager, bad)


def test_naive_unknown_source_warn_mode(caplog: pytest.LogCaptureFixture) -> None:
    manager = naive(unknown_source="warn")
    manager.validate(item("Answer: 1", "1", "mystery"))  # accepted for queueing
    caplog.set_level(logging.WARNING, logger="relayrl.reward.managers.naive")
    for n in range(5):
        outcome = asyncio.run(outcome_of(manager.score(item("x", "1", "mystery", f"m{n}"))))
        assert isinstance(outcome, InvalidItem)
        assert outcome.status is Status.INVALID_INPUT
    outcome = asyncio.run(outcome_of(manager.score(item("x", "1", "other"))))
    assert isinstance(outcome, InvalidItem)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # once per source
    assert "'mystery'" in warnings[0] and "'other'" in warnings[1]


def test_naive_default_source() -> None:
    manager = naive(default_source="arith")
    assert_correct(score(manager, item("Answer: 3", "3")))
    manager.validate(item("Answer: 3", "3"))
    # an explicit data_source still wins
    assert_correct(score(manager, item("#### 3", "3", "gsm8k")))
    without = naive()
    with pytest.raises(InvalidItem, match="data_source is empty"):
        without.validate(item("Answer: 3", "3"))


def test_naive_restricted_data_sources() -> None:
    manager = naive(data_sources=["gsm8k", "arith"])
    assert manager.data_sources == ("gsm8k", "arith")
    assert_correct(score(manager, item("#### 3", "3", "gsm8k")))
    with pytest.raises(InvalidItem) as caught:
        manager.validate(item(r"\boxed{3}", "3", "math"))
    assert "knows: arith, gsm8k" in caught.value.message


def test_naive_validate_rejects_missing_ground_truth() -> None:
    manager = naive(unknown_source="warn")
    with pytest.raises(InvalidItem, match="ground_truth is empty"):
        manager.validate(item("Answer: 3", "  ", "arith"))
    with pytest.raises(InvalidItem):
        score(manager, item("Answer: 3", "", "arith"))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"data_sources": ["gsm8k", "humaneval"]}, "'humaneval' (known: DigitalLearningGmbH"),
        ({"data_sources": []}, "at least 1"),
        ({"data_sources": ["arith", "arith"]}, "twice"),
        ({"default_source": "humaneval"}, "default_source 'humaneval'"),
        ({"data_sources": ["arith"], "default_source": "gsm8k"}, "(known: arith)"),
        ({"default_source": ""}, "at least 1"),
        ({"unknown_source": "ignore"}, "'warn' or 'error'"),
        ({"scorer": "gsm8k"}, "Extra inputs are not permitted"),
    ],
)
def test_naive_config_errors(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError) as caught:
        NaiveConfig.model_validate({"type": "naive", **fields})
    assert fragment in str(caught.value)


def test_naive_config_requires_its_type() -> None:
    with pytest.raises(ValidationError):
        NaiveConfig.model_validate({})
    with pytest.raises(ValidationError):
        NaiveConfig.model_validate({"type": "gdpo"})
    config = NaiveConfig.model_validate({"type": "naive", "description": "rules", "timeout_s": 5})
    assert config.unknown_source == "error" and config.data_sources is None


def test_importing_the_config_does_not_import_sympy() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import relayrl.reward.managers.naive; "
        "import relayrl.reward.managers.rules as r; "
        "assert r.math_equal('1/2', '0.5'); "
        "print('sympy' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
