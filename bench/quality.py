"""Quality at an equal step budget: synchronous training, post-local SGD and DiLoCo
on real text, with the bytes and the wall time each one costs.

What is measured: the default GPT on byte-level text (`data=text`, the Python
standard library's sources, no download), 4 ranks as 2 replicas x 2 shards,
the same `--steps` and data for every config:
  sync                    averager=none (gradients all-reduced across replicas every step)
  periodic P              post-local SGD, averaging parameters every P steps
  diloco P                DiLoCo, Nesterov outer SGD (lr 0.7, momentum 0.9) every P steps
for each P in `--periods`, all after the same `--warmup` synchronous steps.
Per run, from rank 0's metrics.jsonl: the held-out loss at the last step
(`eval/loss` over `--eval-batches` batches of the corpus's held-out last 1 %,
never trained on, the same batches for every config), the cross-replica bytes
of the whole run (`comm/cross_replica_bytes_total`, warmup included) and the
training time (the sum of `train/step_time_s`: steps, averaging, eval; not
process start-up).

Where: two "nodes" on this machine (network namespaces, 2 ranks each, joined
by a veth pair shaped with `tc tbf` to `--rate`, built by bench/averaging.py's
`Link`): each node holds one replica, so shards talk over the node's loopback
and only the cross-replica traffic crosses the link, as on two real nodes.
Without root, `ip` or `tc` the runs use `python train.py launcher.nproc=4`
over loopback, and the table says the wall times are not over a link.

Goal reported against: DiLoCo's held-out loss within 2 % of sync at >= 10x
fewer cross-replica bytes, and lower than post-local SGD at the same period.

    python bench/quality.py [--steps 384] [--warmup 8] [--periods 16,64] [--rate 100mbit] [--loopback]
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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from averaging import (
    RUN_TIMEOUT_S,
    Link,
    RunFailed,
    link_unavailable,
    print_load,
    print_table,
    rate_bits,
    start,
    wait_all,
)

LAYOUT = ["sharding=hybrid_shard", "sharding.replicate=2"]
SETTINGS = ["data=text", "optimizer=adamw", "train.log_every=1", "wandb.mode=disabled"]
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = "--steps 4 --warmup 2 --periods 1 --eval-batches 1 --loopback".split()
SMOKE_OVERRIDES = "model.n_layer=1 model.d_model=32 train.batch_size=2 train.seq_len=32 data.max_bytes=1000000".split()


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


def methods(periods: list[int], warmup: int) -> list[Method]:
    found = [Method("sync", ("averager=none",))]
    for kind in ("periodic", "diloco"):
        found += [
            Method(f"{kind} {p}", (f"averager={kind}", f"averager.period={p}", f"averager.warmup_steps={warmup}"), p)
            for p in periods
        ]
    return found


def train_args(method: Method, args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        *LAYOUT,
        *SETTINGS,
        *method.overrides,
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


def run_all(args: argparse.Namespace, workdir: Path, link: Link | None) -> dict[str, Result]:
    results = {}
    for n, method in enumerate(methods(args.periods, args.warmup), 1):
        run_dir = workdir / f"run{n:02d}"
        run_dir.mkdir(parents=True)
        if link is None:
            cmd = [[sys.executable, "train.py", "launcher.nproc=4", *train_args(method, args, run_dir)]]
        else:
            cmd = [link.node_cmd(node, train_args(method, args, run_dir), n) for node in (0, 1)]
        if n == 1:
            print("command per run (the method's overrides vary):\n  " + "\n  ".join(map(shlex.join, cmd)))
        logs = [run_dir / f"node{node}.out" for node in range(len(cmd))]
        began = time.monotonic()
        wait_all([start(c, log) for c, log in zip(cmd, logs)], logs, RUN_TIMEOUT_S * 4)
        results[method.label] = result = summarize(run_dir, args.steps)
        print(
            f"  [{n}] {method.label:<12} eval/loss {result.eval_loss:.4f}, "
            f"{result.cross_replica_bytes / 1e6:,.1f} MB cross-replica, {result.syncs} syncs, "
            f"training {result.train_s:.0f} s (process {time.monotonic() - began:.0f} s)",
            flush=True,
        )
    return results


def report(results: dict[str, Result], args: argparse.Namespace, where: str) -> None:
    sync = results["sync"]
    rows = [
        [
            label,
            f"{r.eval_loss:.4f}",
            f"{r.eval_loss / sync.eval_loss - 1:+.1%}",
            f"{r.cross_replica_bytes / 1e6:,.1f}",
            f"{sync.cross_replica_bytes / r.cross_replica_bytes:.1f}x",
            str(r.syncs),
            f"{r.train_s:.0f}",
            f"{r.train_s / sync.train_s:.2f}",
        ]
        for label, r in results.items()
    ]
    print(f"\n{args.steps} steps, warmup {args.warmup}, 2 replicas x 2 shards, {where}")
    print_table(
        ["method", "eval/loss", "vs sync", "cross-replica MB", "fewer bytes", "syncs", "train s", "vs sync"], rows
    )
    print("\ngoal: DiLoCo within 2 % of sync at >= 10x fewer bytes, and below post-local SGD at the same period")
    for p in args.periods:
        d, s = results[f"diloco {p}"], results[f"periodic {p}"]
        within = d.eval_loss <= 1.02 * sync.eval_loss
        fewer = sync.cross_replica_bytes / d.cross_replica_bytes
        print(
            f"  period {p}: DiLoCo {d.eval_loss / sync.eval_loss - 1:+.1%} vs sync ({'met' if within else 'missed'}), "
            f"{fewer:.1f}x fewer bytes ({'met' if fewer >= 10 else 'missed'}), "
            f"{'below' if d.eval_loss < s.eval_loss else 'not below'} post-local SGD "
            f"({d.eval_loss:.4f} vs {s.eval_loss:.4f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=384)
    parser.add_argument("--warmup", type=int, default=8, help="synchronous steps before local training")
    parser.add_argument("--periods", type=lambda s: [int(p) for p in s.split(",")], default=[16, 64])
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches of 8 x 64 bytes per rank")
    parser.add_argument("--rate", default="100mbit", help="the shaped link's rate (tc syntax)")
    parser.add_argument("--loopback", action="store_true", help="skip the link even where it can be built")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE + SMOKE_OVERRIDES)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. train.batch_size=4")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    rate_bits(args.rate)
    began = time.monotonic()
    print_load()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # so the `with` blocks still clean up (namespaces, temp dir)
        signal.signal(sig, lambda signum, frame: sys.exit(f"bench/quality.py: got signal {signum}, cleaning up"))
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        reason = "--loopback" if args.loopback else link_unavailable()
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
