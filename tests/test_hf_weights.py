"""Hugging Face weights in (`model.init_from`) and out (`python -m harness.export`)
through DCP's Hugging Face storage reader and writer, with real transformers
models, real safetensors files and real multi-rank runs; and the refusals of
weights that do not fit, before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from harness.config import ConfigError, register_configs
from harness.data import build_data
from harness.launch.check import settle_config
from harness.models import HFCausalLM, Llama, build_model, materialize
from harness.models.hf_weights import hf_state, save_hf_weights
from harness.overrides import override_errors

from support import REPO, check_ok, losses, make, read_metrics, run_cli

register_configs()
CPU = torch.device("cpu")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
SMALL = ["train.batch_size=4", "train.seq_len=16", "train.log_every=1", "optimizer=adamw"]
# a Llama of the debug shape, narrower; model=hf the same shape through transformers, tied
LLAMA = ["model=llama", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2"]
HF_LLAMA = [
    "model=hf",
    "model.config_overrides.hidden_size=64",
    "model.config_overrides.intermediate_size=256",
    "model.config_overrides.tie_word_embeddings=true",  # a transformers key the default overrides lack: no '+'
]
# GPT-2's GELU and a position table longer than train.seq_len (SMALL's 16), as GPT-2's 1024 rows would be
GPT = ["model=gpt", "model.n_layer=2", "model.d_model=64", "model.activation=gelu_new", "model.n_positions=32"]
MODEL_ARGS = {"llama": LLAMA, "hf": HF_LLAMA, "gpt": GPT}


def exported_tensors(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the logits."""
    if isinstance(model, HFCausalLM):
        return model.causal_lm.get_output_embeddings()
    return model.output if isinstance(model, Llama) else model.head


def save_tiny_llama(path: Path, **config) -> None:
    """A random transformers Llama saved the ordinary way (save_pretrained)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, num_key_value_heads=2, **{**shape, **config})).save_pretrained(path)


# (model, layout, checkpoint mode): the Llama as post-local SGD replicas that have diverged
# (the export is their mean), model=hf sharded over 2 ranks, the GPT (GPT-2's layout) under DDP
CASES = [
    ("llama", ["launcher.nproc=2", "sharding=no_shard", "averager=periodic", "averager.warmup_steps=2"], "full"),
    ("hf", ["launcher.nproc=2", "sharding=full_shard", "averager=none"], "sharded"),
    ("gpt", ["launcher.nproc=2", "sharding=ddp", "averager=none"], "full"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout,mode", CASES, ids=[f"{m}-{mode}" for m, _, mode in CASES])
def test_export_loads_in_transformers_and_init_from_reads_it_back_bitwise(model, layout, mode, tmp_path, cli_env):
    """Train and checkpoint; `python -m harness.export` writes safetensors that
    transformers' AutoModelForCausalLM loads bit for bit and that give the
    harness model's logits; `model.init_from` reads them back bit for bit, in
    one process and sharded over 2 ranks (whose first loss is the one-process
    loss of the same batch). The GPT's goes through GPT-2's layout (transposed
    Conv1D weights) both ways, and init_from takes its GELU and its position
    table's rows from config.json."""
    from transformers import AutoModelForCausalLM

    run, out = tmp_path / "run", tmp_path / "hf"
    args = [*SMALL, *MODEL_ARGS[model], *layout, "train.steps=6", "checkpoint.interval=5", f"checkpoint={mode}"]
    check_ok(run_cli([*args, f"hydra.run.dir={run}"], cli_env, tmp_path))
    source = run / "checkpoints" / "step_5" if model == "llama" else run  # the llama's last step averages them
    proc = subprocess.run(
        [sys.executable, "-m", "harness.export", str(source), str(out)], env=cli_env, capture_output=True, text=True
    )
    check_ok(proc)
    exported = exported_tensors(out)
    if model == "llama":  # steps 4-5 were local: the replicas differ, and the export is their mean
        assert "exported the mean of 2 diverged replicas at step 5" in proc.stdout, proc.stdout
        assert "this run" not in proc.stdout + proc.stderr, "the export speaks of exporting, not of resuming"
        step = run / "checkpoints" / "step_5"
        r0, r1 = (torch.load(step / f, weights_only=True)["model"] for f in ("full.pt", "replica_1.pt"))
        assert not torch.equal(r0["output.weight"], r1["output.weight"])
        torch.testing.assert_close(exported["lm_head.weight"], (r0["output.weight"] + r1["output.weight"]) / 2)

    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for name, param in theirs.named_parameters():
        assert torch.equal(param, exported[name]), name

    # init_from alone gives the architecture (config.json's), as from_pretrained(out) takes it
    cfg = settle([f"model={model}", f"model.init_from={out}", *SMALL], tmp_path)
    if model == "gpt":
        assert (cfg.model.activation, cfg.model.n_positions, cfg.model.n_layer) == ("gelu_new", 32, 2)
    ours = build_model(cfg.model, cfg.train.seq_len)
    materialize(ours, CPU, seed=123, init_from=cfg.model.init_from)
    state = hf_state(ours)  # the parameters as transformers lays them out, under its names
    assert state.keys() == exported.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, exported[name]), name  # harness -> HF -> harness is bitwise

    sharded = tmp_path / "sharded"
    args = [*SMALL, f"model={model}", f"model.init_from={out}", "launcher.nproc=2", "sharding=full_shard"]
    proc = run_cli([*args, "averager=none", "train.steps=1", f"hydra.run.dir={sharded}"], cli_env, tmp_path)
    check_ok(proc)
    recorded = OmegaConf.to_container(OmegaConf.load(sharded / ".hydra" / "config.yaml").model)
    assert recorded == OmegaConf.to_container(cfg.model), "the run records what it built"
    architecture = "gpt2" if model == "gpt" else "llama"
    assert (
        f"model.init_from={out}: the architecture from its config.json: {architecture}, 2 layers, hidden size 64"
        in (sharded / "train.log").read_text()
    )
    # the run's first global batch (2 ranks x 4), read in one process
    tokens, targets = build_data(make(*args, "train.batch_size=8"), rank=0, world_size=1, device=CPU).next_batch()
    logits = []
    output_head(ours).register_forward_hook(lambda module, args, out: logits.append(out))
    with torch.no_grad():
        first = ours(tokens, targets).item()
        expected = theirs(input_ids=tokens).logits
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)
    assert losses(sharded)[0] == pytest.approx(first, rel=1e-5)
    assert read_metrics(sharded)[0]["train/loss"] != pytest.approx(read_metrics(run)[0]["train/loss"], rel=1e-3)


