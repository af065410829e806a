"""Step time and MFU of the harness against a hand-written FSDP2 loop and a plain loop, eager and compiled.

What is measured: ms per optimizer step, tokens/s and MFU on the device the
ranks use (the GPU when CUDA is visible, else the CPU) for six paths that train
the same model from the same initial weights on the same batches, for each
model in turn (a GPT and a Llama, `--models`):

  harness                 `build_job` + `Trainer` as `run_rank` runs them (checkpoint=none, W&B disabled,
                          its periodic logging and rank 0's metrics.jsonl included), the config's own
                          settings: sharding.param_dtype=auto (bf16 compute on CUDA), fused optimizer on
                          CUDA, train.grad_clip, averager=none
  minimal FSDP2           forward, backward, `harness.optim.clip_grad_norm_`, step, zero_grad on a model
                          sharded by hand: fully_shard per block and root on the harness's mesh with the
                          same MixedPrecisionPolicy, optimizer and data stream
  plain                   no FSDP, no collective in the step: fp32 params, autocast to the compute dtype,
                          fused optimizer on CUDA, torch.nn.utils.clip_grad_norm_ (foreach); each rank
                          trains its own copy on its own batches, so per-rank throughput compares
  ...+compile             harness with train.compile=true; minimal with `compile_blocks` before sharding;
                          plain with torch.compile of the whole model

How: ranks start the harness way (in this process for --nproc 1, else the
harness's own launcher, `harness.launch.start_local_ranks`, with the config's
start method; bench/harness_runs.py). Every rank builds all paths side by
side. Round 0 is warm-up (compiling happens there); then in each of --rounds
rounds every path runs --steps-per-round steps, the order rotated each round
to cancel drift, each path timed between device synchronize + barrier on both
ends, so a round lasts as long as the slowest rank. Reported: per-path median
step time, global tokens/s, MFU (tokens/s per device * flops/token / peak), the
median of per-round ratios against the targets below, and the max parameter
difference between harness and minimal (same work; bf16 on CUDA need not be
bit-identical).

The targets are a GPU's: on CPU the ratios are printed and the verdicts read
"n/a on CPU".

    python bench/gpu.py [--nproc 1] [--rounds 10] [--steps-per-round 10] [--no-compile]
                        [--compile-backend inductor] [hydra overrides ...]
    python bench/gpu.py --smoke   # CPU, 2 ranks, 1 block of each model, 1 measured round of 1 step, eager backend
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness_runs import FSDP2_STRATEGIES, SMOKE_HELP, check, compose, launch, rank_env
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from harness.data import build_data
from harness.dist import resolve_device, synchronize, visible_gpus
from harness.job import build_job
from harness.loop import Trainer
from harness.models import build_model, materialize
from harness.optim import build_optimizer, clip_grad_norm_
from harness.plan import RunPlan, averager_configured
from harness.sharding import RESHARD_AFTER_FORWARD, compile_blocks, resolve_dtype
from harness.throughput import peak_flops

# Each model in turn, its shape by device: on a GPU the 163M GPT of the issue and Llama 3.2 1B (the
# architecture users train; batch 2 of 2048 so that its six paths fit side by side in 80 GB, unmeasured
# so far); on CPU a tiny GPT and a tiny Llama, so that a run with compiling ends in minutes on 2 cores.
CUDA_MODELS = {
    "gpt": [
        "model=gpt",
        "model.n_layer=12",
        "model.n_head=12",
        "model.d_model=768",
        "model.vocab_size=50304",
        "train.batch_size=16",
        "train.seq_len=1024",
    ],
    "llama3_1b": ["model=llama3_1b", "train.batch_size=2", "train.seq_len=2048"],
}
CPU_SIZE = ["train.batch_size=4", "train.seq_len=64", "dist.threads_per_rank=1"]
CPU_MODELS = {
    "gpt": ["model=gpt", "model.n_layer=2", "model.d_model=64", "model.n_head=4", *CPU_SIZE],
    "llama": ["model=llama", "model.n_layer=2", "model.d_model=64", "model.n_heads=4", *CPU_SIZE],
}
# --smoke: every path on 2 ranks, the tiny models smaller still, compiled paths traced by dynamo with the eager
# backend (no inductor code generation, which takes minutes on a cold CPU cache)
SMOKE = ["--nproc", "2", "--rounds", "1", "--steps-per-round", "1", "--compile-backend", "eager"]
SMOKE_OVERRIDES = ["train.device=cpu", "model.n_layer=1", "train.seq_len=32", "train.batch_size=2"]
OVERHEAD_TARGET, PLAIN_TARGET, MFU_TARGET = 1.05, 1.0, 0.45


def model_defaults(args: argparse.Namespace) -> dict[str, list[str]]:
    """The models to measure, each with its default shape: the device's set, or the one
    model an override names (with the shape keys of neither)."""
    fixed = ["averager=none", "wandb.mode=disabled", f"launcher.nproc={args.nproc}"]
    # which defaults apply depends on the device the overrides leave the ranks on
    probe = compose([*fixed, *args.overrides])
    cuda = resolve_device(probe.train.device, visible_gpus()) == "cuda"  # NVML: the parent never inits CUDA
    models = CUDA_MODELS if cuda else CPU_MODELS
    named = [o.split("=", 1)[1] for o in args.overrides if o.startswith("model=")]
    if named:  # another model: its shape keys differ
        return {named[-1]: [d for d in models["gpt"] if not d.startswith("model")]}
    return {name: models[name] for name in args.models.split(",")} if args.models else models


def compose_config(args: argparse.Namespace, defaults: list[str], run_dir: Path) -> tuple[DictConfig, RunPlan]:
    fixed = ["averager=none", "wandb.mode=disabled", f"launcher.nproc={args.nproc}"]
    cfg = compose(["sharding=full_shard", *fixed, *defaults, *args.overrides])
    with open_dict(cfg):  # the harness paths train in every round: train.steps bounds Trainer.run(until=...)
        cfg.train.steps = (args.rounds + 1) * args.steps_per_round
    plan = check(cfg, args.nproc, run_dir)
    if cfg.sharding.strategy not in FSDP2_STRATEGIES or averager_configured(cfg):
        raise SystemExit(
            f"bench/gpu.py: the minimal loop is synchronous FSDP2: sharding must be one of "
            f"{', '.join(FSDP2_STRATEGIES)} and averager=none (got sharding={cfg.sharding.strategy}, "
            f"averager={cfg.averager._target_})"
        )
    return cfg, plan


def build_harness(cfg, env, plan: RunPlan, run_dir: Path, compiled: bool, stack: contextlib.ExitStack):
    """The harness's own assembly and loop (`build_job` + `Trainer`, as `run_rank` runs them, rank 0 writing
    metrics.jsonl into `run_dir`); `steps(n)` trains n more steps."""
    cfg = OmegaConf.merge(cfg, {"train": {"compile": compiled}})
    run_dir.mkdir(parents=True, exist_ok=True)
    job = build_job(cfg, env, plan)
    trainer = stack.enter_context(Trainer(job, cfg, env, run_dir))  # checkpoint=none: only its per-step checks

    def steps(n: int) -> None:
        trainer.run(until=trainer.state.step + n)

    return job, steps


def build_minimal(cfg, mesh, env, compiled: bool):
    """The hand-written counterpart of `build_job` + `train`, with identical settings, on the harness's mesh."""
    device = env.device
    model = build_model(cfg.model, cfg.train.seq_len)
    if compiled:
        compile_blocks(model)  # before sharding, as build_job does: FSDP2's hooks stay outside the graphs
    fsdp_mesh = mesh if mesh["replicate"].size() > 1 else mesh["shard"]
    policy = MixedPrecisionPolicy(
        param_dtype=resolve_dtype(cfg.sharding.param_dtype, device, low_precision_on_cuda=True),
        reduce_dtype=resolve_dtype(cfg.sharding.reduce_dtype, device, low_precision_on_cuda=False),
    )
    reshard = RESHARD_AFTER_FORWARD[cfg.sharding.strategy]
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    materialize(model, device, cfg.train.seed)
    # same class, hyperparameters and fused choice
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), device)
    data = build_data(cfg, env.rank, env.world_size, device)
    max_norm = cfg.train.grad_clip

    def steps(n: int) -> None:
        for _ in range(n):
            inputs, targets = data.next_batch()
            model(inputs, targets).backward()
            if max_norm > 0:
                clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return model, steps


