"""The plain-PyTorch peer users pick instead of fullcg: gpt-fast style decoding.

A static KV cache per layer ``[batch, max_len, kv_heads, head_dim]``, SDPA with a mask
over the whole cache, and ``torch.compile(mode="reduce-overhead", fullgraph=True)``. It
shares the weights of a :class:`fullcg.models.llama.LlamaModel`, so both compute the same
function and time the same weight traffic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fullcg.models.llama import LlamaModel, apply_rotary, rotary_angles


class PeerDecoder(torch.nn.Module):
    def __init__(self, model: LlamaModel, batch: int, max_len: int) -> None:
        super().__init__()
        self.m = model
        cfg = model.cfg
        ref = model.lm_head.weight
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=ref.dtype, device=ref.device) for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=ref.dtype, device=ref.device) for _ in range(cfg.num_layers)]
        self.max_len = max_len

    def fill_random(self) -> None:
        for t in self.k_cache + self.v_cache:
            t.normal_()

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode token per sequence: ``input_ids [B]``, ``input_pos [B]`` (same position for all)."""
        m, cfg = self.m, self.m.cfg
        b = input_ids.shape[0]
        hidden = m.embed_tokens(input_ids)
        mask = (torch.arange(self.max_len, device=input_ids.device) <= input_pos[0]).view(1, 1, 1, -1)
        rotary = rotary_angles(input_pos, m.inv_freq)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            qkv = attn.qkv_proj(x).view(b, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
            q, k, v = qkv.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
            q = apply_rotary(q, rotary)
            k = apply_rotary(k, rotary)
            self.k_cache[i].index_copy_(1, input_pos[:1], k.unsqueeze(1))
            self.v_cache[i].index_copy_(1, input_pos[:1], v.unsqueeze(1))
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),  # [B, H, 1, D]
                self.k_cache[i].transpose(1, 2),
                self.v_cache[i].transpose(1, 2),
                attn_mask=mask,
                enable_gqa=True,
            )
            hidden = hidden + attn.o_proj(out.reshape(b, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return m.lm_head(m.norm(hidden))
