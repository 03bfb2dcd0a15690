"""A real vLLM OpenAI server on the tiny model: it loads our tokenizer and chat template, and
its greedy completions (tokens and logprobs) are those of `transformers` on the same weights.

One server per module (about 25 s to start on two cores); it runs in its own session, so the
API server and its EngineCore child share a process group whose id is the server's PID, and the
last test checks that SIGTERM leaves none of them behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relayrl.core.ports import free_port
from relayrl.models import TinyModelConfig
from relayrl.models.tiny import init_model
from relayrl_testkit.helpers.engines import vllm_cache

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 240.0
MAX_MODEL_LEN = 512
NUM_NEW_TOKENS = 8
NUM_TOP_LOGPROBS = 5
LOGPROB_TOLERANCE = 1e-3
# Loopback only: never through an HTTP(S)_PROXY from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def process_group(pgid: int) -> list[int]:
    """PIDs of the live processes in a process group (zombies excluded), from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            pids.append(int(entry.name))
    return pids


def rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a model directory, as a child process
    in its own session, with its caches and temporary files under `workdir`."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "vllm.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--enforce-eager",
            "--distributed-executor-backend", "uni",
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--seed", "0",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        (self.workdir / "tmp").mkdir(exist_ok=True)
        return {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "VLLM_CACHE_ROOT": str(vllm_cache(self.workdir)),
            "TMPDIR": str(self.workdir / "tmp"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Start and wait for /health; on exit or timeout, stop it and raise with its log."""
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.workdir,
                start_new_session=True,
            )
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - began > timeout_s:
                self.stop()
                raise TimeoutError(f"vLLM not healthy in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.25)
        self.start_s = time.monotonic() - began
        return self

    def _healthy(self) -> bool:
        try:
            with _OPENER.open(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with _OPENER.open(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} -> {exc.code}: {exc.read().decode()}") from None

    def get(self, path: str) -> dict[str, Any]:
        with _OPENER.open(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def rss_bytes(self) -> int:
        """Resident memory of the API server and its engine process together."""
        return sum(rss_bytes(pid) for pid in process_group(self.pid))

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server, SIGKILL it after `timeout_s`, then SIGKILL whatever is left of
        its process group (an engine orphaned by a killed server); idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(30)
        deadline = time.monotonic() + 10
        while process_group(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if process_group(self.pid):
            os.killpg(self.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-model")
    init_model(directory, TinyModelConfig(seed=0))
    return directory


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    vllm = VllmServer(model_dir, tmp_path_factory.mktemp("vllm"))
    vllm.start()
    try:
        yield vllm
    finally:
        vllm.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def greedy_decode(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> torch.Tensor:
    """Greedy continuation by full forward passes (no KV cache); the log-softmax over the
    vocabulary at every position of prompt + continuation, shape [T, V]."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits_V = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits_V.argmax()))
        logits_TV = model(torch.tensor([ids[:-1]])).logits[0]
    return torch.log_softmax(logits_TV.double(), dim=-1)


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def test_server_starts_with_the_tiny_model(
    server: VllmServer, model_dir: Path, record_property: Any
) -> None:
    rss_gib = server.rss_bytes() / 2**30
    record_property("vllm_start_s", round(server.start_s, 1))
    record_property("vllm_rss_gib", round(rss_gib, 2))
    print(f"vLLM ready in {server.start_s:.1f} s, RSS {rss_gib:.2f} GiB (server + engine)")
    (model,) = server.get("/v1/models")["data"]
    assert model["id"] == str(model_dir) and model["max_model_len"] == MAX_MODEL_LEN
    assert len(process_group(server.pid)) >= 2  # the API server and its EngineCore


def test_greedy_completions_match_transformers(
    server: VllmServer, tokenizer: PreTrainedTokenizerBase, hf_model: torch.nn.Module
) -> None:
    chat = [{"role": "user", "content": "What is 17 + 25?"}]
    prompts = [
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        "Sam has 12 coins and buys 7 more. How many coins does Sam have?\nAnswer:",
    ]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    answer = server.post(
        "/v1/completions",
        {
            "model": str(server.model_dir),
            "prompt": prompt_ids,
            "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0,
            "logprobs": NUM_TOP_LOGPROBS,
            "prompt_logprobs": 1,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        },
    )
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert answer["usage"]["completion_tokens"] == NUM_NEW_TOKENS * len(prompts)
    worst = 0.0
    for prompt, choice in zip(prompt_ids, choices, strict=True):
        assert choice["finish_reason"] == "length"
        logp_TV = greedy_decode(hf_model, prompt, NUM_NEW_TOKENS)
        expected = logp_TV[len(prompt) - 1 :].argmax(-1).tolist()
        tokens = [token_id(t) for t in choice["logprobs"]["tokens"]]
        assert tokens == expected
        logprobs = choice["logprobs"]
        steps = zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
        for position, (logprob, top) in enumerate(steps, start=len(prompt) - 1):
            assert len(top) == NUM_TOP_LOGPROBS
            chosen = tokens[position - len(prompt) + 1]
            worst = max(worst, abs(logprob - float(logp_TV[position, chosen])))
            for token, top_logprob in top.items():
                worst = max(worst, abs(top_logprob - float(logp_TV[position, token_id(token)])))
        # The prompt's own tokens, teacher-forced.
        for position, scored in enumerate(choice["prompt_logprobs"][1:], start=1):
            actual = scored[str(prompt[position])]["logprob"]
            worst = max(worst, abs(actual - float(logp_TV[position - 1, prompt[position]])))
    print(f"largest |logprob vLLM - transformers|: {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE


def test_server_tokenizes_and_templates_like_transformers(
    server: VllmServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    model = str(server.model_dir)
    text = 'Answer: 1234 <tool_call>\n{"name": "calculator"}\n</tool_call><|im_end|>'
    served = server.post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
    assert served["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": '{"result": 5}'},
    ]
    templated = server.post(
        "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True}
    )
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(templated["tokens"]) == expected
    assert templated["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_sigterm_stops_server_and_engine(server: VllmServer) -> None:
    members = process_group(server.pid)
    assert server.pid in members
    server.stop()
    assert server.process is not None and server.process.returncode is not None
    assert process_group(server.pid) == []  # the engine and helpers too, not only the server
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=2):
        pass
