"""Hugging Face ``transformers`` causal LMs on fullcg: ``attn_implementation="fullcg"``.

transformers looks attention functions up by name in a public registry
(``AttentionInterface``); :func:`register` adds ``"fullcg"`` there, and to the mask
registry (``AttentionMaskInterface``) with a mask function that builds nothing, because
fullcg's ops know each request's extent from the step's metadata. :func:`prepare` gives
every attention module of a model a :class:`fullcg.Attention` child (layer id from HF's
``layer_idx``; head sizes, sliding window and logit soft-cap as HF applies them to that
layer) with a paged KV cache, after refusing what fullcg cannot run yet: token mixers
that keep a state of their own (Mamba, short convolutions, linear attention), and
attention it cannot reproduce. Each call passes its softmax scale and sink logits on.

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

import functools
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import fullcg
from fullcg.integrations.eager_kernels import use_fused_ops
from fullcg.integrations.fused_linear import fuse_sibling_projections

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers import masking_utils
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

    ``query [1, H, T, D]``, ``key [1, Hkv, T, D]``, ``value [1, Hkv, T, Dv]`` (a packed
    batch of this step's new tokens) go through the module's :class:`fullcg.Attention`,
    which saves k/v to the paged cache and attends over each request's cached prefix and
    new tokens. The softmax scale is the call's ``scaling``; gpt-oss's sink logits
    (``s_aux``) are passed on; a ``sliding_window`` or ``softcap`` in the call must be
    the one :func:`prepare` gave the layer. Returns ``(out [1, T, H, Dv], None)``.
    """
    attn = getattr(module, _CHILD, None)
    # Where errors happen, say which layer (read only then: traced code that reads the
    # layer index differs per layer, so Dynamo could not trace a layer once for all).
    if attn is None:
        raise RuntimeError(
            f"{_where(module)}: this module has no fullcg KV cache; call "
            "fullcg.integrations.transformers.prepare(model, num_pages=..., page_size=...) first"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"{_where(module)}: fullcg runs packed batches (batch dimension 1, all requests' tokens concatenated); "
            f"got query of shape {tuple(query.shape)}. Pass input_ids[None] and position_ids[None], "
            "or drive the model through fullcg.integrations.transformers.PackedCausalLM"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{_where(module)}: keys ({key.shape[2]}) and queries ({query.shape[2]}) differ in length, so a transformers "
            "cache is in use; call the model with use_cache=False (fullcg keeps the KV cache itself)"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{_where(module)}: got an attention mask, which fullcg would ignore; request boundaries come from the "
            "forward context's metadata. Pass no attention_mask (and register() the 'fullcg' mask function)"
        )
    if dropout and module.training:
        raise ValueError(f"{_where(module)}: attention dropout in training mode is not supported; call model.eval()")
    if kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"{_where(module)}: transformers asked for non-causal attention, which fullcg cannot run")
    shapes = (query.shape[1], query.shape[3], key.shape[1], value.shape[1], value.shape[3])
    if shapes != (attn.num_heads, attn.head_dim, attn.num_kv_heads, attn.num_kv_heads, attn.v_head_dim):
        raise ValueError(
            f"{_where(module)}: transformers passed query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)}, but prepare() built the layer for {attn.num_heads} query heads and "
            f"{attn.num_kv_heads} kv heads of {attn.head_dim} (values {attn.v_head_dim}); call prepare(model, ...) "
            "again after changing the model"
        )
    # A window or soft-cap in the call (what flash-attention would apply) must be what prepare()
    # gave the layer from the config (what HF's masks and eager attention apply).
    _check_same(module, "sliding_window", kwargs, attn.sliding_window, "window")
    _check_same(module, "softcap", kwargs, attn.logit_softcap, "logit soft-cap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    # [1, H, T, D] -> [T, H, D]; contiguous because kernels index tokens by row. Made
    # contiguous before the batch dimension is dropped: torch 2.11's Inductor works out the
    # strides of a view of a non-contiguous tensor from the token count's hint, guarding
    # that it is not 1, which gave one-token steps a graph of their own.
    q = query.transpose(1, 2).contiguous()[0]
    k = key.transpose(1, 2).contiguous()[0]
    v = value.transpose(1, 2).contiguous()[0]
    out = attn(q, k, v, sinks=sinks, scale=None if scaling is None else float(scaling))
    return out.unsqueeze(0), None


def _where(module: torch.nn.Module) -> str:
    return f"fullcg attention (layer {getattr(module, 'layer_idx', '?')})"


def _check_same(module: torch.nn.Module, name: str, kwargs: dict[str, Any], built: float | None, what: str) -> None:
    if name not in kwargs:
        return
    given = kwargs[name]
    same = given is None if built is None else given is not None and abs(float(given) - built) <= 1e-6 * built
    if not same:
        raise UnsupportedModelError(
            f"{_where(module)}: transformers applies {name}={given!r}, but prepare() built the layer with {what} {built!r} "
            "from the config; fullcg read this model's config wrongly, so it cannot run it (please report it)"
        )


# --- what prepare() refuses ---------------------------------------------------------------

# Token mixers other than attention keep a state across steps (an SSM state, the last few
# inputs of a convolution, a linear-attention or recurrent state), which fullcg's KV cache
# does not hold: under fullcg they would see only the step's own tokens. Matched by class
# name (transformers' own classes, e.g. GraniteMoeHybridMambaLayer, Lfm2ShortConv,
# Qwen3NextGatedDeltaNet, MiniMaxLightningAttention), first match wins.
_STATEFUL_MIXERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"DeltaNet|DeltaAttention|GatedDelta"), "a gated DeltaNet (linear-attention) mixer"),
    (re.compile(r"Mamba|Bamba|Mixer$|SSM|StateSpace"), "a Mamba (state-space) mixer"),
    (re.compile(r"ShortConv"), "a short-convolution mixer"),
    (re.compile(r"LinearAttention|LightningAttention|LinearAttn"), "a linear-attention mixer"),
    (re.compile(r"RecurrentBlock|Rglru|RGLRU|Rwkv|xLSTM|[ms]LSTM|Retention"), "a recurrent mixer"),
)

