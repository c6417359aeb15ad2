"""``backend="triton"``: fused Triton attention kernels, forward and backward.

Status (read before trusting it on a GPU)
-----------------------------------------
- **Tested**: only through the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) with
  triton 3.9.0 and torch 2.13.0 (CPU build): ``tests/test_triton.py`` checks the forward, LSE and
  backward (dq, dk, dv, and the LSE's own gradient) against float64 math for every mask kind
  (causal both alignments, sliding window, padding with fully masked rows, documents, documents
  & causal, dense bool, bias, bias & causal, from_function, ``|``, ``~``, band & padding),
  ragged lengths (37×53), Tq ≠ Tk, GQA 2/1 and 4/2 with per-head masks, Dk ≠ Dv, head dims
  16–80 (non-powers of two padded), fp32/fp16/bf16, NaN-poisoned memory around every input,
  bit-identical re-runs, skipped blocks never read, and the kernel-block-inside-sparse-block
  loops the GPU configs use (16-wide kernel blocks in 32-wide sparse blocks).
- **Built for sm90, offline**: ``benchmarks/gpu.py --compile-only`` compiles every autotune
  config (head dims 64/128/256) to a Hopper cubin with the wheel's ptxas and reports shared
  memory, registers and spills. All build and use wgmma. With the report's plain ptxas flags
  every forward config at D ≤ 128 builds without spills; with the flags Triton itself passes
  (``-lineinfo --regAllocOptLevel=2``, not yet used by the report) some spill ~100–180 bytes
  (e.g. forward D=64 128×32). dK/dV at D = 128 spills 160–800 bytes in every config, and
  everything at D = 256 spills (0.7–23 KB): expect D = 256 to be slow.
- **Not yet run on a GPU — none of it.** Nothing compiled has executed: the autotuned configs
  (``launch.CONFIGS``), real fp16/bf16 tensor-core numerics and the speed are unmeasured.
  ``benchmarks/gpu.py`` checks correctness at full size first, then times it against torch
  SDPA (flash, cuDNN), compiled FlexAttention and SDPA with a dense mask.
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
