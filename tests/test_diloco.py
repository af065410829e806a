"""DiLoCo and Streaming DiLoCo with real ranks: outer SGD at lr 1 is post-local
SGD, fragments sync once per period each, bf16 halves the bytes, the outer
state reshards with the model, and the eval pass scores held-out data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_config import make

from harness.models import build_model

from support import FAST, REPO, check_ok, loss_by_step, read_metrics, run_cli, saved_state

# 2 replicas of the tiny MLP; warmup 2, period 4: periodic averages after steps 3, 7 and 11, DiLoCo after 6 and 10
LOCAL = ["launcher.nproc=2", "sharding=no_shard", "optimizer=adamw", "averager.period=4", "averager.warmup_steps=2"]
OUTER_IS_AVERAGE = [
    "averager=diloco",
    "averager.outer_optimizer.lr=1.0",
    "averager.outer_optimizer.momentum=0",
    "averager.outer_optimizer.nesterov=false",
]


def train(run_dir: Path, env: dict, *overrides: str) -> list[dict]:
    check_ok(run_cli([*FAST, f"hydra.run.dir={run_dir}", *overrides], env, REPO))
    return read_metrics(run_dir)


def syncs(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if r.get("averager/averaged")}


@pytest.mark.slow
def test_outer_sgd_at_lr_1_is_post_local_sgd_and_narrow_dtypes_cut_the_bytes(tmp_path, cli_env):
    """DiLoCo averages Δ = θ_outer - θ_r and steps θ_outer - mean Δ; post-local
    SGD averages θ_r. On the same schedule the two are equal in exact arithmetic.
    The schedules differ by one step: `periodic` (torch's PeriodicModelAverager)
    averages after local steps 1, 1 + P, 1 + 2P, ... past warmup, DiLoCo (the
    paper's, torchft's) after P, 2P, ... So periodic with warmup W runs against
    DiLoCo with warmup W + 1, under plain SGD: periodic's first average, one
    local step from equal parameters and optimizer states, is then DiLoCo's last
    synchronous step (the mean of the parameters after a plain SGD step is the
    step with the mean gradient), and every later sync falls on the same step.
    (Without clipping: clipping each replica's gradient is not clipping their mean.)
    In floats each subtraction rounds, so the two differ in the last bits."""
    common = ["train.steps=11", "checkpoint=full", "checkpoint.interval=3", "checkpoint.keep=4"]
    common += [*LOCAL, "optimizer=sgd", "averager.warmup_steps=2", "train.grad_clip=0"]  # clipping is not linear
    periodic = train(tmp_path / "periodic", cli_env, *common, "averager=periodic")
    diloco = train(tmp_path / "diloco", cli_env, *common, *OUTER_IS_AVERAGE, "averager.warmup_steps=3")
    runs = ("periodic", "diloco")
    after_sync = [saved_state(tmp_path / run / "checkpoints" / "step_9", tmp_path)["model"] for run in runs]
    for key, a in after_sync[0].items():
        torch.testing.assert_close(after_sync[1][key], a, rtol=1e-5, atol=1e-6)
    la, lb = loss_by_step(tmp_path / "periodic"), loss_by_step(tmp_path / "diloco")
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-5)
    assert sorted(syncs(periodic)) == [3, 7, 11] and sorted(syncs(diloco)) == [7, 11]
    assert [r["averager/outer_lr"] for r in syncs(diloco).values()] == [1.0] * 2
    full_sync = {r["comm/averaging_bytes"] for r in syncs(periodic).values()}
    assert {r["comm/averaging_bytes"] for r in syncs(diloco).values()} == full_sync

    whole = full_sync.pop()
    bf16 = train(
        tmp_path / "bf16", cli_env, *LOCAL, "train.steps=11", "averager=periodic", "averager.comm_dtype=bfloat16"
    )
    assert [r["comm/averaging_bytes"] * 2 for r in syncs(bf16).values()] == [whole] * 3
    # int8: a byte per value of whole blocks (1024 values per replica's chunk) plus an fp32 scale per block
    int8 = train(tmp_path / "int8", cli_env, *LOCAL, "train.steps=11", "averager=periodic", "averager.comm_dtype=int8")
    padded = -(-whole // 4 // 2048) * 2048
    assert [r["comm/averaging_bytes"] for r in syncs(int8).values()] == [padded + padded // 1024 * 4] * 3
    assert loss_by_step(tmp_path / "int8")[11] == pytest.approx(loss_by_step(tmp_path / "bf16")[11], rel=1e-3)


@pytest.mark.slow
def test_diloco_ends_where_torchft_diloco_ends(tmp_path, cli_env):
    """The same model, initial weights, batches and optimizers (AdamW inside,
    the paper's Nesterov 0.7/0.9 outside), period 4 from the first step: the harness's
    averager=diloco (2 replicas, FSDP2 no_shard) and torchft's DiLoCo (one
    fragment, tests/probes/torchft_diloco.py) sync after the same steps and end
    on the same parameters, bit for bit, and the same losses."""
    common = [*FAST, "launcher.nproc=2", "sharding=no_shard", "train.steps=12", "train.grad_clip=0"]
    common += ["averager=diloco", "averager/outer_optimizer=nesterov", "averager.period=4", "averager.warmup_steps=0"]
    rows = train(tmp_path / "harness", cli_env, *common, "checkpoint=full")
    assert sorted(syncs(rows)) == [4, 8, 12]
    probe = REPO / "tests" / "probes" / "torchft_diloco.py"
    check_ok(run_cli([str(tmp_path / "torchft.pt"), *common], cli_env, REPO, ranks=2, script=probe))
    theirs = torch.load(tmp_path / "torchft.pt", weights_only=True)
    step = tmp_path / "harness" / "checkpoints" / "step_12"
    for replica, file in enumerate(("full.pt", "replica_1.pt")):
        ours = torch.load(step / file, weights_only=True)["model"]
        assert ours.keys() == theirs["params"][replica].keys()
        for name, value in ours.items():
            assert torch.equal(value, theirs["params"][replica][name]), (replica, name)
    mean_loss = [sum(step_losses) / 2 for step_losses in zip(*theirs["losses"])]
    assert list(loss_by_step(tmp_path / "harness").values()) == pytest.approx(mean_loss, rel=1e-6)


@pytest.mark.slow
def test_fragments_sync_once_per_period_each_split_the_bytes_and_overlap_a_step(tmp_path, cli_env):
    """Period 8, 4 fragments, bf16, sync_delay 1: a fragment's all-reduce starts
    every 2 steps, in turn (its bytes on that step's row), and its outer step is
    applied a step later (the `averager/averaged` row); each start's bytes at most
    1.5/4 of a whole sync, the four together exactly one (in bf16: half of the
    float32 sync). The last step syncs every fragment at once, so the run ends
    with one model."""
    rows = train(
        tmp_path / "run",
        cli_env,
        *LOCAL,
        "model.n_layer=4",
        "train.steps=18",
        "averager=diloco",
        "averager.period=8",
        "averager.fragments=4",
        "averager.comm_dtype=bfloat16",
        "averager.sync_delay=1",
    )
    # the first start after period / fragments = 2 local steps (steps 3 and 4), then one every 2 steps
    started = {r["step"]: r["comm/averaging_bytes"] for r in rows if r["comm/averaging_bytes"]}
    assert sorted(started) == [4, 6, 8, 10, 12, 14, 16, 18]
    synced = syncs(rows)
    assert [(s, r["averager/fragment"]) for s, r in synced.items()] == [
        (5, 0),
        (7, 1),
        (9, 2),
        (11, 3),
        (13, 0),
        (15, 1),
        (17, 2),
        (18, 3),  # every fragment, fragment 3's turn
    ]
    whole = sum(nbytes for s, nbytes in started.items() if s < 12)
    params = sum(p.numel() for p in build_model(make("model=mlp", "model.n_layer=4").model, 16).parameters())
    assert whole == params * 2  # bf16: 2 bytes per parameter, each fragment once per period
    assert max(nbytes for s, nbytes in started.items() if s < 18) <= 1.5 / 4 * whole
    assert started[18] == whole
    default_lr = make("averager=diloco").averager.outer_optimizer.lr
    assert all(r["averager/pseudo_grad_norm"] > 0 and r["averager/outer_lr"] == default_lr for r in synced.values())


@pytest.mark.slow
def test_logged_rows_carry_every_byte_whatever_log_every_is(tmp_path, cli_env):
    """sync_delay 1, log_every 10: the syncs start at steps 6, 10 and 14, only 10
    a log step, and at the run's last, 15 (every fragment, applied at once); each
    logged row carries the bytes since the previous one, so the rows add up to the
    running total and every start's bytes show."""
    rows = train(
        tmp_path / "run",
        cli_env,
        *LOCAL,
        "train.steps=15",
        "train.log_every=10",
        "averager=diloco",
        "averager.sync_delay=1",
    )
    assert sorted(syncs(rows)) == [7, 11, 15]
    whole = 4 * sum(p.numel() for p in build_model(make("model=mlp").model, 16).parameters())
    assert sum(r["comm/averaging_bytes"] for r in rows) == 4 * whole
    sent = sum(r["comm/averaging_bytes"] + r["comm/grad_sync_bytes"] for r in rows)
    assert sent == rows[-1]["comm/cross_replica_bytes_total"]


@pytest.mark.slow
def test_eval_pass_scores_held_out_text_and_leaves_training_unchanged(tmp_path, cli_env):
    common = [*LOCAL, "averager=diloco", "data=text", "model=llama", "model.d_model=64", "model.dropout=0.1"]
    common.append("train.steps=6")
    train(tmp_path / "plain", cli_env, *common)
    rows = train(tmp_path / "eval", cli_env, *common, "train.eval_every=4", "train.eval_batches=2")
    assert [r["step"] for r in rows if "eval/loss" in r] == [4, 6]  # every 4 steps and at the end
    assert loss_by_step(tmp_path / "eval") == loss_by_step(
        tmp_path / "plain"
    )  # dropout is off while scoring and no RNG is drawn
    assert all(0 < r["eval/loss"] < 6 for r in rows if "eval/loss" in r)
