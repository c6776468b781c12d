"""The attention kernels a config needs, known and built before the first capture.

On a fresh machine the first step compiles every attention kernel it reaches: FlashInfer
JIT-builds its CUDA modules with nvcc (its FA2 module for a dtype and head dim, and on
Hopper each FMHAv2 module, 90-120 s apiece), and fullcg's Triton kernels compile (about a
second each). Reached inside the first CUDA-graph capture, that reads as a capture stalled
for minutes. This module knows which kernels a config needs and builds them first:

- :func:`layer_shapes` reads what the kernels depend on from a model's fullcg attention
  layers and their KV caches (:class:`LayerShape`: heads, head dims, dtype, page size,
  windows, soft-caps, skip-softmax, multi-head latent attention);
- :func:`plan_kernels` lists the kernels (:class:`Kernel`) the configured attention
  implementation runs for those shapes on a GPU of a given compute capability: for
  ``auto``, FlashInfer's modules for what FlashInfer serves and the Triton kernels it
  falls back to (the k/v save always, attention where skip-softmax or fp32 needs them);
- :func:`build_kernels` builds the ones not built yet. FlashInfer's modules go through its
  JIT specs, all in one ninja run (FlashInfer's own ``build_jit_specs``) on a background
  thread; meanwhile the Triton kernels are compiled, not launched, with the arguments the
  ``triton`` implementation plans for a stand-in step of each shape (its ``step_plan``),
  so that a real step's launch finds them compiled in this process, side by side on up to
  :data:`MAX_BUILD_THREADS` threads, each then loaded as its first launch would load it
  (its C launcher, which Triton builds with the host's compiler, and its GPU module). They are kept in
  ``<fullcg cache>/kernels/triton`` (:func:`kernel_dir`), whatever Triton cache directory
  Inductor has set, with a manifest of what was built for which GPU, Triton and kernel
  source: a later process loads them from there (milliseconds) and logs nothing;
- :func:`fused_kernels` lists the fused element-wise kernels (``fullcg.ops.fused``: RMSNorm,
  SiLU-and-multiply, rotary embedding) a model's modules launch on eager steps, which a
  model captured without a compiler replays; they are built the same way, each launched
  on stand-in rows of the model's widths;
- :func:`before_capture` plans and builds them for a model before its first capture; the step
  runner and capture without a compiler (which adds the fused kernels) call it, once per
  process and kernel set.

``python -m fullcg build-kernels`` builds the attention kernels of layers described by flags at
deploy time (README, "Deploying"), and with ``--compiler none`` the fused kernels of the widths
its flags give (:func:`fused_kernel`): it knows no modules, so a model whose modules launch
other widths (per-head q/k norms) has those built at its first capture.

Not covered (built on first use, as before): kernels that depend on how a model calls its
layers rather than on the layers, such as attention over given k/v in the chunked-prefix
pattern; per-call sinks (a layer without its own ``sinks`` is taken to return no LSE);
skip-softmax decode without ``SkipSoftmaxConfig.decode_split_tiles`` in eager steps, whose
Triton kernel is sized by each batch's page-table width (captured steps use the static
table's, which is planned for); under ``auto``, the Triton MLA kernel for steps too large
for FlashInfer's MLA plan.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fullcg import cache_trust
from fullcg.config import FullCGConfig
from fullcg.diagnostics import log_once
from fullcg.ops.impl import fmha_v2

if TYPE_CHECKING:
    from fullcg.context import ForwardContext
    from fullcg.kv_cache import KVCache

__all__ = [
    "LayerShape", "Kernel", "BuildResult", "KernelBuildError", "layer_shapes", "plan_kernels", "plan_for",
    "build_kernels", "before_capture", "kernel_dir", "fused_kernels", "fused_kernel",
]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
#: ``(head_dim, v_head_dim)`` FlashInfer's FA2 ragged prefill takes beyond equal dims: DeepSeek's
#: decompressed keys and values (``flashinfer.py``'s ``_DEEPSEEK_MHA_DIMS``).
_FLASHINFER_MHA_DIMS = (192, 128)
#: Multi-head latent attention's dims FlashInfer builds its MLA module for (``flashinfer_mla``).
_MLA_RANK, _MLA_ROPE = 512, 64
_FMHA_PAGED, _FMHA_ROWS = "Q_PAGED_KV_NHD", "CONTIGUOUS_Q_KV"
#: Stand-in factors and sizes for the probes: Triton specialises on none of these values.
_FACTOR, _SOFTCAP = 2.0, 30.0
_MANIFEST = "manifest.json"
_ENV_TRITON_CACHE = "TRITON_CACHE_DIR"


class KernelBuildError(RuntimeError):
    """Building a kernel ahead failed; the message names each failure and what to check."""


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What the attention kernels of one layer depend on.

    Attributes:
        num_heads: query heads (None where only the KV cache is known: then the Triton
            attention kernels, which specialise on the query heads per KV head, are left out).
        num_kv_heads, head_dim, v_head_dim, page_size, dtype: the KV cache's.
        attends: ``"cache"``, ``"latent"`` (multi-head latent attention's latent cache,
            ``KVCache.v_in_k``) or ``"given"`` (its MHA form: attention over given k/v only).
        sliding_window: the layer's window in keys (None: none); logit_softcap: capped scores.
        returns_lse: the layer asks for LSE (its own attention sinks).
        prefill_skip, decode_skip: the config gives the layer a skip-softmax factor.
        v_after_k: one allocation with V a whole number of pages after K (``KVCache.allocate``),
            which FlashInfer's FMHAv2 paged kernel needs.
        layer_id: a layer of this shape (for the probes' telemetry; not part of the shape).
    """

    num_heads: int | None
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype: torch.dtype
    attends: str = "cache"
    sliding_window: int | None = None
    logit_softcap: bool = False
    returns_lse: bool = False
    prefill_skip: bool = False
    decode_skip: bool = False
    v_after_k: bool = True
    layer_id: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel, or JIT module, a config needs.

    ``library`` is ``"flashinfer"`` or ``"triton"``; ``what`` the FlashInfer module kind
    (``fa2``, ``fmha_v2``, ``mla``, ``trtllm-gen``) or the Triton kernel's role (``save_kv``,
    ``prefill``, ``decode``, ``decode+save``, ...); ``args`` what else identifies it. Two
    kernels are the same kernel when these three agree. ``name`` says it in words and
    ``shape`` is a layer it is built for.
    """

    library: str
    what: str
    args: tuple[Any, ...]
    name: str = dataclasses.field(compare=False)
    shape: LayerShape | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What :func:`build_kernels` did: ``built`` now, ``ready`` already (FlashInfer modules on
    disk, Triton kernels loaded from the kernel cache), in ``seconds``."""

    built: tuple[Kernel, ...]
    ready: tuple[Kernel, ...]
    seconds: float


