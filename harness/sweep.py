"""Hydra multirun: what a sweep job is called on W&B, what it leaves behind
when it ends, and the sweep's closing summary.

Each job of `python train.py -m ...` starts its own ranks (see `launch`); a job
that fails is recorded in its `result.json` and the sweep goes on. The
`SweepSummary` callback (registered in `conf/config.yaml`) prints one line per
failed job and a summary line at the end, and makes the sweep exit 1 when any
job failed. It reads the jobs' `result.json` files rather than in-process
state, so it also works for launchers that run jobs elsewhere (submitit).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

# `python train.py`'s exit status when training finished without one or more replica groups: the run's
# model is complete (the surviving groups trained every step), which a scheduler can tell from a failure (1)
FINISHED_WITHOUT_GROUPS = 3

RESULT_FILE = "result.json"


def swept_overrides(hydra_cfg: Any) -> list[str]:
    """This job's overrides for the keys the sweep varies, in command-line order
    (`optimizer=adamw`, `averager.period=4`); all of its overrides when nothing
    is swept. The sweep's own overrides (with their `a,b,c` lists) are in the
    sweep dir's `multirun.yaml`; `hydra.sweeper.params` from a preset adds more."""
    parser = OverridesParser.create()
    multirun = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    sweep_level = list(OmegaConf.load(multirun).hydra.overrides.task) if multirun.exists() else []
    swept = {o.key_or_group for o in parser.parse_overrides(sweep_level) if o.is_sweep_override()}
    swept |= {key.lstrip("+~") for key in (hydra_cfg.sweeper.get("params") or {})}
    job = list(hydra_cfg.overrides.task)
    named = [text for text, o in zip(job, parser.parse_overrides(job)) if o.key_or_group in swept]
    return named or job


def name_wandb_run(cfg: DictConfig, hydra_cfg: Any) -> str:
    """A sweep job's W&B run: grouped by the sweep dir's name, named and tagged by
    its swept overrides (`wandb.group`/`wandb.name` set by the user win); returns
    the job's name."""
    overrides = swept_overrides(hydra_cfg)
    name = ",".join(overrides) or f"job{hydra_cfg.job.num}"
    if cfg.wandb.group is None:
        cfg.wandb.group = Path(hydra_cfg.sweep.dir).name
    if cfg.wandb.name is None:
        cfg.wandb.name = name
    # W&B refuses tags over 64 characters
    cfg.wandb.tags = list(dict.fromkeys([*cfg.wandb.tags, *(t for t in overrides if len(t) <= 64)]))
    return name


def write_result(run_dir: Path, hydra_cfg: Any, name: str, exit_code: int, reason: str) -> dict:
    """The job's outcome, next to its metrics: what the summary and reports read."""
    result = {
        "job": int(hydra_cfg.job.num),
        "name": name,
        "overrides": list(hydra_cfg.overrides.task),
        # a fault-tolerant job whose model is complete although a replica group was lost for good: completed
        "status": "completed" if exit_code in (0, FINISHED_WITHOUT_GROUPS) else "failed",
        "exit_code": exit_code,
        "reason": reason,
    }
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result


def read_results(sweep_dir: Path, since: float) -> list[dict]:
    """Results of the jobs in `sweep_dir` written after `since` (a reused sweep dir keeps older jobs' files)."""
    files = [p for p in sweep_dir.glob(f"*/{RESULT_FILE}") if p.stat().st_mtime >= since]
    return sorted((json.loads(p.read_text()) for p in files), key=lambda r: r["job"])


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time() - 1  # mtimes can be coarser than time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = read_results(sweep_dir, self.started)
        failed = [r for r in results if r["status"] != "completed"]
        for r in failed:
            print(
                f"harness: job {r['job']} ({r['name']}) failed with exit {r['exit_code']}: {r['reason']}",
                file=sys.stderr,
            )
        print(
            f"harness: sweep {sweep_dir}: {len(results) - len(failed)} of {len(results)} jobs completed"
            + (f", failed: {', '.join(str(r['job']) for r in failed)}" if failed else ""),
            file=sys.stderr if failed else sys.stdout,
        )
        if failed:
            sys.exit(1)  # SystemExit passes Hydra's error handler, which only catches Exception
