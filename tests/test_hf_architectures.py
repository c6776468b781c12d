"""Hugging Face decoder architectures on fullcg: each runs equal to HF's eager attention, or is refused.

Every architecture in ``ARCHITECTURES`` is a tiny random model (2 layers, hidden size 64,
fp32, CPU) built from its config class. Its logits through fullcg equal HF's own eager
attention without a cache, recomputed over each request's whole sequence, on every step
(prefill, chunked prefill, mixed and decode steps), and greedy ``fullcg.generate`` equals
HF ``generate(do_sample=False)``. Prompts are longer than every sliding window, so a window
applied wrongly shows. The rest of the file pins down what ``prepare`` refuses, and the message.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import transformers

import fullcg
from fullcg.engine import BatchScheduler
from fullcg.integrations import transformers as fhf

TOLERANCE = 1e-4
WINDOW = 4  # every sliding window below: shorter than the prompts
# A budget of 8 tokens per step: prefill (chunked), extend + prefill, mixed, decode-only steps.
PROMPTS = [[3, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125], [7, 19, 31, 43, 55], [11, 23, 35]]
GENERATE_PROMPTS = [[3, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 9, 4], [7, 19, 31, 43, 55], [11, 23, 35],
                    [60, 61, 62, 63, 64, 65, 66]]

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_SLIDING_FULL = ["sliding_attention", "full_attention"]


def _arch(cls: str, config: str, **fields):
    return lambda: (getattr(transformers, cls), getattr(transformers, config)(**{**_TINY, **fields}))


#: name -> (builder of (model class, config), per-layer sliding windows, per-layer soft-caps).
#: The windows and soft-caps are what HF's masks and eager attention apply to each layer.
ARCHITECTURES = {
    "llama": (_arch("LlamaForCausalLM", "LlamaConfig"), [None, None], [None, None]),
    # One window for every layer (no layer_types): config.sliding_window.
    "mistral": (_arch("MistralForCausalLM", "MistralConfig", sliding_window=WINDOW), [WINDOW, WINDOW], [None, None]),
    # use_sliding_window: layers from max_window_layers on slide.
    "qwen2": (_arch("Qwen2ForCausalLM", "Qwen2Config", use_sliding_window=True, sliding_window=WINDOW,
                    max_window_layers=1), [None, WINDOW], [None, None]),
    "gemma": (_arch("GemmaForCausalLM", "GemmaConfig", head_dim=16), [None, None], [None, None]),
    # Attention logit soft-capping on every layer, final-logit soft-capping, sliding and full layers.
    "gemma2": (_arch("Gemma2ForCausalLM", "Gemma2Config", head_dim=16, sliding_window=WINDOW, layer_types=_SLIDING_FULL,
                     attn_logit_softcapping=2.0, final_logit_softcapping=5.0, query_pre_attn_scalar=16),
               [WINDOW, None], [2.0, 2.0]),
    # QK-norm, a local rotary base on sliding layers, query_pre_attn_scalar for the scale.
    "gemma3": (_arch("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=16, sliding_window=WINDOW,
                     layer_types=_SLIDING_FULL, query_pre_attn_scalar=24), [WINDOW, None], [None, None]),
    # Attention sinks (s_aux) and alternating sliding and full layers; a mixture of experts.
    "gpt_oss": (_arch("GptOssForCausalLM", "GptOssConfig", head_dim=16, sliding_window=WINDOW,
                      layer_types=_SLIDING_FULL, num_local_experts=4, num_experts_per_tok=2),
                [WINDOW, None], [None, None]),
    # Sliding layers with rotary, a full layer without.
    "cohere2": (_arch("Cohere2ForCausalLM", "Cohere2Config", sliding_window=WINDOW, layer_types=_SLIDING_FULL),
                [WINDOW, None], [None, None]),
    "phi3": (_arch("Phi3ForCausalLM", "Phi3Config", sliding_window=WINDOW), [WINDOW, WINDOW], [None, None]),
    # Fused qkv, partial rotary, parallel residual; the module calls its head size head_size.
    "gpt_neox": (_arch("GPTNeoXForCausalLM", "GPTNeoXConfig", num_key_value_heads=4), [None, None], [None, None]),
    # attention_multiplier as the softmax scale, embedding/residual/logit multipliers.
    "granite": (_arch("GraniteForCausalLM", "GraniteConfig", attention_multiplier=0.3, embedding_multiplier=2.0,
                      residual_multiplier=0.5, logits_scaling=2.0), [None, None], [None, None]),
    # QK-norm over all heads, norms after attention and MLP.
    "olmo2": (_arch("Olmo2ForCausalLM", "Olmo2Config"), [None, None], [None, None]),
    "starcoder2": (_arch("Starcoder2ForCausalLM", "Starcoder2Config", sliding_window=WINDOW),
                   [WINDOW, WINDOW], [None, None]),
    # Scales q itself and passes scaling=1.0 to the attention function.
    "opt": (_arch("OPTForCausalLM", "OPTConfig", ffn_dim=128, word_embed_proj_dim=64, num_key_value_heads=4,
                  tie_word_embeddings=False),
            [None, None], [None, None]),
    # Multi-head latent attention over a latent cache (fullcg.MLAAttention): rank 16 + rope 8 per token.
    "deepseek_v3": (_arch("DeepseekV3ForCausalLM", "DeepseekV3Config", num_key_value_heads=4, head_dim=8,
                          q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                          first_k_dense_replace=1), [None, None], [None, None]),
    # DeepSeek-V2: the same latent attention with a complex rotary embedding (freqs_cis).
    "deepseek_v2": (_arch("DeepseekV2ForCausalLM", "DeepseekV2Config", num_key_value_heads=4, head_dim=8,
                          q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                          first_k_dense_replace=1), [None, None], [None, None]),
    # module.sliding_window is set on every layer; layer_types says none slides.
    "exaone4_full": (_arch("Exaone4ForCausalLM", "Exaone4Config", sliding_window=WINDOW,
                           layer_types=["full_attention"] * 2), [None, None], [None, None]),
    "exaone4": (_arch("Exaone4ForCausalLM", "Exaone4Config", sliding_window=WINDOW, layer_types=_SLIDING_FULL),
                [WINDOW, None], [None, None]),
    # Full layers with heads of their own size (32, sliding ones 16); the last two layers reuse
    # the keys and values of the last earlier layer of their type (KV sharing).
    "gemma4": (_arch("Gemma4ForCausalLM", "Gemma4TextConfig", num_hidden_layers=4, head_dim=16, global_head_dim=32,
                     sliding_window=WINDOW, layer_types=_SLIDING_FULL * 2, num_kv_shared_layers=2,
                     hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
               [WINDOW, None, WINDOW, None], [None] * 4),
    # No mask of Moshi's applies config.sliding_window; one as long as the longest sequence is no window.
    "moshi": (_arch("MoshiForCausalLM", "MoshiConfig", head_dim=16, sliding_window=_TINY["max_position_embeddings"]),
              [None, None], [None, None]),
}

#: Compiled: windows on every layer, soft-capping with sliding and full layers, sinks, and
#: multi-head latent attention.
COMPILED = ["mistral", "gemma2", "gpt_oss", "deepseek_v3", "deepseek_v2"]
GENERATE_COMPILED = ["gemma2", "gpt_oss"]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights that make every part matter (HF initializes biases to 0 and norm weights to 1,
    which would hide a bias, a norm or a sink dropped on the way): norm weights near 1, other
    vectors (biases, sinks) near 0, matrices scaled by their fan-in."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            base = 1.0 if "norm" in name and not name.endswith("bias") else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def build(arch: str, seed: int = 0, **config_changes) -> torch.nn.Module:
    """A tiny random ``arch`` with HF's eager attention (the reference), in eval mode."""
    make, _, _ = ARCHITECTURES[arch]
    cls, config = make()
    for key, value in config_changes.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize(cls(config), seed).eval()


