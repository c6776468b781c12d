"""The forward context: per-step data that attention ops read at run time.

Attention ops never take per-batch metadata as graph inputs (it would make graphs depend
on request boundaries). Instead the caller wraps each model step in
``with fullcg.forward_context(metadata, model):`` and the ops look it up when they run, as
vLLM and SGLang do.

The context stack is per thread, like torch's grad mode: two threads stepping two models
never see each other's batch. Code that Dynamo traces may read a few *static facts* of the
step (how many prefix chunks there are, how many rows one holds); they are plain attributes
of the thread's state, so Dynamo guards on their values (evaluated in the calling thread),
not on the identity of a new context object each step (which would recompile every step).

A compiled step runs its graph inside a *derived* context (:func:`derived_context`) that
also carries the step's dispatch key: the graph variant and the capture size it replays.
"""

from __future__ import annotations

import contextlib
import inspect
import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fullcg.compat import enable_size_oblivious
from fullcg.config import FullCGConfig, GraphMode, env_config, layer_factors
from fullcg.diagnostics import warn_once
from fullcg.errors import InferenceTensorError
from fullcg.kv_cache import KVCache
from fullcg.metadata import AttentionMetadata

__all__ = [
    "CacheOwner",
    "ForwardContext",
    "StepState",
    "current_context",
    "current_context_and_facts",
    "derived",
    "enter",
    "leave",
    "forward_context",
    "derived_context",
    "get_forward_context",
    "has_forward_context",
    "num_prefix_chunks",
    "mla_mha_step",
    "model_of",
    "prefix_chunk_tokens",
    "skip_softmax_factors",
]

logger = logging.getLogger(__name__)


class CacheOwner:
    """A module that owns one layer's KV cache (:class:`fullcg.Attention` is one).

    :func:`forward_context` finds a model's caches by walking its modules for these.
    """

    layer_id: int
    #: ``[layer_id, kv_cache uid]``, int64 on the CPU: the identity the layer's ops read at run time.
    layer_key: torch.Tensor
    kv_cache: KVCache | None


@dataclasses.dataclass(eq=False, slots=True)
class StepState:
    """What a step's attention calls work out once and share (a context lives for one step).

    Every slot is filled by the first call that needs it and read by the step's later calls
    (the other layers). The runner clears it between a full graph's warm-up and its capture:
    buffers the warm-up made must not be baked into a graph that outlives them.

    Attributes:
        implementations: the implementation resolved per ``(head_dim, v_head_dim)``.
        ran: implementations a composite (``auto``) ran calls on, by name: with
            :attr:`implementations`, what replays of a captured step plan.
        auto_choices: ``auto``'s choice per kind of call.
        plans: per op and call shape, the launch plan later calls of compiled steps run
            directly, with the cache fit it was made for.
        checked_caches: ``layer_id -> KVCache`` checked to be the layer's own and to fit.
        saved_kv: ``layer_id -> (k, v)`` saved by an eager call (a second save is refused).
        chunk_buffers: gather and result buffers of ``merge_prefix_chunks``, per shape.
        kernel_state: each implementation's own per-step state, by implementation name.
        fallback_counted: the step was counted as a compiled model's fallback.
    """

    implementations: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    ran: dict[str, Any] = dataclasses.field(default_factory=dict)
    auto_choices: dict[tuple[object, ...], Any] = dataclasses.field(default_factory=dict)
    plans: dict[tuple[object, ...], tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    checked_caches: dict[int, KVCache] = dataclasses.field(default_factory=dict)
    saved_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    chunk_buffers: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=dict)
    kernel_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    fallback_counted: bool = False

    def clear(self) -> None:
        """Forget everything (see the class doc: before a capture)."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, dict):
                value.clear()
        self.fallback_counted = False

    def resolved(self) -> tuple[Any, ...]:
        """Every implementation the step's calls resolved or ran on, once each."""
        found = (*self.implementations.values(), *self.ran.values())
        return tuple({id(i): i for i in found}.values())


