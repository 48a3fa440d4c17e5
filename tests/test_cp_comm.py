"""The context-parallel exchange (doc_packed.cp.comm) on gloo ranks: several fields in one
AllToAll-V, sent as runs of rows, each landing whole in its own buffer."""

import pytest
import torch

from cp_cases import exchange_fields


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_lands_every_field_from_every_peer(run_ranks, world):
    for got, want, split, want_split, empty in run_ranks(exchange_fields, world):
        assert len(got) == len(want) == 4 and empty == []
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(g, w)
        assert torch.equal(split[0], want_split)
