"""`train.float8` (harness/float8.py) on the CPU, through torchao's emulated float8
(HARNESS_TEST_FLOAT8_EMULATE=1): which linears convert and what the converted model
computes, the refusals, and (2 ranks) checkpoints in every mode with averaging."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness import float8
from harness.config import register_configs
from harness.export import export
from harness.models import build_model, materialize
from harness.validate import config_warnings

from support import FAST, REPO, SMALL, check_ok, read_metrics, run_cli

register_configs()

LLAMA = {"_target_": "harness.models.Llama", "n_layer": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2}
GPT = {"_target_": "harness.models.GPT", "n_layer": 2, "n_head": 4, "d_model": 64}
SEQ = 32


@pytest.fixture(autouse=True)
def inductor_settings_restored():
    """rowwise sets inductor's emulate_precision_casts for the process (torchtitan's workaround): not for
    the tests that run after these in the same worker. Through torch's own `patch` (pytest 9.2's
    monkeypatch deletes an attribute of a module with `__getattr__` on undo, and a deleted torch config
    entry then raises on every read)."""
    config = torch._inductor.config
    with config.patch(emulate_precision_casts=config.emulate_precision_casts):
        yield


def built(spec: dict, recipe: str) -> torch.nn.Module:
    model = build_model(OmegaConf.create({"vocab_size": 256, **spec}), SEQ)
    float8.convert(model, recipe, fsdp=False)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def converted(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
def test_the_blocks_linears_compute_in_float8_close_to_the_plain_model(spec, recipe, monkeypatch, caplog):
    """Every linear of the blocks converts, the output projection never; the state dict keeps its keys,
    shapes and dtypes (a checkpoint or an export sees no difference); the loss stays within bf16's
    rounding of the plain model's, the blocks' outputs and the gradients within float8's."""
    monkeypatch.setenv(float8.EMULATE_ENV, "1")
    plain = built(spec, "none")
    with caplog.at_level(logging.INFO, logger="harness.float8"):
        model = built(spec, recipe)
    linears = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    assert converted(model) == [n for n in linears if n.startswith("blocks.")] and converted(plain) == []
    head = "output" if "Llama" in spec["_target_"] else "head"
    assert f"1 outside the blocks ({head}) left in the compute dtype" in caplog.text
    assert f"float8 {recipe} (emulated): {len(linears) - 1} linears converted" in caplog.text
    mine, theirs = model.state_dict(), plain.state_dict()
    assert list(mine) == list(theirs)
    assert all(type(mine[k]) is torch.Tensor and torch.equal(mine[k], theirs[k]) for k in theirs)

    outputs = {}
    for name, m in (("plain", plain), ("float8", model)):
        m.blocks[-1].register_forward_hook(lambda _m, _args, out, name=name: outputs.__setitem__(name, out))
    tokens = torch.randint(256, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (plain, model)]
    for loss in losses:
        loss.backward()
    # the model's output, its loss, within bf16's rounding (2**-8); the last block's output within
    # float8's (e4m3 rounds each matmul input by up to 2**-4), but rounded: float8 did compute
    torch.testing.assert_close(losses[1], losses[0], rtol=2**-8, atol=0)
    rel = (outputs["float8"] - outputs["plain"]).norm() / outputs["plain"].norm()
    assert 1e-6 < rel < 2**-4, rel
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        cosine = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cosine > 0.99, (name, cosine)


def test_linears_float8_cannot_multiply_stay_as_they_are(monkeypatch, caplog):
    """A SwiGLU width that is not a multiple of 16: its three projections stay, attention's convert."""
    monkeypatch.setenv(float8.EMULATE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="harness.float8"):
        model = built({**LLAMA, "intermediate_size": 40}, "tensorwise")
    assert [n.rsplit(".", 1)[1] for n in converted(model)] == ["wq", "wk", "wv", "wo"] * 2
    assert "6 whose features are not multiples of 16 (e.g. blocks.0.feed_forward.w1)" in caplog.text


