"""The arithmetic under the multi-rank runs, checked in one process in a few
seconds: the averaging schedules and the one warmup test, DiLoCo's fragment
plan and sync, the byte accounting of the cross-replica mean, gradient
clipping, the FLOP count, the learning-rate schedules and the weight-decay
groups.

A world of 4 runs in this process on torch's fake process group, whose
collectives do nothing: it checks byte counts and buffer shapes, not values.
Values come from a world of 1 on gloo, or two ranks as threads of this process.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness import metrics
from harness.averaging import (
    CrossReplicaTraffic,
    DiLoCoAverager,
    HierarchicalReplicaAverager,
    ReplicaAverager,
    average_local_shards,
    buckets,
    collectives,
    mean_over_group,
    outer_step,
    plan_fragments,
)
from harness.clock import Clock, Schedule, Tick
from harness.config import AdamWConf
from harness.lr_schedules import build_lr_schedule
from harness.models import GPT, Llama, TokenMLP
from harness.models.hf import HFCausalLM
from harness.optim import build_local_optimizer, clip_grad_norm_


@pytest.fixture
def fake_world_of_4():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield dist.group.WORLD
    dist.destroy_process_group()


def ticks(schedule: Schedule, steps: int = 17, replicas: int = 1) -> list[Tick]:
    """Replica 0's ticks of a run of `steps` steps on `schedule`, its replicas in step (no figures shared)."""
    clock, out = Clock(schedule, steps, replicas, 0, True, 1, torch.device("cpu")), []
    while not clock.finished:
        out.append(clock.next())
        clock.advance()
    return out


def averager_schedule(averager: str, **keys) -> Schedule:
    return {"periodic": ReplicaAverager, "diloco": DiLoCoAverager, "hierarchical": HierarchicalReplicaAverager}[
        averager
    ].schedule(OmegaConf.create(keys))


# -- schedules: the clock's ticks on the averagers' fixed schedules ---------------------


def test_warmup_steps_are_synchronous_and_replicas_diverge_after_the_first_local_step():
    for warmup in (3, 0):
        schedule = averager_schedule("periodic", period=4, warmup_steps=warmup)
        clock = Clock(schedule, 17, 1, 0, True, 1, torch.device("cpu"))
        synchronous, ends, diverged = [], [], [clock.diverged]
        while not clock.finished:
            tick = clock.next()
            synchronous.append(tick.synchronous)
            ends.append(tick.starts_alone)
            clock.advance()
            diverged.append(clock.diverged)
        assert [s for s, sync in enumerate(synchronous) if sync] == list(range(warmup))
        assert [s for s, start in enumerate(ends) if start] == [warmup]  # the first local step
        assert [done for done, d in enumerate(diverged) if not d] == list(range(warmup + 1))  # after W steps: equal


@pytest.mark.parametrize(
    "period, warmup, expected",
    [
        (4, 3, [3, 7, 11, 15, 16]),
        (1, 0, list(range(17))),
        (3, 0, [0, 3, 6, 9, 12, 15, 16]),
        (1, 5, list(range(5, 17))),
        (16, 2, [2, 16]),
    ],
)
def test_periodic_averages_after_iteration_warmup_plus_k_periods(period, warmup, expected):
    """PyTorch's PeriodicModelAverager: after 0-based iteration `warmup + k·period`; and after the run's last
    (16: the 17th step), which ends a cut period so that the run ends with one model."""
    schedule = averager_schedule("periodic", period=period, warmup_steps=warmup)
    assert [t.local for t in ticks(schedule) if t.exchange is not None] == expected
    assert [t.step for t in ticks(schedule)] == list(range(1, 18))  # replicas in step: one step a tick


def test_hierarchical_averages_within_the_group_of_the_largest_dividing_period():
    """PyTorch's HierarchicalModelAverager: past warmup, the largest period dividing the iteration."""
    for warmup, expected in ((3, {4: 2, 6: 2, 8: 8, 10: 2, 12: 2, 14: 2, 16: 8}), (0, {0: 8, 2: 2, 4: 2, 6: 2, 8: 8})):
        schedule = averager_schedule("hierarchical", period_group_size=[[2, 2], [8, 4]], warmup_steps=warmup)
        met = {
            t.local: 8 if t.exchange is not None else t.level and t.level.period for t in ticks(schedule, replicas=4)
        }
        assert {s: p for s, p in met.items() if p and s <= max(expected)} == expected


