"""Quality at an equal step budget: synchronous training, post-local SGD and DiLoCo
on real text, with the bytes and the wall time each one costs, over seeds, with
a sweep of DiLoCo's outer optimizer.

What is measured: the default GPT on byte-level text (`data=text`, the Python
standard library's sources, no download), 2 replicas (x 2 shards, or x 1 with
`--layout 2x1`), the same `--steps` and data for every config:
  sync                    averager=none (gradients all-reduced across replicas every step)
  periodic P              post-local SGD, averaging parameters every P steps
  diloco P <setting>      DiLoCo every P steps, its outer optimizer one of `--outer` (OUTER below:
                          `default` is averager=diloco's own; `all` every setting)
  diloco P <dtype>        the `--dtype-setting` outer optimizer with pseudo-gradients sent in each
                          of `--comm-dtypes` other than float32
for each P in `--periods`, all after the same `--warmup` synchronous steps, and
each for every seed of `--seeds` (`train.seed`: the initial weights and the
order of the data). Per run, from rank 0's metrics.jsonl: the held-out loss at
the last step (`eval/loss` over `--eval-batches` batches of the corpus's
held-out last 1 %, never trained on), the cross-replica bytes of the whole run
(`comm/cross_replica_bytes_total`, warmup included) and the training time (the
sum of `train/step_time_s`: steps, averaging, eval; not process start-up).
Reported per config: the mean held-out loss over seeds and its spread (half
the range), and every comparison says whether the difference is smaller than
the spread between seeds.

Resumable: each finished run's result goes into `--results` (JSON, keyed by
the run's whole config), and a re-run with the same file skips it; the table
is printed after every run, so a long sweep can be stopped and continued.

Where: two "nodes" on this machine (network namespaces, 2 ranks each, joined
by a veth pair shaped with `tc tbf` to `--rate`, built by bench/averaging.py's
`Link`): each node holds one replica, so shards talk over the node's loopback
and only the cross-replica traffic crosses the link, as on two real nodes.
Without root, `ip` or `tc`, with `--loopback` or `--layout 2x1`, the runs use
`python train.py` over loopback, and the table says the wall times are not
over a link.

Goals reported against (issue 21): DiLoCo with the default setting at or below
post-local SGD's held-out loss at the same period; DiLoCo within 3 % of sync at
>= 10x fewer cross-replica bytes; 8-bit pseudo-gradients within the seed spread
of float32 at about a quarter of its bytes.

    python bench/quality.py [--steps 384] [--warmup 8] [--periods 16,64] [--seeds 1] [--outer default]
                            [--comm-dtypes float32] [--dtype-setting default] [--layout 2x2|2x1]
                            [--results outputs/quality.json] [--rate 100mbit] [--loopback]
                            [hydra overrides for every run ...]
    python bench/quality.py --smoke   # 4 steps, period 1, a 1-block GPT on 1 MB of text, over loopback

`--smoke` runs over loopback (`--loopback`): the link changes the wall times,
not the code path of the methods compared, and its two torchruns per method
are too slow for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
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
from flags import at_least, integers

LAYOUTS = {
    "2x2": ("launcher.nproc=4", "sharding=hybrid_shard", "sharding.replicate=2"),
    "2x1": ("launcher.nproc=2", "sharding=no_shard"),
}
SETTINGS = ["data=text", "optimizer=adamw", "train.log_every=1", "wandb.mode=disabled"]
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = (
    "--steps 4 --warmup 2 --periods 1 --eval-batches 1 --loopback --outer avg --comm-dtypes float32,int8 "
    "--dtype-setting avg --seeds 1"
).split()
SMOKE_OVERRIDES = "model.n_layer=1 model.d_model=32 train.batch_size=2 train.seq_len=32 data.max_bytes=1000000".split()
# DiLoCo's outer optimizer settings the sweep compares: SGD (Nesterov where momentum > 0), lr / momentum
OUTER = {
    "avg": (1.0, 0.0),  # outer SGD at lr 1 without momentum: post-local SGD's average
    "0.7/0.5": (0.7, 0.5),  # modded-nanogpt's
    "0.5/0.7": (0.5, 0.7),
    "0.4/0.9": (0.4, 0.9),
    "0.7/0.9": (0.7, 0.9),  # the paper's (arXiv 2311.08105)
    "1.0/0.9": (1.0, 0.9),
    "sgd 0.5": (0.5, 0.0),
    "sgd 0.7": (0.7, 0.0),
    "sgd 0.85": (0.85, 0.0),
}


@dataclass(frozen=True)
class Method:
    label: str
    overrides: tuple[str, ...]
    period: int | None = None


@dataclass
class Result:
    eval_loss: float
    cross_replica_bytes: int
    train_s: float
    syncs: int


def outer_overrides(setting: str) -> tuple[str, ...]:
    if setting == "default":
        return ()
    lr, momentum = OUTER[setting]
    return (
        f"averager.outer_optimizer.lr={lr}",
        f"averager.outer_optimizer.momentum={momentum}",
        f"averager.outer_optimizer.nesterov={str(momentum > 0).lower()}",
    )


def methods(args: argparse.Namespace) -> list[Method]:
    found = [Method("sync", ("averager=none",))]
    for p in args.periods:
        local = (f"averager.period={p}", f"averager.warmup_steps={args.warmup}")
        found.append(Method(f"periodic {p}", ("averager=periodic", *local), p))
        for setting in args.outer:
            found.append(Method(f"diloco {p} {setting}", ("averager=diloco", *local, *outer_overrides(setting)), p))
        for dtype in args.comm_dtypes:
            if dtype != "float32":
                overrides = (*outer_overrides(args.dtype_setting), f"averager.comm_dtype={dtype}")
                found.append(
                    Method(f"diloco {p} {args.dtype_setting} {dtype}", ("averager=diloco", *local, *overrides), p)
                )
    return found


def train_args(method: Method, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        *LAYOUTS[args.layout][1:],
        *SETTINGS,
        *method.overrides,
        f"train.seed={seed}",
        f"train.steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.eval_batches={args.eval_batches}",
        *args.overrides,
        f"hydra.run.dir={run_dir}",
    ]


def summarize(run_dir: Path, steps: int) -> Result:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise RunFailed(f"no {path}")
    rows = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
    if sorted(rows) != list(range(1, steps + 1)) or "eval/loss" not in rows[steps]:
        raise RunFailed(f"{path}: expected one row per step 1..{steps} and eval/loss at {steps}")
    return Result(
        eval_loss=rows[steps]["eval/loss"],
        cross_replica_bytes=rows[steps]["comm/cross_replica_bytes_total"],
        train_s=sum(r["train/step_time_s"] for r in rows.values()),
        syncs=sum(1 for r in rows.values() if r.get("averager/averaged")),
    )


def run_key(method: Method, seed: int, args: argparse.Namespace) -> str:
    """What makes a run: every override but the run directory (and where it runs)."""
    return " ".join([*train_args(method, seed, args, Path("-"))[:-1], f"link={not args.loopback}"])


def run_all(args: argparse.Namespace, workdir: Path, link: Link | None) -> dict[str, list[Result]]:
    saved = json.loads(args.results.read_text()) if args.results.exists() else {}
    results: dict[str, list[Result]] = {}
    runs = [(m, seed) for seed in args.seeds for m in methods(args)]
    for n, (method, seed) in enumerate(runs, 1):
        key = run_key(method, seed, args)
        ran = key not in saved
        if ran:
            run_dir = workdir / f"run{n:03d}"
            run_dir.mkdir(parents=True)
            if link is None:
                cmd = [[sys.executable, "train.py", LAYOUTS[args.layout][0], *train_args(method, seed, args, run_dir)]]
            else:
                cmd = [link.node_cmd(node, train_args(method, seed, args, run_dir), n) for node in (0, 1)]
            print(f"  [{n}/{len(runs)}] " + "\n    ".join(map(shlex.join, cmd)), flush=True)
            logs = [run_dir / f"node{node}.out" for node in range(len(cmd))]
            wait_all([start(c, log) for c, log in zip(cmd, logs)], logs, RUN_TIMEOUT_S * 4)
            saved[key] = asdict(summarize(run_dir, args.steps))
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(json.dumps(saved, indent=1))
        results.setdefault(method.label, []).append(Result(**saved[key]))
        if ran:  # the running table
            print_summary(results, len(args.seeds))
    return results


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def spread(values: list[float]) -> float:
    """Half the range over seeds: the +- a seed's result falls within."""
    return (max(values) - min(values)) / 2