@pytest.mark.slow
def test_a_resume_does_not_read_init_from_and_export_speaks_of_exporting(tmp_path, cli_env):
    """init_from says what it read and loaded; the run's resume works after the
    directory has moved (it reads neither its config.json nor its weights); the
    export of the run speaks of exporting, and refuses a file as its target."""
    save_tiny_llama(tmp_path / "hf")
    run = tmp_path / "run"
    args = [*SMALL, "model=llama", f"model.init_from={tmp_path / 'hf'}", "launcher.nproc=1", "averager=none"]
    args += ["sharding=full_shard", "checkpoint=full", "checkpoint.interval=2", f"hydra.run.dir={run}"]
    check_ok(run_cli([*args, "train.steps=2"], cli_env, tmp_path))
    log = (run / "train.log").read_text()
    assert f"model.init_from={tmp_path / 'hf'}: the architecture from its config.json: llama, 2 layers" in log
    assert "loaded 21 tensors (" in log and "parameters) from 1 safetensors file(s)" in log

    (tmp_path / "hf").rename(tmp_path / "moved")
    check_ok(run_cli([*args, "train.steps=4"], cli_env, tmp_path))
    log = (run / "train.log").read_text()
    assert f"model.init_from is not read: the run resumes from {run / 'checkpoints' / 'step_2'}" in log
    assert [row["step"] for row in read_metrics(run) if "train/loss" in row] == [1, 2, 3, 4]

    (tmp_path / "a_file").write_text("not a folder")
    export = [sys.executable, "-m", "harness.export", str(run)]
    proc = subprocess.run([*export, str(tmp_path / "a_file")], env=cli_env, capture_output=True, text=True)
    assert proc.returncode == 2 and "is a file, not a directory. Fix:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and (tmp_path / "a_file").read_text() == "not a folder"
    proc = subprocess.run([*export, str(tmp_path / "out")], env=cli_env, capture_output=True, text=True)
    check_ok(proc)
    assert "this run" not in proc.stdout + proc.stderr and "RNG states" not in proc.stdout + proc.stderr
    assert proc.stdout.startswith("exported the model at step 4"), proc.stdout
    assert "without a tokenizer: the run trained on SyntheticTokens without a tokenizer file" in proc.stdout


