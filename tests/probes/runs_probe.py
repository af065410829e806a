"""Runs of one world size in turn on the same ranks, each a job built and trained with the harness's
own calls (`build_job`, `Trainer`) after the checks a launch makes (`validate`, `preflight`), in a run
dir of its own, resuming where it says (tests/test_clock.py: runs resumed with a changed config, some
with another replica count on the same ranks). The tests compare what they leave on disk.

Usage: python tests/probes/local_ranks.py N tests/probes/runs_probe.py RUNS.json
RUNS.json: [{"dir", "overrides", "slowdown", "resume": null | {"run": DIR, "pick": "middle" | "last" | STEP}}, ...]
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.checkpoint_paths import complete_checkpoints, step_of  # noqa: E402
from harness.config import register_configs  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.job import build_job  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.loop import Trainer  # noqa: E402
from harness.plan import plan_run  # noqa: E402
from harness.preflight import preflight  # noqa: E402
from harness.rng import seed_rank  # noqa: E402
from harness.slowdown import ENV as SLOWDOWN  # noqa: E402
from harness.validate import validate  # noqa: E402


def checkpoint_to_resume(resume: dict | None) -> Path | None:
    """The checkpoint of an earlier run to resume from: its last, the one at a step, or the one nearest its
    middle step."""
    if resume is None:
        return None
    saved = complete_checkpoints(Path(resume["run"]) / "checkpoints")
    if resume["pick"] == "last":
        return saved[-1]
    if isinstance(resume["pick"], int):
        return next(p for p in saved if step_of(p) == resume["pick"])
    last = step_of(saved[-1])
    return min(saved[:-1], key=lambda p: abs(step_of(p) - last // 2))


def train(env, run: dict) -> None:
    """One run: compose, check as a launch does, build the job and train it."""
    os.environ.pop(SLOWDOWN, None)
    if run["slowdown"]:
        os.environ[SLOWDOWN] = run["slowdown"]
    resume, run_dir = checkpoint_to_resume(run["resume"]), Path(run["dir"])
    extra = [f"checkpoint.resume={resume}" if resume is not None else "checkpoint.resume=never"]
    cfg = compose("config", overrides=["wandb.mode=disabled", *run["overrides"], *extra])
    validate(cfg, world_size=env.world_size, gpus=0)
    plan = plan_run(cfg, env.world_size, env.local_world_size, run_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        errors = preflight(cfg, run_dir, plan.resume_from)
        assert not errors, errors
    dist.barrier()
    seed_rank(cfg.train.seed, plan.rank_in_mesh(env.rank))
    job = build_job(cfg, env, plan)
    with Trainer(job, cfg, env, run_dir, plan.resume_from) as trainer:
        trainer.run()
    if env.is_main:
        (run_dir / "resumed_from.json").write_text(json.dumps(None if resume is None else str(resume)))


def main(runs_file: str) -> None:
    register_configs()
    env = init_distributed("cpu", 120, 1)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for run in json.loads(Path(runs_file).read_text()):
            train(env, run)
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now(0)
