"""What the mask constructors accept and refuse, and how masks print.

``padding(q_mask=..., kv_mask=...)`` refuses a row with no real token unless asked for
(``allow_empty_rows=True``): torch's ``key_padding_mask`` (True = padding) passed as a
"real token" mask leaves an unpadded row all False. ``documents`` refuses ids it cannot
compare (strings, floats, ids without values). A mask's ``repr`` is the call that builds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.masks import MaskSpace

torch.set_num_threads(1)


def space(batch=1, q_len=8, kv_len=8):
    return MaskSpace(batch=batch, heads=1, q_len=q_len, kv_len=kv_len)


def runs(rows, width):
    """A ``[B, width]`` bool "real token" mask with row b real on ``[start, stop)``."""
    return torch.tensor([[start <= t < stop for t in range(width)] for start, stop in rows])


# ---- padding: rows with no real token ----------------------------------------------------------

def test_padding_mask_row_without_real_keys_is_refused_with_the_row_and_the_fix():
    """torch's key_padding_mask of a batch whose row 1 has no padding: passed as kv_mask, row 1
    has no real key; the error names the row, ``~mask`` and the opt-in."""
    key_padding_mask = runs([(5, 8), (8, 8), (6, 8)], 8)  # True = padding (torch)
    with pytest.raises(ValueError) as error:
        ak.padding(kv_mask=key_padding_mask)
    message = str(error.value)
    for word in ("kv_mask", "row [1]", "no real key", "~", "True = real", "allow_empty_rows=True"):
        assert word in message, (word, message)
    with pytest.raises(ValueError, match=r"(?s)q_mask.*rows \[0, 2\].*no real query.*~"):
        ak.padding(q_mask=runs([(0, 0), (0, 3), (2, 2)], 4))


def test_padding_mask_accepts_every_left_and_right_padding_and_empty_rows_on_request():
    """Each row one non-empty run at either end (or both, or neither) is a padding mask and is
    never refused; an empty row builds when asked for, and a length of 0 is always allowed."""
    width = 6
    every_run = [(start, width) for start in range(width)] + [(0, stop) for stop in range(1, width)]
    for rows in (every_run, [(2, 6), (2, 6)], [(0, 3), (0, 3)], [(1, 4)]):
        mask = ak.padding(q_mask=runs(rows, width), kv_mask=runs(rows, width))
        assert mask.kv_starts.tolist() == [s for s, _ in rows]
        assert mask.kv_lengths.tolist() == [e - s for s, e in rows]
    with pytest.raises(ValueError, match="allow_empty_rows"):
        ak.padding(kv_mask=runs([(2, 6), (0, 0)], width))
    allowed = ak.padding(kv_mask=runs([(2, 6), (0, 0)], width), allow_empty_rows=True)
    dense = allowed.to_dense(space(batch=2, q_len=3, kv_len=width))
    assert dense[0, 0, :, 2:].all() and not dense[0, 0, :, :2].any() and not dense[1].any()
    assert ak.padding(kv_lengths=[0, 3]).check(space(batch=2, kv_len=3)) == []
    assert ak.masks.real_keys(runs([(2, 6), (0, 0)], width)).kv_lengths.tolist() == [4, 0]


def test_padding_mask_with_padding_inside_suggests_the_inverse_when_that_is_one_run():
    """torch's key_padding_mask of a row padded on both sides is True at both ends: not one
    run of real tokens, but its inverse is."""
    with pytest.raises(ValueError, match=r"(?s)not one contiguous run.*~"):
        ak.padding(kv_mask=torch.tensor([[True, False, False, True]]))
    with pytest.raises(ValueError) as error:  # no run either way: no suggestion to invert
        ak.padding(kv_mask=torch.tensor([[True, False, True, False]]))
    assert "~" not in str(error.value)


def test_padding_mask_row_without_real_keys_is_refused_when_a_compiled_graph_runs():
    real = runs([(3, 8), (8, 8)], 8)

    def fn(q, k, v):
        return ak.attention(q, k, v, ak.padding(kv_mask=real))

    q = torch.randn(2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"(?s)row \[1\].*allow_empty_rows"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, q, q)


# ---- documents: ids ----------------------------------------------------------------------------

@pytest.mark.parametrize("ids,error,words", [
    (["a", "a", "b"], TypeError, ["q_ids", "str", "integer", "enumerate"]),
    (np.array(["a", "a", "b"]), TypeError, ["q_ids", "str", "integer", "enumerate"]),
    (np.array(["a", "b"], dtype=object), TypeError, ["q_ids", "integer"]),
    (None, TypeError, ["q_ids", "NoneType", "integer"]),
    (torch.tensor([0.0, 0.0, 1.0]), TypeError, ["q_ids", "torch.float32", ".long()"]),
    ([0.0, 1.0], TypeError, ["q_ids", "torch.float32", ".long()"]),
    (torch.tensor([1j, 2j]), TypeError, ["q_ids", "complex", "integer"]),
    (torch.zeros(2, 1, 4, dtype=torch.long), TypeError, ["q_ids", "(2, 1, 4)", "[B, T]", "one id per position"]),
    (torch.tensor(3), TypeError, ["q_ids", "()", "one id per position"]),
    ([[0, 0], [1]], ValueError, ["q_ids", "[B, T]", "same length"]),
])
def test_documents_refuses_ids_it_cannot_compare(ids, error, words):
    with pytest.raises(error) as caught:
        ak.documents(ids)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_documents_checks_kv_ids_and_causal_form_in_the_constructor():
    with pytest.raises(TypeError, match="kv_ids.*str"):
        ak.documents([0, 0, 1], ["a", "b", "b"])
    # meta ids hold no values: accepted for shape propagation (tests/test_shape_only.py)
    meta = ak.documents(torch.zeros(2, dtype=torch.long, device="meta"), causal="top_left")
    assert meta.documents.q_ids.device.type == "meta"
    assert ak.documents([]).q_ids.dtype == torch.long  # an empty list has no dtype: ids are long


# ---- repr: the call that builds the mask -------------------------------------------------------

LONG = torch.arange(100, 132)  # 32 lengths


@pytest.mark.parametrize("mask,text", [
    (ak.causal(), "causal()"),
    (ak.causal("bottom_right"), "causal('bottom_right')"),
    (ak.sliding_window(128), "sliding_window(128)"),
    (ak.sliding_window(128, 4), "sliding_window(128, 4)"),
    (ak.sliding_window(128, align="bottom_right"), "sliding_window(128, align='bottom_right')"),
    (ak.sliding_window(1 << 40, 4), "sliding_window(UNBOUNDED, 4)"),
    (ak.padding(kv_lengths=[128, 90]), "padding(kv_lengths=[128, 90])"),
    (ak.padding(q_lengths=[3, 2], q_starts=[0, 1]),
     "padding(q_lengths=[3, 2], q_starts=[0, 1])"),
    (ak.padding(kv_lengths=7), "padding(kv_lengths=7)"),
    (ak.padding(kv_lengths=LONG), "padding(kv_lengths=[100, 101, 102, 103, …] (32 rows))"),
    (ak.padding(kv_mask=runs([(2, 6), (0, 4)], 6)), "padding(kv_lengths=[4, 4], kv_starts=[2, 0])"),
    (ak.documents([0, 0, 1, 1, 1]), "documents([0, 0, 1, 1, 1])"),
    (ak.documents([0, 0, 1], [0, 0, 0, 1]), "documents([0, 0, 1], [0, 0, 0, 1])"),
    (ak.documents(torch.arange(4096) // 1024), "documents(<ids [4096]: 4 documents>)"),
    (ak.documents(torch.stack([torch.arange(64) // 16, torch.arange(64) // 32])),
     "documents(<ids [2, 64]: 2 to 4 documents per row>)"),
    (ak.documents([0, 0, 1, 1, 1], causal="top_left"), "documents([0, 0, 1, 1, 1], causal='top_left')"),
    (ak.causal() & ak.padding(kv_lengths=[5, 3]), "causal() & padding(kv_lengths=[5, 3])"),
    (ak.causal() & ak.sliding_window(4) & ak.padding(q_lengths=[2]),
     "causal() & sliding_window(4) & padding(q_lengths=[2])"),
    (ak.causal() | ak.sliding_window(4, 4), "causal() | sliding_window(4, 4)"),
    ((ak.causal() | ak.sliding_window(4, 4)) & ak.padding(q_lengths=[2]),
     "(causal() | sliding_window(4, 4)) & padding(q_lengths=[2])"),
    (~ak.causal(), "~causal()"),
    (~(ak.causal() & ak.sliding_window(2)), "~(causal() & sliding_window(2))"),
    (ak.causal(sequences=ak.padding(kv_lengths=[5, 3])),
     "causal(sequences=padding(kv_lengths=[5, 3]))"),
    (ak.causal("bottom_right", sequences=ak.padding(q_lengths=[3, 2], kv_lengths=[5, 3])),
     "causal('bottom_right', sequences=padding(q_lengths=[3, 2], kv_lengths=[5, 3]))"),
    (ak.sliding_window(8, 2, sequences=ak.padding(kv_starts=[1, 0])),
     "sliding_window(8, 2, sequences=padding(kv_starts=[1, 0]))"),
    (ak.dense(torch.ones(2, 1, 1, 6, dtype=torch.bool)), "dense(<bool [2, 1, 1, 6]>)"),
    (ak.bias(torch.zeros(1, 4, 8, 8)), "bias(<float32 [1, 4, 8, 8]>)"),
])
def test_repr_is_the_call_that_builds_the_mask(mask, text):
    assert repr(mask) == text


def test_str_draws_the_mask_at_the_size_its_tensors_fix():
    """``print(mask)`` draws █/░ at the size of its ids or dense tensor (a side left open as
    long as the other, 8×8 when nothing fixes one) and falls back to the repr for a mask too
    large to draw."""
    assert str(ak.documents([0, 0, 1, 1, 1])) == "██░░░\n██░░░\n░░███\n░░███\n░░███"
    packed = ak.documents([0, 0, 1], [0, 1, 1, 1], causal="top_left") & ak.causal()
    assert str(packed) == packed.draw(3, 4) == "█░░░\n█░░░\n░█░░"
    assert str(ak.dense(torch.tensor([[True, False, True]]))) == "█░█\n█░█\n█░█"
    assert str(ak.padding(kv_mask=runs([(1, 3)], 3)) & ak.causal()) == "░░░\n░█░\n░██"
    assert str(ak.causal()) == ak.causal().draw(8, 8)
    assert str(ak.documents(torch.arange(100) // 10)) == "documents(<ids [100]: 10 documents>)"