@pytest.mark.parametrize(
    "fragments, period, warmup, expected",
    [
        (1, 4, 2, {5: 0, 9: 0, 13: 0, 16: 0}),
        (1, 4, 0, {3: 0, 7: 0, 11: 0, 15: 0, 16: 0}),  # after steps 4, 8, 12, ... (1-based), as torchft's DiLoCo
        (2, 4, 2, {3: 0, 5: 1, 7: 0, 9: 1, 11: 0, 13: 1, 15: 0, 16: 1}),
        (4, 8, 0, {1: 0, 3: 1, 5: 2, 7: 3, 9: 0, 11: 1, 13: 2, 15: 3, 16: 0}),
        (4, 4, 1, {s: (s - 1) % 4 for s in range(1, 17)}),
    ],
)
def test_each_fragment_syncs_once_per_period_after_its_offset(fragments, period, warmup, expected):
    """Fragment f first syncs after (f + 1)·period/F local steps, then every period (torchft's schedule); the
    run's last step (16: the 17th) ends its cut period with a sync of every fragment (its turn's logged)."""
    keys = {"period": period, "warmup_steps": warmup, "fragments": fragments, "sync_delay": 0}
    due = {t.local: t.exchange for t in ticks(averager_schedule("diloco", **keys))}
    assert {s: f for s, f in due.items() if f is not None} == expected


def test_one_fragment_syncs_a_period_later_than_periodic_less_one_step():
    """periodic averages after local step 1, 1 + P, ...; DiLoCo after P, 2P, ...: with one
    more warmup step DiLoCo syncs where periodic does, but its first one (tests/test_diloco.py)."""
    for period, warmup in [(1, 0), (4, 2), (5, 7)]:
        keys = {"period": period, "fragments": 1, "sync_delay": 0}
        diloco = ticks(averager_schedule("diloco", warmup_steps=warmup + 1, **keys), 40)
        periodic = ticks(averager_schedule("periodic", period=period, warmup_steps=warmup), 40)
        synced = [t.local for t in diloco if t.exchange is not None]
        assert synced == [t.local for t in periodic if t.exchange is not None and t.local >= warmup + period]


def test_replica_averager_averages_where_the_clock_says(world_of_1):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    traffic = CrossReplicaTraffic()
    clock = Clock(averager_schedule("periodic", period=2, warmup_steps=3), 8, 1, 0, True, 1, torch.device("cpu"))
    averager = ReplicaAverager(mesh=mesh, traffic=traffic, clock=clock)
    param = torch.ones(5)
    averaged, synchronous = [], []
    while not clock.finished:
        synchronous.append(clock.next().synchronous)
        averager.before_step()
        averager.average_parameters([param])
        averaged.append(traffic.step_metrics(averager.step)[metrics.AVERAGER_AVERAGED])
        clock.advance()
    assert synchronous == [True] * 3 + [False] * 5
    assert averaged == [0, 0, 0, 1, 0, 1, 0, 1]  # after iterations 3, 5, 7
    assert averager.step == 8


# -- DiLoCo's fragments and sync ---------------------------------------------------


def tiny_mlp() -> TokenMLP:
    # units by size: 4 blocks of 296 (ln 16, fc 8*16+16, out_proj 16*8+8), tok_emb 256, head 256, ln_f 16
    with torch.device("meta"):
        return TokenMLP(n_layer=4, d_model=8, hidden=16, vocab_size=32)


def fragment_units(model: torch.nn.Module, plan: list[list[int]]) -> list[set[str]]:
    """Each fragment as the set of units it holds (`blocks.2`, `head`, ...)."""
    names = [n for n, _ in model.named_parameters()]
    unit = lambda name: ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]  # noqa: E731
    return [{unit(names[i]) for i in fragment} for fragment in plan]


@pytest.mark.parametrize(
    "count, expected",
    [
        (1, [{"tok_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"}]),
        # largest unit first onto the lightest fragment (the first of equals)
        (2, [{"blocks.0", "blocks.2", "tok_emb", "ln_f"}, {"blocks.1", "blocks.3", "head"}]),
        (4, [{"blocks.0", "tok_emb"}, {"blocks.1", "head"}, {"blocks.2", "ln_f"}, {"blocks.3"}]),
    ],
)
def test_plan_fragments_balances_whole_units(count, expected):
    model = tiny_mlp()
    plan = plan_fragments(model, count)
    assert fragment_units(model, plan) == expected
    units = [u for fragment in fragment_units(model, plan) for u in fragment]
    assert len(units) == len(set(units))  # a unit is never split across fragments
    assert sorted(i for fragment in plan for i in fragment) == list(range(len(list(model.parameters()))))
    assert all(fragment == sorted(fragment) for fragment in plan)  # indices in model order
    assert plan == plan_fragments(tiny_mlp(), count)  # deterministic


