"""The ``@triton.jit`` kernels: the forward, the backward's dQ (which also writes the row
statistics) and dK/dV, and the stored-dS backward's statistics and dQ = dS·K.

Loaded by ``launch.kernels()`` once per mode (compiled for CUDA, interpreted for CPU
tensors), never imported by name: Triton decides at decoration time which one it is.

- **Base 2.** Scores are kept as ``s2 = (q·kᵀ·scale + bias)·log2(e)``, so the softmax uses
  ``exp2`` and the scale is one multiply (``qk_scale``). The LSE is stored in natural log,
  float32; a fully masked row keeps ``m = -inf``, ``l = 0``: output 0, LSE ``-inf``.
- **One walk.** Every kernel visits its tiles through :func:`_walk`, over the host-built block
  lists of its row (``launch.BlockLists``: PARTIAL sparse blocks first, then FULL ones), and
  calls its pass's tile function (:func:`_fwd_tile`, :func:`_dq_tile`, :func:`_dkdv_tile`,
  :func:`_dq_stored_tile`) for each kernel block. ``ONE_LOOP`` off: one loop over the PARTIAL
  blocks, where the mask program runs, and one over the FULL blocks, where nothing does (the
  Triton tutorial's two calls of one inner loop); on: a single loop that tests per block
  whether to mask (one software pipeline per row: short rows). When a kind's blocks
  are evenly spaced (``PARTIAL_STRIDED``/``FULL_STRIDED``) their positions are computed from
  the loop counter instead of loaded, so the pipeliner can prefetch several tiles ahead.
- **The mask program** (:data:`MaskArgs`, one kernel argument) runs in PARTIAL tiles only:
  a band, per-batch lengths, per-row document ranges or ids, a dense int8 mask, a bias; each
  a ``tl.constexpr`` switch, so a feature that is off costs nothing. Tiles compare tile
  offsets against per-tile scalars (:func:`_allowed`), which the compiler folds into each
  thread's constant offsets. ``BOUNDS``: a length is not a multiple of the sparse blocks (the
  host marks ragged blocks PARTIAL, so FULL tiles never check bounds).
- **Score modifiers** (:data:`~attnkit.backends.triton.launch.ModArgs`, one argument ``mods``)
  run in every tile, FULL ones too, on the scaled scores in natural units before the mask:
  a soft cap ``cap·tanh(s/cap)``, ALiBi ``slope·(k − q − shift)`` computed from positions, and
  a per-head bias by relative position ``k − q`` read from a vector (a relative-position
  table already looked up per distance, O(Tq + Tk)). The dQ kernel adds their parameters'
  gradients by atomics: one per tile for the slope (given a slot per program, as the
  invariance contract does, in an order fixed by the walk), one per score for the vector.
- **Invariance** (``launch.key_order_lists``): under the contract every listed block is
  PARTIAL, in key order, from each sequence's first key (``SHIFTED``), so a row's keys fold
  in the same blocks, the same order and the same arithmetic whatever the batch or chunk.
- **TMA** (``TMA`` from the config, ``TMA_OK`` from the host): walked tiles come by tensor
  descriptors made in the kernel (they zero-fill past the ends), else by pointers.
- Head dims are padded to powers of two (``DK_PAD``/``DV_PAD``; ``EVEN_*``: no padding).
  ``UPCAST`` (interpreter and bfloat16 only) casts dot operands to float32, because the
  interpreter's ``tl.dot`` multiplies bfloat16 bit patterns (triton-lang/triton#11584).
"""

from collections import namedtuple

import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
"""Whether this copy of the module is the interpreter's (``launch.kernels`` loads one per mode)."""

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BIAS_FLOOR = tl.constexpr(-2.35e38)
"""The least bias value a kernel adds: ``finfo(float32).min · LOG2E`` would overflow to −inf
in base 2, so a row of only such fills (``finfo.min`` padding) would read as a row with no
key; clamped, it stays the uniform average the other backends give (values below the floor
count as equal: a row of only such values averages them all)."""

# The kernels take the mask program, the block lists and the stored-dS buffer as one tuple
# argument each (``launch.MaskArgs``, ``launch.Lists``, ``launch.Stored``), their switches
# ``tl.constexpr``; inside, each pass hands its tiles one tuple of what they share.
Common = namedtuple("Common", [
    "b", "h", "q_len", "kv_len", "head_dk", "head_dv", "qk_scale", "mask", "own", "offs_dk",
    "offs_dv", "BOUNDS", "EVEN_DK", "EVEN_DV", "PRECISION", "UPCAST", "USE_TMA", "mods"])
"""What every tile of a program needs: its (batch, head), sizes, the base-2 scale, the mask
program and its own rows' part (:func:`_own_rows`), head-dim offsets and switches, and the
score modifiers."""

Walked = namedtuple("Walked", ["src", "s_t", "s_d", "length", "dim"])
"""A walked tensor of one head: a pointer base with row/column strides, or a TMA descriptor.

A tuple built in a kernel keeps its ``tl.constexpr`` fields only while it is never assigned
to a name (an assignment turns them into tensors): :data:`Common` and the passes' contexts
are built inside the calls that take them, and the tile functions read them off their
parameters."""

SIZES = ["heads", "q_len", "kv_len", "TUNE_KEY"]
"""Sizes the JIT must not specialize on (multiples of 16, 1): one binary serves every length.
The GQA group (1: dK/dV's loop over a group's heads disappears) and the head dims keep their
specializations."""


