"""attnkit: scaled dot-product attention, exact and fast, with first-class masks.

    import attnkit as ak
    out = ak.attention(q, k, v, mask=ak.causal())
    out = ak.attention(q, k, v, mask=ak.causal() & ak.softcap(30.0))   # a score modifier
"""

from typing import TYPE_CHECKING

from . import masks, modifiers
from .api import AttentionResult, attention, available_backends, explain_dispatch, plan
from .call import Plan
from .dispatch import use_backend
from .invariance import invariant
from .masks import bias, causal, dense, documents, from_function, padding, sliding_window
from .modifiers import alibi, relative_bias, score_function, sinks, softcap, t5_buckets
from .paged import paged_attention
from .varlen import varlen_attention

__version__ = "0.1.0"

__all__ = [
    "attention", "plan", "Plan", "varlen_attention", "paged_attention", "AttentionResult",
    "available_backends",
    "explain_dispatch", "use_backend", "invariant",
    "masks", "modifiers", "nn", "causal", "sliding_window",
    "padding", "documents", "dense", "bias", "from_function",
    "softcap", "alibi", "relative_bias", "sinks", "score_function", "t5_buckets", "__version__",
]

if TYPE_CHECKING:  # type checkers see nn as imported, and no __getattr__ that answers any name
    from . import nn
else:
    def __getattr__(name):  # nn imports lazily: attention() alone needs no module classes
        if name == "nn":
            import importlib
            return importlib.import_module(".nn", __name__)
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