def test_plan_fragments_of_a_gpt_is_balanced_to_within_its_largest_unit():
    with torch.device("meta"):
        model = GPT(n_layer=6, n_head=2, d_model=16, vocab_size=64, seq_len=32)
    params = list(model.parameters())
    largest_unit = max(
        sum(p.numel() for p in unit.parameters()) for unit in [*model.blocks, model.tok_emb, model.pos_emb, model.head]
    )
    for count in (2, 3, 4):
        plan = plan_fragments(model, count)
        sizes = [sum(params[i].numel() for i in fragment) for fragment in plan]
        assert sum(sizes) == sum(p.numel() for p in params)
        assert max(sizes) - min(sizes) <= largest_unit, sizes


def test_plan_fragments_places_a_tied_embedding_once():
    with torch.device("meta"):
        model = Llama(vocab_size=64, d_model=16, n_layer=2, n_heads=2, tie_embeddings=True, seq_len=8)
    for count in (1, 2):
        indices = sorted(i for fragment in plan_fragments(model, count) for i in fragment)
        assert indices == list(range(len(list(model.parameters())))), indices


def test_outer_step_moves_outer_by_the_mean_pseudo_gradient(world_of_1):
    local = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0, 5.0]])]
    outer = [torch.tensor([3.0, 2.0, 1.0]), torch.tensor([[0.0, 5.0]])]
    optimizer = torch.optim.SGD(outer, lr=0.5)
    nbytes, sums = outer_step(local, outer, optimizer, dist.group.WORLD, torch.float32)
    # one replica: mean Δ = Δ = outer - local; outer ← outer - 0.5 Δ; local ← outer
    expected = [torch.tensor([2.0, 2.0, 2.0]), torch.tensor([[2.0, 5.0]])]
    for t, e in zip([*outer, *local], [*expected, *expected]):
        torch.testing.assert_close(t, e, rtol=0, atol=0)
    assert all(t.grad is None for t in outer)
    assert nbytes == 5 * 4
    # [Σ‖θ_local - mean θ_local‖², Σ‖mean θ_local‖², Σ‖mean Δ‖²] before the step
    assert sums.tolist() == [0.0, 1 + 4 + 9 + 16 + 25, 4 + 0 + 4 + 16 + 0]


# -- the cross-replica mean: bytes and values ---------------------------------------


@pytest.mark.parametrize("numel, chunk", [(10, 3), (8, 2), (1, 1)])
def test_mean_over_group_counts_bytes_in_the_dtype_sent(fake_world_of_4, monkeypatch, numel, chunk):
    assert mean_over_group(torch.ones(numel), fake_world_of_4, torch.float32) == numel * 4
    assert mean_over_group(torch.ones(numel, dtype=torch.float64), fake_world_of_4, torch.float64) == numel * 8
    exchanged = []
    all_to_all, all_gather = dist.all_to_all_single, dist.all_gather_into_tensor
    monkeypatch.setattr(
        dist, "all_to_all_single", lambda out, inp, **kw: exchanged.append(inp) or all_to_all(out, inp, **kw)
    )
    monkeypatch.setattr(
        dist, "all_gather_into_tensor", lambda out, inp, **kw: exchanged.append(inp) or all_gather(out, inp, **kw)
    )
    # bf16: exactly half, counted from the tensor's own elements, not the padding to 4 equal chunks
    assert mean_over_group(torch.ones(numel), fake_world_of_4, torch.bfloat16) == numel * 2
    sent, mine = exchanged
    assert (sent.dtype, sent.numel()) == (torch.bfloat16, 4 * chunk)  # every member's chunk, padded
    assert (mine.dtype, mine.numel()) == (torch.bfloat16, chunk)  # this rank's summed chunk


def test_average_local_shards_counts_every_bucket(fake_world_of_4, monkeypatch):
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 64)  # 16 float32 per bucket
    params = [torch.ones(10), torch.ones(10), torch.ones(3, 5), torch.ones(7, dtype=torch.float64)]
    assert list(buckets(params)) == [[0], [1], [2], [3]]
    _, nbytes, _ = average_local_shards(
        [{"params": params[:2]}, {"params": params[2:]}], fake_world_of_4, torch.float32
    )
    assert nbytes == (10 + 10 + 15 + 7) * 4  # in the dtype sent: the float64 bucket crosses as float32
    _, nbytes, _ = average_local_shards(params[:3], fake_world_of_4, torch.bfloat16)
    assert nbytes == (10 + 10 + 15) * 2


