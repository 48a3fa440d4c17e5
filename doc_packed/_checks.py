"""Argument validation for the public API: every rule raises before any kernel runs.

Shape, dtype, device and layout rules look at metadata only, so they are free under
``torch.compile``; there a failed check becomes :func:`argument_error` in the graph, so the
compiled call raises the same error (see :func:`doc_packed.api.doc_packed_attn`). Messages are
built with :func:`describe`, which dynamo can trace. Rules on the *values* of ``cu_seqlens`` live
in :mod:`doc_packed._doc_layout`, which validates every layout before caching it
(docs/contract.md).
"""

from __future__ import annotations

import math
import operator
import re
import sys

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# GPU kernels take cu_seqlens, windows and lengths as 32-bit ints, so no row, document or window
# is longer than this (an int64 cu_seqlens is accepted, its values must fit); a larger value
# would wrap instead of failing
INT32_MAX = 2**31 - 1
CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _scalar(x: object) -> str:
    if isinstance(x, str):
        return f"'{x}'"
    if x is None or isinstance(x, (int, float)):
        return f"{x}"
    return f"a {type(x).__name__}"


def describe(x: object) -> str:
    """``x`` for an error message, built from pieces torch.compile can trace (``repr`` of some
    values is not), so a failed check reads the same compiled or not."""
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_scalar(e) for e in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    return _scalar(x)


def check_length(name: str, value: object) -> int:
    """A token count (``seq_len``): an int in ``[1, 2**31 - 1]`` (kernels take 32-bit lengths)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    assert isinstance(value, int)
    if not 1 <= value <= INT32_MAX:
        raise ValueError(f"{name} must be in [1, 2**31 - 1] (kernels take 32-bit lengths), got {value}")
    return value


def check_count(name: str, value: object) -> int:
    """A positive int (a group size)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    assert isinstance(value, int)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_cost(name: str, value: object) -> float:
    """A finite, non-negative real number (a planning weight or tolerance)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {describe(value)}")
    if isinstance(value, int) and abs(value) > sys.float_info.max:
        raise ValueError(f"{name} must be finite and >= 0, got an int too large for a float")
    number = float(value)
    if not 0 <= number < math.inf:  # also NaN
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return number


def check_int_rows(name: str, rows: object) -> list[list[int]]:
    """Document boundaries given as rows of integers (lists, tuples or arrays): at least one row of
    at least two, each an int in ``[0, 2**31 - 1]`` (what an int32 ``cu_seqlens`` holds). The
    ordering rules are :func:`doc_packed._doc_layout.validate_bounds`'s."""
    try:
        raw = [list(row) for row in rows]  # type: ignore[attr-defined]
        out = [[operator.index(x) for x in row] for row in raw]
    except TypeError:
        raise TypeError(f"{name} must be a tensor or rows of ints, got {describe(rows)}") from None
    if any(isinstance(x, bool) for row in raw for x in row):
        raise TypeError(f"{name} must hold ints, not bools")
    if not out or any(len(row) < 2 for row in out):
        raise ValueError(f"{name} as lists needs at least one row of at least two boundaries")
    if any(not 0 <= x <= INT32_MAX for row in out for x in row):
        raise ValueError(f"{name} entries must be in [0, 2**31 - 1] (int32)")
    return out


