"""The ``@triton.jit`` kernels of the triton backend: forward, dQ (which also writes the
backward's row statistics), dK/dV; and for the stored-dS backward (``launch.BACKWARD``) the
row statistics alone, dK/dV storing dS (``STORE_DS``), and dQ from the stored dS.

This module is never imported by name: ``launch.kernels(interpret)`` loads it once per
flavour (compiled for CUDA, interpreted for CPU tensors), because Triton decides at
decoration time whether ``@triton.jit`` compiles or interprets (see ``launch.py``).

Conventions shared by every kernel:

- Scores are kept in base 2: ``s2 = (q·kᵀ·scale + bias) · log2(e)``, so the softmax uses
  ``exp2`` and the scale costs one multiply (``qk_scale = scale·log2(e)``). The LSE is stored in
  natural log (``lse = lse2 · ln 2``), float32.
- Tiles are visited through host-built block lists (``launch.BlockLists``): per (batch, head,
  sparse row) the PARTIAL sparse blocks first, then the FULL ones. Sparse blocks are
  ``SPARSE_Q × SPARSE_K``; a kernel block (``BLOCK_M``/``BLOCK_N``) divides them, so a kernel
  walks ``SPARSE/BLOCK`` sub-tiles of every listed sparse block. The split walks are written
  once, as ``for part in tl.static_range(2)``, which unrolls into two loops with ``masked``
  (the helpers' ``partial``) a compile-time constant in each: the PARTIAL loop then the FULL
  one, or the FULL loop first (``FULL_FIRST``). Each loop either takes a sparse block per
  iteration with its sub-tiles unrolled, or one kernel block per iteration (``FLAT``: what
  Triton's software pipeliner sees is then a single tile). ``MERGED`` (the ``one_loop`` walk)
  runs one loop over the whole list instead, ``partial`` a runtime test per block. When every
  row's FULL blocks are evenly spaced (``FULL_STRIDED``: consecutive for causal, windows,
  documents, padding, no mask), and likewise its PARTIAL ones (``PARTIAL_STRIDED``: one or
  two per row for causal, windows, documents), the loops compute each tile's position from
  the row's first two blocks instead of loading it per iteration. With an
  address that depends on a load made in the loop, Triton's software pipeliner keeps one
  tile of prefetch, issued after the compute (sm90 PTX: ``cp.async.wait_group 0`` at the
  loop head whatever ``num_stages``); with an affine one, ``num_stages − 1`` tiles stay in
  flight during the compute (``wait_group 2`` with 3 stages). ``ORDERED``
  launches the programs of a head heaviest row first (``_ordered_block``). These switches are
  autotuned with the block sizes (``launch.WALKS``); the tile work itself is written once
  (``_fwd_tile``, ``_dkdv_tile``, ``_dq_tile``).
- PARTIAL tiles evaluate the mask program (``_allowed``/``_masked_scores``) and, when a
  length is not a multiple of the sparse blocks (``BOUNDS``), the sequence bounds; FULL tiles
  apply nothing (the host marks ragged tail blocks PARTIAL, so FULL tiles are always in
  bounds). The mask inputs of a program's own rows load once, before the walk (``_own_rows``).
- The kernels take the mask program flat (the names ``launch.MaskProgram.args()``/``flags()``
  pass) and pack it once into a :data:`MaskArgs` tuple for the helpers. Triton 3.6 compiles
  an ``if`` on the tuple's ``HAS_*`` fields as a branch on a constant (folded away later, so
  a feature that is off costs nothing), which type-checks both sides: a value assigned under
  such an ``if`` must keep its type and shape (``_own_rows``, ``_allowed``).
- A fully masked row keeps ``m = -inf`` and ``l = 0``: its output is exactly 0 and its LSE
  ``-inf``; the backward turns that LSE into ``+inf`` so ``exp2(s - lse) = 0`` (zero gradients).
- Head dims are padded to powers of two (``DK_PAD``/``DV_PAD``) with load masks; ``EVEN_DK``
  and ``EVEN_DV`` drop those masks when the dims are already powers of two.
- Pointers and bounds masks of a tile come from ``_tile_ptrs``/``_in_bounds``; tiles inside the
  walk are loaded with ``_load_tile``. A program's own block (loaded or stored once) is written
  as ``tl.load(_tile_ptrs(...), mask=_in_bounds(...))``: Triton evaluates keyword arguments
  first, so the mask is built before the pointers there, the op order the configs were built
  and measured with. ptxas's register allocation follows that order: building those pointers
  first instead cost dQ's 128×64 config at D = 128 eleven registers and a 44-byte spill.
- ``UPCAST`` casts dot operands to float32 first. It is set only under the interpreter
  for bfloat16, whose ``tl.dot`` multiplies the raw uint16 bit patterns there
  (triton-lang/triton#11584); on a GPU it is always off.
"""

from collections import namedtuple

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

MaskArgs = namedtuple("MaskArgs", [
    "band_lo", "band_hi", "q_lens", "s_qlen_b", "kv_lens", "s_kvlen_b",
    "q_docs", "s_qdoc_b", "s_qdoc_t", "kv_docs", "s_kvdoc_b", "s_kvdoc_t",
    "dense", "s_dense_b", "s_dense_h", "s_dense_q", "s_dense_k",
    "bias", "s_bias_b", "s_bias_h", "s_bias_q", "s_bias_k",
    "HAS_LO", "HAS_HI", "HAS_QLEN", "HAS_KVLEN", "HAS_DOCS", "DOC_RANGES", "HAS_DENSE",
    "HAS_BIAS"])
"""The mask program as the helpers take it: band bounds ``lo ≤ kv − q ≤ hi``, per-batch
lengths ``[B]``, documents, the dense int8 and bias ``[B, H, Tq, Tk]`` views (each pointer with
its strides; unused ones get a placeholder and stride 0), then the constexpr feature switches.
Documents come as int32 ids ``[B, T]`` per side, or with ``DOC_RANGES`` (documents that are
contiguous runs) as int32 ``[B, T, 2]`` per side: for each query the key range ``[lo, hi)`` of
its document, for each key the query range. A tile then compares positions with the ranges of
its *rows* only, instead of holding an id for every column (which took the D128 forward to
the 255-register limit with a spill)."""


SIZES_AND_MASK = ["TUNE_KEY", "heads", "q_len", "kv_len",
                  "s_n_b", "s_n_h", "s_n_r", "s_i_b", "s_i_h", "s_i_r", "band_lo", "band_hi",
                  "s_qlen_b", "s_kvlen_b", "s_qdoc_b", "s_qdoc_t", "s_kvdoc_b", "s_kvdoc_t",
                  "s_dense_b", "s_dense_h", "s_dense_q", "s_dense_k",
                  "s_bias_b", "s_bias_h", "s_bias_q", "s_bias_k"]
"""Integer arguments the JIT must not specialize on (divisible by 16, equal to 1): lengths,
head counts, block-list strides and mask parameters change with every shape and mask but gain
nothing from the hints, so leaving them out lets one binary serve every sequence length.
(Q/K/V/output strides keep their hints: they decide whether tile loads are vectorized.)"""


DS_STRIDES = ["s_ds_b", "s_ds_h", "s_ds_r", "s_ds_e"]
"""The stored-dS buffer's strides (``launch.ds_buffer``): sizes, as :data:`SIZES_AND_MASK`."""


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a [M, K] @ b [K, N]`` accumulated in float32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _program_ids(heads):
    """This program's block index and ``(batch, head)`` (int64) in a grid of
    ``(blocks, batch × heads)``."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    return pid, (pid_bh // heads).to(tl.int64), (pid_bh % heads).to(tl.int64)


@triton.jit
def _tile_ptrs(base, offs_r, offs_d, s_r, s_d):
    """Pointers to the tile ``base[offs_r, offs_d]`` → ``[R, D]`` (``s_r``, ``s_d``: row and
    column strides)."""
    return base + offs_r[:, None] * s_r + offs_d[None, :] * s_d


@triton.jit
def _in_bounds(offs_r, offs_d, rows, dim):
    """``[R, D]`` bool: row ``< rows`` and column ``< dim`` (sequence end and head-dim padding)."""
    return (offs_r[:, None] < rows) & (offs_d[None, :] < dim)


@triton.jit
def _load_tile(ptrs, offs_r, offs_d, rows, dim, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Load the ``[R, D]`` tile at ``ptrs`` (from :func:`_tile_ptrs`). MASKED: out-of-bounds rows
    and columns read 0 (a tile that may cross the sequence end); otherwise only the head-dim
    padding is masked, and nothing when ``EVEN_D``."""
    if MASKED:
        tile = tl.load(ptrs, mask=_in_bounds(offs_r, offs_d, rows, dim), other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < dim, other=0.0)
    return tile


