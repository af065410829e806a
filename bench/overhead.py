"""Per-step overhead of the harness training loop over a hand-written loop on the same layout.

What is measured, on the same model, initial weights, optimizer (fused by
default here, as on CUDA), batches and process count:
- the wall-clock time per optimizer step of the harness's own job and loop
  (`harness.job.build_job` + `harness.loop.Trainer`, with its periodic logging
  at the default `train.log_every`, rank 0 writing metrics.jsonl as in any run,
  W&B disabled) against the hand-written loop of bench/reference_loops.py for
  that layout: FSDP2 by hand when a replica is sharded, a plain module when a
  replica is one device (its gradients all-reduced when there are several);
- what the host does for a step that does not log: the aten ops it dispatches
  and the host syncs among them (`harness.profiling.DispatchCounter`), the CPU
  proxies of a GPU's kernel launches and idle time, over `--count-steps` steps
  of each path after the timed rounds. Targets: ops <= 1.05x the hand-written
  loop's, 0 host syncs.
- where replicas of one device train synchronously (`--nproc 2` or more,
  `--strategy no_shard`), also against torch's DistributedDataParallel on the
  same plain module: both overlap their gradient all-reduces with backward, in
  buckets of the same size (the hand-written loop all-reduces its buckets
  after backward).
- with `--balance-time` (2 or more one-device replicas), also the harness with
  post-local SGD and `averager.balance=time` on equal replicas: the aten ops and
  host syncs of its steps between two exchanges (target: 0 host syncs; the
  replicas meet, and the host waits, only at exchanges); with `--period-auto`
  the same for `averager.period=auto` (its period held at the counted one by
  `min_period` = `max_period`: it measures, and the host waits, at exchanges
  only). One replica has no exchange: these need `--nproc 2` or more.

How: the real Hydra config is composed (averager=none, wandb disabled, fp32
params and reductions) and `--nproc` ranks are started with the harness's own
launcher (`harness.launch.start_local_ranks`, via bench/harness_runs.py; one
rank runs in this process).
Every rank builds the setups side by side and runs them in alternating rounds
of `--steps-per-round` steps, rotating which one goes first each round to
cancel drift. A round is timed on rank 0 between two barriers, so
it is as long as the slowest rank. Round 0 is warm-up and not counted. The
result is the median over rounds of harness/minimal (and harness/DDP) round-time
ratios; the models must end with identical parameters, which shows they did the
same work.

    python bench/overhead.py [--nproc 2] [--rounds 30] [--steps-per-round 10] [--count-steps 5]
                             [--model gpt|mlp] [--strategy full_shard] [hydra overrides ...]
    python bench/overhead.py --nproc 1        # one device: the plain module against a plain loop
    python bench/overhead.py --strategy no_shard   # 2 synchronous one-device replicas: + against DDP
    python bench/overhead.py --strategy no_shard --balance-time  # + post-local SGD, balance=time, between exchanges
    python bench/overhead.py --strategy no_shard --period-auto   # + post-local SGD, period=auto, between exchanges
    python bench/overhead.py --smoke   # 2 one-device replicas (every path but FSDP2 by hand), mlp, 2 rounds x 2 steps
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
from flags import at_least
from harness_runs import FSDP2_STRATEGIES, SMOKE_HELP, check, compose, launch, rank_env
from omegaconf import DictConfig, open_dict
from reference_loops import minimal_fsdp2, plain

from harness.dist import local_view, synchronize
from harness.job import build_job
from harness.loop import Trainer
from harness.plan import RunPlan
from harness.profiling import DispatchCounter

TARGET, OPS_TARGET = 1.03, 1.05
SMOKE = ["--nproc", "2", "--strategy", "no_shard", "--rounds", "2", "--steps-per-round", "2", "--count-steps", "2"]
SMOKE += ["--model", "mlp", "--balance-time", "--period-auto"]


def compose_config(args: argparse.Namespace) -> DictConfig:
    overrides = [
        f"model={args.model}",
        f"sharding={args.strategy}",
        "averager=none",
        "wandb.mode=disabled",
        "sharding.param_dtype=float32",
        "sharding.reduce_dtype=float32",
        "optimizer.fused=true",  # as on CUDA; CPU's for-loop Adam reads each parameter's step on the host
        f"launcher.nproc={args.nproc}",
        *args.overrides,
    ]
    cfg = compose(overrides)
    with open_dict(cfg):  # the harness trains through every round, then to its next log step and the counted ones
        cfg.train.steps = args.rounds * args.steps_per_round + cfg.train.log_every + args.count_steps + 1
    if args.count_steps >= cfg.train.log_every:
        raise SystemExit(f"bench/overhead.py: --count-steps must be below train.log_every={cfg.train.log_every}")
    return cfg


def count_dispatch(steps, n: int) -> tuple[float, float]:
    """(aten ops, host syncs) per step of `steps(n)`, on this rank."""
    with DispatchCounter() as counter:
        steps(n)
    return counter.total / n, counter.host_syncs / n


PLANNED = {  # the plans counted between exchanges: each one's averager keys, given its period
    "balance=time": lambda period: ["averager.balance=time"],
    "period=auto": lambda period: [
        "averager.period=auto",
        f"averager.max_period={period}",
        f"averager.min_period={period}",
    ],
}


def planned(cfg: DictConfig, count_steps: int, name: str) -> DictConfig:
    """`cfg` with post-local SGD whose periods are planned (`PLANNED[name]`), a period past every step it trains
    after the first exchange (periodic: after the first step), so the counted ones are between two exchanges."""
    period = 2 + count_steps + 1
    keys = ["averager=periodic", f"averager.period={period}", "averager.warmup_steps=0", *PLANNED[name](period)]
    with open_dict(cfg):
        cfg.averager = compose(keys).averager
        cfg.train.steps = 2 + count_steps + 1
    return cfg


def worker(
    cfg: DictConfig,
    run_dir: Path,
    plan: RunPlan,
    rounds: int,
    steps_per_round: int,
    count_steps: int,
    command: str,
    plans: list[tuple[str, DictConfig, RunPlan]],
) -> None:
    """One rank: the harness path and the hand-written ones side by side, in rotating rounds."""
    with rank_env(cfg, run_dir) as env:  # the harness logs as under train.py: stdout + train.log on rank 0
        # (a) the harness path: its own assembly (mesh, model, sharding, optimizer, data) and loop;
        # rank 0 writes metrics.jsonl as in any run (wandb disabled, checkpoint=none by default)
        job = build_job(cfg, env, plan)
        with Trainer(job, cfg, env, run_dir) as trainer:
            # (b) the hand-written loop for the same layout, and DDP beside synchronous one-device replicas
            one_device = job.mesh["shard"].size() == 1
            models, loops = {"harness": job.model}, {}
            if not one_device:
                models["minimal"], loops["minimal"] = minimal_fsdp2(cfg, job.mesh, env)
            elif env.world_size == 1:
                models["minimal"], loops["minimal"] = plain(cfg, env)
            else:
                models["minimal"], loops["minimal"] = plain(cfg, env, gradients="buckets")
                models["DDP"], loops["DDP"] = plain(cfg, env, gradients="ddp")

            def run_harness(n: int) -> None:
                trainer.run(until=trainer.clock.step + n)

            paths = {"harness": run_harness, **loops}
            times = {name: [] for name in paths}
            orders = []
            for r in range(rounds):
                order = list(paths)[r % len(paths) :] + list(paths)[: r % len(paths)]
                orders.append("".join(name[0] for name in order))
                for name in order:
                    synchronize(env.device)
                    dist.barrier()
                    start = time.perf_counter()
                    paths[name](steps_per_round)
                    synchronize(env.device)
                    dist.barrier()
                    times[name].append((time.perf_counter() - start) / steps_per_round)

            # count steps that do not log: every path first trains to the harness's next log step
            to_log_step = -trainer.clock.step % cfg.train.log_every or cfg.train.log_every
            for run in paths.values():
                run(to_log_step)
            counts = {name: count_dispatch(run, count_steps) for name, run in paths.items()}

        diffs = {}
        for name, model in models.items():
            diff = torch.zeros(())
            for hp, mp in zip(job.model.parameters(), model.parameters(), strict=True):
                diff = torch.maximum(diff, (local_view(hp) - local_view(mp)).abs().max().cpu())
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            diffs[name] = diff.item()

        for name, planned_cfg, planned_plan in plans:  # past the first exchange, then steps of a period
            job = build_job(planned_cfg, env, planned_plan)
            (run_dir / name).mkdir(exist_ok=True)
            with Trainer(job, planned_cfg, env, run_dir / name) as trainer:
                trainer.run(until=2)
                counts[f"harness, {name}"] = count_dispatch(lambda n: trainer.run(until=2 + n), count_steps)
                trainer.run()

        if env.is_main:
            reference = "plain-module loop" if one_device else "minimal FSDP2 loop"
            if one_device and env.world_size > 1:
                reference += ", its gradients' mean taken after backward in the harness's buckets"
            report(cfg, env, job, times, orders, steps_per_round, command, diffs, counts, reference)


def report(cfg, env, job, times, orders, steps_per_round, command, diffs, counts, reference) -> None:
    mesh, model = job.mesh, job.model
    params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full (global) size
    model_desc = ", ".join(f"{k}={v}" for k, v in cfg.model.items())
    others = [name for name in times if name != "harness"]
    print(f"\ncommand:  {command}")
    print(
        f"torch:    {torch.__version__}, backend {dist.get_backend()}, device {env.device}, "
        f"{torch.get_num_threads()} thread(s) per rank"
    )
    print(f"nproc:    {env.world_size}, mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}")
    print(f"model:    {model_desc} -> {params:,} parameters")
    print(
        f"setup:    sharding={cfg.sharding.strategy} (fp32), {cfg.optimizer._target_.rsplit('.', 1)[-1]} "
        f"lr={cfg.optimizer.lr} wd={cfg.optimizer.weight_decay} fused={cfg.optimizer.fused}, "
        f"grad_clip={cfg.train.grad_clip}, batch {cfg.train.batch_size}x{cfg.train.seq_len} per rank, "
        f"data={cfg.data._target_}, harness log_every={cfg.train.log_every}"
    )
    print(f"against:  minimal = the {reference} (bench/reference_loops.py)")
    if "DDP" in times:
        print("          DDP = torch's DistributedDataParallel on the same plain module, its default buckets")
    print(f"rounds:   {len(orders)} x {steps_per_round} steps per path, round 0 = warm-up\n")
    header = "".join(f"{name + ' ms':>11} {'ratio':>7}" for name in others)
    print(f"{'round':>5} {'order':>5} {'harness ms':>11} {header}")
    for r, order in enumerate(orders):
        h = times["harness"][r]
        cells = "".join(f"{times[name][r] * 1e3:>11.2f} {h / times[name][r]:>7.3f}" for name in others)
        print(f"{r:>5} {order:>5} {h * 1e3:>11.2f} {cells}{'  (warm-up)' if r == 0 else ''}")
    medians = {name: statistics.median(times[name][1:]) for name in times}
    print("\nmedian step time: " + ", ".join(f"{name} {medians[name] * 1e3:.2f} ms" for name in times))
    for name in others:
        ratios = [h / m for h, m in zip(times["harness"][1:], times[name][1:])]
        print(f"per-round ratio harness/{name}: min {min(ratios):.3f}, max {max(ratios):.3f}")
        fastest = min(times["harness"][1:]) / min(times[name][1:])
        print(f"fastest rounds' ratio harness/{name}: {fastest:.3f} (least disturbed by other load)")
        same = "identical" if diffs[name] == 0 else "DIFFERENT: the two paths did not do the same work"
        print(f"final parameters: max |harness - {name}| = {diffs[name]:.3g} ({same})")
        median = statistics.median(ratios)
        if name == "minimal":
            verdict = "ok" if median <= TARGET else "ABOVE TARGET"
            print(f"overhead: median ratio harness/minimal = {median:.3f} (target <= {TARGET}) {verdict}")
        else:
            print(f"median ratio harness/{name} = {median:.3f}")
    h_ops, h_syncs = counts["harness"]
    print(
        "\ndispatched per step that does not log (rank 0): "
        + "; ".join(f"{name} {ops:.0f} aten ops, {syncs:g} host syncs" for name, (ops, syncs) in counts.items())
    )
    m_ops = counts["minimal"][0]
    ops_verdict = "ok" if h_ops / m_ops <= OPS_TARGET else "ABOVE TARGET"
    print(f"ops: harness/minimal = {h_ops / m_ops:.3f} (target <= {OPS_TARGET}) {ops_verdict}")
    print(f"host syncs per step that does not log: harness {h_syncs:g} (target 0) {'ok' if h_syncs == 0 else 'ABOVE'}")
    for name in PLANNED:
        if f"harness, {name}" in counts:
            ops, syncs = counts[f"harness, {name}"]
            print(
                f"{name}, equal replicas, steps between exchanges: {ops:.0f} aten ops, {syncs:g} host syncs "
                f"(target 0) {'ok' if syncs == 0 else 'ABOVE'}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(1), default=2)
    parser.add_argument("--rounds", type=at_least(2), default=30, help="including one warm-up round")
    parser.add_argument("--steps-per-round", type=at_least(1), default=10)
    parser.add_argument("--count-steps", type=at_least(1), default=5, help="steps whose dispatched ops are counted")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--strategy", choices=FSDP2_STRATEGIES, default="full_shard")
    parser.add_argument(
        "--balance-time", action="store_true", help="also count post-local SGD with balance=time between exchanges"
    )
    parser.add_argument(
        "--period-auto", action="store_true", help="also count post-local SGD with period=auto between exchanges"
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.batch_size=16")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    if (args.balance_time or args.period_auto) and args.nproc < 2:
        parser.error("--balance-time and --period-auto count steps between exchanges: one replica has none (--nproc 2)")
    cfg = compose_config(args)
    command = " ".join(["python", *sys.argv])
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as tmp:
        run_dir = Path(tmp)
        plan = check(cfg, args.nproc, run_dir)
        plans = []
        for name, wanted in (("balance=time", args.balance_time), ("period=auto", args.period_auto)):
            if wanted:
                planned_cfg = planned(cfg.copy(), args.count_steps, name)
                plans.append((name, planned_cfg, check(planned_cfg, args.nproc, run_dir / name)))
        counts = (args.rounds, args.steps_per_round, args.count_steps)
        launch(cfg, run_dir, plan, worker, *counts, command, plans)
    print("bench/overhead.py: done")


if __name__ == "__main__":
    main()