# config.layer_types entries (and the like) fullcg runs; anything else is a mixer it does not.
# ("attention" is GraniteMoeHybrid's name for a full-attention layer.)
_FULL_ATTENTION_LAYER_TYPES = ("full_attention", "attention")
_ATTENTION_LAYER_TYPES = (*_FULL_ATTENTION_LAYER_TYPES, "sliding_attention")
_LAYER_TYPE_FEATURES = {
    "linear_attention": "linear attention",
    "mamba": "Mamba (state-space) layers",
    "conv": "short-convolution layers",
    "chunked_attention": "chunked attention (attention within fixed blocks of tokens)",
    "recurrent": "recurrent layers",
}
# Config fields of looped (recurrent-depth) models: how often a stack of layers runs per step.
_LOOP_FIELDS = ("n_recurrent_loops", "loop_num_passes", "num_loops", "H_cycles", "L_cycles")

# transformers' mask functions that apply a sliding window (causal).
_SLIDING_MASK_FUNCTIONS = ("create_sliding_window_causal_mask", "sliding_window_causal_mask_function",
                           "sliding_window_overlay")

_STATE_FIX = ("fullcg holds only attention's keys and values, not the state this mixer keeps between steps; "
              "run this model with transformers' own cache")


def _layer_of(name: str) -> int | str:
    """The decoder layer a module sits in, from its qualified name (``model.layers.3.mamba`` -> 3)."""
    match = re.search(r"\.(\d+)(\.|$)", "." + name)
    return int(match.group(1)) if match else "?"


def _refuse(
    feature: str, name: str, module: nn.Module | None, fix: str, layer: int | str | None = None
) -> UnsupportedModelError:
    if layer is None:
        layer = getattr(module, "layer_idx", None)
        layer = layer if isinstance(layer, int) else _layer_of(name)
    where = f"layer {layer} ({name})" if name else f"layer {layer}"
    return UnsupportedModelError(f"fullcg cannot run {feature} yet, which {where} uses; {fix}")


