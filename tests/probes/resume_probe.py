"""Ranks' entry for tests: SGD (momentum 0, whose optimizer state is empty, and 0.9) resumes bit for
bit in every checkpoint mode, on the layout the overrides name. For each case, run A trains
`train.steps` steps with the harness's own `build_job` + `Trainer`, saving at step
`checkpoint.interval`; run B, a fresh job, resumes from that checkpoint and trains to the same step.
Each rank then compares what it holds of A's and B's model and optimizer state.

Usage: python tests/probes/local_ranks.py N tests/probes/resume_probe.py OUT.json [hydra overrides...]
Writes OUT.json (rank 0): {"<mode> momentum=<m>": [the state keys that differ, on any rank], ...}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint.state_dict import get_state_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.checkpoint import inner_optimizer  # noqa: E402
from harness.config import register_configs  # noqa: E402
from harness.dist import init_distributed, local_view, teardown  # noqa: E402
from harness.job import build_job  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.loop import Trainer  # noqa: E402
from harness.plan import plan_run  # noqa: E402
from harness.rng import seed_rank  # noqa: E402

MODES = {"full": ["checkpoint=full"], "sharded": ["checkpoint=sharded"]}
MODES["async"] = ["checkpoint=sharded", "checkpoint.async=true"]


def state_of(job) -> dict:
    """A copy of what this rank holds of the model and the optimizer, as local tensors and plain values, by key
    (a copy: a run that goes on does not change it)."""
    model, optim = get_state_dict(job.model, inner_optimizer(job.optimizer))
    flat = {f"model.{k}": local_view(v).clone() for k, v in model.items()}
    for fqn, values in optim["state"].items():
        flat.update({f"optim.{fqn}.{k}": local_view(v).clone() if torch.is_tensor(v) else v for k, v in values.items()})
    return flat


def train(cfg, env, run_dir: Path, resume_from: Path | None = None) -> dict:
    run_dir.mkdir(exist_ok=True)
    seed_rank(cfg.train.seed, env.rank)
    job = build_job(cfg, env, plan_run(cfg, env.world_size, env.local_world_size, run_dir))
    with Trainer(job, cfg, env, run_dir, resume_from=resume_from) as trainer:
        trainer.run()
    return state_of(job)


def main(out: str, overrides: list[str]) -> None:
    register_configs()
    root = Path(out).parent
    differ = {}
    env = None
    for mode, checkpoint in MODES.items():
        for momentum in (0.0, 0.9):
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
                cfg = compose(
                    "config",
                    overrides=["wandb.mode=disabled", "optimizer=sgd", f"optimizer.momentum={momentum}"]
                    + checkpoint
                    + overrides,
                )
            env = env or init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
            case = f"{mode} momentum={momentum}"
            a, b = root / f"{mode}_{momentum}_a", root / f"{mode}_{momentum}_b"
            uninterrupted = train(cfg, env, a)
            resumed = train(cfg, env, b, resume_from=a / "checkpoints" / f"step_{cfg.checkpoint.interval}")
            mine = sorted(
                k
                for k in uninterrupted.keys() | resumed.keys()
                if k not in uninterrupted
                or k not in resumed
                or not (
                    torch.equal(uninterrupted[k], resumed[k])
                    if torch.is_tensor(uninterrupted[k])
                    else uninterrupted[k] == resumed[k]
                )
            )
            everyone = [None] * env.world_size
            dist.all_gather_object(everyone, mine)
            differ[case] = sorted({k for keys in everyone for k in keys})
            if momentum:  # the optimizer state is not empty, so the comparison above covers it
                assert any(k.endswith("momentum_buffer") for k in uninterrupted), case
    if env.is_main:
        Path(out).write_text(json.dumps(differ))
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_now(0)  # the output is written; interpreter finalization can abort in gloo (see exit_now)
