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
from omegaconf import DictConfig, OmegaConf

from harness.checkpoint import meta as meta_format
from harness.checkpoint_paths import META, complete_checkpoints
from harness.config import decays_matrices_only

log = logging.getLogger(__name__)

RNG_FILE = "rng.pt"
# model keys that change no parameter: a run may resume with another value
SHAPE_FREE_MODEL_KEYS = {"dropout", "activation_checkpointing", "init_from"}  # weights come from the checkpoint
# model configs in meta.json before components were chosen by `_target_`
LEGACY_MODEL_NAMES = {"gpt": "harness.models.GPT", "mlp": "harness.models.TokenMLP"}
# model keys added since, with what every model saved before the key existed had: a GPT had biases
# and an untied head (its own `head.weight`) before model.bias and model.tie_embeddings
LEGACY_MODEL_KEYS = {"harness.models.GPT": {"bias": True, "tie_embeddings": False}}


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


RESUME_FIX = "Fix: point checkpoint.resume at a step_<N> directory written by harness, or checkpoint.resume=never."


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


def check_compatible(meta: dict, cfg: DictConfig, path: Path) -> list[str]:
    """Why the checkpoint at `path` cannot resume the run configured by `cfg` (empty: it can)."""
    errors = []
    saved_model = saved_model_config(meta["model"])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    differ = [
        k for k in sorted((set(saved_model) | set(model)) - SHAPE_FREE_MODEL_KEYS) if saved_model.get(k) != model.get(k)
    ]
    if differ:
        # a checkpoint saved before a key existed loads as saved with the key at the value it then had
        filled = set(saved_model) - set(meta["model"]) - {"_target_"}
        diffs = [
            f"model.{k}: saved {saved_model.get(k)!r}{' (saved before the key existed)' if k in filled else ''}, "
            f"configured {model.get(k)!r}"
            for k in differ
        ]
        scalars = all(isinstance(saved_model.get(k), (bool, int, float, str)) for k in differ)
        as_saved = (
            f"{' '.join(f'model.{k}={_override(saved_model[k])}' for k in differ)} to continue as saved"
            if scalars and "_target_" not in differ
            else "set the model to the saved one (the overrides above)"
        )
        errors.append(
            f"checkpoint.resume: the checkpoint at {str(path)!r} holds another model ({'; '.join(diffs)}). "
            f"Fix: {as_saved}, or checkpoint.resume=never with a new hydra.run.dir to start fresh."
        )
    if meta["optimizer"] != cfg.optimizer._target_:
        errors.append(
            f"checkpoint.resume: the checkpoint at {str(path)!r} holds {meta['optimizer']} state, but "
            f"optimizer._target_={cfg.optimizer._target_}. Fix: resume with the saved optimizer, or "
            "checkpoint.resume=never with a new hydra.run.dir."
        )
    return errors + _decay_group_errors(meta.get("config") or {}, cfg, path) + _clock_errors(meta, cfg, path)


def _override(value) -> str:
    """A scalar config value as a command-line override writes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _clock_errors(meta: dict, cfg: DictConfig, path: Path) -> list[str]:
    """The run's clock derives its plan again from a checkpoint's inputs for the config it resumes with
    (docs/configuration.md#changing-a-run-at-resume); these changes it cannot honour."""
    errors, step = [], meta.get("step", 0)
    at = f"the checkpoint at {str(path)!r} is at step {step}"
    if step > cfg.train.steps:
        errors.append(
            f"train.steps={cfg.train.steps}: {at}, past it, so nothing is left to train. Fix: train.steps={step} "
            "or more (more steps go on from it), or checkpoint.resume=never with a new hydra.run.dir."
        )
    saved = meta.get("config") or {}
    saved_averager, averager = saved.get("averager") or {}, cfg.averager
    warmup, saved_warmup = averager.get("warmup_steps"), saved_averager.get("warmup_steps")
    if averager.get("_target_") and saved_averager.get("_target_") and saved_warmup is not None:
        if step > saved_warmup and warmup > step:
            errors.append(
                f"averager.warmup_steps={warmup}: {at}, past its warmup of {saved_warmup} steps, so its replicas "
                "already trained apart (their parameters differ), and a warmup step averages gradients, not "
                f"parameters: it cannot make them one model again. Fix: averager.warmup_steps={saved_warmup} (or "
                f"any up to {step}), or averager=none (synchronous: a resume starts every replica from their mean)."
            )
    in_flight = ((meta.get("cross_replica") or {}).get("averager") or {}).get("in_flight")
    fragments, saved_fragments = averager.get("fragments"), saved_averager.get("fragments")
    if in_flight is not None and fragments is not None and saved_fragments not in (None, fragments):
        errors.append(
            f"averager.fragments={fragments}: {at}, inside the delay of a sync of fragment {in_flight['fragment']} "
            f"of {saved_fragments}, whose mean pseudo-gradient it holds for that fragment's parameters alone. Fix: "
            f"averager.fragments={saved_fragments}, or resume from a checkpoint saved outside a sync's delay (its "
            "meta.json's cross_replica.averager has no in_flight)."
        )
    return errors


def _decay_group_errors(saved: dict, cfg: DictConfig, path: Path) -> list[str]:
    """A resume keeps each optimizer's weight-decay groups (`decay_1d`): saved
    param groups do not load into other ones (DCP matches groups by their
    parameters' FQNs, so a new group gets no hyperparameters, or two saved ones
    the last's), and the training it continues would change unasked. A
    checkpoint saved before `decay_1d` existed has one group."""
    errors = []
    for key in ("optimizer", "averager.outer_optimizer"):
        configured, saved_opt = OmegaConf.select(cfg, key), _select(saved, key)
        if configured is None or saved_opt is None:
            continue  # no outer optimizer configured, or none saved (its state starts fresh)
        saved_split = decays_matrices_only(saved_opt)
        if saved_split == decays_matrices_only(configured):
            continue
        as_saved = {"decay_1d": saved_opt.get("decay_1d", True), "weight_decay": saved_opt.get("weight_decay", 0.0)}
        fix = next(  # the fewest saved values that give the saved groups back
            keys
            for keys in (("decay_1d",), ("weight_decay",), ("decay_1d", "weight_decay"))
            if decays_matrices_only({**configured, **{k: as_saved[k] for k in keys}}) == saved_split
        )
        errors.append(
            f"checkpoint.resume: the checkpoint at {str(path)!r} was saved with "
            f"{_decay_groups(saved_opt, key, 'saved before decay_1d existed')}, but this run has "
            f"{_decay_groups(configured, key, 'no decay_1d key')}; a resume keeps the weight-decay groups. Fix: "
            f"{' '.join(f'{key}.{k}={str(as_saved[k]).lower()}' for k in fix)} to continue as saved, or "
            "checkpoint.resume=never with a new hydra.run.dir to start fresh."
        )
    return errors


def _decay_groups(optimizer, key: str, without_key: str) -> str:
    """How the optimizer config `optimizer` (at `key`) gives its weight decay,
    in words (`without_key`: why it has no `decay_1d`)."""
    decay = optimizer.get("weight_decay", 0.0)
    if decays_matrices_only(optimizer):
        return f"{key}.weight_decay={decay} on matrices only ({key}.decay_1d=false: two param groups)"
    if not decay:
        return f"{key}.weight_decay=0 (one param group)"
    flag = f"{key}.decay_1d=true" if "decay_1d" in optimizer else without_key
    return f"{key}.weight_decay={decay} on every parameter ({flag}: one param group)"


def _select(tree: dict, key: str):
    """`tree`'s value at the dotted `key`; None where a level is missing."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


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
