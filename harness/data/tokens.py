"""`data=tokens`: pretokenized shards (`python -m harness.prepare`, or nanoGPT's
train.bin/val.bin) read through memory maps, alone or as a weighted mixture.

Sample i of the global sequence is a window of `length` tokens: each shard is
cut into non-overlapping windows, and each epoch visits all of them in an order
drawn from `train.seed` and the epoch (`WindowOrder`, a keyed permutation that
needs no table, so memory does not grow with the corpus); epochs follow each
other. With `data.sources` the samples are dealt to the sources by weight
(`Mixture`), each source with its own sequence. Everything is a pure function
of the sample index, so resuming, on any world size, continues exactly.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import torch

from harness import metrics
from harness.data.shards import NANOGPT_FILES, SPLITS, TokenIdsOutOfRange, read_index, shard_errors


class WindowOrder:
    """A permutation of range(n) keyed by (seed, epoch): a 4-round Feistel network over
    the smallest even-bit power of two >= n, walked until it lands inside range(n)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.half_bits = max(1, math.ceil(math.log2(max(n, 2)) / 2))
        self.mask = (1 << self.half_bits) - 1
        self.keys = [zlib.crc32(f"{seed}/{epoch}/{r}".encode()) for r in range(self.ROUNDS)]

    def _round(self, x: np.ndarray, key: int) -> np.ndarray:
        x = (x * np.uint64(0x9E3779B1) + np.uint64(key)) & np.uint64(0xFFFFFFFF)
        return (x ^ (x >> np.uint64(15))) & np.uint64(self.mask)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half_bits), x & np.uint64(self.mask)
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << np.uint64(self.half_bits)) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._permute(positions.astype(np.uint64))
        outside = out >= self.n
        while outside.any():  # cycle walking: a bijection of the larger domain restricted to range(n)
            out[outside] = self._permute(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


class TokenFiles:
    """One dataset's shards of one split, memory-mapped, cut into windows of `length` tokens. Every
    window read is checked against `vocab_size` (a max over the batch, on the data thread): an index
    that does not match its shards would otherwise fail in the embedding, with an IndexError."""

    def __init__(self, paths: list[Path], dtype: np.dtype, vocab_size: int, key: str):
        self.paths, self.vocab_size, self.key = paths, vocab_size, key
        self.maps = [np.memmap(p, dtype=dtype, mode="r") for p in paths]
        self.tokens = sum(len(m) for m in self.maps)
        self._ends: dict[int, np.ndarray] = {}

    def windows(self, length: int) -> np.ndarray:
        """Cumulative window counts per shard (a window needs `length` tokens inside one shard)."""
        if length not in self._ends:
            self._ends[length] = np.cumsum([len(m) // length for m in self.maps])
        return self._ends[length]

    def rows(self, window_ids: np.ndarray, length: int) -> torch.Tensor:
        ends = self.windows(length)
        shards = np.searchsorted(ends, window_ids, side="right")
        starts = (window_ids - np.concatenate([[0], ends[:-1]])[shards]) * length
        out = np.empty((len(window_ids), length), dtype=np.int64)
        for row, (shard, start) in enumerate(zip(shards, starts)):
            out[row] = self.maps[shard][start : start + length]
        if len(out) and out.max() >= self.vocab_size:
            row = int(np.argmax(out.max(axis=1) >= self.vocab_size))
            raise TokenIdsOutOfRange(
                f"{self.key}: shard {self.paths[shards[row]]} holds token id {int(out[row].max())}, but the model "
                f"embeds ids below model.vocab_size={self.vocab_size}: the dataset's index does not match its "
                "shards. Fix: re-run python -m harness.prepare for this dataset, or a model.vocab_size above "
                "its largest id."
            )
        return torch.from_numpy(out)


class TokenSource:
    """One dataset (a harness.prepare directory, or nanoGPT's train.bin/val.bin with
    `format=nanogpt`): its index read and checked at construction (cheap), its
    shards mapped at `open()`."""

    def __init__(self, path: str, format: str, vocab_size: int, key: str):
        self.root, self.format, self.key, self.vocab_size = Path(path).expanduser(), format, key, vocab_size
        if format == "nanogpt":
            missing = [f for f in NANOGPT_FILES.values() if not (self.root / f).is_file()]
            if missing:
                raise ValueError(
                    f"{key}={path!r} has no {' or '.join(missing)} (data.format=nanogpt reads nanoGPT's "
                    "prepared train.bin and val.bin). Fix: point it at that folder, or data.format=harness."
                )
            self.index = {"dtype": "uint16", "vocab_size": 2**16}
            self.files = {split: [self.root / name] for split, name in NANOGPT_FILES.items()}
            return
        if format != "harness":
            raise ValueError(f"data.format={format!r} is not a token format. Fix: data.format=harness or nanogpt.")
        self.index = read_index(self.root)
        if self.index["vocab_size"] > vocab_size:
            raise ValueError(
                f"{key}={path!r} holds token ids up to {self.index['vocab_size'] - 1} (its tokenizer's vocabulary "
                f"is {self.index['vocab_size']}), more than model.vocab_size={vocab_size} embeds. "
                f"Fix: model.vocab_size={self.index['vocab_size']} (or a multiple of 64 above it)."
            )
        self.files = {split: [self.root / s["file"] for s in self.index[split]] for split in SPLITS}

    def preflight_errors(self, length: int, evaluates: bool) -> list[str]:
        if self.format == "harness":
            errors = shard_errors(self.root, self.index)
        else:
            errors = [e for name in NANOGPT_FILES.values() if (e := self._nanogpt_errors(name))]
        return errors or self._window_errors(length, evaluates)

    def _window_errors(self, length: int, evaluates: bool) -> list[str]:
        """A split that must be read holds at least one window of `length` tokens inside one file (the
        shards' token counts, from the index or the files' sizes): else training, or the first eval,
        would fail inside the ranks."""
        itemsize = np.dtype(self.index["dtype"]).itemsize
        errors = []
        for split in ("train", "eval") if evaluates else ("train",):
            sizes = [p.stat().st_size // itemsize for p in self.files[split]]
            if not any(size >= length for size in sizes):
                what = NANOGPT_FILES[split] if self.format == "nanogpt" else f"its longest {split} shard"
                use = "train" if split == "train" else "evaluate (train.eval_every)"
                fix = "lower train.seq_len, or prepare more text"
                fix += ", or train.eval_every=0" if split == "eval" else ""
                errors.append(
                    f"{self.key}={str(self.root)!r}: {what} holds {max(sizes, default=0)} tokens, fewer than "
                    f"one window of train.seq_len+1={length} tokens, so the run could not {use}. "
                    f"Fix: {fix}."
                )
        return errors

    def _nanogpt_errors(self, name: str) -> str | None:
        """nanoGPT's files carry no vocabulary: their largest id must fit the model's embedding,
        which it indexes. A max over the memory map reads the file once (2 GB: 2 s from disk, docs/data.md)."""
        path, dtype = self.root / name, np.dtype(self.index["dtype"])
        size = path.stat().st_size
        if size == 0 or size % dtype.itemsize:
            return (
                f"{self.key}={str(self.root)!r}: {name} holds {size} bytes, not a whole number of {dtype.name} "
                "tokens (data.format=nanogpt reads nanoGPT's uint16 token files). Fix: re-create it with "
                "nanoGPT's prepare.py, or point at another folder."
            )
        top = int(np.memmap(path, dtype=dtype, mode="r").max())
        if top < self.vocab_size:
            return None
        return (
            f"{self.key}={str(self.root)!r}: {name} holds token ids up to {top}, more than "
            f"model.vocab_size={self.vocab_size} embeds (ids below {self.vocab_size}). Fix: model.vocab_size="
            f"{top + 1} or more (a multiple of 64 is faster: {-(-(top + 1) // 64) * 64}; GPT-2's tokenizer: 50304)."
        )

    def open(self) -> dict[str, TokenFiles]:
        dtype, key = np.dtype(self.index["dtype"]), f"{self.key}={str(self.root)!r}"
        return {split: TokenFiles(paths, dtype, self.vocab_size, key) for split, paths in self.files.items()}


class Mixture:
    """Deals global samples to sources by weight, exactly and with O(1) state: each
    block of BLOCK samples holds round(weight·BLOCK) of each source (largest
    remainders), in an order drawn from the seed and the block. Returns, for a
    sample index, its source and its index within that source's own sequence."""

    BLOCK = 1024

    def __init__(self, weights: list[float], seed: int):
        quotas = [w / sum(weights) * self.BLOCK for w in weights]
        counts = [math.floor(q) for q in quotas]
        for s in sorted(range(len(quotas)), key=lambda s: counts[s] - quotas[s])[: self.BLOCK - sum(counts)]:
            counts[s] += 1
        self.counts, self.seed = counts, seed
        self._cached: tuple[int | None, tuple | None] = (None, None)

    def locate(self, index: int) -> tuple[int, int]:
        block, offset = divmod(index, self.BLOCK)
        sources, ranks = self._layout_of(block)
        source = int(sources[offset])
        return source, block * self.counts[source] + int(ranks[offset])

    def samples_per_source(self, n: int) -> list[int]:
        """How many of the first `n` global samples each source has served."""
        block, offset = divmod(n, self.BLOCK)
        served = np.bincount(self._layout_of(block)[0][:offset], minlength=len(self.counts))
        return [block * count + int(extra) for count, extra in zip(self.counts, served)]

    def _layout_of(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block `block`'s source per position, and each position's rank among its source's."""
        cached_block, layout = self._cached  # one attribute: the data thread and the loop both ask
        if block != cached_block:
            order = WindowOrder(self.BLOCK, self.seed, -1 - block)(np.arange(self.BLOCK))
            sources = np.repeat(np.arange(len(self.counts)), self.counts)[order]
            ranks = np.zeros(self.BLOCK, dtype=np.int64)
            for s in range(len(self.counts)):
                ranks[sources == s] = np.arange(self.counts[s])
            layout = (sources, ranks)
            self._cached = (block, layout)
        return layout


class TokenShards:
    """`data=tokens`: `path` (one dataset) or `sources` (a list of {path, weight}),
    in `format` harness (harness.prepare's shards and index) or nanogpt."""

    def __init__(
        self,
        vocab_size: int,
        seed: int,
        path: str | None = None,
        sources: list | None = None,
        format: str = "harness",
    ):
        if (path is None) == (not sources):
            raise ValueError(
                f"data.path={path!r} and data.sources={sources!r}: give exactly one. Fix: data.path=<dir> "
                "for one dataset, or data.sources=[{path: <dir>, weight: 0.7}, {path: <dir>, weight: 0.3}]."
            )
        entries = [{"path": path, "weight": 1.0}] if path is not None else [dict(s) for s in sources]
        for i, entry in enumerate(entries):
            if set(entry) != {"path", "weight"} or not 0 < float(entry["weight"]) < math.inf:
                raise ValueError(
                    f"data.sources[{i}]={entry!r} must be {{path: <dir>, weight: <positive finite number>}}. "
                    "Fix: e.g. data.sources=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]."
                )
        key = "data.path" if path is not None else "data.sources[{}].path"
        self.sources = [TokenSource(e["path"], format, vocab_size, key.format(i)) for i, e in enumerate(entries)]
        names = [Path(e["path"]).name for e in entries]  # the dashboard's data/tokens/<name>: unique
        self.names = names if len(set(names)) == len(names) else [f"{i}_{n}" for i, n in enumerate(names)]
        self.weights = [float(e["weight"]) for e in entries]
        self.mixture = Mixture(self.weights, seed) if len(entries) > 1 else None
        self.seed = seed
        self.splits: list[dict[str, TokenFiles]] = []

    def preflight_errors(self, length: int, evaluates: bool) -> list[str]:
        return [e for s in self.sources for e in s.preflight_errors(length, evaluates)]

    def eval_errors(self, eval_every: int, eval_batches: int | str) -> list[str]:
        if eval_every > 0 and any(not s.files["eval"] for s in self.sources):
            return [
                f"train.eval_every={eval_every} scores held-out data, but a dataset has no eval shards. Fix: "
                "re-run harness.prepare with eval_fraction > 0, or train.eval_every=0."
            ]
        return []

    def open(self) -> None:
        self.splits = [s.open() for s in self.sources]

    def samples(self, first: int, count: int, length: int) -> torch.Tensor:
        indices = range(first, first + count)
        located = [self.mixture.locate(i) for i in indices] if self.mixture else [(0, i) for i in indices]
        out = torch.empty(count, length, dtype=torch.long)
        for source in {s for s, _ in located}:
            rows = [row for row, (s, _) in enumerate(located) if s == source]
            out[rows] = self._windows(source, np.array([located[row][1] for row in rows]), length)
        return out

    def tokens_read(self, samples: int, length: int) -> dict:
        """`data/tokens/<source>`: tokens the first `samples` global samples took from each source (mixtures)."""
        if self.mixture is None:
            return {}
        served = self.mixture.samples_per_source(samples)
        return {metrics.DATA_SOURCE_TOKENS.named(name): n * length for name, n in zip(self.names, served)}

    def eval_sources(self) -> list[tuple[str, float]]:
        """A mixture's held-out sets, each scored on its own (`eval/loss/<name>`), with their
        share of the weight (`eval/loss` is the weighted mean); none for one dataset."""
        if self.mixture is None:
            return []
        return [(name, weight / sum(self.weights)) for name, weight in zip(self.names, self.weights)]

    def eval_windows(self, length: int, source: int = 0) -> int:
        """Source `source`'s held-out windows of `length` tokens."""
        return int(self.splits[source]["eval"].windows(length)[-1])

    def eval_samples(self, windows: np.ndarray, length: int, source: int = 0) -> torch.Tensor:
        """Held-out windows `windows` of source `source` (numbered over its eval shards, in order)."""
        return self.splits[source]["eval"].rows(np.asarray(windows, dtype=np.int64), length)

    def _windows(self, source: int, within: np.ndarray, length: int) -> torch.Tensor:
        """Samples `within` of source `source`'s own sequence: epoch by epoch, each a keyed order of its windows."""
        files = self.splits[source]["train"]
        windows = int(files.windows(length)[-1])
        if windows == 0:
            raise ValueError(
                f"{self.names[source]}: no training shard holds a window of train.seq_len+1={length} tokens. "
                "Fix: lower train.seq_len, or prepare more text."
            )
        epochs, positions = np.divmod(within, windows)
        ids = np.empty_like(within)
        key = zlib.crc32(f"{self.seed}/{source}".encode())
        for epoch in np.unique(epochs):
            ids[epochs == epoch] = WindowOrder(windows, key, int(epoch))(positions[epochs == epoch])
        return files.rows(ids, length)
