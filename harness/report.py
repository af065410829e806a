"""Plots and tables from `metrics.jsonl` (the rows W&B gets), so they work
offline and after the fact.

    python -m harness.report <run dir>    ->  <run dir>/report/run.png, summary.md, summary.csv
    python -m harness.report <sweep dir>  ->  <sweep dir>/report/jobs.md, jobs.csv, loss.png, tradeoff.png

A sweep report has one line per job dir, failed jobs included (their
`result.json` says why), sorted by final loss. `tradeoff.png` puts each job's
final loss (held-out `eval/loss` when every job has one) against its
cross-replica bytes and against its training time.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from harness import metrics  # noqa: E402
from harness.sweep import RESULT_FILE  # noqa: E402

# checkpoint metric -> bar label
TIMINGS = {
    metrics.CHECKPOINT_STATE_DICT: "state dict",
    metrics.CHECKPOINT_SAVE: "save (training blocked)",
    metrics.CHECKPOINT_WRITE: "write (until durable)",
    metrics.CHECKPOINT_STAGING_WAIT: "async staging wait",
    metrics.CHECKPOINT_LOAD: "load (resume)",
    metrics.CHECKPOINT_SET_STATE_DICT: "set state dict (resume)",
}


@dataclass
class Run:
    path: Path
    name: str
    rows: list[dict]
    config: dict  # the resolved config from .hydra/config.yaml ({} when missing)
    result: dict | None  # a sweep job's result.json

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(row["step"], row[key]) for row in self.rows if row.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def last(self, key: str) -> float | None:
        values = self.series(key)[1]
        return values[-1] if values else None


TEXT_METRICS = {metrics.CHECKPOINT_MODE}  # the metrics whose values are words; every other value is a number


def read_run(path: Path) -> Run:
    """A run's rows, config and result. A value that should be a number and is not (a hand-edited or
    foreign metrics.jsonl) is left out, with a line on stderr naming the file and line: plotted, it would
    turn the axis categorical and draw a falling loss rising."""
    metrics_file = path / "metrics.jsonl"
    rows = []
    if metrics_file.exists():
        for number, line in enumerate(metrics_file.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a killed job
                continue
            for key in [k for k, v in row.items() if k not in TEXT_METRICS and not _number(v)]:
                print(
                    f"harness.report: {metrics_file}:{number}: {key}={row.pop(key)!r} is not a number; left out",
                    file=sys.stderr,
                )
            rows.append(row)
    config_file = path / ".hydra" / "config.yaml"
    config = OmegaConf.to_container(OmegaConf.load(config_file)) if config_file.exists() else {}
    result_file = path / RESULT_FILE
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    if result:
        name = result.get("name") or ",".join(result["overrides"])
    else:
        name = (config.get("wandb") or {}).get("name") or path.name
    return Run(path, name, rows, config, result)


def _number(value) -> bool:
    return value is None or isinstance(value, (int, float))  # NaN and inf are numbers: a skipped step's loss


def status(run: Run) -> str:
    if run.result is not None:
        return run.result["status"]
    target = (run.config.get("train") or {}).get("steps")
    return "completed" if run.rows and run.rows[-1]["step"] == target else "incomplete"


def summarize(run: Run) -> dict:
    """One table line: what a comparison of runs looks at."""
    tokens = run.series(metrics.TRAIN_TOKENS_PER_S)[1][1:]  # step 1's time includes start-up
    saves, loads = run.series(metrics.CHECKPOINT_SAVE)[1], run.series(metrics.CHECKPOINT_LOAD)[1]
    drift = run.series(metrics.AVERAGER_DRIFT)[1]
    total_bytes = run.last(metrics.COMM_TOTAL_BYTES)
    return {
        "job": run.result["job"] if run.result else "",
        "name": run.name,
        "status": status(run),
        "steps": run.rows[-1]["step"] if run.rows else 0,
        "final loss": _round(run.last(metrics.TRAIN_LOSS), 4),
        "eval loss": _round(run.last(metrics.EVAL_LOSS), 4),
        "training s": _round(training_seconds(run), 1),
        "tokens/s (median)": _round(statistics.median(tokens), 0) if tokens else None,
        "cross-replica MB per rank": _round(total_bytes / 1e6, 3) if total_bytes is not None else None,
        "averaging steps": sum(1 for row in run.rows if row.get(metrics.AVERAGER_AVERAGED)),
        "mean drift": _round(statistics.fmean(drift), 6) if drift else None,
        "checkpoint saves": len(saves),
        "checkpoint save s (total blocked)": _round(sum(saves), 3) if saves else None,
        "checkpoint load s": _round(sum(loads), 3) if loads else None,
        "failure": run.result["reason"][:160] if run.result and run.result["status"] != "completed" else "",
    }


def training_seconds(run: Run) -> float | None:
    """Time spent in the loop: each logged `train/step_time_s` is the mean since the previous log."""
    total, previous = 0.0, 0
    for row in run.rows:
        if row.get(metrics.TRAIN_STEP_TIME) is not None:
            total += row[metrics.TRAIN_STEP_TIME] * (row["step"] - previous)
            previous = row["step"]
    return total if previous else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits) if digits else int(round(value))


def write_tables(lines: list[dict], out: Path, stem: str) -> None:
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)
    (out / f"{stem}.md").write_text(markdown_table(lines))


def markdown_table(lines: list[dict]) -> str:
    def cell(value) -> str:
        return "–" if value is None or value == "" else str(value).replace("|", "\\|")

    header = list(lines[0])
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows += ["| " + " | ".join(cell(line[key]) for key in header) + " |" for line in lines]
    return "\n".join(rows) + "\n"


def plot_run(run: Run, path: Path) -> None:
    _save(run_figure(run), path)


def paced_replicas(run: Run) -> list[str]:
    """The replicas whose local steps the run's exchange rows hold (averager.balance=time or adacomm), in order."""
    prefix = metrics.REPLICA_LOCAL_STEPS.named("")
    return sorted({key.removeprefix(prefix) for row in run.rows for key in row if key.startswith(prefix)}, key=int)