def print_summary(results: dict[str, list[Result]], seeds: int) -> None:
    sync = results.get("sync")
    rows = []
    for label, runs in results.items():
        losses = [r.eval_loss for r in runs]
        vs_sync = f"{mean(losses) / mean([r.eval_loss for r in sync]) - 1:+.1%}" if sync else "-"
        fewer = f"{sync[0].cross_replica_bytes / runs[0].cross_replica_bytes:.1f}x" if sync else "-"
        rows.append(
            [
                label,
                f"{mean(losses):.4f}",
                f"{spread(losses):.4f}",
                f"{len(runs)}/{seeds}",
                vs_sync,
                f"{runs[0].cross_replica_bytes / 1e6:,.1f}",
                fewer,
                str(runs[0].syncs),
                f"{mean([r.train_s for r in runs]):.0f}",
            ]
        )
    header = ["method", "eval/loss mean", "+- (seeds)", "seeds", "vs sync", "MB", "fewer bytes", "syncs", "train s"]
    print_table(header, rows)


def compare(a: list[Result], b: list[Result]) -> str:
    """a's mean loss against b's, whether the difference exceeds the seeds' spread, and on
    how many seeds a is lower (runs are in seed order: a pair shares initial weights and data order)."""
    la, lb = [r.eval_loss for r in a], [r.eval_loss for r in b]
    difference = mean(la) - mean(lb)
    if len(la) < 2 or len(lb) < 2:
        return f"{mean(la):.4f} vs {mean(lb):.4f}: {difference:+.4f} (one seed: no spread to compare it with)"
    noise = max(spread(la), spread(lb))
    within = abs(difference) <= noise
    verdict = "smaller than the spread between seeds" if within else "larger than the spread between seeds"
    lower = f"lower on {sum(x < y for x, y in zip(la, lb))} of {len(la)} seeds"
    return f"{mean(la):.4f} vs {mean(lb):.4f}: {difference:+.4f} ({verdict}, +-{noise:.4f}; {lower})"


