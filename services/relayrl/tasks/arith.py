"""`arith`: single-turn integer arithmetic ("What is 12 + 7?"), answered as `Answer: 19`.

The default (two-digit sums and differences, one-digit products, no negative answers) is sized
for the tiny model; the knobs make it harder (`max_digits`, `num_operations`, `max_factor`,
`allow_negative`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from relayrl.conversation.tools import evaluate_expression
from relayrl.tasks.base import ANSWER_INSTRUCTION, Question, Record, Task

OPERATORS = ("+", "-", "*")
_COMMUTATIVE = ("+", "*")


def expression_text(operands: Sequence[int | str], operators: Sequence[str]) -> str:
    """`12 + 7 * 3`: operands and operators interleaved, one space around each operator."""
    assert len(operands) == len(operators) + 1
    parts = [str(operands[0])]
    for operator, operand in zip(operators, operands[1:], strict=True):
        parts += [operator, str(operand)]
    return " ".join(parts)


def canonical_expression(operands: Sequence[int | str], operators: Sequence[str]) -> str:
    """The form that decides the split: operands sorted (as text) when every operator is the
    same commutative one (`12 + 7` and `7 + 12` are one question), else the expression as
    written."""
    if len(set(operators)) == 1 and operators[0] in _COMMUTATIVE:
        return expression_text(sorted(operands, key=str), operators)
    return expression_text(operands, operators)


def integer_value(expression: str) -> int:
    """The value with the usual precedence, by the gateway's calculator (exact integers)."""
    value = evaluate_expression(expression)
    assert isinstance(value, int), (expression, value)
    return value


@dataclass(frozen=True)
class ArithTask(Task):
    """Single-turn arithmetic: `num_operations` operators from `operators`; operands of + and -
    have up to `max_digits` digits, factors of * are 2..`max_factor`."""

    name: ClassVar[str] = "arith"
    agent: ClassVar[str] = "single_turn"

    max_digits: int = 2
    num_operations: int = 1
    operators: tuple[str, ...] = OPERATORS
    max_factor: int = 9
    allow_negative: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.max_digits <= 9:
            raise ValueError(f"max_digits must be in [1, 9], got {self.max_digits}")
        if not 1 <= self.num_operations <= 4:
            raise ValueError(f"num_operations must be in [1, 4], got {self.num_operations}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}")
        if not 2 <= self.max_factor <= 99:
            raise ValueError(f"max_factor must be in [2, 99], got {self.max_factor}")

    def draw(self, rng: random.Random) -> Question:
        while True:
            operators = [rng.choice(self.operators) for _ in range(self.num_operations)]
            operands = [
                rng.randint(2, self.max_factor)
                if "*" in operators[max(i - 1, 0) : i + 1]
                else rng.randint(0, 10**self.max_digits - 1)
                for i in range(self.num_operations + 1)
            ]
            expression = expression_text(operands, operators)
            value = integer_value(expression)
            if value >= 0 or self.allow_negative:
                break
        return Question(
            text=f"What is {expression}?\n{ANSWER_INSTRUCTION}",
            answer=value,
            split_keys=(canonical_expression(operands, operators),),
        )

    def sft_turns(self, question: Question) -> list[Record]:
        return [{"prompt": question.text, "answer": f"Answer: {question.answer}"}]
