"""A DeepSeek-V2/V3-shaped decoder built on :class:`fullcg.MLAAttention`.

Multi-head latent attention over a latent paged cache (``kv_lora_rank + qk_rope_head_dim``
values per token and layer), DeepSeek's decoupled rotary embedding (interleaved pairs by
default, YaRN optional), a dense SwiGLU MLP in the first ``first_k_dense_replace`` layers
and a mixture of experts after them: sigmoid-scored, group-limited top-k routed experts
plus shared experts, as DeepSeek-V3 routes.

Module and parameter names are Hugging Face's ``DeepseekV3ForCausalLM``'s (without its
``model.`` prefix), so :meth:`DeepseekModel.load_hf_state_dict` is a rename, and
:meth:`DeepseekModel.from_hf` gives a model whose logits equal HF's. The MoE runs every
expert on every token, weighted by the router (zero for experts not chosen): static
shapes, so one graph and one CUDA graph serve every token count, at ``n_routed_experts /
num_experts_per_tok`` times the FLOPs of a sparse dispatch. Right for tests and decode
benchmarks; a serving engine would dispatch tokens to experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import fullcg
from fullcg.models.llama import RMSNorm, Rotary, rotary_angles

__all__ = ["YarnScaling", "DeepseekConfig", "DeepseekModel"]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times the original (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling, with the fields (and defaults) of a Hugging Face ``rope_scaling``
    / ``rope_parameters`` dict of ``rope_type`` ``"yarn"``.

    It changes three things, each as transformers computes it: the inverse frequencies
    (:meth:`inv_freq`), a factor on cos and sin (:meth:`rotary_factor`), and, with
    ``mscale_all_dim``, the softmax scale (:meth:`softmax_scale_factor`).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    #: Overrides the cos/sin factor that ``mscale`` and ``mscale_all_dim`` would give.
    attention_factor: float | None = None
    #: Round the correction range to whole dimensions (transformers' default).
    truncate: bool = True

    _KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or self.factor < 1:
            raise ValueError(f"YarnScaling: factor must be a number >= 1, got {self.factor!r}")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"YarnScaling: original_max_position_embeddings must be a positive integer, got {value!r}")

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> YarnScaling:
        """From a Hugging Face rope dict (``{"rope_type" or "type": "yarn", "factor": ..., ...}``);
        ``rope_theta`` and ``partial_rotary_factor`` 1.0 in it are accepted and ignored here."""
        rope_type = params.get("rope_type", params.get("type", "yarn"))
        if rope_type != "yarn":
            raise ValueError(
                f"YarnScaling: rope type {rope_type!r} is not YaRN; DeepseekModel supports 'default' and 'yarn'")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "YarnScaling: partial_rotary_factor must be 1.0 (DeepSeek rotates all qk_rope_head_dim values)")
        unknown = set(params) - set(cls._KEYS) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if unknown:
            raise ValueError(
                f"YarnScaling: unknown rope parameters {sorted(unknown)}; expected some of {list(cls._KEYS)}")
        if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
            raise ValueError("YarnScaling: a YaRN rope dict needs 'factor' and 'original_max_position_embeddings'")
        given = {k: params[k] for k in cls._KEYS if k in params and params[k] is not None}
        # transformers reads beta_fast/beta_slow as `value or default`: 0 means the default.
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            given[key] = given.get(key) or default
        return cls(**given)

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """float32 ``[dim / 2]``: the extrapolated (original) frequencies for high-frequency
        pairs, interpolated (divided by ``factor``) for low-frequency ones, a linear ramp between."""

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def rotary_factor(self) -> float:
        """The factor on cos and sin (transformers' ``attention_scaling``): 1.0 when ``mscale``
        equals ``mscale_all_dim``, as in DeepSeek's checkpoints."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))
        return yarn_get_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """``mscale(factor, mscale_all_dim)`` (1.0 without ``mscale_all_dim``); DeepSeek
        multiplies the softmax scale by its square."""
        return yarn_get_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DeepseekConfig: {name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """Sizes and options of a :class:`DeepseekModel` (names as in HF's ``DeepseekV3Config``,
    ``num_hidden_layers`` as ``num_layers`` and ``num_attention_heads`` as ``num_heads``)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    #: Rank of the query compression (q_a_proj, q_a_layernorm, q_b_proj); None: one q_proj.
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    #: YaRN scaling (a :class:`YarnScaling`, or an HF rope dict, converted); None: plain rope.
    rope_scaling: YarnScaling | None = None
    #: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ...; False: halves.
    rope_interleave: bool = True
    #: The eps of the hidden-state norms (the latent norms use 1e-6 whatever it is, as HF).
    rms_norm_eps: float = 1e-6
    #: Biases on q_a_proj, kv_a_proj_with_mqa and o_proj (never on q_proj or q_b_proj, as in HF).
    attention_bias: bool = False
    #: Layers before this one have a dense MLP, the rest a mixture of experts.
    first_k_dense_replace: int = 1
    #: Routed experts per MoE layer; 0: every layer dense.
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    #: Experts are routed in groups: only the ``topk_group`` best of ``n_group`` groups (by
    #: the sum of each group's two best scores) may be chosen from.
    n_group: int = 4
    topk_group: int = 2
    moe_intermediate_size: int = 32
    #: Shared experts, always on, as one MLP ``n_shared_experts * moe_intermediate_size`` wide.
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # an HF rope dict; a frozen dataclass keeps its fields
            object.__setattr__(self, "rope_scaling", YarnScaling.from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"DeepseekConfig: rope_scaling must be a YarnScaling, a YaRN dict or None, "
                             f"got {self.rope_scaling!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int(getattr(self, name), name)
        if self.q_lora_rank is not None:
            _positive_int(self.q_lora_rank, "q_lora_rank (or None for a plain q_proj)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"DeepseekConfig: qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.n_routed_experts and self.first_k_dense_replace < self.num_layers:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size"):
            _positive_int(getattr(self, name), name)
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or experts // groups < 2:
            raise ValueError(
                f"DeepseekConfig: n_routed_experts ({experts}) must be a multiple of n_group ({groups}) with at least "
                "two experts per group (a group scores by its two best experts)"
            )
        if self.topk_group > groups:
            raise ValueError(f"DeepseekConfig: topk_group ({self.topk_group}) must be at most n_group ({groups})")
        if self.num_experts_per_tok > self.topk_group * (experts // groups):
            raise ValueError(
                f"DeepseekConfig: num_experts_per_tok ({self.num_experts_per_tok}) must be at most the experts of the "
                f"topk_group groups a token may use ({self.topk_group} x {experts // groups})"
            )
        if isinstance(self.n_shared_experts, bool) or not isinstance(self.n_shared_experts, int) \
                or self.n_shared_experts < 0:
            raise ValueError(f"DeepseekConfig: n_shared_experts must be an integer >= 0, got {self.n_shared_experts!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(qk_head_dim)``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
        when the scaling has ``mscale_all_dim`` (as DeepSeek and transformers compute it)."""
        scale = self.qk_head_dim ** (-0.5)
        if self.rope_scaling is not None:
            m = self.rope_scaling.softmax_scale_factor()
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has a mixture of experts (else a dense MLP)."""
        return bool(self.n_routed_experts) and layer_id >= self.first_k_dense_replace

    @classmethod
    def tiny(cls, **changes: object) -> DeepseekConfig:
        """Two layers (dense, then 8 experts in 4 groups), hidden 64: milliseconds on a CPU."""
        return dataclasses.replace(cls(), **changes)

    @classmethod
    def deepseek_v2_lite(cls, **changes: object) -> DeepseekConfig:
        """The shape of DeepSeek-V2-Lite (27 layers, 16 heads, no q compression, 64 experts),
        routed as DeepSeek-V3 routes (V2 scores experts with a softmax; these sizes are for benchmarks)."""
        base = cls(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16, q_lora_rank=None,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rope_scaling=YarnScaling(factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                                     mscale=0.707, mscale_all_dim=0.707),
            first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
            moe_intermediate_size=1408, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
        )
        return dataclasses.replace(base, **changes)

    @classmethod
    def deepseek_v3(cls, **changes: object) -> DeepseekConfig:
        """The shape of DeepSeek-V3 (61 layers, 128 heads, 256 experts in 8 groups)."""
        base = cls(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61, num_heads=128,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rope_scaling=YarnScaling(factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                                     mscale=1.0, mscale_all_dim=1.0),
            first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
            moe_intermediate_size=2048, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        )
        return dataclasses.replace(base, **changes)

    @classmethod
    def preset(cls, name: str, **changes: object) -> DeepseekConfig:
        presets = {"tiny": cls.tiny, "deepseek_v2_lite": cls.deepseek_v2_lite, "deepseek_v3": cls.deepseek_v3}
        if name not in presets:
            raise ValueError(f"unknown model size {name!r}; choose one of {', '.join(presets)}")
        return presets[name](**changes)

    @classmethod
    def from_hf(cls, hf_config: Any) -> DeepseekConfig:
        """From a transformers ``DeepseekV3Config`` (its ``rope_parameters``, or the
        ``rope_scaling`` and ``rope_theta`` of older versions)."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"DeepseekConfig.from_hf: hidden_act {act!r} is not supported; DeepseekModel uses SiLU")
        if getattr(hf_config, "tie_word_embeddings", False):
            raise ValueError("DeepseekConfig.from_hf: tie_word_embeddings=True is not supported; DeepSeek's lm_head "
                             "is a weight of its own")
        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(
                f"DeepseekConfig.from_hf: rope type {rope_type!r} is not supported; use 'default' or 'yarn'")
        scaling = YarnScaling.from_dict(rope) if rope_type == "yarn" else None
        n_layers = hf_config.num_hidden_layers
        first_dense = hf_config.first_k_dense_replace
        return cls(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_layers=n_layers,
            num_heads=hf_config.num_attention_heads, q_lora_rank=hf_config.q_lora_rank,
            kv_lora_rank=hf_config.kv_lora_rank, qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
            rope_theta=float(rope_theta), rope_scaling=scaling,
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)), rms_norm_eps=hf_config.rms_norm_eps,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            # HF builds a MoE in every layer from first_k_dense_replace on; None counts as 0.
            first_k_dense_replace=n_layers if first_dense is None else first_dense,
            n_routed_experts=hf_config.n_routed_experts or 0, num_experts_per_tok=hf_config.num_experts_per_tok,
            n_group=hf_config.n_group, topk_group=hf_config.topk_group,
            moe_intermediate_size=hf_config.moe_intermediate_size, n_shared_experts=hf_config.n_shared_experts,
            routed_scaling_factor=float(hf_config.routed_scaling_factor), norm_topk_prob=bool(hf_config.norm_topk_prob),
        )


