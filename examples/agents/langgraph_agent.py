"""A LangGraph graph whose nodes bind different tools, unchanged but for where its model lives:
a `research` node whose model may call `lookup`, then a `compute` node whose model may call
`calculator`, each on `ChatOpenAI.bind_tools`.

    FW=.venv/share/venvs/frameworks/bin/python     # make setup builds it
    relayrl up --task lookup --agent-serve \\
        --agent "$FW examples/agents/langgraph_agent.py --serve"

The `compute` node's request offers other tools than the `research` node's, so it does not
extend that conversation: it becomes a second segment of the same sample, trained with the
sample's reward (docs/architecture.md#segments). `make setup` builds the frameworks' virtual
environment (`.venv/share/venvs/frameworks`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from tools import NUDGE, run_agent, run_tool, session_of


def build_graph(llm: ChatOpenAI, labels: dict[str, str]) -> Any:
    @tool
    def lookup(key: str) -> str:
        """Look up the value stored under a key."""
        return run_tool("lookup", json.dumps({"key": key}), labels)

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
        return run_tool("calculator", json.dumps({"expression": expression}), labels)

    researcher = llm.bind_tools([lookup])
    computer = llm.bind_tools([calculator])

    def research(state: MessagesState) -> dict[str, Any]:
        return {"messages": [researcher.invoke(state["messages"])]}

    def compute(state: MessagesState) -> dict[str, Any]:
        return {"messages": [computer.invoke([*state["messages"], HumanMessage(NUDGE)])]}

    graph = StateGraph(MessagesState)
    graph.add_node("research", research)
    graph.add_node("lookup_tool", ToolNode([lookup]))
    graph.add_node("compute", compute)
    graph.add_node("calculator_tool", ToolNode([calculator]))
    graph.add_edge(START, "research")
    graph.add_conditional_edges(
        "research", tools_condition, {"tools": "lookup_tool", END: "compute"}
    )
    graph.add_edge("lookup_tool", "compute")
    graph.add_conditional_edges("compute", tools_condition, {"tools": "calculator_tool", END: END})
    graph.add_edge("calculator_tool", END)
    return graph.compile()


def solve(task: dict[str, Any]) -> None:
    session = session_of(task)
    llm = ChatOpenAI(
        model="policy",
        base_url=session["base_url"],
        api_key=session["api_key"],
        max_tokens=96,
        max_retries=2,
    )
    messages = [(m["role"], m["content"]) for m in task["messages"]]
    build_graph(llm, task["labels"]).invoke({"messages": messages}, {"recursion_limit": 12})


if __name__ == "__main__":
    sys.exit(run_agent(solve))
