"""`averager.period=auto` against fixed averaging periods: the held-out loss each reaches at equal wall time,
over loopback and over a shaped link between two network namespaces.

What is measured: post-local SGD (`averager=periodic`) at each fixed period of `--periods` (period 1: the
replicas' parameters averaged after every step, synchronous-like) and at `averager.period=auto` with its
default budget (at each exchange the run's clock takes as the next period the smallest whose exposed exchange
time stays within `averager.comm_budget`, 0.1, of the wall time, within [`averager.min_period`,
`averager.max_period`]). Every run is the real CLI on the default job's model, `model=gpt` (4 blocks, d_model
128, 834,304 parameters: 3,337,216 bytes of fp32 parameters per rank per exchange, read from
`comm/averaging_bytes`), on byte-level text (`data=text`, the Python standard library's sources; the default
job's synthetic tokens make a poor held-out curve), AdamW, the job's 10 synchronous warmup steps, the same
`--steps` for every config, each for every seed `train.seed` = 0 .. `--seeds`-1 (the initial weights and the
order of the data), W&B disabled, the held-out loss (`eval/loss` over `--eval-batches` batches of the corpus's
held-out last 1 %) every `--eval-every` steps and at the last. 2 replicas x 1 rank (`sharding=no_shard`), one
thread per rank, on three links:

  loopback   python train.py launcher.nproc=2 sharding=no_shard ... (both ranks on this host's loopback)
  <rate>     one rank in each of two network namespaces joined by a veth pair shaped with `tc tbf` to each of
             `--rates` (bench/averaging.py's `Link`), a torchrun per namespace (`--nproc-per-node 1`), so the
             exchanges cross the link as between two nodes. Needs root, `ip netns` and `tc`; without them this
             part is skipped, saying why.

Time is read as bench/uneven.py reads it, from rank 0's metrics.jsonl: a run's wall time at a step is the sum
of `train/step_time_s` x steps over its log rows from step 1 on (training and exchanges; not process start-up,
the first step's own start-up, eval passes or saves). Equal wall time: for each seed, T = the shortest total
training wall time among that seed's runs on the link (every config). Every run's held-out curve reaches its
seed's T, so no loss is extrapolated; the runs compared at one T share initial weights and data order, and
ran back to back, so they shared the host's load more than runs minutes apart do (on the shared 2-core machine
one config's total wall time moved by up to 1.6x between seeds with the load). The `at T min` column scores
every run at the link's single shortest run instead (one T for every seed), for comparison. Each
run's held-out loss at T is interpolated linearly between its evals. Caveat: between exchanges an eval is the
replicas' mean loss, each replica scored alone, while every run ends with an exchange, so the run that sets
its seed's T is scored on its averaged model (a bonus of averaging that longer periods would also get if they
stopped there).

Reported per link and config: the median over seeds of the loss at T, its ratio to the best fixed period's
(which fixed period is best, which worst), the losses per seed, the median total wall time, final loss,
exchanges and exchange share (the sum of `averager/time_s` over the wall time); for `auto`, the periods it took
(`averager/period` of its exchange rows: the period each exchange ended, with its `averager/exchange_share`):
seed 0's changes, the median over seeds at each exchange, and each seed's median period (its last, cut to the
run's end, left out). Seeds run in turn, configs in reverse order every other seed (A B A ...), against drift.
The train.py / torchrun command is printed once per part.

Targets, printed as met / not met with the measured gap: `auto` within 1 % of the best fixed period's held-out
loss at equal wall time on every link, below the worst fixed period's, and on loopback a short period (the
median over seeds of its median period <= 4).

Observed on this 2-core CPU machine (2026-11-29, load 0.5-3.5 from another test suite): a local step takes
0.06-0.07 s quiet (0.055-0.10 s over the runs; 300 steps of period 64 took 16-28 s of training wall time); an
exchange of the 3.3 MB holds training up about 0.015 s on loopback, 0.026 s at 1gbit and 0.29 s at 100mbit,
so period 1 spends 13 %, 26 % and 80 % of its wall time in exchanges there, and the 10 synchronous warmup
steps cost 2.9 s at 100mbit (a gradient all-reduce of the same bytes each). Start-up adds about 8 s a run on
loopback and 10-12 s over the link (a torchrun per namespace).

    python bench/period.py [--part loopback,link] [--rates 1gbit,100mbit] [--periods 1,4,16,64] [--seeds 3]
                           [--steps 300] [--warmup 10] [--eval-every 20] [--eval-batches 8]
                           [--workdir DIR] [--plot period.png] [hydra overrides for every run ...]
    python bench/period.py --smoke   # loopback only, 1 seed, periods 1,4 and auto, a 1-block GPT, 12 steps

A full run (both parts, 5 configs, 3 seeds: 45 runs) took 1,478 s (25 min) on the 2-core machine at load 1-2
(the fixed periods alone, 36 runs at load 2-3.5: 1,531 s); the total is printed at the end. That run (harness
46b1a33): auto within 1 % of the best fixed period on each link (loopback +0.66 % of period 4's 2.6735, taking
periods 2-3; 1gbit +0.87 % of period 4's 2.7095, taking 4-6, once 17-18 after one slow exchange; 100mbit
+0.16 % of period 64's 2.7503, taking 47-59), below the worst (period 1) everywhere. `--plot` draws, per link,
the period `auto` took against wall time (every seed) and the held-out loss against wall time (seed 0, every
config, T marked).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from averaging import (
    RUN_TIMEOUT_S,
    Link,
    RunFailed,
    link_unavailable,
    print_load,
    print_table,
    start,
    tc_rate,
    wait_all,
)
from flags import at_least, directory, file_to_write, integers
from uneven import Run, loss_at

REPO = Path(__file__).resolve().parents[1]
PARTS = ("loopback", "link")
SETTINGS = ["model=gpt", "data=text", "optimizer=adamw", "sharding=no_shard", "averager=periodic"]
SETTINGS += ["wandb.mode=disabled", "dist.threads_per_rank=1"]  # both "nodes" of the link share this host's cores
AUTO = "auto"
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = "--part loopback --seeds 1 --periods 1,4 --steps 12 --warmup 2 --eval-every 4 --eval-batches 2".split()
SMOKE_OVERRIDES = "model.n_layer=1 model.d_model=32 train.batch_size=2 train.seq_len=32 data.max_bytes=1000000".split()
LOSS_TARGET = 0.01  # auto within 1 % of the best fixed period's held-out loss at equal wall time
SHORT_PERIOD = 4  # on loopback, auto's median period at most this
SHOWN = 12  # auto's period changes printed, of seed 0


@dataclass(frozen=True)
class Config:
    label: str
    period: int | str  # an int, or AUTO

    @property
    def overrides(self) -> list[str]:
        return [f"averager.period={self.period}"]


# ------------------------------------------------------------------ reading runs


def wall_at(run: Run, steps: list[int]) -> list[float]:
    """The run's wall time at each of `steps`, as `Run.trace` counts it (the sum of step times from step 1 on),
    linear in the steps between two log rows (an exchange between them: its share of the interval)."""
    points, wall, last = [], 0.0, None
    for row in run.rows:
        if "train/step_time_s" in row:
            if last is not None:
                wall += row["train/step_time_s"] * (row["train/step"] - last)
            last = row["train/step"]
            points.append((last, wall))
    out = []
    for step in steps:
        for (s0, w0), (s1, w1) in zip(points, points[1:]):
            if s0 <= step <= s1:
                out.append(w0 + (w1 - w0) * (step - s0) / max(s1 - s0, 1))
                break
        else:
            out.append(points[-1][1] if step > points[-1][0] else 0.0)
    return out


def held_out_at(run: Run, wall: float) -> float:
    """bench/uneven.py's `loss_at`: the held-out loss at `wall` s, linear between evals; before its first eval
    (a run that slow never sets T, but a very short one might) the first eval's."""
    first_wall, first_loss = run.trace()[0]
    return first_loss if wall < first_wall else loss_at(run, wall)


