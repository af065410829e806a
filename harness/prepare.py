"""Local raw text to token shards that `data=tokens` reads:

    python -m harness.prepare input=[<files or globs>] out=<dir> [tokenizer=<file or model dir>] [key=value ...]

Documents are read with Hugging Face `datasets` in streaming mode (memory does
not grow with the corpus): a `.jsonl`/`.json`/`.parquet` record is one
(`text_field`), any other file (`.txt`, `.py`, ...) is one document of plain
text. They are tokenized with a local
Hugging Face `tokenizers` file, or with a byte-level BPE of `vocab_size`
trained on the corpus itself by `tokenizers`' trainer and saved next to the
shards; `encode_batch_fast` runs on `num_proc` threads (tokenizers' thread
pool, sized when the process first uses it). A document is held out
(eval shards) when a hash of its number and `seed` falls below
`eval_fraction`; every `docs_per_shard` documents of a split make one shard, so
the shards depend on the corpus and the settings alone, not on the threads or
on interruptions. Each shard is written to a temporary name, fsynced and
renamed, and `index.json` last: a re-run skips the shards already written and
finishes the rest; a directory prepared with another tokenizer or other
settings is refused. Everything that can be checked (the settings, the
inputs - each file must be UTF-8 text unless it is a `.parquet` file, and
some document must hold text -, `out`, the tokenizer) is checked before `out`
is created, so a refused run leaves nothing a later run would trust. Format:
harness/data/shards.py; docs/data.md.
"""

from __future__ import annotations

import codecs
import glob as globlib
import itertools
import json
import logging
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from harness.config import ConfigError, PrepareConf, register_configs
from harness.data.shards import FORMAT, INDEX, SPLITS, sha256_of, shard_errors, shard_name, token_dtype, write_durably
from harness.overrides import override_errors

log = logging.getLogger(__name__)

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # any other file is plain text
SETTINGS = "prepare.json"  # what the shards in a directory were made with, written before the first shard
NEEDS = 'harness.prepare needs Hugging Face datasets and tokenizers. Fix: pip install -e ".[data]".'


def quiet() -> bool:
    """No progress display when stderr is not a terminal (a log file, a CI job)."""
    return not sys.stderr.isatty()


def patterns(cfg: DictConfig) -> list[str]:
    """`input` as a list: one path or glob (what users type first) is a list of one."""
    return [str(p) for p in cfg.input] if isinstance(cfg.input, ListConfig) else [str(cfg.input)]


def setting_errors(cfg: DictConfig) -> list[str]:
    """The keys that are wrong whatever the files hold."""
    from tokenizers import pre_tokenizers

    errors = []
    if not 0.0 <= cfg.eval_fraction < 1.0 or cfg.docs_per_shard < 1:
        errors.append(
            f"eval_fraction={cfg.eval_fraction} must be in [0, 1) and docs_per_shard={cfg.docs_per_shard} >= 1. "
            "Fix: eval_fraction=0.01 docs_per_shard=4096."
        )
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + 1  # every byte, and eot_token
    if cfg.tokenizer is None and cfg.vocab_size < smallest:
        errors.append(
            f"vocab_size={cfg.vocab_size} is below the smallest byte-level BPE, {smallest} tokens (the 256 bytes "
            f"and eot_token), which would be trained instead. Fix: vocab_size={smallest} or more (e.g. 8192)."
        )
    return errors


def out_errors(cfg: DictConfig) -> list[str]:
    """`out` must be a directory, or a path one can be created at."""
    out = Path(cfg.out).expanduser()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out else f"is inside {str(existing)!r}, which is a file"
        return [f"out={cfg.out!r} {where}, not a directory. Fix: out=<a new directory, or one prepared before>."]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"out={cfg.out!r}: {str(existing)!r} cannot be written to. Fix: out=<a directory you can write to>."]
    return []


