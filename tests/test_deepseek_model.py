"""fullcg.models.deepseek: a DeepSeek-V3-shaped decoder on fullcg.MLAAttention equals
transformers' DeepseekV3ForCausalLM (eager attention, no cache) step by step, eagerly and
compiled, in greedy generation, and loads its weights strictly."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.models.deepseek import DeepseekConfig, DeepseekModel, YarnScaling

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[test]'")

PAGE = 4
TOLERANCE = dict(atol=1e-4, rtol=1e-4)
#: Each request's whole token sequence (prompt and the tokens fed back while decoding).
LENGTHS = [13, 7, 4]
#: Per step, (request, first position, new tokens) of each request in it.
STEPS = [
    [(0, 0, 4), (1, 0, 5)],  # prefill of two prompts (request 0's first chunk)
    [(0, 4, 4)],  # chunked prefill: request 0's next chunk over its cached prefix (extend)
    [(0, 8, 3), (1, 5, 1), (2, 0, 3)],  # mixed: extend, decode and prefill in one step
    [(0, 11, 1), (1, 6, 1), (2, 3, 1)],  # decode
    [(0, 12, 1)],  # decode, one token
]
PAGES_PER_REQUEST = 4  # request r owns pages [4r, 4r + 4): 16 tokens, the longest needs 13
NUM_PAGES = PAGES_PER_REQUEST * len(LENGTHS)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        # mscale != mscale_all_dim, so cos/sin get a factor other than 1 and the softmax scale one too.
        "mscale": 1.0, "mscale_all_dim": 0.8}

#: name -> HF config changes. q compression or a plain q_proj, with and without YaRN; the
#: first with a large rms_norm_eps (HF's q_a/kv_a norms keep eps 1e-6 whatever it is), the
#: last with attention biases and rotary over halves instead of interleaved pairs.
VARIANTS = {
    "q_lora": dict(q_lora_rank=32, rms_norm_eps=1e-2),
    "q_proj": dict(q_lora_rank=None),
    "q_lora_yarn": dict(q_lora_rank=32, rope_scaling=YARN),
    "q_proj_yarn": dict(q_lora_rank=None, rope_scaling=YARN),
    "q_proj_yarn_bias_halves": dict(q_lora_rank=None, rope_scaling=YARN, attention_bias=True, rope_interleave=False),
}


def hf_config(**changes: object) -> transformers.DeepseekV3Config:
    """Two layers, the second a MoE of 8 experts in 4 groups (2 groups allowed, 2 experts a
    token) plus one shared expert; rank 32 + rope 8 per token."""
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
              moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=None, pad_token_id=0)
    kw.update(changes)
    config = transformers.DeepseekV3Config(**kw)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def build_hf(seed: int = 0, **changes: object) -> torch.nn.Module:
    """A random HF DeepseekV3ForCausalLM, fp32, eval. Every part matters: norm weights near 1,
    biases and the routers' correction biases near 0 but not 0, matrices by fan-in."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config(**changes)).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def build_pair(variant: str = "q_lora_yarn", seed: int = 0) -> tuple[torch.nn.Module, DeepseekModel]:
    """(HF reference, our model with its weights and a latent cache)."""
    ref = build_hf(seed, **VARIANTS[variant])
    model = DeepseekModel.from_hf(ref)
    model.allocate_kv_cache(NUM_PAGES, PAGE)
    return ref, model


def sequences(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in LENGTHS]


def step_inputs(seqs: list[torch.Tensor], step: int) -> tuple[torch.Tensor, torch.Tensor, fullcg.AttentionMetadata]:
    parts = STEPS[step]
    ids = torch.cat([seqs[r][start: start + n] for r, start, n in parts])
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in parts])
    table = torch.stack([torch.arange(r * PAGES_PER_REQUEST, (r + 1) * PAGES_PER_REQUEST, dtype=torch.int32)
                         for r, _, _ in parts])
    md = fullcg.AttentionMetadata.build([n for *_, n in parts], [start for _, start, _ in parts], table, PAGE)
    return ids, positions, md


@torch.no_grad()
def hf_logits(ref: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF's logits over each whole sequence, no cache (causal: row p sees tokens 0..p)."""
    return [ref(seq[None], use_cache=False).logits[0] for seq in seqs]


def expected_rows(full: list[torch.Tensor], step: int) -> torch.Tensor:
    return torch.cat([full[r][start: start + n] for r, start, n in STEPS[step]])


def run_steps(ref: torch.nn.Module, model: DeepseekModel, run, steps=range(len(STEPS))) -> None:
    seqs = sequences()
    full = hf_logits(ref, seqs)
    with torch.inference_mode():
        for step in steps:
            ids, positions, md = step_inputs(seqs, step)
            with fullcg.forward_context(md, model):
                got = run(ids, positions)
            torch.testing.assert_close(got, expected_rows(full, step), **TOLERANCE, msg=lambda m: f"step {step}: {m}")


def test_the_steps_cover_prefill_chunked_prefill_mixed_and_decode():
    seqs = sequences()
    modes = [{m.value for m in step_inputs(seqs, s)[2].forward_modes} for s in range(len(STEPS))]
    assert modes == [{"prefill"}, {"extend"}, {"extend", "decode", "prefill"}, {"decode"}, {"decode"}]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_eager_logits_equal_hf_deepseek_v3_every_step(variant):
    ref, model = build_pair(variant)
    run_steps(ref, model, model)


def test_the_config_from_hf_carries_yarn_interleave_and_moe():
    cfg = DeepseekConfig.from_hf(hf_config(q_lora_rank=None, rope_scaling=YARN, rope_interleave=False))
    assert cfg.q_lora_rank is None and cfg.rope_interleave is False
    assert cfg.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
                                           mscale=1.0, mscale_all_dim=0.8)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 4, 2)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    ref = build_hf(**VARIANTS["q_proj_yarn"])
    # The softmax scale and the rotary frequencies and factor are HF's.
    assert DeepseekModel(cfg).layers[0].self_attn.mla.attn.scale == pytest.approx(ref.model.layers[0].self_attn.scaling,
                                                                                  rel=1e-12)
    model = DeepseekModel.from_hf(ref)
    torch.testing.assert_close(model.inv_freq, ref.model.rotary_emb.inv_freq, atol=0, rtol=0)
    assert model.rotary_factor == pytest.approx(ref.model.rotary_emb.attention_scaling, rel=1e-12) != 1.0


