"""What a device can do and did: its peak FLOP/s (for `train/mfu`) and its peak memory."""

from __future__ import annotations

import functools
import logging
import resource

import torch

from harness import metrics

log = logging.getLogger(__name__)


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
        return {metrics.MEMORY_CUDA_MAX: torch.cuda.max_memory_allocated(device) / 2**30}
    return {metrics.MEMORY_MAX_RSS: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