def run_figure(run: Run):
    replicas = paced_replicas(run)  # a row of the replicas' paces
    fig, axes = plt.subplots(3 if replicas else 2, 2, figsize=(13, 12.5 if replicas else 8.5))
    (ax_loss, ax_drift), (ax_speed, ax_ckpt) = axes[:2]
    if replicas:
        _paces(run, replicas, *axes[2])
    fig.suptitle(f"{run.name}: {describe(run.config)}" if run.config else run.name, fontsize=11)

    steps, loss = run.series(metrics.TRAIN_LOSS)
    ax_loss.plot(steps, loss, marker=".", label="train/loss (mean over ranks)")
    averaged = [row["step"] for row in run.rows if row.get(metrics.AVERAGER_AVERAGED)]
    for i, step in enumerate(averaged):
        ax_loss.axvline(step, color="tab:orange", alpha=0.35, lw=0.8, label="averaging step" if i == 0 else None)
    warmup = (run.config.get("averager") or {}).get("warmup_steps")
    if averaged and warmup:
        ax_loss.axvspan(0, warmup, color="grey", alpha=0.12, label=f"synchronous warmup ({warmup} steps)")
    steps, eval_loss = run.series(metrics.EVAL_LOSS)
    if eval_loss:
        ax_loss.plot(steps, eval_loss, marker="s", ms=4, color="tab:red", label="eval/loss (held out)")
    title = f"Training loss, averaging steps marked\n{logged_steps([run])}"
    _labels(ax_loss, title, "step", "loss (cross-entropy, nats)")

    steps, drift = run.series(metrics.AVERAGER_DRIFT)
    if drift:
        ax_drift.plot(steps, drift, marker="o", ms=3, color="tab:orange", label=metrics.AVERAGER_DRIFT)
        _labels(
            ax_drift, "Replica drift just before each averaging step", "step", "relative RMS distance from the mean"
        )
    else:
        _empty(ax_drift, "Replica drift", "no averaging steps in this run")

    steps, speed = run.series(metrics.TRAIN_TOKENS_PER_S)
    ax_speed.plot(steps, speed, marker=".", color="tab:green", label="train/tokens_per_s (all ranks)")
    ax_speed.set_ylim(bottom=0)
    _labels(ax_speed, "Throughput", "step", "tokens / s")

    _checkpoint_bars(run, ax_ckpt)
    fig.tight_layout()
    return fig