def test_buckets_are_runs_of_one_dtype_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 64)
    sizes = [(4, torch.float32), (2, torch.bfloat16), (8, torch.float32), (8, torch.float32), (1, torch.float32)]
    tensors = [torch.ones(n, dtype=dtype) for n, dtype in sizes] + [torch.ones(40)]
    assert list(buckets(tensors)) == [[0], [1], [2, 3], [4], [5]]  # 16 floats fit, 17 do not; too big goes alone


def test_mean_over_a_world_of_one_keeps_the_values(world_of_1):
    x = torch.randn(11, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    assert mean_over_group(y, world_of_1, torch.float32) == 44
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert mean_over_group(y, world_of_1, torch.bfloat16) == 22
    torch.testing.assert_close(y, x.bfloat16().float(), rtol=0, atol=0)  # rounded to bf16 on the wire, once
    params = [x.clone(), x[:4].clone()]
    time_s, nbytes, drift = average_local_shards(params, world_of_1, torch.float32)
    assert (nbytes, drift) == (15 * 4, 0.0) and time_s >= 0
    torch.testing.assert_close(params[0], x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_eight_bit_mean_is_within_its_stated_error_and_counts_values_and_scales(world_of_1, dtype):
    """Each QUANT_BLOCK block crosses as 8-bit values plus an fp32 scale, twice
    (to the member that sums it, back from it): per element the error is at most
    two quantisation errors, each max|block| / 254 for int8 (half a step) and
    2^-4 of the value for float8_e4m3fn (3 mantissa bits; near zero half its
    subnormal step)."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, 3000)
    y = x.clone()
    blocks = -(-3000 // collectives.QUANT_BLOCK)
    assert mean_over_group(y, world_of_1, dtype) == blocks * collectives.QUANT_BLOCK + blocks * 4
    padded = torch.zeros(blocks * collectives.QUANT_BLOCK)
    padded[:3000] = x
    block_max = padded.view(blocks, -1).abs().amax(1).repeat_interleave(collectives.QUANT_BLOCK)[:3000]
    if dtype == torch.int8:
        bound = 2 * block_max / 254
    else:  # half an ulp: 2^-4 relative, or half the subnormal step (2^-9 of the scale) near zero
        bound = 2 * (x.abs() * 2**-4 * (1 + 2**-4) + block_max / 448 * 2**-10)
    assert torch.all((y - x).abs() <= bound * (1 + 1e-6)), (y - x).abs().max()
    assert not torch.equal(y, x)
    # started (a delayed DiLoCo sync): halfway the all-gather starts, the mean lands at the wait
    z = x.clone()
    mean = collectives.start_mean_over_group(z, world_of_1, dtype)
    mean.advance()
    assert torch.equal(z, x)
    mean.wait()
    assert torch.equal(z, y)


# -- gradient clipping ---------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    ours = [torch.zeros(s, requires_grad=True) for s in shapes] + [torch.zeros(3, requires_grad=True)]  # no grad
    theirs = [torch.zeros(s, requires_grad=True) for s in shapes]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm > 0 else float("inf"))
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    if max_norm == 0.5:
        total = torch.cat([a.grad.reshape(-1) for a in ours[:3]]).norm()
        torch.testing.assert_close(total, torch.tensor(0.5), rtol=1e-5, atol=0)


# -- FLOP count --------------------------------------------------------------------


def test_gpt_flops_per_token_follow_the_shapes():
    n_layer, d, vocab, seq_len = 3, 16, 64, 32
    with torch.device("meta"):
        model = GPT(n_layer=n_layer, n_head=4, d_model=d, vocab_size=vocab, seq_len=seq_len)
    matmul_weights = n_layer * (3 * d * d + d * d + 4 * d * d + 4 * d * d) + vocab * d  # qkv, out, fc, out; head
    biases = n_layer * (3 * d + d + 4 * d + d)
    norms = n_layer * 2 * 2 * d + 2 * d  # every non-embedding parameter counts, as in torchtitan
    attention = 12 * n_layer * d * seq_len
    assert model.flops_per_token(seq_len) == 6 * (matmul_weights + biases + norms) + attention


def test_mlp_flops_per_token_have_no_attention_term():
    n_layer, d, hidden, vocab = 2, 8, 24, 32
    with torch.device("meta"):
        model = TokenMLP(n_layer=n_layer, d_model=d, hidden=hidden, vocab_size=vocab)
    weights = n_layer * (2 * d + d * hidden + hidden + hidden * d + d) + 2 * d + vocab * d
    assert model.flops_per_token(128) == 6 * weights


def test_diloco_config_rules_report_every_broken_rule():
    cfg = OmegaConf.create(
        {
            "averager": {
                "period": 4,
                "warmup_steps": -1,
                "fragments": 3,
                "outer_optimizer": None,
                "sync_delay": 4,
                "mix": 1.5,
            },
            "model": {"_target_": "harness.models.TokenMLP", "n_layer": 2, "d_model": 8, "hidden": 8, "vocab_size": 8},
            "train": {"seq_len": 8},
        }
    )
    errors = DiLoCoAverager.config_errors(cfg, 2)
    assert [e.split(" ")[0] for e in errors] == [
        "averager.warmup_steps=-1",
        "averager.outer_optimizer",
        "averager.sync_delay=4",  # at least the 4 / 3 steps between fragment syncs
        "averager.mix=1.5",
        "averager.fragments=3",
    ]


# -- learning-rate schedules -----------------------------------------------------


def lrs_of(schedule_cfg: dict, total_steps: int, in_backward: bool = False) -> list[list[float]]:
    """The learning rate each of `total_steps` steps trains at, for every optimizer the schedule drives."""
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    optimizer_cfg = OmegaConf.create(
        {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.5, "in_backward": in_backward}
    )
    optimizer = build_local_optimizer(optimizer_cfg, params, torch.device("cpu"))
    schedule = build_lr_schedule(OmegaConf.create(schedule_cfg), optimizer, total_steps)
    trained_at = []
    for _ in range(total_steps):
        optimizers = optimizer.optimizers if in_backward else [optimizer]
        trained_at.append([o.param_groups[0]["lr"] for o in optimizers])
        assert trained_at[-1][0] == schedule.lr
        for o in optimizers:  # as the loop: the optimizer steps, then the schedule
            o.step()
        schedule.step()
    return trained_at


def test_warmup_cosine_ramps_up_then_decays_to_its_minimum_at_the_last_step():
    cfg = {"_target_": "harness.lr_schedules.WarmupCosine", "warmup_steps": 4, "min_lr_ratio": 0.1}
    lrs = [lr for [lr] in lrs_of(cfg, 12)]
    assert lrs[:4] == pytest.approx([0.125, 0.25, 0.375, 0.5])
    assert lrs[4] == pytest.approx(0.5) and lrs[-1] == pytest.approx(0.05)
    middle = 0.05 + 0.45 * 0.5 * (1 + math.cos(math.pi * 3 / 7))  # step index 7: 3 of 7 decay steps done
    assert lrs[7] == pytest.approx(middle)
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))


def test_wsd_is_flat_until_its_decay_then_linear_to_the_minimum():
    cfg = {"_target_": "harness.lr_schedules.WarmupStableDecay", "warmup_steps": 2, "decay_fraction": 0.25}
    lrs = [lr for [lr] in lrs_of({**cfg, "min_lr_ratio": 0.0}, 12)]
    assert lrs == pytest.approx([0.25, 0.5, *[0.5] * 7, 0.5 * 2 / 3, 0.5 / 3, 0.0])


def test_step_decay_multiplies_by_gamma_after_each_milestone_for_every_in_backward_optimizer():
    cfg = {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [2, 4], "gamma": 0.1}
    lrs = lrs_of(cfg, 6, in_backward=True)
    assert all(len(set(step)) == 1 and len(step) == 3 for step in lrs)  # every parameter's optimizer follows
    assert [step[0] for step in lrs] == pytest.approx([0.5, 0.5, 0.05, 0.05, 0.005, 0.005])


def test_schedule_position_round_trips_through_a_checkpoint_part():
    cfg = OmegaConf.create({"_target_": "harness.lr_schedules.WarmupCosine", "warmup_steps": 3, "min_lr_ratio": 0.0})
    make = lambda: build_lr_schedule(  # noqa: E731
        cfg, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), total_steps=10
    )
    trained, resumed = make(), make()
    for _ in range(5):
        trained.schedulers[0].optimizer.step()
        trained.step()
    state = json.loads(json.dumps(trained.state_dict()))  # meta.json holds it
    resumed.load_state_dict({"step": 5, **state})
    assert resumed.lr == trained.lr
    for lr_schedule in (trained, resumed):
        lr_schedule.schedulers[0].optimizer.step()
        lr_schedule.step()
    assert resumed.lr == trained.lr and resumed.schedulers[0].last_epoch == 6


# -- weight-decay groups -------------------------------------------------------------

GPT_MATRICES = {  # every parameter of 2 dimensions in a 1-block untied GPT: the ones weight decay falls on by default
    "tok_emb.weight",
    "pos_emb.weight",
    "blocks.0.attn.qkv.weight",
    "blocks.0.attn.out_proj.weight",
    "blocks.0.mlp.fc.weight",
    "blocks.0.mlp.out_proj.weight",
    "head.weight",
}


def one_block_gpt() -> GPT:
    return GPT(n_layer=1, n_head=2, d_model=8, vocab_size=16, seq_len=4, tie_embeddings=False)


def adamw(**overrides):
    """The adamw schema's defaults (weight_decay 0.01, decay_1d false) with `overrides`."""
    return OmegaConf.merge(OmegaConf.structured(AdamWConf), overrides)


def decay_by_fqn(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}


def test_weight_decay_falls_on_matrices_only_by_default():
    model = one_block_gpt()
    optimizer = build_local_optimizer(adamw(), model.parameters(), torch.device("cpu"))
    assert len(optimizer.param_groups) == 2
    decays = decay_by_fqn(model, optimizer)
    assert decays.keys() == dict(model.named_parameters()).keys()
    assert {n for n, d in decays.items() if d == 0.01} == GPT_MATRICES
    vectors = {n for n, p in model.named_parameters() if p.ndim == 1}
    assert {n for n, d in decays.items() if d == 0.0} == vectors  # biases, LayerNorm weights and biases
    assert {"blocks.0.ln_attn.weight", "blocks.0.attn.qkv.bias", "ln_f.bias"} <= vectors


@pytest.mark.parametrize("overrides", [{"decay_1d": True}, {"weight_decay": 0.0}], ids=["decay_1d", "no decay"])
def test_decay_1d_or_no_weight_decay_keeps_one_group(overrides):
    model = one_block_gpt()
    optimizer = build_local_optimizer(adamw(**overrides), model.parameters(), torch.device("cpu"))
    [group] = optimizer.param_groups
    assert len(group["params"]) == len(list(model.parameters()))
    assert group["weight_decay"] == overrides.get("weight_decay", 0.01)


def test_in_backward_gives_each_parameters_optimizer_its_decay():
    model = one_block_gpt()
    optimizer = build_local_optimizer(adamw(in_backward=True), model.parameters(), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    decays = {}
    for per_parameter in optimizer.optimizers:
        [group] = per_parameter.param_groups
        [param] = group["params"]
        decays[names[id(param)]] = group["weight_decay"]
    assert {n for n, d in decays.items() if d == 0.01} == GPT_MATRICES
    assert len(decays) == len(names) and set(decays.values()) == {0.01, 0.0}


def test_fsdp2_parameters_and_their_local_shards_group_by_the_full_tensors_dimensions(world_of_1):
    """Under FSDP2 the parameters are DTensors, whose `ndim` is the full
    tensor's; DiLoCo's outer optimizer steps their local shards, which keep it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from harness.averaging.diloco import OuterState

    model = one_block_gpt()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    optimizer = build_local_optimizer(adamw(), model.parameters(), torch.device("cpu"))
    assert {n for n, d in decay_by_fqn(model, optimizer).items() if d == 0.01} == GPT_MATRICES
    outer = OuterState(model, adamw(), "device", 1, world_of_1)
    by_tensor = {id(t): n for n, t in zip(outer.names, outer.tensors)}
    outer_decays = {by_tensor[id(t)]: g["weight_decay"] for g in outer.optimizer.param_groups for t in g["params"]}
    assert {n for n, d in outer_decays.items() if d == 0.01} == GPT_MATRICES


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_flops_per_token_are_torchtitans_count(tie):
    """torchtitan's 6 * (parameters - embedding table) + 12 * layers * heads * head_dim * seq_len,
    by hand for a GQA shape; a tied table is the output projection too, so it counts then.
    transformers' Llama of the same shape (model=hf) is counted the same way."""
    n_layer, d, heads, kv_heads, vocab, seq_len = 3, 64, 8, 2, 100, 32
    with torch.device("meta"):
        model = Llama(vocab, d, n_layer, heads, kv_heads, multiple_of=32, ffn_dim_multiplier=1.3, tie_embeddings=tie)
    hidden = 224  # int(1.3 * int(2 * 4 * 64 / 3)) = 221, rounded up to a multiple of 32
    head_dim = d // heads
    block = d * d + 2 * d * kv_heads * head_dim + d * d + 3 * d * hidden + 2 * d  # wq, wk + wv, wo, SwiGLU, norms
    output = vocab * d  # the output projection (the table itself is a lookup)
    expected = 6 * (n_layer * block + d + output) + 12 * n_layer * heads * head_dim * seq_len
    assert model.flops_per_token(seq_len) == expected
    shape = {k: model.hf_config()[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")}
    shape.update(num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie)
    assert HFCausalLM(vocab, config_overrides=shape).flops_per_token(seq_len) == expected


class Doubled:
    """A stand-in for the mean over the replicas, started on a flat tensor: `wait()` negates and doubles it,
    so a gradient that went through the reduction and came back is told apart from autograd's."""

    def __init__(self, flat: torch.Tensor, calls: list):
        self.flat = flat
        calls.append((flat.numel(), flat.dtype))

    def wait(self) -> None:
        self.flat.mul_(-2)


def three_linears() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))  # 6 tensors


@pytest.mark.parametrize("bucket_bytes,calls", [(0, 6), (600, 3), (2**20, 1)])
def test_a_one_device_replicas_gradients_reach_the_hook_once_in_buckets(bucket_bytes, calls):
    """GradientReduction hands every gradient to the cross-replica mean once, in reduce_dtype, and
    takes the result back: one parameter at a time (0), or in flat buckets of about `bucket_bytes`
    in reverse parameter order (3: 352, 576 and 512 bytes here), waited for when backward ends,
    then the mask of which of the 6 tensors have a gradient on this rank (all: nothing to read back)."""
    from harness.averaging import GradientReduction

    model = three_linears()
    reference = copy.deepcopy(model)
    inputs = torch.randn(5, 8)
    reference(inputs).square().sum().backward()
    seen = []
    reduction = GradientReduction(model, torch.float64, bucket_bytes)
    reduction.set_all_reduce_hook(lambda flat: Doubled(flat, seen), active=lambda: True)
    mask = [(6, torch.float64)] if bucket_bytes else []
    for _ in range(2):  # the buckets' buffers are kept from one backward to the next
        model.zero_grad(set_to_none=True)
        seen.clear()
        model(inputs).square().sum().backward()
        assert len(seen) == calls + len(mask) and {dtype for _, dtype in seen} == {torch.float64}
        assert sum(n for n, _ in seen[:calls]) == sum(p.numel() for p in model.parameters())
        assert seen[calls:] == mask
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine.grad, -2 * theirs.grad)
    # two micro-batches: the first only accumulates (no mean, the buffers kept), the last reduces the sum
    buffers = [bucket.flat for bucket in reduction.buckets or []]
    model.zero_grad(set_to_none=True)
    seen.clear()
    reduction.set_requires_gradient_sync(False)
    model(inputs).square().sum().backward()
    kept = [bucket.flat for bucket in reduction.buckets or []]
    assert seen == [] and len(kept) == len(buffers) and all(a is b for a, b in zip(buffers, kept))
    reduction.set_requires_gradient_sync(True)
    model(inputs).square().sum().backward()
    assert len(seen) == calls + len(mask)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, -2 * (theirs.grad + theirs.grad))


def two_ranks_in_threads(work):
    """`work(rank, group)` on two ranks, threads of this process with a gloo group of their own (gloo's
    waits release the GIL; autograd runs each thread's backward and its hooks on that thread)."""
    store, results, errors = dist.HashStore(), {}, []

    def rank(r: int) -> None:
        try:
            results[r] = work(r, dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30)))
        except BaseException as e:  # the other rank then times out in its collective
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[0], results[1]]


