"""Start local processes joined in a process group, for tests and examples (one machine, CPU).

    from attnkit.distributed import spawn

    def work(rank, world_size, seq_len):        # module-level: it is pickled by reference
        ...                                     # torch.distributed is initialised here
        return result                           # any picklable value

    results = spawn(work, 4, 4096)              # [result of rank 0, ..., result of rank 3]

For real runs across GPUs and nodes launch with ``torchrun`` instead (docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
"""How long any collective or transfer may wait before raising (a dead peer never hangs a run)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _worker(rank: int, fn: Callable, world_size: int, port: int, backend: str,
            timeout: datetime.timedelta, threads: int, result_dir: str, args: tuple,
            env: Mapping[str, str]) -> None:
    os.environ.update(env)
    torch.set_num_threads(threads)
    if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()  # nobody tears the group down while a peer still uses it
    finally:
        dist.destroy_process_group()
    # A file, not a queue: a large result in a pipe would block this process until the parent
    # reads it, while the parent waits for the process to exit.
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout: datetime.timedelta = DEFAULT_TIMEOUT, threads: Optional[int] = None,
          env: Optional[Mapping[str, str]] = None, start_method: Optional[str] = None) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh local processes that share a
    ``torch.distributed`` process group; return their return values, in rank order.

    The group uses ``backend`` (gloo: CPU tensors; ``"nccl"``: rank r uses GPU r, untested
    here) over a free port on 127.0.0.1 only, with ``timeout`` on every collective and
    transfer. ``fn`` must be importable (a module-level function) and its result picklable.
    ``threads``: intra-op threads per process (default: the cores this process may use, shared
    out among the ranks). ``env``: extra environment variables set in each process before it
    starts work. An exception in any rank stops every rank and is raised here
    (``torch.multiprocessing.ProcessRaisedException``, with the rank's traceback).

    ``start_method``: default ``"forkserver"`` where available: one server process imports
    torch and attnkit once and every later rank is forked from it (importing torch costs
    seconds per process); ``"spawn"`` starts each rank from scratch.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive int")
    threads = threads or max(1, _cores() // world_size)
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "forkserver":  # no effect once the server runs (it already has them)
        mp.get_context("forkserver").set_forkserver_preload(["torch", "attnkit.distributed"])
    with tempfile.TemporaryDirectory(prefix="attnkit-spawn-") as result_dir:
        mp.start_processes(_worker, nprocs=world_size, join=True, start_method=start_method,
                           args=(fn, world_size, free_port(), backend, timeout, threads,
                                 result_dir, args, dict(env or {})))
        results = []
        for rank in range(world_size):
            with open(os.path.join(result_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


class PeakMemory:
    """Peak growth of this process's resident memory (bytes) inside a ``with`` block.

        meter = PeakMemory()          # early: before the work whose memory is measured
        with meter:
            work()
        meter.peak                    # bytes

    Resets the kernel's high-water mark (``/proc/self/clear_refs``, Linux) on entry and reads
    ``VmHWM`` on exit: ``peak = VmHWM − VmRSS at entry``. This counts real pages, whoever
    touched them (torch's CPU allocator, gloo, MKL, Python), not an estimate; pages allocated
    but never written (an ``empty`` tensor not yet filled) are not counted, as they hold nothing.

    The C allocator would hide part of it: memory it keeps from earlier frees is reused without
    growing the RSS, and glibc's adaptive threshold serves big blocks from that cache. So (glibc
    only) creating a ``PeakMemory`` makes blocks of ``mmap_threshold`` bytes or more come from
    the OS and go back to it on free (``mallopt(M_MMAP_THRESHOLD)``; for the rest of the
    process: create it before the big allocations of the run, or blocks freed into the heap
    earlier may be reused unseen), and entering returns free memory to the OS (``malloc_trim``).
    """

    M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number

    def __init__(self, mmap_threshold: int = 1 << 16):
        self.peak = 0
        self._libc = None
        try:
            import ctypes
            self._libc = ctypes.CDLL("libc.so.6")
            self._libc.mallopt(self.M_MMAP_THRESHOLD, mmap_threshold)
        except (OSError, AttributeError):  # not glibc: measure what the allocator lets us see
            self._libc = None

    def __enter__(self) -> "PeakMemory":
        if self._libc is not None:
            self._libc.malloc_trim(0)
        self.baseline = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        return self

    def __exit__(self, *exc) -> None:
        self.peak = _status_bytes("VmHWM") - self.baseline


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {key}")
