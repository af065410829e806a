"""Fixtures; the helpers tests import are in support.py."""

from __future__ import annotations

import pytest

from support import base_env


@pytest.fixture
def cli_env(tmp_path):
    return base_env(tmp_path)


def pytest_collection_modifyitems(items):
    """The multi-process tests (`slow`) first, the in-process ones after: the two xdist
    workers take the long ones while both are busy and end on short ones, instead of
    one worker finishing a long test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