@dataclasses.dataclass(eq=False)
class ForwardContext:
    """What attention ops can see while a step runs.

    Attributes:
        metadata: the batch.
        kv_caches: ``layer_id -> KVCache`` of the model that runs.
        config: attention implementation, skip-softmax and debug settings of the step.
        source: what the caches came from (a model's class name), for error messages.
        compiled: the step runs a compiled graph; its attention calls skip the checks
            that tracing already did (unless ``config.debug_checks``).
        variant: :attr:`GraphMode.FULL` or :attr:`GraphMode.PIECEWISE` for a step a runner
            runs; None otherwise.
        padded_size: the capture size a captured step replays (the dispatch key with
            ``variant``); None when the step runs uncaptured.
        step: what the step's attention calls work out once and share.
    """

    metadata: AttentionMetadata
    kv_caches: Mapping[int, KVCache]
    config: FullCGConfig
    source: str = ""
    compiled: bool = False
    variant: GraphMode | None = None
    padded_size: int | None = None
    step: StepState = dataclasses.field(default_factory=StepState)


class _ThreadState(threading.local):
    """This thread's context stack, and the static facts of its innermost context."""

    def __init__(self) -> None:
        self.stack: list[ForwardContext] = []
        self.num_prefix_chunks = 0
        self.prefix_chunk_tokens = 0
        self.prefill_factor: float | None = None
        self.decode_factor: float | None = None
        self.layer_factors: tuple[tuple[int, float | None, float | None], ...] = ()
        #: The fewest query heads a latent layer needs to run this step in MHA form; None: absorbed.
        self.mla_mha: int | None = None

    def publish(self) -> None:
        if self.stack:
            ctx = self.stack[-1]
            md = ctx.metadata
            self.num_prefix_chunks = md.num_prefix_chunks
            self.prefix_chunk_tokens = md.prefix_chunk_tokens
            self.prefill_factor = ctx.config.skip_softmax.prefill_scale_factor
            self.decode_factor = ctx.config.skip_softmax.decode_scale_factor
            self.layer_factors = ctx.config.skip_softmax.per_layer
            self.mla_mha = _mla_mha(self.stack)
        else:
            self.num_prefix_chunks, self.prefix_chunk_tokens = 0, 0
            self.prefill_factor = self.decode_factor = None
            self.layer_factors = ()
            self.mla_mha = None


def _mla_mha(stack: list[ForwardContext]) -> int | None:
    """The fewest query heads a multi-head latent attention layer needs to run this step in
    MHA form (``FullCGConfig.mla_mha_min_heads``), or None where the step runs absorbed:
    a decode request, no request with ``FullCGConfig.mla_mha_min_tokens`` new tokens, or a
    full graph (which never holds the host's chunk loop).

    The step's own context decides (the innermost the caller entered, not a runner's
    derived one): Dynamo traces the model there, so both front ends agree.
    """
    ctx = stack[-1]
    if ctx.compiled:  # a runner's derived context: the step's own decides, unless it is a full graph
        if ctx.variant is GraphMode.FULL:
            return None
        ctx = next((c for c in reversed(stack) if not c.compiled), ctx)
    threshold = ctx.config.mla_mha_min_tokens
    md = ctx.metadata
    if threshold is None or md.has_decode or not md.query_lens or max(md.query_lens) < threshold:
        return None
    return ctx.config.mla_mha_min_heads  # each layer compares its own heads (mla_mha_step)


_state = _ThreadState()


# Walking a model's modules every step costs ~0.1 ms on a 32-layer model; remember the
# result until some layer gets a new cache. Cleared then (not just marked stale), so a
# cache a model dropped is freed at once, not kept alive until the model's next step.
_module_caches: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, KVCache]] = weakref.WeakKeyDictionary()
# Facts of a model's caches that every step's entry checks, computed with its cache map.
_module_facts: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int | None, bool]] = weakref.WeakKeyDictionary()

