"""Multi-head latent attention (fullcg.MLAAttention): the absorbed form over a latent cache
equals attention over decompressed keys and values, eagerly and compiled."""

from __future__ import annotations

import math

import pytest
import torch

import fullcg

H, RANK, NOPE, ROPE, VDIM = 4, 32, 16, 8, 16
PAGE = 4
# (query_lens, prefix_lens) per step: two prompts (one in two chunks), then both decode.
STEPS = [([4, 5], [0, 0]), ([3], [4]), ([1, 1], [7, 5]), ([1], [8])]
REQUESTS_OF_STEP = [[0, 1], [0], [0, 1], [0]]
LENGTHS = {0: 9, 1: 6}


def _inputs(seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {r: {"q_nope": torch.randn(n, H, NOPE, generator=g), "q_pe": torch.randn(n, H, ROPE, generator=g),
                "latent": torch.randn(n, RANK, generator=g), "k_pe": torch.randn(n, ROPE, generator=g)}
            for r, n in LENGTHS.items()}


def _kv_b(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H * (NOPE + VDIM), RANK, generator=g) / math.sqrt(RANK)


def _decompressed(x: dict[str, torch.Tensor], kv_b: torch.Tensor, positions: range) -> torch.Tensor:
    """Per-head keys [W_UK c ; k_pe] and values W_UV c over the whole sequence, causal."""
    per_head = kv_b.view(H, NOPE + VDIM, RANK)
    k_nope = torch.einsum("hnr,sr->shn", per_head[:, :NOPE], x["latent"])
    v = torch.einsum("hvr,sr->shv", per_head[:, NOPE:], x["latent"])
    k = torch.cat([k_nope, x["k_pe"][:, None, :].expand(-1, H, -1)], dim=-1)
    q = torch.cat([x["q_nope"], x["q_pe"]], dim=-1)
    scale = 1.0 / math.sqrt(NOPE + ROPE)
    rows = []
    for p in positions:
        scores = torch.einsum("hd,shd->hs", q[p], k[: p + 1]) * scale
        rows.append(torch.einsum("hs,shv->hv", scores.softmax(-1), v[: p + 1]))
    return torch.stack(rows)


def _step_inputs(inputs, step):
    (q_lens, p_lens), reqs = STEPS[step], REQUESTS_OF_STEP[step]
    parts = {name: torch.cat([inputs[r][name][p: p + q] for r, q, p in zip(reqs, q_lens, p_lens)])
             for name in ("q_nope", "q_pe", "latent", "k_pe")}
    table = torch.stack([torch.arange(r * 4, r * 4 + 4, dtype=torch.int32) for r in reqs])
    return parts, fullcg.AttentionMetadata.build(q_lens, p_lens, table, PAGE)


def _expected(inputs, kv_b, step):
    (q_lens, p_lens), reqs = STEPS[step], REQUESTS_OF_STEP[step]
    return torch.cat([_decompressed(inputs[r], kv_b, range(p, p + q)) for r, q, p in zip(reqs, q_lens, p_lens)])


def test_the_latent_cache_holds_rank_plus_rope_values_per_token_once():
    mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
    cache = mla.allocate_kv_cache(8, PAGE)
    assert tuple(cache.k.shape) == (8, PAGE, 1, RANK + ROPE) and tuple(cache.v.shape) == (8, PAGE, 1, RANK)
    assert cache.v.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr(), "the value is the latent"
    assert cache.k.untyped_storage().nbytes() == 8 * PAGE * (RANK + ROPE) * 4


def test_absorbed_mla_over_the_latent_cache_equals_decompressed_attention_step_by_step():
    inputs, kv_b = _inputs(), _kv_b()
    mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
    mla.allocate_kv_cache(8, PAGE)
    with torch.inference_mode():
        for step in range(len(STEPS)):
            parts, md = _step_inputs(inputs, step)
            with fullcg.forward_context(md, mla):
                out, lse = mla(**parts, kv_b_weight=kv_b, return_lse=True)
            torch.testing.assert_close(out, _expected(inputs, kv_b, step), atol=1e-5, rtol=1e-5)
            assert lse.shape == (md.num_tokens, H) and lse.dtype == torch.float32


class _MLAStep(torch.nn.Module):
    """One MLA layer with its kv_b projection, called with token inputs."""

    def __init__(self, kv_b: torch.Tensor) -> None:
        super().__init__()
        self.mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
        self.kv_b = torch.nn.Parameter(kv_b, requires_grad=False)

    def forward(self, q_nope, q_pe, latent, k_pe):
        return self.mla(q_nope, q_pe, latent, k_pe, self.kv_b)


@pytest.mark.parametrize("compiler", ["eager", "none"])
@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "auto"])
def test_compiled_mla_equals_decompressed_attention_in_every_graph_mode(compiler, graph_mode):
    torch._dynamo.reset()
    inputs, kv_b = _inputs(seed=2), _kv_b(seed=3)
    model = _MLAStep(kv_b)
    model.mla.allocate_kv_cache(8, PAGE)
    run = fullcg.compile(model, compiler=compiler, graph_mode=graph_mode)
    with torch.inference_mode():
        for step in range(len(STEPS)):
            parts, md = _step_inputs(inputs, step)
            with fullcg.forward_context(md, model):
                out = run(parts["q_nope"], parts["q_pe"], parts["latent"], parts["k_pe"])
            torch.testing.assert_close(out, _expected(inputs, kv_b, step), atol=1e-5, rtol=1e-5)
    if compiler != "none":
        assert len(run.runners) == 1, "one graph for every token count, one-token steps included"