def build_pair(arch: str):
    """(HF reference with eager attention, an identical copy prepared for fullcg, its PackedCausalLM)."""
    ref = build(arch)
    model = copy.deepcopy(ref)
    return ref, model, fhf.prepare(model, num_pages=64, page_size=4)


def reference_logits(ref: torch.nn.Module, step) -> torch.Tensor:
    """HF eager on each request's whole sequence so far, no cache; the rows of this step's new tokens."""
    rows = []
    with torch.no_grad():
        for req, q_len in zip(step.requests, step.metadata.query_lens):
            seq = req.tokens[: req.num_cached + q_len]
            rows.append(ref(torch.tensor([seq]), use_cache=False).logits[0, req.num_cached :])
    return torch.cat(rows)


def run_steps(ref, model_for_context, run, *, config=None):
    """Drive ``run`` through prefill, chunked prefill, mixed and decode steps; the largest
    logit difference from HF and the forward modes of each step."""
    sched = BatchScheduler(PROMPTS, 3, num_pages=64, page_size=4, max_num_tokens=8)
    worst, kinds = 0.0, []
    while (step := sched.next_step()) is not None:
        expected = reference_logits(ref, step)
        with torch.no_grad(), fullcg.forward_context(step.metadata, model_for_context, config=config):
            got = run(step.input_ids, step.positions)
        worst = max(worst, (got - expected).abs().max().item())
        kinds.append(frozenset(m.value for m in step.modes))
        # Both follow the reference's greedy tokens, so every step compares the same inputs.
        sched.advance(step, [int(expected[r].argmax()) if r is not None else None for r in step.sample_rows])
    return worst, kinds


