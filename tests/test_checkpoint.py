"""Checkpoints with real ranks and real files: bitwise resume in every mode,
resharding, per-replica copies, atomic commits, keep-last-k, load errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import (
    REPO,
    SMALL,
    assert_bitwise_equal,
    check_ok,
    loss_by_step,
    make,
    read_metrics,
    run_cli,
    saved_state,
    steps_saved,
)

LOCAL_SGD = ["optimizer=adamw", "averager=periodic", "averager.period=3"]
# warmup 2: averaging at steps 3, 6, 9, 12, so the replicas have diverged at step 7
LAYOUTS = {
    "2x1": ["launcher.nproc=2", "sharding=no_shard", "averager.warmup_steps=2", *LOCAL_SGD],
    # DDP, 4 replicas: synchronous (4-rank gradient all-reduce) until step 8, then
    # post_localSGD_hook with averaging at 9 and 12; 2 micro-batches per step (no_sync on the first)
    "ddp4": ["launcher.nproc=4", "sharding=ddp", "averager.warmup_steps=8", "train.grad_accum=2", *LOCAL_SGD],
    # 2 replicas x 2 shards (HSDP layout, per-replica copies of shards) of a Llama, with
    # Streaming DiLoCo in bf16 (its 2 blocks are the fragments), overlapped by 2 steps and
    # mixed: fragment 0's sync starts after step 6 and is applied after 8, fragment 1's
    # after 10 and 12, so the checkpoints at 7 and 10 fall inside a delay window (their
    # mean pseudo-gradient in flight), at 9 only fragment 0 has outer-optimizer state
    "2x2-diloco": [
        "launcher.nproc=4",
        "model=llama",
        "model.d_model=64",
        "sharding=hybrid_shard",
        "sharding.replicate=2",
        "optimizer=adamw",
        "averager=diloco",
        "averager/outer_optimizer=nesterov",  # with momentum: outer optimizer state to save
        "averager.period=8",
        "averager.fragments=2",
        "averager.warmup_steps=2",
        "averager.comm_dtype=bfloat16",
        "averager.sync_delay=2",
        "averager.mix=0.5",
        "model.activation_checkpointing=full",  # recomputed in backward: resume stays exact
    ],
}
PROBE = REPO / "tests" / "probes" / "checkpoint_probe.py"
RUNS_PROBE = REPO / "tests" / "probes" / "runs_probe.py"


def train(run_dir: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    proc = run_cli([*SMALL, f"hydra.run.dir={run_dir}", *overrides], env, REPO)
    check_ok(proc)
    return proc


# 2x1 (FSDP2 no_shard, post-local SGD) resumes in all three modes in tests/test_faults.py
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp4", "2x2-diloco"])
def test_resume_in_every_mode_is_bitwise_equal_to_an_uninterrupted_run(layout, tmp_path, cli_env):
    """Run A trains 12 steps, saving sharded at every step. Run B resumes from A's step 7 (between averaging
    steps) saving full at 9 (an averaging step); run C resumes from B's step 9 to 12 saving sharded with
    async_save (at 10, while training goes on, and at 12): everything the checkpoints at 10 and 12 hold
    (model, optimizer, RNG states, DiLoCo's outer parameters and state), and every loss after step 7,
    equal A's bit for bit. (A run stopped by its own `train.steps` ends with an exchange, one model, so a
    run that goes on from its last checkpoint is not the one that never stopped: resumes from checkpoints
    saved on the way are.)"""
    # the learning rate decays after steps 3 and 6, so B resumes past both: the schedule's position must come back
    schedule = ["lr_scheduler=step", "lr_scheduler.milestones=[3,6]"]
    base = [*LAYOUTS[layout], *schedule, "model.dropout=0.1", "checkpoint.keep=12", "train.steps=12"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(a, cli_env, *base, "checkpoint=sharded", "checkpoint.interval=1")
    train(
        b,
        cli_env,
        *base,
        f"checkpoint.resume={a / 'checkpoints' / 'step_7'}",
        "checkpoint=full",
        "checkpoint.interval=9",
    )
    resume_c = f"checkpoint.resume={b / 'checkpoints' / 'step_9'}"
    train(c, cli_env, *base, resume_c, "checkpoint=sharded", "checkpoint.async=true", "checkpoint.interval=10")

    for step in ("step_10", "step_12"):
        assert_bitwise_equal(
            saved_state(a / "checkpoints" / step, tmp_path), saved_state(c / "checkpoints" / step, tmp_path)
        )
    la, lb, lc = loss_by_step(a), loss_by_step(b), loss_by_step(c)
    assert [lb[s] for s in range(8, 10)] + [lc[s] for s in range(10, 13)] == [la[s] for s in range(8, 13)]

    assert steps_saved(b) == ["step_9", "step_12"] and steps_saved(c) == ["step_10", "step_12"]
    meta = json.loads((b / "checkpoints" / "step_9" / "meta.json").read_text())
    clock = meta["clock"]  # replica steps of every replica: 9 each
    replicas = meta["mesh"]["replicate"]
    assert meta["replica_copies"] == replicas and clock["done"] + sum(clock["taken"]) == 9 * replicas
    accum = 2 if "train.grad_accum=2" in LAYOUTS[layout] else 1
    assert meta["data"]["samples"] == 9 * 4 * accum * int(LAYOUTS[layout][0].split("=")[1])
    # every replica's local progress is in the checkpoint, not just replica 0's
    assert (b / "checkpoints" / "step_9" / "replica_1.pt").exists()
    if "diloco" in layout:  # the outer state is in the checkpoint, once; so is a sync in flight
        in_flight = json.loads((c / "checkpoints" / "step_10" / "meta.json").read_text())["cross_replica"]
        # its apply (after step 12) is the clock's to say: 2 steps into the stride the sync began
        assert in_flight["averager"]["in_flight"] == {"fragment": 1}
        parts = torch.load(b / "checkpoints" / "step_9" / "full.pt", weights_only=True)["parts"]["cross_replica"]
        assert set(parts["params"]) == set(saved_state(a / "checkpoints" / "step_12", tmp_path)["model"])
        assert meta["cross_replica"]["averager"]["outer_state"]  # fragments synced so far have optimizer state
    rows = read_metrics(a) + read_metrics(c)
    lr = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    # optimizer.lr until step 3, × 0.1 after it, × 0.01 after step 6
    assert lr[1] == lr[3] and lr[4] == pytest.approx(lr[1] / 10) and lr[12] == pytest.approx(lr[1] / 100), lr
    assert len({r["averager/outer_lr"] for r in rows if "averager/outer_lr" in r}) <= 1  # the outer lr is not scheduled
    rows = read_metrics(b) + read_metrics(c)
    resumed = [r for r in rows if "run/resumed_from_step" in r]
    assert [r["run/resumed_from_step"] for r in resumed] == [7, 9]
    assert all(r["checkpoint/load_s"] > 0 and r["checkpoint/set_state_dict_s"] > 0 for r in resumed)
    saves = [r for r in rows if "checkpoint/save_s" in r]
    assert {r["checkpoint/mode"] for r in saves} == {"sharded", "full"}  # an async save is a sharded save: one name
    assert all(r["checkpoint/state_dict_s"] >= 0 for r in saves)
    assert all(r["checkpoint/bytes"] > 0 for r in saves if "checkpoint/bytes" in r)
    assert any("checkpoint/write_s" in r and "checkpoint/save_s" not in r for r in rows), "async write time logged"


# SGD's resume on each layout: (ranks, overrides); the local-SGD layouts save at step 3, between averages
LOCAL_SGD_SGD = ["averager=periodic", "averager.period=3", "averager.warmup_steps=1"]
SGD_LAYOUTS = {
    "one-device replicas": (2, ["sharding=no_shard", *LOCAL_SGD_SGD]),
    "ddp": (2, ["sharding=ddp", *LOCAL_SGD_SGD]),
    "FSDP2": (2, ["sharding=full_shard", "averager=none"]),
    "HSDP 2x2": (4, ["sharding=hybrid_shard", "sharding.replicate=2", *LOCAL_SGD_SGD]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", SGD_LAYOUTS)
def test_sgd_with_and_without_momentum_resumes_bitwise_in_every_mode(layout, tmp_path, cli_env):
    """The mission's own optimizer: plain SGD, whose optimizer state is empty (a full checkpoint of it
    once failed to load: torch's distribute step found no tensor to take a device from), and SGD with
    momentum, each saved at step 3 in every mode (full, sharded, async), resumed by a fresh job and
    trained to step 5: model and optimizer state equal an uninterrupted run's bit for bit on every rank
    (tests/probes/resume_probe.py)."""
    nproc, overrides = SGD_LAYOUTS[layout]
    out = tmp_path / "differ.json"
    args = [str(out), *SMALL, "model.dropout=0.1", "train.steps=5", "checkpoint.interval=3", *overrides]
    check_ok(run_cli(args, cli_env, tmp_path, ranks=nproc, script=REPO / "tests" / "probes" / "resume_probe.py"))
    differ = json.loads(out.read_text())
    assert len(differ) == 6 and all(keys == [] for keys in differ.values()), differ


@pytest.mark.slow
def test_full_checkpoint_loads_in_a_plain_process_without_torch_distributed(tmp_path, cli_env):
    run = tmp_path / "run"
    train(
        run,
        cli_env,
        "launcher.nproc=4",
        "sharding=hybrid_shard",
        "sharding.replicate=2",
        "averager=none",
        "train.steps=3",
        "checkpoint=full",
    )
    code = f"""
