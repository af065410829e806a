"""A failed save says what is known of its cause: a full disk or a lost rank
only where the error points there (in-process, fast)."""

from __future__ import annotations

import errno

import pytest
import torch.distributed as dist

from harness.checkpoint.checkpointer import _likely_cause

DISK = "Fix: if the disk is full, free space"
PEER = "Another rank stopped during the save"
OTHER = "points at neither a full disk nor a lost rank"


@pytest.mark.parametrize(
    "error,expected",
    [
        (OSError(errno.ENOSPC, "No space left on device"), DISK),
        (OSError(errno.EFBIG, "File too large"), DISK),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 4035"), DISK),
        (dist.DistError("Connection closed by peer [127.0.0.1]:29500"), PEER),
        (RuntimeError("[gloo] Timed out waiting 600000ms for recv operation"), PEER),
        (KeyError("<class 'type'>"), OTHER),  # torch 2.11's reused-stager bug: not the disk
        (PermissionError(errno.EACCES, "Permission denied"), OTHER),
    ],
)
def test_a_failed_save_names_a_cause_only_with_evidence(error, expected):
    message = _likely_cause(error)
    assert expected in message
    assert (DISK in message) == (expected == DISK) and (PEER in message) == (expected == PEER)
