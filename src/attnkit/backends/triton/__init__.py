"""``backend="triton"``: fused Triton attention kernels, forward and backward.

The forward kernel walks each query block's list of key blocks (the mask's block map: FULL
blocks without an element mask, PARTIAL ones with it, EMPTY ones never read) with an online
softmax, and returns the output and the LSE. The backward recomputes the scores per tile:
dK/dV per key block, dQ per query block (``launch.BACKWARD`` selects the variant in which
dK/dV stores dS for dQ instead). Masks are lowered once per mask and shapes to a small
program of tensors and flags (``launch.compile_mask``): bands and lengths as arithmetic,
documents and per-sequence runs as row ranges, anything else as a dense element mask.
Figures (correctness at full size, speed against SDPA and FlexAttention, host time, offline
sm90 builds) are in docs/BENCHMARKS.md with their dates and commands.

Tested on CPU through the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported: the mode is fixed per process; ``tests/test_triton.py``). Interpreter caveat:
its ``tl.dot`` multiplies bfloat16 bit patterns (triton-lang/triton#11584), so under the
interpreter bf16 operands are cast to float32 first (``UPCAST``; exact, as on tensor cores);
the GPU path never does this. The interpreter of triton < 3.9 cannot run these kernels.

Not supported, and why:

- dropout (it would need a counter-based RNG matching attnkit's generator contract) and
  ``return_weights`` (the kernel never materialises Tq×Tk): ``reference``/``tiled`` do them;
- float64 (no fp64 ``tl.dot`` on tensor cores), head dims above 256 (shared memory), a bias
  that requires grad (the bias is a constant in the backward), a scale ≤ 0;
- CPU tensors unless ``TRITON_INTERPRET=1``; even then ``backend="auto"`` never picks triton on
  CPU (the interpreter is for tests, not speed).

Layout: ``kernels.py`` (``@triton.jit``), ``launch.py`` (mask program, block lists, tiles,
autotune, launches), ``backend.py`` (``_forward``/``_backward``, the autograd Function,
:class:`TritonBackend`). Importing this package does not import triton.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
