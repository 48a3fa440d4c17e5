"""One attention call's arguments after its tensors, by name: the record the custom ops build
from their flat schema and hand down whole (the context-parallel runtime, the gradient rule).

Its own module so that :mod:`doc_packed.ops` and :mod:`doc_packed.cp` both import it and
neither imports the other for it (``ops`` holds the schema table, ``_SHARED``, and asserts the
two list the same names in the same order)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Call"]


class Call(NamedTuple):
    """The arguments both ops take after their tensors, by name (``ops._SHARED``'s order, so
    ``op(q, k, v, *call)`` passes them back positionally). Built once per call from the op's
    arguments and handed down whole: to the context-parallel runtime and the gradient rules."""

    cu_seqlens: torch.Tensor
    seq_len: int
    causal: bool
    window_left: int
    window_right: int
    scale: float
    backend: str
    cp_group: str | None
    planning_doc_len: int = 0  # planning_doc_len, planning_cp_dim: for cost estimates only
    planning_cp_dim: str | None = None
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
