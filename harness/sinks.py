"""Where metric rows go: `metrics.jsonl` and W&B (the names are `harness.metrics`'s).

Only rank 0 writes; other ranks get a sink whose `log` does nothing. W&B runs
offline by default inside the run dir; `WANDB_MODE` in the environment wins
over `wandb.mode`. W&B trouble (no network, no key, unwritable dir) warns once
and falls back - offline, then disabled - and never stops training.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

from harness import metrics
from harness.config import WandbConf

log = logging.getLogger(__name__)


class MetricsSink:
    def __init__(self, run_dir: Path, settings: WandbConf, config: dict, enabled: bool):
        """`config`: the resolved run config as plain values (W&B's run config)."""
        self.rows = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None
        overrides = run_dir / ".hydra" / "overrides.yaml"
        if enabled and overrides.exists():  # the command line's overrides, to filter runs by in W&B's table
            config = {**config, "overrides": OmegaConf.to_container(OmegaConf.load(overrides))}
        self.wandb_run = _start_wandb(run_dir, settings, config) if enabled else None

    def log(self, row: dict[str, float], step: int) -> None:
        """One row for `step`; steps must increase (W&B drops lower ones)."""
        metrics.check_declared(row)
        if self.rows is None:
            return
        row = {metrics.TRAIN_STEP: step, **row}
        self.rows.write(json.dumps({"step": step, **row}) + "\n")
        self.rows.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)

    def rewind(self, step: int) -> None:
        """Drop `metrics.jsonl` rows after `step` (a resumed run logs those steps
        again, identically), so the file's x-axis stays strictly ordered. A new
        W&B run starts at `step` anyway."""
        if self.rows is None:
            return
        path = Path(self.rows.name)
        self.rows.close()
        kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self.rows = open(path, "a", encoding="utf-8")

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
            self.rows = None
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            # finish() can return before wandb-core has flushed and closed the
            # run file (seen under load: a .wandb file with only its header);
            # teardown waits for wandb-core to exit, so the files are complete.
            wandb.teardown()
            self.wandb_run = None


def _step_of(line: str) -> float:
    """A row's step; a line cut short by a killed process counts as past every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")


def _start_wandb(run_dir: Path, settings: WandbConf, config: dict):
    import wandb

    requested = os.environ.get("WANDB_MODE") or str(settings.mode)
    for mode in dict.fromkeys([requested, "offline"]):  # requested first, then the offline fallback
        if mode == "disabled":
            return None
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