# ---- small helpers ------------------------------------------------------------------------
@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a [M, K] @ b [K, N]`` accumulated in float32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    """tanh in float32: libdevice's when compiled; interpreted (no libdevice tanh there), an
    odd Taylor polynomial below 1/4 (no cancellation near 0; error below 1e-10 there),
    ``(1 − e)/(1 + e)`` with ``e = exp(−2|x|)`` above, the sign restored."""
    if not INTERPRETED:
        return libdevice.tanh(x)
    a = tl.abs(x)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (
        62.0 / 2835.0 + a2 * (-1382.0 / 155925.0))))))
    e = tl.math.exp2(a * (-2.0 * LOG2E))
    large = (1.0 - e) / (1.0 + e)
    t = tl.where(a < 0.25, small, large)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _program_ids(heads):
    """This program's block index and ``(batch, head)`` (int64) in a ``(blocks, B × heads)``
    grid."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    return pid, (pid_bh // heads).to(tl.int64), (pid_bh % heads).to(tl.int64)


@triton.jit
def _tile_ptrs(base, offs_r, offs_d, s_r, s_d):
    """Pointers to ``base[offs_r, offs_d]`` → ``[R, D]``."""
    return base + offs_r[:, None] * s_r + offs_d[None, :] * s_d


@triton.jit
def _in_bounds(offs_r, offs_d, rows, dim):
    """``[R, D]``: row ``< rows`` and column ``< dim``."""
    return (offs_r[:, None] < rows) & (offs_d[None, :] < dim)


@triton.jit
def _own_tile(base, offs_r, offs_d, s, rows, dim):
    """A program's own ``[R, D]`` tile of a ``[B, H, T, D]`` tensor (``base``: its head;
    ``s``: the four strides), zero past the ends. The mask is built before the pointers
    (keyword arguments are evaluated first): the order ptxas allocates registers best in."""
    return tl.load(_tile_ptrs(base, offs_r, offs_d, s[2], s[3]),
                   mask=_in_bounds(offs_r, offs_d, rows, dim), other=0.0)


@triton.jit
def _store_tile(base, offs_r, offs_d, s, rows, dim, value):
    tl.store(_tile_ptrs(base, offs_r, offs_d, s[2], s[3]), value.to(base.dtype.element_ty),
             mask=_in_bounds(offs_r, offs_d, rows, dim))


@triton.jit
def _walked(base, s, length, dim, BLOCK: tl.constexpr, D_PAD: tl.constexpr,
            USE_TMA: tl.constexpr):
    """One head's ``[length, dim]`` rows (``base``, strides ``s``) as a :data:`Walked`: a
    descriptor of ``[BLOCK, D_PAD]`` tiles with USE_TMA, else the pointer."""
    src = base
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[length, dim], strides=[s[2], 1],
                                        block_shape=[BLOCK, D_PAD])
    return Walked(src, s[2], s[3], length, dim)


@triton.jit
def _load_walked(w, start, offs_r, offs_d, BOUNDED: tl.constexpr, EVEN: tl.constexpr,
                 USE_TMA: tl.constexpr):
    """Rows ``start …`` (``offs_r``) of a :data:`Walked` tensor → ``[R, D]``; BOUNDED: rows past
    the end read 0 (a TMA copy always zero-fills)."""
    if USE_TMA:
        tile = w.src.load([start, 0])
    else:
        ptrs = _tile_ptrs(w.src, offs_r, offs_d, w.s_t, w.s_d)
        if BOUNDED:
            tile = tl.load(ptrs, mask=_in_bounds(offs_r, offs_d, w.length, w.dim), other=0.0)
        elif EVEN:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < w.dim, other=0.0)
    return tile


# ---- the walk -------------------------------------------------------------------------------
@triton.jit
def _spacing(blocks, first, count, SPARSE: tl.constexpr, STRIDED: tl.constexpr):
    """When entries ``first … first + count`` of a row's list are evenly spaced (STRIDED):
    ``(base, step)`` with entry ``j`` at position ``base + j·step`` (two loads, before the
    loop); else ``(0, 0)``, unused."""
    base = 0
    step = 0
    if STRIDED:
        b0 = tl.load(blocks + first, mask=count > 0, other=0)
        b1 = tl.load(blocks + first + 1, mask=count > 1, other=0)
        step = tl.where(count > 1, b1 - b0, 1) * SPARSE
        base = b0 * SPARSE - first * step
    return base, step


@triton.jit
def _walk_blocks(TILE: tl.constexpr, state, c, ctx, blocks, first, split, stop, shift,
                 SPARSE: tl.constexpr, BLOCK: tl.constexpr, PARTIAL: tl.constexpr,
                 STRIDED: tl.constexpr):
    """Fold entries ``first … stop`` of a row's list into ``state``, one kernel block per
    iteration: ``state = TILE(state, c, ctx, t, start, partial, MAY_PARTIAL)`` (``c``: the
    :data:`Common` part, ``ctx`` the pass's own), ``t`` the kernel
    block's place in the list (entry ``t // (SPARSE // BLOCK)``), ``start`` its first
    position (entry ``j`` covers ``shift + j·SPARSE …``). PARTIAL: 1, every entry is PARTIAL;
    0, none is; 2, those before ``split`` (``partial`` a runtime value)."""
    SUBS: tl.constexpr = SPARSE // BLOCK
    p_base, p_step = _spacing(blocks, first, split - first, SPARSE, STRIDED and PARTIAL != 0)
    f_base, f_step = _spacing(blocks, split, stop - split, SPARSE, STRIDED and PARTIAL != 1)
    for t in range(first * SUBS, stop * SUBS):
        j = t // SUBS
        if PARTIAL == 2:
            partial = t < split * SUBS
        else:
            partial = PARTIAL == 1
        if not STRIDED:
            start = tl.load(blocks + j) * SPARSE
        elif PARTIAL == 2:
            start = tl.where(partial, p_base + j * p_step, f_base + j * f_step)
        elif PARTIAL == 1:
            start = p_base + j * p_step
        else:
            start = f_base + j * f_step
        state = TILE(state, c, ctx, t, shift + start + (t % SUBS) * BLOCK, partial, PARTIAL != 0)
    return state


@triton.jit
def _walk(TILE: tl.constexpr, state, c, ctx, lists, b, h, row, SPARSE: tl.constexpr,
          BLOCK: tl.constexpr, ONE_LOOP: tl.constexpr, FULL_FIRST: tl.constexpr):
    """Fold row ``row`` of the (batch ``b``, head ``h``) block lists into ``state`` with TILE
    (see :func:`_walk_blocks`): its PARTIAL entries and its FULL ones, in two loops (the FULL
    one first with FULL_FIRST: each kernel takes the order ptxas allocates its registers best
    in) or, with ONE_LOOP, in one. SHIFTED lists place batch ``b``'s blocks from its first
    key, ``starts[b]`` (the invariance contract's left padding, ``launch.key_order_lists``)."""
    shift = 0
    if lists.SHIFTED:
        shift = tl.load(lists.starts + b * lists.s_start)
    counts = b * lists.s_n[0] + h * lists.s_n[1] + row * lists.s_n[2]
    n_partial = tl.load(lists.num_partial + counts)
    n_full = tl.load(lists.num_full + counts)
    blocks = lists.index + b * lists.s_i[0] + h * lists.s_i[1] + row * lists.s_i[2]
    if ONE_LOOP:
        state = _walk_blocks(TILE, state, c, ctx, blocks, 0, n_partial, n_partial + n_full,
                             shift, SPARSE, BLOCK, 2, lists.PARTIAL_STRIDED and lists.FULL_STRIDED)
    else:
        for part in tl.static_range(2):
            if (part == 0) != FULL_FIRST:
                state = _walk_blocks(TILE, state, c, ctx, blocks, 0, n_partial, n_partial,
                                     shift, SPARSE, BLOCK, 1, lists.PARTIAL_STRIDED)
            else:
                state = _walk_blocks(TILE, state, c, ctx, blocks, n_partial, n_partial,
                                     n_partial + n_full, shift, SPARSE, BLOCK, 0,
                                     lists.FULL_STRIDED)
    return state


# ---- the mask program ------------------------------------------------------------------------
@triton.jit
def _own_rows(offs, b, length, mask, TRANSPOSED: tl.constexpr):
    """The mask's inputs for a program's own rows (query rows ``offs``, or TRANSPOSED key
    rows), loaded once before the walk instead of in every tile: the batch's query and key
    lengths, and the rows' document ranges ``[lo, hi)`` (``DOC_RANGES``) or ids (in ``lo``).
    Unused entries are 0. → ``(q_limit, kv_limit, lo [R], hi [R])``."""
    q_limit = 0
    kv_limit = 0
    lo = tl.zeros_like(offs)
    hi = tl.zeros_like(offs)
    if mask.HAS_QLEN:
        q_limit = tl.load(mask.q_lens + b * mask.s_qlen)
    if mask.HAS_KVLEN:
        kv_limit = tl.load(mask.kv_lens + b * mask.s_kvlen)
    if mask.HAS_DOCS:
        if TRANSPOSED:  # key rows: each key's query range (or id)
            ptrs = mask.kv_docs + b * mask.s_kvdoc[0] + offs * mask.s_kvdoc[1]
            missing = -2  # never equal to a query's id
        else:  # query rows: each query's key range (or id)
            ptrs = mask.q_docs + b * mask.s_qdoc[0] + offs * mask.s_qdoc[1]
            missing = -1
        if mask.DOC_RANGES:
            lo = tl.load(ptrs, mask=offs < length, other=0)
            hi = tl.load(ptrs + 1, mask=offs < length, other=0)
        else:
            lo = tl.load(ptrs, mask=offs < length, other=missing)
    return q_limit, kv_limit, lo, hi


@triton.jit
def _allowed(q_start, k_start, i, j, c, TRANSPOSED: tl.constexpr):
    """Bool "may attend" of the tile whose query rows start at ``q_start`` and key rows at
    ``k_start``; ``i``, ``j``: its query and key offsets as broadcastable aranges (``[M, 1]`` ×
    ``[1, N]``, TRANSPOSED ``[1, M]`` × ``[N, 1]``) → ``[M, N]`` (``[N, M]``). Comparisons are
    written against the offsets with the starts moved to the scalar side
    (``k − q ≤ hi`` as ``j − i ≤ hi + q_start − k_start``), so the aranges fold into each
    thread's constant offsets; with documents the band is compared on positions, the form of
    the documents' own comparisons. The host clamps the band to ``[-Tq, Tk]``, so no sum
    overflows int32."""
    q_limit, kv_limit, lo, hi = c.own
    if c.BOUNDS:
        inside = (i < c.q_len - q_start) & (j < c.kv_len - k_start)
        ok = inside
    else:
        if TRANSPOSED:
            ok = tl.full([j.shape[0], i.shape[1]], 1, tl.int1)
        else:
            ok = tl.full([i.shape[0], j.shape[1]], 1, tl.int1)
        inside = ok
    q_pos = q_start + i
    k_pos = k_start + j
    if c.mask.HAS_DOCS:
        if c.mask.HAS_LO:
            if TRANSPOSED:
                ok = ok & (q_pos <= k_pos - c.mask.band_lo)
            else:
                ok = ok & (k_pos >= q_pos + c.mask.band_lo)
        if c.mask.HAS_HI:
            if TRANSPOSED:
                ok = ok & (q_pos >= k_pos - c.mask.band_hi)
            else:
                ok = ok & (k_pos <= q_pos + c.mask.band_hi)
    else:
        if c.mask.HAS_LO:
            ok = ok & (j - i >= c.mask.band_lo + q_start - k_start)
        if c.mask.HAS_HI:
            ok = ok & (j - i <= c.mask.band_hi + q_start - k_start)
    if c.mask.HAS_QLEN:
        ok = ok & (i < q_limit - q_start)
    if c.mask.HAS_KVLEN:
        ok = ok & (j < kv_limit - k_start)
    if c.mask.HAS_DOCS and c.mask.DOC_RANGES:  # the other side's positions against the rows' ranges
        if TRANSPOSED:
            ok = ok & (q_pos >= lo[:, None]) & (q_pos < hi[:, None])
        else:
            ok = ok & (k_pos >= lo[:, None]) & (k_pos < hi[:, None])
    elif c.mask.HAS_DOCS:  # the rows' ids against the other side's, loaded per tile
        if TRANSPOSED:
            q_doc = tl.load(c.mask.q_docs + c.b * c.mask.s_qdoc[0] + q_pos * c.mask.s_qdoc[1],
                            mask=q_pos < c.q_len, other=-1)
            ok = ok & (q_doc == lo[:, None])
        else:
            kv_doc = tl.load(c.mask.kv_docs + c.b * c.mask.s_kvdoc[0] + k_pos * c.mask.s_kvdoc[1],
                             mask=k_pos < c.kv_len, other=-2)
            ok = ok & (lo[:, None] == kv_doc)
    if c.mask.HAS_DENSE:
        s = c.mask.s_dense
        flag = tl.load(c.mask.dense + c.b * s[0] + c.h * s[1] + q_pos * s[2] + k_pos * s[3],
                       mask=inside, other=0)
        ok = ok & (flag != 0)
    return ok


@triton.jit
def _masked(s, q_start, k_start, c, TRANSPOSED: tl.constexpr):
    """Scores ``s`` (``[M, N]``, TRANSPOSED ``[N, M]``) of a PARTIAL tile with forbidden entries
    at ``-inf`` and, with a bias (then ``s`` is scaled, base 2), the bias added."""
    if TRANSPOSED:
        i = tl.arange(0, s.shape[1])[None, :]
        j = tl.arange(0, s.shape[0])[:, None]
    else:
        i = tl.arange(0, s.shape[0])[:, None]
        j = tl.arange(0, s.shape[1])[None, :]
    ok = _allowed(q_start, k_start, i, j, c, TRANSPOSED)
    if c.mask.HAS_BIAS:  # float32 values, -inf = masked
        sb = c.mask.s_bias
        q_pos = q_start + i
        k_pos = k_start + j
        offs = c.b * sb[0] + c.h * sb[1] + q_pos * sb[2] + k_pos * sb[3]
        if c.BOUNDS:
            extra = tl.load(c.mask.bias + offs, mask=(q_pos < c.q_len) & (k_pos < c.kv_len),
                            other=0.0)
        else:
            extra = tl.load(c.mask.bias + offs)
        extra = extra.to(tl.float32)
        ok = ok & (extra != float("-inf"))
        extra = tl.where(extra < BIAS_FLOOR, BIAS_FLOOR, extra)  # NaN stays NaN
        s = s + tl.where(ok, extra * LOG2E, 0.0)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _relative(s, q_start, k_start, TRANSPOSED: tl.constexpr):
    """Key minus query position of every entry of a tile shaped as ``s`` (``[M, N]``,
    TRANSPOSED ``[N, M]``) → int32, ``s``'s shape."""
    if TRANSPOSED:
        rel = (k_start + tl.arange(0, s.shape[0]))[:, None] - (q_start + tl.arange(0, s.shape[1]))[None, :]
    else:
        rel = (k_start + tl.arange(0, s.shape[1]))[None, :] - (q_start + tl.arange(0, s.shape[0]))[:, None]
    return rel


@triton.jit
def _modified(s, q_start, k_start, c, TRANSPOSED: tl.constexpr):
    """Raw scores ``s`` (unscaled ``q·kᵀ``) → the modified scores in base 2, and the soft
    cap's derivative ``1 − tanh²`` (1.0 without one): scale, cap, ALiBi, relative bias."""
    s = s * (c.qk_scale * LN2)
    slope_of = 1.0
    if c.mods.HAS_CAP:
        t = _tanh(s / c.mods.cap)
        s = c.mods.cap * t
        slope_of = 1.0 - t * t
    if c.mods.HAS_ALIBI or c.mods.HAS_DIAG:
        rel = _relative(s, q_start, k_start, TRANSPOSED)
        if c.mods.HAS_ALIBI:
            slope = tl.load(c.mods.slopes + c.b * c.mods.s_slopes[0] + c.h * c.mods.s_slopes[1])
            s = s + slope.to(tl.float32) * (rel - c.mods.shift).to(tl.float32)
        if c.mods.HAS_DIAG:
            at = rel + c.mods.diag_off
            s = s + tl.load(c.mods.diag + c.h * c.mods.s_diag[0] + at * c.mods.s_diag[1],
                            mask=(at >= 0) & (at < c.mods.diag_len), other=0.0).to(tl.float32)
    return s * LOG2E, slope_of


@triton.jit
def _scores(x, y, q_start, k_start, c, partial, TRANSPOSED: tl.constexpr):
    """Base-2 scores ``x @ yᵀ · qk_scale`` of query rows from ``q_start`` and key rows from
    ``k_start`` (``x`` = q ``[M, D]``, ``y`` = k ``[N, D]`` → ``[M, N]``; TRANSPOSED: ``x`` = k,
    ``y`` = q → ``[N, M]``), modified (:func:`_modified`), through :func:`_masked` when
    ``partial``; and the soft cap's derivative (1.0 without one). Without a bias or modifier
    the mask only selects, so it applies to the raw scores and the scale comes last (the
    caller's ``exp2(s2 − lse)`` is then one FMA per score, as in FULL tiles)."""
    s = _dot(x, tl.trans(y), c.PRECISION, c.UPCAST)
    slope_of = 1.0
    if c.mods.ANY:
        s, slope_of = _modified(s, q_start, k_start, c, TRANSPOSED)
        if partial:
            s = _masked(s, q_start, k_start, c, TRANSPOSED)
    elif c.mask.HAS_BIAS:
        s = s * c.qk_scale
        if partial:
            s = _masked(s, q_start, k_start, c, TRANSPOSED)
    else:
        if partial:
            s = _masked(s, q_start, k_start, c, TRANSPOSED)
        s = s * c.qk_scale
    return s, slope_of


# ---- forward ----------------------------------------------------------------------------------
FwdCtx = namedtuple("FwdCtx", ["q", "q_start", "k", "v", "BLOCK_N"])


@triton.jit
def _fwd_tile(state, c, ctx, t, start_n, partial, MAY_PARTIAL: tl.constexpr):
    """Key rows ``start_n …`` folded into the online softmax ``state = (m [M], l [M],
    acc [M, DV])`` of the query rows ``ctx.q_start …``. FULL tiles and PARTIAL ones without a
    bias take the row max on the raw scores and scale inside the exponent's FMA (one multiply
    per row, ``max(s)·scale = max(s·scale)`` for scale > 0). A row with nothing allowed yet
    keeps ``m = -inf`` and subtracts 0 (only where a tile may be PARTIAL). In the one-loop walk
    only the masking is conditional: Triton's pipeliner fails on a loop whose branch yields
    the softmax itself."""
    m_i, l_i, acc = state
    offs_n = start_n + tl.arange(0, ctx.BLOCK_N)
    bounded: tl.constexpr = c.BOUNDS and MAY_PARTIAL
    k = _load_walked(ctx.k, start_n, offs_n, c.offs_dk, bounded, c.EVEN_DK, c.USE_TMA)  # [N, DK]
    v = _load_walked(ctx.v, start_n, offs_n, c.offs_dv, bounded, c.EVEN_DV, c.USE_TMA)  # [N, DV]
    if c.mask.HAS_BIAS or c.mods.ANY:  # scaled (and modified) scores, bias added in base 2
        s2, _ = _scores(ctx.q, k, ctx.q_start, start_n, c, partial, False)
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s2 - m_sub[:, None])
    else:
        s = _dot(ctx.q, tl.trans(k), c.PRECISION, c.UPCAST)  # unscaled
        if partial:
            s = _masked(s, ctx.q_start, start_n, c, False)
        m_new = tl.maximum(m_i, tl.max(s, 1) * c.qk_scale)
        m_sub = m_new
        if MAY_PARTIAL:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * c.qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, c.PRECISION, c.UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=SIZES)
