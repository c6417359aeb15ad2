"""attnkit: scaled dot-product attention, exact and fast, with first-class masks.

    import attnkit as ak
    out = ak.attention(q, k, v, mask=ak.causal())
"""

from . import masks
from .api import AttentionResult, attention, available_backends, explain_dispatch
from .dispatch import use_backend
from .masks import bias, causal, dense, documents, from_function, padding, sliding_window

__version__ = "0.1.0"

__all__ = [
    "attention", "AttentionResult", "available_backends", "explain_dispatch", "use_backend",
    "masks", "nn", "causal", "sliding_window",
    "padding", "documents", "dense", "bias", "from_function", "__version__",
]


def __getattr__(name):  # nn imports lazily: attention() alone needs no module classes
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
