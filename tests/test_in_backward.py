"""`optimizer.in_backward=true` with real ranks: each parameter steps inside
backward, bitwise like the normal step, with and without averaging, and its
per-parameter optimizers checkpoint and resume exactly. The in-backward runs
also recompute activations (`model.activation_checkpointing`), with dropout on:
bitwise equal to the normal step keeping them, so checkpointing changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import FAST, REPO, assert_bitwise_equal, check_ok, flat, run_cli, saved_state

LAYOUTS = {
    "2x1": ["launcher.nproc=2", "sharding=no_shard"],
    "2x2": ["launcher.nproc=4", "sharding=hybrid_shard", "sharding.replicate=2", "model=llama", "model.d_model=64"],
}
POST_LOCAL = ["averager=periodic", "averager.period=2", "averager.warmup_steps=3"]  # warmup, local steps, averaging
CASES = {  # SGD and AdamW, with and without averaging, on both layouts (the resume test adds AdamW + averaging on 2x2)
    "2x1": [("sgd", POST_LOCAL)],
    "2x2": [("adamw", ["averager=none"])],
}
RECOMPUTE = {"2x1": "full", "2x2": "selective"}  # activation checkpointing in the in-backward run


def train(run_dir: Path, env: dict, *overrides: str) -> None:
    check_ok(run_cli([*FAST, "train.grad_clip=0", f"hydra.run.dir={run_dir}", *overrides], env, REPO))


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_in_backward_steps_bitwise_like_the_normal_step(layout, tmp_path, cli_env):
    """Parameters and optimizer state after 8 steps: the per-parameter steps in
    backward run the same single-tensor kernels on the same reduced gradients."""
    for optimizer, averaging in CASES[layout]:
        momentum = ["optimizer.momentum=0.9"] if optimizer == "sgd" else []  # so SGD has state to compare too
        schedule = ["lr_scheduler=warmup_cosine", "lr_scheduler.warmup_steps=3"]  # each parameter's optimizer follows
        common = [*LAYOUTS[layout], f"optimizer={optimizer}", *momentum, *averaging, *schedule, "checkpoint=full"]
        common.append("model.dropout=0.1")  # recomputed blocks must draw the same dropout masks
        states = []
        for in_backward, recompute in (("false", "none"), ("true", RECOMPUTE[layout])):
            run = tmp_path / f"{optimizer}-{in_backward}"
            train(
                run,
                cli_env,
                *common,
                f"optimizer.in_backward={in_backward}",
                f"model.activation_checkpointing={recompute}",
            )
            state = saved_state(run / "checkpoints" / "step_8", tmp_path)
            states.append({"model": state["model"], "optim_state": state["optim"]["state"]})
        assert_bitwise_equal(*states)
        assert flat(states[0]["optim_state"]), "the optimizer state was compared"


@pytest.mark.slow
def test_in_backward_resumes_exactly(tmp_path, cli_env):
    """Per-parameter optimizers saved as one FQN-keyed state dict: resumed from the checkpoint at 5
    (between averagings, in full mode) to 8, everything saved at 8 (sharded) equals an uninterrupted run's."""
    schedule = ["lr_scheduler=step", "lr_scheduler.milestones=[2,4]"]  # resumed at 5: past both decays
    common = [*LAYOUTS["2x2"], "optimizer=adamw", "optimizer.in_backward=true", *POST_LOCAL, *schedule]
    train(tmp_path / "a", cli_env, *common, "checkpoint=sharded")
    train(tmp_path / "full", cli_env, *common, "checkpoint=full", "checkpoint.interval=5")
    resume = f"checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step_5'}"
    train(tmp_path / "b", cli_env, *common, resume, "checkpoint=sharded")
    a, b = (saved_state(tmp_path / run / "checkpoints" / "step_8", tmp_path) for run in ("a", "b"))
    assert_bitwise_equal(a, b)
    assert len(a["optim"]["param_groups"]) == len(a["model"])  # one optimizer per parameter, keyed by FQN
