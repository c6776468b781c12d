"""Hugging Face models on fullcg: per-step logits equal HF's own sdpa attention, refusals at prepare."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from hf_models import ARCHITECTURES, build, build_pair, transformers

import fullcg
from fullcg.engine import BatchScheduler
from fullcg.integrations import transformers as fhf

# Prompt lengths chosen with a budget of 8 tokens per step so the steps are, in order:
# prefill (chunked), extend + prefill, mixed (decode + prefill), decode-only, ...
PROMPTS = [[3, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125], [7, 19, 31, 43, 55], [11, 23, 35]]
TOLERANCE = 1e-4


def reference_logits(ref: torch.nn.Module, step) -> torch.Tensor:
    """HF with sdpa on each request's whole sequence so far; the rows of this step's new tokens."""
    rows = []
    with torch.no_grad():
        for req, q_len in zip(step.requests, step.metadata.query_lens):
            seq = req.tokens[: req.num_cached + q_len]
            rows.append(ref(torch.tensor([seq]), use_cache=False).logits[0, req.num_cached :])
    return torch.cat(rows)


def run_steps(ref, model_for_context, run, *, config=None, max_new_tokens=3):
    """Drive ``run`` through prefill, chunked prefill, mixed and decode steps; returns the
    largest logit difference from HF's sdpa and the set of forward modes of each step."""
    sched = BatchScheduler(PROMPTS, max_new_tokens, num_pages=64, page_size=4, max_num_tokens=8)
    worst, kinds = 0.0, []
    while (step := sched.next_step()) is not None:
        expected = reference_logits(ref, step)
        with fullcg.forward_context(step.metadata, model_for_context, config=config), torch.no_grad():
            got = run(step.input_ids, step.positions)
        worst = max(worst, (got - expected).abs().max().item())
        kinds.append(frozenset(m.value for m in step.modes))
        # Both follow the reference's greedy tokens, so every step compares the same inputs.
        sched.advance(step, [int(expected[r].argmax()) if r is not None else None for r in step.sample_rows])
    return worst, kinds


def test_the_steps_cover_prefill_chunked_prefill_mixed_and_decode():
    ref, model, step_module = build_pair("llama")
    _, kinds = run_steps(ref, step_module, step_module)
    assert kinds[0] == {"prefill"}
    assert {"extend", "prefill"} <= kinds[1]
    assert any({"decode", "prefill"} <= k for k in kinds)  # mixed
    assert {"decode"} in kinds  # decode-only


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_eager_logits_equal_hf_sdpa_every_step(arch):
    ref, model, step_module = build_pair(arch)
    worst, _ = run_steps(ref, step_module, step_module)
    assert worst < TOLERANCE


@pytest.mark.parametrize("graph_mode", fullcg.config.GRAPH_MODES)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_compiled_logits_equal_hf_sdpa_every_step_in_every_graph_mode(arch, graph_mode):
    torch._dynamo.reset()
    ref, model, step_module = build_pair(arch)
    config = fullcg.FullCGConfig(graph_mode=graph_mode, compiler="eager")
    compiled = torch.compile(step_module, backend=fullcg.Backend(config))
    fullcg.reset_graph_mode_counts()
    worst, kinds = run_steps(ref, step_module, compiled, config=config)
    assert worst < TOLERANCE
    counts = fullcg.graph_mode_counts()
    assert sum(counts.values()) == len(kinds)  # every step ran compiled
    if graph_mode == "full_and_piecewise":
        assert counts["full:eager"] == sum(k == {"decode"} for k in kinds)


def test_inductor_compiled_logits_equal_hf_sdpa():
    torch._dynamo.reset()
    ref, model, step_module = build_pair("qwen3")
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="inductor")
    compiled = torch.compile(step_module, backend=fullcg.Backend(config))
    worst, _ = run_steps(ref, step_module, compiled, config=config, max_new_tokens=2)
    assert worst < TOLERANCE


def test_the_hf_model_compiled_directly_with_packed_inputs_equals_hf_sdpa():
    # The calling convention of the HF model itself: batch dimension 1, use_cache=False.
    torch._dynamo.reset()
    ref, model, _ = build_pair("llama")
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="eager")
    compiled = torch.compile(model, backend=fullcg.Backend(config))

    def run(ids, pos):
        return compiled(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]

    worst, _ = run_steps(ref, model, run, config=config)
    assert worst < TOLERANCE