def _attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """HF self-attention modules: those that carry a ``layer_idx`` and a softmax ``scaling``."""
    for name, module in model.named_modules():
        if isinstance(module, fullcg.Attention):
            continue
        if isinstance(getattr(module, "layer_idx", None), int) and isinstance(getattr(module, "scaling", None), float):
            yield name, module


def _is_depthwise_causal_conv(module: nn.Module) -> bool:
    # A convolution over the token axis, channel by channel (Mamba's and short-conv mixers'
    # conv1d): it reads the previous kernel_size - 1 tokens. GPT-2's ``Conv1D`` is a linear
    # layer, not an nn.Conv1d, so it does not count.
    return (isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1
            and module.groups == module.in_channels and module.groups > 1)


def _check_mixers(model: nn.Module, config: Any, attention: list[tuple[str, nn.Module]]) -> None:
    attention_ids = {id(m) for _, m in attention}
    for name, module in model.named_modules():
        if id(module) in attention_ids or isinstance(module, (fullcg.Attention, PreTrainedModel)):
            continue
        cls = type(module).__name__
        for pattern, feature in _STATEFUL_MIXERS:
            if pattern.search(cls):
                raise _refuse(f"{feature} ({cls})", name, None, _STATE_FIX, layer=_layer_of(name))
    # Structure, for mixers under other names, inside the decoder layers (where the attention
    # modules are; vision and audio towers of multimodal models run once, without state).
    decoder = {name.rsplit(f".{m.layer_idx}.", 1)[0] for name, m in attention if f".{m.layer_idx}." in name}
    for name, module in model.named_modules():
        if not any(name.startswith(prefix + ".") for prefix in decoder):
            continue
        if _is_depthwise_causal_conv(module):
            raise _refuse(f"a causal convolution over past tokens ({type(module).__name__} in a token mixer)", name,
                          None, _STATE_FIX, layer=_layer_of(name))
        if isinstance(getattr(module, "A_log", None), torch.Tensor):
            raise _refuse(f"a state-space or linear-attention mixer ({type(module).__name__}, with a decay A_log)",
                          name, None, _STATE_FIX, layer=_layer_of(name))
    for key in ("layer_types", "layers_block_type", "block_types"):
        types = _field(config, key, None)
        if not isinstance(types, (list, tuple)):
            continue
        for i, layer_type in enumerate(types):
            if layer_type in _ATTENTION_LAYER_TYPES:
                continue
            feature = _LAYER_TYPE_FEATURES.get(layer_type, f"{layer_type!r} layers")
            raise _refuse(f"{feature} (config.{key}[{i}] = {layer_type!r})", "", None,
                          "fullcg runs models whose every layer is full or sliding-window attention", layer=i)
    pattern = _field(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and "M" in pattern:
        raise _refuse(f"Mamba (state-space) layers (config.hybrid_override_pattern = {pattern!r})", "", None,
                      _STATE_FIX, layer=pattern.index("M"))


def _field(config: Any, name: str, default: Any = None) -> Any:
    """``getattr(config, name, default)``, also when the config refuses to answer: a
    heterogeneous config raises for a global read of a field that varies per layer."""
    try:
        return getattr(config, name, default)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, a RuntimeError
        return default


def _sub_config(module: nn.Module, config: Any) -> Any:
    sub = getattr(module, "config", None)
    return sub if sub is not None and _field(sub, "num_attention_heads") is not None else config


def _is_alibi(config: Any) -> bool:
    attn_config = _field(config, "attn_config", None)
    return bool(
        _field(config, "model_type", None) == "bloom"
        or _field(config, "alibi", False)
        or getattr(attn_config, "alibi", False)
        or (isinstance(attn_config, dict) and attn_config.get("alibi"))
        or "alibi" in str(_field(config, "position_embedding_type", "")).lower()
    )


def _applies_sliding_masks(model: nn.Module) -> bool:
    """Whether the model's code builds sliding-window masks at all (its modeling modules use
    transformers' sliding-window mask functions). Moshi, for one, has a
    ``config.sliding_window`` that no mask of its applies."""
    wanted = [getattr(masking_utils, name, None) for name in _SLIDING_MASK_FUNCTIONS]
    wanted = [f for f in wanted if f is not None]
    for module_name in {type(m).__module__ for m in model.modules()}:
        namespace = vars(sys.modules[module_name]) if module_name in sys.modules else {}
        if any(value is f for value in namespace.values() for f in wanted):
            return True
    return False


def _layer_window(name: str, module: nn.Module, sub: Any) -> int | None:
    """The sliding window HF's masks give this layer (None: full causal attention).

    With ``config.layer_types``, that list decides (``sliding_attention`` layers get
    ``config.sliding_window``): models such as Exaone 4 set ``module.sliding_window`` on
    every layer but apply it only on sliding ones. Without it, ``config.sliding_window``
    applies to every layer (Mistral, Phi-3, Starcoder2) unless ``use_sliding_window`` is off.
    :func:`_plan` then drops (or refuses) a window none of the model's masks applies.
    """
    layer_types = _field(sub, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        idx = module.layer_idx
        if idx >= len(layer_types):
            raise _refuse(f"a layer missing from config.layer_types ({len(layer_types)} entries)", name, module,
                          "make config.layer_types list every layer")
        if layer_types[idx] in _FULL_ATTENTION_LAYER_TYPES:
            return None
        if layer_types[idx] != "sliding_attention":
            raise _refuse(f"{layer_types[idx]!r} layers", name, module,
                          "fullcg runs models whose every layer is full or sliding-window attention")
        window = _field(sub, "sliding_window", None)
        if not isinstance(window, int) or window <= 0:
            raise _refuse(f"a sliding-window layer without a window (config.sliding_window={window!r})", name, module,
                          "set config.sliding_window")
        return window
    if _field(sub, "use_sliding_window", True) is False:
        return None
    window = _field(sub, "sliding_window", None)
    if window is None:
        return None
    if not isinstance(window, int) or window <= 0:
        raise _refuse(f"sliding_window={window!r}", name, module, "set config.sliding_window to a positive integer or None")
    return window


def _layer_spec(name: str, module: nn.Module, config: Any) -> dict[str, Any]:
    """Keyword arguments of the :class:`fullcg.Attention` that stands in for one HF attention module."""
    sub = _sub_config(module, config)
    num_heads = _field(sub, "num_attention_heads", None) or getattr(module, "num_heads", None)
    groups = getattr(module, "num_key_value_groups", None)
    if groups:
        num_kv_heads = num_heads // groups
    else:
        num_kv_heads = _field(sub, "num_key_value_heads", None) or num_heads
    if isinstance(getattr(module, "qk_head_dim", None), int):  # multi-head latent attention, decompressed
        head_dim = module.qk_head_dim
    else:
        head_dim = next((v for v in (getattr(module, "head_dim", None), getattr(module, "head_size", None),
                                     _field(sub, "head_dim", None)) if isinstance(v, int)), None)
        head_dim = head_dim or sub.hidden_size // num_heads
    v_head_dim = getattr(module, "v_head_dim", None)
    softcap = getattr(module, "attn_logit_softcapping", None) or _field(sub, "attn_logit_softcapping", None)
    return dict(
        num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, layer_id=module.layer_idx,
        scale=module.scaling, v_head_dim=v_head_dim if isinstance(v_head_dim, int) else None,
        sliding_window=_layer_window(name, module, sub), logit_softcap=float(softcap) if softcap else None,
    )


def _plan(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers model (with .config), got {type(model).__name__}")
    if _field(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"fullcg cannot run encoder-decoder models yet ({type(model).__name__}); use a decoder-only causal LM"
        )
    if (getattr(model, "_tp_size", None) or 1) > 1 or any(
            type(p).__name__ == "DTensor" for p in model.parameters()):
        # Not known to work: transformers' tensor parallelism shards through DTensor, whose
        # redistributions fullcg's split graphs and captured pieces have not been made to hold.
        raise UnsupportedModelError(
            f"{type(model).__name__} is sharded with transformers' tensor parallelism (tp_plan, DTensor weights), "
            "which fullcg does not run; load it unsharded, or build the model on fullcg with "
            "fullcg.TensorParallel (e.g. fullcg.models.llama.LlamaModel(cfg, tp=fullcg.TensorParallel()))"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if _is_alibi(config) or _is_alibi(text_config):
        raise UnsupportedModelError(
            f"fullcg cannot run ALiBi position biases yet ({type(model).__name__} adds them to every layer's "
            "attention scores); use a model with rotary or learned position embeddings"
        )
    modules = list(_attention_modules(model))
    _check_mixers(model, text_config, modules)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        raise UnsupportedModelError(
            f"{type(model).__name__} computes attention itself instead of through transformers' AttentionInterface, "
            "so fullcg cannot plug in; use a model class that supports attn_implementation"
        )
    if not modules:
        raise UnsupportedModelError(
            f"found no attention modules (with layer_idx and scaling) in {type(model).__name__}; fullcg supports "
            "decoder-only transformers models whose attention goes through AttentionInterface"
        )
    for key in _LOOP_FIELDS:
        loops = _field(text_config, key, None)
        if isinstance(loops, int) and not isinstance(loops, bool) and loops > 1:
            raise UnsupportedModelError(
                f"fullcg cannot run decoder layers that run several times per step yet (config.{key} = {loops} in "
                f"{type(model).__name__}): each pass would save its keys and values over the last one's in the "
                "layer's one KV cache"
            )
    sliding_masks = _applies_sliding_masks(model)
    plan = []
    seen: dict[int, str] = {}
    for name, module in modules:
        sub = _sub_config(module, text_config)
        if any(hasattr(module, a) for a in ("lambda_q1", "lambda_init")) or "DiffLlama" in type(module).__name__:
            raise _refuse(
                f"differential attention ({type(module).__name__} attends twice per layer, over each half of the "
                "values, and subtracts)", name, module, "there is no fix on the fullcg side yet")
        if callable(getattr(module, "prepare_dynamic_mask", None)) or _field(sub, "keep_window_size") is not None:
            raise _refuse(
                f"a dynamic (content-dependent) attention mask ({type(module).__name__} builds it from the values)",
                name, module, "there is no fix on the fullcg side yet")
        if (getattr(module, "is_cross_attention", False) or _field(sub, "add_cross_attention", False)
                or re.search(r"encoder_attn|cross_?att", name, re.IGNORECASE)):
            raise _refuse("cross-attention", name, module, "use a decoder-only causal LM")
        if (getattr(module, "is_causal", True) is not True or _field(sub, "is_causal", True) is not True
                or _field(sub, "use_bidirectional_attention", False) or _field(sub, "prefix_lm", False)):
            raise _refuse("non-causal (bidirectional) attention", name, module, "use a decoder-only causal LM")
        if module.layer_idx in seen:
            raise _refuse(f"two attention modules with one layer_idx ({seen[module.layer_idx]} and {name})", name,
                          module, "fullcg keeps one KV cache per layer_idx")
        seen[module.layer_idx] = name
        spec = _layer_spec(name, module, text_config)
        window = spec["sliding_window"]
        if window is not None and not sliding_masks:
            # The config has a window no mask of the model applies; HF's caches would (Moshi), so
            # its forward and its generate disagree past the window. A window no position can
            # exceed is the same as none.
            longest = _field(sub, "max_position_embeddings")
            if not isinstance(longest, int) or window < longest:
                raise _refuse(
                    f"a sliding window no mask of {type(model).__name__} applies (config.sliding_window={window}; "
                    "its transformers cache would, so HF's forward and generate disagree past the window)", name, module,
                    "fullcg cannot tell which is meant; if no sequence is longer than the window, either is exact: "
                    "set config.sliding_window to config.max_position_embeddings (or None) before building the model")
            spec["sliding_window"] = None
        sinks = getattr(module, "sinks", None)
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (spec["num_heads"],)):
            raise _refuse(f"attention sinks of shape {tuple(getattr(sinks, 'shape', ()))}", name, module,
                          f"fullcg takes one sink logit per query head ([{spec['num_heads']}])")
        plan.append((name, module, spec))
    return plan


def check_supported(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Raise :class:`UnsupportedModelError` for what fullcg cannot run; return the attention modules.

    Refused: encoder-decoder models; ALiBi; token mixers that keep a state between steps
    (Mamba/SSM, short convolutions, linear attention and gated DeltaNet, recurrent
    blocks), found by class name, structure and ``config.layer_types``; differential
    attention (DiffLlama); dynamic masks (Doge); models whose attention does not go
    through transformers' ``AttentionInterface``; cross- and bidirectional attention;
    layers run several times per step; a config window no mask of the model applies.
    Runs (each layer's :class:`fullcg.Attention` gets them): sliding windows per layer,
    attention logit soft-capping, attention sinks, a value head size of its own.
    """
    return [(name, module) for name, module, _ in _plan(model)]


def prepare(
    model: nn.Module,
    *,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    fuse_projections: bool = True,
    fused_ops: bool = True,
) -> PackedCausalLM:
    """Make a transformers causal LM run its attention through fullcg, with a paged KV cache.

    Checks the model (:func:`check_supported`), switches it to
    ``attn_implementation="fullcg"`` (registering it if needed), and gives each attention
    module a :class:`fullcg.Attention` child with a cache of ``num_pages`` pages of
    ``page_size`` tokens, in ``dtype``/``device`` (default: the module's weights'). Each
    layer gets HF's head counts and sizes, sliding window (``config.layer_types`` first)
    and attention logit soft-cap. Calling it again replaces the caches.

    With ``fuse_projections`` (the default), each layer's query, key and value projections,
    and its MLP's gate and up projections, are stored as one weight per group
    (:func:`fullcg.integrations.fused_linear.fuse_sibling_projections`; memory unchanged),
    so a compiled step runs one matmul per group: the same values, fewer and fuller kernels.
    The model's ``state_dict`` keeps the separate keys (``q_proj.weight``, ...), so what it
    saves loads into the model as transformers builds it, and such a checkpoint loads into it.
    Run eagerly, the siblings share one matmul as well.

    With ``fused_ops`` (the default), RMSNorm modules, SwiGLU MLPs and Llama-style attention
    modules whose forward fullcg recognises (checked on probe inputs) run one fused kernel
    each for the norm, for ``silu(gate) * up`` and for the rotary embedding of q and k when a
    step runs eagerly or is captured without a compiler
    (:func:`fullcg.integrations.eager_kernels.use_fused_ops`); ``torch.compile`` still traces
    their own forward.

    Returns a :class:`PackedCausalLM` over ``model`` (``input_ids [T], positions [T] ->
    logits [T, vocab]``): the module to compile, run steps with, or pass to
    :func:`fullcg.generate`.
    """
    plan = _plan(model)
    for name, flag in (("fuse_projections", fuse_projections), ("fused_ops", fused_ops)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        logger.info("switching %s from attn_implementation=%r to %r", type(model).__name__,
                    model.config._attn_implementation, ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for _, module, spec in plan:
        attn = _latent_attention(module, spec)
        if attn is None:
            attn = fullcg.Attention(**spec)
        ref = next(module.parameters(), None)
        attn.allocate_kv_cache(
            num_pages, page_size,
            dtype=dtype or (ref.dtype if ref is not None else torch.float32),
            device=device or (ref.device if ref is not None else "cpu"),
        )
        setattr(module, _CHILD, attn)  # a child module: forward_context(metadata, model) finds the cache
    if fuse_projections:  # last: a prepare that fails leaves the model's layout as it was
        fuse_sibling_projections(model)
    if fused_ops:
        switched = use_fused_ops(model)
        logger.info("fullcg: %d norm, MLP and attention modules of %s run fused kernels on eager steps", switched,
                    type(model).__name__)
    logger.info("fullcg: prepared %d attention layers of %s (%d pages of %d tokens each)",
                len(plan), type(model).__name__, num_pages, page_size)
    return PackedCausalLM(model)


#: HF attention classes whose forward fullcg replaces to keep a latent cache (multi-head latent
#: attention), with the rotary helper their module applies: DeepSeek-V3's takes (cos, sin),
#: DeepSeek-V2's a complex ``freqs_cis``. Other MLA classes run decompressed through the
#: attention interface.
_LATENT_ATTENTION_CLASSES = {"DeepseekV3Attention": "apply_rotary_pos_emb", "DeepseekV2Attention": "apply_rotary_emb"}


def _latent_attention(module: nn.Module, spec: dict[str, Any]) -> fullcg.MLAAttention | None:
    """For a DeepSeek-V3 attention module: a :class:`fullcg.MLAAttention` over a latent cache,
    with the module's forward replaced by :func:`_latent_forward`; None for other modules."""
    if type(module).__name__ not in _LATENT_ATTENTION_CLASSES or spec["sliding_window"] or spec["logit_softcap"]:
        return None
    # The absorbed form reads kv_b_proj's weight as it is: only a plain floating-point Linear
    # (a quantized one, FP8 with its scales or int8, or an adapter-wrapped one, is computed by
    # its own forward, so such a layer runs decompressed through HF's code).
    kv_b = getattr(module, "kv_b_proj", None)
    if type(kv_b) is not nn.Linear or kv_b.weight.dtype not in (torch.float16, torch.bfloat16, torch.float32) \
            or hasattr(kv_b, "weight_scale_inv"):
        return None
    helpers = sys.modules.get(type(module).__module__)
    if helpers is None or not hasattr(helpers, _LATENT_ATTENTION_CLASSES[type(module).__name__]):
        return None
    mla = fullcg.MLAAttention(
        module.num_heads, module.kv_lora_rank, module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim,
        layer_id=spec["layer_id"], scale=float(module.scaling),
    )
    # An instance attribute (this module only); a partial of a module-level function, so the
    # prepared model still pickles and deep-copies (a copy calls its own module).
    module.forward = functools.partial(_latent_forward, module)
    return mla


def _rotate_pairs(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rotary embedding, token-major: ``x [1, T, heads, D]`` as ``D / 2``
    complex pairs times ``freqs_cis [1, T, D / 2]``, in real arithmetic (what HF's
    ``apply_rotary_emb`` computes through complex tensors, which Inductor does not take)."""
    cos_sin = torch.view_as_real(freqs_cis).unsqueeze(2)  # [1, T, 1, D / 2, 2]
    cos, sin = cos_sin[..., 0], cos_sin[..., 1]
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2).type_as(x)


def _latent_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any = None,
                    attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """DeepSeek-V2/V3 attention with a latent cache: the module's own projections, norm and
    rotary embedding, then :class:`fullcg.MLAAttention` (the latent and rope key saved,
    never the decompressed keys and values)."""
    mla = getattr(self, _CHILD)
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            f"fullcg attention (layer {self.layer_idx}): fullcg runs packed batches (batch dimension 1); got hidden "
            f"states of shape {tuple(hidden_states.shape)}; drive the model through PackedCausalLM"
        )
    if attention_mask is not None:
        raise ValueError(
            f"fullcg attention (layer {self.layer_idx}): got an attention mask, which fullcg would ignore; request "
            "boundaries come from the forward context's metadata"
        )
    helpers = sys.modules[type(self).__module__]
    tokens = hidden_states.shape[1]
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    # Token-major throughout ([1, T, heads, dim], rotary embedding over dimension 2): no
    # transposed views, which would make Dynamo guard that the token count is not 1.
    q = q.view(1, tokens, self.num_heads, self.qk_head_dim)
    q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    latent = self.kv_a_layernorm(latent)
    k_rot = k_rot.view(1, tokens, 1, self.qk_rope_head_dim)
    if isinstance(position_embeddings, torch.Tensor):  # DeepSeek-V2: complex freqs_cis
        q_rot, k_rot = _rotate_pairs(q_rot, position_embeddings), _rotate_pairs(k_rot, position_embeddings)
        out = mla(q_nope[0], q_rot[0], latent[0], k_rot[0, :, 0], self.kv_b_proj.weight)
        return self.o_proj(out.reshape(1, tokens, -1)), None
    cos, sin = position_embeddings
    if getattr(self.config, "rope_interleave", False):
        q_rot, k_rot = helpers.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    else:
        q_rot, k_rot = helpers.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    out = mla(q_nope[0], q_rot[0], latent[0], k_rot[0, :, 0], self.kv_b_proj.weight)
    return self.o_proj(out.reshape(1, tokens, -1)), None


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
        fullcg.context.check_positions(positions)  # eager steps; compiled ones under debug_checks
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.logits[0]

