"""`python -m harness.prepare` and `data=tokens` on small corpora the tests write:
real `datasets` streams, real `tokenizers` BPE training, real files; one real
CLI prepare + multi-rank training run."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.config import ConfigError, register_configs
from harness.data import TokenShards, TokenStream
from harness.data.tokens import Mixture, WindowOrder
from harness.prepare import prepare
from harness.validate import validate

from support import REPO, check_ok, read_metrics, run_cli

register_configs()
CPU = torch.device("cpu")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_corpus(root: Path) -> list[str]:
    """40 documents: 20 .txt files, 12 .jsonl records, 8 .parquet records. Returns their texts."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))) + f" doc{n}." for n in range(40)]
    (root / "txt").mkdir(parents=True)
    for n, text in enumerate(texts[:20]):
        (root / "txt" / f"{n:02d}.txt").write_text(text)
    with open(root / "records.jsonl", "w") as f:
        for n, text in enumerate(texts[20:32]):
            f.write(json.dumps({"id": n, "body": text}) + "\n")
    pd.DataFrame({"body": texts[32:]}).to_parquet(root / "records.parquet")
    return texts


def prepare_cfg(root: Path, out: Path, *overrides: str):
    inputs = f"input=[{root}/txt/*.txt,{root}/records.jsonl,{root}/records.parquet]"
    defaults = [inputs, f"out={out}", "text_field=body", "vocab_size=300", "docs_per_shard=6", "eval_fraction=0.2"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("prepare", overrides=[*defaults, *overrides])


def decode_documents(out: Path, split: str) -> list[str]:
    from tokenizers import Tokenizer

    index = json.loads((out / "index.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    docs = []
    for shard in index[split]:
        ids = np.fromfile(out / shard["file"], dtype=index["dtype"]).tolist()
        assert ids[-1] == index["eot_id"] and len(ids) == shard["tokens"]
        cut = [i for i, t in enumerate(ids) if t == index["eot_id"]]
        docs += [tokenizer.decode(ids[a + 1 if a else 0 : b]) for a, b in zip([0, *cut], cut)]
    return docs


def file_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".json")}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    texts = write_corpus(root)
    out = root / "prepared"
    prepare(prepare_cfg(root, out, "num_proc=1"))
    return root, out, texts


def test_prepare_round_trips_every_document_and_holds_some_out(dataset):
    """decode(encode(text)) gives each document back, each in exactly one split;
    the held-out share is about eval_fraction; the index describes the files."""
    _, out, texts = dataset
    train, held = decode_documents(out, "train"), decode_documents(out, "eval")
    assert sorted(train + held) == sorted(texts)
    assert not set(train) & set(held) and 2 <= len(held) <= 16  # 20 % of 40, drawn by a hash
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 300 and len(index["sources"]) == 22
    for shard in index["train"] + index["eval"]:  # the largest id, for loaders to check without a read
        assert shard["max_id"] == np.fromfile(out / shard["file"], dtype=index["dtype"]).max()
    assert [s["documents"] for s in index["train"]][:-1] == [6] * (len(index["train"]) - 1)


def test_shards_do_not_depend_on_threads_or_interruptions(dataset, tmp_path):
    """Two threads give the same bytes (tokenizer included) as one; a run interrupted after
    some shards (index.json and the last shard never written, a partial file left) and
    re-run finishes with the same bytes, rewriting only what is missing."""
    root, out, _ = dataset
    two = tmp_path / "two"
    prepare(prepare_cfg(root, two, "num_proc=2"))
    assert file_bytes(two) == file_bytes(out)
    index = json.loads((two / "index.json").read_text())
    kept = two / index["train"][0]["file"]
    before = kept.stat().st_mtime_ns
    (two / "index.json").unlink()
    (two / index["train"][-1]["file"]).unlink()
    (two / "train_00001.bin.partial").write_bytes(b"\x00" * 7)  # a write cut short
    prepare(prepare_cfg(root, two, "num_proc=2"))
    assert file_bytes(two) == file_bytes(out)
    assert kept.stat().st_mtime_ns == before  # not rewritten


def source(out: Path, **kwargs) -> TokenShards:
    shards = TokenShards(vocab_size=300, seed=5, path=str(out), **kwargs)
    shards.open()
    return shards


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_read_one_global_sequence_across_epochs_and_resume_exactly(dataset, world_size):
    """Rank r of w reads its slice of one global sequence (the union of a step is one
    process's batch of w·B); 30 steps pass several epoch boundaries; a stream stopped
    at step 7 and resumed on another world size continues with the next samples."""
    _, out, _ = dataset
    single = TokenStream(source(out), 8, 48, 0, 1, CPU)
    ranks = [TokenStream(source(out), 8 // world_size, 48, r, world_size, CPU) for r in range(world_size)]
    windows = int(single.source.splits[0]["train"].windows(49)[-1])
    assert 30 * 8 > 3 * windows  # several epochs
    expected = [single.next_batch()[0] for _ in range(30)]
    for step in range(30):
        got = torch.cat([s.next_batch()[0] for s in ranks])
        assert torch.equal(got, expected[step]), step
        if step == 6:
            state = ranks[0].state_dict()
            ranks = [TokenStream(source(out), 4, 48, r, 2, CPU) for r in range(2)]  # resumed on 2 ranks
            for s in ranks:
                s.load_state_dict(state)
    epochs = [single.source.samples(e * windows, windows, 49) for e in range(2)]
    assert sorted(map(tuple, epochs[0].tolist())) == sorted(map(tuple, epochs[1].tolist()))  # each epoch: all windows
    assert not torch.equal(epochs[0], epochs[1])  # in another order


def test_window_order_is_a_permutation_keyed_by_seed_and_epoch():
    for n in (1, 2, 7, 1000, 4097):
        order = WindowOrder(n, seed=3, epoch=0)(np.arange(n))
        assert sorted(order.tolist()) == list(range(n))
    a, b, c = (WindowOrder(1000, s, e)(np.arange(1000)) for s, e in [(3, 0), (3, 1), (4, 0)])
    assert not np.array_equal(a, b) and not np.array_equal(a, c)


def test_mixture_keeps_its_weights_and_counts_exactly():
    """70/30: every block of 1024 samples holds 717 and 307 (within one sample of the
    weights), each source's own indices run 0, 1, 2, ... without gaps, and the counts
    the dashboard gets equal a count of the samples dealt."""
    mixture = Mixture([0.7, 0.3], seed=1)
    dealt = [mixture.locate(i) for i in range(5000)]
    for s in (0, 1):
        within = [w for src, w in dealt if src == s]
        assert within == list(range(len(within)))
    assert mixture.samples_per_source(4096) == [4 * 717, 4 * 307]  # whole blocks: 0.7002 and 0.2998
    for n in (0, 1, 1023, 1024, 3333, 5000):
        assert mixture.samples_per_source(n) == [sum(1 for src, _ in dealt[:n] if src == s) for s in (0, 1)]


def test_nanogpt_train_and_val_bins_are_read_as_they_are(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) * 7 % 50000
    tokens.tofile(tmp_path / "train.bin")
    tokens[:300].tofile(tmp_path / "val.bin")
    shards = TokenShards(vocab_size=50304, seed=0, path=str(tmp_path), format="nanogpt")
    shards.open()
    rows = shards.samples(0, 58, 17)  # 1000 // 17 = 58 windows: one epoch
    starts = sorted(int(np.flatnonzero(tokens == row[0])[0]) for row in rows.numpy().astype(np.uint16))
    assert starts == [17 * w for w in range(58)]
    assert torch.equal(shards.eval_samples([0], 17)[0], torch.from_numpy(tokens[:17].astype(np.int64)))
    assert shards.eval_windows(17) == 300 // 17


def test_a_batch_with_an_id_the_model_does_not_embed_names_its_shard(dataset, tmp_path):
    """An index whose vocabulary is below its shards' ids, without prepare's recorded largest ids: the first
    batch read says so, naming the shard and the fix, where the embedding raised an IndexError."""
    from harness.data.shards import TokenIdsOutOfRange

    out = tmp_path / "copy"
    shutil.copytree(dataset[1], out)
    break_dataset(out, "index vocabulary below its ids, unrecorded")
    shards = TokenShards(vocab_size=256, seed=0, path=str(out))
    assert shards.preflight_errors(17, evaluates=False) == []
    shards.open()
    with pytest.raises(TokenIdsOutOfRange, match=r"shard .*\.bin holds token id \d+, but the model embeds ids below"):
        shards.samples(0, 8, 17)


def break_dataset(out: Path, case: str) -> None:
    index = json.loads((out / "index.json").read_text())
    if case == "truncated shard":
        path = out / index["train"][1]["file"]
        path.write_bytes(path.read_bytes()[:-6])
    elif case == "index not matching":
        index["train"][0]["tokens"] += 1
        (out / "index.json").write_text(json.dumps(index))
    elif case == "nanogpt ids above the vocabulary":
        (np.arange(1000, dtype=np.uint16) % 300).tofile(out / "train.bin")
        np.arange(100, dtype=np.uint16).tofile(out / "val.bin")
    elif case.startswith("index vocabulary below its ids"):  # a hand-edited index, with or without prepare's max_id
        index["vocab_size"] = 256
        if case.endswith("unrecorded"):
            for shard in index["train"] + index["eval"]:
                del shard["max_id"]
        (out / "index.json").write_text(json.dumps(index))
    elif case == "dtype too small":
        index["vocab_size"] = 70000
        (out / "index.json").write_text(json.dumps(index))
    elif case.startswith("nanogpt too short"):  # train.bin of 10 tokens, or a val.bin shorter than a window
        (np.arange(10 if case.endswith("train.bin") else 1000, dtype=np.uint16) % 300).tofile(out / "train.bin")
        np.arange(10, dtype=np.uint16).tofile(out / "val.bin")


LOADER_CASES = [
    ("truncated shard", [], ["shard train_00001.bin holds", "truncated", "Fix: re-run python -m harness.prepare"]),
    ("index not matching", [], ["shard train_00000.bin holds", "its index says", "Fix:"]),
    ("dtype too small", ["model.vocab_size=70016"], ["its shards are uint16", "cannot hold token ids up to 69999"]),
    (  # the largest id harness.prepare recorded per shard, against the index's vocabulary
        "index vocabulary below its ids",
        ["model.vocab_size=256"],
        ["shard train_00000.bin holds token ids up to", "beyond the vocabulary of 256 its index.json says"],
    ),
    ("vocabulary", ["model.vocab_size=256"], ["holds token ids up to 299", "Fix: model.vocab_size=300"]),
    (
        "nanogpt ids above the vocabulary",
        ["data.format=nanogpt", "model.vocab_size=256"],
        ["train.bin holds token ids up to 299, more than model.vocab_size=256", "Fix: model.vocab_size=300 or more"],
    ),
    (
        "nanogpt too short: train.bin",
        ["data.format=nanogpt"],
        ["train.bin holds 10 tokens, fewer than one window of train.seq_len+1=65 tokens", "Fix: lower train.seq_len"],
    ),
    (
        "nanogpt too short: val.bin",
        ["data.format=nanogpt", "train.eval_every=5"],
        ["val.bin holds 10 tokens", "could not evaluate", "or train.eval_every=0"],
    ),
    ("a file, not a directory", ["data.path={out}/train_00000.bin"], ["is a file, not a dataset directory", "Fix:"]),
    (
        "infinite weight",
        ["data.path=null", "data.sources=[{path: {out}, weight: inf}, {path: {out}, weight: 1}]"],
        ["data.sources[0]=", "weight: <positive finite number>", "Fix:"],
    ),
]


@pytest.mark.parametrize("case,overrides,expected", LOADER_CASES, ids=[c[0] for c in LOADER_CASES])
def test_data_that_does_not_fit_is_refused_before_any_rank_starts(dataset, tmp_path, case, overrides, expected):
    from harness.preflight import preflight

    out = tmp_path / "copy"
    shutil.copytree(dataset[1], out)
    break_dataset(out, case)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        overrides = [o.replace("{out}", str(out)) for o in overrides]
        cfg = compose("config", overrides=["data=tokens", f"data.path={out}", "model.vocab_size=320", *overrides])
    try:  # validate reads the index (the vocabulary), preflight the files (as the launcher calls them)
        validate(cfg, world_size=2, gpus=0)
        message = "\n".join(preflight(cfg, tmp_path / "run", None))
    except ConfigError as e:
        message = str(e)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"


PREPARE_CASES = [
    ("glob matches nothing", ["input=[{root}/nothing/*.txt]"], ["matches no file", "Fix:"]),
    ("text field missing", ["text_field=content"], ["text_field='content' is not a field", "body", "Fix:"]),
    ("empty corpus", ["input=[{root}/empty/*.txt]"], ["holds no text", "Fix:"]),
    ("another tokenizer", ["vocab_size=280"], ["holds shards prepared with other settings", "vocab_size", "Fix:"]),
    ("out inside a file", ["out={tmp}/a_file/data"], ["out='{tmp}/a_file/data' is inside", "a file", "Fix:"]),
    (
        "a binary input",
        ["input=[{root}/txt/*.txt,{root}/mixed/*]"],
        ["{root}/mixed/blob.txt (byte 0x80 near offset 128 is not UTF-8)", "Fix:", "skip_undecodable=true"],
    ),
    ("BPE below the bytes", ["vocab_size=10"], ["vocab_size=10 is below", "257 tokens", "Fix: vocab_size=257"]),
    ("not a tokenizer", ["tokenizer={root}/records.jsonl"], ["is not a Hugging Face tokenizers file", "Fix:"]),
    (
        "eot not in the tokenizer",
        ["tokenizer={out}/tokenizer.json", "eot_token='</s>'"],
        ["eot_token='</s>' is not a token", "its special tokens: <|endoftext|>", "Fix:"],
    ),
]


def write_mixed(root: Path) -> None:
    """A folder of one text file and one binary file (every byte value) named .txt."""
    (root / "mixed").mkdir(exist_ok=True)
    (root / "mixed" / "notes.txt").write_text("plain text " * 20)
    (root / "mixed" / "blob.txt").write_bytes(bytes(range(256)) * 4)


@pytest.mark.parametrize("case,overrides,expected", PREPARE_CASES, ids=[c[0] for c in PREPARE_CASES])
def test_bad_prepare_input_is_refused_with_the_fix(dataset, tmp_path, case, overrides, expected):
    """Refused before anything is written: `out` is not created (nor changed, when it exists)."""
    root, out, _ = dataset
    (root / "empty").mkdir(exist_ok=True)
    (root / "empty" / "blank.txt").write_text("")
    write_mixed(root)
    (tmp_path / "a_file").write_text("not a folder")
    target = tmp_path / "out" if case != "another tokenizer" else out
    before, files_before = file_bytes(out), sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as info:
        prepare(prepare_cfg(root, target, *[o.format(root=root, out=out, tmp=tmp_path) for o in overrides]))
    for text in expected:
        text = text.format(root=root, tmp=tmp_path)
        assert text in str(info.value), f"{text!r} not in:\n{info.value}"
    assert file_bytes(out) == before
    assert sorted(tmp_path.rglob("*")) == files_before, "a refused prepare wrote files"


def test_one_input_path_and_skipping_undecodable_files(dataset, tmp_path):
    """`input` may be one glob (not a list); skip_undecodable=true leaves out the binary file, and only it."""
    root, _, _ = dataset
    write_mixed(root)
    out = tmp_path / "out"
    index = prepare(prepare_cfg(root, out, f"input={root}/mixed/*", "skip_undecodable=true", "eval_fraction=0"))
    assert [s["file"] for s in index["sources"]] == [str(root / "mixed" / "notes.txt")]
    assert decode_documents(out, "train") == ["plain text " * 20]


def run_on_a_terminal(command: list[str], env: dict, cwd: Path) -> str:
    """What `command` writes to a terminal (a pseudo-terminal 120 columns wide, so tqdm draws)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(command, stdin=child, stdout=child, stderr=child, env=env, cwd=cwd)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=240) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_prepare_shows_one_progress_bar_per_phase_on_a_terminal_and_none_off_it(dataset, tmp_path, cli_env):
    root, _, _ = dataset
    inputs = f"input=[{root}/txt/*.txt,{root}/records.jsonl,{root}/records.parquet]"
    command = [sys.executable, "-m", "harness.prepare", inputs, "text_field=body", "vocab_size=300"]
    shown = run_on_a_terminal([*command, f"out={tmp_path}/tty"], cli_env, tmp_path)
    # a bar's last drawing ends its line (tqdm's close; the terminal writes \r\n); redrawings before it end in \r
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in shown.split("\n")]
    bars = [line for line in lines if re.search(r"\[\d\d:\d\d", line)]
    phases = ["checking the input is UTF-8 text", "training a BPE of 300 tokens", f"tokenizing into {tmp_path}/tty"]
    assert [bar.split(":")[0] for bar in bars] == phases, shown
    assert "merging pairs" in bars[1] and "Resolving data files" not in shown, shown
    proc = subprocess.run([*command, f"out={tmp_path}/pipe"], capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    check_ok(proc)
    assert not re.search(r"\[\d\d:\d\d", proc.stdout + proc.stderr), proc.stderr


@pytest.mark.slow
def test_prepare_cli_then_two_ranks_train_on_a_mixture(dataset, tmp_path, cli_env):
    """The real commands: python -m harness.prepare writes a second dataset with the
    first one's tokenizer; python train.py trains 2 ranks on a 70/30 mixture of the
    two, scores every window of each held-out split (`train.eval_batches=all`), and
    logs the tokens read from each."""
    root, out, _ = dataset
    other = tmp_path / "other"
    args = [f"input=[{root}/txt/*.txt]", f"out={other}", f"tokenizer={out}/tokenizer.json", "docs_per_shard=4"]
    command = [sys.executable, "-m", "harness.prepare", *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=cli_env)
    check_ok(proc)
    assert f"train with data=tokens data.path={other} model.vocab_size=300" in proc.stdout
    assert not list(tmp_path.glob("*.log"))  # nothing written next to the command
    run = tmp_path / "run"
    sources = f"data.sources=[{{path: {out}, weight: 0.7}}, {{path: {other}, weight: 0.3}}]"
    train = ["model=mlp", "data=tokens", sources, "model.vocab_size=300", "train.seq_len=16", "train.batch_size=4"]
    train += ["train.steps=8", "train.log_every=1", "train.eval_every=4", "train.eval_batches=all", "launcher.nproc=2"]
    check_ok(run_cli([*train, f"hydra.run.dir={run}"], cli_env, tmp_path))
    rows = read_metrics(run)
    last = rows[-1]
    read = last[f"data/tokens/{out.name}"] + last[f"data/tokens/{other.name}"]
    assert read == 8 * 2 * 4 * 17  # every token read, from one source or the other
    assert 0.5 < last[f"data/tokens/{out.name}"] / read < 0.9
    evaluated = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evaluated] == [4, 8]
    for r in evaluated:  # each source scored on its own held-out shards; eval/loss their weighted mean
        a, b = r[f"eval/loss/{out.name}"], r[f"eval/loss/{other.name}"]
        assert a != b and r["eval/loss"] == pytest.approx(0.7 * a + 0.3 * b, rel=1e-9)