def test_prepare_attaches_one_fullcg_layer_per_hf_layer_with_hf_layer_ids_and_scale():
    ref, model, _ = build_pair("qwen3", num_pages=8, page_size=16)
    layers = fhf.attention_layers(model)
    assert [a.layer_id for a in layers] == [0, 1]
    hf_attn = model.model.layers[1].self_attn
    assert layers[1] is hf_attn.fullcg_attention
    assert layers[1].scale == hf_attn.scaling
    assert (layers[1].num_heads, layers[1].num_kv_heads, layers[1].head_dim) == (4, 2, 16)
    assert tuple(layers[1].kv_cache.k.shape) == (8, 16, 2, 16)
    assert model.config._attn_implementation == "fullcg"


def test_register_is_idempotent_and_fills_both_registries():
    fhf.register()
    fhf.register()
    assert transformers.AttentionInterface._global_mapping["fullcg"] is fhf.attention_forward
    assert "fullcg" in transformers.masking_utils.AttentionMaskInterface._global_mapping


def test_the_model_config_built_with_attn_implementation_fullcg_runs_after_prepare():
    fhf.register()
    cls, config = ARCHITECTURES["llama"]()
    model = cls._from_config(config, attn_implementation="fullcg").eval()
    assert model.config._attn_implementation == "fullcg"
    step_module = fhf.prepare(model, num_pages=8, page_size=4)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), 4)
    with fullcg.forward_context(md, step_module), torch.no_grad():
        assert step_module(torch.tensor([5, 6, 7]), torch.arange(3)).shape == (3, 128)


def test_running_without_prepare_names_the_fix():
    fhf.register()
    model = build("llama")
    model.set_attn_implementation("fullcg")
    with pytest.raises(RuntimeError, match=r"prepare\(model"):
        model(torch.tensor([[1, 2]]), use_cache=False)


def test_a_transformers_cache_is_refused_with_the_fix():
    ref, model, step_module = build_pair("llama")
    md = fullcg.AttentionMetadata.build([2], [0], torch.tensor([[0]], dtype=torch.int32), 4)
    with fullcg.forward_context(md, model), torch.no_grad():
        model(torch.tensor([[1, 2]]), use_cache=True)  # the first call has no past: allowed
        cache = {_cache_argument(model): transformers.DynamicCache(config=model.config)}
        model(torch.tensor([[1, 2]]), use_cache=True, **cache)
        md2 = fullcg.AttentionMetadata.build([1], [2], torch.tensor([[0]], dtype=torch.int32), 4)
        with fullcg.forward_context(md2, model), pytest.raises(ValueError, match="use_cache=False"):
            model(torch.tensor([[3]]), position_ids=torch.tensor([[2]]), use_cache=True, **cache)


