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

How: the real Hydra config is composed (averager=none, wandb disabled, fp32
params and reductions) and `--nproc` ranks are started with the harness's own
launcher (`harness.launch.start_local_ranks`, via bench/harness_runs.py; one
rank runs in this process).
Every rank builds both setups side by side and runs them in alternating rounds
of `--steps-per-round` steps, swapping which one goes first each round to
cancel drift. A round is timed on rank 0 between two barriers, so
it is as long as the slowest rank. Round 0 is warm-up and not counted. The
result is the median over rounds of harness/minimal round-time ratios; the two
models must end with identical parameters, which shows they did the same work.

    python bench/overhead.py [--nproc 2] [--rounds 30] [--steps-per-round 10] [--count-steps 5]
                             [--model gpt|mlp] [--strategy full_shard] [hydra overrides ...]
    python bench/overhead.py --nproc 1        # one device: the plain module against a plain loop
    python bench/overhead.py --smoke   # one rank, mlp, 2 rounds x 2 steps: the whole path in seconds
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
from reference_loops import minimal_fsdp2, plain

from harness.dist import local_view, synchronize
from harness.job import build_job
from harness.loop import Trainer
from harness.plan import RunPlan
from harness.profiling import DispatchCounter

TARGET, OPS_TARGET = 1.03, 1.05
SMOKE = ["--nproc", "1", "--rounds", "2", "--steps-per-round", "2", "--count-steps", "2", "--model", "mlp"]


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


def worker(
    cfg: DictConfig, run_dir: Path, plan: RunPlan, rounds: int, steps_per_round: int, count_steps: int, command: str
) -> None:
    """One rank: the harness path and the hand-written one side by side, in alternating rounds."""
    with rank_env(cfg, run_dir) as env:  # the harness logs as under train.py: stdout + train.log on rank 0
        # (a) the harness path: its own assembly (mesh, model, sharding, optimizer, data) and loop;
        # rank 0 writes metrics.jsonl as in any run (wandb disabled, checkpoint=none by default)
        job = build_job(cfg, env, plan)
        with Trainer(job, cfg, env, run_dir) as trainer:
            # (b) the hand-written loop for the same layout
            one_device = job.mesh["shard"].size() == 1
            if one_device:
                m_model, run_minimal = plain(cfg, env, average_gradients=env.world_size > 1)
            else:
                m_model, run_minimal = minimal_fsdp2(cfg, job.mesh, env)

            def run_harness(n: int = steps_per_round) -> None:
                trainer.run(until=trainer.state.step + n)

            paths = {"harness": run_harness, "minimal": lambda: run_minimal(steps_per_round)}
            times = {name: [] for name in paths}
            orders = []
            for r in range(rounds):
                order = ("harness", "minimal") if r % 2 == 0 else ("minimal", "harness")
                orders.append(order[0][0] + order[1][0])
                for name in order:
                    synchronize(env.device)
                    dist.barrier()
                    start = time.perf_counter()
                    paths[name]()
                    synchronize(env.device)
                    dist.barrier()
                    times[name].append((time.perf_counter() - start) / steps_per_round)

            # count steps that do not log: both paths first train to the harness's next log step
            to_log_step = -trainer.state.step % cfg.train.log_every or cfg.train.log_every
            run_harness(to_log_step)
            run_minimal(to_log_step)
            counts = {
                "harness": count_dispatch(run_harness, count_steps),
                "minimal": count_dispatch(run_minimal, count_steps),
            }

        diff = torch.zeros(())
        for hp, mp in zip(job.model.parameters(), m_model.parameters(), strict=True):
            diff = torch.maximum(diff, (local_view(hp) - local_view(mp)).abs().max().cpu())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)

        if env.is_main:
            reference = "plain module" if one_device else "minimal FSDP2"
            report(cfg, env, job, times, orders, steps_per_round, command, diff.item(), counts, reference)


def report(cfg, env, job, times, orders, steps_per_round, command, diff, counts, reference) -> None:
    mesh, model = job.mesh, job.model
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
        f"setup:    sharding={cfg.sharding.strategy} (fp32), {cfg.optimizer._target_.rsplit('.', 1)[-1]} "
        f"lr={cfg.optimizer.lr} wd={cfg.optimizer.weight_decay} fused={cfg.optimizer.fused}, "
        f"grad_clip={cfg.train.grad_clip}, batch {cfg.train.batch_size}x{cfg.train.seq_len} per rank, "
        f"data={cfg.data._target_}, harness log_every={cfg.train.log_every}"
    )
    print(f"against:  the {reference} loop (bench/reference_loops.py)")
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
    (h_ops, h_syncs), (m_ops, m_syncs) = counts["harness"], counts["minimal"]
    print(
        f"\ndispatched per step that does not log (rank 0): harness {h_ops:.0f} aten ops, {h_syncs:g} host syncs; "
        f"minimal {m_ops:.0f} aten ops, {m_syncs:g} host syncs"
    )
    ops_verdict = "ok" if h_ops / m_ops <= OPS_TARGET else "ABOVE TARGET"
    print(f"ops: harness/minimal = {h_ops / m_ops:.3f} (target <= {OPS_TARGET}) {ops_verdict}")
    print(f"host syncs per step that does not log: harness {h_syncs:g} (target 0) {'ok' if h_syncs == 0 else 'ABOVE'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30, help="including one warm-up round")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--count-steps", type=int, default=5, help="steps whose dispatched ops are counted")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--strategy", choices=FSDP2_STRATEGIES, default="full_shard")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.batch_size=16")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    if args.rounds < 2 or args.steps_per_round < 1 or args.count_steps < 1:
        parser.error("need --rounds >= 2 (round 0 is warm-up), --steps-per-round >= 1 and --count-steps >= 1")
    cfg = compose_config(args)
    command = " ".join(["python", *sys.argv])
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as tmp:
        run_dir = Path(tmp)
        plan = check(cfg, args.nproc, run_dir)
        launch(cfg, run_dir, plan, worker, args.rounds, args.steps_per_round, args.count_steps, command)
    print("bench/overhead.py: done")


if __name__ == "__main__":
    main()
