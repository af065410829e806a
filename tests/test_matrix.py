"""The combination matrix: a pairwise cover of averager x `averager.balance` x `averager.period_schedule`
x layout x checkpoint mode x optimizer x `fault_tolerance` x extras (every value of each paired with
every value of each other in some row). Each row is refused before start (the config alone tells:
`validate`, or the composition of its overrides) or trains, with one replica slowed where
`balance=time`; then a run resumed from a checkpoint inside it ends bit for bit where it ends (model,
optimizer, RNG states, the averager's tensors), and its last checkpoint resumed with more `train.steps`
trains to the new end and saves there. A pair every row refuses is a pair the harness refuses.

The rows of one world size run in one launch (tests/probes/matrix_probe.py: each phase a job built
and trained with the harness's own calls); the replica groups of fault tolerance run as launches
of their own (`python train.py fault_tolerance=torchft`)."""

from __future__ import annotations

import json
import shutil
from itertools import combinations, product
from pathlib import Path

import pytest
from test_config import make

from harness.validate import ConfigError, validate

from support import REPO, TRAIN, assert_bitwise_equal, base_env, check_ok, read_metrics, run_cli, saved_state

DIMS = {
    "averager": ["none", "periodic", "diloco", "streaming", "hierarchical"],
    "balance": ["steps", "time"],
    "schedule": ["fixed", "adacomm"],
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
    "streaming": ["averager=diloco", "averager.period=4", "averager.fragments=2", "averager.sync_delay=1"],
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
COMMON += ["checkpoint.keep=10"]
STEPS, MORE = 16, 8
# the last replica slowed: its steps padded to 0.5 s, the others' to 0.1 s (more than their compute on a loaded
# host, so they stay within the dead band of each other), so it is planned 1 step of 4 at every measured
# exchange (round(4 x 0.1 / 0.5) = 1; still 1 while the others' steps take up to 0.18 s), the others 4, on
# every run alike: a resume's plans are the uninterrupted run's
FAST_S, SLOW_S = 0.1, 0.5


def refusals(row: dict) -> list[str]:
    """Why the harness refuses `row` before start, as this table sees it (`test_each_row_is_refused_or_runs`
    holds it against `validate` and the composition of the overrides)."""
    why = []
    if row["averager"] == "none" and (row["balance"] != "steps" or row["schedule"] != "fixed"):
        why.append("averager=none has no averager.balance or averager.period_schedule")
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


ROWS = cover()


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
    if row["schedule"] != "fixed":
        keys.append(f"averager.period_schedule={row['schedule']}")
    if row["ft"] == "torchft":
        keys.append("fault_tolerance=torchft")
    return keys


def slowdown(row: dict) -> str:
    """HARNESS_TEST_SLOWDOWN for the row: with balance=time its last replica slowed, its others padded."""
    if row["balance"] != "time":
        return ""
    replicas = LAYOUTS[row["layout"]][1]
    return ",".join(f"{r}:{SLOW_S if r == replicas - 1 else FAST_S}s" for r in range(replicas))


def refused_by_the_harness(row: dict) -> str | None:
    """The harness's own answer before start: the error of composing or validating the row, or None."""
    try:
        cfg = make(*overrides(row))
        validate(cfg, world_size=LAYOUTS[row["layout"]][2], gpus=0)
    except (ConfigError, Exception) as e:  # a composition error is Hydra's own
        return str(e)
    return None


def test_the_rows_cover_every_pair_and_each_is_refused_or_runs():
    """Every pair of values is in a row, a trainable one unless the harness refuses the pair itself; and
    a row this table refuses is refused before start, naming a key of it (the others pass the same checks
    in their runs)."""
    trained = [row for row in ROWS if not refusals(row)]
    for a, b in combinations(DIMS, 2):
        for va in DIMS[a]:
            for vb in DIMS[b]:
                rows = [row for row in ROWS if row[a] == va and row[b] == vb]
                assert rows, (a, va, b, vb)
                if not any(row in trained for row in rows):
                    assert all(refusals(row) for row in rows)
    assert len(trained) >= 20
    for row in ROWS:
        if refusals(row):
            error = refused_by_the_harness(row)
            assert error is not None, name(row)
            assert any(key.split("=")[0] in error for key in overrides(row) if "." in key.split("=")[0]), error


def check_row(runs: Path, row: dict, tmp_path: Path, groups: list[str]) -> None:
    """A's and B's last checkpoints are equal bit for bit; C trained on to the new end and saved there;
    with balance=time the slowed replica was planned fewer local steps than the others once measured."""
    for group in groups:  # "" for one world; each replica group's outputs under fault tolerance
        a, b, c = (runs / phase / group for phase in "abc")
        end = f"checkpoints/step_{STEPS}"
        assert_bitwise_equal(saved_state(a / end, tmp_path), saved_state(b / end, tmp_path))
        assert (c / "checkpoints" / f"step_{STEPS + MORE}" / "meta.json").is_file(), name(row)
        assert read_metrics(c)[-1]["step"] == STEPS + MORE
    if row["balance"] == "time":
        slow = LAYOUTS[row["layout"]][1] - 1
        rows = [r for phase in "ac" for r in read_metrics(runs / phase / groups[0])]
        planned = [r for r in rows if f"replica/local_steps/{slow}" in r]
        assert any(r[f"replica/local_steps/{slow}"] < r["replica/local_steps/0"] for r in planned), name(row)


def phases(row: dict, runs: Path) -> list[dict]:
    """The row's three runs for tests/probes/matrix_probe.py."""
    keys, slow = overrides(row), slowdown(row)
    resumes = (None, {"run": str(runs / "a"), "pick": "middle"}, {"run": str(runs / "a"), "pick": "last"})
    return [
        {"dir": str(runs / phase), "overrides": [*keys, f"train.steps={steps}"], "slowdown": slow, "resume": resume}
        for phase, steps, resume in zip("abc", (STEPS, STEPS, STEPS + MORE), resumes)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_row_of_one_world_trains_resumes_bit_for_bit_and_goes_on(ranks, tmp_path, cli_env):
    rows = [row for row in ROWS if not refusals(row) and row["ft"] == "none" and LAYOUTS[row["layout"]][2] == ranks]
    runs = [run for row in rows for run in phases(row, tmp_path / name(row))]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    probe = REPO / "tests" / "probes" / "matrix_probe.py"
    check_ok(run_cli([str(tmp_path / "runs.json")], cli_env, tmp_path, ranks=ranks, script=probe, timeout=900))
    for row in rows:
        check_row(tmp_path / name(row), row, tmp_path, [""])


@pytest.mark.slow
@pytest.mark.parametrize("row", [row for row in ROWS if not refusals(row) and row["ft"] == "torchft"], ids=name)
def test_each_row_of_replica_groups_trains_resumes_bit_for_bit_and_goes_on(row, tmp_path):
    """The same three runs as launches of `python train.py fault_tolerance=torchft`: B's run dir holds each
    group's checkpoint from inside A, C's each group's last (checkpoint.resume=auto takes them)."""
    env = {**base_env(tmp_path), "HARNESS_TEST_SLOWDOWN": slowdown(row)}
    runs, groups = tmp_path / "runs", LAYOUTS[row["layout"]][1]

    def launch(phase: str, steps: int) -> None:
        args = [*overrides(row), f"train.steps={steps}", f"hydra.run.dir={runs / phase}"]
        check_ok(run_cli(args, env, tmp_path, script=TRAIN, timeout=600))

    launch("a", STEPS)
    saved = sorted(int(p.name.split("_")[1]) for p in (runs / "a" / "replica_group_0" / "checkpoints").iterdir())
    middle = min((s for s in saved if s < STEPS), key=lambda s: abs(s - STEPS // 2))
    for phase, step in (("b", middle), ("c", STEPS)):
        for g in range(groups):
            source = runs / "a" / f"replica_group_{g}" / "checkpoints" / f"step_{step}"
            shutil.copytree(source, runs / phase / f"replica_group_{g}" / "checkpoints" / f"step_{step}")
    launch("b", STEPS)
    launch("c", STEPS + MORE)
    check_row(runs, row, tmp_path, [f"replica_group_{g}" for g in range(groups)])
