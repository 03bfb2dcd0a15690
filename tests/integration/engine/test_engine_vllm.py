"""A real vLLM engine started by `python -m relayrl.engine` on the tiny model, driven through
`VllmEngineClient`: token-in/token-out with log-probs that match transformers, weight-version
spans across a pause, the worker extension loading tensors in place, clear errors."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from relayrl.core.ports import free_port
from relayrl.engine.process import EngineProcess
from relayrl.inference.client import (
    EngineRejected,
    EngineUnavailable,
    GenerateRequest,
    Generation,
    SamplingOptions,
    VllmEngineClient,
)

PROMPT = (3, 17, 42, 99, 7, 250)
GREEDY = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(engine: EngineProcess, scenario):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        client = VllmEngineClient(engine.url)
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(main())


def request(
    sampling: SamplingOptions = GREEDY, prompt: tuple[int, ...] = PROMPT
) -> GenerateRequest:
    return GenerateRequest(f"test-{uuid.uuid4().hex[:8]}", prompt, sampling)


def transformers_greedy(model_dir: Path, num_tokens: int) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = list(PROMPT)
    logprobs = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            log_softmax = torch.log_softmax(logits.double(), dim=-1)
            token = int(torch.argmax(logits))
            ids.append(token)
            logprobs.append(float(log_softmax[token]))
    return ids[len(PROMPT) :], logprobs


def test_tokens_and_logprobs_match_transformers_on_the_same_weights(
    engine: EngineProcess, model_dir: Path
) -> None:
    generation: Generation = run(engine, lambda client: client.generate(request()))
    expected_ids, expected_logprobs = transformers_greedy(model_dir, GREEDY.max_tokens)
    assert list(generation.token_ids) == expected_ids
    assert generation.logprobs == pytest.approx(expected_logprobs, abs=1e-3)
    assert generation.finish_reason == "length"
    assert [(s.start, s.end) for s in generation.version_spans] == [(0, GREEDY.max_tokens)]


def test_sampled_logprobs_are_those_of_the_tempered_distribution_the_trainer_computes(
    engine: EngineProcess, model_dir: Path
) -> None:
    """At temperature 0.6 a token's log-prob is log softmax(logits / 0.6), as the trainer's
    recompute has it (relayrl.trainer.forward), not vLLM's default temperature-1 one, which
    differs by 0.18 nats per token on SmolLM2 and would read as train/inference mismatch."""
    sampling = SamplingOptions(max_tokens=12, temperature=0.6, seed=5, ignore_eos=True)
    generation: Generation = run(engine, lambda client: client.generate(request(sampling)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([list(PROMPT) + list(generation.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()
    tokens = torch.tensor(generation.token_ids)
    tempered = torch.log_softmax(logits / 0.6, dim=-1)[torch.arange(len(tokens)), tokens]
    raw = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens]
    assert generation.logprobs == pytest.approx(tempered.tolist(), abs=1e-3)
    assert float((tempered - raw).abs().mean()) > 1e-2  # the two really differ here


def test_a_pause_keep_across_a_version_change_splits_the_spans(engine: EngineProcess) -> None:
    long = SamplingOptions(max_tokens=400, temperature=1.0, seed=1, ignore_eos=True)

    async def attempt(client: VllmEngineClient, old: str, new: str) -> Generation:
        await client.set_weight_version(old)
        rollout = asyncio.create_task(client.generate(request(long)))
        await asyncio.sleep(0.05)
        await client.pause("keep")
        assert await client.is_paused()
        await client.set_weight_version(new)
        await client.reset_prefix_cache()
        await client.resume()
        assert not await client.is_paused()
        assert await client.weight_version() == new
        return await rollout

    async def scenario(client: VllmEngineClient) -> Generation:
        # The pause has to land while the 400 tokens are being generated (~0.3 s here); on a
        # loaded machine it can land before the request starts or after it ends, which makes
        # one span: try again with new labels (the assertions below still need a split).
        for k in range(5):
            generation = await attempt(client, str(3 + 2 * k), str(4 + 2 * k))
            if len(generation.version_spans) > 1:
                break
        return generation

    generation = run(engine, scenario)
    spans = generation.version_spans
    assert len(spans) == 2 and int(spans[1].version) == int(spans[0].version) + 1, spans
    assert spans[0].start == 0 and spans[0].end == spans[1].start and spans[1].end == 400
    assert len(generation.token_ids) == len(generation.logprobs) == 400


def test_worker_extension_reports_digests_and_loads_tensors_in_place(
    engine: EngineProcess, model_dir: Path, tmp_path: Path
) -> None:
    original = load_file(model_dir / "model.safetensors")
    changed = {name: (t * 0 if name.endswith("norm.weight") else t) for name, t in original.items()}
    save_file(changed, tmp_path / "changed.safetensors")
    save_file(original, tmp_path / "original.safetensors")

    async def scenario(client: VllmEngineClient) -> None:
        (before,) = await client.worker_rpc("relayrl_weight_info", {})
        baseline = await client.generate(request())
        (loaded,) = await client.worker_rpc(
            "relayrl_load_tensors", {"path": str(tmp_path / "changed.safetensors")}
        )
        assert "model.norm.weight" in loaded["loaded"]
        (after,) = await client.worker_rpc("relayrl_weight_info", {})
        assert after["digest"] != before["digest"]
        flat = await client.generate(request())
        # Zeroed norms make every logit equal: log(1 / vocab) for each sampled token.
        assert flat.logprobs[0] == pytest.approx(-torch.log(torch.tensor(512.0)).item(), abs=1e-4)
        await client.worker_rpc(
            "relayrl_load_tensors", {"path": str(tmp_path / "original.safetensors")}
        )
        (restored,) = await client.worker_rpc("relayrl_weight_info", {})
        assert restored["digest"] == before["digest"]
        again = await client.generate(request())
        assert again.token_ids == baseline.token_ids

    run(engine, scenario)


def test_bad_requests_are_rejected_and_a_dead_engine_is_unavailable(
    engine: EngineProcess,
) -> None:
    async def scenario(client: VllmEngineClient) -> None:
        with pytest.raises(EngineRejected, match="400"):
            await client.generate(request(prompt=(10**6,)))  # not in the vocabulary
        with pytest.raises(ValueError, match="not a relayrl worker-extension method"):
            await client.worker_rpc("reset_weights", {})
        # a file outside the model folder and the engine's load_dirs is never read
        with pytest.raises(EngineUnavailable, match="outside the model folder"):
            await client.worker_rpc("relayrl_load_tensors", {"path": "/etc/passwd"})
        assert await client.health()
        dead = VllmEngineClient(f"http://127.0.0.1:{free_port()}")
        try:
            assert not await dead.health()
            with pytest.raises(EngineUnavailable):
                await dead.generate(request())
        finally:
            await dead.close()

    run(engine, scenario)