import torch, torch.distributed as dist
from omegaconf import OmegaConf
from harness.models import build_model
ckpt = torch.load({str(run / "checkpoints" / "step_3" / "full.pt")!r}, weights_only=True)
model = build_model(OmegaConf.create({{"_target_": "harness.models.TokenMLP", "n_layer": 2, "d_model": 64,
                                       "hidden": 256, "vocab_size": 256}}), 16).to_empty(device="cpu")
print(model.load_state_dict(ckpt["model"]))
tokens = torch.randint(256, (2, 17))
assert torch.isfinite(model(tokens[:, :-1], tokens[:, 1:]))
assert not dist.is_initialized()
assert set(ckpt["optim"]["state"]) == set(ckpt["model"]), "optimizer state is keyed by parameter FQN"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "All keys matched successfully" in proc.stdout


def probe(ckpt: Path, out: Path, nproc: int, env: dict, *overrides: str) -> dict:
    proc = run_cli([str(ckpt), str(out), *SMALL, *overrides], env, REPO, ranks=nproc, script=PROBE)
    check_ok(proc)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_checkpoints_reshard_exactly_with_the_outer_state_and_training_continues(tmp_path, cli_env):
    """Streaming DiLoCo saved by 2 replicas x 2 shards (sharded) loads into 2 x 1,
    and saved by 2 x 1 (full) into 2 x 2: the parameters, θ_outer and the outer
    optimizer state are exactly the saved ones, the data position is global, and
    training goes on from the sharded one on the other layout."""
    diloco = ["averager=diloco", "averager/outer_optimizer=nesterov", "averager.period=4", "averager.fragments=2"]
    diloco.append("averager.warmup_steps=2")
    hybrid = ["launcher.nproc=4", "sharding=hybrid_shard", "sharding.replicate=2"]
    plain = ["launcher.nproc=2", "sharding=no_shard"]
    for name, saved_by, mode, loaded_by, nproc in [
        ("sharded", hybrid, "sharded", plain, 2),
        ("full", plain, "full", hybrid, 4),
    ]:
        run = tmp_path / name
        train(run, cli_env, *saved_by, *diloco, "train.steps=6", f"checkpoint={mode}")
        step_dir = run / "checkpoints" / "step_6"
        saved = saved_state(step_dir, tmp_path)
        got = probe(step_dir, tmp_path / f"{name}.pt", nproc, cli_env, *loaded_by, *diloco)
        assert_bitwise_equal(got["model"], saved["model"])
        assert_bitwise_equal(got["parts"]["cross_replica"], saved["parts"]["cross_replica"])
        outer = saved["parts"]["cross_replica"]
        assert set(outer["optim_state"]) == set(outer["params"])  # both fragments have synced by step 6
        assert got["step"] == 6 and got["samples"] == 6 * 4 * int(saved_by[0].split("=")[1])
    more = tmp_path / "more"
    train(
        more,
        cli_env,
        *plain,
        *diloco,
        "train.steps=8",
        "checkpoint=sharded",
        f"checkpoint.resume={tmp_path / 'sharded' / 'checkpoints' / 'step_6'}",
    )
    assert sorted(loss_by_step(more)) == [7, 8] and steps_saved(more) == ["step_8"]


