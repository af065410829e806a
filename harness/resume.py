"""What a resume does with the config it runs with (docs/configuration.md#changing-a-run-at-resume).

Every config key declares its rule beside its schema (`RESUME` of each class in harness/config.py: honoured
from the resumed run's first step, the plan derived again, or refused); here they are read, for one
resume: `changes` are the keys whose value differs from the checkpoint's config, each with its rule;
`check_compatible` refuses, before any rank starts, the changes a resume cannot honour, each naming the
saved value as the fix; `summary` is the resumed run's one log line. `table` is the rules as
docs/configuration.md shows them (`python -m harness.resume` prints it). Pure: no torch, no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.config import (
    EXTRA_KEYS,
    SCHEMAS,
    Config,
    DiLoCoAveragerConf,
    OnResume,
    ProfileConf,
    Resume,
    decays_matrices_only,
    plain,
)

SECTIONS = ("train", "model", "data", "optimizer", "lr_scheduler", "averager", "sharding", "checkpoint")
SECTIONS += ("fault_tolerance", "wandb", "metrics", "launcher", "dist")
MISSING = object()  # a key the saved config has not (saved before it existed, or by another option)


@dataclass(frozen=True)
class Change:
    """A key whose value the run changes against its checkpoint's config."""

    key: str
    saved: Any
    now: Any
    rule: Resume


def rules_of(schema: type) -> dict[str, Resume]:
    """The rules a schema class declares, its bases' included (a dotted key: a nested node's, overridden)."""
    merged: dict[str, Resume] = {}
    for cls in reversed(schema.__mro__):
        merged.update(vars(cls).get("RESUME", {}))
    return merged


def keys_of(schema: type) -> set[str]:
    """The keys a schema class declares (its fields, and those no dataclass field can carry)."""
    return {f.name for f in dataclasses.fields(schema)} | EXTRA_KEYS.get(schema, set())


