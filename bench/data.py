"""The token loader against training, its memory against the corpus size, and prepare against tokenizers.

What is measured, side by side in one run:
  loader     `data=tokens` (TokenShards + TokenStream, as a rank reads) on a generated corpus of
             `--big-gb` GB of uint16 tokens: tokens/s of `next_batch` at the default job's batch shape,
             median of `--rounds` rounds, against the tokens/s the default GPT trains at in this
             process (forward, backward, AdamW step; median of rounds): target >= 100x.
  memory     a fresh process per corpus (`--small-mb` MB and `--big-gb` GB) opens the dataset and
             reads `--batches` batches: its resident memory, anonymous (the process's own) and
             file-backed (mapped shard pages) apart: the target is anonymous memory that does not
             grow with the corpus.
  prepare    `python -m harness.prepare`'s tokens/s on one thread (num_proc=1) against
             `tokenizers`' own `encode_batch` on one thread, same tokenizer, same text (the standard
             library's sources, `--text-mb` MB): target >= 0.8x.

    python bench/data.py [--big-gb 2] [--small-mb 100] [--text-mb 8] [--rounds 5] [--batches 200]
    python bench/data.py --smoke   # 8 MB and 1 MB corpora, 0.25 MB of text, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from flags import above, at_least
from harness_runs import CONF, SMOKE_HELP, compose
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from harness.config import register_configs
from harness.data import TokenShards, TokenStream
from harness.data.shards import FORMAT, INDEX, shard_name
from harness.models import build_model, materialize
from harness.optim import build_optimizer

LOADER_TARGET, PREPARE_TARGET = 100.0, 0.8
VOCAB = 50304
SHARD_TOKENS = 2**27  # 256 MB per uint16 shard


def generate_corpus(root: Path, total_bytes: int) -> Path:
    """A harness.prepare-format dataset of random uint16 tokens, `total_bytes` of training shards."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train, left = [], total_bytes // 2
    while left > 0:
        n = min(SHARD_TOKENS, left)
        rng.integers(0, VOCAB, n, dtype=np.uint16).tofile(root / shard_name("train", len(train)))
        train.append({"file": shard_name("train", len(train)), "tokens": n, "documents": 1})
        left -= n
    rng.integers(0, VOCAB, 4096, dtype=np.uint16).tofile(root / shard_name("eval", 0))
    index = {"format": FORMAT, "dtype": "uint16", "vocab_size": VOCAB, "eot_id": 0, "tokenizer_sha256": None}
    index |= {"sources": [], "train": train, "eval": [{"file": shard_name("eval", 0), "tokens": 4096, "documents": 1}]}
    (root / INDEX).write_text(json.dumps(index))
    return root


def loader_tokens_per_s(root: Path, batch: int, seq_len: int, batches: int) -> float:
    stream = TokenStream(TokenShards(VOCAB, seed=0, path=str(root)), batch, seq_len, 0, 2, torch.device("cpu"))
    stream.source.open()
    start = time.perf_counter()
    for _ in range(batches):
        stream.next_batch()
    return batches * batch * seq_len / (time.perf_counter() - start)


def training_tokens_per_s(steps: int) -> float:
    """The default job's model and optimizer, one process, the default batch shape."""
    cfg = compose([])
    model = build_model(cfg.model, cfg.train.seq_len)
    materialize(model, torch.device("cpu"), 0)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), torch.device("cpu"))
    tokens = torch.randint(cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    start = time.perf_counter()
    for _ in range(steps):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * tokens[:, :-1].numel() / (time.perf_counter() - start)


def memory_of_reading(root: Path, batches: int) -> dict:
    """Resident memory (kB) of a fresh process after opening `root` and reading `batches` batches."""
    bench = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(bench)!r}); from data import read_and_report; "
    code += f"read_and_report({str(root)!r}, {batches})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def read_and_report(root: str, batches: int) -> None:
    loader_tokens_per_s(Path(root), 8, 256, batches)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    print(json.dumps({k: int(status[k].split()[0]) for k in ("RssAnon", "RssFile", "VmRSS")}))


def stdlib_text(megabytes: float) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for path in sorted(root.glob("*.py")):
        docs.append(path.read_text(errors="replace"))
        size += len(docs[-1])
        if size >= megabytes * 2**20:
            break
    return docs


