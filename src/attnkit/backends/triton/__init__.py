"""``backend="triton"``: fused Triton attention kernels, forward and backward.

Status
------
- **Run on a GPU** (NVIDIA H200, torch 2.11, triton 3.6, 2026-11-26; docs/BENCHMARKS.md):
  correct at full size for every benchmarked mask (dense, causal, sliding window, documents &
  causal; D 64 and 128; N up to 16384), with SDPA's own bf16 error. Speed at D 128, bf16:
  forward 1.26–1.33× SDPA-flash for N ≥ 4096 (dense), forward+backward 1.13–1.19× for
  N ≥ 2048; 0.62–0.78× of cuDNN; sliding window 1.03× and documents 0.93× of compiled
  FlexAttention forward (0.87× / 0.67× forward+backward). Each call cost 0.23–0.49 ms of host
  time (Python, ~75 kernel arguments); the mask's block lists are cached per mask and shape.
  The two smallest forward+backward rows (causal N 1024, documents) waited on that host time:
  by the autotuner's per-kernel times, their kernels alone were 1.22× flash and 0.82× Flex.
- **Since that run, not yet measured on a GPU**: (1) once the autotuner has chosen a config for
  a launch template the kernel is launched directly with it (the autotuner's own lookup costs
  ~120 µs per launch with 78 arguments, measured on CPU); (2) documents that are contiguous
  runs are passed as ranges (each query's key range, each key's query range) instead of ids,
  so a tile holds one pair per row rather than an id per column: offline, the D128 128×128
  forward went from 255 registers with a 56-byte spill to 230 and none (causal: 231), the
  suspected cause of the documents kernel's 15 % deficit to causal on equal work;
  (3) new walks as autotune candidates (``launch.WALKS``): ``+flat``, one kernel block per
  loop iteration (offline: flat dK/dV 32×128 needs 96 KiB of shared memory and no spill,
  against 193 KiB and a 4–12-byte spill unrolled), ``one_loop``, one loop over a row's PARTIAL
  and FULL blocks (one software pipeline to fill per row instead of two, for short rows such
  as 1024-token documents), ``+lpt``, a head's heaviest rows launched first, and ``+tma``,
  the walked tiles by TMA copies through descriptors made in the kernel; (4) a program's own document ranges and padding lengths load once, before
  the walk, not in every PARTIAL tile; (5) PARTIAL tiles skip sequence-end checks when the
  lengths are multiples of 128 (``BOUNDS``) and compare the band as ``k ≤ q + hi``; (6) FULL
  forward tiles take the row max before scaling (one multiply per row, the scale inside the
  exponent's FMA). Offline sm90 PTX of the D128 forward, per thread and tile: FULL 599 → 537
  operations, causal PARTIAL 1133 → 859; (7) where a row's FULL (PARTIAL) blocks are evenly
  spaced, the loops compute tile positions instead of loading them in the loop, which made
  Triton 3.6 wait for every outstanding copy at the loop head (``cp.async.wait_group 0``):
  3 stages now keep 2 tiles in flight, with new 3- and 4-stage candidates; (8) from a
  template's third call the compiled kernel is launched directly, skipping Triton's
  argument binding (50–65 µs per launch offline); (9) the autotuner's timings are kept on
  disk (``launch.AUTOTUNE_CACHE``); (10) dK/dV's loop loads each query block's base-2 LSE
  (written by the Δ preprocess) and Δ without a predicate where the block cannot cross the
  sequence end: sm90 SASS of the D128 32×128 flat loop, FULL tiles 395 → 278 instructions;
  (11) PARTIAL tiles compare the band on tile offsets (``_allowed``): causal forward PARTIAL
  tile 956 → 797 instructions; (12) PARTIAL tiles evaluate only the parts of an ``&`` mask
  that can forbid something in a PARTIAL block (``launch.needed_leaves``): aligned documents
  under causal evaluate causal alone; (13) without a bias, PARTIAL tiles mask the raw scores
  and scale after, as FULL tiles do (causal forward PARTIAL tile 797 → 736 instructions).
  Whether each is faster is for the next GPU run to
  say (docs/BENCHMARKS.md has the command): it checks every autotune candidate on the GPU,
  then records every candidate's time per workload (``config_ms`` in the JSON).
- **Tested in CI** through the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) with
  triton 3.9 and torch 2.13 (CPU build): ``tests/test_triton.py`` checks the forward, LSE and
  backward (dq, dk, dv, and the LSE's own gradient) against float64 math for every mask kind
  (causal both alignments, sliding window, padding with fully masked rows, documents, documents
  & causal, dense bool, bias, bias & causal, from_function, ``|``, ``~``, band & padding),
  ragged lengths (37×53), Tq ≠ Tk, GQA 2/1 and 4/2 with per-head masks, Dk ≠ Dv, head dims
  16–80 (non-powers of two padded), fp32/fp16/bf16, NaN-poisoned memory around every input,
  bit-identical re-runs, skipped blocks never read, every walk of the block lists, the layout
  cache (including masks whose tensors change in place), and the kernel-block-inside-sparse-
  block loops the GPU configs use. (The interpreter of triton 3.6 cannot run these kernels: a
  scalar ``tl.load`` there returns a 1-element array, which ``range`` refuses.)
- **Built for sm90, offline**: ``benchmarks/gpu.py --compile-only`` compiles every autotune
  config (head dims 64/128/256) as the JIT would (same specialization, Triton's own ptxas run
  and flags) and reports shared memory, registers and spills: all use wgmma; at D ≤ 128
  only a few dK/dV candidates spill (4–24 bytes). D = 256 (untested on a GPU; the next
  run's ``--check-configs`` covers it): every forward candidate used to need more shared
  memory than a block may have (288–292 KiB: none could launch); its candidates are now
  flat walks, which fit (96–192 KiB; spills only in two dK/dV shapes, 52 and 104 bytes,
  and dQ 32×32, 4 bytes).
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
