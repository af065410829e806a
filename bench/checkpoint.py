"""What a checkpoint costs through the harness's own `Checkpointer`, against plain `torch.save`.

What is measured, per configuration (model size x rank count), for each save
mode - `checkpoint=full`, `checkpoint=sharded`, `checkpoint=sharded
checkpoint.async=true` - from the metrics `Checkpointer` itself returns:

    state_dict s   checkpoint/state_dict_s: collecting the state (full mode: the
                   one-tensor-at-a-time gather onto rank 0, i.e. consolidation)
    save s         checkpoint/save_s: time inside `save()` (synchronous: the whole
                   save; async: until the background staging + write are launched)
    stg wait s     async only: checkpoint/staging_wait_s, the time
                   `wait_for_staging()` waited for the background staging copy
                   right before the next `optimizer.step()`
    blocked s      how long the training loop was blocked: save s (+ stg wait s)
    durable s      start of the save until the checkpoint is committed (fsync'd,
                   renamed): save_s for synchronous saves; for the async save the
                   checkpoint/write_s that `Checkpointer.wait()` returns, except
                   that when the write finished before the loop reached `wait()`
                   it is the write's completion + the commit (no idle time)
    GB, MB/s       checkpoint/bytes (all files of the step_<N> directory), and
                   bytes / durable s
    fwd+bwd s      the next training step's forward + backward + grad clip (as
                   the loop does it), run right after `save()` returned: with the
                   async save in flight it competes with the background copy and
                   write for the CPU (the hidden cost of the async save)

and, as the practical limit of this disk, one process doing `torch.save` of
the same full state (model + Adam state, whole tensors, gathered once with the
harness's `gather_full`, so exactly the payload of full.pt) into one file,
then flush + os.fsync.

How: the real Hydra config is composed (model=mlp sized by `--sizes`,
optimizer=adam, averager=none, sharding=full_shard, batch 2x16, one thread per
rank, train.grad_clip as configured) and each configuration is one launch of N
ranks with the harness's own launcher (`harness.launch.start_local_ranks`, fork;
bench/harness_runs.py). The ranks build the job with `build_job`, take one
optimizer step so Adam state exists, and then run `--rounds` rounds; a round
saves once in every mode (step = round + 1, each mode into its own
`checkpoint.dir`) and runs the torch.save limit on rank 0, in an order rotated
every round to cancel drift. Every save starts after a barrier and is followed,
as in `harness.loop.Trainer.run`, by one training step: forward + backward
(+ clip), `wait_for_staging()`, `optimizer.step()` + `zero_grad`, then
`wait()` (a no-op for synchronous saves); every mode trains the same step, so
the parameters keep training between saves. A time is the slowest rank's.
Each checkpoint is deleted (untimed) right after it is measured, so the disk
holds at most one checkpoint plus the limit file at a time (200M parameters +
Adam = 2.4 GB). All files go to one temporary directory (`--dir`, default the
system temp dir), deleted at the end. Reported: medians over rounds, the async
save's blocked time (save_s + staging_wait_s) against the synchronous sharded
save's save_s (target <= 10 %), the forward+backward slowdown of the step with
the async save in flight against the steps after the synchronous saves, sharded
throughput against the torch.save limit (target >= 0.8), and the full mode's
consolidation cost by size and rank count.

    python bench/checkpoint.py [--sizes 10m,50m,200m] [--ranks 2,4] [--rounds 5] [--dir DIR]
    python bench/checkpoint.py --smoke   # --sizes tiny (99k parameters) --ranks 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from flags import at_least, directory, integers
from harness_runs import SMOKE_HELP, check, compose, launch, rank_env
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict

from harness.checkpoint import Checkpointer, checkpoint_dir, gather_full, inner_optimizer
from harness.config import plain
from harness.job import build_job
from harness.models import build_model
from harness.plan import RunPlan

# model=mlp shapes: params = 2*vocab*d_model + n_layer*(2*d_model*hidden + hidden + 3*d_model) + 2*d_model
SIZES = {
    "10m": {"vocab_size": 256, "d_model": 512, "hidden": 2048, "n_layer": 5},  # 10,766,848
    "50m": {"vocab_size": 256, "d_model": 1024, "hidden": 4096, "n_layer": 6},  # 50,900,992
    "200m": {"vocab_size": 256, "d_model": 1024, "hidden": 4096, "n_layer": 24},  # 202,024,960
    "tiny": {"vocab_size": 256, "d_model": 64, "hidden": 256, "n_layer": 2},  # 99,328: --smoke
}
SMOKE = ["--sizes", "tiny", "--ranks", "2", "--rounds", "1"]
MODES = {  # name -> checkpoint overrides
    "full": ["checkpoint=full"],
    "sharded": ["checkpoint=sharded"],
    "sharded+async": ["checkpoint=sharded", "checkpoint.async=true"],
}
LIMIT = "torch.save"  # the single-process limit, measured as a fourth "mode" in the rotation
ASYNC_TARGET = 0.10  # async blocked / sync sharded blocked
THROUGHPUT_TARGET = 0.8  # sharded MB/s / torch.save MB/s


def compose_configs(size: str, ranks: int, ckpt_root: Path, run_dir: Path) -> tuple[dict[str, DictConfig], RunPlan]:
    """One config per mode, identical but for `checkpoint.*`, each validated; the run's plan."""
    shape = SIZES[size]
    base = [
        "model=mlp",
        *(f"model.{k}={v}" for k, v in shape.items()),
        "optimizer=adam",
        "averager=none",
        "sharding=full_shard",
        "wandb.mode=disabled",
        "train.batch_size=2",
        "train.seq_len=16",
        "dist.threads_per_rank=1",
        f"launcher.nproc={ranks}",
    ]
    cfgs = {
        mode: compose([*base, *overrides, f"checkpoint.dir={ckpt_root / mode}"]) for mode, overrides in MODES.items()
    }
    plans = {mode: check(cfg, ranks, run_dir) for mode, cfg in cfgs.items()}
    return cfgs, plans["full"]


