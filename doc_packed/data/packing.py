"""Packing documents into rows, optionally for context parallelism.

Documents in a packed row are independent, so which row holds a document and where it sits in
the row are free choices. With ``cp_size`` the packer uses them: rank ``r`` owns the ``r``-th
``torch.chunk`` of every row (:func:`doc_packed.cp.plan.owner_ranges`), and documents are placed
so that every rank's contiguous shards carry the same attention work (exact (query, key) pairs,
:mod:`doc_packed._mask`, what the planner counts) and shard boundaries fall between documents.
Then :func:`doc_packed.plan_context_parallel` moves no queries and only the few documents that
straddle a boundary send keys. Positions (per document) and labels are unchanged by the order.
Without ``cp_size`` it packs first-fit in the given order (the historical behaviour).

This module holds the public functions; the CP-aware order is :mod:`doc_packed.data._search`
(which passes to run and which packing to keep), :mod:`doc_packed.data._packer` (one pass),
:mod:`doc_packed.data._trades` and :mod:`doc_packed.data._two_shards` (remedies), over the work
counts of :mod:`doc_packed.data._work`; rows, first-fit and padding are
:mod:`doc_packed.data._rows`. docs/packing.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from .._checks import check_count, check_length, check_window
from ._rows import PAD, PackOrder, first_fit, pad_rows
from ._search import cp_order
from .boundaries import cu_seqlens_from_lengths

__all__ = ["PAD", "PackOrder", "Packed", "pack_order", "pack_documents", "pack_stream"]


class Packed(tuple):
    """Packed rows (:func:`pack_documents`): unpacks as ``(rows, cu_seqlens)``, as before, and
    carries what maps tokens back.

    Attributes:
        rows: ``[B, seq_len, ...]``, padding positions hold ``pad_value``.
        cu_seqlens: ``[B, max_docs + 1]`` int32; every padding segment is a document of its own.
        doc_index: ``[B, seq_len]`` int64, the index in ``documents`` of each position's
            document, :data:`PAD` (-1) for padding.
        padded_fraction: padding positions over all positions.
    """

    doc_index: torch.Tensor
    padded_fraction: float

    def __new__(cls, rows: torch.Tensor, cu_seqlens: torch.Tensor, doc_index: torch.Tensor, padded_fraction: float):
        obj = super().__new__(cls, (rows, cu_seqlens))
        obj.doc_index = doc_index
        obj.padded_fraction = padded_fraction
        return obj

    @property
    def rows(self) -> torch.Tensor:
        return self[0]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self[1]


def _check_lengths(lengths: object, seq_len: int) -> list[int]:
    try:
        out = [int(n) for n in lengths]  # type: ignore[attr-defined]
    except TypeError:
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}") from None
    for i, n in enumerate(out):
        if n < 0 or n > seq_len:
            raise ValueError(f"lengths[{i}] = {n}: each document must have 0 to seq_len={seq_len} tokens")
    return out


def _check_cp(cp_size: object) -> int | None:
    return None if cp_size is None else check_count("cp_size", cp_size)


def pack_order(
    lengths: Sequence[int],
    seq_len: int,
    *,
    cp_size: int | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
) -> PackOrder:
    """Rows of ``seq_len`` tokens as orders of the documents of ``lengths`` (each at most
    ``seq_len``), for loaders that pack themselves.

    Without ``cp_size``: first-fit in the given order. With ``cp_size``: every document once,
    rows and order chosen so that the ``torch.chunk`` shards of ``cp_size`` ranks carry equal
    attention work (counted for ``causal``/``window_size`` as the planner counts it, summed over
    the rows: the rows are meant to be planned together, as one batch) and shard boundaries fall
    between documents where the lengths allow. Deterministic: depends on the lengths only.
    """
    seq_len = check_length("seq_len", seq_len)
    c = _check_cp(cp_size)
    left, right = check_window(causal, window_size)
    ls = _check_lengths(lengths, seq_len)
    if c is None or c == 1:
        rows = first_fit(ls, seq_len)
        return pad_rows(rows, [[ls[i] for i in row] for row in rows], seq_len)
    rows, lens, _ = cp_order(ls, seq_len, c, causal, left, right, None)
    return pad_rows(rows, lens, seq_len, c)


def _split(documents: Sequence[torch.Tensor], seq_len: int, split_long: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Documents as pieces of at most ``seq_len`` tokens, and each piece's document index."""
    pieces, owner = [], []
    for i, d in enumerate(documents):
        if not isinstance(d, torch.Tensor) or d.dim() < 1:
            raise TypeError(f"documents[{i}] must be a tensor with a token dim first, got {type(d).__name__}")
        if d.shape[0] > seq_len and not split_long:
            raise ValueError(f"documents[{i}] has {d.shape[0]} tokens, more than seq_len={seq_len}")
        for p in d.split(seq_len) if d.shape[0] > 0 else []:
            pieces.append(p)
            owner.append(i)
    return pieces, owner


