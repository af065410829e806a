"""What the GPU path adds, tested where it can be on CPU: the rank start method,
the fused-optimizer choice, the one-reduction gradient clip, a non-finite step
skipped on the device, MFU's FLOP count, the stager shim, per-block compile and
ddp's autocast. tests/test_cuda.py runs the same paths on a GPU when one is
present."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed.checkpoint.staging as staging
from omegaconf import OmegaConf

import harness.compat
from harness.clock import SYNCHRONOUS, Clock
from harness.compat import ReusableStager
from harness.models import build_model
from harness.nonfinite import MAX_UNREPORTED, NonFiniteGuard
from harness.optim import build_optimizer, clip_grad_norm_
from harness.throughput import peak_flops

from support import FAST, OPTIMIZERS, check_ok, losses, read_metrics, run_cli, skipped_step_against_a_run_without_it

CPU = torch.device("cpu")


def adamw(**overrides):
    return OmegaConf.create(
        {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, "fused": None, **overrides}
    )


def test_fused_optimizer_is_the_default_on_cuda_only():
    params = list(torch.nn.Linear(2, 2).parameters())
    assert build_optimizer(adamw(), params, torch.device("cuda")).defaults["fused"] is True
    assert build_optimizer(adamw(), params, CPU).defaults["fused"] is None
    assert build_optimizer(adamw(fused=False), params, torch.device("cuda")).defaults["fused"] is False
    sgd = OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1})  # a YAML without `fused`
    assert build_optimizer(sgd, params, torch.device("cuda")).defaults["fused"] is None


def grads_of(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(7, 3), (5,), (0,), (4, 4)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize("scale,max_norm", [(10.0, 1.0), (0.01, 1.0), (3.0, 0.0)])
def test_clip_grad_norm_matches_torch(scale, max_norm):
    ours, stock = grads_of(0, scale), grads_of(0, scale)
    norm = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(stock, max_norm or math.inf)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, stock):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if max_norm:
        assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])).item() <= max_norm * (1 + 1e-5)


@pytest.mark.parametrize("bad", ["gradient", "loss"], ids=["NaN gradients", "inf loss, finite gradients"])
@pytest.mark.parametrize("bad_step", [1, 3], ids=["first step", "later step"])
@pytest.mark.parametrize("fused", [False, True], ids=["checked on the host", "skipped on the device"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_skipped_step_leaves_every_tensor_as_it_was_and_the_next_is_a_run_without_it(
    name, fused, bad_step, bad, world_of_1
):
    """`train.nonfinite=skip` through the loop's own calls (`NonFiniteGuard.backward`, the norm,
    `check`, the step): the bad step leaves parameters and every optimizer state tensor bit for bit as
    they were (no state at all where it was the first: fused SGD's momentum comes from `empty_like`),
    and the next step equals that of a run that never saw the bad batch. tests/test_cuda.py runs the
    fused cases on a GPU."""
    skipped_step_against_a_run_without_it(name, fused, bad_step, bad, CPU)


def test_no_device_flag_is_overwritten_before_it_is_read(world_of_1):
    """A replica may take more steps between two reports than `train.log_every` (a period of DiLoCo's 16
    under balance=time, where only exchanges report): the flags grow instead of wrapping, so a NaN at any
    of them is reported; and however rarely a run logs, a report falls at least every MAX_UNREPORTED
    steps where the ranks meet (`due`)."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], fused=True)
    guard = NonFiniteGuard("skip", optimizer, CPU, log_every=4, steps_in_backward=False, replica_ranks=None)
    assert guard.flags.numel() == 4
    clock = Clock(SYNCHRONOUS, 3 * MAX_UNREPORTED, 1, 0, True, 1, CPU)
    for step in range(1, 11):
        tick = clock.next()
        guard.check(tick, torch.tensor(1.0), torch.tensor(math.nan if step == 3 else 1.0))
        clock.advance()
    assert guard.flags.numel() >= 10 and guard.report(tick) == {"train/skipped_nonfinite": 1}
    for _ in range(MAX_UNREPORTED - 1):
        tick = clock.next()
        clock.advance()
    assert not guard.due(tick)
    assert guard.due(clock.next())


def test_flops_per_token_counts_every_weight_outside_the_embeddings_and_attention():
    d, layers, vocab, seq = 64, 3, 100, 32
    gpt = build_model(
        OmegaConf.create(
            {"_target_": "harness.models.GPT", "n_layer": layers, "n_head": 4, "d_model": d, "vocab_size": vocab}
        ),
        seq,
    )
    block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d  # attn, mlp, norms
    weights = layers * block + 2 * d + vocab * d  # + final norm + head; embeddings are lookups
    assert gpt.flops_per_token(seq) == 6 * weights + 12 * layers * d * seq
    mlp = build_model(
        OmegaConf.create(
            {"_target_": "harness.models.TokenMLP", "n_layer": 2, "d_model": d, "hidden": 128, "vocab_size": vocab}
        ),
        seq,
    )
    assert mlp.flops_per_token(seq) == 6 * (2 * (2 * d + d * 128 + 128 + 128 * d + d) + 2 * d + vocab * d)


def test_peak_flops_comes_from_config_or_the_gpu_table():
    assert peak_flops(CPU, None) is None
    assert peak_flops(CPU, 123.0) == 123e12


@pytest.mark.parametrize("shim", [False, True], ids=["torch's stage", "shimmed stage"])
def test_one_stager_stages_three_times_into_the_same_buffers(shim, monkeypatch):
    """Three stages through one ReusableStager, as three async saves do: each
    returns a copy of the values at that moment, in buffers reused from the
    first. Without the shim this is torch's own DefaultStager, which fails on
    the second stage on 2.11 and 2.12 (pytorch/pytorch#183413)."""
    needs_shim = harness.compat.STAGE_CLOSES_STAGER
    monkeypatch.setattr(harness.compat, "STAGE_CLOSES_STAGER", shim)
    stager = ReusableStager(
        staging.StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    weight = torch.zeros(4, 3)

    def stage(value: float) -> dict:
        weight.fill_(value)
        return stager.stage({"model": {"weight": weight}, "step": int(value)}).result()

    staged = [stage(1.0)]
    if needs_shim and not shim:
        with pytest.raises(KeyError, match="<class 'type'>"):
            stage(2.0)
        return
    staged += [stage(2.0), stage(3.0)]
    stager.close()
    assert [s["model"]["weight"].unique().tolist() for s in staged[-1:]] == [[3.0]]
    assert [s["step"] for s in staged] == [1, 2, 3]
    assert len({s["model"]["weight"].data_ptr() for s in staged}) == 1, "staging buffers were not reused"
    assert staged[0]["model"]["weight"].data_ptr() != weight.data_ptr()


@pytest.mark.slow
def test_spawned_ranks_train_like_forked_ones(tmp_path, cli_env):
    """`launcher.start_method=spawn` (what auto picks for CUDA ranks) runs the
    same job as fork: fresh interpreters, same losses. No process of the job
    (launcher or rank) goes through interpreter finalization, where a gloo
    thread aborts now and then: a `sitecustomize` on the children's path
    registers the first exit handler, which runs last and only if finalization
    happens, and records the process's argv."""
    finalized = tmp_path / "finalized.txt"
    hook = tmp_path / "site"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import atexit, sys\natexit.register(lambda: open({str(finalized)!r}, 'a').write(repr(sys.argv) + '\\n'))\n"
    )
    env = {**cli_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), cli_env.get("PYTHONPATH")]))}
    runs = {}
    for method in ("fork", "spawn"):
        proc = run_cli([*FAST, f"launcher.start_method={method}", f"hydra.run.dir={method}"], env, tmp_path)
        check_ok(proc)
        assert f"starting 2 local ranks ({method};" in proc.stdout
        runs[method] = losses(tmp_path / method)
    assert runs["spawn"] == runs["fork"]
    lines = finalized.read_text().splitlines() if finalized.exists() else []
    jobs = [line for line in lines if "train.py" in line or "multiprocessing" in line]
    assert jobs == [], f"finalized: {jobs}"


