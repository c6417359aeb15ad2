"""``backend="triton"`` compiled on a CUDA device, at full size, against float64 math there.

What the interpreter tests (``tests/test_triton.py``) cannot show: the compiled kernels, every
autotune candidate, TMA walks, direct launches and sequences of thousands of positions.

- every mask kind (causal top-left and bottom-right, window, documents & causal, padding with
  empty rows, dense, bias, no mask, GQA, ragged lengths; bf16, and fp16 for some), forward
  and backward through both backwards, each kernel at its first candidate (autotuning would
  compile every candidate for every kind);
- every candidate of every kernel at D = 128 (``TritonOptions(candidate=i)``), on a causal
  and a documents mask, through both backwards;
- direct launches: the autotuned, ``JITFunction`` and direct launches of one call, and the
  same with ``direct_launch=False``, give bit-identical results;
- poisoned memory: inputs and the output gradient as views inside NaN-filled buffers (ragged
  lengths, a head dim that is not a power of two);
- packed sequences (``varlen_attention``) and the paged cache on the device.

Before every call the caching allocator's free blocks are filled with NaN, so an output
element the kernels never write shows up.

The rule: ‖x − truth‖/‖truth‖ ≤ 2 × that of the same math in the inputs' dtype + 2e-3, for
out, LSE, dq, dk, dv; LSE −inf and out exactly 0 on fully masked rows. Every test is marked
``gpu`` and the module skips without CUDA. Without pytest::

    PYTHONPATH=src python3 tests/test_gpu.py   # runs every test, prints pass/fail
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

try:
    import pytest
except ImportError:  # the runner at the bottom needs no pytest
    pytest = None

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import attnkit as ak  # noqa: E402


def device_problem() -> Optional[str]:
    """Why these tests cannot run in this process (``None`` when they can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device (the compiled kernels at full size)"
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from attnkit.backends.triton import launch
    if launch.interpreting():
        return "triton runs through the interpreter in this process (TRITON_INTERPRET is set)"
    return None


if pytest is not None and __name__ != "__main__" and device_problem():
    pytest.skip(device_problem(), allow_module_level=True)

gpu: Callable = pytest.mark.gpu if pytest is not None else (lambda test: test)

DEVICE = torch.device("cuda")
BATCH, HEADS, N, D = 2, 4, 2048, 128  # the mask kinds' shape
RAGGED = (1000, 1537)  # Tq, Tk: neither a multiple of the sparse blocks
BACKWARDS = ("recompute", "stored_ds")
FLOOR = 2e-3
NAMES = ("out", "lse", "dq", "dk", "dv")


# ---- the truth -----------------------------------------------------------------------------------
def attention_math(q, k, v, dout, allowed, bias, scale: float, dtype: torch.dtype,
                   cap: Optional[float] = None) -> list[torch.Tensor]:
    """softmax(q kᵀ·scale + bias, masked) v and its gradients computed in ``dtype``, one
    (batch, head) at a time; with ``cap``, the scaled scores soft-capped (``cap·tanh(s/cap)``)
    before the bias. q ``[B, H, Tq, Dk]``, k ``[B, Hkv, Tk, Dk]``, v ``[B, Hkv, Tk, Dv]``,
    dout ``[B, H, Tq, Dv]``; ``allowed`` (bool) and ``bias`` broadcastable to ``[B, H, Tq, Tk]``
    or ``None``. Returns out, lse ``[B, H, Tq]``, dq, dk, dv; a fully masked row has out 0,
    LSE −inf and zero gradients."""
    batch, heads, tq, _ = q.shape
    group, full = heads // k.shape[1], (batch, heads, tq, k.shape[2])
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=dtype, device=q.device)
    dq, dk, dv = (torch.zeros(t.shape, dtype=dtype, device=q.device) for t in (q, k, v))
    for b in range(batch):
        for h in range(heads):
            g = h // group
            qh, kh, vh, doh = (t.to(dtype) for t in (q[b, h], k[b, g], v[b, g], dout[b, h]))
            s = (qh @ kh.T) * scale
            capped = None
            if cap is not None:
                capped = torch.tanh(s / cap)
                s = cap * capped
            if bias is not None:
                s = s + bias.expand(full)[b, h].to(dtype)
            if allowed is not None:
                s = s.masked_fill(~allowed.expand(full)[b, h], -math.inf)
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - torch.where(torch.isneginf(m), 0, m))  # 0 on a fully masked row
            total = p.sum(-1, keepdim=True)
            p = p / total.clamp_min(torch.finfo(dtype).tiny)
            lse[b, h] = (m + total.log())[:, 0]
            out[b, h] = p @ vh
            ds = p * (doh @ vh.T - (doh * out[b, h]).sum(-1, keepdim=True))
            if capped is not None:
                ds = ds * (1 - capped * capped)
            dq[b, h] = (ds @ kh) * scale
            dk[b, g] += (ds.T @ qh) * scale
            dv[b, g] += p.T @ doh
    return [out, lse, dq, dk, dv]


