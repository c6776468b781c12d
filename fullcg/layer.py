"""``fullcg.Attention``: the layer a model uses in place of its attention computation."""

from __future__ import annotations

import math

import torch
from torch import nn

from fullcg import context, source_keys
from fullcg.context import CacheOwner
from fullcg.kv_cache import KVCache
from fullcg.ops.attention import ATTENTION_OPS, LAYER_FROM_KEY

__all__ = ["Attention", "fold_sinks"]

def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with a sink column added to each row's softmax, from attention without it.

    A sink logit ``s`` (per head, no value) scales a row's output by
    ``sum / (sum + e^s) = sigmoid(lse - s)`` and adds itself to the LSE, exactly. Rows that
    saw nothing (padding; LSE -inf) stay zero with LSE -inf.
    """
    s = sinks.to(torch.float32)
    weight = torch.sigmoid(lse - s)
    out = (out.to(torch.float32) * weight[..., None]).to(out.dtype)
    lse = torch.where(torch.isneginf(lse), lse, torch.logaddexp(lse, s))
    return out, lse


class _NoBackward(torch.autograd.Function):
    """Marks attention results as depending on its inputs, with a backward that refuses:
    fullcg's ops compute no gradients, and autograd would otherwise treat the results as
    constants and return wrong gradients for everything before them."""

    @staticmethod
    def forward(ctx, layer_id, result, *inputs):  # type: ignore[override]
        ctx.layer_id = layer_id
        return result.view_as(result)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError(
            f"fullcg.Attention (layer {ctx.layer_id}) has no backward: fullcg's attention ops are for inference. "
            "Run steps under torch.inference_mode() (or torch.no_grad()); to fine-tune, use another attention "
            "implementation (for a transformers model, attn_implementation='sdpa')"
        )


class Attention(nn.Module, CacheOwner):
    """Attention over a paged KV cache (or over given k/v) through the ``fullcg`` ops.

    The layer holds its head counts, scale, layer id and KV cache; per-step data (which
    tokens belong to which request, where their KV lives) comes from
    :func:`fullcg.forward_context`.

    Args:
        num_heads: query heads.
        head_dim: query/key head size.
        num_kv_heads: key/value heads (GQA); defaults to ``num_heads``.
        layer_id: unique per layer of a model; names the layer's KV cache and counters.
        scale: softmax scale; defaults to ``1 / sqrt(head_dim)``.
        v_head_dim: value head size; defaults to ``head_dim``.
        sliding_window: each query sees only itself and the ``sliding_window - 1`` keys
            before it (Mistral, Gemma 2/3, gpt-oss); None: every earlier key.
        logit_softcap: scores become ``c * tanh(scores / c)`` before the softmax (Gemma 2);
            None: no capping.
        sinks: the layer holds a learned sink logit per query head (``self.sinks``,
            ``[num_heads]``, gpt-oss): an extra softmax column with no value, which takes
            its share of each row's weight. :meth:`forward` also takes sinks per call.

    Skip-softmax factors come from the step's config (the forward context's, or the
    compile backend's for compiled steps), never from the layer, so eager and compiled
    runs of one model always agree.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        *,
        layer_id: int,
        scale: float | None = None,
        v_head_dim: int | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Attention: {name} must be a positive integer, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"Attention: layer_id must be a non-negative integer, got {layer_id!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"Attention: scale must be a positive finite number, got {scale!r}")
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0
        ):
            raise ValueError(
                f"Attention: sliding_window must be a positive integer (keys a query sees, itself included), "
                f"got {sliding_window!r}"
            )
        if logit_softcap is not None and not _positive_finite(logit_softcap):
            raise ValueError(f"Attention: logit_softcap must be a positive finite number, got {logit_softcap!r}")
        if not isinstance(sinks, bool):
            raise TypeError(
                f"Attention: sinks must be True or False (a learned sink per head); pass sink logits per call as "
                f"forward(..., sinks=tensor), got {type(sinks).__name__}"
            )
        source_keys.prefetch_triton()  # the first kernel's lookup needs it; weights load meanwhile
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        with torch.inference_mode(False):  # updated in place when the layer gets a cache, whatever the mode
            #: The layer's identity as its ops read it when they run: ``[layer_id, uid of its
            #: KV cache (0: none)]``, int64, on the CPU whatever the model's device (a plain
            #: attribute: ``.to()`` leaves it). A graph input rather than constants, so every
            #: layer traces to the same graph (see ``fullcg.ops.attention``).
            self.layer_key = torch.tensor([layer_id, 0], dtype=torch.int64, device="cpu")
        self.layer_id = layer_id
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self.sliding_window = sliding_window
        self.logit_softcap = float(logit_softcap) if logit_softcap is not None else None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self._kv_cache: KVCache | None = None
        # Plain attributes, so traced code reads constants instead of lifting the cache tensors.
        self._kv_dtype: torch.dtype | None = None
        self._kv_device: torch.device | None = None

    def __setstate__(self, state: dict) -> None:
        # A copied or unpickled layer holds another cache (a copy is a new cache, with a new
        # uid): its key must name that one, not the original's.
        if "_layer_id" not in state and "layer_id" in state:  # pickled before layer_id was a property
            state = {**state, "_layer_id": state["layer_id"]}
            del state["layer_id"]
        super().__setstate__(state)
        cache = self.__dict__.get("_kv_cache")
        self.__dict__.setdefault("_kv_dtype", cache.k.dtype if cache is not None else None)
        self.__dict__.setdefault("_kv_device", cache.k.device if cache is not None else None)
        with torch.inference_mode(False):
            self.layer_key = torch.tensor([self._layer_id, cache.uid if cache is not None else 0], dtype=torch.int64,
                                          device="cpu")

    @property
    def layer_id(self) -> int:
        """Unique per layer of a model; names the layer's KV cache and counters."""
        return self._layer_id

    @layer_id.setter
    def layer_id(self, layer_id: int) -> None:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"Attention: layer_id must be a non-negative integer, got {layer_id!r}")
        self._layer_id = layer_id
        self.layer_key[0] = layer_id
        context.forget_kv_caches()  # caches are found by layer id

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window is not None else "")
            + (f", logit_softcap={self.logit_softcap:g}" if self.logit_softcap is not None else "")
            + (", sinks=True" if self.sinks is not None else "")
        )

    def allocate_kv_cache(
        self, num_pages: int, page_size: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> KVCache:
        """Give the layer a paged KV cache ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        self.kv_cache = KVCache.allocate(
            num_pages, page_size, self.num_kv_heads, self.head_dim, v_head_dim=self.v_head_dim,
            dtype=dtype or torch.float32, device=device or "cpu",
        )
        return self.kv_cache

    @property
    def kv_cache(self) -> KVCache | None:
        """The layer's paged KV cache (None until allocated or assigned)."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: KVCache | None) -> None:
        if cache is not None and (
            cache.num_kv_heads != self.num_kv_heads or cache.head_dim != self.head_dim or cache.v_head_dim != self.v_head_dim
        ):
            raise ValueError(
                f"Attention(layer_id={self.layer_id}): a KV cache of pages {tuple(cache.k.shape)} does not fit "
                f"{self.num_kv_heads} kv heads of {self.head_dim}"
            )
        self._kv_cache = cache
        self._kv_dtype, self._kv_device = (cache.k.dtype, cache.k.device) if cache is not None else (None, None)
        self.layer_key[1] = cache.uid if cache is not None else 0
        context.forget_kv_caches()

    def _as_3d(self, x: torch.Tensor, name: str, heads: int, dim: int) -> torch.Tensor:
        if x.dim() == 2 and x.shape[1] == heads * dim:
            return x.view(x.shape[0], heads, dim)
        if x.dim() == 3 and x.shape[1] == heads and x.shape[2] == dim:
            return x
        raise ValueError(
            f"Attention(layer_id={self.layer_id}): {name} must be [tokens, {heads}, {dim}] or "
            f"[tokens, {heads * dim}], got shape {tuple(x.shape)}"
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        return_lse: bool = False,
        key_value_num_tokens: int | None = None,
        use_kv_cache: bool = True,
        causal: bool = True,
        prefix_chunk: int | None = None,
        save_kv_cache: bool | None = None,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend ``q`` over this step's keys; returns ``out`` (and LSE if ``return_lse``).

        ``q`` is ``[T, num_heads, head_dim]`` or flattened ``[T, num_heads * head_dim]``;
        ``out`` comes back in the same layout. By default the new ``k``/``v`` are saved
        into the KV cache and every query token attends causally over its request's cached
        prefix and new tokens. With ``use_kv_cache=False`` it attends over ``k``/``v`` as
        given, packed per request like ``q`` (``causal`` or not), or, with
        ``prefix_chunk=c``, over chunk ``c`` of the cached prefix as gathered by
        :meth:`gather_prefix_chunk`. ``save_kv_cache`` (default: ``use_kv_cache``) writes
        the new ``k``/``v`` into the cache; the chunked-prefix pattern sets it for the
        suffix, which attends over given k/v. ``key_value_num_tokens`` says how many leading rows
        of ``k``/``v`` are valid; the rest (padding) is never read. LSE is
        ``float32 [T, num_heads]``, natural log.

        ``sinks`` (``[num_heads]`` logits; default: the layer's own, if it has them) adds a
        sink column to each row's softmax; the LSE returned includes it. A call over a
        prefix chunk never applies sinks: they belong once to the row, and the chunked-prefix
        pattern applies them with the new tokens' call, whose result the chunks merge into.
        ``scale`` overrides the layer's softmax scale for this call (a model that scales q
        itself passes 1.0).
        """
        flat = q.dim() == 2
        q3 = self._as_3d(q, "q", self.num_heads, self.head_dim)
        k3 = self._as_3d(k, "k", self.num_kv_heads, self.head_dim)
        v3 = self._as_3d(v, "v", self.num_kv_heads, self.v_head_dim)
        if scale is None:
            scale = self.scale
        elif not _positive_finite(scale):
            raise ValueError(f"Attention(layer_id={self.layer_id}): scale must be a positive finite number, got {scale!r}")
        if sinks is None:
            sinks = self.sinks
        if prefix_chunk is not None:
            sinks = None
        elif sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != self.num_heads):
            raise ValueError(
                f"Attention(layer_id={self.layer_id}): sinks must be [{self.num_heads}] (one logit per query head), "
                f"got shape {tuple(sinks.shape)}"
            )
        out = torch.empty((q3.shape[0], self.num_heads, self.v_head_dim), dtype=q3.dtype, device=q3.device)
        prefill_factor, decode_factor = context.layer_skip_softmax_factors(self)
        # The plain op, whatever the step: the runner that runs the step decides where it is
        # split (the compile backend makes every attention node a split point; capture
        # without a compiler splits at attention calls while it captures piecewise).
        op = ATTENTION_OPS[(False, bool(return_lse) or sinks is not None)]
        lse = op(
            q3, k3, v3, out, LAYER_FROM_KEY, key_value_num_tokens, prefill_factor, decode_factor, scale,
            use_kv_cache, causal, prefix_chunk, use_kv_cache if save_kv_cache is None else save_kv_cache,
            self.sliding_window, self.logit_softcap, 0,
            # Layer id and cache uid, read when the op runs (the op checks the step's cache
            # for this layer is this one): every layer traces to the same graph.
            self.layer_key,
        )
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        if not torch.compiler.is_compiling() and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
        ):
            inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
            out = _NoBackward.apply(self.layer_id, out, *inputs)
            if lse is not None:
                lse = _NoBackward.apply(self.layer_id, lse, *inputs)
        if flat:
            out = out.view(q3.shape[0], self.num_heads * self.v_head_dim)
        return (out, lse) if return_lse else out

    def merge_prefix_chunks(
        self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, scale: float | None = None
    ) -> None:
        """Attend ``q`` over every chunk of this step's cached prefix, merging each into
        ``out``/``lse`` in place (the chunked-prefix pattern, whatever the chunk count).

        ``out``, ``lse`` are a partial result with LSE, usually of the new tokens over
        themselves: ``out, lse = attn(q, k, v, return_lse=True, use_kv_cache=False,
        save_kv_cache=True)``. Afterwards they are attention over prefix and new tokens.
        The chunk loop runs inside one op, so a compiled model has one graph for every
        chunk count (a Python loop over chunks in the model would trace one per count).
        Models that transform a chunk before attending to it (an up-projection) use
        :meth:`gather_prefix_chunk` and ``prefix_chunk=c`` instead. ``scale`` overrides the
        layer's softmax scale, as in :meth:`forward`; pass the one the partial result used.
        """
        if scale is None:
            scale = self.scale
        elif not _positive_finite(scale):
            raise ValueError(f"Attention(layer_id={self.layer_id}): scale must be a positive finite number, got {scale!r}")
        q3 = self._as_3d(q, "q", self.num_heads, self.head_dim)
        out3 = self._as_3d(out, "out", self.num_heads, self.v_head_dim)
        prefill_factor, decode_factor = context.layer_skip_softmax_factors(self)
        torch.ops.fullcg.merge_prefix_chunks.default(
            q3, out3, lse, LAYER_FROM_KEY, prefill_factor, decode_factor, scale, 0, self.sliding_window,
            self.logit_softcap, self.layer_key,
        )

    def gather_prefix_chunk(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of prefix chunk ``chunk`` of every request, packed, from the cache.

        Rows: ``metadata.prefix_chunk_tokens`` (a fixed size, so graphs do not depend on
        request lengths); the packing is ``metadata.prefix_chunks[chunk]``.
        """
        if self._kv_dtype is None:  # (not the cache itself: traced code reads constants)
            raise RuntimeError(f"Attention(layer_id={self.layer_id}) has no KV cache; call allocate_kv_cache first")
        rows = context.prefix_chunk_tokens()
        k = torch.empty((rows, self.num_kv_heads, self.head_dim), dtype=self._kv_dtype, device=self._kv_device)
        v = torch.empty((rows, self.num_kv_heads, self.v_head_dim), dtype=self._kv_dtype, device=self._kv_device)
        torch.ops.fullcg.gather_prefix_chunk.default(k, v, LAYER_FROM_KEY, chunk, self.layer_key)
        return k, v
