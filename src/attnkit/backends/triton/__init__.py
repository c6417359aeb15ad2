"""``backend="triton"``: fused Triton attention kernels, forward and backward.

The forward walks each query block's list of key blocks (the mask's block map: FULL blocks
without an element mask, PARTIAL ones with it, EMPTY ones never read) with an online softmax
and returns the output and the LSE. The backward recomputes the scores per tile: dK/dV per key
block, and dQ per query block, either recomputing dP too or from the dS tiles dK/dV stored
(``TritonOptions.backward``). A decoding step (a few queries, no gradients) takes a
split-key kernel instead, its key chunks' partial softmaxes merged (``launch.decode``).
Masks are lowered once per mask and shapes to a small program
(``launch.compile_mask``): bands and lengths as arithmetic, documents and per-sequence runs as
row ranges, anything else as a dense element mask.

Layout: ``kernels.py`` (``@triton.jit``: one walk, one tile function per pass), ``launch.py``
(options, mask program, block lists, candidates, launches), ``backend.py`` (the step API
``forward_step``/``backward_step``, which ring attention also calls, the autograd Function
and :class:`TritonBackend`). Importing this package does not import triton.

CPU tensors run through the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported; triton ≥ 3.9), for tests, never picked by ``backend="auto"``. Not supported:
dropout and ``return_weights`` (``reference``/``tiled`` do them), float64, head dims above 256,
a bias that requires grad, a scale ≤ 0.
"""

from .backend import TritonBackend, backward_step, forward_step, score_mods
from .launch import TritonOptions

__all__ = ["TritonBackend", "TritonOptions", "forward_step", "backward_step", "score_mods"]
