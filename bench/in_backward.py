"""The optimizer step inside backward against the normal step: peak memory and step time.

What is measured: the real CLI (`python train.py`) training a wide MLP LM
(`--width`, 4 blocks; 34M parameters at the default) with AdamW and no
clipping, as one FSDP2 rank (`sharding=full_shard launcher.nproc=1
averager=none`), once with `optimizer.in_backward=false` and once with `true`,
alternating for `--repeats` rounds (A B, B A, ...) to cancel drift. Per run,
from its metrics.jsonl (`train.log_every=1`): the peak memory the harness
logs - on CUDA `memory/cuda_max_allocated_gb` (`torch.cuda.max_memory_allocated`),
on CPU `memory/max_rss_gb` (the process's peak resident set, `ru_maxrss`:
everything the process touched, allocator slack included) - and the median
`train/step_time_s` after the first `--skip` steps. Per round the in-backward
run's figures are divided by the normal run's; the table gives each round and
the medians.

Target (issue 13): peak memory lower by >= 80 % of the gradient bytes (4 bytes
per parameter: the sharded fp32 gradients the normal step holds until
`optimizer.step()`), step time no worse than 1.05x.

    python bench/in_backward.py [--repeats 3] [--steps 12] [--width 1024] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def command(args: argparse.Namespace, in_backward: bool, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "model=mlp",
        f"model.d_model={args.width}",
        f"model.hidden={4 * args.width}",
        "model.n_layer=4",
        "optimizer=adamw",
        f"optimizer.in_backward={str(in_backward).lower()}",
        "train.grad_clip=0",
        f"train.steps={args.steps}",
        "train.batch_size=8",
        "train.seq_len=64",
        "train.log_every=1",
        f"train.device={args.device}",
        "sharding=full_shard",
        "launcher.nproc=1",
        "averager=none",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    ]


def measure(args: argparse.Namespace, in_backward: bool, run_dir: Path) -> tuple[float, float]:
    """(peak memory in bytes, median step seconds) of one run."""
    done = subprocess.run(command(args, in_backward, run_dir), cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "memory/cuda_max_allocated_gb" if args.device == "cuda" else "memory/max_rss_gb"
    peak = max(r[key] for r in rows if key in r) * 2**30
    return peak, statistics.median(r["train/step_time_s"] for r in rows[args.skip :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the step time (start-up)")
    parser.add_argument("--width", type=int, default=1024, help="model.d_model; hidden is 4x")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    w, vocab = args.width, 256
    params = 2 * vocab * w + 4 * (2 * w + 2 * 4 * w * w + 5 * w) + 2 * w
    grad_bytes = 4 * params
    memory = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS (ru_maxrss)"
    print(f"{params / 1e6:.1f}M parameters, gradients {grad_bytes / 2**20:.0f} MiB; peak memory = {memory}")
    print("command:", shlex.join(command(args, True, Path("<run>"))))
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-in-backward-") as tmp:
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {flag: measure(args, flag, Path(tmp) / f"r{r}-{flag}") for flag in order}
            (peak_n, time_n), (peak_b, time_b) = got[False], got[True]
            saved = (peak_n - peak_b) / grad_bytes
            rounds.append((saved, time_b / time_n))
            print(
                f"  round {r + 1}: normal {peak_n / 2**20:,.0f} MiB {time_n * 1e3:.1f} ms/step | in backward "
                f"{peak_b / 2**20:,.0f} MiB {time_b * 1e3:.1f} ms/step | saved {saved:.0%} of the gradient bytes, "
                f"step time {time_b / time_n:.3f}x",
                flush=True,
            )
    saved = statistics.median(s for s, _ in rounds)
    ratio = statistics.median(t for _, t in rounds)
    print(
        f"median over {args.repeats} rounds: peak memory lower by {saved:.0%} of the gradient bytes "
        f"(target >= 80 %: {'met' if saved >= 0.8 else 'missed'}), step time {ratio:.3f}x "
        f"(target <= 1.05x: {'met' if ratio <= 1.05 else 'missed'})"
    )


if __name__ == "__main__":
    main()
