"""The ``fullcg`` custom ops (importing this package registers them)."""

from fullcg.ops.attention import (
    ATTENTION_OPS,
    attention,
    attention_with_lse,
    breakable_attention,
    breakable_attention_with_lse,
    gather_prefix_chunk,
    merge_attn_states,
    merge_prefix_chunks,
)
from fullcg.ops.linear import skinny_linear

__all__ = [
    "ATTENTION_OPS",
    "attention",
    "attention_with_lse",
    "breakable_attention",
    "breakable_attention_with_lse",
    "gather_prefix_chunk",
    "merge_attn_states",
    "merge_prefix_chunks",
    "skinny_linear",
]
