"""The run's one clock (harness/clock): its rules by hand; the ticks every replica's clock hands
out for a whole run (each replica step read once, every replica at the same exchanges, the run ending
at `train.steps` for each); its checkpoint part, from which a resume derives the plan again (the same
ticks when nothing changed, a well-formed run when the steps, the period, the balance or the replica
count did); DiLoCo's delayed apply with a replica planned fewer steps than the delay; the non-finite
flags a period longer than `train.log_every` leaves; the figures and weighted means through real
collectives."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.clock import Clock, Schedule, Tick
from harness.clock.rules import (
    adacomm_period,
    auto_period,
    balanced_local_steps,
    exchange_share,
    fit_to_remaining,
    level_meeting,
    mean_weight,
)

from support import REPO, check_ok, read_metrics, run_cli

CPU = torch.device("cpu")
PROBE = REPO / "tests" / "probes" / "clock_probe.py"


def test_the_rules_by_hand():
    # AdaComm: ceil(sqrt(F / F0) * period), within [min_period, period]
    assert adacomm_period(1.0, 4.0, 32, 1) == 16
    assert adacomm_period(0.01, 4.0, 32, 4) == 4
    assert adacomm_period(9.0, 4.0, 32, 1) == 32  # a loss above the first never lengthens the period
    assert adacomm_period(math.nan, 4.0, 32, 1) == 32
    # period=auto: the fewest steps k with e / (k·s + e) <= budget, within [shortest, longest]; the shortest
    # until both times are measured
    assert auto_period(0.3, 0.06, 0.1, 1, 64) == 45 and exchange_share(0.3, 0.06, 45) <= 0.1
    assert exchange_share(0.3, 0.06, 44) > 0.1
    assert auto_period(0.09, 0.1, 0.1, 1, 64) == 9  # exactly at the budget: not one more for a float's noise
    assert auto_period(0.001, 0.1, 0.1, 2, 64) == 2 and auto_period(10.0, 0.01, 0.1, 1, 64) == 64
    assert auto_period(None, 0.1, 0.1, 3, 64) == 3 and auto_period(0.1, None, 0.1, 3, 64) == 3
    # the fastest takes the period; within the dead band (25 %) too; the rest what fits in its time
    assert balanced_local_steps(8, [1.0, 2.0, 1.2, 8.0, 100.0]) == [8, 4, 8, 1, 1]
    assert balanced_local_steps(8, [1.0, None]) == [8, 8]
    # the run's last period: cut in proportion, every replica at least one step
    assert fit_to_remaining([8, 4], 12) == ([8, 4], False)
    assert fit_to_remaining([8, 4], 6) == ([4, 2], True)
    assert fit_to_remaining([4, 4], 6) == ([3, 3], True)
    assert fit_to_remaining([8, 1], 3) == ([2, 1], True)
    assert fit_to_remaining([8, 8], 1) == ([1, 1], True)
    # the weights: the steps each member's tensors hold; equal: the plain mean, bit for bit
    assert mean_weight([4, 1], 4) == 4 * 2 / 5 and mean_weight([2, 2], 2) is None
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
    # the run's last period, cut: a point some member of the group does not train on after is skipped by its
    # group (a member's last step is a meeting of every rank, which comes first)
    assert level_meeting(2, [8] * 4, [1, 3, 3, 3], 0, {2: 2, 8: 4}, 8) is None
    assert level_meeting(2, [8] * 4, [1, 3, 3, 3], 2, {2: 2, 8: 4}, 8) == (2, [2, 2])
    assert level_meeting(2, [8] * 4, [1, 2, 2, 2], 2, {2: 2, 8: 4}, 8) is None


SCHEDULES = {  # (schedule keys, replicas): post-local SGD, Streaming DiLoCo with a delay, a hierarchy
    "periodic": ({"warmup": 2, "period": 4, "first": 1}, 3),
    "streaming": ({"warmup": 2, "period": 8, "first": 4, "fragments": 2, "sync_delay": 2}, 2),
    "hierarchical": ({"warmup": 2, "period": 8, "first": 7, "levels": ((2, 2), (8, 4))}, 4),
}


def inputs(replicas: int, step: int, times: list[float | None], fragments: int = 1, syncs: int = 1) -> dict:
    """A checkpoint's clock part at an exchange at global step `step`, each replica's step time `times`."""
    return {
        "step": step,
        "replicas": replicas,
        "done": step * replicas,
        "taken": [0] * replicas,
        "syncs": syncs,
        "trained": [step] * replicas,
        "held": [[0] * replicas for _ in range(fragments)],
        "step_times": times,
        "first_loss": None,
        "first_loss_shared": True,
        "exchange_loss": None,
        "exchange_time": None,
    }


def clocks(schedule: Schedule, steps: int, replicas: int, state: dict | None = None) -> list[Clock]:
    """One clock per replica, each resumed from `state` (None: from the start)."""
    out = [Clock(schedule, steps, replicas, r, True, 1, CPU) for r in range(replicas)]
    for clock in out:
        if state is not None:
            clock.load_state_dict(state)
    return out


def walk(clock: Clock, states: dict | None = None) -> list[Tick]:
    """This replica's ticks to the run's end (no averager: each exchange counts the plan); `states`
    collects its clock part after each meeting, by global step, as a save there would hold it."""
    ticks = []
    while not clock.finished:
        ticks.append(clock.next())
        clock.advance()
        if states is not None and ticks[-1].meeting:
            states[clock.step] = {"step": clock.step, **clock.state_dict()}
    return ticks


def check_run(runs: list[list[Tick]], steps: int, first_slot: int = 0, levels: tuple = ()) -> None:
    """A run is well formed: each replica step of the run read once; every replica at the same exchanges
    (at the same global step, the same fragment) and meetings (where log, eval and save fall), a delayed sync's
    collectives in the same order among them on each; a hierarchy's
    group (`levels`: (period, replicas per group)) meets as often between two exchanges on each member, each
    time on ticks that are alike meetings of every rank or not (those collectives come first); each
    replica's global step never goes back and ends at `steps` on its last tick."""
    slots = sorted(t.slot for ticks in runs for t in ticks)
    assert slots == list(range(first_slot, first_slot + len(slots)))
    exchanges = {tuple((t.step, t.exchange) for t in ticks if t.exchange is not None) for ticks in runs}
    assert len(exchanges) == 1, exchanges
    meetings = {tuple(t.step for t in ticks if t.meeting) for ticks in runs}
    assert len(meetings) == 1, meetings
    if any(t.apply_after or t.advance or t.apply_before for ticks in runs for t in ticks):  # a delayed sync
        assert all(collectives(ticks) == collectives(runs[0]) for ticks in runs), [collectives(t)[-6:] for t in runs]
    for period, size in levels:
        for first in range(0, len(runs), size):
            met = [group_meetings(runs[r], period) for r in range(first, first + size)]
            assert all(m == met[0] for m in met), (period, first, met)
    for ticks in runs:
        assert [t.step for t in ticks] == sorted(t.step for t in ticks) and ticks[-1].step == steps
        assert ticks[-1].last and not any(t.last for t in ticks[:-1])
        assert sum(t.lr_steps for t in ticks) == steps - ticks[0].before


