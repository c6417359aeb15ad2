"""Sequence parallelism over ``torch.distributed`` (gloo on CPU, NCCL on GPU): ring attention,
Ulysses (:func:`ulysses_attention`: all-to-all to head shards of the whole sequence) and their
hybrid on a 2-D mesh (:func:`hybrid_attention`: Ulysses inside a group, ring across groups).

    import attnkit as ak
    from attnkit.distributed import ring_attention, shard, unshard

    # on every rank of an initialised process group (torchrun, or spawn() for local runs):
    q_local = shard(q, rank, world_size, layout="zigzag")          # [..., H, T/P, D]
    out_local = ring_attention(q_local, k_local, v_local, ak.causal(), layout="zigzag")
    out = unshard(gathered_outputs, layout="zigzag")                 # [..., H, T, D]

For masks other than plain causal (packed documents, windows, padding), ``plan_balance(mask, T, P)``
plans a :class:`BalancedLayout` that evens out the work; pass it as ``layout=`` to all three.

Not imported by ``import attnkit``: it loads ``torch.distributed`` on first use only.
See docs/DISTRIBUTED.md.
"""

from .balance import (BalancedLayout, balance_blocks, default_block, plan_balance, rank_work,
                      tile_work)
from .comm import RingComm
from .hybrid import hybrid_attention, hybrid_bytes, hybrid_shard, hybrid_unshard
from .launch import PeakMemory, spawn
from .parallel import SequenceParallel
from .ring import LAYOUTS, RingStats, ring_attention, shard, unshard
from .ulysses import ulysses_attention, ulysses_bytes

__all__ = ["ring_attention", "shard", "unshard", "spawn", "RingStats", "RingComm", "PeakMemory",
           "LAYOUTS", "plan_balance", "BalancedLayout", "balance_blocks", "default_block",
           "tile_work", "rank_work", "ulysses_attention", "ulysses_bytes", "SequenceParallel",
           "hybrid_attention", "hybrid_bytes", "hybrid_shard", "hybrid_unshard"]
