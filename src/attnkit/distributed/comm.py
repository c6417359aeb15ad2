"""Ring communication over ``torch.distributed``: every rank sends to the next rank and receives
from the previous one, asynchronously, so a transfer overlaps the computation that follows it.

Works with any process group that supports point-to-point operations: gloo (CPU tensors, tested
here with multi-process runs) and NCCL (CUDA tensors; written for it, not tested on GPUs here).
Waits are bounded by the process group's timeout (``init_process_group(timeout=...)``), so a
rank whose peer died raises instead of hanging forever; :meth:`RingComm.handshake` waits for
every other rank with a bound of its own.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class Exchange:
    """Transfers in flight: ``wait()`` blocks until they are done and returns the received
    tensors (those given as ``recv`` to :meth:`RingComm.exchange`)."""

    works: list
    received: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works = []
        return self.received


class RingComm:
    """The ring of one process group: rank r sends to r+1 and receives from r−1 (mod P).

    ``group=None`` is the default (world) group. Ranks are *group* ranks; peers are converted to
    global ranks for the point-to-point calls.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ring attention needs an initialised torch.distributed process group: launch with "
                "torchrun and call torch.distributed.init_process_group(...), or use "
                "attnkit.distributed.spawn(fn, world_size) for local processes")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next_peer = self._global((self.rank + 1) % self.world_size)
        self.prev_peer = self._global((self.rank - 1) % self.world_size)
        self.bytes_sent = 0

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def exchange(self, send: Sequence[torch.Tensor], recv: Optional[Sequence[torch.Tensor]] = None,
                 *, tag: int = 0) -> Exchange:
        """Start sending each tensor of ``send`` to the next rank and receiving tensors of the same
        shapes from the previous rank (into ``recv``, allocated when ``None``); returns at once.

        Tensor ``i`` travels with tag ``tag + i``, so two exchanges in flight at the same time
        (K/V and dK/dV in the backward pass) need tag ranges that do not overlap. Neither
        ``send`` nor ``recv`` may be touched until :meth:`Exchange.wait` returns. With a single
        rank the ring is the identity: the "received" tensors are ``send`` themselves.
        """
        if self.world_size == 1:
            return Exchange([], list(send))
        recv = list(recv) if recv is not None else [torch.empty_like(t) for t in send]
        ops = []
        for i, (outgoing, incoming) in enumerate(zip(send, recv)):
            if not outgoing.is_contiguous() or not incoming.is_contiguous():
                raise ValueError("ring transfers need contiguous tensors (call .contiguous())")
            ops.append(dist.P2POp(dist.isend, outgoing, self.next_peer, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, incoming, self.prev_peer, self.group, tag + i))
            self.bytes_sent += outgoing.numel() * outgoing.element_size()
        return Exchange(dist.batch_isend_irecv(ops), recv)

    def handshake(self, timeout: float, *, tag: int, device: torch.device) -> tuple[list[int], str]:
        """Exchange a one-element token with every other rank of the group and wait at most
        ``timeout`` seconds, in all, for theirs.

        Returns the group ranks whose token did not arrive in time (empty when every rank came)
        and the first transport error seen (``""`` when none). Every rank that calls it learns
        the same absent ranks. On gloo a recv that times out closes the connection to that
        peer, so the group is unusable afterwards (a later transfer between the two fails). One token per peer: ``P − 1`` tiny sends and receives per rank.
        """
        if self.world_size == 1:
            return [], ""
        deadline = time.monotonic() + timeout
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        token = torch.tensor([self.rank], dtype=torch.int64, device=device)
        tokens = torch.empty(len(peers), dtype=torch.int64, device=device)
        recvs = [dist.irecv(tokens[i:i + 1], self._global(peer), self.group, tag)
                 for i, peer in enumerate(peers)]
        sends = [dist.isend(token, self._global(peer), self.group, tag) for peer in peers]
        absent, first_error = [], ""

        def finished(work) -> bool:
            nonlocal first_error
            # At least 1 ms: a zero timeout means "no timeout" to torch.distributed.
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
            try:
                work.wait(timeout=left)
                return True
            except RuntimeError as error:  # a timeout, or the peer's connection is gone
                first_error = first_error or str(error)
                return False

        for peer, work in zip(peers, recvs):
            if not finished(work):
                absent.append(peer)
        for peer, work in zip(peers, sends):
            if peer not in absent and not finished(work):
                absent.append(peer)
        return sorted(absent), first_error

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in group-rank order; bounded by the group timeout."""
        gathered: list = [None] * self.world_size
        if self.world_size == 1:
            return [obj]
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered


def ranks_text(ranks: list[int]) -> str:
    """``"rank 3"`` or ``"ranks 0, 2"``: ranks named in a message."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def disagreement_text(name: str, signatures: list[dict[str, str]],
                      fixes: dict[str, str]) -> Optional[str]:
    """``None`` when every rank's signature (one dict per rank, rank order) is the same; else
    what differs, on which ranks, and the fix ``fixes[key]`` of each differing key, as the
    message of ``name`` (the collective call that compared them)."""
    differing = [key for key in signatures[0]
                 if any(s[key] != signatures[0][key] for s in signatures)]
    if not differing:
        return None
    lines = []
    for key in differing:
        by_value: dict[str, list[int]] = {}
        for rank, signature in enumerate(signatures):
            by_value.setdefault(signature[key], []).append(rank)
        lines.append(f"  {key}: " + "; ".join(f"{ranks_text(ranks)}: {value}"
                                              for value, ranks in by_value.items()))
    return (f"{name}: the {len(signatures)} ranks disagree on {', '.join(differing)}:\n"
            + "\n".join(lines) + "\nFix:\n"
            + "\n".join(f"  {key}: {fixes[key]}" for key in differing))
