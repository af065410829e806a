"""Replicas that do not wait for each other: `averager.balance=time` against
`balance=steps` with one slow replica, equal replicas bit for bit, and
`averager.period_schedule=adacomm` against fixed periods on a slow link (issue 44).

What is measured, every run the real CLI (`python train.py`, or two torchruns
over bench/averaging.py's shaped `Link`), on byte-level text (`data=text`),
AdamW, held-out loss (`eval/loss`) every `--eval-every` steps, read back from
rank 0's metrics.jsonl. A run's wall time at a step is the sum of
`train/step_time_s` over its log rows from step 1 on (training, averaging and
eval; not process start-up or the first step's own start-up):

Part `uneven`: 4 replicas (`launcher.nproc=4 sharding=no_shard`), replica 3
`--factor` times slower (HARNESS_TEST_SLOWDOWN, a test-only knob that makes it
sleep (factor - 1) x its own compute each local step), post-local SGD every
`--period` steps, `balance=steps` against `balance=time`, the same
`train.steps` (the time run goes on to 1.5 times them, to reach the steps run's
loss), `--rounds` times side by side (the steps run, then the time run).
Reported, as medians over the rounds: the wall time `balance=time` takes to reach
`balance=steps`'s final held-out loss, over `balance=steps`'s (target <= 0.7), and
the held-out losses at equal global samples (the time run's first eval at or past
`--steps`; target: within 1 %); per run the wall time and loss at those samples,
the slow replica's mean local steps per uneven period (from the fourth, the first
planned from measured times, whole ones) and the fast ones' mean wait at the
exchanges. Every run ends with an exchange, so each final loss is of one model.

Part `hierarchy`: part uneven with hierarchical averaging instead, pairs of
replicas every `--period`/4 steps and all 4 every `--period`
(`averager=hierarchical`; under `balance=time` the pairs meet at points of each
replica's planned period).

Part `torchft`: part uneven with each replica a replica group of its own
(`fault_tolerance=torchft`: a lighthouse, the groups' Managers, a quorum before
each exchange), group 3 slowed; the figures are group 0's rows.

`--factor` alone scales the slow replica's own compute, which on a shared host
grows and shrinks with the cores its peers leave it while they wait for it
under `balance=steps`: the 4 replicas' `balance=steps` run took 50 s in one
world (waiting in gloo's all-reduce) and 37 s as replica groups (waiting in
torchft's quorum), the slow one's steps faster there, so the two parts' slow
replicas are not equally slow. `--pad S` pads every replica's local steps to
S s and the slow one's to factor x S: a device's speed whatever the host does
(S above a step's compute under load).

Part `equal`: the same 4 replicas, none slowed: `balance=time` and
`balance=steps` end with the same parameters and optimizer state, bit for bit
(the final checkpoints compared tensor by tensor), and every period was
`--period` steps for every replica.

Part `adacomm`: AdaComm from `--adacomm-period` against fixed periods
`--periods`, 2 replicas x 2 shards over a `--rate` link (two network
namespaces; over loopback where it cannot be built, said so), the same steps.
Reported: each run's held-out loss at equal wall time (the shortest run's,
each run's trace interpolated linearly), target adacomm at or below the best
fixed period's; and the period AdaComm chose over time (`--plot` draws loss
against wall time and the period into a PNG).

    python bench/uneven.py [--part uneven,hierarchy,torchft,equal,adacomm] [--steps 160] [--period 8] [--factor 2]
                           [--pad 0.2] [--rounds 3] [--adacomm-steps 256] [--periods 1,4,16,32] [--adacomm-period 32]
                           [--eval-every 16] [--rate 100mbit] [--loopback] [--plot uneven.png]
                           [hydra overrides for every run ...]
    python bench/uneven.py --smoke   # every part, a 1-block GPT, a few steps, over loopback
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from averaging import RUN_TIMEOUT_S, Link, RunFailed, link_unavailable, print_load, print_table, tc_rate, wait_all
from flags import above, at_least, file_to_write, integers

REPO = Path(__file__).resolve().parents[1]
SLOWDOWN = "HARNESS_TEST_SLOWDOWN"
SETTINGS = ["data=text", "optimizer=adamw", "wandb.mode=disabled"]
FOUR = ["launcher.nproc=4", "sharding=no_shard"]
TWO_BY_TWO = ["sharding=hybrid_shard", "sharding.replicate=2"]
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = "--steps 8 --period 2 --warmup 2 --adacomm-steps 8 --periods 2 --adacomm-period 4 --eval-every 4".split()
# every part but torchft, whose runs are part uneven's with the replica groups' keys (bench/matrix.py's smoke
# runs replica groups through this machinery's launches)
SMOKE += ["--rounds", "1", "--loopback", "--part", "uneven,hierarchy,equal,adacomm"]
SMOKE_OVERRIDES = "model.n_layer=1 model.d_model=32 train.batch_size=2 train.seq_len=32 data.max_bytes=1000000".split()
TIME_TARGET, LOSS_TARGET = 0.7, 0.01
GO_ON = 1.5  # part uneven's balance=time run trains this many times the samples, to reach balance=steps's loss


@dataclass
class Run:
    label: str
    rows: list[dict]
    run_dir: Path

    def trace(self) -> list[tuple[float, float]]:
        """(wall s, eval loss) at each eval, the wall time from step 1 on."""
        wall, last, points = 0.0, None, []
        for row in self.rows:
            if "train/step_time_s" in row:
                if last is not None:
                    wall += row["train/step_time_s"] * (row["train/step"] - last)
                last = row["train/step"]
            if "eval/loss" in row:
                points.append((wall, row["eval/loss"]))
        return points

    @property
    def wall(self) -> float:
        return self.trace()[-1][0]

    @property
    def final_loss(self) -> float:
        return self.trace()[-1][1]

    def exchanges(self) -> list[dict]:
        return [r for r in self.rows if "averager/period" in r]


def loss_at(run: Run, wall: float) -> float:
    """The run's held-out loss at `wall` seconds, linear between its evals."""
    points = run.trace()
    for (w0, l0), (w1, l1) in zip(points, points[1:]):
        if w0 <= wall <= w1:
            return l0 + (l1 - l0) * (wall - w0) / max(w1 - w0, 1e-9)
    return points[-1][1]