def input_files(cfg: DictConfig) -> list[Path]:
    """The files `input` names, sorted; ConfigError for a pattern that matches nothing."""
    files, errors = [], []
    for pattern in patterns(cfg):
        matched = sorted(p for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matched:
            errors.append(f"input={pattern!r} matches no file. Fix: check the path or pattern ('**' recurses).")
        files += [Path(p) for p in matched]
    if errors:
        raise ConfigError("\n\n".join(errors))
    return sorted(set(files))


def undecodable(path: Path, progress) -> str | None:
    """Why `path` is not UTF-8 text (None: it is), read in blocks (memory does not grow with the file)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                progress.update(path.stat().st_size - offset)  # the rest of the file, unread
                return f"byte 0x{e.object[e.start]:02x} near offset {offset + e.start} is not UTF-8"
            offset += len(block)
            progress.update(len(block))
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "it ends inside a UTF-8 character"
    return None


def text_files(files: list[Path], skip_undecodable: bool) -> list[Path]:
    """`files` without those that are not UTF-8 text (skipped with a warning, or refused naming them).
    Parquet files are binary, their strings UTF-8 by format; JSON must be UTF-8 (RFC 8259)."""
    from tqdm import tqdm

    checked = [f for f in files if BUILDERS.get(f.suffix) != "parquet"]
    total = sum(f.stat().st_size for f in checked)
    with tqdm(total=total, unit="B", unit_scale=True, desc="checking the input is UTF-8 text", disable=quiet()) as bar:
        bad = {f: why for f in checked if (why := undecodable(f, bar))}
    if not bad:
        return files
    listed = "; ".join(f"{f} ({why})" for f, why in itertools.islice(bad.items(), 5))
    listed += f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    if skip_undecodable:
        log.warning("skipping %d input file(s) that are not UTF-8 text (skip_undecodable=true): %s", len(bad), listed)
        return [f for f in files if f not in bad]
    raise ConfigError(
        f"input: {len(bad)} file(s) are not UTF-8 text (binary files among the inputs?): {listed}. Fix: narrow "
        "input to text files (e.g. '**/*.txt'), or skip_undecodable=true to skip such files."
    )


def documents(files: list[Path], text_field: str) -> Iterator[str]:
    """Every document of `files`, in file order, streamed through `datasets`."""
    from datasets import load_dataset

    for builder, group in itertools.groupby(files, key=lambda p: BUILDERS.get(p.suffix, "text")):
        paths = [str(p) for p in group]
        extra = {"sample_by": "document"} if builder == "text" else {}
        records = load_dataset(builder, data_files=paths, split="train", streaming=True, **extra)
        field = "text" if builder == "text" else text_field
        for number, record in enumerate(records):
            if number == 0 and field not in record:
                raise ConfigError(
                    f"text_field={field!r} is not a field of the records in {paths[0]} (it has: "
                    f"{', '.join(record)}). Fix: text_field=<the field holding the text>."
                )
            if record[field]:
                yield record[field]


def held_out(number: int, seed: int, fraction: float) -> bool:
    return zlib.crc32(f"{seed}/{number}".encode()) < fraction * 2**32


def given_tokenizer(cfg: DictConfig):
    """`tokenizer`'s file, loaded and checked before anything is written; None when tokenizer=null."""
    from tokenizers import Tokenizer

    if cfg.tokenizer is None:
        return None
    model_tokenizer(cfg)
    path = Path(cfg.tokenizer).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"tokenizer={cfg.tokenizer!r} is not a file. Fix: a tokenizer.json, a Hugging Face model directory, "
            "or tokenizer=null."
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
        raise ConfigError(
            f"tokenizer={cfg.tokenizer!r} is not a Hugging Face tokenizers file ({e}). Fix: the model's "
            "tokenizer.json, or tokenizer=null to train a BPE on the corpus."
        ) from None
    if tokenizer.token_to_id(cfg.eot_token) is None:
        special = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        raise ConfigError(
            f"eot_token={cfg.eot_token!r} is not a token of tokenizer={cfg.tokenizer!r} (its special tokens: "
            f"{', '.join(special) or 'none'}). Fix: eot_token=<its end-of-text token> (e.g. '</s>' or "
            "'<|end_of_text|>')."
        )
    return tokenizer


def model_tokenizer(cfg: DictConfig) -> None:
    """`tokenizer=<a Hugging Face model directory>`: its tokenizer.json, and its end-of-text token
    (tokenizer_config.json's eos_token) unless `eot_token` was set; the directory's tokenizer_config.json
    is kept next to the shards (its special tokens), for `harness.export`. In place; ConfigError for a
    directory without tokenizer.json."""
    if cfg.tokenizer is None or not Path(cfg.tokenizer).expanduser().is_dir():
        return
    model = Path(cfg.tokenizer).expanduser()
    if not (model / "tokenizer.json").is_file():
        raise ConfigError(
            f"tokenizer={cfg.tokenizer!r} is a directory without tokenizer.json (a slow tokenizer's files, or not "
            "a model's directory). Fix: a model directory with tokenizer.json (save_pretrained of a fast "
            "tokenizer writes it), a tokenizer.json file, or tokenizer=null."
        )
    cfg.tokenizer = str(model / "tokenizer.json")
    config = model / "tokenizer_config.json"
    eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos and cfg.eot_token == PrepareConf.eot_token:
        cfg.eot_token = eos
        log.info("end-of-text token: %r, the model's eos_token", eos)


def load_tokenizer(cfg: DictConfig, files: list[Path], out: Path, given):
    """The tokenizer: `given` (`tokenizer`'s file), else the BPE in `out` from an earlier (interrupted) run
    with the same settings, else a byte-level BPE trained on the corpus now. Saved as out/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tqdm import tqdm

    saved = out / "tokenizer.json"
    if given is not None:
        path = Path(cfg.tokenizer).expanduser()
        if not saved.exists():
            write_durably(saved, path.read_bytes())
        if (path.parent / "tokenizer_config.json").is_file() and not (out / "tokenizer_config.json").exists():
            write_durably(out / "tokenizer_config.json", (path.parent / "tokenizer_config.json").read_bytes())
        return given
    if saved.exists():
        return Tokenizer.from_file(str(saved))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[cfg.eot_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its own bars, several for the one phase: ours covers it
    )
    log.info("training a byte-level BPE of %d tokens on the corpus", cfg.vocab_size)
    progress = tqdm(unit="doc", desc=f"training a BPE of {cfg.vocab_size} tokens", disable=quiet())

    def read() -> Iterator[str]:
        for text in documents(files, cfg.text_field):
            progress.update()
            yield text
        progress.set_postfix_str("merging pairs")  # after the last document, tokenizers computes the merges

    tokenizer.train_from_iterator(read(), trainer=trainer)
    progress.close()
    write_durably(saved, tokenizer.to_str().encode())
    return tokenizer


def claim(out: Path, settings: dict) -> None:
    """Refuse an output directory made with other settings or another tokenizer; else record ours."""
    path = out / SETTINGS
    if path.exists():
        before = json.loads(path.read_text())
        if before != settings:
            differ = sorted(k for k in settings.keys() | before.keys() if before.get(k) != settings.get(k))
            raise ConfigError(
                f"out={str(out)!r} holds shards prepared with other settings ({', '.join(differ)} differ"
                + (", another tokenizer" if "tokenizer_sha256" in differ else "")
                + "); mixing them would make one dataset of two. Fix: a new out directory, or delete that one."
            )
    elif any(out.glob("*.bin")):
        raise ConfigError(f"out={str(out)!r} holds .bin files harness.prepare did not write. Fix: a new out directory.")
    else:
        write_durably(path, json.dumps(settings, indent=2).encode())


def prepare(cfg: DictConfig) -> dict:
    """Write the dataset `cfg` describes (see the module's docstring); returns its index."""
    try:
        import datasets
        import tokenizers  # noqa: F401
    except ImportError:
        raise ConfigError(NEEDS) from None
    datasets.disable_progress_bars()  # "Resolving data files" once per file type and pass: ours show the phases
    if missing := sorted(OmegaConf.missing_keys(cfg)):
        raise ConfigError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required. Fix: python -m "
            "harness.prepare input=<a file, glob or [list] of them> out=<the dataset directory to write>."
        )
    errors, files, given = setting_errors(cfg) + out_errors(cfg), [], None
    try:  # every wrong key at once
        files = input_files(cfg)
    except ConfigError as e:
        errors.append(str(e))
    try:
        given = given_tokenizer(cfg)
    except ConfigError as e:
        errors.append(str(e))
    if errors:
        raise ConfigError("\n\n".join(errors))
    os.environ["RAYON_NUM_THREADS"] = str(cfg.num_proc or os.cpu_count())  # tokenizers' thread pool
    files = text_files(files, cfg.skip_undecodable)
    # the first document with text: a missing text_field, or a corpus without text, is refused here
    if next(documents(files, cfg.text_field), None) is None:
        raise ConfigError(f"input={patterns(cfg)} holds no text (no non-empty document). Fix: point it at text.")
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_hash = sha256_of(Path(cfg.tokenizer).expanduser()) if cfg.tokenizer is not None else None
    settings = {
        **{k: cfg[k] for k in ("text_field", "eot_token", "eval_fraction", "docs_per_shard", "seed")},
        "tokenizer_sha256": tokenizer_hash,
        "vocab_size": None if cfg.tokenizer is not None else cfg.vocab_size,
    }
    claim(out, settings)
    tokenizer = load_tokenizer(cfg, files, out, given)
    vocab, eot = tokenizer.get_vocab_size(), tokenizer.token_to_id(cfg.eot_token)
    dtype = token_dtype(vocab)
    index = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": vocab,
        "eot_id": eot,
        "tokenizer_sha256": sha256_of(out / "tokenizer.json"),
        "sources": [{"file": str(f.resolve()), "bytes": f.stat().st_size} for f in files],
        "train": [],
        "eval": [],
    }
    write_shards(cfg, files, tokenizer, eot, dtype, out, index)
    if not index["train"]:
        raise ConfigError(
            f"input={patterns(cfg)}: every document was held out (eval_fraction={cfg.eval_fraction}). "
            "Fix: a lower eval_fraction, or more documents."
        )
    errors = shard_errors(out, index)
    if errors:
        raise ConfigError("\n".join(errors))
    write_durably(out / INDEX, json.dumps(index, indent=2).encode())
    return index


