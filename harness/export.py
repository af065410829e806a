"""Write a harness checkpoint as a Hugging Face checkpoint:

    python -m harness.export <run dir, checkpoints dir or step_<N> dir> <out dir>

`out` gets safetensors (DCP's Hugging Face storage writer) and the config.json
that `transformers.AutoModelForCausalLM.from_pretrained` loads, for models with
Hugging Face's layout (`model=gpt` as GPT-2's `GPT2LMHeadModel`, `model=llama`,
`model=hf`). The checkpoint is read the
way a resume on one process reads it (harness.checkpoint.load), so `full` and
`sharded` checkpoints both export; replicas that had diverged (post-local SGD,
DiLoCo) export as their mean, and the command says so. A fault-tolerant run's
replica groups export as the mean of their checkpoints at their newest common
step (`--group <r>`: one group's newest). The tokenizer the run
trained with (`data.path`'s, else `model.init_from`'s) is written next to the
weights, with its special tokens' ids in config.json and generation_config.json.
`export.json` records the source checkpoint, its step, the replicas averaged
and the tokenizer's origin.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from harness.checkpoint import CheckpointError, checkpoint_dir, complete_checkpoints, load
from harness.checkpoint.files import read_meta, saved_model_config
from harness.checkpoint_paths import group_checkpoints, groups_at_one_step, step_of
from harness.config import ConfigError, SyntheticDataConf
from harness.dist import init_distributed, teardown
from harness.job import build_job
from harness.models.hf_weights import save_hf_weights
from harness.plan import RunPlan


def find_checkpoints(source: Path, group: int | None = None) -> list[Path]:
    """The checkpoint(s) `source` names: a step_<N> dir, or the newest complete one under a
    checkpoints dir or a run dir (its checkpoint.dir from .hydra/config.yaml). A run with replica
    groups (fault_tolerance=torchft): each group's checkpoint at their newest common complete step
    (to be averaged), or `group`'s newest alone."""
    if not source.exists():
        raise ConfigError(
            f"{str(source)!r} does not exist. Fix: pass a run directory (outputs/<date>/<time>), its checkpoints "
            "directory, or one step_<N> directory."
        )
    if (source / "meta.json").is_file():
        return [source]
    run_config = source / ".hydra" / "config.yaml"
    checkpoint = OmegaConf.load(run_config).checkpoint if run_config.is_file() else OmegaConf.create({"dir": None})
    groups = {r: done for r, done in group_checkpoints(checkpoint, source).items() if done}
    if group is not None:
        if group not in groups:
            raise ConfigError(
                f"{str(source)!r} has no replica group {group} with a complete checkpoint (groups with one: "
                f"{sorted(groups) or 'none'}). Fix: name one of them, or leave the group out for their mean."
            )
        return [groups[group][-1]]
    if groups:
        found = groups_at_one_step(checkpoint, source)
        if len(found) < len(groups):  # no step in common
            newest = ", ".join(f"group {r}: step {step_of(done[-1])}" for r, done in groups.items())
            raise ConfigError(
                f"{str(source)!r}: its replica groups saved no step in common ({newest}), so there is no one model "
                "to take. Fix: name a group (export: --group <r>; generate: group=<r>)."
            )
        return found
    for root in [checkpoint_dir(checkpoint, source), source]:
        if done := complete_checkpoints(root):
            return [done[-1]]
    raise ConfigError(
        f"{str(source)!r} holds no complete harness checkpoint (a step_<N> directory with a meta.json). "
        "Fix: pass a run directory whose run saved checkpoints (checkpoint.mode=full or sharded), its "
        "checkpoints directory, or one step_<N> directory."
    )


def tokenizer_dir(cfg) -> tuple[Path | None, str]:
    """Where the run's tokenizer is (a directory holding tokenizer.json: `data.path`'s dataset, the
    first of `data.sources`, else `model.init_from`'s directory), and what it is, for the log."""
    data, init_from = cfg.data, cfg.model.get("init_from")
    candidates = []
    if data.get("path"):
        candidates.append((data.path, f"the dataset's (data.path={data.path})"))
    if data.get("sources"):
        path = data.sources[0]["path"]
        candidates.append((path, f"the first source's (data.sources[0].path={path})"))
    if init_from:
        candidates.append((init_from, f"the initial model's (model.init_from={init_from})"))
    for path, what in candidates:
        if (Path(path).expanduser() / "tokenizer.json").is_file():
            return Path(path).expanduser(), what
    return None, f"the run trained on {data._target_.rsplit('.', 1)[-1]} without a tokenizer file"


def run_tokenizer(checkpoint: Path) -> tuple[Path | None, str]:
    """`tokenizer_dir` of the run that saved `checkpoint` (its config in meta.json)."""
    return tokenizer_dir(OmegaConf.create(read_meta(checkpoint)["config"]))


