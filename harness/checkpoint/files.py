"""The files of a checkpoint, and finding them. Pure: no torch.distributed, so
`harness.preflight` can check a checkpoint before any process group exists.

One checkpoint is a directory `<checkpoint.dir>/step_<N>/`:

    meta.json       step, mode, layout, replica copies, model config, the resolved
                    config, byte count, and every stateful part's small state
                    (`data`: the data position, `cross_replica`: the averager's clock)
    rng.pt          every rank's RNG states, a list indexed by global rank
    full mode:      full.pt - {"model": FQN -> tensor, "optim": FQN-keyed state},
                    plain tensors, loadable with torch.load(weights_only=True)
    sharded mode:   a DCP directory (.metadata + one file per rank)

Atomicity: every file is written under `step_<N>.partial/`; rank 0 writes
`meta.json` once every rank's part is on disk, and then renames the directory
to `step_<N>/`. Only renamed directories with a `meta.json` count, so a save
killed halfway never hides or damages the previous checkpoint, and the next
save deletes the leftover `.partial` directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from harness.checkpoint import meta as meta_format
from harness.checkpoint_paths import META, complete_checkpoints

log = logging.getLogger(__name__)

RNG_FILE = "rng.pt"
# model configs in meta.json before components were chosen by `_target_`
LEGACY_MODEL_NAMES = {"gpt": "harness.models.GPT", "mlp": "harness.models.TokenMLP"}
# model keys added since, with what every model saved before the key existed had: a GPT had biases
# and an untied head (its own `head.weight`) before model.bias and model.tie_embeddings, and exact
# GELU before model.activation (model.n_positions: null, train.seq_len's rows, as before it existed)
LEGACY_MODEL_KEYS = {"harness.models.GPT": {"bias": True, "tie_embeddings": False, "activation": "gelu"}}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written; the message names the path and the fix. One that
    cannot be read also says what is wrong with it (`problem`, of `path`), so that a reader other than a
    resume (an export, a replica group) can name its own fix."""

    def __init__(self, message: str, path: Path | None = None, problem: str | None = None):
        super().__init__(message)
        self.path, self.problem = path, problem


def unreadable(path: Path, problem: str, fix: str) -> CheckpointError:
    """The CheckpointError of a checkpoint a resume cannot read: `checkpoint.resume=<path>: <problem>. <fix>`."""
    return CheckpointError(f"checkpoint.resume={str(path)!r}: {problem}. {fix}", path, problem)


RESUME_FIX = (
    "Fix: checkpoint.resume=auto (the newest complete checkpoint in checkpoint.dir, if any), a path to a step_<N> "
    "directory written by harness (or its checkpoints folder), or checkpoint.resume=never."
)


def read_meta(path: Path) -> dict:
    """`meta.json` of the checkpoint at `path`, in today's format whichever version wrote it (`meta.upgrade`);
    CheckpointError when missing, unreadable, or a field is of the wrong type or out of range."""
    if not path.exists():
        raise unreadable(path, "no such file or directory", RESUME_FIX)
    if not path.is_dir():
        raise unreadable(path, "a file, not a checkpoint (a step_<N> directory holding meta.json)", RESUME_FIX)
    try:
        raw = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise unreadable(
            path,
            f"it is not a complete checkpoint: it has no {META} (a save that did not finish, or not a harness "
            "checkpoint)",
            RESUME_FIX,
        ) from None
    except (OSError, ValueError) as e:
        raise unreadable(path, f"{META} is unreadable ({e}); the checkpoint is corrupt", RESUME_FIX) from None
    found = meta_format.problems(raw, upgrading=True)
    if not found:
        meta = meta_format.upgrade(raw)
        found = meta_format.problems(meta)
    if found:
        raise unreadable(path, f"its {META} cannot be a checkpoint's: {'; '.join(found)}", META_FIX)
    return meta


META_FIX = (
    f"Fix: if {META} was edited by hand, put back what the run wrote; else resume from another checkpoint "
    "(checkpoint.resume=<its step_<N> dir>), or checkpoint.resume=never with a new hydra.run.dir."
)


def saved_model_config(model: dict) -> dict:
    """A model config as meta.json records it, in today's keys: `_target_` for a legacy name, and
    each key added since (`LEGACY_MODEL_KEYS`) with the value the model was saved with."""
    model = dict(model)
    if "name" in model and "_target_" not in model:
        model["_target_"] = LEGACY_MODEL_NAMES.get(model.pop("name"))
    return {**LEGACY_MODEL_KEYS.get(model.get("_target_"), {}), **model}


def write_durably(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def commit(partial: Path, meta: dict, rngs: list, keep: int) -> int:
    """Make `partial` a complete checkpoint (rank 0, once every rank's files are
    on disk): rng.pt, meta.json, fsync, rename; then drop all but the newest
    `keep`. Returns its size in bytes."""
    write_durably(rngs, partial / RNG_FILE)
    meta["bytes"] = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file())
    (partial / META).write_text(json.dumps(meta, indent=1))
    _fsync_dir(partial)
    final = partial.with_name(partial.name.removesuffix(".partial"))
    partial.rename(final)
    _fsync_dir(final.parent)
    for old in complete_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint step %d saved to %s (%.1f MB)", meta["step"], final, meta["bytes"] / 1e6)
    return meta["bytes"]


def remove_leftovers(root: Path) -> None:
    """`.partial` directories of saves that never finished (a crash, a kill)."""
    if root.is_dir():
        for p in root.glob("step_*.partial"):
            log.warning("removing incomplete checkpoint %s", p)
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
