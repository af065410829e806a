"""`TorchftLink`: the replica link over torchft's Manager (harness/averaging/link.py's
protocol): the replicas are the replica groups in the current quorum, `begin()` is a quorum
(which heals this group when it is behind), `commit()` is `should_commit`."""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

from harness.fault_tolerance.config_rules import LIGHTHOUSE_ENV, quiet_torchft

log = logging.getLogger(__name__)


class _Reported:
    """A collective of the Manager's process group whose failure (a lost peer, a
    timeout) is reported to the Manager instead of raised: the exchange then
    does not commit, and the group trains on.

    The first failure also lets go of this group's end of the process group at
    once, not at the next quorum: a gloo ring member whose neighbour died fails
    at once, but the live groups further along the ring wait on it, and they
    hear of the failure only when its connections close. Gloo's abort() does
    not close them; the context's destruction, when no work holds it any more,
    does (4 gloo ranks, one SIGKILLed mid-allreduce: the rank two places behind
    failed after the full timeout without this, after 0.08 s with it)."""

    def __init__(self, link: TorchftLink, start):
        self.link, self.work = link, None
        if link.manager.errored() is None:
            try:
                self.work = start()
            except Exception as e:  # the group is broken: report, let the commit say no
                self._report(e)

    def wait(self) -> None:
        if self.work is not None:
            try:
                self.work.wait()
            except Exception as e:
                self._report(e)
            self.work = None

    def _report(self, e: Exception) -> None:
        self.work = None
        if self.link.manager.errored() is not None:  # reported and released already
            return
        log.warning("a cross-replica collective failed (%s: %s): this exchange will not commit", type(e).__name__, e)
        self.link.manager.report_error(e)
        self.link.pg.shutdown()  # torchft's wrappers drop the process group; the next quorum configures a new one


class LighthouseUnreachable(RuntimeError):
    """The lighthouse did not answer; the message names it and the fix (no restart helps)."""


def forget_previous_manager(group_rank: int) -> None:
    """The Manager publishes its address in the group's rendezvous store; torchrun keeps that store
    across its restarts, so a restarted group would find the dead attempt's address there. The
    group's first rank deletes it before any rank creates its Manager."""
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if group_rank == 0:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


def refuse_a_closed_lighthouse(lighthouse: str, patience_s: float = 2.0) -> None:
    """A lighthouse address where nothing listens is known at once, not after torchft's connect
    timeout (`fault_tolerance.timeout_s`, 60 s by default): a refused connection, still refused
    after `patience_s` (a lighthouse being started alongside), raises LighthouseUnreachable.
    Anything else (no route, a slow network) is left to torchft's own timeout."""
    url = urlparse(lighthouse)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            socket.create_connection((url.hostname, url.port), timeout=patience_s).close()
            return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        except OSError:
            return
    raise LighthouseUnreachable(
        f"fault_tolerance: nothing listens at the torchft lighthouse address {lighthouse} (fault_tolerance.lighthouse, "
        f"or {LIGHTHOUSE_ENV}): the connection was refused. Fix: start it (torchft_lighthouse --min_replicas 1) and "
        "pass the address it prints, or leave fault_tolerance.lighthouse=null to have the launcher start one."
    )


class ExchangesFailed(RuntimeError):
    """`fault_tolerance.max_failed_exchanges` exchanges in a row did not commit; the message names the fix."""


class CommitUnknown(RuntimeError):
    """This rank did not hear its group's commit vote: the group restarts (and is healed), as in torchft."""


class QuorumFailed(RuntimeError):
    """A quorum was asked for and not given; the Manager can be asked again."""


PLACE_STRIDE = 2**32  # a Manager step is commits * this + steps: more commits always rank first