#: The key of the warning about steps run with autograd enabled (see :mod:`fullcg.diagnostics`).
GRAD_WARNING = "step with autograd"


def forget_kv_caches() -> None:
    """Drop the remembered layer -> cache maps (a layer's cache changed)."""
    _module_caches.clear()
    _module_facts.clear()


def model_of(kv_caches: Mapping[int, KVCache]) -> torch.nn.Module | None:
    """The model whose layers :func:`forward_context` collected ``kv_caches`` from (a
    context's ``kv_caches`` is the remembered map itself), or None: a map given directly,
    or one forgotten since because a layer got a new cache."""
    for model, caches in list(_module_caches.items()):
        if caches is kv_caches:
            return model
    return None


def _facts(source: object, caches: Mapping[int, KVCache]) -> tuple[int | None, bool]:
    """(fewest pages of any cache or None, whether some cache is an inference tensor)."""
    if isinstance(source, torch.nn.Module):
        hit = _module_facts.get(source)
        if hit is not None:
            return hit
    facts = (min((c.num_pages for c in caches.values()), default=None), any(c.is_inference for c in caches.values()))
    if isinstance(source, torch.nn.Module):
        _module_facts[source] = facts
    return facts


def _collect_kv_caches(source: object) -> dict[int, KVCache]:
    if source is None:
        return {}
    if isinstance(source, torch.nn.Module):
        cached = _module_caches.get(source)
        if cached is not None:
            return cached
        caches: dict[int, KVCache] = {}
        for name, mod in source.named_modules():
            if isinstance(mod, CacheOwner) and mod.kv_cache is not None:
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


def _check_entry(metadata: AttentionMetadata, facts: tuple[int | None, bool], source: str) -> None:
    """Checks of a step against its caches, once at entry (never per attention call)."""
    min_pages, inference = facts
    if min_pages is not None:
        metadata.verified(min_pages)  # page ids against the real caches (one comparison after build)
    if inference and not torch.is_inference_mode_enabled():
        raise InferenceTensorError(
            f"the KV caches of {source} were allocated under torch.inference_mode and can only be written inside "
            "it: run steps under `with torch.inference_mode():`, or allocate the caches outside inference mode"
        )
    if torch.is_grad_enabled():
        warn_once(
            GRAD_WARNING,
            "fullcg: a step runs with autograd enabled; fullcg steps are inference steps: the KV cache never "
            "records autograd history (wrap steps in torch.inference_mode() or torch.no_grad() to silence this)",
            stacklevel=4,
        )


def _warn_unknown_layers(per_layer: tuple[tuple[int, Any, Any], ...], caches: Mapping[int, KVCache], source: str) -> None:
    """Warn (once per pair of factors and layers) about per-layer skip-softmax factors for
    layers the step's model does not have: a typo there would leave the layer dense, silently."""
    unknown = [lid for lid, _, _ in per_layer if lid not in caches]
    if unknown:
        warn_once(
            ("per_layer", per_layer, frozenset(caches)),
            f"fullcg: SkipSoftmaxConfig.per_layer names layers {unknown}, which {source} has no KV cache for "
            f"(its layers: {sorted(caches)}); their factors apply only to a layer that attends with that layer_id",
            stacklevel=4,
        )


