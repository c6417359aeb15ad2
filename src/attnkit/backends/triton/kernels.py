"""The ``@triton.jit`` kernels of the triton backend: forward, Δ preprocess, dK/dV, dQ.

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
  walks ``SPARSE/BLOCK`` sub-tiles of every listed sparse block.
- PARTIAL tiles evaluate the mask program (``_allowed``/``_bias``) and the sequence bounds;
  FULL tiles apply nothing (the host marks ragged tail blocks PARTIAL, so FULL tiles are
  always in bounds).
- A fully masked row keeps ``m = -inf`` and ``l = 0``: its output is exactly 0 and its LSE
  ``-inf``; the backward turns that LSE into ``+inf`` so ``exp2(s - lse) = 0`` (zero gradients).
- Head dims are padded to powers of two (``DK_PAD``/``DV_PAD``) with load masks; ``EVEN_DK``
  and ``EVEN_DV`` drop those masks when the dims are already powers of two.
- ``DOT_UPCAST`` casts dot operands to float32 first. It is set only under the interpreter
  for bfloat16, whose ``tl.dot`` multiplies the raw uint16 bit patterns there
  (triton-lang/triton#11584); on a GPU it is always off.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a [M, K] @ b [K, N]`` accumulated in float32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


# ---- the mask program: element mask of a PARTIAL tile, from indices or loaded -------------
@triton.jit
def _allowed(q_pos, k_pos, b, h, q_len, kv_len,
             band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
             q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
             dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
             HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
             HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr):
    """Bool "may attend" for query positions ``q_pos`` and key positions ``k_pos``, two
    broadcastable 2-D index tensors (``[M, 1]`` × ``[1, N]``, or transposed) → ``[M, N]``."""
    inside = (q_pos < q_len) & (k_pos < kv_len)
    ok = inside
    if HAS_LO:  # band: kv - q >= band_lo
        ok = ok & (k_pos - q_pos >= band_lo)
    if HAS_HI:  # band: kv - q <= band_hi
        ok = ok & (k_pos - q_pos <= band_hi)
    if HAS_QLEN:
        ok = ok & (q_pos < tl.load(q_lens + b * s_qlen_b))
    if HAS_KVLEN:
        ok = ok & (k_pos < tl.load(kv_lens + b * s_kvlen_b))
    if HAS_DOCS:
        q_doc = tl.load(q_docs + b * s_qdoc_b + q_pos * s_qdoc_t, mask=q_pos < q_len, other=-1)
        kv_doc = tl.load(kv_docs + b * s_kvdoc_b + k_pos * s_kvdoc_t, mask=k_pos < kv_len, other=-2)
        ok = ok & (q_doc == kv_doc)
    if HAS_DENSE:
        flag = tl.load(dense + b * s_dense_b + h * s_dense_h + q_pos * s_dense_q + k_pos * s_dense_k,
                       mask=inside, other=0)
        ok = ok & (flag != 0)
    return ok


@triton.jit
def _bias(q_pos, k_pos, b, h, q_len, kv_len, bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k):
    """The loaded additive bias (float32, ``-inf`` = masked) at ``q_pos`` × ``k_pos``."""
    inside = (q_pos < q_len) & (k_pos < kv_len)
    offs = b * s_bias_b + h * s_bias_h + q_pos * s_bias_q + k_pos * s_bias_k
    return tl.load(bias + offs, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _masked_scores(s2, q_pos, k_pos, b, h, q_len, kv_len,
                   band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                   q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                   dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                   bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                   HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                   HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    """Base-2 scores of a PARTIAL tile with the bias added and forbidden entries set to -inf."""
    ok = _allowed(q_pos, k_pos, b, h, q_len, kv_len,
                  band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                  q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                  dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                  HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE)
    if HAS_BIAS:
        extra = _bias(q_pos, k_pos, b, h, q_len, kv_len, bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k)
        ok = ok & (extra != float("-inf"))
        s2 = s2 + tl.where(ok, extra * LOG2E, 0.0)
    return tl.where(ok, s2, float("-inf"))


# ---- forward ---------------------------------------------------------------------------------
@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_dk, offs_dv, b, h,
              s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale,
              band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
              q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
              dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
              bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_DK: tl.constexpr,
              EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
              HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """One K/V tile of the online softmax: updates ``acc [M, DV]``, ``l_i [M]``, ``m_i [M]``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * s_k_t + offs_dk[None, :] * s_k_d  # [N, DK]
    v_ptrs = v_base + offs_n[:, None] * s_v_t + offs_dv[None, :] * s_v_d  # [N, DV]
    if MASKED:
        k = tl.load(k_ptrs, mask=(offs_n[:, None] < kv_len) & (offs_dk[None, :] < head_dk), other=0.0)
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < head_dv), other=0.0)
    else:
        if EVEN_DK:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_dk[None, :] < head_dk, other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < head_dv, other=0.0)
    s2 = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [M, N]
    if MASKED:
        s2 = _masked_scores(s2, offs_m[:, None], offs_n[None, :], b, h, q_len, kv_len,
                            band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                            q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                            dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                            bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                            HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    m_new = tl.maximum(m_i, tl.max(s2, 1))  # [M]
    if MASKED:  # a row with nothing allowed yet keeps m = -inf: subtract 0 instead (no inf - inf)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s2 - m_sub[:, None])  # [M, N]
    alpha = tl.math.exp2(m_i - m_sub)  # [M]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["TUNE_KEY"])
def attn_fwd(Q, K, V, Out, Lse,
             s_q_b, s_q_h, s_q_t, s_q_d, s_k_b, s_k_h, s_k_t, s_k_d,
             s_v_b, s_v_h, s_v_t, s_v_d, s_o_b, s_o_h, s_o_t, s_o_d, s_l_b, s_l_h, s_l_t,
             heads, group, q_len, kv_len, head_dk, head_dv, qk_scale,
             num_partial, num_full, index, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
             band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
             q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
             dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
             bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
             TUNE_KEY,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
             SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
             EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr,
             HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
             HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
             HAS_BIAS: tl.constexpr):
    """Forward: one program per (query block, batch × query head).

    Writes ``Out [B, H, Tq, Dv]`` (input dtype) and ``Lse [B, H, Tq]`` (float32, natural log).
    ``TUNE_KEY`` is unused by the body: it only keys the autotuner's cache.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    h_kv = h // group  # GQA: K/V are indexed, never repeated
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)

    q_ptrs = Q + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_t + offs_dk[None, :] * s_q_d
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < q_len) & (offs_dk[None, :] < head_dk), other=0.0)
    k_base = K + b * s_k_b + h_kv * s_k_h
    v_base = V + b * s_v_b + h_kv * s_v_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)

    row = (pid_m * BLOCK_M) // SPARSE_Q
    counts = b * s_n_b + h * s_n_h + row * s_n_r
    n_partial = tl.load(num_partial + counts)
    n_full = tl.load(num_full + counts)
    blocks = index + b * s_i_b + h * s_i_h + row * s_i_r
    for j in range(0, n_partial):
        block = tl.load(blocks + j)
        for sub in tl.static_range(SPARSE_K // BLOCK_N):
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, k_base, v_base, block * SPARSE_K + sub * BLOCK_N, offs_m,
                offs_dk, offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk,
                head_dv, qk_scale, band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                BLOCK_N, True, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    for j in range(n_partial, n_partial + n_full):
        block = tl.load(blocks + j)
        for sub in tl.static_range(SPARSE_K // BLOCK_N):
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, k_base, v_base, block * SPARSE_K + sub * BLOCK_N, offs_m,
                offs_dk, offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk,
                head_dv, qk_scale, band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                BLOCK_N, False, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)

    empty = l_i == 0.0  # no allowed key: output 0, LSE -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = Out + b * s_o_b + h * s_o_h + offs_m[:, None] * s_o_t + offs_dv[None, :] * s_o_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < head_dv))
    tl.store(Lse + b * s_l_b + h * s_l_h + offs_m * s_l_t, lse, mask=offs_m < q_len)


# ---- backward --------------------------------------------------------------------------------
@triton.jit
def attn_bwd_delta(Out, dOut, Delta, s_o_b, s_o_h, s_o_t, s_o_d, s_do_b, s_do_h, s_do_t, s_do_d,
                   heads, q_len, head_dv, BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr):
    """Δ = rowsum(dO ∘ O) in float32: ``Delta [B, H, Tq]`` (contiguous)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, DV_PAD)
    inside = (offs_m[:, None] < q_len) & (offs_dv[None, :] < head_dv)
    o = tl.load(Out + b * s_o_b + h * s_o_h + offs_m[:, None] * s_o_t + offs_dv[None, :] * s_o_d,
                mask=inside, other=0.0).to(tl.float32)
    do = tl.load(dOut + b * s_do_b + h * s_do_h + offs_m[:, None] * s_do_t + offs_dv[None, :] * s_do_d,
                 mask=inside, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * q_len + offs_m, tl.sum(o * do, 1), mask=offs_m < q_len)