# ------------------------------------------------------------------------------ shapes


def layer_shapes(source: torch.nn.Module | Mapping[int, KVCache], config: FullCGConfig) -> tuple[LayerShape, ...]:
    """The distinct :class:`LayerShape` of a model's fullcg attention layers that hold a KV
    cache (``source`` a model), or of a ``layer_id -> KVCache`` map (query heads, windows,
    soft-caps and sinks then unknown). A :class:`fullcg.MLAAttention` layer adds its MHA
    form's shape when ``config.mla_mha_min_tokens`` and ``mla_mha_min_heads`` let its steps take it."""
    from fullcg.layer import Attention
    from fullcg.mla import MLAAttention

    found: dict[LayerShape, None] = {}
    if isinstance(source, torch.nn.Module):
        latent_parents = {id(m.attn): m for m in source.modules() if isinstance(m, MLAAttention)}
        for layer in source.modules():
            if not isinstance(layer, Attention) or layer.kv_cache is None:
                continue
            shape = _cache_shape(layer.kv_cache, config, layer.layer_id, layer.num_heads, layer.sliding_window,
                                 layer.logit_softcap is not None, layer.sinks is not None)
            found.setdefault(shape)
            parent = latent_parents.get(id(layer))
            if parent is not None and config.mla_mha_form_for(parent.num_heads):
                # The MHA form: every head its own key (nope + rope) and value, over given k/v.
                heads, qk_dim = parent.num_heads, parent.qk_nope_head_dim + parent.qk_rope_head_dim
                found.setdefault(dataclasses.replace(
                    shape, num_heads=heads, num_kv_heads=heads, head_dim=qk_dim, v_head_dim=parent.v_head_dim,
                    attends="given", returns_lse=True, v_after_k=False))
    else:
        for layer_id, cache in source.items():
            found.setdefault(_cache_shape(cache, config, layer_id, None, None, False, False))
    return tuple(found)


def _cache_shape(cache: KVCache, config: FullCGConfig, layer_id: int, heads: int | None, window: int | None,
                 softcap: bool, sinks: bool) -> LayerShape:
    prefill, decode = config.skip_softmax.factors_for(layer_id)
    return LayerShape(
        heads, cache.num_kv_heads, cache.head_dim, cache.v_head_dim, cache.page_size, cache.k.dtype,
        attends="latent" if cache.v_in_k else "cache", sliding_window=window, logit_softcap=softcap,
        returns_lse=sinks, prefill_skip=prefill is not None, decode_skip=decode is not None,
        v_after_k=fmha_v2.v_offset_pages(cache) is not None, layer_id=layer_id,
    )


# ------------------------------------------------------------------------------ the plan


def plan_kernels(
    shapes: Sequence[LayerShape],
    config: FullCGConfig,
    *,
    capability: tuple[int, int],
    flashinfer: bool | None = None,
    triton: bool | None = None,
    use_fmha_v2: bool = True,
    mla_backend: str | None = None,
    table_pages: int = 1,
) -> tuple[Kernel, ...]:
    """The kernels ``config.attention_impl`` runs for layers of ``shapes`` on a GPU of
    ``capability``, each once, in a stable order.

    ``flashinfer``/``triton``: whether they are installed (default: looked up), as
    ``attention_impl="auto"`` decides with. ``use_fmha_v2`` and ``mla_backend`` are the
    ``flashinfer`` implementation's settings of those names. ``table_pages``: the page-table
    width captured full graphs hold (``max_pages_per_request``, else the cache's pages),
    which sizes skip-softmax decode's Triton kernel when no ``decode_split_tiles`` is set.
    ``reference`` and implementations fullcg does not know need nothing built.
    """
    if flashinfer is None:
        flashinfer = importlib.util.find_spec("flashinfer") is not None
    if triton is None:
        triton = importlib.util.find_spec("triton") is not None
    planner = _Planner(config, tuple(capability), use_fmha_v2, mla_backend, max(1, table_pages))
    found: dict[Kernel, None] = {}
    for shape in shapes:
        impl = config.attention_impl
        if impl == "auto":  # as fullcg.ops.impl.resolve_implementation decides, for these head dims
            fi = flashinfer and _flashinfer_takes(shape.head_dim, shape.v_head_dim)
            tr = triton and _triton_takes(shape.head_dim, shape.v_head_dim)
            impl = "auto" if fi and tr else "flashinfer" if fi else "triton" if tr else "reference"
        kernels = {"triton": planner.triton, "flashinfer": planner.flashinfer, "auto": planner.auto}.get(impl)
        for kernel in (kernels(shape) if kernels is not None else ()):
            found.setdefault(kernel)
    return tuple(found)


#: The fused element-wise kernels' roles (``fullcg.ops.fused``); their args: (dtype, widths...).
_FUSED_ROLES = ("rms_norm", "silu_mul", "rotate_half")


def fused_kernel(role: str, dtype: torch.dtype, *widths: Any) -> Kernel | None:
    """The fused element-wise kernel of ``role`` for ``dtype`` and ``widths``: ``rms_norm``
    (columns, cast_before_weight), ``silu_mul`` (columns of the product), ``rotate_half``
    (half the head dim, query heads); None for a dtype the kernels do not take."""
    from fullcg.ops.fused import KERNEL_DTYPES

    if role not in _FUSED_ROLES:
        raise ValueError(f"unknown fused kernel role {role!r}; choose {', '.join(_FUSED_ROLES)}")
    if dtype not in KERNEL_DTYPES:
        return None
    dt = _dtype_name(dtype)
    if role == "rotate_half":
        what = f"{widths[1]} query heads of {2 * widths[0]}"
    elif role == "rms_norm":
        what = f"{widths[0]} columns, " + ("cast before the weight" if widths[1] else "weight in float32")
    else:
        what = f"{widths[0]} columns"
    return Kernel("triton", role, (dt, *widths), f"Triton fused {role} ({dt}, {what})")


def fused_kernels(model: torch.nn.Module) -> tuple[Kernel, ...]:
    """The fused element-wise kernels ``model``'s modules launch on eager steps, each once, in
    module order: fullcg's own Llama norms and MLPs, and the transformers modules
    ``fullcg.integrations.transformers.prepare`` switched to the fused ops. Only the float
    dtypes the kernels take; a module of another kind launches none."""
    from fullcg.integrations import eager_kernels
    from fullcg.models import llama

    found: dict[Kernel, None] = {}

    def add(role: str, dtype: torch.dtype, *args: Any) -> None:
        kernel = fused_kernel(role, dtype, *args)
        if kernel is not None:
            found.setdefault(kernel)

    for module in model.modules():
        if isinstance(module, llama.RMSNorm):
            add("rms_norm", module.weight.dtype, module.weight.shape[-1], False)
        elif isinstance(module, llama.LlamaMLP):
            add("silu_mul", module.down_proj.weight.dtype, module.down_proj.weight.shape[-1])
        for role, dtype, *args in eager_kernels.fused_kernel_specs(module):
            add(role, dtype, *args)
    return tuple(found)