# which branches of `Branches` rank r's micro-batch m goes through, 2 micro-batches a step: b only on the
# first micro-batch, c on rank 0's first only, d never, e on rank 1's last only (every rank's last backward
# must produce the same gradients with bucket_bytes=0: each is reduced in its own hook)
USES = {(0, 0): "abc", (0, 1): "a", (1, 0): "ab", (1, 1): "ae"}
USES_ALONE = {k: v.replace("e", "") for k, v in USES.items()}


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.branch = torch.nn.ModuleDict({name: torch.nn.Linear(4, 4) for name in "abcde"})

    def forward(self, inputs: torch.Tensor, names: str) -> torch.Tensor:
        return sum(self.branch[name](inputs).square().sum() for name in names)


@pytest.mark.parametrize("bucket_bytes", [0, 100, 2**20])  # one parameter at a time, 9 buckets, one
def test_accumulated_gradients_the_last_micro_batch_skips_are_averaged_and_unused_ones_stay_none(bucket_bytes):
    """Two replicas, 2 micro-batches a step, the first only accumulating: every gradient comes back as
    the mean over the replicas of what each accumulated over the step (zeros where a replica has none),
    those the last micro-batch did not produce included, and a parameter no replica used keeps none
    (as on a local step: no weight decay, no momentum), as DDP's reducer with find_unused_parameters."""
    from harness.averaging import GradientReduction
    from harness.averaging.hooks import reduce_over_replicas
    from harness.averaging.link import MeshLink

    uses = USES_ALONE if bucket_bytes == 0 else USES
    model = Branches()
    inputs = {key: torch.randn(3, 4) for key in uses}
    accumulated = []  # each rank's gradients over one step, autograd's alone
    for r in range(2):
        alone = copy.deepcopy(model)
        for m in range(2):
            alone(inputs[r, m], uses[r, m]).backward()
        accumulated.append({n: p.grad for n, p in alone.named_parameters()})

    def replica(rank: int, group: dist.ProcessGroup) -> list[dict]:
        mine = copy.deepcopy(model)
        reduction = GradientReduction(mine, torch.float32, bucket_bytes)
        reduce_over_replicas(mine, reduction, MeshLink(group), CrossReplicaTraffic())
        steps = []
        for _ in range(2):  # the buckets and what a step leaves are kept to the next
            mine.zero_grad(set_to_none=True)
            for m in range(2):
                reduction.set_requires_gradient_sync(m == 1)
                mine(inputs[rank, m], uses[rank, m]).backward()
            steps.append({n: None if p.grad is None else p.grad.clone() for n, p in mine.named_parameters()})
        return steps

    for rank, steps in enumerate(two_ranks_in_threads(replica)):
        for step in steps:
            for name, grad in step.items():
                mine, theirs = accumulated[0][name], accumulated[1][name]
                if mine is None and theirs is None:
                    assert grad is None, f"rank {rank}: {name} has a gradient no replica produced"
                    continue
                mean = sum(g if g is not None else torch.zeros_like(grad) for g in (mine, theirs)) / 2
                assert torch.equal(grad, mean), f"rank {rank}: {name} {grad.sum():.4f}, expected {mean.sum():.4f}"


