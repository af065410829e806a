"""Helpers the tests share: run the real CLI (`python train.py` / `torchrun`) in a temp dir, read its metrics."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
LOCAL_RANKS = REPO / "tests" / "probes" / "local_ranks.py"
# Small and fast, but the real code path: tiny MLP LM, few steps, no W&B unless a test asks.
# Checkpoint tests: the tiny MLP LM, logging every step.
SMALL = ["model=mlp", "train.batch_size=4", "train.seq_len=16", "train.log_every=1"]
FAST = ["model=mlp", "train.steps=8", "train.batch_size=4", "train.seq_len=16", "train.log_every=1"]


def make(*overrides: str):
    """The config `python train.py <overrides>` composes (the schemas registered)."""
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def checkpoint_meta(step: int, replicas: int = 2, **fields) -> dict:
    """A well-formed meta.json of today's format (harness/checkpoint/meta.py) for a checkpoint at `step` of a
    synchronous run of `replicas` one-rank replicas, with `fields` replaced: what a test that fakes a
    checkpoint writes, so that only the field it is about is wrong."""
    from harness.checkpoint.meta import FORMAT

    clock = {"replicas": replicas, "done": step * replicas, "taken": [0] * replicas, "syncs": 0}
    clock |= {"trained": [step] * replicas, "held": [[0] * replicas], "step_times": [None] * replicas}
    clock |= {"first_loss": None, "first_loss_shared": True, "exchange_loss": None, "exchange_time": None}
    meta = {"format": FORMAT, "step": step, "mode": "full", "world_size": replicas, "replica_copies": 1}
    meta |= {"mesh": {"replicate": replicas, "shard": 1}, "clock": clock, "data": {"samples": 0}}
    return {**meta, **fields}


def base_env(tmp_path: Path) -> dict:
    """The caller's environment minus anything that would make a child think it is a torchrun rank."""
    env = dict(os.environ)
    env.update(
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
        WANDB_CACHE_DIR=str(tmp_path / ".wandb_cache"),
        WANDB_CONFIG_DIR=str(tmp_path / ".wandb_config"),
        WANDB_DATA_DIR=str(tmp_path / ".wandb_data"),
        PYTHONUNBUFFERED="1",
        HYDRA_FULL_ERROR="0",
        # torchrun's per-launch log tree (its --log-dir), in the test's folder: its default is a new /tmp/torchelastic_*
        PET_LOG_DIR=str(tmp_path / "torchrun-logs"),
    )
    env.pop("HARNESS_RUN_STAMP", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# Variables the interpreter or an import reads at start: a command whose env sets one of them
# differently from the test process runs in a fresh interpreter, as does every command when
# HARNESS_TEST_FRESH=1 (the suite as a user's shell would run it, about a third slower).
STARTUP_VARS = ("PYTHON", "LD_", "OMP_", "MKL_", "CUDA_", "TORCH_", "NCCL_", "GLOO_")

# The zygote: a process that has imported what train.py imports (torch, Hydra, the harness)
# and forks one child per command, which runs the script as `python script args` would,
# in its own session, cwd, environment, argv and stdout/stderr files. Every command of the
# suite otherwise spends about 3.4 s of its 6 s importing the same modules again (median
# 2.6 s forked against 6.0 s fresh for an 8-step run on 2 ranks, quiet machine).
ZYGOTE = r"""
import os, pickle, runpy, signal, sys, time, traceback
sys.path.insert(0, os.environ["HARNESS_REPO"])
import train  # noqa: F401  its imports, and registering the configs
sys.path.pop(0)
requests, replies = sys.stdin.buffer, sys.stdout.buffer
while True:
    try:
        script, args, env, cwd, out, err, timeout = pickle.load(requests)
    except EOFError:
        break
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.chdir(cwd)
            os.environ.clear(); os.environ.update(env)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    deadline, status = time.monotonic() + timeout, None
    while status is None:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(wait_status)
        elif time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.02)
    pickle.dump(status, replies); replies.flush()
"""
_zygote: subprocess.Popen | None = None


def _run_forked(cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            env={**os.environ, "HARNESS_REPO": str(REPO), "PYTHONUNBUFFERED": "1"},
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    with tempfile.TemporaryDirectory(prefix="harness-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        pickle.dump((cmd[1], cmd[2:], env, str(cwd), str(out), str(err), timeout), _zygote.stdin)
        _zygote.stdin.flush()
        status = pickle.load(_zygote.stdout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if status == "timeout":
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, status, stdout, stderr)


def _needs_fresh_interpreter(env: dict) -> bool:
    if os.environ.get("HARNESS_TEST_FRESH") == "1":
        return True
    keys = {k for k in {*env, *os.environ} if k.startswith(STARTUP_VARS) and k != "PYTHONUNBUFFERED"}
    return any(env.get(k) != os.environ.get(k) for k in keys)


def run_cli(
    args: list[str],
    env: dict,
    cwd: Path,
    *,
    torchrun_nproc: int | None = None,
    script: Path = TRAIN,
    timeout: int = 240,
    fresh: bool = False,
    ranks: int | None = None,
) -> subprocess.CompletedProcess:
    """`python script args` (or under `torchrun`, or as `ranks` ranks of the harness's own
    launcher: tests/probes/local_ranks.py) in `cwd` with `env`. The options are keyword-only: a
    timeout passed in torchrun_nproc's place once started 600 ranks on a one-GPU machine, which ran
    out of host memory and stopped answering. Without torchrun the
    command is forked from the zygote above unless `fresh` (a test of the interpreter's own
    start, e.g. an import that fails) or its environment needs a fresh interpreter."""
    if ranks:
        args, script = [str(ranks), str(script), *args], LOCAL_RANKS
    if torchrun_nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun_nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            str(script),
            *args,
        ]
    else:
        cmd = [sys.executable, str(script), *args]
        if not fresh and not _needs_fresh_interpreter(env):
            return _run_forked(cmd, env, cwd, timeout)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    """The logged losses in step order (a resumed run's first row holds the resume's metrics only)."""
    return [row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    )


def steps_saved(run_dir: Path) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").iterdir()), key=lambda n: (len(n), n))


def saved_state(step_dir: Path, tmp_path: Path) -> dict:
    """Everything the checkpoint holds as one dict, read the way a user would:
    full.pt with torch.load, a DCP directory through PyTorch's own converter,
    and every rank's RNG states (`rng`) from rng.pt."""
    if (step_dir / "full.pt").exists():
        state = torch.load(step_dir / "full.pt", weights_only=True)
    else:
        # the converter behind `python -m torch.distributed.checkpoint.format_utils dcp_to_torch`,
        # called in-process: a subprocess per read cost a torch import (~4 s of CPU) each time
        out = tmp_path / f"{step_dir.parent.parent.name}_{step_dir.name}.pt"
        dcp_to_torch_save(step_dir, out)
        state = torch.load(out, weights_only=False)
    return {**state, "rng": torch.load(step_dir / "rng.pt", weights_only=True)}


def flat(tree, prefix: str = "") -> dict:
    """Leaves of nested dicts and lists by their path (`rng.0.torch`)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for key, value in items:
        if isinstance(value, dict) or (isinstance(value, list) and value and isinstance(value[0], dict)):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _lists(value):
    """Tuples as lists (a resumed optimizer's `betas` come back from disk as a list)."""
    return [_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def assert_bitwise_equal(a: dict, b: dict) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    differ = [
        k for k in fa if not (torch.equal(fa[k], fb[k]) if torch.is_tensor(fa[k]) else _lists(fa[k]) == _lists(fb[k]))
    ]
    assert not differ, f"{len(differ)} entries differ, e.g. {differ[:3]}"


def loss_by_step(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row}


def check_rank_config(cfg, run_dir, plan) -> None:
    """A rank's entrypoint for `start_local_ranks` in tests: the config arrived
    typed (enums, not strings) and in struct mode (a misspelled key raises)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError

    from harness.config import CheckpointMode

    assert OmegaConf.is_struct(cfg), "the rank's config is not in struct mode"
    assert isinstance(cfg.checkpoint.mode, CheckpointMode), f"checkpoint.mode is a {type(cfg.checkpoint.mode)}"
    try:
        cfg.train.stepz  # noqa: B018
    except ConfigAttributeError:
        return
    raise AssertionError("reading the misspelled cfg.train.stepz did not fail")


# the optimizers of conf/optimizer/, as `skipped_step_against_a_run_without_it` builds them
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd momentum": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}),
}


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters and every optimizer state value, copied, by name."""
    state = {f"param {i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for i, values in enumerate(optimizer.state.values()):
        state.update({f"state {i} {k}": v.clone() for k, v in values.items()})
    return state


def skipped_step_against_a_run_without_it(name: str, fused: bool, bad_step: int, bad: str, device) -> None:
    """`train.nonfinite=skip` through the loop's own calls (`NonFiniteGuard.backward`, the norm, `check`,
    the step), for optimizer `name` on `device`: step `bad_step` has NaN gradients or an infinite loss
    (`bad`); it must leave every tensor as it was, and the next step must equal that of a run without it."""
    from harness.clock import SYNCHRONOUS, Clock
    from harness.nonfinite import NonFiniteGuard
    from harness.optim import clip_grad_norm_

    cls, hyper = OPTIMIZERS[name]
    torch.manual_seed(0)
    batches = [torch.randn(6, 4, device=device) for _ in range(4)]

    def train(skip_bad: bool) -> list[dict]:
        """The state before the first step, then after each step taken."""
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 3).to(device)
        optimizer = cls(model.parameters(), lr=0.1, fused=fused or None, **hyper)
        guard = NonFiniteGuard("skip", optimizer, device, log_every=10, steps_in_backward=False, replica_ranks=None)
        assert guard.on_device == fused
        clock = Clock(SYNCHRONOUS, len(batches), 1, 0, True, 1, device)
        states = [snapshot(model, optimizer)]
        for step, x in enumerate(batches, start=1):
            if step == bad_step and skip_bad:
                continue
            tick = clock.next()
            loss = model(x).square().mean()
            if step == bad_step:
                loss = loss * torch.tensor(float("nan"), device=device) if bad == "gradient" else loss + float("inf")
            guard.backward(loss)
            norm = clip_grad_norm_(model.parameters(), 1.0)
            if guard.check(tick, loss, norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.advance()
            states.append(snapshot(model, optimizer))
        if fused and not skip_bad:
            assert guard.report(tick) == {"train/skipped_nonfinite": 1}
        return states

    seen, never = train(skip_bad=False), train(skip_bad=True)
    for got, expected in [(seen[bad_step], seen[bad_step - 1]), (seen[bad_step + 1], never[bad_step])]:
        assert got.keys() == expected.keys()
        differ = [key for key in got if not torch.equal(got[key], expected[key])]
        assert not differ, (name, fused, bad_step, bad, differ)