def _materialise(
    pieces: list[torch.Tensor], owner: list[int], order: PackOrder, seq_len: int, max_docs: int | None, pad_value
) -> Packed:
    tail = pieces[0].shape[1:]
    B = len(order.rows)
    out = torch.full((B, seq_len, *tail), pad_value, dtype=pieces[0].dtype)
    index = torch.full((B, seq_len), PAD, dtype=torch.int64)
    for b, (row, ln) in enumerate(zip(order.rows, order.lengths)):
        parts, at = [], 0
        for j, n in zip(row, ln):
            if j != PAD:
                parts.append(pieces[j])
                index[b, at : at + n] = owner[j]
            else:
                parts.append(out[b, at : at + n])
            at += n
        if parts:
            out[b] = torch.cat(parts, 0)
    cu = cu_seqlens_from_lengths(order.lengths, seq_len, max_docs=max_docs)
    return Packed(out, cu, index, order.padded_fraction)


def pack_documents(
    documents: Sequence[torch.Tensor],
    seq_len: int,
    *,
    cp_size: int | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    max_docs: int | None = None,
    pad_value: float | int = 0,
    split_long: bool = True,
) -> Packed:
    """Pack variable-length documents ``[L_i, ...]`` into rows ``[B, seq_len, ...]``.

    A document longer than ``seq_len`` is cut into pieces of at most ``seq_len`` tokens, each its
    own document (``split_long=False`` raises instead). Without ``cp_size``: first-fit in the
    given order, the unfilled tail of a row is padding. With ``cp_size``: the order of
    :func:`pack_order` (balanced ``torch.chunk`` shards for that many ranks, under the mask of
    ``causal``/``window_size``; the rows are one batch). Padding is ``pad_value`` and every
    padding segment is its own document. Returns :class:`Packed`
    ``(rows, cu_seqlens, doc_index, padded_fraction)``.
    """
    if not documents:
        raise ValueError("documents is empty")
    seq_len = check_length("seq_len", seq_len)
    pieces, owner = _split(documents, seq_len, split_long)
    if not pieces:
        raise ValueError("documents holds no tokens")
    order = pack_order([p.shape[0] for p in pieces], seq_len, cp_size=cp_size, causal=causal, window_size=window_size)
    return _materialise(pieces, owner, order, seq_len, max_docs, pad_value)