def exchange_share(run: Run) -> float:
    """The exchanges' share of the run's wall time: the sum of `averager/time_s` over its total."""
    return sum(r.get("averager/time_s", 0.0) for r in run.rows) / max(run.wall, 1e-9)


def n_exchanges(run: Run) -> int:
    return sum(1 for r in run.rows if r.get("averager/averaged"))


def periods_taken(run: Run) -> list[tuple[int, int, float | None]]:
    """(step, period, the exchange share that planned it) at each of an auto run's exchanges."""
    return [(r["train/step"], r["averager/period"], r.get("averager/exchange_share")) for r in run.exchanges()]


def by_tenth(taken: list[list[tuple[int, int, float | None]]]) -> str:
    """The median period of the exchanges (every seed's) whose step falls in each tenth of the run's steps:
    'steps 1-30: 1, 31-60: 3, ...'."""
    steps = max(t[-1][0] for t in taken)
    bounds = [round(steps * k / 10) for k in range(11)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        periods = [p for t in taken for s, p, _ in t if lo < s <= hi]
        if hi > lo:
            out.append(f"{lo + 1}-{hi}: {statistics.median(periods):g}" if periods else f"{lo + 1}-{hi}: -")
    return "steps " + ", ".join(out)


# ------------------------------------------------------------------ running


def common(args: argparse.Namespace, seed: int, run_dir: Path) -> list[str]:
    every = args.eval_every
    return [
        *SETTINGS,
        f"train.steps={args.steps}",
        f"train.seed={seed}",
        f"train.log_every={every}",
        f"train.eval_every={every}",
        f"train.eval_batches={args.eval_batches}",
        f"averager.warmup_steps={args.warmup}",
        *args.overrides,
        f"hydra.run.dir={run_dir}",
    ]


def one_rank_per_node(cmd: list[str]) -> list[str]:
    """bench/averaging.py's `Link.node_cmd` starts 2 ranks per namespace; here each namespace is one replica of
    one rank."""
    cmd = list(cmd)
    cmd[cmd.index("--nproc-per-node") + 1] = "1"
    return cmd


class Runner:
    """Starts a config's run on one link (loopback, or both namespaces of a `Link`) and reads it back."""

    def __init__(self, args: argparse.Namespace, workdir: Path, link: Link | None) -> None:
        self.args, self.workdir, self.link, self.n = args, workdir, link, 0

    def cmds(self, config: Config, seed: int, run_dir: Path, n: int) -> list[list[str]]:
        train_args = [*config.overrides, *common(self.args, seed, run_dir)]
        if self.link is None:
            return [[sys.executable, "train.py", "launcher.nproc=2", *train_args]]
        return [one_rank_per_node(self.link.node_cmd(node, train_args, n)) for node in (0, 1)]

    def print_cmds(self, config: Config) -> None:
        cmds = self.cmds(config, 0, self.workdir / "<run>", 0)
        what = "both nodes at once; rendezvous port and id vary" if self.link else "one launcher"
        print(f"  command per run ({what}; averager.period, train.seed and hydra.run.dir vary):")
        print("    " + "\n    ".join(map(shlex.join, cmds)), flush=True)

    def run(self, name: str, config: Config, seed: int) -> Run:
        self.n += 1
        run_dir = self.workdir / f"{self.n:03d}-{name}-{config.label.replace(' ', '')}-seed{seed}"
        run_dir.mkdir(parents=True)
        cmds = self.cmds(config, seed, run_dir, self.n)
        logs = [run_dir / f"node{node}.out" for node in range(len(cmds))]
        wait_all([start(cmd, log) for cmd, log in zip(cmds, logs)], logs, RUN_TIMEOUT_S)
        metrics = run_dir / "metrics.jsonl"
        if not metrics.exists():
            raise RunFailed(f"{name} {config.label} seed {seed}: no {metrics}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        return Run(config.label, rows, run_dir)


# ------------------------------------------------------------------ one link


@dataclass
class LinkResult:
    name: str
    configs: list[Config]
    runs: dict[Config, list[Run]]  # each config's runs, by seed

    @property
    def walls(self) -> list[float]:
        """T of each seed: the shortest training wall time among that seed's runs (every config)."""
        return [min(self.runs[c][s].wall for c in self.configs) for s in range(len(self.runs[self.configs[0]]))]


def measure(name: str, runner: Runner, configs: list[Config], args: argparse.Namespace) -> LinkResult:
    runs: dict[Config, list[Run]] = {c: [] for c in configs}
    total = len(configs) * args.seeds
    for seed in range(args.seeds):
        for config in configs if seed % 2 == 0 else configs[::-1]:
            began = time.monotonic()
            run = runner.run(name, config, seed)
            runs[config].append(run)
            done = sum(map(len, runs.values()))
            print(
                f"  [{done:>2}/{total}] {name} {config.label:<9} seed {seed}: wall {run.wall:6.1f} s, "
                f"final eval/loss {run.final_loss:.4f}, {n_exchanges(run)} exchanges, exchange share "
                f"{exchange_share(run):.1%} ({time.monotonic() - began:.0f} s with start-up)",
                flush=True,
            )
    return LinkResult(name, configs, runs)


def report(result: LinkResult) -> list[str]:
    """The link's table, the auto periods, and its target lines; returns the verdicts."""
    walls, runs = result.walls, result.runs
    at = {c: [held_out_at(run, wall) for run, wall in zip(runs[c], walls)] for c in result.configs}
    median = {c: statistics.median(v) for c, v in at.items()}
    everywhere = min(walls)  # the shortest run of the link, all seeds: the same T for every run
    at_min = {c: statistics.median(held_out_at(run, everywhere) for run in runs[c]) for c in result.configs}
    fixed = [c for c in result.configs if c.period != AUTO]
    best, worst = min(fixed, key=median.get), max(fixed, key=median.get)
    print(
        f"\n{result.name}: held-out loss at equal wall time T, each seed's T the shortest training wall time among "
        f"its runs: {', '.join(f'{w:.1f}' for w in walls)} s; medians over {len(walls)} seed(s) (at T min: every run "
        f"at the link's shortest, {everywhere:.1f} s)"
    )
    rows = []
    for c in result.configs:
        rs = runs[c]
        mark = " (best fixed)" if c == best else " (worst fixed)" if c == worst and len(fixed) > 1 else ""
        rows.append(
            [
                c.label + mark,
                f"{median[c]:.4f}",
                f"{median[c] / median[best]:.4f}",
                " ".join(f"{x:.4f}" for x in at[c]),
                f"{at_min[c]:.4f}",
                f"{statistics.median(r.wall for r in rs):.1f}",
                f"{statistics.median(r.final_loss for r in rs):.4f}",
                f"{statistics.median(n_exchanges(r) for r in rs):g}",
                f"{statistics.median(exchange_share(r) for r in rs):.1%}",
            ]
        )
    header = ["config", "eval/loss at T", "vs best", "per seed", "at T min", "wall s", "final loss", "exchanges"]
    print_table([*header, "exch share"], rows)
    print(f"  best fixed period: {best.period}; worst: {worst.period}")
    auto = next((c for c in result.configs if c.period == AUTO), None)
    if auto is None:
        return []
    taken = [periods_taken(run) for run in runs[auto]]
    if not all(taken):
        print("  auto: its exchange rows carry no averager/period: nothing to report of its periods")
        return [f"{result.name}: auto's periods not in its metrics: not met"]
    changes = [(s, p, e) for i, (s, p, e) in enumerate(taken[0]) if i == 0 or p != taken[0][i - 1][1]]
    share = lambda e: "" if e is None else f" ({e:.1%})"  # noqa: E731
    more = f", ... ({len(changes) - SHOWN} changes more)" if len(changes) > SHOWN else ""
    print(
        "  auto, seed 0, the period each exchange ended where it changed (step: period (averager/exchange_share)): "
        + ", ".join(f"{s}: {p}{share(e)}" for s, p, e in changes[:SHOWN])
        + more
    )
    counts = collections.Counter(p for _, p, _ in taken[0])
    print(f"  auto, seed 0, exchanges per period: {', '.join(f'{p}: {n}' for p, n in sorted(counts.items()))}")
    print(f"  auto, median over seeds of the periods ended in each tenth of the run: {by_tenth(taken)}")
    medians = [statistics.median(p for _, p, _ in t[:-1] or t) for t in taken]  # the last: cut to the run's end
    period = statistics.median(medians)
    print(
        f"  auto, each seed's median period (its last, cut to the run's end, left out): "
        f"{', '.join(f'{m:g}' for m in medians)}; their median {period:g}"
    )
    gap = median[auto] / median[best] - 1
    verdicts = [
        f"{result.name}: auto {median[auto]:.4f} against the best fixed period ({best.period}) {median[best]:.4f}: "
        f"{gap:+.2%} (target within {LOSS_TARGET:.0%}): {'met' if gap <= LOSS_TARGET else 'not met'}",
        f"{result.name}: auto {median[auto]:.4f} against the worst fixed period ({worst.period}) "
        f"{median[worst]:.4f}: {median[auto] / median[worst] - 1:+.2%} (target: below it): "
        f"{'met' if median[auto] < median[worst] or len(fixed) < 2 else 'not met'}",
    ]
    if result.name == "loopback":
        verdicts.append(
            f"{result.name}: auto's median period {period:g} (target <= {SHORT_PERIOD}): "
            f"{'met' if period <= SHORT_PERIOD else 'not met'}"
        )
    for line in verdicts:
        print("  " + line)
    return verdicts


# ------------------------------------------------------------------ plot


def plot(results: list[LinkResult], path: Path) -> None:
    """Per link: the period auto took against wall time (every seed; above), and the held-out loss against wall
    time (seed 0 of every config; below, T marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.5 * len(results), 8), squeeze=False)
    for col, result in enumerate(results):
        ax_period, ax_loss = axes[0][col], axes[1][col]
        auto = next((c for c in result.configs if c.period == AUTO), None)
        if auto is not None:
            for seed, run in enumerate(result.runs[auto]):
                taken = periods_taken(run)
                if taken:
                    walls = wall_at(run, [s for s, _, _ in taken])
                    ax_period.plot(
                        walls, [p for _, p, _ in taken], drawstyle="steps-pre", marker=".", label=f"seed {seed}"
                    )
            ax_period.set_yscale("log", base=2)
            ax_period.legend()
        else:
            ax_period.text(0.5, 0.5, "auto not run", ha="center", va="center", transform=ax_period.transAxes)
        ax_period.set(xlabel="wall time, s (from step 1)", ylabel="period (local steps)")
        ax_period.set_title(f"{result.name}: the period auto took")
        ax_period.grid(alpha=0.3)
        for config in result.configs:
            walls, losses = zip(*result.runs[config][0].trace())
            ax_loss.plot(walls, losses, marker=".", label=config.label)
        ax_loss.axvline(result.walls[0], color="grey", linestyle="--", label=f"T = {result.walls[0]:.1f} s")
        ax_loss.set(xlabel="wall time, s (from step 1)", ylabel="held-out loss", title=f"{result.name}: seed 0")
        ax_loss.legend()
        ax_loss.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=lambda s: s.split(","), default=list(PARTS), help=",".join(PARTS))
    parser.add_argument("--rates", type=lambda s: [tc_rate(r) for r in s.split(",")], default=["1gbit", "100mbit"])
    parser.add_argument("--periods", type=integers(1), default=[1, 4, 16, 64], help="the fixed periods")
    parser.add_argument("--seeds", type=at_least(1), default=3, help="runs per config: train.seed = 0 .. SEEDS-1")
    parser.add_argument("--steps", type=at_least(1), default=300, help="steps per run, warmup included")
    parser.add_argument("--warmup", type=at_least(0), default=10, help="averager.warmup_steps (the job's 10)")
    parser.add_argument("--eval-every", type=at_least(1), default=20, help="train.eval_every (and log_every)")
    parser.add_argument("--eval-batches", type=at_least(1), default=8, help="train.eval_batches")
    parser.add_argument(
        "--workdir",
        type=directory,
        default=None,
        help="keep the runs' dirs in a new folder under it (default: deleted)",
    )
    parser.add_argument("--plot", type=file_to_write, default=None, help="PNG: auto's period and the loss curves")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE + SMOKE_OVERRIDES)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *(sys.argv[1:] if argv is None else argv)])
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    unknown = set(args.part) - set(PARTS)
    if unknown or not args.part:
        parser.error(f"--part {','.join(sorted(unknown))}: choose from {','.join(PARTS)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be above --warmup {args.warmup}: every step would be synchronous")
    if args.eval_every > args.steps:
        parser.error(f"--eval-every {args.eval_every} must be at most --steps {args.steps}: one eval is no curve")
    if len(set(args.periods)) != len(args.periods):
        parser.error(f"--periods {','.join(map(str, args.periods))}: each period once")
    return args


@contextlib.contextmanager
def keep_or_delete(under: Path | None) -> Iterator[Path]:
    """A new folder for the runs' dirs: under `under`, kept (its path printed), or a temporary one."""
    if under is None:
        with tempfile.TemporaryDirectory(prefix="bench-period-") as tmp:
            yield Path(tmp)
        return
    workdir = Path(tempfile.mkdtemp(prefix="bench-period-", dir=under))
    print(f"run dirs: {workdir}")
    yield workdir


def main() -> None:
    args = parse_args()
    began = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # so the `with` blocks still clean up (namespaces, temp dir)
        signal.signal(sig, lambda signum, frame: sys.exit(f"bench/period.py: got signal {signum}, cleaning up"))
    configs = [Config(f"period {p}", p) for p in args.periods]
    configs.append(Config(AUTO, AUTO))
    print(
        f"{len(configs)} configs ({', '.join(c.label for c in configs)}) x {args.seeds} seed(s), {args.steps} steps, "
        f"warmup {args.warmup}, eval every {args.eval_every} steps ({args.eval_batches} batches); "
        f"settings for every run: {' '.join([*SETTINGS, *args.overrides])}"
    )
    print_load()
    results, verdicts = [], []
    try:
        with keep_or_delete(args.workdir) as workdir:
            if "loopback" in args.part:
                print("\n== part loopback: 2 local ranks, 2 replicas x 1 rank")
                runner = Runner(args, workdir, None)
                runner.print_cmds(configs[-1])
                results.append(measure("loopback", runner, configs, args))
                verdicts += report(results[-1])
            if "link" in args.part:
                print(f"\n== part link: 2 namespaces x 1 rank, a veth pair shaped to {', '.join(args.rates)}")
                reason = link_unavailable()
                if reason:
                    print(f"  skipped: {reason}; part link needs root, `ip netns` and `tc`")
                else:
                    with Link() as link:  # closes (kills what runs inside, deletes the namespaces) however it ends
                        try:
                            link.open()
                        except (subprocess.CalledProcessError, OSError) as e:
                            print(f"  skipped: cannot build the namespaces ({getattr(e, 'stderr', '') or e})")
                        else:
                            runner = Runner(args, workdir, link)
                            runner.print_cmds(configs[-1])
                            for rate in args.rates:
                                print(f"\n-- {rate}")
                                link.shape(rate)
                                results.append(measure(rate, runner, configs, args))
                                verdicts += report(results[-1])
    except RunFailed as e:
        sys.exit(f"bench/period.py: a run failed: {e}")
    print_load()
    if verdicts:
        print("\ntargets (auto against the fixed periods, held-out loss at equal wall time):")
        for line in verdicts:
            print("  " + line)
    if args.plot is not None and results:
        plot(results, args.plot)
    print(f"\ntotal {time.monotonic() - began:.0f} s")
    print("bench/period.py: done")


if __name__ == "__main__":
    main()
