"""`data=synthetic` (the default): a learnable token walk, no files."""

from __future__ import annotations

import threading

import numpy as np
import torch

from harness.rng import seeded_generator

_LANGUAGE_SEED = 1234  # fixes the synthetic "grammar", so runs with other seeds learn the same task
_EVAL_STREAM = 2**40  # synthetic eval samples are numbered from here: never drawn in training


MAX_EVAL_BATCHES = 100_000  # batches an eval pass of the endless held-out stream may score


class SyntheticTokens:
    """A noisy deterministic walk: the next token is perm[token] with prob 1-noise,
    else uniform. Loss can fall from ln(V) towards the noise entropy."""

    def __init__(self, noise: float, vocab_size: int, seed: int):
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"data.noise={noise} must be in [0, 1). Fix: data.noise=0.1.")
        self.vocab_size, self.noise, self.seed = vocab_size, noise, seed
        self.next_token = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(_LANGUAGE_SEED))
        self._perm_powers, self._lock = [self.next_token], threading.Lock()

    def eval_errors(self, eval_every: int, eval_batches: int | str) -> list[str]:
        if eval_every > 0 and eval_batches == "all":
            return [
                f"train.eval_batches={eval_batches} scores every held-out window, but data=synthetic's held-out "
                "stream is endless. Fix: a number of batches, e.g. train.eval_batches=4."
            ]
        if eval_every > 0 and isinstance(eval_batches, int) and eval_batches > MAX_EVAL_BATCHES:
            return [  # a split of text or tokens bounds a pass (a number past it is every window); this stream none
                f"train.eval_batches={eval_batches} batches at every eval of an endless stream, each generated on "
                f"the host: past {MAX_EVAL_BATCHES:,} a pass takes hours (and its window numbers alone filled the "
                "host's memory). Fix: train.eval_batches=4, or a few hundred for a final number."
            ]
        return []

    def eval_samples(self, windows: np.ndarray, length: int) -> torch.Tensor:
        """Held-out windows of an endless stream of their own (`eval_windows` is absent: none is a last)."""
        return self._draw(_EVAL_STREAM + np.asarray(windows), length)

    def samples(self, first: int, count: int, length: int) -> torch.Tensor:
        return self._draw(range(first, first + count), length)

    def _draw(self, indices, length: int) -> torch.Tensor:
        starts, breaks, random_tokens = [], [], []
        for index in indices:  # each sample its own stream: the same draws in any batch
            g = seeded_generator(self.seed, int(index))
            starts.append(torch.randint(self.vocab_size, (1,), generator=g))
            breaks.append(torch.rand(length, generator=g) < self.noise)
            random_tokens.append(torch.randint(self.vocab_size, (length,), generator=g))
        breaks, walk_from = torch.stack(breaks), torch.stack(random_tokens)
        # token t is perm^k(x_b): b the last break at or before t (position 0 always is one, from its start
        # token), x_b the token drawn there, k = t - b; no loop over positions
        breaks[:, 0] = True
        walk_from[:, 0] = torch.cat(starts)
        positions = torch.arange(length)
        last_break = torch.where(breaks, positions, 0).cummax(dim=1).values
        return self._walk(walk_from.gather(1, last_break), positions - last_break, length - 1)

    def _walk(self, tokens: torch.Tensor, steps: torch.Tensor, most: int) -> torch.Tensor:
        """perm applied `steps` (at most `most`) times to each of `tokens`: perm^(2^j) for each bit j of the count."""
        for bit, perm_power in enumerate(self._powers(most.bit_length())):
            tokens = torch.where((steps >> bit) & 1 == 1, perm_power[tokens], tokens)
        return tokens

    def _powers(self, bits: int) -> list[torch.Tensor]:
        """perm^1, perm^2, perm^4, ...: the first `bits` powers, computed once (under a lock: the
        data prefetch thread and the loop's evals both ask)."""
        with self._lock:
            while len(self._perm_powers) < bits:
                last = self._perm_powers[-1]
                self._perm_powers.append(last[last])
            return self._perm_powers[:bits]
