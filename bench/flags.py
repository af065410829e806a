"""The benches' argparse types: a flag's bad value is refused where it is parsed, by argparse's own error,
which names the flag and exits 2 before anything runs (`argument --rounds: must be an integer >= 1, got 0`).
Light (no torch), so that every bench imports it: `python bench/<name>.py` puts bench/ on the path."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= `minimum` (a count: rounds, steps, ranks)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def above(bound: float) -> Callable[[str], float]:
    """A finite number > `bound` (seconds, sizes, a slowdown factor)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > bound):
            raise argparse.ArgumentTypeError(f"must be a finite number > {bound:g}, got {text!r}")
        return value

    return parse


def integers(minimum: int) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each >= `minimum` (periods, seeds, rank counts)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(item) for item in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers, each >= {minimum}, got {text!r}")
        return values

    return parse


def directory(text: str) -> Path:
    """An existing directory (to work in)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"must be an existing directory, got {text!r}")
    return Path(text)


def file_to_write(text: str) -> Path:
    """A file to write at the end (a plot): in an existing directory, and not a directory itself."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"must be a file name in an existing directory, got {text!r}")
    return path