def at_step(run: Run, step: int) -> tuple[float, float]:
    """(wall s, eval loss) of the run's first eval at or past global step `step` (with balance=time an eval falls
    at the first exchange at or past a multiple of train.eval_every)."""
    wall, last = 0.0, None
    for row in run.rows:
        if "train/step_time_s" in row:
            if last is not None:
                wall += row["train/step_time_s"] * (row["train/step"] - last)
            last = row["train/step"]
        if "eval/loss" in row and row["step"] >= step:
            return wall, row["eval/loss"]
    return run.trace()[-1]


def time_to(run: Run, loss: float) -> float | None:
    """The wall time at which the run's held-out loss first reaches `loss`, linear between evals."""
    points = run.trace()
    for (w0, l0), (w1, l1) in zip(points, points[1:]):
        if l1 <= loss:
            return w0 + (w1 - w0) * (l0 - loss) / (l0 - l1) if l0 > loss else w0
    return None


def train(label: str, overrides: list[str], workdir: Path, link: Link | None = None, slow: str = "") -> Run:
    run_dir = workdir / label.replace(" ", "_")
    run_dir.mkdir(parents=True)
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    if link is None:
        cmds = [[sys.executable, "train.py", *args]]
    else:
        cmds = [link.node_cmd(node, args, len(list(workdir.iterdir()))) for node in (0, 1)]
    print(f"  {label}: {SLOWDOWN}={slow} " if slow else f"  {label}: ", end="")
    print("\n    ".join(map(shlex.join, cmds)), flush=True)
    env = {**os.environ, SLOWDOWN: slow} if slow else {k: v for k, v in os.environ.items() if k != SLOWDOWN}
    logs = [run_dir / f"node{n}.out" for n in range(len(cmds))]
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    wait_all(procs, logs, RUN_TIMEOUT_S * 4)
    metrics = run_dir / "metrics.jsonl"
    if (run_dir / "replica_group_0").is_dir():  # fault_tolerance=torchft: each group logs its own rows
        metrics = run_dir / "replica_group_0" / "metrics.jsonl"
    if not metrics.exists():
        raise RunFailed(f"{label}: no {metrics}")
    return Run(label, [json.loads(line) for line in metrics.read_text().splitlines()], run_dir)


