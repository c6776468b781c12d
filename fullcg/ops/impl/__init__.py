"""Attention implementations: the code that computes what the ``fullcg`` ops promise.

An implementation subclasses :class:`AttentionImpl` (``name``, ``forward``, and where it
needs them ``save_kv``, ``plan``, ``capture_safe``). The step's ``config.attention_impl``
picks one by name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

import torch

from fullcg.errors import ImplementationUnavailableError
from fullcg.ops.impl.base import AttentionImpl

__all__ = ["AttentionImpl", "register_implementation", "resolve_implementation", "available_implementations"]

logger = logging.getLogger(__name__)


_registry: dict[str, AttentionImpl] = {}
# Built-in implementations that are imported on first use (they may need optional packages).
_lazy: dict[str, str] = {
    "reference": "fullcg.ops.impl.reference",
    "triton": "fullcg.ops.impl.triton",
    "flashinfer": "fullcg.ops.impl.flashinfer",
}


def register_implementation(impl: AttentionImpl) -> None:
    """Make ``impl`` selectable as ``FullCGConfig(attention_impl=impl.name)``."""
    if not isinstance(impl, AttentionImpl):
        raise TypeError(
            f"an attention implementation must subclass fullcg.ops.impl.AttentionImpl, got {type(impl).__name__}"
        )
    if not isinstance(impl.name, str) or not impl.name:
        raise TypeError(f"{type(impl).__name__}.name must be a non-empty str, got {impl.name!r}")
    if impl.name == "auto":
        raise ValueError("'auto' is reserved: it picks an implementation by device")
    _registry[impl.name] = impl


def available_implementations() -> list[str]:
    return sorted({*_registry, *_lazy})


@functools.lru_cache(maxsize=None)
def _auto_names(device_type: str) -> tuple[str, ...]:
    """What ``auto`` tries, best first: on CUDA devices FlashInfer and the Triton kernels
    where installed (both can be captured in full graphs), then the reference.

    Cached: looking a package up on sys.path costs more than a whole op call.
    """
    names = []
    if device_type == "cuda":
        names = [name for name, package in (("flashinfer", "flashinfer"), ("triton", "triton"))
                 if importlib.util.find_spec(package) is not None]
    return (*names, "reference")


def resolve_implementation(
    name: str, device: torch.device, head_dim: int | None = None, v_head_dim: int | None = None
) -> AttentionImpl:
    """The implementation called ``name``; ``auto`` picks the best one for ``device`` that
    takes these head dims (any, when not given): on CUDA with FlashInfer and Triton both
    installed, :class:`fullcg.ops.impl.auto.AutoAttention`, which picks per call."""
    if name == "auto":
        names = _auto_names(torch.device(device).type)
        found = [impl for impl in _loadable(names[:-1])
                 if head_dim is None or impl.supports(head_dim, head_dim if v_head_dim is None else v_head_dim)]
        if len(found) == 2:
            return _auto_pair(*found)
        return found[0] if found else _load(names[-1])
    return _load(name)


@functools.lru_cache(maxsize=None)
def _loadable(names: tuple[str, ...]) -> tuple[AttentionImpl, ...]:
    """The implementations among ``names`` that import; ``auto`` passes over (and logs) one
    whose package is installed but broken, rather than failing every step."""
    found = []
    for name in names:
        try:
            found.append(_load(name))
        except ImplementationUnavailableError as exc:
            logger.warning("fullcg: attention_impl='auto' passes over %r: %s", name, exc)
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _auto_pair(flashinfer: AttentionImpl, triton: AttentionImpl) -> AttentionImpl:
    from fullcg.ops.impl.auto import AutoAttention

    return AutoAttention(flashinfer, triton)


def _load(name: str) -> AttentionImpl:
    impl = _registry.get(name)
    if impl is None and name in _lazy:
        try:
            importlib.import_module(_lazy[name])  # registers itself
        except ModuleNotFoundError as e:  # a package it needs (its own ImportErrors already say what to do)
            raise ImplementationUnavailableError(
                f"attention implementation {name!r} cannot be imported: {e.name} is not installed "
                f"(pip install fullcg[{name}]; it needs a CUDA GPU); use attention_impl='reference' or 'auto'"
            ) from e
        except ImportError as e:
            raise ImplementationUnavailableError(str(e)) from e
        impl = _registry.get(name)
    if impl is None:
        raise ValueError(
            f"unknown attention implementation {name!r}; available: {', '.join(available_implementations())} "
            "(or register one with fullcg.ops.impl.register_implementation)"
        )
    return impl
