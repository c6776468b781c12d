"""Per-step data that attention ops read at run time: the forward context.

Attention ops never take per-batch metadata as graph inputs (it would make graphs depend
on request boundaries). Instead the caller wraps each model step in
``with fullcg.forward_context(metadata, kv_caches):`` and the ops look it up when they
run, as vLLM and SGLang do.

Code that Dynamo traces may read a few *static facts* of the step (whether attention must
be breakable, how many prefix chunks there are). Those live in plain module globals so
that Dynamo guards on their values, not on the identity of a new context object each step
(which would recompile every step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
from collections.abc import Iterator, Mapping, Sequence

import logging
import weakref

import torch

from fullcg.config import FullCGConfig
from fullcg.kv_cache import KVCache

__all__ = [
    "ForwardMode",
    "AttentionMetadata",
    "ForwardContext",
    "forward_context",
    "get_forward_context",
    "has_forward_context",
    "is_breakable",
    "num_prefix_chunks",
    "prefix_chunk_tokens",
    "skip_softmax_factors",
]


class ForwardMode(enum.Enum):
    """What a request does in this step."""

    PREFILL = "prefill"  #: no cached prefix yet: all tokens are new
    EXTEND = "extend"  #: new tokens on a cached prefix (chunked prefill)
    DECODE = "decode"  #: one new token on a cached prefix

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


def _as_int_tuple(values: Sequence[int] | torch.Tensor, name: str) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold integers, got {x!r}")
        out.append(x)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixChunk:
    """One chunk of every request's cached prefix, for the chunked-prefix pattern.

    Request ``r`` contributes prefix positions ``[starts[r], starts[r] + lens[r])``,
    packed at rows ``[offsets[r], offsets[r] + lens[r])`` of the gathered k/v.
    ``kv_start_loc`` is ``offsets`` as an ``int32`` tensor on the batch's device, for kernels.
    (Chunk attention always runs eagerly between pieces, so a per-step tensor is safe.)
    """

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    offsets: tuple[int, ...]  # len R + 1
    kv_start_loc: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Describes one batch: which tokens belong to which request, and where their KV lives.

    Build it with :meth:`build`. Host-side tuples serve the reference implementation and
    validation; the tensors (on the batch's device) serve GPU kernels.

    Attributes:
        query_lens: new tokens per request; the batch's ``q`` packs them in request order.
        prefix_lens: tokens already in the KV cache per request.
        forward_modes: :class:`ForwardMode` per request.
        page_size: tokens per KV-cache page.
        page_table: ``int32 [num_requests, max_pages]``: page ids of each request's KV.
        slot_mapping: ``int64 [num_tokens]``: flat cache slot (``page * page_size + offset``)
            of each new token.
        query_start_loc: ``int32 [num_requests + 1]``: cumulative query lengths.
        seq_lens: ``int32 [num_requests]``: prefix plus new tokens.
        prefix_lens_tensor: ``int32 [num_requests]``.
        is_decode: ``bool [num_requests]``: which requests are in decode mode.
        num_tokens_tensor: ``int32 [1]``: real (unpadded) new tokens, for kernels that must
            not read the count on the host (CUDA graphs replay with other counts).
        prefix_chunk_tokens: capacity of one gathered prefix chunk (all requests together).
        prefix_chunks: the chunk plan for the chunked-prefix pattern.
    """

    query_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    forward_modes: tuple[ForwardMode, ...]
    page_size: int
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens_tensor: torch.Tensor
    is_decode: torch.Tensor
    num_tokens_tensor: torch.Tensor
    prefix_chunk_tokens: int
    prefix_chunks: tuple[PrefixChunk, ...]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int] | torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
        forward_modes: Sequence[ForwardMode | str] | None = None,
        *,
        prefix_chunk_tokens: int = 4096,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Validate a batch description and derive the rest.

        ``forward_modes`` defaults to: prefill when there is no prefix, decode for a single
        new token on a prefix, extend otherwise. ``device`` defaults to the page table's.
        """
        q_lens = _as_int_tuple(query_lens, "query_lens")
        p_lens = _as_int_tuple(prefix_lens, "prefix_lens")
        num_reqs = len(q_lens)
        if num_reqs == 0:
            raise ValueError("a batch needs at least one request, got query_lens=()")
        if len(p_lens) != num_reqs:
            raise ValueError(
                f"query_lens and prefix_lens must have one entry per request, got {num_reqs} and {len(p_lens)}"
            )
        if any(n <= 0 for n in q_lens):
            raise ValueError(f"every request needs at least one new token, got query_lens={list(q_lens)}")
        if any(n < 0 for n in p_lens):
            raise ValueError(f"prefix_lens must be >= 0, got {list(p_lens)}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if isinstance(prefix_chunk_tokens, bool) or not isinstance(prefix_chunk_tokens, int) or prefix_chunk_tokens <= 0:
            raise ValueError(f"prefix_chunk_tokens must be a positive integer, got {prefix_chunk_tokens!r}")

        if forward_modes is None:
            modes = tuple(
                ForwardMode.PREFILL if p == 0 else ForwardMode.DECODE if q == 1 else ForwardMode.EXTEND
                for q, p in zip(q_lens, p_lens)
            )
        else:
            if len(forward_modes) != num_reqs:
                raise ValueError(f"forward_modes needs one entry per request ({num_reqs}), got {len(forward_modes)}")
            modes = tuple(ForwardMode(m) if isinstance(m, str) else m for m in forward_modes)
        for r, (mode, q, p) in enumerate(zip(modes, q_lens, p_lens)):
            if not isinstance(mode, ForwardMode):
                raise TypeError(f"forward_modes[{r}] must be a fullcg.ForwardMode, got {mode!r}")
            if mode is ForwardMode.PREFILL and p != 0:
                raise ValueError(f"request {r} is in prefill mode but has a cached prefix of {p} tokens: use extend")
            if mode is ForwardMode.EXTEND and p == 0:
                raise ValueError(f"request {r} is in extend mode but has no cached prefix: use prefill")
            if mode is ForwardMode.DECODE and (q != 1 or p == 0):
                raise ValueError(
                    f"request {r} is in decode mode, which needs exactly one new token on a cached prefix; "
                    f"got {q} new tokens on a prefix of {p}"
                )

        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise ValueError("page_table must be a 2-D integer tensor [num_requests, max_pages]")
        if page_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.shape[0] != num_reqs:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {num_reqs} requests")
        seq = [q + p for q, p in zip(q_lens, p_lens)]
        capacity = page_table.shape[1] * page_size
        if max(seq) > capacity:
            raise ValueError(
                f"a request needs {max(seq)} KV slots but page_table has room for {capacity} "
                f"({page_table.shape[1]} pages of {page_size}); add pages"
            )
        dev = torch.device(device) if device is not None else page_table.device
        page_table = page_table.to(device=dev, dtype=torch.int32)

        # Slot of each new token: its absolute position looked up through the page table.
        req_idx = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(q_lens))
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        pos = torch.arange(sum(q_lens)) - starts[req_idx] + torch.tensor(p_lens)[req_idx]
        pt_cpu = page_table.cpu().long()
        slot_mapping = pt_cpu[req_idx, pos // page_size] * page_size + pos % page_size

        # Prefix chunks: split the gather capacity evenly over requests that have a prefix.
        with_prefix = sum(1 for p in p_lens if p > 0)
        chunks: list[PrefixChunk] = []
        if with_prefix:
            per_req = max(1, prefix_chunk_tokens // with_prefix)
            for c in range(math.ceil(max(p_lens) / per_req)):
                lens = tuple(max(0, min(per_req, p - c * per_req)) for p in p_lens)
                offsets = (0, *torch.tensor(lens).cumsum(0).tolist())
                chunks.append(
                    PrefixChunk(
                        tuple(c * per_req for _ in p_lens), lens, tuple(offsets),
                        torch.tensor(offsets, dtype=torch.int32, device=dev),
                    )
                )

        return cls(
            query_lens=q_lens,
            prefix_lens=p_lens,
            forward_modes=modes,
            page_size=page_size,
            page_table=page_table,
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=starts.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            prefix_lens_tensor=torch.tensor(p_lens, dtype=torch.int32, device=dev),
            is_decode=torch.tensor([m.is_decode for m in modes], dtype=torch.bool, device=dev),
            num_tokens_tensor=torch.tensor([sum(q_lens)], dtype=torch.int32, device=dev),
            prefix_chunk_tokens=prefix_chunk_tokens,
            prefix_chunks=tuple(chunks),
        )

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    # Cached: every attention call of a step asks (the dataclass is frozen, so they never change).
    @functools.cached_property
    def num_tokens(self) -> int:
        """Real (unpadded) new tokens in the batch."""
        return sum(self.query_lens)

    @functools.cached_property
    def is_decode_only(self) -> bool:
        return all(self.decode_flags)

    @functools.cached_property
    def decode_flags(self) -> tuple[bool, ...]:
        """Whether each request is in decode mode (host side of ``is_decode``)."""
        return tuple(m is ForwardMode.DECODE for m in self.forward_modes)

    @functools.cached_property
    def has_decode(self) -> bool:
        return any(self.decode_flags)

    @functools.cached_property
    def query_starts(self) -> tuple[int, ...]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardContext:
    """What attention ops can see while a step runs."""

    metadata: AttentionMetadata
    kv_caches: Mapping[int, KVCache]
    config: FullCGConfig
    breakable: bool


logger = logging.getLogger(__name__)

_stack: list[ForwardContext] = []
# Static facts of the innermost context, as plain values so Dynamo guards on their values.
_breakable: bool = False
_num_prefix_chunks: int = 0
_prefix_chunk_tokens: int = 0
_prefill_factor: float | None = None
_decode_factor: float | None = None


def _publish() -> None:
    global _breakable, _num_prefix_chunks, _prefix_chunk_tokens, _prefill_factor, _decode_factor
    if _stack:
        ctx = _stack[-1]
        _breakable = ctx.breakable
        _num_prefix_chunks = len(ctx.metadata.prefix_chunks)
        _prefix_chunk_tokens = ctx.metadata.prefix_chunk_tokens
        _prefill_factor = ctx.config.skip_softmax.prefill_scale_factor
        _decode_factor = ctx.config.skip_softmax.decode_scale_factor
    else:
        _breakable, _num_prefix_chunks, _prefix_chunk_tokens = False, 0, 0
        _prefill_factor = _decode_factor = None


# Walking a model's modules every step costs ~0.1 ms on a 32-layer model; remember the
# result until some layer gets a new cache. Cleared then (not just marked stale), so a
# cache a model dropped is freed at once, not kept alive until the model's next step.
_module_caches: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, KVCache]] = weakref.WeakKeyDictionary()


def forget_kv_caches() -> None:
    """Drop the remembered layer -> cache maps (a layer's cache changed)."""
    _module_caches.clear()


def _collect_kv_caches(source: object) -> dict[int, KVCache]:
    from fullcg.layer import Attention  # the layer module imports this one

    if source is None:
        return {}
    if isinstance(source, torch.nn.Module):
        cached = _module_caches.get(source)
        if cached is not None:
            return cached
        caches: dict[int, KVCache] = {}
        for name, mod in source.named_modules():
            if isinstance(mod, Attention) and mod.kv_cache is not None:
                if mod.layer_id in caches:
                    raise ValueError(
                        f"two fullcg.Attention layers share layer_id {mod.layer_id} (one is {name!r}); "
                        "give every layer of a model its own layer_id"
                    )
                caches[mod.layer_id] = mod.kv_cache
        _module_caches[source] = caches
        return caches
    if isinstance(source, Mapping):
        for key, cache in source.items():
            if not isinstance(cache, KVCache):
                raise TypeError(f"kv_caches[{key!r}] must be a fullcg.KVCache, got {type(cache).__name__}")
        return dict(source)
    raise TypeError(
        f"kv_caches must be a model (nn.Module) or a mapping layer_id -> fullcg.KVCache, got {type(source).__name__}"
    )


@contextlib.contextmanager
def forward_context(
    metadata: AttentionMetadata,
    kv_caches: torch.nn.Module | Mapping[int, KVCache] | None = None,
    *,
    config: FullCGConfig | None = None,
    breakable: bool = False,
) -> Iterator[ForwardContext]:
    """Make ``metadata`` (and the KV caches) visible to attention ops for one step.

    Args:
        metadata: the batch, from :meth:`AttentionMetadata.build`.
        kv_caches: the model whose :class:`fullcg.Attention` layers hold KV caches, or a
            mapping ``layer_id -> KVCache``. Needed by attention that uses the cache.
        config: attention implementation and skip-softmax settings for this step;
            defaults to :meth:`FullCGConfig.from_env`.
        breakable: run attention as breakable ops (split points of a piecewise graph).
    """
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"forward_context needs a fullcg.AttentionMetadata, got {type(metadata).__name__}")
    ctx = ForwardContext(
        metadata=metadata,
        kv_caches=_collect_kv_caches(kv_caches),
        config=config if config is not None else FullCGConfig.from_env(),
        breakable=bool(breakable),
    )
    _enable_size_oblivious_once()
    _stack.append(ctx)
    _publish()
    try:
        yield ctx
    finally:
        _stack.pop()
        _publish()