# --- what runs: equal to HF on every step ---


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prepare_gives_each_layer_the_window_and_soft_cap_hf_applies(arch):
    _, windows, softcaps = ARCHITECTURES[arch]
    _, model, _ = build_pair(arch)
    layers = fhf.attention_layers(model)
    assert [a.sliding_window for a in layers] == windows
    assert [a.logit_softcap for a in layers] == softcaps


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_eager_logits_equal_hf_every_step(arch):
    ref, _, step_module = build_pair(arch)
    worst, kinds = run_steps(ref, step_module, step_module)
    assert worst < TOLERANCE
    assert kinds[0] == {"prefill"} and {"extend", "prefill"} <= kinds[1]  # chunked prefill
    assert any({"decode", "prefill"} <= k for k in kinds) and {"decode"} in kinds  # mixed, decode-only


@pytest.mark.parametrize("graph_mode", fullcg.config.GRAPH_MODES)
@pytest.mark.parametrize("arch", COMPILED)
def test_compiled_logits_equal_hf_every_step_in_every_graph_mode(arch, graph_mode):
    torch._dynamo.reset()
    ref, _, step_module = build_pair(arch)
    config = fullcg.FullCGConfig(graph_mode=graph_mode, compiler="eager")
    compiled = fullcg.compile(step_module, config)
    fullcg.reset_graph_mode_counts()
    worst, kinds = run_steps(ref, step_module, compiled, config=config)
    assert worst < TOLERANCE
    counts = fullcg.graph_mode_counts()
    assert sum(counts.values()) == len(kinds)  # every step ran compiled
    if graph_mode == "full_and_piecewise":
        # Prefill, chunked-prefill and mixed steps as pieces with attention between them,
        # decode-only steps as one graph with attention inside.
        decode_steps = sum(k == {"decode"} for k in kinds)
        assert counts == {"full:eager": decode_steps, "piecewise:eager": len(kinds) - decode_steps}
        assert 0 < decode_steps < len(kinds)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_inductor_compiled_logits_equal_hf_with_windows_soft_caps_and_sinks(arch):
    torch._dynamo.reset()
    ref, _, step_module = build_pair(arch)
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="inductor")
    compiled = fullcg.compile(step_module, config)
    assert run_steps(ref, step_module, compiled, config=config)[0] < TOLERANCE


@pytest.mark.parametrize("arch, compiled", [(a, False) for a in ARCHITECTURES] + [(a, True) for a in GENERATE_COMPILED],
                         ids=[f"{a}-eager" for a in ARCHITECTURES] + [f"{a}-compiled" for a in GENERATE_COMPILED])
def test_greedy_generate_equals_hf_generate_token_for_token(arch, compiled):
    if compiled:
        torch._dynamo.reset()
    ref, model, _ = build_pair(arch)
    # A budget of 8 tokens and 2 requests at a time: chunked prefill, mixed steps, requests joining.
    got = fullcg.generate(model, GENERATE_PROMPTS, 8, max_num_tokens=8, max_num_seqs=2, compile=compiled,
                          config=fullcg.FullCGConfig(compiler="eager"), progress=False)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                    for p in GENERATE_PROMPTS]
    assert got == expected
    assert len({t for g in got for t in g}) > 4  # not a degenerate model repeating a few tokens