def save_published_model(path: Path, corpus: list[str]) -> None:
    """A "published" model the ordinary way: a fast tokenizer (BPE with <s> and </s>, trained on
    `corpus`) and a random Llama 3.2-style model (scaled RoPE, tied) with its special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(vocab_size=320, num_key_value_heads=2, tie_word_embeddings=True, **shape)
    config.rope_parameters = {**rope, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
    config.bos_token_id, config.eos_token_id = fast.bos_token_id, fast.eos_token_id
    LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.slow
def test_published_model_to_generated_text_with_no_hand_edits(tmp_path, cli_env):
    """A published model's directory -> harness.prepare with its tokenizer (and its
    end-of-text token) -> train from it -> harness.export -> transformers loads the
    tokenizer and the model from the export alone and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = [" ".join(WORDS[i % 7 :] + WORDS[: i % 5]) + f" note {i}." for i in range(30)]
    (tmp_path / "corpus").mkdir()
    for i, text in enumerate(corpus):
        (tmp_path / "corpus" / f"{i:02d}.txt").write_text(text)
    published, data, run, out = (tmp_path / name for name in ("published", "data", "run", "out"))
    save_published_model(published, corpus)
    prepare = [f"input=[{tmp_path / 'corpus'}/*.txt]", f"out={data}", f"tokenizer={published}"]
    command = [sys.executable, "-m", "harness.prepare", *prepare]
    check_ok(subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=cli_env))
    theirs = AutoTokenizer.from_pretrained(published)
    assert json.loads((data / "index.json").read_text())["eot_id"] == theirs.eos_token_id  # </s>, not <|endoftext|>

    args = [*SMALL, "model=llama", f"model.init_from={published}", "data=tokens", f"data.path={data}"]
    args += ["launcher.nproc=1", "averager=none", "sharding=full_shard", "checkpoint=full", "train.steps=2"]
    check_ok(run_cli([*args, f"hydra.run.dir={run}"], cli_env, tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "harness.export", str(run), str(out)], env=cli_env, capture_output=True, text=True
    )
    check_ok(proc)
    assert f"with the tokenizer the run trained with, the dataset's (data.path={data})" in proc.stdout

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == theirs.get_vocab()
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.generation_config.eos_token_id == theirs.eos_token_id
    prompt = tokenizer("alpha beta", return_tensors="pt")
    ids = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert ids.shape[1] > prompt.input_ids.shape[1]
    greedy = tokenizer.decode(ids[0], skip_special_tokens=True)
    assert greedy.startswith("alpha beta")

    # python -m harness.generate on the run (exported on the way): the same text, greedy; on the export,
    # sampled from a seed
    generate = [sys.executable, "-m", "harness.generate", str(run), "prompt=alpha beta", "max_new_tokens=6"]
    proc = subprocess.run(generate, env=cli_env, capture_output=True, text=True)
    check_ok(proc)
    assert proc.stdout == greedy + "\n"
    sampled = [*generate[:3], str(out), *generate[4:], "temperature=1.5", "top_p=0.95", "seed=3"]  # the export
    proc = subprocess.run(sampled, env=cli_env, capture_output=True, text=True)
    check_ok(proc)
    torch.manual_seed(3)
    ids = model.generate(**prompt, max_new_tokens=6, do_sample=True, temperature=1.5, top_p=0.95)
    assert proc.stdout == tokenizer.decode(ids[0], skip_special_tokens=True) + "\n"
    proc = subprocess.run([*generate[:4], "prompt=x", "temprature=1"], env=cli_env, capture_output=True, text=True)
    assert proc.returncode == 2 and "Fix: temperature=1 (the closest key)" in proc.stderr, proc.stderr


