"""The on-disk format of pretokenized data, shared by `harness.prepare` (which
writes it) and `data=tokens` (which reads it).

A dataset directory holds flat little-endian token files, `train_00000.bin`,
... and `eval_00000.bin`, ... (uint16, or uint32 when the vocabulary needs it;
documents separated by the end-of-text token), the tokenizer it was made with
(`tokenizer.json`), and `index.json`: the dtype, the vocabulary size, the
end-of-text id, the tokenizer file's sha256, the source files and the token
count of every shard, so a reader can check each file against it. nanoGPT's
`train.bin`/`val.bin` (uint16, no index) are read as a dataset too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

INDEX = "index.json"
FORMAT = "harness-tokens/1"
SPLITS = ("train", "eval")
NANOGPT_FILES = {"train": "train.bin", "eval": "val.bin"}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every token id below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def shard_name(split: str, number: int) -> str:
    return f"{split}_{number:05d}.bin"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_durably(path: Path, data: bytes) -> None:
    """Write, fsync, then rename into place: a reader sees the whole file or none."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def read_index(root: Path) -> dict:
    """`index.json` of the dataset at `root`; ValueError naming the path when it is missing or unreadable."""
    path = root / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"data.path={str(root)!r} holds no {INDEX}: not a dataset written by `python -m harness.prepare` "
            "(or its run did not finish). Fix: run (or re-run) python -m harness.prepare with out="
            f"{str(root)!r}, or data.format=nanogpt for nanoGPT's train.bin/val.bin."
        ) from None
    except NotADirectoryError:
        raise ValueError(
            f"data.path={str(root)!r} is a file, not a dataset directory. Fix: data.path=<the directory "
            "python -m harness.prepare wrote (its out=)>, or for nanoGPT's files the folder holding train.bin "
            "and val.bin with data.format=nanogpt."
        ) from None
    except (OSError, ValueError) as e:
        message = f"data.path={str(root)!r}: {INDEX} is unreadable ({e}). Fix: re-run harness.prepare."
        raise ValueError(message) from None
    if index.get("format") != FORMAT:
        raise ValueError(
            f"data.path={str(root)!r}: {INDEX} has format {index.get('format')!r}, this harness reads {FORMAT!r}. "
            "Fix: re-run python -m harness.prepare into a new directory."
        )
    return index


def shard_errors(root: Path, index: dict) -> list[str]:
    """Why the shards at `root` do not match their index: a missing file, a size that is not the
    index's token count (truncated or appended to), a dtype that cannot hold the vocabulary, token
    ids (as harness.prepare recorded them) beyond it."""
    dtype = np.dtype(index["dtype"])
    if index["vocab_size"] > np.iinfo(dtype).max + 1:
        return [
            f"data.path={str(root)!r}: its shards are {dtype.name}, which cannot hold token ids up to "
            f"{index['vocab_size'] - 1} (vocab_size {index['vocab_size']}). Fix: re-run harness.prepare "
            "(it picks uint32 for vocabularies above 65536)."
        ]
    errors = []
    for split in SPLITS:
        for shard in index[split]:
            path = root / shard["file"]
            expected = shard["tokens"] * dtype.itemsize
            if shard.get("max_id", -1) >= index["vocab_size"]:  # recorded by harness.prepare
                errors.append(
                    f"data.path={str(root)!r}: shard {shard['file']} holds token ids up to {shard['max_id']}, "
                    f"beyond the vocabulary of {index['vocab_size']} its {INDEX} says: the index is not these "
                    "shards'."
                )
            if not path.is_file():
                errors.append(f"data.path={str(root)!r}: shard {shard['file']} listed in {INDEX} is missing.")
            elif path.stat().st_size != expected:
                errors.append(
                    f"data.path={str(root)!r}: shard {shard['file']} holds {path.stat().st_size} bytes, its index "
                    f"says {shard['tokens']} {dtype.name} tokens ({expected} bytes): truncated or not this index's."
                )
    if errors:
        errors[-1] += " Fix: re-run python -m harness.prepare with the same settings (it rewrites what is wrong)."
    return errors


class TokenIdsOutOfRange(ValueError):
    """A batch holds a token id the model does not embed (a dataset whose index does not match its
    shards); the message names the shard and the fix."""
