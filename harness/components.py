"""Components chosen by `_target_`: the class a config node names, and whether
it accepts the node's keys. Shared by `validate` and the components' own
config rules (an averager's `config_errors`), so neither imports the other."""

from __future__ import annotations

import importlib
import inspect

from omegaconf import DictConfig


def target_class(
    node: DictConfig,
    group: str,
    base: type,
    base_name: str,
    runtime_args: tuple[str, ...],
    options: str,
    harness_keys: tuple[str, ...] = (),
) -> tuple[type | None, list[str]]:
    """The class `<group>._target_` names, or the errors why it cannot be built from `node`:
    it must import, subclass `base`, and accept every key of `node` (the
    `runtime_args` are filled in by the harness, not the config; the
    `harness_keys` are the harness's, not the class's)."""
    target = node.get("_target_")
    try:
        module, _, name = str(target).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None, [f"{group}._target_={target!r} cannot be imported. Fix: name a class, or pick {group}={options}."]
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        return None, [
            f"{group}._target_={target!r} is not a {base_name} subclass. "
            f"Fix: point it at such a class, or pick {group}={options}."
        ]
    params = inspect.signature(cls).parameters
    accepted = [p for p in params if p not in ("self", *runtime_args)]
    errors = [
        f"{group}.{key}={node[key]!r} is not an argument of {target}. It accepts: {', '.join(accepted)}. "
        f"Fix: check the spelling of {group}.{key}."
        for key in node.keys()
        if not str(key).startswith("_") and key not in accepted and key not in harness_keys
    ]
    return (None if errors else cls), errors