def _flashinfer_takes(head_dim: int, v_head_dim: int) -> bool:
    """``FlashInferAttention.supports``, without importing FlashInfer."""
    return (head_dim in fmha_v2.HEAD_DIMS and v_head_dim == head_dim) or (head_dim, v_head_dim) in (
        _FLASHINFER_MHA_DIMS, (_MLA_RANK + _MLA_ROPE, _MLA_RANK))


def _triton_takes(head_dim: int, v_head_dim: int) -> bool:
    """``TritonAttention.supports``: multiples of 16 up to 256, or a latent and a rope part
    that are powers of two >= 16."""
    def dim(x: int) -> bool:
        return 16 <= x <= 256 and x % 16 == 0

    def pow2(x: int) -> bool:
        return x >= 16 and x & (x - 1) == 0

    return (dim(head_dim) and dim(v_head_dim)) or (
        head_dim > v_head_dim and pow2(v_head_dim) and pow2(head_dim - v_head_dim))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Planner:
    """The kernels of one layer shape per implementation (see :func:`plan_kernels`)."""

    def __init__(self, config: FullCGConfig, capability: tuple[int, int], use_fmha_v2: bool,
                 mla_backend: str | None, table_pages: int) -> None:
        self.skip = config.skip_softmax
        self.capability = capability
        self.use_fmha_v2 = use_fmha_v2
        self.mla_backend = mla_backend
        self.table_pages = table_pages

    # ---- per implementation

    def triton(self, shape: LayerShape) -> list[Kernel]:
        if shape.attends == "latent":
            roles = ["latent_save", "mla", "mla+save"]
        elif shape.attends == "given":
            roles = ["prefill (given k/v)", "prefill (prefix chunk)", "decode (given k/v)"]
        else:
            roles = ["save_kv", "prefill", "decode", "decode+save"]
        # The saves need no query heads; attention kernels specialise on them (None: unknown).
        return [self._triton(role, shape) for role in roles
                if role in ("save_kv", "latent_save") or shape.num_heads is not None]

    def flashinfer(self, shape: LayerShape) -> list[Kernel]:
        if shape.dtype not in _HALF:
            return []  # FlashInfer refuses other dtypes (auto runs them on Triton)
        dims = (shape.head_dim, shape.v_head_dim)
        if shape.attends == "latent":
            out = []
            if self._mla_served(shape):
                backend = self.mla_backend or _mla_backend_for(self.capability)
                out.append(Kernel("flashinfer", "mla", (backend, _dtype_name(shape.dtype), _MLA_RANK, _MLA_ROPE),
                                  f"FlashInfer MLA module ({backend}, {_dtype_name(shape.dtype)}, rank {_MLA_RANK} "
                                  f"+ rope {_MLA_ROPE})"))
            return out + [self._triton("save_kv", shape)]  # flashinfer_mla.save_latent: the Triton save
        if not (dims == _FLASHINFER_MHA_DIMS and shape.attends == "given") and not (
                dims[0] == dims[1] and dims[0] in fmha_v2.HEAD_DIMS):
            return []  # refused at run time, naming the implementations that take these dims
        window = shape.sliding_window is not None
        out = [self._fa2(shape.dtype, *dims, window, shape.logit_softcap)]
        if self._fmha_v2(shape):
            if shape.attends == "cache" and shape.v_after_k and fmha_v2.page_size_fits(shape.page_size, dims[0]):
                out.append(self._fmha(_FMHA_PAGED, shape.dtype))
            # Over rows: given k/v, or the cache's own new k/v when LSE or a prefill factor is asked for.
            if shape.attends == "given" or shape.returns_lse or shape.prefill_skip:
                out.append(self._fmha(_FMHA_ROWS, shape.dtype))
        if (shape.prefill_skip or shape.decode_skip) and self.capability >= (10, 0) and not window \
                and not shape.logit_softcap:
            out.append(Kernel("flashinfer", "trtllm-gen", (),
                              "FlashInfer trtllm-gen FMHA module (skip-softmax on SM100+)"))
        if shape.attends == "cache":
            out.append(self._triton("save_kv", shape))  # FlashInferAttention.save_kv: the Triton save
        return out

    def auto(self, shape: LayerShape) -> list[Kernel]:
        """FlashInfer where AutoAttention.choose gives it the calls, Triton where it falls back."""
        if shape.dtype not in _HALF:
            return self.triton(shape)
        if shape.attends == "latent":
            return self.flashinfer(shape) if self._mla_served(shape) else self.triton(shape)
        kernels = self.flashinfer(shape)
        if not any(k.library == "flashinfer" for k in kernels):
            return self.triton(shape)  # dims FlashInfer takes only elsewhere (192/128 over given k/v)
        if shape.attends == "cache" and (shape.prefill_skip or shape.decode_skip):
            # Skip-softmax calls FlashInfer does not honour (decode below SM100, captured
            # steps, mixed factors, windows): the Triton kernels.
            kernels += [k for k in self.triton(shape) if k.what != "save_kv"]
        return kernels

    # ---- pieces

    def _mla_served(self, shape: LayerShape) -> bool:
        """FlashInfer's MLA kernel takes these layers (``flashinfer_mla.refusal``, but for the batch)."""
        return ((shape.v_head_dim, shape.head_dim - shape.v_head_dim) == (_MLA_RANK, _MLA_ROPE)
                and shape.num_kv_heads == 1 and shape.dtype in _HALF and self.capability >= (8, 0)
                and shape.sliding_window is None and not shape.logit_softcap
                and not (shape.prefill_skip or shape.decode_skip))

    def _fmha_v2(self, shape: LayerShape) -> bool:
        """FMHAv2 runs some calls of these layers (``FlashInferAttention._fmha_v2_serves``)."""
        return (self.use_fmha_v2 and self.capability == (9, 0) and shape.dtype == torch.bfloat16
                and shape.sliding_window is None and not shape.logit_softcap
                and shape.head_dim == shape.v_head_dim and shape.head_dim in fmha_v2.HEAD_DIMS
                and (shape.num_heads is None or shape.num_heads % shape.num_kv_heads == 0))

    @staticmethod
    def _fa2(dtype: torch.dtype, head_dim: int, v_head_dim: int, window: bool, softcap: bool) -> Kernel:
        dims = f"{head_dim}" if head_dim == v_head_dim else f"{head_dim}/{v_head_dim}"
        flags = (", sliding window" if window else "") + (", soft-cap" if softcap else "")
        return Kernel("flashinfer", "fa2", (_dtype_name(dtype), head_dim, v_head_dim, window, softcap),
                      f"FlashInfer FA2 prefill/decode module ({_dtype_name(dtype)}, head dim {dims}{flags})")

    @staticmethod
    def _fmha(layout: str, dtype: torch.dtype) -> Kernel:
        return Kernel("flashinfer", "fmha_v2", (layout, _dtype_name(dtype)),
                      f"FlashInfer FMHAv2 {layout} module ({_dtype_name(dtype)})")

    def _triton(self, role: str, shape: LayerShape) -> Kernel:
        """A Triton kernel, identified by what its specialisation depends on for ``role``."""
        s, dt = shape, _dtype_name(shape.dtype)
        tiles = (self.skip.tile_q, self.skip.tile_kv, self.skip.decode_split_tiles)
        dims = f"{s.head_dim}" if s.head_dim == s.v_head_dim else f"{s.head_dim}/{s.v_head_dim}"
        heads = f"{s.num_heads}/{s.num_kv_heads} heads of {dims}"
        if role == "save_kv":
            if s.attends == "latent":  # FlashInfer's latent save writes whole rows as k and as v
                rows = (s.head_dim, s.head_dim)
            else:
                rows = (s.num_kv_heads * s.head_dim, s.num_kv_heads * s.v_head_dim)
            return Kernel("triton", role, (dt, *rows), f"Triton k/v save ({dt}, rows of {rows[0]}/{rows[1]})", s)
        if role == "latent_save":
            args = (dt, s.v_head_dim, s.head_dim - s.v_head_dim, s.page_size)
            return Kernel("triton", role, args, f"Triton latent save ({dt}, rank {args[1]} + rope {args[2]}, "
                                                f"page {s.page_size})", s)
        if role in ("mla", "mla+save"):
            args = (dt, s.num_heads, s.v_head_dim, s.head_dim - s.v_head_dim, s.page_size)
            return Kernel("triton", role, args, f"Triton {role} ({dt}, {s.num_heads} heads, rank {args[2]} + rope "
                                                f"{args[3]}, page {s.page_size})", s)
        skip = s.decode_skip if role.startswith("decode") else s.prefill_skip
        flags = ((", sliding window" if s.sliding_window is not None else "")
                 + (", soft-cap" if s.logit_softcap else "") + (", skip-softmax" if skip else ""))
        window: int | bool = s.sliding_window is not None
        table = 0
        if skip and role.startswith("decode") and self.skip.decode_split_tiles is None:
            # Unsplit skip-softmax decode runs one run over the keys it may see: a constant
            # sized by the page table's width and the window.
            window, table = s.sliding_window or False, self.table_pages
        page = s.page_size if s.attends == "cache" else 0
        args = (dt, s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim, page, window, s.logit_softcap, skip,
                *tiles, table)
        where = f", page {page}" if page else ""
        return Kernel("triton", role, args, f"Triton {role} ({dt}, {heads}{where}{flags})", s)


