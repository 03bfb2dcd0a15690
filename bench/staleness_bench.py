"""What staleness costs and what the behaviour corrections win back, in the real pipeline:
`relayrl up` (redis, gateway, reward-service, weight-sync, trainer, vLLM engine) on the default
task in `sync` mode, with rollout held exactly `lag` versions behind the trainer
(`research.policy_lag`, docs/staleness.md#controlled-lag), without correction and with TIS
(C = 2) or IcePop ([0.5, 5]) weights. Every variant has the same seed, steps, warm start and
a constant learning rate (1e-3, 2.5x the default job's peak) at which the policy moves fast
enough for lag to matter (lag 0 gains about 8 held-out points in 30 steps); each
variant runs once per seed (`--seeds`) and the summary is the mean over seeds.

Per variant: final held-out accuracy (greedy; the trained policy, published at the end),
train reward over the last steps, the mean policy lag the trainer recorded, the mean
|log π_old - log μ| per trained token and the fraction of tokens whose raw weight π_old/μ is
at or above 2 (what TIS would cap), both averaged over the steps at full lag.

The last line is exactly:
    staleness-bench: lag0=<acc> lag8_none=<acc> lag8_tis=<acc> lag8_icepop=<acc>
    recovered=<(lag8_tis - lag8_none) / (lag0 - lag8_none)>
(on one line).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from up_runs import UpRun, run_up

from relayrl.core.records import StepRecord

# label, lag, importance_sampling
VARIANTS: dict[str, tuple[int, dict]] = {
    "lag0": (0, {"kind": "none"}),
    "lag2_none": (2, {"kind": "none"}),
    "lag4_none": (4, {"kind": "none"}),
    "lag8_none": (8, {"kind": "none"}),
    "lag4_tis": (4, {"kind": "tis", "cap": 2.0}),
    "lag8_tis": (8, {"kind": "tis", "cap": 2.0}),
    "lag8_icepop": (8, {"kind": "icepop", "alpha": 0.5, "beta": 5.0}),
}
LAST_STEPS = 5  # train reward is averaged over these
# Compared between the bench's source (the trainer's step records) and the dashboards' (the
# trainer's /metrics as scraped): the same step must show the same values.
DASHBOARD_METRICS = ("abs_log_ratio_mean", "is_raw_frac_over_cap", "policy_lag_mean", "reward_mean")


@dataclass
class Result:
    label: str
    lag: int
    seed: int  # -1: the mean over seeds
    warm: float
    final: float
    reward_last: float
    policy_lag: float
    abs_log_ratio: float
    over_cap: float
    wall_s: float
    dashboard_step: int
    dashboard_gap: float  # largest |record - scraped gauge| over DASHBOARD_METRICS


def variant_config(args: argparse.Namespace, lag: int, weights: dict, seed: int) -> dict:
    trainer: dict = {"algorithm": {"loss": {"importance_sampling": weights}}}
    if lag:
        trainer["research"] = {"policy_lag": lag}
    return {
        "train": {
            "mode": "sync",
            "steps": args.steps,
            "lr": args.lr,
            "lr_schedule": "constant",
            "seed": seed,
        },
        "eval": {"interval_steps": 0, "sampled": False},
        "services": {"trainer": trainer},
    }


def summarise(label: str, lag: int, seed: int, run: UpRun) -> Result:
    steps = run.steps
    full_lag = [r for r in steps if r.step >= lag] or steps
    last = steps[-LAST_STEPS:]
    return Result(
        label=label,
        lag=lag,
        seed=seed,
        warm=run.accuracy("warm_start"),
        final=run.accuracy("final"),
        reward_last=statistics.fmean(_measured(r.reward_mean) for r in last),
        policy_lag=statistics.fmean(r.policy_lag_mean or 0.0 for r in full_lag),
        abs_log_ratio=statistics.fmean(_measured(r.abs_log_ratio_mean) for r in full_lag),
        over_cap=statistics.fmean(_measured(r.is_raw_frac_over_cap) for r in full_lag),
        wall_s=run.wall_s,
        **dashboard_check(run, steps),
    )


def _measured(value: float | None) -> float:
    """A per-step scalar every step of these runs has (a step without it is a broken run)."""
    if value is None:
        raise RuntimeError("staleness-bench: a step record lacks a scalar every step logs")
    return value


def dashboard_check(run: UpRun, steps: list[StepRecord]) -> dict:
    step, scraped = run.dashboard_values()
    record = next((r for r in steps if r.step == step), None)
    if record is None or any(name not in scraped for name in DASHBOARD_METRICS):
        return {"dashboard_step": step, "dashboard_gap": float("inf")}
    gap = max(abs((getattr(record, name) or 0.0) - scraped[name]) for name in DASHBOARD_METRICS)
    return {"dashboard_step": step, "dashboard_gap": gap}


def mean_of(results: list[Result], label: str) -> Result:
    """The mean over seeds of a variant's figures (one row of the summary)."""
    rows = [r for r in results if r.label == label]
    fields = ("warm", "final", "reward_last", "policy_lag", "abs_log_ratio", "over_cap", "wall_s")
    means = {f: statistics.fmean(getattr(r, f) for r in rows) for f in fields}
    return Result(
        label=label,
        lag=rows[0].lag,
        seed=-1,
        **means,
        dashboard_step=-1,
        dashboard_gap=max(r.dashboard_gap for r in rows),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="trainer steps per variant")
    parser.add_argument("--lr", type=float, default=1e-3, help="constant learning rate")
    parser.add_argument(
        "--seeds", default="0,1", help="comma-separated; every variant runs once per seed"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument("--runs-dir", type=Path, help="default: a temporary folder")
    args = parser.parse_args()
    labels = args.variants.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    unknown = [x for x in labels if x not in VARIANTS]
    if unknown:
        sys.exit(f"staleness-bench: unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="staleness-bench-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"staleness-bench: sync mode, {args.steps} steps, lr {args.lr:g} constant, seeds "
        f"{seeds}; runs in {runs_dir}",
        file=sys.stderr,
    )
    results = []
    for seed in seeds:
        for label in labels:
            lag, weights = VARIANTS[label]
            config = variant_config(args, lag, weights, seed)
            run = run_up(f"{label}-s{seed}", config, runs_dir, bench="staleness-bench")
            results.append(summarise(label, lag, seed, run))
    means = {label: mean_of(results, label) for label in labels}
    print(
        f"{'variant':<12} {'seed':>4} {'lag':>3} {'warm':>6} {'final':>6} {'reward':>7} "
        f"{'pol.lag':>7} {'|dlogp|':>8} {'w>=2':>6} {'wall s':>7}"
    )
    for r in [*results, *means.values()]:
        seed = "mean" if r.seed < 0 else str(r.seed)
        print(
            f"{r.label:<12} {seed:>4} {r.lag:>3} {r.warm:>6.1%} {r.final:>6.1%} "
            f"{r.reward_last:>7.3f} {r.policy_lag:>7.2f} {r.abs_log_ratio:>8.4f} "
            f"{r.over_cap:>6.3f} {r.wall_s:>7.0f}"
        )
    print(
        f"final: held-out accuracy after {args.steps} steps; reward: train reward, mean over the "
        f"last {LAST_STEPS} steps; pol.lag, |dlogp| (mean |log pi_old - log mu| per token) and "
        "w>=2 (tokens with pi_old/mu >= 2): mean over the steps at full lag"
    )
    gaps = [r.dashboard_gap for r in results]
    print(
        "dashboards vs bench: the trainer's last /metrics scrape (steps "
        f"{sorted({r.dashboard_step for r in results})}) against its step record, "
        f"{', '.join(DASHBOARD_METRICS)}: largest difference {max(gaps):.2g} "
        f"({'agree' if max(gaps) < 1e-9 else 'DISAGREE'})"
    )

    def acc(label: str) -> str:
        return f"{means[label].final:.3f}" if label in means else "n/a"

    recovered = "n/a"
    if {"lag0", "lag8_none", "lag8_tis"} <= means.keys():
        lost = means["lag0"].final - means["lag8_none"].final
        won = means["lag8_tis"].final - means["lag8_none"].final
        recovered = f"{won / lost:.2f}" if abs(lost) > 1e-9 else "n/a (lag 8 lost nothing)"
    print(
        f"staleness-bench: lag0={acc('lag0')} lag8_none={acc('lag8_none')} "
        f"lag8_tis={acc('lag8_tis')} lag8_icepop={acc('lag8_icepop')} recovered={recovered}"
    )


if __name__ == "__main__":
    main()
