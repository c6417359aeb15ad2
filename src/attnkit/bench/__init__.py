"""Benchmarks of attnkit against torch SDPA, FlexAttention and naive attention.

- :mod:`attnkit.bench.workloads`: the problems as data (shapes, mask three ways, FLOPs),
- :mod:`attnkit.bench.runner`: interleaved timing, error check, tables, JSON,
- :mod:`attnkit.bench.memory`: peak memory and time against N, one fresh process each,
- :mod:`attnkit.bench.plots`: PNG figures,
- :mod:`attnkit.bench.hostreads`: counting reads of tensor values on the host (device syncs).

Used by ``attnkit bench`` and ``benchmarks/cpu.py``; nothing here is imported by ``attnkit``.
"""

from .runner import Options, run_benchmark, write_results
from .workloads import Workload, quick_workloads, standard_workloads

__all__ = ["Options", "run_benchmark", "write_results", "Workload", "quick_workloads",
           "standard_workloads"]
