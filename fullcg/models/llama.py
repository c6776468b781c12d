"""A small Llama-style decoder built on :class:`fullcg.Attention`.

RMSNorm, rotary embedding, GQA attention over a paged KV cache, SwiGLU MLP. Weights are
random but deterministic from a seed, so two instances built alike are identical. Sizes
go from ``tiny`` (CPU tests) to ``llama3_8b`` (the shape of Llama-3-8B, for GPU
benchmarks). With ``chunked_prefix=True`` attention uses the chunked-prefix pattern:
the new tokens attend over themselves with LSE, then each chunk of the cached prefix is
attended separately and merged in exactly by LSE (``Attention.merge_prefix_chunks``).

Tensor parallelism: ``LlamaModel(cfg, tp=TensorParallel(group))`` shards the model over a
``torch.distributed`` group (:mod:`fullcg.distributed`): q/k/v column-parallel by heads
(KV heads replicated when there are fewer than ranks), ``o_proj`` row-parallel, the MLP's
gate/up column-parallel and ``down_proj`` row-parallel; the embedding, norms and
``lm_head`` are replicated, so every rank returns the full logits. Each rank's
``fullcg.Attention`` has its local head counts (its KV cache holds its heads only); every
rank runs the same steps with the same metadata. Without ``tp`` (or at size 1) the model is
the plain single-device one, with ``nn.Linear`` layers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import fullcg
from fullcg.distributed import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TensorParallel
from fullcg.ops import fused

__all__ = ["LlamaConfig", "LlamaModel"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    chunked_prefix: bool = False
    #: Keys a query sees (itself included) in sliding layers; None: every layer attends fully.
    sliding_window: int | None = None
    #: With a window, every ``full_attention_every``-th layer (the last of each group) attends
    #: fully, as Gemma's and gpt-oss's alternate; 0: every layer slides.
    full_attention_every: int = 0
    logit_softcap: float | None = None
    attention_sinks: bool = False

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (None: full attention)."""
        every = self.full_attention_every
        if self.sliding_window is None or (every and layer_id % every == every - 1):
            return None
        return self.sliding_window

    @classmethod
    def tiny(cls, **changes: object) -> LlamaConfig:
        """Two layers, hidden 64: runs in milliseconds on a CPU."""
        return dataclasses.replace(cls(), **changes)

    @classmethod
    def mid(cls, **changes: object) -> LlamaConfig:
        """Eight layers, hidden 1024, 16/4 heads of 64: a mid-size GPU test model."""
        base = cls(
            vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
            num_kv_heads=4, head_dim=64, rope_theta=500000.0,
        )
        return dataclasses.replace(base, **changes)

    @classmethod
    def llama3_8b(cls, **changes: object) -> LlamaConfig:
        """The shape of Llama-3-8B: 32 layers, hidden 4096, 32/8 heads of 128, vocab 128256."""
        base = cls(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
            num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        )
        return dataclasses.replace(base, **changes)

    @classmethod
    def preset(cls, name: str, **changes: object) -> LlamaConfig:
        presets = {"tiny": cls.tiny, "mid": cls.mid, "llama3_8b": cls.llama3_8b}
        if name not in presets:
            raise ValueError(f"unknown model size {name!r}; choose one of {', '.join(presets)}")
        return presets[name](**changes)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.eager_step(x, self.weight):  # one kernel when no compiler fuses the norm
            return fused.rms_norm(x, self.weight, self.eps, 0.0, False)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