def pack_stream(
    documents: Iterable[torch.Tensor],
    seq_len: int,
    *,
    cp_size: int,
    rows: int = 1,
    lookahead: int = 4,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    max_docs: int | None = None,
    pad_value: float | int = 0,
) -> Iterator[Packed]:
    """Streaming :func:`pack_documents`: documents in, batches of ``rows`` packed rows out.

    Holds the next ``lookahead`` batches' worth of tokens (``lookahead * rows * seq_len``) and
    packs each batch from them: the oldest held documents worth half a batch always go in, the
    rest is a cross-section of everything held (every length class in proportion), which the
    CP-aware packer places; what it leaves stays for the next batch. A document passed over
    ``2 * lookahead`` times is placed by force (that batch is first-fit, oldest first, if the
    packer left it out), so a document is out within about ``4 * lookahead`` batches of being
    read (tests/test_packing.py checks ``4 * lookahead + 2``; docs/packing.md has the measured
    waits and what look-ahead buys). Documents longer
    than ``seq_len`` are split as in :func:`pack_documents`; ``doc_index`` counts documents
    from the start of the stream.
    """
    seq_len = check_length("seq_len", seq_len)
    c = check_count("cp_size", cp_size)
    rows = check_count("rows", rows)
    lookahead = check_count("lookahead", lookahead)
    left, right = check_window(causal, window_size)
    budget = lookahead * rows * seq_len
    held: list[tuple[torch.Tensor, int, int]] = []  # (piece, document index, batches passed over)
    tokens, index, done = 0, 0, False
    it = iter(documents)
    while True:
        while not done and tokens < budget:
            try:
                d = next(it)
            except StopIteration:
                done = True
                break
            pieces, _ = _split([d], seq_len, True)
            held += [(p, index, 0) for p in pieces]
            tokens += sum(p.shape[0] for p in pieces)
            index += 1
        if not held:
            return
        lens = [p.shape[0] for p, _, _ in held]
        overdue = {j for j, h in enumerate(held) if h[2] >= 2 * lookahead}
        placed = _stream_batch(lens, seq_len, c, causal, left, right, rows, overdue)
        order = pad_rows(placed[0], placed[1], seq_len, c if c > 1 else None)
        yield _materialise([p for p, _, _ in held], [i for _, i, _ in held], order, seq_len, max_docs, pad_value)
        taken = {j for r in order.rows for j in r if j != PAD}
        held = [(p, i, w + 1) for j, (p, i, w) in enumerate(held) if j not in taken]
        tokens = sum(p.shape[0] for p, _, _ in held)


def _stream_batch(
    lens: list[int], seq_len: int, c: int, causal: bool, left: int, right: int, rows: int, overdue: set[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """One batch of ``rows`` rows from held documents (indices into ``lens``, arrival order);
    the ``overdue`` ones (all among the oldest) must be placed."""
    cap = rows * seq_len
    pick: list[int] = []
    total = 0
    for i, n in enumerate(lens):  # the oldest half batch (at least one document) always goes in
        if pick and total + n > cap // 2:
            break
        pick.append(i)
        total += n
    chosen = set(pick)
    rest = sorted((i for i in range(len(lens)) if i not in chosen), key=lambda i: (-lens[i], i))
    want = cap + cap // 32 - total  # a little more than fits: the packer needs choice to fill exactly
    share = want / max(1, sum(lens[i] for i in rest))
    acc = 0.0
    for i in rest:  # systematic sample by tokens: every length class in proportion
        acc += lens[i] * min(1.0, share)
        if acc >= lens[i] / 2:
            pick.append(i)
            acc -= lens[i]
    sub = [lens[i] for i in pick]
    if c == 1:
        fit = first_fit(sub, seq_len)[:rows]
        got = [[pick[j] for j in r] for r in fit]
        return got, [[lens[i] for i in r] for r in got]
    rws, lns, _ = cp_order(sub, seq_len, c, causal, left, right, rows)
    placed = {pick[j] for r in rws for j in r if j != PAD}
    if not overdue <= placed:
        # an overdue document did not fit: first-fit, oldest first (keeps every wait bounded)
        fit = first_fit(sub, seq_len)[:rows]
        rws, lns = fit, [[sub[j] for j in r] for r in fit]
    return [[pick[j] if j != PAD else PAD for j in r] for r in rws], lns
