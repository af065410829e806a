"""The metrics sink: every logged row goes to `metrics.jsonl` and to W&B.

Only rank 0 writes; other ranks get a sink whose `log` does nothing. W&B runs
offline by default inside the run dir; `WANDB_MODE` in the environment wins
over `wandb.mode`. W&B trouble (no network, no key, unwritable dir) warns once
and falls back - offline, then disabled - and never stops training.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
from pathlib import Path

import torch
from omegaconf import OmegaConf

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
        if self.rows is None:
            return
        row = {"train/step": step, **row}
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
        run.define_metric("train/step")
        run.define_metric("*", step_metric="train/step")
        log.info("W&B run %s (%s) in %s", run.id, mode, run.dir)
        return run
    return None


# Peak dense bf16 FLOP/s of one device (vendor datasheets, as torchtitan's
# get_peak_flops), matched by substring of the CUDA device name, first match wins.
PEAK_TFLOPS = {
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
}


@functools.cache  # the loop asks once per `train` call; an unknown GPU is reported once
def peak_flops(device: torch.device, configured_tflops: float | None) -> float | None:
    """One device's peak FLOP/s for MFU: `train.peak_tflops`, else the GPU's
    entry in PEAK_TFLOPS; None (no MFU) on CPU or an unknown GPU."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if tflops is None:
        log.warning(
            "no peak FLOP/s known for %r: train/mfu is not logged. Fix: train.peak_tflops=<its dense bf16 TFLOP/s>",
            name,
        )
    return tflops * 1e12 if tflops is not None else None


def memory_metrics(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"memory/cuda_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"memory/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
