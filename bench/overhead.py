"""Per-step overhead of the harness training loop over a hand-written FSDP2 loop.

What is measured: the wall-clock time per optimizer step of the harness's own
job and loop (`harness.job.build_job` + `harness.loop.Trainer`, with its
periodic logging at the default `train.log_every`, rank 0 writing metrics.jsonl
as in any run, W&B disabled) against a minimal loop - forward, backward, clip_grad_norm_, step,
zero_grad - on the same model, initial weights, FSDP2 layout, mesh, AdamW
hyperparameters, batches and process count.

How: the real Hydra config is composed (averager=none, wandb disabled, fp32
params and reductions) and `--nproc` ranks are started with the harness's own
launcher (`harness.launch.start_local_ranks`, via bench/harness_runs.py).
Every rank builds both setups side by side and runs them in alternating rounds
of `--steps-per-round` steps, swapping which one goes first each round to
cancel drift. A round is timed on rank 0 between two barriers, so
it is as long as the slowest rank. Round 0 is warm-up and not counted. The
result is the median over rounds of harness/minimal round-time ratios; the two
models must end with identical parameters, which shows they did the same work.

    python bench/overhead.py [--nproc 2] [--rounds 30] [--steps-per-round 10]
                             [--model gpt|mlp] [--strategy full_shard] [hydra overrides ...]
    python bench/overhead.py --smoke   # 2 ranks, mlp, 2 rounds x 2 steps: the whole path in seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness_runs import FSDP2_STRATEGIES, SMOKE_HELP, check, compose, launch, rank_env
from omegaconf import DictConfig, open_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from harness.data import build_data
from harness.job import build_job
from harness.loop import Trainer
from harness.models import build_model, materialize
from harness.optim import clip_grad_norm_
from harness.plan import RunPlan
from harness.sharding import RESHARD_AFTER_FORWARD

TARGET = 1.03
SMOKE = ["--nproc", "2", "--rounds", "2", "--steps-per-round", "2", "--model", "mlp"]


def compose_config(args: argparse.Namespace) -> DictConfig:
    overrides = [
        f"model={args.model}",
        f"sharding={args.strategy}",
        "averager=none",
        "wandb.mode=disabled",
        "sharding.param_dtype=float32",
        "sharding.reduce_dtype=float32",
        f"launcher.nproc={args.nproc}",
        *args.overrides,
    ]
    cfg = compose(overrides)
    with open_dict(cfg):  # the harness trains through every round: train.steps bounds Trainer.run(until=...)
        cfg.train.steps = args.rounds * args.steps_per_round
    if cfg.optimizer._target_ != "torch.optim.AdamW":
        raise SystemExit("bench/overhead.py: the minimal loop uses AdamW; drop the optimizer override")
    return cfg


def build_minimal(cfg, mesh, env):
    """The hand-written counterpart of `harness.job.build_job` (model, FSDP2, AdamW, data)."""
    device = env.device
    model = build_model(cfg.model, cfg.train.seq_len)
    fsdp_mesh = mesh if mesh["replicate"].size() > 1 else mesh["shard"]
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    reshard = RESHARD_AFTER_FORWARD[cfg.sharding.strategy]
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=fp32)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=fp32)
    materialize(model, device, cfg.train.seed)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
    )
    data = build_data(cfg, env.rank, env.world_size, device)
    return model, optimizer, data


def minimal_steps(model, optimizer, data, steps: int, max_norm: float) -> None:
    for _ in range(steps):
        inputs, targets = data.next_batch()
        loss = model(inputs, targets)
        loss.backward()
        clip_grad_norm_(model.parameters(), max_norm)  # the harness's: one foreach norm, one all-reduce
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def worker(cfg: DictConfig, run_dir: Path, plan: RunPlan, rounds: int, steps_per_round: int, command: str) -> None:
    """One rank: the harness path and the minimal path side by side, in alternating rounds."""
    with rank_env(cfg, run_dir) as env:  # the harness logs as under train.py: stdout + train.log on rank 0
        # (a) the harness path: its own assembly (mesh, model, sharding, optimizer, data) and loop;
        # rank 0 writes metrics.jsonl as in any run (wandb disabled, checkpoint=none by default)
        job = build_job(cfg, env, plan)
        with Trainer(job, cfg, env, run_dir) as trainer:
            # (b) the minimal path, on the same mesh
            m_model, m_optimizer, m_data = build_minimal(cfg, job.mesh, env)
            max_norm = cfg.train.grad_clip

            def run_harness() -> None:
                trainer.run(until=trainer.state.step + steps_per_round)

            def run_minimal() -> None:
                minimal_steps(m_model, m_optimizer, m_data, steps_per_round, max_norm)

            paths = {"harness": run_harness, "minimal": run_minimal}
            times = {name: [] for name in paths}
            orders = []
            for r in range(rounds):
                order = ("harness", "minimal") if r % 2 == 0 else ("minimal", "harness")
                orders.append(order[0][0] + order[1][0])
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    paths[name]()
                    if env.device.type == "cuda":
                        torch.cuda.synchronize()
                    dist.barrier()
                    times[name].append((time.perf_counter() - start) / steps_per_round)

        diff = torch.zeros(())
        for hp, mp in zip(job.model.parameters(), m_model.parameters(), strict=True):
            diff = torch.maximum(diff, (hp.to_local() - mp.to_local()).abs().max().cpu())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)

        if env.is_main:
            report(cfg, env, job.mesh, job.model, times, orders, steps_per_round, command, diff.item())


def report(cfg, env, mesh, model, times, orders, steps_per_round, command, diff) -> None:
    params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full (global) size
    model_desc = ", ".join(f"{k}={v}" for k, v in cfg.model.items())
    print(f"\ncommand:  {command}")
    print(
        f"torch:    {torch.__version__}, backend {dist.get_backend()}, device {env.device}, "
        f"{torch.get_num_threads()} thread(s) per rank"
    )
    print(f"nproc:    {env.world_size}, mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}")
    print(f"model:    {model_desc} -> {params:,} parameters")
    print(
        f"setup:    sharding={cfg.sharding.strategy} (fp32), AdamW lr={cfg.optimizer.lr} "
        f"wd={cfg.optimizer.weight_decay}, grad_clip={cfg.train.grad_clip}, batch {cfg.train.batch_size}x"
        f"{cfg.train.seq_len} per rank, data={cfg.data._target_}, harness log_every={cfg.train.log_every}"
    )
    print(f"rounds:   {len(orders)} x {steps_per_round} steps per path, round 0 = warm-up\n")
    print(f"{'round':>5} {'order':>5} {'harness ms':>11} {'minimal ms':>11} {'ratio':>7}")
    ratios = []
    for r, (order, h, m) in enumerate(zip(orders, times["harness"], times["minimal"])):
        note = "  (warm-up)" if r == 0 else ""
        if r > 0:
            ratios.append(h / m)
        print(f"{r:>5} {order:>5} {h * 1e3:>11.2f} {m * 1e3:>11.2f} {h / m:>7.3f}{note}")
    h_med, m_med = (statistics.median(times[k][1:]) for k in ("harness", "minimal"))
    print(f"\nmedian step time: harness {h_med * 1e3:.2f} ms, minimal {m_med * 1e3:.2f} ms")
    print(f"per-round ratio:  min {min(ratios):.3f}, max {max(ratios):.3f}")
    h_min, m_min = (min(times[k][1:]) for k in ("harness", "minimal"))
    print(
        f"fastest round:    harness {h_min * 1e3:.2f} ms, minimal {m_min * 1e3:.2f} ms, ratio {h_min / m_min:.3f}"
        " (least disturbed by other load)"
    )
    print(
        f"final parameters: max |harness - minimal| = {diff:.3g}"
        f" ({'identical' if diff == 0 else 'DIFFERENT: the two paths did not do the same work'})"
    )
    median = statistics.median(ratios)
    verdict = "ok" if median <= TARGET else "ABOVE TARGET"
    print(f"overhead: median ratio harness/minimal = {median:.3f} (target <= {TARGET}) {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30, help="including one warm-up round")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--strategy", choices=FSDP2_STRATEGIES, default="full_shard")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.batch_size=16")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    if args.rounds < 2 or args.steps_per_round < 1:
        parser.error("need --rounds >= 2 (round 0 is warm-up) and --steps-per-round >= 1")
    cfg = compose_config(args)
    command = " ".join(["python", *sys.argv])
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as tmp:
        run_dir = Path(tmp)
        plan = check(cfg, args.nproc, run_dir)
        launch(cfg, run_dir, plan, worker, args.rounds, args.steps_per_round, command)
    print("bench/overhead.py: done")


if __name__ == "__main__":
    main()
