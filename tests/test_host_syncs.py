"""The host's side of a step, counted on CPU for what a GPU pays (harness/profiling.py):
a step that does not log reads nothing back from the device (no host sync: the
host can queue the next step while the device runs this one), and at one device
the harness dispatches about the aten ops a plain loop does (each one a kernel
launch or more on a GPU). With a fused optimizer, as on CUDA by default: CPU's
for-loop AdamW reads each parameter's step count on the host."""

from __future__ import annotations

import json

import pytest

from support import REPO, check_ok, run_cli

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "probes" / "dispatch_probe.py"
COMMON = ["optimizer.fused=true", "model.n_layer=2", "model.d_model=64", "train.seq_len=32", "train.batch_size=4"]
COMMON += ["train.steps=6", "train.log_every=6"]  # steps 2-5 do not log
OPS_TARGET = 1.05  # harness / plain loop, one device (issue 37)
# (ranks, overrides, steps that wait for a collective's result: averaging steps read the drift)
LAYOUTS = {
    # a plain module; train.nonfinite=skip keeps the step on the device too
    "one device": (1, ["train.nonfinite=skip"], []),
    "FSDP2": (2, ["sharding=full_shard", "averager=none"], []),
    # one-device replicas, 2 micro-batches a step: warmup step 2 exchanges gradients through their
    # GradientReduction, step 4 is local; averaging after steps 3 and 5
    "one-device replicas": (
        2,
        ["sharding=no_shard", "averager.warmup_steps=2", "averager.period=2", "train.grad_accum=2"],
        [3, 5],
    ),
}
# not sharding=ddp: its reducer (find_unused_parameters, kept for bitwise resume) reads its used-parameter map
# on the host once per parameter and step (29 a step for a 2-layer GPT, docs/gpu.md)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_that_does_not_log_reads_nothing_back_from_the_device(layout, tmp_path, cli_env):
    nproc, overrides, waiting = LAYOUTS[layout]
    out = tmp_path / "counts.json"
    check_ok(run_cli([str(out), *COMMON, *overrides], cli_env, tmp_path, ranks=nproc, script=PROBE))
    counts = json.loads(out.read_text())
    assert counts["steps"] == [2, 3, 4, 5]
    for rank, per_step in enumerate(counts["ranks"]):
        syncs = {step: c["host_syncs"] for step, c in zip(counts["steps"], per_step) if step not in waiting}
        assert set(syncs.values()) == {0}, f"rank {rank}: host syncs by step {syncs}"
        assert all(c["ops"] > 100 for c in per_step), "the counter saw the step"
    if nproc == 1:  # at one device: within 5 % of a plain loop's ops
        harness = counts["ranks"][0][-1]["ops"]
        plain = counts["plain"][-1]["ops"]
        assert harness <= OPS_TARGET * plain, f"harness {harness} aten ops a step, plain loop {plain}"
