"""The combination matrix (issue 50): a pairwise cover of averager x `averager.balance` x
the period's schedule (fixed, `averager.period_schedule=adacomm`, `averager.period=auto`) x layout x
checkpoint mode x optimizer x `fault_tolerance` x extras, every
value of each dimension in a row with every value of each other. A row passes when:

- refused: composing or validating it fails before any rank starts, naming one of its keys (a pair that
  every row refuses is a pair the harness refuses; every other pair is in a row that trains);
- trained (with `balance=time` the last replica slowed: HARNESS_TEST_SLOWDOWN pads its steps to 0.5 s,
  the others' to 0.1 s; with an async checkpoint 2.5 s and 0.5 s): run A trains 16 steps; run B, resumed
  from A's checkpoint nearest step 8, ends bit for bit where A ends (model, optimizer, RNG states, the
  averager's tensors, every replica's copy); run C, A's last checkpoint resumed with `train.steps=24`,
  trains to 24 and saves there; with an averager A and C end with an exchange (one model); with
  `balance=time` the slowed replica was planned fewer local steps than the others. With `period=auto` every
  exchange is 0.5 s slower (HARNESS_TEST_EXCHANGE_DELAY), so that auto, once it has measured, takes its
  longest period (the row's averager.period as averager.max_period) on every run alike.

The rows of one world run in one launch per world size (the harness's launcher, every run a job built
and trained with `build_job` and `Trainer` after `validate` and `preflight`, as a launch makes, in a run
dir of its own); replica groups run as `python train.py fault_tolerance=torchft` launches. The table
lists each row, what it passed and its seconds; the bench exits 1 if a row failed.

    python bench/matrix.py [--rows one-world,torchft] [--only SUBSTRING]
    python bench/matrix.py --smoke   # the cover's checks, the refused rows, and one row each of 2 ranks
                                     # with balance=time and of replica groups
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import combinations, product
from pathlib import Path

import torch
import torch.distributed as dist
from harness_runs import REPO, SMOKE_HELP, check, compose, launch, rank_env
from omegaconf import DictConfig
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.checkpoint_paths import complete_checkpoints, step_of
from harness.config import ConfigError
from harness.job import build_job
from harness.loop import Trainer
from harness.plan import RunPlan, plan_run
from harness.preflight import preflight
from harness.rng import seed_rank
from harness.slowdown import ENV as SLOWDOWN
from harness.slowdown import EXCHANGE_DELAY_ENV as EXCHANGE_DELAY
from harness.validate import validate

DIMS = {
    "averager": ["none", "periodic", "diloco", "streaming", "hierarchical"],
    "balance": ["steps", "time"],
    "schedule": ["fixed", "adacomm", "auto"],
    "layout": ["2x1", "ddp", "hsdp", "hsdp_zero2", "4x1"],
    "checkpoint": ["full", "sharded", "async"],
    "optimizer": ["sgd", "nesterov", "adamw", "in_backward"],
    "ft": ["none", "torchft"],
    "extras": ["plain", "grad_accum", "dropout_step"],
}
LAYOUTS = {  # (overrides, replicas, ranks)
    "2x1": (["sharding=no_shard"], 2, 2),
    "ddp": (["sharding=ddp"], 2, 2),
    "hsdp": (["sharding=hybrid_shard", "sharding.replicate=2"], 2, 4),
    "hsdp_zero2": (["sharding=hybrid_shard_zero2", "sharding.replicate=2"], 2, 4),
    "4x1": (["sharding=no_shard"], 4, 4),
}
AVERAGERS = {
    "none": ["averager=none"],
    "periodic": ["averager=periodic", "averager.period=4"],
    "diloco": ["averager=diloco", "averager.period=4", "averager/outer_optimizer=nesterov"],
    "streaming": ["averager=diloco", "averager.period=8", "averager.fragments=2", "averager.sync_delay=1"],
    "hierarchical": ["averager=hierarchical"],  # pairs every 2 steps and all every 4; all every 4 with 2 replicas
}
OPTIMIZERS = {
    "sgd": ["optimizer=sgd"],
    "nesterov": ["optimizer=sgd", "optimizer.momentum=0.9", "optimizer.nesterov=true"],
    "adamw": ["optimizer=adamw"],
    "in_backward": ["optimizer=adamw", "optimizer.in_backward=true", "train.grad_clip=0"],
}
EXTRAS = {
    "plain": [],
    "grad_accum": ["train.grad_accum=2"],
    "dropout_step": ["model.dropout=0.1", "lr_scheduler=step", "lr_scheduler.milestones=[6,13]"],
}
CHECKPOINTS = {
    "full": ["checkpoint=full"],
    "sharded": ["checkpoint=sharded"],
    "async": ["checkpoint=sharded", "checkpoint.async=true"],
}
COMMON = ["model=mlp", "train.batch_size=4", "train.seq_len=16", "train.log_every=4", "checkpoint.interval=6"]
COMMON += ["checkpoint.keep=10", "wandb.mode=disabled"]
STEPS, MORE = 16, 8
# the last replica slowed: its steps padded to 0.5 s, the others' to 0.1 s (more than their compute on a loaded
# host, so they stay within the dead band of each other), so it is planned 1 step of 4 at every measured
# exchange (round(4 x 0.1 / 0.5) = 1; still 1 while the others' steps take up to 0.18 s), the others 4, on
# every run alike: a resume's plans are the uninterrupted run's
FAST_S, SLOW_S = 0.1, 0.5
# with an async checkpoint: its background write (the GIL, the cores) slowed the fast replica's next steps from
# 0.10 to 0.35 s on the 2 cores, which a run resumed from that checkpoint does not see (a plan from measured wall
# time is exact at resume only where the pads cover such noise)
ASYNC_FAST_S, ASYNC_SLOW_S = 0.5, 2.5


def refusals(row: dict) -> list[str]:
    """Why the harness refuses `row` before start, as this table sees it (checked against the harness's own
    answer for every refused row: `refused_by_the_harness`)."""
    why = []
    if row["averager"] == "none" and (row["balance"] != "steps" or row["schedule"] != "fixed"):
        why.append("averager=none has no averager.balance, averager.period_schedule or averager.period")
    if row["averager"] == "hierarchical" and row["schedule"] == "auto":
        why.append("averager=hierarchical has no averager.period")
    if row["balance"] == "time" and row["layout"] == "ddp":
        why.append("balance=time with sharding=ddp")
    if row["averager"] == "hierarchical" and (row["schedule"] == "adacomm" or row["ft"] == "torchft"):
        why.append("averager=hierarchical with adacomm or fault_tolerance=torchft")
    if row["ft"] == "torchft" and row["layout"] == "ddp":
        why.append("sharding=ddp with fault_tolerance=torchft")
    if row["optimizer"] == "in_backward" and (row["extras"] == "grad_accum" or row["layout"] == "ddp"):
        why.append("optimizer.in_backward with train.grad_accum or sharding=ddp")
    if row["optimizer"] == "in_backward" and row["ft"] == "torchft" and row["averager"] == "none":
        why.append("optimizer.in_backward with synchronous steps under fault_tolerance=torchft")
    return why


def pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in combinations(DIMS, 2) if a in row and b in row}


def cover() -> list[dict]:
    """A greedy pairwise cover: the rows of replica groups first (the dearest), each row trainable where its
    pair allows, a pair that every row refuses covered by a refused one."""
    every = [dict(zip(DIMS, values)) for values in product(*DIMS.values())]
    trainable = set().union(*(pairs(row) for row in every if not refusals(row)))

    def full(row: dict) -> dict:  # a row being built: its missing dimensions at their first value
        return {d: row.get(d, values[0]) for d, values in DIMS.items()}

    def covers(row: dict) -> set:  # a refused row covers only the pairs that no row trains
        return pairs(row) - trainable if refusals(full(row)) else pairs(row)

    def cost(row: dict) -> int:
        return 10 * (row.get("ft") == "torchft") + 2 * (LAYOUTS[row.get("layout", "2x1")][2] == 4)

    uncovered = {((a, va), (b, vb)) for a, b in combinations(DIMS, 2) for va in DIMS[a] for vb in DIMS[b]}
    rows = []
    while uncovered:
        row = dict(min(uncovered, key=lambda p: (("ft", "torchft") not in p, p)))
        for d in DIMS:
            if d not in row:
                row[d] = min(
                    DIMS[d],
                    key=lambda v, d=d: (
                        bool(refusals(full({**row, d: v}))) and not refusals(full(row)),
                        -len(covers({**row, d: v}) & uncovered),
                        cost({**row, d: v}),
                    ),
                )
        rows.append(row)
        uncovered -= covers(row)
    return rows


def name(row: dict) -> str:
    return "-".join(row[d] for d in DIMS)


def overrides(row: dict) -> list[str]:
    layout, replicas, ranks = LAYOUTS[row["layout"]]
    keys = [*COMMON, f"launcher.nproc={ranks}", *layout, *AVERAGERS[row["averager"]], *CHECKPOINTS[row["checkpoint"]]]
    keys += [*OPTIMIZERS[row["optimizer"]], *EXTRAS[row["extras"]]]
    if row["averager"] == "hierarchical":
        keys.append(f"averager.period_group_size={[[2, 2], [4, 4]] if replicas == 4 else [[4, 2]]}".replace(" ", ""))
    if row["averager"] != "none":  # no synchronous step for the optimizer in backward under fault tolerance
        warmup = 0 if row["optimizer"] == "in_backward" and row["ft"] == "torchft" else 2
        keys.append(f"averager.warmup_steps={warmup}")
    if row["balance"] != "steps":
        keys.append(f"averager.balance={row['balance']}")
    if row["schedule"] == "adacomm":
        keys.append("averager.period_schedule=adacomm")
    if row["schedule"] == "auto":  # its longest: the averager's period (none and hierarchical have none: refused)
        period = next((k.split("=")[1] for k in keys if k.startswith("averager.period=")), None)
        keys += ["averager.period=auto", *([f"averager.max_period={period}"] if period else [])]
    if row["ft"] == "torchft":
        keys.append("fault_tolerance=torchft")
    return keys


def slowdown(row: dict) -> str:
    """HARNESS_TEST_SLOWDOWN for the row: with balance=time its last replica slowed, the others padded."""
    if row["balance"] != "time":
        return ""
    replicas = LAYOUTS[row["layout"]][1]
    fast, slow = (ASYNC_FAST_S, ASYNC_SLOW_S) if row["checkpoint"] == "async" else (FAST_S, SLOW_S)
    return ",".join(f"{r}:{slow if r == replicas - 1 else fast}s" for r in range(replicas))


def exchange_delay(row: dict) -> str:
    """HARNESS_TEST_EXCHANGE_DELAY for the row: with period=auto each exchange 0.5 s slower, so that the period it
    measures its way to is its longest (its steps take at most 0.5 s, padded or loaded: 0.5 x 0.9 / (0.1 x 0.5) = 9
    local steps or more, past the rows' 4 per exchange)."""
    return "0.5" if row["schedule"] == "auto" else ""


def refused_by_the_harness(row: dict) -> str | None:
    """The harness's own answer before start: the error composing or validating the row, or None."""
    try:
        validate(compose(overrides(row)), world_size=LAYOUTS[row["layout"]][2], gpus=0)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # a composition error is Hydra's own
        return str(e)
    return None


def check_cover(rows: list[dict]) -> list[str]:
    """What is wrong with the cover: a pair in no row, or only in refused rows while some row could train it."""
    every = [dict(zip(DIMS, values)) for values in product(*DIMS.values())]
    trainable = set().union(*(pairs(row) for row in every if not refusals(row)))
    trained = set().union(*(pairs(row) for row in rows if not refusals(row)))
    missing = set().union(*(pairs(row) for row in every)) - set().union(*(pairs(row) for row in rows))
    return [f"pair {p} in no row" for p in sorted(missing)] + [
        f"pair {p} trains in no row" for p in sorted(trainable - trained)
    ]


# -- the runs -------------------------------------------------------------------------------------


def phases(row: dict) -> list[tuple[str, list[str], str | None]]:
    """The row's three runs: (its dir, its overrides, which of A's checkpoints it resumes from)."""
    keys = overrides(row)
    return [
        ("a", [*keys, f"train.steps={STEPS}"], None),
        ("b", [*keys, f"train.steps={STEPS}"], "middle"),
        ("c", [*keys, f"train.steps={STEPS + MORE}"], "last"),
    ]


def resume_point(checkpoints: Path, pick: str | None) -> Path | None:
    """A's checkpoint (in `checkpoints`) nearest its middle step, or its last."""
    if pick is None:
        return None
    saved = complete_checkpoints(checkpoints)
    return saved[-1] if pick == "last" else min(saved[:-1], key=lambda p: abs(step_of(p) - STEPS // 2))


def worker(cfg: DictConfig, run_dir: Path, plan: RunPlan, rows: list[dict]) -> None:
    """One rank: each row's three runs in turn, each a job of its own on these ranks."""
    with rank_env(cfg, run_dir) as env:
        for row in rows:
            for knob, value in ((SLOWDOWN, slowdown(row)), (EXCHANGE_DELAY, exchange_delay(row))):
                os.environ.pop(knob, None)
                if value:
                    os.environ[knob] = value
            runs = run_dir / name(row)
            for phase, keys, pick in phases(row):
                resume = resume_point(runs / "a" / "checkpoints", pick)
                extra = [f"checkpoint.resume={resume}" if resume is not None else "checkpoint.resume=never"]
                row_cfg = compose([*keys, *extra])
                validate(row_cfg, world_size=env.world_size, gpus=0)
                row_plan = plan_run(row_cfg, env.world_size, env.local_world_size, runs / phase)
                if env.is_main:
                    (runs / phase).mkdir(parents=True, exist_ok=True)
                    errors = preflight(row_cfg, runs / phase, row_plan.resume_from)
                    assert not errors, errors
                dist.barrier()
                seed_rank(row_cfg.train.seed, row_plan.rank_in_mesh(env.rank))
                job = build_job(row_cfg, env, row_plan)
                with Trainer(job, row_cfg, env, runs / phase, row_plan.resume_from) as trainer:
                    trainer.run()


def replica_groups(row: dict, runs: Path) -> None:
    """The row's three runs as `python train.py fault_tolerance=torchft` launches: B's run dir holds each group's
    checkpoint from inside A, C's each group's last (checkpoint.resume=auto takes them)."""
    env = {**os.environ, SLOWDOWN: slowdown(row)}
    if exchange_delay(row):
        env[EXCHANGE_DELAY] = exchange_delay(row)
    groups = LAYOUTS[row["layout"]][1]
    for phase, keys, pick in phases(row):
        if pick is not None:
            step = step_of(resume_point(runs / "a" / "replica_group_0" / "checkpoints", pick))
            for g in range(groups):
                source = runs / "a" / f"replica_group_{g}" / "checkpoints" / f"step_{step}"
                shutil.copytree(source, runs / phase / f"replica_group_{g}" / "checkpoints" / f"step_{step}")
        cmd = [sys.executable, str(REPO / "train.py"), *keys, f"hydra.run.dir={runs / phase}"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{phase}: exit {proc.returncode}: {proc.stderr[-2000:]}")


# -- what a row passed ----------------------------------------------------------------------------


def state(step_dir: Path, scratch: Path) -> dict:
    """Everything a checkpoint holds, by path: full.pt as saved, a DCP directory through torch's converter, rng.pt."""
    if (step_dir / "full.pt").exists():
        saved = torch.load(step_dir / "full.pt", weights_only=True)
    else:
        out = scratch / "dcp.pt"
        dcp_to_torch_save(step_dir, out)
        saved = torch.load(out, weights_only=False)
    return flat({**saved, "rng": torch.load(step_dir / "rng.pt", weights_only=True)})


def flat(tree, prefix: str = "") -> dict:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        return {prefix: tree}
    out = {}
    for key, value in items:
        out.update(flat(value, f"{prefix}{key}."))
    return out


def equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def check_row(row: dict, runs: Path, scratch: Path) -> str:
    """'' when the row passed; else what failed."""
    replicas = LAYOUTS[row["layout"]][1]
    groups = [f"replica_group_{g}" for g in range(replicas)] if row["ft"] == "torchft" else [""]
    for group in groups:
        a, b, c = (runs / phase / group for phase in "abc")
        end = f"checkpoints/step_{STEPS}"
        sa, sb = state(a / end, scratch), state(b / end, scratch)
        differ = sorted(k for k in sa.keys() | sb.keys() if k not in sa or k not in sb or not equal(sa[k], sb[k]))
        if differ:
            return f"{group or 'B'} not bit for bit A's: {len(differ)} entries, e.g. {differ[:2]}"
        rows = [json.loads(line) for line in (c / "metrics.jsonl").read_text().splitlines()]
        if rows[-1]["step"] != STEPS + MORE or not (c / "checkpoints" / f"step_{STEPS + MORE}" / "meta.json").is_file():
            return f"{group or 'C'} did not train on to step {STEPS + MORE} and save there"
        for run, steps in ((a, STEPS), (c, STEPS + MORE)):
            logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            last = [r for r in logged if r["step"] == steps]  # an async save's last row joins it at exit
            if row["averager"] != "none" and not any(r.get("averager/averaged") for r in last):
                return f"{group or run.name.upper()} did not end with an exchange at step {steps}"
    if row["balance"] == "time":
        slow = replicas - 1
        files = [runs / phase / groups[0] / "metrics.jsonl" for phase in "ac"]
        logged = [json.loads(line) for f in files for line in f.read_text().splitlines()]
        if not any(r.get(f"replica/local_steps/{slow}", 1e9) < r.get("replica/local_steps/0", 0) for r in logged):
            return "the slowed replica was never planned fewer local steps"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=lambda s: s.split(","), default=["one-world", "torchft"])
    parser.add_argument("--only", default="", help="rows whose name holds this")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    unknown = set(args.rows) - {"one-world", "torchft"}
    if unknown:
        parser.error(f"--rows {','.join(sorted(unknown))}: choose from one-world,torchft")
    rows = cover()
    problems = check_cover(rows)
    refused = [row for row in rows if refusals(row)]
    trained = [row for row in rows if not refusals(row) and args.only in name(row)]
    if not trained:  # it would train nothing and say "done"
        parser.error(f"--only {args.only}: no trained row's name holds it (names: averager-balance-...-extras)")
    if args.smoke:  # one row of 2 ranks with balance=time, one of replica groups (of those --only leaves)
        picks = [
            next(
                (r for r in trained if r["ft"] == "none" and r["balance"] == "time" and LAYOUTS[r["layout"]][2] == 2),
                None,
            ),
            next((r for r in trained if r["ft"] == "torchft" and LAYOUTS[r["layout"]][2] == 2), None),
        ]
        trained = [r for r in picks if r is not None]
        if not trained:
            parser.error(f"--smoke --only {args.only}: neither smoke row's name holds it")
    began = time.monotonic()
    print(f"matrix: {len(rows)} rows covering every pair of {len(DIMS)} dimensions; {len(refused)} refused")
    results: dict[str, tuple[str, float]] = {}
    for row in refused:
        error = refused_by_the_harness(row)
        keys = [k.split("=")[0] for k in overrides(row) if "." in k.split("=")[0]]
        named = error is not None and any(key in error for key in keys)
        results[name(row)] = ("refused" if named else f"NOT REFUSED (or no key named): {error}", 0.0)
    with tempfile.TemporaryDirectory(prefix="bench-matrix-") as tmp:
        workdir = Path(tmp)
        if "one-world" in args.rows:
            for ranks in (2, 4):
                world = [row for row in trained if row["ft"] == "none" and LAYOUTS[row["layout"]][2] == ranks]
                if world:
                    start = time.monotonic()
                    cfg = compose([*COMMON, f"launcher.nproc={ranks}", "sharding=no_shard"])
                    run_dir = workdir / f"world{ranks}"
                    run_dir.mkdir()
                    launch(cfg, run_dir, check(cfg, ranks, run_dir), worker, world)
                    each = (time.monotonic() - start) / len(world)
                    for row in world:
                        results[name(row)] = (check_row(row, run_dir / name(row), workdir) or "passed", each)
        if "torchft" in args.rows:
            for row in (r for r in trained if r["ft"] == "torchft"):
                start = time.monotonic()
                replica_groups(row, workdir / name(row))
                result = check_row(row, workdir / name(row), workdir) or "passed"
                results[name(row)] = (result, time.monotonic() - start)
    print("| row (averager-balance-schedule-layout-checkpoint-optimizer-ft-extras) | result | s |")
    print("|---|---|---|")
    for row_name, (result, seconds) in results.items():
        print(f"| {row_name} | {result} | {seconds:.0f} |")
    failed = problems + [f"{n}: {r}" for n, (r, _) in results.items() if r not in ("passed", "refused")]
    print(f"\n{len(results)} rows run in {time.monotonic() - began:.0f} s: {len(failed)} failed")
    for problem in failed:
        print(f"  FAILED {problem}")
    if failed:
        raise SystemExit(1)
    print("bench/matrix.py: done")


if __name__ == "__main__":
    main()