def relative_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """‖x − truth‖/‖truth‖ over truth's finite entries; infinite where x is not finite there
    or differs from truth's −inf anywhere."""
    x, truth = x.detach().double(), truth.detach().double()
    if not torch.equal(torch.isneginf(x), torch.isneginf(truth)):
        return math.inf
    finite = torch.isfinite(truth)
    x, truth = x[finite], truth[finite]
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - truth).norm() / truth.norm().clamp_min(1e-30))


def make_inputs(batch: int, heads: int, heads_kv: int, tq: int, tk: int, d: int, dtype, seed: int):
    """q ``[B, H, Tq, D]``, k and v ``[B, Hkv, Tk, D]``, dout ``[B, H, Tq, D]`` in ``dtype``."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shapes = ((batch, heads, tq, d), (batch, heads_kv, tk, d), (batch, heads_kv, tk, d),
              (batch, heads, tq, d))
    return [torch.randn(shape, generator=gen, device=DEVICE, dtype=dtype) for shape in shapes]


class Case:
    """Inputs, a mask and its independent dense form, with the float64 truth and the same math
    in the inputs' dtype (the yardstick), computed once for every run compared with them."""

    def __init__(self, label: str, inputs: list[torch.Tensor], mask, allowed=None, bias=None,
                 cap: Optional[float] = None):
        self.label, self.inputs, self.mask = label, inputs, mask
        scale = 1 / math.sqrt(inputs[0].shape[-1])
        self.truth = attention_math(*inputs, allowed, bias, scale, torch.float64, cap)
        self.plain = attention_math(*inputs, allowed, bias, scale, inputs[0].dtype, cap)

    def problems(self, got: list[torch.Tensor], how: str) -> list[str]:
        """What is wrong with ``got`` (out, lse, dq, dk, dv), one line each."""
        found = []
        for name, x, truth, plain in zip(NAMES, got, self.truth, self.plain):
            err, allowed = relative_error(x, truth), 2 * relative_error(plain, truth) + FLOOR
            if not err <= allowed:
                found.append(f"{self.label} {how}: {name} error {err:.2e} > allowed {allowed:.2e}")
        empty = torch.isneginf(self.truth[1])
        if (got[0][empty] != 0).any():
            found.append(f"{self.label} {how}: fully masked rows are not exactly 0")
        return found


def run(options, q, k, v, dout, mask) -> list[torch.Tensor]:
    """``TritonBackend(options)`` forward and backward: out, lse, dq, dk, dv. Views stay views;
    the caching allocator's free blocks hold NaN first, so an output never written shows."""
    from attnkit.backends.triton import TritonBackend
    from attnkit.inputs import validate

    poison = torch.full((1 << 28,), math.nan, device=q.device)
    del poison
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    result = TritonBackend(options).forward(validate(*leaves, mask))
    return [result.out.detach(), result.lse.detach(), *torch.autograd.grad(result.out, leaves, dout)]


def options(**kwargs):
    """``launch.TritonOptions(**kwargs)`` (triton's backend imported on first use)."""
    from attnkit.backends.triton import launch
    return launch.TritonOptions(**kwargs)


def sorted_ids(length: int, docs: int, gen: torch.Generator) -> torch.Tensor:
    """Document ids ``[length]`` (int64, on the device), sorted: packed sequences."""
    return torch.randint(0, docs, (length,), generator=gen).sort().values.to(DEVICE)