def _leaves(node: DictConfig, prefix: str, rules: dict[str, Resume]) -> Iterator[tuple[str, Resume | None]]:
    """Each leaf key under `node` with its rule: a nested node of a schema recurses with its own rules (a
    parent's dotted rule for one of its keys wins)."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            nested = rules_of(OmegaConf.get_type(child))
            nested.update({k[len(key) + 1 :]: r for k, r in rules.items() if k.startswith(f"{key}.")})
            yield from _leaves(child, f"{prefix}{key}.", nested)
        else:
            yield f"{prefix}{key}", rules.get(str(key))


def leaves(cfg: DictConfig) -> Iterator[tuple[str, Resume | None]]:
    """Every leaf key of the composed config `cfg`, with its rule (None: a key without one)."""
    for section in SECTIONS:
        node = cfg[section]
        yield from _leaves(node, f"{section}.", rules_of(OmegaConf.get_type(node)))


def _at(tree: dict, key: str):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def _lists(value):
    """Tuples as lists (JSON has no tuples: a saved `betas` reads back as a list)."""
    return [_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def changes(saved: dict, cfg: DictConfig) -> list[Change]:
    """The keys of `cfg` whose value differs from `saved` (a checkpoint's config), each with its rule; keys
    the saved config has not (added since, or another option's) are the concern of their option's
    `_target_`, and `checkpoint.resume` itself is left out (a resume changes it)."""
    current, found = plain(cfg), []
    for key, rule in leaves(cfg):
        before, now = _at(saved, key), _at(current, key)
        if key == "checkpoint.resume" or before is MISSING or _lists(before) == _lists(now):
            continue
        found.append(Change(key, before, now, rule))
    return found


# -- refusals --------------------------------------------------------------------------------------


def check_compatible(meta: dict, cfg: DictConfig, path: Path) -> list[str]:
    """Why the checkpoint at `path` cannot resume the run configured by `cfg` (empty: it can): the model
    it holds, each refused key, and the changes a rule refuses in the cases its words name."""
    from harness.checkpoint.files import saved_model_config

    saved = meta.get("config") or {}
    optimizer = {"_target_": meta["optimizer"], **(saved.get("optimizer") or {})}  # meta.json always has its class
    found = changes({**saved, "optimizer": optimizer}, cfg)
    errors = _model_errors(saved_model_config(meta["model"]), meta["model"], cfg, path)
    for change in found:
        if change.rule is not None and change.rule.on == OnResume.refused and not change.key.startswith("model."):
            errors.append(_refused(change, path))
    return errors + _decay_group_errors(saved, cfg, path) + _plan_errors(meta, cfg, path)


def _refused(change: Change, path: Path) -> str:
    """A refused change, naming the saved value (for a `_target_`, the option that has it)."""
    group, _, field = change.key.rpartition(".")
    saved = f"{change.key}={_override(change.saved)}"
    if field == "_target_":
        options = [name for name, schema in SCHEMAS.get(group, {}).items() if schema._target_ == change.saved]
        saved = f"{group}={options[0]}" if options else saved
    return (
        f"checkpoint.resume: the checkpoint at {str(path)!r} was saved with {change.key}={_shown(change.saved)}, "
        f"this run has {_shown(change.now)}: {change.rule.does}. Fix: {saved} to continue as saved, or "
        "checkpoint.resume=never with a new hydra.run.dir to start fresh."
    )


def _shown(value) -> str:
    return str(value) if isinstance(value, (int, float, bool)) or value is None else repr(value)


def _override(value) -> str:
    """A config value as a command-line override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{','.join(_override(v) for v in value)}]"
    return "null" if value is None else str(value)


def _model_errors(saved_model: dict, recorded: dict, cfg: DictConfig, path: Path) -> list[str]:
    """The model the checkpoint holds against the one configured, on the keys whose rule refuses a change
    (a checkpoint saved before a key existed is read with the key at the value it then had)."""
    model, rules = OmegaConf.to_container(cfg.model, resolve=True), rules_of(OmegaConf.get_type(cfg.model))
    free = {k for k, r in rules.items() if r.on != OnResume.refused}
    differ = [k for k in sorted((set(saved_model) | set(model)) - free) if saved_model.get(k) != model.get(k)]
    if not differ:
        return []
    filled = set(saved_model) - set(recorded) - {"_target_"}
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
    return [
        f"checkpoint.resume: the checkpoint at {str(path)!r} holds another model ({'; '.join(diffs)}). "
        f"Fix: {as_saved}, or checkpoint.resume=never with a new hydra.run.dir to start fresh."
    ]


def _plan_errors(meta: dict, cfg: DictConfig, path: Path) -> list[str]:
    """The run's clock derives its plan again from a checkpoint's inputs for the config it resumes with; the
    changes it cannot honour (train.steps, averager.warmup_steps, averager.fragments), and an outer optimizer
    of another class where the checkpoint holds its state."""
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
    state = (meta.get("cross_replica") or {}).get("averager") or {}
    in_flight = state.get("in_flight")
    fragments, saved_fragments = averager.get("fragments"), saved_averager.get("fragments")
    if in_flight is not None and fragments is not None and saved_fragments not in (None, fragments):
        errors.append(
            f"averager.fragments={fragments}: {at}, inside the delay of a sync of fragment {in_flight['fragment']} "
            f"of {saved_fragments}, whose mean pseudo-gradient it holds for that fragment's parameters alone. Fix: "
            f"averager.fragments={saved_fragments}, or resume from a checkpoint saved outside a sync's delay (its "
            "meta.json's cross_replica.averager has no in_flight)."
        )
    outer, saved_outer = (
        OmegaConf.select(cfg, "averager.outer_optimizer._target_"),
        _at(saved, "averager.outer_optimizer._target_"),
    )
    if state.get("outer_state") and outer is not None and saved_outer is not MISSING and outer != saved_outer:
        errors.append(
            f"averager.outer_optimizer._target_={outer}: {at}, and holds the state of its outer optimizer, "
            f"{saved_outer}, which another class cannot take. Fix: the saved outer optimizer "
            "(averager/outer_optimizer=<its option>), or checkpoint.resume=never with a new hydra.run.dir."
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
        configured, saved_opt = OmegaConf.select(cfg, key), _at(saved, key)
        if configured is None or not isinstance(saved_opt, dict):
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


# -- what the resumed run says, and the docs' table ------------------------------------------------


def summary(meta: dict, cfg: DictConfig, path: Path) -> str | None:
    """The resumed run's one log line: each key it changed, and what it does with it (None: none)."""
    found = changes(meta.get("config") or {}, cfg)
    if not found:
        return None
    said = [
        f"{c.key} {_override(c.saved)} -> {_override(c.now)} ({c.rule.on.value}: {c.rule.does})"
        for c in found
        if c.rule is not None
    ]
    return f"resuming {path} (step {meta['step']}) with {len(said)} key(s) changed: {'; '.join(said)}"


def schemas() -> Iterator[tuple[str, type]]:
    """Every schema class of the config, with the section it configures: each group's options, and the
    plain sections (a nested node's class too)."""
    for group, options in SCHEMAS.items():
        for schema in options.values():
            yield group, schema
    for schema in SCHEMAS["optimizer"].values():  # DiLoCo's outer optimizer is one of them
        yield "averager.outer_optimizer", schema
    for section in ("launcher", "dist", "train", "metrics"):
        schema = next(f for f in dataclasses.fields(Config) if f.name == section).default_factory
        yield section, schema
    yield "train.profile", ProfileConf


def section_rules(section: str, schema: type) -> dict[str, Resume]:
    """The rules of `schema` where it configures `section`: its own, with those its parent node declares for
    it (DiLoCo's for its outer optimizer)."""
    rules = rules_of(schema)
    if section == "averager.outer_optimizer":
        parent = rules_of(DiLoCoAveragerConf)
        rules.update({k.split(".", 1)[1]: r for k, r in parent.items() if k.startswith("outer_optimizer.")})
    return rules


def table() -> str:
    """The rules as a markdown table, a row per section and rule: docs/configuration.md's."""
    rows: dict[tuple[str, Resume], set[str]] = {}
    for section, schema in schemas():
        for key, rule in section_rules(section, schema).items():
            if key in keys_of(schema):
                rows.setdefault((section.split(".")[0], rule), set()).add(f"{section}.{key}")
    order = {section: i for i, section in enumerate(SECTIONS)}
    lines = ["| keys | a changed value at resume |", "|---|---|"]
    for (_, rule), keys in sorted(rows.items(), key=lambda r: (order[r[0][0]], r[0][1].on.value, min(r[1]))):
        lines.append(f"| {', '.join(f'`{k}`' for k in sorted(keys))} | {rule.on.value}: {rule.does} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