@torch.library.custom_op(
    "doc_packed::argument_error",
    mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,),  # it must raise at every call, never be replayed
)
def argument_error(like: torch.Tensor, kind: str, message: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Raises ``TypeError``/``ValueError(message)`` when it runs.

    Under ``torch.compile`` a failed check calls this op instead of raising while tracing (with
    ``fullgraph=True`` dynamo would turn the raise into ``Unsupported``), so the compiled call
    raises our error, before any kernel. Its fake returns ``(out, lse)`` shaped for ``like`` (q)
    so the code after the call traces."""
    raise (TypeError if kind == "TypeError" else ValueError)(message)


@argument_error.register_fake
def _(like, kind, message):
    lse_shape = (like.shape[0], like.shape[2], like.shape[1]) if like.dim() == 4 else (0,)
    return torch.empty_like(like), like.new_empty(lse_shape, dtype=torch.float32)


def check_cu_seqlens(cu_seqlens: object) -> torch.Tensor:
    """A ``[B, MAX_DOCS + 1]`` int32 or int64 tensor with ``B >= 1`` and ``MAX_DOCS >= 1`` (its
    values are checked by :mod:`doc_packed._doc_layout`, which also converts int64 once per
    layout)."""
    cu = _check_tensor("cu_seqlens", cu_seqlens)
    if cu.dtype not in CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu.dtype}")
    if cu.dim() != 2 or cu.shape[1] < 2 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [B, MAX_DOCS + 1] with B >= 1 and MAX_DOCS >= 1, got {tuple(cu.shape)}")
    return cu


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_window(causal: bool, window_size: object) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(_is_int(w) for w in window_size):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {describe(window_size)}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size={(left, right)}: each side must be >= 0, or -1 for unbounded")
    if left > INT32_MAX or right > INT32_MAX:
        raise ValueError(
            f"window_size={(left, right)}: each side must be at most 2**31 - 1 (no document is "
            "longer: kernels take 32-bit lengths); use -1 for unbounded"
        )
    if causal and right > 0:
        raise ValueError(
            f"window_size={(left, right)} has a right window {right} > 0 but causal=True; "
            "use causal=False for a window that looks ahead"
        )
    return left, (0 if causal else right)


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, shard: bool = False
) -> None:
    """Ranks, shapes, dtypes, devices and memory layout of the four tensors. Any strides with a
    contiguous head dim: ``[B, H, S, D].transpose(1, 2)`` (SDPA's and flex's layout) is taken as
    it lies when ``B == 1`` and copied once per pass when the batch and sequence dims cannot
    merge into one token dim (docs/kernels.md)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        _check_tensor(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {tuple(t.shape)}")
    B, S, Hq, D = q.shape
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share q's [B, S] = {(B, S)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share [B, S, H_kv] (v's head dim may differ)")
    if k.shape[3] != D:
        raise ValueError(f"k's head dim {k.shape[3]} must equal q's head dim {D}")
    _check_nonempty(q, {"B (batch)": B, "S (tokens per row)": 1 if shard else S, "H_q (heads)": Hq, "D (head dim)": D})
    check_gqa(Hq, k.shape[2])
    if v.shape[3] == 0:
        raise ValueError(f"v has an empty head dim: shape {tuple(v.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; expected one of float16, bfloat16, float32, float64")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.float64 and q.device.type != "cpu":
        raise TypeError("float64 is supported on CPU only")
    for name, t in (("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; use one device")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(
                f"{name} has stride {t.stride()}: the head dim must be contiguous (stride 1); "
                f"call .contiguous() on {name}"
            )
    check_cu_seqlens(cu_seqlens)
    if cu_seqlens.shape[0] != B:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} rows but q has batch size {B}")


def _check_nonempty(q: torch.Tensor, dims: dict[str, int], layout: str = "[B, S, H_q, D]") -> None:
    """Name the empty dimension of ``q`` (a context-parallel shard may hold 0 tokens)."""
    for name, size in dims.items():
        if size == 0:
            raise ValueError(f"q {layout} has {name} = 0: shape {tuple(q.shape)}; every dimension must be >= 1")


def check_gqa(Hq: int, Hkv: int) -> None:
    """q heads must be a whole multiple of k/v heads (GQA/MQA without repeating K/V)."""
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}: q heads must be a multiple of k/v heads (GQA)")


