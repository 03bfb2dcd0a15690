"""The engine emulator (`python -m relayrl_testkit.emulator`, the pipeline benchmark's load
generator) as a real process on a loopback port, driven through the gateway's own
`VllmEngineClient`: episode durations by arrival, tokens, log-probs and version spans, vLLM's
pause modes, aborts and control endpoints; then a real relayrl-weightsync pushing a version
into it over gRPC, and a real relayrl-gateway rolling out groups against it."""

from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayrl.inference.client import (
    EngineRejected,
    GenerateRequest,
    Generation,
    SamplingOptions,
    VllmEngineClient,
)
from relayrl.sim.durations import EpisodeModel
from relayrl_testkit.emulator import emitted_tokens
from relayrl_testkit.emulator_launcher import Emulator, start_emulator

PROMPT = (3, 17, 42, 99, 7, 250)
VOCAB = 512
STOP = 2
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def emulators(tmp_path: Path) -> Iterator[Callable[..., Emulator]]:
    """Starts emulators (seed, time_scale, ...); every one is stopped by PID afterwards."""
    started: list[Emulator] = []

    def start(**options: Any) -> Emulator:
        emulator = start_emulator(
            tmp_path / f"emulator-{len(started)}", vocab_size=VOCAB, **options
        )
        started.append(emulator)
        return emulator

    yield start
    for emulator in started:
        emulator.stop()


def drive(emulator: Emulator, scenario):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        client = VllmEngineClient(emulator.url)
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(main())


def request(max_tokens: int, stop: tuple[int, ...] = (STOP,)) -> GenerateRequest:
    sampling = SamplingOptions(max_tokens=max_tokens, stop_token_ids=stop)
    return GenerateRequest(f"t-{uuid.uuid4().hex[:8]}", PROMPT, sampling)


def scale_for(seed: int, index: int, wall_s: float) -> float:
    """The time scale at which episode `index` of `seed` takes `wall_s` wall seconds."""
    return wall_s / float(EpisodeModel().durations(seed, 1, start=index)[0])


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def spans_of(generation: Generation) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in generation.version_spans]


def expected_tokens(
    emulator: Emulator, record: dict[str, Any], stops: tuple[int, ...]
) -> list[int]:
    """What the emulator returns for a finished request of its log (its own token function)."""
    tokens, _ = emitted_tokens(
        emulator.seed,
        record["index"],
        record["tokens"],
        VOCAB,
        stops,
        end_with_stop=record["finish_reason"] == "stop",
    )
    return tokens


# --- generation ------------------------------------------------------------------------------


def test_the_ith_arrival_gets_episode_i_with_tokens_logprobs_and_spans(emulators) -> None:
    seed = 11
    emulator = emulators(seed=seed, time_scale=0.0005)
    caps = [64, 100_000, 64, 100_000, 7]

    async def scenario(client: VllmEngineClient) -> list[Generation]:
        return [await client.generate(request(cap)) for cap in caps]

    generations = drive(emulator, scenario)
    episodes = EpisodeModel().episodes(seed, 0, len(caps))
    records = emulator.records()
    assert [r["index"] for r in records] == list(range(len(caps)))
    for i, (cap, generation, record) in enumerate(zip(caps, generations, records, strict=True)):
        assert record["duration_s"] == pytest.approx(float(episodes.durations_s[i]), rel=1e-12)
        assert record["episode_tokens"] == int(episodes.tokens[i])
        num_tokens = min(int(episodes.tokens[i]), cap)
        assert len(generation.token_ids) == len(generation.logprobs) == num_tokens
        assert record["tokens"] == num_tokens and record["request_id"] == generation.request_id
        assert all(lp < 0 for lp in generation.logprobs)
        assert all(0 <= t < VOCAB for t in generation.token_ids)
        assert spans_of(generation) == [("default", 0, num_tokens)]
        assert record["version_start"] == record["version_end"] == "default"
        assert record["finish_time"] >= record["arrival_time"]
        if num_tokens == cap:
            assert generation.finish_reason == "length"
            assert STOP not in generation.token_ids
        else:  # the episode ended first: it stops on the stop token, as vLLM returns it
            assert generation.finish_reason == "stop"
            assert generation.token_ids[-1] == STOP and STOP not in generation.token_ids[:-1]
        assert list(generation.token_ids) == expected_tokens(emulator, record, (STOP,))
    assert {g.finish_reason for g in generations} == {"length", "stop"}
    assert emulator.metric('relayrl_emulator_requests_total{finish_reason="length"}') == 3
    assert emulator.stop() == 0  # SIGTERM: a graceful stop