#: The eps of q_a_layernorm and kv_a_layernorm: DeepSeek's code and transformers build them with
#: the RMSNorm default, not ``rms_norm_eps`` (which only the hidden-state norms use).
LATENT_NORM_EPS = 1e-6


def apply_rope(x: torch.Tensor, rotary: Rotary, interleave: bool) -> torch.Tensor:
    """DeepSeek's rotary embedding of ``x [T, H, R]`` by ``(cos, sin) [T, 1, R/2]``.

    Interleaved: pairs ``(x0, x1), (x2, x3), ...`` rotate, and the result is laid out as all
    rotated first members, then all second members, exactly as transformers'
    ``apply_rotary_pos_emb_interleave`` (queries and keys alike, so their dot products are
    those of the interleaved layout). Otherwise the halves rotate (``rotate_half``).
    """
    cos, sin = rotary
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DeepseekAttention(nn.Module):
    """MLA: the query (optionally through a low-rank ``q_a``/``q_b`` pair), one latent and
    one rope key per token, attended in the absorbed form by :class:`fullcg.MLAAttention`."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        q_out = cfg.num_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)  # no bias even with attention_bias, as HF
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.mla = fullcg.MLAAttention(
            cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
            layer_id=layer_id, scale=cfg.softmax_scale,
        )

    def forward(self, rotary: Rotary, hidden: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        # View the contiguous projection as heads first, then split (as llama.py, for Inductor).
        q = q.view(-1, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_rope(q_pe, rotary, cfg.rope_interleave)
        # The rope key is one "head" shared by all query heads.
        k_pe = apply_rope(k_pe.unsqueeze(1), rotary, cfg.rope_interleave).squeeze(1)
        out = self.mla(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight)  # [T, heads, v], a transposed view
        # Copy to token-major before flattening: reshaping (or .contiguous()) of the transposed
        # view makes Dynamo guard that the token count is not 1 (a second graph for decode).
        out = out.clone(memory_format=torch.contiguous_format)
        return self.o_proj(out.view(-1, cfg.num_heads * cfg.v_head_dim))


class DeepseekMLP(nn.Module):
    """SwiGLU: the dense MLP of the first layers, and the shared experts of MoE layers."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekRouter(nn.Module):
    """DeepSeek-V3's router: sigmoid scores; the choice adds a per-expert correction bias and
    is limited to the best groups; the chosen experts' (unbiased) scores, normalised when
    ``norm_topk_prob``, times ``routed_scaling_factor``, weight them. Runs in float32
    whatever the model's dtype (the weight and bias stay float32, as in transformers)."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routing weights ``float32 [T, n_routed_experts]``, zero for the experts not chosen."""
        cfg = self.cfg
        experts, groups = cfg.n_routed_experts, cfg.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        expert_mask = group_mask.repeat_interleave(experts // groups, dim=1)  # [T, experts]
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        return torch.zeros_like(scores).scatter(1, idx, weights)


class DeepseekExperts(nn.Module):
    """The routed experts' weights as transformers stores them: ``gate_up_proj [E, 2I, D]``
    (gate rows, then up rows) and ``down_proj [E, D, I]``."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """Every expert on every token ``x [T, D]``, summed with ``routing [T, E]`` weights.

        Dense on purpose: no data-dependent shapes, so the step compiles to one graph for
        every token count and captures as a CUDA graph. (bmm, not einsum, as in mla.py.)
        """
        xs = x.unsqueeze(0).expand(self.gate_up_proj.shape[0], -1, -1)  # [E, T, D]
        gate, up = torch.bmm(xs, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
        out = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, D]
        return (out * routing.t().unsqueeze(-1).to(out.dtype)).sum(dim=0)


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts (always on)."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.gate = DeepseekRouter(cfg)
        self.experts = DeepseekExperts(cfg)
        self.shared_experts = DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x)) + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DeepseekAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = DeepseekMoE(cfg) if cfg.is_moe_layer(layer_id) else DeepseekMLP(
            cfg.hidden_size, cfg.intermediate_size)

    def forward(self, rotary: Rotary, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(rotary, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekModel(nn.Module):
    """Token ids ``[T]`` and positions ``[T]`` in, logits ``[T, vocab]`` out (packed tokens of
    every request of a step; the request structure comes from the forward context).

    ``seed`` draws deterministic random weights on the CPU (routers and correction biases
    included); ``seed=None`` keeps torch's initialisation (fast on a GPU, not reproducible).
    The routers stay float32 whatever ``dtype``. Weights of a transformers
    ``DeepseekV3ForCausalLM``: :meth:`from_hf` or :meth:`load_hf_state_dict`.
    """

    def __init__(
        self,
        cfg: DeepseekConfig,
        *,
        seed: int | None = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        dim = cfg.qk_rope_head_dim
        if cfg.rope_scaling is None:
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.rotary_factor = 1.0
        else:
            inv_freq = cfg.rope_scaling.inv_freq(dim, cfg.rope_theta)
            self.rotary_factor = cfg.rope_scaling.rotary_factor()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if seed is not None:
            self._init_weights(seed)
        self.to(device=device, dtype=dtype)
        # Rotary frequencies and routers stay float32 whatever the dtype (routing in bf16
        # would pick other experts than the checkpoint's reference implementation).
        self.inv_freq = self.inv_freq.float()
        for module in self.modules():
            if isinstance(module, DeepseekRouter):
                module.float()

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Deterministic across devices: drawn on the CPU from one generator, in a fixed order.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))

    def mla_layers(self) -> list[fullcg.MLAAttention]:
        """Each layer's :class:`fullcg.MLAAttention`, in layer order."""
        return [layer.self_attn.mla for layer in self.layers]

    def attention_layers(self) -> list[fullcg.Attention]:
        """The :class:`fullcg.Attention` inside each MLA layer (what holds the latent cache)."""
        return [mla.attn for mla in self.mla_layers()]

    def allocate_kv_cache(
        self, num_pages: int, page_size: int, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[fullcg.KVCache]:
        """Give every layer a latent paged cache of ``num_pages`` pages of ``page_size`` tokens,
        ``kv_lora_rank + qk_rope_head_dim`` values per token; dtype and device default to
        the model's. Returns the caches, in layer order."""
        ref = self.lm_head.weight
        return [mla.allocate_kv_cache(num_pages, page_size, dtype=dtype or ref.dtype, device=device or ref.device)
                for mla in self.mla_layers()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        fullcg.context.check_positions(positions)  # eager steps; compiled ones under debug_checks
        hidden = self.embed_tokens(input_ids)
        cos, sin = rotary_angles(positions, self.inv_freq)  # once per step, shared by every layer
        if self.rotary_factor != 1.0:  # YaRN's magnitude correction, on cos and sin as transformers applies it
            cos, sin = cos * self.rotary_factor, sin * self.rotary_factor
        for layer in self.layers:
            hidden = layer((cos, sin), hidden)
        return self.lm_head(self.norm(hidden))

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy in the weights of a transformers ``DeepseekV3ForCausalLM`` state dict (its key
        names: ``model.layers.0.self_attn.kv_b_proj.weight``, ``lm_head.weight``, ...).

        Strict: a missing or unexpected key (an FP8 checkpoint's ``weight_scale_inv``, the
        multi-token-prediction layer ``model.layers.{num_layers}.*`` of a raw DeepSeek-V3
        checkpoint) or a shape that differs raises, naming them; nothing is copied then.
        """
        ours = self.state_dict(keep_vars=True)  # parameters and persistent buffers, as tensors we can copy into
        theirs = {(name if name.startswith("lm_head.") else name.removeprefix("model.")): (name, t)
                  for name, t in state_dict.items()}
        missing = sorted(n if n.startswith("lm_head.") else "model." + n for n in ours.keys() - theirs.keys())
        unexpected = sorted(theirs[n][0] for n in theirs.keys() - ours.keys())
        if missing or unexpected:
            raise KeyError(
                f"DeepseekModel.load_hf_state_dict: the state dict does not match this model: missing keys {missing}, "
                f"unexpected keys {unexpected}; build the model from the checkpoint's config (DeepseekConfig.from_hf) "
                "and drop keys it does not hold"
            )
        wrong = [f"{theirs[n][0]}: {tuple(theirs[n][1].shape)} != {tuple(t.shape)}" for n, t in ours.items()
                 if theirs[n][1].shape != t.shape]
        if wrong:
            raise ValueError(f"DeepseekModel.load_hf_state_dict: shapes differ (checkpoint != model): {wrong}")
        for name, t in ours.items():
            t.copy_(theirs[name][1])

    @classmethod
    def from_hf(
        cls, hf_model: nn.Module, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    ) -> DeepseekModel:
        """A :class:`DeepseekModel` with the config and weights of a transformers
        ``DeepseekV3ForCausalLM`` (in its dtype and device unless given)."""
        ref = hf_model.lm_head.weight
        model = cls(DeepseekConfig.from_hf(hf_model.config), seed=None, dtype=dtype or ref.dtype,
                    device=device or ref.device)
        model.load_hf_state_dict(hf_model.state_dict())
        return model