def attn_fwd(Q, K, V, Out, Lse, s_q, s_k, s_v, s_out, s_lse,
             heads, group, q_len, kv_len, head_dk, head_dv, qk_scale, lists, mask, mods, TUNE_KEY,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
             SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
             EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr, ONE_LOOP: tl.constexpr, TMA: tl.constexpr,
             TMA_OK: tl.constexpr, BOUNDS: tl.constexpr):
    """Forward, one program per (query block, batch × head): ``Out [B, H, Tq, Dv]`` and
    ``Lse [B, H, Tq]`` (float32, natural log). ``s_*``: each tensor's strides; ``TUNE_KEY``
    only keys the autotuner's cache."""
    pid_m, b, h = _program_ids(heads)
    h_kv = h // group  # GQA: K/V are indexed, never repeated
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_ptrs = _tile_ptrs(Q + b * s_q[0] + h * s_q[1], offs_m, offs_dk, s_q[2], s_q[3])
    q = tl.load(q_ptrs, mask=_in_bounds(offs_m, offs_dk, q_len, head_dk), other=0.0)  # [M, DK]
    USE_TMA: tl.constexpr = TMA and TMA_OK
    k = _walked(K + b * s_k[0] + h_kv * s_k[1], s_k, kv_len, head_dk, BLOCK_N, DK_PAD, USE_TMA)
    v = _walked(V + b * s_v[0] + h_kv * s_v[1], s_v, kv_len, head_dv, BLOCK_N, DV_PAD, USE_TMA)
    own = _own_rows(offs_m, b, q_len, mask, False)
    state = (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32),
             tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32))
    m_i, l_i, acc = _walk(
        _fwd_tile, state, Common(b, h, q_len, kv_len, head_dk, head_dv, qk_scale, mask, own,
                                 offs_dk, offs_dv, BOUNDS, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                                 USE_TMA, mods),
        FwdCtx(q, q_start, k, v, BLOCK_N), lists, b, h, q_start // SPARSE_Q, SPARSE_K, BLOCK_N,
        ONE_LOOP, False)
    empty = l_i == 0.0  # no allowed key: output 0, LSE -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = _tile_ptrs(Out + b * s_out[0] + h * s_out[1], offs_m, offs_dv, s_out[2], s_out[3])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=_in_bounds(offs_m, offs_dv, q_len, head_dv))
    tl.store(Lse + b * s_lse[0] + h * s_lse[1] + offs_m * s_lse[2], lse, mask=offs_m < q_len)