@pytest.mark.parametrize("arch, feature_off", [
    ("mistral", {"sliding_window": None}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gpt_oss", {"layer_types": ["full_attention"] * 2}),
])
def test_windows_and_soft_caps_change_hf_logits_so_the_equality_tests_see_them(arch, feature_off):
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        on = build(arch)(prompt, use_cache=False).logits
        off = build(arch, **feature_off)(prompt, use_cache=False).logits
    assert (on - off).abs().max() > 100 * TOLERANCE


def test_sinks_change_hf_logits_so_the_equality_tests_see_them():
    prompt = torch.tensor([PROMPTS[0]])
    model = build("gpt_oss")
    with torch.no_grad():
        on = model(prompt, use_cache=False).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink no row attends to: as if there were none
        off = model(prompt, use_cache=False).logits
    assert (on - off).abs().max() > 100 * TOLERANCE


def test_the_softmax_scale_comes_from_each_call():
    # OPT multiplies q by 1/sqrt(head_dim) itself and passes scaling=1.0.
    _, model, _ = build_pair("opt")
    layer = model.model.decoder.layers[0].self_attn
    assert layer.scaling == 0.25 and layer.fullcg_attention.scale == 0.25
    ref, _, step_module = build_pair("opt")
    assert run_steps(ref, step_module, step_module)[0] < TOLERANCE


def test_a_window_transformers_applies_other_than_the_layers_is_an_error_naming_both():
    _, model, step_module = build_pair("mistral")
    model.model.layers[1].self_attn.fullcg_attention.sliding_window = None  # as if prepare read the config wrongly
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), 4)
    with torch.no_grad(), fullcg.forward_context(md, step_module), pytest.raises(
            fhf.UnsupportedModelError, match=r"layer 1\).*sliding_window=4.*window None"):
        step_module(torch.tensor([5, 6, 7]), torch.arange(3))


# --- what is refused at prepare, naming the feature and the layer ---


def _tiny(config_cls: str, **fields):
    return getattr(transformers, config_cls)(**{**_TINY, **fields})


REFUSED = {
    # Hybrids: token mixers whose state between steps fullcg does not keep.
    "lfm2 (short convolution)": (
        lambda: transformers.Lfm2ForCausalLM(_tiny("Lfm2Config", layer_types=["conv", "full_attention"])),
        r"short-convolution mixer \(Lfm2ShortConv\).*layer 0 \(model\.layers\.0\.conv\)"),
    "granitemoehybrid (Mamba2)": (
        lambda: transformers.GraniteMoeHybridForCausalLM(_tiny(
            "GraniteMoeHybridConfig", layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2)),
        r"Mamba \(state-space\) mixer \(GraniteMoeHybridMambaLayer\).*layer 0 \(model\.layers\.0\.mamba\)"),
    "qwen3_next (gated DeltaNet)": (
        lambda: transformers.Qwen3NextForCausalLM(_tiny(
            "Qwen3NextConfig", head_dim=16, layer_types=["linear_attention", "full_attention"], num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
        r"gated DeltaNet \(linear-attention\) mixer \(Qwen3NextGatedDeltaNet\).*layer 0 \(model\.layers\.0\.linear_attn\)"),
    "diffllama (two attention calls per layer)": (
        lambda: transformers.DiffLlamaForCausalLM(_tiny("DiffLlamaConfig")),
        r"differential attention \(DiffLlamaAttention attends twice per layer.*layer 0 \(model\.layers\.0\.self_attn\)"),
    "doge (dynamic mask)": (
        lambda: transformers.DogeForCausalLM(_tiny("DogeConfig", num_experts=4, num_experts_per_tok=2)),
        r"dynamic \(content-dependent\) attention mask \(DogeAttention.*layer 0 \(model\.layers\.0\.self_attn\)"),
    # HF's forward ignores the window, its cache applies it: forward and generate disagree past it.
    "moshi (a window no mask applies)": (
        lambda: transformers.MoshiForCausalLM(_tiny("MoshiConfig", head_dim=16, sliding_window=WINDOW)),
        r"sliding window no mask of MoshiForCausalLM applies \(config\.sliding_window=4;.*layer 0 \(model\.layers\.0\.self_attn\)"),
    "t5 (encoder-decoder)": (
        lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
        r"encoder-decoder models yet \(T5ForConditionalGeneration\)"),
    "bart (encoder-decoder)": (
        lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)),
        r"encoder-decoder models yet \(BartForConditionalGeneration\)"),
    "bloom (ALiBi)": (
        lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)),
        r"ALiBi position biases yet \(BloomForCausalLM"),
    "mpt (ALiBi)": (
        lambda: transformers.MptForCausalLM(transformers.MptConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4)),
        r"ALiBi position biases yet \(MptForCausalLM"),
    "falcon (ALiBi)": (
        lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)),
        r"ALiBi position biases yet \(FalconForCausalLM"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_prepare_refuses_naming_the_feature_and_layer(what):
    make, message = REFUSED[what]
    model = make().eval()
    with pytest.raises(fhf.UnsupportedModelError, match=message):
        fhf.prepare(model, num_pages=8, page_size=4)
    assert not fhf.attention_layers(model)  # refused before changing anything
    assert model.config._attn_implementation != "fullcg"


