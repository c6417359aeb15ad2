"""``attnkit explain``: the reference computation, step by step, on small matrices.

With no inputs it runs a classic 3-token example of causal self-attention: Q = K = V =
[[1,0],[2,0],[3,0]], d_k = 2, scale 1/√2. Its last row is softmax([2.121, 4.243, 6.364]) ≈
[0.0127, 0.1057, 0.8816], so O[2] ≈ [2.869, 0].
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from rich.markup import escape

from ..backends.reference import Steps, steps
from ..inputs import Inputs, validate
from ..masks import causal
from ..modifiers import alibi, softcap

from ._common import (UsageError, agg_figure, check_output, fmt_number, matrix_table,
                      save_figure)

HELP = ("print the attention computation step by step (default: a 3-token causal example, "
        "Q = K = V = [[1,0],[2,0],[3,0]])")

EXAMPLE_QKV = [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]
"""The built-in example: Q = K = V (3 positions, d_k = 2), causal mask, scale 1/√2."""

MAX_SCORES = 2 ** 24
"""The most attention scores (batch × heads × queries × keys) explain takes: it keeps every
step of every score in float64, on the order of 150 bytes a score."""

ANNOTATED = 20
"""Up to this many rows and columns, the heatmap of ``--plot`` labels every cell with its
weight; a larger matrix is drawn in a figure no larger than one of this many cells a side."""

SHOWN_ROWS = 32
"""Rows printed per matrix: a longer one shows its first rows and its last after a ``…`` row
(and, whatever its length, only the columns that fit the console's width); ``--plot`` draws
every weight."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, what in (("q", "queries [Tq, Dk]"), ("k", "keys [Tk, Dk] (default: --q)"),
                       ("v", "values [Tk, Dv] (default: --k)")):
        parser.add_argument(f"--{name}", metavar="JSON|FILE.npy",
                            help=f"{what}: a JSON nested list like '[[1,0],[2,0]]' or a .npy file")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the causal mask (query i sees keys j <= i); on by default "
                             "for the built-in example, off for your own inputs")
    parser.add_argument("--scale", type=float, default=None,
                        help="multiply the scores by this (default 1/sqrt(Dk))")
    parser.add_argument("--softcap", type=float, default=None, metavar="C",
                        help="soft-cap the scaled scores, s -> C*tanh(s/C) (a score modifier, "
                             "shown as step 3b)")
    parser.add_argument("--alibi", type=float, default=None, metavar="SLOPE",
                        help="add the ALiBi bias SLOPE*(j - i) to the scores, in every head (a "
                             "score modifier, shown as step 3b)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write a heatmap PNG of the attention weights to PATH")


NOT_NUMBERS = {"b": "booleans", "U": "strings", "S": "bytes", "O": "Python objects",
               "M": "dates", "m": "time spans", "V": "structured records"}
"""Array kinds (``dtype.kind``) that are not real numbers, by the words an error uses for them."""


