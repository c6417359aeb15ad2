"""The invariance contract: ``with attnkit.invariant():`` (or ``attention(...,
invariant=True)``) makes a query row's result a function of that row's own inputs alone.

Under it, for every backend that accepts it (``tiled``; the others refuse with their reason
and ``auto`` passes them over), bit for bit (docs/NUMERICS.md, "Invariance"):

1. run to run: the same inputs give the same outputs, LSE and gradients;
2. batch invariance: a sequence's output rows and LSE do not depend on the other sequences
   of the batch, the batch size, the sequence's place in it, or the padding around it
   (right or left; a packed ``varlen_attention`` batch runs each sequence as its own call);
3. chunking invariance: a query row computed in a full prefill, in any chunk of a chunked
   prefill, or as a decoding step over a cache gives the same bits.

How: the tiled engine's fixed schedule (``TiledOptions.fixed_blocks``): each sequence's keys
are reduced in blocks of ``FIXED_BLOCK_K`` at its own absolute positions (a left-padded
sequence's blocks start at its first real key), one kernel call per (query block, key block)
merged in key order, every call on a multiple of ``ROW_QUANTUM`` query rows, never a path
chosen from the call's shapes. Key blocks a row may not attend change nothing (their merge
weight is exactly 0), so the rows around it and the keys it cannot see leave its bits alone.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

_MODE = threading.local()
"""``_MODE.on``: whether :func:`invariant` is active on this thread (absent: no)."""


@contextlib.contextmanager
def invariant(enabled: bool = True):
    """Run every ``attention()`` call in the ``with`` block under the invariance contract
    (see this module): ``backend="auto"`` picks a backend that keeps it, an explicit backend
    that cannot raises with its reason. Thread-local, like :func:`attnkit.use_backend`; an
    explicit ``attention(..., invariant=False)`` still wins. For a model's forward or a
    ``generate`` loop::

        with attnkit.invariant():
            model.generate(**batch)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"invariant(enabled={enabled!r}): pass True or False")
    before = getattr(_MODE, "on", False)
    _MODE.on = enabled
    try:
        yield
    finally:
        _MODE.on = before


def active(explicit: Optional[bool] = None) -> bool:
    """Whether a call runs under the contract: ``explicit`` when given (``attention(...,
    invariant=...)``), else the :func:`invariant` mode of this thread."""
    if explicit is None:
        return bool(getattr(_MODE, "on", False))
    if not isinstance(explicit, bool):
        raise TypeError(f"invariant={explicit!r}: pass True, False or None (None follows "
                        f"attnkit.invariant())")
    return explicit