@pytest.mark.parametrize("compiler", ["eager", "none"])
@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "auto"])
def test_compiled_logits_equal_hf_deepseek_v3_in_every_graph_mode(compiler, graph_mode):
    torch._dynamo.reset()
    ref, model = build_pair("q_lora_yarn")
    run = fullcg.compile(model, compiler=compiler, graph_mode=graph_mode)
    fullcg.reset_graph_mode_counts()
    run_steps(ref, model, run)
    assert sum(fullcg.graph_mode_counts().values()) == len(STEPS), "every step ran through fullcg"
    if compiler != "none":
        assert len(run.runners) == 1, "one graph for every token count, one-token steps included"


def test_greedy_generate_equals_hf_generate_token_for_token():
    ref, model = build_pair("q_lora_yarn", seed=1)
    prompts = [[5, 17, 29, 41, 53, 65, 77, 89, 101], [7, 19, 31], [11, 23, 35, 47, 59]]
    # A budget of 8 tokens and 2 requests at a time: chunked prefill, mixed steps, requests joining.
    got = fullcg.generate(model, prompts, 6, max_num_tokens=8, max_num_seqs=2,
                          config=fullcg.FullCGConfig(compiler="none"), progress=False)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
    assert got == expected
    assert any(len(set(g)) > 2 for g in got)  # not a degenerate model repeating one token


def test_the_cache_holds_rank_plus_rope_values_per_token_per_layer():
    cfg = DeepseekConfig.tiny()
    model = DeepseekModel(cfg)
    caches = model.allocate_kv_cache(8, PAGE)
    assert len(caches) == cfg.num_layers
    for layer, cache in zip(model.attention_layers(), caches):
        assert layer.kv_cache is cache
        assert tuple(cache.k.shape) == (8, PAGE, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert cache.v.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr(), "the value is the latent"
        assert cache.k.untyped_storage().nbytes() == 8 * PAGE * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_the_tiny_model_runs_a_step_with_its_own_random_weights():
    model = DeepseekModel(DeepseekConfig.tiny())
    model.allocate_kv_cache(NUM_PAGES, PAGE)
    ids, positions, md = step_inputs(sequences(), 0)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        logits = model(ids, positions)
    assert logits.shape == (9, 256) and torch.isfinite(logits).all()
    assert torch.equal(DeepseekModel(DeepseekConfig.tiny()).lm_head.weight, model.lm_head.weight), "seeded"


def test_loading_a_state_dict_with_a_missing_or_extra_key_raises_naming_it():
    ref = build_hf()
    model = DeepseekModel(DeepseekConfig.from_hf(ref.config))
    before = model.lm_head.weight.clone()
    state = dict(ref.state_dict())
    del state["model.layers.1.mlp.gate.e_score_correction_bias"]
    with pytest.raises(KeyError, match=r"missing keys \['model\.layers\.1\.mlp\.gate\.e_score_correction_bias'\]"):
        model.load_hf_state_dict(state)
    state = {**ref.state_dict(), "model.layers.0.self_attn.kv_b_proj.weight_scale_inv": torch.ones(1)}
    with pytest.raises(KeyError, match=r"unexpected keys \['model\.layers\.0\.self_attn\.kv_b_proj\.weight_scale_inv"):
        model.load_hf_state_dict(state)
    state = {**ref.state_dict(), "lm_head.weight": torch.zeros(5, 64)}
    with pytest.raises(ValueError, match=r"lm_head\.weight: \(5, 64\) != \(128, 64\)"):
        model.load_hf_state_dict(state)
    assert torch.equal(model.lm_head.weight, before), "nothing is copied from a state dict that does not match"
    model.load_hf_state_dict(ref.state_dict())
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_bad_configs_name_the_fix():
    with pytest.raises(ValueError, match="multiple of n_group"):
        DeepseekConfig.tiny(n_routed_experts=6)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        DeepseekConfig.tiny(qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="supports 'default' and 'yarn'"):
        DeepseekConfig.tiny(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        DeepseekConfig.from_hf(hf_config(hidden_act="gelu"))