def positions(tq: int, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions ``[Tq, 1]`` and key positions ``[1, Tk]``, for dense masks."""
    return torch.arange(tq, device=DEVICE)[:, None], torch.arange(tk, device=DEVICE)[None, :]


def mask_cases(dtype: torch.dtype, only: Optional[tuple] = None) -> list[Case]:
    """Every mask kind on ``[BATCH, HEADS, N, D]`` inputs (GQA and ragged: their own shapes)."""
    gen = torch.Generator().manual_seed(0)
    i, j = positions(N, N)
    ids = sorted_ids(N, 6, gen)
    dense = (torch.rand(N, N, generator=gen) < 0.6).to(DEVICE)
    bias = torch.randn(N, N, generator=gen).to(DEVICE)
    q_len = torch.tensor([N, N - N // 6], device=DEVICE)
    kv_len = torch.tensor([N - N // 4, 0], device=DEVICE)
    window = N // 7  # not a multiple of the blocks
    cases = {
        "causal": lambda x: Case("causal", x, ak.causal(), i >= j),
        "window": lambda x: Case(f"window{window}", x, ak.sliding_window(window),
                                 (j <= i) & (j >= i - window)),
        "documents&causal": lambda x: Case("documents&causal", x, ak.documents(ids) & ak.causal(),
                                           (ids[:, None] == ids[None, :]) & (i >= j)),
        "padding": lambda x: Case("padding (empty rows)", x,
                                  ak.padding(q_len.tolist(), kv_len.tolist()),
                                  ((i < q_len[:, None, None]) & (j < kv_len[:, None, None]))[:, None]),
        "dense": lambda x: Case("dense", x, ak.dense(dense), dense),
        "bias&causal": lambda x: Case("bias&causal", x, ak.bias(bias) & ak.causal(), i >= j, bias),
        "none": lambda x: Case("no mask", x, None),
        "gqa": lambda x: Case("causal GQA 4/2", x, ak.causal(), i >= j),
    }
    found = []
    for name, make in cases.items():
        if only is None or name in only:
            heads_kv = HEADS // 2 if name == "gqa" else HEADS
            found.append(make(make_inputs(BATCH, HEADS, heads_kv, N, N, D, dtype, len(found))))
    if only is None:  # ragged: Tq ≠ Tk, neither a multiple of the blocks
        tq, tk = RAGGED
        qi, kj = positions(tq, tk)
        q_ids, kv_ids = sorted_ids(tq, 5, gen), sorted_ids(tk, 5, gen)
        found.append(Case("ragged causal bottom-right",
                          make_inputs(BATCH, HEADS, HEADS, tq, tk, D, dtype, 8),
                          ak.causal("bottom_right"), kj <= qi + (tk - tq)))
        found.append(Case("ragged documents", make_inputs(BATCH, HEADS, HEADS, tq, tk, D, dtype, 9),
                          ak.documents(q_ids, kv_ids), q_ids[:, None] == kv_ids[None, :]))
    return found


def run_cases(cases: list[Case], choices: list[tuple[str, object]]) -> None:
    """Each case under each ``(how, TritonOptions)``; one assertion listing every problem."""
    found = []
    for case in cases:
        for how, chosen in choices:
            try:
                found += case.problems(run(chosen, *case.inputs, case.mask), how)
            except Exception as error:  # noqa: BLE001 - a failure of this case, listed with the rest
                first = (str(error).splitlines() or [""])[0][:200]
                found.append(f"{case.label} {how}: {type(error).__name__}: {first}")
    assert not found, "\n".join(found)


# ---- the tests ----------------------------------------------------------------------------------------
@gpu
def test_mask_kinds_bf16():
    """Every mask kind in bf16, through both backwards, at each kernel's first candidate."""
    run_cases(mask_cases(torch.bfloat16), [(b, options(backward=b, candidate=0)) for b in BACKWARDS])


@gpu
def test_mask_kinds_fp16():
    """Some mask kinds in fp16 (the kernels' other half-precision dtype), both backwards."""
    run_cases(mask_cases(torch.float16, ("causal", "documents&causal", "bias&causal")),
              [(b, options(backward=b, candidate=0)) for b in BACKWARDS])


@gpu
def test_every_candidate():
    """Candidate i of every kernel's list (the last where a list is shorter) for every i, at
    D = 128 on a causal and a documents mask, through both backwards."""
    from attnkit.backends.triton import launch

    bucket = launch.head_bucket(D)
    count = max(len(buckets[bucket]) for buckets in launch.CONFIGS.values())
    i, j = positions(N, N)
    ids = sorted_ids(N, 7, torch.Generator().manual_seed(1))
    cases = [Case("causal", make_inputs(1, 2, 2, N, N, D, torch.bfloat16, 10), ak.causal(), i >= j),
             Case("documents", make_inputs(1, 2, 2, N, N, D, torch.bfloat16, 11), ak.documents(ids),
                  ids[:, None] == ids[None, :])]
    run_cases(cases, [(f"candidate {c} {b}", options(backward=b, candidate=c, autotune_cache=False))
                      for c in range(count) for b in BACKWARDS])


@gpu
def test_direct_launches_match_jit():
    """One call three times with the default options (the autotuner's launches, then
    ``JITFunction``'s, then the binaries called directly), once more on copies of the inputs
    (other pointers swapped in), and the same four with ``direct_launch=False``: all bit for
    bit the same. Causal runs the recomputing backward by default, documents the stored-dS one."""
    from attnkit.backends.triton import launch
    from attnkit.inputs import validate

    ids = torch.arange(N, device=DEVICE) // (N // 7)  # documents spanning a few blocks each
    for label, mask in (("causal", ak.causal()), ("documents&causal", ak.documents(ids) & ak.causal())):
        q, k, v, dout = make_inputs(BATCH, HEADS, HEADS, N, N, D, torch.bfloat16, 20)
        results = []
        for chosen in (options(), options(direct_launch=False)):
            results += [run(chosen, q, k, v, dout, mask) for _ in range(3)]
            results.append(run(chosen, *(t.clone() for t in (q, k, v, dout)), mask))
        plan = launch.make_plan(validate(q, k, v, mask), options())
        assert launch.stores_ds(q, plan) == (label != "causal"), f"{label}: another backward ran"
        assert any(call.shared.get("direct") for call in plan.layout.calls.values()), \
            f"{label}: no launch went direct"
        for index, result in enumerate(results[1:], 1):
            for name, x, first in zip(NAMES, result, results[0]):
                assert torch.equal(x, first), f"{label}: run {index} {name} differs from run 0"


@gpu
def test_poisoned_memory():
    """q, k, v and dout as views inside NaN-filled buffers (rows after Tq/Tk and head-dim
    columns after D = 96 are NaN; one base pointer is not 16-byte aligned): every result is
    finite and right. Each kernel's first and last candidate (an index past every list), both
    backwards."""
    tq, tk = RAGGED
    d = 96
    i, j = positions(tq, tk)
    gen = torch.Generator().manual_seed(3)
    q_ids, kv_ids = sorted_ids(tq, 4, gen), sorted_ids(tk, 4, gen)
    clean = make_inputs(BATCH, HEADS, HEADS, tq, tk, d, torch.bfloat16, 30)
    views = []
    for index, t in enumerate(clean):
        buffer = torch.full((*t.shape[:2], t.shape[2] + 67, d + 40), math.nan, dtype=t.dtype,
                            device=DEVICE)
        start = 3 if index == 1 else 8  # k's base pointer not 16-byte aligned
        views.append(buffer[:, :, 5:5 + t.shape[2], start:start + d])
        views[-1].copy_(t)
    cases = [Case("causal bottom-right", views, ak.causal("bottom_right"), j <= i + (tk - tq)),
             Case("documents&causal", views, ak.documents(q_ids, kv_ids) & ak.causal("bottom_right"),
                  (q_ids[:, None] == kv_ids[None, :]) & (j <= i + (tk - tq)))]
    run_cases(cases, [(f"candidate {c} {b}", options(backward=b, candidate=c))
                      for c in (0, 1 << 10) for b in BACKWARDS])


@gpu
def test_ring_steps():
    """Ring attention's steps on the compiled kernels, in one process: the sequence cut into 8
    chunks (zigzag over 4 ranks), every (query chunk × key chunk) pair on the mask's window,
    merged by LSE; the backward of each pair with the whole rows' out and LSE, summed. Equal to
    the whole sequence's truth (the transfers themselves are tested on CPU with gloo)."""
    from attnkit.distributed.ring import Piece, pair_step
    from attnkit.inputs import validate
    from attnkit.numerics import merge

    found, chunks = [], 8
    for case in mask_cases(torch.bfloat16, only=("causal", "window", "documents&causal", "padding",
                                                 "dense", "bias&causal")):
        q, k, v, dout = case.inputs
        whole = validate(q, k, v, case.mask)
        size = N // chunks
        parts = [Piece(0, c * size, size) for c in range(chunks)]
        steps = {(a, b): pair_step("triton", whole.mask, whole.space, whole.scale, parts[a], parts[b])
                 for a in range(chunks) for b in range(chunks)}
        out = torch.zeros(*q.shape[:3], v.shape[-1], device=DEVICE)
        lse = torch.full(q.shape[:3], -math.inf, device=DEVICE)
        rows = [slice(p.global_start, p.global_start + p.count) for p in parts]
        for (a, b), (step, tiles) in steps.items():
            if tiles:
                part = step.forward(q[:, :, rows[a]], k[:, :, rows[b]], v[:, :, rows[b]])
                out[:, :, rows[a]], lse[:, :, rows[a]] = merge(out[:, :, rows[a]], lse[:, :, rows[a]], *part)
        out = out.to(q.dtype)
        grads = [torch.zeros(t.shape, device=DEVICE) for t in (q, k, v)]
        for (a, b), (step, tiles) in steps.items():
            if tiles:
                dq, dk, dv = step.backward(q[:, :, rows[a]], k[:, :, rows[b]], v[:, :, rows[b]],
                                           out[:, :, rows[a]], lse[:, :, rows[a]],
                                           dout[:, :, rows[a]], None)
                grads[0][:, :, rows[a]] += dq
                grads[1][:, :, rows[b]] += dk
                grads[2][:, :, rows[b]] += dv
        found += case.problems([out, lse, *grads], "ring steps")
    assert not found, "\n".join(found)


@gpu
def test_score_modifiers():
    """Softcap, ALiBi (bottom-right, GQA, Tq ≠ Tk) and a T5 relative bias in the compiled
    kernels, bf16, with causal and documents masks: out, LSE, dq, dk, dv against float64 math
    with the same modifiers written out (the biases as dense ``[H, Tq, Tk]`` tensors)."""
    gen = torch.Generator().manual_seed(5)
    slopes = (torch.rand(HEADS, generator=gen) * 0.1).to(DEVICE)
    table = torch.randn(HEADS, 32, generator=gen).to(DEVICE)
    tq, tk = RAGGED
    found = []
    for label, (lq, lk), cap, use_alibi, use_table in (
            ("softcap&causal", (N, N), 20.0, False, False),
            ("alibi bottom-right GQA", (tq, tk), None, True, False),
            ("relative&documents", (N, N), None, False, True),
            ("softcap&alibi&relative&causal", (N, N), 20.0, True, True)):
        i, j = positions(lq, lk)
        heads_kv = HEADS // 2 if "GQA" in label else HEADS
        shift = lk - lq if "bottom-right" in label else 0
        mask = ak.causal("bottom_right") if "bottom-right" in label else ak.causal()
        allowed = j <= i + shift
        if label.startswith("relative"):
            ids = sorted_ids(N, 6, gen)
            mask, allowed = ak.documents(ids), ids[:, None] == ids[None, :]
        bias = torch.zeros(HEADS, lq, lk, device=DEVICE)
        if use_alibi:
            mask = mask & ak.alibi(slopes, align="bottom_right" if shift else "top_left")
            bias = bias + slopes[:, None, None] * (j - i - shift)
        if use_table:
            mask = mask & ak.relative_bias(table)
            bias = bias + table[:, ak.t5_buckets(j - i, 32)]
        if cap is not None:
            mask = mask & ak.softcap(cap)
        inputs = make_inputs(BATCH, HEADS, heads_kv, lq, lk, D, torch.bfloat16, lq)
        case = Case(label, inputs, mask, allowed, bias[None], cap)
        try:
            found += case.problems(run(options(candidate=0), *inputs, mask), "candidate 0")
        except Exception as error:  # noqa: BLE001 - listed with the rest
            found.append(f"{label}: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
    assert not found, "\n".join(found)


# ---- without pytest -------------------------------------------------------------------------------------
@gpu
def test_decoding_steps():
    """The split-key decoding kernel (few queries against a long cache, no gradients; what
    ``auto`` runs for a decoding step on CUDA): Tq 1 and 8, GQA 8:1, bf16, bottom-right causal
    and per-batch key lengths (one 0: output 0, LSE −inf), every chunk count, against float64."""
    import attnkit as ak
    from attnkit.backends.triton import TritonBackend, TritonOptions
    from attnkit.inputs import validate

    found = []
    for batch, q_len, kv_len in ((2, 1, 20000), (1, 8, 32768), (4, 8, 4000)):
        q, k, v, dout = make_inputs(batch, 32, 4, q_len, kv_len, 128, torch.bfloat16, seed=kv_len)
        lengths = torch.tensor([kv_len - 17 * b for b in range(batch)], device=DEVICE)
        if batch > 1:
            lengths[-1] = 0  # a sequence with no keys yet
        mask = ak.causal("bottom_right") & ak.padding(kv_lengths=lengths)
        kv = torch.arange(kv_len, device=DEVICE)
        allowed = ((kv[None, :] <= kv_len - q_len + torch.arange(q_len, device=DEVICE)[:, None])[None, None]
                   & (kv[None, None, None, :] < lengths[:, None, None, None]))
        case = Case(f"decode B{batch} Tq{q_len} Tk{kv_len}", [q, k, v, dout], mask, allowed)
        for splits in (None, 1, 7):
            got = TritonBackend(TritonOptions(decode_splits=splits)).forward(validate(q, k, v, mask))
            found += case.problems([got.out, got.lse], f"splits={splits}")
    assert not found, "\n".join(found)


@gpu
def test_dropout_with_a_cpu_generator_on_the_device():
    """A CPU generator with CUDA inputs (accepted by validation for every backend): the
    reference draws on the generator's device, so the pattern and the result are the CPU's."""
    import attnkit as ak

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    results = [ak.attention(*(t.to(device) for t in (q, k, v)), ak.causal(), dropout_p=0.3,
                            generator=torch.Generator().manual_seed(5), backend="reference")
               for device in ("cpu", DEVICE)]
    torch.testing.assert_close(results[1].cpu(), results[0])


@gpu
def test_steps_make_no_device_sync():
    """A ragged decode step (``MultiHeadAttention`` over a ``KVCache(lengths=)``, every layer)
    and a padded prefill with a mask built before: no host read, so no device sync, under
    ``torch.cuda.set_sync_debug_mode("error")`` (after one warm-up call each)."""
    import attnkit as ak
    from attnkit.nn import KVCache, MultiHeadAttention

    torch.manual_seed(0)
    layers = [MultiHeadAttention(512, 8, num_kv_heads=2, device=DEVICE, dtype=torch.bfloat16)
              for _ in range(2)]
    lengths = torch.tensor([3, 40, 17, 64], device=DEVICE)
    caches = [KVCache.empty(256) for _ in layers]
    with torch.no_grad():
        x = torch.randn(4, 64, 512, device=DEVICE, dtype=torch.bfloat16)
        for i, layer in enumerate(layers):
            x, _, caches[i] = layer(x, cache=caches[i], is_causal=True, lengths=lengths)

        def step():
            h = torch.randn(4, 1, 512, device=DEVICE, dtype=torch.bfloat16)
            for i, layer in enumerate(layers):
                h, _, caches[i] = layer(h, cache=caches[i], is_causal=True)
        q, k, v, _ = make_inputs(4, 8, 2, 512, 512, 128, torch.bfloat16, seed=3)
        mask = ak.causal() & ak.padding(kv_lengths=torch.tensor([512, 100, 0, 333], device=DEVICE))
        prefill = lambda: ak.attention(q, k, v, mask)  # noqa: E731
        for run in (step, prefill):
            run()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")


@gpu
def test_a_decode_step_replays_in_a_cuda_graph():
    """One attention call of a decode step (GQA, per-sequence key lengths) captured in a CUDA
    graph and replayed after the lengths were written in place equals the eager call with the
    new lengths."""
    import attnkit as ak

    q, k, v, _ = make_inputs(4, 8, 2, 1, 4096, 128, torch.bfloat16, seed=5)
    lengths = torch.tensor([4096, 1000, 1, 2500], device=DEVICE)
    mask = ak.causal("bottom_right") & ak.padding(kv_lengths=lengths)
    ak.attention(q, k, v, mask)  # plan and compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ak.attention(q, k, v, mask)
    lengths.copy_(torch.tensor([7, 4096, 3000, 12], device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    fresh = ak.attention(q, k, v, ak.causal("bottom_right") & ak.padding(kv_lengths=lengths.clone()))
    torch.testing.assert_close(out, fresh)


@gpu
def test_a_plan_runs_without_sync_and_replays_in_a_cuda_graph():
    """A plan (``attnkit.plan``) of a left-padded decode step: its run makes no device sync,
    and captured in a CUDA graph and replayed after new q, k, v were written into its
    inputs it equals ``attention`` on them."""
    import attnkit as ak

    q, k, v, _ = make_inputs(4, 8, 2, 1, 2048, 128, torch.bfloat16, seed=6)
    mask = ak.padding(kv_starts=torch.tensor([0, 700, 2047, 31], device=DEVICE))
    plan = ak.plan(q, k, v, mask)
    plan(q, k, v)  # derives what the plan keeps from the mask, outside the checked calls
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan(q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan(q, k, v)
    fresh = make_inputs(4, 8, 2, 1, 2048, 128, torch.bfloat16, seed=7)[:3]
    for buffer, value in zip((q, k, v), fresh):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ak.attention(*fresh, mask))


@gpu
def test_garbage_in_padding_and_unwritten_slots_is_never_read():
    """NaN past each sequence's keys (padding, unwritten cache slots) gives exactly the result
    of zeros there, on the triton kernels, forward and, for the prefill, backward."""
    import attnkit as ak

    for q_len in (1, 300):
        q, k, v, dout = make_inputs(3, 8, 2, q_len, 1500, 64, torch.bfloat16, seed=q_len)
        lengths = torch.tensor([1500, 700, 1], device=DEVICE)
        outside = (torch.arange(1500, device=DEVICE) >= lengths[:, None])[:, None, :, None]
        mask = ak.causal("bottom_right") & ak.padding(kv_lengths=lengths)
        results = []
        for fill in (0.0, float("nan")):
            leaves = [t.detach().clone().requires_grad_(q_len > 1) for t in (q, k, v)]
            with torch.no_grad():
                leaves[1].masked_fill_(outside, fill)
                leaves[2].masked_fill_(outside, fill)
            out = ak.attention(*leaves, mask, backend="triton")
            grads = torch.autograd.grad(out, leaves, dout) if q_len > 1 else ()
            results.append((out, *(g.masked_fill(outside, 0) if i else g
                                   for i, g in enumerate(grads))))
        for clean, garbage in zip(*results):
            assert torch.equal(clean, garbage)


@gpu
def test_varlen_packed_sequences():
    """``varlen_attention`` on the triton kernels at full size (16 documents of 64..1,024
    tokens, bf16, GQA 8:2, causal and a bottom-right window on decode-shaped segments):
    each document against its own float64 math, forward and backward."""
    import attnkit as ak

    lengths = torch.linspace(64, 1024, 16).long().tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    total = cu[-1].item()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (torch.randn(total, h, 64, device=DEVICE, generator=gen).bfloat16()
               for h in (8, 2, 2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ak.varlen_attention(*leaves, cu, mask=ak.causal(), backend="triton")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    problems = []
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = [t[a:e].transpose(0, 1)[None] for t in (q, k, v, dout)]
        causal = torch.ones(e - a, e - a, dtype=torch.bool, device=DEVICE).tril()
        truth = attention_math(*alone, causal, None, 1 / math.sqrt(64), torch.float64)
        plain = attention_math(*alone, causal, None, 1 / math.sqrt(64), torch.bfloat16)
        mine = [out[a:e].transpose(0, 1)[None], None,
                *(g[a:e].transpose(0, 1)[None] for g in grads)]
        for name, x, t, p in zip(("out", "lse", "dq", "dk", "dv"), mine, truth, plain):
            if x is not None and relative_error(x, t) > 2 * relative_error(p, t) + 2e-3:
                problems.append(f"document {b} {name}: {relative_error(x, t):.2e}")
    assert not problems, "; ".join(problems)
    decode_q = torch.randn(16, 8, 64, device=DEVICE, generator=gen).bfloat16()
    window = ak.sliding_window(100, align="bottom_right")
    got = ak.varlen_attention(decode_q, k, v, torch.arange(17, device=DEVICE), cu, mask=window,
                              backend="triton")
    want = ak.varlen_attention(decode_q.float(), k.float(), v.float(),
                               torch.arange(17, device=DEVICE), cu, mask=window,
                               backend="reference")
    assert relative_error(got.float(), want) < 2e-2


@gpu
def test_paged_cache_on_the_device():
    """``PagedKVCache`` on CUDA: a ragged prefill, forks and decode steps through
    ``MultiHeadAttention`` equal the contiguous cache's, and ``paged_attention`` over pools
    filled elsewhere equals the gathered call."""
    import attnkit as ak
    from attnkit.nn import KVCache, MultiHeadAttention, PagedKVCache

    torch.manual_seed(0)
    mha = MultiHeadAttention(256, 8, num_kv_heads=2, device=DEVICE).eval()
    lengths = torch.tensor([3, 40, 17, 64], device=DEVICE)
    prompt = torch.randn(4, 64, 256, device=DEVICE)
    with torch.no_grad():
        a = mha(prompt, cache=KVCache.empty(), is_causal=True, lengths=lengths)
        p = mha(prompt, cache=PagedKVCache(64, 16), is_causal=True, lengths=lengths)
        contiguous, paged = a.cache, p.cache
        for _ in range(20):
            x = torch.randn(4, 1, 256, device=DEVICE)
            a, p = mha(x, cache=contiguous, is_causal=True), mha(x, cache=paged, is_causal=True)
            assert relative_error(p.out, a.out) < 1e-5
            contiguous = a.cache
        paged.fork(1)
        new = torch.randn(5, 2, 1, 32, device=DEVICE)
        paged.append(new, new)
        q = torch.randn(5, 8, 1, 32, device=DEVICE)
        got = paged.attend(q)
        want = ak.attention(q, paged.keys, paged.values, paged.mask(), backend="reference")
        assert relative_error(got, want) < 1e-5


FIRST = ("test_steps_make_no_device_sync", "test_a_decode_step_replays_in_a_cuda_graph",
         "test_a_plan_runs_without_sync_and_replays_in_a_cuda_graph",
         "test_garbage_in_padding_and_unwritten_slots_is_never_read",
         "test_varlen_packed_sequences", "test_paged_cache_on_the_device")
"""Run first by :func:`main`: the checks no GPU run has made yet (a cut-off run reports them)."""


def main() -> int:
    """Run every test of this module, :data:`FIRST` first; print each one's outcome and time."""
    problem = device_problem()
    if problem:
        print(f"tests/test_gpu.py skipped: {problem}")
        return 0
    tests = sorted(((name, test) for name, test in globals().items()
                    if name.startswith("test_") and callable(test)),
                   key=lambda item: item[0] not in FIRST)  # stable: the rest in file order
    failed = []
    for name, test in tests:
        start = time.perf_counter()
        try:
            test()
            print(f"pass {name} ({time.perf_counter() - start:.0f} s)", flush=True)
        except Exception:  # noqa: BLE001 - reported, counted
            failed.append(name)
            print(f"FAIL {name} ({time.perf_counter() - start:.0f} s)", flush=True)
            traceback.print_exc()
    print(f"{len(tests) - len(failed)} passed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
