"""Rule scorers: pure functions that judge a response against a ground truth without a model or
a sandbox, chosen by the item's `data_source` (the `naive` manager dispatches to them).

A rule scorer takes a `RewardItem` and returns a `Verdict`: 1.0 / OK for a correct final
answer, 0.0 / POLICY_FAIL for a wrong or missing one (the message says what was extracted and
what was expected, so a reward curve can be debugged from a sample of results). An item that
cannot be judged at all (no ground truth, a ground truth that is not an answer) raises
`InvalidItem`: a broken dataset row must not train the policy towards 0.

`RULE_SCORERS` is a closed, read-only table: adding a data source means adding a function here
(or writing a manager of one's own), never registering one at import time somewhere else.

The `math` rule's contract is ours: what part of a response is its final answer (the last
`\\boxed{}`, else the text after the last "answer is"), what part of a ground truth is the
answer, and the answer forms our rules settle without sympy (strings, plain numbers, words,
tuples vs lists; see `compare_math`). The symbolic equivalence of what is left is Hugging
Face's math-verify (`symbolic`), imported only when a comparison needs it. The policy's text is
untrusted: only math-verify's LaTeX parser reads it (never sympy's `parse_expr`, which uses
`eval`), and limits in `symbolic` make a hostile answer (`9^{9^{9}}`) fail in milliseconds and
bound any comparison by a deadline, in whichever thread it runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from types import MappingProxyType

from relayrl.reward.items import InvalidItem, RewardItem, Status, Verdict

RuleScorer = Callable[[RewardItem], Verdict]

# Longest extracted answer or ground truth quoted in a verdict's message.
MESSAGE_QUOTE_CHARS = 80
# Longest answer that is compared at all (a longer "final answer" is not an answer).
MAX_ANSWER_CHARS = 2000
# Longest number read as a plain number (Python refuses int() of over 4300 digits).
MAX_NUMBER_CHARS = 100
# Relative tolerance of plain-number comparisons (0.3333333 vs \frac{1}{3}).
NUMERIC_REL_TOL = 1e-6
NUMERIC_ABS_TOL = 1e-9


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
# A run of letters is a word ("no", "yes"), never a product of variables (n*o == o*n).
_WORD = re.compile(r"[A-Za-z]{2,}")


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
    tolerance (0.3333333 is 1/3)."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    tolerance = max(Fraction(NUMERIC_REL_TOL) * max(abs(a), abs(b)), Fraction(NUMERIC_ABS_TOL))
    return abs(a - b) <= tolerance


def _has_top_level_comma(text: str) -> bool:
    """Whether `text` has a comma outside (), [], {} (and `\\{ \\}`)."""
    depth = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and text[i + 1 : i + 2] in ("{", "}"):
            depth += 1 if text[i + 1] == "{" else -1
            i += 2
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            return True
        i += 1
    return False


def _sequence_kind(text: str) -> tuple[str, str] | None:
    """The brackets of a tuple or interval ("(", "]"), ("", "") for a set or an unbracketed
    list (all solutions, in any order), None for anything else."""
    for left, right in (("\\{", "\\}"), *_BRACKETS.items(), ("(", "]"), ("[", ")")):
        if text.startswith(left) and text.endswith(right) and len(text) > len(left + right):
            inner = text[len(left) : -len(right)]
            if _balanced(inner) and (left == "\\{" or _has_top_level_comma(inner)):
                return ("", "") if left == "\\{" else (left, right)
    return ("", "") if _has_top_level_comma(text) else None


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if depth < 0:
            return False
    return depth == 0


def math_equal(predicted: str, expected: str) -> bool:
    """Whether a final answer is the same as the ground truth's (see `compare_math`)."""
    return compare_math(predicted, expected)[0]


def compare_math(predicted: str, expected: str) -> tuple[bool, str]:
    """Whether a final answer is the same as the ground truth's, and why it was not compared
    when it was refused (empty otherwise).

    Our rules settle what they can without sympy: equal normalised strings, text
    case-insensitively, plain numbers (integers exactly, others within a relative 1e-6). Two
    they keep from math-verify, which gets them wrong: a word is not a product of variables
    (`no` is not `on`), and a tuple, an interval and a set or list of solutions are different
    answers even with the same elements (`(1,2)` is not `1,2`). Everything else is math-verify's
    symbolic comparison, behind limits (`symbolic`)."""
    if len(predicted) > MAX_ANSWER_CHARS or len(expected) > MAX_ANSWER_CHARS:
        return False, f"over {MAX_ANSWER_CHARS} characters"
    a, b = normalize_math_answer(predicted), normalize_math_answer(expected)
    if a == b:
        return True, ""
    if not a or not b:
        return False, ""
    if a.casefold() == b.casefold() and not re.search(r"[\d\\]", b):
        return True, ""  # a textual answer ("Monday", "(C)")
    num_a, num_b = _plain_number(a), _plain_number(b)
    if num_a is not None and num_b is not None:
        return _numbers_close(num_a, num_b), ""
    if _WORD.fullmatch(a) or _WORD.fullmatch(b):
        return False, ""
    kind_a, kind_b = _sequence_kind(a), _sequence_kind(b)
    if kind_a is not None and kind_b is not None and kind_a != kind_b:
        return False, ""
    # Lazy: importing sympy and math-verify takes about a second, and most answers are settled
    # above (the reward-service's config imports this module).
    from relayrl.reward.managers import symbolic

    comparison = symbolic.answers_equal(predicted, expected)
    return comparison.equal, comparison.refused


def score_math(item: RewardItem) -> Verdict:
    """MATH-style final answer: the last `\\boxed{}` (or "answer is ...") is equivalent to the
    ground truth's answer (see `compare_math`)."""
    expected = math_ground_truth(_require_ground_truth(item))
    if not expected:
        raise InvalidItem(f"item {item.item_id!r}: the ground truth holds no answer")
    answer = extract_math_answer(item.response)
    if answer is None:
        return _no_answer("\\boxed{} or 'answer is'", expected)
    equal, refused = compare_math(answer, expected)
    return _verdict(equal, answer, expected, f"not compared: {refused}" if refused else "")


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
