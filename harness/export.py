"""Write a harness checkpoint as a Hugging Face checkpoint:

    python -m harness.export <run dir, checkpoints dir or step_<N> dir> <out dir>

`out` gets safetensors (DCP's Hugging Face storage writer) and the config.json
that `transformers.AutoModelForCausalLM.from_pretrained` loads, for models with
Hugging Face's layout (`model=llama`, `model=hf`). The checkpoint is read the
way a resume on one process reads it (harness.checkpoint.load), so `full` and
`sharded` checkpoints both export; replicas that had diverged (post-local SGD,
DiLoCo) export as their mean, and the command says so. `export.json` next to
the weights records the source checkpoint, its step and the replicas averaged.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from harness.checkpoint import CheckpointError, checkpoint_dir, complete_checkpoints, load
from harness.checkpoint.files import read_meta
from harness.config import ConfigError, SyntheticDataConf
from harness.dist import init_distributed, teardown
from harness.job import build_job
from harness.models.hf_weights import save_hf_weights
from harness.plan import RunPlan


def find_checkpoint(source: Path) -> Path:
    """The checkpoint `source` names: a step_<N> dir, or the newest complete one under a
    checkpoints dir or a run dir (its checkpoint.dir from .hydra/config.yaml)."""
    if (source / "meta.json").is_file():
        return source
    roots = [source]
    run_config = source / ".hydra" / "config.yaml"
    if run_config.is_file():
        roots.insert(0, checkpoint_dir(OmegaConf.load(run_config).checkpoint, source))
    for root in roots:
        if done := complete_checkpoints(root):
            return done[-1]
    raise ConfigError(
        f"{str(source)!r} holds no complete harness checkpoint (a step_<N> directory with a meta.json). "
        "Fix: pass a run directory whose run saved checkpoints (checkpoint.mode=full or sharded), its "
        "checkpoints directory, or one step_<N> directory."
    )


def export(source: Path, out: Path) -> dict:
    """Export the checkpoint `source` names to `out`; returns what export.json records."""
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
    path = find_checkpoint(source)
    meta = read_meta(path)
    cfg = OmegaConf.create(meta["config"])
    # One process on CPU reads the checkpoint as a resume on another layout does.
    # The data source does not matter (only its position is restored), so it is
    # synthetic: the run's corpus need not be at hand.
    cfg.sharding.strategy, cfg.sharding.replicate, cfg.sharding.param_dtype = "no_shard", None, "float32"
    cfg.data = OmegaConf.structured(SyntheticDataConf)
    cfg.train.device, cfg.train.compile = "cpu", False
    cfg.model.activation_checkpointing, cfg.model.init_from = "none", None
    env = init_distributed("cpu", cfg.dist.timeout_s, None)
    try:
        job = build_job(cfg, env, RunPlan(1, 1, 1, averaging=False, resume_from=path))
        if not hasattr(job.model, "hf_names"):
            raise ConfigError(
                f"checkpoint {str(path)!r} holds model {cfg.model._target_}, which has no Hugging Face layout. "
                "Fix: export runs of model=llama or model=hf."
            )
        # the loader speaks to a resumed run ("this run has 1 rank: RNG states not restored"); the
        # export says itself what it wrote (the mean of diverged replicas)
        logging.getLogger("harness.checkpoint").setLevel(logging.ERROR)
        load(path, job, rank=0)
        record = {"checkpoint": str(path.resolve()), "step": meta["step"], "replicas_averaged": meta["replica_copies"]}
        save_hf_weights(job.model, out, notes={"export.json": record})
    finally:
        teardown()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a run directory, its checkpoints directory, or a step_<N> directory")
    parser.add_argument("out", type=Path, help="the Hugging Face checkpoint directory to write (new or empty)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        record = export(args.source, args.out)
    except (ConfigError, CheckpointError) as e:
        print(f"harness.export: {e}", file=sys.stderr)
        return 2
    averaged = record["replicas_averaged"]
    what = f"the mean of {averaged} diverged replicas" if averaged > 1 else "the model"
    print(f"exported {what} at step {record['step']} of {record['checkpoint']} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
