"""Ranks' entry for tests: `train.float8` through checkpoints, with the harness's own `build_job` +
`Trainer` (run with HARNESS_TEST_FLOAT8_EMULATE=1 on CPU). For each case (a recipe, checkpoint modes and
overrides), in each of its modes:

  A  float8, trains 4 steps, saving at 2 and 4; what it holds at 2 and at 4
  B  float8, resumes A's step 2, trains to 4: holds what A does at 4 (an exact resume)
  C  train.float8=none, resumes A's step 2: holds what A did at 2 (a float8 checkpoint loads in a
     run without it, same keys, shapes and dtypes); trains to 4, saving at 4
  D  float8, resumes C's step 4 without training: holds what C does at 4 (and back)

Usage: python tests/probes/local_ranks.py N tests/probes/float8_probe.py OUT.json CASE [-- CASE ...]
where CASE is `RECIPE MODE[,MODE...] [hydra overrides...]` (modes: full, sharded, async); the runs of
case i are in OUT.json's folder under `<i>_<mode>_<run>`. Writes OUT.json (rank 0): {"<i> <mode>
<check>": [the state keys that differ, on any rank], "<i> converted": Float8Linear modules in A's
model, "<i> dtypes": of A's parameters and optimizer state}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from resume_probe import MODES, state_of  # noqa: E402  (this folder: the script's own)

from harness.config import register_configs  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.job import build_job  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.loop import Trainer  # noqa: E402
from harness.plan import plan_run  # noqa: E402
from harness.rng import seed_rank  # noqa: E402


def differ(a: dict, b: dict) -> list[str]:
    return sorted(
        k
        for k in a.keys() | b.keys()
        if k not in a
        or k not in b
        or not (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k])
        or (torch.is_tensor(a[k]) and (a[k].dtype, a[k].shape) != (b[k].dtype, b[k].shape))
    )


def trainer(cfg, env, run_dir: Path, resume_from: Path | None = None) -> tuple:
    run_dir.mkdir(exist_ok=True)
    seed_rank(cfg.train.seed, env.rank)
    job = build_job(cfg, env, plan_run(cfg, env.world_size, env.local_world_size, run_dir))
    return job, Trainer(job, cfg, env, run_dir, resume_from=resume_from)


def main(out: str, cases: list[list[str]]) -> None:
    register_configs()
    root, report, env = Path(out).parent, {}, None
    for case, (recipe, modes, *overrides) in enumerate(cases):
        for mode in modes.split(","):

            def config(float8: str, mode: str = mode, overrides: list[str] = overrides):
                with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
                    return compose(
                        "config",
                        overrides=["wandb.mode=disabled", f"train.float8={float8}", "train.steps=4"]
                        + ["checkpoint.interval=2", *MODES[mode], *overrides],
                    )

            float8, plain = config(recipe), config("none")
            env = env or init_distributed(float8.train.device, float8.dist.timeout_s, float8.dist.threads_per_rank)
            a, b, c, d = (root / f"{case}_{mode}_{run}" for run in "abcd")
            job, run = trainer(float8, env, a)
            with run:
                run.run(until=2)
                a2 = state_of(job)
                run.run()
            a4 = state_of(job)
            report[f"{case} converted"] = sum(type(m).__name__ == "Float8Linear" for m in job.model.modules())
            report[f"{case} dtypes"] = sorted({str(v.dtype) for v in a4.values() if torch.is_tensor(v)})
            job, run = trainer(float8, env, b, resume_from=a / "checkpoints" / "step_2")
            with run:
                run.run()
            checks = {"float8 resumes exactly": differ(a4, state_of(job))}
            job, run = trainer(plain, env, c, resume_from=a / "checkpoints" / "step_2")
            with run:
                checks["float8 checkpoint loads without float8"] = differ(a2, state_of(job))
                run.run()
            c4 = state_of(job)
            job, run = trainer(float8, env, d, resume_from=c / "checkpoints" / "step_4")
            with run:
                checks["checkpoint without float8 loads with float8"] = differ(c4, state_of(job))
            for check, keys in checks.items():
                everyone = [None] * env.world_size
                dist.all_gather_object(everyone, keys)
                report[f"{case} {mode} {check}"] = sorted({k for rank_keys in everyone for k in rank_keys})
    if env.is_main:
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    teardown()


def split_cases(args: list[str]) -> list[list[str]]:
    cases = [[]]
    for arg in args:
        if arg == "--":
            cases.append([])
        else:
            cases[-1].append(arg)
    return cases


if __name__ == "__main__":
    main(sys.argv[1], split_cases(sys.argv[2:]))
    exit_now(0)  # the output is written; interpreter finalization can abort in gloo (see exit_now)
