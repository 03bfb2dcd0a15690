"""The `math` rule's symbolic comparison (math-verify behind our limits): it runs in any
thread, refuses what would compute a huge number, and stops at its deadline."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from relayrl.reward.managers import symbolic
from relayrl.reward.managers.symbolic import Comparison, answers_equal, run_with_deadline

# Passes the screen (no power, exponential or factorial is large) and then keeps sympy busy
# for minutes: only the deadline stops it.
PAST_THE_SCREEN = r"\sum_{k=1}^{100000} k^{k}"


def in_worker_thread(function, *args):  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(function, *args).result(timeout=60)


def test_a_comparison_runs_in_a_worker_thread() -> None:
    # math-verify's own timeouts (SIGALRM) raise ValueError outside the main thread
    assert in_worker_thread(answers_equal, r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}") == (
        Comparison(True)
    )
    assert in_worker_thread(answers_equal, "(x+1)^3", "x^2+2x+1") == Comparison(False)


def test_an_answer_past_the_screen_stops_at_the_deadline_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(symbolic, "DEADLINE_S", 0.5)
    with ThreadPoolExecutor(max_workers=1) as pool:
        start = time.perf_counter()
        stopped = pool.submit(answers_equal, PAST_THE_SCREEN, "1").result(timeout=60)
        assert time.perf_counter() - start < 5.0
        assert stopped == Comparison(False, "stopped at the 0.5 s deadline")
        # the same thread goes on comparing, with nothing left pending from the deadline
        assert pool.submit(answers_equal, "2x", "x+x").result(timeout=60) == Comparison(True)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("9^{9^{9}}", "a power too large to compute"),
        ("x^{100}", "a power of an expression with a large exponent"),
        ("((1+\\sqrt{2})^{64})^{64}", "a power of an expression with a large exponent"),
        ("2^{2^{x}}", "an exponential inside an exponent or a function (a tower)"),
        ("\\sin(e^{10^{9}})", "a large number inside an exponent or a function"),
        ("\\exp(3^{7})", "a number beyond a float's range"),
        ("(10^{6})!", "a factorial or binomial of a large number"),
        ("\\binom{10^{9}}{5 \\cdot 10^{8}}", "a factorial or binomial of a large number"),
        ("1" * 251, "over 250 characters"),
        ("(" * 9 + "1" + ")" * 9, "nested deeper than 8"),
    ],
)
def test_costly_answers_are_refused_fast(answer: str, reason: str) -> None:
    answers_equal("1", "2")  # math-verify warmed up before timing
    start = time.perf_counter()
    assert answers_equal(answer, "x+1") == Comparison(False, reason)
    assert time.perf_counter() - start < 1.0


def test_the_ground_truth_is_screened_too() -> None:
    assert answers_equal("1", "9^{9^{9}}") == Comparison(False, "a power too large to compute")


def test_run_with_deadline_returns_the_value_or_none() -> None:
    assert run_with_deadline(lambda: 42, 5.0) == 42

    def spin() -> int:
        while True:
            pass

    start = time.perf_counter()
    assert run_with_deadline(spin, 0.2) is None
    assert time.perf_counter() - start < 2.0


def test_run_with_deadline_lets_other_exceptions_through() -> None:
    def fail() -> None:
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        run_with_deadline(fail, 5.0)


def test_a_deadline_that_races_the_return_leaks_nothing() -> None:
    # Deadlines about as long as the work: the timer often fires while the call returns. Its
    # exception must be raised inside run_with_deadline or cleared, never later in the caller.
    leaked = []

    def work() -> int:
        total = 0
        for i in range(2_000):
            total += i
        return total

    def many() -> None:
        for _ in range(300):
            try:
                run_with_deadline(work, 0.0001)
                sum(range(1_000))  # bytecode where a leaked exception would surface
            except BaseException as exc:  # what the test looks for
                leaked.append(exc)

    thread = threading.Thread(target=many)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert leaked == []