def parse_matrix(text: str) -> torch.Tensor:
    """A JSON nested list or the path of a ``.npy`` file → a float64 tensor.

    Raises ``ValueError`` for text that is neither, and for arrays that are empty, have fewer
    than 2 dimensions or hold anything but real integers or floats (complex, booleans,
    strings, objects, dates); a JSON ``true``/``false`` is refused wherever it stands, naming
    its index.
    """
    path = Path(text)
    try:
        from_file = text.endswith(".npy") or path.is_file()
    except OSError:  # e.g. a JSON matrix longer than a file name may be
        from_file = False
    if from_file:
        if not path.exists():
            raise ValueError(f"{text!r}: no such file; check the path, or pass a JSON matrix "
                             f"like '[[1,0],[2,0]]'")
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as error:
            raise ValueError(f"cannot read {text!r} as a .npy array ({error}); pass a numeric "
                             f"array saved with numpy.save") from None
        if not isinstance(array, np.ndarray):  # an .npz archive
            array.close()
            raise ValueError(f"{text!r} is an .npz archive, not a .npy array; pass one array "
                             f"saved with numpy.save")
    else:
        try:
            data = json.loads(text)
            array = np.asarray(data)
        except (json.JSONDecodeError, ValueError, TypeError) as error:
            raise ValueError(f"cannot read {text!r} as a JSON matrix (e.g. '[[1,0],[2,0]]') "
                             f"or a .npy file: {error}") from None
        where = _first_boolean(data)
        if where is not None:  # numpy reads true as 1.0 next to floats: refuse it everywhere
            index, value = where
            raise ValueError(f"{text!r} holds the JSON boolean {json.dumps(value)} at "
                             f"{index or 'its top level'}, where a number is needed (queries, "
                             f"keys and values are numbers); write 1 and 0 for true/false")
    kind = array.dtype.kind
    if kind == "c":
        raise ValueError(f"{text!r} holds complex numbers ({array.dtype}), and attention is "
                         f"computed on real numbers only: its imaginary part would be lost; pass "
                         f"real arrays (e.g. save a.real)")
    if kind not in "iuf":
        fix = "save a.astype(float)" if from_file else "write numbers, e.g. '[[1,0],[2,0]]'"
        raise ValueError(f"{text!r} holds {NOT_NUMBERS.get(kind, 'values')} ({array.dtype}), "
                         f"not real numbers; pass integers or floats ({fix})")
    if array.size == 0:
        raise ValueError(f"{text!r} is empty (shape {array.shape}); pass at least one row "
                         f"and one column")
    if array.ndim == 0:
        raise ValueError(f"{text!r} is a single number (shape ()); pass a matrix such as "
                         f"'[[1,0],[2,0]]'")
    if array.ndim == 1:
        raise ValueError(f"{text!r} is one vector (shape {array.shape}), where a matrix "
                         f"[positions, features] is needed; for one position write it as one "
                         f"row, e.g. '[[1,0]]'")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64))


def _first_boolean(data, index: str = "") -> Optional[tuple[str, bool]]:
    """``(index, value)`` of the first JSON ``true``/``false`` in the nested lists ``data``,
    with its index written like ``[0][1]``; ``None`` when it holds none."""
    if isinstance(data, bool):
        return index, data
    if isinstance(data, list):
        for i, item in enumerate(data):
            found = _first_boolean(item, f"{index}[{i}]")
            if found is not None:
                return found
    return None


def build_inputs(q=None, k=None, v=None, *, causal_mask: Optional[bool] = None,
                 scale: Optional[float] = None, softcap_at: Optional[float] = None,
                 alibi_slope: Optional[float] = None) -> Inputs:
    """Validated inputs for explain.

    ``q``/``k``/``v`` are tensors ``[T, D]`` or ``None``: all ``None`` means the built-in
    example :data:`EXAMPLE_QKV` (causal unless ``causal_mask=False``); ``k`` defaults to ``q``
    and ``v`` to ``k`` (self-attention). ``softcap_at`` / ``alibi_slope``: score modifiers
    (:func:`attnkit.softcap`, :func:`attnkit.alibi` with one slope for every head). Raises
    ``ValueError`` for a non-finite ALiBi slope and for whatever ``inputs.validate`` refuses.
    """
    if q is None and k is None and v is None:
        q = torch.tensor(EXAMPLE_QKV, dtype=torch.float64)  # [3, 2]
        k, v = q.clone(), q.clone()
        causal_mask = True if causal_mask is None else causal_mask
    else:
        q = q if q is not None else (k if k is not None else v)
        k = k if k is not None else q
        v = v if v is not None else k
    parts = [causal()] if causal_mask else []
    if softcap_at is not None:
        parts.append(softcap(softcap_at))
    if alibi_slope is not None:
        if not math.isfinite(alibi_slope):
            raise ValueError(f"--alibi {alibi_slope:g}: the ALiBi slope must be a finite number "
                             f"(the bias added to score (i, j) is slope·(j − i)), e.g. --alibi 0.5")
        heads = q.shape[-3] if q.dim() >= 3 else 1  # one slope, for every query head
        parts.append(alibi(torch.full((heads,), alibi_slope, dtype=torch.float64)))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return validate(q, k, v, mask, scale=scale)