def collectives(ticks: list[Tick]) -> list[str]:
    """What crosses every replica, in this replica's order: the meetings of every rank (the non-finite
    check, log, save), the exchanges, and a DiLoCo sync in flight's one collective after its start (a narrow
    comm_dtype's all-gather, at its halfway advance or its apply, whichever comes first). A sync whose apply
    falls past a replica's end issues none there."""
    out, in_flight = [], False
    for t in ticks:
        if t.apply_before and in_flight:  # before the step, so before its meeting
            out.append("sync")
            in_flight = False
        if t.meeting:
            out.append(f"meeting {t.step}")
        if (t.apply_after or t.advance) and in_flight:
            out.append("sync")
            in_flight = False  # the apply after an advance issues nothing new
        if t.exchange is not None:
            out.append(f"exchange {t.exchange}")
            in_flight = True
    return out


def group_meetings(ticks: list[Tick], period: int) -> list[tuple[int, bool]]:
    """Where this replica's group of the level `period` meets: (exchanges before it, every rank meets there too)."""
    out, exchanges = [], 0
    for t in ticks:
        if t.level is not None and t.level.period == period:
            out.append((exchanges, t.meeting))
        exchanges += t.exchange is not None
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("times", ["equal", "uneven"])
def test_every_replica_reads_each_replica_step_once_and_meets_at_the_same_steps(name, times):
    """Replicas planned their own local steps (from step times, as an exchange plans them) take ticks that
    read each replica step of the run once, meet at the same global steps, and end together at `train.steps`,
    the last period cut (every replica at least one step); equal replicas read as synchronous ones do: slot
    = step x replicas + replica, the global step one a tick."""
    keys, replicas = SCHEDULES[name]
    schedule = Schedule(balance="time", **keys)
    speeds = [1.0] * replicas if times == "equal" else [1.0, 6.0, 2.0, 3.5][:replicas]
    for steps in (37, 43, 50):
        runs = [
            walk(c) for c in clocks(schedule, steps, replicas, inputs(replicas, 9, speeds, keys.get("fragments", 1)))
        ]
        check_run(runs, steps, first_slot=9 * replicas, levels=schedule.levels)
        if times == "equal":
            assert all(
                t.slot == t.before * replicas + r and t.step == t.before + 1 for r, ts in enumerate(runs) for t in ts
            )
            assert not any(t.meeting for t in runs[0] if t.exchange is None and not t.last)  # balance=time
        else:
            assert len({len(ticks) for ticks in runs}) == replicas  # each its own number of local steps
            exchanges = sum(t.exchange is not None for t in runs[0])
            assert sum(t.meeting for t in runs[0]) <= exchanges + 2  # at exchanges, and the cut end