@triton.jit
def _row_stats(Lse, Delta, b, h, heads, offs_m, s_l_b, s_l_h, s_l_t, q_len):
    """Base-2 LSE (``+inf`` on fully masked rows and rows past the end, so ``exp2(s - lse) = 0``)
    and Δ for the query rows ``offs_m``."""
    lse = tl.load(Lse + b * s_l_b + h * s_l_h + offs_m * s_l_t, mask=offs_m < q_len,
                  other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(Delta + (b * heads + h) * q_len + offs_m, mask=offs_m < q_len, other=0.0)
    return lse2, delta


@triton.jit
def _bwd_kv_tile(dk, dv, k, v, q_base, do_base, Lse, Delta, start_m, offs_n, offs_dk, offs_dv,
                 b, h, heads, s_q_t, s_q_d, s_do_t, s_do_d, s_l_b, s_l_h, s_l_t,
                 q_len, kv_len, head_dk, head_dv, qk_scale,
                 band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                 q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                 dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                 bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                 BLOCK_M: tl.constexpr, MASKED: tl.constexpr, EVEN_DK: tl.constexpr,
                 EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                 HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """One query tile's contribution to ``dk [N, DK]`` and ``dv [N, DV]`` (transposed scores)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_ptrs = q_base + offs_m[:, None] * s_q_t + offs_dk[None, :] * s_q_d  # [M, DK]
    do_ptrs = do_base + offs_m[:, None] * s_do_t + offs_dv[None, :] * s_do_d  # [M, DV]
    if MASKED:
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < q_len) & (offs_dk[None, :] < head_dk), other=0.0)
        do = tl.load(do_ptrs, mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < head_dv), other=0.0)
    else:
        if EVEN_DK:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=offs_dk[None, :] < head_dk, other=0.0)
        if EVEN_DV:
            do = tl.load(do_ptrs)
        else:
            do = tl.load(do_ptrs, mask=offs_dv[None, :] < head_dv, other=0.0)
    lse2, delta = _row_stats(Lse, Delta, b, h, heads, offs_m, s_l_b, s_l_h, s_l_t, q_len)
    s2_t = _dot(k, tl.trans(q), PRECISION, UPCAST) * qk_scale  # [N, M]
    if MASKED:
        s2_t = _masked_scores(s2_t, offs_m[None, :], offs_n[:, None], b, h, q_len, kv_len,
                              band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                              q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                              dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                              bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                              HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    p_t = tl.math.exp2(s2_t - lse2[None, :])  # [N, M] softmax weights, transposed
    dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST)
    dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST)  # [N, M]
    ds_t = p_t * (dp_t - delta[None, :])  # gradient of the scaled scores
    dk += _dot(ds_t.to(q.dtype), q, PRECISION, UPCAST)
    return dk, dv


@triton.jit(do_not_specialize=["TUNE_KEY"])
def attn_bwd_dkdv(Q, K, V, dOut, Lse, Delta, dK, dV,
                  s_q_b, s_q_h, s_q_t, s_q_d, s_k_b, s_k_h, s_k_t, s_k_d,
                  s_v_b, s_v_h, s_v_t, s_v_d, s_do_b, s_do_h, s_do_t, s_do_d,
                  s_l_b, s_l_h, s_l_t, s_dk_b, s_dk_h, s_dk_t, s_dk_d, s_dv_b, s_dv_h, s_dv_t, s_dv_d,
                  heads, heads_kv, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale,
                  num_partial, num_full, index, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
                  band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                  q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                  dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                  bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                  TUNE_KEY,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                  SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                  EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr,
                  HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                  HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """dK, dV: one program per (key block, batch × kv head); loops over the group's query heads
    (GQA without atomics) and, per head, over the non-empty query blocks of this key block
    (the transposed block lists). Writes ``dK [B, Hkv, Tk, Dk]``, ``dV [B, Hkv, Tk, Dv]``."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads_kv).to(tl.int64)
    h_kv = (pid_bh % heads_kv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k = tl.load(K + b * s_k_b + h_kv * s_k_h + offs_n[:, None] * s_k_t + offs_dk[None, :] * s_k_d,
                mask=(offs_n[:, None] < kv_len) & (offs_dk[None, :] < head_dk), other=0.0)
    v = tl.load(V + b * s_v_b + h_kv * s_v_h + offs_n[:, None] * s_v_t + offs_dv[None, :] * s_v_d,
                mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < head_dv), other=0.0)
    dk = tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    col = (pid_n * BLOCK_N) // SPARSE_K
    for g in range(0, group):
        h = h_kv * group + g
        q_base = Q + b * s_q_b + h * s_q_h
        do_base = dOut + b * s_do_b + h * s_do_h
        counts = b * s_n_b + h * s_n_h + col * s_n_r
        n_partial = tl.load(num_partial + counts)
        n_full = tl.load(num_full + counts)
        blocks = index + b * s_i_b + h * s_i_h + col * s_i_r
        for j in range(0, n_partial):
            block = tl.load(blocks + j)
            for sub in tl.static_range(SPARSE_Q // BLOCK_M):
                dk, dv = _bwd_kv_tile(
                    dk, dv, k, v, q_base, do_base, Lse, Delta, block * SPARSE_Q + sub * BLOCK_M,
                    offs_n, offs_dk, offs_dv, b, h, heads, s_q_t, s_q_d, s_do_t, s_do_d,
                    s_l_b, s_l_h, s_l_t, q_len, kv_len, head_dk, head_dv, qk_scale,
                    band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                    q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                    dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                    bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                    BLOCK_M, True, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                    HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
        for j in range(n_partial, n_partial + n_full):
            block = tl.load(blocks + j)
            for sub in tl.static_range(SPARSE_Q // BLOCK_M):
                dk, dv = _bwd_kv_tile(
                    dk, dv, k, v, q_base, do_base, Lse, Delta, block * SPARSE_Q + sub * BLOCK_M,
                    offs_n, offs_dk, offs_dv, b, h, heads, s_q_t, s_q_d, s_do_t, s_do_d,
                    s_l_b, s_l_h, s_l_t, q_len, kv_len, head_dk, head_dv, qk_scale,
                    band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                    q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                    dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                    bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                    BLOCK_M, False, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                    HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    dk = dk * sm_scale
    tl.store(dK + b * s_dk_b + h_kv * s_dk_h + offs_n[:, None] * s_dk_t + offs_dk[None, :] * s_dk_d,
             dk.to(dK.dtype.element_ty), mask=(offs_n[:, None] < kv_len) & (offs_dk[None, :] < head_dk))
    tl.store(dV + b * s_dv_b + h_kv * s_dv_h + offs_n[:, None] * s_dv_t + offs_dv[None, :] * s_dv_d,
             dv.to(dV.dtype.element_ty), mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < head_dv))


@triton.jit
def _bwd_q_tile(dq, q, do, lse2, delta, k_base, v_base, start_n, offs_m, offs_dk, offs_dv, b, h,
                s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk, head_dv, qk_scale,
                band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_DK: tl.constexpr,
                EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """One key tile's contribution to ``dq [M, DK]``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * s_k_t + offs_dk[None, :] * s_k_d  # [N, DK]
    v_ptrs = v_base + offs_n[:, None] * s_v_t + offs_dv[None, :] * s_v_d  # [N, DV]
    if MASKED:
        k = tl.load(k_ptrs, mask=(offs_n[:, None] < kv_len) & (offs_dk[None, :] < head_dk), other=0.0)
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < head_dv), other=0.0)
    else:
        if EVEN_DK:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_dk[None, :] < head_dk, other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < head_dv, other=0.0)
    s2 = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [M, N]
    if MASKED:
        s2 = _masked_scores(s2, offs_m[:, None], offs_n[None, :], b, h, q_len, kv_len,
                            band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                            q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                            dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                            bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                            HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    p = tl.math.exp2(s2 - lse2[:, None])  # [M, N]
    dp = _dot(do, tl.trans(v), PRECISION, UPCAST)  # [M, N]
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
    return dq


@triton.jit(do_not_specialize=["TUNE_KEY"])
def attn_bwd_dq(Q, K, V, dOut, Lse, Delta, dQ,
                s_q_b, s_q_h, s_q_t, s_q_d, s_k_b, s_k_h, s_k_t, s_k_d,
                s_v_b, s_v_h, s_v_t, s_v_d, s_do_b, s_do_h, s_do_t, s_do_d,
                s_l_b, s_l_h, s_l_t, s_dq_b, s_dq_h, s_dq_t, s_dq_d,
                heads, group, q_len, kv_len, head_dk, head_dv, qk_scale, sm_scale,
                num_partial, num_full, index, s_n_b, s_n_h, s_n_r, s_i_b, s_i_h, s_i_r,
                band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                TUNE_KEY,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr,
                SPARSE_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                EVEN_DK: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr,
                HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_QLEN: tl.constexpr,
                HAS_KVLEN: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_DENSE: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """dQ: one program per (query block, batch × query head), over the forward block lists.
    Writes ``dQ [B, H, Tq, Dk]``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    h_kv = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_t + offs_dk[None, :] * s_q_d,
                mask=(offs_m[:, None] < q_len) & (offs_dk[None, :] < head_dk), other=0.0)
    do = tl.load(dOut + b * s_do_b + h * s_do_h + offs_m[:, None] * s_do_t + offs_dv[None, :] * s_do_d,
                 mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < head_dv), other=0.0)
    lse2, delta = _row_stats(Lse, Delta, b, h, heads, offs_m, s_l_b, s_l_h, s_l_t, q_len)
    k_base = K + b * s_k_b + h_kv * s_k_h
    v_base = V + b * s_v_b + h_kv * s_v_h
    dq = tl.zeros([BLOCK_M, DK_PAD], dtype=tl.float32)

    row = (pid_m * BLOCK_M) // SPARSE_Q
    counts = b * s_n_b + h * s_n_h + row * s_n_r
    n_partial = tl.load(num_partial + counts)
    n_full = tl.load(num_full + counts)
    blocks = index + b * s_i_b + h * s_i_h + row * s_i_r
    for j in range(0, n_partial):
        block = tl.load(blocks + j)
        for sub in tl.static_range(SPARSE_K // BLOCK_N):
            dq = _bwd_q_tile(
                dq, q, do, lse2, delta, k_base, v_base, block * SPARSE_K + sub * BLOCK_N, offs_m,
                offs_dk, offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk,
                head_dv, qk_scale, band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                BLOCK_N, True, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    for j in range(n_partial, n_partial + n_full):
        block = tl.load(blocks + j)
        for sub in tl.static_range(SPARSE_K // BLOCK_N):
            dq = _bwd_q_tile(
                dq, q, do, lse2, delta, k_base, v_base, block * SPARSE_K + sub * BLOCK_N, offs_m,
                offs_dk, offs_dv, b, h, s_k_t, s_k_d, s_v_t, s_v_d, q_len, kv_len, head_dk,
                head_dv, qk_scale, band_lo, band_hi, q_lens, s_qlen_b, kv_lens, s_kvlen_b,
                q_docs, s_qdoc_b, s_qdoc_t, kv_docs, s_kvdoc_b, s_kvdoc_t,
                dense, s_dense_b, s_dense_h, s_dense_q, s_dense_k,
                bias, s_bias_b, s_bias_h, s_bias_q, s_bias_k,
                BLOCK_N, False, EVEN_DK, EVEN_DV, PRECISION, UPCAST,
                HAS_LO, HAS_HI, HAS_QLEN, HAS_KVLEN, HAS_DOCS, HAS_DENSE, HAS_BIAS)
    dq = dq * sm_scale
    tl.store(dQ + b * s_dq_b + h * s_dq_h + offs_m[:, None] * s_dq_t + offs_dk[None, :] * s_dq_d,
             dq.to(dQ.dtype.element_ty), mask=(offs_m[:, None] < q_len) & (offs_dk[None, :] < head_dk))
