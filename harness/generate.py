"""Sample text from a trained model:

    python -m harness.generate <run dir, checkpoint dir or export dir> prompt="..." [key=value ...]

`group=<r>`: of a fault-tolerant run, that replica group's model (default: the
mean of the groups' at their newest common step, as `harness.export` takes).

A run (or one of its checkpoints) is exported first (`harness.export`, into a
temporary directory), then transformers' `generate` continues the prompt with
the exported model and tokenizer, exactly as a user of the export would:
greedy with `temperature=0` (the default), else sampled with `temperature` and
`top_p` from `seed`. Prints the prompt and its continuation.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

from harness.checkpoint import CheckpointError
from harness.config import ConfigError

# the keys, their types and defaults
KEYS = {"prompt": (str, None), "max_new_tokens": (int, 64), "temperature": (float, 0.0), "top_p": (float, 1.0)}
KEYS["seed"] = (int, 0)
KEYS["group"] = (int, None)  # a fault-tolerant run: this replica group's model, not their mean
# a value of each key for a message's fix: its default, or what to write instead of it
EXAMPLES = {key: default for key, (_, default) in KEYS.items()}
EXAMPLES["group"] = "0 (a replica group's number), or no group= for the groups' mean"


def parse(args: list[str]) -> dict:
    """`key=value` arguments; ConfigError naming a bad one and the fix."""
    from harness.overrides import closest

    values = {key: default for key, (_, default) in KEYS.items()}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in KEYS:
            typo = closest(key, list(KEYS)) if sep else None
            raise ConfigError(
                f"{arg!r} is not a key=value of harness.generate. "
                f"Fix: {f'{typo}={value} (the closest key)' if typo else 'one of ' + ', '.join(f'{k}=' for k in KEYS)}."
            )
        try:
            values[key] = KEYS[key][0](value)
        except ValueError:
            kind = KEYS[key][0].__name__
            raise ConfigError(f"{key}={value!r} is not a {kind}. Fix: e.g. {key}={EXAMPLES[key]}.") from None
    if not values["prompt"]:
        given = "no prompt" if values["prompt"] is None else "prompt='' is empty: there is nothing to continue"
        raise ConfigError(f'{given}. Fix: prompt="def main(" (in quotes when it has spaces).')
    if not 0 <= values["seed"] < 2**63:
        raise ConfigError(f"seed={values['seed']} is outside [0, 2**63) (torch's seeds). Fix: e.g. seed=0.")
    sampling = values["temperature"], values["top_p"]
    if values["max_new_tokens"] < 1 or not sampling[0] >= 0 or sampling[0] == math.inf or not 0 < sampling[1] <= 1:
        raise ConfigError(
            f"max_new_tokens={values['max_new_tokens']}, temperature={values['temperature']}, top_p={values['top_p']}: "
            "max_new_tokens must be >= 1, temperature a finite number >= 0 (0 is greedy), top_p in (0, 1]. "
            "Fix: e.g. max_new_tokens=64 temperature=0.8 top_p=0.95."
        )
    return values


NO_TOKENIZER_FIX = "Fix: train on data=tokens prepared by harness.prepare, which keeps its tokenizer."


def generate(model_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> str:
    """The prompt and its continuation by the Hugging Face model in `model_dir` (an export)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.float8 import torchao_quieted

    if not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{str(model_dir)!r} holds no tokenizer.json. {NO_TOKENIZER_FIX}")
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise ConfigError(
            f"{str(model_dir)!r} holds a config.json but no weights (*.safetensors): an export cut short, or its "
            "weights moved. Fix: export the run again (python -m harness.export <run dir> <out dir>), or pass the "
            "run's directory."
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torchao_quieted():  # transformers imports torchao where it is installed
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    positions = getattr(model.config, "n_positions", None)  # a learned position table (GPT-2's): none past it
    length = inputs.input_ids.shape[1]
    if positions is not None and length + max_new_tokens > positions:
        room = f"max_new_tokens={positions - length}" if length < positions else "a shorter prompt"
        raise ConfigError(
            f"the prompt ({length} tokens) and max_new_tokens={max_new_tokens} run past the model's {positions} "
            f"positions (a GPT's: its model.n_positions, by default the run's train.seq_len). Fix: {room}."
        )
    sample = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=max_new_tokens, **(sample or {"do_sample": False}))
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    source = Path(argv[0])
    try:
        settings = parse(argv[1:])
        if (source / "config.json").is_file():  # an export (or any Hugging Face model directory)
            if settings.pop("group") is not None:
                raise ConfigError(
                    f"group= picks a replica group of a fault-tolerant run, but {str(source)!r} is an export: one "
                    "model. Fix: drop group=, or pass the run's directory with group=<r>."
                )
            print(generate(source, **settings))
            return 0
        from harness.export import export, find_checkpoints, reading, run_tokenizer

        group = settings.pop("group")
        paths = find_checkpoints(source, group)
        with reading(paths):
            where, what = run_tokenizer(paths[0])
        if where is None:  # said before the export, naming the run
            raise ConfigError(
                f"{str(source)!r}: {what}, so no tokenizer turns the prompt into tokens. {NO_TOKENIZER_FIX}"
            )
        with tempfile.TemporaryDirectory(prefix="harness-generate-") as out:
            export(source, Path(out) / "model", group)
            print(generate(Path(out) / "model", **settings))
    except (ConfigError, CheckpointError) as e:
        print(f"harness.generate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