def common(args: argparse.Namespace, steps: int) -> list[str]:
    every = args.eval_every
    return [
        *SETTINGS,
        f"train.steps={steps}",
        f"train.log_every={every}",
        f"train.eval_every={every}",
        f"train.eval_batches={args.eval_batches}",
        f"averager.warmup_steps={args.warmup}",
        *args.overrides,
    ]


def mean_of(rows: list[dict], key: str) -> str:
    """The mean of `key` over `rows`, or '-' (balance=steps logs no replica figures)."""
    values = [r[key] for r in rows if key in r]
    return f"{statistics.fmean(values):.3f}" if values else "-"


def periodic(args: argparse.Namespace) -> list[str]:
    return ["averager=periodic", f"averager.period={args.period}"]


def hierarchy(args: argparse.Namespace) -> list[str]:
    """Pairs of replicas every period/4 steps, all 4 every period."""
    pairs = f"[{max(1, args.period // 4)},2]"
    return ["averager=hierarchical", f"averager.period_group_size=[{pairs},[{args.period},4]]"]


def slowdown(args: argparse.Namespace, slow: int) -> str:
    """HARNESS_TEST_SLOWDOWN: replica `slow` `--factor` times slower; with `--pad`, every replica's local steps
    padded to a fixed time, the slow one's to `--factor` times it."""
    if args.pad is None:
        return f"{slow}:{args.factor}"
    return ",".join(f"{r}:{args.pad * (args.factor if r == slow else 1):g}s" for r in range(4))


def part_uneven(args: argparse.Namespace, workdir: Path, part: str = "uneven") -> None:
    slow = 3  # the last of the 4 replicas
    keys = hierarchy(args) if part == "hierarchy" else periodic(args)
    if part == "torchft":
        keys = [*keys, "fault_tolerance=torchft"]
    print(f"\n== part {part}: 4 replicas, replica {slow} {args.factor}x slower, {' '.join(keys)}, ", end="")
    print(f"{args.steps} steps, {args.rounds} rounds")
    rows, ratios, gaps = [], [], []
    for round_ in range(1, args.rounds + 1):  # the two side by side in each round: the host's load drifts
        runs = {  # balance=time goes on past the samples of balance=steps's run, to reach its final loss
            balance: train(
                f"{part} {balance} {round_}",
                [*FOUR, *common(args, steps), *keys, f"averager.balance={balance}"],
                workdir,
                slow=slowdown(args, slow),
            )
            for balance, steps in (("steps", args.steps), ("time", math.ceil(args.steps * GO_ON)))
        }
        steps_run, time_run = runs["steps"], runs["time"]
        reached = time_to(time_run, steps_run.final_loss)  # None: not even GO_ON times the samples reached it
        ratios.append(math.inf if reached is None else reached / steps_run.wall)
        equal = {"steps": (steps_run.wall, steps_run.final_loss), "time": at_step(time_run, args.steps)}
        gaps.append(equal["time"][1] / steps_run.final_loss - 1)
        for balance, run in runs.items():
            # the uneven periods: from the fourth (a process measures from its third period on) and whole (the
            # run's cut last one left out); their `averager/period` is the fastest replica's steps
            ex = [r for r in run.exchanges()[3:] if r["averager/period"] == args.period]
            wall, loss = equal[balance]
            rows.append(
                [
                    round_,
                    balance,
                    f"{wall:.1f}",
                    f"{loss:.4f}",
                    "-" if balance == "steps" else f"not in {GO_ON}x" if reached is None else f"{reached:.1f}",
                    mean_of(ex, f"replica/local_steps/{slow}"),
                    mean_of(ex, "replica/local_steps/0"),
                    mean_of(ex, "replica/wait_s/0"),
                    mean_of(ex, f"replica/wait_s/{slow}"),
                ]
            )
    header = ["round", "balance", "wall s", "eval/loss", "s to steps' loss", "slow steps", "fast"]
    print_table([*header, "fast wait s", "slow wait s"], rows)
    ratio, gap = statistics.median(ratios), statistics.median(gaps)
    verdict = "ok" if ratio <= TIME_TARGET else "not met"
    print(
        f"  wall time for balance=time to reach balance=steps's final held-out loss, over balance=steps's: "
        f"median {ratio:.2f}x of {', '.join(f'{r:.2f}' for r in ratios)} (target <= {TIME_TARGET}) {verdict}"
    )
    verdict = "ok" if abs(gap) <= LOSS_TARGET else "lower, outside the band" if gap < 0 else "not met"
    print(
        f"  held-out loss at equal global samples, time/steps - 1: median {gap:+.2%} of "
        f"{', '.join(f'{g:+.2%}' for g in gaps)} (target within {LOSS_TARGET:.0%}) {verdict}"
    )
    if args.plot is not None and part == "uneven":  # harness.report's figure of the last balance=time run
        from harness.report import plot_run, read_run

        paces = args.plot.with_name(f"{args.plot.stem}-paces{args.plot.suffix}")
        plot_run(read_run(time_run.run_dir), paces)
        print(f"  plot: {paces}")