_size_oblivious_enabled = False


def _enable_size_oblivious_once() -> None:
    """Let Dynamo treat token counts of 0 and 1 like any other, for this process.

    Without it Dynamo specializes a batch of one token (every decode step of a single
    request) into a graph of its own: a recompile the first time such a batch comes.
    Set once rather than per step: patching torch's config costs tens of microseconds,
    too much for the per-step path.
    """
    global _size_oblivious_enabled
    if _size_oblivious_enabled:
        return
    _size_oblivious_enabled = True
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "backed_size_oblivious") and not fx_config.backed_size_oblivious:
        fx_config.backed_size_oblivious = True
        logger.info("fullcg: enabled torch.fx.experimental._config.backed_size_oblivious (one graph for all token counts)")


@contextlib.contextmanager
def derived_context(
    ctx: ForwardContext, *, config: FullCGConfig, breakable: bool, metadata: AttentionMetadata | None = None
) -> Iterator[ForwardContext]:
    """``ctx`` with another config and breakable flag (and, for graph replays, the metadata
    in static buffers): how a compiled step runs its graph."""
    derived = ForwardContext(metadata if metadata is not None else ctx.metadata, ctx.kv_caches, config, breakable)
    _stack.append(derived)
    _publish()
    try:
        yield derived
    finally:
        _stack.pop()
        _publish()


def has_forward_context() -> bool:
    return bool(_stack)


def get_forward_context() -> ForwardContext:
    """The innermost active forward context; raises if there is none."""
    if not _stack:
        raise RuntimeError(
            "fullcg attention needs per-step metadata, but no forward context is active: "
            "run the model inside `with fullcg.forward_context(metadata, model):`"
        )
    return _stack[-1]


def is_breakable() -> bool:
    """Whether attention in the current step must use the breakable ops (piecewise graphs)."""
    return _breakable


def num_prefix_chunks() -> int:
    """How many prefix chunks the chunked-prefix pattern walks in the current step."""
    return _num_prefix_chunks


def skip_softmax_factors() -> tuple[float | None, float | None]:
    """The current step's configured (prefill, decode) skip-softmax factors; None = dense."""
    return _prefill_factor, _decode_factor


def prefix_chunk_tokens() -> int:
    """Rows of one gathered prefix chunk (all requests together) in the current step."""
    return _prefix_chunk_tokens