@triton.jit
def _walk_tile(src, start, offs_r, offs_d, s_r, s_d, rows, dim, BOUNDED: tl.constexpr,
               EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """A tile of the walk: rows ``start …`` (``offs_r``) of ``src``, a tensor descriptor with
    USE_TMA (:func:`_describe`: the TMA copy zero-fills past the ends), else a base pointer
    (loaded as :func:`_load_tile`, BOUNDED: rows checked against ``rows``)."""
    if USE_TMA:
        tile = src.load([start, 0])
    else:
        tile = _load_tile(_tile_ptrs(src, offs_r, offs_d, s_r, s_d), offs_r, offs_d, rows, dim,
                          BOUNDED, EVEN_D)
    return tile


@triton.jit
def _describe(base, rows, dim, s_r, BLOCK: tl.constexpr, D_PAD: tl.constexpr,
              USE_TMA: tl.constexpr):
    """``base`` (one head's ``[rows, dim]`` rows, unit stride along dim) as a tensor descriptor
    of ``[BLOCK, D_PAD]`` tiles for :func:`_walk_tile`, or ``base`` itself without USE_TMA."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[rows, dim], strides=[s_r, 1],
                                        block_shape=[BLOCK, D_PAD])
    else:
        src = base
    return src


@triton.jit
def _block_row(num_partial, num_full, index, b, h, row, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r):
    """Row ``row`` of the (batch ``b``, head ``h``) block lists: its PARTIAL and FULL counts and
    a pointer to its entries (PARTIAL blocks first)."""
    counts = b * s_n_b + h * s_n_h + row * s_n_r
    n_partial = tl.load(num_partial + counts)
    n_full = tl.load(num_full + counts)
    return n_partial, n_full, index + b * s_i_b + h * s_i_h + row * s_i_r


@triton.jit
def _spacing(blocks, first, count, SPARSE: tl.constexpr, STRIDED: tl.constexpr):
    """When entries ``first … first + count`` of a row's list are evenly spaced blocks
    (``STRIDED``): ``(base, step)`` such that entry ``j`` starts at position ``base + j·step``
    (the first two blocks loaded once, before the loop); otherwise ``(0, 0)``, unused."""
    base = 0
    step = 0
    if STRIDED:
        b0 = tl.load(blocks + first, mask=count > 0, other=0)
        b1 = tl.load(blocks + first + 1, mask=count > 1, other=0)
        step = tl.where(count > 1, b1 - b0, 1) * SPARSE
        base = b0 * SPARSE - first * step
    return base, step


@triton.jit
def _sparse_start(blocks, j, base, step, SPARSE: tl.constexpr, STRIDED: tl.constexpr):
    """First position of entry ``j`` of a row's list: computed when evenly spaced
    (``STRIDED``, see :func:`_spacing`), else loaded."""
    if STRIDED:
        start = base + j * step
    else:
        start = tl.load(blocks + j) * SPARSE
    return start


@triton.jit
def _block_start(blocks, t, base, step, SUBS: tl.constexpr, SPARSE: tl.constexpr,
                 BLOCK: tl.constexpr, STRIDED: tl.constexpr):
    """First position of kernel block ``t`` of a row's list in the one-block-per-iteration
    loops: sub-block ``t % SUBS`` of entry ``t // SUBS``, computed when the entries are evenly
    spaced (``STRIDED``: from ``t`` alone), else loaded."""
    return _sparse_start(blocks, t // SUBS, base, step, SPARSE, STRIDED) + (t % SUBS) * BLOCK


@triton.jit
def _list_spacing(blocks, n_partial, n_full, SPARSE: tl.constexpr, STRIDED: tl.constexpr):
    """For the one-loop walk, before its loop: the PARTIAL and the FULL entries' spacings
    (:func:`_spacing`), ``(p_base, p_step, f_base, f_step)``."""
    p_base, p_step = _spacing(blocks, 0, n_partial, SPARSE, STRIDED)
    f_base, f_step = _spacing(blocks, n_partial, n_full, SPARSE, STRIDED)
    return p_base, p_step, f_base, f_step


@triton.jit
def _merged_start(blocks, t, split, spacing, SUBS: tl.constexpr, SPARSE: tl.constexpr,
                  BLOCK: tl.constexpr, STRIDED: tl.constexpr):
    """First position of kernel block ``t`` of a row's whole list (the one-loop walk, the
    PARTIAL blocks' kernel blocks before ``split``): with ``STRIDED`` (the PARTIAL and the
    FULL entries each evenly spaced, ``spacing`` from :func:`_list_spacing`) an address that
    depends on ``t`` alone, so the loop pipelines; else loaded."""
    if STRIDED:
        p_base, p_step, f_base, f_step = spacing
        j = t // SUBS
        start = tl.where(t < split, p_base + j * p_step, f_base + j * f_step) + (t % SUBS) * BLOCK
    else:
        start = _block_start(blocks, t, 0, 0, SUBS, SPARSE, BLOCK, False)
    return start


@triton.jit
def _ordered_block(order, pid, SUBS: tl.constexpr, ORDER_KIND: tl.constexpr):
    """The kernel block program ``pid`` takes when programs follow ``order`` (the sparse rows,
    the most tiles first; ``launch.BlockLists.order``): the grid has ``SUBS`` consecutive
    programs per sparse row (``launch._grid``), so the heaviest rows of a head start first and
    the light ones fill the tail of the launch. ORDER_KIND (known to the host): 0 the rows'
    own order, 1 its reverse (causal rows; computed, where a loaded row index costs the D128
    forward 31 registers), 2 any other (loaded from ``order``)."""
    if ORDER_KIND == 0:
        block = pid
    elif ORDER_KIND == 1:
        block = (tl.num_programs(0) // SUBS - 1 - pid // SUBS) * SUBS + pid % SUBS
    else:
        block = tl.load(order + pid // SUBS) * SUBS + pid % SUBS
    return block


# ---- the mask program: element mask of a PARTIAL tile, from indices or loaded -------------
@triton.jit
def _own_rows(offs, b, length, mask, TRANSPOSED: tl.constexpr):
    """What the mask of a PARTIAL tile needs from the program's own rows (query rows ``offs``,
    or TRANSPOSED key rows), loaded once before the walk rather than in every tile, where
    each load's latency would sit in the tile's critical path: the batch's query and key
    lengths, and the rows' document ranges ``[lo, hi)`` (``DOC_RANGES``) or ids (in ``lo``).
    Unused entries are 0. → ``(q_limit, kv_limit, lo [R], hi [R])``."""
    q_limit = 0
    kv_limit = 0
    lo = tl.zeros_like(offs)  # each value keeps one type in every branch: the compiler
    hi = tl.zeros_like(offs)  # may see the tuple's flags as values, not constants
    if mask.HAS_QLEN:
        q_limit = tl.load(mask.q_lens + b * mask.s_qlen_b)
    if mask.HAS_KVLEN:
        kv_limit = tl.load(mask.kv_lens + b * mask.s_kvlen_b)
    if mask.HAS_DOCS:
        if TRANSPOSED:  # key rows: the query range (or id) of each key's document
            ptrs = mask.kv_docs + b * mask.s_kvdoc_b + offs * mask.s_kvdoc_t
            missing = -2  # never equal to a query's id
        else:  # query rows: the key range (or id) of each query's document
            ptrs = mask.q_docs + b * mask.s_qdoc_b + offs * mask.s_qdoc_t
            missing = -1
        if mask.DOC_RANGES:
            lo = tl.load(ptrs, mask=offs < length, other=0)
            hi = tl.load(ptrs + 1, mask=offs < length, other=0)
        else:
            lo = tl.load(ptrs, mask=offs < length, other=missing)
    return q_limit, kv_limit, lo, hi


@triton.jit
def _allowed(q_start, k_start, i, j, b, h, q_len, kv_len, mask, own, TRANSPOSED: tl.constexpr,
             BOUNDS: tl.constexpr):
    """Bool "may attend" in a tile whose query rows start at ``q_start`` and key rows at
    ``k_start``; ``i``, ``j``: the tile's query and key offsets, broadcastable aranges
    (``[M, 1]`` × ``[1, N]``, or TRANSPOSED: ``[1, M]`` × ``[N, 1]``) → ``[M, N]`` (``[N, M]``);
    ``own``: :func:`_own_rows` of the first axis. BOUNDS: the tile may cross the end of a
    sequence (else no position is checked against it). Every comparison is written against the
    offsets, the positions' starts moved to the scalar or per-row side (``k − q ≤ hi`` as
    ``j − i ≤ hi + q_start − k_start``): the compiler then folds the aranges into each thread's
    constant offsets (offline sm90 SASS of a causal 128×128 tile: 195 instructions for the mask
    instead of 361, where positions ``start + arange`` were compared)."""
    q_limit, kv_limit, lo, hi = own
    if BOUNDS:
        inside = (i < q_len - q_start) & (j < kv_len - k_start)
        ok = inside
    else:  # the flags below may compile as branches: ok starts with its final shape
        if TRANSPOSED:
            ok = tl.full([j.shape[0], i.shape[1]], 1, tl.int1)
        else:
            ok = tl.full([i.shape[0], j.shape[1]], 1, tl.int1)
        inside = ok
    # the band lo <= kv - q <= hi (the host clamps lo and hi to [-Tq, Tk]: the sums stay far
    # inside int32): as j - i against a per-tile scalar, or, with documents, as positions, the
    # form of their comparisons below, one add per row (offline, offsets beside positions
    # made a documents tile of the 128×128 forward spill or grow)
    if mask.HAS_DOCS:
        q_pos = q_start + i
        k_pos = k_start + j
        if mask.HAS_LO:
            if TRANSPOSED:
                ok = ok & (q_pos <= k_pos - mask.band_lo)
            else:
                ok = ok & (k_pos >= q_pos + mask.band_lo)
        if mask.HAS_HI:
            if TRANSPOSED:
                ok = ok & (q_pos >= k_pos - mask.band_hi)
            else:
                ok = ok & (k_pos <= q_pos + mask.band_hi)
    else:
        if mask.HAS_LO:
            ok = ok & (j - i >= mask.band_lo + q_start - k_start)
        if mask.HAS_HI:
            ok = ok & (j - i <= mask.band_hi + q_start - k_start)
    if mask.HAS_QLEN:
        ok = ok & (i < q_limit - q_start)
    if mask.HAS_KVLEN:
        ok = ok & (j < kv_limit - k_start)
    if mask.HAS_DOCS and mask.DOC_RANGES:  # the other side's positions against the rows' ranges
        if TRANSPOSED:
            ok = ok & (q_start + i >= lo[:, None]) & (q_start + i < hi[:, None])
        else:
            ok = ok & (k_start + j >= lo[:, None]) & (k_start + j < hi[:, None])
    elif mask.HAS_DOCS:  # the rows' ids against the other side's, loaded per tile
        if TRANSPOSED:
            q_pos = q_start + i
            q_doc = tl.load(mask.q_docs + b * mask.s_qdoc_b + q_pos * mask.s_qdoc_t,
                            mask=q_pos < q_len, other=-1)
            ok = ok & (q_doc == lo[:, None])
        else:
            k_pos = k_start + j
            kv_doc = tl.load(mask.kv_docs + b * mask.s_kvdoc_b + k_pos * mask.s_kvdoc_t,
                             mask=k_pos < kv_len, other=-2)
            ok = ok & (lo[:, None] == kv_doc)
    if mask.HAS_DENSE:
        flag = tl.load(mask.dense + b * mask.s_dense_b + h * mask.s_dense_h
                       + (q_start + i) * mask.s_dense_q + (k_start + j) * mask.s_dense_k,
                       mask=inside, other=0)
        ok = ok & (flag != 0)
    return ok


@triton.jit
def _masked_scores(s2, q_start, k_start, b, h, q_len, kv_len, mask, own, TRANSPOSED: tl.constexpr,
                   BOUNDS: tl.constexpr):
    """Base-2 scores ``s2`` (``[M, N]``, or TRANSPOSED ``[N, M]``) of a PARTIAL tile whose query
    rows start at ``q_start`` and key rows at ``k_start``, with the bias added and forbidden
    entries set to -inf."""
    if TRANSPOSED:
        i = tl.arange(0, s2.shape[1])[None, :]
        j = tl.arange(0, s2.shape[0])[:, None]
    else:
        i = tl.arange(0, s2.shape[0])[:, None]
        j = tl.arange(0, s2.shape[1])[None, :]
    ok = _allowed(q_start, k_start, i, j, b, h, q_len, kv_len, mask, own, TRANSPOSED, BOUNDS)
    if mask.HAS_BIAS:  # loaded float32, -inf = masked
        q_pos = q_start + i
        k_pos = k_start + j
        offs = b * mask.s_bias_b + h * mask.s_bias_h + q_pos * mask.s_bias_q + k_pos * mask.s_bias_k
        if BOUNDS:
            extra = tl.load(mask.bias + offs, mask=(q_pos < q_len) & (k_pos < kv_len), other=0.0)
        else:
            extra = tl.load(mask.bias + offs)
        extra = extra.to(tl.float32)
        ok = ok & (extra != float("-inf"))
        s2 = s2 + tl.where(ok, extra * LOG2E, 0.0)
    return tl.where(ok, s2, float("-inf"))


@triton.jit
def _scores(x, y, qk_scale, q_start, k_start, b, h, q_len, kv_len, mask, own, partial,
            TRANSPOSED: tl.constexpr, BOUNDS: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr):
    """Base-2 scores ``x @ yᵀ · qk_scale`` of the query rows from ``q_start`` against the key rows
    from ``k_start``: ``x`` = q ``[M, D]``, ``y`` = k ``[N, D]`` → ``[M, N]``, or TRANSPOSED (``x`` = k,
    ``y`` = q) → ``[N, M]``. A ``partial`` tile goes through the mask program (a constant in
    the split walks, a runtime test in the one-loop walk). Without a bias the mask only selects,
    so it applies to the raw scores and the scale comes last: the caller's ``exp2(s2 − lse)``
    then compiles to one FMA per score, as in FULL tiles."""
    s = _dot(x, tl.trans(y), PRECISION, UPCAST)  # [M, N] or [N, M]
    if mask.HAS_BIAS:  # added in base 2: scaled scores first
        s2 = s * qk_scale
        if partial:
            s2 = _masked_scores(s2, q_start, k_start, b, h, q_len, kv_len, mask, own, TRANSPOSED,
                                BOUNDS)
    else:
        if partial:
            s = _masked_scores(s, q_start, k_start, b, h, q_len, kv_len, mask, own, TRANSPOSED,
                               BOUNDS)
        s2 = s * qk_scale
    return s2


@triton.jit
def _fwd_tile(q, m_i, l_i, acc, start_n, k_base, v_base, q_start, offs_dk, offs_dv, b, h,
              s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale, mask, own,
              partial, LOAD_BOUNDS: tl.constexpr, BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr,
              EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr, MERGED: tl.constexpr, USE_TMA: tl.constexpr):
    """One key block (rows ``start_n …``) folded into the online softmax of the query rows
    ``q_start …``: the running max ``m_i [M]``, sum ``l_i [M]`` and output ``acc [M, DV]``.
    ``partial``: the block goes through the mask program; LOAD_BOUNDS: its loads check the
    sequence end. In the split walks (``partial`` a constant) a FULL block, and a PARTIAL one
    without a bias (masked on the raw scores), scales after the row max (``max(s)·scale =
    max(s·scale)``, scale > 0) and inside the exponent's FMA: one multiply per row instead of
    one per score. In the MERGED walk (``partial`` a runtime test)
    only the masking is conditional: Triton 3.6's software pipeliner fails on a loop whose
    branch yields the softmax itself. USE_TMA: ``k_base``/``v_base`` are tensor descriptors
    (TMA copies, which zero-fill past the sequence end and the head dim)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _walk_tile(k_base, start_n, offs_n, offs_dk, s_k_t, s_k_d, kv_len, head_dk, LOAD_BOUNDS,
                   EVEN_DK, USE_TMA)  # [N, DK]
    v = _walk_tile(v_base, start_n, offs_n, offs_dv, s_v_t, s_v_d, kv_len, head_dv, LOAD_BOUNDS,
                   EVEN_DV, USE_TMA)  # [N, DV]
    s = _dot(q, tl.trans(k), PRECISION, UPCAST)  # [M, N], unscaled
    # a row with nothing allowed yet keeps m = -inf: subtract 0, not inf (only PARTIAL tiles,
    # so not in the split walks' FULL loops; in the MERGED walk ``partial`` is a runtime test)
    if mask.HAS_BIAS:  # the bias is added in base 2: scaled scores first
        s2 = s * qk_scale
        if partial:
            s2 = _masked_scores(s2, q_start, start_n, b, h, q_len, kv_len, mask, own, False,
                                BOUNDS)
        m_new = tl.maximum(m_i, tl.max(s2, 1))  # [M]
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s2 - m_sub[:, None])  # [M, N]
    else:  # the mask only selects: on the raw scores
        if partial:
            s = _masked_scores(s, q_start, start_n, b, h, q_len, kv_len, mask, own, False, BOUNDS)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_sub = m_new
        if MERGED:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        elif partial:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)  # [M]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


