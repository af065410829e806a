"""The metrics sink: jsonl, W&B and TensorBoard get the same rows; W&B trouble never stops training."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness import metrics
from harness.sinks import MetricsSink

from support import REPO, read_metrics
from wandb_reader import find_run_files, read_run


def wandb_cfg(**kw):
    base = {
        "mode": "offline",
        "project": "p",
        "entity": None,
        "group": "g",
        "name": None,
        "tags": ["t"],
        "init_timeout_s": 90.0,
    }
    return OmegaConf.create({**base, **kw})


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    for key, sub in [("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")]:
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc key
    monkeypatch.setenv("WANDB_SILENT", "true")


def log_rows(sink: MetricsSink, n: int = 3) -> list[dict]:
    rows = [{"train/loss": 5.0 - i, "train/lr": 0.1} for i in range(n)]
    for step, row in enumerate(rows, start=1):
        sink.log(row, step)
    sink.close()
    return rows


def test_rows_reach_jsonl_and_the_offline_wandb_run(tmp_path, wandb_env):
    """W&B's run opens on its own thread: rows logged before it is open reach it too, in order."""
    sink = MetricsSink(tmp_path, wandb_cfg(), {"a": {"b": 1}}, enabled=True)
    rows = log_rows(sink)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": i, "train/step": i, **r} for i, r in enumerate(rows, start=1)]
    [path] = find_run_files(tmp_path / "wandb")
    run = read_run(path)
    assert [(h["_step"], h["train/loss"], h["train/step"]) for h in run["history"]] == [(1, 5, 1), (2, 4, 2), (3, 3, 3)]
    assert run["config"]["a"] == {"b": 1} and run["run"]["group"] == "g" and run["run"]["tags"] == ["t"]