Rotary = tuple[torch.Tensor, torch.Tensor]


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> Rotary:
    """cos and sin ``[T, 1, D/2]`` (float32) of the rotary angles at ``positions [T]``.

    Made once per step and shared by every layer: computed per layer, they were a dozen of
    each layer's ~85 traced ops, which Dynamo traces 32 times and Inductor compiles.
    """
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of ``x [T, H, D]`` by :func:`rotary_angles`."""
    cos, sin = rotary
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _parallel(tp: TensorParallel | None) -> TensorParallel | None:
    """``tp`` if it shards anything (size > 1), else None: the single-device model."""
    return tp if tp is not None and tp.size > 1 else None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        tp = _parallel(tp)
        q_size = cfg.num_heads * cfg.head_dim
        if tp is None:
            self.num_heads, self.num_kv_heads, self.head_start = cfg.num_heads, cfg.num_kv_heads, 0
            self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * cfg.num_kv_heads * cfg.head_dim, bias=False)
            self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        else:
            qkv = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, tp=tp)
            self.num_heads, self.num_kv_heads, self.head_start = qkv.num_heads, qkv.num_kv_heads, qkv.head_start
            self.qkv_proj = qkv
            self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp=tp)
        self.q_size = self.num_heads * cfg.head_dim  # this rank's
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # This rank's heads only: its KV cache holds its KV heads, its sinks its query heads'.
        self.attn = fullcg.Attention(
            self.num_heads, cfg.head_dim, self.num_kv_heads, layer_id=layer_id,
            sliding_window=cfg.layer_window(layer_id), logit_softcap=cfg.logit_softcap, sinks=cfg.attention_sinks,
        )

    def forward(self, rotary: Rotary, hidden: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        # View the contiguous projection as heads first, then split: a view of a split
        # (non-contiguous) slice makes Inductor guard on the token count being > 1.
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, cfg.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q = apply_rotary(q, rotary)
        k = apply_rotary(k, rotary)
        if cfg.chunked_prefix:
            out = self._chunked_prefix_attention(q, k, v)
        else:
            out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1))

    def _chunked_prefix_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # The new tokens attend over themselves (and are saved to the cache); each chunk of
        # the cached prefix is attended apart and merged in exactly by LSE, in one op.
        out, lse = self.attn(q, k, v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
        self.attn.merge_prefix_chunks(q, out, lse)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = _parallel(tp)
        if tp is None:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        else:
            # Gate and up are split section by section, so the local output still chunks into (gate, up).
            self.gate_up_proj = ColumnParallelLinear(
                cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], tp=tp)
            self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if fused.eager_step(gate):
            return self.down_proj(fused.silu_mul(gate, up))
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, rotary: Rotary, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(rotary, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Token ids ``[T]`` and positions ``[T]`` in, logits ``[T, vocab]`` out.

    ``seed=None`` keeps torch's default initialisation: not reproducible, but fast when the
    model is built under ``with torch.device("cuda"):`` (the seeded draw runs on the CPU, so
    that every device gets the same weights, about a minute and a half for the 8B shape).

    The batch's request structure comes from the forward context, so the same call works
    for prefill, extend, decode and mixed batches.

    ``tp`` (a :class:`fullcg.distributed.TensorParallel` of size > 1) shards the model over
    its group, as the module doc says; every rank builds it with the same arguments and runs
    the same steps. The seeded weights are drawn at full size, in the single-device model's
    order, and each rank keeps its slice, so the sharded model computes what the
    single-device one does (up to float rounding in the all-reduce). With ``seed=None`` each
    rank keeps torch's default initialisation, which differs between ranks: load weights
    afterwards (``load_full`` of the parallel linears, ``copy_`` of the replicated ones).
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        seed: int | None = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        #: The tensor-parallel group (None: the single-device model).
        self.tp = _parallel(tp)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if seed is not None:
            self._init_weights(seed)
        self.to(device=device, dtype=dtype)
        self.inv_freq = self.inv_freq.float()  # rotary frequencies stay float32 whatever the dtype

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Deterministic across devices: drawn on the CPU from one generator, in a fixed order.
        # A sharded model draws every parameter at its full size and keeps its slice, so
        # that it holds exactly the single-device model's weights.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif self.tp is None:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            else:
                owner_name, _, attr = name.rpartition(".")
                owner = self.get_submodule(owner_name)
                if isinstance(owner, (ColumnParallelLinear, RowParallelLinear)):
                    full = torch.randn(owner.full_shape(attr), generator=g) / owner.full_shape(attr)[-1] ** 0.5
                    p.copy_(owner.shard(attr, full))
                elif isinstance(owner, fullcg.Attention) and attr == "sinks":
                    heads = self.cfg.num_heads
                    start = self.get_submodule(owner_name.rpartition(".")[0]).head_start
                    full = torch.randn(heads, generator=g) / heads**0.5
                    p.copy_(full[start : start + owner.num_heads])
                else:
                    fan_in = p.shape[-1]
                    p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)

    def attention_layers(self) -> list[fullcg.Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> None:
        """Give every attention layer a paged cache of ``num_pages`` pages, in the model's dtype and device."""
        ref = self.lm_head.weight
        for attn in self.attention_layers():
            attn.allocate_kv_cache(num_pages, page_size, dtype=ref.dtype, device=ref.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        fullcg.context.check_positions(positions)  # eager steps; compiled ones under debug_checks
        hidden = self.embed_tokens(input_ids)
        rotary = rotary_angles(positions, self.inv_freq)
        for layer in self.layers:
            hidden = layer(rotary, hidden)
        return self.lm_head(self.norm(hidden))