def _paces(run: Run, replicas: list[str], ax_steps, ax_wait, replica: str = "replica") -> None:
    """Each replica's local steps per period and its wait at each exchange (the straggler cost)."""
    for name in replicas:
        steps, local = run.series(metrics.REPLICA_LOCAL_STEPS.named(name))
        ax_steps.plot(steps, local, marker=".", drawstyle="steps-pre", label=f"{replica} {name}")
        steps, wait = run.series(metrics.REPLICA_WAIT.named(name))
        ax_wait.plot(steps, wait, marker=".", label=f"{replica} {name}")
    steps, period = run.series(metrics.AVERAGER_PERIOD)
    ax_steps.plot(steps, period, color="black", lw=0.8, ls="--", drawstyle="steps-pre", label=metrics.AVERAGER_PERIOD)
    _labels(ax_steps, "Local steps per period, by replica", "step", "local steps")
    steps, exchange = run.series(metrics.AVERAGER_EXCHANGE_TIME)  # period=auto: what it chose the period from
    waits = "Wait at each exchange for the last replica"
    if exchange:
        ax_wait.plot(steps, exchange, color="black", lw=0.8, ls="--", label=f"{metrics.AVERAGER_EXCHANGE_TIME} (auto)")
        waits += ", and the exchange's own time"
    _labels(ax_wait, waits, "step", "seconds")


def describe(config: dict) -> str:
    """The knobs a reader compares runs by, in one line."""
    model, optim, avg, shard = (config.get(k) or {} for k in ("model", "optimizer", "averager", "sharding"))
    averager = _class_name(avg) if avg.get("_target_") else "none (synchronous)"
    if str(avg.get("period")) == "auto":
        averager += f", period auto (budget {avg.get('comm_budget')}), after {avg.get('warmup_steps')}"
    elif "period" in avg:
        averager += f" every {avg.get('period')} steps after {avg.get('warmup_steps')}"
    return (
        f"{_class_name(model)} model, {_class_name(optim)} lr {optim.get('lr', '?')}, averager {averager}, "
        f"{shard.get('strategy', '?')} ({shard.get('replicate') or 'implied'} replicas), "
        f"{(config.get('launcher') or {}).get('nproc', '?')} local ranks"
    )


def _class_name(node: dict) -> str:
    return str(node.get("_target_") or node.get("name") or "?").rsplit(".", 1)[-1]


def _checkpoint_bars(run: Run, ax) -> None:
    events = [(row["step"], key, row[key]) for row in run.rows for key in TIMINGS if row.get(key) is not None]
    if not events:
        _empty(ax, "Checkpoint timings", "no checkpoint saved or loaded (checkpoint=none)")
        return
    steps = sorted({step for step, _, _ in events})
    keys = [key for key in TIMINGS if any(k == key for _, k, _ in events)]
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = {step: value for step, k, value in events if k == key}
        xs = [j + i * width for j, step in enumerate(steps) if step in values]
        ax.bar(xs, [values[step] for step in steps if step in values], width, label=TIMINGS[key])
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(steps))], [str(s) for s in steps])
    _labels(ax, "Checkpoint timings, per save and per load", "step", "seconds")


