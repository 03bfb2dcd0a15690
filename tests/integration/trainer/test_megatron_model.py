"""The megatron-core trainer model on CPU with gloo, against transformers' Qwen2.

Every megatron run happens in ranks started by `spawn_ranks` (fresh processes: megatron's
process groups are global, and the CPU compatibility layer is never installed in the pytest
process). Each rank function returns plain tensors; the assertions run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.trainer.hf_mapping import ModelSpec, hf_tensor_names, mcore_to_hf
from relayrl.trainer.model import RankFailedError, spawn_ranks

TIMEOUT_S = 240.0
LOGITS_TOL = 1e-5
GRAD_TOL = 1e-6
NUM_ROWS, SEQ_LEN = 8, 14


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random tokens with ragged lengths, right-padded with 0 (fixed seed)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 512, (NUM_ROWS, SEQ_LEN), generator=generator)
    lengths = torch.randint(2, SEQ_LEN + 1, (NUM_ROWS,), generator=generator)
    lengths[0] = SEQ_LEN
    ids[torch.arange(SEQ_LEN) >= lengths.unsqueeze(1)] = 0
    return ids, lengths


def first_scored() -> torch.Tensor:
    """A response start per row: mid-row, at the row's end (nothing scored), and at 1."""
    _, lengths = token_batch()
    first = (lengths // 2).clamp(min=1)
    first[1], first[2] = lengths[1], 1
    return first


def scored_mask(lengths: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    t = torch.arange(SEQ_LEN)
    return ((t >= first.unsqueeze(1)) & (t < lengths.unsqueeze(1))).float()


def global_token_count() -> float:
    _, lengths = token_batch()
    return float((lengths - 1).sum())


def nll_loss(batch: Any, global_tokens: float):
    """-sum(logp * mask) / global token count: the contribution of one micro-batch."""

    def loss_fn(logp_bT: torch.Tensor, rows: slice) -> tuple[torch.Tensor, dict[str, float]]:
        mask_bT = batch.token_mask_BT()[rows]
        loss = -(logp_bT * mask_bT).sum() / global_tokens
        return loss, {"loss": float(loss), "num_rows": float(rows.stop - rows.start)}

    return loss_fn


def masked_loss(mask_BT: torch.Tensor):
    def loss_fn(logp_bT: torch.Tensor, rows: slice) -> tuple[torch.Tensor, dict[str, float]]:
        return -(logp_bT * mask_BT[rows]).sum() / float(mask_BT.sum()), {}

    return loss_fn


def local_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from relayrl.trainer.model import unwrap_model

    return {n: p.main_grad.detach().clone() for n, p in unwrap_model(model).named_parameters()}


def gathered_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A plain (non-schedule) forward, vocabulary shards gathered over TP."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq_len = ids.shape[1]
    position_ids = torch.arange(seq_len).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(ids, position_ids, mask)
    return gather_from_tensor_model_parallel_region(logits).float()


# ---------------------------------------------------------------------------- rank functions


def model_checks(rank: int, world_size: int, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    """TP = world size: HF load, logits, log-probs, grads, export, one step, save_hf_dir."""
    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.forward import (
        TokenBatch,
        forward_backward,
        forward_logprobs,
        optimizer_step,
    )
    from relayrl.trainer.hf_mapping import export_hf_tensors
    from relayrl.trainer.megatron_compat import install_cpu_compat
    from relayrl.trainer.model import (
        build_model,
        build_optimizer,
        init_parallel,
        load_hf_dir,
        save_hf_dir,
    )

    layout = init_parallel(tensor_model_parallel_size=world_size, seed=0)
    out: dict[str, Any] = {"layout": layout, "compat": [install_cpu_compat() for _ in range(2)]}
    spec = ModelSpec.from_hf_dir(hf_dir)
    model = build_model(spec)
    load_hf_dir(model, hf_dir)
    batch = TokenBatch(*token_batch())

    logits = gathered_logits(model, batch.input_ids_BT)
    out["logits"] = logits
    out["logp"] = forward_logprobs(model, batch, micro_batch_size=3)
    out["logp_t07"] = forward_logprobs(model, batch, micro_batch_size=8, temperature=0.7)
    for name, temperature in (("logp_direct", 1.0), ("logp_direct_t07", 0.7)):
        logp_all = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
        logp = logp_all.gather(-1, batch.input_ids_BT[:, 1:].unsqueeze(-1)).squeeze(-1)
        out[name] = torch.nn.functional.pad(logp, (1, 0)) * batch.token_mask_BT()

    loss_fn = nll_loss(batch, global_token_count())
    out["metrics_1mb"] = forward_backward(
        model, batch, micro_batch_size=NUM_ROWS, temperature=1.0, loss_fn=loss_fn
    )
    out["grads_1mb"] = local_grads(model)
    out["metrics_4mb"] = forward_backward(
        model, batch, micro_batch_size=NUM_ROWS // 4, temperature=1.0, loss_fn=loss_fn
    )
    out["grads_4mb"] = local_grads(model)

    # the output layer over the scored positions only, against the whole pass masked to them
    mask = scored_mask(batch.lengths_B, first_scored())
    scored = TokenBatch.scoring(batch.input_ids_BT, batch.lengths_B, mask)
    out["logp_scored"] = forward_logprobs(model, scored, micro_batch_size=3, temperature=0.7)
    out["logp_scored_mask"] = mask
    masked_nll = masked_loss(mask)
    forward_backward(model, batch, micro_batch_size=3, temperature=1.0, loss_fn=masked_nll)
    out["grads_masked"] = local_grads(model)
    forward_backward(model, scored, micro_batch_size=3, temperature=1.0, loss_fn=masked_nll)
    out["grads_scored"] = local_grads(model)
    out["export_before"] = dict(export_hf_tensors(model, spec))

    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, clip_grad=0.0))
    out["step"] = optimizer_step(optimizer)
    out["logits_after"] = gathered_logits(model, batch.input_ids_BT)
    out["export_after"] = dict(export_hf_tensors(model, spec))
    out["saved"] = save_hf_dir(model, spec, out_dir, tokenizer_from=hf_dir)
    return out


def data_parallel_checks(rank: int, world_size: int, hf_dir: Path) -> dict[str, Any]:
    """DP = world size, TP 1: each rank takes its contiguous share of the rows."""
    from relayrl.trainer.forward import TokenBatch, forward_backward, forward_logprobs
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir

    layout = init_parallel(tensor_model_parallel_size=1, seed=0)
    model = build_model(ModelSpec.from_hf_dir(hf_dir))
    load_hf_dir(model, hf_dir)
    ids, lengths = token_batch()
    share = slice(rank * NUM_ROWS // world_size, (rank + 1) * NUM_ROWS // world_size)
    batch = TokenBatch(ids[share], lengths[share])
    logp = forward_logprobs(model, batch, micro_batch_size=2)
    forward_backward(
        model,
        batch,
        micro_batch_size=2,
        temperature=1.0,
        loss_fn=nll_loss(batch, global_token_count()),
    )
    return {"layout": layout, "rows": share, "logp": logp, "grads": local_grads(model)}


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    tensors = []
    for inner in optimizer.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state.get(param, {})
                tensors += [torch.as_tensor(state[key]).clone() for key in sorted(state)]
    return tensors


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) and a
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def checkpoint_checks(
    rank: int, world_size: int, hf_dir: Path, root: Path, tp: int, distributed: bool
) -> dict[str, Any]:
    """Train a step, save, train on; then a fresh model + optimizer loads the checkpoint and
    must hold the saved weights, optimizer state and RNG, and take the identical next step."""
    from relayrl.trainer.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.forward import TokenBatch, forward_backward, optimizer_step
    from relayrl.trainer.model import (
        build_model,
        build_optimizer,
        init_parallel,
        load_hf_dir,
        unwrap_model,
    )

    init_parallel(tensor_model_parallel_size=tp, seed=0)
    spec = ModelSpec.from_hf_dir(hf_dir)
    batch = TokenBatch(*token_batch())
    loss_fn = nll_loss(batch, global_token_count())
    settings = OptimizerConfig(lr=1e-2, weight_decay=0.1)

    def train_step(model: Any, optimizer: Any) -> tuple[bool, float]:
        forward_backward(model, batch, micro_batch_size=4, temperature=1.0, loss_fn=loss_fn)
        return optimizer_step(optimizer)

    def weights(model: Any) -> list[torch.Tensor]:
        return [p.detach().clone() for p in unwrap_model(model).parameters()]

    model = build_model(spec, use_distributed_optimizer=distributed)
    load_hf_dir(model, hf_dir)
    optimizer = build_optimizer(model, settings)
    initial_weights = weights(model)
    save_checkpoint(root / "step_00000000", model, optimizer, {"step": 0})  # before any step
    train_step(model, optimizer)
    save_checkpoint(root / "step_00000001", model, optimizer, {"step": 1, "data": [3, 4]})
    saved_weights, saved_optimizer = weights(model), _optimizer_tensors(optimizer)
    saved_rng = torch.get_rng_state()
    train_step(model, optimizer)
    next_weights = weights(model)
    torch.rand(3)  # move the RNG on

    fresh = build_model(spec, use_distributed_optimizer=distributed)
    fresh_optimizer = build_optimizer(fresh, settings)
    common = load_checkpoint(latest_checkpoint(root), fresh, fresh_optimizer)
    out = {
        "common": common,
        "weights_diff": _max_diff(saved_weights, weights(fresh)),
        "optimizer_diff": _max_diff(saved_optimizer, _optimizer_tensors(fresh_optimizer)),
        "rng_equal": torch.equal(saved_rng, torch.get_rng_state()),
    }
    train_step(fresh, fresh_optimizer)
    out["next_weights_diff"] = _max_diff(next_weights, weights(fresh))
    # The checkpoint from before the first step loads too, and its next step is the first.
    assert load_checkpoint(root / "step_00000000", fresh, fresh_optimizer) == {"step": 0}
    out["initial_weights_diff"] = _max_diff(initial_weights, weights(fresh))
    train_step(fresh, fresh_optimizer)
    out["first_step_diff"] = _max_diff(saved_weights, weights(fresh))
    return out


def _model_and_optimizer(hf_dir: Path) -> tuple[Any, Any]:
    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.model import (
        build_model,
        build_optimizer,
        init_parallel,
        load_hf_dir,
    )

    init_parallel(tensor_model_parallel_size=1, seed=0)
    model = build_model(ModelSpec.from_hf_dir(hf_dir))
    load_hf_dir(model, hf_dir)
    return model, build_optimizer(model, OptimizerConfig(lr=1e-2))


def _one_step(model: Any, optimizer: Any) -> None:
    from relayrl.trainer.forward import TokenBatch, forward_backward, optimizer_step

    batch = TokenBatch(*token_batch())
    loss_fn = nll_loss(batch, global_token_count())
    forward_backward(model, batch, micro_batch_size=8, temperature=1.0, loss_fn=loss_fn)
    optimizer_step(optimizer)


def save_then_die_mid_save(rank: int, world_size: int, hf_dir: Path, root: Path) -> None:
    """Save step_1; then die (as SIGKILL would) after step_2's shards are written but before
    the save commits."""
    import os

    from megatron.core import dist_checkpointing

    from relayrl.trainer.checkpointing import save_checkpoint

    model, optimizer = _model_and_optimizer(hf_dir)
    _one_step(model, optimizer)
    save_checkpoint(root / "step_1", model, optimizer, {"step": 1})
    _one_step(model, optimizer)
    real_save = dist_checkpointing.save

    def save_and_die(*args: Any, **kwargs: Any) -> None:
        real_save(*args, **kwargs)
        os._exit(9)

    dist_checkpointing.save = save_and_die
    save_checkpoint(root / "step_2", model, optimizer, {"step": 2})


def resume_and_save_again(rank: int, world_size: int, hf_dir: Path, root: Path) -> dict:
    from relayrl.trainer.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint

    model, optimizer = _model_and_optimizer(hf_dir)
    latest = latest_checkpoint(root)
    common = load_checkpoint(latest, model, optimizer)
    _one_step(model, optimizer)
    saved = save_checkpoint(root / "step_2", model, optimizer, {"step": 2})
    return {"latest": latest.name, "common": common, "saved": saved.name}


def fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on purpose")
    torch.distributed.barrier()  # rank 0 waits for a rank that never comes


# ---------------------------------------------------------------------------- fixtures


def hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def logits_from_tensors(model_dir: Path, tensors: dict[str, torch.Tensor], ids: torch.Tensor):
    """A transformers Qwen2 built here from the config, loaded with exported tensors only."""
    model = Qwen2ForCausalLM(Qwen2Config.from_pretrained(model_dir)).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tp1(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_dir = tmp_path_factory.mktemp("tp1") / "hf"
    return spawn_ranks(model_checks, 1, model_dir, out_dir, timeout_s=TIMEOUT_S)[0]


@pytest.fixture(scope="module")
def tp2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("tp2") / "hf"
    return spawn_ranks(model_checks, 2, model_dir, out_dir, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------------- tests


def test_install_cpu_compat_is_a_no_op_when_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relayrl.trainer import megatron_compat

    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    modes_before = torch._C._len_torch_function_stack()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_compat.install_cpu_compat() is False
    assert megatron_compat.install_cpu_compat() is False
    assert torch.cuda.current_device is current_device
    assert torch.cuda.synchronize is synchronize
    assert torch._C._len_torch_function_stack() == modes_before
    assert not megatron_compat.cpu_compat_installed()


def test_install_cpu_compat_is_idempotent_on_cpu(tp1: dict[str, Any]) -> None:
    assert tp1["compat"] == [True, True]


def test_tp1_logits_match_transformers(tp1: dict[str, Any], model_dir: Path) -> None:
    ids, _ = token_batch()
    diff = (tp1["logits"] - hf_logits(model_dir, ids)).abs().max()
    assert diff <= LOGITS_TOL


@pytest.mark.slow
def test_tp2_logits_match_transformers(tp2: list[dict[str, Any]], model_dir: Path) -> None:
    ids, _ = token_batch()
    reference = hf_logits(model_dir, ids)
    assert [r["layout"].tp_rank for r in tp2] == [0, 1]
    for result in tp2:
        assert (result["logits"] - reference).abs().max() <= LOGITS_TOL


@pytest.mark.parametrize("topology", ["tp1", "tp2"])
def test_forward_logprobs_equal_a_direct_log_softmax(
    topology: str, request: pytest.FixtureRequest
) -> None:
    if topology == "tp2":
        request.applymarker(pytest.mark.slow)
    results = request.getfixturevalue(topology)
    for result in results if isinstance(results, list) else [results]:
        assert result["logp"].dtype == torch.float32
        assert result["logp"].shape == (NUM_ROWS, SEQ_LEN)
        torch.testing.assert_close(result["logp"], result["logp_direct"], atol=1e-5, rtol=0)
        torch.testing.assert_close(result["logp_t07"], result["logp_direct_t07"], atol=1e-5, rtol=0)
        # t = 0 and padding carry 0 exactly.
        _, lengths = token_batch()
        pad = torch.arange(SEQ_LEN) >= lengths.unsqueeze(1)
        assert (result["logp"][:, 0] == 0).all() and (result["logp"][pad] == 0).all()


@pytest.mark.slow
def test_only_the_scored_positions_pass_the_output_layer_with_the_same_result(
    tp1: dict[str, Any], tp2: list[dict[str, Any]]
) -> None:
    for result in [tp1, *tp2]:
        mask = result["logp_scored_mask"]
        logp = result["logp_scored"]
        # equal where scored (a response), 0 before (a prompt: its logits never computed)
        torch.testing.assert_close(logp, result["logp_t07"] * mask, atol=1e-5, rtol=0)
        assert (logp[mask == 0] == 0).all()
        for name, grad in result["grads_masked"].items():
            torch.testing.assert_close(result["grads_scored"][name], grad, atol=GRAD_TOL, rtol=0)


def test_logprobs_agree_across_tensor_parallel_sizes(
    tp1: dict[str, Any], tp2: list[dict[str, Any]]
) -> None:
    for result in tp2:
        torch.testing.assert_close(result["logp"], tp1["logp"], atol=1e-5, rtol=0)


def test_export_at_tp1_rebuilds_the_model_in_transformers(
    tp1: dict[str, Any], model_dir: Path
) -> None:
    spec = ModelSpec.from_hf_dir(model_dir)
    ids, _ = token_batch()
    assert list(tp1["export_before"]) == hf_tensor_names(spec)
    before = logits_from_tensors(model_dir, tp1["export_before"], ids)
    assert (before - hf_logits(model_dir, ids)).abs().max() <= LOGITS_TOL
    # After an optimizer step the export follows the trained weights, not the source file.
    assert tp1["step"][0]
    after = logits_from_tensors(model_dir, tp1["export_after"], ids)
    assert (after - before).abs().max() > 1e-3
    assert (after - tp1["logits_after"]).abs().max() <= LOGITS_TOL


@pytest.mark.slow
def test_export_and_save_hf_dir_at_tp2(
    tp1: dict[str, Any], tp2: list[dict[str, Any]], model_dir: Path
) -> None:
    ids, _ = token_batch()
    for result in tp2:  # every TP rank gets the full tensors
        for name, tensor in result["export_before"].items():
            assert torch.equal(tensor, tp2[0]["export_before"][name])
    before = logits_from_tensors(model_dir, tp2[0]["export_before"], ids)
    assert (before - hf_logits(model_dir, ids)).abs().max() <= LOGITS_TOL
    after = logits_from_tensors(model_dir, tp2[0]["export_after"], ids)
    assert (after - before).abs().max() > 1e-3
    assert (after - tp2[0]["logits_after"]).abs().max() <= LOGITS_TOL
    # save_hf_dir: rank 0 wrote a folder transformers loads as it is.
    saved = tp2[0]["saved"]
    assert tp2[1]["saved"] is None and saved is not None
    assert {p.name for p in model_dir.iterdir()} <= {p.name for p in saved.iterdir()}
    assert (saved / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (hf_logits(saved, ids) - tp2[0]["logits_after"]).abs().max() <= LOGITS_TOL


def test_gradients_do_not_depend_on_the_number_of_micro_batches(tp1: dict[str, Any]) -> None:
    assert len(tp1["metrics_1mb"]) == 1 and len(tp1["metrics_4mb"]) == 4
    total = sum(m["loss"] for m in tp1["metrics_4mb"])
    assert abs(total - tp1["metrics_1mb"][0]["loss"]) < 1e-5
    for name, grad in tp1["grads_1mb"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(tp1["grads_4mb"][name], grad, atol=GRAD_TOL, rtol=0)


@pytest.mark.slow
def test_gradients_at_dp2_equal_dp1(tp1: dict[str, Any], model_dir: Path) -> None:
    results = spawn_ranks(data_parallel_checks, 2, model_dir, timeout_s=TIMEOUT_S)
    assert [r["layout"].dp_size for r in results] == [2, 2]
    for result in results:
        torch.testing.assert_close(result["logp"], tp1["logp"][result["rows"]], atol=1e-6, rtol=0)
        # Each rank holds the gradient of the whole global batch: summed, not averaged.
        for name, grad in tp1["grads_1mb"].items():
            torch.testing.assert_close(result["grads"][name], grad, atol=GRAD_TOL, rtol=0)


@pytest.mark.slow
def test_gradients_at_tp2_equal_tp1(
    tp1: dict[str, Any], tp2: list[dict[str, Any]], model_dir: Path
) -> None:
    spec = ModelSpec.from_hf_dir(model_dir)
    reference = mcore_to_hf([tp1["grads_1mb"]], spec)
    for key in ("grads_1mb", "grads_4mb"):
        gathered = mcore_to_hf([r[key] for r in tp2], spec)
        for name, grad in reference.items():
            torch.testing.assert_close(gathered[name], grad, atol=GRAD_TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "tp", "distributed"),
    [(1, 1, False), (2, 1, True), (2, 2, False)],
    ids=["single", "dp2-distributed-optimizer", "tp2"],
)
def test_checkpoint_round_trip(
    world_size: int, tp: int, distributed: bool, model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    results = spawn_ranks(
        checkpoint_checks, world_size, model_dir, root, tp, distributed, timeout_s=TIMEOUT_S
    )
    for result in results:
        assert result["common"] == {"step": 1, "data": [3, 4]}
        assert result["weights_diff"] == 0.0
        assert result["optimizer_diff"] == 0.0
        assert result["rng_equal"]
        assert result["next_weights_diff"] == 0.0
        assert result["initial_weights_diff"] == 0.0
        assert result["first_step_diff"] == 0.0
    # no partial folder left
    assert sorted(p.name for p in root.iterdir()) == ["step_00000000", "step_00000001"]


def test_latest_checkpoint_ignores_partial_and_picks_the_highest_step(tmp_path: Path) -> None:
    from relayrl.trainer.checkpointing import COMMON_FILE, latest_checkpoint

    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for name, step in (("step_9", 9), ("step_10", 10), (".step_11.partial", 11)):
        (tmp_path / name).mkdir()
        if not name.startswith("."):
            (tmp_path / name / COMMON_FILE).write_text(f'{{"common": {{"step": {step}}}}}')
    (tmp_path / "step_12").mkdir()  # killed before completion: no common.json
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"


def test_spawn_ranks_raises_with_the_failing_ranks_traceback() -> None:
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 failed.*boom on purpose"):
        spawn_ranks(fail_on_rank_1, 2, timeout_s=60)


@pytest.mark.slow
def test_a_save_killed_before_its_rename_leaves_the_previous_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(RankFailedError, match="exited with code 9"):
        spawn_ranks(save_then_die_mid_save, 1, model_dir, tmp_path, timeout_s=TIMEOUT_S)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_2.partial", "step_1"]
    result = spawn_ranks(resume_and_save_again, 1, model_dir, tmp_path, timeout_s=TIMEOUT_S)[0]
    assert result == {"latest": "step_1", "common": {"step": 1}, "saved": "step_2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]
