"""Abnormal exits of complete runs: how often a run that finished training still
ends non-zero or by a signal (the exit-time gloo abort, SIGABRT).

What is measured: many short complete runs (tiny MLP, 4 steps, post-local SGD
on 2 ranks, a full checkpoint at the end), alternating between `torchrun
--nproc-per-node 2 train.py` and `python train.py` (2 local ranks), while
`--load` busy processes compete for the cores. Counted per entry point and
launcher: runs, non-zero exits, and those among them that a signal ended
(torchrun prints `Signal N (SIGxxx)`; a negative return code is a signal too).

Side by side, `--old` also runs the pre-fix entry point: train.py as it was
before `exit_now`, which leaves through interpreter finalization (written to
a temporary file in the repository root for the run, so Hydra finds conf/).
Runs alternate new/old and torchrun/python to cancel drift.

    python bench/exits.py [--runs 300] [--load 1] [--old [--old-every K]]
    python bench/exits.py --smoke   # --runs 1 --load 0 --old: each entry point once, under python
                                    # train.py (the torchrun launcher, 3 s more a run, is left out)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from flags import at_least

REPO = Path(__file__).resolve().parents[1]
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = ["--runs", "1", "--load", "0", "--old"]
ARGS = [
    "model=mlp",
    "train.steps=4",
    "train.batch_size=2",
    "train.seq_len=16",
    "train.log_every=2",
    "sharding=no_shard",
    "averager.warmup_steps=2",
    "averager.period=2",
    "checkpoint=full",
    "wandb.mode=disabled",
]
OLD_ENTRY = """import sys
import hydra
from harness.config import register_configs
from harness.launch import prepare_torchrun_rank, refuse_unwritable_run_dir, start
register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> None:
    start(cfg)


if __name__ == "__main__":
    refuse_unwritable_run_dir(sys.argv)
    prepare_torchrun_rank(sys.argv)
    main()
"""


def busy() -> None:
    while True:
        pass


def run_once(entry: Path, launcher: str, run_dir: Path) -> tuple[int, str, float]:
    cmd = [sys.executable, str(entry)]
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            str(entry),
        ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PET_LOG_DIR"] = str(run_dir / "torchrun-logs")  # torchrun's log tree in the run dir, not /tmp
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, *ARGS, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=at_least(1), default=300, help="runs per entry point (half torchrun, half python)"
    )
    parser.add_argument("--load", type=at_least(0), default=1, help="busy processes competing for the cores")
    parser.add_argument("--old", action="store_true", help="also run the pre-fix entry point, side by side")
    parser.add_argument(
        "--old-every", type=at_least(1), default=1, help="with --old: run the old entry every K-th round"
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    entries = {"train.py (exit_now)": REPO / "train.py"}
    old = None
    if args.old:
        old = REPO / f".exits_bench_old_entry_{os.getpid()}.py"
        old.write_text(OLD_ENTRY)
        entries["old entry (finalization)"] = old
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    counts: dict[tuple[str, str], Counter] = {}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="harness-exits-") as tmp:
            for i in range(args.runs):
                for name, entry in entries.items():
                    turn = i
                    if entry == old:
                        if i % args.old_every:
                            continue
                        turn = i // args.old_every  # its own runs alternate launchers too
                    launcher = ("python", "torchrun")[turn % 2]
                    code, out, seconds = run_once(entry, launcher, Path(tmp) / f"run{i}_{len(name)}")
                    key = (name, launcher)
                    c = counts.setdefault(key, Counter())
                    c["runs"] += 1
                    times.setdefault(key, []).append(seconds)
                    if code != 0:
                        c["non-zero"] += 1
                        signal = re.search(r"Signal \d+ \((SIG\w+)\)", out)
                        if signal or code < 0:
                            c[signal.group(1) if signal else f"signal {-code}"] += 1
                        print(
                            f"run {i} {name} {launcher}: exit {code}: {out.strip().splitlines()[-1][:200]}", flush=True
                        )
                if (i + 1) % 20 == 0:
                    # The running table, so a run cut short still leaves its figures.
                    print(f"\n{i + 1}/{args.runs} rounds, {args.load} busy process(es), {os.cpu_count()} cores")
                    print_table(counts, times)
    finally:
        for hog in hogs:
            hog.terminate()
        if old is not None:
            old.unlink()
    print(f"\nfinal: {args.runs} rounds, {args.load} busy process(es), {os.cpu_count()} cores")
    print_table(counts, times)
    print("bench/exits.py: done")


def print_table(counts: dict[tuple[str, str], Counter], times: dict[tuple[str, str], list[float]]) -> None:
    print(f"{'entry point':<28} {'launcher':<9} {'runs':>5} {'non-zero':>9} {'signals':<20} {'median s':>8}")
    for (name, launcher), c in sorted(counts.items()):
        signals = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("runs", "non-zero")) or "-"
        print(
            f"{name:<28} {launcher:<9} {c['runs']:>5} {c['non-zero']:>9} {signals:<20} "
            f"{statistics.median(times[(name, launcher)]):>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
