"""Network faults on every link of `relayrl up` while it trains: each part on a host of its own
(`hosts: {isolate: true}`), every fault kind of relayrl_testkit.netfault put on every link that
carries traffic (docs/recovery.md#hosts-of-our-own), then a random schedule, and every run
audited (`relayrl audit`: no group lost or trained twice, no prompt skipped).

A run takes its faults one after another: a fault starts once the run has committed a version,
and its stall is the time from its heal to the next committed version. A fault after whose heal
no version is committed within HUNG_BOUND_S counts as hung. The links (client - server, as in
the table of docs/recovery.md#silent-peers-the-bound-on-every-link) and the largest bound that
detects a silent peer on each:

    gateway-redis, trainer-redis, reward-redis   redis-py, command 30 s
    gateway-engine-0                             generate and control calls, 30 s
    weightsync-engine-0                          control calls 30 s; the engine's bucket pull
                                                 from weight-sync (gRPC keepalive) 30 s
    trainer-weightsync                           publish, push, commit wait, 30 s
    gateway-weightsync                           RegisterEngine 10 s; weight-sync's pause,
                                                 resume and drain of the gateway, 30 s
    trainer-gateway                              policy step, pause, resume, 30 s
    up-engine-0                                  `relayrl up`'s evaluations, 30 s

A fault between two hosts takes their packets both ways, so it cuts every call between them
whichever side makes it. Each kind lasts SHORT_FAULT_S, and each link also gets one partition
longer than its largest bound (LONG_MARGIN_S beyond it), so that the bound fires and its
recovery path runs: a short outage TCP rides out proves nothing about timeouts.
half_open_restart restarts the link's server behind the partition by SIGKILLing its process
group (its PID from the run's stack.json), as a crashed host; `relayrl up`'s supervisor starts
it again on the same host, and the partition lasts RESTART_FAULT_S or until the server is
running again, whichever is later.

The last line is exactly (one line):
    netfault-bench: faults=<n> runs_completed=<n>/<n> lost=<n> trained_twice=<n>
                    prompts_skipped=<n> hung=<n> max_stall_s=<s>
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos_bench import ChaosError, UpRun, audit_into, audit_totals, kill_group

from relayrl_testkit.netfault import KINDS, Fault, Faults, Kind, network_of_run

SHORT_FAULT_S = 5.0
"""A short fault: past TCP's first retransmissions, well inside every bound."""
RESTART_FAULT_S = 10.0
"""half_open_restart at the least: it lasts until the server is back (the engine: ~30 s)."""
RESTART_WAIT_S = 180.0
"""How long a server restarted by half_open_restart may take to be running again."""
LONG_MARGIN_S = 5.0
"""The long fault of a link lasts this much longer than the link's largest bound."""
HUNG_BOUND_S = 60.0
"""A heal to the next committed version (issue 36's bound on max_stall_s): longer is hung."""
GIVE_UP_S = 300.0
"""No version this long after a heal: the run is stopped and its faults left are moved on."""
SLOW_RATE_BYTES_S = 64_000
"""slow: the rate each direction of the link is held to."""
STEP_MARGIN = 5
"""A run takes no new fault once it is this many steps from its end (it must commit after)."""
STEPS_PER_FAULT = 5
"""Steps a run is given for each fault that stops training (a fault and its recovery take one
or two here)..."""
STEPS_PER_S = 4.0
"""...and for each second of a fault that does not (`up` to the engine, slow, half_open, whose
new connections work): the tiny task trains one to three steps a second meanwhile (the most
when its groups carry no signal), and a fault is taken only with room for it (`room_for`)."""
GOES_ON = ("slow", "half_open")
"""Kinds under which training goes on, on any link."""
EST_FAULT_S = 10.0
"""What the plan's time estimate takes for a fault's recovery, on top of its length..."""
EST_START_S = 150.0
"""...and for a run to start (namespaces, Redis, the engine, the warm start) and stop."""
RUN_OVER: dict[str, Any] = {
    "hosts": {"isolate": True},
    # evaluations every few steps, so that the link from `relayrl up` to the engine has traffic
    "eval": {"interval_steps": 5, "sampled": False},
    # runs of hundreds of short steps: a checkpoint every few seconds is plenty
    "train": {"checkpoint_interval_steps": 10},
    # restarts by half_open_restart, on top of those the faults themselves may cause
    "supervision": {"max_restarts": 30, "restart_backoff_s": 1.0},
}