def check_varlen(q: object, k: object, v: object, cu_seqlens: object) -> None:
    """The shape rules of the packed (varlen) entry: ``q [T, H_q, D]``, ``k``/``v [T, H_kv, D]``,
    ``cu_seqlens [N + 1]`` int32/int64. Dtypes, devices and strides are then
    :func:`check_qkv`'s (on the one-row views); ``max_seqlen`` is :func:`check_max_seqlen_arg`'s."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        _check_tensor(name, t)
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    assert isinstance(cu_seqlens, torch.Tensor)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D packed [T, H, D], got shape {tuple(t.shape)} "
                "(rows [B, S, H, D] go to doc_packed_attn)"
            )
    T, Hq, D = q.shape
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share [T, H_kv] (v's head dim may differ)")
    if k.shape[0] != T:
        raise ValueError(f"k and v hold {k.shape[0]} tokens but q holds {T}; one cu_seqlens serves q and k/v")
    if k.shape[2] != D:
        raise ValueError(f"k's head dim {k.shape[2]} must equal q's head dim {D}")
    _check_nonempty(q, {"T (tokens)": T, "H_q (heads)": Hq, "D (head dim)": D}, "[T, H_q, D]")
    check_gqa(Hq, k.shape[1])
    if v.shape[2] == 0:
        raise ValueError(f"v has an empty head dim: shape {tuple(v.shape)}")
    if cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D [N + 1] with N >= 1 documents, got shape {tuple(cu_seqlens.shape)} "
            "(a [B, MAX_DOCS + 1] layout of rows goes to doc_packed_attn)"
        )


def check_max_seqlen_arg(max_seqlen: object, name: str = "max_seqlen") -> None:
    """``max_seqlen``: an int in ``[1, 2**31 - 1]`` or None. Eager calls only: under
    ``torch.compile`` reading the int would make dynamo guard on its value, so a new
    ``max_seqlen`` every step would recompile (the value is not used by any kernel)."""
    if max_seqlen is None:
        return
    if not _is_int(max_seqlen):
        raise TypeError(f"{name} must be an int or None, got {describe(max_seqlen)}")
    assert isinstance(max_seqlen, int)
    if not 1 <= max_seqlen <= INT32_MAX:
        raise ValueError(f"{name} must be in [1, 2**31 - 1], got {max_seqlen}")


CP_GLOBAL_HINT = (
    "; under context parallelism cu_seqlens is global: every rank passes the whole sequence's "
    "boundaries, not the part that falls in its own chunk"
)


def cp_layout_error(err: ValueError, seq_len: int, cp_size: int) -> ValueError:
    """A context-parallel call's error about where ``cu_seqlens`` ends: the likely cause is a rank
    passing the boundaries of its own chunk, so say that the length is the ranks' chunks together
    and that ``cu_seqlens`` is global. Other errors are returned as they are."""
    msg = str(err)
    if "must end at the sequence length" not in msg or CP_GLOBAL_HINT in msg:
        return err
    together = f"the sequence length {seq_len} ({cp_size} ranks' chunks of q together)"
    return ValueError(msg.replace(f"the sequence length {seq_len}", together) + CP_GLOBAL_HINT)


def varlen_layout_error(err: ValueError, tokens: int, cp_size: int | None) -> ValueError:
    """The packed entry's wording for an error about the values of its ``cu_seqlens``: the layout
    rules speak of row 0 of ``[B, MAX_DOCS + 1]`` and "the sequence length", where the caller
    passed a 1-D ``cu_seqlens`` and ``tokens`` tokens (``cp_size`` ranks: the whole sequence's,
    which a rank's chunk of ``cu_seqlens`` does not reach: :func:`cp_layout_error`'s hint)."""
    msg = str(err)
    if not msg.startswith("cu_seqlens[0] "):
        return err
    msg = "cu_seqlens " + msg[len("cu_seqlens[0] ") :]
    total = (
        f"T = {tokens}, the tokens in q"
        if cp_size is None
        else f"T = {tokens}, the whole sequence's tokens ({cp_size} ranks' chunks of q together)"
    )
    msg = msg.replace(" (unused slots repeat it)", "")
    msg = re.sub(r"the sequence length \d+( \(\d+ ranks' chunks of q together\))?", total, msg)
    if cp_size is not None and "must end at" in msg and CP_GLOBAL_HINT not in msg:
        msg += CP_GLOBAL_HINT
    return ValueError(msg)


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return float(head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if isinstance(scale, int) and scale > sys.float_info.max:  # float() would overflow
        raise ValueError("scale must be a positive finite float, got an int too large for a float")
    value = float(scale)
    if not 0 < value < math.inf:  # also NaN
        raise ValueError(f"scale must be a positive finite float, got {value}")
    return value


def check_variants(
    q: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    sinks: object,
    softcap: object,
    prefix_lens: object,
    return_max_logits: object,
) -> float:
    """The attention variants' metadata rules (docs/contract.md, "Variants"); returns the softcap
    as the op takes it (0.0: none). ``q`` is ``[B, S, H_q, D]`` and ``cu_seqlens`` ``[B, N + 1]``
    (the varlen entry passes its one-row views). The values of ``prefix_lens`` (each in
    ``[0, its document's length]``) are checked where the layout is read, before any kernel."""
    if not isinstance(return_max_logits, bool):
        raise TypeError(f"return_max_logits must be a bool, got {type(return_max_logits).__name__}")
    cap = 0.0
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if isinstance(softcap, int) and abs(softcap) > sys.float_info.max:
            raise ValueError("softcap must be a positive finite float, got an int too large for a float")
        cap = float(softcap)
        if not 0 < cap < math.inf:  # also NaN
            raise ValueError(f"softcap must be a positive finite float (None: no softcapping), got {cap}")
    if sinks is not None:
        t = _check_tensor("sinks", sinks)
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"sinks must be a floating tensor (one logit per q head), got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != q.shape[2]:
            raise ValueError(f"sinks must be [H_q] = [{q.shape[2]}] (one logit per q head), got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"sinks is on {t.device} but q is on {q.device}; use one device")
    if prefix_lens is not None:
        t = _check_tensor("prefix_lens", prefix_lens)
        if t.dtype not in CU_SEQLENS_DTYPES:
            raise TypeError(f"prefix_lens must be int32 or int64, got {t.dtype}")
        want = (cu_seqlens.shape[0], cu_seqlens.shape[1] - 1)
        if tuple(t.shape) != want:
            raise ValueError(
                f"prefix_lens must have one entry per document slot of cu_seqlens, shape {want}, got {tuple(t.shape)}"
            )
        if t.device != cu_seqlens.device:
            raise ValueError(f"prefix_lens is on {t.device} but cu_seqlens is on {cu_seqlens.device}; use one device")
        if not causal:
            raise ValueError(
                "prefix_lens needs causal=True: a prefix makes the start of each document bidirectional "
                "inside an otherwise causal mask (with causal=False every key of the document is visible already)"
            )
    return cap


def check_varlen_prefix(prefix_lens: object, cu_seqlens: torch.Tensor) -> None:
    """The varlen entry's ``prefix_lens``: None or a 1-D ``[N]`` tensor (one per document of the
    1-D ``cu_seqlens``); dtype, device and causality are :func:`check_variants`'s."""
    if prefix_lens is None:
        return
    t = _check_tensor("prefix_lens", prefix_lens)
    if t.dim() != 1 or t.shape[0] != cu_seqlens.shape[0] - 1:
        raise ValueError(
            f"prefix_lens must be 1-D [N] = [{cu_seqlens.shape[0] - 1}] (one per document of cu_seqlens), "
            f"got shape {tuple(t.shape)}"
        )
