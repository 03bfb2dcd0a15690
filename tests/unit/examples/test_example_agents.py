"""The example agents' tools (examples/agents/tools.py, standard library only) are offered
exactly as the gateway's built-in tool loop offers its tools, so the chat template renders the
same prompt for an example agent as for `tool_agent`, and they compute what the built-ins do."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from relayrl.conversation.tools import ToolTable

TOOLS_PY = Path(__file__).resolve().parents[3] / "examples" / "agents" / "tools.py"


@pytest.fixture(scope="module")
def tools() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_agent_tools", TOOLS_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_tools_are_the_gateways_schemas(tools: ModuleType) -> None:
    assert ToolTable().schemas() == tools.TOOLS


def test_the_example_tools_answer_like_the_built_ins(tools: ModuleType) -> None:
    labels = {"lookup:k7": "23"}
    assert json.loads(tools.run_tool("lookup", '{"key": "k7"}', labels)) == {"result": "23"}
    assert "error" in json.loads(tools.run_tool("lookup", '{"key": "k8"}', labels))
    calc = json.loads(tools.run_tool("calculator", '{"expression": "(12 + 30) * 2"}', {}))
    assert calc == {"result": 84}
    for bad in ('{"expression": "__import__(\\"os\\")"}', '{"expression": "2 ** 1000"}', "{"):
        assert "error" in json.loads(tools.run_tool("calculator", bad, {})), bad
    assert "error" in json.loads(tools.run_tool("shell", "{}", {}))