def logged_losses(run_dir, after: int = 0) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r and r["step"] > after]


@pytest.mark.slow
def test_compiled_blocks_with_fused_adamw_averaging_and_three_async_saves(tmp_path, cli_env):
    """`train.compile=true` on post-local SGD (2 replicas) with fused AdamW and an
    async sharded save at steps 2, 4 and 6 through one stager: it follows the
    eager run, and an eager run resumes from the compiled run's checkpoint
    (parameter names do not change under compile) and ends where it ended."""
    common = [
        *FAST,
        "train.steps=6",
        "optimizer=adamw",
        "averager.warmup_steps=2",
        "averager.period=2",
        "checkpoint=sharded",
        "checkpoint.async=true",
        "checkpoint.interval=2",
        "checkpoint.keep=3",
    ]
    compiled = tmp_path / "compiled"
    check_ok(
        run_cli(
            [*common, "train.compile=true", "optimizer.fused=true", f"hydra.run.dir={compiled}"],
            cli_env,
            tmp_path,
            timeout=400,
        )
    )
    eager = tmp_path / "eager"
    check_ok(run_cli([*common, f"hydra.run.dir={eager}"], cli_env, tmp_path))
    assert logged_losses(compiled) == pytest.approx(logged_losses(eager), rel=1e-4)
    assert sorted(p.name for p in (compiled / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    assert [r["step"] for r in read_metrics(compiled) if r.get("averager/averaged")] == [3, 5, 6]  # and the last

    resumed = tmp_path / "resumed"
    check_ok(
        run_cli(
            [
                *common,
                "optimizer.fused=true",
                f"checkpoint.resume={compiled / 'checkpoints' / 'step_4'}",
                f"checkpoint.dir={resumed / 'checkpoints'}",
                f"hydra.run.dir={resumed}",
            ],
            cli_env,
            tmp_path,
        )
    )
    assert logged_losses(resumed, after=4) == pytest.approx(logged_losses(compiled, after=4), rel=1e-4)


@pytest.mark.slow
def test_ddp_computes_in_the_configured_dtype_under_autocast(tmp_path, cli_env):
    """sharding.param_dtype is ddp's autocast dtype (auto = bf16 on CUDA, fp32 on
    CPU): bf16 compute changes the losses a little."""
    runs = {}
    for dtype in ("float32", "bfloat16"):  # auto is float32 on CPU: what every other CPU test runs
        check_ok(
            run_cli(
                [*FAST, "sharding=ddp", f"sharding.param_dtype={dtype}", f"hydra.run.dir={dtype}"], cli_env, tmp_path
            )
        )
        runs[dtype] = losses(tmp_path / dtype)
    assert runs["bfloat16"] != runs["float32"]
    assert runs["bfloat16"] == pytest.approx(runs["float32"], rel=2e-2)


@pytest.mark.slow
def test_profile_writes_a_trace_and_an_op_table_per_rank_for_the_steps_its_schedule_picks(tmp_path, cli_env):
    """train.profile: skip 2 steps, warm up 1, record 2, until the run ends (repeat=0), keeping the newest
    window (keep=1): each of the 2 ranks records windows ending at steps 5 and 10 and leaves the second's
    trace, which Perfetto reads (Chrome trace JSON) and which holds the training steps' ops, and its table."""
    profile = ["train.profile.enabled=true", "train.profile.wait=2", "train.profile.warmup=1"]
    profile += ["train.profile.active=2", "train.profile.repeat=0", "train.profile.keep=1"]
    check_ok(run_cli([*FAST, *profile, "train.steps=12", "hydra.run.dir=run"], cli_env, tmp_path))
    out = tmp_path / "run" / "profile"
    for rank in (0, 1):
        traces = sorted(out.glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, sorted(p.name for p in out.iterdir())
        events = json.loads(traces[0].read_text())["traceEvents"]
        assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 2
        assert any(e.get("name") == "aten::mm" for e in events)
        tables = sorted(p.name for p in out.glob(f"rank{rank}_step*.txt"))
        assert tables == [f"rank{rank}_step10.txt"]
        assert "Self CPU" in (out / tables[0]).read_text()
