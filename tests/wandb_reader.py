"""Minimal reader for wandb offline run files (``run-<id>.wandb``), for tests.

This depends on wandb's *internal*, undocumented on-disk format; wandb 0.31
ships no public reader (``wandb.sdk.internal.datastore`` is gone). That is why
pyproject pins ``wandb>=0.31,<0.32``: re-check this module when bumping it.

Format (as written by wandb-core 0.31):

* a 7-byte file header: ``b":W&B"``, magic ``0xBEE1`` (u16 little-endian),
  version ``0`` (u8);
* then LevelDB-log framing: the file is cut into 32 KiB blocks counted from
  offset 0 (the first block includes the file header). Each block holds
  chunks ``<crc32 u32 LE><length u16 LE><type u8><data>``, type FULL=1,
  FIRST=2, MIDDLE=3, LAST=4. The crc is plain ``zlib.crc32`` of the type byte
  followed by the data. A block tail shorter than a chunk header (7 bytes) is
  zero padding;
* each reassembled record is a ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK_LEN = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

__all__ = ["find_run_files", "iter_records", "read_run"]


def find_run_files(root: str | Path) -> list[Path]:
    """All ``run-*.wandb`` files below ``root`` (recursively), sorted."""
    return sorted(Path(root).rglob("run-*.wandb"))


def _iter_chunks(data: bytes, path: Path):
    """Yield (type, payload) for every chunk; ValueError on any damage."""
    pos = FILE_HEADER.size
    while pos < len(data):
        left_in_block = BLOCK_LEN - pos % BLOCK_LEN
        if left_in_block < CHUNK_HEADER.size:  # block trailer: zero padding
            if data[pos : pos + left_in_block].strip(b"\0"):
                raise ValueError(f"{path}: non-zero block padding at {pos}")
            pos += left_in_block
            continue
        if len(data) - pos < CHUNK_HEADER.size:
            raise ValueError(f"{path}: truncated chunk header at {pos}")
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        start = pos + CHUNK_HEADER.size
        if kind not in (FULL, FIRST, MIDDLE, LAST):
            raise ValueError(f"{path}: bad chunk type {kind} at {pos}")
        if length > left_in_block - CHUNK_HEADER.size or start + length > len(data):
            raise ValueError(f"{path}: truncated/overlong chunk at {pos}")
        payload = data[start : start + length]
        if zlib.crc32(bytes([kind]) + payload) != crc:
            raise ValueError(f"{path}: crc mismatch in chunk at {pos}")
        yield kind, payload
        pos = start + length


def iter_records(path: str | Path):
    """Yield every ``Record`` protobuf stored in a ``.wandb`` file, in order."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < FILE_HEADER.size:
        raise ValueError(f"{path}: too short to be a wandb file")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a wandb run file (bad header {data[:7]!r})")
    pending: bytearray | None = None
    for kind, payload in _iter_chunks(data, path):
        if (kind in (FULL, FIRST)) != (pending is None):
            raise ValueError(f"{path}: chunk type {kind} out of sequence")
        if kind == FULL:
            buf = payload
        elif kind == FIRST:
            pending = bytearray(payload)
            continue
        else:
            pending += payload
            if kind == MIDDLE:
                continue
            buf, pending = bytes(pending), None
        record = pb.Record()
        try:
            record.ParseFromString(buf)
        except Exception as e:  # google.protobuf.message.DecodeError
            raise ValueError(f"{path}: undecodable record: {e}") from e
        yield record
    if pending is not None:
        raise ValueError(f"{path}: file ends inside a multi-chunk record")


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _history_value(item):
    # wandb 0.31 only fills value_json; HistoryItem's typed `value` oneof is unused.
    if item.WhichOneof("value"):
        raise ValueError(f"typed history value for {_key(item)!r}: newer wandb format?")
    return json.loads(item.value_json)


def _apply_config(config: dict, cfg) -> None:
    for item in cfg.update:
        config[_key(item)] = json.loads(item.value_json)
    for item in cfg.remove:
        config.pop(_key(item), None)


def read_run(path: str | Path) -> dict:
    """Decode a ``.wandb`` file into history rows, config, run info and summary.

    ``config`` keeps wandb's own ``_wandb`` entry; history rows include wandb's
    ``_step``/``_runtime``/``_timestamp`` keys.
    """
    history: list[dict] = []
    kinds: list[str] = []
    config: dict = {}
    summary: dict = {}
    run: dict = {}
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":
            history.append({_key(i): _history_value(i) for i in rec.history.item})
        elif kind == "config":
            _apply_config(config, rec.config)
        elif kind == "run":
            r = rec.run
            run = {
                "project": r.project,
                "group": r.run_group,
                "tags": list(r.tags),
                "display_name": r.display_name,
                "run_id": r.run_id,
            }
            _apply_config(config, r.config)
        elif kind == "summary":
            for item in rec.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
            for item in rec.summary.remove:
                summary.pop(_key(item), None)
    if not run:
        raise ValueError(f"{path}: no run record found ({len(kinds)} records: {kinds[:8]})")
    return {"history": history, "config": config, "run": run, "summary": summary}