def parameter_count(cfg: DictConfig) -> int:
    model = build_model(cfg.model, cfg.train.seq_len)  # meta device: no memory
    return sum(p.numel() for p in model.parameters())


# --- one rank ---------------------------------------------------------------------


def torch_save_limit(state: dict, path: Path) -> tuple[float, int]:
    """Seconds and bytes of one durable single-process torch.save of `state`."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start, path.stat().st_size


def train_step_compute(job, grad_clip: float) -> float:
    """Seconds of one step's compute before `optimizer.step()`, as in the loop: forward, backward, clip."""
    start = time.perf_counter()
    inputs, targets = job.data.next_batch()
    job.model(inputs, targets).backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(job.model.parameters(), grad_clip)
    return time.perf_counter() - start


def worker(cfg: DictConfig, run_dir: Path, plan: RunPlan, cfgs: dict[str, dict], rounds: int, work_dir: str) -> None:
    """One rank: build the job, one Adam step, then `rounds` rounds of every mode + the limit; rank 0
    writes what it measured to <work_dir>/result.json for the parent."""
    work = Path(work_dir)
    with rank_env(cfg, run_dir) as env:  # as under train.py: rank 0 logs each save to stdout
        job = build_job(cfg, env, plan)
        inputs, targets = job.data.next_batch()  # one step, so the Adam state exists
        job.model(inputs, targets).backward()
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        # the object measured: the harness's Checkpointer, one per mode, built as `Trainer` builds it
        checkpointers = {
            mode: Checkpointer(
                OmegaConf.create(c).checkpoint,
                checkpoint_dir(OmegaConf.create(c).checkpoint, run_dir),
                env.rank,
                env.device,
                c,
            )
            for mode, c in cfgs.items()
        }

        # The limit's payload: what full mode writes to full.pt, gathered once onto rank 0 (untimed).
        model_sd, optim_sd = get_state_dict(job.model, inner_optimizer(job.optimizer))
        full_state = gather_full({"model": model_sd, "optim": optim_sd}, keep=env.is_main)
        del model_sd, optim_sd
        limit_file = work / "limit.pt"

        names = [*cfgs, LIMIT]
        results = {name: [] for name in names}
        orders = []
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            orders.append(order)
            for name in order:
                dist.barrier()
                if name == LIMIT:
                    if env.is_main:
                        seconds, nbytes = torch_save_limit(full_state, limit_file)
                        results[name].append(
                            {
                                "state_dict_s": 0.0,
                                "save_s": seconds,
                                "staging_wait_s": 0.0,
                                "blocked_s": seconds,
                                "durable_s": seconds,
                                "step_s": 0.0,
                                "bytes": nbytes,
                            }
                        )
                        limit_file.unlink()
                    continue
                ckpt = checkpointers[name]
                row = ckpt.save(job, r + 1)
                done_at = []  # when the async write's future completed (the commit is still to come)
                if ckpt.async_save:
                    ckpt.pending.written.add_done_callback(lambda _, at=done_at: at.append(time.perf_counter()))
                    started = ckpt.pending.started
                # One training step, in the loop's order (harness.loop.Trainer.run), after every mode's save,
                # so each round trains the same number of steps; only the async save is still in flight here.
                step_s = train_step_compute(job, cfg.train.grad_clip)
                ckpt.wait_for_staging()  # async: waits for the staging copy, adds to pending.staging_wait_s
                job.optimizer.step()
                job.optimizer.zero_grad(set_to_none=True)
                if ckpt.async_save:
                    wait_start = time.perf_counter()
                    row.update(ckpt.wait())  # write_s: from the start of save until durable (committed)
                    staging_wait = row["checkpoint/staging_wait_s"]
                    durable = row["checkpoint/write_s"]
                    if done_at and done_at[0] < wait_start:
                        # Written before the loop got to wait(): durable = written + the commit, not + idle.
                        durable = done_at[0] - started + (time.perf_counter() - wait_start)
                else:
                    staging_wait = 0.0
                    durable = row["checkpoint/save_s"]
                save_s = row["checkpoint/save_s"]
                slowest = torch.tensor(
                    [row["checkpoint/state_dict_s"], save_s, staging_wait, save_s + staging_wait, durable, step_s],
                    dtype=torch.float64,
                )
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if env.is_main:
                    state_dict_s, save_s, staging_wait_s, blocked_s, durable_s, step_s = slowest.tolist()
                    results[name].append(
                        {
                            "state_dict_s": state_dict_s,
                            "save_s": save_s,
                            "staging_wait_s": staging_wait_s,
                            "blocked_s": blocked_s,
                            "durable_s": durable_s,
                            "step_s": step_s,
                            "bytes": row["checkpoint/bytes"],
                        }
                    )
                    shutil.rmtree(ckpt.root)  # untimed: keeps the disk to one checkpoint at a time
            dist.barrier()
        for ckpt in checkpointers.values():
            ckpt.close()

        peak_rss = [None] * env.world_size
        dist.all_gather_object(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if env.is_main:
            out = {
                "params": sum(p.numel() for p in job.model.parameters()),
                "results": results,
                "orders": orders,
                "peak_rss": peak_rss,
                "threads": torch.get_num_threads(),
                "backend": dist.get_backend(),
                "device": str(env.device),
            }
            (work / "result.json").write_text(json.dumps(out))


# --- the parent ---------------------------------------------------------------------


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per measured name; MB/s is per round, then the median."""
    out = {}
    for name, rows in runs.items():
        out[name] = {
            key: statistics.median(r[key] for r in rows)
            for key in ("state_dict_s", "save_s", "staging_wait_s", "blocked_s", "durable_s", "step_s", "bytes")
        }
        out[name]["mb_s"] = statistics.median(r["bytes"] / 1e6 / r["durable_s"] for r in rows)
        out[name]["durable_range"] = (min(r["durable_s"] for r in rows), max(r["durable_s"] for r in rows))
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


SYNC_MODES = ("full", "sharded")  # their step runs with no save in flight: the baseline step


def step_times(c: dict) -> tuple[float, float]:
    """Median forward+backward(+clip) seconds: with no save in flight (the steps after the synchronous
    saves) and with the async save in flight."""
    base = statistics.median(r["step_s"] for mode in SYNC_MODES for r in c["runs"][mode])
    return base, c["summary"]["sharded+async"]["step_s"]


def print_report(configs: list[dict], rounds: int) -> None:
    header = (
        f"{'size':>5} {'params':>12} {'ranks':>5} {'mode':<14} {'state_dict s':>12} {'save s':>8} "
        f"{'stg wait s':>10} {'blocked s':>10} {'durable s':>10} {'durable min-max':>16} {'GB':>6} "
        f"{'MB/s':>7} {'vs limit':>8} {'fwd+bwd s':>9}"
    )
    print(f"\nmedians over {rounds} round(s), each column on its own; times are the slowest rank's; GB = 1e9 bytes")
    print(
        "save s = checkpoint/save_s (time inside save()); stg wait s = checkpoint/staging_wait_s (async: the wait\n"
        "for the staging copy before optimizer.step()); blocked s = the loop's blocked time, save s + stg wait s\n"
        "per round; fwd+bwd s = the next training step's forward + backward + grad clip, right after save()\n"
        "returned (async: with the save in flight)\n"
    )
    print(header)
    print("-" * len(header))
    for c in configs:
        s = c["summary"]
        limit = s[LIMIT]["mb_s"]
        for name in [*MODES, LIMIT]:
            m = s[name]
            lo, hi = m["durable_range"]
            sd = "-" if name == LIMIT else f"{m['state_dict_s']:.3f}"
            wait = f"{m['staging_wait_s']:.3f}" if name == "sharded+async" else "-"
            step = "-" if name == LIMIT else f"{m['step_s']:.3f}"
            ranks = "1" if name == LIMIT else str(c["ranks"])
            print(
                f"{c['size']:>5} {c['params']:>12,} {ranks:>5} {name:<14} {sd:>12} {m['save_s']:>8.3f} {wait:>10} "
                f"{m['blocked_s']:>10.3f} {m['durable_s']:>10.3f} {f'{lo:.2f}-{hi:.2f}':>16} "
                f"{m['bytes'] / 1e9:>6.2f} {m['mb_s']:>7.0f} {m['mb_s'] / limit:>8.2f} {step:>9}"
            )
        print()

    print(
        f"async save, loop blocked time (save_s + staging_wait_s) / synchronous sharded save_s "
        f"(target <= {ASYNC_TARGET:.0%}):"
    )
    for c in configs:
        s = c["summary"]
        a = s["sharded+async"]
        ratio = a["blocked_s"] / s["sharded"]["blocked_s"]
        print(
            f"  {c['size']:>5} x {c['ranks']} ranks: {a['blocked_s']:.3f} s (save {a['save_s']:.3f} + staging wait "
            f"{a['staging_wait_s']:.3f}) / {s['sharded']['blocked_s']:.3f} s = {ratio:6.1%}  "
            f"{verdict(ratio <= ASYNC_TARGET)}   (of which state_dict {a['state_dict_s']:.3f} s)"
        )

    print(
        "\nhidden cost of the async save: forward+backward(+clip) of the step with the save in flight vs with\n"
        "none in flight (median of the steps after the full and sharded saves); and blocked + that slowdown\n"
        "against the synchronous sharded save_s:"
    )
    for c in configs:
        s = c["summary"]
        base, busy = step_times(c)
        extra = busy - base
        total = s["sharded+async"]["blocked_s"] + extra
        print(
            f"  {c['size']:>5} x {c['ranks']} ranks: {busy:.3f} s vs {base:.3f} s = {busy / base - 1:+6.0%} "
            f"({extra:+.3f} s); blocked + slowdown {total:.3f} s = {total / s['sharded']['blocked_s']:6.1%} "
            f"of the sync sharded save"
        )

    print(f"\nsharded throughput / single-process torch.save + fsync (target >= {THROUGHPUT_TARGET}):")
    for c in configs:
        s = c["summary"]
        ratio = s["sharded"]["mb_s"] / s[LIMIT]["mb_s"]
        async_ratio = s["sharded+async"]["mb_s"] / s[LIMIT]["mb_s"]
        print(
            f"  {c['size']:>5} x {c['ranks']} ranks: {s['sharded']['mb_s']:.0f} / {s[LIMIT]['mb_s']:.0f} MB/s = "
            f"{ratio:.2f}  {verdict(ratio >= THROUGHPUT_TARGET)}   (async, start to durable: {async_ratio:.2f})"
        )

    print("\nfull mode: consolidation (state_dict_s, gather onto rank 0) and its share of the full save:")
    for c in configs:
        f = c["summary"]["full"]
        print(
            f"  {c['size']:>5} x {c['ranks']} ranks: {f['state_dict_s']:.3f} s of {f['durable_s']:.3f} s "
            f"({f['state_dict_s'] / f['durable_s']:.0%}), {f['bytes'] / 1e9 / f['state_dict_s']:.2f} GB/s gathered;"
            f" sharded state_dict {c['summary']['sharded']['state_dict_s']:.3f} s"
        )

    print("\npeak RSS per rank (GB, rank 0 holds the limit's full copy of the state):")
    for c in configs:
        print(f"  {c['size']:>5} x {c['ranks']} ranks: " + ", ".join(f"{b / 1e9:.2f}" for b in c["peak_rss"]))


def fs_type(path: Path) -> str:
    best = ("?", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mount, kind = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) >= len(best[1]):
                best = (f"{kind} ({dev} on {mount})", mount)
    return best[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10m,50m,200m", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--ranks", type=integers(1), default=[2, 4], help="comma list of rank counts")
    parser.add_argument("--rounds", type=at_least(1), default=5)
    parser.add_argument(
        "--dir", type=directory, default=None, help="parent of the temporary directory (default: system temp dir)"
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        parser.error(f"unknown --sizes {unknown}; choose from {', '.join(SIZES)}")

    tmp = tempfile.TemporaryDirectory(prefix="harness-ckpt-bench-", dir=args.dir)
    root = Path(tmp.name)
    cpus = len(os.sched_getaffinity(0))
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    print(f"command:  {' '.join(['python', *sys.argv])}")
    print(f"machine:  {cpus} cores, {mem_gb:.0f} GB RAM, {platform.platform()}, Python {platform.python_version()}")
    print(f"torch:    {torch.__version__}")
    print(f"disk:     {root} on {fs_type(root)}, {shutil.disk_usage(root).free / 1e9:.0f} GB free")
    print(
        "setup:    model=mlp, optimizer=adam (state after one step), averager=none, sharding=full_shard, "
        "batch 2x16, dist.threads_per_rank=1"
    )

    configs = []
    try:
        for size in sizes:
            for ranks in args.ranks:
                work = root / f"{size}-{ranks}"
                run_dir = work / "run"
                run_dir.mkdir(parents=True)
                cfgs, plan = compose_configs(size, ranks, work / "checkpoints", run_dir)
                params = parameter_count(cfgs["full"])
                need = 2 * 12 * params  # one checkpoint + the limit file, fp32 params + 2 Adam moments
                if shutil.disk_usage(root).free < 1.2 * need:
                    raise SystemExit(
                        f"bench/checkpoint.py: {size} needs ~{need / 1e9:.1f} GB free under {root}; "
                        "pass --dir on a larger disk"
                    )
                print(f"\n== {size} ({params:,} parameters) x {ranks} ranks: {args.rounds} round(s) ==", flush=True)
                start = time.perf_counter()
                modes = {mode: plain(cfg) for mode, cfg in cfgs.items()}
                launch(cfgs["full"], run_dir, plan, worker, modes, args.rounds, str(work))
                out = json.loads((work / "result.json").read_text())
                shutil.rmtree(work, ignore_errors=True)
                print(
                    f"   done in {time.perf_counter() - start:.0f} s; round orders: "
                    + " | ".join(",".join(o) for o in out["orders"]),
                    flush=True,
                )
                configs.append(
                    {
                        "size": size,
                        "ranks": ranks,
                        "params": out["params"],
                        "peak_rss": out["peak_rss"],
                        "summary": summarize(out["results"]),
                        "runs": out["results"],
                    }
                )
    finally:
        tmp.cleanup()
    print(f"\nranks:    backend {out['backend']}, device {out['device']}, {out['threads']} thread(s) per rank")
    print_report(configs, args.rounds)
    print("bench/checkpoint.py: done")


if __name__ == "__main__":
    main()
