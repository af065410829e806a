"""`ReplicaGroup`: one replica group's side of fault tolerance for the Trainer (the quorum
at the start of each step that crosses replicas, the ft/* metrics) and the heal state a live
peer sends from memory."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from harness import metrics
from harness.checkpoint.checkpointer import tensor_state
from harness.checkpoint.replicas import inner_optimizer
from harness.clock import Tick
from harness.dist import local_view
from harness.fault_tolerance.config_rules import join_timeout_s
from harness.fault_tolerance.link import QuorumFailed, TorchftLink
from harness.fault_tolerance.outputs import FINISHED, PeersFinished, finished_peer
from harness.rng import seed_rank

log = logging.getLogger(__name__)

# =1: a heal's sender and receiver log a SHA-256 digest of the whole state, to check that it arrived
# bit for bit (it reads every byte twice on each side, so it is off by default)
HEAL_DIGEST_ENV = "HARNESS_HEAL_DIGEST"


class ReplicaGroup:
    """One replica group's side of fault tolerance, for the Trainer: the quorum at
    the start of each step that crosses replicas (and of the first step a group
    runs, which is how a restarted group joins), the heal state, the ft/* metrics."""

    def __init__(self, trainer, link: TorchftLink, replica_id: int, shard: int, seed: int, ft, outputs: Path):
        """`ft`: the fault_tolerance config (its quorum timeout: how long a group's first quorum waits for a peer)."""
        self.trainer, self.link, self.replica_id = trainer, link, replica_id
        self.shard, self.seed, self.outputs = shard, seed, outputs
        self.alone_after_s = ft.quorum_timeout_s
        self.late_after_s = join_timeout_s(ft, trainer.clock.replicas)
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0  # the launcher's and torchrun's
        self.heals, self.heals_sent, self.skipped_steps, self.replicas, self.joined = 0, 0, 0, None, False
        self.looked = False  # a restarted group looked for peers that finished the run
        device = trainer.env.device
        # what this group sends a peer it heals, copied after the work queued on the training stream
        self.staging = HostStaging(torch.cuda.current_stream(device) if device.type == "cuda" else None, link.transport)
        self.row: dict = {}
        link.manager.register_state_dict_fn("harness", self._load_heal_state, self._heal_state)

    def before_step(self, tick: Tick) -> Tick:
        """Open a quorum if the step `tick` crosses replicas; the time it waits there is the clock's to leave
        out of step times. A group's first quorum is how it joins (at its start or restart): at its first step
        that crosses replicas, where its peers open theirs (with replicas that take their own number of local
        steps, an exchange: a group that joined at a local step would open one quorum more than they), and it
        is healed there when it is behind. A heal replaces every part of the job, the clock included: the
        step is then the clock's next one, as this group now stands."""
        clock = self.trainer.clock
        if self.restarted and not self.looked:  # before its first step: a run its peers finished is not trained on
            self._stop_if_a_peer_finished()
        self.looked = True
        if not tick.crosses_replicas:
            return tick
        heals, sent = self.heals, self.heals_sent
        if tick.exchange is not None:  # the fast group waits here for the slow one, before its last step
            clock.waiting()
        start = time.perf_counter()
        self._quorum(lambda: self.link.begin(tick.step) if self.joined else self._join(tick))
        if tick.exchange is not None:  # the quorum is the exchange's, which it holds up
            clock.held_up(time.perf_counter() - start)
        else:
            clock.waited(time.perf_counter() - start)
        self.joined = True
        if self.heals_sent == sent:  # no peer to heal: a heal sent at an earlier quorum has been received by now
            self.staging.release()
        if self.heals == heals:
            return tick
        self.row[metrics.FT_HEAL_TIME] = self.row[metrics.FT_QUORUM_TIME]
        return clock.next()

    def complete_the_last_exchange(self, tick: Tick) -> None:
        """At the run's last step, redo its exchange if it did not commit (a group was lost in it): no
        later sync would take its window in, so each survivor would end with a model of its own. The
        survivors redo it among themselves (`TorchftLink.reform`), weighed over themselves; a group
        restarted meanwhile finds them finished and stops. Each retry follows a loss, so there are at
        most as many as groups."""
        averager = self.trainer.job.cross_replica.averager
        if averager is None:  # synchronous training: a step that did not commit was skipped, as any other
            return
        for _ in range(self.replicas):
            if not averager.uncommitted:
                return
            self._quorum(self.link.reform)
            log.warning(
                "step %d: the last exchange did not commit; redoing it among the %d replica groups left",
                tick.step,
                self.replicas,
            )
            averager.redo_exchange()
        if averager.uncommitted:
            log.warning(
                "step %d: the last exchange did not commit again: each group ends with its own model", tick.step
            )

    def _quorum(self, open_quorum) -> None:
        """Open a quorum with `open_quorum`, asked again while it fails (each failure is one more exchange
        that did not commit, so `fault_tolerance.max_failed_exchanges` bounds them); log a change in
        its size; its time adds to this step's ft/quorum_s."""
        start = time.perf_counter()
        while True:
            try:
                open_quorum()
                break
            except QuorumFailed as e:
                self.link.exchange_failed(e)
                log.warning("step %d: %s; asking again", self.trainer.clock.step + 1, e)
        replicas = self.link.size()
        if self.replicas is not None and replicas != self.replicas:
            change = "joined" if replicas > self.replicas else "left"
            log.warning("replica group(s) %s: %d in the quorum (was %d)", change, replicas, self.replicas)
        self.replicas = replicas
        self.row[metrics.FT_QUORUM_TIME] = self.row.get(metrics.FT_QUORUM_TIME, 0.0) + time.perf_counter() - start

    def _join(self, tick: Tick) -> None:
        """A group's first quorum, at its (re)start: repeated until it holds every group of the run, or
        another group once the lighthouse's wait for late groups (`join_timeout_s`) is over (then a
        group that is behind has been healed), or `fault_tolerance.quorum_timeout_s` has passed with none.
        The lighthouse gives a lone asker a quorum of its own once the others' wait is over, or at
        once while no other group's Manager is up, and gives the first groups to ask a quorum of their
        own while the others' Managers are not up yet; a group that took that would train on apart,
        out of step with its peers, and hold up their quorums. Groups started together meet here,
        and a restarted group waits here for its peers' next quorum, unless they have finished."""
        began = time.monotonic()
        while True:
            if self.restarted:
                self._stop_if_a_peer_finished()
            heals = self.heals
            self.link.begin(tick.step)
            waited = time.monotonic() - began
            together = self.link.size() == self.trainer.clock.replicas
            if together or (self.link.size() > 1 and waited > self.late_after_s) or self.heals > heals:
                return
            if waited > self.alone_after_s:
                return
            time.sleep(0.2)

    def _stop_if_a_peer_finished(self) -> None:
        """Raise PeersFinished if a peer has trained every step (read by the group's first rank, on a file
        system its peers write to: one machine, or a shared run dir; elsewhere the group waits as before)."""
        found = [finished_peer(self.outputs.parent, self.replica_id, self.trainer.cfg.steps)]
        dist.broadcast_object_list(found, src=0)  # every rank of the group stops, or none
        if found[0] is not None:
            peer, step = found[0]
            raise PeersFinished(
                f"replica group {self.replica_id} restarted after replica group {peer} finished training (step "
                f"{step}): no peer is left to heal from, and the run's model is theirs, so it stops at step "
                f"{self.trainer.clock.step} (its newest checkpoint)"
            )

    def finish(self) -> None:
        """This group has trained every step: say so in its outputs, for a peer that restarts after it exits;
        unless no exchange of the run ever committed (ExchangesFailed: the groups trained apart)."""
        self.link.all_failed()
        if dist.get_rank() == 0:
            (self.outputs / FINISHED).write_text(json.dumps({"step": self.trainer.clock.step}))

    def gradients_committed(self, tick: Tick) -> bool:
        """A synchronous step's gradient exchange (averager=none, or a warmup step) succeeded with enough
        replica groups; else the step is skipped, counted in ft/skipped_steps."""
        if not tick.synchronous:
            return True
        committed = self.link.commit()
        self.skipped_steps += not committed
        return committed

    def step_metrics(self) -> dict:
        """This step's ft/* figures (the quorum's, if one opened), then reset."""
        row = {**self.row, metrics.FT_REPLICAS: self.replicas or 0, metrics.FT_HEALS: self.heals}
        row[metrics.FT_SKIPPED_STEPS], self.row = self.skipped_steps, {}
        return row

    def _heal_state(self) -> dict:
        """What a live peer sends a group it heals: the job's state at the start of this step, as
        local tensors (ranks with the same shard index hold the same slices), staged into host
        memory, because the transfer reads it while this group trains on. A heal costs one host
        copy of a rank's state and no device memory: torchft's HTTP transport serves host tensors
        as they are (a device tensor it would copy to the host itself, after a device clone of the
        whole state)."""
        self.heals_sent += 1
        state = self.staging.stage(self._state())
        self.row[metrics.FT_HEAL_SENT_BYTES] = self.staging.nbytes
        if os.environ.get(HEAL_DIGEST_ENV) == "1":
            log.info("sending the heal state of step %d (digest %s)", state["step"], digest(state))
        return state

    def _state(self) -> dict:
        """The job's state, as views of its local tensors (no copy)."""
        job = self.trainer.job
        parts = job.checkpoint_parts()
        return _local(
            {
                "step": self.trainer.clock.step,
                "model": {fqn: local_view(p) for fqn, p in job.model.named_parameters()},
                "optim": get_optimizer_state_dict(job.model, inner_optimizer(job.optimizer)),
                "parts": {name: part.state_dict() for name, part in parts.items()},
                "part_tensors": {name: tensor_state(part) for name, part in parts.items()},
            }
        )

    @torch.no_grad()
    def _load_heal_state(self, state: dict) -> None:
        """Take a peer's heal state: every value is the peer's, bit for bit; the data
        position is global, so this group reads its own samples from it, and its RNG
        is seeded from the step and its ranks."""
        job, step = self.trainer.job, state["step"]
        for fqn, p in job.model.named_parameters():
            local_view(p).copy_(state["model"][fqn])
        params = dict(job.model.named_parameters())
        optim = _in_layout(state["optim"], params)
        set_optimizer_state_dict(job.model, inner_optimizer(job.optimizer), optim)
        parts = job.checkpoint_parts()
        for name, part in parts.items():
            part.load_state_dict({"step": step, **state["parts"][name]})
        for name, part in parts.items():
            tensors = tensor_state(part)
            if tensors:
                _copy_into(tensors, state["part_tensors"][name])
                part.load_tensor_state_dict(tensors)
        job.clock.rejoined = True  # its step time restarts from its peers' (said at the next exchange)
        rank = self.replica_id * self.shard + dist.get_rank()
        seed_rank(self.seed + step, rank)
        self.heals += 1
        if os.environ.get(HEAL_DIGEST_ENV) == "1":  # the state as this group now holds it, against the sender's
            log.info("healed from a live peer at step %d (digest %s)", step, digest(self._state()))
        else:
            log.info("healed from a live peer at step %d", step)


def digest(state) -> str:
    """A short hash of a state tree's values, bit for bit (tensors by their bytes, in tree order). The
    clock's part is left out: a healed group holds it from its own side (at the sender's exchange, at its
    own local step of its own plan)."""
    h = hashlib.sha256()

    def walk(value) -> None:
        if isinstance(value, dict):
            for key in sorted((k for k in value if k != "clock"), key=str):
                h.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif torch.is_tensor(value):
            h.update(str(value.dtype).encode())
            # a copy: numpy() of the tensor itself would make its storage non-resizable (HostStaging.release)
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).clone().numpy().tobytes())
        else:
            h.update(repr(value).encode())

    walk(state)
    return h.hexdigest()[:16]


def _local(state):
    """A state tree with each tensor as its local view (a DTensor's shard), detached, not copied."""
    return tree_map(lambda v: local_view(v).detach() if torch.is_tensor(v) else v, state)


class HostStaging:
    """The host memory a heal state is copied into: one flat buffer per dtype of the state's exact size
    (each tensor at an offset aligned to ALIGN bytes; one per dtype because torch's serialization, which
    torchft's transport sends the state with, refuses two views of one storage as different types), kept
    from heal to heal while the state's layout stays the same, and released when the group has no peer to
    heal. On CUDA it is page-locked with `cudaHostRegister`,
    as DCP's shared-memory stager does: the caching host allocator behind `pin_memory=True` rounds each
    block up to a power of two (up to 2x the state) and keeps it for the life of the process.

    torchft's transport serves the buffers' views from a heal until its Manager's next `should_commit`,
    which may be steps away (a join quorum followed by local steps): a buffer is written again or freed
    only once the transport serves it no more (`disallow_checkpoint`: it waits for the requests being
    answered, and later ones wait for the next heal's state, or fail)."""

    ALIGN = 64

    def __init__(self, training_stream: torch.cuda.Stream | None, transport):
        """`training_stream`: the stream the training thread queues its work on (CUDA), else None;
        `transport`: torchft's checkpoint transport that serves the staged state (its Manager's)."""
        self.training_stream, self.transport = training_stream, transport
        self.layout, self.flats, self.buffers, self.nbytes, self.pinned = None, [], [], 0, False

    @torch.no_grad()
    def stage(self, state: dict) -> dict:
        """A copy of `state` in host memory (its tensors in the flat buffers, the rest as they are); torchft
        serves it again once its `send_checkpoint` has it (`allow_checkpoint`)."""
        self.transport.disallow_checkpoint()  # a request still served from the buffers must not read a half copy
        values, spec = tree_flatten(state)
        tensors = [v for v in values if torch.is_tensor(v)]
        layout = (spec, [(t.shape, t.dtype) for t in tensors])
        if layout != self.layout:
            self.release()
            self._allocate(tensors)
            self.layout = layout
        cuda = self.training_stream is not None and any(t.is_cuda for t in tensors)
        if cuda:
            # torchft calls this on its quorum thread, under its recovery stream, while the training thread
            # waits for the quorum in `start_quorum` (use_async_quorum=False): nothing more is queued on the
            # training stream, but the last step's kernels (its optimizer step) may still be running there.
            # So the recovery stream waits for everything queued on it so far before copying ...
            torch.cuda.current_stream().wait_stream(self.training_stream)
        for buffer, tensor in zip(self.buffers, tensors):
            buffer.copy_(tensor, non_blocking=True)
        if cuda:
            # ... and the copies are complete before torchft serves the buffers (the training thread queues
            # no new step until this quorum returns, so nothing writes the state meanwhile)
            torch.cuda.current_stream().synchronize()
        staged = iter(self.buffers)
        return tree_unflatten([next(staged) if torch.is_tensor(v) else v for v in values], spec)

    def _allocate(self, tensors: list[torch.Tensor]) -> None:
        self.buffers = [None] * len(tensors)
        self.pinned = any(t.is_cuda for t in tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            align = max(1, self.ALIGN // dtype.itemsize)
            offsets, end = [], 0
            for i in members:
                offsets.append(end)
                end += -(-tensors[i].numel() // align) * align
            flat = torch.empty(end, dtype=dtype)
            if self.pinned and end > 0:
                nbytes = end * dtype.itemsize
                _cuda_call("cudaHostRegister", torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0))
            self.flats.append(flat)
            for i, o in zip(members, offsets):
                self.buffers[i] = flat[o : o + tensors[i].numel()].view(tensors[i].shape)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        """Free the buffers, once the transport serves them no more (it keeps the views until the next heal)."""
        if not self.flats:
            return
        self.transport.disallow_checkpoint()
        for flat in self.flats:
            if self.pinned and flat.numel() > 0:
                _cuda_call("cudaHostUnregister", torch.cuda.cudart().cudaHostUnregister(flat.data_ptr()))
            flat.untyped_storage().resize_(0)
        self.layout, self.flats, self.buffers, self.pinned = None, [], [], False


def _cuda_call(name: str, error) -> None:
    """A CUDA runtime call's `cudaError` (0: success) as a RuntimeError naming it. Only reached on CUDA,
    which the CPU tests cannot run: it is one line on the path every CUDA heal takes, not a branch of its own."""
    code = int(error)
    if code != 0:
        raise RuntimeError(
            f"HostStaging: {name} returned cudaError {code} for the heal state's host buffer (an earlier "
            "asynchronous CUDA error can surface here too; CUDA_LAUNCH_BLOCKING=1 tells them apart)"
        )


def _in_layout(optim: dict, params: dict) -> dict:
    """A sent optimizer state dict (local tensors) with each parameter-shaped state
    laid out as its parameter (DTensors under FSDP2), for `set_optimizer_state_dict`."""
    state = {}
    for fqn, values in optim["state"].items():
        p = params[fqn]
        device = local_view(p).device  # the sent tensors are on the host, in the transport's buffers
        # copies: the optimizer keeps the tensors it is given, and the transport's buffers are not ours to keep
        values = {k: v.to(device, copy=True) if torch.is_tensor(v) else v for k, v in values.items()}
        state[fqn] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == local_view(p).shape and v.dim() > 0
            else v
            for k, v in values.items()
        }
    return {"state": state, "param_groups": optim["param_groups"]}


def _copy_into(target: dict, sent: dict) -> None:
    for key, value in target.items():
        if isinstance(value, dict):
            _copy_into(value, sent[key])
        elif torch.is_tensor(value):
            local_view(value).copy_(sent[key])
