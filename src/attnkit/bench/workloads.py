"""Benchmark workloads as data: shapes, the mask in three equivalent forms, and the FLOP count.

Every workload carries its mask three ways, built from the same parameters:

- the attnkit mask object (what ``attnkit.attention`` gets),
- a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (plus the ``BlockMask`` built from
  it once, with Flex's default block size of 128),
- a dense bool tensor ``[1, 1, N, N]`` for torch SDPA's ``attn_mask`` and the naive method
  (built once, outside any timing).

FLOP convention (as the FlashAttention papers): a forward pass costs ``4·B·H·D`` per attended
(query, key) pair (two matmuls, 2 FLOPs per multiply-add); a dense mask attends ``N²`` pairs and
a causal one, by convention, ``N²/2``. Window, documents and padding masks count the pairs they
really allow (the *useful* FLOPs; skipped work earns nothing). Forward+backward counts 3.5× the
forward (the backward is 2.5× the forward: five matmuls instead of two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import masks as ak_masks
from ..masks import Mask, MaskSpace

FLEX_BLOCK_SIZE = 128
"""Block size of FlexAttention's ``create_block_mask`` (its default)."""

BACKWARD_FACTOR = 2.5
"""Backward FLOPs as a multiple of forward FLOPs (so forward+backward = 3.5× forward)."""

KINDS = ("dense", "causal", "window", "documents", "causal_padding")
"""The mask kinds a workload can have."""