def _labels(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _empty(ax, title: str, text: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def logged_steps(runs: list[Run]) -> str:
    """What a loss curve is drawn from: `train/loss` exists only on logged rows."""
    every = sorted({str((run.config.get("train") or {}).get("log_every", "?")) for run in runs})
    if every == ["1"]:
        return "at every step"
    return f"at the logged steps only (train.log_every={'/'.join(every)}: lower it for more points)"


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep_loss(runs: list[Run], path: Path, title: str, colors: dict[str, str]) -> None:
    _save(sweep_loss_figure(runs, title, colors), path)


def sweep_loss_figure(runs: list[Run], title: str, colors: dict[str, str]):
    fig, ax = plt.subplots(figsize=(10, 6))
    for run in runs:
        steps, loss = run.series(metrics.TRAIN_LOSS)
        failed = status(run) != "completed"
        ax.plot(
            steps,
            loss,
            marker=".",
            ls="--" if failed else "-",
            color=colors[run.name],
            label=f"{run.name}" + (" (failed)" if failed else ""),
        )
    _labels(ax, f"Training loss per job: {title}\n{logged_steps(runs)}", "step", "loss (cross-entropy, nats)")
    fig.tight_layout()
    return fig


def plot_tradeoff(lines: list[dict], path: Path, title: str, colors: dict[str, str]) -> None:
    _save(tradeoff_figure(lines, title, colors), path)


def tradeoff_figure(lines: list[dict], title: str, colors: dict[str, str]):
    """Final loss against cross-replica traffic and against training time: the
    trade-off of communication-efficient training in one picture. Jobs are told
    apart by colour, named in one legend beside the plots (labels at the points
    overlap and run off the axes as soon as jobs end close together)."""
    evaluated = all(line["eval loss"] is not None for line in lines if line["final loss"] is not None)
    loss_key, loss_label = ("eval loss", "held-out eval/loss") if evaluated else ("final loss", "final training loss")
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), layout="constrained")
    legend = {}
    for ax, x_key, x_label in [
        (axes[0], "cross-replica MB per rank", "cross-replica traffic per rank over the run (MB all-reduced)"),
        (axes[1], "training s", "training time (s, sum of step times; start-up excluded)"),
    ]:
        points = [line for line in lines if line[loss_key] is not None and line[x_key] is not None]
        for line in points:
            completed = line["status"] == "completed"
            label = line["name"] + ("" if completed else f" ({line['status']})")
            legend[label] = ax.scatter(
                line[x_key], line[loss_key], s=40, color=colors[line["name"]], marker="o" if completed else "x"
            )
        if not points:
            _empty(ax, title, f"no job logged both a loss and {x_key}")
            continue
        ax.set_title(f"{loss_label} vs {x_key.split(' per')[0]} (lower left is better)", fontsize=10)
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"{loss_label} at the last step (nats)")
        right = max(line[x_key] for line in points)
        ax.set_xlim(0, right * 1.08 if right > 0 else 1)  # from 0, the farthest point inside
        ax.margins(y=0.1)
        ax.grid(alpha=0.3)
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="outside right upper", fontsize=8, title="job")
    fig.suptitle(title, fontsize=11)
    return fig


def job_dirs(sweep_dir: Path) -> list[Path]:
    """A sweep's job dirs: Hydra's numbered subdirs that hold metrics or a result."""
    dirs = [
        p for p in sweep_dir.iterdir() if p.is_dir() and ((p / "metrics.jsonl").exists() or (p / RESULT_FILE).exists())
    ]
    return sorted(dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def report_run(run_dir: Path, out: Path) -> list[Path]:
    run = read_run(run_dir)
    plot_run(run, out / "run.png")
    line = summarize(run)
    write_tables([line], out, "summary")
    print(markdown_table([line]), end="")
    return [out / "run.png", out / "summary.md", out / "summary.csv"]


def replica_group_dirs(run_dir: Path) -> list[Path]:
    """A fault-tolerant run's groups (fault_tolerance=torchft): each logs into replica_group_<r>/."""
    dirs = [p for p in run_dir.glob("replica_group_*") if (p / "metrics.jsonl").exists()]
    return sorted(dirs, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def read_replica_groups(run_dir: Path) -> list[Run]:
    """A fault-tolerant run's groups, each a Run of its own metrics under the run's config."""
    config = read_run(run_dir).config
    runs = []
    for group_dir in replica_group_dirs(run_dir):
        run = read_run(group_dir)
        run.config, run.name = config, group_dir.name
        runs.append(run)
    return runs


def report_replica_groups(run_dir: Path, out: Path) -> list[Path]:
    """A fault-tolerant run: one table line per replica group, and its quorum and loss over steps (and each
    group's local steps and waits where the groups' paces are planned: averager.balance=time or adacomm)."""
    runs = read_replica_groups(run_dir)
    lines = [
        {
            **summarize(run),
            "heals": run.last(metrics.FT_HEALS),
            "skipped steps": run.last(metrics.FT_SKIPPED_STEPS),
            "fewest groups in a quorum": min(run.series(metrics.FT_REPLICAS)[1], default=None),
        }
        for run in runs
    ]
    write_tables(lines, out, "summary")
    plot_replica_groups(runs, out / "replica_groups.png", run_dir.name)
    print(markdown_table(lines), end="")
    return [out / "replica_groups.png", out / "summary.md", out / "summary.csv"]


def plot_replica_groups(runs: list[Run], path: Path, title: str) -> None:
    _save(replica_groups_figure(runs, title), path)


def replica_groups_figure(runs: list[Run], title: str):
    paces = exchanges_of_groups(runs)
    groups = paced_replicas(paces)
    fig = plt.figure(figsize=(11, 12.5 if groups else 8))
    grid = fig.add_gridspec(3 if groups else 2, 2)
    ax_quorum = fig.add_subplot(grid[0, :])
    ax_loss = fig.add_subplot(grid[1, :], sharex=ax_quorum)
    if groups:
        _paces(paces, groups, fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1]), "replica group")
    fig.suptitle(f"{title}: replica groups (fault_tolerance=torchft)", fontsize=11)
    for i, run in enumerate(runs):
        steps, replicas = run.series(metrics.FT_REPLICAS)
        # offset a little per group, so groups with the same quorum stay visible
        ax_quorum.step(steps, [r + 0.04 * i for r in replicas], where="post", color=f"C{i}", label=run.name)
        healed = [row["step"] for row in run.rows if metrics.FT_HEAL_TIME in row]
        if healed:
            ax_quorum.plot(healed, [0.5] * len(healed), "v", color=f"C{i}", label=f"{run.name} healed")
        ax_loss.plot(*run.series(metrics.TRAIN_LOSS), color=f"C{i}", label=run.name)
    ax_quorum.set_ylim(bottom=0)
    _labels(ax_quorum, "Replica groups in each group's last quorum (ft/replicas); ▼ = healed", "step", "groups")
    _labels(ax_loss, "Training loss per group (its logged rows)", "step", "loss (cross-entropy, nats)")
    fig.tight_layout()
    return fig


