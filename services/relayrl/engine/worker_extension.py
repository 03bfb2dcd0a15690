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
from collections.abc import Iterator
from typing import Any

import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (dtype and shape included, so a cast shows)."""
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{data.dtype}:{tuple(data.shape)}:".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


class RelayrlWorkerExtension:
    """Mixed into vLLM's worker: `self.model_runner.model` is the loaded model."""

    def _relayrl_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

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
        path = request["path"]
        wanted = set(request.get("names") or [])

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not wanted or name in wanted:
                        yield name, handle.get_tensor(name)

        names = [name for name, _ in tensors()] if not wanted else sorted(wanted)
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=tensors(), is_checkpoint_format=True
        )
        return {"loaded": names}

    def relayrl_ping(self, request_json: str = "{}") -> dict[str, Any]:
        """Liveness of the extension itself (it is loaded, and this worker answers)."""
        return {"ok": True}
