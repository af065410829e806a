"""Token streams: one protocol, several sources (a file each): synthetic tokens
(default, no files, synthetic.py), byte-level text from local files (text.py),
and pretokenized shards written by `python -m harness.prepare` (tokens.py).

Every rank reads a disjoint, deterministic slice of one global sequence of
samples: with `n` samples consumed by all ranks so far, rank r of w takes
samples n + r*B ... n + r*B + B-1, and a step consumes w*B (B = the rank's
samples per step: `train.batch_size` × `train.grad_accum`). The union over
ranks of one step is exactly what a single process with batch w*B would read.
In a job the run's clock says which replica step (slot) a step reads, so
replicas that take their own number of local steps (`averager.balance=time`)
still read each sample once; equal replicas read exactly the order above.
The position is that one global count (`TokenStream.samples`), saved by the
checkpoint code through `state_dict()`; because it does not depend on the
world size, a run resumed on another layout continues with the next unread
sample - none skipped, none read twice.

A data source is a class named by `data._target_`, built from its config keys
plus `vocab_size` and `seed`, with `samples(first, count, length)` and, for
`train.eval_every`, `eval_samples(windows, length)`: held-out windows (an array
of their numbers) from data it never trains on (text: the corpus's last
`data.eval_fraction` of bytes), with `eval_windows(length)` saying how many the
split holds (absent: an endless held-out stream); a mixture also names its
sources in `eval_sources()` and takes `source=` in both. Its
constructor refuses bad arguments with a ValueError naming the key and the fix
(`validate` builds it to ask, so it must be cheap); a source that reads files
checks them in `preflight_errors(length, evaluates)` (samples of `length` =
`train.seq_len` + 1 tokens, held-out ones too when `evaluates`) and loads them
in `open()`, which every
rank calls together; one with held-out data it cannot always provide says so in
`eval_errors(train.eval_every, train.eval_batches)`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from harness.data.synthetic import SyntheticTokens
from harness.data.text import TextTokens, text_root
from harness.data.tokens import TokenShards

__all__ = ["SyntheticTokens", "TextTokens", "TokenShards", "TokenStream", "build_data", "data_source", "text_root"]


class TokenStream:
    """Batches of (inputs, targets) for one rank; `samples` = samples consumed by all ranks.

    The input pipeline stays off the critical path: while a step runs, a thread of
    the stream's own reads (and on CUDA pins) the next micro-batch, which the loop
    then copies to the device without waiting. Sources draw from their own seeded
    generators, never from the global RNG, so reading ahead changes no value.

    A step reads `micro_batches` micro-batches of `batch_size` sequences per
    rank, consecutive samples of the rank's one slice of the step, so a run
    with K micro-batches of B reads exactly what a run with one batch of K·B
    reads, rank by rank. Checkpoints fall between steps, so `samples` is the
    whole position.

    In a job, `clock` (the run's) says which replica step of the run each step reads
    (`Tick.slot`: a slot is `ranks_per_replica` ranks' slices); the position is anchored
    where the run started or resumed (`anchor`: samples, and the clock's replica steps
    then), so a resume on another layout maps the slots that follow onto the samples
    that follow. Without a clock (a stream on its own) each step is the one after the last read."""

    def __init__(
        self,
        source,
        batch_size: int,
        seq_len: int,
        rank: int,
        world_size: int,
        device: torch.device,
        micro_batches: int = 1,
        clock=None,
        ranks_per_replica: int = 1,
    ):
        self.source, self.batch_size, self.seq_len = source, batch_size, seq_len
        self.rank, self.world_size, self.device = rank, world_size, device
        self.micro_batches, self.clock = micro_batches, clock
        self.rank_samples = batch_size * micro_batches  # one rank's samples per step
        self.replica_samples = self.rank_samples * ranks_per_replica  # one slot's
        self.rank_in_replica = rank % ranks_per_replica
        self.anchor = (0, 0)  # (samples, replica steps of the run) at the run's start or its resume
        self.position = 0  # without a clock: the samples all ranks read so far
        self._micro = 0  # micro-batches of the current step read so far
        self._ahead: tuple[int, Future] | None = None  # (position, micro-batch) being read ahead
        self._thread: ThreadPoolExecutor | None = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch of the step being taken, read ahead while the previous step
        ran; the one after it starts reading now, on the stream's thread."""
        seqs = self._take(self._first())
        self._micro += 1
        if self._micro == self.micro_batches:
            self._micro = 0
            self.position += self.world_size * self.rank_samples
        following = self._first(next_step=self._micro == 0)
        self._ahead = (following, self._reader().submit(self._read, following))
        seqs = seqs.to(self.device, non_blocking=True)  # from pinned memory on CUDA: queued, no wait
        return seqs[:, :-1], seqs[:, 1:]

    def _first(self, next_step: bool = False) -> int:
        """The first global sample of this rank's next micro-batch (of the step after the one
        being taken, when `next_step`: the step's micro-batches are read)."""
        if self.clock is None:
            return self.position + self.rank * self.rank_samples + self._micro * self.batch_size
        slot = self.clock.next_slot() if next_step else self.clock.slot()
        return self._sample(slot) + self.rank_in_replica * self.rank_samples + self._micro * self.batch_size

    def _sample(self, slot: int) -> int:
        """The first global sample of replica step `slot` of the run."""
        samples, slots = self.anchor
        return samples + (slot - slots) * self.replica_samples

    def _take(self, first: int) -> torch.Tensor:
        """The micro-batch at `first`: the one read ahead, unless the position moved since
        (a checkpoint or a heal loaded another one), then read now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == first:
            return ahead[1].result()
        if ahead is not None:  # a source is read by one thread at a time
            wait([ahead[1]])
        return self._read(first)

    def _read(self, first: int) -> torch.Tensor:
        seqs = self.source.samples(first, self.batch_size, self.seq_len + 1)
        return seqs.pin_memory() if self.device.type == "cuda" else seqs  # so the copy to the GPU is async

    def _reader(self) -> ThreadPoolExecutor:
        """One thread that reads ahead (started at the first batch, not when the stream is built)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harness-data")
        return self._thread

    def eval_windows(self, batches: int | str, source: int | None = None) -> list[np.ndarray]:
        """The held-out windows an eval pass scores (of a mixture's source `source`), batch by batch:
        `batches` × batch_size windows spread evenly over the held-out split, the middle of each of
        as many equal stretches (a split's start can be easier or harder than its whole), the same
        every pass and on every rank; every window with `"all"` (the last batch shorter). A source
        without `eval_windows` holds out an endless stream: its first windows, which are alike."""
        which = {} if source is None else {"source": source}
        count = getattr(self.source, "eval_windows", None)
        total = count(self.seq_len + 1, **which) if count is not None else None
        if total is None:
            windows = np.arange(batches * self.batch_size)
        elif batches == "all" or batches * self.batch_size >= total:
            windows = np.arange(total)
        else:
            wanted = batches * self.batch_size
            windows = (2 * np.arange(wanted) + 1) * total // (2 * wanted)
        return [windows[i : i + self.batch_size] for i in range(0, len(windows), self.batch_size)]

    def eval_batch(self, windows: np.ndarray, source: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out windows `windows` (of a mixture's source `source`) as a batch on the device."""
        which = {} if source is None else {"source": source}
        seqs = self.source.eval_samples(windows, self.seq_len + 1, **which)
        seqs = seqs.to(self.device, non_blocking=True)
        return seqs[:, :-1], seqs[:, 1:]

    def eval_sources(self) -> list[tuple[str, float]]:
        """A mixture's sources, scored one by one, with their weights (sum 1); [] otherwise."""
        sources = getattr(self.source, "eval_sources", None)
        return sources() if sources is not None else []

    def tokens_read(self) -> dict:
        """Per-source token counts of a mixture so far (`data/tokens/*`), from the global position."""
        counts = getattr(self.source, "tokens_read", None)
        return counts(self.samples, self.seq_len + 1) if counts is not None else {}

    @property
    def samples(self) -> int:
        """Samples consumed by all ranks so far (where every rank meets, the same on each)."""
        if self.clock is None:
            return self.position
        return self._sample(self.clock.consumed())

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        """The position of a checkpoint or a healing peer (after the clock's: the slots count from it)."""
        if self.clock is None:
            self.position = int(state["samples"])
        else:
            self.anchor = (int(state["samples"]), self.clock.consumed())


def data_source(cfg: DictConfig):
    """The source `data` names, unopened (cheap): its config keys plus the two
    arguments the harness fills in, given here and nowhere else."""
    build = instantiate(cfg.data, _partial_=True, _convert_="all")  # plain lists and dicts (data.sources)
    return build(vocab_size=cfg.model.vocab_size, seed=cfg.train.seed)


def build_data(
    cfg: DictConfig, rank: int, world_size: int, device: torch.device, clock=None, ranks_per_replica: int = 1
) -> TokenStream:
    """This rank's slice of the stream `cfg.data` describes, its files opened (collective); in a job the
    run's `clock` says which replica step each step reads (its replicas of `ranks_per_replica` ranks)."""
    source = data_source(cfg)
    if hasattr(source, "open"):
        source.open()
    train = cfg.train
    return TokenStream(
        source, train.batch_size, train.seq_len, rank, world_size, device, train.grad_accum, clock, ranks_per_replica
    )
