"""Data slicing/determinism and layout-independent model init (in-process, fast)."""

from __future__ import annotations

import os

import numpy as np
import torch
from omegaconf import OmegaConf

from harness.data import TextTokens, TokenStream, build_data
from harness.models import build_model, materialize

CPU = torch.device("cpu")


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
    a = stream(2, 1, 4)
    batches = [a.next_batch()[0] for _ in range(5)]
    b = stream(2, 1, 4)
    b.load_state_dict({"samples": 3 * 2 * 4})
    assert torch.equal(b.next_batch()[0], batches[3])
    assert a.state_dict() == {"samples": 5 * 2 * 4}


def test_position_carries_over_to_another_world_size_without_gaps_or_repeats():
    old = [stream(4, r, 2) for r in range(4)]
    seen = [s.next_batch()[0] for s in old]  # one step on 4 ranks: samples 0..7
    new = [stream(2, r, 2) for r in range(2)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    seen += [s.next_batch()[0] for s in new]  # one step on 2 ranks: samples 8..11
    assert torch.equal(torch.cat(seen), stream(1, 0, 12).next_batch()[0])


def test_synthetic_tokens_follow_a_learnable_pattern():
    source = stream(1, 0, 1).source
    seqs = source.samples(0, 64, 65)
    follows = (seqs[:, 1:] == source.next_token[seqs[:, :-1]]).float().mean().item()
    assert 0.85 < follows < 0.95  # noise=0.1 breaks about one token in ten


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
    held_out = {tuple(w.tolist()) for k in range(4) for w in s.eval_batch(k)[0]}
    assert held_out and not held_out & {tuple(w.tolist()) for w in windows}  # never trained on
    assert torch.equal(s.eval_batch(0)[0], s.eval_batch(0)[0])  # the same batches every pass


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
