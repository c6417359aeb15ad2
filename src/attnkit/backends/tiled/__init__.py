"""Memory-efficient tiled attention in PyTorch (FlashAttention's algorithm, CPU and CUDA).

The score matrix is never built: queries are processed ``block_q`` rows at a time and keys in
*segments* (runs of ``block_k``-wide blocks that the mask's block map classifies alike):

- EMPTY blocks are never computed,
- FULL runs apply no mask,
- PARTIAL runs evaluate ``mask.tile`` (and ``tile_bias``) for that run only, except, with
  torch's fused CPU kernel, square tiles the mask's key ranges show to be lower/upper
  triangles (``masks.key_ranges``, read with the plan): those are never evaluated and run as
  *staircase* segments (a
  sliding-window row: upper triangle, full keys, lower triangle) in strips of
  ``TiledOptions.triangle_strip`` query rows that each see only their allowed keys; and
  partial runs whose rows fall into groups over disjoint keys (the documents of a packed
  row) run as *pieces*, each group of rows over its own keys (``Segment.pieces``, found once
  per plan).

Query blocks that see the same keys relative to their rows and need no element mask (every
block of a sliding window, every other block of equal documents) run as one kernel call over
strided views of all of them (``Plan.runs``).

An online softmax (running max ``m``, running sum ``l``, rescaled accumulator) in fp32 (fp64 for
fp64 input) merges the segments, in place in the output where its rows are a view of it. The
backward pass recomputes every tile from ``(q, k, v, out, lse)``; nothing of size Tq×Tk is
saved. Peak extra memory is a few tiles of ``TILE_ELEMENTS`` scores plus O(T·D) accumulators.

GQA keeps K/V un-repeated: a query block of all G heads sharing one K/V head is laid out as
``[B, Hkv, G·n, D]`` so one batched matmul serves the whole group; a run executes once per
member of the group instead (query heads ``g, g+G, …`` against all K/V heads).

Score modifiers (:mod:`attnkit.modifiers`), in the order :meth:`Modifiers.apply` defines:

- ALiBi and relative biases depend on ``j − i`` alone: each call builds them once, one vector
  per head over the relative positions (O((Tq + Tk)·H), :meth:`Modifiers.position_bias`), and
  every tile reads its bias from it. Alone (no softcap, no score function) they go through
  the fused kernel as its additive mask: a segment without element mask runs over its keys in
  reverse order (K and V reversed once per call, O(T·D)), so that its bias is a view of the
  reversed vector with unit strides (nothing built; see :class:`Positions`); strips, causal
  squares and additive tiles get the bias added (at most a tile); runs execute block by block
  (reversed keys do not shift with a run's blocks). The backward is torch's fused one,
  unless the slopes or tables need gradients or the biases span more than :data:`WIDE_BIAS`:
  then the matmul path, which forms dS, sums it along diagonals into the vector's gradient,
  and the slopes' and tables' come from the vector's construction.
- Softcap and score functions run on the matmul path (the fused kernel takes no change of its
  scores): the softcap with its derivative written out (``dS · (1 − tanh²)``), score functions
  recomputed per tile with autograd enabled locally (``torch.autograd.grad`` of the tile gives
  dS before them and the gradients of the tensors they read, accumulated over tiles).

Nothing of size Tq×Tk is built for them either. The matmul path exponentiates in base 2 and
counts weights below ``2^FLUSH_BELOW`` as 0, so that no tile holds subnormal floats.

Positions may be offset (``q_offset``, ``kv_offset``: global positions of the first local
query/key) so one shard of a longer sequence is computed against another with the global mask,
as ring attention does.

How the engine schedules its tiles (fused kernel or matmul, runs, shared prefixes, staircases)
is set by a :class:`TiledOptions` value, carried by the plan (and so part of its cache key):
``TiledBackend(options)``, ``tiled_attention(..., options=...)``.

Layout (each module imports only from those listed before it): ``plan.py`` (constants,
:class:`TiledOptions`, the plan and its groups, :class:`Problem`), ``positions.py`` (ALiBi and
relative biases read by relative position, and their gradients), ``tiles.py`` (where a group
reads and writes, segment masks, score modifiers and dropout per tile), ``forward.py`` (the
segment kernels, the schedule, :func:`tiled_forward`), ``backward.py`` (:func:`tiled_backward`),
``backend.py`` (the autograd Function, :func:`tiled_attention`, :func:`tiled_weights`,
:class:`TiledBackend`).
"""

from .backend import TiledBackend, tiled_attention, tiled_weights
from .backward import tiled_backward
from .forward import fused_kernel_takes, tiled_forward, uses_fused_kernel
from .plan import (BLOCK_K, FLUSH_BELOW, FUSED_BLOCK_Q, LOG2E, MODIFIED_TILE_KEYS, TILE_ELEMENTS,
                   WIDE_BIAS, Group, Plan, Problem, Segment, TiledOptions, build_plan,
                   choose_block_q, make_plan)

# private, for tests that reach them as ``tiled.<name>``
from .forward import _schedule  # noqa: F401
from .tiles import _run_view, _RunWork  # noqa: F401

__all__ = [
    "BLOCK_K", "FLUSH_BELOW", "FUSED_BLOCK_Q", "LOG2E", "MODIFIED_TILE_KEYS", "TILE_ELEMENTS",
    "WIDE_BIAS", "Group", "Plan", "Problem", "Segment", "TiledBackend", "TiledOptions",
    "build_plan", "choose_block_q", "fused_kernel_takes", "make_plan", "tiled_attention",
    "tiled_backward", "tiled_forward", "tiled_weights", "uses_fused_kernel",
]
