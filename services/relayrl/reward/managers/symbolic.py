"""Symbolic equivalence of two final answers for the `math` rule (`rules.math_equal`):
Hugging Face's math-verify parses the LaTeX into sympy and decides, behind limits of ours that
keep a hostile answer from costing more than milliseconds.

`rules` imports this module only when the cheap comparisons (strings, plain numbers) leave a
pair undecided: importing it imports sympy and math-verify.

Why the limits. math-verify bounds its own work with SIGALRM, which works only in the main
thread, and the reward-service scores in worker threads (`asyncio.to_thread`), so here its
timeouts are off. Without them `\\boxed{9^{9^{9}}}` compared with `1` runs past a minute, and
with them it still costs their 5 s. So, in order:

- an answer over MAX_SYMBOLIC_CHARS or nested deeper than MAX_NESTING_DEPTH is not parsed (the
  parser's time doubles with each level: 15 nested braces take seconds);
- each parsed answer is evaluated once, bottom-up, with every power, exponential and factorial
  checked first (`screen`): one that would compute a huge number or expand a huge power is
  refused before math-verify evaluates it, which it could not be stopped in (one long integer
  operation in C);
- the rest runs under DEADLINE_S, enforced in whichever thread scores (`run_with_deadline`).

Only math-verify's LaTeX extraction is used: its plain-expression extraction hands the text to
sympy's `parse_expr`, which calls `eval`.
"""

from __future__ import annotations

import cmath
import ctypes
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import sympy as sp
from math_verify import LatexExtractionConfig, parse, verify
from sympy.functions.combinatorial.factorials import CombinatorialFunction
from sympy.functions.elementary.hyperbolic import HyperbolicFunction
from sympy.functions.elementary.trigonometric import TrigonometricFunction

T = TypeVar("T")

# Longest answer handed to math-verify, and deepest nesting of (), [] and {} in it.
MAX_SYMBOLIC_CHARS = 250
MAX_NESTING_DEPTH = 8
# Longest a comparison may run (parsing both answers and verifying), in any thread.
DEADLINE_S = 5.0
# Bounds of the evaluation that `screen` allows.
MAX_POWER_BITS = 40_000  # a rational raised to an integer may have about this many bits
MAX_RATIONAL_EXPONENT = 10_000  # |n| of rational ** n
MAX_SYMBOLIC_EXPONENT = 64  # |n| of x ** n, (1 + sqrt(2)) ** n, after sympy merges powers
MAX_EXPONENT_ATOM = 10**6  # numbers inside a non-numeric exponent (2^{100\pi}) or sin()
MAX_COMBINATORIAL_ARGUMENT = 10_000  # n of n!, \binom{n}{k}

_LATEX_ONLY = (LatexExtractionConfig(),)
_PERCENT = re.compile(r"\\?%|\\percent(?![a-zA-Z])")
_GROWTH_FUNCTIONS = (sp.exp, TrigonometricFunction, HyperbolicFunction)


class _DropOwnTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off and that the caller must
    bound the work itself; `run_with_deadline` does, so an operator need not read it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropOwnTimeoutWarning())


class TooCostly(Exception):
    """Comparing the answer would cost more than the limits allow; it is refused (not equal)."""


@dataclass(frozen=True)
class Comparison:
    """The verdict on a pair of answers."""

    equal: bool
    refused: str = ""
    """Why the pair was not compared (a limit, the deadline); empty when it was."""


def answers_equal(predicted: str, expected: str) -> Comparison:
    """Whether math-verify finds `predicted` equivalent to `expected` (the ground truth's
    answer), both raw LaTeX as extracted; a percent sign is dropped first, so `50\\%` is 50."""
    for text in (predicted, expected):
        if len(text) > MAX_SYMBOLIC_CHARS:
            return Comparison(False, f"over {MAX_SYMBOLIC_CHARS} characters")
        if _nesting_depth(text) > MAX_NESTING_DEPTH:
            return Comparison(False, f"nested deeper than {MAX_NESTING_DEPTH}")
    try:
        equal = run_with_deadline(lambda: _verified(predicted, expected), DEADLINE_S)
    except TooCostly as exc:
        return Comparison(False, str(exc))
    except Exception as exc:
        # sympy raises many kinds of exception on odd input (deep nesting: RecursionError): an
        # answer that cannot be shown equal is not equal, never a scorer failure.
        return Comparison(False, f"the comparison failed: {type(exc).__name__}")
    if equal is None:
        return Comparison(False, f"stopped at the {DEADLINE_S:g} s deadline")
    return Comparison(equal)


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth -= 1
    return deepest


def _parsed(answer: str) -> list[Any]:
    """math-verify's parse of one answer (sympy objects, then the normalised LaTeX as a string
    fallback), with `i` as the imaginary unit and every sympy object screened."""
    found = parse(
        "\\boxed{" + _PERCENT.sub("", answer) + "}",
        extraction_config=_LATEX_ONLY,
        parsing_timeout=None,  # type: ignore[arg-type] - None turns its SIGALRM off
    )
    out = []
    for value in found:
        if not isinstance(value, str):
            value = _imaginary_unit(value)
            screen(value)
        out.append(value)
    return out


def _verified(predicted: str, expected: str) -> bool:
    gold = _parsed(expected)
    answer = _parsed(predicted)
    if not gold or not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=None))