def test_control_endpoints_and_refusals(emulators) -> None:
    emulator = emulators(seed=0, time_scale=0.0005)

    async def scenario(client: VllmEngineClient) -> None:
        assert await client.health()
        assert await client.weight_version() == "default"
        await client.set_weight_version("3")
        assert await client.weight_version() == "3"
        assert not await client.is_paused()
        await client.reset_prefix_cache()
        await client.reset_prefix_cache()
        assert await client.worker_rpc("relayrl_ping", {}) == [{"ok": True, "holds": ""}]
        (info,) = await client.worker_rpc("relayrl_weight_info", {})
        assert info["num_params"] == 0 and set(info) == {"num_params", "digest", "tensors"}
        generation = await client.generate(request(5))
        assert spans_of(generation) == [("3", 0, 5)]
        with pytest.raises(EngineRejected, match="not served by the engine emulator"):
            await client.worker_rpc("relayrl_load_tensors", {"path": "/nowhere"})
        with pytest.raises(EngineRejected, match="grpc data plane only"):
            await client.worker_rpc("relayrl_receive", {"transport": "mooncake"})
        with pytest.raises(EngineRejected, match=r"token_ids must be integers in \[0, 512\)"):
            await client.generate(GenerateRequest("bad", (1, VOCAB + 5)))
        with pytest.raises(EngineRejected, match="mode must be one of"):
            await client.pause("freeze")  # type: ignore[arg-type]
        async with aiohttp.ClientSession(trust_env=False) as http:
            url = emulator.url + "/inference/v1/generate"
            for body, message in [
                ({"request_id": "x", "token_ids": []}, "token_ids must be a non-empty list"),
                ({"request_id": "x"}, "token_ids must be a non-empty list"),
                (
                    {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
                    "max_tokens must be an integer >= 1",
                ),
                (
                    {"token_ids": [1], "sampling_params": {"stop_token_ids": "2"}},
                    "stop_token_ids must be a list",
                ),
                ([1, 2], "must be a JSON object"),
            ]:
                async with http.post(url, json=body) as response:
                    assert response.status == 400, body
                    assert message in (await response.json())["error"]["message"]
            async with http.post(url, data=b"{not json") as response:
                assert response.status == 400

    drive(emulator, scenario)
    assert emulator.metric("relayrl_emulator_prefix_cache_resets_total") == 2
    assert emulator.metric("relayrl_emulator_weight_version") == 3
    assert [r["index"] for r in emulator.records()] == [0]  # refused bodies draw no episode


def test_keep_pause_freezes_and_resume_continues_at_the_new_version(emulators) -> None:
    seed = 5
    emulator = emulators(seed=seed, time_scale=scale_for(seed, 0, wall_s=4.0))

    async def scenario(client: VllmEngineClient) -> tuple[Generation, Generation]:
        first = asyncio.ensure_future(client.generate(request(40)))
        await until(lambda: emulator.metric("relayrl_emulator_inflight_requests") == 1, "start")
        await asyncio.sleep(0.6)  # about 15 % of its 4 s
        await client.pause("keep")
        assert await client.is_paused()
        # arriving while paused: it waits for /resume
        second = asyncio.ensure_future(client.generate(request(40)))
        await until(lambda: emulator.metric("relayrl_emulator_queued_requests") == 1, "queue")
        await asyncio.sleep(0.3)
        assert not first.done() and not second.done()
        assert emulator.metric("relayrl_emulator_paused_bool") == 1
        await client.set_weight_version("7")
        await client.resume()
        assert not await client.is_paused()
        return await first, await second

    first, second = drive(emulator, scenario)
    assert first.finish_reason == "length" and len(first.token_ids) == 40
    ((old, start, split), (new, split_again, end)) = spans_of(first)
    assert (old, new, start, end) == ("default", "7", 0, 40)
    assert split == split_again and 0 < split < 40
    assert spans_of(second) == [("7", 0, 40)]
    by_index = {r["index"]: r for r in emulator.records()}
    assert (by_index[0]["version_start"], by_index[0]["version_end"]) == ("default", "7")
    assert (by_index[1]["version_start"], by_index[1]["version_end"]) == ("7", "7")
    assert by_index[0]["paused_wall_s"] > 0 and by_index[1]["paused_wall_s"] > 0
    assert by_index[1]["arrival_time"] > by_index[0]["arrival_time"]


def test_abort_pause_and_abort_requests_end_requests_with_their_tokens_so_far(emulators) -> None:
    seed = 6
    emulator = emulators(seed=seed, time_scale=scale_for(seed, 0, wall_s=60.0))

    async def scenario(client: VllmEngineClient) -> tuple[Generation, Generation]:
        kept = request(30)
        doomed = request(30)
        first = asyncio.ensure_future(client.generate(kept))
        second = asyncio.ensure_future(client.generate(doomed))
        await until(lambda: emulator.metric("relayrl_emulator_inflight_requests") == 2, "start")
        await client.abort([doomed.request_id])
        aborted = await second
        assert not first.done()
        await client.pause("abort")
        assert await client.is_paused()
        return await first, aborted

    by_pause, by_id = drive(emulator, scenario)
    records = {r["request_id"]: r for r in emulator.records()}
    for generation in (by_pause, by_id):
        assert generation.finish_reason == "abort"
        record = records[generation.request_id]
        assert record["finish_reason"] == "abort" and record["tokens"] == len(generation.token_ids)
        assert len(generation.token_ids) < 30  # far from its 60 s
        planned, _ = emitted_tokens(emulator.seed, record["index"], 30, VOCAB, (STOP,))
        assert list(generation.token_ids) == planned[: len(generation.token_ids)]
        n = len(generation.token_ids)
        assert spans_of(generation) == ([("default", 0, n)] if n else [])
    assert emulator.metric('relayrl_emulator_requests_total{finish_reason="abort"}') == 2
    assert emulator.metric("relayrl_emulator_inflight_requests") == 0


def test_wait_pause_returns_once_in_flight_requests_finished(emulators) -> None:
    seed = 14  # episode 1 is a tenth of episode 0
    emulator = emulators(seed=seed, time_scale=scale_for(seed, 0, wall_s=1.0))

    async def scenario(client: VllmEngineClient) -> Generation:
        first = asyncio.ensure_future(client.generate(request(20)))
        await until(lambda: emulator.metric("relayrl_emulator_inflight_requests") == 1, "start")
        await client.pause("wait")
        # it finished before the pause answered: its log line is already written
        (record,) = emulator.records()
        assert record["finish_reason"] == "length"
        assert emulator.metric("relayrl_emulator_inflight_requests") == 0
        assert await client.is_paused()
        generation = await first
        assert generation.finish_reason == "length" and len(generation.token_ids) == 20
        waiting = asyncio.ensure_future(client.generate(request(20)))
        await until(lambda: emulator.metric("relayrl_emulator_queued_requests") == 1, "queue")
        assert not waiting.done()
        await client.resume()
        return await waiting

    after_resume = drive(emulator, scenario)
    assert after_resume.finish_reason == "length"
    assert [r["index"] for r in emulator.records()] == [0, 1]


# --- with real weight-sync and gateway processes ---------------------------------------------


def test_a_weightsync_version_is_received_over_grpc_and_committed(
    emulators, model_dir: Path, tmp_path: Path
) -> None:
    import grpc
    from safetensors.torch import load_file

    from relayrl.core.service_process import ServiceProcess
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
    from relayrl.weightsync.sender import WeightSyncSender

    emulator = emulators(seed=0, time_scale=0.01, sync_time_s=10.0)
    weights = load_file(model_dir / "model.safetensors")
    config = {
        "bucket_size_bytes": 96 * 1024,
        "chunk_size_bytes": 32 * 1024,
        "engines": {"urls": [emulator.url], "load_timeout_s": 60},
        "transfer_timeout_s": 60,
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as weightsync:
        sender = WeightSyncSender(weightsync.target, timeout_s=60)
        try:
            result = sender.publish(1, 1, weights.items())
            sender.wait_committed(result.transfer_id, 60)
        finally:
            sender.close()
        with grpc.insecure_channel(weightsync.target) as channel:
            state = weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
                pb.GetVersionRequest(), timeout=10
            )
    assert state.committed.version == 1
    assert [(r.version, r.live) for r in state.replicas] == [(1, True)]
    assert result.num_buckets_sent > 3

    async def scenario(client: VllmEngineClient) -> tuple[str, dict[str, Any], bool]:
        (info,) = await client.worker_rpc("relayrl_weight_info", {})
        return await client.weight_version(), info, await client.is_paused()

    version, info, paused = drive(emulator, scenario)
    assert version == "1" and not paused  # restored: version set, resumed
    assert info["num_params"] == sum(t.numel() for t in weights.values())
    assert emulator.metric('relayrl_emulator_weight_loads_total{outcome="ok"}') == 1
    assert emulator.metric("relayrl_emulator_received_bytes_total") == result.bytes_total
    assert emulator.metric("relayrl_emulator_weight_version") == 1


def test_over_tls_an_engine_pulls_with_its_own_ca_and_one_without_is_refused(
    emulators, model_dir: Path, tmp_path: Path
) -> None:
    """weight-sync serving mutual TLS: an engine whose config names the CA and its client
    certificate loads the version; one without them is refused with the reason, and is
    dropped while the other commits."""
    from safetensors.torch import load_file

    from relayrl.core.config import ClientCredentialsConfig, TlsClientConfig
    from relayrl.core.grpc_client import ClientIdentity
    from relayrl.core.service_process import ServiceProcess
    from relayrl.engine.config import WEIGHTSYNC_TLS_ENV
    from relayrl.weightsync.sender import WeightSyncSender
    from relayrl_testkit.helpers.pki import make_ca, make_cert, mutual_tls_server

    pki = tmp_path / "pki"
    pki.mkdir()
    make_ca(pki, "ca")
    make_cert(pki, "ca", "server", san="DNS:localhost,IP:127.0.0.1")
    for name in ("trainer", "engine"):
        make_cert(pki, "ca", name)

    def client_tls(name: str) -> TlsClientConfig:
        return TlsClientConfig(
            ca_file=pki / "ca.crt", cert_file=pki / f"{name}.crt", key_file=pki / f"{name}.key"
        )

    with_ca = emulators(
        seed=0,
        time_scale=0.01,
        sync_time_s=10.0,
        env={WEIGHTSYNC_TLS_ENV: client_tls("engine").model_dump_json()},
    )
    without = emulators(seed=1, time_scale=0.01, sync_time_s=10.0)
    weights = load_file(model_dir / "model.safetensors")
    config = {
        "grpc": {"tls": mutual_tls_server(pki)},
        "bucket_size_bytes": 96 * 1024,
        "chunk_size_bytes": 32 * 1024,
        "engines": {"urls": [with_ca.url, without.url], "load_timeout_s": 60, "attempts": 1},
        "transfer_timeout_s": 60,
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as weightsync:
        trainer = ClientIdentity.from_config(
            ClientCredentialsConfig(tls=client_tls("trainer")), "trainer"
        )
        sender = WeightSyncSender(weightsync.target, timeout_s=60, identity=trainer)
        try:
            result = sender.publish(1, 1, weights.items())
            sender.wait_committed(result.transfer_id, 60)
        finally:
            sender.close()
        log = weightsync.log()
    assert with_ca.metric('relayrl_emulator_weight_loads_total{outcome="ok"}') == 1
    assert with_ca.metric("relayrl_emulator_weight_version") == 1
    assert without.metric('relayrl_emulator_weight_loads_total{outcome="ok"}') == 0
    assert "serves TLS, but this engine has no weightsync_tls" in log, log[-3000:]


def test_a_gateway_rolls_out_groups_with_the_emulators_tokens(
    emulators, redis_server, model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from relayrl.conversation.rendering import turn_end_token_ids
    from relayrl.core.service_process import ServiceProcess
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.tq import TransferQueue

    emulator = emulators(seed=21, time_scale=0.002)
    partition = "train"
    tq = TransferQueue(redis_server.client())
    tq.create_partition(partition)
    groups = [
        common_pb2.PromptGroup(
            uid=f"g{k}",
            num_samples=2,
            prompt_token_ids=[1, 77, 88, 99, 2, 1],
            data_source="arith",
            ground_truth="4",
            sampling=common_pb2.SamplingParams(temperature=1.0, max_response_tokens=12, seed=7),
        )
        for k in range(3)
    ]
    tq.put_groups(partition, groups)
    config = {
        "tq": {"url": redis_server.url, "partitions": [partition]},
        "tokenizer": str(model_dir),
        "engines": {"urls": [emulator.url], "health_interval_s": 0.5, "request_timeout_s": 60},
        "rollout": {"partitions": [partition]},
        "rollout_shape": {"batch_groups": 3, "eta": 0},
    }
    with ServiceProcess("relayrl-gateway", config, tmp_path / "gw") as gateway:
        deadline = time.monotonic() + 60
        while tq.counts(partition).groups.get("finished", 0) < 3:
            assert time.monotonic() < deadline, gateway.log()
            time.sleep(0.1)
    trajectories = [t for g in tq.get_groups(partition, ["g0", "g1", "g2"]) for t in g.trajectories]
    tq.close()
    records = emulator.records()
    assert len(trajectories) == len(records) == 6
    stops = turn_end_token_ids(AutoTokenizer.from_pretrained(model_dir))
    # the trajectories hold exactly the emulator's tokens, one of its episodes each
    assert sorted(list(t.response_token_ids) for t in trajectories) == sorted(
        expected_tokens(emulator, r, stops) for r in records
    )
    for trajectory in trajectories:
        assert len(trajectory.response_token_ids) == 12  # max_response_tokens < any episode
        assert len(trajectory.rollout_logprobs) == 12
        assert all(lp < 0 for lp in trajectory.rollout_logprobs)
        (span,) = trajectory.spans
        assert (span.start, span.end, span.policy_version) == (0, 12, 0)
        assert trajectory.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
    # the gateway labelled the emulator's weights with its initial version
    assert {r["version_end"] for r in records} == {"0"}