def test_generate_continues_with_an_exported_gpt_as_the_harness_gpt_would(tmp_path, capsys):
    """harness.generate on a GPT's export (GPT-2's layout, a BPE tokenizer beside it, as harness.export
    writes them) prints the greedy continuation the harness's own GPT computes token by token; more
    tokens than its position table holds (train.seq_len) are refused naming max_new_tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from harness.generate import main
    from harness.models import GPT

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    torch.manual_seed(0)
    ours = GPT(n_layer=2, n_head=2, d_model=32, vocab_size=tokenizer.get_vocab_size(), seq_len=16).eval()
    files = {
        "tokenizer.json": tokenizer.to_str().encode(),
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"},
    }
    save_hf_weights(ours, tmp_path / "out", notes=files)

    ids, logits = tokenizer.encode("alpha beta").ids, []
    ours.head.register_forward_hook(lambda module, args, out: logits.append(out))
    with torch.no_grad():
        for _ in range(6):
            ours(torch.tensor([ids]), torch.tensor([ids]))
            ids.append(int(logits[-1][0, -1].argmax()))
    assert main([str(tmp_path / "out"), "prompt=alpha beta", "max_new_tokens=6"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(ids) + "\n"
    assert main([str(tmp_path / "out"), "prompt=alpha beta"]) == 2  # 64 new tokens by default
    prompt = len(tokenizer.encode("alpha beta").ids)
    expected = (
        "run past the model's 16 positions (a GPT's: its model.n_positions, by default the run's train.seq_len). "
        f"Fix: max_new_tokens={16 - prompt}."
    )
    assert expected in capsys.readouterr().err


def zoo_config(family: str):
    """A tiny random config of each family the zoo covers (save_pretrained'd by the test)."""
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, Qwen2Config

    if family == "gpt2":  # GPT-2's Conv1D weights, tanh GELU (gelu_new) and 32 positions, tied
        return GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    llama3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}
    llama3["original_max_position_embeddings"] = 8  # the batch's 16 tokens run past it
    if family == "llama3.2":  # scaled RoPE, tied
        config = LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **shape)
        config.rope_parameters = {**llama3, "factor": 32.0}
    elif family == "llama3.1":  # scaled RoPE, untied, grouped-query attention
        config = LlamaConfig(num_key_value_heads=1, tie_word_embeddings=False, **shape)
        config.rope_parameters = {**llama3, "factor": 8.0}
    elif family == "qwen2":  # attention biases
        config = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **shape)
    else:  # gemma: scaled embeddings, (1 + w) norms, GeLU MLP, tied
        config = GemmaConfig(num_key_value_heads=1, head_dim=16, **shape)
    return config


ZOO = [("llama3.2", "llama"), ("llama3.1", "llama"), ("qwen2", "hf"), ("gemma", "hf"), ("gpt2", "gpt")]


