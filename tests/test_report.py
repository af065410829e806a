"""`python -m harness.report` on input it cannot use (the plots themselves are
checked on real sweeps in test_sweep.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import metrics
from harness.report import main as report_main
from harness.report import read_run, run_figure, summarize, sweep_loss_figure, tradeoff_figure

from support import REPO


def test_a_dir_without_runs_is_refused_with_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "missing"):
        proc = subprocess.run(
            [sys.executable, "-m", "harness.report", str(target)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2
        assert str(target) in proc.stderr and "Fix: pass outputs/" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "empty" / "report").exists()


def write_job(job_dir: Path, num: int, overrides: list[str], losses: dict[int, float], mb: float, log_every: int):
    """A finished sweep job's files as the harness writes them: result.json, .hydra/config.yaml, metrics.jsonl."""
    (job_dir / ".hydra").mkdir(parents=True)
    result = {"job": num, "name": ",".join(overrides), "overrides": overrides, "status": "completed"}
    (job_dir / "result.json").write_text(json.dumps({**result, "exit_code": 0, "reason": ""}))
    (job_dir / ".hydra" / "config.yaml").write_text(f"train:\n  steps: {max(losses)}\n  log_every: {log_every}\n")
    rows = [
        {
            "step": step,
            metrics.TRAIN_LOSS: loss,
            metrics.TRAIN_STEP_TIME: 0.1,
            metrics.COMM_TOTAL_BYTES: mb * 1e6 * step / max(losses),
            **({metrics.EVAL_LOSS: loss + 0.05} if step == max(losses) else {}),
        }
        for step, loss in losses.items()
    ]
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_two_by_two_sweeps_plots_name_every_job_in_a_legend_inside_the_figure(tmp_path):
    """Four jobs that end close together: the trade-off plot names them in one legend
    (no labels at the points, which overlapped and ran off the axes), inside the
    saved figure; the loss plots say they draw only the logged steps."""
    sweep = tmp_path / "sweep"
    grid = [(p, o) for p in ("averager.period=16", "averager.period=64") for o in ("optimizer=sgd", "optimizer=adamw")]
    for num, overrides in enumerate(grid):
        losses = {1: 5.5, 10: 3.0 + 0.01 * num, 20: 2.5 + 0.001 * num}
        write_job(sweep / str(num), num, list(overrides), losses, mb=1.0 + 0.01 * num, log_every=10)
    assert report_main([str(sweep)]) == 0
    runs = [read_run(sweep / str(num)) for num in range(4)]
    lines = [summarize(run) for run in runs]
    colors = {run.name: f"C{i}" for i, run in enumerate(runs)}
    fig = tradeoff_figure(lines, "sweep", colors)
    fig.canvas.draw()
    [legend] = fig.legends
    assert sorted(t.get_text() for t in legend.get_texts()) == sorted(run.name for run in runs)
    assert not any(ax.texts for ax in fig.axes)  # no labels at the points
    inside = fig.bbox.padded(1)
    assert all(inside.contains(*corner) for corner in legend.get_window_extent().corners())
    for figure in (sweep_loss_figure(runs, "sweep", colors), run_figure(runs[0])):
        titles = " ".join(ax.get_title() for ax in figure.axes)
        assert "at the logged steps only (train.log_every=10" in titles, titles
    assert (sweep / "report" / "tradeoff.png").stat().st_size > 0


def test_a_value_that_is_not_a_number_is_left_out_naming_file_and_line(tmp_path, capsys):
    """A row whose loss is a word (a hand-edited or foreign metrics.jsonl) made the loss axis
    categorical and drew a falling loss rising, silently: the value is left out, naming file and line."""
    rows = [{"step": 1, metrics.TRAIN_LOSS: 3.0}, {"step": 2, metrics.TRAIN_LOSS: "n/a", metrics.TRAIN_LR: 0.1}]
    rows += [{"step": 3, metrics.TRAIN_LOSS: 2.0, metrics.CHECKPOINT_MODE: "full"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = read_run(tmp_path)
    assert run.series(metrics.TRAIN_LOSS) == ([1, 3], [3.0, 2.0]) and run.series(metrics.TRAIN_LR) == ([2], [0.1])
    assert run.rows[2][metrics.CHECKPOINT_MODE] == "full"
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}:2: train/loss='n/a' is not a number; left out" in err
    assert report_main([str(tmp_path)]) == 0