# ---- forward ---------------------------------------------------------------------------------
@triton.jit(do_not_specialize=SIZES_AND_MASK)
def attn_fwd(Q, K, V, Out, Lse,
             s_q_b, s_q_h, s_q_t, s_q_d, s_k_b, s_k_h, s_k_t, s_k_d,
             s_v_b, s_v_h, s_v_t, s_v_d, s_o_b, s_o_h, s_o_t, s_o_d, s_l_b, s_l_h, s_l_t,
             heads, group, q_len, kv_len, head_dk, head_dv, qk_scale,
             num_partial, num_full, index, order, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
             band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
             q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
             dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
             bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
             TUNE_KEY,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
             SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
             EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr, FULL_FIRST: tl.constexpr,
             FLAT: tl.constexpr, MERGED: tl.constexpr, ORDERED: tl.constexpr,
             TMA: tl.constexpr, TMA_OK: tl.constexpr,
             ORDER_KIND: tl.constexpr, PARTIAL_STRIDED: tl.constexpr,
             FULL_STRIDED: tl.constexpr,
             BOUNDS: tl.constexpr,
             HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
             HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, DOC_RANGES: tl.constexpr,
             HAS_DENSE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Forward: one program per (query block, batch × query head).

    Writes ``Out [B, H, Tq, Dv]`` (input dtype) and ``Lse [B, H, Tq]`` (float32, natural log).
    ``TUNE_KEY`` is unused by the body: it only keys the autotuner's cache.
    """
    mask = MaskArgs(band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                    q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                    dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                    bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                    HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, DOC_RANGES, HAS_DENSE,
                    HAS_BIAS)
    pid_m, b, h = _program_ids(heads)
    if ORDERED:  # heaviest query blocks first (see _ordered_block)
        pid_m = _ordered_block(order, pid_m, SPARSE_Q // BLOCK_M, ORDER_KIND)
        if pid_m * BLOCK_M >= q_len:  # the grid rounds up to whole sparse rows
            return
    h_kv = h // group  # GQA: K/V are indexed, never repeated
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)

    q_ptrs = _tile_ptrs(Q + b * s_q_b + h * s_q_h, offs_m, offs_dk, s_q_t, s_q_d)  # [M, DK]
    q = tl.load(q_ptrs, mask=_in_bounds(offs_m, offs_dk, q_len, head_dk), other=0.0)
    k_base = K + b * s_k_b + h_kv * s_k_h
    v_base = V + b * s_v_b + h_kv * s_v_h
    USE_TMA: tl.constexpr = TMA and TMA_OK  # the config asks for TMA, the host allows it
    k_base = _describe(k_base, kv_len, head_dk, s_k_t, BLOCK_N, DK_PAD, USE_TMA)
    v_base = _describe(v_base, kv_len, head_dv, s_v_t, BLOCK_N, DV_PAD, USE_TMA)

    own = _own_rows(offs_m, b, q_len, mask, False)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)

    n_partial, n_full, blocks = _block_row(num_partial, num_full, index, b, h,
                                           (pid_m * BLOCK_M) // SPARSE_Q,
                                           s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r)
    SUBS: tl.constexpr = SPARSE_K // BLOCK_N  # kernel blocks per sparse block
    if MERGED:  # one loop over the whole list, PARTIAL blocks first: one pipeline per row
        STRIDED = PARTIAL_STRIDED and FULL_STRIDED  # constexpr
        spacing = _list_spacing(blocks, n_partial, n_full, SPARSE_K, STRIDED)
        for t in range(0, (n_partial + n_full) * SUBS):
            start_n = _merged_start(blocks, t, n_partial * SUBS, spacing, SUBS,
                                    SPARSE_K, BLOCK_N, STRIDED)
            m_i, l_i, acc = _fwd_tile(
                q, m_i, l_i, acc, start_n, k_base, v_base, q_start, offs_dk, offs_dv, b, h,
                s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale, mask,
                own, t < n_partial * SUBS, BOUNDS, BOUNDS, BLOCK_N, EVEN_DK, EVEN_DV,
                PRECISION, UPCAST, MERGED, USE_TMA)
    for part in tl.static_range(0 if MERGED else 2):  # or a loop per kind (launch.WALKS)
        masked = (part == 0) != FULL_FIRST  # constexpr: the loop is unrolled
        first = 0 if masked else n_partial
        stop = n_partial if masked else n_partial + n_full
        STRIDED = (PARTIAL_STRIDED and masked) or (FULL_STRIDED and not masked)  # constexpr
        base, step = _spacing(blocks, first, stop - first, SPARSE_K, STRIDED)
        if FLAT:  # one kernel block per iteration
            for t in range(first * SUBS, stop * SUBS):
                start_n = _block_start(blocks, t, base, step, SUBS, SPARSE_K, BLOCK_N, STRIDED)
                m_i, l_i, acc = _fwd_tile(
                    q, m_i, l_i, acc, start_n, k_base, v_base, q_start, offs_dk, offs_dv, b, h,
                    s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale, mask,
                    own, masked, masked and BOUNDS, BOUNDS, BLOCK_N, EVEN_DK, EVEN_DV,
                    PRECISION, UPCAST, MERGED, USE_TMA)
        else:  # one sparse block per iteration, its kernel blocks unrolled
            for j in range(first, stop):
                block_start = _sparse_start(blocks, j, base, step, SPARSE_K, STRIDED)
                for sub in tl.static_range(SUBS):
                    m_i, l_i, acc = _fwd_tile(
                        q, m_i, l_i, acc, block_start + sub * BLOCK_N, k_base, v_base,
                        q_start, offs_dk, offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len,
                        head_dk, head_dv, qk_scale, mask, own, masked, masked and BOUNDS,
                        BOUNDS, BLOCK_N, EVEN_DK, EVEN_DV, PRECISION, UPCAST, MERGED, USE_TMA)

    empty = l_i == 0.0  # no allowed key: output 0, LSE -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = _tile_ptrs(Out + b * s_o_b + h * s_o_h, offs_m, offs_dv, s_o_t, s_o_d)  # [M, DV]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=_in_bounds(offs_m, offs_dv, q_len, head_dv))
    tl.store(Lse + b * s_l_b + h * s_l_h + offs_m * s_l_t, lse, mask=offs_m < q_len)


# ---- backward --------------------------------------------------------------------------------
@triton.jit
def _own_row_stats(o_base, do, Lse, dLse, Lse2, Delta, b, h, heads, offs_m, offs_dv, s_o_t, s_o_d,
                   q_len, head_dv, HAS_DLSE: tl.constexpr):
    """The backward's statistics of a program's own query rows ``offs_m`` (in the dQ kernel, or
    the stats kernel before the stored-dS backward), computed there and stored for dK/dV:
    Δ = rowsum(dO ∘ O) (minus the LSE's own gradient ``dLse`` when HAS_DLSE) into ``Delta``,
    and the LSE in base 2 into ``Lse2``, ``+inf`` on fully masked rows and rows past the end
    (so ``exp2(s − lse2) = 0`` there). ``Lse``,
    ``dLse``, ``Lse2``, ``Delta``: ``[B, H, Tq]`` float32, contiguous; ``do``: the program's
    ``[M, DV]`` dO tile; ``o_base``: this (batch, head)'s output."""
    rows = (b * heads + h) * q_len + offs_m
    inside = offs_m < q_len
    o = tl.load(_tile_ptrs(o_base, offs_m, offs_dv, s_o_t, s_o_d),
                mask=_in_bounds(offs_m, offs_dv, q_len, head_dv), other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dLse + rows, mask=inside, other=0.0)
    lse = tl.load(Lse + rows, mask=inside, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(Delta + rows, delta, mask=inside)
    tl.store(Lse2 + rows, lse2, mask=inside)
    return lse2, delta


@triton.jit
def _row_stats(Lse2, Delta, b, h, heads, offs_m, q_len, BOUNDED: tl.constexpr):
    """Base-2 LSE (``+inf`` on fully masked rows and, when BOUNDED, rows past the end, so
    ``exp2(s − lse2) = 0``) and Δ of the query rows ``offs_m``, from the buffers the dQ kernel
    wrote (:func:`_own_row_stats`). Not BOUNDED: every row is inside (no predicate per element)."""
    rows = (b * heads + h) * q_len + offs_m
    if BOUNDED:
        lse2 = tl.load(Lse2 + rows, mask=offs_m < q_len, other=float("inf"))
        delta = tl.load(Delta + rows, mask=offs_m < q_len, other=0.0)
    else:
        lse2 = tl.load(Lse2 + rows)
        delta = tl.load(Delta + rows)
    return lse2, delta


@triton.jit
def _walk_row_stats(lse_src, delta_src, start_m, b, h, heads, offs_m, q_len,
                    BOUNDED: tl.constexpr, USE_TMA: tl.constexpr):
    """:func:`_row_stats` of a walked query block (rows ``start_m …``). With USE_TMA,
    ``lse_src``/``delta_src`` are 1-D descriptors of one head's rows, and rows past the end
    read 0 instead of ``+inf``: harmless there, because their q and dO tiles (TMA copies too)
    read 0, so they add nothing to dK or dV."""
    if USE_TMA:
        lse2 = lse_src.load([start_m])
        delta = delta_src.load([start_m])
    else:
        lse2, delta = _row_stats(lse_src, delta_src, b, h, heads, offs_m, q_len, BOUNDED)
    return lse2, delta


@triton.jit
def _ds_at(ds_head, slot_row, j, start_m, s_ds_r, s_ds_e, SPARSE_Q: tl.constexpr,
           STORE_DS: tl.constexpr):
    """Where (an element offset into ``DS``) dK/dV stores the dS tile of its key rows and the
    query block ``start_m …``, entry ``j`` of its column's list (STORE_DS; else 0, unused).
    ``DS [B, H, R, E, SPARSE_K, SPARSE_Q]`` keeps one slot per listed sparse block, indexed as
    the *forward* lists index it (query row ``r``, entry ``e`` of that row), so the dQ kernel
    (:func:`attn_bwd_dq_stored`) reads its slots at addresses affine in its loop counter;
    ``ds_head``: the (batch, head)'s offset plus the key rows' within a slot, made once per
    head; ``slot_row``: this column's ``e`` for each of its entries (``launch.Layout.slots``)."""
    at = 0
    if STORE_DS:
        e = tl.load(slot_row + j)
        at = ds_head + (start_m // SPARSE_Q) * s_ds_r + e * s_ds_e + start_m % SPARSE_Q
    return at


@triton.jit
def _ds_view(DS, ds_rows, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
             SPARSE_Q: tl.constexpr):
    """``DS`` as a tensor descriptor of ``[ds_rows, SPARSE_Q]`` (a slot's key rows one after
    another) in ``[BLOCK_R, BLOCK_C]`` tiles, for TMA copies at :func:`_ds_coords`."""
    return tl.make_tensor_descriptor(DS, shape=[ds_rows, SPARSE_Q], strides=[SPARSE_Q, 1],
                                     block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def _ds_coords(at, SPARSE_Q: tl.constexpr):
    """The :func:`_ds_view` coordinates (row, column) of element offset ``at`` into ``DS``."""
    return (at // SPARSE_Q).to(tl.int32), (at % SPARSE_Q).to(tl.int32)


@triton.jit
def _dkdv_tile(k, v, dk, dv, start_m, q_base, do_base, lse_src, delta_src, k_start, offs_dk,
               offs_dv, b, h, heads, s_q_t, s_q_d, s_do_t, s_do_d, q_len, kv_len, head_dk, head_dv,
               qk_scale, mask, own, partial, ds_dst, ds_at, LOAD_BOUNDS: tl.constexpr,
               BOUNDS: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_DK: tl.constexpr,
               EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               USE_TMA: tl.constexpr, SPARSE_Q: tl.constexpr, STORE_DS: tl.constexpr,
               DS_TMA: tl.constexpr):
    """One query block's (rows ``start_m …``) contribution to ``dk [N, DK]`` and ``dv [N, DV]``
    of the key rows ``k_start …`` (transposed scores ``[N, M]``); ``partial``, LOAD_BOUNDS,
    USE_TMA: as for :func:`_fwd_tile`. STORE_DS: the tile's ``dsᵀ [N, M]`` (q's dtype, the
    operand of dK's product) is also stored at offset ``ds_at`` (:func:`_ds_at`) of ``ds_dst``,
    rows ``SPARSE_Q`` apart: with DS_TMA ``ds_dst`` describes ``DS`` as ``[rows, SPARSE_Q]``
    and the tile goes by one TMA store (registers to shared memory, then an asynchronous
    copy), else ``ds_dst`` is ``DS`` (stored through a blocked layout: a shuffle through
    shared memory and back, ~110 more SASS instructions a tile than without the store in
    offline sm90 builds of the flat 32×128 loops, against ~45 by TMA)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _walk_tile(q_base, start_m, offs_m, offs_dk, s_q_t, s_q_d, q_len, head_dk, LOAD_BOUNDS,
                   EVEN_DK, USE_TMA)  # [M, DK]
    do = _walk_tile(do_base, start_m, offs_m, offs_dv, s_do_t, s_do_d, q_len, head_dv,
                    LOAD_BOUNDS, EVEN_DV, USE_TMA)  # [M, DV]
    lse2, delta = _walk_row_stats(lse_src, delta_src, start_m, b, h, heads, offs_m, q_len,
                                  LOAD_BOUNDS, USE_TMA)
    s2_t = _scores(k, q, qk_scale, start_m, k_start, b, h, q_len, kv_len, mask, own,
                   partial, True, BOUNDS, PRECISION, UPCAST)  # [N, M]
    p_t = tl.math.exp2(s2_t - lse2[None, :])  # [N, M] softmax weights, transposed
    dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST)
    dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST)  # [N, M]
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # gradient of the scaled scores
    if STORE_DS:
        if DS_TMA:
            ds_r, ds_c = _ds_coords(ds_at, SPARSE_Q)
            ds_dst.store([ds_r, ds_c], ds_t)
        else:
            rows = tl.arange(0, ds_t.shape[0])
            cols = tl.arange(0, ds_t.shape[1])
            tl.store(ds_dst + ds_at + rows[:, None] * SPARSE_Q + cols[None, :], ds_t)
    dk += _dot(ds_t, q, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def _dq_tile(q, do, lse2, delta, dq, start_n, k_base, v_base, q_start, offs_dk, offs_dv, b, h,
             s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale, mask, own,
             partial, LOAD_BOUNDS: tl.constexpr, BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr,
             EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    """One key block's (rows ``start_n …``) contribution to ``dq [M, DK]`` of the query rows
    ``q_start …``; ``partial``, LOAD_BOUNDS, USE_TMA: as for :func:`_fwd_tile`."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _walk_tile(k_base, start_n, offs_n, offs_dk, s_k_t, s_k_d, kv_len, head_dk, LOAD_BOUNDS,
                   EVEN_DK, USE_TMA)  # [N, DK]
    v = _walk_tile(v_base, start_n, offs_n, offs_dv, s_v_t, s_v_d, kv_len, head_dv, LOAD_BOUNDS,
                   EVEN_DV, USE_TMA)  # [N, DV]
    s2 = _scores(q, k, qk_scale, q_start, start_n, b, h, q_len, kv_len, mask, own,
                 partial, False, BOUNDS, PRECISION, UPCAST)  # [M, N]
    p = tl.math.exp2(s2 - lse2[:, None])  # [M, N]
    dp = _dot(do, tl.trans(v), PRECISION, UPCAST)  # [M, N]
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
    return dq


@triton.jit(do_not_specialize=SIZES_AND_MASK + ["heads_kv", "ds_rows"] + DS_STRIDES)
def attn_bwd_dkdv(Q, K, V, dOut, Lse2, Delta, dK, dV, DS, slots,
                  s_q_b, s_q_h, s_q_t, s_q_d, s_k_b, s_k_h, s_k_t, s_k_d,
                  s_v_b, s_v_h, s_v_t, s_v_d, s_do_b, s_do_h, s_do_t, s_do_d,
                  s_dk_b, s_dk_h, s_dk_t, s_dk_d, s_dv_b, s_dv_h, s_dv_t, s_dv_d,
                  s_ds_b, s_ds_h, s_ds_r, s_ds_e, ds_rows,
                  heads, heads_kv, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale,
                  num_partial, num_full, index, order, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
                  band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                  q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                  dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                  bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                  TUNE_KEY,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                  SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                  EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, FULL_FIRST: tl.constexpr,
                  FLAT: tl.constexpr, MERGED: tl.constexpr, ORDERED: tl.constexpr,
                  TMA: tl.constexpr, TMA_OK: tl.constexpr,
                  ORDER_KIND: tl.constexpr, PARTIAL_STRIDED: tl.constexpr,
                  FULL_STRIDED: tl.constexpr,
                  BOUNDS: tl.constexpr,
                  HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                  HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, DOC_RANGES: tl.constexpr,
                  HAS_DENSE: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_DS: tl.constexpr,
                  DS_TMA: tl.constexpr):
    """dK, dV: one program per (key block, batch × kv head); loops over the group's query heads
    (GQA without atomics) and, per head, over the non-empty query blocks of this key block
    (the transposed block lists). Writes ``dK [B, Hkv, Tk, Dk]``, ``dV [B, Hkv, Tk, Dv]``, and
    with STORE_DS every tile's dS into its slot of ``DS`` for :func:`attn_bwd_dq_stored`
    (:func:`_ds_at`; ``slots``: ``[B, H, C, R]`` int32, strided as ``index``; ``ds_rows``:
    ``DS``'s size over ``SPARSE_Q``)."""
    mask = MaskArgs(band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                    q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                    dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                    bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                    HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, DOC_RANGES, HAS_DENSE,
                    HAS_BIAS)
    pid_n, b, h_kv = _program_ids(heads_kv)
    if ORDERED:  # heaviest key blocks first (see _ordered_block)
        pid_n = _ordered_block(order, pid_n, SPARSE_K // BLOCK_N, ORDER_KIND)
        if pid_n * BLOCK_N >= kv_len:  # the grid rounds up to whole sparse columns
            return
    k_start = pid_n * BLOCK_N
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k = tl.load(_tile_ptrs(K + b * s_k_b + h_kv * s_k_h, offs_n, offs_dk, s_k_t, s_k_d),
                mask=_in_bounds(offs_n, offs_dk, kv_len, head_dk), other=0.0)  # [N, DK]
    v = tl.load(_tile_ptrs(V + b * s_v_b + h_kv * s_v_h, offs_n, offs_dv, s_v_t, s_v_d),
                mask=_in_bounds(offs_n, offs_dv, kv_len, head_dv), other=0.0)  # [N, DV]
    own = _own_rows(offs_n, b, kv_len, mask, True)
    dk = tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    col = (pid_n * BLOCK_N) // SPARSE_K  # this key block's row in the transposed block lists
    SUBS: tl.constexpr = SPARSE_Q // BLOCK_M  # kernel blocks per sparse block
    USE_TMA: tl.constexpr = TMA and TMA_OK  # the config asks for TMA, the host allows it
    ds_dst = DS
    if STORE_DS and DS_TMA:  # dS tiles by TMA stores, whatever the walk loads by
        ds_dst = _ds_view(DS, ds_rows, BLOCK_N, BLOCK_M, SPARSE_Q)
    for g in range(0, group):
        h = h_kv * group + g
        q_base = _describe(Q + b * s_q_b + h * s_q_h, q_len, head_dk, s_q_t, BLOCK_M, DK_PAD,
                           USE_TMA)
        do_base = _describe(dOut + b * s_do_b + h * s_do_h, q_len, head_dv, s_do_t, BLOCK_M,
                            DV_PAD, USE_TMA)
        lse_src = Lse2
        delta_src = Delta
        if USE_TMA:  # the query rows' LSE and Δ as 1-D descriptors too
            lse_src = tl.make_tensor_descriptor(Lse2 + (b * heads + h) * q_len, shape=[q_len],
                                                strides=[1], block_shape=[BLOCK_M])
            delta_src = tl.make_tensor_descriptor(Delta + (b * heads + h) * q_len, shape=[q_len],
                                                  strides=[1], block_shape=[BLOCK_M])
        n_partial, n_full, blocks = _block_row(num_partial, num_full, index, b, h, col,
                                               s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r)
        slot_row = slots + b * s_i_b + h * s_i_h + col * s_i_r  # its entries' slots
        ds_head = b * s_ds_b + h * s_ds_h + (k_start % SPARSE_K) * SPARSE_Q  # see _ds_at
        if MERGED:  # one loop over the whole list, PARTIAL blocks first
            STRIDED = PARTIAL_STRIDED and FULL_STRIDED  # constexpr
            spacing = _list_spacing(blocks, n_partial, n_full, SPARSE_Q, STRIDED)
            for t in range(0, (n_partial + n_full) * SUBS):
                start_m = _merged_start(blocks, t, n_partial * SUBS, spacing, SUBS,
                                        SPARSE_Q, BLOCK_M, STRIDED)
                ds_at = _ds_at(ds_head, slot_row, t // SUBS, start_m, s_ds_r, s_ds_e, SPARSE_Q,
                               STORE_DS)
                dk, dv = _dkdv_tile(
                    k, v, dk, dv, start_m, q_base, do_base, lse_src, delta_src, k_start, offs_dk,
                    offs_dv, b, h, heads, s_q_t, s_q_d, s_do_t, s_do_d, q_len, kv_len, head_dk,
                    head_dv, qk_scale, mask, own, t < n_partial * SUBS, ds_dst, ds_at, BOUNDS,
                    BOUNDS, BLOCK_M, EVEN_DK, EVEN_DV, PRECISION, UPCAST, USE_TMA, SPARSE_Q,
                    STORE_DS, DS_TMA)
        for part in tl.static_range(0 if MERGED else 2):  # or a loop per kind (launch.WALKS)
            masked = (part == 0) != FULL_FIRST  # constexpr: the loop is unrolled
            first = 0 if masked else n_partial
            stop = n_partial if masked else n_partial + n_full
            STRIDED = (PARTIAL_STRIDED and masked) or (FULL_STRIDED and not masked)  # constexpr
            base, step = _spacing(blocks, first, stop - first, SPARSE_Q, STRIDED)
            if FLAT:  # one kernel block per iteration
                for t in range(first * SUBS, stop * SUBS):
                    start_m = _block_start(blocks, t, base, step, SUBS, SPARSE_Q, BLOCK_M, STRIDED)
                    ds_at = _ds_at(ds_head, slot_row, t // SUBS, start_m, s_ds_r, s_ds_e,
                                   SPARSE_Q, STORE_DS)
                    dk, dv = _dkdv_tile(
                        k, v, dk, dv, start_m, q_base, do_base, lse_src, delta_src, k_start,
                        offs_dk, offs_dv, b, h, heads, s_q_t, s_q_d, s_do_t, s_do_d, q_len,
                        kv_len, head_dk, head_dv, qk_scale, mask, own, masked, ds_dst, ds_at,
                        masked and BOUNDS, BOUNDS, BLOCK_M, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                        USE_TMA, SPARSE_Q, STORE_DS, DS_TMA)
            else:  # one sparse block per iteration, its kernel blocks unrolled
                for j in range(first, stop):
                    block_start = _sparse_start(blocks, j, base, step, SPARSE_Q, STRIDED)
                    for sub in tl.static_range(SUBS):
                        ds_at = _ds_at(ds_head, slot_row, j, block_start + sub * BLOCK_M,
                                       s_ds_r, s_ds_e, SPARSE_Q, STORE_DS)
                        dk, dv = _dkdv_tile(
                            k, v, dk, dv, block_start + sub * BLOCK_M, q_base, do_base,
                            lse_src, delta_src, k_start, offs_dk, offs_dv, b, h, heads, s_q_t,
                            s_q_d, s_do_t, s_do_d, q_len, kv_len, head_dk, head_dv, qk_scale,
                            mask, own, masked, ds_dst, ds_at, masked and BOUNDS, BOUNDS, BLOCK_M,
                            EVEN_DK, EVEN_DV, PRECISION, UPCAST, USE_TMA, SPARSE_Q, STORE_DS,
                            DS_TMA)
    dk = dk * sm_scale
    tl.store(_tile_ptrs(dK + b * s_dk_b + h_kv * s_dk_h, offs_n, offs_dk, s_dk_t, s_dk_d),
             dk.to(dK.dtype.element_ty), mask=_in_bounds(offs_n, offs_dk, kv_len, head_dk))
    tl.store(_tile_ptrs(dV + b * s_dv_b + h_kv * s_dv_h, offs_n, offs_dv, s_dv_t, s_dv_d),
             dv.to(dV.dtype.element_ty), mask=_in_bounds(offs_n, offs_dv, kv_len, head_dv))


@triton.jit(do_not_specialize=SIZES_AND_MASK)
def attn_bwd_dq(Q, K, V, dOut, Out, Lse, dLse, Lse2, Delta, dQ,
                s_q_b, s_q_h, s_q_t, s_q_d, s_k_b, s_k_h, s_k_t, s_k_d,
                s_v_b, s_v_h, s_v_t, s_v_d, s_do_b, s_do_h, s_do_t, s_do_d,
                s_o_b, s_o_h, s_o_t, s_o_d, s_dq_b, s_dq_h, s_dq_t, s_dq_d,
                heads, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale,
                num_partial, num_full, index, order, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
                band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                TUNE_KEY,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, FULL_FIRST: tl.constexpr,
                FLAT: tl.constexpr, MERGED: tl.constexpr, ORDERED: tl.constexpr,
                TMA: tl.constexpr, TMA_OK: tl.constexpr,
                ORDER_KIND: tl.constexpr, PARTIAL_STRIDED: tl.constexpr,
                FULL_STRIDED: tl.constexpr,
                BOUNDS: tl.constexpr,
                HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, DOC_RANGES: tl.constexpr,
                HAS_DENSE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DLSE: tl.constexpr):
    """dQ: one program per (query block, batch × query head), over the forward block lists.
    Writes ``dQ [B, H, Tq, Dk]``, and first its rows' Δ and base-2 LSE into ``Delta`` and
    ``Lse2`` for dK/dV (:func:`_own_row_stats`; ``Out``, ``Lse``, ``dLse``: the forward's output
    and LSE, the LSE's gradient)."""
    mask = MaskArgs(band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                    q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                    dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                    bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                    HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, DOC_RANGES, HAS_DENSE,
                    HAS_BIAS)
    pid_m, b, h = _program_ids(heads)
    if ORDERED:  # heaviest query blocks first (see _ordered_block)
        pid_m = _ordered_block(order, pid_m, SPARSE_Q // BLOCK_M, ORDER_KIND)
        if pid_m * BLOCK_M >= q_len:  # the grid rounds up to whole sparse rows
            return
    h_kv = h // group
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = tl.load(_tile_ptrs(Q + b * s_q_b + h * s_q_h, offs_m, offs_dk, s_q_t, s_q_d),
                mask=_in_bounds(offs_m, offs_dk, q_len, head_dk), other=0.0)  # [M, DK]
    do = tl.load(_tile_ptrs(dOut + b * s_do_b + h * s_do_h, offs_m, offs_dv, s_do_t, s_do_d),
                 mask=_in_bounds(offs_m, offs_dv, q_len, head_dv), other=0.0)  # [M, DV]
    lse2, delta = _own_row_stats(Out + b * s_o_b + h * s_o_h, do, Lse, dLse, Lse2, Delta, b, h,
                                 heads, offs_m, offs_dv, s_o_t, s_o_d, q_len, head_dv, HAS_DLSE)
    USE_TMA: tl.constexpr = TMA and TMA_OK  # the config asks for TMA, the host allows it
    k_base = _describe(K + b * s_k_b + h_kv * s_k_h, kv_len, head_dk, s_k_t, BLOCK_N, DK_PAD,
                       USE_TMA)
    v_base = _describe(V + b * s_v_b + h_kv * s_v_h, kv_len, head_dv, s_v_t, BLOCK_N, DV_PAD,
                       USE_TMA)
    own = _own_rows(offs_m, b, q_len, mask, False)
    dq = tl.zeros([BLOCK_M, DK_PAD], dtype=tl.float32)

    n_partial, n_full, blocks = _block_row(num_partial, num_full, index, b, h,
                                           (pid_m * BLOCK_M) // SPARSE_Q,
                                           s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r)
    SUBS: tl.constexpr = SPARSE_K // BLOCK_N  # kernel blocks per sparse block
    if MERGED:  # one loop over the whole list, PARTIAL blocks first
        STRIDED = PARTIAL_STRIDED and FULL_STRIDED  # constexpr
        spacing = _list_spacing(blocks, n_partial, n_full, SPARSE_K, STRIDED)
        for t in range(0, (n_partial + n_full) * SUBS):
            start_n = _merged_start(blocks, t, n_partial * SUBS, spacing, SUBS,
                                    SPARSE_K, BLOCK_N, STRIDED)
            dq = _dq_tile(q, do, lse2, delta, dq, start_n, k_base, v_base, q_start, offs_dk,
                          offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk,
                          head_dv, qk_scale, mask, own, t < n_partial * SUBS, BOUNDS, BOUNDS,
                          BLOCK_N, EVEN_DK, EVEN_DV, PRECISION, UPCAST, USE_TMA)
    for part in tl.static_range(0 if MERGED else 2):  # or a loop per kind (launch.WALKS)
        masked = (part == 0) != FULL_FIRST  # constexpr: the loop is unrolled
        first = 0 if masked else n_partial
        stop = n_partial if masked else n_partial + n_full
        STRIDED = (PARTIAL_STRIDED and masked) or (FULL_STRIDED and not masked)  # constexpr
        base, step = _spacing(blocks, first, stop - first, SPARSE_K, STRIDED)
        if FLAT:  # one kernel block per iteration
            for t in range(first * SUBS, stop * SUBS):
                start_n = _block_start(blocks, t, base, step, SUBS, SPARSE_K, BLOCK_N, STRIDED)
                dq = _dq_tile(q, do, lse2, delta, dq, start_n, k_base, v_base, q_start, offs_dk,
                              offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk,
                              head_dv, qk_scale, mask, own, masked, masked and BOUNDS, BOUNDS,
                              BLOCK_N, EVEN_DK, EVEN_DV, PRECISION, UPCAST, USE_TMA)
        else:  # one sparse block per iteration, its kernel blocks unrolled
            for j in range(first, stop):
                block_start = _sparse_start(blocks, j, base, step, SPARSE_K, STRIDED)
                for sub in tl.static_range(SUBS):
                    dq = _dq_tile(q, do, lse2, delta, dq, block_start + sub * BLOCK_N,
                                  k_base, v_base, q_start, offs_dk, offs_dv, b, h, s_k_t, s_k_d,
                                  s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale, mask,
                                  own, masked, masked and BOUNDS, BOUNDS, BLOCK_N, EVEN_DK,
                                  EVEN_DV, PRECISION, UPCAST, USE_TMA)
    dq = dq * sm_scale
    tl.store(_tile_ptrs(dQ + b * s_dq_b + h * s_dq_h, offs_m, offs_dk, s_dq_t, s_dq_d),
             dq.to(dQ.dtype.element_ty), mask=_in_bounds(offs_m, offs_dk, q_len, head_dk))


# ---- the stored-dS backward: statistics, then dK/dV storing dS, then dQ = dS·K ------------------
@triton.jit(do_not_specialize=["TUNE_KEY", "heads", "q_len"])
def attn_bwd_stats(dOut, Out, Lse, dLse, Lse2, Delta,
                   s_do_b, s_do_h, s_do_t, s_do_d, s_o_b, s_o_h, s_o_t, s_o_d,
                   heads, q_len, head_dv, TUNE_KEY,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DK_PAD: tl.constexpr,
                   DV_PAD: tl.constexpr, FULL_FIRST: tl.constexpr, FLAT: tl.constexpr,
                   MERGED: tl.constexpr, ORDERED: tl.constexpr, TMA: tl.constexpr,
                   HAS_DLSE: tl.constexpr):
    """The row statistics dK/dV needs before it runs, when dQ runs after it (the stored-dS
    backward): one program per (query block, batch × head) writes its rows' ``Delta`` and
    ``Lse2`` (:func:`_own_row_stats`). BLOCK_N, DK_PAD and the walk switches are the launch
    machinery's (``launch.Call``), unused here."""
    pid_m, b, h = _program_ids(heads)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, DV_PAD)
    do = tl.load(_tile_ptrs(dOut + b * s_do_b + h * s_do_h, offs_m, offs_dv, s_do_t, s_do_d),
                 mask=_in_bounds(offs_m, offs_dv, q_len, head_dv), other=0.0)  # [M, DV]
    _own_row_stats(Out + b * s_o_b + h * s_o_h, do, Lse, dLse, Lse2, Delta, b, h, heads, offs_m,
                   offs_dv, s_o_t, s_o_d, q_len, head_dv, HAS_DLSE)


@triton.jit(do_not_specialize=SIZES_AND_MASK + DS_STRIDES + ["ds_rows"])
def attn_bwd_dq_stored(K, DS, dQ,
                       s_k_b, s_k_h, s_k_t, s_k_d, s_dq_b, s_dq_h, s_dq_t, s_dq_d,
                       s_ds_b, s_ds_h, s_ds_r, s_ds_e, ds_rows,
                       heads, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale,
                       num_partial, num_full, index, order,
                       s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
                       TUNE_KEY,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                       SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                       EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, FULL_FIRST: tl.constexpr,
                       FLAT: tl.constexpr, MERGED: tl.constexpr, ORDERED: tl.constexpr,
                       TMA: tl.constexpr, TMA_OK: tl.constexpr,
                       ORDER_KIND: tl.constexpr, PARTIAL_STRIDED: tl.constexpr,
                       FULL_STRIDED: tl.constexpr, BOUNDS: tl.constexpr):
    """dQ from the dS tiles dK/dV stored (STORE_DS): one program per (query block, batch ×
    query head), ``dq = scale · Σ dS·K`` over its row's listed blocks, one matmul per tile
    where the recomputing kernel (:func:`attn_bwd_dq`) does three; no mask, statistics, V
    or dO. The dS tiles already hold the mask (zero where masked), so PARTIAL and FULL
    blocks are one loop (the one-loop walk's positions, :func:`_merged_start`); the slot of
    entry ``e`` is at an address affine in the loop counter. Past the end of the keys a
    slot may never have been written: with BOUNDS those rows are not read (zeroed, with TMA).
    USE_TMA (``TMA`` and the host's ``TMA_OK``): K and the dS tiles by TMA copies (``ds_rows``:
    ``DS``'s size over ``SPARSE_Q``). Writes ``dQ [B, H, Tq, Dk]``. FULL_FIRST, FLAT,
    MERGED: the launch machinery's, unused (head_dv, DV_PAD, EVEN_DV, qk_scale too)."""
    pid_m, b, h = _program_ids(heads)
    if ORDERED:  # heaviest query blocks first (see _ordered_block)
        pid_m = _ordered_block(order, pid_m, SPARSE_Q // BLOCK_M, ORDER_KIND)
        if pid_m * BLOCK_M >= q_len:  # the grid rounds up to whole sparse rows
            return
    h_kv = h // group
    q_start = pid_m * BLOCK_M
    row = q_start // SPARSE_Q
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    USE_TMA: tl.constexpr = TMA and TMA_OK  # the config asks for TMA, the host allows it
    k_base = _describe(K + b * s_k_b + h_kv * s_k_h, kv_len, head_dk, s_k_t, BLOCK_N, DK_PAD,
                       USE_TMA)
    # this block's columns of each slot: [N, M] tiles, SPARSE_Q apart
    ds_at = b * s_ds_b + h * s_ds_h + row * s_ds_r + q_start % SPARSE_Q  # of entry 0
    if USE_TMA:  # entry t's tile at the coordinates of ds_at + its offset
        ds_src = _ds_view(DS, ds_rows, BLOCK_N, BLOCK_M, SPARSE_Q)
    else:
        ds_src = (DS + ds_at + tl.arange(0, BLOCK_N)[:, None] * SPARSE_Q
                  + tl.arange(0, BLOCK_M)[None, :])
    n_partial, n_full, blocks = _block_row(num_partial, num_full, index, b, h, row,
                                           s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r)
    SUBS: tl.constexpr = SPARSE_K // BLOCK_N  # kernel blocks per sparse block
    STRIDED: tl.constexpr = PARTIAL_STRIDED and FULL_STRIDED
    spacing = _list_spacing(blocks, n_partial, n_full, SPARSE_K, STRIDED)
    dq = tl.zeros([BLOCK_M, DK_PAD], dtype=tl.float32)
    for t in range(0, (n_partial + n_full) * SUBS):
        start_n = _merged_start(blocks, t, n_partial * SUBS, spacing, SUBS, SPARSE_K, BLOCK_N,
                                STRIDED)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _walk_tile(k_base, start_n, offs_n, offs_dk, s_k_t, s_k_d, kv_len, head_dk, BOUNDS,
                       EVEN_DK, USE_TMA)  # [N, DK]
        slot = (t // SUBS) * s_ds_e + (t % SUBS) * (BLOCK_N * SPARSE_Q)  # entry t's sub-tile
        if USE_TMA:
            ds_r, ds_c = _ds_coords(ds_at + slot, SPARSE_Q)
            ds_t = ds_src.load([ds_r, ds_c])  # [N, M]
            if BOUNDS:  # rows never written may hold anything, NaN too: not 0 · K
                ds_t = tl.where(offs_n[:, None] < kv_len, ds_t, 0.0)
        elif BOUNDS:
            ds_t = tl.load(ds_src + slot, mask=offs_n[:, None] < kv_len, other=0.0)
        else:
            ds_t = tl.load(ds_src + slot)
        dq += _dot(tl.trans(ds_t), k, PRECISION, UPCAST)
    dq = dq * sm_scale
    tl.store(_tile_ptrs(dQ + b * s_dq_b + h * s_dq_h, offs_m, offs_dk, s_dq_t, s_dq_d),
             dq.to(dQ.dtype.element_ty), mask=_in_bounds(offs_m, offs_dk, q_len, head_dk))
