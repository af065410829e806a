"""`data=text`: byte-level text from local files (the Python standard library's
sources by default), cached once per machine."""

from __future__ import annotations

import glob as globlib
import hashlib
import logging
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from harness.rng import seeded_generator

log = logging.getLogger(__name__)


class TextTokens:
    """Byte-level text from local files (the standard library's sources by default):
    non-overlapping windows, visited in a seeded random order per epoch."""

    def __init__(
        self,
        root: str | None,
        glob: str,
        max_bytes: int,
        cache_dir: str,
        vocab_size: int,
        seed: int,
        eval_fraction: float = 0.01,
    ):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(
                f"data.eval_fraction={eval_fraction} must be in [0, 1): the share of the corpus held out for "
                "eval/loss. Fix: data.eval_fraction=0.01."
            )
        if max_bytes < 1:
            raise ValueError(f"data.max_bytes={max_bytes} must be >= 1. Fix: data.max_bytes=67108864 (64 MiB).")
        if vocab_size < 256:
            raise ValueError(
                f"model.vocab_size={vocab_size} is too small for data=text, which is byte-level "
                "(256 symbols). Fix: model.vocab_size=256."
            )
        self.root, self.glob, self.max_bytes, self.cache_dir, self.seed = root, glob, max_bytes, cache_dir, seed
        self.eval_fraction = eval_fraction
        self.tokens: np.ndarray | None = None  # the training part of the corpus
        self.held_out: np.ndarray | None = None  # its last eval_fraction, for eval_samples
        self._epoch, self._order = -1, None

    def preflight_errors(self, length: int, evaluates: bool) -> list[str]:
        """The corpus's files exist (its size is known once `open` has cached it, which says so)."""
        if self.root is not None and not os.path.isdir(os.path.expanduser(self.root)):
            return [
                f"data.root={self.root!r} is not a directory. Fix: point data.root at a folder of "
                "text files, or data.root=null for the Python standard library's sources."
            ]
        files = self.files()
        if not files:
            return [
                f"data.glob={self.glob!r} matches no file under data.root={self.root!r}. "
                "Fix: check the pattern ('**' recurses), e.g. data.glob='**/*.py'."
            ]
        total = min(sum(os.path.getsize(p) for p in files), self.max_bytes)  # the bytes `open` caches
        held = int(total * self.eval_fraction)
        short = [_too_short(total - held, length, "text corpus", "add files (data.root, data.glob)")]
        if evaluates and self.eval_fraction > 0:  # an eval pass needs a window of the held-out part
            short.append(_too_short(held, length, "held-out part of the text corpus", "raise data.eval_fraction"))
        return [error for error in short if error]

    def files(self) -> list[str]:
        root = text_root(self.root)
        files = (p for p in globlib.iglob(os.path.join(root, self.glob), recursive=True) if os.path.isfile(p))
        if self.root is None:  # the stdlib folder also holds installed packages; keep the stdlib alone
            files = (p for p in files if "site-packages" not in p and "dist-packages" not in p)
        return sorted(files)

    def open(self) -> None:
        """Map the corpus, built once per machine and cached (collective).

        The cache name hashes the file list, sizes and mtimes, so edited files
        rebuild it. Local rank 0 writes it (to a temp name, then an atomic
        rename); the other ranks wait at a barrier and map the finished file.
        """
        files = self.files()
        key = hashlib.sha1(
            repr([self.max_bytes] + [(p, os.path.getsize(p), os.path.getmtime(p)) for p in files]).encode()
        ).hexdigest()[:16]
        path = Path(os.path.expanduser(self.cache_dir)) / f"text-{key}.u8"
        if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            written = 0
            with open(tmp, "wb") as out:
                for p in files:
                    if written >= self.max_bytes:
                        break
                    data = Path(p).read_bytes()[: self.max_bytes - written]
                    out.write(data)
                    written += len(data)
            os.replace(tmp, path)
            log.info("cached %d bytes from %d files under %s at %s", written, len(files), text_root(self.root), path)
        if dist.is_initialized():
            dist.barrier()
        corpus = np.memmap(path, dtype=np.uint8, mode="r")
        split = len(corpus) - int(len(corpus) * self.eval_fraction)
        self.tokens, self.held_out = corpus[:split], corpus[split:]

    def eval_errors(self, eval_every: int, eval_batches: int | str) -> list[str]:
        """Why `train.eval_every` cannot score held-out data from this source."""
        if eval_every > 0 and self.eval_fraction == 0:
            return [
                f"train.eval_every={eval_every} scores held-out data, but data.eval_fraction=0 holds none of the "
                "text corpus out. Fix: data.eval_fraction=0.01 (the corpus's last 1 %), or train.eval_every=0."
            ]
        return []

    def eval_windows(self, length: int) -> int:
        """The held-out bytes' windows of `length`."""
        return _windows(self.held_out, length, "held-out part of the text corpus", "raise data.eval_fraction")

    def eval_samples(self, windows: np.ndarray, length: int) -> torch.Tensor:
        """Held-out windows `windows` (numbered from the held-out part's start, each `length` bytes)."""
        return torch.stack(
            [torch.from_numpy(self.held_out[w * length : (w + 1) * length].astype(np.int64)) for w in windows]
        )

    def samples(self, first: int, count: int, length: int) -> torch.Tensor:
        windows = _windows(self.tokens, length, "text corpus", "add files (data.root, data.glob)")
        rows = []
        for index in range(first, first + count):
            epoch, i = divmod(index, windows)
            if epoch != self._epoch:
                self._epoch, self._order = epoch, torch.randperm(windows, generator=seeded_generator(self.seed, epoch))
            start = int(self._order[i]) * length
            rows.append(torch.from_numpy(self.tokens[start : start + length].astype(np.int64)))
        return torch.stack(rows)


def _windows(tokens: np.ndarray, length: int, part: str, more: str) -> int:
    if error := _too_short(len(tokens), length, part, more):
        raise ValueError(error)
    return (len(tokens) - 1) // length


def _too_short(size: int, length: int, part: str, more: str) -> str | None:
    """Why a `part` of `size` bytes holds no window of `length` (None: it holds one)."""
    if (size - 1) // length >= 1:
        return None
    return (
        f"the {part} holds {size} bytes, fewer than one window of train.seq_len+1={length} bytes. "
        f"Fix: lower train.seq_len, or {more}."
    )


def text_root(root: str | None) -> str:
    """`data.root`, or the standard library's sources (present on every machine) when null."""
    return os.path.expanduser(root) if root is not None else sysconfig.get_paths()["stdlib"]