@dataclass(frozen=True)
class Link:
    a: str
    """The client side (`up` is `relayrl up` itself, in the root namespace)."""
    b: str
    """The server side: what half_open_restart restarts."""
    bound_s: float
    """The largest silent-peer bound on the link (docs/recovery.md)."""

    @property
    def name(self) -> str:
        return f"{self.a}-{self.b}"


LINKS = {
    link.name: link
    for link in (
        Link("gateway", "redis", 30.0),
        Link("trainer", "redis", 30.0),
        Link("reward", "redis", 30.0),
        Link("gateway", "engine-0", 30.0),
        Link("weightsync", "engine-0", 30.0),
        Link("trainer", "weightsync", 30.0),
        Link("weightsync", "gateway", 30.0),
        Link("trainer", "gateway", 30.0),
        Link("up", "engine-0", 30.0),
    )
}
# gateway-weightsync names the same pair of hosts as weightsync-gateway (the gateway's
# RegisterEngine and weight-sync's calls to the gateway); its restart is the gateway's.
ALIASES = {"gateway-weightsync": "weightsync-gateway"}


@dataclass
class Planned:
    link: str
    kind: str
    for_s: float
    why: str  # short, long (past the link's bound) or random


@dataclass
class Outcome:
    planned: Planned
    run: str
    step: int  # trainer steps logged when it started
    lasted_s: float = 0.0
    stall_s: float | None = None  # heal -> next committed version
    hung: bool = False
    note: str = ""


@dataclass
class RunResult:
    name: str
    steps: int
    completed: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def plan(links: list[str], kinds: list[str], rounds: int, seed: int, quick: bool) -> list[Planned]:
    """The fixed schedule (every kind on every link, then one long partition per link), then
    `rounds` random picks; with `quick`, one short fault per link, the kinds taken in turn."""

    def short(kind: str) -> float:
        return RESTART_FAULT_S if kind == "half_open_restart" else SHORT_FAULT_S

    if quick:
        return [
            Planned(link, kinds[i % len(kinds)], short(kinds[i % len(kinds)]), "short")
            for i, link in enumerate(links)
        ]
    fixed: list[Planned] = []
    long_kind = "partition" if "partition" in kinds else kinds[0]
    for link in links:
        fixed += [Planned(link, kind, short(kind), "short") for kind in kinds]
        fixed.append(Planned(link, long_kind, LINKS[link].bound_s + LONG_MARGIN_S, "long"))
    rng = random.Random(seed)
    picks = []
    for _ in range(rounds):
        link, kind = rng.choice(links), rng.choice(kinds)
        low = short(kind)
        for_s = round(rng.uniform(low, max(low, LINKS[link].bound_s + LONG_MARGIN_S)), 1)
        picks.append(Planned(link, kind, for_s, "random"))
    return fixed + picks


def steps_for(faults: list[Planned]) -> int:
    """Steps enough for a run to take `faults` one after another: too many are trained after
    the last fault for nothing, and a run given too few passes the faults it has no room for
    on to the next run."""
    goes_on_s = sum(f.for_s for f in faults if f.kind in GOES_ON or LINKS[f.link].a == "up")
    return STEP_MARGIN + round(goes_on_s * STEPS_PER_S) + STEPS_PER_FAULT * len(faults)