def test_a_hybrid_is_refused_by_its_layer_types_when_the_mixer_has_an_unknown_class_name(monkeypatch):
    make, _ = REFUSED["lfm2 (short convolution)"]
    model = make()
    monkeypatch.setattr(fhf, "_STATEFUL_MIXERS", ())  # as if the class were named otherwise
    with pytest.raises(fhf.UnsupportedModelError, match=r"causal convolution over past tokens.*layer 0"):
        fhf.prepare(model, num_pages=8, page_size=4)
    model.model.layers[0].conv.conv = torch.nn.Identity()  # and without the convolution to find
    with pytest.raises(fhf.UnsupportedModelError, match=r"short-convolution layers \(config\.layer_types\[0\] = 'conv'\)"):
        fhf.prepare(model, num_pages=8, page_size=4)


def test_gpt2_conv1d_is_a_linear_layer_not_a_convolution_mixer():
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert [a.layer_id for a in fhf.attention_layers(model)] == []
    fhf.prepare(model, num_pages=8, page_size=4)
    assert [a.layer_id for a in fhf.attention_layers(model)] == [0, 1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_keeps_one_latent_per_token_not_decompressed_keys_and_values(arch):
    """DeepSeek-V2/V3's attention runs as fullcg.MLAAttention: its cache holds the latent and
    the rope key (kv_lora_rank + qk_rope_head_dim values per token, one KV head), the value
    being the latent's view."""
    _, model, _ = build_pair(arch)
    found = 0
    for module in model.modules():
        if type(module).__name__ in ("DeepseekV3Attention", "DeepseekV2Attention"):
            assert isinstance(getattr(module, fhf._CHILD), fullcg.MLAAttention)
            found += 1
    assert found == 2
    for layer in fhf.attention_layers(model):
        cache = layer.kv_cache
        assert cache.v_in_k and tuple(cache.k.shape[2:]) == (1, 16 + 8) and cache.v.shape[-1] == 16


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("compiled", [False, True])
def test_deepseek_in_mha_form_for_prompt_steps_equals_hf_every_step(compiled, arch, monkeypatch):
    """Every step without decode requests runs MLA in MHA form (the new tokens up-projected,
    the cached prefix chunk by chunk), still over the latent cache: logits equal HF's."""
    from fullcg.ops import torch_ops

    gathered = []
    gather = torch_ops.gather_prefix_chunk
    monkeypatch.setattr(torch_ops, "gather_prefix_chunk", lambda *a: (gathered.append(1), gather(*a))[1])
    torch._dynamo.reset()
    ref, _, step_module = build_pair(arch)
    config = fullcg.FullCGConfig(mla_mha_min_tokens=1, mla_mha_min_heads=1)  # its few heads too
    run = fullcg.compile(step_module, compiler="eager", mla_mha_min_tokens=1, mla_mha_min_heads=1) \
        if compiled else step_module
    worst, kinds = run_steps(ref, step_module, run, config=config)
    assert worst < TOLERANCE
    assert {"extend", "prefill"} <= kinds[1]
    assert gathered, "an extend step read its cached prefix chunk by chunk"


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_a_prepared_deepseek_model_pickles_and_its_copy_runs_on_its_own_cache(arch):
    import pickle

    ref, model, step_module = build_pair(arch)
    copy_module = pickle.loads(pickle.dumps(step_module))
    worst, _ = run_steps(ref, copy_module, copy_module)
    assert worst < TOLERANCE
    for original, copied in zip(fhf.attention_layers(model), fhf.attention_layers(copy_module.model)):
        assert copied.kv_cache.k.data_ptr() != original.kv_cache.k.data_ptr()
