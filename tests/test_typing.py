"""The public API's annotations as a type checker reads them: return types by flag
(overloads), operands the mask operators take, fields of the results."""

import typing
from typing import Iterator

import pytest
import torch

import attnkit as ak
from attnkit.distributed import hybrid_attention, ring_attention, ulysses_attention
from attnkit.distributed.parallel import SequenceParallel
from attnkit.masks import Mask
from attnkit.nn import MHAOutput, PagedKVCache


@pytest.mark.parametrize("fn", [ak.varlen_attention, ak.paged_attention, PagedKVCache.attend,
                                ring_attention, ulysses_attention, hybrid_attention])
def test_return_lse_overloads_give_tensor_or_result(fn):
    returns = [typing.get_type_hints(o)["return"] for o in typing.get_overloads(fn)]
    assert returns[:2] == [torch.Tensor, ak.AttentionResult]


def test_mask_operators_take_what_they_accept():
    def accepts(method, *types):
        hint = typing.get_type_hints(method)["other"]
        return set(types) <= set(typing.get_args(hint) or (hint,))
    assert accepts(Mask.__and__, Mask, torch.Tensor, type(None))
    assert accepts(Mask.__or__, Mask, torch.Tensor)
    assert accepts(Mask.__rand__, torch.Tensor, type(None))


def test_result_and_option_types():
    assert PagedKVCache in typing.get_args(typing.get_type_hints(MHAOutput)["cache"])
    assert "MHAOutput" in ak.nn.__all__
    for cm in (ak.use_backend, ak.invariant):
        assert typing.get_type_hints(cm.__wrapped__)["return"] == Iterator[None]
    mesh = typing.get_type_hints(SequenceParallel)["mesh"]
    assert mesh is not object and type(None) in typing.get_args(mesh)
