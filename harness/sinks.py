"""Where metric rows go: `metrics.jsonl`, W&B and, with `metrics.tensorboard=true`,
TensorBoard event files (the names are `harness.metrics`'s).

Only rank 0 writes; other ranks get a sink whose `log` does nothing. W&B runs
offline by default inside the run dir; `WANDB_MODE` in the environment wins
over `wandb.mode`. W&B trouble (no network, no key, unwritable dir) warns once
and falls back - offline, then disabled - and never stops training.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness import metrics
from harness.config import WandbConf

log = logging.getLogger(__name__)


def config_errors(cfg: DictConfig) -> list[str]:
    """The sinks' rules for `validate`: TensorBoard is an optional extra; W&B's wait is a duration."""
    errors = []
    if cfg.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        errors.append(
            "metrics.tensorboard=true writes TensorBoard event files through torch.utils.tensorboard, but the "
            "'tensorboard' package is not installed in this Python environment. Fix: pip install -e "
            '".[tensorboard]" (or pip install tensorboard), or metrics.tensorboard=false.'
        )
    timeout = cfg.wandb.init_timeout_s
    if not (0 < timeout < math.inf):
        errors.append(
            f"wandb.init_timeout_s={timeout} must be a positive number of seconds (how long W&B may take to start "
            "before the run falls back to offline). Fix: wandb.init_timeout_s=90 (W&B's own default)."
        )
    return errors


class MetricsSink:
    """Rows to metrics.jsonl, W&B and TensorBoard. W&B's run opens on a thread of its own (about a
    second offline, up to `wandb.init_timeout_s` online) while the run builds and starts training:
    a replica group restarted after a failure asks for its first quorum without waiting for it, so
    its peers do not either. Rows logged before it is open reach it, in order, once it is."""

    def __init__(self, run_dir: Path, settings: WandbConf, config: dict, enabled: bool, tensorboard: bool = False):
        """`config`: the resolved run config as plain values (W&B's run config);
        `tensorboard`: also write event files under `<run_dir>/tensorboard/`."""
        self.rows = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None
        overrides = run_dir / ".hydra" / "overrides.yaml"
        if enabled and overrides.exists():  # the command line's overrides, to filter runs by in W&B's table
            config = {**config, "overrides": OmegaConf.to_container(OmegaConf.load(overrides))}
        self.wandb_run, self.wandb_pending = None, []  # the run once open, and the rows it has yet to get
        self.wandb_opening = None
        if enabled and (os.environ.get("WANDB_MODE") or str(settings.mode)) != "disabled":
            self.wandb_opening = ThreadPoolExecutor(1, "harness-wandb").submit(_start_wandb, run_dir, settings, config)
        self.tensorboard = TensorBoardEvents(run_dir / "tensorboard") if enabled and tensorboard else None

    def wandb(self, wait: bool = False):
        """W&B's run, once open (None until then, or without W&B); `wait` for it to open."""
        if self.wandb_opening is not None and (wait or self.wandb_opening.done()):
            self.wandb_run, self.wandb_opening = self.wandb_opening.result(), None
            for row, step in self.wandb_pending if self.wandb_run is not None else []:
                self.wandb_run.log(row, step=step)
            self.wandb_pending = []
        return self.wandb_run

    def log(self, row: dict[str, float], step: int) -> None:
        """One row for `step`; steps must increase (W&B drops lower ones)."""
        metrics.check_declared(row)
        if self.rows is None:
            return
        if self.tensorboard is not None:  # before train/step joins the row: TensorBoard has its own step axis
            self.tensorboard.log(row, step)
        row = {metrics.TRAIN_STEP: step, **row}
        self.rows.write(json.dumps({"step": step, **row}) + "\n")
        self.rows.flush()
        if self.wandb() is not None:
            self.wandb_run.log(row, step=step)
        elif self.wandb_opening is not None:
            self.wandb_pending.append((row, step))

    def rewind(self, step: int) -> Path | None:
        """Move `metrics.jsonl` rows after `step` aside (a resumed run logs those steps again: identically
        after a crash; otherwise when it resumes an earlier checkpoint), so the file's x-axis stays strictly
        ordered and nothing logged is lost: they go to `metrics.rewound.<n>.jsonl`, whose path is returned
        (None: no row was after `step`). A new W&B run starts at `step` anyway; TensorBoard hides its events
        after `step`."""
        if self.tensorboard is not None:
            self.tensorboard.rewind(step)
        if self.rows is None:
            return None
        path = Path(self.rows.name)
        self.rows.close()
        lines = path.read_text().splitlines(keepends=True)
        kept, later = [x for x in lines if _step_of(x) <= step], [x for x in lines if _step_of(x) > step]
        aside = None
        if later:
            aside = next(p for n in count(1) if not (p := path.with_name(f"metrics.rewound.{n}.jsonl")).exists())
            aside.write_text("".join(later))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self.rows = open(path, "a", encoding="utf-8")
        return aside

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
            self.rows = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb(wait=True) is not None:
            import wandb

            self.wandb_run.finish()
            # finish() can return before wandb-core has flushed and closed the
            # run file (seen under load: a .wandb file with only its header);
            # teardown waits for wandb-core to exit, so the files are complete.
            wandb.teardown()
            self.wandb_run = None
            remove_wandb_temp_dirs()


# W&B makes temporary directories as its modules load (its media and artifact staging, in the system's
# temp dir) and leaves them to finalizers at interpreter exit, which a harness process never reaches
# (harness.launch.exit.exit_now): each launch left two empty ones behind. Where wandb 0.31 keeps them:
WANDB_TEMP_DIRS = (
    ("wandb.sdk.data_types._private", "MEDIA_TMP"),
    ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"),
)


def remove_wandb_temp_dirs() -> None:
    """Remove the temporary directories W&B made in this process, once it is done."""
    for module, path in WANDB_TEMP_DIRS:
        holder = sys.modules.get(module)
        for name in path.split("."):
            holder = getattr(holder, name, None)
        if isinstance(holder, tempfile.TemporaryDirectory):
            holder.cleanup()


class TensorBoardEvents:
    """Every numeric value of a row as a scalar at the row's step, in event files
    under `log_dir`; strings (`checkpoint/mode`) are left out: they are settings,
    in the run's config, and text summaries would each add a tag to the dashboard.

    Each session (a run, or a resume of it) writes its own file, opened at its
    first row (so after any `rewind`) with `purge_step`: the file starts with a
    SessionLog.START at that step, TensorBoard's documented restart mark, which
    hides the events earlier files hold at or past it. A fresh run writes one
    too (at step 0), because TensorBoard's Python loader takes a run's first
    START for its start and only later ones for restarts.
    """

    def __init__(self, log_dir: Path):
        # imported on rank 0 only when asked for (tensorboard is an optional extra), before training starts
        from torch.utils.tensorboard import SummaryWriter

        self.summary_writer, self.log_dir = SummaryWriter, log_dir
        self.writer = None
        self.first_step = 0  # this session's purge_step

    def log(self, row: dict[str, float], step: int) -> None:
        if self.writer is None:
            self.writer = self.summary_writer(str(self.log_dir), purge_step=self.first_step)
        for name, value in row.items():
            if isinstance(value, (int, float)):  # bools too, as 0 and 1
                self.writer.add_scalar(name, value, step)
        # the row is in the file when `log` returns, as in metrics.jsonl: SummaryWriter
        # writes on a thread and, with TensorFlow installed, flushes every 120 s. Costs
        # under 0.1 ms a row, beside about 1 ms for a row's dozen add_scalar calls.
        self.writer.flush()

    def rewind(self, step: int) -> None:
        """The rows after `step` are logged again: the next file hides the old ones."""
        self.close()
        self.first_step = step + 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _step_of(line: str) -> float:
    """A row's step; a line cut short by a killed process counts as past every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")


def _start_wandb(run_dir: Path, settings: WandbConf, config: dict):
    requested = os.environ.get("WANDB_MODE") or str(settings.mode)
    if requested == "disabled":  # before the import: wandb takes about a second to import
        return None
    import wandb

    for mode in dict.fromkeys([requested, "offline"]):  # requested first, then the offline fallback
        try:
            run = wandb.init(
                mode=mode,
                dir=str(run_dir),
                project=settings.project,
                entity=settings.entity,
                group=settings.group,
                name=settings.name,
                tags=list(settings.tags),
                config=config,
                settings=wandb.Settings(silent=True, console="off", init_timeout=settings.init_timeout_s),
            )
        except Exception as e:  # wandb raises many types (UsageError, CommError, OSError, ...)
            log.warning(
                "W&B mode=%s failed (%s: %s); %s",
                mode,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                "falling back to offline" if mode != "offline" else "continuing without W&B",
            )
            continue
        run.define_metric(metrics.TRAIN_STEP)
        for metric in metrics.METRICS.values():
            if metric != metrics.TRAIN_STEP:
                run.define_metric(metric, step_metric=metrics.TRAIN_STEP, summary=metric.summary)
        log.info("W&B run %s (%s) in %s", run.id, mode, run.dir)
        return run
    return None
