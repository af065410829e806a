"""Random numbers: seeded generators for values that must not depend on the
layout, and the per-rank RNG states a checkpoint carries."""

from __future__ import annotations

import random

import torch


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """A generator for one named or numbered `stream` of `seed` (a sample, an epoch, a parameter)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % 2**63)


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