def test_bad_shapes_and_weights_name_what_mla_expects():
    mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
    with pytest.raises(ValueError, match=r"kv_b_weight must be \[4 \* \(16 \+ 16\), 32\]"):
        mla.split_kv_b(torch.zeros(3, RANK))
    t = 2
    with pytest.raises(ValueError, match=r"latent must have shape \[2, 32\]"):
        mla(torch.zeros(t, H, NOPE), torch.zeros(t, H, ROPE), torch.zeros(t, RANK + 1), torch.zeros(t, ROPE), _kv_b())
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer"):
        fullcg.MLAAttention(H, 0, NOPE, ROPE, VDIM, layer_id=0)


def test_an_implementation_that_reads_v_as_contiguous_refuses_a_latent_cache(monkeypatch):
    import fullcg.ops.impl
    from fullcg.ops.impl import register_implementation
    from fullcg.ops.impl.reference import ReferenceAttention

    # A throwaway registry: the stand-in must not outlive the test (other tests list the choices).
    monkeypatch.setattr(fullcg.ops.impl, "_registry", dict(fullcg.ops.impl._registry))

    class ContiguousOnly(ReferenceAttention):
        name = "contiguous-only"
        takes_v_in_k = False

    register_implementation(ContiguousOnly())
    inputs, kv_b = _inputs(), _kv_b()
    mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
    mla.allocate_kv_cache(8, PAGE)
    parts, md = _step_inputs(inputs, 0)
    config = fullcg.FullCGConfig(attention_impl="contiguous-only")
    with torch.inference_mode(), fullcg.forward_context(md, mla, config=config):
        with pytest.raises(NotImplementedError, match="cannot attend over a latent cache.*attention_impl='reference'"):
            mla(**parts, kv_b_weight=kv_b)


# The MHA form: two requests (24 and 16 tokens); (query_lens, prefix_lens, requests,
# prefix_chunk_tokens) per step. Steps without decode run in MHA form under
# mla_mha_min_tokens=1 (and mla_mha_min_heads=1: the layer has few heads), with 4, 14 and 7
# prefix chunks; the decode step runs absorbed.
MHA_LENGTHS = {0: 24, 1: 16}
MHA_STEPS = [
    ([8, 6], [0, 0], [0, 1], 4096),
    ([6, 4], [8, 6], [0, 1], 2),
    ([5], [14], [0], 1),
    ([1, 1], [19, 10], [0, 1], 4096),
    ([4], [20], [0], 3),
]
MHA_EVERY_PROMPT = fullcg.FullCGConfig(mla_mha_min_tokens=1, mla_mha_min_heads=1)


