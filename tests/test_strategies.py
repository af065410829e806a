"""Every sharding strategy trains on real ranks (gloo) and matches a single process.

The data slicing makes the union of the ranks' batches at a step equal to a
single process's batch of world*B samples, so with synchronous training
(`averager=none`) every layout must follow the single-process loss curve up to
fp32 reduction order.
"""

from __future__ import annotations

import pytest

from support import FAST, base_env, check_ok, losses, run_cli

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 8
ANY_MODEL = [o for o in FAST if not o.startswith("model=")]
MLP = ("model=mlp",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process (launcher.nproc=1), global batch, synchronous: the losses of each
    model's run, run once per model."""
    runs = {}

    def losses_of(model: tuple[str, ...]) -> list[float]:
        if model not in runs:
            tmp = tmp_path_factory.mktemp("reference")
            args = [*ANY_MODEL, *model, "launcher.nproc=1", "averager=none", "sharding=full_shard"]
            args += [f"train.batch_size={GLOBAL_BATCH}", f"hydra.run.dir={tmp / 'run'}"]
            check_ok(run_cli(args, base_env(tmp), tmp))
            runs[model] = losses(tmp / "run")
        return runs[model]

    return losses_of


# (strategy, ranks, replicas, micro-batches per step, model): with gradient accumulation the K
# micro-batches of each rank hold what one batch of K·B would, and only the last reduces gradients
# (FSDP2's set_requires_gradient_sync, DDP's no_sync); the Llama, sharded, with its table tied;
# a transformers model
LAYOUTS = [
    ("full_shard", 2, None, 1, MLP),
    ("shard_grad_op", 2, None, 1, MLP),
    ("hybrid_shard", 2, 2, 1, MLP),
    ("hybrid_shard_zero2", 2, 2, 1, MLP),
    ("no_shard", 2, None, 1, MLP),
    ("ddp", 2, None, 1, MLP),
    ("ddp", 2, None, 4, MLP),
    ("hybrid_shard", 4, 2, 2, MLP),
    ("full_shard", 2, None, 1, ("model=llama", "model.tie_embeddings=true")),
    ("hybrid_shard", 2, 2, 1, ("model=hf",)),  # transformers' LlamaForCausalLM, its decoder layers as blocks
]


@pytest.mark.parametrize(
    "strategy,nproc,replicate,accum,model",
    LAYOUTS,
    ids=[f"{s}@{n}" + (f"x{k}" if k > 1 else "") + ("" if m == MLP else f"-{m[0][6:]}") for s, n, _, k, m in LAYOUTS],
)
def test_strategy_trains_and_matches_single_process(strategy, nproc, replicate, accum, model, reference, tmp_path):
    reference = reference(model)
    run_dir = tmp_path / "run"
    args = [
        *ANY_MODEL,
        *model,
        f"launcher.nproc={nproc}",
        "averager=none",
        f"sharding={strategy}",
        f"train.batch_size={GLOBAL_BATCH // nproc // accum}",
        f"train.grad_accum={accum}",
        f"hydra.run.dir={run_dir}",
    ]
    if replicate:
        args.append(f"sharding.replicate={replicate}")
    proc = run_cli(args, base_env(tmp_path), tmp_path)
    check_ok(proc)
    got = losses(run_dir)
    assert len(got) == len(reference) == 8
    assert got[-1] < got[0] - 0.5, f"loss did not fall: {got}"
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-6), f"{strategy}@{nproc} diverged from 1 process"
    assert f"'replicate': {replicate or (nproc if strategy in ('no_shard', 'ddp') else 1)}" in proc.stdout
