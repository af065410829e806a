"""Step time, MFU and the host's work per step of the harness against hand-written loops, eager and compiled.

What is measured, for each model in turn (a GPT and a Llama, `--models`), on
the device the ranks use (the GPU when CUDA is visible, else the CPU), for paths
that train the same model from the same initial weights on the same batches:

  harness                 `build_job` + `Trainer` as `run_rank` runs them (checkpoint=none, W&B disabled,
                          rank 0's metrics.jsonl included), the config's own settings:
                          sharding.param_dtype=auto (bf16 compute on CUDA), fused optimizer on CUDA,
                          train.grad_clip, averager=none. At one rank (the default) a replica is one
                          device: a plain module, no FSDP2
  minimal FSDP2           FSDP2 applied by hand (bench/reference_loops.py) on the harness's mesh with the same
                          mixed-precision policy, optimizer and data stream; at one rank this is what the
                          harness itself ran before one-device replicas dropped FSDP2
  plain                   a plain module, fp32 params, autocast to the compute dtype, fused optimizer on CUDA;
                          each rank trains its own copy on its own batches, so per-rank throughput compares
  ...+compile             harness with train.compile=true (one device: the whole model; FSDP2: per block and
                          the output loss); minimal with `compile_blocks` before sharding; plain with
                          torch.compile of the whole model
  float8 <recipe>         the harness with train.float8=tensorwise, then rowwise (harness/float8.py), in the
                          compiled pass (float8 pays compiled; the eager one with --no-compile), where the
                          device has float8 matmuls (compute capability 8.9+; the smoke emulates them on CPU),
                          else a line says why not

`--quality STEPS` (`--float8`: 300) then trains the harness in bf16 and in each float8 recipe STEPS
steps each, compiled (by inductor; with another backend eager, which computes the same), from the same
initial weights on the same batches of memory-mapped text (`data=text`: the Python standard library's
sources, bytes), and compares their training loss at the end (the mean over the last tenth of the
steps): float8's within 1 % of bf16's is the target.

The data is memory-mapped tokens (`data=tokens`) the bench writes itself into
its temporary directory, so the batches cost a read, not a generation
(`--data synthetic` for the synthetic walk instead).

How, built so that a crash costs at most the model it happened in and the
machine stays up (the first GPU runs of the version before this one never came
back): each model runs in a process of its own, which prints its table as soon
as it is done, so a crash in Llama leaves the GPT's figures; the bench sets a
core-dump size of 0 for itself and its children (a crashed CUDA process can dump
a core as large as its address space). In that process the ranks start the
harness way (in the process itself for --nproc 1, else the harness's own
launcher, `harness.launch.start_local_ranks`, with the config's start method;
bench/harness_runs.py). Each path in turn is built, trained one warm-up round
(compiling happens there) and `--rounds` rounds of `--steps-per-round` steps,
each round timed between device synchronize + barrier on both ends; the harness
logs every `--steps-per-round` + 1 steps and each of its log steps falls between
two rounds, untimed, so every timed step is a step that does not log. Then
`--count-steps` more steps (none logs) count the aten ops the host dispatches and
the host syncs among them (`harness.profiling.DispatchCounter`, no profiler). The
path is then freed (nothing of it is referenced any more, dynamo's caches are
reset, CUDA's cache emptied), so that a model that fills the card fits (Llama 3.2
1B at 8 x 2048 on 140 GB, 4 x 2048 below). Reported: per-path median step time,
global tokens/s, MFU (tokens/s per device * flops/token / peak: the model's
bf16-equivalent FLOPs over the dense bf16 peak, float8 rows too), the counts,
the peak of CUDA memory allocated while the path was built and trained, and the
ratios against the targets below (GPU targets; on CPU "n/a on CPU").

`--kernels` (opt-in) also counts, on CUDA, the device activities per step
(kernels, copies, memsets) and the host's CUDA synchronize calls, from
torch.profiler: each path in a process of its own, one profiler session in it
(kineto's CUPTI teardown has known crashes for back-to-back sessions in one
process: kineto pull requests 1169 and 1554), after the timing runs.

    python bench/gpu.py [--nproc 1] [--rounds 10] [--steps-per-round 10] [--no-compile] [--kernels [PATH,...]]
                        [--compile-backend inductor] [--models gpt,llama3_1b] [--data tokens] [hydra overrides ...]
    python bench/gpu.py --quick   # on a GPU: GPT and Llama, eager and compiled, few rounds
    python bench/gpu.py --float8  # on a GPU: GPT and Llama compiled, harness and plain in bf16 against the
                                  # float8 recipes, few rounds, then the 300-step quality check
    python bench/gpu.py --smoke   # CPU, 2 ranks, 1 block of the GPT, 1 measured round of 1 step, eager backend,
                                  # the harness path's kernel count (a profiler session of CPU ops on CPU),
                                  # the float8 rows emulated, a quality check of 2 steps
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from flags import at_least
from harness_runs import FSDP2_STRATEGIES, SMOKE_HELP, check, compose, launch, rank_env
from omegaconf import DictConfig, OmegaConf, open_dict
from reference_loops import minimal_fsdp2, plain

from harness import float8
from harness.data.shards import FORMAT, INDEX, shard_name, token_dtype
from harness.dist import resolve_device, synchronize, visible_gpus
from harness.job import build_job
from harness.loop import Trainer
from harness.mesh import build_mesh
from harness.plan import RunPlan, averager_configured
from harness.profiling import DispatchCounter
from harness.sharding import resolve_dtype
from harness.throughput import peak_flops

# Each model in turn, its shape by device: on a GPU GPT-2 small as nanoGPT trains it (`model=gpt2`: 124M,
# biases, tied head) at 32 x 1024 (the figures in docs/gpu.md before issue 51 are of the 163M GPT of issue 37,
# the same shape with an untied head: `model=gpt2 model.tie_embeddings=false`) and Llama 3.2 1B (the batch
# set by the card's memory: `llama_batch`); on CPU a tiny GPT and a tiny Llama, so that a run with
# compiling ends in minutes on 2 cores.
CUDA_MODELS = {
    "gpt": ["model=gpt2", "train.batch_size=32", "train.seq_len=1024"],
    "llama3_1b": ["model=llama3_1b", "train.seq_len=2048"],
}
# fused AdamW as on CUDA: CPU's default for-loop Adam reads each parameter's step count on the host
CPU_SIZE = ["train.batch_size=4", "train.seq_len=64", "dist.threads_per_rank=1", "optimizer.fused=true"]
CPU_MODELS = {
    "gpt": ["model=gpt", "model.n_layer=2", "model.d_model=64", "model.n_head=4", *CPU_SIZE],
    "llama": ["model=llama", "model.n_layer=2", "model.d_model=64", "model.n_heads=4", *CPU_SIZE],
}
PATHS = ("harness", "minimal FSDP2", "plain")
FLOAT8_PATHS = ("float8 tensorwise", "float8 rowwise")  # the harness with train.float8=<recipe>
# --float8: the compiled pass of these paths alone, few rounds, and the quality check
FLOAT8_ONLY = ("harness", "plain", *FLOAT8_PATHS)
FLOAT8_QUALITY_STEPS = 300
# --smoke: every path on 2 ranks, the tiny GPT smaller still (the Llama differs in the model alone), compiled paths
# traced by dynamo with the eager backend (no inductor code generation, which takes minutes on a cold CPU cache),
# the harness's kernel count
SMOKE = ["--nproc", "2", "--rounds", "1", "--steps-per-round", "1", "--count-steps", "1", "--models", "gpt"]
SMOKE += ["--compile-backend", "eager", "--kernels", "harness", "--quality", "2"]
SMOKE_OVERRIDES = ["train.device=cpu", "model.n_layer=1", "train.seq_len=32", "train.batch_size=2"]
# --quick: what whoever has a GPU runs first, after a one-minute smoke of train.py (docs/gpu.md); each model
# under 3 minutes of GPU time on an H100
QUICK = ["--rounds", "3", "--steps-per-round", "5", "--count-steps", "3"]
OVERHEAD_TARGET, PLAIN_TARGET, MFU_TARGET = 1.03, 0.98, 0.45
FLOAT8_TARGET, FLOAT8_LOSS_TOLERANCE = 1.2, 0.01  # tokens/s over the bf16 harness's (Llama 3.2 1B, compiled); loss
COUNTS = ("ops", "host syncs")  # per step, in the table's order
TOKENS_WRITTEN = 2**22  # per split: enough windows that no path reads one twice in a quick run


def llama_batch() -> str:
    """Llama 3.2 1B at a batch that fills the card, one path at a time: 8 x 2048 from 120 GiB (H200), else 4."""
    total = int(subprocess.run(  # NVML through nvidia-smi: this process must not initialise CUDA before forking
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True, text=True, check=False,
    ).stdout.strip() or 0)  # fmt: skip
    return f"train.batch_size={8 if total >= 120 * 1024 else 4}"


def model_defaults(args: argparse.Namespace) -> dict[str, list[str]]:
    """The models to measure, each with its default shape: the device's set, or the one
    model an override names (with the shape keys of neither)."""
    probe = compose([*fixed_overrides(args), *args.overrides])
    cuda = resolve_device(probe.train.device, visible_gpus()) == "cuda"  # NVML: the parent never inits CUDA
    models = dict(CUDA_MODELS if cuda else CPU_MODELS)
    named = [o.split("=", 1)[1] for o in args.overrides if o.startswith("model=")]
    if named:  # another model: its shape keys differ
        return {named[-1]: [d for d in models["gpt"] if not d.startswith("model")]}
    wanted = args.models.split(",") if args.models else list(models)
    unknown = [name for name in wanted if name not in models]
    if unknown:
        print(
            f"bench/gpu.py: --models {args.models}: {', '.join(unknown)} is not one of this device's models "
            f"({', '.join(models)}). Fix: --models {','.join(models)}, or a Hydra override model=<name>.",
            file=sys.stderr,
        )
        raise SystemExit(2)  # a bad argument's status, as argparse's
    if cuda and "llama3_1b" in wanted:
        models["llama3_1b"] = [*models["llama3_1b"], llama_batch()]
    return {name: models[name] for name in wanted}


def fixed_overrides(args: argparse.Namespace) -> list[str]:
    return ["averager=none", "wandb.mode=disabled", f"launcher.nproc={args.nproc}"]


def write_tokens(root: Path, vocab_size: int) -> None:
    """A `data=tokens` dataset of uniformly drawn ids (harness.prepare's format, no tokenizer):
    what the bench trains on, so that a batch costs a memory-mapped read."""
    root.mkdir(parents=True, exist_ok=True)
    dtype, rng = token_dtype(vocab_size), np.random.default_rng(0)
    index = {"format": FORMAT, "dtype": dtype.name, "vocab_size": vocab_size, "eot_id": None, "sources": []}
    for split in ("train", "eval"):
        rng.integers(0, vocab_size, TOKENS_WRITTEN, dtype=dtype).tofile(root / shard_name(split, 0))
        index[split] = [{"file": shard_name(split, 0), "tokens": TOKENS_WRITTEN}]
    (root / INDEX).write_text(json.dumps(index))


def compose_config(args: argparse.Namespace, defaults: list[str], run_dir: Path) -> tuple[DictConfig, RunPlan]:
    cfg = compose(["sharding=full_shard", *fixed_overrides(args), *defaults, *args.overrides])
    if args.data == "tokens" and cfg.data._target_ == "harness.data.SyntheticTokens":
        write_tokens(run_dir / "tokens", cfg.model.vocab_size)
        data = ["data=tokens", f"data.path={run_dir / 'tokens'}"]
        cfg = compose(["sharding=full_shard", *fixed_overrides(args), *defaults, *data, *args.overrides])
    with open_dict(cfg):
        # the harness logs once between two timed rounds; it trains the warm-up and the timed rounds, each
        # after a log step, then to the next log step and the counted steps
        cfg.train.log_every = args.steps_per_round + 1
        cfg.train.steps = (args.rounds + 2) * cfg.train.log_every + args.count_steps + 1
    plan = check(cfg, args.nproc, run_dir)
    if cfg.sharding.strategy not in FSDP2_STRATEGIES or averager_configured(cfg):
        raise SystemExit(
            f"bench/gpu.py: the minimal loop is synchronous FSDP2: sharding must be one of "
            f"{', '.join(FSDP2_STRATEGIES)} and averager=none (got sharding={cfg.sharding.strategy}, "
            f"averager={cfg.averager._target_})"
        )
    return cfg, plan


def build_path(name: str, compiled: bool, cfg, env, plan: RunPlan, run_dir: Path, stack: contextlib.ExitStack):
    """Path `name`, built: (`steps(n)`: train n steps, `to_log_step()`: untimed, through the harness's next
    log step, what the table says of the path). Everything it holds lives in `stack`'s scope and the returned
    closures, so that it is freed with them."""
    if name == "harness" or name in FLOAT8_PATHS:
        recipe = name.split()[1] if name in FLOAT8_PATHS else "none"
        cfg = OmegaConf.merge(cfg, {"train": {"compile": compiled, "float8": recipe}})
        path_dir = run_dir / f"{name.replace(' ', '-')}{'+compile' * compiled}"
        path_dir.mkdir(parents=True, exist_ok=True)
        job = build_job(cfg, env, plan)
        trainer = stack.enter_context(Trainer(job, cfg, env, path_dir))  # checkpoint=none: only its per-step checks

        def steps(n: int) -> None:
            trainer.run(until=trainer.clock.step + n)

        def to_log_step() -> None:
            steps(-trainer.clock.step % cfg.train.log_every)

        info = {
            "mesh": dict(zip(job.mesh.mesh_dim_names, job.mesh.shape)),
            "flops_per_token": job.flops_per_token,
            "one_device": job.mesh["shard"].size() == 1,
            "fused": getattr(job.optimizer, "defaults", {}).get("fused"),
        }
        return steps, to_log_step, info
    if name == "minimal FSDP2":
        _, steps = minimal_fsdp2(cfg, build_mesh(plan.replicate, plan.shard, env.device.type), env, compiled)
    else:
        _, steps = plain(cfg, env, compiled)
    return steps, lambda: None, {}


def measure_path(name: str, compiled: bool, cfg, env, plan, run_dir, args) -> dict:
    """A path's round times (round 0, the warm-up, first) and host counts, and what the table says of it;
    the path itself is gone when this returns."""
    cuda = env.device.type == "cuda"
    if cuda:  # the peak of this path alone: the previous one is freed
        torch.cuda.reset_peak_memory_stats(env.device)
    with contextlib.ExitStack() as stack:
        steps, to_log_step, info = build_path(name, compiled, cfg, env, plan, run_dir, stack)
        times = []
        for _ in range(args.rounds + 1):
            to_log_step()  # the harness's log step falls between rounds, untimed
            synchronize(env.device)
            dist.barrier()
            start = time.perf_counter()
            steps(args.steps_per_round)
            synchronize(env.device)
            dist.barrier()
            times.append((time.perf_counter() - start) / args.steps_per_round)
        to_log_step()  # counted steps must not log
        synchronize(env.device)
        with DispatchCounter() as counter:
            steps(args.count_steps)
        counts = {"ops": counter.total / args.count_steps, "host syncs": counter.host_syncs / args.count_steps}
    peak_gib = torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else None
    return {"times": times, "counts": counts, "peak_gib": peak_gib, **info}


def free(device: torch.device) -> None:
    """After a path: its Python objects, dynamo's compiled code and guards, the CUDA allocator's cached blocks."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def count_kernels(name: str, compiled: bool, cfg, env, plan, run_dir, args) -> dict:
    """Per step that does not log, of path `name` after a warm-up round: the device activities (kernels,
    copies, memsets) and the host's CUDA synchronize calls, from one torch.profiler session."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with contextlib.ExitStack() as stack:
        steps, to_log_step, _ = build_path(name, compiled, cfg, env, plan, run_dir, stack)
        steps(args.steps_per_round)
        to_log_step()
        synchronize(env.device)
        with torch.profiler.profile(activities=activities) as profiler:
            steps(args.count_steps)
            synchronize(env.device)
        events = profiler.events()
        kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events) / args.count_steps
        # the host's synchronize calls, but the one that closes the window above
        syncs = (sum("Synchronize" in e.name for e in events) - (env.device.type == "cuda")) / args.count_steps
    return {"kernels": kernels, "cuda syncs": syncs}


def worker(cfg: DictConfig, run_dir: Path, plan: RunPlan, args: argparse.Namespace, command: str) -> None:
    if args.compile_backend != "inductor":  # every torch.compile of this rank (nn.Module.compile's too) uses it
        torch.compile = functools.partial(torch.compile, backend=args.compile_backend)
    runs = [("", False)] + ([] if args.no_compile else [("+compile", True)])
    if args.float8:
        runs = [] if args.float8 == "quality" else runs[-1:]
    # the harness logs as under train.py; its log steps fall outside the timed rounds
    with rank_env(cfg, run_dir) as env:
        if args.kernels_of:
            name, _, suffix = args.kernels_of.partition("+")
            counts = count_kernels(name, bool(suffix), cfg, env, plan, run_dir, args)
            if env.is_main:
                cells = ", ".join(f"{v:.1f} {k}" for k, v in counts.items())
                print(f"{args.kernels_of:<22} per step that does not log: {cells}", flush=True)
            dist.barrier()
            return
        results = {}
        for suffix, compiled in runs:
            names = FLOAT8_ONLY if args.float8 else PATHS
            if (suffix, compiled) == runs[-1] and args.float8_refused is None:  # float8 pays compiled: that pass
                names = dict.fromkeys([*names, *FLOAT8_PATHS])
            for name in names:
                results[name + suffix] = measure_path(name, compiled, cfg, env, plan, run_dir, args)
                free(env.device)
        if env.is_main and results:
            report(cfg, env, results, args.steps_per_round, command, args.compile_backend, args.float8_refused)
        elif env.is_main and args.float8_refused is not None:  # --float8 quality: no table to say it in
            print(f"float8 quality check: not run here: {args.float8_refused}", flush=True)
        if args.quality_cfg is not None and args.float8_refused is None:
            # dynamo's other backends compute what eager does (the smoke's): their tracing would only cost time
            compiled = not args.no_compile and args.compile_backend == "inductor"
            losses = quality(args.quality_cfg, env, plan, run_dir, compiled)
            if env.is_main:
                report_quality(losses, compiled, env.device.type == "cuda")
        dist.barrier()  # no rank tears down while rank 0 still reports


def quality(cfg: DictConfig, env, plan: RunPlan, run_dir: Path, compiled: bool) -> dict[str, list[float]]:
    """The harness in bf16 and in each float8 recipe, `train.steps` steps each from the same initial weights
    on the same batches, logging every step: each one's training losses."""
    losses = {}
    for name in ("harness", *FLOAT8_PATHS):
        recipe = name.split()[1] if name in FLOAT8_PATHS else "none"
        path_cfg = OmegaConf.merge(cfg, {"train": {"compile": compiled, "float8": recipe}})
        path_dir = run_dir / f"quality-{name.replace(' ', '-')}"
        path_dir.mkdir(parents=True, exist_ok=True)
        with Trainer(build_job(path_cfg, env, plan), path_cfg, env, path_dir) as trainer:
            trainer.run()
        if env.is_main:
            rows = [json.loads(line) for line in (path_dir / "metrics.jsonl").read_text().splitlines()]
            losses[name] = [row["train/loss"] for row in rows if "train/loss" in row]
        free(env.device)
    return losses


def report_quality(losses: dict[str, list[float]], compiled: bool, gpu: bool) -> None:
    steps = len(losses["harness"])
    last = max(1, steps // 10)

    def final(name: str) -> float:
        return statistics.fmean(losses[name][-last:])

    bf16 = final("harness")
    print(
        f"quality: {steps} steps each, {'compiled' if compiled else 'eager'}, from the same initial weights on the "
        "same batches of data=text; "
        f"training loss at the end (mean of the last {last} steps): harness {bf16:.4f}"
    )
    for name in FLOAT8_PATHS:
        change = final(name) / bf16 - 1
        verdict = ("ok" if abs(change) <= FLOAT8_LOSS_TOLERANCE else "OUTSIDE") if gpu else "n/a on CPU"
        print(
            f"  {name}: {final(name):.4f} ({change:+.2%} of the harness's), target within "
            f"{FLOAT8_LOSS_TOLERANCE:.0%} {verdict}"
        )
    sys.stdout.flush()


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over measured rounds (round 0 is warm-up) of a[r] / b[r]."""
    return statistics.median(x / y for x, y in zip(a[1:], b[1:]))


def report(cfg, env, results, steps_per_round, command, compile_backend, float8_refused) -> None:
    harness = results.get("harness") or results["harness+compile"]
    mesh, flops_per_token, one_dev, fused = (harness[k] for k in ("mesh", "flops_per_token", "one_device", "fused"))
    gpu = env.device.type == "cuda"
    peak = peak_flops(env.device, cfg.train.peak_tflops)
    device_name = torch.cuda.get_device_name() if gpu else f"cpu, {torch.get_num_threads()} thread(s)"
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * env.world_size
    dtype = resolve_dtype(cfg.sharding.param_dtype, env.device, low_precision_on_cuda=True)
    reduce = resolve_dtype(cfg.sharding.reduce_dtype, env.device, low_precision_on_cuda=False)
    opt = cfg.optimizer
    print(f"\ncommand:  {command}")
    print(f"torch:    {torch.__version__}, backend {dist.get_backend()}")
    print(f"device:   {device_name}; peak {'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'} per device")
    layout = "one-device replica (plain module)" if one_dev else "FSDP2"
    print(f"nproc:    {env.world_size}, mesh {mesh}: the harness runs {layout}")
    print(f"model:    {', '.join(f'{k}={v}' for k, v in cfg.model.items())}, {flops_per_token / 1e6:.1f} MFLOP/token")
    print(
        f"setup:    sharding={cfg.sharding.strategy}, compute {str(dtype)[6:]}, reduce {str(reduce)[6:]}, "
        f"{opt._target_.rsplit('.', 1)[-1]} lr={opt.lr} wd={opt.weight_decay} "
        f"fused={fused}, "
        f"grad_clip={cfg.train.grad_clip}, batch {cfg.train.batch_size}x{cfg.train.seq_len} per rank, "
        f"data={cfg.data._target_}, log_every={cfg.train.log_every} (between rounds, untimed)"
    )
    rounds = len(harness["times"])
    print(f"rounds:   {rounds} x {steps_per_round} steps per path, one path at a time, round 0 = warm-up\n")
    header = "".join(f"{k + '/step':>17}" for k in COUNTS)
    print(f"{'path':<26} {'ms/step':>9} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9}{header}   per-round ms/step")
    medians, mfu = {}, {}
    for name, result in results.items():
        times, counts = result["times"], result["counts"]
        medians[name] = statistics.median(times[1:])
        tps = tokens_per_step / medians[name]
        mfu[name] = None if peak is None else tps / env.world_size * flops_per_token / peak
        cells = "".join(f"{counts[k]:>17.1f}" for k in COUNTS)
        rounds_ms = " ".join(f"{x * 1e3:.1f}" for x in times)
        mfu_cell = "n/a" if mfu[name] is None else f"{mfu[name]:.3f}"
        peak_cell = "n/a" if result["peak_gib"] is None else f"{result['peak_gib']:.2f}"
        print(f"{name:<26} {medians[name] * 1e3:>9.2f} {tps:>11,.0f} {mfu_cell:>6} {peak_cell:>9}{cells}   {rounds_ms}")
    print(
        "MFU: the model's FLOPs per token as bf16 counts them, over the device's dense bf16 peak, float8 rows "
        "too (their float8 matmuls have twice that peak); peak GiB: CUDA memory allocated, n/a on CPU\n"
    )

    def verdict(ok: bool, miss: str) -> str:
        return ("ok" if ok else miss) if gpu else "n/a on CPU"

    compiled = "harness+compile" in results
    for suffix in [suffix for suffix in ("", "+compile") if "harness" + suffix in results]:
        kind = "compiled" if suffix else "eager"
        ratio = median_ratio(results["plain" + suffix]["times"], results["harness" + suffix]["times"])
        print(
            f"harness / plain throughput ({kind}): {ratio:.3f}, target >= {PLAIN_TARGET} "
            f"{verdict(ratio >= PLAIN_TARGET, 'BELOW TARGET')}"
        )
        if not one_dev and "minimal FSDP2" + suffix in results:  # FSDP2: against FSDP2 by hand, same settings
            ratio = median_ratio(results["harness" + suffix]["times"], results["minimal FSDP2" + suffix]["times"])
            print(
                f"harness / minimal FSDP2 step time ({kind}): {ratio:.3f}, target <= {OVERHEAD_TARGET} "
                f"{verdict(ratio <= OVERHEAD_TARGET, 'ABOVE TARGET')}"
            )
    syncs = harness["counts"]["host syncs"]
    print(f"harness host syncs per step that does not log: {syncs:g}, target 0 {'ok' if syncs == 0 else 'ABOVE'}")
    if compiled and "harness" in results:
        speedup = medians["harness"] / medians["harness+compile"]
        print(f"harness+compile speed-up over harness eager: {speedup:.3f}, target > 1 {verdict(speedup > 1, 'NONE')}")
    if compiled:
        if mfu["harness+compile"] is not None:
            value = mfu["harness+compile"]
            print(f"harness+compile MFU: {value:.3f} (target >= {MFU_TARGET} for Llama 3.2 1B)")
        if compile_backend != "inductor":
            print(f"compiled paths: torch.compile backend={compile_backend} (not inductor): their times are no figures")
    suffix = "+compile" if compiled else ""
    for name in FLOAT8_PATHS:
        if name + suffix in results:
            ratio = median_ratio(results["harness" + suffix]["times"], results[name + suffix]["times"])
            print(
                f"{name} / harness tokens/s ({'compiled' if compiled else 'eager'}): {ratio:.3f}, target >= "
                f"{FLOAT8_TARGET} for Llama 3.2 1B compiled {verdict(ratio >= FLOAT8_TARGET, 'BELOW TARGET')}"
            )
    if float8_refused is not None:
        print(f"float8 rows (and --quality): not run here: {float8_refused}")
    sys.stdout.flush()


def run_model(args: argparse.Namespace, command: str) -> None:
    """This process's part: the model `--only` names (its table), or one path's kernels (`--kernels-of`)."""
    defaults = model_defaults(args)[args.only]
    with tempfile.TemporaryDirectory(prefix="harness-bench-gpu-") as tmp:
        run_dir = Path(tmp)
        cfg, plan = compose_config(args, defaults, run_dir)
        # why the device cannot run float8 (asked here: the ranks' parent must not initialise CUDA), or None
        refused = float8.config_errors(OmegaConf.merge(cfg, {"train": {"float8": "tensorwise"}}), visible_gpus())
        args.float8_refused = " ".join(refused) or None
        args.quality_cfg = quality_config(args, defaults, run_dir) if args.quality else None
        launch(cfg, run_dir, plan, worker, args, command)  # one rank in this process, as `python train.py` runs it


def quality_config(args: argparse.Namespace, defaults: list[str], run_dir: Path) -> DictConfig:
    """The quality check's config: the timed paths' on memory-mapped text, `--quality` steps, each one logged."""
    cfg = compose(["sharding=full_shard", *fixed_overrides(args), *defaults, "data=text", *args.overrides])
    with open_dict(cfg):
        cfg.train.steps, cfg.train.log_every = args.quality, 1
    check(cfg, args.nproc, run_dir)
    return cfg


def kernel_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The paths whose kernels `--kernels` asks for (all of them when it names none); a path it has not is
    argparse's error (exit 2), as every bad flag is."""
    every = [name + suffix for suffix in ["", "+compile"][: 1 if args.no_compile else 2] for name in PATHS]
    wanted = every if args.kernels == "all" else args.kernels.split(",")
    unknown = [name for name in wanted if name not in every]
    if unknown:
        parser.error(f"--kernels {args.kernels}: no path {', '.join(unknown)} (paths: {','.join(every)})")
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(1), default=1)
    parser.add_argument("--rounds", type=at_least(1), default=10, help="measured rounds, after one warm-up round")
    parser.add_argument("--steps-per-round", type=at_least(1), default=10)
    parser.add_argument("--count-steps", type=at_least(1), default=4, help="steps whose host work is counted")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled paths (slow to compile on CPU)")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        choices=torch._dynamo.list_backends(exclude_tags=()),
        metavar="BACKEND",
        help="torch.compile backend of the compiled paths (smoke: eager); one torch._dynamo.list_backends() names",
    )
    parser.add_argument(
        "--models", default=None, help="comma-separated, of the device's set (GPU: gpt,llama3_1b; CPU: gpt,llama)"
    )
    parser.add_argument("--data", choices=("tokens", "synthetic"), default="tokens", help="what the paths read")
    parser.add_argument(
        "--kernels",
        nargs="?",
        const="all",
        default=None,
        help="also count device activities per step with torch.profiler, each path in a process of its own "
        "(comma-separated paths, default all)",
    )
    parser.add_argument("--quick", action="store_true", help=f"the first bench on a GPU: {' '.join(QUICK)}")
    parser.add_argument(
        "--float8",
        nargs="?",
        const="both",
        choices=("both", "speed", "quality"),
        help=f"the float8 comparison alone: speed ({', '.join(FLOAT8_ONLY)}, compiled, {' '.join(QUICK)}), "
        f"then quality (--quality {FLOAT8_QUALITY_STEPS}); `--float8 speed` or `--float8 quality` runs one part "
        "(each a device call of its own, under a few minutes)",
    )
    parser.add_argument(
        "--quality",
        type=at_least(0),
        default=None,
        help="then train bf16 and each float8 recipe this many steps on the same text and compare their final "
        f"training loss (default 0: none; {FLOAT8_QUALITY_STEPS} with --float8)",
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE + SMOKE_OVERRIDES)}")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # the model this process measures (set by the bench)
    parser.add_argument("--kernels-of", help=argparse.SUPPRESS)  # the path this process counts (set by the bench)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, applied last, e.g. train.batch_size=8")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
        os.environ[float8.EMULATE_ENV] = "1"  # the float8 rows on CPU, as the tests run them (and the children)
    elif args.quick or args.float8:
        args = parser.parse_args([*QUICK, *sys.argv[1:]])
    if args.quality is None:
        args.quality = FLOAT8_QUALITY_STEPS if args.float8 in ("both", "quality") else 0
    command = shlex.join(["python", *sys.argv])
    if args.only:
        run_model(args, command)
        return
    # a crashed CUDA process (or rank) dumps no core: it could be as large as its address space and fill the disk
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    paths = kernel_paths(args, parser) if args.kernels else []
    float8_cfg = compose(["train.float8=tensorwise", *args.overrides]) if args.float8 else None
    if float8_cfg is not None and (refused := float8.config_errors(float8_cfg, visible_gpus())):
        parser.error(f"--float8 {args.float8}: {' '.join(refused)}")  # before any measuring: nothing to compare
    failed = []

    def child(*extra: str) -> None:
        """This bench in a process of its own, for one model's table or one path's kernels."""
        code = subprocess.run([sys.executable, __file__, *sys.argv[1:], *extra]).returncode
        if code != 0:
            failed.append(f"{' '.join(extra[1::2])} (exit {code})")

    for name in model_defaults(args):
        print(f"## {name}", flush=True)
        child("--only", name)
        if paths:
            print(f"\nkernels ({name}), each path in a process of its own:", flush=True)
        for path in paths:
            child("--only", name, "--kernels-of", path)
    if failed:
        raise SystemExit(f"bench/gpu.py: failed: {'; '.join(failed)} (the other figures above stand)")
    print("bench/gpu.py: done")


if __name__ == "__main__":
    main()
