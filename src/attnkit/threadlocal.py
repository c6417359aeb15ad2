"""A thread-local setting for the length of a ``with`` block: the modes
(:func:`attnkit.use_backend`, :func:`attnkit.invariant`,
:func:`attnkit.integrations.transformers.sequence_parallel`) and the compiled operators'
:func:`attnkit.masks.unkeyed` scope. Thread-local rather than a ``ContextVar``: torch.compile
traces the reads of an attribute of a ``threading.local``."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


@contextlib.contextmanager
def setting(local: threading.local, name: str, value, default=None) -> Iterator[None]:
    """``local.<name>`` is ``value`` on this thread inside the block; afterwards (also when
    the block raises) what it was before, ``default`` where it was unset."""
    before = getattr(local, name, default)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, before)
