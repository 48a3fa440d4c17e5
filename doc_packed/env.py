"""Which attention backends this machine can run, and which one a call gets.

``python -m doc_packed.env`` prints torch's version, the device, and per backend whether it
is usable here (for a bf16, head dim 128, GQA 4:1 probe) or why not, e.g.
``fa4: not usable: needs the flash-attn-4 package (pip install 'doc-packed[fa4]')``, and
whether AutoParallel imports (with the real import error when it does not).
:func:`backend_for` answers the same for real inputs: the backend ``doc_packed_attn`` runs.
"""

from __future__ import annotations

import importlib.metadata

import torch

from . import kernels
from ._checks import check_qkv, check_window

__all__ = ["autoparallel_status", "backend_for", "backend_reasons", "call_reasons", "report"]

AUTOPARALLEL_HINT = (
    "pip install -e '.[autoparallel]' and AutoParallel from its git repository, "
    "github.com/meta-pytorch/autoparallel (README, Install); the PyPI package named autoparallel is unrelated"
)


def backend_for(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    backend: str = "auto",
    v: torch.Tensor | None = None,
    softcap: float | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> str:
    """The kernel backend ``doc_packed_attn(q, k, v, cu_seqlens, ...)`` runs on these inputs.

    For a local (not context-parallel) call; validates like the op (``v`` defaults to ``k``'s
    shape; ``softcap`` and ``prefix_lens`` as the op takes them: variants change the choice) and
    raises the op's errors, including ``ValueError`` for a forced ``backend`` that cannot take
    the inputs. Reads ``cu_seqlens`` once per tensor (cached). Sinks never change the backend.
    """
    spec, flat, variant = _problem(q, k, cu_seqlens, causal, window_size, v, softcap, prefix_lens)
    return kernels.choose(backend, spec, flat, k.shape[2], variant)


def call_reasons(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    v: torch.Tensor | None = None,
    softcap: float | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> dict[str, str | None]:
    """Per backend, why it cannot run this local call (None: it can), variants included: e.g.
    ``fa4: takes no bidirectional prefixes ...`` for a call with ``prefix_lens``."""
    spec, flat, variant = _problem(q, k, cu_seqlens, causal, window_size, v, softcap, prefix_lens)
    return kernels.reasons(flat, spec, k.shape[2], variant)


def _problem(q, k, cu_seqlens, causal, window_size, v, softcap, prefix_lens):
    from ._checks import check_variants
    from .ops import _local_problem

    v = k if v is None else v
    check_qkv(q, k, v, cu_seqlens)
    left, right = check_window(causal, window_size)
    cap = check_variants(q, cu_seqlens, causal, None, softcap, prefix_lens, False)
    spec = _local_problem(cu_seqlens, q.shape[1], causal, left, right, prefix_lens)
    return spec, q, kernels.Variant.of(q, v, cap)


def backend_reasons(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    heads: tuple[int, int] = (32, 8),
) -> dict[str, str | None]:
    """Per backend, why it cannot run local calls of this kind here; None when it can."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.empty(0, heads[0], head_dim, dtype=dtype, device=device)
    return kernels.reasons(q, None, heads[1])


def _package_line() -> str:
    from .kernels import fa4

    try:
        version = importlib.metadata.version(fa4.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if fa4.available():
        from .kernels import fa4_launch

        replay = "on" if fa4_launch.enabled() else "off (DOC_PACKED_FA4_REPLAY=0)"
        adopt = fa4.adoption_status(version)
        return (
            f"{fa4.PACKAGE}: installed ({version or 'version unknown'}); launch replay (forward and backward) {replay}; "
            f"a new layout's first call adopted from other layouts' recordings: {adopt}"
        )
    return f"{fa4.PACKAGE}: not installed ({fa4.INSTALL_HINT})"


def autoparallel_status() -> tuple[bool, str]:
    """Whether AutoParallel and its solver (pulp) import here, and a line that says so: where it
    was found, or the import's own error (e.g. a missing NumPy, or the unrelated PyPI package)."""
    try:
        import autoparallel
        import autoparallel.api  # noqa: F401
        import pulp
    except Exception as err:  # any import failure is the answer, not a crash of the report
        return False, f"AutoParallel: does not import: {type(err).__name__}: {err} ({AUTOPARALLEL_HINT})"
    where = getattr(autoparallel, "__file__", None) or "?"
    return True, f"AutoParallel: imports ({where}; pulp {getattr(pulp, '__version__', '?')})"


def report() -> str:
    """The text ``python -m doc_packed.env`` prints."""
    from . import __version__

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    lines = [f"doc-packed {__version__}, torch {torch.__version__} ({cuda})"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"device: {torch.cuda.get_device_name()}, compute capability {major}.{minor}")
    else:
        lines.append("device: cpu (no CUDA device)")
    lines.append(_package_line())
    lines.append(autoparallel_status()[1])
    why = backend_reasons()
    lines.append("backends for bf16, head dim 128, GQA 4:1 (auto tries them in this order):")
    for name, reason in why.items():
        lines.append(f"  {name}: " + ("usable" if reason is None else f"not usable: {reason}"))
    first = next(name for name, reason in why.items() if reason is None)
    lines.append(f"auto would run {first} for such a call made on one device (not context parallel)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
