"""Sample text from a trained model:

    python -m harness.generate <run dir, checkpoint dir or export dir> prompt="..." [key=value ...]

A run (or one of its checkpoints) is exported first (`harness.export`, into a
temporary directory), then transformers' `generate` continues the prompt with
the exported model and tokenizer, exactly as a user of the export would:
greedy with `temperature=0` (the default), else sampled with `temperature` and
`top_p` from `seed`. Prints the prompt and its continuation.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness.checkpoint import CheckpointError
from harness.config import ConfigError

# the keys, their types and defaults
KEYS = {"prompt": (str, None), "max_new_tokens": (int, 64), "temperature": (float, 0.0), "top_p": (float, 1.0)}
KEYS["seed"] = (int, 0)


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
            raise ConfigError(f"{key}={value!r} is not a {kind}. Fix: e.g. {key}={KEYS[key][1]}.") from None
    if values["prompt"] is None:
        raise ConfigError('no prompt. Fix: prompt="def main(" (in quotes when it has spaces).')
    if values["max_new_tokens"] < 1 or values["temperature"] < 0 or not 0 < values["top_p"] <= 1:
        raise ConfigError(
            f"max_new_tokens={values['max_new_tokens']}, temperature={values['temperature']}, top_p={values['top_p']}: "
            "max_new_tokens must be >= 1, temperature >= 0 (0 is greedy), top_p in (0, 1]. "
            "Fix: e.g. max_new_tokens=64 temperature=0.8 top_p=0.95."
        )
    return values


def generate(model_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> str:
    """The prompt and its continuation by the Hugging Face model in `model_dir` (an export)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"{str(model_dir)!r} has no tokenizer: the run trained on tokens without a tokenizer file (synthetic "
            "data, byte-level text). Fix: train on data=tokens prepared by harness.prepare, which keeps its tokenizer."
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
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
            print(generate(source, **settings))
            return 0
        from harness.export import export

        with tempfile.TemporaryDirectory(prefix="harness-generate-") as out:
            export(source, Path(out) / "model")
            print(generate(Path(out) / "model", **settings))
    except (ConfigError, CheckpointError) as e:
        print(f"harness.generate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