def prepare_against_encode_batch(workdir: Path, megabytes: float, rounds: int) -> tuple[list[float], list[float]]:
    """tokens/s of harness.prepare (num_proc=1) and of tokenizers' encode_batch on the same text."""
    from tokenizers import Tokenizer

    from harness.prepare import prepare

    text_dir = workdir / "text"
    text_dir.mkdir()
    docs = stdlib_text(megabytes)
    for n, doc in enumerate(docs):
        (text_dir / f"{n:05d}.txt").write_text(doc)
    base = [f"input=[{text_dir}/*.txt]", "vocab_size=8192", "num_proc=1", "eval_fraction=0"]
    prepare(compose_prepare([*base, f"out={workdir / 'trained'}"]))  # trains the tokenizer both then use
    tokenizer_file = workdir / "trained" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ours, theirs = [], []

    def run_prepare(r: int) -> None:
        cfg = compose_prepare([*base, f"out={workdir / f'round{r}'}", f"tokenizer={tokenizer_file}"])
        start = time.perf_counter()
        index = prepare(cfg)
        ours.append(sum(s["tokens"] for s in index["train"]) / (time.perf_counter() - start))

    def run_encode_batch(r: int) -> None:
        start = time.perf_counter()
        encoded = tokenizer.encode_batch(docs)
        theirs.append(sum(len(e.ids) + 1 for e in encoded) / (time.perf_counter() - start))  # + end-of-text

    for r in range(rounds):  # the order alternates, to cancel drift
        for measure in (run_prepare, run_encode_batch) if r % 2 == 0 else (run_encode_batch, run_prepare):
            measure(r)
    return ours, theirs


def compose_prepare(overrides: list[str]):
    """conf/prepare.yaml with `overrides`, as `python -m harness.prepare` composes it."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hydra_compose("prepare", overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-gb", type=above(0), default=2.0)
    parser.add_argument("--small-mb", type=above(0), default=100.0)
    parser.add_argument("--text-mb", type=above(0), default=8.0)
    parser.add_argument("--rounds", type=at_least(1), default=5)
    parser.add_argument("--batches", type=at_least(1), default=200, help="batches read per loader round")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"  # tokenizers' thread pool, before its first use: one core for both
    if args.smoke:
        args.big_gb, args.small_mb, args.text_mb, args.rounds, args.batches = 8 / 1024, 1.0, 0.25, 1, 20
    cfg = compose([])
    batch, seq_len = cfg.train.batch_size, cfg.train.seq_len
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        big = generate_corpus(work / "big", int(args.big_gb * 2**30))
        small = generate_corpus(work / "small", int(args.small_mb * 2**20))
        loader, training = [], []
        for _ in range(args.rounds):
            loader.append(loader_tokens_per_s(big, batch, seq_len, args.batches))
            training.append(training_tokens_per_s(steps=3))
        memory = {"small": memory_of_reading(small, args.batches), "big": memory_of_reading(big, args.batches)}
        ours, theirs = prepare_against_encode_batch(work, args.text_mb, args.rounds)
    ratio = statistics.median(a / b for a, b in zip(loader, training))
    print(f"loader: {args.big_gb:g} GB of uint16 tokens, batch {batch} x {seq_len} per rank, {args.rounds} rounds")
    print(f"  loader {statistics.median(loader):,.0f} tok/s; the default GPT trains {statistics.median(training):,.0f}")
    verdict = "meets" if ratio >= LOADER_TARGET else "misses"
    print(f"  median ratio {ratio:,.0f}x ({verdict} the target >= {LOADER_TARGET:g}x)")
    print("memory after reading, kB: | corpus | RssAnon | RssFile | VmRSS |")
    for name, size in (("small", f"{args.small_mb:g} MB"), ("big", f"{args.big_gb:g} GB")):
        m = memory[name]
        print(f"  | {size} | {m['RssAnon']:,} | {m['RssFile']:,} | {m['VmRSS']:,} |")
    growth = memory["big"]["RssAnon"] / memory["small"]["RssAnon"]
    print(f"  anonymous memory, big / small corpus: {growth:.2f}x (the target: no growth with the corpus)")
    prepare_ratio = statistics.median(a / b for a, b in zip(ours, theirs))
    print(
        f"prepare, one thread, {args.text_mb:g} MB of text: {statistics.median(ours):,.0f} tok/s; tokenizers' "
        f"encode_batch {statistics.median(theirs):,.0f} tok/s; median ratio {prepare_ratio:.2f} "
        f"({'meets' if prepare_ratio >= PREPARE_TARGET else 'misses'} the target >= {PREPARE_TARGET})"
    )
    print("bench/data.py: done")


if __name__ == "__main__":
    main()
