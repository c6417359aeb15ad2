"""Position biases (ALiBi, relative) on the tiled engine: a call's biases by relative position
(:class:`Positions`, with K/V in reverse order for the fused kernel), one segment's view of them
(:class:`PositionTile`), and their backward: dS summed along diagonals into the position
vector's gradient, and from it the gradients of the slopes and tables."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ...numerics import unit_rows
from .plan import Problem, Segment


class Positions(NamedTuple):
    """A call's position biases (ALiBi, relative): ``vector [1|B, Hq, L]``, the bias of each
    relative position (:meth:`Problem.position_vector`), and, for the fused kernel,
    ``backwards`` (the vector reversed along L) with ``keys``/``values`` ``[B, Hkv, Tk, D]``
    in reverse order: a segment without element mask runs over its keys last to first, so
    its bias is a view of ``backwards`` with unit strides (:meth:`PositionTile.backwards`),
    and a causal row meets its nearest keys first (torch's CPU kernel slows down when a
    row's running maximum keeps climbing by much, as ALiBi makes it over keys in order)."""

    vector: torch.Tensor
    backwards: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


def _positions(problem: Problem, dtype: torch.dtype, fused: bool = False,
               keys: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None,
               vector: Optional[torch.Tensor] = None, rows: int = 0) -> Optional[Positions]:
    """The :class:`Positions` of a call, or ``None`` without ALiBi and relative biases.
    ``vector``: the position vector, when the caller has it already. With ``fused``,
    ``keys`` and ``values`` ``[B, Hkv, Tk, D]`` are reversed too when the call has at least
    ``Dk + Dv`` query ``rows`` per K/V head (G·Tq): building every segment's bias then costs
    more than reversing K/V once (a decoding step builds its small bias instead)."""
    vector = problem.position_vector(dtype) if vector is None else vector
    if (vector is None or not fused or rows < keys.shape[-1] + values.shape[-1]
            or problem.plan.options.fixed_blocks):  # the fixed schedule reads keys in order
        return None if vector is None else Positions(vector)
    # (a flip of overlapping rows may come back with a strided last dim: unit_rows)
    return Positions(vector, vector.flip(-1), unit_rows(keys.flip(2)), unit_rows(values.flip(2)))


class PositionTile(NamedTuple):
    """The ALiBi and relative biases of one segment, read from the call's vectors by relative
    position (:class:`Positions`), never built as a ``Tq × Tk`` tensor. ``vector`` and
    ``reverse`` ``[V0, V1, G, L]``: the vector and its reverse in the work's layout (see
    ``_BlockWork.positions``), G query heads stacked as rows of ``rows`` each; ``first``: the
    index in ``vector`` of row 0's bias for key 0 (row i's bias for key j is at ``first + j −
    i``); ``span``: the keys."""

    vector: torch.Tensor
    reverse: Optional[torch.Tensor]
    first: int
    rows: int
    span: int

    def natural(self, rows: slice = slice(None), keys: slice = slice(None)) -> torch.Tensor:
        """The bias of rows ``rows`` (of each head's ``rows``) and keys ``keys``, built:
        ``[V0, V1, G·r, k]``. Read as a view with rows reversed (row r is query row ``rows −
        1 − r``, entry ``(r, j)`` at ``first − (rows − 1) + r + j``), then put in order."""
        v, n = self.vector, self.rows
        start, stop, _ = rows.indices(n)
        skewed = v.as_strided((*v.shape[:3], n, self.span), (*v.stride()[:3], 1, 1),
                              v.storage_offset() + self.first - (n - 1))  # [V0, V1, G, n, span]
        return skewed[..., n - stop:n - start, keys].flip(3).flatten(2, 3)  # [V0, V1, G·r, k]

    def backwards(self, member: int) -> torch.Tensor:
        """The bias of head ``member`` (of the G stacked) with the keys in reverse order, as a
        view ``[V0, V1, rows, span]`` of the reversed vector: key ``j'`` is key ``span − 1 −
        j'``, so entry ``(i, j')`` is ``reverse[L − first − span + i + j']``, strides 1 and 1
        (which torch's fused kernel takes as its additive mask as is)."""
        v = self.reverse
        return v.as_strided((v.shape[0], v.shape[1], self.rows, self.span),
                            (v.stride(0), v.stride(1), 1, 1),
                            v.storage_offset() + member * v.stride(2)
                            + v.shape[-1] - self.first - self.span)


def _spread(vector: torch.Tensor) -> float:
    """The largest range (max − min) of a position vector ``[1|B, Hq, L]`` over one head."""
    if vector.shape[-1] == 0:
        return 0.0
    return float((vector.amax(-1) - vector.amin(-1)).max())


def _position_tile(problem: Problem, work, positions: Optional[Positions], batch: int,
                   rows: tuple[int, int], seg: Segment) -> Optional[PositionTile]:
    """The :class:`PositionTile` of query rows ``rows`` (local) over segment ``seg``, or
    ``None`` without position biases."""
    if positions is None:
        return None
    first = (problem.kv_offset + seg.start) - (problem.q_offset + rows[0]) + problem.space.q_len - 1
    reverse = None if positions.backwards is None else work.positions(positions.backwards, batch)
    return PositionTile(work.positions(positions.vector, batch), reverse, first, rows[1] - rows[0],
                        seg.stop - seg.start)


def _add_position_grad(grad_vector: torch.Tensor, grad_scores: torch.Tensor, first: int) -> None:
    """Add one segment's score gradient ``[B, Hq, n, span]`` (where biases are added) into the
    position vector's gradient ``[1|B, Hq, L]``, summed along each diagonal ``j − i``: row i's
    key j goes to index ``first + j − i`` (``first``: see :class:`PositionTile`). The rows
    are laid out skewed in a zero buffer ``[B, Hq, n, n + span]`` (one spare column keeps
    them apart) so that each diagonal becomes a column, then summed over the rows."""
    batch, heads, n, span = grad_scores.shape
    width = n + span
    skewed = grad_scores.new_zeros(batch, heads, n, width)
    skewed.as_strided((batch, heads, n, span), (heads * n * width, n * width, width - 1, 1),
                      n - 1).copy_(grad_scores)  # row i, key j → column j − i + n − 1
    sums = skewed.sum(2)[..., :width - 1]  # [B, Hq, n + span − 1]
    if grad_vector.shape[0] == 1:
        sums = sums.sum(0, keepdim=True)
    grad_vector[..., first - (n - 1):first + span] += sums


def _add_position_param_grads(problem: Problem, grad_vector: torch.Tensor, params: list) -> None:
    """Add the slopes' and tables' gradients into their accumulators (``params``: ``(tensor,
    accumulator)`` pairs) from the position vector's gradient ``[1|B, Hq, L]``, through the
    vector's construction (:meth:`Modifiers.pull_back`, O((Tq + Tk)·H))."""
    modifiers = problem.modifiers
    wanted = {id(t) for t, _ in params}
    found = modifiers.pull_back(lambda m: (m.position_bias(problem.space, grad_vector.dtype),),
                                (grad_vector,), [id(t) in wanted for t in modifiers.tensors])
    by_id = {id(t): grad for t, grad in zip(modifiers.tensors, found)}
    for tensor, total in params:
        if by_id.get(id(tensor)) is not None:
            total += by_id[id(tensor)]