def _mla_backend_for(capability: tuple[int, int]) -> str:
    from fullcg.ops.impl import flashinfer_mla

    return flashinfer_mla.backend_for(capability)


def plan_for(shapes: Sequence[LayerShape], config: FullCGConfig, device: torch.device,
             table_pages: int = 1) -> tuple[Kernel, ...]:
    """:func:`plan_kernels` on CUDA ``device`` (its compute capability), with the registered
    ``flashinfer`` implementation's settings where FlashInfer is installed."""
    use_fmha_v2, mla_backend = True, None
    if importlib.util.find_spec("flashinfer") is not None:
        try:
            from fullcg.ops.impl import resolve_implementation

            impl = resolve_implementation("flashinfer", device)
            use_fmha_v2, mla_backend = bool(getattr(impl, "use_fmha_v2", True)), getattr(impl, "mla_backend", None)
        except Exception:  # a broken FlashInfer: auto passes over it, and so does the plan's build
            pass
    return plan_kernels(shapes, config, capability=torch.cuda.get_device_capability(device),
                        use_fmha_v2=use_fmha_v2, mla_backend=mla_backend, table_pages=table_pages)


# ------------------------------------------------------------------------------ building


def build_kernels(kernels: Sequence[Kernel], device: torch.device | str | int, config: FullCGConfig | None = None,
                  *, when: str = "") -> BuildResult:
    """Build ``kernels`` on CUDA ``device`` where they are not built yet (see the module
    docstring): FlashInfer's modules in one ninja run on a background thread, the Triton
    kernels meanwhile on this one. Logs one line naming what it builds before it starts
    (a warning when FlashInfer modules are among them: those take minutes), nothing when
    everything is built. ``config`` gives the skip-softmax tiles the Triton kernels are
    planned with and where the fullcg cache is (default: ``FullCGConfig.from_env()``);
    ``when`` is said in the log line after "building N attention kernels".

    Raises :class:`KernelBuildError` naming what failed, after building everything else.
    """
    start = time.perf_counter()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernels are built for a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = config if config is not None else FullCGConfig.from_env()
    flashinfer_kernels = [k for k in kernels if k.library == "flashinfer"]
    triton_kernels = [k for k in kernels if k.library == "triton"]
    failures: list[str] = []
    try:
        fi_todo = [k for k in flashinfer_kernels if not _flashinfer_built(k)]
    except Exception as exc:  # noqa: BLE001 - an installed FlashInfer that does not import
        failures.append(f"FlashInfer: {type(exc).__name__}: {exc}")
        flashinfer_kernels = fi_todo = []
    directory = kernel_dir(config)
    manifest = _Manifest(directory, device)
    tr_todo = [k for k in triton_kernels if not manifest.has(k)]
    todo = fi_todo + tr_todo
    if todo:
        where = ([f"FlashInfer's JIT cache {_flashinfer_jit_dir()}"] if fi_todo else []) + (
            [f"{_triton_dir(directory)}"] if tr_todo else [])
        logger.log(
            logging.WARNING if fi_todo else logging.INFO,
            "fullcg: building %d kernel(s)%s, once per machine (cached in %s)%s: %s",
            len(todo), when and f" {when}", " and ".join(where),
            "; each FlashInfer module takes a minute or more" if fi_todo else "",
            "; ".join(k.name for k in todo),
        )
    thread = None
    if fi_todo:
        thread = threading.Thread(target=_build_flashinfer, args=(fi_todo, failures), name="fullcg-flashinfer-build",
                                  daemon=True)
        thread.start()
    # Every Triton kernel is compiled or loaded here, built or not: a real launch looks in
    # the process's own cache first, then in Triton's directory, not in this one. An
    # interrupt here does not wait for the FlashInfer build: its thread is a daemon.
    _build_triton(triton_kernels, set(tr_todo), device, config, directory, manifest, failures)
    if thread is not None:
        thread.join()
    manifest.save()
    seconds = time.perf_counter() - start
    if failures:
        raise KernelBuildError("building attention kernels ahead failed: " + "; ".join(failures))
    if todo:
        logger.debug("fullcg: built %d kernel(s) in %.1f s", len(todo), seconds)
    ready = tuple(k for k in flashinfer_kernels + triton_kernels if k not in set(todo))
    return BuildResult(tuple(todo), ready, seconds)