def _imaginary_unit(value: Any) -> Any:
    """math-verify reads `i` as a variable (only `I` is the unit), so `e^{i\\pi}` would not be
    -1; in a MATH answer `i` is the imaginary unit."""
    symbols = {s: sp.I for s in getattr(value, "free_symbols", ()) if s.name == "i"}
    return value.xreplace(symbols) if symbols else value


# --------------------------------------------------------------------------------------------
# screen: refuse what would compute a huge number
# --------------------------------------------------------------------------------------------


def screen(value: Any) -> Any:
    """`value` evaluated bottom-up with each power, exponential and factorial checked before
    sympy computes it; raises TooCostly for `9^{9^{9}}`, `x^{1000}`, `e^{e^{e^{10}}}`,
    `(10^{6})!` and the like. Returns the evaluated stand-in (only the checks use it)."""
    if isinstance(value, sp.MatrixBase) and not isinstance(value, sp.Basic):
        for element in value:
            screen(element)
        return value
    if not isinstance(value, sp.Basic) or not value.args:
        return value
    args = [screen(arg) for arg in value.args]
    if isinstance(value, sp.Pow):
        result = _checked_pow(args[0], args[1])
    elif isinstance(value, _GROWTH_FUNCTIONS):
        for arg in args:
            _check_growth_argument(arg)
        result = value.func(*args)
        _check_magnitude(result)
    elif isinstance(value, CombinatorialFunction):
        if any(a.is_Number and abs(a) > MAX_COMBINATORIAL_ARGUMENT for a in args):
            raise TooCostly("a factorial or binomial of a large number")
        result = value.func(*args)
    elif isinstance(value, (sp.Add, sp.Mul)):
        result = value.func(*args)
    else:
        return value  # sets, relations, other functions: their arguments are checked
    _check_merged_powers(result)
    return result


def _bits(value: Any) -> int:
    return int(value.p).bit_length() + int(value.q).bit_length()


def _checked_pow(base: Any, exponent: Any) -> Any:
    if exponent.is_Number:
        if not exponent.is_Rational:
            raise TooCostly("a non-rational numeric exponent")
        size = abs(exponent)
        if exponent.q > MAX_SYMBOLIC_EXPONENT:
            raise TooCostly("an exponent with a large denominator")
        if base.is_Rational:
            if size > MAX_RATIONAL_EXPONENT or _bits(base) * size > MAX_POWER_BITS:
                raise TooCostly("a power too large to compute")
        elif size > MAX_SYMBOLIC_EXPONENT:
            raise TooCostly("a power of an expression with a large exponent")
    else:
        _check_growth_argument(exponent)
    return sp.Pow(base, exponent)


def _check_growth_argument(argument: Any) -> None:
    """The argument of exp, sin, cosh, ... or a symbolic exponent holds no other exponential
    and only moderate numbers: evaluating `e^{e^{e^{100}}}` or `\\sin(e^{10^{6}})` needs
    astronomically many digits."""
    if not isinstance(argument, sp.Basic):
        raise TooCostly("a matrix or set inside an exponent or a function")
    for atom in argument.atoms(sp.Rational):
        if abs(atom.p) > MAX_EXPONENT_ATOM or atom.q > MAX_EXPONENT_ATOM:
            raise TooCostly("a large number inside an exponent or a function")
    if argument.has(sp.exp) or any(not p.exp.is_Number for p in argument.atoms(sp.Pow)):
        raise TooCostly("an exponential inside an exponent or a function (a tower)")


def _check_merged_powers(result: Any) -> None:
    # sympy merges powers as it builds (x^{64}x^{64} is x^{128}, ((1+\sqrt{2})^{64})^{64} is
    # (1+\sqrt{2})^{4096}): a large one would be expanded for seconds.
    for power in result.atoms(sp.Pow):
        large = power.exp.is_Number and abs(power.exp) > MAX_SYMBOLIC_EXPONENT
        if large and not power.base.is_Rational:
            raise TooCostly("a power of an expression with a large exponent")


def _check_magnitude(result: Any) -> None:
    """A number beyond a float's range (e^{2187}) is refused: sympy's simplify can spend
    minutes on one."""
    if not result.is_number or result.has(sp.oo, -sp.oo, sp.zoo, sp.nan):
        return
    if not cmath.isfinite(complex(sp.N(result, 15))):
        raise TooCostly("a number beyond a float's range")


# --------------------------------------------------------------------------------------------
# a deadline in any thread
# --------------------------------------------------------------------------------------------


class _DeadlineExceeded(BaseException):
    """Raised inside the comparing thread at its deadline. A BaseException, so that the
    libraries' `except Exception` handlers let it through."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    # None clears an exception that is set and not raised yet.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


def run_with_deadline(function: Callable[[], T], deadline_s: float) -> T | None:
    """`function()`, or None if it runs past `deadline_s`. Works in any thread: at the deadline
    a timer raises an exception in the calling thread (CPython's PyThreadState_SetAsyncExc).
    It is raised at the next bytecode, as math-verify's SIGALRM handler would be in the main
    thread, so a single long operation in C is not cut short (`screen` refuses those)."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(thread_id, _DeadlineExceeded)

    timer = threading.Timer(deadline_s, interrupt)
    timer.daemon = True
    try:
        try:
            timer.start()  # in the try: a short deadline can pass before start() returns
            return function()
        finally:
            with lock:
                state["done"] = True
                if state["fired"]:
                    _set_async_exc(thread_id, None)
            timer.cancel()
    except _DeadlineExceeded:
        return None