def test_a_transformers_models_decoder_layers_convert(monkeypatch):
    """model=hf, whose `blocks` is a list of transformers' decoder layers: their linears convert, lm_head stays."""
    monkeypatch.setenv(float8.EMULATE_ENV, "1")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        model = build_model(compose("config", overrides=["model=hf"]).model, SEQ)
    float8.convert(model, "rowwise", fsdp=False)
    assert len(converted(model)) == 14 and not any("lm_head" in name for name in converted(model))


def test_the_float8_all_gathers_scales_follow_the_weights_whatever_changed_them(world_of_1, monkeypatch):
    """FSDP2 all-gathering the weights in float8: before each forward every weight's scale is computed
    in one all-reduce from the weights as they are then, also after a change outside the optimizer
    step (a heal, a resume, DiLoCo's delayed sync), which torchao's precomputed scale would outlive."""
    monkeypatch.setenv(float8.EMULATE_ENV, "1")
    model = build_model(OmegaConf.create({"vocab_size": 256, **LLAMA}), SEQ)
    float8.convert(model, "tensorwise", fsdp=True)
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, torch.device("cpu"), seed=0)
    weights = [m.weight for m in model.modules() if type(m).__name__ == "Float8Linear"]
    tokens = torch.randint(256, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for scale in (1.0, 3.0):
        with torch.no_grad():
            for weight in weights:
                weight.to_local().mul_(scale)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        for weight in weights:  # the scale torchao keeps on the local shard (`to_local()` would be a view)
            amax = weight.detach().full_tensor().abs().max().double()
            expected = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
            assert weight._local_tensor._precomputed_scale == expected


def cfg(**train):
    return OmegaConf.create({"train": {"float8": "tensorwise", "device": "cpu", "compile": False, **train}})


def test_refused_where_it_cannot_run_and_warned_without_compile(monkeypatch):
    """On the CPU (without the tests' emulation), with a GPU below compute capability 8.9 (named),
    and without torchao (naming the extra); run without train.compile, it warns."""
    monkeypatch.delenv(float8.EMULATE_ENV, raising=False)
    (cpu,) = float8.config_errors(cfg(), gpus=0)
    assert "train.float8=tensorwise: the ranks run on the CPU, where float8 cannot pay" in cpu and "Fix:" in cpu
    assert float8.config_errors(cfg(float8="none"), gpus=0) == []
    (old,) = float8.capability_errors("train.float8=rowwise", [("NVIDIA A100-SXM4-80GB", 8, 0), ("NVIDIA H100", 9, 0)])
    assert old.startswith("train.float8=rowwise: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no float8")
    assert "H100 (" not in old and "Fix: train.float8=none" in old
    assert float8.capability_errors("train.float8=rowwise", [("NVIDIA L4", 8, 9)]) == []
    monkeypatch.setitem(sys.modules, "torchao", None)  # a torchao that does not import, as a missing one
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    (missing,) = float8.config_errors(cfg(), gpus=0)
    assert "train.float8=tensorwise trains through torchao" in missing and 'pip install -e ".[float8]"' in missing
    (slow,) = float8.config_warnings(cfg())
    assert "without train.compile=true" in slow and float8.config_warnings(cfg(compile=True)) == []
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        composed = compose("config", overrides=["train.float8=tensorwise"])
    assert slow in config_warnings(composed)  # what the run logs before it starts


# (recipe, checkpoint modes, overrides): a Llama that FSDP2 shards over the 2 ranks, all-gathering its
# weights in float8 (their scales precomputed), with gradient accumulation, in every mode; 2 one-device
# replicas under DiLoCo in int8, rowwise (its checkpoints differ from a plain run's in nothing else)
CASES = [
    ("tensorwise", "full,sharded,async", ["model=llama", "sharding=full_shard", "averager=none", "train.grad_accum=2"]),
    (
        "rowwise",
        "sharded",
        ["sharding=no_shard", "averager=diloco", "averager.period=2", "averager.warmup_steps=1"]
        + ["averager.comm_dtype=int8"],
    ),
]


@pytest.mark.slow
def test_float8_checkpoints_resume_exactly_and_load_both_ways_in_every_mode(tmp_path, cli_env):
    """tests/probes/float8_probe.py on 2 ranks: a float8 run resumes bit for bit, its checkpoint loads
    into a run without float8 and back, exactly, in full, sharded and async checkpoints, FSDP2's and
    averaging replicas'; the files hold plain tensors (nothing of torchao: a process without it reads
    them); the export of the float8 Llama is Hugging Face's plain weights."""
    args = [str(tmp_path / "report.json")]
    for recipe, modes, overrides in CASES:
        args += [recipe, modes, *SMALL, "model.d_model=64", *overrides, "--"]
    probe = REPO / "tests" / "probes" / "float8_probe.py"
    env = {**cli_env, float8.EMULATE_ENV: "1"}
    check_ok(run_cli(args[:-1], env, tmp_path, ranks=2, script=probe))
    report = json.loads((tmp_path / "report.json").read_text())
    for case in range(len(CASES)):
        assert report.pop(f"{case} converted") > 0 and report.pop(f"{case} dtypes") == ["torch.float32"]
    assert len(report) == 3 * 4 and all(keys == [] for keys in report.values()), report
    files = [p for p in tmp_path.glob("*/checkpoints/step_*/*") if p.is_file()]
    assert files and not [p for p in files if b"torchao" in p.read_bytes()]
    step = tmp_path / "0_full_a" / "checkpoints" / "step_4"
    export(step, tmp_path / "hf")
    saved = torch.load(step / "full.pt", weights_only=True)["model"]
    exported = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    names = built(LLAMA, "none").hf_names()
    assert exported.keys() == set(names.values())
    assert all(torch.equal(exported[hf], saved[fqn]) for fqn, hf in names.items())


def skip_without_float8_matmuls() -> None:
    if errors := float8.config_errors(cfg(device="cuda"), torch.cuda.device_count()):
        pytest.skip(errors[0])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_compiled_float8_run_trains_to_its_end_on_cuda(recipe, tmp_path, cli_env):
    """train.py on the GPU(s) in float8, compiled (FSDP2 from 2 GPUs, else a one-device replica): the
    blocks' linears convert, the run ends, the loss falls."""
    skip_without_float8_matmuls()
    cli_env.pop(float8.EMULATE_ENV, None)  # real float8 matmuls
    args = [*FAST, "model=llama", "model.d_model=64", "train.steps=20", "train.device=cuda", "averager=none"]
    args += ["sharding=full_shard", f"train.float8={recipe}", "train.compile=true", "hydra.run.dir=run"]
    proc = run_cli(args, cli_env, tmp_path)
    check_ok(proc)
    assert f"float8 {recipe}: 14 linears converted" in proc.stdout + proc.stderr
    rows = [row for row in read_metrics(tmp_path / "run") if "train/loss" in row]
    assert rows[-1]["step"] == 20 and rows[-1]["train/loss"] < rows[0]["train/loss"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float8_checkpoints_load_both_ways_on_cuda(tmp_path, cli_env):
    """The probe of the CPU test on the GPU(s), in real float8: a float8 checkpoint loads exactly into a
    run without float8 and back, in every mode, and holds plain tensors. (A resume is not compared bit
    for bit here: CUDA's embedding backward accumulates with atomics.)"""
    skip_without_float8_matmuls()
    cli_env.pop(float8.EMULATE_ENV, None)  # real float8 matmuls
    nproc = min(2, torch.cuda.device_count())
    args = [str(tmp_path / "report.json"), "tensorwise", "full,sharded,async", *SMALL, "model=llama"]
    args += ["model.d_model=64", "train.device=cuda", "sharding=full_shard", "averager=none"]
    check_ok(
        run_cli(args, cli_env, tmp_path, torchrun_nproc=nproc, script=REPO / "tests" / "probes" / "float8_probe.py")
    )
    report = json.loads((tmp_path / "report.json").read_text())
    loads = {check: keys for check, keys in report.items() if "loads" in check}
    assert len(loads) == 6 and all(keys == [] for keys in loads.values()), loads
    files = [p for p in tmp_path.glob("*/checkpoints/step_*/*") if p.is_file()]
    assert files and not [p for p in files if b"torchao" in p.read_bytes()]
