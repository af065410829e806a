"""`data=synthetic` (the default): a learnable token walk, no files."""

from __future__ import annotations

import torch

from harness.rng import seeded_generator

_LANGUAGE_SEED = 1234  # fixes the synthetic "grammar", so runs with other seeds learn the same task
_EVAL_STREAM = 2**40  # synthetic eval samples are numbered from here: never drawn in training


class SyntheticTokens:
    """A noisy deterministic walk: the next token is perm[token] with prob 1-noise,
    else uniform. Loss can fall from ln(V) towards the noise entropy."""

    def __init__(self, noise: float, vocab_size: int, seed: int):
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"data.noise={noise} must be in [0, 1). Fix: data.noise=0.1.")
        self.vocab_size, self.noise, self.seed = vocab_size, noise, seed
        self.next_token = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(_LANGUAGE_SEED))

    def eval_samples(self, first: int, count: int, length: int) -> torch.Tensor:
        return self.samples(_EVAL_STREAM + first, count, length)

    def samples(self, first: int, count: int, length: int) -> torch.Tensor:
        starts, breaks, random_tokens = [], [], []
        for index in range(first, first + count):
            g = seeded_generator(self.seed, index)
            starts.append(torch.randint(self.vocab_size, (1,), generator=g))
            breaks.append(torch.rand(length, generator=g) < self.noise)
            random_tokens.append(torch.randint(self.vocab_size, (length,), generator=g))
        breaks, random_tokens = torch.stack(breaks), torch.stack(random_tokens)
        out = torch.empty(count, length, dtype=torch.long)
        out[:, 0] = torch.cat(starts)
        for t in range(1, length):
            out[:, t] = torch.where(breaks[:, t], random_tokens[:, t], self.next_token[out[:, t - 1]])
        return out
