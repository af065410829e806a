"""The metrics sink: jsonl and W&B get the same rows; W&B trouble never stops training."""

from __future__ import annotations

import json
import logging

import pytest
from omegaconf import OmegaConf

from harness.sinks import MetricsSink

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
    log_rows(MetricsSink(tmp_path, wandb_cfg(), {}, enabled=False))
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_online_without_network_falls_back_to_offline(tmp_path, wandb_env, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: connection refused
    sink = MetricsSink(tmp_path, wandb_cfg(mode="online", init_timeout_s=10), {}, enabled=True)
    assert sink.wandb_run is not None and sink.wandb_run.settings.mode == "offline"
    log_rows(sink, n=2)
    assert "W&B mode=online failed" in caplog.text and "falling back to offline" in caplog.text
    # (the failed online attempt leaves W&B's own run-<id> folder next to it)
    [offline] = [p for p in find_run_files(tmp_path / "wandb") if p.parent.name.startswith("offline-run-")]
    assert [h["train/loss"] for h in read_run(offline)["history"]] == [5, 4]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
