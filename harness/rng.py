"""Random numbers: seeded generators for values that must not depend on the
layout, and the per-rank RNG states a checkpoint carries."""

from __future__ import annotations

import random
import zlib

import torch


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """A generator for one named or numbered `stream` of `seed` (a sample, an epoch, a parameter)."""
    return torch.Generator().manual_seed(_mix(seed, stream))


def seed_rank(seed: int, rank: int) -> None:
    """Seed this rank's global RNGs (torch on every device, Python) from `train.seed`
    and the rank. Unseeded, every process starts from its own random state, so
    the draws in training (dropout) and the RNG states a checkpoint records
    would differ between two runs of one config, and between a run and the
    rank torchrun restarts; a resume then restores the saved states."""
    value = _mix(seed, zlib.crc32(f"rank {rank}".encode()))
    torch.manual_seed(value)
    random.seed(value)


def _mix(seed: int, stream: int) -> int:
    return (seed * 1_000_003 + stream) % 2**63


def rng_state() -> dict:
    """This process's RNG states: torch, Python, and CUDA's once CUDA is in use
    (CPU ranks on a GPU machine never touch it)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
