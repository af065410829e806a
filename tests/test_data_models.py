"""Data slicing/determinism, layout-independent model init, and the Llama
checked against Hugging Face's (in-process, fast)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness import metrics
from harness.config import register_configs
from harness.data import TextTokens, TokenStream, build_data
from harness.loop import evaluate
from harness.models import GPT, Llama, build_model, materialize, parameter_count
from harness.models.hf_weights import save_hf_weights
from harness.models.llama import hf_name
from harness.models.loss import lm_loss
from harness.models.pretrained import adopt_init_from
from harness.rng import seeded_generator

from support import REPO, make

CPU = torch.device("cpu")
register_configs()


def run_config(data: dict, batch_size: int, seed: int, grad_accum: int = 1):
    """The keys `build_data` reads from a run's config."""
    train = {"batch_size": batch_size, "grad_accum": grad_accum, "seq_len": 16, "seed": seed}
    return OmegaConf.create({"data": data, "model": {"vocab_size": 256}, "train": train})


def stream(world_size: int, rank: int, batch_size: int, grad_accum: int = 1) -> TokenStream:
    cfg = run_config({"_target_": "harness.data.SyntheticTokens", "noise": 0.1}, batch_size, 3, grad_accum)
    return build_data(cfg, rank=rank, world_size=world_size, device=CPU)


def test_ranks_read_disjoint_slices_whose_union_is_the_single_process_batch():
    single = stream(1, 0, batch_size=8)
    ranks = [stream(4, r, batch_size=2) for r in range(4)]
    for _ in range(3):
        x1, y1 = single.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)
        assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    rows = {tuple(r.tolist()) for r in torch.cat([stream(4, r, 2).next_batch()[0] for r in range(4)])}
    assert len(rows) == 8


