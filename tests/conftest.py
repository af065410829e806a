"""Fixtures; the helpers tests import are in support.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support import base_env


@pytest.fixture
def cli_env(tmp_path):
    return base_env(tmp_path)


@pytest.fixture
def world_of_1():
    """A process group of this process alone, on gloo: collectives with real values."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