def build_plain(cfg, env, compiled: bool):
    """Single-device training with no process group in the step: what FSDP2 and the harness are measured against."""
    device = env.device
    model = build_model(cfg.model, cfg.train.seq_len)
    materialize(model, device, cfg.train.seed)  # fp32 parameters, the same initial values
    dtype = resolve_dtype(cfg.sharding.param_dtype, device, low_precision_on_cuda=True)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), device)  # fused on CUDA (optimizer.fused=null)
    forward = torch.compile(model) if compiled else model  # the whole model: no FSDP hooks to keep outside
    # its own rank's batches, the same as the sharded paths see, without any gradient exchange
    data = build_data(cfg, env.rank, env.world_size, device)
    max_norm = cfg.train.grad_clip

    def steps(n: int) -> None:
        for _ in range(n):
            inputs, targets = data.next_batch()
            amp = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
            with amp:
                loss = forward(inputs, targets)
            loss.backward()
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return model, steps


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module, device: torch.device) -> float:
    """Max |a - b| over all parameters of two models sharded alike, over all ranks."""
    diff = torch.zeros((), device=device)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        la, lb = pa.to_local(), pb.to_local()
        if la.numel():  # a rank's shard of a small parameter can be empty
            diff = torch.maximum(diff, (la.float() - lb.float()).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def worker(
    cfg: DictConfig,
    run_dir: Path,
    plan: RunPlan,
    rounds: int,
    steps_per_round: int,
    compiled: bool,
    compile_backend: str,
    command: str,
) -> None:
    if compile_backend != "inductor":  # every torch.compile of this rank (compile_blocks' too) uses it
        torch.compile = functools.partial(torch.compile, backend=compile_backend)
    # the harness logs as under train.py; that cost is measured too
    with rank_env(cfg, run_dir) as env, contextlib.ExitStack() as stack:
        paths, models, jobs = {}, {}, {}
        variants = [("", False)] + ([("+compile", True)] if compiled else [])
        for suffix, comp in variants:
            jobs[suffix], paths["harness" + suffix] = build_harness(
                cfg, env, plan, run_dir / f"harness{suffix}", comp, stack
            )
            models["harness" + suffix] = jobs[suffix].model
            models["minimal FSDP2" + suffix], paths["minimal FSDP2" + suffix] = build_minimal(
                cfg, jobs[suffix].mesh, env, comp
            )
            models["plain" + suffix], paths["plain" + suffix] = build_plain(cfg, env, comp)

        names = list(paths)
        times = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # each path takes its turn first
            for name in order:
                synchronize(env.device)
                dist.barrier()
                start = time.perf_counter()
                paths[name](steps_per_round)
                synchronize(env.device)
                dist.barrier()
                times[name].append((time.perf_counter() - start) / steps_per_round)

        diffs = {
            suffix: max_abs_diff(models["harness" + suffix], models["minimal FSDP2" + suffix], env.device)
            for suffix, _ in variants
        }
        if env.is_main:
            job = jobs[""]
            device_name = (
                torch.cuda.get_device_name()
                if env.device.type == "cuda"
                else f"cpu, {torch.get_num_threads()} thread(s)"
            )
            report(
                cfg,
                env,
                job,
                times,
                diffs,
                steps_per_round,
                command,
                device_name,
                peak_flops(env.device, cfg.train.peak_tflops),
                compile_backend,
            )
        dist.barrier()  # no rank tears down while rank 0 still reports


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over measured rounds (round 0 is warm-up) of a[r] / b[r]: pairs of one round share its drift."""
    return statistics.median(x / y for x, y in zip(a[1:], b[1:]))


def report(cfg, env, job, times, diffs, steps_per_round, command, device_name, peak, compile_backend) -> None:
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * env.world_size
    params = sum(p.numel() for p in job.model.parameters())  # DTensor numel is the global size
    dtype = resolve_dtype(cfg.sharding.param_dtype, env.device, low_precision_on_cuda=True)
    reduce = resolve_dtype(cfg.sharding.reduce_dtype, env.device, low_precision_on_cuda=False)
    opt = cfg.optimizer
    print(f"\ncommand:  {command}")
    print(f"torch:    {torch.__version__}, backend {dist.get_backend()}")
    print(f"device:   {device_name}; peak {'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'} per device")
    print(f"nproc:    {env.world_size}, mesh {dict(zip(job.mesh.mesh_dim_names, job.mesh.shape))}")
    print(
        f"model:    {', '.join(f'{k}={v}' for k, v in cfg.model.items())} -> {params:,} parameters, "
        f"{job.flops_per_token / 1e6:.1f} MFLOP/token"
    )
    print(
        f"setup:    sharding={cfg.sharding.strategy}, compute {str(dtype)[6:]}, reduce {str(reduce)[6:]}, "
        f"{opt._target_.rsplit('.', 1)[-1]} lr={opt.lr} wd={opt.weight_decay} "
        f"fused={job.optimizer.defaults.get('fused')}, grad_clip={cfg.train.grad_clip}, batch "
        f"{cfg.train.batch_size}x{cfg.train.seq_len} per rank, data={cfg.data._target_}, "
        f"log_every={cfg.train.log_every}"
    )
    rounds = len(next(iter(times.values())))
    print(f"rounds:   {rounds} x {steps_per_round} steps per path, round 0 = warm-up (compiles), order rotated\n")

    print(f"{'path':<22} {'ms/step':>9} {'tokens/s':>11} {'MFU':>6}   per-round ms/step (round 0 = warm-up)")
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    mfu = {}
    for name, t in times.items():
        tps = tokens_per_step / medians[name]
        mfu[name] = None if peak is None else tps / env.world_size * job.flops_per_token / peak
        rounds_ms = " ".join(f"{x * 1e3:.1f}" for x in t)
        print(
            f"{name:<22} {medians[name] * 1e3:>9.2f} {tps:>11,.0f} "
            f"{'n/a' if mfu[name] is None else f'{mfu[name]:.3f}':>6}   {rounds_ms}"
        )

    print()
    for suffix, diff in diffs.items():
        kind = "compiled" if suffix else "eager"
        print(
            f"final parameters ({kind}): max |harness - minimal FSDP2| = {diff:.3g}"
            f"{' (identical)' if diff == 0 else ''}"
        )
    print()
    gpu = env.device.type == "cuda"  # the targets are the GPU's; on CPU the ratios are printed, not judged

    def verdict(ok: bool, miss: str) -> str:
        return ("ok" if ok else miss) if gpu else "n/a on CPU"

    checks = [("harness / minimal FSDP2 (eager, identical settings)", "", OVERHEAD_TARGET)]
    if "harness+compile" in times:
        checks.append(("harness+compile / minimal FSDP2+compile (identical settings)", "+compile", OVERHEAD_TARGET))
    for label, suffix, target in checks:
        ratio = median_ratio(times["harness" + suffix], times["minimal FSDP2" + suffix])
        print(
            f"{label}: step-time ratio {ratio:.3f} (median of per-round ratios), target <= {target} "
            f"{verdict(ratio <= target, 'ABOVE TARGET')}"
        )
    best = min((n for n in ("harness", "harness+compile") if n in times), key=medians.get)
    ratio = median_ratio(times["plain"], times[best])  # throughput ratio = inverse step-time ratio
    print(
        f"best harness throughput / plain eager throughput: {ratio:.3f} (best = {best}), target >= "
        f"{PLAIN_TARGET} {verdict(ratio >= PLAIN_TARGET, 'BELOW TARGET')}"
    )
    if "harness+compile" not in times:
        print(f"harness+compile MFU: skipped (--no-compile), target >= {MFU_TARGET}")
    elif peak is None:
        why = "n/a on CPU" if not gpu else "n/a (no peak FLOP/s for this device; give train.peak_tflops=)"
        print(f"harness+compile MFU: {why}, target >= {MFU_TARGET}")
    else:
        value = mfu["harness+compile"]
        print(
            f"harness+compile MFU: {value:.3f}, target >= {MFU_TARGET} {verdict(value >= MFU_TARGET, 'BELOW TARGET')}"
        )
    if "harness+compile" in times and compile_backend != "inductor":
        print(f"compiled paths: torch.compile backend={compile_backend} (not inductor): their times are no figures")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds, after one warm-up round")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled paths (slow to compile on CPU)")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the compiled paths (smoke: eager)"
    )
    parser.add_argument(
        "--models", default=None, help="comma-separated, of the device's set (GPU: gpt,llama3_1b; CPU: gpt,llama)"
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE + SMOKE_OVERRIDES)}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, applied last, e.g. train.batch_size=8")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    if args.nproc < 1 or args.rounds < 1 or args.steps_per_round < 1:
        parser.error("need --nproc, --rounds and --steps-per-round >= 1")
    command = shlex.join(["python", *sys.argv])
    for name, defaults in model_defaults(args).items():
        print(f"## {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix="harness-bench-gpu-") as tmp:
            run_dir = Path(tmp)
            cfg, plan = compose_config(args, defaults, run_dir)
            rank_args = (args.rounds + 1, args.steps_per_round, not args.no_compile, args.compile_backend, command)
            launch(cfg, run_dir, plan, worker, *rank_args)  # one rank in this process, as `python train.py` runs it
    print("bench/gpu.py: done")


if __name__ == "__main__":
    main()
