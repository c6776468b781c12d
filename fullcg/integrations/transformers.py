"""Hugging Face ``transformers`` causal LMs on fullcg: ``attn_implementation="fullcg"``.

transformers looks attention functions up by name in a public registry
(``AttentionInterface``); :func:`register` adds ``"fullcg"`` there, and to the mask
registry (``AttentionMaskInterface``) with a mask function that builds nothing, because
fullcg's ops know each request's extent from the step's metadata. :func:`prepare` gives
every attention module of a model a :class:`fullcg.Attention` child (layer id from HF's
``layer_idx``, scale from HF's ``scaling``) with a paged KV cache, after refusing what
fullcg cannot run yet.

The model is then driven with *packed* batches, as vLLM's Transformers backend does:
batch dimension 1, every request's new tokens concatenated, ``position_ids`` per token,
``use_cache=False`` (fullcg holds the KV cache)::

    fhf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fullcg")
    step = fhf.prepare(model, num_pages=256, page_size=16)   # PackedCausalLM: ids [T], positions [T] -> logits [T, V]
    compiled = torch.compile(step, backend="fullcg")
    with fullcg.forward_context(metadata, step):
        logits = compiled(input_ids, positions)

Compiling ``model`` itself and calling it with ``input_ids[None]`` works too, but its
graph inputs then have the token count in dimension 1, where fullcg's CUDA-graph
padding does not look; :class:`PackedCausalLM` puts it first, so steps are captured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import fullcg

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "fullcg.integrations.transformers needs Hugging Face transformers; install it with "
        "`pip install fullcg[transformers]`"
    ) from err

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PackedCausalLM",
    "UnsupportedModelError",
    "attention_forward",
    "attention_layers",
    "check_supported",
    "prepare",
    "register",
]

logger = logging.getLogger(__name__)

#: The name under which :func:`register` puts fullcg into transformers' registries.
ATTN_IMPLEMENTATION = "fullcg"

# The attribute (a child module, so forward_context(metadata, model) finds its KV cache)
# that prepare() sets on every HF attention module.
_CHILD = "fullcg_attention"


class UnsupportedModelError(ValueError):
    """A model uses an attention feature fullcg cannot run yet; raised by :func:`prepare`.

    The message names the feature and the layer (HF's ``layer_idx`` and the module's
    qualified name), so nothing runs silently wrong.
    """


def register() -> None:
    """Put ``"fullcg"`` into transformers' attention and mask registries (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # fullcg's ops take each request's extent (and causality) from the step's metadata, so
    # transformers must not build a [T, T] mask: it would cost memory and never be read.
    return None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="fullcg"``.

    ``query [1, H, T, D]``, ``key``/``value [1, Hkv, T, D]`` (a packed batch of this step's
    new tokens) go through the module's :class:`fullcg.Attention`, which saves k/v to the
    paged cache and attends over each request's cached prefix and new tokens. Returns
    ``(out [1, T, H, D], None)``.
    """
    attn = getattr(module, _CHILD, None)
    where = f"fullcg attention (layer {getattr(module, 'layer_idx', '?')})"
    if attn is None:
        raise RuntimeError(
            f"{where}: this module has no fullcg KV cache; call "
            "fullcg.integrations.transformers.prepare(model, num_pages=..., page_size=...) first"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"{where}: fullcg runs packed batches (batch dimension 1, all requests' tokens concatenated); "
            f"got query of shape {tuple(query.shape)}. Pass input_ids[None] and position_ids[None], "
            "or drive the model through fullcg.integrations.transformers.PackedCausalLM"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{where}: keys ({key.shape[2]}) and queries ({query.shape[2]}) differ in length, so a transformers "
            "cache is in use; call the model with use_cache=False (fullcg keeps the KV cache itself)"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{where}: got an attention mask, which fullcg would ignore; request boundaries come from the "
            "forward context's metadata. Pass no attention_mask (and register() the 'fullcg' mask function)"
        )
    for name in ("sliding_window", "softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"{where}: transformers asked for {name}={kwargs[name]!r}, which fullcg cannot run")
    if dropout and module.training:
        raise ValueError(f"{where}: attention dropout in training mode is not supported; call model.eval()")
    if scaling is not None and abs(scaling - attn.scale) > 1e-12 * attn.scale:
        raise ValueError(
            f"{where}: transformers passed scaling={scaling}, but prepare() built the layer with {attn.scale}; "
            "call prepare(model, ...) again after changing the model"
        )
    # [1, H, T, D] -> [T, H, D]; contiguous because kernels index tokens by row. Made
    # contiguous before the batch dimension is dropped: torch 2.11's Inductor works out the
    # strides of a view of a non-contiguous tensor from the token count's hint, guarding
    # that it is not 1, which gave one-token steps a graph of their own.
    q = query.transpose(1, 2).contiguous()[0]
    k = key.transpose(1, 2).contiguous()[0]
    v = value.transpose(1, 2).contiguous()[0]
    out = attn(q, k, v)
    return out.unsqueeze(0), None


def _attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """HF self-attention modules: those that carry a ``layer_idx`` and a softmax ``scaling``."""
    for name, module in model.named_modules():
        if isinstance(module, fullcg.Attention):
            continue
        if isinstance(getattr(module, "layer_idx", None), int) and isinstance(getattr(module, "scaling", None), float):
            yield name, module


def _refuse(feature: str, name: str, module: nn.Module, fix: str) -> UnsupportedModelError:
    layer = getattr(module, "layer_idx", "?")
    return UnsupportedModelError(
        f"fullcg cannot run {feature} yet, which layer {layer} ({name}) uses; {fix}"
    )


def check_supported(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Raise :class:`UnsupportedModelError` for what fullcg cannot run; return the attention modules.

    Refused: encoder-decoder models, models whose attention does not go through
    transformers' ``AttentionInterface``, sliding-window attention, attention logit
    soft-capping, ALiBi, attention sinks, and cross- or bidirectional (non-causal)
    attention.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers model (with .config), got {type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"fullcg cannot run encoder-decoder models yet ({type(model).__name__}); use a decoder-only causal LM"
        )
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        raise UnsupportedModelError(
            f"{type(model).__name__} computes attention itself instead of through transformers' AttentionInterface, "
            "so fullcg cannot plug in; use a model class that supports attn_implementation"
        )
    modules = list(_attention_modules(model))
    if not modules:
        raise UnsupportedModelError(
            f"found no attention modules (with layer_idx and scaling) in {type(model).__name__}; fullcg supports "
            "decoder-only transformers models whose attention goes through AttentionInterface"
        )
    layer_types = getattr(config, "layer_types", None)
    for name, module in modules:
        idx = module.layer_idx
        sub = getattr(module, "config", config)
        layer_type = layer_types[idx] if layer_types is not None and idx < len(layer_types) else None
        window = getattr(module, "sliding_window", None)
        if window is None and layer_type is None:
            window = getattr(sub, "sliding_window", None)  # e.g. Mistral: one window for every layer
        if window is not None or (layer_type is not None and "sliding" in layer_type):
            raise _refuse(
                f"sliding-window attention (window {window or getattr(sub, 'sliding_window', None)})", name, module,
                "if no sequence ever exceeds the window, full attention is exact: set config.sliding_window=None "
                "(and config.use_sliding_window=False where the config has it) before building the model",
            )
        if layer_type is not None and layer_type != "full_attention":
            raise _refuse(f"{layer_type!r} layers", name, module, "only 'full_attention' layers are supported")
        softcap = getattr(module, "attn_logit_softcapping", None) or getattr(sub, "attn_logit_softcapping", None)
        if softcap:
            raise _refuse(f"attention logit soft-capping (attn_logit_softcapping={softcap})", name, module,
                          "there is no fix on the fullcg side yet")
        if getattr(sub, "alibi", False) or "alibi" in str(getattr(sub, "position_embedding_type", "")).lower():
            raise _refuse("ALiBi position biases", name, module, "there is no fix on the fullcg side yet")
        if getattr(module, "sinks", None) is not None:
            raise _refuse("attention sinks", name, module, "there is no fix on the fullcg side yet")
        if getattr(module, "is_cross_attention", False) or getattr(sub, "add_cross_attention", False):
            raise _refuse("cross-attention", name, module, "use a decoder-only causal LM")
        if getattr(module, "is_causal", True) is not True or getattr(sub, "is_causal", True) is not True:
            raise _refuse("non-causal (bidirectional) attention", name, module, "use a decoder-only causal LM")
    return modules


def prepare(
    model: nn.Module,
    *,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> PackedCausalLM:
    """Make a transformers causal LM run its attention through fullcg, with a paged KV cache.

    Checks the model (:func:`check_supported`), switches it to
    ``attn_implementation="fullcg"`` (registering it if needed), and gives each attention
    module a :class:`fullcg.Attention` child with a cache of ``num_pages`` pages of
    ``page_size`` tokens, in ``dtype``/``device`` (default: the module's weights').
    Calling it again replaces the caches.

    Returns a :class:`PackedCausalLM` over ``model`` (``input_ids [T], positions [T] ->
    logits [T, vocab]``): the module to compile, run steps with, or pass to
    :func:`fullcg.generate`.
    """
    modules = check_supported(model)
    register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        logger.info("switching %s from attn_implementation=%r to %r", type(model).__name__,
                    model.config._attn_implementation, ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for name, module in modules:
        sub = getattr(module, "config", model.config)
        num_heads = sub.num_attention_heads
        groups = getattr(module, "num_key_value_groups", None)
        num_kv_heads = num_heads // groups if groups else getattr(sub, "num_key_value_heads", None) or num_heads
        attn = fullcg.Attention(num_heads, module.head_dim, num_kv_heads, layer_id=module.layer_idx, scale=module.scaling)
        ref = next(module.parameters(), None)
        attn.allocate_kv_cache(
            num_pages, page_size,
            dtype=dtype or (ref.dtype if ref is not None else torch.float32),
            device=device or (ref.device if ref is not None else "cpu"),
        )
        setattr(module, _CHILD, attn)  # a child module: forward_context(metadata, model) finds the cache
    logger.info("fullcg: prepared %d attention layers of %s (%d pages of %d tokens each)",
                len(modules), type(model).__name__, num_pages, page_size)
    return PackedCausalLM(model)


def attention_layers(model: nn.Module) -> list[fullcg.Attention]:
    """The :class:`fullcg.Attention` layers :func:`prepare` attached, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, fullcg.Attention)]
    return sorted(layers, key=lambda a: a.layer_id)


class PackedCausalLM(nn.Module):
    """A prepared transformers causal LM with fullcg's calling convention.

    ``forward(input_ids [T], positions [T]) -> logits [T, vocab]``: one packed step, the
    token count first (so fullcg pads and captures it with CUDA graphs). The per-step
    batch structure comes from :func:`fullcg.forward_context`.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not attention_layers(model):
            raise RuntimeError(
                f"{type(model).__name__} has no fullcg attention layers; call "
                "fullcg.integrations.transformers.prepare(model, num_pages=..., page_size=...) first"
            )
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"{type(model).__name__} runs attn_implementation={model.config._attn_implementation!r}; "
                "call fullcg.integrations.transformers.prepare(model, ...) to switch it to 'fullcg'"
            )
        self.model = model

    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        """The model's ``generation_config.eos_token_id`` (what ``fullcg.generate`` stops at by default)."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.logits[0]

