"""A byte-level BPE tokenizer trained here, on a corpus our own code writes, in Qwen2's shape.

Nothing is downloaded: the corpus (English-like sentences, arithmetic with `Answer: <integer>`
lines, tool-call JSON, ChatML conversations) comes from a seeded `random.Random`, and the
`tokenizers` BPE trainer turns it into a vocabulary of exactly the requested size. The
pre-tokenizer is Qwen2's (its split regex, then byte-level), so every digit is its own token and
any byte string round-trips.

Special tokens follow Qwen2.5: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (end of a
chat turn) are special (dropped by `skip_special_tokens`); `<tool_call>`, `</tool_call>`,
`<tool_response>`, `</tool_response>` are added tokens that stay in decoded text, so a tool
parser reading the text (vLLM's `hermes`) sees them.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + len(TOOL_TOKENS) + 64
MAX_VOCAB_SIZE = 4096

# Qwen2's pre-tokenizer split: `\p{N}` alone is why digits never merge.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5's ChatML template (system default, tools block, hermes-style <tool_call> JSON, tool
# results as <tool_response> in a user turn), except that tool-call arguments may be a JSON
# string (OpenAI's wire form) or a mapping (what vLLM hands templates after parsing them).
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'DEFAULT_SYSTEM_PROMPT' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query." }}
    {{- "\n\nYou are provided with function signatures within <tools></tools> XML tags:" }}
    {{- "\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and" }}
    {{- " arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nDEFAULT_SYSTEM_PROMPT<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".replace("DEFAULT_SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT)

_COMMON_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell "
    "does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant cover food "
    "sun four between state keep eye never last let thought city tree cross farm hard start "
    "might story saw far sea draw left late run while press close night real life few north "
    "open seem together next white children begin got walk example ease paper group always "
    "music those both mark often letter until mile river car feet care second book carry took "
    "science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
    "color face wood main enough plain girl usual young ready above ever red list though feel "
    "talk bird soon body dog family direct pose leave song measure door product black short "
    "numeral class wind question happen complete ship area half rock order fire south problem "
    "piece told knew pass since top whole king space heard best hour better true during hundred "
    "five remember step early hold west ground interest reach fast verb sing listen six table "
    "travel less morning ten simple several vowel toward war lay against pattern slow center "
    "love person money serve appear road map rain rule govern pull cold notice voice unit power "
    "town fine certain fly fall lead cry dark machine note wait plan figure star box noun field "
    "rest correct able pound done beauty drive stood contain front teach week final gave green "
    "oh quick develop ocean warm free minute strong special mind behind clear tail produce fact "
    "sum total plus minus times divide product result compute solve check value equal apples "
    "oranges coins tickets marbles each costs buys sells left remaining altogether how many"
)
_WORDS = tuple(_COMMON_WORDS.split())
_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
    "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "str", "th", "tr",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "nt", "rd", "st", "ck", "sh", "th")
_TOOLS = (
    ("calculator", "expression"),
    ("search", "query"),
    ("python", "code"),
    ("lookup", "key"),
)
_OPERATORS = ("+", "-", "*")
NUM_CORPUS_LINES = 6000
_ADDED_TOKENS_RE = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)))


@dataclass(frozen=True)
class TokenizerSpec:
    """What the trainer needs: the final vocabulary size and the corpus seed."""

    vocab_size: int
    corpus_seed: int = 0


def _pseudo_word(rng: random.Random) -> str:
    """An English-looking made-up word: one to three onset-vowel-coda syllables."""
    syllables = (
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice((1, 1, 2, 2, 3)))
    )
    return "".join(syllables)


def _sentence(rng: random.Random) -> str:
    words = [
        rng.choice(_WORDS) if rng.random() < 0.8 else _pseudo_word(rng)
        for _ in range(rng.randint(4, 14))
    ]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", "?", "!", ","))


def _expression(rng: random.Random, depth: int = 0) -> tuple[str, int]:
    """A random integer expression and its value (no division, so the value is exact)."""
    if depth >= 2 or rng.random() < 0.5:
        value = rng.randint(0, 999 if depth == 0 else 99)
        return str(value), value
    left, left_value = _expression(rng, depth + 1)
    right, right_value = _expression(rng, depth + 1)
    operator = rng.choice(_OPERATORS)
    value = {"+": left_value + right_value, "-": left_value - right_value}.get(
        operator, left_value * right_value
    )
    text = f"{left} {operator} {right}"
    return (f"({text})" if depth > 0 else text), value


def _arithmetic(rng: random.Random) -> str:
    expression, value = _expression(rng)
    form = rng.randrange(4)
    if form == 0:
        return f"{expression} = {value}"
    if form == 1:
        return f"What is {expression}?\nAnswer: {value}"
    if form == 2:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        noun = rng.choice(("apples", "coins", "tickets", "marbles"))
        return (
            f"Sam has {a} {noun} and buys {b} more. How many {noun} does Sam have?\n"
            f"Sam has {a} + {b} = {a + b} {noun}.\nAnswer: {a + b}"
        )
    return f"Let me compute {expression} step by step. The result is {value}.\nAnswer: {value}"


def _tool_call(rng: random.Random) -> str:
    name, argument = rng.choice(_TOOLS)
    value = _expression(rng)[0] if name in ("calculator", "python") else _sentence(rng)
    call = json.dumps({"name": name, "arguments": {argument: value}})
    return f"<tool_call>\n{call}\n</tool_call>"


def _conversation(rng: random.Random) -> str:
    expression, value = _expression(rng)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return (
        f"{IM_START}system\n{DEFAULT_SYSTEM_PROMPT}{IM_END}\n"
        f"{IM_START}user\nWhat is {expression}?{IM_END}\n"
        f"{IM_START}assistant\n<tool_call>\n{call}\n</tool_call>{IM_END}\n"
        f"{IM_START}user\n<tool_response>\n{json.dumps({'result': value})}\n</tool_response>"
        f"{IM_END}\n"
        f"{IM_START}assistant\n{_sentence(rng)}\nAnswer: {value}{IM_END}\n"
    )


def corpus_lines(seed: int = 0, num_lines: int = NUM_CORPUS_LINES) -> Iterator[str]:
    """The training corpus, the same for the same seed: a mix of prose, arithmetic, tool calls
    and chat transcripts."""
    rng = random.Random(seed)
    makers = (_sentence, _sentence, _arithmetic, _arithmetic, _tool_call, _conversation)
    for _ in range(num_lines):
        yield rng.choice(makers)(rng)


def _training_pieces(lines: Iterator[str]) -> Iterator[str]:
    # The trainer sees raw text (added tokens are not split out before training), so markup
    # tokens would only teach merges like "<|" + "im"; encoding cuts text at them, so the
    # trainer gets the pieces between them, as encoding will.
    for line in lines:
        yield from (piece for piece in _ADDED_TOKENS_RE.split(line) if piece)


def _empty_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Train the BPE tokenizer: special tokens take ids 0..2, the tool-markup tokens the last
    four ids, the vocabulary has exactly `spec.vocab_size` entries (or ValueError)."""
    if not MIN_VOCAB_SIZE <= spec.vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {spec.vocab_size} is outside [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]"
        )
    tokenizer = _empty_tokenizer()
    trainer = BpeTrainer(
        vocab_size=spec.vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_pieces(corpus_lines(spec.corpus_seed)), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise ValueError(
            f"the built-in corpus supports a vocabulary of {tokenizer.get_vocab_size()} tokens, "
            f"not {spec.vocab_size}: choose a smaller vocab_size"
        )
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict[str, object]:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token in (*SPECIAL_TOKENS, *TOOL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, object]:
    def entry(token: str) -> dict[str, object]:
        return {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }

    return {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": entry(IM_END),
        "pad_token": entry(PAD_TOKEN),
    }


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> list[Path]:
    """Write the Hugging Face files (`tokenizer.json`, `tokenizer_config.json` with the chat
    template, `special_tokens_map.json`); the paths written."""
    paths = [
        directory / "tokenizer.json",
        directory / "tokenizer_config.json",
        directory / "special_tokens_map.json",
    ]
    tokenizer.save(str(paths[0]), pretty=True)
    _write_json(paths[1], _tokenizer_config(tokenizer, max_length))
    _write_json(paths[2], _special_tokens_map())
    return paths
