"""Byte accounting of what crosses replicas, reported on logged rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness import metrics


@dataclass
class CrossReplicaTraffic:
    """Bytes this rank put into cross-replica collectives (the reduced buffers'
    sizes in the dtype they were sent in; a ring all-reduce sends about
    2(R-1)/R times that on the wire), and the figures of this step's averaging.
    The per-kind counts run since the previous logged row, so the rows add up
    to the running total whatever `train.log_every` is."""

    grad_sync_bytes: int = 0
    averaging_bytes: int = 0
    total_bytes: int = 0
    averaged: dict | None = None  # this step's averaging metrics (averager/drift, averager/time_s, ...)

    def add_grad(self, tensor: torch.Tensor) -> None:
        self.grad_sync_bytes += tensor.numel() * tensor.element_size()
        self.total_bytes += tensor.numel() * tensor.element_size()

    def add_averaging(self, nbytes: int) -> None:
        self.averaging_bytes += nbytes
        self.total_bytes += nbytes

    def step_metrics(self, averager_step: int | None) -> dict:
        """A logged row's figures (bytes since the previous logged row), then reset for the next."""
        row = {
            metrics.COMM_GRAD_SYNC_BYTES: self.grad_sync_bytes,
            metrics.COMM_AVERAGING_BYTES: self.averaging_bytes,
            metrics.COMM_TOTAL_BYTES: self.total_bytes,
        }
        if averager_step is not None:
            row.update(
                {metrics.AVERAGER_AVERAGED: int(self.averaged is not None), metrics.AVERAGER_STEP: averager_step}
            )
            row.update(self.averaged or {})
        self.grad_sync_bytes = self.averaging_bytes = 0
        self.averaged = None
        return row