def test_wandb_mode_env_var_wins_over_config(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = MetricsSink(tmp_path, wandb_cfg(mode="offline"), {}, enabled=True)
    assert sink.wandb_run is None
    log_rows(sink)
    assert not (tmp_path / "wandb").exists() and (tmp_path / "metrics.jsonl").exists()


def test_online_without_api_key_falls_back_to_offline_and_keeps_logging(tmp_path, wandb_env, caplog):
    caplog.set_level(logging.WARNING)
    sink = MetricsSink(tmp_path, wandb_cfg(mode="online"), {}, enabled=True)
    log_rows(sink, n=2)
    assert "W&B mode=online failed" in caplog.text and "falling back to offline" in caplog.text
    assert len(find_run_files(tmp_path / "wandb")) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_unwritable_wandb_dir_warns_and_training_logs_go_on(tmp_path, wandb_env, caplog):
    caplog.set_level(logging.WARNING)
    (tmp_path / "wandb").write_text("a file where W&B wants its folder")
    sink = MetricsSink(tmp_path, wandb_cfg(), {}, enabled=True)
    log_rows(sink, n=2)
    assert sink.wandb_run is None and "continuing without W&B" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_sink_on_other_ranks_writes_nothing(tmp_path, wandb_env):
    log_rows(MetricsSink(tmp_path, wandb_cfg(), {}, enabled=False, tensorboard=True))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_online_without_network_falls_back_to_offline(tmp_path, wandb_env, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: connection refused
    sink = MetricsSink(tmp_path, wandb_cfg(mode="online", init_timeout_s=10), {}, enabled=True)
    assert sink.wandb(wait=True) is not None and sink.wandb_run.settings.mode == "offline"
    log_rows(sink, n=2)
    assert "W&B mode=online failed" in caplog.text and "falling back to offline" in caplog.text
    # (the failed online attempt leaves W&B's own run-<id> folder next to it)
    [offline] = [p for p in find_run_files(tmp_path / "wandb") if p.parent.name.startswith("offline-run-")]
    assert [h["train/loss"] for h in read_run(offline)["history"]] == [5, 4]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.fixture
def no_wandb(wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


def log_resumed_run(run_dir) -> None:
    """A run that checkpoints at step 4 and dies after logging step 5, then resumes
    from step 4 and logs steps 5 and 6 again, with other values."""
    sink = MetricsSink(run_dir, wandb_cfg(), {}, enabled=True, tensorboard=True)
    for step in range(1, 6):
        row = {metrics.TRAIN_LOSS: 5.0 / step, metrics.TRAIN_LR: 0.1, metrics.COMM_TOTAL_BYTES: 123_456_789 * step}
        sink.log(row, step)
        if step == 4:
            sink.log({metrics.CHECKPOINT_MODE: "full", metrics.CHECKPOINT_SAVE: 0.25}, step)
    sink.close()
    sink = MetricsSink(run_dir, wandb_cfg(), {}, enabled=True, tensorboard=True)
    sink.rewind(4)
    sink.log({metrics.CHECKPOINT_LOAD: 0.5, metrics.RUN_RESUMED_FROM: 4, metrics.RUN_RESTARTS: 1}, 4)
    for step in (5, 6):
        sink.log({metrics.TRAIN_LOSS: 10.0 / step, metrics.TRAIN_LR: 0.05, metrics.TRAIN_SKIPPED_NONFINITE: True}, step)
    sink.close()


def jsonl_scalars(run_dir) -> list[tuple[str, int, float]]:
    """metrics.jsonl's numeric values as (tag, step, value), rounded to float32 as
    TensorBoard stores them; train/step is TensorBoard's own step axis, not a tag."""
    return sorted(
        (name, row["step"], float(np.float32(value)))
        for row in read_metrics(run_dir)
        for name, value in row.items()
        if name not in ("step", metrics.TRAIN_STEP) and isinstance(value, (int, float))
    )


def test_tensorboard_events_hold_every_numeric_value_of_metrics_jsonl_across_a_resume(tmp_path, no_wandb):
    log_resumed_run(tmp_path)
    assert not (tmp_path / "wandb").exists()
    events = EventAccumulator(str(tmp_path / "tensorboard"))  # TensorBoard's own reader
    events.Reload()
    logged = sorted((tag, e.step, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag))
    # the resumed run's steps 5 and 6 only: the first run's step 5 is hidden, as in metrics.jsonl
    assert logged == jsonl_scalars(tmp_path)
    assert (metrics.TRAIN_LOSS, 5, float(np.float32(2.0))) in logged
    # ... whose row was moved aside, not lost
    [aside] = [json.loads(line) for line in (tmp_path / "metrics.rewound.1.jsonl").read_text().splitlines()]
    assert aside["step"] == 5 and aside[metrics.TRAIN_LOSS] == 1.0
    assert metrics.CHECKPOINT_MODE not in events.Tags()["scalars"]  # a string: not a scalar


def test_without_metrics_tensorboard_no_event_files(tmp_path, no_wandb):
    log_rows(MetricsSink(tmp_path, wandb_cfg(), {}, enabled=True))
    assert not (tmp_path / "tensorboard").exists()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def poll(server: subprocess.Popen, log, read, done, timeout_s: float = 60):
    """`read()` every half second until `done(it)`; the last value read."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, log.read_text()
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def check_served(url: str, tags: dict, run_dir, run: str) -> None:
    """The run's scalar tags are metrics.jsonl's, and train/loss its values, each step once."""
    logged = jsonl_scalars(run_dir)
    assert set(tags[run]) == {tag for tag, _, _ in logged}
    query = urllib.parse.urlencode({"run": run, "tag": metrics.TRAIN_LOSS})
    served = get_json(f"{url}data/plugin/scalars/scalars?{query}")
    assert [(step, value) for _, step, value in served] == [
        (step, value) for tag, step, value in logged if tag == metrics.TRAIN_LOSS
    ]


# auto: the Rust data server where its wheel exists (here); false: the Python loader, which
# takes a run's first SessionLog.START for its start (so every session writes one)
@pytest.mark.parametrize("load_fast", ["auto", "false"])
def test_tensorboard_serves_a_sweeps_runs_while_they_log(tmp_path, no_wandb, load_fast):
    """`tensorboard --logdir` on a sweep's folder shows each job's run dir as a
    run: a finished resumed one (the steps it logged again once, with their new
    values) and one still logging, whose next row shows up while its writer is open."""
    sweep = tmp_path / "multirun"
    for job in ("0", "1"):
        (sweep / job).mkdir(parents=True)
    log_resumed_run(sweep / "0")
    running = MetricsSink(sweep / "1", wandb_cfg(), {}, enabled=True, tensorboard=True)
    for step in (1, 2):
        running.log({metrics.TRAIN_LOSS: 3.0 - step, metrics.TRAIN_LR: 0.1}, step)
    log = tmp_path / "tensorboard.log"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(sweep), "--load_fast", load_fast]
    with open(log, "w") as out:
        server = subprocess.Popen(
            [*command, "--reload_interval", "1", "--host", "127.0.0.1", "--port", "0"], stdout=out, stderr=out
        )
    try:
        found = poll(server, log, lambda: re.search(r"at (http://127\.0\.0\.1:\d+/)", log.read_text()), bool)
        assert found, log.read_text()
        url = found[1]
        runs = {"0/tensorboard", "1/tensorboard"}
        tags = poll(server, log, lambda: get_json(url + "data/plugin/scalars/tags"), lambda tags: set(tags) == runs)
        check_served(url, tags, sweep / "0", "0/tensorboard")
        check_served(url, tags, sweep / "1", "1/tensorboard")
        # the open writer's next row
        running.log({metrics.TRAIN_LOSS: 0.5, metrics.EVAL_LOSS: 0.75}, 3)
        tags = poll(
            server,
            log,
            lambda: get_json(url + "data/plugin/scalars/tags"),
            lambda tags: metrics.EVAL_LOSS in tags["1/tensorboard"],
        )
        check_served(url, tags, sweep / "1", "1/tensorboard")
    finally:
        server.kill()
        server.wait()
        running.close()


def test_metrics_tensorboard_without_the_package_is_refused_before_any_rank_starts(tmp_path):
    """In a Python where `import tensorboard` fails (a None in sys.modules: the
    import alone is stubbed), the default job validates and logs, and
    metrics.tensorboard=true gets the paragraph naming key, value and fix."""
    script = f"""
import sys
sys.modules["tensorboard"] = None
from pathlib import Path
from hydra import compose, initialize_config_dir
from harness.config import ConfigError, register_configs
from harness.sinks import MetricsSink
from harness.validate import validate
register_configs()
with initialize_config_dir(config_dir="{REPO / "conf"}", version_base=None):
    default = compose("config", overrides=["wandb.mode=disabled"])
    tensorboard = compose("config", overrides=["metrics.tensorboard=true"])
validate(default, world_size=2, gpus=0)
sink = MetricsSink(Path("{tmp_path}"), default.wandb, {{}}, enabled=True, tensorboard=default.metrics.tensorboard)
sink.log({{"train/loss": 1.0}}, 1)
sink.close()
try:
    validate(tensorboard, world_size=2, gpus=0)
except ConfigError as e:
    print(e)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "metrics.tensorboard=true writes TensorBoard event files through torch.utils.tensorboard, but the "
        "'tensorboard' package is not installed in this Python environment. Fix: pip install -e "
        '".[tensorboard]" (or pip install tensorboard), or metrics.tensorboard=false.'
    )
    assert (tmp_path / "metrics.jsonl").exists()
