"""Post-local SGD on real ranks: the schedule, bit-identical replicas after
averaging, equivalence with synchronous SGD, hierarchy, DDP, and counted bytes.

Steps are 1-based counts of finished steps: averaging after 0-based iteration
`warmup + k*period` (PyTorch's PeriodicModelAverager) shows at step warmup + k*period + 1.
"""

from __future__ import annotations

import json

import pytest
import torch

from support import REPO, check_ok, run_cli

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "probes" / "replica_probe.py"
SMALL = ["model=mlp", "train.batch_size=4", "train.seq_len=16", "optimizer=sgd"]


def probe(tmp_path, cli_env, nproc: int, *overrides: str) -> list[dict]:
    out = tmp_path / "probe.json"
    check_ok(run_cli([str(out), *SMALL, *overrides], cli_env, tmp_path, ranks=nproc, script=PROBE))
    return json.loads(out.read_text())


def averaged_steps(records) -> list[int]:
    return [r["step"] for r in records if r["averager/averaged"]]


@pytest.mark.parametrize(
    "layout",
    [
        ["sharding=hybrid_shard", "sharding.replicate=2"],  # 4 ranks = 2 replicas x 2 shards (FSDP2)
        ["sharding=ddp"],  # 4 ranks = 4 replicas, PyTorch's post_localSGD_hook for gradients
    ],
    ids=["fsdp2-2x2", "ddp-4x1"],
)
def test_periodic_schedule_and_bit_identical_replicas(layout, tmp_path, cli_env):
    records = probe(
        tmp_path,
        cli_env,
        4,
        *layout,
        "averager=periodic",
        "averager.period=4",
        "averager.warmup_steps=3",
        "train.steps=12",
    )
    assert averaged_steps(records) == [4, 8, 12]
    for r in records:
        all_same = all(all(row) for row in r["same"])
        if r["step"] <= 3 or r["averager/averaged"]:
            assert all_same, f"replicas differ at step {r['step']} (warmup or just averaged)"
        else:
            assert not any(r["same"][0][1:]), f"replicas identical at local step {r['step']}"
        assert r["averager/step"] == r["step"]
        payload = 4 * r["local_numel"]  # fp32 bytes of this rank's local shards
        assert r["comm/grad_sync_bytes"] == (payload if r["step"] <= 3 else 0)
        assert r["comm/averaging_bytes"] == (payload if r["averager/averaged"] else 0)
        if r["averager/averaged"]:
            assert r["averager/drift"] > 0 and r["averager/time_s"] > 0
    if layout == ["sharding=hybrid_shard", "sharding.replicate=2"]:
        assert records[0]["local_numel"] * 2 == sum(p.numel() for p in torch.load(tmp_path / "probe.pt").values())


def test_warmup_is_fully_synchronous_and_never_averages(tmp_path, cli_env):
    records = probe(
        tmp_path, cli_env, 2, "sharding=no_shard", "averager.period=1", "averager.warmup_steps=6", "train.steps=6"
    )
    assert averaged_steps(records) == []
    assert all(r["comm/grad_sync_bytes"] > 0 and all(map(all, r["same"])) for r in records)


def test_period_one_sgd_equals_synchronous_training(tmp_path, cli_env):
    """Plain SGD is linear in the gradient, so averaging parameters after every
    step = averaging gradients before it (clipping off: it is per replica). The
    local run accumulates 2 micro-batches of 2 where the synchronous one takes
    one batch of 4: the same samples per replica, so the same gradients."""
    common = [
        "sharding=hybrid_shard",
        "sharding.replicate=2",
        "train.steps=8",
        "train.grad_clip=0",
        "optimizer.momentum=0",
    ]
    sync_dir, local_dir = tmp_path / "sync", tmp_path / "local"
    sync_dir.mkdir(), local_dir.mkdir()
    sync = probe(sync_dir, cli_env, 4, *common, "averager=none")
    local_sgd = ["averager=periodic", "averager.period=1", "averager.warmup_steps=0"]
    local = probe(local_dir, cli_env, 4, *common, "train.batch_size=2", "train.grad_accum=2", *local_sgd)
    assert averaged_steps(local) == list(range(1, 9))
    assert all(r["comm/grad_sync_bytes"] == 0 for r in local)
    assert all(r["comm/grad_sync_bytes"] > 0 and r["comm/averaging_bytes"] == 0 for r in sync)
    assert [r["train/loss"] for r in local] == pytest.approx([r["train/loss"] for r in sync], rel=1e-5)
    a, b = torch.load(sync_dir / "probe.pt"), torch.load(local_dir / "probe.pt")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_hierarchical_pairs_at_small_period_all_at_large(tmp_path, cli_env):
    records = probe(
        tmp_path,
        cli_env,
        4,
        "sharding=no_shard",
        "averager=hierarchical",
        "averager.period_group_size=[[2,2],[4,4]]",
        "averager.warmup_steps=2",
        "train.steps=9",
    )
    by_step = {r["step"]: r["same"] for r in records}
    # 0-based iterations 2..8: multiples of 4 average all 4 replicas, other even ones pairs {0,1} {2,3}
    assert averaged_steps(records) == [3, 5, 7, 9]
    for step in (5, 9):
        assert all(map(all, by_step[step])), step
    for step in (3, 7):
        same = by_step[step]
        assert same[0][1] and same[2][3] and not same[0][2] and not same[1][3], (step, same)
    for step in (4, 6, 8):
        assert not by_step[step][0][1] and not by_step[step][2][3], step