def final_tensors(run: Run) -> dict:
    step_dir = max((run.run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))
    found = {}
    for path in sorted(step_dir.glob("*.pt")):
        if path.name != "rng.pt":
            state = torch.load(path, weights_only=True)
            stack = [(f"{path.name}/{k}", v) for k, v in state.items() if k in ("model", "optim")]
            while stack:
                key, value = stack.pop()
                if isinstance(value, dict):
                    stack += [(f"{key}/{k}", v) for k, v in value.items()]
                elif isinstance(value, torch.Tensor):
                    found[key] = value
    return found


def part_equal(args: argparse.Namespace, workdir: Path) -> None:
    print(f"\n== part equal: 4 equal replicas, period {args.period}, {args.steps} steps, final checkpoints compared")
    extra = [*periodic(args), "checkpoint=full", f"checkpoint.interval={args.steps}"]
    runs = {
        b: train(f"equal {b}", [*FOUR, *common(args, args.steps), *extra, f"averager.balance={b}"], workdir)
        for b in ("steps", "time")
    }
    plans = [[r[f"replica/local_steps/{q}"] for q in range(4)] for r in runs["time"].exchanges()]
    equal_plans = all(len(set(p)) == 1 for p in plans)
    a, b = final_tensors(runs["steps"]), final_tensors(runs["time"])
    same = a.keys() == b.keys() and bool(a) and all(torch.equal(a[k], b[k]) for k in a)
    print(f"  balance=time's periods, local steps per replica: {plans}")
    print(f"  every period equal: {equal_plans}; final parameters and optimizer state bitwise equal: {same}")


def part_adacomm(args: argparse.Namespace, workdir: Path, link: Link | None, where: str) -> None:
    print(f"\n== part adacomm: 2 replicas x 2 shards, {where}, {args.adacomm_steps} steps")
    layout = TWO_BY_TWO if link is not None else [*TWO_BY_TWO, "launcher.nproc=4"]
    base = [*layout, *common(args, args.adacomm_steps), "averager=periodic"]
    runs = [train(f"fixed {p}", [*base, f"averager.period={p}"], workdir, link) for p in args.periods]
    adacomm = train(
        f"adacomm {args.adacomm_period}",
        [*base, f"averager.period={args.adacomm_period}", "averager.period_schedule=adacomm"],
        workdir,
        link,
    )
    runs.append(adacomm)
    wall = min(run.wall for run in runs)
    at = {run.label: loss_at(run, wall) for run in runs}
    rows = [[run.label, f"{run.wall:.1f}", f"{run.final_loss:.4f}", f"{at[run.label]:.4f}"] for run in runs]
    print_table(["run", "wall s", "final eval/loss", f"eval/loss at {wall:.1f} s"], rows)
    best = min(runs[:-1], key=lambda run: at[run.label])
    verdict = "ok" if at[adacomm.label] <= at[best.label] else "not met"
    print(
        f"  at equal wall time ({wall:.1f} s): adacomm {at[adacomm.label]:.4f} against the best fixed "
        f"({best.label}) {at[best.label]:.4f} (target: at or below) {verdict}"
    )
    chosen = [(r["train/step"], r["averager/period"]) for r in adacomm.exchanges()]
    changes = [(s, p) for i, (s, p) in enumerate(chosen) if i == 0 or p != chosen[i - 1][1]]
    print("  adacomm's period (from step: period): " + ", ".join(f"{s}: {p}" for s, p in changes))
    if args.plot is not None:
        plot(runs, adacomm, args.plot)