def _mha_inputs(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {r: {"q_nope": torch.randn(n, H, NOPE, generator=g), "q_pe": torch.randn(n, H, ROPE, generator=g),
                "latent": torch.randn(n, RANK, generator=g), "k_pe": torch.randn(n, ROPE, generator=g)}
            for r, n in MHA_LENGTHS.items()}


def _mha_step(inputs, kv_b, step):
    q_lens, p_lens, reqs, chunk_tokens = MHA_STEPS[step]
    parts = {name: torch.cat([inputs[r][name][p: p + q] for r, q, p in zip(reqs, q_lens, p_lens)])
             for name in ("q_nope", "q_pe", "latent", "k_pe")}
    table = torch.stack([torch.arange(r * 8, r * 8 + 8, dtype=torch.int32) for r in reqs])
    md = fullcg.AttentionMetadata.build(q_lens, p_lens, table, PAGE, prefix_chunk_tokens=chunk_tokens)
    expected = torch.cat([_decompressed(inputs[r], kv_b, range(p, p + q)) for r, q, p in zip(reqs, q_lens, p_lens)])
    return parts, md, expected


class _RecordsForm(_MLAStep):
    """Notes which form each eager step ran in."""

    def forward(self, q_nope, q_pe, latent, k_pe, return_lse=False):
        self.forms.append("mha" if fullcg.context.mla_mha_step(self.mla.num_heads) else "absorbed")
        return self.mla(q_nope, q_pe, latent, k_pe, self.kv_b, return_lse=return_lse)


def test_prompt_steps_in_mha_form_over_many_prefix_chunks_equal_decompressed_attention():
    inputs, kv_b = _mha_inputs(seed=4), _kv_b(seed=5)
    model = _RecordsForm(kv_b)
    model.forms = []
    model.mla.allocate_kv_cache(16, PAGE)
    with torch.inference_mode():
        for step in range(len(MHA_STEPS)):
            parts, md, expected = _mha_step(inputs, kv_b, step)
            with fullcg.forward_context(md, model, config=MHA_EVERY_PROMPT):
                out, lse = model(parts["q_nope"], parts["q_pe"], parts["latent"], parts["k_pe"], return_lse=True)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            assert lse.shape == (md.num_tokens, H) and torch.isfinite(lse).all()
    # The layer saw the form the step asked for; every step's latents went into the cache.
    assert model.forms == ["mha", "mha", "mha", "absorbed", "mha"]
    cache = model.mla.kv_cache.k.view(-1, RANK + ROPE)
    for r, n in MHA_LENGTHS.items():
        stored = cache[r * 8 * PAGE: r * 8 * PAGE + n]
        want = torch.cat([inputs[r]["latent"], inputs[r]["k_pe"]], dim=-1)
        done = 24 if r == 0 else 11
        torch.testing.assert_close(stored[:done], want[:done])


def test_absorbed_and_mha_forms_agree_and_lse_merges_exactly():
    inputs, kv_b = _mha_inputs(seed=6), _kv_b(seed=7)
    results = {}
    for name, config in (("mha", MHA_EVERY_PROMPT), ("absorbed", fullcg.FullCGConfig(mla_mha_min_tokens=None))):
        mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
        mla.allocate_kv_cache(16, PAGE)
        outs = []
        with torch.inference_mode():
            for step in range(3):
                parts, md, _ = _mha_step(inputs, kv_b, step)
                with fullcg.forward_context(md, mla, config=config):
                    outs.append(mla(parts["q_nope"], parts["q_pe"], parts["latent"], parts["k_pe"], kv_b,
                                    return_lse=True))
        results[name] = outs
    for (o1, l1), (o2, l2) in zip(results["mha"], results["absorbed"]):
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


def test_the_form_follows_mla_mha_min_tokens_decode_requests_and_full_graphs():
    table = torch.arange(1200, dtype=torch.int32).view(2, 600)
    long_prompt = fullcg.AttentionMetadata.build([2100, 2], [0, 0], table, PAGE)
    short = fullcg.AttentionMetadata.build([100, 2], [0, 0], table, PAGE)
    with_decode = fullcg.AttentionMetadata.build([2100, 1], [0, 5], table, PAGE)
    default = fullcg.FullCGConfig()
    assert default.mla_mha_min_tokens == 2048

    def form(md, config=default, variant=None):
        with torch.inference_mode(), fullcg.forward_context(md, config=config) as ctx:
            if variant is None:
                return fullcg.context.mla_mha_step()
            with fullcg.context.derived_context(ctx, config=config, variant=variant, padded_size=None):
                return fullcg.context.mla_mha_step()

    assert form(long_prompt) and not form(short) and not form(with_decode)
    assert not form(long_prompt, fullcg.FullCGConfig(mla_mha_min_tokens=None))
    assert form(short, fullcg.FullCGConfig(mla_mha_min_tokens=100))
    assert form(long_prompt, variant="piecewise") and not form(long_prompt, variant="full")
    assert not fullcg.context.mla_mha_step()  # outside any context
    with pytest.raises(fullcg.errors.InvalidConfigError, match="mla_mha_min_tokens must be a positive integer"):
        fullcg.FullCGConfig(mla_mha_min_tokens=0)


def test_only_layers_of_mla_mha_min_heads_or_more_take_the_mha_form(monkeypatch):
    """Few heads attend absorbed in every step (the absorbed kernels read each latent once
    for all heads and win there); the threshold is per layer, by its query heads."""
    assert fullcg.FullCGConfig().mla_mha_min_heads == 64
    inputs, kv_b = _mha_inputs(seed=4), _kv_b(seed=5)
    ran: list[str] = []
    mha_form = fullcg.MLAAttention._mha_form
    monkeypatch.setattr(fullcg.MLAAttention, "_mha_form",
                        lambda self, *a: (ran.append(f"mha/{self.num_heads}"), mha_form(self, *a))[1])
    for min_heads, form in ((64, []), (H + 1, []), (H, [f"mha/{H}"]), (1, [f"mha/{H}"])):
        ran.clear()
        mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=0)
        mla.allocate_kv_cache(16, PAGE)
        config = fullcg.FullCGConfig(mla_mha_min_tokens=1, mla_mha_min_heads=min_heads)
        with torch.inference_mode():
            for step in (0, 1):  # the first fills the prefix the second reads
                parts, md, expected = _mha_step(inputs, kv_b, step)
                with fullcg.forward_context(md, mla, config=config):
                    out = mla(parts["q_nope"], parts["q_pe"], parts["latent"], parts["k_pe"], kv_b)
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert ran == form * 2, min_heads
        assert config.mla_mha_form_for(H) == bool(form), "kernel planning follows the layers' rule"
        with fullcg.forward_context(md, mla, config=config):
            assert fullcg.context.mla_mha_step(H) == bool(form) and fullcg.context.mla_mha_step()
    with pytest.raises(fullcg.errors.InvalidConfigError, match="mla_mha_min_heads must be a positive integer"):
        fullcg.FullCGConfig(mla_mha_min_heads=0)