def test_fresh_runs_of_the_fixed_schedules_are_well_formed():
    for name, (keys, replicas) in SCHEDULES.items():
        for balance in ("steps", "time"):
            schedule = Schedule(balance=balance, **keys)
            runs = [walk(c) for c in clocks(schedule, 29, replicas)]
            check_run(runs, 29, levels=schedule.levels)
            assert [t.step for t in runs[0]] == list(range(1, 30)), name  # before any plan: in step


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_resume_derives_the_plan_again_exactly_or_for_the_run_it_is_in(name):
    """The clock part saved at any meeting of an uneven run resumes to the very ticks the run took from
    there; resumed with more or fewer steps, another period, balance=steps, or another replica count, the
    run from there is well formed and ends at its own `train.steps`."""
    keys, replicas = SCHEDULES[name]
    schedule = Schedule(balance="time", **keys)
    speeds = [1.0, 6.0, 2.0, 3.5][:replicas]
    start = inputs(replicas, 9, speeds, keys.get("fragments", 1))
    states: dict[int, dict] = {}
    runs = [walk(c, states if r == 0 else None) for r, c in enumerate(clocks(schedule, 45, replicas, start))]
    assert len(states) > 3
    for step, state in states.items():
        again = [walk(c) for c in clocks(schedule, 45, replicas, json.loads(json.dumps(state)))]
        assert again == [[t for t in ticks if t.before >= step] for ticks in runs], step
    for step, state in list(states.items())[::2]:
        done = state["done"] + sum(state["taken"])
        changes = [
            (schedule, 45 + 17, replicas),  # more steps (the run's end too: the cut period goes on)
            (schedule, max(step + 1, 30), replicas),  # fewer
            (Schedule(**{**schedule.__dict__, "period": schedule.period * 2, "first": 1}), 45, replicas),
            (Schedule(**{**schedule.__dict__, "balance": "steps"}), 45, replicas),
        ]
        if not schedule.levels:  # a hierarchy's groups are its replica count's
            changes += [(schedule, 45, replicas + 1), (schedule, 45, replicas - 1 or 3)]
        for changed, steps, count in changes:
            if step >= steps:
                continue
            runs_after = [walk(c) for c in clocks(changed, steps, count, state)]
            first = done if count == replicas else step * count
            check_run(runs_after, steps, first_slot=first, levels=changed.levels)


