"""relayrl.tasks: the built-in tasks `relayrl up` trains on, with rule rewards the
reward-service already has.

- `arith`: single-turn arithmetic, answered as `Answer: <integer>` (agent `single_turn`).
- `lookup`: the values a question needs come only from the gateway's `lookup` tool (agent
  `tool_agent`, labels `lookup:<key>`), scored by the same `arith` rule.

    from relayrl.tasks import TASKS, score, write_jsonl
    task = TASKS["arith"]                        # or dataclasses.replace(task, max_digits=3)
    write_jsonl(task.prompts("train", 2000, seed=0), run_dir / "prompts.jsonl")
    write_jsonl(task.sft_examples(500, seed=0), run_dir / "sft.jsonl")
    heldout = task.prompts("heldout", 200, seed=0)   # never shares a question with "train"
    correct = score(task, response_text, heldout[0]["ground_truth"])

`TASKS` is a closed, read-only table of default-sized tasks; knobs are dataclass fields.
"""

from collections.abc import Mapping
from types import MappingProxyType

from relayrl.tasks.arith import ArithTask
from relayrl.tasks.base import SPLITS, Question, Split, Task, score, split_of, write_jsonl
from relayrl.tasks.lookup import LookupTask, tools_system_prompt

TASKS: Mapping[str, Task] = MappingProxyType(
    {ArithTask.name: ArithTask(), LookupTask.name: LookupTask()}
)
"""Task name -> the task with its default knobs."""

__all__ = [
    "SPLITS",
    "TASKS",
    "ArithTask",
    "LookupTask",
    "Question",
    "Split",
    "Task",
    "score",
    "split_of",
    "tools_system_prompt",
    "write_jsonl",
]
