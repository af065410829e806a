"""The command line's overrides, checked before Hydra's run: the config is
composed from them with Hydra's compose API, and when that fails each bad
override gets one paragraph naming it and the fix - the closest valid key or
option for a typo, the type a key takes, the values an enum allows - instead
of Hydra's message, which has no fix and for a typo suggests a `+key=...`
addition that `validate` then refuses. A sweep (`-m`) is checked value by
value. Overrides of `hydra.*` keep Hydra's own message: its run reports them.

Light: Hydra and OmegaConf only (no torch), so `validate` shares `closest`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override
from hydra.errors import HydraException, MissingConfigException
from omegaconf import BooleanNode, DictConfig, EnumNode, FloatNode, IntegerNode, ListConfig, OmegaConf, StringNode
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

# difflib's similarity for "a typo of": stepz/steps 0.8, sgdd/sgd 0.86, asnyc/async 0.8; gpu/cpu (0.67) is no typo
TYPO_CUTOFF = 0.7


def closest(name: str, names: list[str]) -> str | None:
    """The one of `names` that `name` is most likely a typo of, if any."""
    matches = difflib.get_close_matches(name, names, n=1, cutoff=TYPO_CUTOFF)
    return matches[0] if matches else None


def override_errors(argv: list[str], config_dir: Path, config_name: str = "config") -> list[str]:
    """One paragraph per override in `argv` (train.py's command line) that Hydra
    cannot compose into the config in `config_dir`; empty when the config
    composes or the command is not a run or sweep of that config (`--help`,
    `--info`, another `--config-path`/`--config-dir`). `register_configs()` must
    have run. Bad flags end here as in Hydra's own run (argparse, exit 2)."""
    args = get_args_parser().parse_args(argv[1:])
    if args.help or args.hydra_help or args.shell_completion or args.info or args.experimental_rerun:
        return []
    if args.config_path or args.config_dir:
        return []
    overrides, errors = _parse(args.overrides)
    if errors:
        return errors
    # Hydra refuses a sweep of its own keys (`hydra.*`) in its own words
    overrides = [o for o in overrides if not (o.is_sweep_override() and o.is_hydra_override())]
    if not args.multirun:
        errors = [_sweep_without_multirun(o) for o in overrides if o.is_sweep_override()]
        overrides = [o for o in overrides if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(config_dir.absolute()), version_base=None):
        for job, varied in _jobs(overrides):
            for error in _composition_errors(job, args.config_name or config_name):
                if varied is not None and not error.startswith(f"harness: {varied}:"):
                    error = error.replace("harness: ", f"harness: in the sweep's job with {varied}: ", 1)
                if error not in errors:
                    errors.append(error)
    return errors


def _parse(lines: list[str]) -> tuple[list[Override], list[str]]:
    parser = OverridesParser.create()
    overrides, errors = [], []
    for line in lines:
        try:
            overrides += parser.parse_overrides([line])
        except HydraException as e:
            reason = " ".join(str(e).splitlines()[1:2])
            errors.append(
                f"harness: the override {line!r} cannot be parsed ({reason}). Fix: write key=value to set a key, "
                "group=option to pick a config, +key=value to add a key, ~key to delete one; values with spaces "
                "or commas in quotes (https://hydra.cc/docs/advanced/override_grammar/basic/)."
            )
    return overrides, errors


def _sweep_without_multirun(o: Override) -> str:
    key, values = o.get_key_element(), o.input_line.split("=", 1)[1]
    return (
        f"harness: {o.input_line} is a sweep over several values, which needs -m. Fix: "
        f"`python train.py -m ... {o.input_line}` runs one job per value; {key}=[{values}] is a list, "
        f"{key}='{values}' a string."
    )


def _jobs(overrides: list[Override]) -> list[tuple[list[str], str | None]]:
    """The jobs that check every swept value, each with the value it varies: one
    with every sweep at its first value, then one per further value with the
    other sweeps at their first. Not the cartesian product: a bad key, type or
    option is bad next to any other value; two values that fail only together
    fail in Hydra's job for them. Non-discrete sweeps (`interval(...)`) are left
    to Hydra's sweeper, which refuses them."""
    swept = []
    for o in overrides:
        if not o.is_sweep_override():
            swept.append([o.input_line])
        elif o.is_discrete_sweep() and (values := _sweep_values(o)):
            swept.append([f"{o.get_key_element()}={v}" for v in values])
    first = [values[0] for values in swept]
    jobs: list[tuple[list[str], str | None]] = [(first, None)]
    for i, values in enumerate(swept):
        jobs += [([*first[:i], value, *first[i + 1 :]], value) for value in values[1:]]
    return jobs


def _sweep_values(o: Override) -> list[str]:
    if isinstance(o.value(), Glob):  # options of a group: they exist
        return o.value().filter(GlobalHydra.instance().config_loader().get_group_options(o.key_or_group))
    return list(o.sweep_string_iterator())


def _composition_errors(job: list[str], config_name: str) -> list[str]:
    """Compose `job`; on failure explain it, drop the bad override (and, for an
    unknown group option, every override inside that group, which cannot be
    checked against an option that does not exist) and compose again, so every
    bad override is reported at once."""
    errors: list[str] = []
    overrides = OverridesParser.create().parse_overrides(job)
    while True:
        try:
            cfg = compose(config_name, overrides=[o.input_line for o in overrides])
            return errors + _truth_errors(cfg, overrides)
        except (HydraException, OmegaConfBaseException, ValueError) as e:
            bad = _bad_override(e, overrides)
            if (bad is not None and bad.is_hydra_override()) or _in_hydra(e):
                return errors  # Hydra's own run reports it in its own words
            errors.append(explain(e, bad))
            if bad is None:
                return errors
            group = bad.key_or_group if isinstance(e, MissingConfigException) else None
            overrides = [o for o in overrides if o is not bad and not (group and _inside(o.key_or_group, group))]
        except Exception:  # noqa: BLE001 - not a composition error (an assertion on odd input): Hydra's run reports it
            return errors


def _inside(key: str, group: str) -> bool:
    return key == group or key.startswith((f"{group}.", f"{group}/"))


def _in_hydra(e: Exception) -> bool:
    if isinstance(e, MissingConfigException):
        return (e.missing_cfg_file or "").startswith("hydra/")
    return str(getattr(e.__cause__, "full_key", "")).startswith("hydra.")


def _bad_override(e: Exception, overrides: list[Override]) -> Override | None:
    """The override that `e` is about, if it is one of `overrides` (it may be a config file's value)."""
    if isinstance(e, MissingConfigException):
        group = (e.missing_cfg_file or "").rpartition("/")[0]
        return next((o for o in overrides if o.key_or_group == group), None)
    full_key = getattr(e.__cause__, "full_key", None)
    for o in overrides:
        key = o.key_or_group
        if full_key is not None:
            if key == full_key or key.startswith(f"{full_key}.") or full_key.startswith(f"{key}["):
                return o
        elif f"'{key}'" in str(e):  # Hydra's own errors quote the key: "An item is already at 'train.steps'"
            return o
    return None


def explain(e: Exception, bad: Override | None) -> str:
    """One paragraph for the composition error `e` about override `bad`
    (None: not about an override): what is wrong and the fix."""
    cause = e.__cause__
    if isinstance(e, MissingConfigException) and e.options is not None:
        return _unknown_option(e, bad)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and isinstance(cause.parent_node, DictConfig):
        return _unknown_key(cause, bad)
    if bad is not None and bad.is_add() and cause is None:
        key, value = bad.key_or_group, bad.input_line.split("=", 1)[1]
        return (
            f"harness: +{key}={value}: {key} is already in the config, and '+' adds a key that is not. "
            f"Fix: {key}={value} (without the '+')."
        )
    if isinstance(cause, ValidationError) and cause.child_node is not None:
        return _wrong_value(cause, bad)
    reason = _reason(e)
    if bad is not None and str(getattr(cause, "full_key", "")).startswith(f"{bad.key_or_group}["):
        # an element of a typed list or tuple: OmegaConf names the container's type
        return f"harness: {bad.input_line}: {reason}. Fix: write {bad.key_or_group} as a {cause.ref_type_str}."
    if bad is None:
        return f"harness: the config cannot be composed: {reason}. Fix: correct the config file or value it names."
    return f"harness: {bad.input_line}: {reason}. Fix: correct or drop {bad.input_line}."


def _reason(e: Exception) -> str:
    """OmegaConf's message (else Hydra's) without its `full_key: ...` details, Hydra's search path or
    Hydra's advice to add with '+' (which `validate` refuses for a key the schema lacks)."""
    lines = []
    for line in str(e.__cause__ or e).splitlines():
        if line.startswith((" ", "\t", "Config search path")):
            break
        if not line.startswith("To append"):
            lines.append(line.strip().rstrip("."))
    return "; ".join(line for line in lines if line)


def _unknown_option(e: MissingConfigException, bad: Override | None) -> str:
    group, _, option = (e.missing_cfg_file or "").rpartition("/")
    options = sorted(e.options or [])
    given = bad.input_line if bad is not None else f"{group}={option} (a config file's default)"
    typo = closest(option, options)
    fix = f"{group}={typo} (the closest option), or" if typo else "pick"
    return (
        f"harness: {given}: config group {group} has no option '{option}' (its options are the files in "
        f"conf/{group}/). Fix: {fix} one of {group}={'|'.join(options)}."
    )


def _unknown_key(cause: OmegaConfBaseException, bad: Override | None) -> str:
    node: DictConfig = cause.parent_node
    full_key, key = str(cause.full_key), str(cause.key)
    path = full_key[: -len(key)].rstrip(".")
    owner = f"'{path}' ({cause.object_type.__name__})" if path else "the config"
    keys = [str(k) for k in node.keys() if k != "hydra"]
    given = bad.input_line if bad is not None else f"{full_key} (in a config file)"
    value = bad.input_line.split("=", 1)[1] if bad is not None and "=" in bad.input_line else "..."
    rest = bad.key_or_group[len(full_key) :] if bad is not None else ""
    typo = None
    if "/" not in key:  # `train/x=...` is group syntax on a plain key: no typo to guess
        # a top-level key may be a section's key given without its section (`steps=3`)
        typo = closest(key, keys) or (None if path else _closest_nested(key, node))
    other_keys = getattr(cause.object_type, "OTHER_KEYS", None)  # a schema that takes no keys says why
    if other_keys is not None:
        return f"harness: {given}: {other_keys.format(key=full_key)}"
    not_taken = getattr(cause.object_type, "NOT_TAKEN", {}).get(key)  # ... or one that lacks a sibling's key
    if not_taken is not None:
        return f"harness: {given}: {not_taken}"
    if typo is not None:
        fixed = f"{path}.{typo}" if path else typo
        fix = f"{fixed}{rest}={value} (the closest key)"
    else:
        fix = f"one of the keys of {path or 'the config'}: {', '.join(keys)}"
    return f"harness: {given}: {owner} has no key '{key}'. Fix: {fix}."


def _closest_nested(key: str, root: DictConfig) -> str | None:
    """`section.name` for the section key `key` is (closest to), e.g. `train.steps` for `steps`."""
    nested = {}
    for section in root.keys():
        if section != "hydra" and isinstance(root._get_node(section), DictConfig):
            for name in root._get_node(section).keys():
                nested.setdefault(str(name), f"{section}.{name}")
    typo = closest(key, list(nested))
    return nested[typo] if typo else None


def _wrong_value(cause: OmegaConfBaseException, bad: Override | None) -> str:
    """A value the key's declared type or enum refuses: what the key takes, and an example."""
    node, key = cause.child_node, str(cause.full_key)
    given = bad.input_line if bad is not None else f"{key} (in a config file)"
    if isinstance(node, EnumNode):
        allowed = [str(m.value) for m in node.enum_type]
        value = bad.input_line.split("=", 1)[1] if bad is not None else ""
        typo = closest(value, allowed)
        fix = f"{key}={typo} (the closest value), or one of" if typo else "one of"
        return f"harness: {given}: {key} must be one of {'|'.join(allowed)}. Fix: {fix} {key}={'|'.join(allowed)}."
    if isinstance(node, DictConfig):
        first = next(iter(node.keys()), "...")
        return (
            f"harness: {given}: {key} is a section of keys, not a value. "
            f"Fix: set its keys one by one, e.g. {key}.{first}={_render(node[first])}."
        )
    kind, example = {
        BooleanNode: ("true or false", "true"),
        IntegerNode: ("an integer", "1"),
        FloatNode: ("a number", "0.5"),
        StringNode: ("a string", "text"),
        ListConfig: ("a list", "[a,b]"),
    }.get(type(node), (None, None))
    if kind is None:
        return f"harness: {given}: {_reason(cause)}. Fix: give {key} a value of the type it takes."
    if node._is_optional():
        kind += " or null"
    current = node._value()
    example = _render(current) if current not in (None, []) else example
    return f"harness: {given}: {key} takes {kind}. Fix: {key}={example}, for example."


TRUTH = {"true", "false", "yes", "no", "on", "off", "1", "0"}  # what a true/false key takes, in any case


def _truth_errors(cfg: DictConfig, overrides: list[Override]) -> list[str]:
    """Overrides of a true/false key with another value: OmegaConf's BooleanNode takes any integer (2 is
    true) and Hydra composes it without a word; and of a key that takes an integer or a word (its schema's
    `INTEGER_OR`, typed Any) with anything else."""
    errors = []
    for o in overrides:
        if o.is_hydra_override() or o.value() is None or "=" not in o.input_line:
            continue
        parent_key, _, name = o.key_or_group.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        node = parent._get_node(name) if isinstance(parent, DictConfig) and name in parent else None
        value = o.input_line.split("=", 1)[1].strip()
        key = o.key_or_group
        if isinstance(node, BooleanNode) and value.lower() not in TRUTH:
            errors.append(f"harness: {o.input_line}: {key} takes true or false. Fix: {key}=true or {key}=false.")
        schema = OmegaConf.get_type(parent) if node is not None else None
        word = getattr(schema, "INTEGER_OR", {}).get(name)
        number = isinstance(o.value(), int) and not isinstance(o.value(), bool)
        if word is not None and not number and value != word:  # a key typed Any to take its word too
            default = schema.__dataclass_fields__[name].default
            errors.append(
                f"harness: {o.input_line}: {key} takes an integer or {word}. Fix: {key}={default} (the default), or "
                f"{key}={word}."
            )
    return errors


def _render(value: Any) -> str:
    """`value` as an override writes it: [a,b], true, null."""
    if isinstance(value, (list, tuple, ListConfig)):
        return f"[{','.join(_render(v) for v in value)}]"
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)