@contextlib.contextmanager
def forward_context(
    metadata: AttentionMetadata,
    kv_caches: torch.nn.Module | Mapping[int, KVCache] | None = None,
    *,
    config: FullCGConfig | None = None,
) -> Iterator[ForwardContext]:
    """Make ``metadata`` (and the KV caches) visible to attention ops for one step.

    Args:
        metadata: the batch, from :meth:`AttentionMetadata.build`.
        kv_caches: the model whose :class:`fullcg.Attention` layers hold KV caches, or a
            mapping ``layer_id -> KVCache``. Needed by attention that uses the cache. The
            mapping is for op calls and layers that own no cache (``kv_cache`` None); a
            layer that owns one runs on it alone, so pass its model (captured graphs hold
            the owned caches' addresses; a mapping could not switch them).
        config: attention implementation and skip-softmax settings for this step;
            defaults to :meth:`FullCGConfig.from_env`.

    Where a step is split into pieces is not the caller's choice: a compiled model's runner
    decides per step (see :mod:`fullcg.runner`).
    """
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"forward_context needs a fullcg.AttentionMetadata, got {type(metadata).__name__}")
    ctx = ForwardContext(
        metadata=metadata,
        kv_caches=_collect_kv_caches(kv_caches),
        config=config if config is not None else env_config(),
        source=_source_name(kv_caches),
    )
    _check_entry(metadata, _facts(kv_caches, ctx.kv_caches), ctx.source)
    if ctx.config.skip_softmax.per_layer and ctx.kv_caches:
        _warn_unknown_layers(ctx.config.skip_softmax.per_layer, ctx.kv_caches, ctx.source)
    enable_size_oblivious()
    with _pushed(ctx):
        yield ctx


def _source_name(source: object) -> str:
    """What a step's caches came from, as error messages name it."""
    if isinstance(source, torch.nn.Module):
        return f"{type(source).__name__} (id {id(source):#x})"
    return "a mapping of KV caches" if source is not None else "no KV caches"


def enter(ctx: ForwardContext) -> None:
    """Make ``ctx`` this thread's innermost context until :func:`leave` (the runner's
    per-step path pairs them in ``try``/``finally``; everything else uses a ``with``)."""
    state = _state
    state.stack.append(ctx)
    state.publish()


def leave() -> None:
    """End the innermost context :func:`enter` began."""
    state = _state
    state.stack.pop()
    state.publish()


@contextlib.contextmanager
def _pushed(ctx: ForwardContext) -> Iterator[ForwardContext]:
    enter(ctx)
    try:
        yield ctx
    finally:
        leave()


def derived_context(
    ctx: ForwardContext,
    *,
    config: FullCGConfig,
    variant: GraphMode,
    padded_size: int | None,
    metadata: AttentionMetadata | None = None,
) -> contextlib.AbstractContextManager[ForwardContext]:
    """How a runner runs its graph for a step: ``ctx`` with the runner's config, the dispatch
    key (``variant``, ``padded_size``) and, for full-graph replays, the metadata in static
    buffers."""
    return _pushed(derived(ctx, config=config, variant=variant, padded_size=padded_size, metadata=metadata))


def derived(
    ctx: ForwardContext,
    *,
    config: FullCGConfig,
    variant: GraphMode,
    padded_size: int | None,
    metadata: AttentionMetadata | None = None,
) -> ForwardContext:
    """The context :func:`derived_context` enters (for :func:`enter`/:func:`leave`)."""
    return ForwardContext(
        metadata if metadata is not None else ctx.metadata, ctx.kv_caches, config,
        source=ctx.source, compiled=True, variant=GraphMode(variant), padded_size=padded_size,
    )


#: The static facts traced code may read, in the order :func:`static_facts` gives them.
STATIC_FACTS = ("num_prefix_chunks", "prefix_chunk_tokens", "prefill_factor", "decode_factor",
                "layer_factors", "mla_mha")


def static_facts() -> tuple[object, ...]:
    """The static facts of this thread's innermost context (named by :data:`STATIC_FACTS`):
    what traced code may read, so what Dynamo guards on when it does."""
    return current_context_and_facts()[1]


def current_context_and_facts() -> tuple[ForwardContext | None, tuple[object, ...]]:
    """:func:`current_context` and :func:`static_facts` in one call (direct dispatch's per-step path)."""
    state = _state
    stack = state.stack
    return (stack[-1] if stack else None), (state.num_prefix_chunks, state.prefix_chunk_tokens, state.prefill_factor,
                                            state.decode_factor, state.layer_factors, state.mla_mha)


def has_forward_context() -> bool:
    return bool(_state.stack)


