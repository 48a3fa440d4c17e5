"""The CP-aware order: which packing passes to run, and which packing to keep (:func:`cp_order`).

One pass (:class:`doc_packed.data._packer.Packer`) places heavy documents, then the rest, then
closes the cells. Where that packing leaves documents out or moves queries, one more is tried in
which every column a heavy document's piece leaves room only for light documents *claims* the
lightest tokens it needs (the shortest documents held back for closing cells excluded): later
heavy documents count only on the rest, so no two columns are promised the same light documents
(:meth:`~doc_packed.data._packer.Packer._claim`). Where the claimed packing still moves queries
(or the first left documents out), its heavy documents are also *evened*: a last piece placed
for the fewest keys leaves its column just enough room for the lightest documents, and closing a
cell before a heavy document can shift it left (each token of shift puts a shard's length of
pairs more on a whole-shard piece); a shorter last piece (at most ``_EVEN_KEYS`` of all-gather's
keys more) moves work to the document's other pieces until the worst of its columns is lowest.
Last, a packing whose heaviest column is at most ``_CLAIM_BELOW`` over is brought under the
planner's tolerance where *trades between cells* can (:func:`doc_packed.data._trades.trade_cells`:
a document of that column for shorter ones of equal total length from a column with room; no
cell changes length and no straddling document moves, so the keys stay the same). One row of
few documents over two ranks is solved exactly instead (:mod:`doc_packed.data._two_shards`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cp.plan import TOLERANCE, chunk_len
from ._packer import LeftOut, Packer
from ._rows import PAD, first_fit, pad_rows
from ._trades import trade_cells
from ._two_shards import exact_applies, two_shards
from ._work import Docs, column_loads, straddle_keys

__all__ = ["best_pass", "cp_order"]

_PASSES = 2  # packing passes at most, the second aiming the columns the first one missed
_GOOD_ENOUGH = 0.004  # imbalance below which one pass is enough (the planner moves work above TOLERANCE)
_RETRY_BELOW = 0.05  # ... and above which a second pass does not help (measured)
_CLAIM_BELOW = 0.1  # claimed light tokens are tried below this imbalance (above it a document
# alone outweighs a column, and claims do not change that; measured on the bench grid)
_EVEN_KEYS = 0.002  # keys an even split may add to a heavy document's last rank, of all-gather's
_MIN_PER_SHARD = 3  # below this many documents per shard on average: first-fit rows (measured:
# at 2-3 the CP-aware rows were first-fit's in 7 of 9 bench cells, a trade in 2, and took 20-135 ms)


def cp_order(lengths: list[int], seq_len: int, c: int, causal: bool, left: int, right: int, n_rows: int | None):
    """``(rows, lengths, left out)``: each row's document indices in order (:data:`PAD` for
    padding a pass put inside the row) and their lengths (a row may end short of ``seq_len``:
    :func:`pad_rows` pads it), and the documents no row took. ``n_rows`` None:
    :func:`doc_packed.data.pack_order`'s batch, every document placed (first-fit where the CP-aware
    order cannot do better); else a streaming batch of that many rows, which may leave some out."""
    total = sum(lengths)
    R = n_rows if n_rows is not None else max(1, -(-total // seq_len))
    live = [n for n in lengths if n]
    few = total > len(live) * chunk_len(seq_len, c) // _MIN_PER_SHARD
    if n_rows is None and live and few and not exact_applies(c, R, causal, left, len(live), total, seq_len):
        # fewer than _MIN_PER_SHARD documents per shard on average: most must straddle, and
        # placing them one by one costs more than it gains; first-fit rows (the planner balances)
        fit = first_fit(lengths, seq_len)
        return fit, [[lengths[i] for i in r] for r in fit], []
    rows, lens, spill, loads = best_pass(
        lengths, seq_len, c, causal, left, right, R, n_rows is None, one_remedy=n_rows is None
    )
    fit = first_fit(lengths, seq_len) if n_rows is None else []

    if spill and n_rows is None:
        # some documents fit no cell: rather than rows of their own, take first-fit's rows and
        # order each row's documents alone (a row that still cannot close keeps first-fit order)
        rows, lens, loads = [], [], None
        for row in fit:
            sub = [lengths[i] for i in row]
            if R > 1:  # (one row of all the documents: its pass is the one that just left some out)
                one, one_lens, left_out, _ = best_pass(sub, seq_len, c, causal, left, right, 1, True)
                if not left_out:
                    rows.append([row[j] if j != PAD else PAD for j in one[0]])
                    lens.append(one_lens[0])
                    continue
            rows.append(list(row))
            lens.append(sub)
        spill = []
    if n_rows is None:
        # never worse than first-fit on the heaviest rank (a safety net for inputs the greedy
        # assignment handles badly; measured: long+short documents in several rows)
        fit_lens = [[lengths[i] for i in r] for r in fit]
        if len(fit) <= len(rows):
            if loads is None:
                done = pad_rows([list(r) for r in rows], [list(x) for x in lens], seq_len, c).lengths
                loads = column_loads(done, seq_len, c, causal, left, right)
            mine = max(loads)
            theirs = max(
                column_loads(
                    pad_rows([list(r) for r in fit], [list(x) for x in fit_lens], seq_len).lengths,
                    seq_len,
                    c,
                    causal,
                    left,
                    right,
                )
            )
            if theirs < mine:
                return fit, fit_lens, []
    return rows, lens, spill


def best_pass(
    lengths: list[int],
    seq_len: int,
    c: int,
    causal: bool,
    left: int,
    right: int,
    R: int,
    bail: bool = False,
    *,
    one_remedy: bool = False,
):
    """The better of up to ``_PASSES`` packings (fewest documents left out, then balance), and
    its owner-first column loads. Where the first leaves documents out or moves queries (and
    is within ``_CLAIM_BELOW`` of balance), one packing with claimed light tokens
    (:meth:`Packer._claim`) is tried too, and kept where it leaves fewer documents out, or as
    many and is no worse in balance and either moves no query or needs no more keys on any
    rank; kept at once if it moves no query. Its heavy documents are evened (``even``, see
    :meth:`Packer._best_end`) where the first left documents out; where it improved on the
    first but still moves queries, one more claimed packing with them evened is tried and kept
    on the same terms. A result that still moves queries gets :func:`trade_cells`, kept
    where they bring it within the planner's tolerance. With ``bail`` (the caller has no use for a packing
    that leaves documents out), a pass sure to leave one out stops there: that one is returned
    as the only one left out, with no rows. With ``one_remedy`` (:func:`pack_order`'s batch),
    the shifted pass is not tried after a claimed one: at most three packings (first, claimed,
    evened) before trades. On 600 draws (5 distributions, 8 x 128k and 1 x 1M, CP 4-64, seeds
    0-9) and the bench grid, a shifted pass after a claimed one on the batch never brought it
    within the planner's tolerance with nothing left out (13 tries; one draw's rows changed, 1.0486
    -> 1.0499, fewer queries moved), and it cost a whole pass (lognormal-512, 8 x 128k, CP 32,
    seed 9: 64 -> 45 ms, the same rows). Rows packed alone after a batch left documents out
    and streaming batches keep it: there it did help (1 of 10 single rows; 7 of bench_packing's
    16 streaming settings change without it, some for the worse)."""
    docs = Docs(lengths, causal, left, right)
    if exact_applies(c, R, causal, left, len(docs.live), docs.tokens, seq_len):
        got = two_shards(docs, seq_len)
        if got is not None:
            done = pad_rows([list(got[0])], [list(got[1])], seq_len, c).lengths
            return [got[0]], [got[1]], [], column_loads(done, seq_len, c, causal, left, right)
    args = (docs, lengths, seq_len, c, causal, left, right, R, bail)
    try:
        best = first = _pass(*args, None, False)
    except LeftOut as e:
        return [], [], [e.doc], None
    claimed = None
    tried_claim = (first[0][0] or first[0][1] > 1 + TOLERANCE) and first[0][1] <= 1 + _CLAIM_BELOW
    if tried_claim:
        # where the first left documents out, room is contested: heavy pieces are evened at once
        even = _even_keys(R, seq_len, c)
        try:
            claimed = _pass(*args, None, True, even if first[0][0] else None)
        except LeftOut:
            claimed = None
        if claimed is not None and not first[0][0] and (0, 1 + TOLERANCE) < claimed[0] < first[0]:
            # better than the first but still moving queries: again with heavy documents evened
            try:
                evened = _pass(*args, None, True, even)
            except LeftOut:
                evened = None
            if evened is not None and _better_claimed(evened, claimed, seq_len, c, causal, left, right):
                claimed = evened
        if claimed is not None and _better_claimed(claimed, first, seq_len, c, causal, left, right):
            if claimed[0] <= (0, 1 + TOLERANCE):
                return (*claimed[1], claimed[2])
        else:
            claimed = None
    shift = None
    for _ in range(0 if one_remedy and tried_claim else _PASSES - 1):
        score, loads = best[0], best[2]
        if not 1 + _GOOD_ENOUGH < score[1] <= 1 + _RETRY_BELOW:
            break  # balanced, or a document alone outweighs a column: another pass cannot help
        # the next pass aims each column lower by what the last one ended above the mean
        mean = sum(loads) / c
        shift = [(shift[r] if shift else 0.0) + (loads[r] - mean) for r in range(c)]
        try:
            got = _pass(*args, shift, False)
        except LeftOut:
            break
        if got[0] < best[0]:
            best = got
        else:
            break
    if claimed is not None and _better_claimed(claimed, best, seq_len, c, causal, left, right):
        best = claimed
    if not best[0][0] and 1 + TOLERANCE < best[0][1] <= 1 + _CLAIM_BELOW:
        traded = trade_cells(best[1][0], best[1][1], best[2], docs, seq_len, c)
        if traded is not None:  # no query moves now
            return traded[0], traded[1], best[1][2], traded[2]
    return (*best[1], best[2])


def _pass(
    docs: Docs,
    lengths: list[int],
    seq_len: int,
    c: int,
    causal: bool,
    left: int,
    right: int,
    R: int,
    bail: bool,
    shift: Sequence[float] | None,
    claim: bool,
    even: int | None = None,
):
    """One packing: ``(score, packing, loads, padded lengths)``, the score ``(documents left
    out, owner-first imbalance)``. Raises :class:`LeftOut` where ``bail`` stops it."""
    got = Packer(lengths, seq_len, c, causal, left, right, R, shift, docs, claim, bail, even).run()
    done = pad_rows([list(r) for r in got[0]], [list(x) for x in got[1]], seq_len, c).lengths
    loads = column_loads(done, seq_len, c, causal, left, right)
    mean = sum(loads) / c
    score = (len(got[2]), max(loads) / mean if mean else 1.0)
    return score, got, loads, done


def _even_keys(R: int, seq_len: int, c: int) -> int:
    """Keys a heavy document's last rank may receive from it where that evens its pieces'
    columns (:meth:`Packer._best_end`): ``_EVEN_KEYS`` of all-gather's per rank."""
    return int(_EVEN_KEYS * R * (seq_len - chunk_len(seq_len, c)))


def _better_claimed(new, old, seq_len: int, c: int, causal: bool, left: int, right: int) -> bool:
    """Whether the packing with claimed light tokens replaces ``old`` (see :func:`best_pass`)."""
    (spill, imb), (spill0, imb0) = new[0], old[0]
    if spill != spill0:
        return spill < spill0
    if imb > imb0:
        return False
    if imb <= 1 + TOLERANCE:
        return True  # no query moves now (some did)
    keys = straddle_keys(new[3], seq_len, c, causal, left, right)
    return keys <= straddle_keys(old[3], seq_len, c, causal, left, right)
