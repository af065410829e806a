"""Bad input through the real CLI: exit code != 0, one paragraph naming the
key/value/path and the fix, and nothing written or overwritten; and the
paragraphs for overrides Hydra cannot compose (`harness.overrides`), in-process."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.config import ConfigError, register_configs
from harness.launch import local_rank_count
from harness.launch.check import settle_config
from harness.overrides import closest, override_errors

from support import FAST, REPO, TRAIN, checkpoint_meta, run_cli

register_configs()

MODEL = {"name": "gpt", "n_layer": 4, "n_head": 4, "d_model": 128, "vocab_size": 256}  # conf/model/gpt.yaml
BASE = [o for o in FAST if not o.startswith("model=")]  # the default model: gpt


def fake_checkpoint(step_dir: Path, **model) -> Path:
    step_dir.mkdir(parents=True)
    (step_dir / "meta.json").write_text(
        json.dumps(checkpoint_meta(5, model={**MODEL, **model}, optimizer="torch.optim.AdamW"))
    )
    return step_dir


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


# Through the CLI: one case of each place a refusal comes from (Hydra's composition,
# a sweep's, validate, the machine, a checkpoint, the run dir, a missing extra, the
# fault-tolerance rules); every rule has its own in-process test (test_config.py,
# SETTLED below). (id, overrides, texts the message must contain); {tmp} is the
# test's tmp dir, {run} the run dir.
CASES = [
    ("typo", ["train.stepz=3"], ["train.stepz=3", "Fix: train.steps=3 (the closest key)"]),
    (
        "sweep value",
        ["-m", "averager.period=2,x"],
        ["harness: averager.period=x: averager.period takes an integer or auto."],
    ),
    ("zero lr", ["optimizer.lr=0"], ["optimizer.lr=0", "Fix:"]),
    ("averaging with one replica", ["sharding=full_shard"], ["averages parameters across", "Fix: sharding=no_shard"]),
    (
        "replicate not dividing world",
        ["launcher.nproc=4", "sharding.replicate=3"],
        ["sharding.replicate=3 does not divide the world size 4", "Fix:"],
    ),
    ("cuda without cuda", ["train.device=cuda"], ["train.device=cuda", "Fix:"]),
    ("checkpoint corrupt", ["checkpoint.resume={tmp}/corrupt"], ["{tmp}/corrupt", "meta.json is unreadable", "Fix:"]),
    (
        "resume=never over checkpoints",
        ["checkpoint=sharded", "checkpoint.resume=never"],
        ["{run}/checkpoints already holds checkpoints (step_5)", "Fix:"],
    ),
    ("unwritable run dir", ["hydra.run.dir={tmp}/a_file/run"], ["a_file is not a writable directory", "Fix:"]),
    (
        "ft without torchft",  # a torchft on PYTHONPATH that fails to import, as a missing one does
        ["fault_tolerance=torchft", "sharding=no_shard"],
        ["needs the torchft package", 'pip install -e ".[ft]"'],
    ),
    (
        "ft lighthouse not a url",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.lighthouse=node0:29510"],
        ["fault_tolerance.lighthouse='node0:29510' is not a lighthouse URL", "Fix:"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly_and_writes_nothing(name, overrides, expected, tmp_path, cli_env):
    if name == "cuda without cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = tmp_path / "run"
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "meta.json").write_text("{truncated")
    (tmp_path / "a_file").write_text("not a folder")
    if name == "resume=never over checkpoints":
        fake_checkpoint(run / "checkpoints" / "step_5")
    if name == "ft without torchft":
        (tmp_path / "shadow" / "torchft").mkdir(parents=True)
        (tmp_path / "shadow" / "torchft" / "__init__.py").write_text(
            "raise ImportError(\"No module named 'torchft'\")\n"
        )
        cli_env = {**cli_env, "PYTHONPATH": f"{tmp_path / 'shadow'}:{cli_env.get('PYTHONPATH', '')}"}
    before = snapshot(tmp_path)
    args = [o.format(tmp=tmp_path, run=run) for o in overrides]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={run}")
    flags = [a for a in args if a.startswith("-")]  # -m before the overrides, as Hydra's parser wants it
    proc = run_cli([*flags, *BASE, *(a for a in args if a not in flags)], cli_env, tmp_path, fresh=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    for text in expected:
        assert text.format(tmp=tmp_path, run=run) in out, f"{text!r} not in:\n{out}"
    assert "Traceback" not in out
    assert snapshot(tmp_path) == before, "a refused run wrote or changed files"


ADACOMM = "averager.period_schedule=adacomm"
# The rules the CLI cases above do not reach and no other test checks, through
# `settle_config`: what train.py runs on the composed config before any rank starts.
# An override `HARNESS_TEST_SLOWDOWN=...` sets that environment variable instead.
SLOWDOWN, FLOAT8_EMULATE = "HARNESS_TEST_SLOWDOWN=", "HARNESS_TEST_FLOAT8_EMULATE="
EXCHANGE_DELAY = "HARNESS_TEST_EXCHANGE_DELAY="
KNOBS = (SLOWDOWN, FLOAT8_EMULATE, EXCHANGE_DELAY)
SETTLED = [
    ("plus unknown key", ["+averager.perod=4"], ["Unknown config key 'averager.perod'", "Fix: averager.period=4"]),
    ("negative steps", ["train.steps=-5"], ["train.steps=-5", "Fix:"]),
    ("negative lr", ["optimizer.lr=-0.1"], ["optimizer.lr=-0.1", "Fix:"]),
    ("heads not dividing width", ["model.n_head=3"], ["model.d_model=128 is not divisible by model.n_head=3", "Fix:"]),
    ("checkpoint incomplete", ["checkpoint.resume={tmp}/incomplete"], ["{tmp}/incomplete", "no meta.json", "Fix:"]),
    (  # it said "the checkpoint is corrupt"
        "checkpoint a plain file",
        ["checkpoint.resume={tmp}/a_file"],
        ["checkpoint.resume='{tmp}/a_file': a file, not a checkpoint", "Fix:"],
    ),
    (
        "resume into another model size",
        ["checkpoint.resume={tmp}/deep/step_5"],
        ["model.n_layer: saved 8, configured 4", "Fix:"],
    ),
    (  # synchronous training too (averager=none): a group survives only by its peers
        "ft with one replica",
        ["fault_tolerance=torchft", "sharding=full_shard", "averager=none"],
        ["survives only by its peers", "Fix:"],
    ),
    (
        "ft quorum above the groups",
        ["fault_tolerance=torchft", "sharding=no_shard", "averager=none", "fault_tolerance.min_replicas=3"],
        ["fault_tolerance.min_replicas=3 must be between 1 and the 2 replica groups", "Fix:"],
    ),
    (
        "ft join timeout not positive",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.join_timeout_s=0"],
        [
            "fault_tolerance.join_timeout_s=0",
            "must be a positive number of seconds",
            "Fix: fault_tolerance.join_timeout_s=null (the default",
        ],
    ),
    (  # each timeout's fix is its own default (every one said "e.g. 60")
        "ft quorum timeout not positive",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.quorum_timeout_s=-1"],
        ["fault_tolerance.quorum_timeout_s=-1.0", "Fix: fault_tolerance.quorum_timeout_s=300 (the default)."],
    ),
    (  # the generic timeout rule's fix was 60 s; the heartbeat's default is 0.5
        "ft heartbeat timeout zero",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.heartbeat_timeout_s=0"],
        [
            "fault_tolerance.heartbeat_timeout_s=0.0 must be a number of seconds of at least 0.2",
            "Fix: fault_tolerance.heartbeat_timeout_s=0.5 (the default), at least 0.2.",
        ],
    ),
    (
        "ft heartbeat timeout not a number",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.heartbeat_timeout_s=nan"],
        ["fault_tolerance.heartbeat_timeout_s=nan must be", "Fix: fault_tolerance.heartbeat_timeout_s=0.5"],
    ),
    (  # torchft's lighthouse overflowed on it
        "ft heartbeat timeout out of range",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.heartbeat_timeout_s=1e300"],
        ["fault_tolerance.heartbeat_timeout_s=1e+300", "at most 604800", "Fix:"],
    ),
    (  # below the Managers' beat: every quorum held one group, the synchronous groups trained apart, exit 0
        "ft heartbeat timeout below a beat",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.heartbeat_timeout_s=0.01"],
        ["fault_tolerance.heartbeat_timeout_s=0.01 is shorter than 2 of the heartbeats", "Fix:"],
    ),
    (  # the launcher numbers the groups; it was ignored, and recorded in .hydra/config.yaml
        "ft replica id under the launcher",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.replica_id=5"],
        ["fault_tolerance.replica_id=5", "starts every replica group itself", "Fix: drop fault_tolerance.replica_id"],
    ),
    (
        "ft synchronous steps in backward",
        ["fault_tolerance=torchft", "sharding=no_shard", "averager=none", "optimizer.in_backward=true"],
        ["optimizer.in_backward=true with fault_tolerance=torchft", "only once its gradient exchange", "Fix:"],
    ),
    (
        "ft no failed exchange allowed",
        ["fault_tolerance=torchft", "sharding=no_shard", "fault_tolerance.max_failed_exchanges=0"],
        ["fault_tolerance.max_failed_exchanges=0 must be >= 1", "Fix:"],
    ),
    # the pace's rules (harness/averaging/config_rules.py pace_errors)
    (
        "min period above the period",
        [
            "sharding=no_shard",
            "averager=periodic",
            "averager.period=4",
            "averager.period_schedule=adacomm",
            "averager.min_period=8",
        ],
        ["averager.min_period=8 is above averager.period=4", "Fix: averager.min_period between 1 and 4"],
    ),
    (  # it was accepted and changed nothing: only adacomm shortens the period
        "min period with a fixed period",
        ["sharding=no_shard", "averager=diloco", "averager.period=16", "averager.min_period=4"],
        [
            "averager.min_period=4 with averager.period_schedule=fixed has no effect",
            "Fix: averager.period_schedule=adacomm to let the period shorten from averager.period=16 down to 4, "
            "or drop averager.min_period",
        ],
    ),
    (
        "min period in a hierarchy",
        ["sharding=no_shard", "averager=hierarchical", "averager.min_period=2"],
        ["averager.min_period=2 with averager.period_schedule=fixed has no effect", "Fix: drop averager.min_period"],
    ),
    (
        "adacomm from a period of 1",
        ["sharding=no_shard", "averager=periodic", "averager.period=1", "averager.period_schedule=adacomm"],
        ["averager.period_schedule=adacomm with averager.period=1", "Fix: a longer starting period"],
    ),
    (
        "adacomm at a stride the delay fills",
        ["sharding=no_shard", "averager=diloco", "averager.period=8", "averager.sync_delay=7", ADACOMM],
        ["averager.period_schedule=adacomm with averager.sync_delay=7", "Fix: a longer starting period"],
    ),
    (
        "balance by time in a hierarchy whose periods do not nest",
        [
            "sharding=no_shard",
            "averager=hierarchical",
            "averager.balance=time",
            "averager.period_group_size=[[3,2],[8,4]]",
        ],
        [
            "averager.balance=time with averager.period_group_size=[[3,2],[8,4]]: each period must divide the next",
            "Fix: e.g. averager.period_group_size=[[3,2],[9,4]]",
        ],
    ),
    (
        "adacomm in a hierarchy",
        ["sharding=no_shard", "averager=hierarchical", "averager.period_schedule=adacomm"],
        ["averager.period_schedule=adacomm with averager=hierarchical", "Fix: averager.period_schedule=fixed"],
    ),
    (
        "adacomm from one step per fragment",
        [
            "sharding=no_shard",
            "averager=diloco",
            "averager.period=2",
            "averager.fragments=2",
            "averager.period_schedule=adacomm",
        ],
        ["averager.period_schedule=adacomm with averager.period=2 and averager.fragments=2", "Fix: a longer"],
    ),
    (
        "balance by time under ddp",
        ["sharding=ddp", "averager=periodic", "averager.balance=time"],
        ["averager.balance=time with sharding=ddp", "Fix: sharding=no_shard"],
    ),
    ("peak flops not a number", ["train.peak_tflops=nan"], ["train.peak_tflops=nan must be positive", "Fix:"]),
    (  # the other refusals (no torchao, a GPU below 8.9): tests/test_float8.py
        "float8 on the CPU",
        ["train.float8=rowwise"],
        ["train.float8=rowwise: the ranks run on the CPU, where float8 cannot pay", "Fix:"],
    ),
    # the test knob that slows replicas: checked with the config (each rank failed alone, with a traceback, or in
    # time.sleep naming neither the variable nor a fix)
    (
        "slowdown not a pair",
        [f"{SLOWDOWN}fast"],
        [
            "HARNESS_TEST_SLOWDOWN='fast' (a test knob that slows replicas, harness/slowdown.py) takes "
            "<replica>:<factor> or <replica>:<seconds>s, comma-separated: 'fast' is not of that form",
            "Fix: e.g. HARNESS_TEST_SLOWDOWN=1:2",
        ],
    ),
    ("slowdown nan", [f"{SLOWDOWN}1:nan"], ["in '1:nan' a factor must be a finite number >= 1", "Fix:"]),
    ("slowdown inf", [f"{SLOWDOWN}0:1.5,1:inf"], ["in '1:inf' a factor must be a finite number >= 1", "Fix:"]),
    ("slowdown below 1", [f"{SLOWDOWN}1:0.5"], ["in '1:0.5' a factor must be a finite number >= 1", "Fix:"]),
    ("slowdown negative s", [f"{SLOWDOWN}1:-0.1s"], ["in '1:-0.1s' seconds must be a finite number >= 0", "Fix:"]),
    ("slowdown twice", [f"{SLOWDOWN}1:2,1:3"], ["HARNESS_TEST_SLOWDOWN='1:2,1:3'", "replica 1 is named twice"]),
    (
        "slowdown of a replica the run has not",
        [f"{SLOWDOWN}2:2"],
        ["the run has 2 replica(s), 0..1, so replica 2 would slow nothing", "or unset HARNESS_TEST_SLOWDOWN"],
    ),
    ("wandb timeout negative", ["wandb.init_timeout_s=-5"], ["wandb.init_timeout_s=-5.0 must be a positive", "Fix:"]),
    (  # it failed at the first eval, after training began
        "text with no held-out window",
        ["data=text", "data.root={tmp}/tiny", "train.eval_every=10"],
        [
            "the held-out part of the text corpus holds 12 bytes",
            "Fix: lower train.seq_len, or raise data.eval_fraction",
        ],
    ),
    (  # MemoryError at the first eval
        "eval batches past any pass",
        ["train.eval_every=10", "train.eval_batches=10000000000"],
        ["train.eval_batches=10000000000 batches at every eval of an endless stream", "Fix: train.eval_batches=4"],
    ),
    ("eval batches negative, eval off", ["train.eval_batches=-1"], ["train.eval_batches=-1 is neither", "Fix:"]),
    (  # its fix read "train.eval_batches=4", the same value to the eye
        "eval batches a quoted number",
        ["train.eval_every=10", "train.eval_batches='4'"],
        ["train.eval_batches='4' (a string)", "Fix: train.eval_batches=4 without quotes"],
    ),
    (
        "resume latest",
        ["checkpoint.resume=latest"],
        ["checkpoint.resume='latest': no such file or directory", "Fix: checkpoint.resume=auto"],
    ),
    (  # it slowed nothing, without a word
        "slowdown of synchronous training",
        ["averager=none", f"{SLOWDOWN}1:3"],
        ["this run trains synchronously (averager=none): it would slow nothing", "Fix: unset HARNESS_TEST_SLOWDOWN"],
    ),
    # averager.period=auto (harness/averaging/config_rules.py _auto_errors)
    (
        "period a word",
        ["averager.period=often"],
        ["averager.period='often' is out of range: it must be an integer >= 1, or auto", "averager.period=auto"],
    ),
    (
        "comm budget out of range",
        ["averager.period=auto", "averager.comm_budget=1.5"],
        ["averager.comm_budget=1.5 is out of range", "Fix: averager.comm_budget=0.1"],
    ),
    (
        "comm budget without auto",
        ["averager.comm_budget=0.2"],
        ["averager.comm_budget=0.2 without averager.period=auto has no effect", "Fix: averager.period=auto"],
    ),
    (
        "auto and adacomm",
        ["averager.period=auto", "averager.period_schedule=adacomm"],
        ["averager.period=auto with averager.period_schedule=adacomm", "Fix: averager.period_schedule=fixed"],
    ),
    (
        "auto's bounds crossed",
        ["averager.period=auto", "averager.min_period=8", "averager.max_period=4"],
        ["averager.min_period=8 is above averager.max_period=4", "Fix: averager.min_period between 1 and 4"],
    ),
    (
        "auto's longest not a period of the fragments",
        ["averager=diloco", "averager.period=auto", "averager.fragments=3", "averager.max_period=64"],
        ["averager.fragments=3 does not divide averager.max_period=64"],
    ),
    (
        "exchange delay negative",
        [f"{EXCHANGE_DELAY}-1"],
        ["HARNESS_TEST_EXCHANGE_DELAY='-1' (a test knob", "takes seconds", "Fix:"],
    ),
    (
        "exchange delay without exchanges",
        ["averager=none", f"{EXCHANGE_DELAY}0.2"],
        ["this run has none (no averager, or one replica)", "Fix: unset HARNESS_TEST_EXCHANGE_DELAY"],
    ),
    (  # ignored: only 1 emulates
        "float8 emulation spelled true",
        [f"{FLOAT8_EMULATE}true"],
        ["HARNESS_TEST_FLOAT8_EMULATE='true' (a test knob", "Fix: HARNESS_TEST_FLOAT8_EMULATE=1"],
    ),
]


@pytest.mark.parametrize("name,overrides,expected", SETTLED, ids=[c[0] for c in SETTLED])
def test_every_refusal_names_the_key_and_the_fix(name, overrides, expected, tmp_path, monkeypatch):
    (tmp_path / "incomplete").mkdir()
    (tmp_path / "a_file").write_text("not a checkpoint")
    fake_checkpoint(tmp_path / "deep" / "step_5", n_layer=8)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.py").write_text("x = 1\n" * 200)  # 1200 bytes: 12 held out (data.eval_fraction)
    for knob in KNOBS:
        monkeypatch.delenv(knob[:-1], raising=False)
    for override in (o for o in overrides if o.startswith(KNOBS)):
        name, _, value = override.partition("=")
        monkeypatch.setenv(name, value)
    args = [*BASE, *(o.format(tmp=tmp_path) for o in overrides if not o.startswith(KNOBS))]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=args)
    nproc = local_rank_count(cfg)
    with pytest.raises(ConfigError) as refused:
        settle_config(cfg, nproc, nproc, tmp_path / "run", args)
    for text in expected:
        assert text.format(tmp=tmp_path) in str(refused.value), f"{text!r} not in:\n{refused.value}"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_disk_full_during_a_save_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path, cli_env):
    """RLIMIT_FSIZE makes every write past 256 KiB fail with EFBIG, as a full disk would."""
    run = tmp_path / "run"
    args = [
        *FAST,
        "model.d_model=256",
        "averager=none",
        "sharding=full_shard",
        "checkpoint=full",
        "checkpoint.interval=2",
        f"hydra.run.dir={run}",
    ]
    ok = run_cli([*args, "train.steps=2"], cli_env, tmp_path)
    assert ok.returncode == 0, ok.stderr
    before = snapshot(run / "checkpoints" / "step_2")
    limit = 256 * 1024
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *args, "train.steps=4"],
        env=cli_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # torch's zip writer reports the short write in its own words ("unexpected pos ..."), so match ours
    assert (
        "saving checkpoint step 4" in out
        and "was not committed" in out
        and "Fix: if the disk is full, free space" in out
    )
    assert snapshot(run / "checkpoints" / "step_2") == before
    assert "Traceback" in (run / "train.log").read_text(), "the failed save's traceback is kept in train.log"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4.partial"]


# (id, module, its arguments, texts the message must contain); {tmp} is the test's tmp dir
TOOL_CASES = [
    ("prepare typo", "prepare", ["inptu=[{tmp}/a.txt]", "out={tmp}/data"], ["inptu=[{tmp}/a.txt]:", "Fix: input=["]),
    ("prepare type", "prepare", ["input={tmp}/a.txt", "out={tmp}/data", "vocab_size=big"], ["takes an integer"]),
    ("prepare no out", "prepare", ["input={tmp}/a.txt"], ["out is required. Fix: python -m harness.prepare input="]),
    ("prepare out a file", "prepare", ["input={tmp}/a.txt", "out={tmp}/a.txt"], ["out='{tmp}/a.txt' is a file"]),
    ("export out a file", "export", ["{tmp}", "{tmp}/a.txt"], ["'{tmp}/a.txt' is a file, not a directory. Fix:"]),
    ("export overrides", "export", ["source={tmp}", "out={tmp}/x"], ["takes two paths, not key=value overrides"]),
    ("generate empty prompt", "generate", ["{tmp}/run", "prompt="], ["prompt='' is empty", 'Fix: prompt="def main("']),
    ("generate seed", "generate", ["{tmp}/run", "prompt=def", "seed=99999999999999999999999"], ["outside [0, 2**63)"]),
    ("generate nan", "generate", ["{tmp}/run", "prompt=def", "temperature=nan"], ["temperature a finite number"]),
    (  # its fix said group=None, itself refused
        "generate group a word",
        "generate",
        ["{tmp}/run", "prompt=def", "group=first"],
        ["group='first' is not a int. Fix: e.g. group=0 (a replica group's number)"],
    ),
    ("generate no run", "generate", ["{tmp}/none", "prompt=def"], ["'{tmp}/none' does not exist. Fix:"]),
    (  # transformers' FileNotFoundError traceback
        "generate an export without weights",
        "generate",
        ["{tmp}/export", "prompt=def"],
        ["'{tmp}/export' holds a config.json but no weights", "Fix: export the run again"],
    ),
    (  # dropped silently
        "generate a group of an export",
        "generate",
        ["{tmp}/export", "prompt=def", "group=1"],
        ["group= picks a replica group of a fault-tolerant run, but '{tmp}/export' is an export", "Fix: drop group="],
    ),
    (  # refused before the export, naming the run
        "generate no tokenizer",
        "generate",
        ["{tmp}/run", "prompt=def"],
        ["'{tmp}/run': the run trained on SyntheticTokens without a tokenizer file", "Fix: train on data=tokens"],
    ),
    ("report out a file", "report", ["{tmp}/run", "--out", "{tmp}/a.txt"], ["--out '{tmp}/a.txt' cannot be a"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,module,args,expected", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_bad_tool_input_fails_clearly_and_writes_nothing(name, module, args, expected, tmp_path, cli_env):
    """`python -m harness.prepare`, `export`, `generate` and `report` get train.py's treatment (Hydra's composition
    errors too). {tmp}/run is a run of synthetic tokens with a checkpoint (its meta.json) and metrics."""
    (tmp_path / "a.txt").write_text("some text")
    step = fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_5")
    meta = json.loads((step / "meta.json").read_text())
    meta["config"] = {"data": {"_target_": "harness.data.SyntheticTokens", "noise": 0.1}, "model": MODEL}
    (step / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 5.0}) + "\n")
    (tmp_path / "export").mkdir()  # an export cut short: its config and tokenizer, no weights
    (tmp_path / "export" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "export" / "tokenizer.json").write_text("{}")
    before = snapshot(tmp_path)
    command = [sys.executable, "-m", f"harness.{module}", *[a.format(tmp=tmp_path) for a in args]]
    proc = subprocess.run(command, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    for text in expected:
        assert text.format(tmp=tmp_path) in out, f"{text!r} not in:\n{out}"
    assert "Traceback" not in out and "\n\n" not in out.strip(), out
    assert snapshot(tmp_path) == before, "a refused command wrote or changed files"


def composition_errors(*args: str) -> list[str]:
    return override_errors(["train.py", *args], REPO / "conf")


# (command line, the paragraph it gets)
COMPOSITION = [
    (
        ["train.stepz=3"],
        "harness: train.stepz=3: 'train' (TrainConf) has no key 'stepz'. Fix: train.steps=3 (the closest key).",
    ),
    (["steps=3"], "harness: steps=3: the config has no key 'steps'. Fix: train.steps=3 (the closest key)."),
    (
        ["model.foo=1"],
        "harness: model.foo=1: 'model' (GPTConf) has no key 'foo'. "
        "Fix: one of the keys of model: activation_checkpointing, init_from, _target_, n_layer, n_head, d_model, "
        "vocab_size, bias, tie_embeddings, activation, n_positions, dropout.",
    ),
    (["train.steps=abc"], "harness: train.steps=abc: train.steps takes an integer. Fix: train.steps=200, for example."),
    (  # OmegaConf takes any integer for a bool: 2 was true
        ["model.bias=2"],
        "harness: model.bias=2: model.bias takes true or false. Fix: model.bias=true or model.bias=false.",
    ),
    (
        ["sharding.replicate=two"],
        "harness: sharding.replicate=two: sharding.replicate takes an integer or null. "
        "Fix: sharding.replicate=1, for example.",
    ),
    (["wandb.tags=abc"], "harness: wandb.tags=abc: wandb.tags takes a list. Fix: wandb.tags=[a,b], for example."),
    (
        ["train.device=gpu"],
        "harness: train.device=gpu: train.device must be one of auto|cpu|cuda. Fix: one of train.device=auto|cpu|cuda.",
    ),
    (
        ["train.nonfinite=skp"],
        "harness: train.nonfinite=skp: train.nonfinite must be one of error|skip. "
        "Fix: train.nonfinite=skip (the closest value), or one of train.nonfinite=error|skip.",
    ),
    (
        ["optimizer=sgdd"],
        "harness: optimizer=sgdd: config group optimizer has no option 'sgdd' (its options are the files in "
        "conf/optimizer/). Fix: optimizer=sgd (the closest option), or one of optimizer=adam|adamw|sgd.",
    ),
    (
        ["averager=diloco", "averager/outer_optimizer=nesterv"],
        "harness: averager/outer_optimizer=nesterv: config group averager/outer_optimizer has no option 'nesterv' "
        "(its options are the files in conf/averager/outer_optimizer/). Fix: averager/outer_optimizer=nesterov "
        "(the closest option), or one of averager/outer_optimizer=adamw|nesterov|sgd.",
    ),
    (
        ["+train.steps=5"],
        "harness: +train.steps=5: train.steps is already in the config, and '+' adds a key that is not. "
        "Fix: train.steps=5 (without the '+').",
    ),
    (
        ["train.steps=1,2"],
        "harness: train.steps=1,2 is a sweep over several values, which needs -m. Fix: `python train.py -m ... "
        "train.steps=1,2` runs one job per value; train.steps=[1,2] is a list, train.steps='1,2' a string.",
    ),
    (
        ["model.activation_checkpointing=ful"],
        "harness: model.activation_checkpointing=ful: model.activation_checkpointing must be one of "
        "none|full|selective. Fix: model.activation_checkpointing=full (the closest value)",
    ),
    (["train.steps"], "harness: the override 'train.steps' cannot be parsed (missing EQUAL at '<EOF>')."),
    (
        ["-m", "averager.warmup_steps=2,4,x"],
        "harness: averager.warmup_steps=x: averager.warmup_steps takes an integer.",
    ),
    (  # its fix was "averager.min_period=auto (the closest key)"
        ["averager=hierarchical", "averager.period=auto"],
        "harness: averager.period=auto: averager=hierarchical averages at the periods of averager.period_group_size",
    ),
    (
        ["-m", "averager=periodic,none", "averager.period=8"],
        "harness: in the sweep's job with averager=none: averager.period=8: averager=none trains synchronously "
        "(gradients averaged every step): no local steps to average, plan or balance, so it takes none of the "
        "averagers' keys. Fix: averager=periodic or averager=diloco to use it, or leave averager.period out.",
    ),
    (  # no local steps to balance: synchronous training has no such key
        ["averager=none", "averager.balance=time"],
        "harness: averager.balance=time: averager=none trains synchronously (gradients averaged every step): no "
        "local steps to average, plan or balance, so it takes none of the averagers' keys. Fix: averager=periodic "
        "or averager=diloco to use it, or leave averager.balance out.",
    ),
]


@pytest.mark.parametrize("args,paragraph", COMPOSITION, ids=[" ".join(c[0]) for c in COMPOSITION])
def test_composition_errors_get_one_paragraph_with_the_fix(args, paragraph):
    [error] = composition_errors(*args)
    assert error.startswith(paragraph), error
    assert "\n" not in error and "Fix: " in error
    assert "+" + args[-1] not in error, "suggests adding the key given (which validate refuses)"


def test_every_bad_override_is_reported_at_once():
    errors = composition_errors("optimizer=sgdd", "optimizer.lr=abc", "train.stepz=3", "train.device=tpu")
    # optimizer.lr cannot be checked against an option that does not exist
    assert [e.split(":")[1].strip() for e in errors] == ["optimizer=sgdd", "train.stepz=3", "train.device=tpu"]


@pytest.mark.parametrize(
    "args",
    [
        [],
        FAST,
        ["-m", "optimizer=glob(*)", "averager.period=2,4", "train.steps=range(1,3)"],
        ["hydra.foo=1"],  # Hydra's own keys keep Hydra's own message, from its run
        ["--help", "train.stepz=3"],  # Hydra's help, not a run
    ],
)
def test_composable_commands_and_hydra_s_own_pass(args):
    assert composition_errors(*args) == []


def test_closest_is_a_typo_not_a_guess():
    assert closest("stepz", ["seed", "steps", "seq_len"]) == "steps"
    assert closest("gpu", ["auto", "cpu", "cuda"]) is None