# ---- backward ---------------------------------------------------------------------------------
@triton.jit
def _row_stats(o_base, do, Lse, dLse, Lse2, Delta, row0, offs_m, s_out, q_len, head_dv,
               HAS_DLSE: tl.constexpr):
    """The backward's statistics of a program's own query rows, stored for dK/dV:
    Δ = rowsum(dO ∘ O) (minus the LSE's gradient with HAS_DLSE) and the LSE in base 2, ``+inf``
    where it is ``-inf`` (so ``exp2(s − lse2) = 0``). ``Lse``, ``dLse``, ``Lse2``, ``Delta``:
    contiguous ``[B, H, Tq]`` float32, this head's rows from ``row0``; ``do``: the ``[M, DV]``
    dO tile; ``o_base``: this head's output."""
    rows = row0 + offs_m
    inside = offs_m < q_len
    o = tl.load(_tile_ptrs(o_base, offs_m, tl.arange(0, do.shape[1]), s_out[2], s_out[3]),
                mask=_in_bounds(offs_m, tl.arange(0, do.shape[1]), q_len, head_dv), other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dLse + rows, mask=inside, other=0.0)
    lse = tl.load(Lse + rows, mask=inside, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(Delta + rows, delta, mask=inside)
    tl.store(Lse2 + rows, lse2, mask=inside)
    return lse2, delta


DqCtx = namedtuple("DqCtx", ["q", "do", "lse2", "delta", "q_start", "k", "v", "BLOCK_N"])


@triton.jit
def _dq_tile(dq, c, ctx, t, start_n, partial, MAY_PARTIAL: tl.constexpr):
    """Key rows ``start_n …``'s contribution to ``dq [M, DK]`` of the query rows
    ``ctx.q_start …``."""
    offs_n = start_n + tl.arange(0, ctx.BLOCK_N)
    bounded: tl.constexpr = c.BOUNDS and MAY_PARTIAL
    k = _load_walked(ctx.k, start_n, offs_n, c.offs_dk, bounded, c.EVEN_DK, c.USE_TMA)  # [N, DK]
    v = _load_walked(ctx.v, start_n, offs_n, c.offs_dv, bounded, c.EVEN_DV, c.USE_TMA)  # [N, DV]
    s2, slope_of = _scores(ctx.q, k, ctx.q_start, start_n, c, partial, False)  # [M, N]
    p = tl.math.exp2(s2 - ctx.lse2[:, None])
    dp = _dot(ctx.do, tl.trans(v), c.PRECISION, c.UPCAST)  # [M, N]
    ds = p * (dp - ctx.delta[:, None])  # the gradient of the modified scores
    if c.mods.GRAD_SLOPE or c.mods.GRAD_DIAG:
        rel = _relative(ds, ctx.q_start, start_n, False)
        if c.mods.GRAD_SLOPE:  # d slope = Σ ds · (k − q − shift)
            slot = (ctx.q_start // 16) * c.mods.s_dslope[2]  # one per program (or shared: 0)
            tl.atomic_add(c.mods.dslope + c.b * c.mods.s_dslope[0] + c.h * c.mods.s_dslope[1]
                          + slot,
                          tl.sum(tl.sum(ds * (rel - c.mods.shift).to(tl.float32), 1), 0))
        if c.mods.GRAD_DIAG:  # d vector[k − q] = Σ ds along the diagonal
            at = rel + c.mods.diag_off
            tl.atomic_add(c.mods.ddiag + c.h * c.mods.s_ddiag[0] + at * c.mods.s_ddiag[1], ds,
                          mask=(at >= 0) & (at < c.mods.diag_len) & (ds != 0.0))
    if c.mods.HAS_CAP:
        ds = ds * slope_of
    return dq + _dot(ds.to(k.dtype), k, c.PRECISION, c.UPCAST)


@triton.jit(do_not_specialize=SIZES)
def attn_bwd_dq(Q, K, V, dOut, Out, Lse, dLse, Lse2, Delta, dQ, s_q, s_k, s_v, s_dout, s_out, s_dq,
                heads, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale, lists, mask,
                mods, TUNE_KEY, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, ONE_LOOP: tl.constexpr, TMA: tl.constexpr,
                TMA_OK: tl.constexpr, BOUNDS: tl.constexpr, HAS_DLSE: tl.constexpr):
    """dQ, one program per (query block, batch × head), over the forward's lists: writes
    ``dQ [B, H, Tq, Dk]``, and first its rows' Δ and base-2 LSE into ``Delta``/``Lse2`` for
    dK/dV (:func:`_row_stats`)."""
    pid_m, b, h = _program_ids(heads)
    h_kv = h // group
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = _own_tile(Q + b * s_q[0] + h * s_q[1], offs_m, offs_dk, s_q, q_len, head_dk)
    do = _own_tile(dOut + b * s_dout[0] + h * s_dout[1], offs_m, offs_dv, s_dout, q_len, head_dv)
    lse2, delta = _row_stats(Out + b * s_out[0] + h * s_out[1], do, Lse, dLse, Lse2, Delta,
                             (b * heads + h) * q_len, offs_m, s_out, q_len, head_dv, HAS_DLSE)
    USE_TMA: tl.constexpr = TMA and TMA_OK
    k = _walked(K + b * s_k[0] + h_kv * s_k[1], s_k, kv_len, head_dk, BLOCK_N, DK_PAD, USE_TMA)
    v = _walked(V + b * s_v[0] + h_kv * s_v[1], s_v, kv_len, head_dv, BLOCK_N, DV_PAD, USE_TMA)
    own = _own_rows(offs_m, b, q_len, mask, False)
    dq = _walk(_dq_tile, tl.zeros([BLOCK_M, DK_PAD], dtype=tl.float32),
               Common(b, h, q_len, kv_len, head_dk, head_dv, qk_scale, mask, own, offs_dk,
                      offs_dv, BOUNDS, EVEN_DK, EVEN_DV, PRECISION, UPCAST, USE_TMA, mods),
               DqCtx(q, do, lse2, delta, q_start, k, v, BLOCK_N), lists, b, h,
               q_start // SPARSE_Q, SPARSE_K, BLOCK_N, ONE_LOOP, True)
    _store_tile(dQ + b * s_dq[0] + h * s_dq[1], offs_m, offs_dk, s_dq, q_len, head_dk,
                dq * sm_scale)


DkdvCtx = namedtuple("DkdvCtx", ["k", "v", "k_start", "q", "do", "lse2", "delta",
                                 "stored", "ds_dst", "ds_head", "slot_row", "BLOCK_M", "SPARSE_Q"])


@triton.jit
def _ds_at(ctx, t, start_m):
    """The element offset into the stored-dS buffer of this tile's slot: entry ``t // SUBS``
    of the column's list holds query block row ``start_m // SPARSE_Q``; its slot ``e`` (the
    entry's place in that row's forward list, ``Layout.slots``) is where dQ-stored reads it
    at an address affine in its loop counter."""
    e = tl.load(ctx.slot_row + t // (ctx.SPARSE_Q // ctx.BLOCK_M))
    s = ctx.stored.s_ds
    return ctx.ds_head + (start_m // ctx.SPARSE_Q) * s[2] + e * s[3] + start_m % ctx.SPARSE_Q


@triton.jit
def _dkdv_tile(state, c, ctx, t, start_m, partial, MAY_PARTIAL: tl.constexpr):
    """Query rows ``start_m …``'s contribution to ``state = (dk [N, DK], dv [N, DV])`` of the
    key rows ``ctx.k_start …`` (transposed scores ``[N, M]``). With ``stored.STORE`` the tile's
    ``dsᵀ`` (q's dtype) also goes to its slot of the buffer (by a TMA store with ``BY_TMA``)."""
    dk, dv = state
    offs_m = start_m + tl.arange(0, ctx.BLOCK_M)
    bounded: tl.constexpr = c.BOUNDS and MAY_PARTIAL
    q = _load_walked(ctx.q, start_m, offs_m, c.offs_dk, bounded, c.EVEN_DK, c.USE_TMA)  # [M, DK]
    do = _load_walked(ctx.do, start_m, offs_m, c.offs_dv, bounded, c.EVEN_DV, c.USE_TMA)
    if c.USE_TMA:
        lse2 = ctx.lse2.load([start_m])
        delta = ctx.delta.load([start_m])
    elif bounded:
        lse2 = tl.load(ctx.lse2 + offs_m, mask=offs_m < c.q_len, other=float("inf"))
        delta = tl.load(ctx.delta + offs_m, mask=offs_m < c.q_len, other=0.0)
    else:
        lse2 = tl.load(ctx.lse2 + offs_m)
        delta = tl.load(ctx.delta + offs_m)
    s2_t, slope_of = _scores(ctx.k, q, start_m, ctx.k_start, c, partial, True)  # [N, M]
    p_t = tl.math.exp2(s2_t - lse2[None, :])
    dv += _dot(p_t.to(do.dtype), do, c.PRECISION, c.UPCAST)
    dp_t = _dot(ctx.v, tl.trans(do), c.PRECISION, c.UPCAST)  # [N, M]
    ds_t = p_t * (dp_t - delta[None, :])
    if c.mods.HAS_CAP:
        ds_t = ds_t * slope_of
    ds_t = ds_t.to(q.dtype)
    if ctx.stored.STORE:
        at = _ds_at(ctx, t, start_m)
        if ctx.stored.BY_TMA:
            ctx.ds_dst.store([(at // ctx.SPARSE_Q).to(tl.int32),
                              (at % ctx.SPARSE_Q).to(tl.int32)], ds_t)
        else:
            rows = tl.arange(0, ds_t.shape[0])
            cols = tl.arange(0, ds_t.shape[1])
            tl.store(ctx.ds_dst + at + rows[:, None] * ctx.SPARSE_Q + cols[None, :], ds_t)
    dk += _dot(ds_t, q, c.PRECISION, c.UPCAST)
    return dk, dv


@triton.jit(do_not_specialize=SIZES + ["heads_kv"])
def attn_bwd_dkdv(Q, K, V, dOut, Lse2, Delta, dK, dV, s_q, s_k, s_v, s_dout, s_dk, s_dv,
                  heads, heads_kv, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale,
                  lists, mask, mods, stored, TUNE_KEY,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                  SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                  EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, ONE_LOOP: tl.constexpr, TMA: tl.constexpr,
                  TMA_OK: tl.constexpr, BOUNDS: tl.constexpr):
    """dK, dV, one program per (key block, batch × kv head), over the transposed lists of
    each query head of its group in turn (GQA without atomics): writes ``dK [B, Hkv, Tk, Dk]``,
    ``dV [B, Hkv, Tk, Dv]``, and with ``stored.STORE`` every tile's dS (:data:`Stored`)."""
    pid_n, b, h_kv = _program_ids(heads_kv)
    k_start = pid_n * BLOCK_N
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k = _own_tile(K + b * s_k[0] + h_kv * s_k[1], offs_n, offs_dk, s_k, kv_len, head_dk)
    v = _own_tile(V + b * s_v[0] + h_kv * s_v[1], offs_n, offs_dv, s_v, kv_len, head_dv)
    own = _own_rows(offs_n, b, kv_len, mask, True)
    USE_TMA: tl.constexpr = TMA and TMA_OK
    col = k_start // SPARSE_K  # this key block's row of the transposed lists
    ds_dst = stored.ds
    if stored.STORE and stored.BY_TMA:  # the buffer as [rows, SPARSE_Q] tiles
        ds_dst = tl.make_tensor_descriptor(stored.ds, shape=[stored.rows, SPARSE_Q],
                                           strides=[SPARSE_Q, 1], block_shape=[BLOCK_N, BLOCK_M])
    state = (tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32),
             tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32))
    for g in range(0, group):
        h = h_kv * group + g
        q = _walked(Q + b * s_q[0] + h * s_q[1], s_q, q_len, head_dk, BLOCK_M, DK_PAD, USE_TMA)
        do = _walked(dOut + b * s_dout[0] + h * s_dout[1], s_dout, q_len, head_dv, BLOCK_M, DV_PAD, USE_TMA)
        lse2 = Lse2 + (b * heads + h) * q_len
        delta = Delta + (b * heads + h) * q_len
        if USE_TMA:  # the rows' statistics as 1-D descriptors too
            lse2 = tl.make_tensor_descriptor(lse2, shape=[q_len], strides=[1],
                                             block_shape=[BLOCK_M])
            delta = tl.make_tensor_descriptor(delta, shape=[q_len], strides=[1],
                                              block_shape=[BLOCK_M])
        slot_row = stored.slots + b * lists.s_i[0] + h * lists.s_i[1] + col * lists.s_i[2]
        ds_head = (b * stored.s_ds[0] + h * stored.s_ds[1] + (k_start % SPARSE_K) * SPARSE_Q)
        state = _walk(_dkdv_tile, state,
                      Common(b, h, q_len, kv_len, head_dk, head_dv, qk_scale, mask, own, offs_dk,
                             offs_dv, BOUNDS, EVEN_DK, EVEN_DV, PRECISION, UPCAST, USE_TMA, mods),
                      DkdvCtx(k, v, k_start, q, do, lse2, delta, stored, ds_dst, ds_head,
                              slot_row, BLOCK_M, SPARSE_Q),
                      lists, b, h, col, SPARSE_Q, BLOCK_M, ONE_LOOP, True)
    dk, dv = state
    _store_tile(dK + b * s_dk[0] + h_kv * s_dk[1], offs_n, offs_dk, s_dk, kv_len, head_dk,
                dk * sm_scale)
    _store_tile(dV + b * s_dv[0] + h_kv * s_dv[1], offs_n, offs_dv, s_dv, kv_len, head_dv, dv)


# ---- the stored-dS backward's own kernels --------------------------------------------------------
@triton.jit(do_not_specialize=["heads", "q_len"])
def attn_bwd_stats(dOut, Out, Lse, dLse, Lse2, Delta, s_dout, s_out, heads, q_len, head_dv,
                   BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr, HAS_DLSE: tl.constexpr):
    """The row statistics (:func:`_row_stats`) alone, for dK/dV when dQ runs after it: one
    program per (query block, batch × head)."""
    pid_m, b, h = _program_ids(heads)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    do = _own_tile(dOut + b * s_dout[0] + h * s_dout[1], offs_m, tl.arange(0, DV_PAD), s_dout, q_len,
                   head_dv)
    _row_stats(Out + b * s_out[0] + h * s_out[1], do, Lse, dLse, Lse2, Delta, (b * heads + h) * q_len,
               offs_m, s_out, q_len, head_dv, HAS_DLSE)


DqStoredCtx = namedtuple("DqStoredCtx", ["k", "ds_src", "ds_at", "s_slot", "BLOCK_N",
                                         "SPARSE_Q", "SPARSE_K"])


@triton.jit
def _dq_stored_tile(dq, c, ctx, t, start_n, partial, MAY_PARTIAL: tl.constexpr):
    """``dq += dSᵀ·K`` of key rows ``start_n …``, the dS tile read from its slot (entry
    ``t // SUBS``; PARTIAL and FULL alike: the stored tiles hold the mask already). Slots
    past the end of the keys may never have been written: with BOUNDS those rows read 0."""
    offs_n = start_n + tl.arange(0, ctx.BLOCK_N)
    k = _load_walked(ctx.k, start_n, offs_n, c.offs_dk, c.BOUNDS, c.EVEN_DK, c.USE_TMA)
    SUBS: tl.constexpr = ctx.SPARSE_K // ctx.BLOCK_N
    slot = (t // SUBS) * ctx.s_slot + (t % SUBS) * (ctx.BLOCK_N * ctx.SPARSE_Q)
    if c.USE_TMA:
        at = ctx.ds_at + slot
        ds_t = ctx.ds_src.load([(at // ctx.SPARSE_Q).to(tl.int32),
                                (at % ctx.SPARSE_Q).to(tl.int32)])  # [N, M]
        if c.BOUNDS:  # never-written rows may hold anything, NaN too: not 0 · K
            ds_t = tl.where(offs_n[:, None] < c.kv_len, ds_t, 0.0)
    elif c.BOUNDS:
        ds_t = tl.load(ctx.ds_src + slot, mask=offs_n[:, None] < c.kv_len, other=0.0)
    else:
        ds_t = tl.load(ctx.ds_src + slot)
    return dq + _dot(tl.trans(ds_t), k, c.PRECISION, c.UPCAST)


@triton.jit(do_not_specialize=SIZES)
def attn_bwd_dq_stored(K, dQ, s_k, s_dq, heads, group, q_len, kv_len, head_dk, head_dv,
                       sm_scale, lists, stored, TUNE_KEY,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                       SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, EVEN_DK: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
                       TMA_OK: tl.constexpr, BOUNDS: tl.constexpr):
    """dQ = scale · Σ dS·K from the slots dK/dV stored (one matmul a tile where
    :func:`attn_bwd_dq` does three): one program per (query block, batch × head), over its
    row's list in one loop. Writes ``dQ [B, H, Tq, Dk]``."""
    pid_m, b, h = _program_ids(heads)
    h_kv = h // group
    q_start = pid_m * BLOCK_M
    row = q_start // SPARSE_Q
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    USE_TMA: tl.constexpr = TMA and TMA_OK
    k = _walked(K + b * s_k[0] + h_kv * s_k[1], s_k, kv_len, head_dk, BLOCK_N, DK_PAD, USE_TMA)
    s = stored.s_ds
    ds_at = b * s[0] + h * s[1] + row * s[2] + q_start % SPARSE_Q  # entry 0's [N, M] tile
    if USE_TMA:
        ds_src = tl.make_tensor_descriptor(stored.ds, shape=[stored.rows, SPARSE_Q],
                                           strides=[SPARSE_Q, 1], block_shape=[BLOCK_N, BLOCK_M])
    else:
        ds_src = (stored.ds + ds_at + tl.arange(0, BLOCK_N)[:, None] * SPARSE_Q
                  + tl.arange(0, BLOCK_M)[None, :])
    dq = _walk(_dq_stored_tile, tl.zeros([BLOCK_M, DK_PAD], dtype=tl.float32),
               Common(b, h, q_len, kv_len, head_dk, head_dv, 0.0, None, None, offs_dk, offs_dk,
                      BOUNDS, EVEN_DK, EVEN_DK, PRECISION, UPCAST, USE_TMA, None),
               DqStoredCtx(k, ds_src, ds_at, s[3], BLOCK_N, SPARSE_Q, SPARSE_K), lists, b, h,
               row, SPARSE_K, BLOCK_N, True, False)
    tl.store(_tile_ptrs(dQ + b * s_dq[0] + h * s_dq[1], offs_m, offs_dk, s_dq[2], s_dq[3]),
             (dq * sm_scale).to(dQ.dtype.element_ty),
             mask=_in_bounds(offs_m, offs_dk, q_len, head_dk))


# ---- decoding: few queries, many keys ---------------------------------------------------------
@triton.jit(do_not_specialize=["heads_kv", "q_len", "kv_len", "chunk", "s_table", "page"])
def attn_decode(Q, K, V, PartAcc, PartM, PartL, s_q, s_k, s_v, heads_kv, group, q_len, kv_len,
                head_dk, head_dv, kv_lens, s_kvlen, ranges, s_ranges, chunk, qk_scale,
                table, s_table, page,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DK_PAD: tl.constexpr,
                DV_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                HAS_KVLEN: tl.constexpr, CAUSAL: tl.constexpr, HAS_RANGES: tl.constexpr,
                PAGED: tl.constexpr):
    """Split-key decoding (flash-decoding): one program per (batch × kv head, key chunk, block
    of rows) holds BLOCK_R of the ``group · q_len`` query rows of that kv head's query heads
    (GQA by index: one load of each K/V tile serves them all) and folds the keys ``[split ·
    chunk, …)`` of the chunk that its rows may see into an online softmax; the partial sums
    go to ``PartAcc [B, Hkv, splits, R, DV_PAD]``, ``PartM``/``PartL [B, Hkv, splits, R]``
    (base 2; R the rows of all row blocks), merged by ``launch.merge_splits``.
    Keys past the batch element's length (``kv_lens`` with HAS_KVLEN, else ``kv_len``) are
    masked, with CAUSAL query ``i`` sees keys up to ``kv_len − q_len + i`` (bottom-right), and
    with HAS_RANGES only the keys ``[lo, hi)`` of its run (``ranges [B, Tq, 2]`` int32, strides
    ``s_ranges``: per-sequence causal masks, left padding, causal documents). With PAGED,
    K and V are pools ``[num_blocks, page, Hkv, D]`` (strides passed as block, head, slot,
    dim) read through ``table [B, ≥ kv_len / page]`` (row stride ``s_table``): key n of batch
    element b lies in block ``table[b, n // page]`` at slot ``n % page``; only entries of
    keys inside the loop's range are read."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // heads_kv).to(tl.int64)
    h_kv = (pid_bh % heads_kv).to(tl.int64)
    # row r: query i = r % q_len of head h_kv · group + r // q_len; a program holds BLOCK_R
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = rows % q_len
    head = h_kv * group + rows // q_len
    real = rows < group * q_len
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + b * s_q[0] + head[:, None] * s_q[1] + i[:, None] * s_q[2]
                + offs_dk[None, :] * s_q[3], mask=real[:, None] & (offs_dk[None, :] < head_dk),
                other=0.0)  # [R, DK]
    length = kv_len
    if HAS_KVLEN:
        length = tl.load(kv_lens + b * s_kvlen)
    start = split * chunk
    stop = tl.minimum(start + chunk, length)
    last = kv_len - q_len + i  # the last key query i sees (CAUSAL: bottom-right over all keys)
    lo = tl.zeros_like(i)
    hi = tl.zeros_like(i)
    if HAS_RANGES:  # and no key outside every row's run is read (it may hold anything)
        run = ranges + b * s_ranges[0] + i * s_ranges[1]
        lo = tl.load(run, mask=real, other=0)
        hi = tl.load(run + 1, mask=real, other=0)
        start = tl.maximum(start, tl.min(tl.where(real, lo, kv_len), 0))
        stop = tl.minimum(stop, tl.max(tl.where(real, hi, 0), 0))
    k_base = K + h_kv * s_k[1]
    v_base = V + h_kv * s_v[1]
    if not PAGED:
        k_base += b * s_k[0]
        v_base += b * s_v[0]
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, DV_PAD], dtype=tl.float32)
    for n in range(start, stop, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        inside = offs_n < stop
        k_rows = offs_n.to(tl.int64) * s_k[2]
        v_rows = offs_n.to(tl.int64) * s_v[2]
        if PAGED:  # the block holding each key, read from the table
            block = tl.load(table + b * s_table + offs_n // page, mask=inside, other=0)
            k_rows = block.to(tl.int64) * s_k[0] + (offs_n % page) * s_k[2]
            v_rows = block.to(tl.int64) * s_v[0] + (offs_n % page) * s_v[2]
        k = tl.load(k_base + k_rows[:, None] + offs_dk[None, :] * s_k[3],
                    mask=inside[:, None] & (offs_dk[None, :] < head_dk), other=0.0)  # [N, DK]
        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * s_v[3],
                    mask=inside[:, None] & (offs_dv[None, :] < head_dv), other=0.0)  # [N, DV]
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [R, N], base 2
        ok = inside[None, :] & real[:, None]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= last[:, None])
        if HAS_RANGES:
            ok = ok & (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    part = (pid_bh * tl.num_programs(1) + split).to(tl.int64)
    at = part * (tl.num_programs(2) * BLOCK_R) + rows  # [R]: this program's rows of the part
    tl.store(PartM + at, m_i)
    tl.store(PartL + at, l_i)
    tl.store(PartAcc + at[:, None] * DV_PAD + offs_dv[None, :], acc)