# ---- FlashInfer


def _flashinfer_jit_dir() -> Path:
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_JIT_DIR)


def _flashinfer_uri(kernel: Kernel) -> str:
    """The module's name in FlashInfer's JIT cache (its ``get_*_uri`` functions, which
    generate no sources)."""
    return _flashinfer_jit(kernel, uri=True)


def _flashinfer_spec(kernel: Kernel) -> Any:
    """The module's JIT spec, with the arguments the ``flashinfer`` implementation's
    wrappers pass (int32 indices, q, k/v and output in one dtype, no rope, no fp16 QK
    reduction; the FA2 module serves paged, ragged and tensor-core decode alike)."""
    return _flashinfer_jit(kernel, uri=False)


def _flashinfer_jit(kernel: Kernel, *, uri: bool) -> Any:
    """FlashInfer's ``get_*_uri`` (``uri``) or ``gen_*_module`` for ``kernel``: one place
    for the arguments, so a module's name and its spec never disagree."""
    import flashinfer.jit as jit

    if kernel.what == "fa2":
        dtype, head_dim, v_head_dim, window, softcap = kernel.args
        dt = getattr(torch, dtype)
        fn = jit.get_batch_prefill_uri if uri else jit.gen_batch_prefill_module
        return fn("fa2", dt, dt, dt, torch.int32, head_dim, v_head_dim, 0, window, softcap, False)
    if kernel.what == "mla":
        backend, dtype, rank, rope = kernel.args
        dt = getattr(torch, dtype)
        fn = jit.get_batch_mla_uri if uri else jit.gen_batch_mla_module
        return fn(backend, dt, dt, dt, torch.int32, rank, rope, False)
    if kernel.what == "fmha_v2":
        layout, dtype = kernel.args
        if uri:  # as gen_fmha_v2_module names it
            short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
            return f"trtllm_fmha_v2_{layout.lower()}_{short}_{short}"
        return jit.gen_fmha_v2_module(layout, getattr(torch, dtype))
    if kernel.what == "trtllm-gen":
        return "fmha_gen" if uri else jit.gen_trtllm_gen_fmha_module()
    raise ValueError(f"unknown FlashInfer module kind {kernel.what!r}")


def _flashinfer_built(kernel: Kernel) -> bool:
    """Whether the module's library is in FlashInfer's JIT cache or its AOT directory: a
    look at two paths, where asking FlashInfer would generate the module's sources first."""
    from flashinfer.jit import env as jit_env

    uri = _flashinfer_uri(kernel)
    return any((Path(base) / uri / f"{uri}.so").exists()
               for base in (jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR))


def _build_flashinfer(kernels: Sequence[Kernel], failures: list[str]) -> None:
    """All modules in one ninja run (FlashInfer's ``build_jit_specs``: one job pool over
    every module's sources); each on its own where that function is missing."""
    try:
        specs = [_flashinfer_spec(k) for k in kernels]
        try:
            from flashinfer.jit import build_jit_specs
        except ImportError:
            for spec in specs:
                spec.build_and_load()
        else:
            build_jit_specs(specs, verbose=False)
    except Exception as exc:  # noqa: BLE001 - reported with the kernels' names
        output = str(exc).strip().splitlines()
        detail = "\n".join(output[-20:])  # ninja's output ends with the failing command's errors
        failures.append(f"FlashInfer ({', '.join(k.name for k in kernels)}): {type(exc).__name__}: {detail} "
                        "(check that nvcc and ninja are on PATH; FLASHINFER_JIT_VERBOSE=1 shows the build)")


# ---- Triton


def kernel_dir(config: FullCGConfig) -> Path | None:
    """``<fullcg cache>/kernels`` (the cache root of ``config.cache_dir``, else
    ``$FULLCG_CACHE_DIR``, else ``~/.cache/fullcg``), created if missing, where the Triton
    kernels built ahead and their manifest are kept; None when it fails the cache's trust
    check (warned about once) or cannot be written: Triton's own directory is used then."""
    from fullcg.compile_cache import cache_root

    root, shared = cache_root(config)
    usable = cache_trust.usable_dir(root, root / "kernels", trust_shared=shared, shared_modes=shared)
    if isinstance(usable, cache_trust.Untrusted):
        log_once(("kernel dir", str(root / "kernels")), logger, logging.WARNING,
                 "fullcg: not keeping attention kernels in %s: %s is %s (Triton's own cache directory is used "
                 "instead; see 'Caches and trust' in docs/configuration.md)", root / "kernels", usable.path,
                 usable.reason)
        return None
    if isinstance(usable, str):
        logger.info("fullcg: %s; Triton's own cache directory is used", usable)
        return None
    return usable


def _triton_dir(directory: Path | None) -> str:
    if directory is not None:
        return str(directory / "triton")
    return os.environ.get(_ENV_TRITON_CACHE) or os.path.expanduser("~/.triton/cache")


@contextlib.contextmanager
def _triton_cache_in(directory: Path | None) -> Iterator[None]:
    """Triton compiles into and loads from ``<directory>/triton`` inside (Triton reads the
    variable on every compile). Inductor points ``TRITON_CACHE_DIR`` at its own directory
    once it has compiled, so without this the same kernel would land in a different
    directory depending on what ran first, and a deploy-time build would not be found."""
    if directory is None:
        yield
        return
    with _env_lock:
        before = os.environ.get(_ENV_TRITON_CACHE)
        os.environ[_ENV_TRITON_CACHE] = str(directory / "triton")
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_ENV_TRITON_CACHE, None)
            else:
                os.environ[_ENV_TRITON_CACHE] = before


