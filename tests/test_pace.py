"""Replicas that do not wait for each other (`averager.balance=time`) and a period that
follows the loss (`averager.period_schedule=adacomm`): the rules by hand, the plan and
the weighted means through real collectives, and whole runs on real ranks: equal
replicas train bit for bit what `balance=steps` trains, a slowed replica takes fewer
local steps, resumes are exact."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.averaging import schedule
from harness.averaging.pace import (
    Pace,
    adacomm_period,
    balanced_local_steps,
    fit_to_remaining,
    level_meeting,
    mean_weight,
)

from support import REPO, check_ok, read_metrics, run_cli

PROBE = REPO / "tests" / "probes" / "pace_probe.py"


def test_the_rules_by_hand():
    # AdaComm: ceil(sqrt(F / F0) * period), within [min_period, period]
    assert adacomm_period(1.0, 4.0, 32, 1) == 16
    assert adacomm_period(0.01, 4.0, 32, 4) == 4
    assert adacomm_period(9.0, 4.0, 32, 1) == 32  # a loss above the first never lengthens the period
    assert adacomm_period(math.nan, 4.0, 32, 1) == 32
    # the fastest takes the period; within the dead band (25 %) too; the rest what fits in its time
    assert balanced_local_steps(8, [1.0, 2.0, 1.2, 8.0, 100.0]) == [8, 4, 8, 1, 1]
    assert balanced_local_steps(8, [1.0, None]) == [8, 8]
    # the run's last period: cut in proportion, every replica at least one step
    assert fit_to_remaining([8, 4], 12) == ([8, 4], False)
    assert fit_to_remaining([8, 4], 6) == ([4, 2], True)
    assert fit_to_remaining([4, 4], 6) == ([3, 3], True)
    assert fit_to_remaining([8, 1], 3) == ([2, 1], True)
    assert fit_to_remaining([8, 8], 1) == ([1, 1], True)
    # the weights: steps trained over the replicas that trained (fault tolerance: a group outside the quorum, 0)
    for windows, weight in (([[4, 0, 2]], 4 * 2 / 6), ([[4, 0, 4]], None), ([[2, 2, 2], [4, 0, 2]], 6 * 2 / 10)):
        pace = paces(3, [4, 4, 4])[0]
        pace.windows = windows  # with fragments: the last F exchanges', since the fragment's last sync
        assert pace.weights(windows[-1]) == weight
    # a hierarchy's levels within a period of 8 (pairs every 2 steps, all 4 at 8): replica 3 plans 2 steps, so
    # it reaches the points after 0, 1, 1 of them; its pair skips the points it trained nothing before
    sizes, planned = {2: 2, 8: 4}, [8, 8, 8, 2]
    meets = {r: {t: level_meeting(t, planned, None, r, sizes, 8) for t in range(1, 9)} for r in range(4)}
    assert {t for t, m in meets[0].items() if m} == {2, 4, 6} and meets[0][2] == (2, [2, 2])
    assert {t for t, m in meets[2].items() if m} == {4} and meets[2][4] == (2, [4, 1])
    assert {t for t, m in meets[3].items() if m} == {1} and meets[3][1] == (2, [4, 1])
    # three levels: the pair's weights count from the last point its group of 4 met at
    sizes, planned = {2: 2, 4: 4, 8: 8}, [8] * 7 + [3]
    assert level_meeting(4, planned, None, 4, sizes, 8) == (4, [4, 4, 4, 1])
    assert level_meeting(6, planned, None, 6, sizes, 8) == (2, [2, 1])
    assert level_meeting(2, planned, None, 6, sizes, 8) is None  # replica 7 took no step before the first point
    # the run's last period, cut: a point some member of the group does not reach is skipped by its group
    assert level_meeting(2, [8] * 4, [1, 2, 2, 2], 0, {2: 2, 8: 4}, 8) is None
    assert level_meeting(2, [8] * 4, [1, 2, 2, 2], 2, {2: 2, 8: 4}, 8) == (2, [2, 2])
    assert mean_weight([4, 1], 4) == 4 * 2 / 5 and mean_weight([2, 2], 2) is None


def paces(replicas: int, local_steps: list[int], first: int = 1) -> list[Pace]:
    """One `Pace` per replica, their period under way planned as `local_steps` (what an exchange sets)."""
    out = []
    for replica in range(replicas):
        pace = Pace(4, 2, 1000, "time", "fixed", 1, replicas, replica, True, 1, torch.device("cpu"))
        pace.local_steps, pace.start_done, pace.first_step = list(local_steps), 2 * replicas + first, first
        out.append(pace)
    return out


@pytest.mark.parametrize("local_steps", [[4, 4, 4], [4, 1, 3], [1, 6, 2]], ids=["equal", "uneven", "slow first"])
def test_a_period_reads_each_replica_step_once_and_equal_replicas_as_balance_steps_does(local_steps):
    """The slots of one period's replica steps are the period's range, each once; with equal
    replicas slot = step x replicas + replica, `balance=steps`'s data order, and the global step
    moves one a step."""
    replicas, first = len(local_steps), 5
    group = paces(replicas, local_steps, first)
    slots = [p.slot(first + i) for p in group for i in range(p.local_steps[p.replica])]
    start = group[0].start_done
    assert sorted(slots) == list(range(start, start + sum(local_steps)))
    assert all(p.done(first + p.local_steps[p.replica]) == start + sum(local_steps) for p in group)
    if len(set(local_steps)) == 1:
        assert all(p.slot(first + i) == start + i * replicas + p.replica for p in group for i in range(4))
        assert [group[0].global_step(first + i) for i in range(5)] == [start // replicas + i for i in range(5)]


@pytest.mark.parametrize("averager,fragments", [("periodic", 1), ("diloco", 1), ("diloco", 2), ("hierarchical", 1)])
def test_a_plan_without_exchanges_of_its_own_is_the_fixed_schedule(averager, fragments, world_of_1):
    """A Pace whose plan never changes (adacomm with the loss at the first exchange's, one replica
    measured) exchanges where `periodic_due` (DiLoCo: `fragment_due`, the same fragment; hierarchical:
    where the largest period divides the step) does, and a checkpoint saved without a plan resumes to
    the plan a Pace would have reached."""
    period, warmup, steps = 4, 3, 22
    first = {"periodic": 1, "diloco": period // fragments, "hierarchical": 2}[averager]  # the first_local_steps
    args = (period, warmup, steps, "steps", "adacomm", 1, 1, 0, True, 1, torch.device("cpu"), first)
    pace = Pace(*args, fragments=fragments)
    for step in range(steps):
        if averager == "diloco":
            fixed = schedule.fragment_due(step, warmup, period, fragments)
        elif averager == "hierarchical":
            fixed = schedule.hierarchical_period(step, warmup, [2, period]) == period or None
        else:
            fixed = schedule.periodic_due(step, warmup, period) or None
        assert pace.due(step) == (fixed is not None), step
        if pace.due(step) and averager == "diloco":
            assert pace.fragment() == fixed, step
        resumed = Pace(*args, fragments=fragments)
        resumed.load_state_dict(resumed.plan_at(step), step)
        for key in ("local_steps", "start_done", "last", "syncs", "windows"):
            assert getattr(resumed, key) == getattr(pace, key), (step, key)
        assert resumed.first_step == pace.first_step, step
        if pace.due(step):
            pace.observe(torch.tensor(2.0))
            pace.exchange(step)


@pytest.mark.slow
def test_the_plan_and_the_weighted_means_through_real_collectives(tmp_path, cli_env):
    """2 ranks: the figures each shares at an exchange give the next plan (adacomm's period 3 from a mean
    loss of half the first; the replica twice as slow takes 2 of them), and the means weigh each replica by
    the steps it trained: 3 steps of 1 and 1 of 3 average to 1.5 (fp32, bf16 on the wire, DiLoCo's)."""
    out = tmp_path / "pace.json"
    check_ok(run_cli([str(out)], cli_env, tmp_path, ranks=2, script=PROBE))
    r = json.loads(out.read_text())
    assert r["completed"] == [4, 4] and r["period"] == 3 and r["plan"] == [3, 2] and r["first_step"] == 5
    assert r["step_times"] == pytest.approx([0.1, 0.2], rel=0.05)
    assert r["row"]["replica/local_steps/1"] == 4 and r["row"]["replica/samples/1"] == 32
    assert r["row"]["averager/period"] == 4  # the period in force up to the exchange
    assert r["scale"] == 1.5 and r["equal_weights"] is None  # equal steps: the plain mean, bit for bit
    for key in ("mean", "mean_bf16", "pseudo_gradient_mean"):
        assert r[key] == [1.5] * 6, key


def exchanges(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "averager/period" in r]


def final_state(run_dir, step: int) -> dict:
    """The last checkpoint's model and optimizer tensors, every replica's copy."""
    state = {}
    for path in sorted((run_dir / "checkpoints" / f"step_{step}").glob("*.pt")):
        if path.name != "rng.pt":
            for key, value in torch.load(path, weights_only=True).items():
                if key in ("model", "optim"):
                    state[f"{path.name}/{key}"] = value
    return state


def assert_same(a: dict, b: dict) -> None:
    def leaves(x, prefix=""):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, f"{prefix}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from leaves(v, f"{prefix}/{i}")
        else:
            yield prefix, x

    la, lb = dict(leaves(a)), dict(leaves(b))
    assert la.keys() == lb.keys() and la
    for key in la:
        if isinstance(la[key], torch.Tensor):
            assert torch.equal(la[key], lb[key]), key
        else:
            assert la[key] == lb[key], key


SMALL = [
    "launcher.nproc=2",
    "sharding=no_shard",
    "model=mlp",
    "train.batch_size=4",
    "train.seq_len=16",
    "train.log_every=5",
    "averager.warmup_steps=2",
    "checkpoint=full",
    "checkpoint.keep=10",
]


AVERAGERS = {  # their keys for a largest period of 8, their stride between exchanges, their replicas
    "periodic": (["averager=periodic", "averager.period=8"], 8, 2),
    "diloco": (["averager=diloco", "averager.period=8"], 8, 2),
    # Streaming DiLoCo's 2 fragments, each sync applied 2 local steps after it starts (its overlap)
    "streaming": (
        ["averager=diloco", "averager.period=8", "averager.fragments=2", "averager.sync_delay=2"],
        4,
        2,
    ),
    # pairs every 2 steps (at points of the period under balance=time), all 4 every 8
    "hierarchical": (["averager=hierarchical", "averager.period_group_size=[[2,2],[8,4]]"], 8, 4),
}


def layout(replicas: int) -> list[str]:
    """SMALL with `replicas` ranks, one replica each."""
    return [*(o for o in SMALL if not o.startswith("launcher.nproc=")), f"launcher.nproc={replicas}"]


@pytest.mark.slow
@pytest.mark.parametrize("averager", sorted(AVERAGERS))
def test_equal_replicas_train_with_balance_time_what_balance_steps_trains(averager, tmp_path, cli_env):
    """Equally fast replicas stay within the dead band: every stride between exchanges is `period`
    steps each (Streaming DiLoCo's: period/fragments; the last one cut; a hierarchy's pairs meet at
    every 2 steps of it as `balance=steps` has them), and the run ends bit for bit where `balance=steps`
    ends (every replica's parameters and optimizer state); so does the `balance=steps` run resumed with
    `balance=time` from its checkpoint at step 15, inside a period (Streaming DiLoCo's: inside a sync's
    delay). Equally fast: each step's compute padded to 0.1 s (HARNESS_TEST_SLOWDOWN), since 10 ms steps
    on a host loaded by other tests differed by more than the dead band."""
    keys, stride, replicas = AVERAGERS[averager]
    common = [*layout(replicas), *keys, "train.steps=29", "checkpoint.interval=15"]
    env = {**cli_env, "HARNESS_TEST_SLOWDOWN": ",".join(f"{r}:0.1s" for r in range(replicas))}
    for balance in ("steps", "time"):
        check_ok(run_cli([*common, f"averager.balance={balance}", f"hydra.run.dir={balance}"], env, tmp_path))
    rows = exchanges(tmp_path / "time")
    assert len(rows) >= 3 and all(len({r[f"replica/local_steps/{q}"] for q in range(replicas)}) == 1 for r in rows)
    assert all(r["replica/local_steps/0"] == stride for r in rows[1:])  # the first follows the warmup's end
    assert f"replica/step_time_s/{replicas - 1}" in rows[-1]
    meta = json.loads((tmp_path / "time" / "checkpoints" / "step_29" / "meta.json").read_text())
    last = 29 - rows[-1]["train/step"]  # the last period (no exchange ends it), planned from measured times
    assert meta["cross_replica"]["pace"]["local_steps"] == [last] * replicas
    assert_same(final_state(tmp_path / "steps", 29), final_state(tmp_path / "time", 29))
    middle = tmp_path / "steps" / "checkpoints" / "step_15"
    check_ok(
        run_cli(
            [*common, "averager.balance=time", f"checkpoint.resume={middle}", "hydra.run.dir=resumed"], env, tmp_path
        )
    )
    assert_same(final_state(tmp_path / "steps", 29), final_state(tmp_path / "resumed", 29))


ADACOMM = "averager.period_schedule=adacomm"
SLOWED = {  # keys, fragments, the slowed last replica's pad, its local steps to the fastest's stride, steps
    # adacomm from a stride of 4 between exchanges; replica 1 eight times slower
    "periodic": (["averager=periodic", "averager.period=4", ADACOMM], 1, "0:0.05s,1:0.4s", 1, 24),
    # Streaming DiLoCo's 2 fragments, each sync applied 2 of replica 0's local steps after it starts (the slow
    # replica's 1 step: at the next exchange)
    "streaming": (
        ["averager=diloco", "averager.period=8", "averager.fragments=2", "averager.sync_delay=2", ADACOMM],
        2,
        "0:0.05s,1:0.4s",
        1,
        24,
    ),
    # 4 replicas, pairs within the period and all 4 at its end; replica 3 four times slower than its pair's other
    "hierarchical": (
        ["averager=hierarchical", "averager.period_group_size=[[2,2],[8,4]]"],
        1,
        "0:0.05s,1:0.05s,2:0.05s,3:0.2s",
        2,
        40,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("averager", sorted(SLOWED))
def test_a_slow_replica_takes_fewer_steps_and_a_resume_at_an_exchange_is_exact(averager, tmp_path, cli_env):
    """The last replica slowed (HARNESS_TEST_SLOWDOWN pads each step's compute to a fixed time: the load of a
    shared host moves none): past the first measured period it takes as many steps as fit in the fastest's
    stride (post-local SGD and Streaming DiLoCo with adacomm, each fragment's sync an exchange, also with each
    sync applied 2 of the fastest's steps after it starts (the slow replica's at the next exchange), its figures
    reported there; a hierarchy whose slow replica's pair partner is planned by its own speed, not by its waits
    for the slow one at their meetings; the wall time this saves is bench/uneven.py's to measure, not a test's
    on a loaded machine), the samples count what each trained, and the run is as long as `train.steps` says. A
    run resumed from its checkpoint at an exchange ends bit for bit where it ends; so does a `balance=steps` run
    resumed in the middle of a period with adacomm (post-local SGD)."""
    keys, fragments, slowdown, slow_steps, steps = SLOWED[averager]
    env = {**cli_env, "HARNESS_TEST_SLOWDOWN": slowdown}
    slow = slowdown.count(",")  # the last replica
    common = [*layout(slow + 1), *keys, f"train.steps={steps}", "checkpoint.interval=8"]
    timed = [*common, "averager.balance=time"]
    check_ok(run_cli([*timed, "hydra.run.dir=straight"], env, tmp_path))
    rows = exchanges(tmp_path / "straight")
    measured = [r for r in rows if f"replica/step_time_s/{slow}" in r]
    assert measured and sum(r[f"replica/step_time_s/{slow}"] for r in measured) > 2 * sum(
        r["replica/step_time_s/0"] for r in measured
    )
    planned = rows[rows.index(measured[0]) + 1 :]  # the periods planned from a measured one
    assert planned and all(
        r[f"replica/local_steps/{slow}"] == slow_steps
        and all(r[f"replica/local_steps/{q}"] == r["averager/period"] // fragments for q in range(slow))
        for r in planned
    ), planned
    if "averager.sync_delay=2" in keys:  # a delayed sync's figures, summed at the next exchange, on its row
        assert "averager/pseudo_grad_norm" not in rows[0]
        assert [r["averager/fragment"] for r in rows[1:]] == [k % 2 for k in range(len(rows) - 1)]
    last = read_metrics(tmp_path / "straight")[-1]
    assert last["train/step"] == steps
    assert rows[-1]["replica/samples/0"] > rows[-1][f"replica/samples/{slow}"]
    saves = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "straight" / "checkpoints").iterdir())
    assert saves[-1] == steps and len(saves) >= 2
    exchange_steps = {r["train/step"] for r in rows}
    assert set(saves[:-1]) <= exchange_steps, "a save fell where the replicas do not meet"
    middle = tmp_path / "straight" / "checkpoints" / f"step_{saves[-2]}"
    check_ok(run_cli([*timed, f"checkpoint.resume={middle}", "hydra.run.dir=resumed"], env, tmp_path))
    assert_same(final_state(tmp_path / "straight", steps), final_state(tmp_path / "resumed", steps))
    if averager != "periodic":
        return
    # balance=steps with adacomm: saves fall inside periods; step 8 is one (exchanges after 3, 7, ...)
    for name, extra in (("steps", []), ("steps_resumed", [f"checkpoint.resume={tmp_path}/steps/checkpoints/step_8"])):
        check_ok(run_cli([*common, *extra, f"hydra.run.dir={name}"], cli_env, tmp_path))
    assert 8 not in {r["train/step"] for r in exchanges(tmp_path / "steps")}

    assert_same(final_state(tmp_path / "steps", 24), final_state(tmp_path / "steps_resumed", 24))
