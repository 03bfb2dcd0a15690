"""Rule scorers: pure functions that judge a response against a ground truth without a model or
a sandbox, chosen by the item's `data_source` (the `naive` manager dispatches to them).

A rule scorer takes a `RewardItem` and returns a `Verdict`: 1.0 / OK for a correct final
answer, 0.0 / POLICY_FAIL for a wrong or missing one (the message says what was extracted and
what was expected, so a reward curve can be debugged from a sample of results). An item that
cannot be judged at all (no ground truth, a ground truth that is not an answer) raises
`InvalidItem`: a broken dataset row must not train the policy towards 0.

`RULE_SCORERS` is a closed, read-only table: adding a data source means adding a function here
(or writing a manager of one's own), never registering one at import time somewhere else.

Math answers are compared symbolically with sympy, which is imported only when a comparison
needs it (string and plain-number comparisons settle most items without it). The policy's
text is untrusted: it is never handed to `eval` (sympy's `parse_expr` uses `eval`, so it is not
used); a small parser of our own turns a whitelisted, length-capped expression into sympy
objects, and powers whose result would be huge (`9^{9^{9}}`) are refused before sympy
computes them, so a hostile answer costs milliseconds and fails.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from relayrl.reward.items import InvalidItem, RewardItem, Status, Verdict

if TYPE_CHECKING:
    import sympy

RuleScorer = Callable[[RewardItem], Verdict]

# Longest extracted answer or ground truth quoted in a verdict's message.
MESSAGE_QUOTE_CHARS = 80
# Longest answer that is compared at all (a longer "final answer" is not an answer).
MAX_ANSWER_CHARS = 2000
# Longest number read as a plain number (Python refuses int() of over 4300 digits).
MAX_NUMBER_CHARS = 100
# Longest expression handed to the symbolic comparison, after LaTeX is turned into plain syntax.
MAX_SYMBOLIC_CHARS = 200
# Relative tolerance of numeric comparisons (0.5 vs \frac{1}{2}, 3.14159265 vs \pi).
NUMERIC_REL_TOL = 1e-6
NUMERIC_ABS_TOL = 1e-9
# Bounds that keep sympy's work small on hostile input (see `_safe_pow`).
MAX_LITERAL_DIGITS = 60
MAX_POWER_BITS = 40_000  # a rational raised to an integer may have about this many bits
MAX_RATIONAL_EXPONENT = 10_000  # |n| of rational ** n
MAX_SYMBOLIC_EXPONENT = 64  # |n| of x ** n, (1 + sqrt(2)) ** n
MAX_EXPONENT_ATOM = 10**6  # numbers inside a non-numeric exponent (2^{100\pi}) or sin()
MAX_TUPLE_ELEMENTS = 20
MAX_SIMPLIFY_OPS = 120
# Points where expressions with free symbols are evaluated before sympy's simplify is asked:
# fixed, so the same answer always gets the same reward.
SPOT_CHECK_VALUES = (0.5772156649, 1.3247179572, 2.2360679775, -0.8346268417)


def _verdict(correct: bool, extracted: str, expected: str, note: str = "") -> Verdict:
    extra = f" ({note})" if note else ""
    message = f"extracted {_quote(extracted)}{extra}, expected {_quote(expected)}"
    if correct:
        return Verdict(1.0, Status.OK, message=message)
    return Verdict(0.0, Status.POLICY_FAIL, message=message)


def _no_answer(what: str, expected: str) -> Verdict:
    return Verdict(0.0, Status.POLICY_FAIL, message=f"no {what} found, expected {_quote(expected)}")


def _quote(text: str) -> str:
    if len(text) > MESSAGE_QUOTE_CHARS:
        text = text[: MESSAGE_QUOTE_CHARS - 3] + "..."
    return repr(text)


def _require_ground_truth(item: RewardItem) -> str:
    ground_truth = item.ground_truth.strip()
    if not ground_truth:
        raise InvalidItem(
            f"item {item.item_id!r}: data_source {item.data_source!r} is scored against a "
            "ground truth, and ground_truth is empty"
        )
    return ground_truth


# --------------------------------------------------------------------------------------------
# gsm8k
# --------------------------------------------------------------------------------------------

# A number as GSM8K writes it: optional sign (not a hyphen between words or numbers: "3-5"),
# optional $, thousands groups or plain digits, optional decimals.
_GSM8K_NUMBER = re.compile(
    r"(?:(?<![\w)\]])(?P<sign>-))?\$?\s?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_GSM8K_MARK = "####"


def _gsm8k_number(match: re.Match[str]) -> Fraction | None:
    digits = match["digits"].replace(",", "")
    if len(digits) > MAX_NUMBER_CHARS:
        return None
    return Fraction((match["sign"] or "") + digits)


def extract_gsm8k_answer(response: str) -> tuple[Fraction, bool] | None:
    """The response's final answer and whether it used the strict `#### <number>` format.

    Strict: the first number after the last `####`. Flexible (no usable `####`): the last number
    anywhere, which is what a model that was never taught the format usually ends with."""
    text = response.replace("\u2212", "-")
    mark = text.rfind(_GSM8K_MARK)
    if mark >= 0:
        match = _GSM8K_NUMBER.search(text, mark + len(_GSM8K_MARK))
        if match is not None:
            value = _gsm8k_number(match)
            return None if value is None else (value, True)
    last = None
    for last in _GSM8K_NUMBER.finditer(text):  # noqa: B007 - the last match is the answer
        pass
    if last is None:
        return None
    value = _gsm8k_number(last)
    return None if value is None else (value, False)


def gsm8k_ground_truth(ground_truth: str) -> Fraction:
    """The number a GSM8K ground truth states: a whole solution ending in `#### 42`, or `42`.
    Raises ValueError when it states none."""
    text = ground_truth.replace("\u2212", "-")
    mark = text.rfind(_GSM8K_MARK)
    if mark >= 0:
        text = text[mark + len(_GSM8K_MARK) :]
    text = text.strip().rstrip(".").strip()
    match = _GSM8K_NUMBER.fullmatch(text)
    value = _gsm8k_number(match) if match is not None else None
    if value is None:
        raise ValueError(f"ground truth {_quote(ground_truth)} is not a number")
    return value


def _format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return str(float(value))


GSM8K_FLEXIBLE_SCORE = 0.5
"""The reward of a right number that the response did not put after `####`
(docs/rewards.md#gsm8k)."""


def score_gsm8k(item: RewardItem) -> Verdict:
    """GSM8K final-answer match: the extracted number equals the ground truth's (42.0 == 42,
    $1,000 == 1000). A right answer after `####` (the format GSM8K's prompts ask for) scores
    1; a right last number without it scores GSM8K_FLEXIBLE_SCORE (verl's scorer gives it 0,
    which leaves a model that has not learned the format without any signal)."""
    raw_truth = _require_ground_truth(item)
    try:
        expected = gsm8k_ground_truth(raw_truth)
    except ValueError as exc:
        raise InvalidItem(f"item {item.item_id!r}: {exc}") from None
    found = extract_gsm8k_answer(item.response)
    if found is None:
        return _no_answer("number", _format_number(expected))
    value, strict = found
    verdict = _verdict(
        value == expected,
        _format_number(value),
        _format_number(expected),
        "strict" if strict else "flexible",
    )
    if verdict.status is Status.OK and not strict:
        return Verdict(GSM8K_FLEXIBLE_SCORE, Status.OK, message=verdict.message)
    return verdict


# --------------------------------------------------------------------------------------------
# math: extraction
# --------------------------------------------------------------------------------------------

_BOX_COMMANDS = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_ANSWER_PHRASE = re.compile(r"(?i)\banswer\s*(?:is\s*:?|:)[ \t]*")
_HOPE_SUFFIX = re.compile(r"(?i)I hope it is correct")


def _brace_group(text: str, start: int) -> tuple[str, int] | None:
    """The contents of the `{...}` opening at `text[start]` (nested braces balanced, `\\{` and
    `\\}` skipped) and the index after its `}`; None when unbalanced."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` or `\\fbox{...}` (also `\\boxed 5`); None if there is
    none or the last one is not closed (a truncated response: an earlier box was not the
    final answer, and scanning every earlier one would make a hostile response quadratic)."""
    last = None
    for last in _BOX_COMMANDS.finditer(text):  # noqa: B007 - the last match is the answer
        pass
    if last is None:
        return None
    i = last.end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        group = _brace_group(text, i)
        return group[0] if group is not None else None
    if i > last.end():  # `\boxed 5`: up to the end of the math or the line
        rest = re.match(r"[^$\n]+", text[i:])
        if rest is not None:
            return rest.group(0).strip()
    return None


def _strip_delimiters(answer: str) -> str:
    answer = answer.strip()
    for _ in range(3):
        before = answer
        answer = answer.strip().rstrip(".").strip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if answer.startswith(left) and answer.endswith(right) and len(answer) > 2 * len(left):
                answer = answer[len(left) : -len(right)]
        if answer == before:
            break
    return answer.strip()


def extract_math_answer(response: str) -> str | None:
    """The response's final answer: the last `\\boxed{}`, else the text after the last
    "answer is" / "Answer:" (Minerva's "Final Answer: The final answer is $X$. I hope it is
    correct." included); None when there is neither."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    last = None
    # The last phrase wins, so "Final Answer: The final answer is $5$." gives "$5$.".
    for last in _ANSWER_PHRASE.finditer(response):  # noqa: B007 - the last match is the answer
        pass
    if last is None:
        return None
    end = response.find("\n", last.end())
    answer = response[last.end() : end if end >= 0 else len(response)][:MAX_ANSWER_CHARS]
    hope = _HOPE_SUFFIX.search(answer)
    if hope is not None:
        answer = answer[: hope.start()]
    opening = re.search(r"\$+", answer)
    if opening is not None:  # "is $5$ because ..." -> the first math span
        closing = answer.find("$", opening.end())
        if closing > opening.end():
            answer = answer[opening.end() : closing]
    answer = _strip_delimiters(answer)
    return answer or None


def math_ground_truth(ground_truth: str) -> str:
    """A MATH ground truth is either a whole solution (its last `\\boxed{}` is the answer) or
    the answer itself (DAPO, MATH-500)."""
    boxed = last_boxed(ground_truth)
    return (boxed if boxed is not None else _strip_delimiters(ground_truth)).strip()


# --------------------------------------------------------------------------------------------
# math: normalisation
# --------------------------------------------------------------------------------------------

_TEXT_COMMANDS = ("text", "textbf", "textit", "mbox", "mathrm", "mathbf", "boldsymbol")
_TEXT_COMMAND = re.compile(r"\\(?:" + "|".join(_TEXT_COMMANDS) + r")(?![a-zA-Z])\s*")
_SPACING = re.compile(r"\\[!,;:> ]|\\(?:displaystyle|left|right|quad|qquad)(?![a-zA-Z])|~")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])|°|\\degree")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SHORT_LHS = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?")
_CHOICE = re.compile(r"\(([A-Za-z])\)")


def _text_groups(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, contents) of each top-level `\\text{...}`-like group."""
    for match in _TEXT_COMMAND.finditer(text):
        group = _brace_group(text, match.end())
        if group is not None:
            yield match.start(), group[1], group[0]


def _drop_units_and_unwrap_text(text: str) -> str:
    # Trailing \text{...} after a value are units ("5\text{ cm}"); a wholly textual answer
    # ("\text{(C)}", "\text{Monday}") keeps its words.
    while True:
        groups = list(_text_groups(text))
        if not groups or groups[-1][1] != len(text.rstrip()):
            break
        start = groups[-1][0]
        if not text[:start].strip():
            break
        text = text[:start].rstrip()
    for _ in range(10):  # unwrap the rest, innermost nesting last
        groups = list(_text_groups(text))
        if not groups:
            break
        start, end, contents = groups[0]
        text = text[:start] + contents + text[end:]
    return text


def _fix_shorthand(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{x}`, `\\sqrt2` -> `\\sqrt{2}`."""
    text = re.sub(r"\\sqrt\s*([0-9a-zA-Z])", r"\\sqrt{\1}", text)
    out = []
    i = 0
    while i < len(text):
        if text.startswith("\\frac", i) and not text[i + 5 : i + 6].isalpha():
            out.append("\\frac")
            i += 5
            for _ in range(2):
                while i < len(text) and text[i] == " ":
                    i += 1
                if i < len(text) and text[i] not in "{\\":
                    out.append("{" + text[i] + "}")
                    i += 1
                else:
                    group = _brace_group(text, i)
                    if group is None:
                        break
                    out.append(text[i : group[1]])
                    i = group[1]
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _remove_spaces(text: str) -> str:
    # A space that ends a command before a letter is kept ("\pi r", "\ln x").
    parts = re.split(r"(\\[a-zA-Z]+\s+(?=[a-zA-Z]))", text)
    return "".join(
        re.sub(r"\s+", " ", part).rstrip() + " " if i % 2 else re.sub(r"\s+", "", part)
        for i, part in enumerate(parts)
    ).strip()


def _strip_outer_braces(text: str) -> str:
    while text.startswith("{") and (group := _brace_group(text, 0)) and group[1] == len(text):
        text = group[0]
    return text


def normalize_math_answer(answer: str) -> str:
    """A canonical spelling of a final answer, so that equal answers written differently
    compare equal as strings: LaTeX spacing, `\\left`/`\\right`, `\\dfrac`, `$`, degrees,
    units in `\\text{}`, thousands separators, `\\frac12`, a trailing '.', `x=` and spaces go.

    Percent signs are dropped, so `50\\%` equals `50` (MATH writes `50\\%` where models often
    write 50), but not `0.5`."""
    text = answer.replace("\n", " ").strip()
    text = _strip_delimiters(text)
    text = text.replace("\\\\", "\\")
    text = _SPACING.sub(" ", text)
    text = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", text)
    text = _DEGREES.sub("", text)
    text = re.sub(r"\\?\$|\\?%|\\percent(?![a-zA-Z])", "", text)
    text = _drop_units_and_unwrap_text(text)
    text = text.replace("{,}", "")
    text = _fix_shorthand(text)
    text = _remove_spaces(text)
    text = _strip_outer_braces(text)
    text = text.rstrip(".").rstrip("\\").strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    text = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", text)
    if text.count("=") == 1:
        lhs, rhs = text.split("=")
        if _SHORT_LHS.fullmatch(lhs.strip()) and rhs.strip():
            text = rhs.strip()
    text = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", text)
    choice = _CHOICE.fullmatch(text)
    if choice is not None:
        text = choice.group(1)
    return _strip_outer_braces(text)


# --------------------------------------------------------------------------------------------
# math: comparison
# --------------------------------------------------------------------------------------------

_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")
_PLAIN_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_BRACKETS = {"(": ")", "[": "]"}


def _plain_number(text: str) -> Fraction | None:
    """A number without sympy: `-3`, `0.25`, `\\frac{1}{2}`, `-\\frac{3}{4}`."""
    if _PLAIN_NUMBER.fullmatch(text):
        return Fraction(text)
    match = _PLAIN_FRACTION.fullmatch(text)
    if match is not None and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) else value
    return None


def _numbers_close(a: Fraction, b: Fraction) -> bool:
    """Integers compare exactly (1000001 is not 1000000); anything else within the relative
    tolerance (0.3333333 is 1/3). Exact arithmetic, so 10^{400} does not overflow."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    tolerance = max(Fraction(NUMERIC_REL_TOL) * max(abs(a), abs(b)), Fraction(NUMERIC_ABS_TOL))
    return abs(a - b) <= tolerance


def _complex_close(a: complex, b: complex) -> bool:
    return abs(a - b) <= max(NUMERIC_REL_TOL * max(abs(a), abs(b)), NUMERIC_ABS_TOL)


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside (), [], {} (and `\\{ \\}`)."""
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    while i < len(text):
        if text.startswith(separator, i) and depth == 0:
            parts.append(text[start:i])
            i += len(separator)
            start = i
            continue
        char = text[i]
        if char == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            depth += 1 if text[i + 1] == "{" else -1
            i += 2
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        i += 1
    parts.append(text[start:])
    return parts


def _sequence(text: str) -> tuple[str, str, list[str]] | None:
    """A tuple, interval, set or list: (opening, closing, elements), or None. Unbracketed
    lists ("1,-2") come back with empty brackets."""
    for left, right in (("\\{", "\\}"), *_BRACKETS.items(), ("(", "]"), ("[", ")")):
        if text.startswith(left) and text.endswith(right) and len(text) > len(left + right):
            inner = text[len(left) : -len(right)]
            if _balanced(inner):
                elements = _split_top_level(inner, ",")
                if len(elements) > 1 or left == "\\{":
                    return left, right, elements
    elements = _split_top_level(text, ",")
    if len(elements) > 1:
        return "", "", elements
    return None


def _kind(sequence: tuple[str, str, list[str]]) -> tuple[str, str]:
    """A set `\\{1,2\\}` and a bare list `1, 2` (all solutions) are the same kind: unordered."""
    return ("", "") if sequence[0] == "\\{" else sequence[:2]


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if depth < 0:
            return False
    return depth == 0


def math_equal(predicted: str, expected: str) -> bool:
    """Whether two final answers are the same: as normalised strings (text case-insensitively),
    as numbers (relative tolerance 1e-6), element by element for tuples and intervals (sets
    and unbracketed lists in any order), else symbolically (sympy's simplify of the difference
    is 0)."""
    if len(predicted) > MAX_ANSWER_CHARS or len(expected) > MAX_ANSWER_CHARS:
        return False
    return _equal(normalize_math_answer(predicted), normalize_math_answer(expected), depth=0)


def _equal(a: str, b: str, depth: int) -> bool:
    if a == b:
        return True
    if not a or not b:
        return False
    if a.casefold() == b.casefold() and not re.search(r"[\d\\]", b):
        return True  # a textual answer ("Monday", "(C)")
    if depth < 3:
        unions = _split_top_level(a, "\\cup"), _split_top_level(b, "\\cup")
        if len(unions[0]) > 1 or len(unions[1]) > 1:
            return len(unions[0]) == len(unions[1]) and all(
                _equal(x, y, depth + 1) for x, y in zip(*unions, strict=True)
            )
        seq_a, seq_b = _sequence(a), _sequence(b)
        if seq_a is not None or seq_b is not None:
            return _sequences_equal(seq_a, seq_b, depth)
    num_a, num_b = _plain_number(a), _plain_number(b)
    if num_a is not None and num_b is not None:
        return _numbers_close(num_a, num_b)
    return _symbolic_equal(a, b)


def _sequences_equal(
    a: tuple[str, str, list[str]] | None, b: tuple[str, str, list[str]] | None, depth: int
) -> bool:
    if a is None or b is None or _kind(a) != _kind(b) or len(a[2]) != len(b[2]):
        return False
    left = _kind(a)[0]
    elems_a = a[2]
    elems_b = b[2]
    if len(elems_a) > MAX_TUPLE_ELEMENTS:
        return False
    elems_a = [normalize_math_answer(x) for x in elems_a]
    elems_b = [normalize_math_answer(x) for x in elems_b]
    if all(_equal(x, y, depth + 1) for x, y in zip(elems_a, elems_b, strict=True)):
        return True
    if left:  # tuples and intervals are ordered
        return False
    unmatched = list(elems_b)
    for x in elems_a:
        match = next((i for i, y in enumerate(unmatched) if _equal(x, y, depth + 1)), None)
        if match is None:
            return False
        unmatched.pop(match)
    return True


# --------------------------------------------------------------------------------------------
# math: LaTeX -> plain expression -> sympy (no eval)
# --------------------------------------------------------------------------------------------


class _Unparseable(Exception):
    """The answer is not an expression the symbolic comparison accepts."""


_SIMPLE_COMMANDS = {
    "pi": " pi ",
    "infty": " oo ",
    "cdot": "*",
    "times": "*",
    "ast": "*",
    "div": "/",
    "ln": " log ",
    "log": " log ",
    "sin": " sin ",
    "cos": " cos ",
    "tan": " tan ",
    "exp": " exp ",
}
_NAMES = ("sqrt", "exp", "log", "sin", "cos", "tan", "ln", "pi", "oo")
_PLAIN_WHITELIST = re.compile(r"[0-9a-zA-Z+\-*/^(). ]*")
_COMMAND = re.compile(r"\\([a-zA-Z]+)")


def latex_to_plain(text: str) -> str:
    """`\\frac{a}{b}` -> `((a)/(b))`, `\\sqrt[n]{x}` -> `((x)^(1/(n)))`, `\\pi` -> `pi`,
    `\\cdot` -> `*`, braces -> parentheses; raises _Unparseable on anything else (subscripts,
    `!`, `=`, unknown commands)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            piece, i = _convert_command(text, i)
            out.append(piece)
        elif char == "^":
            i += 1
            if i < len(text) and text[i] == "{":
                group = _brace_group(text, i)
                if group is None:
                    raise _Unparseable("unbalanced braces")
                out.append("^(" + latex_to_plain(group[0]) + ")")
                i = group[1]
            elif i < len(text) and text[i] == "\\":
                piece, i = _convert_command(text, i)
                out.append("^(" + piece + ")")
            elif i < len(text):
                out.append("^(" + text[i] + ")")  # TeX: x^23 is x^2 * 3
                i += 1
            else:
                raise _Unparseable("dangling ^")
        elif char in "{}":
            out.append("(" if char == "{" else ")")
            i += 1
        else:
            out.append(char)
            i += 1
    plain = "".join(out)
    if not _PLAIN_WHITELIST.fullmatch(plain):
        raise _Unparseable("characters outside the whitelist")
    return plain


def _convert_command(text: str, start: int) -> tuple[str, int]:
    match = _COMMAND.match(text, start)
    if match is None:
        raise _Unparseable(f"unsupported {text[start : start + 2]!r}")
    name, i = match.group(1), match.end()
    if name in _SIMPLE_COMMANDS:
        return _SIMPLE_COMMANDS[name], i
    if name == "frac":
        numerator, i = _required_group(text, i)
        denominator, i = _required_group(text, i)
        return f"(({latex_to_plain(numerator)})/({latex_to_plain(denominator)}))", i
    if name == "sqrt":
        index = None
        if text.startswith("[", i):
            close = text.find("]", i)
            if close < 0:
                raise _Unparseable("unclosed \\sqrt[")
            index, i = text[i + 1 : close], close + 1
        radicand, i = _required_group(text, i)
        if index is None:
            return f"sqrt({latex_to_plain(radicand)})", i
        return f"(({latex_to_plain(radicand)})^(1/({latex_to_plain(index)})))", i
    raise _Unparseable(f"unsupported command \\{name}")


def _required_group(text: str, start: int) -> tuple[str, int]:
    while start < len(text) and text[start] == " ":
        start += 1
    group = _brace_group(text, start)
    if group is None:
        raise _Unparseable("a command's argument is not a {...} group")
    return group


_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d*)?|\.\d+)|(?P<letters>[a-zA-Z]+)|(?P<op>[-+*/^()]))"
)


def _tokens(plain: str) -> list[tuple[str, str]]:
    """(kind, text) tokens; letter runs are split into known names and single letters. A run of
    letters only ("no", "yes") is a word, not a product of variables."""
    if re.fullmatch(r"\s*[a-zA-Z]{2,}\s*", plain) and plain.strip() not in _NAMES:
        raise _Unparseable("a word, not an expression")
    tokens: list[tuple[str, str]] = []
    plain = plain.replace("**", "^")
    position = 0
    while position < len(plain):
        match = _TOKEN.match(plain, position)
        if match is None:
            if plain[position:].strip():
                raise _Unparseable(f"unexpected {plain[position]!r}")
            break
        position = match.end()
        if match["number"] is not None:
            if len(match["number"]) > MAX_LITERAL_DIGITS:
                raise _Unparseable("a number literal is too long")
            tokens.append(("number", match["number"]))
        elif match["op"] is not None:
            tokens.append(("op", match["op"]))
        else:
            tokens.extend(_split_letters(match["letters"]))
    return tokens


def _split_letters(run: str) -> list[tuple[str, str]]:
    out = []
    i = 0
    while i < len(run):
        name = next((n for n in _NAMES if run.startswith(n, i)), None)
        if name is not None:
            out.append(("name", name))
            i += len(name)
        else:
            out.append(("name", run[i]))
            i += 1
    return out


class _Parser:
    """Recursive descent over +, -, *, /, ^, unary minus, implicit multiplication (`2x`,
    `2(x+1)`, `x y`), parentheses, sqrt/exp/log/ln/sin/cos/tan, and the constants pi, e, i
    (and I), oo; builds sympy objects directly, so nothing is ever evaluated as Python."""

    def __init__(self, tokens: list[tuple[str, str]], sp: Any) -> None:
        self.tokens = tokens
        self.position = 0
        self.sp = sp

    def parse(self) -> sympy.Expr:
        if not self.tokens:
            raise _Unparseable("empty expression")
        expr = self.expression()
        if self.position != len(self.tokens):
            raise _Unparseable(f"unexpected {self.tokens[self.position][1]!r}")
        return expr

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, op: str) -> bool:
        if self.peek() == ("op", op):
            self.position += 1
            return True
        return False

    def expression(self) -> sympy.Expr:
        expr = self.term()
        while True:
            if self.take("+"):
                expr = expr + self.term()
            elif self.take("-"):
                expr = expr - self.term()
            else:
                return expr

    def term(self) -> sympy.Expr:
        expr = self.unary()
        while True:
            token = self.peek()
            if self.take("*"):
                expr = expr * self.unary()
            elif self.take("/"):
                divisor = self.unary()
                if divisor == 0:
                    raise _Unparseable("division by zero")
                expr = expr / divisor
            elif token is not None and (token[0] != "op" or token[1] == "("):
                expr = expr * self.power()  # implicit multiplication
            else:
                return expr

    def unary(self) -> sympy.Expr:
        if self.take("-"):
            return -self.unary()
        if self.take("+"):
            return self.unary()
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.primary()
        if self.take("^"):
            return _safe_pow(self.sp, base, self.unary())
        return base

    def primary(self) -> sympy.Expr:
        sp = self.sp
        token = self.peek()
        if token is None:
            raise _Unparseable("the expression ends early")
        kind, text = token
        self.position += 1
        if kind == "number":
            return sp.Rational(text)
        if kind == "op":
            if text != "(":
                raise _Unparseable(f"unexpected {text!r}")
            expr = self.expression()
            if not self.take(")"):
                raise _Unparseable("unbalanced parentheses")
            return expr
        functions = {
            "sqrt": sp.sqrt,
            "exp": sp.exp,
            "log": sp.log,
            "ln": sp.log,
            "sin": sp.sin,
            "cos": sp.cos,
            "tan": sp.tan,
        }
        if text in functions:
            # `\\sqrt{3}^2` is (sqrt 3)^2: the argument is one primary, the power applies after
            argument = self.primary()
            if text not in ("sqrt", "log", "ln"):
                _check_growth_argument(sp, argument)
            return functions[text](argument)
        constants = {"pi": sp.pi, "e": sp.E, "i": sp.I, "I": sp.I, "oo": sp.oo}
        if text in constants:
            return constants[text]
        return sp.Symbol(text)


def _bits(value: Any) -> int:
    return int(value.p).bit_length() + int(value.q).bit_length()


def _safe_pow(sp: Any, base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """base ** exponent, refused when sympy would compute a huge number or expand a huge
    power: `9^{9^{9}}`, `x^{1000}`, `2^{10^{6}x}`."""
    if exponent.is_Number:
        if not exponent.is_Rational:
            raise _Unparseable("a non-rational numeric exponent")
        size = abs(exponent)
        if exponent.q > MAX_SYMBOLIC_EXPONENT:
            raise _Unparseable("an exponent with a large denominator")
        if base.is_Rational:
            if size > MAX_RATIONAL_EXPONENT or _bits(base) * size > MAX_POWER_BITS:
                raise _Unparseable("a power too large to compute")
        elif size > MAX_SYMBOLIC_EXPONENT:
            raise _Unparseable("a power of an expression with a large exponent")
    else:
        _check_growth_argument(sp, exponent)
    return sp.Pow(base, exponent)


def _check_growth_argument(sp: Any, argument: sympy.Expr) -> None:
    """The argument of exp, sin, cos, tan or a symbolic exponent holds no other exponential
    and only moderate numbers: evaluating `e^{e^{e^{100}}}` or `\\sin(e^{10^{6}})` needs
    astronomically many digits, and would never finish."""
    for atom in argument.atoms(sp.Rational):
        if abs(atom.p) > MAX_EXPONENT_ATOM or atom.q > MAX_EXPONENT_ATOM:
            raise _Unparseable("a large number inside an exponent or a function")
    if argument.has(sp.exp) or any(not p.exp.is_Number for p in argument.atoms(sp.Pow)):
        raise _Unparseable("an exponential inside an exponent or a function (a tower)")


def parse_math_expression(text: str) -> sympy.Expr:
    """A normalised answer as a sympy expression, or _Unparseable. Only a plain expression of
    at most MAX_SYMBOLIC_CHARS whitelisted characters reaches the parser, and the parser
    builds sympy objects itself (no eval)."""
    if len(text) > 2 * MAX_SYMBOLIC_CHARS:
        raise _Unparseable("too long for a symbolic comparison")
    plain = latex_to_plain(text)
    if len(plain) > MAX_SYMBOLIC_CHARS:
        raise _Unparseable("too long for a symbolic comparison")
    import sympy as sp  # lazy: most answers compare as strings or plain numbers

    expr = _Parser(_tokens(plain), sp).parse()
    # sympy merges powers as it builds (x^{64}x^{64} is x^{128}, ((1+\\sqrt{2})^{64})^{64} is
    # (1+\\sqrt{2})^{4096}): check the result too, or simplify would expand it for seconds.
    for power in expr.atoms(sp.Pow):
        large = power.exp.is_Number and abs(power.exp) > MAX_SYMBOLIC_EXPONENT
        if large and not power.base.is_Rational:
            raise _Unparseable("a power of an expression with a large exponent")
    return expr


def _symbolic_equal(a: str, b: str) -> bool:
    # sympy raises many kinds of exception on odd input (and deep nesting, RecursionError):
    # an answer that cannot be shown equal is not equal, never a scorer failure.
    try:
        return _expressions_equal(parse_math_expression(a), parse_math_expression(b))
    except Exception:
        return False


def _numeric(expr: Any, sp: Any) -> complex | None:
    value = sp.N(expr, 30)
    if not value.is_number or value.has(sp.oo, -sp.oo, sp.zoo, sp.nan):
        return None
    result = complex(value)
    if not (math.isfinite(result.real) and math.isfinite(result.imag)):
        return None
    return result


def _expressions_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    import sympy as sp

    if a == b:
        return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=lambda s: s.name)
    if not symbols:
        if a.has(sp.oo, sp.zoo, sp.nan) or b.has(sp.oo, sp.zoo, sp.nan):
            return False  # infinities compare structurally only (done above)
        if a.is_Rational and b.is_Rational:
            return _numbers_close(Fraction(int(a.p), int(a.q)), Fraction(int(b.p), int(b.q)))
        value_a, value_b = _numeric(a, sp), _numeric(b, sp)
        # A side too large for a float (e^{2187}) is equal only structurally (checked above):
        # sympy's simplify can spend minutes on such numbers.
        return value_a is not None and value_b is not None and _complex_close(value_a, value_b)
    # Cheap rejection first: different expressions almost always differ at a fixed point. A
    # point where either side has no finite value (a pole, an overflow) counts as a
    # difference: equal answers of sane size have values at these irrational-looking points.
    for shift in range(len(SPOT_CHECK_VALUES)):
        point = {
            s: SPOT_CHECK_VALUES[(shift + k) % len(SPOT_CHECK_VALUES)]
            for k, s in enumerate(symbols)
        }
        value_a = _numeric(a.subs(point), sp)
        value_b = _numeric(b.subs(point), sp)
        if value_a is None or value_b is None or not _complex_close(value_a, value_b):
            return False
    return _simplifies_to_zero(a - b, sp)


def _simplifies_to_zero(difference: Any, sp: Any) -> bool:
    """`simplify(a - b) == 0`, on a difference small enough for simplify to finish quickly
    (the cheap `expand` settles polynomials first)."""
    if difference == 0:
        return True
    if sp.count_ops(difference) > MAX_SIMPLIFY_OPS:
        return False
    if sp.expand(difference) == 0:
        return True
    return bool(sp.simplify(difference) == 0)


def score_math(item: RewardItem) -> Verdict:
    """MATH-style final answer: the last `\\boxed{}` (or "answer is ...") is equivalent to the
    ground truth's answer (see `math_equal`)."""
    expected = math_ground_truth(_require_ground_truth(item))
    if not expected:
        raise InvalidItem(f"item {item.item_id!r}: the ground truth holds no answer")
    answer = extract_math_answer(item.response)
    if answer is None:
        return _no_answer("\\boxed{} or 'answer is'", expected)
    return _verdict(math_equal(answer, expected), answer, expected)


# --------------------------------------------------------------------------------------------
# arith
# --------------------------------------------------------------------------------------------

_ARITH_MARK = "Answer:"
_INTEGER = re.compile(rf"[+-]?\d{{1,{MAX_NUMBER_CHARS}}}")
_ARITH_INTEGER = re.compile(rf"[ \t]*(?P<value>{_INTEGER.pattern})(?![\d,]|\.\d)")


def score_arith(item: RewardItem) -> Verdict:
    """Single-turn arithmetic in a fixed format: the last `Answer:` must be followed by an
    integer equal to the ground truth. Nothing else is accepted, so the policy is rewarded
    for the format as well as the value."""
    raw_truth = _require_ground_truth(item)
    if not _INTEGER.fullmatch(raw_truth):
        raise InvalidItem(
            f"item {item.item_id!r}: ground truth {_quote(raw_truth)} is not an integer"
        )
    expected = int(raw_truth)
    mark = item.response.rfind(_ARITH_MARK)
    match = _ARITH_INTEGER.match(item.response, mark + len(_ARITH_MARK)) if mark >= 0 else None
    if match is None:
        return _no_answer("'Answer: <integer>'", str(expected))
    value = int(match["value"])
    return _verdict(value == expected, str(value), str(expected))


RULE_SCORERS: Mapping[str, RuleScorer] = MappingProxyType(
    {
        "gsm8k": score_gsm8k,
        "openai/gsm8k": score_gsm8k,
        "math": score_math,
        "lighteval/MATH": score_math,
        "DigitalLearningGmbH/MATH-lighteval": score_math,
        "HuggingFaceH4/MATH-500": score_math,
        "hendrycks_math": score_math,
        "math_dapo": score_math,
        "arith": score_arith,
    }
)
"""data_source -> rule scorer. Keys are matched exactly (they are dataset names)."""