def test_a_resume_plans_with_the_config_it_runs_with():
    """The checkpoint holds the plan's inputs, not the plan: AdaComm's period from the saved losses (F = F0 / 4:
    half of 8) is 8 again with adacomm switched off; a new period and new hierarchical levels plan the periods
    after the checkpoint (before: the checkpoint's plan stayed)."""
    state = {**inputs(4, 11, [None] * 4), "first_loss": 4.0, "exchange_loss": 1.0}
    adacomm = Schedule(warmup=2, period=8, first=1, period_schedule="adacomm")
    assert clocks(adacomm, 100, 4, state)[0].plan == [4] * 4
    assert clocks(Schedule(warmup=2, period=8, first=1), 100, 4, state)[0].plan == [8] * 4
    assert clocks(Schedule(warmup=2, period=6, first=1), 100, 4, state)[0].plan == [6] * 4
    met = {}
    for every in (2, 4):  # pairs of replicas meet every 2 steps, or every 4; all 4 every 8
        schedule = Schedule(warmup=2, period=8, first=1, levels=((every, 2), (8, 4)))
        met[every] = [t.before for t in walk(clocks(schedule, 27, 4, state)[0]) if t.level is not None]
    assert met == {2: [12, 14, 16, 20, 22, 24], 4: [12, 16, 20, 24]}


def test_diloco_delay_with_a_replica_planned_fewer_steps_than_it():
    """sync_delay 2 of a period of 4; replica 1 takes 1 step a period: its delay is 0, so the sync started at
    the exchange is applied before its one step (which its next pseudo-gradient then holds: none discarded),
    and at the exchange, where saves fall, every replica still holds the sync just started; replica 0 applies
    after its 2nd step. The weights count the steps each pseudo-gradient holds: 4 - 2 and 1."""
    schedule = Schedule(warmup=0, period=4, first=4, sync_delay=2, balance="time")
    fast, slow = clocks(schedule, 100, 2, inputs(2, 8, [1.0, 4.0]))
    assert fast.plan == [4, 1] and [fast.delay(q) for q in (0, 1)] == [2, 0]
    ticks = {}
    for r, clock in enumerate((fast, slow)):
        ticks[r] = []
        while not ticks[r] or ticks[r][-1].exchange is None:
            ticks[r].append(clock.next())
            if ticks[r][-1].apply_before or ticks[r][-1].apply_after:
                clock.applied(0, delayed=True)
            if ticks[r][-1].exchange is None:
                clock.advance()
    assert [(t.apply_before, t.apply_after) for t in ticks[1]] == [(True, False)]
    assert [t.apply_after for t in ticks[0]] == [False, True, False, False]
    assert fast.held == slow.held == [[-2, 0]]  # then each trains its plan: 4 - 2 and 1 - 0 steps held
    held = [h + k for h, k in zip(fast.held[0], fast.plan)]
    assert [mean_weight(held, held[q]) for q in (0, 1)] == [2 * 2 / 3, 1 * 2 / 3]


@pytest.mark.slow
def test_the_plan_and_the_weighted_means_through_real_collectives(tmp_path, cli_env):
    """2 ranks, a replica each (tests/probes/clock_probe.py): the figures each shares at an exchange give the
    next plan (adacomm's period 3 from a mean loss of half the first; the replica 1.5 times as slow takes 2 of
    them); a second exchange weighs each replica by the steps it took (3 of 1.0 and 2 of 3.0 average to 1.8,
    in fp32, bf16 on the wire and DiLoCo's pseudo-gradient mean), the first (equal) is the plain mean; the
    same exchange redone among one replica (a lone survivor) is its own tensors, unscaled."""
    out = tmp_path / "clock.json"
    check_ok(run_cli([str(out)], cli_env, tmp_path, ranks=2, script=PROBE))
    r = json.loads(out.read_text())
    assert r["period"] == 3 and r["plan"] == [3, 2]
    assert r["step_times"] == pytest.approx([0.1, 0.15], rel=0.05)
    assert r["row"]["replica/local_steps/1"] == 4 and r["row"]["replica/samples/1"] == 8 * 8
    assert r["row"]["averager/period"] == 4  # the period in force up to the exchange
    assert r["first_scale"] is None and r["scale"] == pytest.approx([3 * 2 / 5, 2 * 2 / 5])
    for key in ("mean", "mean_bf16", "pseudo_gradient_mean"):
        assert r[key] == pytest.approx([1.8] * 6, rel=1e-2 if key == "mean_bf16" else 1e-6), key