def _cache_argument(model) -> str:
    """The name of the forward's cache argument: ``cache`` in newer transformers, ``past_key_values`` before."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def test_padded_batches_are_refused_with_the_fix():
    ref, model, _ = build_pair("llama")
    md = fullcg.AttentionMetadata.build([2, 2], [0, 0], torch.tensor([[0], [1]], dtype=torch.int32), 4)
    with fullcg.forward_context(md, model), torch.no_grad(), pytest.raises(ValueError, match="packed batches"):
        model(torch.tensor([[1, 2], [3, 4]]), use_cache=False)


# --- refusals: what fullcg cannot run is refused at prepare (test_hf_architectures.py has each feature) ---


def test_encoder_decoder_models_are_refused():
    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    with pytest.raises(fhf.UnsupportedModelError, match="encoder-decoder"):
        fhf.prepare(transformers.T5ForConditionalGeneration(config), num_pages=8, page_size=4)


def test_a_model_sharded_with_transformers_tensor_parallelism_is_refused_naming_the_fix():
    model = build(next(iter(ARCHITECTURES)))
    model._tp_size = 2  # what transformers sets after sharding a model with tp_plan
    with pytest.raises(fhf.UnsupportedModelError, match="fullcg.TensorParallel"):
        fhf.prepare(model, num_pages=8, page_size=4)


# --- fullcg.generate on HF models equals HF's own generate ---

GENERATE_PROMPTS = [[3, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 9, 4], [7, 19, 31, 43, 55], [11, 23, 35],
                    [60, 61, 62, 63, 64, 65, 66]]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_generate_equals_hf_generate_token_for_token(arch):
    torch._dynamo.reset()
    ref, model, _ = build_pair(arch)
    # A budget of 8 tokens and 2 requests at a time: chunked prefill, mixed steps, requests joining.
    got = fullcg.generate(model, GENERATE_PROMPTS, 8, max_num_tokens=8, max_num_seqs=2,
                          config=fullcg.FullCGConfig(compiler="eager"), progress=False)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                    for p in GENERATE_PROMPTS]
    assert got == expected
    assert any(len(set(g)) > 2 for g in got)  # not a degenerate model repeating one token


def test_generate_stops_at_the_hf_models_eos_token_like_hf_generate():
    ref, model, _ = build_pair("llama")
    plain = fullcg.generate(model, GENERATE_PROMPTS, 8, compile=False, stop_token_ids=(), progress=False)
    eos = plain[1][3]  # make a token the model does produce the end of sequence
    for m in (ref, model):
        m.generation_config.eos_token_id = eos
    got = fullcg.generate(model, GENERATE_PROMPTS, 8, compile=False, progress=False)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                    for p in GENERATE_PROMPTS]
    assert len(got[1]) == 4 and got[1][-1] == eos
    assert got == [e[: e.index(eos) + 1] if eos in e else e for e in expected]


def test_seeded_sampling_on_an_hf_model_is_reproducible():
    _, model, _ = build_pair("qwen2")
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=7, compile=False, stop_token_ids=(), progress=False)
    first = fullcg.generate(model, GENERATE_PROMPTS, 6, **kw)
    assert fullcg.generate(model, GENERATE_PROMPTS, 6, **kw) == first
    assert first != fullcg.generate(model, GENERATE_PROMPTS, 6, **{**kw, "seed": 8})


def test_the_generate_benchmark_runs_in_smoke_mode_and_agrees_with_hf(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "generate.py"
    spec = importlib.util.spec_from_file_location("benchmark_generate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch._dynamo.reset()
    assert bench.main(["--smoke", "--engines", "hf,fullcg", "--warmup", "0", "--repeats", "1"]) == 0
    assert "'fullcg/mixed64 (vs hf)': 1.0" in capsys.readouterr().out


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("first_tokens", [1, 9], ids=["one-token-first", "prompt-first"])
def test_fullcg_compile_serves_one_token_and_long_steps_in_either_order(first_tokens, compiler):
    # fullcg.generate captures up front with a one-token stand-in step, so a transformers model
    # is first traced at one token; later steps are prompts of any length. On torch 2.11 a
    # second fake run of the pieces once specialized that trace (and the next) to a constant
    # token count, and the step after raised a ConstraintViolationError. Under Inductor,
    # torch 2.11 guarded "more than one token" while compiling a view of the transposed
    # query, which gave one-token steps a second graph.
    torch._dynamo.reset()
    ref, model, step_module = build_pair("llama")
    compiled = fullcg.compile(step_module, compiler=compiler, graph_mode="piecewise")
    table = torch.arange(64, dtype=torch.int32).view(4, 16)
    steps = [([first_tokens], [0]), ([12], [0]), ([1], [12]), ([5, 1], [0, 13])]
    for q_lens, p_lens in steps:
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table[: len(q_lens)], 4)
        ids = torch.cat([torch.randint(3, 100, (q,)) for q in q_lens])
        pos = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)])
        with torch.no_grad(), fullcg.forward_context(md, step_module):
            got = compiled(ids, pos)
        # The reference sees each request's whole sequence; for a fresh prompt that is its tokens.
        if all(p == 0 for p in p_lens):
            start = 0
            for q in q_lens:
                with torch.no_grad():
                    want = ref(ids[start:start + q][None], use_cache=False).logits[0]
                torch.testing.assert_close(got[start:start + q], want, atol=TOLERANCE, rtol=0)
                start += q
    # One graph for every token count, one-token steps included.
    assert len(compiled.backend.runners) == 1


def test_an_eager_packed_step_at_the_wrong_position_is_refused():
    _, model, step_module = build_pair("llama")
    md = fullcg.AttentionMetadata.build([2], [3], torch.tensor([[0, 1]], dtype=torch.int32), 4)
    with fullcg.forward_context(md, model), torch.no_grad():
        with pytest.raises(fullcg.errors.InvalidBatchError, match="at position 0 but the metadata puts it at 3"):
            step_module(torch.tensor([1, 2]), torch.tensor([0, 1]))
        step_module(torch.tensor([1, 2]), torch.tensor([3, 4]))


def test_a_second_model_with_another_softmax_scale_compiles_in_the_same_process():
    # Dynamo traces a float it saw change (the attention code's `scaling`) as a symbolic
    # input; fullcg keeps floats constant, so each model's graph has its own scale.
    torch._dynamo.reset()
    for head_dim in (16, 8):
        ref = build("llama", head_dim=head_dim)
        model = copy.deepcopy(ref)
        step_module = fhf.prepare(model, num_pages=64, page_size=4)
        compiled = fullcg.compile(step_module, graph_mode="piecewise", compiler="eager", compile_cache=False)
        worst, _ = run_steps(ref, step_module, compiled)
        assert worst < TOLERANCE