@dataclass(frozen=True)
class Workload:
    """One benchmark problem: ``q, k, v [batch, heads, seq_len, head_dim]`` in ``dtype`` under a
    mask of ``kind`` with its parameter (``window``: keys ``q-window ≤ k ≤ q``; ``doc_len``:
    packed causal documents of that many tokens; ``real_len``: the first ``real_len`` positions
    are real, the rest padding, causal within)."""

    name: str
    kind: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    window: Optional[int] = None
    doc_len: Optional[int] = None
    real_len: Optional[int] = None
    dtype: torch.dtype = field(default=torch.float32)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"workload kind {self.kind!r}: choose one of {KINDS}")
        needed = {"window": "window", "documents": "doc_len", "causal_padding": "real_len"}
        if self.kind in needed and getattr(self, needed[self.kind]) is None:
            raise ValueError(f"workload {self.name!r} of kind {self.kind!r} needs {needed[self.kind]}=")

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, N, D)`` of q, k and v."""
        return (self.batch, self.heads, self.seq_len, self.head_dim)

    @property
    def space(self) -> MaskSpace:
        """The :class:`~attnkit.masks.MaskSpace` the attnkit mask is evaluated over."""
        return MaskSpace(self.batch, self.heads, self.seq_len, self.seq_len)

    @property
    def structured(self) -> bool:
        """True for masks torch SDPA cannot express without a dense tensor (window, documents,
        padding): there, SDPA without a mask is only a speed reference."""
        return self.kind not in ("dense", "causal")

    def describe(self) -> str:
        """One line: name, shape and mask parameters."""
        extra = {"window": f", window {self.window}", "documents": f", documents of {self.doc_len}",
                 "causal_padding": f", {self.real_len}/{self.seq_len} real"}.get(self.kind, "")
        return (f"{self.name}: B{self.batch} H{self.heads} N{self.seq_len} D{self.head_dim} "
                f"{str(self.dtype).replace('torch.', '')}, {self.kind}{extra}")

    def inputs(self, seed: int = 0, requires_grad: bool = False):
        """Random ``q, k, v [B, H, N, D]`` (standard normal, fixed ``seed``)."""
        gen = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(self.shape, generator=gen, dtype=self.dtype) for _ in range(3)]
        return tuple(t.requires_grad_(requires_grad) for t in tensors)

    # ---- the mask, three ways -----------------------------------------------------------------
    def doc_ids(self) -> torch.Tensor:
        """Document id of every position ``[N]`` (only for ``kind="documents"``)."""
        return torch.arange(self.seq_len) // self.doc_len

    def attnkit_mask(self) -> Optional[Mask]:
        """The attnkit mask object (``None`` for dense)."""
        if self.kind == "dense":
            return None
        if self.kind == "causal":
            return ak_masks.causal()
        if self.kind == "window":
            return ak_masks.sliding_window(self.window)
        if self.kind == "documents":
            return ak_masks.documents(self.doc_ids()) & ak_masks.causal()
        return ak_masks.causal() & ak_masks.padding(q_lengths=[self.real_len],
                                                    kv_lengths=[self.real_len])

    def mask_mod(self) -> Callable:
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for the same mask."""
        if self.kind == "dense":
            return lambda b, h, q_idx, kv_idx: q_idx >= 0  # every pair allowed
        if self.kind == "causal":
            return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        if self.kind == "window":
            window = self.window
            return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        if self.kind == "documents":
            ids = self.doc_ids()
            return lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
        real = self.real_len
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx < real) & (kv_idx < real)

    def block_mask(self):
        """FlexAttention ``BlockMask`` built from :meth:`mask_mod` (block size 128), or ``None``
        for dense (Flex's own default: every block full)."""
        if self.kind == "dense":
            return None
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(self.mask_mod(), None, None, self.seq_len, self.seq_len,
                                 device="cpu", BLOCK_SIZE=FLEX_BLOCK_SIZE)

    def dense_mask(self) -> torch.Tensor:
        """The mask as a bool tensor ``[1, 1, N, N]`` (True = may attend), for SDPA and naive."""
        mask = self.attnkit_mask()
        if mask is None:
            return torch.ones(1, 1, self.seq_len, self.seq_len, dtype=torch.bool)
        return mask.to_dense(self.space)  # [1, 1, N, N]

    def rows_with_keys(self) -> torch.Tensor:
        """Bool ``[N]``: which query rows have at least one allowed key (padded queries do not)."""
        rows = torch.ones(self.seq_len, dtype=torch.bool)
        if self.kind == "causal_padding":
            rows[self.real_len:] = False
        return rows

    # ---- work ------------------------------------------------------------------------------------
    def attended_pairs(self) -> float:
        """Number of (query, key) pairs counted as work for one (batch, head): exact for window,
        documents and padding, ``N²`` for dense and ``N²/2`` (the convention) for causal."""
        n = self.seq_len
        if self.kind == "dense":
            return float(n * n)
        if self.kind == "causal":
            return n * n / 2
        if self.kind == "window":
            # query i sees min(i, window) earlier keys plus itself
            full = max(0, n - self.window)  # queries with a full window
            ramp = n - full  # queries 0 .. min(n, window)-1 see i+1 keys
            return float(ramp * (ramp + 1) // 2 + full * (self.window + 1))
        if self.kind == "documents":
            sizes = [min(self.doc_len, n - start) for start in range(0, n, self.doc_len)]
            return float(sum(s * (s + 1) // 2 for s in sizes))
        return float(self.real_len * (self.real_len + 1) // 2)

    def flops(self, backward: bool = False) -> float:
        """Useful FLOPs of one forward (``backward=False``) or forward+backward pass."""
        forward = 4.0 * self.batch * self.heads * self.head_dim * self.attended_pairs()
        return forward * (1.0 + BACKWARD_FACTOR) if backward else forward


def standard_workloads() -> list[Workload]:
    """The standard workloads: dense and causal at B1 H8 N2048 D64; sliding window 512,
    packed causal documents of 512, and causal with 3/4 of the sequence real (padding), each at
    B1 H4 N8192 D64; all fp32."""
    n = 8192
    return [
        Workload("dense", "dense", 1, 8, 2048, 64),
        Workload("causal", "causal", 1, 8, 2048, 64),
        Workload("window", "window", 1, 4, n, 64, window=512),
        Workload("documents", "documents", 1, 4, n, 64, doc_len=512),
        Workload("causal_padding", "causal_padding", 1, 4, n, 64, real_len=n * 3 // 4),
    ]


def quick_workloads() -> list[Workload]:
    """The same five kinds at tiny sizes (N 256/512, two heads) for tests and smoke runs."""
    n = 512
    return [
        Workload("dense", "dense", 1, 2, 256, 32),
        Workload("causal", "causal", 1, 2, 256, 32),
        Workload("window", "window", 1, 2, n, 32, window=64),
        Workload("documents", "documents", 1, 2, n, 32, doc_len=128),
        Workload("causal_padding", "causal_padding", 1, 2, n, 32, real_len=n * 3 // 4),
    ]


def select(workloads: list[Workload], names: Optional[list[str]]) -> list[Workload]:
    """The workloads whose name is in ``names``, in that order, each once (all when ``names``
    is empty/None); raises ``ValueError`` naming the choices for an unknown name."""
    if not names:
        return list(workloads)
    known = {w.name: w for w in workloads}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}: choose from {list(known)}")
    return [known[n] for n in dict.fromkeys(names)]  # a name given twice runs once


def packed_ids(length: int, low: int, high: int, median: float, sigma: float,
               seed: int) -> torch.Tensor:
    """LongTensor ``[length]``: document ids of a packed batch whose document lengths are
    log-normal (``median``, ``sigma``) clipped to ``[low, high]``; the last one is cut to fit.
    Seeded (``seed``), for the load-balance benchmark and its tests."""
    import math

    import numpy as np
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < length:
        lengths.append(int(np.clip(rng.lognormal(math.log(median), sigma), low, high)))
    lengths[-1] -= sum(lengths) - length
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