def test_micro_batches_of_a_step_hold_what_one_batch_of_their_sum_holds_rank_by_rank():
    """train.grad_accum=4 with batch 1 reads, on every rank and step, what batch 4 reads."""
    for rank in range(2):
        whole, micro = stream(2, rank, batch_size=4), stream(2, rank, batch_size=1, grad_accum=4)
        for _ in range(3):
            x, y = whole.next_batch()
            parts = [micro.next_batch() for _ in range(4)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert micro.samples == whole.samples == 3 * 2 * 4


def test_stream_is_deterministic_and_resumes_from_its_position():
    """Also in the same stream, whose next batch was already being read ahead (a heal, a resume
    in a bench): the position it is set to wins."""
    a = stream(2, 1, 4)
    batches = [a.next_batch()[0] for _ in range(5)]
    b = stream(2, 1, 4)
    b.load_state_dict({"samples": 3 * 2 * 4})
    assert torch.equal(b.next_batch()[0], batches[3])
    assert a.state_dict() == {"samples": 5 * 2 * 4}
    a.load_state_dict({"samples": 1 * 2 * 4})
    assert torch.equal(a.next_batch()[0], batches[1]) and torch.equal(a.next_batch()[0], batches[2])


def test_position_carries_over_to_another_world_size_without_gaps_or_repeats():
    old = [stream(4, r, 2) for r in range(4)]
    seen = [s.next_batch()[0] for s in old]  # one step on 4 ranks: samples 0..7
    new = [stream(2, r, 2) for r in range(2)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    seen += [s.next_batch()[0] for s in new]  # one step on 2 ranks: samples 8..11
    assert torch.equal(torch.cat(seen), stream(1, 0, 12).next_batch()[0])


def test_synthetic_tokens_follow_a_learnable_pattern():
    """The walk, drawn without a loop over positions, is the per-position recurrence it replaced:
    token t is a fresh draw where the noise breaks the walk, else perm[token t-1]."""
    source = stream(1, 0, 1).source
    seqs = source.samples(0, 64, 65)
    follows = (seqs[:, 1:] == source.next_token[seqs[:, :-1]]).float().mean().item()
    assert 0.85 < follows < 0.95  # noise=0.1 breaks about one token in ten
    for index, seq in enumerate(seqs[:4].tolist()):
        g = seeded_generator(3, index)  # the sample's own stream: start, breaks, fresh tokens
        walk = [torch.randint(256, (1,), generator=g).item()]
        breaks, fresh = torch.rand(65, generator=g) < 0.1, torch.randint(256, (65,), generator=g)
        for t in range(1, 65):
            walk.append(fresh[t].item() if breaks[t] else source.next_token[walk[-1]].item())
        assert seq == walk


def test_text_corpus_is_cached_once_and_windows_do_not_overlap(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.txt").write_bytes(torch.randint(256, (1000 + i,), dtype=torch.uint8).numpy().tobytes())
    cfg = OmegaConf.create(
        {
            "_target_": "harness.data.TextTokens",
            "root": str(root),
            "glob": "*.txt",
            "max_bytes": 10**6,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    source = TextTokens(**{k: v for k, v in cfg.items() if k != "_target_"}, vocab_size=256, seed=0)
    source.open()
    total = sum(os.path.getsize(p) for p in root.iterdir())
    assert len(source.held_out) == int(total * 0.01) and len(source.tokens) + len(source.held_out) == total
    corpus = np.concatenate([source.tokens, source.held_out])  # the held-out part is the corpus's end
    assert corpus.tobytes() == b"".join(p.read_bytes() for p in sorted(root.iterdir()))
    [cached] = list((tmp_path / "cache").iterdir())
    mtime = cached.stat().st_mtime_ns
    source.open()
    assert cached.stat().st_mtime_ns == mtime  # reused, not rebuilt
    s = build_data(run_config(cfg, batch_size=4, seed=0), rank=0, world_size=1, device=CPU)
    windows = torch.cat([s.next_batch()[0] for _ in range(10)])
    assert len({tuple(w.tolist()) for w in windows}) == 40  # 40 distinct windows of the stream
    held_out = {tuple(w.tolist()) for batch in s.eval_windows("all") for w in s.eval_batch(batch)[0]}
    assert len(held_out) == s.source.eval_windows(17) and not held_out & {tuple(w.tolist()) for w in windows}
    assert [b.tolist() for b in s.eval_windows(2)] == [b.tolist() for b in s.eval_windows(2)]  # the same every pass


class Bigram(torch.nn.Module):
    """A bigram language model, its log-probabilities counted (add-one) from `tokens`."""

    def __init__(self, tokens: np.ndarray):
        super().__init__()
        counts = np.ones((256, 256))
        np.add.at(counts, (tokens[:-1], tokens[1:]), 1)
        self.log_probs = torch.nn.Parameter(torch.from_numpy(np.log(counts / counts.sum(1, keepdims=True))).float())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.log_probs[tokens], targets)


def test_eval_loss_estimates_the_whole_held_out_split_and_all_scores_every_window(tmp_path, world_of_1):
    """A held-out split that gets harder along its length (a byte pattern the bigram predicts, then
    more and more random bytes): eval/loss from 4 batches of 8 is within a few percent of a full pass
    (`train.eval_batches=all`); the split's first windows, which eval/loss scored before, are far easier."""
    rng = np.random.default_rng(0)
    length, windows = 65, 400
    pattern = np.resize(np.frombuffer(b"abcdefgh", dtype=np.uint8), length)
    rows = [np.where(rng.random(length) < w / windows, rng.integers(256, size=length), pattern) for w in range(windows)]
    held_out = np.concatenate(rows).astype(np.uint8)
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_bytes(rng.integers(256, size=len(held_out) * 9, dtype=np.uint8).tobytes())
    (root / "b.txt").write_bytes(held_out.tobytes())  # the corpus's last 10 %
    data = {
        "_target_": "harness.data.TextTokens",
        "root": str(root),
        "glob": "*.txt",
        "max_bytes": 10**7,
        "cache_dir": str(tmp_path / "cache"),
        "eval_fraction": 0.1,
    }
    cfg = run_config(data, batch_size=8, seed=0)
    cfg.train.seq_len = length - 1
    s = build_data(cfg, rank=0, world_size=1, device=CPU)
    assert s.source.held_out.tobytes() == held_out.tobytes()
    model = Bigram(held_out)
    full = evaluate(model, s, "all")[metrics.EVAL_LOSS]
    spread = evaluate(model, s, 4)[metrics.EVAL_LOSS]
    first = float(model(*s.eval_batch(np.arange(32))))
    assert abs(spread - full) < 0.03 * full, (spread, full)
    assert first < 0.5 * full, (first, full)  # the windows eval/loss scored before: not the split
    every = np.arange(s.source.eval_windows(length))
    assert full == pytest.approx(float(model(*s.eval_batch(every))), rel=1e-5)  # each window once


def test_default_text_corpus_is_the_standard_library_without_site_packages(tmp_path):
    files = TextTokens(None, "**/*.py", 10**6, "unused", vocab_size=256, seed=0).files()
    assert any(f.endswith(os.path.join("json", "decoder.py")) for f in files)
    assert not any("site-packages" in f for f in files)


def test_init_is_seeded_per_parameter_not_by_order():
    cfg = OmegaConf.create(
        {"_target_": "harness.models.GPT", "n_layer": 2, "n_head": 2, "d_model": 16, "vocab_size": 32}
    )
    a, b = build_model(cfg, 8), build_model(cfg, 8)
    assert next(a.parameters()).is_meta
    materialize(a, CPU, seed=7)
    materialize(b, CPU, seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.qkv.weight, a.blocks[1].attn.qkv.weight)
    assert torch.all(a.blocks[0].ln_attn.weight == 1) and torch.all(a.blocks[0].mlp.fc.bias == 0)
    assert a.blocks[0].mlp.out_proj.weight.std() < a.blocks[0].mlp.fc.weight.std()  # scaled residual init
    c = build_model(cfg, 8)
    materialize(c, CPU, seed=8)
    assert not torch.equal(a.head.weight, c.head.weight)


LLAMA = dict(_target_="harness.models.Llama", n_layer=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64)
HF = dict(
    _target_="harness.models.HFCausalLM",
    vocab_size=64,
    config_overrides=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
)
HF_TIED = {**HF, "config_overrides": {**HF["config_overrides"], "tie_word_embeddings": True}}
GPT_TIED = dict(_target_="harness.models.GPT", n_layer=2, n_head=2, d_model=32, vocab_size=64, bias=False)
LAYOUT_CASES = {"llama": LLAMA, "llama-tied": {**LLAMA, "tie_embeddings": True}, "hf-tied": HF_TIED}
LAYOUT_CASES["gpt-tied-no-bias"] = GPT_TIED


def ties(model) -> set[tuple[str, str]]:
    """(first name, other name) of each parameter registered under two names."""
    first = {}
    named = model.named_parameters(remove_duplicate=False)
    return {(f, n) for n, p in named if (f := first.setdefault(id(p), n)) != n}


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_init_is_the_same_full_value_whatever_the_layout(case):
    """The last rank of a 4-way FSDP2 shard holds its slice of what one process
    materialises (a fake process group: distributing a full value needs no
    collective), for the Llama tied or not and a transformers model (drawn by
    its own _init_weights), and a tied table stays tied."""
    cfg = OmegaConf.create(LAYOUT_CASES[case])
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        # a mesh name of its own: FSDP2 would otherwise reuse an equal mesh of an earlier
        # fake world in this process, with that world's rank
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=(f"layout_{case.replace('-', '_')}",))
        whole, sharded = build_model(cfg, 8), build_model(cfg, 8)
        materialize(whole, CPU, seed=7)
        for block in sharded.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        materialize(sharded, CPU, seed=7)
        for (name, full), (_, shard) in zip(whole.named_parameters(), sharded.named_parameters()):
            assert isinstance(shard, DTensor), name
            assert torch.equal(shard.to_local(), torch.chunk(full, 4)[3]), name
        assert ties(sharded) == ties(whole) and bool(ties(whole)) == ("tied" in case)
        for (name, a), (_, b) in zip(whole.named_buffers(), sharded.named_buffers()):
            assert torch.equal(a, b), name  # computed buffers (HF's rotary frequencies) are set on every rank
    finally:
        dist.destroy_process_group()
    if case == "llama":
        block = whole.blocks[1]
        assert torch.all(block.attention_norm.weight == 1) and torch.all(whole.norm.weight == 1)
        assert block.feed_forward.w2.weight.std() < block.feed_forward.w1.weight.std()  # depth-scaled projections out
        assert not torch.equal(whole.blocks[0].attention.wq.weight, block.attention.wq.weight)


def test_hf_model_is_initialised_as_transformers_initialises_it():
    """model=hf draws each tensor from its own seed, yet by the model's own
    _init_weights: per tensor, the statistics of the model built the ordinary
    way (AutoModelForCausalLM.from_config), norms exactly at one, buffers equal."""
    from transformers import AutoModelForCausalLM

    cfg = OmegaConf.create({**HF, "vocab_size": 256, "config_overrides": {**HF["config_overrides"], "hidden_size": 64}})
    ours = build_model(cfg, 8)
    materialize(ours, CPU, seed=0)
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(ours.config)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        if name.endswith("norm.weight"):
            assert torch.equal(a, b), name
        else:
            assert not torch.equal(a, b), name
            assert abs(a.mean().item() - b.mean().item()) < 4 * b.std().item() / a.numel() ** 0.5, name
            assert a.std().item() == pytest.approx(b.std().item(), rel=0.1), name
    for (name, a), (_, b) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert torch.equal(a, b), name


def hf_config(model: Llama, d_model: int, n_layer: int, n_heads: int, n_kv_heads: int, vocab_size: int, rope=None):
    """transformers' config of `model`'s shape; `rope`: its rope_parameters (default: unscaled, model's theta)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=model.blocks[0].feed_forward.w1.out_features,
        num_hidden_layers=n_layer,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        rms_norm_eps=model.norm.eps,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": model.rope_theta},
        tie_word_embeddings=model.tie_embeddings,
    )


# Llama 3.2's RoPE scaling with original_max_position_embeddings 32 instead of 8192, so that a short
# sequence runs past it and head_dim 16 at theta 1e4 has a frequency in each regime (kept, interpolated, scaled)
SCALED = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SCALED["original_max_position_embeddings"] = 32


@pytest.mark.parametrize(
    "shape,seq",
    [
        (dict(d_model=64, n_layer=2, n_heads=8, n_kv_heads=2, tie_embeddings=False, rope_theta=500000.0), 40),
        (dict(d_model=64, n_layer=2, n_heads=4, n_kv_heads=4, tie_embeddings=True, rope_theta=10000.0), 40),
        (
            dict(
                d_model=64, n_layer=2, n_heads=4, n_kv_heads=2, tie_embeddings=True, rope_theta=1e4, rope_scaling=SCALED
            ),
            96,
        ),
    ],
    ids=["gqa-untied", "mha-tied", "llama3-scaled-rope"],
)
def test_llama_gives_the_logits_of_transformers_llama_with_the_same_weights(shape, seq):
    """The independent check that ours is a Llama: every weight (norms too) drawn
    at random, copied by name into LlamaForCausalLM, and the logits agree to
    float32 rounding. Rotary embeddings follow HF's rotate_half, so q and k
    need no permutation. With Llama 3.1/3.2's RoPE scaling the sequence is
    3 times original_max_position_embeddings; the export writes the scaling back."""
    from transformers import LlamaForCausalLM

    ours = Llama(vocab_size=96, multiple_of=16, ffn_dim_multiplier=1.3, **shape)
    ours.to_empty(device=CPU)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2 + (1 if p.dim() == 1 else 0))
    sizes = {k: shape[k] for k in ("d_model", "n_layer", "n_heads", "n_kv_heads")}
    rope = {**shape.get("rope_scaling", {"rope_type": "default"}), "rope_theta": shape["rope_theta"]}
    config = hf_config(ours, **sizes, vocab_size=96, rope=rope)
    assert ours.hf_config()["rope_parameters"] == rope
    config._attn_implementation = "eager"  # HF's own attention arithmetic, not the SDPA ours calls
    theirs = LlamaForCausalLM(config).eval()
    state = {hf_name(name): value for name, value in ours.state_dict().items()}
    assert state.keys() == theirs.state_dict().keys()
    theirs.load_state_dict(state)
    if shape["tie_embeddings"]:
        assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    logits = []
    ours.output.register_forward_hook(lambda module, args, out: logits.append(out))
    tokens = torch.randint(96, (3, seq), generator=generator)
    ours.eval()(tokens, tokens)
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits
    torch.testing.assert_close(logits[0].detach(), expected, rtol=1e-5, atol=1e-5)


# the architecture keys of the published config.json files (meta-llama/Llama-3.2-1B, Llama-3.1-8B)
LLAMA3_PUBLISHED = {"rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256}
LLAMA3_PUBLISHED["max_position_embeddings"] = 131072
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE["original_max_position_embeddings"] = 8192
LLAMA3_2_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
LLAMA3_2_1B.update(intermediate_size=8192, tie_word_embeddings=True, rope_scaling={**LLAMA3_ROPE, "factor": 32.0})
LLAMA3_1_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
LLAMA3_1_8B.update(intermediate_size=14336, tie_word_embeddings=False, rope_scaling={**LLAMA3_ROPE, "factor": 8.0})


@pytest.mark.parametrize(
    "preset,published,count",
    [("llama3_1b", LLAMA3_2_1B, 1_235_814_400), ("llama3_8b", LLAMA3_1_8B, 8_030_261_248)],
    ids=["1b", "8b"],
)
def test_llama_presets_are_the_published_configs(preset, published, count):
    """Built on the meta device, as validate builds them, the presets export the
    published config.json's architecture (RoPE scaling included) and count the
    published parameters, as transformers' LlamaForCausalLM of that config does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={preset}"]).model
    ours = build_model(cfg, seq_len=8192)
    config = LlamaConfig(**LLAMA3_PUBLISHED, **published)
    exported = LlamaConfig(**ours.hf_config())
    for key in {*LLAMA3_PUBLISHED, *published, "head_dim", "rope_parameters"} - {"rope_theta", "rope_scaling"}:
        assert getattr(exported, key) == getattr(config, key), key
    with torch.device("meta"):
        theirs = LlamaForCausalLM(config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == count


# -- GPT: nanoGPT's model.py, GPT-2's architecture -------------------------------------

# nanoGPT's CPU "baby" config (bias=False, tied) and GPT-2 small as nanoGPT trains it (bias, tied, vocabulary
# 50,304), with the counts nanoGPT's model.py gives them: sum(p.numel() for p in model.parameters()), each once,
# the position table included (its printed "number of parameters" is get_num_params(), without the table:
# 0.82M and 123.69M)
NANOGPT_CONFIGS = [
    ("baby", ["model=gpt", "model.bias=false"], 64, 828_544, 820_352),
    ("gpt2", ["model=gpt2"], 1024, 124_475_904, 123_689_472),
]


@pytest.mark.parametrize("name,overrides,seq_len,count,printed", NANOGPT_CONFIGS, ids=[c[0] for c in NANOGPT_CONFIGS])
def test_gpt_counts_the_parameters_nanogpt_counts(name, overrides, seq_len, count, printed):
    """Built on the meta device from the config a run composes (train.seq_len: nanoGPT's block_size),
    the harness's GPT counts (and a run logs, `parameter_count`) nanoGPT's model.py's parameters."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[*overrides, f"train.seq_len={seq_len}"])
    shape = (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.vocab_size, cfg.model.bias)
    assert shape == ((4, 4, 128, 256, False) if name == "baby" else (12, 12, 768, 50304, True))
    assert cfg.model.tie_embeddings  # model=gpt's default, GPT-2's
    model = build_model(cfg.model, cfg.train.seq_len)
    assert parameter_count(model) == count
    assert parameter_count(model) - model.pos_emb.weight.numel() == printed
    assert model.head.weight is model.tok_emb.weight
    untied = build_model(OmegaConf.merge(cfg.model, {"tie_embeddings": False}), seq_len)
    assert parameter_count(untied) == count + cfg.model.vocab_size * cfg.model.d_model  # 163,109,376 for GPT-2


def test_gpt_bias_and_tie_embeddings_shape_every_layer():
    """bias=false: no Linear and no LayerNorm has a bias (nanoGPT's bias=False); tie_embeddings: the head's
    weight is the token table, one parameter named once (`tok_emb.weight`) that a state dict holds under both
    names, initialised once, N(0, 0.02); untied, the head is a parameter of its own."""
    shape = dict(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8)
    with torch.device("meta"):
        tied, untied = GPT(**shape, bias=False), GPT(**shape, tie_embeddings=False)
        assert GPT(**shape, dropout=0.1).emb_dropout.p == 0.1  # nanoGPT's `drop` on the embeddings' sum
    assert not [n for n, _ in tied.named_parameters() if n.endswith("bias")]
    assert all(m.bias is None for m in tied.modules() if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)))
    assert {n for n, _ in untied.named_parameters() if n.endswith("bias")} >= {"ln_f.bias", "blocks.1.mlp.fc.bias"}
    assert "head.weight" not in dict(tied.named_parameters()) and "head.weight" in tied.state_dict()
    assert "head.weight" in dict(untied.named_parameters()) and untied.head.weight is not untied.tok_emb.weight
    materialize(tied, CPU, seed=0)
    assert tied.head.weight is tied.tok_emb.weight and 0.015 < tied.head.weight.std() < 0.025
    tied.eval()(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    assert tied.tok_emb.weight.grad is not None  # the lookup's and the head's gradients, accumulated


def test_gpt_flops_per_token_count_a_tied_head():
    """The tie changes no matmul: a tied table is the head's weight, counted once, as the head."""
    shape = dict(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8)
    with torch.device("meta"):
        tied, untied = GPT(**shape), GPT(**shape, tie_embeddings=False)
    assert tied.flops_per_token(8) == untied.flops_per_token(8)
    outside_tables = parameter_count(tied) - tied.pos_emb.weight.numel()  # the head is the token table
    assert tied.flops_per_token(8) == 6 * outside_tables + 12 * 2 * 16 * 8


GPT_SHAPES = [  # (bias, tie_embeddings, activation)
    (True, True, "gelu"),
    (True, False, "gelu"),
    (False, True, "gelu"),
    (False, False, "gelu"),
    (True, True, "gelu_new"),
]


@pytest.mark.parametrize(
    "bias,tie,activation", GPT_SHAPES, ids=["gpt2", "untied", "no-bias", "no-bias-untied", "gelu_new"]
)
def test_gpt_exports_as_transformers_gpt2_with_its_logits_and_init_from_reads_it_back(bias, tie, activation, tmp_path):
    """The independent check that ours is GPT-2's architecture, and that its export is GPT-2's
    checkpoint: every weight drawn at random, written by the writer `harness.export` uses
    (GPT-2's names, Conv1D weights transposed, zero biases for a model without them, config.json
    with the model's GELU: exact, or GPT-2's tanh approximation), loaded by transformers'
    GPT2LMHeadModel with no key missing or left over, and the logits agree to float32 rounding
    (at these weights the other GELU would not). `model=gpt model.init_from=<export>` reads it
    back bit for bit, the architecture from its config.json (GPT-2 has biases: zero ones for a
    model without them)."""
    from transformers import GPT2LMHeadModel

    vocab, d, n_layer, n_head, seq = 96, 32, 2, 4, 24
    ours = GPT(n_layer, n_head, d, vocab, seq_len=seq, bias=bias, tie_embeddings=tie, activation=activation)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2 + (1 if p.dim() == 1 else 0))
    save_hf_weights(ours.eval(), tmp_path / "hf")
    theirs, loading = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading
    config = theirs.config
    shape = config.n_positions, config.n_embd, config.n_layer, config.n_head, config.vocab_size
    assert shape == (seq, d, n_layer, n_head, vocab)
    assert (config.activation_function, config.layer_norm_epsilon, config.tie_word_embeddings) == (
        activation,
        1e-5,
        tie,
    )
    assert (theirs.lm_head.weight is theirs.transformer.wte.weight) == tie
    logits = []
    ours.head.register_forward_hook(lambda module, args, out: logits.append(out))
    tokens = torch.randint(vocab, (3, seq), generator=generator)
    with torch.no_grad():
        ours(tokens, tokens)
        expected = theirs.eval()(input_ids=tokens).logits
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)

    cfg = make("model=gpt", f"model.init_from={tmp_path / 'hf'}", f"train.seq_len={seq}")
    adopt_init_from(cfg.model, explicit=set())
    architecture = {k: cfg.model[k] for k in ("n_layer", "n_head", "d_model", "vocab_size", "n_positions")}
    assert architecture == {"n_layer": 2, "n_head": 4, "d_model": 32, "vocab_size": 96, "n_positions": seq}
    assert (cfg.model.bias, cfg.model.tie_embeddings, cfg.model.activation) == (True, tie, activation)
    back = build_model(cfg.model, cfg.train.seq_len)
    materialize(back, CPU, seed=1, init_from=cfg.model.init_from)
    read = dict(back.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(read.pop(name), param), name
    assert all(name.endswith("bias") and not p.any() for name, p in read.items()), sorted(read)
    assert bool(read) != bias  # GPT-2's zero biases, where ours had none