# bucket_bytes in bf16: the last layer's 2 tensors, then one each (the first bucket is in flight when backward
# raises); or 3 buckets, the first not full when backward raises
@pytest.mark.parametrize("bucket_bytes,started,buckets", [(80, 1, 5), (150, 0, 3)])
def test_a_backward_that_raises_leaves_the_next_reduction_whole_and_a_local_one_untouched(
    bucket_bytes, started, buckets
):
    """A backward that raises halfway leaves nothing behind: the next backwards' gradients all come back
    reduced. A backward whose gradients do not cross replicas
    (past the warmup) dispatches no op of the reduction's and leaves autograd's gradients bit for bit,
    in a bfloat16 reduce_dtype too."""
    from harness.averaging import GradientReduction
    from harness.profiling import DispatchCounter

    model = three_linears()
    reference = copy.deepcopy(model)
    inputs = torch.randn(5, 8)
    reference(inputs).square().sum().backward()
    seen, crosses, fail = [], [True], [True]
    reduction = GradientReduction(model, torch.bfloat16, bucket_bytes)
    reduction.set_all_reduce_hook(lambda flat: Doubled(flat, seen), active=lambda: crosses[0])

    def forward() -> torch.Tensor:
        hidden = model[1](model[0](inputs))
        if fail[0]:  # raises in backward once the last layer's gradients (the first bucket) are in
            hidden.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory")))
        return model[2](hidden).square().sum()

    with pytest.raises(RuntimeError, match="out of memory"):
        forward().backward()
    assert len(seen) == started
    fail[0] = False
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        seen.clear()
        forward().backward()
        assert len(seen) == buckets + 1  # and the mask of which tensors have a gradient
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine.grad, (-2 * theirs.grad.bfloat16()).float())

    crosses[0] = False
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    with DispatchCounter() as local:
        forward().backward()
    with DispatchCounter() as plain:
        reference(inputs).square().sum().backward()
    assert reduction.buckets is None, "past the warmup the buckets' buffers are released"
    assert local.total == plain.total, f"the reduction dispatched {local.total - plain.total} ops of its own"
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