class TorchftLink:
    """The replica link over torchft's Manager: the replicas are the replica groups in
    the current quorum; `begin()` is a (synchronous) quorum, which heals this group
    when it is behind; `commit()` is `should_commit`."""

    needs_commit = True

    def __init__(self, ft: DictConfig, replica_id: int, group_rank: int, group_world_size: int, device: torch.device):
        self.commits = 0  # exchanges this group committed (the heal state and checkpoints carry it)
        self.failed_in_a_row = 0  # exchanges since the last that committed (fault_tolerance.max_failed_exchanges)
        self.ft, self.replica_id, self.steps_done = ft, replica_id, 0
        quiet_torchft()
        from torchft.checkpointing import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

        forget_previous_manager(group_rank)
        timeout = timedelta(seconds=ft.timeout_s)
        self.pg = ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.lighthouse = lighthouse = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        refuse_a_closed_lighthouse(lighthouse)
        # the Manager's own default, held here: what serves this group's heal state stops serving before
        # the staging buffer under it is reused or freed (HostStaging)
        self.transport = HTTPTransport(timeout=timeout, num_chunks=0)
        try:
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,  # a heal completes inside the quorum, before the step runs
                timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=timeout,
                rank=group_rank,
                world_size=group_world_size,
                lighthouse_addr=lighthouse,
                replica_id=str(replica_id),
                init_sync=False,  # every group starts from the same seeded weights
                checkpoint_transport=self.transport,
            )
        except RuntimeError as e:
            if "failed to connect" not in str(e):
                raise
            raise LighthouseUnreachable(
                f"fault_tolerance: the torchft lighthouse at {lighthouse} (fault_tolerance.lighthouse, or "
                f"{LIGHTHOUSE_ENV}) did not answer within fault_tolerance.timeout_s={ft.timeout_s} s "
                f"({str(e).split(';')[0]}). Fix: start it (torchft_lighthouse --min_replicas 1) and pass the "
                "address it prints, or leave fault_tolerance.lighthouse=null to have the launcher start one."
            ) from None

    def size(self) -> int:
        return self.manager.num_participants()

    def all_reduce(self, tensor: torch.Tensor) -> _Reported:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return _Reported(self, lambda: self.pg.allreduce([tensor], opts))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> _Reported:
        return _Reported(self, lambda: self.pg.alltoall_base(output, input, [], [], AllToAllOptions()))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> _Reported:
        return _Reported(self, lambda: self.pg.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()))

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        self.all_reduce(tensor).wait()

    def sum_over_members(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)  # this group's world
        self.sum_over_replicas(tensor)

    def begin(self, steps_done: int = 0) -> None:
        """A quorum at the start of the step after `steps_done` steps. torchft heals the groups
        whose Manager step is below the quorum's highest, so that step is set here to this group's
        place: its committed exchanges, then its steps. A group that missed a commit, and a
        restarted group (from scratch or from its own older checkpoint), are behind every live
        peer and so are healed; groups at the same place are not."""
        self.steps_done = steps_done
        place = self.commits * PLACE_STRIDE + steps_done
        self.manager.load_state_dict({"step": place, "batches_committed": self.manager.batches_committed()})
        self._start_quorum()

    def reform(self) -> None:
        """A quorum of the last one's members still alive, without heals (torchft's shrink_only), to redo
        an exchange that did not commit inside its step: a group outside it would need a heal, and a
        heal mid-step would send state that is half this step's."""
        self._start_quorum(allow_heal=False, shrink_only=True)

    def _start_quorum(self, **options) -> None:
        """torchft's `start_quorum`; its failure (the lighthouse gave no quorum in time) is QuorumFailed."""
        try:
            self.manager.start_quorum(**options)
        except (TimeoutError, RuntimeError) as e:
            failed = self.manager._quorum_future
            if failed is None or not failed.done() or failed.exception() is not e:
                raise  # not the quorum's request: applying a heal, say
            # torchft's Manager keeps a failed quorum and raises its error again at the next start_quorum
            # (torchft's TODO there: recover from a failed quorum), so the quorum could only be asked again
            # by restarting the group; nothing else changed when the request failed, so forget it here
            self.manager._quorum_future = None
            try:
                refuse_a_closed_lighthouse(self.lighthouse)
            except LighthouseUnreachable:  # it died: asking again cannot help
                raise LighthouseUnreachable(
                    f"fault_tolerance: the torchft lighthouse at {self.lighthouse} stopped answering (the connection "
                    f"is refused), so no quorum can form (replica group {self.replica_id}, step {self.steps_done}). "
                    "Fix: start it again at that address and restart the job: it resumes from its checkpoints."
                ) from e
            if isinstance(e, TimeoutError):  # torchft's message is gRPC's "Cancelled: Timeout expired"
                quorum_timeout_s = f"fault_tolerance.quorum_timeout_s={self.ft.quorum_timeout_s} s"
                raise QuorumFailed(f"no quorum within {quorum_timeout_s}") from e
            raise QuorumFailed(f"the quorum failed ({type(e).__name__}: {str(e).splitlines()[0]})") from e

    def commit(self) -> bool:
        try:
            committed = self.manager.should_commit()
        except TimeoutError as e:
            # the group's ranks vote, and this one did not hear the outcome: its peers in the group may have
            # committed, so it fails and its group restarts, to be healed from a peer (as in torchft)
            self.exchange_failed(e)
            raise CommitUnknown(
                f"should_commit did not answer within fault_tolerance.timeout_s={self.ft.timeout_s} s: this rank "
                "cannot tell whether its replica group committed, so the group restarts and is healed from a peer"
            ) from e
        self.commits += committed
        if committed:
            self.failed_in_a_row = 0
        else:
            self.exchange_failed()
        return committed

    def exchange_failed(self, cause: Exception | None = None) -> None:
        """One more exchange (or the quorum opening it) did not commit: ExchangesFailed at
        `fault_tolerance.max_failed_exchanges` in a row; `cause`, if the last was a failed request."""
        self.failed_in_a_row += 1
        if self.failed_in_a_row < self.ft.max_failed_exchanges:
            return
        failed = f"{self.failed_in_a_row} exchange{'s' * (self.failed_in_a_row > 1)} in a row across replica groups"
        raise ExchangesFailed(self._failed(f"{failed} did not commit", cause)) from cause

    def all_failed(self) -> None:
        """At the end of the run: ExchangesFailed if it tried exchanges and none ever committed (fewer than
        `max_failed_exchanges`, so none stopped it): the groups' models were never combined."""
        if self.commits == 0 and self.failed_in_a_row:
            failed = f"{self.failed_in_a_row} exchange{'s' * (self.failed_in_a_row > 1)} across replica groups"
            raise ExchangesFailed(self._failed(f"the run ended, and none of its {failed} committed", None))

    def _failed(self, what: str, cause: Exception | None) -> str:
        """The paragraph of exchanges that did not commit: `what`, and the fix for `cause` (the last failure)."""
        where = f"replica group {self.replica_id}, step {self.steps_done}"
        more = "fault_tolerance.max_failed_exchanges allows more in a row."
        if isinstance(cause, QuorumFailed):  # the quorums are what failed: their timeout leads
            return (
                f"fault_tolerance: {what}, the last for want of a quorum: {cause} ({where}), so the groups trained "
                "apart. Fix: raise fault_tolerance.quorum_timeout_s (300 s by default: it covers "
                "a peer's restart; a quorum's requests are also bound by fault_tolerance.timeout_s="
                f"{self.ft.timeout_s} s), and check that the lighthouse's --min_replicas is at most the groups; {more}"
            )
        last = f" (the last: {cause})" if cause else ""
        return (
            f"fault_tolerance: {what}{last} ({where}), each collective given fault_tolerance.timeout_s="
            f"{self.ft.timeout_s} s, so the groups trained apart. Fix: raise fault_tolerance.timeout_s "
            f"if the collectives need longer; the groups' logs name the failing collective; {more}"
        )

    def failed(self) -> bool:
        return self.manager.errored() is not None

    def state_dict(self) -> dict:
        return {"commits": self.commits}

    def load_state_dict(self, state: dict) -> None:
        self.commits = state["commits"]

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
