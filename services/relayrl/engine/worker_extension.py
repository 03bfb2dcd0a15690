"""relayrl's vLLM worker extension: methods vLLM mixes into every worker of an engine started
with `--worker-extension-cls relayrl.engine.worker_extension.RelayrlWorkerExtension`, called
through the server's `/collective_rpc` (one call reaches every worker; each answers for the
weights it holds).

vLLM passes collective_rpc arguments as strings, so each method takes one JSON string.
This module is imported inside the vLLM process: it imports torch and safetensors only, never
the rest of relayrl (a worker must not pull in gRPC or Redis).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from relayrl.dataplane.request import ReceiveRequest
    from relayrl.dataplane.transports.base import KeptResources


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (dtype and shape included, so a cast shows)."""
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{data.dtype}:{tuple(data.shape)}:".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


INITIAL_WEIGHTS = ""
"""What a worker holds before any load: the weights it started from (its model folder); the
same value as `relayrl.dataplane.request.INITIAL_WEIGHTS`, which this module does not import."""


class RelayrlWorkerExtension:
    """Mixed into vLLM's worker: `self.model_runner.model` is the loaded model.

    Each worker remembers which weight-sync transfer it holds whole (`_relayrl_holds`): the
    initial weights until a load, the transfer id after one, None while a load runs or after
    one failed half-way (the model is then a mix). weight-sync reads it with `relayrl_ping`
    and routes nothing to a replica until it holds the committed transfer: the engine's own
    memory, which a restart of the engine (back to its initial weights) or of weight-sync
    cannot get wrong."""

    def _relayrl_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def _relayrl_set_holds(self, holds: str | None) -> None:
        self._relayrl_holds = holds

    def _relayrl_reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            self.model_runner.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=tensors, is_checkpoint_format=True
            )
        except BaseException:
            close = getattr(tensors, "close", None)
            if close is not None:  # a receiving generator tells its data plane at once
                close()
            self._relayrl_end_failed_reload()
            raise
        self._relayrl_refresh_cpu_embedding_gemm()

    def _relayrl_end_failed_reload(self) -> None:
        """vLLM's in-place reload moves every layer onto the meta device with wrapped weight
        loaders until it finalises; a weight stream that fails midway (a dead sender, a
        corrupted bucket) skips that step and leaves a model nothing can load into. Finalise
        it: layers that got nothing get their old tensors back, the others keep what arrived.
        The model is then a mix of two versions -- its replica stays paused until a retry
        loads a whole version, or leaves routing."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
        )

        finalize_layerwise_reload(
            self._relayrl_model(),
            self.model_runner.vllm_config.model_config,  # type: ignore[attr-defined]
        )

    def _relayrl_refresh_cpu_embedding_gemm(self) -> None:
        """On CPU, vLLM gives every embedding used as an output layer (the tied lm_head) a
        GEMM handler prepacked from its weight, and keeps the weight itself; reloading writes
        the new weight in place but leaves the handler on the old one, so logits would come
        from the previous version's embedding. Rebuild those handlers from the new weights."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in self._relayrl_model().modules():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def relayrl_weight_info(self, request_json: str = "{}") -> dict[str, Any]:
        """Parameter count, per-parameter digests (vLLM's own names, which may fuse the HF
        names: qkv_proj, gate_up_proj) and one digest over them all in name order."""
        request = json.loads(request_json or "{}")
        names = set(request.get("names") or [])
        digests = {
            name: tensor_digest(param)
            for name, param in sorted(self._relayrl_model().named_parameters())
            if not names or name in names
        }
        overall = hashlib.sha256("".join(f"{n}={d};" for n, d in digests.items()).encode())
        num_params = sum(p.numel() for p in self._relayrl_model().parameters())
        return {
            "num_params": num_params,
            "digest": overall.hexdigest(),
            "tensors": digests if request.get("per_tensor") else {},
        }

    def relayrl_load_tensors(self, request_json: str) -> dict[str, Any]:
        """Load HF-named tensors into the running model, in place. The request names a
        safetensors file the worker can read: {"path": "...", "names": [...] (optional)}.

        Goes through vLLM's `reload_weights` (checkpoint format), not `load_weights`
        directly: after loading, vLLM's CPU backend repacks linear weights into kernel
        layouts and leaves empty parameters behind, so a plain `load_weights` into a running
        CPU engine fails; the reload path restores the checkpoint layout, loads (fusing
        q/k/v and gate/up itself) and repacks."""
        from safetensors.torch import safe_open

        request = json.loads(request_json)
        path = _loadable(request["path"])
        wanted = set(request.get("names") or [])

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not wanted or name in wanted:
                        yield name, handle.get_tensor(name)

        names = [name for name, _ in tensors()] if not wanted else sorted(wanted)
        self._relayrl_set_holds(None)
        self._relayrl_reload(tensors())
        self._relayrl_set_holds(f"file:{path}")
        return {"loaded": names}

    def relayrl_receive(self, request_json: str) -> dict[str, Any]:
        """Receive a weight-sync version and load it in place (the request is a
        `relayrl.dataplane.request.ReceiveRequest` as JSON: the plan's target and digest, the
        data plane, and for a broadcast data plane the spec and this replica's first receiver
        rank, to which the worker's rank is added; ValueError says what is wrong with one that
        cannot be used). Buckets stream straight into the reload path (see
        `relayrl_load_tensors` for why reload, not load); returns the loaded buckets' sha256 in
        plan order, which the coordinator compares with what the senders pushed. The receiver
        (and gRPC with it) is imported only here, when a version arrives."""
        from relayrl.dataplane.receiver import ReceiveRequest, receive_tensors
        from relayrl.engine.config import weightsync_tls_from_env

        request = ReceiveRequest.from_json(request_json)
        stats: dict[str, Any] = {}
        dtype = next(self._relayrl_model().parameters()).dtype
        tensors = receive_tensors(
            request,
            stats,
            dtype=dtype,
            worker_rank=int(getattr(self, "rank", 0)),
            resources=self._relayrl_kept_resources(request),
            engine_fp8=self._relayrl_fp8_checkpoint_format(),
            tls=weightsync_tls_from_env(os.environ),
        )
        self._relayrl_set_holds(None)
        self._relayrl_reload(tensors)
        self._relayrl_set_holds(request.transfer_id)
        return stats

    def _relayrl_fp8_checkpoint_format(self) -> str | None:
        """ "per_tensor" or "block_128" when this engine serves an FP8 checkpoint (it loads FP8
        weights and their scales as they are), None when it loads bf16/fp16 weights (FP8 from
        weight-sync is then dequantised on the way). UNTESTED on an FP8 engine: vLLM's FP8
        kernels need a GPU."""
        quant_config = getattr(self.model_runner.vllm_config, "quant_config", None)  # type: ignore[attr-defined]
        if not getattr(quant_config, "is_checkpoint_fp8_serialized", False):
            return None
        block = getattr(quant_config, "weight_block_size", None)
        if not block:
            return "per_tensor"
        return "block_128" if list(block) == [128, 128] else f"block_{'x'.join(map(str, block))}"

    def _relayrl_kept_resources(self, request: ReceiveRequest) -> KeptResources:
        """What this worker keeps across versions (one Mooncake engine: starting and stopping
        one per transfer costs about a second), set up before the model is touched, so that a
        data plane that cannot start leaves the model whole."""
        from relayrl.dataplane.transports.base import KeptResources

        kept = getattr(self, "_relayrl_kept", None)
        if kept is None:
            kept = self._relayrl_kept = KeptResources("source")
        if request.spec is not None:
            kept.for_spec(request.spec)
        return kept

    def relayrl_ping(self, request_json: str = "{}") -> dict[str, Any]:
        """Liveness of the extension itself (it is loaded, and this worker answers) and the
        weights it holds whole: the initial ones (""), a transfer id, or None (a mix)."""
        return {"ok": True, "holds": getattr(self, "_relayrl_holds", INITIAL_WEIGHTS)}


def _loadable(path: str) -> str:
    """`path` when it lies in the model folder or an engine's `load_dirs` (what the launcher
    put in RELAYRL_ENGINE_LOAD_DIRS), else ValueError: a caller of /collective_rpc must not
    make the engine read any file it can name."""
    from pathlib import Path

    resolved = Path(path).resolve()
    folders = [
        Path(f).resolve()
        for f in os.environ.get("RELAYRL_ENGINE_LOAD_DIRS", "").split(os.pathsep)
        if f
    ]
    if not any(resolved.is_relative_to(folder) for folder in folders):
        raise ValueError(
            f"relayrl_load_tensors: {path} is outside the model folder and the engine's "
            "load_dirs; weights from elsewhere come through weight-sync"
        )
    return str(resolved)