def report(results: dict[str, list[Result]], args: argparse.Namespace, where: str) -> None:
    print(f"\n{args.steps} steps, warmup {args.warmup}, 2 replicas x {args.layout[-1]} shard(s), {where}")
    print_summary(results, len(args.seeds))
    sync = results["sync"]
    print("\ngoals: DiLoCo (default) <= post-local SGD at the same period; within 3 % of sync at >= 10x fewer bytes")
    for p in args.periods:
        periodic = results[f"periodic {p}"]
        for setting in args.outer:
            d = results[f"diloco {p} {setting}"]
            vs_sync = mean([r.eval_loss for r in d]) / mean([r.eval_loss for r in sync]) - 1
            fewer = sync[0].cross_replica_bytes / d[0].cross_replica_bytes
            print(
                f"  period {p}, {setting}: vs post-local SGD {compare(d, periodic)}; vs sync {vs_sync:+.1%} "
                f"({'within' if vs_sync <= 0.03 else 'not within'} 3 %) at {fewer:.1f}x fewer bytes"
            )
        for dtype in args.comm_dtypes:
            if dtype != "float32" and f"diloco {p} {args.dtype_setting}" in results:
                d = results[f"diloco {p} {args.dtype_setting} {dtype}"]
                base = results[f"diloco {p} {args.dtype_setting}"]
                warmup = sync[0].cross_replica_bytes * args.warmup / args.steps  # the same gradient syncs in every run
                share = (d[0].cross_replica_bytes - warmup) / (base[0].cross_replica_bytes - warmup)
                print(f"  period {p}, {dtype} against float32: {compare(d, base)}, {share:.2f}x the sync bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=at_least(1), default=384)
    parser.add_argument("--warmup", type=at_least(0), default=8, help="synchronous steps before local training")
    parser.add_argument("--periods", type=integers(1), default=[16, 64])
    parser.add_argument("--seeds", type=integers(0), default=[1])
    parser.add_argument(
        "--outer",
        type=lambda s: list(OUTER) if s == "all" else s.split(","),
        default=["default"],
        help=f"DiLoCo outer settings: default, all, or some of {', '.join(OUTER)}",
    )
    parser.add_argument("--comm-dtypes", type=lambda s: s.split(","), default=["float32"])
    parser.add_argument("--dtype-setting", default="default", help="the outer setting of the comm-dtype rows")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="2x2")
    parser.add_argument("--results", type=Path, default=None, help="resumable results (default: a temp file)")
    parser.add_argument(
        "--eval-batches", type=at_least(1), default=16, help="held-out batches of 8 x 64 bytes per rank"
    )
    parser.add_argument("--rate", type=tc_rate, default="100mbit", help="the shaped link's rate (tc syntax)")
    parser.add_argument("--loopback", action="store_true", help="skip the link even where it can be built")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE + SMOKE_OVERRIDES)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. train.batch_size=4")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    unknown = [s for s in [*args.outer, args.dtype_setting] if s != "default" and s not in OUTER]
    if unknown:
        parser.error(f"unknown outer setting(s) {unknown}: choose from default, all, {', '.join(OUTER)}")
    began = time.monotonic()
    print_load()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # so the `with` blocks still clean up (namespaces, temp dir)
        signal.signal(sig, lambda signum, frame: sys.exit(f"bench/quality.py: got signal {signum}, cleaning up"))
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        if args.results is None:
            args.results = Path(tmp) / "results.json"
        reason = "--loopback" if args.loopback else "--layout 2x1" if args.layout == "2x1" else link_unavailable()
        args.loopback = reason is not None
        if reason is None:
            with Link() as link:
                link.open()
                link.shape(args.rate)
                results = run_all(args, Path(tmp), link)
            where = f"replicas across a {args.rate} link"
        else:
            results = run_all(args, Path(tmp), None)
            where = f"loopback, no link ({reason}): wall times are not over a {args.rate} link"
    print_load()
    report(results, args, where)
    print(f"\ntotal {time.monotonic() - began:.0f} s")
    print("bench/quality.py: done")


if __name__ == "__main__":
    main()
