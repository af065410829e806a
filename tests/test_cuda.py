"""The GPU path on a real GPU: self-launch, consecutive async saves and resume,
per-block compile, ddp in bf16, a skipped fused step, a one-GPU replica's
gradient buckets on NCCL. Skipped without CUDA (CI has none); run them on
a GPU machine with `python -m pytest -m gpu`."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
import torch.distributed as dist

from support import (
    FAST,
    OPTIMIZERS,
    REPO,
    check_ok,
    losses,
    read_metrics,
    run_cli,
    skipped_step_against_a_run_without_it,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ONE_REPLICA = ["train.device=cuda", "averager=none", "sharding=full_shard"]  # FSDP2 from 2 GPUs, else one device


def gpus() -> int:
    return torch.cuda.device_count()


def test_python_train_py_starts_one_rank_per_gpu(tmp_path, cli_env):
    """launcher.nproc=null: as many ranks as GPUs, spawned when more than one."""
    proc = run_cli([*FAST, *ONE_REPLICA, "hydra.run.dir=run"], cli_env, tmp_path)
    check_ok(proc)
    assert f"world {gpus()}," in proc.stdout and "device cuda" in proc.stdout
    if gpus() > 1:
        assert f"starting {gpus()} local ranks (spawn;" in proc.stdout
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert all(r["memory/cuda_max_allocated_gb"] > 0 for r in rows if "train/loss" in r)


def test_sweep_jobs_spawn_their_cuda_ranks(tmp_path, cli_env):
    """Each job of `-m` starts its ranks from the sweep process, which never
    initialises CUDA; two jobs in a row both train."""
    proc = run_cli(["-m", *FAST, *ONE_REPLICA, "train.seed=0,1", "hydra.sweep.dir=sweep"], cli_env, tmp_path)
    check_ok(proc)
    assert proc.stdout.count("(spawn;") == 2
    for job in ("0", "1"):
        assert json.loads((tmp_path / "sweep" / job / "result.json").read_text())["status"] == "completed"


def test_three_async_saves_on_cuda_and_resume(tmp_path, cli_env):
    """Async sharded saves at steps 2, 4 and 6 through one stager (pinned host
    buffers), then a resume from step 4 that follows the uninterrupted run.
    Compared with a tolerance: CUDA's embedding backward accumulates with
    atomics, so two uninterrupted runs differ in the last bits too."""
    common = [
        *FAST,
        *ONE_REPLICA,
        "train.steps=6",
        "checkpoint=sharded",
        "checkpoint.async=true",
        "checkpoint.interval=2",
        "checkpoint.keep=3",
    ]
    a = tmp_path / "a"
    check_ok(run_cli([*common, f"hydra.run.dir={a}"], cli_env, tmp_path))
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    b = tmp_path / "b"
    check_ok(
        run_cli(
            [
                *common,
                f"checkpoint.resume={a / 'checkpoints' / 'step_4'}",
                f"checkpoint.dir={b / 'checkpoints'}",
                f"hydra.run.dir={b}",
            ],
            cli_env,
            tmp_path,
        )
    )
    assert losses(b)[-2:] == pytest.approx(losses(a)[-2:], rel=1e-3)


@pytest.mark.parametrize("layout", [["launcher.nproc=1"], ["sharding=full_shard"]], ids=["one device", "FSDP2"])
def test_compiled_runs_follow_the_eager_run_and_report_mfu(layout, tmp_path, cli_env):
    """train.compile=true (one device: the whole model and its loss; FSDP2, with 2+ GPUs: per block and
    the output loss) trains what the eager run trains: in fp32 compute, the same losses to rounding."""
    if "sharding=full_shard" in layout and gpus() < 2:
        pytest.skip("FSDP2 shards over 2 GPUs")
    common = [*FAST, "train.device=cuda", "averager=none", "model=gpt", "sharding.param_dtype=float32", *layout]
    runs = {}
    for compiled in ("true", "false"):
        proc = run_cli(
            [*common, f"train.compile={compiled}", f"hydra.run.dir={compiled}"], cli_env, tmp_path, timeout=600
        )
        check_ok(proc)
        runs[compiled] = [r for r in read_metrics(tmp_path / compiled) if "train/loss" in r]
    assert [r["train/loss"] for r in runs["true"]] == pytest.approx([r["train/loss"] for r in runs["false"]], rel=1e-3)
    if any(name in torch.cuda.get_device_name() for name in ("H100", "H200", "A100")):
        assert 0 < runs["true"][-1]["train/mfu"] < 1


def test_ddp_trains_in_bf16_on_cuda(tmp_path, cli_env):
    """sharding=ddp autocasts to bf16 by default on CUDA (sharding.param_dtype=auto)."""
    runs = {}
    for dtype in ("auto", "float32"):
        check_ok(
            run_cli(
                [
                    *FAST,
                    "train.device=cuda",
                    "sharding=ddp",
                    "averager=none",
                    "launcher.nproc=1",
                    f"sharding.param_dtype={dtype}",
                    f"hydra.run.dir={dtype}",
                ],
                cli_env,
                tmp_path,
            )
        )
        runs[dtype] = losses(tmp_path / dtype)
    assert runs["auto"] != runs["float32"]
    assert runs["auto"] == pytest.approx(runs["float32"], rel=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DiLoCo needs 2 replicas: 2 GPUs")
def test_diloco_outer_state_in_host_memory(tmp_path, cli_env):
    """averager.outer_device=cpu frees the outer parameters and momentum from
    the GPU (2 fp32 copies of the parameters) and trains the same; a resume from
    its checkpoint brings the host copy back."""
    common = [
        *FAST,
        "model.d_model=512",
        "model.hidden=2048",
        "train.device=cuda",
        "launcher.nproc=2",
        "sharding=no_shard",
        "averager=diloco",
        "averager.period=2",
        "averager.warmup_steps=2",
        "checkpoint=sharded",
        "checkpoint.interval=4",
    ]
    peak = {}
    for where in ("device", "cpu"):
        check_ok(run_cli([*common, f"averager.outer_device={where}", f"hydra.run.dir={where}"], cli_env, tmp_path))
        peak[where] = max(
            r["memory/cuda_max_allocated_gb"] for r in read_metrics(tmp_path / where) if "train/loss" in r
        )
    params_gb = 2 * 512 * (256 + 2 * 2 * 2048 + 256) * 4 / 2**30  # a rough lower bound: the MLP's weights
    assert peak["device"] - peak["cpu"] > params_gb
    torch.testing.assert_close(losses(tmp_path / "cpu"), losses(tmp_path / "device"), rtol=1e-4, atol=1e-5)
    resumed = [*common, "averager.outer_device=cpu", "checkpoint.resume=cpu/checkpoints/step_4", "hydra.run.dir=more"]
    check_ok(run_cli(resumed, cli_env, tmp_path))
    torch.testing.assert_close(losses(tmp_path / "more"), losses(tmp_path / "cpu")[4:], rtol=1e-4, atol=1e-5)


def test_a_step_that_does_not_log_reads_nothing_back_from_the_gpu(tmp_path, cli_env):
    """tests/test_host_syncs.py on the GPU: bf16 autocast, the fused AdamW CUDA defaults to, one device."""
    out = tmp_path / "counts.json"
    probe = REPO / "tests" / "probes" / "dispatch_probe.py"
    args = [str(out), "train.device=cuda", "model.n_layer=2", "train.steps=9", "train.log_every=10"]
    check_ok(run_cli(args, cli_env, tmp_path, torchrun_nproc=1, script=probe))
    counts = json.loads(out.read_text())
    assert [c["host_syncs"] for c in counts["ranks"][0]] == [0] * len(counts["steps"])


def test_a_skipped_fused_step_on_the_gpu_leaves_every_tensor_as_it_was(world_of_1):
    """tests/test_gpu_path.py's skipped step with the fused CUDA kernels: fused SGD's first step allocates
    its momentum with `empty_like` on the device, where the memory holds whatever it held."""
    for name, bad_step, bad in itertools.product(OPTIMIZERS, (1, 3), ("gradient", "loss")):
        skipped_step_against_a_run_without_it(name, True, bad_step, bad, torch.device("cuda"))


def test_a_one_gpu_replicas_gradient_buckets_go_through_nccl_and_come_back():
    """GradientReduction on CUDA with a real NCCL all-reduce (a world of one): each bucket is copied in on
    the stream backward ran on, all-reduced on NCCL's, and waited for by the stream that copies it back,
    so every gradient comes back as autograd's in reduce_dtype, bit for bit, on every step."""
    from harness.averaging import CrossReplicaTraffic, GradientReduction
    from harness.averaging.hooks import reduce_over_replicas
    from harness.averaging.link import MeshLink

    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).to(device)
        reference = copy.deepcopy(model)
        reduction = GradientReduction(model, torch.bfloat16, bucket_bytes=2**20)  # 2 layers a bucket
        reduce_over_replicas(model, reduction, MeshLink(dist.group.WORLD), CrossReplicaTraffic())
        for _ in range(3):
            inputs = torch.randn(64, 512, device=device)
            for m in (model, reference):
                m.zero_grad(set_to_none=True)
                m(inputs).square().mean().backward()
            for mine, theirs in zip(model.parameters(), reference.parameters()):
                assert torch.equal(mine.grad, theirs.grad.bfloat16().float())
    finally:
        dist.destroy_process_group()
