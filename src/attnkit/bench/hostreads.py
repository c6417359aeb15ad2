"""Count host reads: the places where a computation reads tensor *values* on the host.

On CUDA each such read is a device synchronisation (the host waits for the queue to drain),
and a call that makes one cannot be captured in a CUDA graph. Counting them on CPU is the
proxy: the same Python code runs, only the sync is free. Counted:

- ATen ops that hand a value to Python or size their output by values:
  ``_local_scalar_dense`` (``item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``if t:``),
  ``nonzero``, indexing with a bool mask (``t[mask]``, ``t[mask] = x``), ``equal``,
  ``masked_select``, ``unique`` and friends, ``repeat_interleave`` with tensor repeats;
- ``Tensor.tolist()`` and ``Tensor.numpy()``, which read memory without an ATen op.

Usage::

    with HostReads() as reads:
        attnkit.attention(q, k, v, mask)
    reads.count, reads.by_kind        # 3, Counter({'item': 2, 'nonzero': 1})
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_OPS = {
    "_local_scalar_dense": "item",
    "nonzero": "nonzero",
    "argwhere": "nonzero",
    "equal": "equal",
    "masked_select": "masked_select",
    "_unique": "unique",
    "_unique2": "unique",
    "unique_dim": "unique",
    "unique_consecutive": "unique",
}
"""ATen ops (by name) that read values on the host, and the kind each is counted as."""


_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
"""ATen ops that read values on the host when an index is a bool mask (``t[mask]``)."""


def _kind(func, args: tuple, kwargs: dict) -> Optional[str]:
    """The kind of host read ``func`` makes with these arguments, or ``None``.
    ``repeat_interleave`` reads its repeats only when they are a tensor and no
    ``output_size`` is given; indexing only with a bool mask among its indices."""
    name = func._schema.name.split("::")[-1]
    if name in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [i for i in indices if isinstance(i, torch.Tensor)
                 and i.dtype in (torch.bool, torch.uint8)]
        return "bool_index" if masks else None
    if name == "repeat_interleave":
        tensor_repeats = func._overloadname in ("Tensor", "self_Tensor")
        return name if tensor_repeats and kwargs.get("output_size") is None else None
    return _VALUE_OPS.get(name)


class _Dispatch(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            self.record(kind)
        return func(*args, **kwargs)


class HostReads:
    """A context manager counting host reads (see the module docstring): :attr:`count` in all
    and :attr:`by_kind` (a ``Counter`` by kind). Not re-entrant; one thread."""

    def __init__(self):
        self.by_kind: collections.Counter = collections.Counter()
        self._mode: Optional[_Dispatch] = None
        self._saved: dict = {}

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def _record(self, kind: str) -> None:
        self.by_kind[kind] += 1

    def _wrap(self, name: str):
        original = getattr(torch.Tensor, name)
        record = self._record

        def wrapper(tensor, *args, **kwargs):
            record(name)
            return original(tensor, *args, **kwargs)

        self._saved[name] = original
        setattr(torch.Tensor, name, wrapper)

    def __enter__(self) -> "HostReads":
        for name in ("tolist", "numpy"):
            self._wrap(name)
        self._mode = _Dispatch(self._record)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
