"""The user-facing commands, end to end: real processes, real files, real W&B offline runs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from support import FAST, REPO, check_ok, check_rank_config, read_metrics, run_cli
from wandb_reader import find_run_files, read_run

pytestmark = pytest.mark.slow


def _run_dirs(root):
    return sorted(p.parent for p in root.glob("outputs/*/*/.hydra"))


def test_mission_command_under_torchrun_writes_one_run_dir_with_metrics_and_wandb(tmp_path, cli_env):
    """`torchrun --nproc-per-node 2 train.py optimizer=sgd averager.period=4`, rank 1 started 2.5 s late.
    It leaves nothing in the temp dir (W&B's media and artifact dirs were left by every launch) but torch's
    compile cache, one per user, shared by every run."""
    cli_env.pop("WANDB_MODE")
    temp = tmp_path / "temp"
    temp.mkdir()
    cli_env["TMPDIR"] = str(temp)
    args = [
        "optimizer=sgd",
        "averager.period=4",
        "averager.warmup_steps=2",
        "train.steps=12",
        "train.log_every=3",
        "train.eval_every=4",
        "train.eval_batches=64",  # an eval pass many steps long: the step time leaves it out
        "model.n_layer=2",
    ]
    proc = run_cli(args, cli_env, tmp_path, torchrun_nproc=2, script=REPO / "tests" / "probes" / "delayed_rank.py")
    check_ok(proc)
    stamps = sorted(p for p in (tmp_path / "outputs").glob("*/*"))
    assert len(stamps) == 1, f"ranks disagreed on the run dir: {stamps}"
    [run_dir] = _run_dirs(tmp_path)
    assert (run_dir / "train.log").exists() and (run_dir / "logs" / "rank1.log").exists()

    rows = read_metrics(run_dir)
    # log steps 1, 3, 6, 9, 12 plus every averaging step (after 0-based iterations 2, 6, 10, and the run's last)
    # and eval step
    assert [r["step"] for r in rows] == [1, 3, 4, 6, 7, 8, 9, 11, 12]
    assert [r["step"] for r in rows if "eval/loss" in r] == [4, 8, 12]
    assert [r["step"] for r in rows if r["averager/averaged"]] == [3, 7, 11, 12]
    log_rows = [r for r in rows if r["step"] in (1, 3, 6, 9, 12)]
    assert log_rows[-1]["train/loss"] < log_rows[0]["train/loss"]
    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/step_time_s",
        "train/tokens_per_s",
        "memory/max_rss_gb",
        "comm/grad_sync_bytes",
        "averager/step",
    ):
        assert all(key in r for r in log_rows), key
    assert all(r["averager/drift"] > 0 for r in rows if r["averager/averaged"])
    # step 12 logs 3 steps and evaluates: its step time is theirs alone (it held the eval: a third of it or more)
    [last] = [r for r in rows if r["step"] == 12]
    assert all("eval/time_s" in r for r in rows if "eval/loss" in r)
    assert last["train/step_time_s"] < last["eval/time_s"] / 3, last
    assert "step 12/12 | loss" in proc.stdout and "tok/s" in proc.stdout
    # eval/loss on the console: on the progress line of a log step that evaluates, on its own line otherwise
    for step in (4, 8, 12):
        eval_loss = f"eval loss {next(r['eval/loss'] for r in rows if r['step'] == step):.4f}"
        assert re.search(rf"step {step}/12 \|(.* \|)? {eval_loss}", proc.stdout), (eval_loss, proc.stdout)

    [wandb_file] = find_run_files(run_dir / "wandb")
    run = read_run(wandb_file)
    history = [{k: v for k, v in row.items() if not k.startswith("_")} for row in run["history"]]
    assert history == [{k: v for k, v in r.items() if k != "step"} for r in rows]
    assert [row["_step"] for row in run["history"]] == [r["step"] for r in rows]
    assert run["config"]["optimizer"]["_target_"] == "torch.optim.SGD"
    assert run["config"]["averager"]["period"] == 4 and run["run"]["project"] == "harness"
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_python_train_py_starts_its_own_ranks(tmp_path, cli_env):
    proc = run_cli([*FAST, "metrics.tensorboard=true", "hydra.run.dir=run"], cli_env, tmp_path)
    check_ok(proc)
    assert "starting 2 local ranks" in proc.stdout and "'replicate': 2" in proc.stdout
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()
    assert (tmp_path / "run" / "logs" / "rank1.log").exists()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 8
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))  # TensorBoard's own reader
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (row["step"], float(np.float32(row["train/loss"]))) for row in rows if "train/loss" in row
    ]


def test_hybrid_two_by_two_under_torchrun(tmp_path, cli_env):
    proc = run_cli(
        [*FAST, "sharding=hybrid_shard", "sharding.replicate=2", "optimizer=adamw", "hydra.run.dir=run"],
        cli_env,
        tmp_path,
        torchrun_nproc=4,
    )
    check_ok(proc)
    assert "mesh {'replicate': 2, 'shard': 2}" in proc.stdout
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]


def test_sweep_under_torchrun_is_refused_with_the_fix(tmp_path, cli_env):
    proc = run_cli(["-m", "averager.period=2,4"], cli_env, tmp_path, torchrun_nproc=2)
    assert proc.returncode != 0
    assert proc.stderr.count("python train.py -m ... launcher.nproc=2") == 1, proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_config_error_under_torchrun_is_printed_once(tmp_path, cli_env):
    proc = run_cli(["sharding=full_shard", "hydra.run.dir=run"], cli_env, tmp_path, torchrun_nproc=2)
    assert proc.returncode != 0
    assert proc.stderr.count("the config cannot run (world size 2)") == 1, proc.stderr


def test_text_data_on_two_ranks_builds_the_cache_once(tmp_path, cli_env):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b"):
        (corpus / f"{name}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    proc = run_cli(
        [
            *FAST,
            "data=text",
            f"data.root={corpus}",
            "data.glob=*.txt",
            f"data.cache_dir={tmp_path / 'cache'}",
            "hydra.run.dir=run",
        ],
        cli_env,
        tmp_path,
    )
    check_ok(proc)
    assert proc.stdout.count("cached 18000 bytes from 2 files") == 1
    assert len(list((tmp_path / "cache").iterdir())) == 1
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]


def test_default_job_on_one_rank_trains_synchronously_and_says_so(tmp_path, cli_env):
    """One GPU starts one rank: the default job's averager has nothing to average
    there, so it trains synchronously and says so; an averager asked for is refused."""
    small = ["model=mlp", "train.steps=3", "train.batch_size=4", "train.seq_len=16"]
    proc = run_cli([*small, "launcher.nproc=1", "hydra.run.dir=run"], cli_env, tmp_path)
    check_ok(proc)
    assert proc.stdout.count("nothing to average, so this run trains synchronously (averager=none)") == 1
    saved = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert saved.averager._target_ is None and saved.sharding.replicate == 1 and saved.launcher.nproc == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 3]  # log steps: the first and the last

    proc = run_cli([*small, "launcher.nproc=1", "averager=periodic", "hydra.run.dir=asked"], cli_env, tmp_path)
    assert proc.returncode == 2 and "so there is nothing to average" in proc.stderr, proc.stderr
    assert "Fix: launcher.nproc=2" in proc.stderr and not (tmp_path / "asked").exists()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ranks_receive_the_typed_struct_mode_config(method, tmp_path):
    """What `python train.py` passes its ranks is Hydra's typed config, not plain values
    (`check_rank_config` fails in a rank for a plain copy, as the second launch shows)."""
    from harness.config import plain, register_configs
    from harness.launch import start_local_ranks
    from harness.plan import plan_run

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=mlp", f"launcher.start_method={method}"])
    plan = plan_run(cfg, 2, 2, tmp_path)
    assert start_local_ranks(cfg, tmp_path, plan, entrypoint=check_rank_config) is None
    untyped = OmegaConf.create(plain(cfg))
    assert "(exit 1)" in start_local_ranks(untyped, tmp_path, plan, entrypoint=check_rank_config)