@pytest.mark.parametrize("compiler", ["eager", "none"])
@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "auto"])
def test_compiled_mha_form_has_one_graph_for_every_prefix_chunk_count(compiler, graph_mode, monkeypatch):
    from fullcg.ops import torch_ops

    gathered: list[int] = []  # prefix chunks the MHA form read back, as the steps ran
    gather = torch_ops.gather_prefix_chunk
    monkeypatch.setattr(torch_ops, "gather_prefix_chunk", lambda *a: (gathered.append(1), gather(*a))[1])
    torch._dynamo.reset()
    inputs, kv_b = _mha_inputs(seed=8), _kv_b(seed=9)
    model = _MLAStep(kv_b)
    model.mla.allocate_kv_cache(16, PAGE)
    run = fullcg.compile(model, compiler=compiler, graph_mode=graph_mode, mla_mha_min_tokens=1, mla_mha_min_heads=1)
    with torch.inference_mode():
        for step in range(len(MHA_STEPS)):
            parts, md, expected = _mha_step(inputs, kv_b, step)
            with fullcg.forward_context(md, model, config=MHA_EVERY_PROMPT):
                out = run(parts["q_nope"], parts["q_pe"], parts["latent"], parts["k_pe"])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if graph_mode != "full":  # a full graph always attends absorbed
        assert len(gathered) >= 4 + 14 + 7, "the prompt steps over a cached prefix ran in MHA form"
    if compiler != "none":
        # One graph in MHA form (0, 4, 14 and 7 prefix chunks alike), one absorbed (the decode step).
        assert len(run.runners) == 2
