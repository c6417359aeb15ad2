"""Sequence parallelism: ring attention over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

    import attnkit as ak
    from attnkit.distributed import ring_attention, shard, unshard

    # on every rank of an initialised process group (torchrun, or spawn() for local runs):
    q_local = shard(q, rank, world_size, layout="zigzag")          # [..., H, T/P, D]
    out_local = ring_attention(q_local, k_local, v_local, ak.causal(), layout="zigzag")
    out = unshard(gathered_outputs, layout="zigzag")                 # [..., H, T, D]

Not imported by ``import attnkit``: it loads ``torch.distributed`` on first use only.
See docs/DISTRIBUTED.md.
"""

from .comm import RingComm
from .launch import PeakMemory, spawn
from .ring import LAYOUTS, RingStats, ring_attention, shard, unshard

__all__ = ["ring_attention", "shard", "unshard", "spawn", "RingStats", "RingComm", "PeakMemory",
           "LAYOUTS"]