def estimate_s(faults: list[Planned], max_steps: int) -> tuple[int, float]:
    """How many runs the faults take, and about how long the bench takes."""
    runs = -(-steps_for(faults) // max_steps)
    return runs, sum(f.for_s + EST_FAULT_S for f in faults) + runs * EST_START_S


def restarter(run: UpRun, part: str) -> Callable[[], None]:
    """half_open_restart's restart: the part's process group SIGKILLed, and back once the
    supervisor has it running (ready) again, under a new PID."""

    def restart() -> None:
        child = run.children()[part]
        kill_group(child["pid"])

        def restarted() -> bool:
            now = run.children()[part]
            return now["restarts"] > child["restarts"] and now["pid"] != child["pid"]

        run.wait(restarted, f"{part} restarted", RESTART_WAIT_S, poll_s=0.1)

    return restart


def inject(run: UpRun, faults: Faults, planned: Planned, rate_bytes_s: int) -> Fault:
    """The planned fault, held for its time; returns it healed. half_open_restart holds until
    its server is back too, so that the restart happens behind the partition and the stall
    after the heal is the clients' recovery, not the server's start."""
    link = LINKS[planned.link]
    kind: Kind = planned.kind  # type: ignore[assignment]  # parse_args took it from KINDS
    if kind == "slow":
        return faults.hold(kind, link.a, link.b, for_s=planned.for_s, rate_bytes_s=rate_bytes_s)
    if kind != "half_open_restart":
        return faults.hold(kind, link.a, link.b, for_s=planned.for_s)
    fault = faults.inject(kind, link.a, link.b, for_s=planned.for_s + RESTART_WAIT_S,
                          restart=restarter(run, link.b))  # fmt: skip
    time.sleep(max(0.0, fault.started + planned.for_s - time.time()))
    fault.heal()
    return fault


def stall_after(run: UpRun, healed: float) -> float:
    """Seconds from a heal to the next committed version (waited for up to GIVE_UP_S)."""

    def stall() -> float | None:
        commits = run.commits_after(healed)
        return max(commits[0] - healed, 1e-3) if commits else None

    return run.wait(stall, "a version committed after the heal", GIVE_UP_S)


def take_faults(run: UpRun, name: str, pending: list[Planned], result: RunResult,
                rate_bytes_s: int, say: Callable[[str], None]) -> None:  # fmt: skip
    """Puts faults on the run one after another, each once a version is committed, until
    none is left or the run is near its end; `pending` keeps those it did not take."""
    run.wait(lambda: run.commits_after(0.0), "the first committed version", 900)
    faults = Faults(network_of_run(run.run_dir), log_path=run.run_dir / "faults.jsonl")
    try:
        while pending and room_for(run, pending[0]):
            planned = pending.pop(0)
            outcome = Outcome(planned, name, run.steps_logged())
            result.outcomes.append(outcome)
            fault = inject(run, faults, planned, rate_bytes_s)
            outcome.lasted_s = fault.lasted_s or 0.0
            try:
                outcome.stall_s = stall_after(run, fault.healed)
            except ChaosError as exc:
                outcome.hung, outcome.note = True, str(exc)
                raise
            outcome.hung = outcome.stall_s > HUNG_BOUND_S
            hung = "  HUNG" if outcome.hung else ""
            say(f"  {name}: {planned.kind:<17} {planned.link:<20} {outcome.lasted_s:5.1f} s "
                f"({planned.why}) at step {outcome.step:>2}; next version "
                f"{outcome.stall_s:5.1f} s after the heal{hung}")  # fmt: skip
    finally:
        faults.heal_all()


def room_for(run: UpRun, planned: Planned) -> bool:
    """Whether the run has steps enough left to take `planned` and commit a version after its
    heal. A fault under which training goes on uses steps at the rate the run trains at (half
    again the latest rate, at least a step a second); a run that ends inside a fault measures
    nothing, so such a fault waits for the next run."""
    left = run.steps - run.steps_logged() - STEP_MARGIN
    if planned.kind in GOES_ON or LINKS[planned.link].a == "up":
        latest = run.step_records()[-20:]
        seconds = latest[-1].time - latest[0].time if len(latest) > 1 else 0.0
        rate = (len(latest) - 1) / seconds if seconds > 0 else 1.0
        return left >= math.ceil(1.5 * max(rate, 1.0) * planned.for_s)
    return left > 0


def one_run(name: str, pending: list[Planned], steps: int, runs_dir: Path,
            rate_bytes_s: int, say: Callable[[str], None]) -> RunResult:  # fmt: skip
    """One `relayrl up` run that takes what faults of `pending` it can, stopped and its hosts
    removed whatever happens, then audited."""
    from relayrl.up.hosts import remove_tagged, tag_of

    result = RunResult(name, steps)
    run = UpRun(runs_dir, steps, runs_dir / f"{name}.log", RUN_OVER)
    try:
        take_faults(run, name, pending, result, rate_bytes_s, say)
        code = run.process.wait(60 * 60)
        result.completed = code == 0 and f"for {steps} steps" in run.output()
        if not result.completed:
            result.error = f"relayrl up exited {code}: " + run.output().splitlines()[-1]
    except (ChaosError, RuntimeError, OSError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        run.stop()
        remove_tagged(tag_of(run.process.pid))
    return audit_into(result, run.run_dir, say)


def names(value: str, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    picked = [ALIASES.get(v.strip(), v.strip()) for v in value.split(",") if v.strip()]
    unknown = [v for v in picked if v not in known]
    if unknown or not picked:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or '(none given)'}; one of {', '.join(known)}"
        )
    return list(dict.fromkeys(picked))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--links", type=lambda v: names(v, list(LINKS), "link"), default=list(LINKS),
        help=f"comma-separated links (default: all): {', '.join(LINKS)}",
    )  # fmt: skip
    parser.add_argument(
        "--kinds", type=lambda v: names(v, KINDS, "kind"), default=list(KINDS),
        help=f"comma-separated fault kinds (default: all): {', '.join(KINDS)}",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8, help="random faults after the fixed ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random schedule")
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: one short fault per link (kinds in turn), no long or random ones",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=600,
                        help="trainer steps of a run at most (more faults: more runs)")  # fmt: skip
    parser.add_argument("--slow-rate-bytes-s", type=int, default=SLOW_RATE_BYTES_S,
                        help="what slow holds each direction of a link to")  # fmt: skip
    parser.add_argument("--plan-only", action="store_true", help="print the plan and stop")
    parser.add_argument("--keep", type=Path, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.rounds < 0:
        parser.error("--rounds must be >= 0")
    if args.max_steps < STEP_MARGIN + STEPS_PER_FAULT:
        parser.error(f"--max-steps must be at least {STEP_MARGIN + STEPS_PER_FAULT}")
    if args.slow_rate_bytes_s <= 0:
        parser.error("--slow-rate-bytes-s must be > 0")
    return args


def report(results: list[RunResult], outcomes: list[Outcome], not_taken: int) -> int:
    print("stall (heal -> next committed version), seconds, per link:")
    by_link: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_link.setdefault(o.planned.link, []).append(o)
    for link, done in sorted(by_link.items()):
        stalls = [o.stall_s for o in done if o.stall_s is not None]
        longest = max((o.lasted_s for o in done), default=0.0)
        worst, num_hung = max(stalls, default=0.0), sum(o.hung for o in done)
        print(f"  {link:<20} faults={len(done):>2}  longest_fault={longest:5.1f}  "
              f"max_stall={worst:6.1f}  hung={num_hung}")  # fmt: skip
    if not_taken:
        print(f"faults planned but not taken (a run failed): {not_taken}")
    completed = sum(r.completed and not r.error for r in results)
    total = audit_totals([r.audit for r in results])
    hung = sum(o.hung for o in outcomes)
    max_stall = max((o.stall_s or 0.0 for o in outcomes), default=0.0)
    print(
        f"netfault-bench: faults={len(outcomes)} runs_completed={completed}/{len(results)} "
        f"lost={total['lost']} trained_twice={total['trained_twice']} "
        f"prompts_skipped={total['prompts_skipped']} hung={hung} max_stall_s={max_stall:.1f}"
    )
    ok = completed == len(results) and not any(total.values()) and not hung and not not_taken
    return 0 if ok and max_stall <= HUNG_BOUND_S else 1


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    pending = plan(args.links, args.kinds, 0 if args.quick else args.rounds, args.seed,
                   args.quick)  # fmt: skip
    runs, bench_s = estimate_s(pending, args.max_steps)
    print(f"netfault-bench: {len(pending)} faults on {len(args.links)} links, about {runs} "
          f"run(s) of up to {args.max_steps} steps, about {bench_s / 60:.0f} min")  # fmt: skip
    for i, p in enumerate(pending):
        print(f"  {i:>3} {p.kind:<17} {p.link:<20} {p.for_s:5.1f} s  {p.why}")
    if args.plan_only:
        return 0
    from relayrl.up.hosts import missing_for_hosts
    from relayrl_testkit.helpers.signals import raise_on_sigterm

    if (missing := missing_for_hosts()) is not None:
        sys.exit(f"netfault-bench: hosts of our own {missing}")
    raise_on_sigterm()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="relayrl-netfault-"))
    started = time.monotonic()
    results: list[RunResult] = []
    while pending:
        steps = min(args.max_steps, steps_for(pending))
        before = len(pending)
        results.append(one_run(f"run-{len(results)}", pending, steps, keep, args.slow_rate_bytes_s,
                               lambda line: print(line, flush=True)))  # fmt: skip
        if results[-1].error and len(pending) == before:
            break  # a run that took no fault: another would fail the same way
    outcomes = [o for r in results for o in r.outcomes]
    records = [asdict(r) for r in results]
    (keep / "netfault.json").write_text(json.dumps(records, indent=1, default=str))
    print(f"runs kept in {keep}; {(time.monotonic() - started) / 60:.1f} min")
    return report(results, outcomes, len(pending))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
