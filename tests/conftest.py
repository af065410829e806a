"""Fixtures; the helpers tests import are in support.py."""

from __future__ import annotations

import pytest

from support import base_env


@pytest.fixture
def cli_env(tmp_path):
    return base_env(tmp_path)
