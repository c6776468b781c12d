"""Tiny random Hugging Face causal LMs for the tests (built from configs: no network)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[test]'")

from fullcg.integrations import transformers as fhf  # noqa: E402

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

#: Architecture name -> (model class, config). Each covers what sets it apart.
ARCHITECTURES = {
    "llama": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(**_COMMON)),
    # Without a sliding window: test_hf_architectures.py covers windows.
    "mistral": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(**_COMMON, sliding_window=None)),
    "qwen2": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**_COMMON)),  # q/k/v biases
    "qwen3": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**_COMMON, head_dim=16)),  # QK-norm
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights that make every part matter: HF initializes biases to 0 and norm weights to 1,
    which would hide a q/k/v bias or a QK-norm that fullcg dropped."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def build(arch: str, seed: int = 0, **config_changes: object) -> torch.nn.Module:
    """A tiny random model of ``arch`` with HF's own ``sdpa`` attention, in eval mode, fp32."""
    cls, config = ARCHITECTURES[arch]()
    for key, value in config_changes.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return randomize(cls(config), seed).eval()


def build_pair(arch: str, *, num_pages: int = 64, page_size: int = 4, seed: int = 0):
    """(HF reference with sdpa, an identical copy prepared for fullcg, its PackedCausalLM)."""
    ref = build(arch, seed)
    model = copy.deepcopy(ref)
    step = fhf.prepare(model, num_pages=num_pages, page_size=page_size)
    return ref, model, step