def plot(runs: list[Run], adacomm: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_period) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        walls, losses = zip(*run.trace())
        ax_loss.plot(walls, losses, marker=".", label=run.label)
    ax_loss.set(xlabel="wall time, s (from step 1)", ylabel="held-out loss", title="Held-out loss against wall time")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    steps = [r["train/step"] for r in adacomm.exchanges()]
    ax_period.plot(steps, [r["averager/period"] for r in adacomm.exchanges()], drawstyle="steps-pre", marker=".")
    ax_period.set(xlabel="step", ylabel="period (local steps)", title=f"The period {adacomm.label} chose")
    ax_period.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"  plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = ("uneven", "hierarchy", "torchft", "equal", "adacomm")
    parser.add_argument("--part", type=lambda s: s.split(","), default=list(parts), help=",".join(parts))
    parser.add_argument("--steps", type=at_least(1), default=160, help="parts uneven, hierarchy, torchft and equal")
    parser.add_argument("--period", type=at_least(1), default=8, help="parts uneven, hierarchy (the largest) and equal")
    parser.add_argument("--factor", type=above(1), default=2.0, help="how much slower the slow replica is")
    parser.add_argument(
        "--pad",
        type=above(0),
        default=None,
        help="pad every replica's local steps to PAD s, the slow one's to factor x PAD: a device's speed whatever "
        "CPU the others leave it (the factor alone scales the slow replica's own compute, which grows and shrinks "
        "with the cores its peers leave it when they wait)",
    )
    parser.add_argument(
        "--rounds", type=at_least(1), default=3, help="parts uneven, hierarchy and torchft: pairs of runs, medians"
    )
    parser.add_argument("--warmup", type=at_least(0), default=4, help="synchronous steps before local training")
    parser.add_argument("--adacomm-steps", type=at_least(1), default=256)
    parser.add_argument("--periods", type=integers(1), default=[1, 4, 16, 32])
    parser.add_argument("--adacomm-period", type=at_least(2), default=32, help="AdaComm's starting period")
    parser.add_argument("--eval-every", type=at_least(1), default=16)
    parser.add_argument("--eval-batches", type=at_least(1), default=8)
    parser.add_argument("--rate", type=tc_rate, default="100mbit", help="part adacomm's link rate (tc syntax)")
    parser.add_argument("--loopback", action="store_true", help="part adacomm over loopback even where a link works")
    parser.add_argument(
        "--plot",
        type=file_to_write,
        default=None,
        help="PNG of part adacomm (loss, period); <stem>-paces: part uneven's",
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE + SMOKE_OVERRIDES)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    unknown = set(args.part) - set(parts)
    if unknown:
        parser.error(f"--part {','.join(sorted(unknown))}: choose from {','.join(parts)}")
    steps = {"--steps": args.steps} if set(args.part) - {"adacomm"} else {}
    if "adacomm" in args.part:
        steps["--adacomm-steps"] = args.adacomm_steps
    for flag, value in steps.items():
        if value <= args.warmup:
            parser.error(f"{flag} {value} must be above --warmup {args.warmup}: every step would be synchronous")
    if "hierarchy" in args.part and args.period < 2:
        parser.error(f"--period {args.period}: part hierarchy averages pairs at a shorter period, so it needs >= 2")
    began = time.monotonic()
    print_load()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # so the `with` blocks still clean up (namespaces, temp dir)
        signal.signal(sig, lambda signum, frame: sys.exit(f"bench/uneven.py: got signal {signum}, cleaning up"))
    with tempfile.TemporaryDirectory(prefix="bench-uneven-") as tmp:
        workdir = Path(tmp)
        if "uneven" in args.part:
            part_uneven(args, workdir)
        if "hierarchy" in args.part:
            part_uneven(args, workdir, "hierarchy")
        if "torchft" in args.part:
            part_uneven(args, workdir, "torchft")
        if "equal" in args.part:
            part_equal(args, workdir)
        if "adacomm" in args.part:
            reason = "--loopback" if args.loopback else link_unavailable()
            if reason is None:
                with Link() as link:
                    link.open()
                    link.shape(args.rate)
                    part_adacomm(args, workdir, link, f"replicas across a {args.rate} link")
            else:
                part_adacomm(args, workdir, None, f"loopback, no link ({reason})")
    print_load()
    print(f"\ntotal {time.monotonic() - began:.0f} s")
    print("bench/uneven.py: done")


if __name__ == "__main__":
    main()
