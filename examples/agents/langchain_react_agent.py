"""LangChain's classic ReAct agent (`langchain-classic` with `langchain-openai`), unchanged but
for where its model lives: `create_react_agent` over `ChatOpenAI`, run by `AgentExecutor`.

    FW=.venv/share/venvs/frameworks/bin/python     # make setup builds it
    relayrl up --task lookup --agent-serve \\
        --agent "$FW examples/agents/langchain_react_agent.py --serve"

The classic ReAct prompt is one user message holding the question, the tools and the
scratchpad of thoughts, actions and observations so far; the model writes "Thought: ...
Action: ... Action Input: ..." and is stopped on "\\nObservation" so that the agent can run
the tool and write the observation itself. Every turn therefore rewrites that one message: no
request extends the one before, and each turn becomes a segment of the sample
(docs/architecture.md#segments). `make setup` builds the frameworks' virtual environment
(`.venv/share/venvs/frameworks`). Its exit, or the served task's result, ends the episode.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from langchain_classic.agents import AgentExecutor, create_react_agent
from langchain_core.prompts import PromptTemplate
from langchain_core.tools import Tool
from langchain_openai import ChatOpenAI
from tools import MAX_TURNS, run_agent, run_tool, session_of

# The classic ReAct prompt (as LangChain's hub publishes it), in our words where it explains.
PROMPT = PromptTemplate.from_template(
    "Answer the question as well as you can. You have these tools:\n\n{tools}\n\n"
    "Use this format:\n\n"
    "Question: the question to answer\n"
    "Thought: what to do next\n"
    "Action: the tool to use, one of [{tool_names}]\n"
    "Action Input: the tool's input\n"
    "Observation: the tool's result\n"
    "... (Thought/Action/Action Input/Observation can repeat)\n"
    "Thought: I know the answer\n"
    "Final Answer: Answer: <integer>\n\n"
    "Question: {input}\n"
    "Thought:{agent_scratchpad}"
)


def langchain_tools(labels: dict[str, str]) -> list[Tool]:
    def lookup(key: str) -> str:
        return run_tool("lookup", json.dumps({"key": key.strip()}), labels)

    def calculator(expression: str) -> str:
        return run_tool("calculator", json.dumps({"expression": expression.strip()}), labels)

    return [
        Tool(name="lookup", func=lookup, description="Look up the value stored under a key."),
        Tool(name="calculator", func=calculator, description="Evaluate an arithmetic expression."),
    ]


def solve(task: dict[str, Any]) -> None:
    session = session_of(task)
    llm = ChatOpenAI(
        model="policy",
        base_url=session["base_url"],
        api_key=session["api_key"],
        max_tokens=96,
        max_retries=2,
    )
    tools = langchain_tools(task["labels"])
    agent = create_react_agent(llm, tools, PROMPT)
    executor = AgentExecutor(
        agent=agent, tools=tools, max_iterations=MAX_TURNS, handle_parsing_errors=True
    )
    question = next(m["content"] for m in reversed(task["messages"]) if m["role"] == "user")
    executor.invoke({"input": question})


if __name__ == "__main__":
    sys.exit(run_agent(solve))