def test_an_exchange_redone_by_a_lone_survivor_leaves_its_model_unscaled(world_of_1):
    """Fault tolerance, the run's last exchange redone among the groups left (`Clock.reweigh`): weighed over
    them alone, so a lone survivor's mean is its own model, not scaled by the weights of an exchange that
    counted a lost group (6 steps against a lost group's 3 made it x1.33)."""
    schedule = Schedule(warmup=0, period=4, first=4, balance="time")
    clock = Clock(schedule, 100, 2, 0, True, 1, CPU, sum_over_replicas=lambda figures: None)  # a quorum of one
    clock.load_state_dict({**inputs(2, 8, [1.0, 2.0]), "held": [[6, 3]]})
    assert mean_weight([6, 3], 6) == pytest.approx(4 / 3) and clock.reweigh([0]) == {0: None}


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
    # Streaming DiLoCo's 2 fragments, each sync applied 2 local steps after it starts (its overlap): DiLoCo's
    # outer step with what a plain one leaves out
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
    assert all(r["replica/local_steps/0"] == stride for r in rows[1:-1])  # the first follows the warmup's end
    assert f"replica/step_time_s/{replicas - 1}" in rows[-2]
    # the last period, cut to the run's end and planned from measured times, ends with an exchange too
    assert rows[-1]["train/step"] == 29 and rows[-1]["replica/local_steps/0"] == 29 - rows[-2]["train/step"]
    meta = json.loads((tmp_path / "time" / "checkpoints" / "step_29" / "meta.json").read_text())
    assert meta["clock"]["taken"] == [0] * replicas
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
    # Streaming DiLoCo's 2 fragments with adacomm, each sync applied 2 of replica 0's local steps after it starts
    # (the slow replica's 1 step: before it), replica 1 eight times slower
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
    stride (Streaming DiLoCo with adacomm, each fragment's sync an exchange, each sync applied 2 of the
    fastest's steps after it starts (the slow replica's before its one step), its figures reported at the next
    exchange; a hierarchy whose slow replica's pair partner is planned by its own speed, not by its waits for
    the slow one at their meetings; the wall time this saves is bench/uneven.py's to measure, not a test's on a
    loaded machine), the samples count what each trained, and the run is as long as `train.steps` says. A run
    resumed from its checkpoint at an exchange ends bit for bit where it ends (post-local SGD's, and every
    layout's, in bench/matrix.py)."""
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
        assert [r["averager/fragment"] for r in rows[1:-1]] == [k % 2 for k in range(len(rows) - 2)]
        assert rows[-1]["averager/fragment"] == (len(rows) - 1) % 2  # the last: every fragment, applied at once
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


NAN_AT = REPO / "tests" / "probes" / "nan_at.py"
RUNS_PROBE = REPO / "tests" / "probes" / "runs_probe.py"
UNEVEN = [*layout(2), "optimizer=sgd", "optimizer.fused=true", "averager.balance=time", "train.steps=20"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,keys,nan_at",
    [
        ("clean", ["averager=periodic", "averager.period=4"], None),
        ("NaN on the fast replica", ["averager=periodic", "averager.period=4"], "0:9"),
        ("NaN early in a period longer than log_every", ["averager=diloco", "train.log_every=10"], "1:3"),
    ],
)
def test_uneven_replicas_with_a_fused_optimizer_stop_for_a_nan_anywhere_and_only_then(
    case, keys, nan_at, tmp_path, cli_env
):
    """The defaults on a GPU, a fused optimizer and train.nonfinite=error, with one replica six times slower
    (balance=time plans it fewer local steps): a clean run ends at train.steps (before: the fast replica found
    one of its steps flagged, 'not finite at step 13', and the run stopped); a NaN on the fast replica stops
    every rank at the next exchange, each saying so (before: the slow one went on into the next collective);
    a NaN early in a DiLoCo period of 16 local steps, more than train.log_every, is reported at the period's
    exchange (before: its flag was overwritten first, and the run ended with exit 0)."""
    env = {**cli_env, "HARNESS_TEST_SLOWDOWN": "0:0.04s,1:0.25s"}
    args = [*UNEVEN, *keys, f"hydra.run.dir={tmp_path / 'run'}"]
    if nan_at is None:
        check_ok(run_cli(args, env, tmp_path))
        rows = exchanges(tmp_path / "run")
        assert any(r["replica/local_steps/1"] < r["replica/local_steps/0"] for r in rows)
        assert read_metrics(tmp_path / "run")[-1]["step"] == 20
        return
    proc = run_cli(args, {**env, "HARNESS_TEST_NAN_AT": nan_at}, tmp_path, script=NAN_AT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    for log in ("train.log", "logs/rank1.log"):  # every rank stopped on the same agreed report
        assert "not finite (NaN/inf)" in (tmp_path / "run" / log).read_text(), log


@pytest.mark.slow
def test_a_resume_honours_more_steps_a_new_period_and_another_replica_count(tmp_path, cli_env):
    """balance=time runs of 4 ranks, the last replica slowed, resumed from their last checkpoint with a
    changed config (tests/probes/runs_probe.py: every run a job on the same ranks): more train.steps train
    on to the new end and save there (before: the run trained forever at its old last step); a new
    averager.period plans the periods after it (before: the checkpoint's period stayed); 4 replicas resumed as
    2 (hybrid_shard 2 x 2) and 2 as 4 end at train.steps (before: 2 -> 4 failed with an IndexError in every
    rank, 4 -> 2 jumped past train.steps and ended without a log or a save). And adacomm resumed from a
    checkpoint before the first exchange ends bit for bit where the uninterrupted run ends (F0 is in it)."""
    four = ["launcher.nproc=4", "sharding=no_shard", "train.batch_size=4", "train.seq_len=16", "model=mlp"]
    two = [*four, "sharding=hybrid_shard", "sharding.replicate=2"]
    keys = ["averager=periodic", "averager.period=4", "averager.warmup_steps=2", "averager.balance=time"]
    keys += ["checkpoint=full", "checkpoint.interval=5", "train.log_every=4"]
    slow4, slow2 = "0:0.04s,1:0.04s,2:0.04s,3:0.3s", "0:0.04s,1:0.3s"
    adacomm = [*two, "averager=periodic", "averager.period=8", "averager.warmup_steps=4", "checkpoint=full"]
    adacomm += ["averager.period_schedule=adacomm", "checkpoint.interval=3", "checkpoint.keep=10", "train.steps=16"]

    def run(name, overrides, slowdown="", resume=None, pick="last"):
        return {
            "dir": str(tmp_path / name),
            "overrides": overrides,
            "slowdown": slowdown,
            "resume": None if resume is None else {"run": str(tmp_path / resume), "pick": pick},
        }

    runs = [
        run("four", [*four, *keys, "train.steps=16"], slow4),
        run("more_steps", [*four, *keys, "train.steps=26"], slow4, "four"),
        run("new_period", [*four, *keys, "train.steps=26", "averager.period=2"], slow4, "four"),
        run("as_two", [*two, *keys, "train.steps=26"], slow2, "four"),
        run("two", [*two, *keys, "train.steps=16"], slow2),
        run("as_four", [*four, *keys, "train.steps=26"], slow4, "two"),
        run("adacomm", adacomm),
        run("adacomm_resumed", adacomm, resume="adacomm", pick=3),
    ]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    check_ok(run_cli([str(tmp_path / "runs.json")], cli_env, tmp_path, ranks=4, script=RUNS_PROBE, timeout=600))
    for name in ("more_steps", "new_period", "as_two", "as_four"):
        rows = read_metrics(tmp_path / name)
        assert rows[-1]["step"] == 26 and "train/loss" in rows[-1], name
        assert (tmp_path / name / "checkpoints" / "step_26" / "meta.json").is_file(), name
    after = [r for r in exchanges(tmp_path / "new_period") if r["train/step"] > 16]
    assert after and all(r["averager/period"] == 2 for r in after[1:])  # the first: the period in force before it
    assert all(r["replica/local_steps/0"] <= 2 for r in after[1:])
    assert "averager/period" in exchanges(tmp_path / "adacomm")[0]
    assert_same(final_state(tmp_path / "adacomm", 16), final_state(tmp_path / "adacomm_resumed", 16))


AUTO = [*layout(2), "averager=periodic", "averager.period=auto", "averager.warmup_steps=2", "checkpoint=full"]


@pytest.mark.slow
def test_period_auto_follows_the_link_and_a_resume_follows_the_budget_and_the_link(tmp_path, cli_env):
    """averager.period=auto on 2 replicas whose steps take 0.05 s (HARNESS_TEST_SLOWDOWN): with every exchange
    0.2 s slower than loopback's (HARNESS_TEST_EXCHANGE_DELAY) it takes the period that
    keeps exchanges within comm_budget 0.1, e ~ 0.2 s: ⌈0.2·0.9/(0.1·0.05)⌉ = 36 local steps, and its rows say
    so (period, exchange time, share). The replicas always take the same steps. Its checkpoint inside a period
    resumed with nothing changed ends that period as planned; resumed with comm_budget=0.5 its periods shrink to
    the new budget's (⌈0.2·0.5/(0.5·0.05)⌉ = 4); resumed over loopback (no delay) they shrink as the
    exchanges' smoothed time falls."""
    pace = {**cli_env, "HARNESS_TEST_SLOWDOWN": "0:0.05s,1:0.05s"}
    slow = {**pace, "HARNESS_TEST_EXCHANGE_DELAY": "0.2"}
    check_ok(run_cli([*AUTO, "train.steps=80", "checkpoint.interval=50", "hydra.run.dir=slow"], slow, tmp_path))
    slowed = exchanges(tmp_path / "slow")
    planned = slowed[3:-1]  # from the first period planned on measured times, the run's cut last left out
    assert planned and all(24 <= r["averager/period"] <= 48 for r in planned), [r["averager/period"] for r in slowed]
    assert all(0.15 < r["averager/exchange_s"] < 0.4 and r["averager/exchange_share"] < 0.15 for r in planned)
    middle = tmp_path / "slow" / "checkpoints" / "step_50"
    resume = [*AUTO, "train.steps=120", f"checkpoint.resume={middle}"]
    check_ok(run_cli([*resume, "train.steps=80", "hydra.run.dir=same"], slow, tmp_path))
    after = [r for r in slowed if r["train/step"] > 50][0]
    assert exchanges(tmp_path / "same")[0]["train/step"] == after["train/step"]  # the period under way, as planned
    check_ok(run_cli([*resume, "averager.comm_budget=0.5", "hydra.run.dir=budget"], slow, tmp_path))
    budget = [r["averager/period"] for r in exchanges(tmp_path / "budget")[1:-1]]
    assert budget and all(r <= 8 for r in budget), budget
    check_ok(run_cli([*resume, "train.steps=200", "hydra.run.dir=link"], pace, tmp_path))
    link = [r["averager/period"] for r in exchanges(tmp_path / "link")[1:-1]]
    assert len(link) >= 3 and link[0] >= 24 and link[-1] < 16, link  # over loopback it exchanges often
    for run in ("slow", "same", "budget", "link"):  # every replica the same steps
        assert all(r["replica/local_steps/0"] == r["replica/local_steps/1"] for r in exchanges(tmp_path / run)), run