def write_shards(cfg, files, tokenizer, eot: int, dtype: np.dtype, out: Path, index: dict) -> None:
    """Tokenize the documents into shards of `docs_per_shard` documents per split, skipping
    shards that an earlier run wrote (a rename makes each whole or absent)."""
    from tqdm import tqdm

    pending = {split: [] for split in SPLITS}
    progress = tqdm(unit="tok", unit_scale=True, desc=f"tokenizing into {out}", disable=quiet())

    def flush(split: str) -> None:
        docs, number = pending[split], len(index[split])
        path = out / shard_name(split, number)
        if path.exists():  # written by an earlier run: renamed into place whole
            array = np.memmap(path, dtype=dtype, mode="r")
        else:
            # encode_batch_fast: the ids without the offsets, which nothing here needs
            ids = [ids + [eot] for ids in (e.ids for e in tokenizer.encode_batch_fast(docs))]
            array = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype)
            write_durably(path, array.tobytes())
            progress.update(len(array))
        # the largest id, which a loader checks against the vocabulary without reading the shard
        shard = {"file": path.name, "tokens": len(array), "documents": len(docs), "max_id": int(array.max())}
        index[split].append(shard)
        pending[split] = []

    for number, text in enumerate(documents(files, cfg.text_field)):
        split = "eval" if held_out(number, cfg.seed, cfg.eval_fraction) else "train"
        pending[split].append(text)
        if len(pending[split]) == cfg.docs_per_shard:
            flush(split)
    for split in SPLITS:
        if pending[split]:
            flush(split)
    progress.close()


@hydra.main(config_path="../conf", config_name="prepare", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        index = prepare(cfg)
    except ConfigError as e:
        print(f"harness.prepare: {e}", file=sys.stderr)
        sys.exit(2)
    tokens = {split: sum(s["tokens"] for s in index[split]) for split in SPLITS}
    print(
        f"{cfg.out}: {tokens['train']:,} training and {tokens['eval']:,} held-out tokens in "
        f"{len(index['train'])} + {len(index['eval'])} shards ({index['dtype']}, vocabulary {index['vocab_size']:,}); "
        f"train with data=tokens data.path={cfg.out} model.vocab_size={index['vocab_size']}"
    )


if __name__ == "__main__":
    register_configs()
    # Hydra's own composition errors name no fix: bad overrides get train.py's paragraphs
    if errors := override_errors(sys.argv, Path(__file__).parents[1] / "conf", "prepare"):
        print("\n\n".join(errors), file=sys.stderr)
        sys.exit(2)
    main()
