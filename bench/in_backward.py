"""The optimizer step inside backward against the normal step: peak memory and step time.

What is measured: the real CLI (`python train.py`) training a wide MLP LM
(`--width`, 4 blocks; 34M parameters at the default) with AdamW and no
clipping, as one FSDP2 rank (`sharding=full_shard launcher.nproc=1
averager=none`), once with `optimizer.in_backward=false` and once with `true`,
alternating for `--repeats` rounds (A B, B A, ...) to cancel drift. Per run,
from its metrics.jsonl (`train.log_every=1`): the median `train/step_time_s`
after the first `--skip` steps, and on CUDA the peak memory the harness logs,
`memory/cuda_max_allocated_gb` (`torch.cuda.max_memory_allocated`). On CPU
there is no allocator peak to read, and the process's peak RSS (`ru_maxrss`)
swings by more than the gradients with glibc's heap, so the peak is measured
by `torch.profiler` (`profile_memory=True`) in a separate run of the same loop
(`build_job` + `harness.loop.Trainer`, same config, one rank in the bench's
own process, with a process group of its own per run): every allocation and free
in steps `--skip`+1 ... `--skip`+3, in time order; the peak of their running
sum is the step's peak above what was live when it started (parameters,
optimizer state). Per round the in-backward run's figures are divided by (or,
for memory, subtracted from) the normal run's; the table gives each round and
the medians.

Target (issue 13): peak memory lower by >= 80 % of the gradient bytes (4 bytes
per parameter: the sharded fp32 gradients the normal step holds until
`optimizer.step()`), step time no worse than 1.05x.

    python bench/in_backward.py [--repeats 3] [--steps 12] [--width 1024] [--device cpu|cuda]
    python bench/in_backward.py --smoke   # --repeats 1 --steps 3 --skip 1 --width 32 --device cpu
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

from flags import at_least

REPO = Path(__file__).resolve().parents[1]
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = ["--repeats", "1", "--steps", "3", "--skip", "1", "--width", "32", "--device", "cpu"]


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
        "train.batch_size=2",  # few activations: the peak is the step's, where the gradients are
        "train.seq_len=32",
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
    run(command(args, in_backward, run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["train/step_time_s"] for r in rows[args.skip :])
    if args.device == "cuda":
        return max(r["memory/cuda_max_allocated_gb"] for r in rows if "train/loss" in r) * 2**30, step_s
    return profile_peak(args, in_backward), step_s


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"run failed: {shlex.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def profile_peak(args: argparse.Namespace, in_backward: bool) -> float:
    """The peak bytes allocated above the start of 3 profiled steps (CPU): the harness's own job and
    loop (`build_job` + `Trainer`), one rank in this process, as `python train.py` runs it, with a
    process group of its own."""
    import torch
    from harness_runs import check, compose, rank_env
    from omegaconf import open_dict

    from harness.job import build_job
    from harness.loop import Trainer

    overrides = [o for o in command(args, in_backward, Path("."))[2:] if not o.startswith(("hydra.", "launcher."))]
    cfg = compose(overrides)
    with open_dict(cfg):
        cfg.train.steps = args.skip + 3
    with tempfile.TemporaryDirectory() as tmp, rank_env(cfg, Path(tmp)) as env:
        job = build_job(cfg, env, check(cfg, 1, Path(tmp)))
        with Trainer(job, cfg, env, Path(tmp)) as trainer:
            trainer.run(until=args.skip)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                trainer.run()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return float(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--steps", type=at_least(1), default=12)
    parser.add_argument("--skip", type=at_least(0), default=2, help="first steps left out of the step time (start-up)")
    parser.add_argument("--width", type=at_least(1), default=1024, help="model.d_model; hidden is 4x")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    if args.steps <= args.skip:
        parser.error(f"--steps {args.steps} must be above --skip {args.skip}: no step would be timed")
    w, vocab = args.width, 256
    params = 2 * vocab * w + 4 * (2 * w + 2 * 4 * w * w + 5 * w) + 2 * w
    grad_bytes = 4 * params
    memory = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "torch.profiler's allocations"
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
    print("bench/in_backward.py: done")


if __name__ == "__main__":
    main()
