"""Per-step overhead of the harness training loop over a hand-written FSDP2 loop.

What is measured: the wall-clock time per optimizer step of `harness.loop.train`
(with its periodic logging at the default `train.log_every`, metrics sink
disabled) against a minimal loop - forward, backward, clip_grad_norm_, step,
zero_grad - on the same model, initial weights, FSDP2 layout, mesh, AdamW
hyperparameters, batches and process count.

How: the real Hydra config is composed (averager=none, wandb disabled, fp32
params and reductions) and `--nproc` ranks are started with torch's elastic
launch API. Every rank builds both setups side by side and runs them in
alternating rounds of `--steps-per-round` steps, swapping which one goes first
each round to cancel drift. A round is timed on rank 0 between two barriers, so
it is as long as the slowest rank. Round 0 is warm-up and not counted. The
result is the median over rounds of harness/minimal round-time ratios; the two
models must end with identical parameters, which shows they did the same work.

    python bench/overhead.py [--nproc 2] [--rounds 30] [--steps-per-round 10]
                             [--model gpt|mlp] [--strategy full_shard] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.checkpoint import Checkpointer, checkpoint_dir  # noqa: E402
from harness.config import ConfigError, plain, register_configs  # noqa: E402
from harness.data import build_data  # noqa: E402
from harness.dist import (  # noqa: E402
    init_distributed,
    teardown,
    visible_gpus,  # noqa: E402
)
from harness.job import build_job  # noqa: E402
from harness.launch import setup_logging, start_method  # noqa: E402
from harness.loop import TrainState, train  # noqa: E402
from harness.metrics import MetricsSink  # noqa: E402
from harness.models import build_model, materialize  # noqa: E402
from harness.optim import clip_grad_norm_  # noqa: E402
from harness.sharding import RESHARD_AFTER_FORWARD  # noqa: E402
from harness.validate import validate  # noqa: E402

FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
TARGET = 1.03


def compose_config(args: argparse.Namespace):
    register_configs()
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
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    try:
        validate(cfg, args.nproc, visible_gpus())
    except ConfigError as e:
        raise SystemExit(f"bench/overhead.py: the config cannot run:\n\n{e}") from None
    if cfg.optimizer._target_ != "torch.optim.AdamW":
        raise SystemExit("bench/overhead.py: the minimal loop uses AdamW; drop the optimizer override")
    return cfg


def build_minimal(cfg, mesh, device):
    """The hand-written counterpart of `harness.job.build_job` (model, FSDP2, AdamW, data)."""
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
    data = build_data(
        cfg.data,
        cfg.model.vocab_size,
        cfg.train.batch_size,
        cfg.train.seq_len,
        cfg.train.seed,
        dist.get_rank(),
        dist.get_world_size(),
        device,
    )
    return model, optimizer, data


def minimal_steps(model, optimizer, data, steps: int, max_norm: float) -> None:
    for _ in range(steps):
        inputs, targets = data.next_batch()
        loss = model(inputs, targets)
        loss.backward()
        clip_grad_norm_(model.parameters(), max_norm)  # the harness's: one foreach norm, one all-reduce
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def worker(cfg_dict: dict, rounds: int, steps_per_round: int, command: str) -> None:
    cfg = OmegaConf.create(cfg_dict)
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    run_dir = tempfile.TemporaryDirectory(prefix="harness-bench-")
    setup_logging(Path(run_dir.name), env.rank)  # the harness logs as under train.py: stdout + train.log on rank 0
    try:
        # (a) the harness path: its own assembly (mesh, model, sharding, optimizer, data) and loop
        job = build_job(cfg, env)
        sink = MetricsSink(Path(run_dir.name), cfg.wandb, cfg_dict, enabled=False)
        train_cfg, state = cfg.train.copy(), TrainState()
        checkpointer = Checkpointer(
            cfg.checkpoint, checkpoint_dir(cfg.checkpoint, Path(run_dir.name)), env.rank, env.device, plain(cfg)
        )  # checkpoint=none by default

        # (b) the minimal path, on the same mesh
        m_model, m_optimizer, m_data = build_minimal(cfg, job.mesh, env.device)
        max_norm = cfg.train.grad_clip

        def run_harness() -> None:
            train_cfg.steps = state.step + steps_per_round
            train(job, sink, train_cfg, env, state, checkpointer)

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
    finally:
        teardown()
        run_dir.cleanup()


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
        f"{cfg.train.seq_len} per rank, data={cfg.data.name}, harness log_every={cfg.train.log_every}"
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
    parser.add_argument("--strategy", choices=FSDP_STRATEGIES, default="full_shard")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.batch_size=16")
    args = parser.parse_args()
    if args.rounds < 2 or args.steps_per_round < 1:
        parser.error("need --rounds >= 2 (round 0 is warm-up) and --steps-per-round >= 1")
    cfg = compose_config(args)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"bench-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        start_method=start_method(cfg),
        monitor_interval=0.1,
    )
    command = " ".join(["python", *sys.argv])
    elastic_launch(launch, worker)(plain(cfg), args.rounds, args.steps_per_round, command)


if __name__ == "__main__":
    main()
