"""Gradient accumulation: K micro-batches of B against one batch of K·B, step time side by side.

What is measured: two jobs built in the same ranks by the harness's own
`build_job` + `harness.loop.Trainer`, training the same model on the same
samples (the data rule makes K micro-batches of B read what one batch of K·B
reads, rank by rank): "accumulated" (`train.batch_size=B train.grad_accum=K`)
and "one batch" (`train.batch_size=K·B train.grad_accum=1`). Round 0 warms
both up; then in each of `--rounds` rounds each job trains `--steps` steps, the
order alternating to cancel drift, each timed between barriers (a round lasts
as long as the slowest rank). Reported: per-round ms/step of each, their ratio,
and the median ratio against the target (issue 23: <= 1.05x where both fit in
memory). The accumulated job runs K forwards and backwards of B each, so the
ratio is the cost of the smaller kernels and, under FSDP2, of the per
micro-batch all-gathers in backward; what it saves is activation memory.

    python bench/grad_accum.py [--nproc 2] [--rounds 5] [--steps 8] [--accum 4] [--micro-batch 4] [overrides ...]
    python bench/grad_accum.py --smoke   # a tiny MLP, 1 round of 2 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from flags import at_least
from harness_runs import SMOKE_HELP, check, compose, launch, rank_env

from harness import metrics
from harness.dist import synchronize
from harness.job import build_job
from harness.loop import Trainer
from harness.models import build_model, materialize
from harness.optim import build_optimizer

TARGET = 1.05
SMOKE_SIZE = ["model=mlp", "model.d_model=32", "model.hidden=64", "model.n_layer=1", "train.seq_len=16"]


def plain_steps(cfg, device, micro_batch: int, accum: int):
    """The same model and optimizer in a hand-written loop without FSDP or collectives
    (each rank its own copy): the ratio a plain PyTorch loop gets on this hardware."""
    model = build_model(cfg.model, cfg.train.seq_len)
    materialize(model, device, cfg.train.seed)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), device)
    tokens = torch.randint(cfg.model.vocab_size, (micro_batch * accum, cfg.train.seq_len + 1), device=device)

    def steps(n: int) -> None:
        for _ in range(n):
            for micro in tokens.split(micro_batch):
                (model(micro[:, :-1], micro[:, 1:]) / accum).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return steps


def rank(cfg, run_dir: Path, plan, args: argparse.Namespace) -> None:
    with rank_env(cfg, run_dir) as env:
        runners, trainers = {}, []
        for name, batch, accum in (
            ("accumulated", args.micro_batch, args.accum),
            ("one batch", args.micro_batch * args.accum, 1),
        ):
            job_cfg = cfg.copy()
            job_cfg.train.batch_size, job_cfg.train.grad_accum = batch, accum
            job_dir = run_dir / name.replace(" ", "_")
            job_dir.mkdir(exist_ok=True)
            trainer = Trainer(build_job(job_cfg, env, plan), job_cfg, env, job_dir).__enter__()
            trainers.append(trainer)
            runners[name] = lambda n, t=trainer: t.run(until=t.clock.step + n)
            runners[f"plain {name}"] = plain_steps(cfg, env.device, batch, accum)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for round_ in range(args.rounds + 1):
            order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
            for name in order:
                synchronize(env.device)
                dist.barrier()
                start = time.perf_counter()
                runners[name](args.steps)
                synchronize(env.device)
                dist.barrier()
                if round_ > 0:  # round 0 warms up
                    times[name].append((time.perf_counter() - start) / args.steps)
        for trainer in trainers:
            trainer.__exit__(None, None, None)
        if env.is_main:
            (run_dir / "times.json").write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=at_least(1), default=2)
    parser.add_argument("--rounds", type=at_least(1), default=5)
    parser.add_argument("--steps", type=at_least(1), default=8, help="steps per job per round")
    parser.add_argument("--accum", type=at_least(1), default=4, help="K: micro-batches per step")
    parser.add_argument("--micro-batch", type=at_least(1), default=4, help="B: sequences per rank per micro-batch")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. sharding=ddp")
    args = parser.parse_args()
    overrides = list(args.overrides)
    if args.smoke:
        args.rounds, args.steps, args.accum, args.micro_batch = 1, 2, 2, 2
        overrides = [*SMOKE_SIZE, *overrides]
    steps = (args.rounds + 1) * args.steps
    cfg = compose(
        [
            "averager=none",
            "wandb.mode=disabled",
            "dist.threads_per_rank=1",
            f"train.steps={steps}",
            f"train.log_every={steps}",
            *overrides,
        ]
    )
    with tempfile.TemporaryDirectory(prefix="bench-grad-accum-") as tmp:
        run_dir = Path(tmp)
        plan = check(cfg, args.nproc, run_dir)
        launch(cfg, run_dir, plan, rank, args)
        times = json.loads((run_dir / "times.json").read_text())
        final_loss = {
            name: [json.loads(line) for line in (run_dir / name.replace(" ", "_") / "metrics.jsonl").open()][-1][
                metrics.TRAIN_LOSS
            ]
            for name in ("accumulated", "one batch")
        }
    k, b = args.accum, args.micro_batch
    print(
        f"gradient accumulation, {args.nproc} ranks, sharding={cfg.sharding.strategy}: "
        f"{k} micro-batches of {b} against one batch of {k * b}, {args.steps} steps per round"
    )
    print("| round | accumulated ms/step | one batch ms/step | ratio | plain PyTorch ratio |")
    print("|---|---|---|---|---|")
    ratios, plain_ratios = [], []
    for i, (acc, one, plain_acc, plain_one) in enumerate(
        zip(times["accumulated"], times["one batch"], times["plain accumulated"], times["plain one batch"]), 1
    ):
        ratios.append(acc / one)
        plain_ratios.append(plain_acc / plain_one)
        print(f"| {i} | {1000 * acc:.1f} | {1000 * one:.1f} | {acc / one:.3f} | {plain_acc / plain_one:.3f} |")
    print(f"final loss: accumulated {final_loss['accumulated']:.6f}, one batch {final_loss['one batch']:.6f}")
    median = statistics.median(ratios)
    verdict = "meets" if median <= TARGET else "misses"
    print(
        f"median ratio {median:.3f} ({verdict} the target <= {TARGET}); a plain PyTorch loop on the same model: "
        f"{statistics.median(plain_ratios):.3f}"
    )
    print("bench/grad_accum.py: done")


if __name__ == "__main__":
    main()
