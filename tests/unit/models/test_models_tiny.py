"""The tiny Qwen2 model and its tokenizer: built from a seed, bit-identical when rebuilt, loaded
by `transformers` as a fast tokenizer and a Qwen2ForCausalLM that runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relayrl.models import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    VLLM_CPU_HEAD_DIMS,
    TinyModelConfig,
    corpus_lines,
)
from relayrl.models.tiny import ModelInfo, init_model, weights_checksum


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    init_model(directory, TinyModelConfig())
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def test_writes_hugging_face_files(model_dir: Path) -> None:
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["torch_dtype"] == config["dtype"] == "float32"
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]  # <|im_end|>, <|endoftext|>
    assert "temperature" not in generation  # sampling defaults stay the caller's
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "{%- if add_generation_prompt %}" in tokenizer_config["chat_template"]
    special_map = json.loads((model_dir / "special_tokens_map.json").read_text())
    assert special_map["eos_token"]["content"] == IM_END
    assert (model_dir / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable


def test_tokenizer_is_fast_and_round_trips_text(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.is_fast and len(tokenizer) == 512
    texts = [
        "What is 37 + 45?\nAnswer: 82",
        "  leading spaces, tabs\tand\n\nblank lines  ",
        'Tool said {"result": -12} — naïve café, 東京, emoji 🤖!',
        "xqzj wvvk: never seen words still encode byte by byte",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert max(ids) < len(tokenizer)


def test_special_tokens_are_single_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)]
    assert ids == [[0], [1], [2], [508], [509], [510], [511]]
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == IM_END and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token is None
    text = f"{IM_START}assistant\n<tool_call>\n{{}}\n</tool_call>{IM_END}"
    ids_in_text = tokenizer.encode(text, add_special_tokens=False)
    assert ids_in_text[0] == 1 and ids_in_text[-1] == 2 and 508 in ids_in_text
    # ChatML markup is special (dropped); tool markup stays, for a tool parser reading text.
    assert tokenizer.decode(ids_in_text, skip_special_tokens=True) == (
        "assistant\n<tool_call>\n{}\n</tool_call>"
    )


def test_digits_are_one_token_each(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("Answer: 1234567890, x=2024 and 3.14", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if re.search(r"\d", p)] == list("12345678902024314")
    vocab_pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    assert all(len(p) == 1 for p in vocab_pieces if re.search(r"\d", p))


def test_corpus_is_seeded_and_covers_the_formats() -> None:
    lines = list(corpus_lines(seed=7, num_lines=300))
    assert lines == list(corpus_lines(seed=7, num_lines=300))
    assert lines != list(corpus_lines(seed=8, num_lines=300))
    text = "\n".join(lines)
    assert re.search(r"Answer: -?\d+", text)
    assert '<tool_call>\n{"name": "' in text and "<tool_response>" in text
    assert f"{IM_START}assistant\n" in text


def test_chat_template_renders_tool_calls_and_results(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}},
                },
                {
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"key": "x"}'},  # wire form
                },
            ],
        },
        {"role": "tool", "content": '{"result": 5}'},
        {"role": "tool", "content": '{"x": 1}'},
        {"role": "assistant", "content": "Answer: 5"},
        {"role": "user", "content": "And 5 + 1?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nUse the calculator.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n"
        '<tool_response>\n{"result": 5}\n</tool_response>\n'
        '<tool_response>\n{"x": 1}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nAnswer: 5<|im_end|>\n"
        "<|im_start|>user\nAnd 5 + 1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert without_prompt.endswith("What is 2 + 3?<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tokenizer.decode(ids) == rendered
    assert ids.count(1) == 7 and ids.count(508) == 2 and ids.count(510) == 2


def test_chat_template_lists_tools_and_defaults_the_system_prompt(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
    user = [{"role": "user", "content": "hi"}]
    with_tools = tokenizer.apply_chat_template(user, tools=[tool], tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in with_tools
    assert "</tools>" in with_tools and with_tools.endswith("<|im_start|>user\nhi<|im_end|>\n")
    plain = tokenizer.apply_chat_template(user, tokenize=False)
    assert plain.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_same_config_gives_identical_weights_and_tokenizer(tmp_path: Path) -> None:
    first = init_model(tmp_path / "a", TinyModelConfig(seed=5))
    second = init_model(tmp_path / "b", TinyModelConfig(seed=5))
    other_seed = init_model(tmp_path / "c", TinyModelConfig(seed=6))
    assert first.weights_sha256 == second.weights_sha256
    assert first.tokenizer_sha256 == second.tokenizer_sha256
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert weights_checksum(tmp_path / "b" / "model.safetensors") == first.weights_sha256
    assert other_seed.weights_sha256 != first.weights_sha256
    assert other_seed.tokenizer_sha256 == first.tokenizer_sha256  # the seed is the weights'


def test_init_leaves_the_callers_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    init_model(tmp_path / "m", TinyModelConfig(seed=9))
    assert torch.equal(torch.rand(4), expected)


def test_default_size_is_about_half_a_million_parameters(tmp_path: Path) -> None:
    info = init_model(tmp_path / "m", TinyModelConfig())
    config = TinyModelConfig()
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * config.intermediate_size + 2 * h
    assert info.num_params == 512 * h + config.num_layers * per_layer + h == 509_568
    assert info.vocab_size == 512 and config.head_dim in VLLM_CPU_HEAD_DIMS
    assert isinstance(info, ModelInfo) and "509568 parameters" in info.summary()


def test_transformers_runs_a_forward_pass(model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None  # Qwen2's biases
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    batch = tokenizer(["What is 12 * 3?", "Answer: 36"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], 512)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.01  # not a degenerate (all-zero) init


def test_init_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty; pass --force"):
        init_model(tmp_path, TinyModelConfig())
    info = init_model(tmp_path, TinyModelConfig(), overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"  # files not ours are left alone
    assert weights_checksum(tmp_path / "model.safetensors") == info.weights_sha256
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        init_model(tmp_path / "file", TinyModelConfig())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_size": 64}, "head size hidden_size/num_heads = 16"),
        ({"hidden_size": 130}, "not a multiple of num_heads"),
        ({"num_kv_heads": 3}, "does not divide num_heads"),
        ({"vocab_size": 100}, "greater than or equal to"),
        ({"vocab_size": 100_000}, "less than or equal to"),
        ({"num_layers": 0}, "greater than or equal to 1"),
        ({"hiden_size": 64}, "Extra inputs are not permitted"),
    ],
)
def test_config_rejects_shapes_that_cannot_run(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TinyModelConfig(**fields)


def test_config_fields_are_described() -> None:
    for name, field in TinyModelConfig.model_fields.items():
        assert field.description, name