def describe_example(inputs: Inputs) -> str:
    """One line showing the built-in example's inputs and what applies to them (mask, scale,
    score modifiers)."""
    parts = ["Q = K = V = [[1,0],[2,0],[3,0]] (3 positions, d_k = 2)"]
    parts.append("causal mask" if inputs.mask is not None else "no mask")
    if not math.isclose(inputs.scale, 1 / math.sqrt(2), rel_tol=1e-12):
        parts.append(f"scale {inputs.scale:g}")
    if inputs.modifiers is not None and inputs.modifiers.changes_scores:
        parts.append(_modifier_names(inputs.modifiers, 0))
    return ", ".join(parts) + "; computed by the float64 reference backend"


def _modifier_names(modifiers, head: int) -> str:
    """The score modifiers explain builds, with their values for query head ``head``:
    e.g. ``softcap 2, ALiBi slope 0.5``."""
    names = []
    if modifiers.softcap is not None:
        names.append(f"softcap {modifiers.softcap.cap:g}")
    for part in modifiers.alibi:
        names.append(f"ALiBi slope {part.slopes.flatten()[head].item():g}")
    return ", ".join(names)


def plot_weights(weights: torch.Tensor, allowed: Optional[torch.Tensor], path, *,
                 title: str = "attention weights") -> Path:
    """Heatmap PNG of ``weights [Tq, Tk]``; masked cells (``allowed`` False, ``[Tq, Tk]`` or
    ``None``) are grey. Up to :data:`ANNOTATED` rows and columns every cell is labelled (its
    weight, or "masked") and ticked; a larger matrix is drawn in a figure of that size, with
    ticks chosen by matplotlib. Uses the Agg canvas."""
    values = weights.detach().double().cpu().numpy()
    rows, cols = values.shape
    labelled = rows <= ANNOTATED and cols <= ANNOTATED
    figure = agg_figure(figsize=(max(4.5, 1.6 + 0.7 * min(cols, ANNOTATED)),
                                 max(3.4, 1.2 + 0.6 * min(rows, ANNOTATED))))
    axes = figure.add_subplot()
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    shown = values if allowed is None else np.ma.masked_array(values, mask=~allowed.cpu().numpy())
    colormap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    image = axes.imshow(shown, cmap=colormap, vmin=0.0, vmax=1.0, interpolation="nearest")
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
    if labelled:
        for i in range(rows):
            for j in range(cols):
                masked = allowed is not None and not bool(allowed[i, j])
                text = "masked" if masked else f"{values[i, j]:.3f}"
                color = "black" if masked or values[i, j] > 0.6 else "white"
                axes.text(j, i, text, ha="center", va="center", color=color,
                          fontsize=7 if masked else 8)
        axes.set_xticks(range(cols))
        axes.set_yticks(range(rows))
    else:
        for axis in (axes.xaxis, axes.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("key j")
    axes.set_ylabel("query i")
    axes.set_title(title, fontsize=10)
    return save_figure(figure, path)


def describe_mask(mask) -> str:
    """A short human name for the masks explain builds (only causal today)."""
    from ..backends.torch_sdpa import is_plain_causal

    return "causal, query i sees keys j <= i" if is_plain_causal(mask) else repr(mask)


def _print_head(console, result: Steps, inputs: Inputs, b: int, h: int) -> None:
    """Print every step for batch ``b``, query head ``h``."""
    q, k, v = inputs.q[b, h], inputs.k[b, h // inputs.group_size], inputs.v[b, h // inputs.group_size]
    tq, dk = q.shape
    tk, dv = v.shape
    default_scale = 1 / math.sqrt(dk)
    scale_note = (f"1/√{dk} = {inputs.scale:.6g}" if math.isclose(inputs.scale, default_scale)
                  else f"{inputs.scale:.6g} (given; 1/√d_k would be {default_scale:.6g})")

    def say(text: str) -> None:  # plain text: brackets like A[i, j] are not rich markup
        console.print(text, markup=False, highlight=False)

    def table(matrix: torch.Tensor, **options):  # what fits the console, SHOWN_ROWS rows at most
        return matrix_table(matrix, width=console.width, max_rows=SHOWN_ROWS, **options)

    console.rule("[bold]1. Inputs")
    gqa = (f"   (GQA: query head {h} uses K/V head {h // inputs.group_size})"
           if inputs.group_size > 1 else "")
    say(f"Q [Tq={tq}, d_k={dk}]   K [Tk={tk}, d_k={dk}]   V [Tk={tk}, d_v={dv}]   "
        f"scale = {scale_note}{gqa}")
    for name, t in (("Q", q), ("K", k), ("V", v)):
        console.print(table(t.double(), title=name, row_name="row"))
    finite_inputs = all(bool(torch.isfinite(t).all()) for t in (q, k, v))
    if not finite_inputs:
        say("A row of Q, K or V holds NaN or ±inf: the steps below use it as zeros, and every "
            "row that holds or may attend it comes out NaN (docs/NUMERICS.md).")

    console.rule("[bold]2. Scores  S = Q Kᵀ")
    say(f"S[i, j] = q_i · k_j   shape [{tq}, {tk}]")
    console.print(table(result.scores[b, h], row_name="i"))

    console.rule("[bold]3. Scaled  S · scale")
    if math.isclose(inputs.scale, default_scale):
        say(f"multiply by {inputs.scale:.6g}: keeps the score variance ≈ 1 when q, k have "
            f"unit-variance entries (Var(q·k) = d_k)")
    else:
        say(f"multiply by {inputs.scale:.6g}: the score variance is scale² · d_k = "
            f"{inputs.scale ** 2 * dk:.3g} when q, k have unit-variance entries "
            f"(Var(q·k) = d_k; 1/√d_k would keep it ≈ 1)")
    console.print(table(result.scaled[b, h], row_name="i"))
    masked = result.masked[b, h]  # [Tq, Tk]: after modifiers and the mask, −inf = masked
    overflowed = (masked.isnan() | masked.isposinf()).any(-1).nonzero().flatten().tolist()
    if finite_inputs and overflowed:
        say(f"Row(s) {', '.join(map(str, overflowed))}: a score the row may attend overflowed "
            f"float64 (|scale · q·k| > {torch.finfo(torch.float64).max:.3g}) although Q and K "
            f"are finite; softmax cannot subtract an infinite maximum, so those rows come out "
            f"NaN, as on every backend. Rescale Q or K.")

    modifiers = inputs.modifiers
    if modifiers is not None and modifiers.changes_scores:
        console.rule("[bold]" + escape(f"3b. Modified  ({_modifier_names(modifiers, h)})"))
        steps_text = []
        if modifiers.softcap is not None:
            cap = modifiers.softcap.cap
            steps_text.append(f"softcap: s → {cap:g}·tanh(s / {cap:g}) (within ±{cap:g})")
        for part in modifiers.alibi:
            steps_text.append(f"alibi: + slope·(j − i), slope {part.slopes.flatten()[h].item():g}")
        say("; then ".join(steps_text) + "  (score modifiers, in their order: softcap, "
            "additive biases, score functions)")
        console.print(table(result.modified[min(b, result.modified.shape[0] - 1),
                                            min(h, result.modified.shape[1] - 1)], row_name="i"))

    console.rule("[bold]4. Masked  (−inf where a query may not attend)")
    source = "modified" if modifiers is not None and modifiers.changes_scores else "scaled"
    if result.allowed is None:
        say(f"no mask: every query sees every key (masked = {source})")
    else:
        allowed = result.allowed[min(b, result.allowed.shape[0] - 1), min(h, result.allowed.shape[1] - 1)]
        say(f"mask: {describe_mask(inputs.mask)}  (█ may attend, ░ masked):")
        picture = ["".join("█" if a else "░" for a in row) for row in allowed.tolist()]
        if len(picture) > SHOWN_ROWS:
            picture = picture[:SHOWN_ROWS - 1] + ["⋮"] + picture[-1:]
        room = max(console.width - 2, 2)
        say("\n".join("  " + (row if len(row) <= room else row[:room - 1] + "…") for row in picture))
        console.print(table(result.masked[b, h], row_name="i"))

    console.rule("[bold]5. Weights  A = softmax(masked) per row")
    say("A[i, j] = exp(m_ij − max_j m_ij) / Σ_j exp(m_ij − max_j m_ij); each row sums to 1 "
        "(0 for a query with no visible key)")
    weights = result.weights[b, h]  # [Tq, Tk]
    console.print(table(weights, row_name="i", extra={"row sum": weights.sum(-1).tolist()}))

    console.rule("[bold]6. Output  O = A V")
    say(f"O[i] = Σ_j A[i, j] · v_j   shape [{tq}, {dv}]")
    console.print(table(result.out[b, h], row_name="i"))

    console.rule("[bold]" + escape("7. Log-sum-exp  LSE[i] = log Σ_j exp(masked[i, j])"))
    lse = result.lse[b, h]  # [Tq]
    rebuilt = torch.exp(result.masked[b, h] - lse[:, None])  # [Tq, Tk]
    rebuilt = torch.where(torch.isneginf(lse)[:, None], torch.zeros_like(rebuilt), rebuilt)
    say("what fast kernels keep instead of A: A = exp(masked − LSE) rebuilds the weights "
        f"(max |difference| here: {(rebuilt - weights).abs().max().item():.1e})")
    shown = [f"LSE[{i}] = {fmt_number(x)}" for i, x in enumerate(lse.tolist())]
    if len(shown) > SHOWN_ROWS:
        shown = shown[:SHOWN_ROWS - 1] + ["…"] + shown[-1:]
    say("  " + "   ".join(shown))


def run(args: argparse.Namespace, console) -> int:
    tensors = {}
    for name in ("q", "k", "v"):
        try:
            text = getattr(args, name)
            tensors[name] = None if text is None else parse_matrix(text)
        except ValueError as error:
            raise UsageError(f"--{name}: {error}") from None
    try:
        inputs = build_inputs(**tensors, causal_mask=args.causal, scale=args.scale,
                              softcap_at=args.softcap, alibi_slope=args.alibi)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    batch, heads, q_len, kv_len = *inputs.q.shape[:3], inputs.k.shape[2]
    if batch * heads * q_len * kv_len > MAX_SCORES:
        raise UsageError(f"--q/--k: {batch} × {heads} × {q_len} × {kv_len} attention scores "
                         f"(batch × heads × queries × keys); explain keeps every step of each in "
                         f"float64 and takes at most {MAX_SCORES} (e.g. 4096 × 4096): pass fewer "
                         f"rows, or call attnkit.attention(q, k, v, backend='reference', "
                         f"return_weights=True) for the weights of a larger case")
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot}: the heatmap is a PNG; give a path ending "
                             f"in .png")
        check_output("--plot", args.plot)
    result = steps(inputs)
    if all(tensor is None for tensor in tensors.values()):
        console.print("[bold]Built-in example[/bold]: a classic 3-token example of scaled "
                      "dot-product attention (give --q/--k/--v for your own inputs)")
        console.print(escape(describe_example(inputs)))
    for b in range(batch):
        for h in range(heads):
            if batch * heads > 1:
                console.rule(f"[bold magenta]batch {b}, head {h}")
            _print_head(console, result, inputs, b, h)
    if args.plot is not None:
        allowed = None
        if result.allowed is not None:
            allowed = result.allowed[0, 0]  # [Tq, Tk]
        try:
            path = plot_weights(result.weights[0, 0], allowed, args.plot,
                                title="attention weights (batch 0, head 0)" if batch * heads > 1
                                else "attention weights A = softmax(masked)")
        except OSError as error:
            raise UsageError(f"--plot {args.plot}: cannot write it ({error.strerror or error}); "
                             f"choose another path") from None
        console.print(f"wrote weights heatmap: {path}")
    return 0