def exchanges_of_groups(runs: list[Run]) -> Run:
    """The exchanges' rows of a fault-tolerant run, one per step: each group logs every group's local steps and
    wait at an exchange it took part in, so the first group that logged one speaks for it (a group that was down
    logged none)."""
    prefix = metrics.REPLICA_LOCAL_STEPS.named("")
    rows: dict[int, dict] = {}
    for run in runs:
        for row in run.rows:
            if any(key.startswith(prefix) for key in row):
                rows.setdefault(row["step"], row)
    return Run(runs[0].path.parent if runs else Path(), "exchanges", [rows[s] for s in sorted(rows)], {}, None)


def report_sweep(sweep_dir: Path, out: Path) -> list[Path]:
    runs = [read_run(path) for path in job_dirs(sweep_dir)]
    lines = [summarize(run) for run in runs]
    lines.sort(key=lambda line: (line["final loss"] is None, line["final loss"] or 0.0, str(line["job"])))
    write_tables(lines, out, "jobs")
    colors = {run.name: f"C{i % 10}" for i, run in enumerate(runs)}  # a job keeps its colour across plots
    plot_sweep_loss(runs, out / "loss.png", sweep_dir.name, colors)
    plot_tradeoff(lines, out / "tradeoff.png", sweep_dir.name, colors)
    print(markdown_table(lines), end="")
    return [out / "jobs.md", out / "jobs.csv", out / "loss.png", out / "tradeoff.png"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a run dir (holds metrics.jsonl) or a sweep dir (holds job dirs)")
    parser.add_argument("--out", type=Path, help="where to write (default: <dir>/report)")
    args = parser.parse_args(argv)
    path = args.dir
    groups = path.is_dir() and bool(replica_group_dirs(path))
    is_run = (path / "metrics.jsonl").exists()
    if not path.is_dir() or not (is_run or groups or job_dirs(path)):
        print(
            f"harness.report: {str(path)!r} is neither a run dir (with metrics.jsonl) nor a sweep dir (with job "
            "dirs holding metrics.jsonl or result.json). Fix: pass outputs/<date>/<time> for a run or "
            "outputs/multirun/<stamp> for a sweep.",
            file=sys.stderr,
        )
        return 2
    out = args.out or path / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # it, or a folder above it, is a file
        print(
            f"harness.report: --out {str(out)!r} cannot be a directory: it or a folder above it is a file. "
            "Fix: --out <a new or existing directory>.",
            file=sys.stderr,
        )
        return 2
    if groups:
        written = report_replica_groups(path, out)
    else:
        written = report_run(path, out) if is_run else report_sweep(path, out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