def get_forward_context() -> ForwardContext:
    """The innermost active forward context; raises if there is none."""
    stack = _state.stack
    if not stack:
        raise RuntimeError(
            "fullcg attention needs per-step metadata, but no forward context is active: "
            "run the model inside `with fullcg.forward_context(metadata, model):`"
        )
    return stack[-1]


def current_context() -> ForwardContext | None:
    """The innermost active forward context, or None (the ops' fast path)."""
    stack = _state.stack
    return stack[-1] if stack else None


_POSITION_NAMES = ("positions", "position_ids")


def positions_argument(model: torch.nn.Module) -> int | None:
    """The index of ``model.forward``'s positions argument (named ``positions`` or
    ``position_ids``), or None: what :func:`check_call_positions` checks."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name in _POSITION_NAMES and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


def check_positions(positions: torch.Tensor) -> None:
    """In an eager step, raise unless ``positions`` are the step's (``metadata.positions``):
    a token given another position would have its k/v rotated for one position and cached
    at another. Compiled steps check at the call under ``debug_checks``
    (:func:`check_call_positions`); a model calls this from its forward."""
    if torch.compiler.is_compiling():  # first, so tracing never reads the context stack
        return
    ctx = current_context()
    if ctx is not None and not ctx.compiled:
        ctx.metadata.check_positions(positions)


def check_call_positions(index: int | None, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """:func:`check_positions` for a compiled model's call (under ``debug_checks``): the
    argument at ``index`` (:func:`positions_argument`) or named as positions."""
    ctx = current_context()
    if ctx is None:
        return
    value = args[index] if index is not None and index < len(args) else next(
        (kwargs[n] for n in _POSITION_NAMES if n in kwargs), None)
    if isinstance(value, torch.Tensor):
        ctx.metadata.check_positions(value.reshape(-1))


def current_padded_size() -> int | None:
    """The capture size the current step replays; None outside a captured step."""
    stack = _state.stack
    return stack[-1].padded_size if stack else None


def current_piece_size() -> int | None:
    """The capture size each piece of the current step replays its own graph at; None
    outside a captured piecewise step (a full-graph step captures its pieces whole)."""
    stack = _state.stack
    if not stack or stack[-1].variant != GraphMode.PIECEWISE:
        return None
    return stack[-1].padded_size


def mla_mha_step(num_heads: int | None = None) -> bool:
    """Whether a :class:`fullcg.MLAAttention` layer of ``num_heads`` query heads runs the
    current step in MHA form (new tokens up-projected, the cached prefix chunk by chunk)
    rather than absorbed over the latent cache: ``FullCGConfig.mla_mha_min_tokens`` and
    ``mla_mha_min_heads`` decide. Without ``num_heads``: whether a layer of enough heads would."""
    least = _state.mla_mha
    return least is not None and (num_heads is None or num_heads >= least)


def num_prefix_chunks() -> int:
    """How many prefix chunks the chunked-prefix pattern walks in the current step."""
    return _state.num_prefix_chunks


def skip_softmax_factors(layer_id: int | None = None) -> tuple[float | None, float | None]:
    """The current step's configured (prefill, decode) skip-softmax factors for ``layer_id``
    (its own where ``SkipSoftmaxConfig.per_layer`` has it, else the global pair); None = dense."""
    state = _state
    default = (state.prefill_factor, state.decode_factor)
    if layer_id is None or not state.layer_factors:
        return default
    return layer_factors(state.layer_factors, layer_id, default)


def layer_skip_softmax_factors(layer: CacheOwner) -> tuple[float | None, float | None]:
    """:func:`skip_softmax_factors` of ``layer``, reading its ``layer_id`` only when some
    layer has factors of its own: traced code that never reads it is the same for every layer."""
    state = _state
    if not state.layer_factors:
        return state.prefill_factor, state.decode_factor
    return skip_softmax_factors(layer.layer_id)


def prefix_chunk_tokens() -> int:
    """Rows of one gathered prefix chunk (all requests together) in the current step."""
    return _state.prefix_chunk_tokens