@functools.lru_cache(maxsize=None)
def _kernel_sources_digest() -> str:
    """A digest of the Triton kernels' source and of the implementation that plans their
    launches: a manifest entry from other sources says nothing about these."""
    import fullcg.ops.impl.triton as impl
    import fullcg.ops.kernels as kernels

    digest = hashlib.sha256()
    files = sorted(Path(kernels.__file__).parent.glob("*.py")) + [Path(impl.__file__)]
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class _Manifest:
    """Which Triton kernels were built into the kernel directory: a kernel's key (its role
    and arguments, the GPU's compute capability, Triton's version, the kernels' sources)
    and the metadata files Triton wrote for it. Built means listed with every file present."""

    def __init__(self, directory: Path | None, device: torch.device) -> None:
        self.path = directory / _MANIFEST if directory is not None else None
        self.triton_dir = directory / "triton" if directory is not None else None
        self.entries: dict[str, list[str]] = {}
        self.changed = False
        self._context = ""
        if self.path is None:
            return
        import triton

        major, minor = torch.cuda.get_device_capability(device)
        self._context = f"sm{major}{minor}|triton {triton.__version__}|{_kernel_sources_digest()}"
        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict):
                self.entries = {str(k): [str(p) for p in v] for k, v in loaded.items() if isinstance(v, list)}
        except (OSError, ValueError):
            pass  # none yet, or unreadable: everything counts as not built

    def key(self, kernel: Kernel) -> str:
        return json.dumps([kernel.what, [str(a) for a in kernel.args], self._context])

    def has(self, kernel: Kernel) -> bool:
        if self.path is None:
            return False
        files = self.entries.get(self.key(kernel))
        return bool(files) and all((self.triton_dir / f).exists() for f in files)

    def record(self, kernel: Kernel, compiled: Sequence[Any]) -> None:
        """Note the kernel built when every launch's files are in the kernel directory: one
        this process had compiled elsewhere before (Triton's cache directory set in code, or
        a launch before the build) would not be found there by the next process."""
        if self.path is None:
            return
        files = []
        for k in compiled:
            found = [p for name, p in (getattr(k, "metadata_group", None) or {}).items() if name.endswith(".json")]
            try:
                files += [str(Path(p).relative_to(self.triton_dir)) for p in found]
            except ValueError:
                return
            if not found:
                return
        if files:
            self.entries[self.key(kernel)] = files
            self.changed = True

    def save(self) -> None:
        """Merge with what other processes wrote meanwhile, write atomically."""
        if self.path is None or not self.changed:
            return
        try:
            current = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            current = {}
        current = current if isinstance(current, dict) else {}
        current.update(self.entries)
        tmp = self.path.with_name(f"{_MANIFEST}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(current, indent=0, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full or read-only disk costs the next start a log line, not this one
            logger.info("fullcg: could not write %s: %s", self.path, exc)


#: A Triton kernel's role -> the stand-in step that plans it, and the part of that step's plan it is.
_ROLES = {
    "save_kv": ("save", "save"),
    "prefill": ("cache_mixed", "prefill"),
    "decode": ("cache_mixed", "decode"),
    "decode+save": ("cache_decode", "decode"),
    "latent_save": ("latent_mixed", "save"),
    "mla": ("latent_mixed", "attend"),
    "mla+save": ("latent_decode", "attend"),
    "prefill (given k/v)": ("given_causal", "prefill"),
    "decode (given k/v)": ("given_causal", "decode"),
    "prefill (prefix chunk)": ("given_chunk", "prefill"),
}


def _build_triton(kernels: Sequence[Kernel], todo: set[Kernel], device: torch.device, config: FullCGConfig,
                  directory: Path | None, manifest: _Manifest, failures: list[str]) -> None:
    probes: dict[tuple[str, LayerShape], list[tuple[str, Any, tuple[Any, ...]]]] = {}
    # One stand-in step per kind and shape serves several kernels; its page table is as wide
    # as the widest any of them is planned with (only unsplit skip-softmax decode has one).
    tables: dict[tuple[str, LayerShape | None], int] = {}
    for kernel in kernels:
        if kernel.what in _ROLES:
            key = (_ROLES[kernel.what][0], kernel.shape)
            tables[key] = max(tables.get(key, 1), _table_pages(kernel))
    with _triton_cache_in(directory), torch.cuda.device(device):
        planned: list[tuple[Kernel, list[tuple[Any, tuple[Any, ...]]]]] = []
        for kernel in kernels:
            try:
                if kernel.what in _FUSED_ROLES:
                    launches = [(_fused_launch(kernel, device), ())]
                else:
                    probe, part = _ROLES[kernel.what]
                    key = (probe, kernel.shape)
                    if key not in probes:
                        probes[key] = _probe(probe, kernel.shape, device, config, tables[key])
                    launches = [(launch, leading) for p, launch, leading in probes[key] if p == part]
                if not launches:
                    raise RuntimeError(f"the {probe} stand-in step planned no {part} launch")
                planned.append((kernel, launches))
            except Exception as exc:  # noqa: BLE001 - reported with the kernel's name
                failures.append(f"{kernel.name}: {type(exc).__name__}: {exc}")
        for kernel, compiled in _compile_all(planned, failures, device):
            if kernel in todo:
                manifest.record(kernel, compiled)


#: The most threads that compile Triton kernels at once. Triton's compiler releases the GIL
#: in its MLIR and LLVM passes and runs ``ptxas`` as a subprocess, so a config's handful of
#: kernels compile side by side; only the parse of each kernel's Python source is serial.
MAX_BUILD_THREADS = 8


def _compile_all(planned: Sequence[tuple[Kernel, Sequence[tuple[Any, tuple[Any, ...]]]]], failures: list[str],
                 device: torch.device | None = None) -> list[tuple[Kernel, list[Any]]]:
    """Compile every planned launch, then load each compiled kernel as its first launch
    would (its launcher, a C module Triton builds with the host's compiler, a few tenths of
    a second each on a fresh machine, and its module on ``device``), all on up to
    :data:`MAX_BUILD_THREADS` threads where Triton compiles asynchronously
    (``AsyncCompileMode``); ``(kernel, compiled)`` for each kernel all of whose launches
    compiled and loaded, a failure noted for each of the others."""
    from fullcg import source_keys

    # The first compile needs Triton's source key and its driver: the background thread's,
    # if one is making them; the other compiles find them made.
    source_keys.wait_for_triton()
    launches = sum(len(ls) for _, ls in planned)
    threads = min(MAX_BUILD_THREADS, os.cpu_count() or 1, launches)
    pool = None
    pending: list[tuple[Kernel, list[Any]]] = []
    done: list[tuple[Kernel, list[Any]]] = []
    try:
        if threads > 1 and not _interpreted():
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(threads, thread_name_prefix="fullcg-triton-build")
        # In a copy of the caller's context: Triton keeps its asynchronous mode in a context
        # variable, so ours is seen by these compiles alone, a caller's mode never takes them,
        # and an interrupt or a failing compile hook part-way leaves no mode behind.
        try:
            contextvars.copy_context().run(_submit, planned, pool, pending, failures)
        except Exception as exc:  # noqa: BLE001 - a hook as compiles finished; each kernel's result says more below
            failures.append(f"finishing Triton's compiles: {type(exc).__name__}: {exc}")
        for kernel, compiled in pending:
            try:
                done.append((kernel, [k.result() if hasattr(k, "result") else k for k in compiled]))
            except Exception as exc:  # noqa: BLE001 - reported with the kernel's name
                failures.append(f"{kernel.name}: {type(exc).__name__}: {exc}")
        unique = list({id(k): k for _, compiled in done for k in compiled if k is not None}.values())
        loaded = (pool.map if pool is not None else map)(_load, unique, [device] * len(unique))
        errors = {id(k): error for k, error in zip(unique, loaded) if error is not None}
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    kept = []
    for kernel, compiled in done:
        error = next((errors[id(k)] for k in compiled if id(k) in errors), None)
        if error is None:
            kept.append((kernel, compiled))
        else:
            failures.append(f"{kernel.name}: {error}")
    return kept


def _submit(planned: Sequence[tuple[Kernel, Sequence[tuple[Any, tuple[Any, ...]]]]], pool: Any,
            pending: list[tuple[Kernel, list[Any]]], failures: list[str]) -> None:
    """Start every planned launch's compile, on ``pool`` under an asynchronous compile mode
    of this context's own where Triton has one (else one at a time, here), and wait for them."""
    mode = None
    try:
        from triton.runtime import _async_compile

        _async_compile.active_mode.set(None)  # this context's: a caller's mode stays the caller's
        if pool is not None:
            mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
    except (ImportError, AttributeError):  # a Triton without asynchronous compiles: one at a time
        mode = None
    with mode if mode is not None else contextlib.nullcontext():
        for kernel, kernel_launches in planned:
            try:
                pending.append((kernel, [_compile(launch, leading) for launch, leading in kernel_launches]))
            except Exception as exc:  # noqa: BLE001 - reported with the kernel's name
                failures.append(f"{kernel.name}: {type(exc).__name__}: {exc}")


def _load(compiled: Any, device: torch.device | None) -> str | None:
    """Make ``compiled``'s launcher and load its module, as Triton does at its first launch
    (``CompiledKernel._init_handles``), on ``device``; what failed, or None."""
    init = getattr(compiled, "_init_handles", None)
    if init is None:
        return None
    try:
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            init()
    except Exception as exc:  # noqa: BLE001 - reported with the kernel's name
        # Triton sets the launcher before loading the module: a load that failed (out of
        # memory, say) would leave a launcher without a function for the first launch to
        # call. Cleared, that launch loads again and raises the load's own error. (A kernel
        # over the GPU's limits keeps the launcher Triton made to raise that error.)
        if getattr(compiled, "module", None) is None and not isinstance(getattr(compiled, "_run", None),
                                                                         functools.partial):
            compiled._run = None
        return f"{type(exc).__name__}: {exc}"
    return None


def _interpreted() -> bool:
    from fullcg.ops.kernels import launch as launch_module

    return bool(launch_module._INTERPRET)


def _fused_launch(kernel: Kernel, device: torch.device) -> Any:
    """A fused kernel's launch on two stand-in rows laid out as the modules' steps lay them
    out: rows of a norm's width, the gate and up halves of one product, q, k and v heads of
    one product. Triton specialises on the dtypes, the constexprs and which integers are 1 or
    multiples of 16, which the real rows share at widths that are multiples of 16."""
    from fullcg.ops.kernels import fused as kernels

    dtype = getattr(torch, kernel.args[0])
    empty = functools.partial(torch.empty, dtype=dtype, device=device)
    if kernel.what == "rms_norm":
        cols, cast_before_weight = kernel.args[1:]
        x = empty(2, cols)
        return kernels.rms_norm_launch(x, empty(cols), empty(2, cols), 1e-6, 0.0, cast_before_weight)
    if kernel.what == "silu_mul":
        cols = kernel.args[1]
        gate, up = empty(2, 2 * cols).chunk(2, dim=-1)
        return kernels.silu_mul_launch(gate, up, empty(2, cols))
    half, q_heads = kernel.args[1:]
    qkv = empty(2, q_heads + 2, 2 * half)
    angles = empty(2, 2 * half)
    return kernels.rotate_half_launch(qkv[:, :q_heads], qkv[:, q_heads:q_heads + 1], angles, angles,
                                      empty(2, q_heads, 2 * half), empty(2, 1, 2 * half))


def _table_pages(kernel: Kernel) -> int:
    """The page-table width a Triton kernel is planned with: an attention kernel's last
    argument (0 where its specialisation does not depend on it), at least one page."""
    if kernel.what.startswith(("prefill", "decode")):
        return max(1, int(kernel.args[-1]))
    return 1


def _compile(launch: Any, leading: tuple[Any, ...]) -> Any:
    """Compile (or load) a planned launch's specialisation without launching it. Triton's
    ``warmup`` binds the arguments exactly as the launch does (``Launcher._launch_jit``:
    the same positional arguments, constexprs by name, ``num_warps``, ``num_stages``), so
    the launch's cache key is this one and it finds the kernel compiled. Under the CPU
    interpreter there is nothing to compile."""
    if _interpreted():
        return None
    launcher = launch.launcher
    # Under an asynchronous compile mode this is a future (``result()`` gives the kernel).
    return launcher.fn.warmup(*leading, *launch.tail, grid=launch.grid, num_warps=launch.num_warps,
                              num_stages=launch.num_stages, **dict(zip(launcher.constexpr_names, launch.constexprs)))


class _Recorder:
    """Stands in for a planned launch: records its leading tensors instead of launching."""

    def __init__(self, part: str, launch: Any, found: list[tuple[str, Any, tuple[Any, ...]]]) -> None:
        self.part, self.launch, self.found = part, launch, found

    def __call__(self, *leading: Any) -> None:
        self.found.append((self.part, self.launch, leading))


def _probe(probe: str, shape: LayerShape, device: torch.device, config: FullCGConfig,
           table_pages: int) -> list[tuple[str, Any, tuple[Any, ...]]]:
    """The launches a stand-in step of ``probe``'s kind plans for layers of ``shape``, each
    with the leading tensors a real step passes it: ``(part, PlannedLaunch, leading)``.

    The step's tensors are small and valid, so a launch the recording misses (the plan's
    layout changed) would run harmlessly rather than fail."""
    from fullcg.context import ForwardContext
    from fullcg.kv_cache import KVCache
    from fullcg.metadata import AttentionMetadata, ForwardMode
    from fullcg.mla import allocate_latent_cache
    from fullcg.ops.call import AttentionCall
    from fullcg.ops.impl import resolve_implementation
    from fullcg.ops.kernels.launch import PlannedLaunch

    s, dt = shape, shape.dtype
    zeros = functools.partial(torch.zeros, dtype=dt, device=device)
    latent, given = s.attends == "latent", probe.startswith("given")
    cache = None
    if latent:
        cache = allocate_latent_cache(1, s.page_size, s.v_head_dim, s.head_dim - s.v_head_dim, dtype=dt, device=device)
    elif not given:
        cache = KVCache.allocate(1, s.page_size, s.num_kv_heads, s.head_dim, v_head_dim=s.v_head_dim, dtype=dt,
                                 device=device)
    if probe == "save":
        from fullcg.ops.kernels.save_kv import plan_save

        slots = torch.full((2,), -1, dtype=torch.int64, device=device)  # metadata's slot_mapping: int64
        if latent:  # flashinfer_mla.save_latent: each row written whole, as k and as v
            whole = zeros(2, 1, s.head_dim)
            leading = (whole, whole, cache.k, cache.k)
        else:
            leading = (zeros(2, s.num_kv_heads, s.head_dim), zeros(2, s.num_kv_heads, s.v_head_dim), cache.k, cache.v)
        return [("save", plan_save(leading[0], leading[1], slots, leading[2], leading[3]).launch, leading)]

    # Stand-in batches (slots -1: nothing written) over page 0, in a page table as wide as
    # the captured steps' (what sizes unsplit skip-softmax decode).
    decode = probe.endswith("decode")
    rows = 2
    width = max(table_pages, math.ceil((rows + 1) / s.page_size))
    if probe == "given_chunk":
        # A request with a cached prefix, so that there is a prefix chunk to attend over (in
        # chunks of a few rows: the chunk's k/v are allocated here). Nothing is saved.
        pages = max(width, math.ceil((rows + 4) / s.page_size))
        md = AttentionMetadata.build([rows], [4], torch.arange(pages, dtype=torch.int32)[None], s.page_size,
                                     [ForwardMode.EXTEND], prefix_chunk_tokens=8, device=device)
    elif decode:
        md = AttentionMetadata.stand_in([1] * rows, [1] * rows, torch.zeros(rows, width, dtype=torch.int32),
                                        s.page_size, [ForwardMode.DECODE] * rows, device=device)
    else:
        md = AttentionMetadata.stand_in([rows], [0], torch.zeros(1, width, dtype=torch.int32), s.page_size,
                                        device=device)
    kv_rows = md.prefix_chunk_tokens if probe == "given_chunk" else rows
    skip = not latent  # the MLA kernel is dense: its layers' factors are refused, not compiled for
    q = zeros(rows, s.num_heads, s.head_dim)
    k = zeros(kv_rows, s.num_kv_heads, s.head_dim)
    v = zeros(kv_rows, s.num_kv_heads, s.v_head_dim)
    out = zeros(rows, s.num_heads, s.v_head_dim)
    call = AttentionCall(
        op="attention_with_lse" if given else "attention", q=q, k=k, v=v, out=out, layer_id=s.layer_id,
        key_value_num_tokens=None, prefill_scale_factor=_FACTOR if skip and s.prefill_skip else None,
        decode_scale_factor=_FACTOR if skip and s.decode_skip else None, scale=1.0 / math.sqrt(s.head_dim),
        use_kv_cache=not given, causal=probe != "given_chunk", prefix_chunk=0 if probe == "given_chunk" else None,
        save_kv_cache=not given, return_lse=given, kv_cache_id=0 if given else cache.uid,
        sliding_window=s.sliding_window,
        logit_softcap=_SOFTCAP if s.logit_softcap else None,
    )
    ctx = ForwardContext(md, {} if cache is None else {s.layer_id: cache}, config)
    plan = resolve_implementation("triton", device).step_plan(call, ctx, cache)
    found: list[tuple[str, Any, tuple[Any, ...]]] = []
    # Each planned launch of the plan records instead of launching; the plan is then called
    # as a real step calls it, so every launch receives the leading tensors it would.
    for part in ("save", "prefill", "decode", "attend"):
        holder = getattr(plan, part, None)
        launch = getattr(holder, "launch", None)
        if isinstance(launch, PlannedLaunch):
            holder.launch = _Recorder(part, launch, found)
    plan(q, k, v, out, cache, s.layer_id)
    return found


# ------------------------------------------------------------------------------ the hook

def _cuda_device(caches: Mapping[int, KVCache]) -> torch.device | None:
    """The CUDA device the caches live on (with its index), or None off CUDA or without caches."""
    device = next(iter(caches.values())).k.device if caches else None
    if device is None or device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


_done: set[tuple[Any, ...]] = set()
#: Held while a hook checks and builds: a second caller (another thread's runner) waits for
#: the first's build rather than capturing before the kernels exist.
_done_lock = threading.Lock()
#: Held while ``TRITON_CACHE_DIR`` points at the kernel directory: the variable is the
#: process's, so two builds at once would otherwise restore each other's value.
_env_lock = threading.RLock()


def before_capture(ctx: ForwardContext, config: FullCGConfig, model: torch.nn.Module | None = None) -> None:
    """Build the kernels ``model``'s layers (default: the model ``ctx``'s KV caches were
    collected from, else the caches alone) need under ``config``, before its first capture,
    and with ``compiler="none"`` the fused element-wise kernels its modules launch.

    Only on CUDA, once per process and device for each distinct set of kernels; a failure
    is a warning (the kernels are then built on first use, as without this), never an error.
    """
    caches = ctx.kv_caches
    device = _cuda_device(caches)
    if device is None:
        return
    try:
        if model is None:
            from fullcg.context import model_of

            model = model_of(caches)
        table_pages = config.max_pages_per_request or max(c.num_pages for c in caches.values())
        kernels = plan_for(layer_shapes(model if model is not None else caches, config), config, device, table_pages)
        if config.compiler == "none" and model is not None:  # eager steps: the fused element-wise kernels too
            kernels += fused_kernels(model)
        key = (device, kernels, config.cache_dir)
        with _done_lock:
            if key in _done:
                return
            _done.add(key)  # before building: a build that fails is not tried again by each step
            if kernels:
                build_kernels(kernels, device, config, when="before the first capture (`python -m fullcg "
                              "build-kernels` builds them at deploy time)")
    except Exception as exc:  # noqa: BLE001 - building ahead is an optimisation
        log_once(("kernel build", type(exc).__name__, str(exc)[:200]), logger, logging.WARNING,
                 "fullcg: building attention kernels ahead failed, so they are built on first use: %s", exc)