@pytest.mark.parametrize("family,model", ZOO, ids=[f"{f}-model={m}" for f, m in ZOO])
def test_model_zoo_init_from_trains_and_exports_what_transformers_computes(family, model, tmp_path):
    """A tiny random model of each family, saved with save_pretrained: `model=<model>
    model.init_from=<dir>` alone builds it (GPT-2's on the harness's GPT); its first logits
    and loss are transformers' on the same batch; after one AdamW step the export (the writer
    harness.export uses) loads in transformers and gives the harness's logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(zoo_config(family)).save_pretrained(tmp_path / "hf")
    cfg = settle([*SMALL, f"model={model}", f"model.init_from={tmp_path / 'hf'}"], tmp_path)
    if family == "gpt2":  # at these weights the two GELUs give the same loss to 1e-6: the key says which
        assert (cfg.model.activation, cfg.model.n_positions, cfg.model.bias) == ("gelu_new", 32, True)
    ours = build_model(cfg.model, cfg.train.seq_len)
    materialize(ours, CPU, seed=0, init_from=cfg.model.init_from)
    tokens = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens, targets = tokens[:, :-1], tokens[:, 1:]

    def their_loss(directory: Path) -> tuple[torch.Tensor, float]:
        theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = theirs(input_ids=tokens).logits
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()

    logits = []
    output_head(ours).register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    loss = ours(tokens, targets)
    expected, theirs = their_loss(tmp_path / "hf")
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(theirs, rel=1e-5)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    loss.backward()
    optimizer.step()
    save_hf_weights(ours.eval(), tmp_path / "out")
    with torch.no_grad():
        after = ours(tokens, targets).item()
    expected, theirs = their_loss(tmp_path / "out")
    torch.testing.assert_close(logits[1], expected, rtol=1e-5, atol=1e-5)
    assert after == pytest.approx(theirs, rel=1e-5) and after < loss.item()


def init_from_case(tmp_path: Path, case: str) -> list[str]:
    """Overrides for one bad `model.init_from`, its files written under `tmp_path`."""
    if case == "missing":
        return [*LLAMA, f"model.init_from={tmp_path / 'nowhere'}"]
    if case == "no safetensors":
        save_tiny_llama(tmp_path / "bin")
        for file in (tmp_path / "bin").glob("*.safetensors"):
            file.unlink()
        torch.save({}, tmp_path / "bin" / "pytorch_model.bin")
        return ["model=llama", f"model.init_from={tmp_path / 'bin'}"]
    if case == "contradicted":
        save_tiny_llama(tmp_path / "wide", hidden_size=128, intermediate_size=512)
        return [*LLAMA, "model.tie_embeddings=true", f"model.init_from={tmp_path / 'wide'}"]
    if case == "contradicted width":
        save_tiny_llama(tmp_path / "wide", hidden_size=128, intermediate_size=512)
        return ["model=llama", "model.multiple_of=64", f"model.init_from={tmp_path / 'wide'}"]
    if case == "shape":  # config.json that does not describe its weights
        save_tiny_llama(tmp_path / "llama")
        config = json.loads((tmp_path / "llama" / "config.json").read_text())
        (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "vocab_size": 128}))
        return ["model=llama", f"model.init_from={tmp_path / 'llama'}"]
    if case == "extra tensor":  # a config.json that ties the table over weights with an lm_head of its own
        save_tiny_llama(tmp_path / "untied")
        config = json.loads((tmp_path / "untied" / "config.json").read_text())
        (tmp_path / "untied" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        return ["model=llama", f"model.init_from={tmp_path / 'untied'}"]
    if case == "no hf layout":
        save_tiny_llama(tmp_path / "llama")
        return ["model=mlp", f"model.init_from={tmp_path / 'llama'}"]
    if case == "gpt past its positions":
        save_tiny_gpt2(tmp_path / "gpt2", n_positions=16)
        return ["model=gpt", "train.seq_len=32", f"model.init_from={tmp_path / 'gpt2'}"]
    if case == "gpt relu":
        save_tiny_gpt2(tmp_path / "gpt2", activation_function="relu")
        return ["model=gpt", f"model.init_from={tmp_path / 'gpt2'}"]
    if case == "base model names":  # GPT2Model's files, as the Hub's gpt2: no `transformer.` prefix
        from transformers import GPT2Config, GPT2Model

        GPT2Model(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4)).save_pretrained(tmp_path / "base")
        return ["model=gpt", f"model.init_from={tmp_path / 'base'}"]
    if case == "not a gpt2":
        save_tiny_llama(tmp_path / "llama")
        return ["model=gpt2", f"model.init_from={tmp_path / 'llama'}"]
    if case == "config vocab":
        save_tiny_llama(tmp_path / "vocab")
        return ["model=hf", f"model.config={tmp_path / 'vocab'}", "model.vocab_size=512"]
    if case == "not a llama":
        save_tiny_qwen2(tmp_path / "qwen2")
        return ["model=llama", f"model.init_from={tmp_path / 'qwen2'}"]
    if case == "yarn":
        save_tiny_llama(tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
        return ["model=llama", f"model.init_from={tmp_path / 'yarn'}"]
    if case == "rope contradicted":  # the Llama 3.1 preset's scaling over a Llama 3.2-scaled checkpoint
        rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope.update(original_max_position_embeddings=8192, rope_theta=500000.0)
        save_tiny_llama(tmp_path / "scaled", rope_parameters=rope)
        return ["model=llama3_8b", "model.rope_scaling.factor=8.0", f"model.init_from={tmp_path / 'scaled'}"]
    if case == "no config.json":
        save_tiny_llama(tmp_path / "bare")
        (tmp_path / "bare" / "config.json").unlink()
        return ["model=hf", f"model.init_from={tmp_path / 'bare'}"]
    if case in ("truncated safetensors", "garbage safetensors"):
        save_tiny_llama(tmp_path / "cut")
        file = tmp_path / "cut" / "model.safetensors"
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2] if case.startswith("trunc") else b"<html>")
        return ["model=llama", f"model.init_from={tmp_path / 'cut'}"]
    if case in ("unknown model_type", "not causal"):
        (tmp_path / "other").mkdir()
        model_type = "nopeformer" if case == "unknown model_type" else "t5"
        (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": model_type}))
        return ["model=hf", f"model.init_from={tmp_path / 'other'}"]
    raise AssertionError(case)


def save_tiny_gpt2(path: Path, **config) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = dict(n_embd=64, n_layer=2, n_head=4)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, **{**shape, **config})).save_pretrained(path)


def save_tiny_qwen2(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=256, num_key_value_heads=2, **shape)).save_pretrained(path)


INIT_FROM_CASES = [
    ("missing", ["model.init_from=", "nowhere", "no such directory", "Fix:"]),
    ("no safetensors", ["holds no *.safetensors", "save_pretrained(..., safe_serialization=True)"]),
    (
        "contradicted",
        [
            "command line contradicts it: model.d_model=64 (config.json: 128); model.tie_embeddings=true (config.json: "
            "false). Fix: drop those model keys"
        ],
    ),
    ("contradicted width", ["model.multiple_of=64", "SwiGLU width of 384 (config.json: intermediate_size=512)"]),
    ("shape", ["tensor 'model.embed_tokens.weight' has shape [256, 64], the model's is [128, 64]", "Fix:"]),
    ("extra tensor", ["holds tensor 'lm_head.weight'", "model.tie_embeddings", "Fix:"]),
    ("no hf layout", ["model TokenMLP has no Hugging Face layout", "Fix: model=gpt (a GPT-2 checkpoint), model=llama"]),
    (
        "gpt past its positions",
        ["train.seq_len=32 is longer than model.n_positions=16", "config.json's n_positions", "Fix: train.seq_len=16"],
    ),
    ("gpt relu", ['activation_function="relu"', 'computes activation_function="gelu" or "gelu_new"', "Fix: model=hf"]),
    ("not a gpt2", ["LlamaConfig (model_type='llama'), not a GPT-2", "Fix: model=hf model.init_from="]),
    (
        "base model names",
        ["holds tensor 'wte.weight' where the model needs 'transformer.wte.weight'", "Fix: write it again", "(<dir>)"],
    ),
    ("config vocab", ["model.vocab_size=512 differs from", "vocab_size=256", "Fix: model.vocab_size=256"]),
    ("not a llama", ["Qwen2Config (model_type='qwen2'), not a Llama", "Fix: model=hf model.init_from="]),
    ("yarn", ["rope_type='yarn'", "Fix: model=hf model.init_from="]),
    ("rope contradicted", ["model.rope_scaling={'rope_type': 'llama3', 'factor': 8.0,", "(config.json: {", "32.0"]),
    ("no config.json", ["holds no config.json", "Fix:"]),
    ("truncated safetensors", ["model.safetensors cannot be read as safetensors", "incomplete metadata", "Fix:"]),
    ("garbage safetensors", ["model.safetensors cannot be read as safetensors", "header too", "Fix:"]),
    ("unknown model_type", ["model_type='nopeformer', which transformers 5.", "does not know", "Fix:"]),
    ("not causal", ["T5Config (model_type='t5')", "no causal LM class", "Fix:"]),
]


def settle(overrides: list[str], tmp_path: Path):
    """The config `python train.py <overrides>` runs with, settled as before any rank starts."""
    cfg = make(*overrides)
    settle_config(cfg, 2, 2, tmp_path / "settled", overrides)
    return cfg


@pytest.mark.parametrize("case,expected", INIT_FROM_CASES, ids=[c[0] for c in INIT_FROM_CASES])
def test_weights_that_do_not_fit_are_refused_before_any_rank_starts(case, expected, tmp_path):
    with pytest.raises(ConfigError) as info:
        settle(init_from_case(tmp_path, case), tmp_path)
    for text in expected:
        assert text in str(info.value), f"{text!r} not in:\n{info.value}"


@pytest.mark.parametrize(
    "setup,expected",
    [
        ("", ["model.model_type='nope' is not a model type transformers knows", "llama", "Fix:"]),
        ("sys.modules['transformers'] = None", ["model=hf needs Hugging Face transformers", '.[hf]"']),
    ],
    ids=["unknown model_type", "transformers missing"],
)
def test_model_hf_names_what_is_missing(setup, expected):
    """Through validate, in a fresh interpreter (so transformers can be absent)."""
    code = (
        f"import sys; {setup}\n"
        "from hydra import compose, initialize_config_dir\n"
        "from harness.config import register_configs\n"
        "from harness.validate import validate\n"
        "register_configs()\n"
        f"with initialize_config_dir(config_dir={str(REPO / 'conf')!r}, version_base=None):\n"
        "    cfg = compose('config', overrides=['model=hf', 'model.model_type=nope'])\n"
        "validate(cfg, world_size=2, gpus=0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in:\n{proc.stderr[-3000:]}"


def test_hf_config_overrides_reach_the_transformers_config():
    assert override_errors(["train.py", *HF_LLAMA], REPO / "conf") == []
    cfg = make(*HF_LLAMA, "model.config_overrides.num_hidden_layers=3")
    model = build_model(cfg.model, seq_len=16)
    assert len(model.blocks) == 3 and model.config.hidden_size == 64 and model.config.vocab_size == 256
    assert OmegaConf.to_container(cfg.model.config_overrides)["tie_word_embeddings"] is True
    assert model.lm_head.weight is model.model.embed_tokens.weight