@pytest.mark.slow
def test_diverged_replicas_load_as_their_mean_into_another_replica_count(tmp_path, cli_env):
    """Post-local SGD's diverged replicas load as their mean into one replica, and as
    θ_outer into DiLoCo (a checkpoint without outer state)."""
    run = tmp_path / "run"
    train(run, cli_env, *LAYOUTS["2x1"], "train.steps=6", "checkpoint=full", "checkpoint.interval=5")
    step_dir = run / "checkpoints" / "step_5"  # steps 4-5 were local: the replicas differ (step 6 averages)
    r0 = torch.load(step_dir / "full.pt", weights_only=True)["model"]
    r1 = torch.load(step_dir / "replica_1.pt", weights_only=True)["model"]
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)
    got = probe(step_dir, tmp_path / "probe.pt", 2, cli_env, "sharding=full_shard", "averager=none")
    for key in r0:
        torch.testing.assert_close(got["model"][key], (r0[key] + r1[key]) / 2, rtol=0, atol=1e-7)
    diloco = ["sharding=no_shard", "averager=diloco", "averager.period=4", "averager.warmup_steps=2"]
    got = probe(step_dir, tmp_path / "diloco.pt", 2, cli_env, *diloco)
    for key, outer in got["parts"]["cross_replica"]["params"].items():
        torch.testing.assert_close(outer, (r0[key] + r1[key]) / 2, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_a_checkpoint_with_weight_decay_on_every_parameter_resumes_only_with_decay_1d_true(tmp_path, cli_env):
    """A checkpoint as saved before `optimizer.decay_1d` existed: trained with
    `decay_1d=true` (the one group of those days, decay on every parameter),
    and the key dropped from its meta.json, which is all that differs from
    what the harness wrote then. The new default (two groups) is refused before
    any rank starts and writes nothing; `decay_1d=true` continues it."""
    run = tmp_path / "run"
    common = ["launcher.nproc=2", "sharding=no_shard", "averager=none", "optimizer=adamw", "checkpoint=full"]
    train(run, cli_env, *common, "train.steps=2", "optimizer.decay_1d=true")
    meta_file = run / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["optimizer"]["decay_1d"]
    meta_file.write_text(json.dumps(meta))
    before = sorted(p.name for p in run.rglob("*"))
    refused = run_cli([*SMALL, f"hydra.run.dir={run}", *common, "train.steps=3"], cli_env, REPO)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Traceback" not in out
    assert "saved before decay_1d existed" in out and "Fix: optimizer.decay_1d=true" in out, out
    assert sorted(p.name for p in run.rglob("*")) == before
    train(run, cli_env, *common, "train.steps=3", "optimizer.decay_1d=true")
    [group] = saved_state(run / "checkpoints" / "step_3", tmp_path)["optim"]["param_groups"]
    assert group["weight_decay"] == 0.01


# one rank, one replica: a GPT's checkpoints; the tied run is nanoGPT's CPU "baby" config (block 64, no bias)
ONE_RANK = ["train.log_every=1", "launcher.nproc=1", "averager=none", "optimizer=adamw"]
TINY_GPT = ["model=gpt", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.batch_size=4"]
BABY_GPT = ["model=gpt", "model.bias=false", "train.seq_len=64", "train.batch_size=4"]


# -- checkpoints written by earlier versions (tests/fixtures/checkpoints/README.md) -------------------

FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"
OLD = {f"{p.parent.name}/{p.name}": p for p in sorted(FIXTURES.glob("v*/*")) if p.is_dir()}
# the clock part each version's checkpoint reads as (the plan's inputs): from the saved config's fixed schedule
# before the clock (v0); a v1 run's last period cut to different lengths counts them as taken
CLOCKS = {
    "v0/periodic_mlp_full": {"replicas": 2, "done": 14, "taken": [1, 1], "syncs": 2},  # exchanges after 3 and 7
    "v0/diloco_in_flight_full": {"replicas": 2, "done": 16, "taken": [0, 0], "syncs": 3},  # after 4, 6 and 8
    "v0/gpt_full": {"replicas": 2, "done": 12, "taken": [0, 0], "syncs": 0},  # in its warmup of 10
    "v0/gpt_sharded": {"replicas": 1, "done": 6, "taken": [0], "syncs": 0},  # synchronous: one replica
    "v1/uneven_cut_full": {"replicas": 2, "done": 47 + 3, "taken": [0, 0], "syncs": 8, "trained": [33, 17]},
}


def old_checkpoint(name: str) -> tuple[dict, Path]:
    """A fixture's continuation.json and its step_<N> directory."""
    spec = json.loads((OLD[name] / "continuation.json").read_text())
    return spec, OLD[name] / f"step_{spec['step']}"


def test_a_checkpoint_of_every_earlier_version_reads_as_todays_format():
    """meta.json of each version (no `format`: 0 before the clock, 1 with its part) reads as today's: the
    clock part derived, the fields the clock replaced gone, every field well formed."""
    from harness.checkpoint.files import read_meta
    from harness.checkpoint.meta import FORMAT, problems, version

    for name in OLD:
        spec, step_dir = old_checkpoint(name)
        raw = json.loads((step_dir / "meta.json").read_text())
        assert version(raw) == int(name[1]), name
        meta = read_meta(step_dir)
        assert meta["format"] == FORMAT and problems(meta) == [] and meta["step"] == spec["step"], name
        assert "averager_step" not in meta["cross_replica"], name
        if in_flight := meta["cross_replica"].get("averager", {}).get("in_flight"):
            assert in_flight == {"fragment": 0}, name  # its apply is the clock's to say
        for key, value in CLOCKS.get(name, {}).items():
            assert meta["clock"][key] == value, (name, key, meta["clock"])


PERIODIC, DILOCO = "v1/periodic_mlp_full", "v1/diloco_in_flight_sharded"
EDITS = [  # (id, fixture, the edit of its meta.json: the path to a field and its new value, or several such; what the
    # refusal names)
    ("negative taken", PERIODIC, ("clock", "taken", 1, -3), "clock.taken[1] is -3, but must be an integer >= 0"),
    ("done a string", PERIODIC, ("clock", "done", "16"), 'clock.done is "16", but must be an integer >= 0'),
    ("no replicas", PERIODIC, ("clock", "replicas", 0), "clock.replicas is 0, but must be an integer >= 1"),
    ("step a string", PERIODIC, ("step", "8"), 'step is "8", but must be an integer >= 0'),
    ("clock past the step", PERIODIC, ("clock", "done", 40), "the clock and the step disagree"),
    (
        "a fragment it has not",
        DILOCO,
        ("cross_replica", "averager", "in_flight", "fragment", 2),
        "cross_replica.averager.in_flight.fragment is 2, but must be one of the 2 fragments' numbers",
    ),
    ("a newer format", "v1/gpt_sharded", ("format", 4), "format is 4, but must be an integer from 0 to 3"),
    (
        "exchange time negative",
        "v2/periodic_mlp_full",
        (("format", 3), ("clock", "exchange_time", -1.0)),  # as today's code writes it, edited
        "clock.exchange_time is -1.0, but must be a number of seconds >= 0, or null",
    ),
    ("a v0 without its mesh", "v0/gpt_full", ("mesh", None), "mesh is None, but must be an object"),
]


@pytest.mark.parametrize("fixture,edit,expected", [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_a_meta_json_edited_wrong_is_refused_naming_the_field(fixture, edit, expected, tmp_path):
    """A well-formed meta.json with a field of the wrong type or out of range is refused before any rank
    starts (preflight), naming the file, the field, its value and the fix (it ended in a TypeError,
    ZeroDivisionError or a run that read ahead of its clock inside the ranks)."""
    from harness.preflight import preflight

    _, step_dir = old_checkpoint(fixture)
    copy = tmp_path / "edited" / step_dir.name
    copy.mkdir(parents=True)
    meta = json.loads((step_dir / "meta.json").read_text())
    for one in edit if isinstance(edit[0], tuple) else [edit]:
        *path, key, value = one
        node = meta
        for part in path:
            node = node[part]
        node[key] = value
    (copy / "meta.json").write_text(json.dumps(meta))
    [error] = preflight(make(f"checkpoint.resume={copy}"), tmp_path / "run", copy)
    for text in (str(copy), "meta.json cannot be a checkpoint's", expected, "Fix: if meta.json was edited by hand"):
        assert text in error, f"{text!r} not in:\n{error}"


@pytest.mark.slow
def test_checkpoints_of_earlier_versions_resume_to_the_same_continuation(tmp_path, cli_env):
    """Every fixture, resumed by today's code with the overrides its run had, logs the training losses its
    writing code went on to log, bit for bit (tests/probes/runs_probe.py: every run a job on the same two
    ranks); the v0 GPT (biases, untied head) with `model.tie_embeddings=false`, as its refusal says. The v1 run
    whose last period was cut to different lengths (balance=time) trains on with more steps to an exchange of
    its own at the new end."""
    runs = []
    for name in OLD:
        spec, step_dir = old_checkpoint(name)
        run = tmp_path / name.replace("/", "_")
        shutil.copytree(step_dir, run / "checkpoints" / step_dir.name)
        overrides = list(spec["overrides"])
        if name.startswith("v0/") and "model=gpt" in overrides:  # as the refusal of the new default says
            overrides.append("model.tie_embeddings=false")
        if name == "v1/uneven_cut_full":
            overrides = [o for o in overrides if not o.startswith("train.steps")] + ["train.steps=31"]
        overrides = [o for o in overrides if not o.startswith("launcher.")]
        resume = {"run": str(run), "pick": spec["step"]}
        runs.append(
            {
                "dir": str(run / "resumed"),
                "overrides": overrides,
                "slowdown": spec.get("slowdown", ""),
                "resume": resume,
            }
        )
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    check_ok(run_cli([str(tmp_path / "runs.json")], cli_env, tmp_path, ranks=2, script=RUNS_PROBE, timeout=600))
    for name, run in zip(OLD, runs):
        spec, _ = old_checkpoint(name)
        resumed = {str(r["step"]): r["train/loss"] for r in read_metrics(Path(run["dir"])) if "train/loss" in r}
        if spec["losses"]:
            assert resumed == spec["losses"], name
    uneven = Path(runs[list(OLD).index("v1/uneven_cut_full")]["dir"])
    rows = read_metrics(uneven)
    assert rows[-1]["step"] == 31 and rows[-1]["averager/averaged"] == 1, rows[-1]
    assert json.loads((uneven / "checkpoints" / "step_31" / "meta.json").read_text())["clock"]["taken"] == [0, 0]


@pytest.mark.slow
def test_a_resume_that_changes_keys_says_so_and_runs_with_the_new_optimizer_settings(tmp_path, cli_env):
    """The v1 post-local SGD fixture resumed with three keys changed logs one line naming each, its saved and
    new value and what the run does with it; the new optimizer.lr is the rate of the resumed steps and the new
    betas are AdamW's (the checkpoint's param groups and the schedule's saved base rate used to win, silently)."""
    spec, step_dir = old_checkpoint("v1/periodic_mlp_full")
    run = tmp_path / "run"
    shutil.copytree(step_dir, run / "checkpoints" / step_dir.name)
    args = [o for o in spec["overrides"] if not o.startswith("train.steps")]
    args += ["train.steps=12", "optimizer.lr=0.001", "optimizer.betas=[0.8,0.99]", "wandb.mode=disabled"]
    args.append(f"hydra.run.dir={run}")
    check_ok(run_cli(args, cli_env, REPO))
    [line] = [line for line in (run / "train.log").read_text().splitlines() if "key(s) changed" in line]
    for text in (
        f"resuming {run / 'checkpoints' / step_dir.name} (step 8) with 3 key(s) changed",
        "train.steps 15 -> 12 (replanned: trains on to the new end",
        "optimizer.lr 0.003 -> 0.001 (honoured: the run's value replaces the checkpoint's",
        "optimizer.betas [0.9,0.999] -> [0.8,0.99] (honoured",
    ):
        assert text in line, f"{text!r} not in {line}"
    assert {r["train/lr"] for r in read_metrics(run) if "train/lr" in r} == {0.001}
    for group in torch.load(run / "checkpoints" / "step_12" / "full.pt", weights_only=True)["optim"]["param_groups"]:
        assert group["lr"] == 0.001 and tuple(group["betas"]) == (0.8, 0.99), group


@pytest.mark.slow
def test_a_gpt_saved_before_tie_embeddings_is_refused_untied_and_exports_as_saved(tmp_path, cli_env):
    """The v0 GPT (biases, and an untied head: its own `head.weight`, before `model.bias` and
    `model.tie_embeddings` existed): the new default, a tied head (a load would keep one of the two
    tables, silently), is refused before any rank starts, naming the key, and writes nothing;
    `model.tie_embeddings=false` continues it (the continuation itself: the test above). Each earlier
    GPT exports: transformers' GPT2LMHeadModel loads it and gives the logits of the harness's GPT holding
    its weights (the diverged DiLoCo replicas: their mean)."""
    from transformers import GPT2LMHeadModel

    from harness.models import GPT

    spec, step_dir = old_checkpoint("v0/gpt_full")
    run = tmp_path / "run"
    shutil.copytree(step_dir, run / "checkpoints" / step_dir.name)
    args = [*spec["overrides"], "train.steps=7", f"hydra.run.dir={run}"]
    before = sorted(p.name for p in run.rglob("*"))
    refused = run_cli(args, cli_env, REPO)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "Traceback" not in out, out
    assert "model.tie_embeddings: saved False (saved before the key existed), configured True" in out, out
    assert "Fix: model.tie_embeddings=false to continue as saved" in out and "model.bias" not in out, out
    assert sorted(p.name for p in run.rglob("*")) == before
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    for name in ("v0/gpt_full", "v0/diloco_in_flight_full", "v0/gpt_sharded", "v1/diloco_in_flight_sharded"):
        _, step_dir = old_checkpoint(name)
        out = tmp_path / name.replace("/", "_")
        export = [sys.executable, "-m", "harness.export", str(step_dir), str(out)]
        check_ok(subprocess.run(export, env=cli_env, capture_output=True, text=True))
        theirs = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
        assert theirs.config.tie_word_embeddings == name.startswith("v1"), name
        if "sharded" in name:  # loaded above; its tensors are DCP's to read
            continue
        copies = [
            torch.load(f, weights_only=True)["model"] for f in sorted(step_dir.glob("*.pt")) if f.name != "rng.pt"
        ]
        ours = GPT(n_layer=2, n_head=2, d_model=16, vocab_size=64, seq_len=16, tie_embeddings=False).eval()
        ours.load_state_dict({k: sum(c[k] for c in copies) / len(copies) for k in copies[0]})
        logits = []
        hook = ours.head.register_forward_hook(lambda module, args, out, logits=logits: logits.append(out))
        with torch.no_grad():
            ours(tokens, tokens)
            torch.testing.assert_close(logits[0], theirs(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
        hook.remove()


@pytest.mark.slow
def test_a_tied_gpt_resumes_bitwise_and_stays_tied(tmp_path, cli_env):
    """nanoGPT's baby config (tied, no bias) logs nanoGPT's parameter count; stopped at step 2
    (sharded) and resumed to 4, it ends bitwise where a run that never stopped ends, with the
    head still the token table."""
    args = [*ONE_RANK, *BABY_GPT, "checkpoint=sharded", "checkpoint.interval=2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run_cli([*args, "train.steps=4", f"hydra.run.dir={straight}"], cli_env, REPO))
    assert "828,544 parameters" in (straight / "train.log").read_text()
    check_ok(run_cli([*args, "train.steps=2", f"hydra.run.dir={stopped}"], cli_env, REPO))
    check_ok(run_cli([*args, "train.steps=4", f"hydra.run.dir={stopped}"], cli_env, REPO))
    assert loss_by_step(stopped) == loss_by_step(straight)
    state = saved_state(stopped / "checkpoints" / "step_4", tmp_path)
    assert_bitwise_equal(state, saved_state(straight / "checkpoints" / "step_4", tmp_path))
    assert torch.equal(state["model"]["head.weight"], state["model"]["tok_emb.weight"])


@pytest.mark.slow
def test_only_complete_checkpoints_count_and_leftovers_are_removed(tmp_path, cli_env):
    run = tmp_path / "run"
    train(
        run,
        cli_env,
        "launcher.nproc=2",
        "sharding=full_shard",
        "averager=none",
        "train.steps=4",
        "checkpoint=sharded",
        "checkpoint.interval=2",
        "checkpoint.keep=2",
    )
    assert steps_saved(run) == ["step_2", "step_4"]
    ckpts = run / "checkpoints"
    # what a save killed halfway leaves behind: a .partial dir, or a step dir without meta.json
    (ckpts / "step_6.partial").mkdir()
    (ckpts / "step_6.partial" / "__0_0.distcp").write_bytes(b"half")
    (ckpts / "step_8").mkdir()
    before = {p.name: p.stat().st_mtime_ns for p in (ckpts / "step_4").iterdir()}
    common = ["launcher.nproc=2", "sharding=full_shard", "averager=none", "checkpoint=sharded"]
    common += ["checkpoint.interval=2", "checkpoint.keep=2"]
    proc = train(run, cli_env, *common, "train.steps=6")
    assert "resumed from" in proc.stdout and "step_4 at step 4" in proc.stdout
    assert "removing incomplete checkpoint" in proc.stdout
    assert steps_saved(run) == ["step_4", "step_6", "step_8"]  # the empty step_8 is not a checkpoint, left alone
    assert {p.name: p.stat().st_mtime_ns for p in (ckpts / "step_4").iterdir()} == before
    # the same command again: nothing left to train, said so before any rank starts or W&B run opens
    again = train(run, {**cli_env, "WANDB_MODE": "offline"}, *common, "train.steps=6")
    assert "already complete at step 6 of 6; nothing to train" in again.stdout, again.stdout
    assert "resumed from" not in again.stdout and not (run / "wandb").exists()
    assert steps_saved(run) == ["step_4", "step_6", "step_8"]


@pytest.mark.slow
def test_truncated_checkpoint_fails_with_the_path_and_writes_nothing(tmp_path, cli_env):
    run = tmp_path / "run"
    train(
        run, cli_env, "launcher.nproc=2", "sharding=full_shard", "averager=none", "train.steps=2", "checkpoint=sharded"
    )
    shard = run / "checkpoints" / "step_2" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = run_cli(
        [
            *SMALL,
            f"hydra.run.dir={run}",
            "launcher.nproc=2",
            "sharding=full_shard",
            "averager=none",
            "train.steps=4",
            "checkpoint=sharded",
        ],
        cli_env,
        REPO,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"loading '{run / 'checkpoints' / 'step_2'}' failed" in out and "checkpoint.resume=never" in out
    assert steps_saved(run) == ["step_2"]
