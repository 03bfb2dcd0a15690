"""How the engine client reads vLLM's tokens-in/tokens-out answer (the JSON shape of vLLM's
`GenerateTokensChoice`): the stop string that ended a generation, and the alternatives per
token when asked; and where a decoded generation is cut for its stop string, as vLLM cuts
its own text."""

from __future__ import annotations

from typing import Any

import pytest

from relayrl.inference.client import EngineUnavailable, _generation, text_before_stop


def answer(**choice: Any) -> dict[str, Any]:
    content = [
        # the sampled token first (here not the most likely one), then the top candidates
        {
            "token_id": 11,
            "logprob": -1.2,
            "rank": 3,
            "top_logprobs": [
                {"token_id": 11, "logprob": -1.2, "rank": 3},
                {"token_id": 12, "logprob": -0.4, "rank": 1},
                {"token_id": 13, "logprob": -0.9, "rank": 2},
            ],
        },
        {
            "token_id": 14,
            "logprob": -0.1,
            "rank": 1,
            "top_logprobs": [
                {"token_id": 14, "logprob": -0.1, "rank": 1},
                {"token_id": 15, "logprob": -2.5, "rank": 2},
            ],
        },
    ]
    base = {
        "index": 0,
        "token_ids": [11, 14],
        "logprobs": {"content": content},
        "finish_reason": "stop",
        "stop_reason": None,
        "weight_versions": [{"version": "2", "start": 0, "end": 2}],
    }
    return {"choices": [base | choice]}


def test_the_stop_string_and_the_alternatives_are_read_from_the_answer() -> None:
    generation = _generation("r1", answer(stop_reason="\nObservation:"), "e0", top=2)
    assert generation.stop_string == "\nObservation:"
    assert generation.logprobs == (-1.2, -0.1)  # the sampled tokens' own, always
    assert generation.top_logprobs == (((12, -0.4), (13, -0.9)), ((14, -0.1), (15, -2.5)))
    # a stop token id (or EOS) is no stop string; no alternatives unless asked
    plain = _generation("r1", answer(stop_reason=151645), "e0")
    assert (plain.stop_string, plain.top_logprobs) == (None, ())


def test_an_answer_with_a_malformed_alternative_is_the_engines_failure() -> None:
    broken = answer()
    broken["choices"][0]["logprobs"]["content"][0]["top_logprobs"] = [{"logprob": -1.0}]
    with pytest.raises(EngineUnavailable, match="malformed generate answer"):
        _generation("r1", broken, "e0", top=2)


@pytest.mark.parametrize(
    ("text", "stop", "include", "kept", "cut"),
    [
        ("Action: add\nObservation: 4", "\nObservation:", False, "Action: add", "\nObservation: 4"),
        ("Action: add\nObservation:", "\nObservation:", True, "Action: add\nObservation:", ""),
        # the first occurrence is where the engine stopped
        ("a##b##", "##", False, "a", "##b##"),
        # no stop string (EOS, a stop token, the length): nothing is cut
        ("all of it", None, False, "all of it", ""),
        # decoded differently from the engine's incremental decoding: nothing is cut
        ("no such string", "\n\n", False, "no such string", ""),
    ],
)
def test_the_text_is_cut_where_vllm_cuts_it(
    text: str, stop: str | None, include: bool, kept: str, cut: str
) -> None:
    assert text_before_stop(text, stop, include) == (kept, cut)
