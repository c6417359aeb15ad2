"""``backend="triton"``: fused Triton attention kernels, forward and backward.

Status
------
- **Run on a GPU** (NVIDIA H200, torch 2.11, triton 3.6, eighth session, 2026-11-26;
  docs/BENCHMARKS.md): correct at full size for every benchmarked mask (dense, causal,
  sliding window, documents & causal; D 128, N up to 16384) with SDPA's own bf16 error, and
  every mask kind (GQA, ragged, bf16 and fp16) and every autotune candidate checked there.
  Speed at D 128, bf16: forward 1.27–1.61× SDPA-flash and forward+backward 1.33–1.37× (N ≥
  4096; 1.20–1.34× at N 1024 by the kernels); 0.72–0.90× of cuDNN; against compiled
  FlexAttention, documents forward 1.25× and sliding window 1.17–1.19×, forward+backward
  0.98–1.01× (window) and 0.89× (documents; 1.00× by the kernels): our forward kernel beats
  Flex's by 1.20–1.24×, our backward (Δ, dK/dV, dQ) was 1.02–1.08× slower than its one (the
  Δ preprocess has since been folded into dQ, not yet measured). A second backward for
  sparse masks, dQ from dS tiles that dK/dV stores (``launch.BACKWARD``: 5 matmuls a tile
  pair instead of 7, no atomics), is built and tested here, not yet timed: the default
  stays the recomputing one.
  Host time per call: ~100–130 µs per forward, ~0.6–0.75 ms per forward+backward (SDPA:
  19 / ~180 µs): from a launch template's third call the compiled kernels are launched
  directly (25–37 µs per launch there, against 213–260 µs for Triton's ``JITFunction``
  argument binding of ~90 arguments); the mask's block lists and the launch arguments are
  cached per mask and shapes, the autotuner's timings on disk (``launch.AUTOTUNE_CACHE``).
  D 64 was last timed in the second session, before the walks and launch changes; D 256's
  candidates were checked there (causal, documents & causal at N 1024), not timed.
- **Tested in CI** through the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) with
  triton 3.9 and torch 2.13 (CPU build): ``tests/test_triton.py`` checks the forward, LSE and
  backward (dq, dk, dv, and the LSE's own gradient) against float64 math for every mask kind
  (causal both alignments, sliding window, padding with fully masked rows, documents, documents
  & causal, dense bool, bias, bias & causal, from_function, ``|``, ``~``, band & padding),
  through both backwards (recomputing, and stored dS with its buffer NaN-poisoned),
  ragged lengths (37×53), Tq ≠ Tk, GQA 2/1 and 4/2 with per-head masks, Dk ≠ Dv, head dims
  16–80 (non-powers of two padded), fp32/fp16/bf16, NaN-poisoned memory around every input,
  bit-identical re-runs, skipped blocks never read, every walk of the block lists, the layout
  cache (including masks whose tensors change in place), and the kernel-block-inside-sparse-
  block loops the GPU configs use. (The interpreter of triton 3.6 cannot run these kernels: a
  scalar ``tl.load`` there returns a 1-element array, which ``range`` refuses.)
- **Built for sm90, offline**: ``benchmarks/gpu.py --compile-only`` compiles every autotune
  config (head dims 64/128/256) as the JIT would (same specialization, Triton's own ptxas run
  and flags) and reports shared memory, registers and spills: all use wgmma; at D ≤ 128
  only a few dK/dV candidates spill (4–24 bytes). D = 256 (every candidate correct on the
  H200, not timed): every forward candidate used to need more shared
  memory than a block may have (288–292 KiB: none could launch); its candidates are now
  flat walks, which fit (96–192 KiB; spills only in two dK/dV shapes, 52 and 104 bytes,
  and dQ 32×32, 8 bytes).
- **Interpreter quirks**: (1) its ``tl.dot`` multiplies bfloat16 bit patterns
  (triton-lang/triton#11584, "not supported yet" upstream), so under the interpreter bf16 dot
  operands are cast to float32 first (``UPCAST``; products of bf16 values are exact in fp32, as
  on tensor cores); the GPU path never does this. (2) The mode is fixed per process when
  triton is imported (its own ``@jit`` library is decorated then): CPU tensors need
  ``TRITON_INTERPRET=1`` set before ``import triton`` (see ``launch.py``).

Not supported, and why
----------------------
- dropout (would need a counter-based RNG matching attnkit's generator contract) and
  ``return_weights`` (the point of the kernel is never to materialise Tq×Tk): use
  ``backend="reference"``/``"tiled"``.
- float64 (no fp64 ``tl.dot`` on tensor cores), head dims above 256 (shared memory), a bias
  that requires grad (the bias is a constant in the backward).
- CPU tensors unless ``TRITON_INTERPRET=1``; even then ``backend="auto"`` never picks triton on
  CPU (the interpreter is for tests, not speed).

Layout: ``kernels.py`` (``@triton.jit``), ``launch.py`` (mask program, block lists, tiles,
autotune, launches), ``backend.py`` (``_forward``/``_backward``, the autograd Function,
:class:`TritonBackend`). Importing this package does not import triton.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
