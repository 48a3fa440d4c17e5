"""Packed rows as orders of documents: the result type, first-fit, and padding to ``seq_len``."""

from __future__ import annotations

from typing import NamedTuple

from ..cp.plan import chunk_len

__all__ = ["PAD", "PAD_PIECE", "PackOrder", "first_fit", "pad_rows"]

PAD = -1  # the document index of padding segments and padding positions
PAD_PIECE = 64  # longest padding segment with cp_size (pairs wasted on padding: <= 64 per token)


class PackOrder(NamedTuple):
    """Rows as orders of document indices (:func:`doc_packed.data.pack_order`).

    Attributes:
        rows: per row, the index of each segment's document in order; :data:`PAD` (-1) for a
            padding segment.
        lengths: per row, the segment lengths in the same order (each row sums to ``seq_len``):
            ``cu_seqlens_from_lengths(order.lengths, seq_len)`` is the layout.
        padded: padding tokens over all rows.
    """

    rows: list[list[int]]
    lengths: list[list[int]]
    padded: int

    @property
    def padded_fraction(self) -> float:
        total = sum(sum(r) for r in self.lengths)
        return self.padded / total if total else 0.0


def first_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    return rows


def pad_rows(rows: list[list[int]], lens: list[list[int]], seq_len: int, cp_size: int | None = None) -> PackOrder:
    """Pad every row to ``seq_len``. For context parallelism, padding is cut at shard boundaries
    and into segments of at most ``PAD_PIECE`` tokens: as one document it would cost its
    length squared over 2 pairs of wasted work, all on the last rank."""
    padded = 0
    cs = chunk_len(seq_len, cp_size) if cp_size else seq_len
    for b, (order, ln) in enumerate(zip(rows, lens)):
        rest = seq_len - sum(ln)
        if rest > 0:
            order.append(PAD)
            ln.append(rest)
        if PAD not in order:
            continue
        padded += sum(n for i, n in zip(order, ln) if i == PAD)
        if cp_size:
            new_o, new_l, at = [], [], 0
            for i, n in zip(order, ln):
                if i != PAD:
                    new_o.append(i)
                    new_l.append(n)
                else:  # pieces of PAD_PIECE from each shard boundary, the last one shorter
                    end = at + n
                    while at < end:
                        stop = min(end, (at // cs + 1) * cs)
                        q, rem = divmod(stop - at, PAD_PIECE)
                        new_o += [PAD] * (q + (1 if rem else 0))
                        new_l += [PAD_PIECE] * q + ([rem] if rem else [])
                        at = stop
                    continue
                at += n
            rows[b], lens[b] = new_o, new_l
    return PackOrder(rows, lens, padded)