def tokenizer_files(source: Path, vocab_size: int) -> tuple[dict, dict]:
    """The tokenizer files to write (name -> bytes) from `source`, and its special tokens' ids
    (bos_token_id, eos_token_id) for config.json and generation_config.json. Without a
    tokenizer_config.json (a BPE harness.prepare trained), one naming the end-of-text token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    files = {"tokenizer.json": (source / "tokenizer.json").read_bytes()}
    if (source / "tokenizer_config.json").is_file():
        config = json.loads((source / "tokenizer_config.json").read_text())
    else:
        index = json.loads((source / "index.json").read_text()) if (source / "index.json").is_file() else {}
        eot = tokenizer.id_to_token(index["eot_id"]) if "eot_id" in index else None
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot}
    files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()

    def token_id(name: str) -> int | None:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        found = tokenizer.token_to_id(token) if token else None
        return found if found is not None and found < vocab_size else None

    return files, {"bos_token_id": token_id("bos_token"), "eos_token_id": token_id("eos_token")}


def export(source: Path, out: Path, group: int | None = None) -> dict:
    """Export the checkpoint `source` names to `out` (the mean of a run's replica groups, or
    `group`'s, `find_checkpoints`); returns what export.json records."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the output {str(out)!r} is a file, not a directory. Fix: name a new or empty directory.")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"the output directory {str(out)!r} is not empty. Fix: name a new or empty directory.")
    existing = next(p for p in out.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"the output {str(out)!r} cannot be created: {str(existing)!r} is a file, not a directory. "
            "Fix: name a new or empty directory elsewhere."
        )
    paths = find_checkpoints(source, group)
    with reading(paths):
        return _export(paths, out)


@contextmanager
def reading(paths: list[Path]):
    """A checkpoint of `paths` that cannot be read, said for an export (or generate): the loader's own
    words are a resume's, naming checkpoint.resume, which neither takes."""
    try:
        yield
    except CheckpointError as e:
        if e.problem is None:
            raise
        fix = (
            "Fix: export a replica group whose checkpoint loads, alone (export: --group <r>; generate: group=<r>), "
            "or pass an earlier step_<N> directory."
            if len(paths) > 1
            else "Fix: pass an earlier step_<N> directory of the run (in its checkpoints directory)."
        )
        raise ConfigError(f"checkpoint {str(e.path)!r}: {e.problem}. {fix}") from None


def _export(paths: list[Path], out: Path) -> dict:
    """`export` of the checkpoint(s) `find_checkpoints` found."""
    path = paths[0]
    meta = read_meta(path)
    cfg = OmegaConf.create(meta["config"])
    cfg.model = saved_model_config(meta["config"]["model"])  # as saved: keys added since at the values it had
    # One process on CPU reads the checkpoint as a resume on another layout does.
    # The data source does not matter (only its position is restored), so it is
    # synthetic: the run's corpus need not be at hand.
    cfg.sharding.strategy, cfg.sharding.replicate, cfg.sharding.param_dtype = "no_shard", None, "float32"
    cfg.data = OmegaConf.structured(SyntheticDataConf)
    cfg.train.device, cfg.train.compile = "cpu", False
    cfg.model.activation_checkpointing, cfg.model.init_from = "none", None
    cfg.train.float8 = "none"  # a float8 run's weights are plain parameters: read into the plain model
    env = init_distributed("cpu", cfg.dist.timeout_s, None)
    try:
        job = build_job(cfg, env, RunPlan(1, 1, 1, averaging=False, resume_from=path))
        if not hasattr(job.model, "hf_config"):
            raise ConfigError(
                f"checkpoint {str(path)!r} holds model {cfg.model._target_}, which has no Hugging Face layout. "
                "Fix: export runs of model=gpt, model=llama or model=hf."
            )
        # the loader speaks to a resumed run ("this run has 1 rank: RNG states not restored"); the
        # export says itself what it wrote (the mean of diverged replicas)
        logging.getLogger("harness.checkpoint").setLevel(logging.ERROR)
        loaded = load(path, job, rank=0, others=tuple(paths[1:]))  # replica groups: the mean of their models
        record = {"checkpoint": str(path.resolve()), "step": meta["step"], "replicas_averaged": loaded.models}
        if len(paths) > 1:
            record.update(checkpoint=[str(p.resolve()) for p in paths], replica_groups=len(paths))
        where, what = run_tokenizer(path)  # the run's own data and init_from, not the stand-ins above
        notes, config = {"export.json": record}, job.model.hf_config()
        if where is not None:
            files, special = tokenizer_files(where, cfg.model.vocab_size)
            notes.update(files)
            config.update(special)
            notes["generation_config.json"] = {**special, "pad_token_id": special["eos_token_id"]}
            record["tokenizer"] = f"{what}: {where}"
        else:
            record["tokenizer"] = None
            record["no_tokenizer"] = what
        save_hf_weights(job.model, out, notes={"config.json": config, **notes})
    finally:
        teardown()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a run directory, its checkpoints directory, or a step_<N> directory")
    parser.add_argument("out", type=Path, help="the Hugging Face checkpoint directory to write (new or empty)")
    parser.add_argument(
        "--group", type=int, default=None, help="a fault-tolerant run: this replica group's model, not their mean"
    )
    args = parser.parse_args(argv)
    if given := [str(a) for a in (args.source, args.out) if str(a).startswith(("source=", "out="))]:
        parser.error(f"{' '.join(given)}: export takes two paths, not key=value overrides (it has no Hydra config)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        record = export(args.source, args.out, args.group)
    except (ConfigError, CheckpointError) as e:
        print(f"harness.export: {e}", file=sys.stderr)
        return 2
    averaged, groups = record["replicas_averaged"], record.get("replica_groups")
    kind = "replica groups" if groups else "replicas"
    what = f"the mean of {averaged} diverged {kind}" if averaged > 1 else "the model"
    where = f"its {groups} replica groups' checkpoints" if groups else record["checkpoint"]
    print(f"exported {what} at step {record['step']} of {where} to {args.out}")
    if record["tokenizer"]:
        print(f"with the tokenizer the run trained with, {record['tokenizer']}")
    else:
        print(
            f"without a tokenizer: {record['no_tokenizer']} (synthetic or byte-level tokens); "
            "AutoTokenizer.from_pretrained cannot load this directory"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
