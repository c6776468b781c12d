"""Building attention kernels ahead: which kernels a config needs, the stand-in steps that
compile them with a real step's specialisation, the deploy command and the hook before capture."""

from __future__ import annotations

import copy
import inspect
import logging
import os

import pytest
import torch

import fullcg
from fullcg import kernel_build
from fullcg.__main__ import main
from fullcg.kernel_build import Kernel, LayerShape, layer_shapes, plan_kernels
from fullcg.models.deepseek import DeepseekConfig, DeepseekModel
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.ops.kernels import launch as launch_module

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)
#: Stand-in steps on the CPU run the Triton kernels' planning (and, where asked, the kernels)
#: under Triton's interpreter, which the suite chooses on machines without a GPU.
interpreted = pytest.mark.skipif(not launch_module._INTERPRET, reason="runs Triton's CPU interpreter")
DENSE_TRITON = ["save_kv", "prefill", "decode", "decode+save"]


def _llama(dtype=torch.bfloat16, page_size=16, **changes) -> LlamaModel:
    cfg = LlamaConfig.tiny(**{"head_dim": 128, "num_heads": 8, "num_kv_heads": 2, **changes})
    model = LlamaModel(cfg, seed=0, dtype=dtype)
    model.allocate_kv_cache(num_pages=8, page_size=page_size)
    return model


def _deepseek(dtype=torch.bfloat16, **changes) -> DeepseekModel:
    # DeepSeek-V3's latent dims (the ones FlashInfer builds its MLA module for), few heads.
    cfg = DeepseekConfig.tiny(**{"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                 "v_head_dim": 128, "num_heads": 4, **changes})
    model = DeepseekModel(cfg, seed=0, dtype=dtype)
    model.allocate_kv_cache(4, 16)
    return model


def _plan(model, capability=HOPPER, flashinfer=True, triton=True, **config) -> tuple[Kernel, ...]:
    cfg = fullcg.FullCGConfig(**config)
    return plan_kernels(layer_shapes(model, cfg), cfg, capability=capability, flashinfer=flashinfer, triton=triton)


def _whats(kernels) -> list[tuple[str, str]]:
    return [(k.library, k.what) for k in kernels]


# ---------------------------------------------------------------------------------- shapes


def test_the_layers_of_a_model_make_one_shape_each_kind():
    model = _llama(num_layers=4, sliding_window=64, full_attention_every=2, attention_sinks=True)
    shapes = layer_shapes(model, fullcg.FullCGConfig())
    assert [s.sliding_window for s in shapes] == [64, None], "sliding and full layers: two shapes, layers alike: one"
    s = shapes[0]
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim, s.page_size, s.dtype, s.attends) == (
        8, 2, 128, 128, 16, torch.bfloat16, "cache")
    assert s.returns_lse and s.v_after_k and not (s.prefill_skip or s.decode_skip)
    per_layer = fullcg.SkipSoftmaxConfig(per_layer={1: (None, 3.0)})
    skips = {(s.layer_id, s.decode_skip) for s in layer_shapes(model, fullcg.FullCGConfig(skip_softmax=per_layer))}
    assert (1, True) in skips and (0, False) in skips, "a layer's own skip-softmax factors make its shape"


def test_multi_head_latent_attention_has_a_latent_shape_and_its_mha_forms():
    model = _deepseek()
    latent, given = layer_shapes(model, fullcg.FullCGConfig(mla_mha_min_heads=4))
    assert (latent.attends, latent.num_heads, latent.num_kv_heads, latent.head_dim, latent.v_head_dim) == (
        "latent", 4, 1, 576, 512)
    assert (given.attends, given.num_heads, given.num_kv_heads, given.head_dim, given.v_head_dim) == (
        "given", 4, 4, 192, 128)
    assert layer_shapes(model, fullcg.FullCGConfig(mla_mha_min_tokens=None)) == (latent,), "no MHA form, no shape"
    assert layer_shapes(model, fullcg.FullCGConfig()) == (latent,), "4 heads take no MHA form by default (64)"


def test_a_bare_cache_map_gives_shapes_without_query_heads():
    model = _llama()
    caches = {a.layer_id: a.kv_cache for a in model.attention_layers()}
    (shape,) = layer_shapes(caches, fullcg.FullCGConfig())
    assert shape.num_heads is None and shape.num_kv_heads == 2
    kernels = plan_kernels([shape], fullcg.FullCGConfig(attention_impl="triton"), capability=HOPPER, triton=True)
    assert _whats(kernels) == [("triton", "save_kv")], "without query heads only the save is known"


# ---------------------------------------------------------------------------------- the plan


def test_triton_runs_its_four_dense_kernels():
    kernels = _plan(_llama(), attention_impl="triton")
    assert _whats(kernels) == [("triton", w) for w in DENSE_TRITON]
    assert kernels[1].name == "Triton prefill (bfloat16, 8/2 heads of 128, page 16)"


def test_triton_runs_its_latent_kernels_and_the_mha_forms():
    kernels = _plan(_deepseek(), attention_impl="triton", mla_mha_min_heads=1)
    assert [k.what for k in kernels] == ["latent_save", "mla", "mla+save", "prefill (given k/v)",
                                         "prefill (prefix chunk)", "decode (given k/v)"]
    assert all(k.library == "triton" for k in kernels)


def test_auto_on_hopper_is_flashinfer_with_fmha_v2_and_the_triton_save():
    kernels = _plan(_llama())
    assert _whats(kernels) == [("flashinfer", "fa2"), ("flashinfer", "fmha_v2"), ("triton", "save_kv")]
    assert kernels[0].args == ("bfloat16", 128, 128, False, False)
    assert kernels[1].args == ("Q_PAGED_KV_NHD", "bfloat16")
    # Elsewhere FMHAv2 is not run; in fp16 neither.
    assert _whats(_plan(_llama(), capability=AMPERE)) == [("flashinfer", "fa2"), ("triton", "save_kv")]
    assert _whats(_plan(_llama(dtype=torch.float16))) == [("flashinfer", "fa2"), ("triton", "save_kv")]
    # A page size FMHAv2 cannot walk: FA2 serves those prefills.
    assert _whats(_plan(_llama(page_size=24))) == [("flashinfer", "fa2"), ("triton", "save_kv")]


def test_auto_adds_fmha_v2_over_rows_where_the_layer_asks_for_lse():
    kernels = _plan(_llama(attention_sinks=True))
    assert [k.args for k in kernels if k.what == "fmha_v2"] == [("Q_PAGED_KV_NHD", "bfloat16"),
                                                                 ("CONTIGUOUS_Q_KV", "bfloat16")]


def test_auto_falls_back_to_triton_where_flashinfer_would_refuse():
    skip = fullcg.SkipSoftmaxConfig(decode_scale_factor=1.0)
    kernels = _plan(_llama(), skip_softmax=skip)
    assert _whats(kernels) == [("flashinfer", "fa2"), ("flashinfer", "fmha_v2")] + [("triton", w) for w in DENSE_TRITON]
    decode = next(k for k in kernels if k.what == "decode")
    assert "skip-softmax" in decode.name and "skip-softmax" not in next(k for k in kernels if k.what == "prefill").name
    on_blackwell = _plan(_llama(), capability=BLACKWELL, skip_softmax=skip)
    assert ("flashinfer", "trtllm-gen") in _whats(on_blackwell), "skip-softmax runs on trtllm-gen there"
    # fp32, head dims FlashInfer lacks, or no FlashInfer: Triton alone.
    for kernels in (_plan(_llama(dtype=torch.float32)), _plan(_llama(head_dim=80)), _plan(_llama(), flashinfer=False)):
        assert _whats(kernels) == [("triton", w) for w in DENSE_TRITON]


def test_windowed_and_full_layers_need_a_flashinfer_module_each():
    kernels = _plan(_llama(num_layers=2, sliding_window=64, full_attention_every=2))
    assert [k.args for k in kernels if k.what == "fa2"] == [("bfloat16", 128, 128, True, False),
                                                            ("bfloat16", 128, 128, False, False)]
    assert [k.args for k in kernels if k.what == "fmha_v2"] == [("Q_PAGED_KV_NHD", "bfloat16")], \
        "FMHAv2 serves the full layers only"


def test_auto_runs_latent_attention_on_flashinfer_and_its_mha_form_on_fa2():
    kernels = _plan(_deepseek(), mla_mha_min_heads=1)
    assert _whats(kernels) == [("flashinfer", "mla"), ("triton", "save_kv"), ("flashinfer", "fa2")]
    assert kernels[1].args == ("bfloat16", 576, 576), "FlashInfer's latent save writes whole rows"
    assert kernels[2].args == ("bfloat16", 192, 128, False, False)
    # Latent dims FlashInfer has no module for: Triton's MLA kernel (the MHA form stays on FA2).
    other = _plan(_deepseek(kv_lora_rank=256), mla_mha_min_heads=1)
    assert [k.what for k in other][:3] == ["latent_save", "mla", "mla+save"]


def test_reference_and_unknown_implementations_need_nothing():
    assert _plan(_llama(), attention_impl="reference") == ()
    assert _plan(_llama(), attention_impl="mine") == ()
    assert _plan(_llama(), flashinfer=False, triton=False) == (), "auto falls back to the reference"


def test_kernels_are_listed_once_whatever_the_number_of_layers():
    assert len(_plan(_llama(num_layers=6), attention_impl="triton")) == 4


# ---------------------------------------------------------------------------------- stand-in steps


def _param_flags(fn) -> tuple[list[str], set[str], set[str]]:
    names = list(inspect.signature(fn.fn).parameters)
    kwargs = getattr(fn, "kwargs", {})  # the interpreter's stand-in keeps the decorator's arguments
    dns = set(getattr(fn, "do_not_specialize", None) or kwargs.get("do_not_specialize") or ())
    dnsoa = set(getattr(fn, "do_not_specialize_on_alignment", None)
                or kwargs.get("do_not_specialize_on_alignment") or ())
    return names, dns, dnsoa


def _specialisation(fn, args, constexprs, num_warps, num_stages) -> tuple:
    """What Triton keys a compiled kernel on: tensors by dtype and 16-byte alignment, ints
    by width, == 1 and divisibility by 16 (width only where not specialised), constexprs."""
    names, dns, dnsoa = _param_flags(fn)
    out = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, name in dnsoa or a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None or isinstance(a, float):
            out.append(type(a).__name__)
        else:
            width = "i32" if -(2**31) <= a < 2**31 else "i64"
            out.append(width if name in dns else (width, a == 1, a % 16 == 0))
    return (fn.fn.__name__, tuple(out), tuple(constexprs), num_warps, num_stages)


@pytest.fixture
def real_launches(monkeypatch):
    """Every Triton launch fullcg makes, as its specialisation (the launches still run)."""
    if not launch_module._INTERPRET:
        pytest.skip("records launches through the interpreter's path (CPU, Triton's interpreter)")
    seen: set[tuple] = set()
    original = launch_module.Launcher._launch_jit

    def record(self, grid, args, constexprs, num_warps, num_stages):
        seen.add(_specialisation(self.fn, args, constexprs, num_warps, num_stages))
        return original(self, grid, args, constexprs, num_warps, num_stages)

    monkeypatch.setattr(launch_module.Launcher, "_launch_jit", record)
    return seen


def _probed(kernels, config) -> set[tuple]:
    probed = set()
    for kernel in kernels:
        probe, part = kernel_build._ROLES[kernel.what]
        for p, launch, leading in kernel_build._probe(probe, kernel.shape, torch.device("cpu"), config, 1):
            if p == part:
                probed.add(_specialisation(launch.launcher.fn, (*leading, *launch.tail), launch.constexprs,
                                           launch.num_warps, launch.num_stages))
    return probed


def _run_steps(model, config, steps) -> None:
    """Eager steps ``(query_lens, prefix_lens, modes)`` over pages 0.. of each request."""
    page = model.attention_layers()[0].kv_cache.page_size
    for q_lens, p_lens in steps:
        table = torch.tensor([[r * 8 + i for i in range(8)] for r in range(len(q_lens))], dtype=torch.int32)
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table, page, prefix_chunk_tokens=4)
        ids = torch.arange(sum(q_lens)) % 200
        positions = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)])
        with torch.inference_mode(), fullcg.forward_context(md, model, config=config):
            model(ids, positions)


def test_stand_in_steps_plan_exactly_the_dense_kernels_real_steps_launch(real_launches):
    config = fullcg.FullCGConfig(attention_impl="triton")
    model = LlamaModel(LlamaConfig.tiny(), seed=0)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    kernels = plan_kernels(layer_shapes(model, config), config, capability=HOPPER, flashinfer=False, triton=True)
    probed = _probed(kernels, config)
    assert len(probed) == 4
    _run_steps(model, config, [([5, 3], [0, 0]), ([1, 1], [5, 3]), ([2, 1], [6, 4])])  # prefill, decode, mixed
    assert real_launches == probed


def test_stand_in_steps_plan_exactly_the_latent_kernels_real_steps_launch(real_launches):
    # MLA in its MHA form from 4 new tokens on, so the steps take both forms and the chunks.
    config = fullcg.FullCGConfig(attention_impl="triton", mla_mha_min_tokens=4, mla_mha_min_heads=1)
    model = DeepseekModel(DeepseekConfig.tiny(qk_rope_head_dim=16, n_routed_experts=0), seed=0)
    model.allocate_kv_cache(16, 4)
    kernels = plan_kernels(layer_shapes(model, config), config, capability=HOPPER, flashinfer=False, triton=True)
    probed = _probed(kernels, config)
    # MHA-form prefill, absorbed decode, MHA-form extend over a cached prefix (chunks), mixed.
    _run_steps(model, config, [([5], [0]), ([1], [5]), ([4], [6]), ([2, 1], [0, 10])])
    assert len(probed) == 6 and real_launches == probed


@interpreted
def test_a_planned_launch_the_recording_misses_would_still_run_on_valid_tensors():
    config = fullcg.FullCGConfig(attention_impl="triton")
    shape = LayerShape(4, 2, 16, 16, 4, torch.float32)
    found = kernel_build._probe("cache_mixed", shape, torch.device("cpu"), config, 3)
    assert sorted(p for p, _, _ in found) == ["decode", "prefill", "save"]
    for _, launch, leading in found:  # as a real launch, on the stand-in's tensors: nothing out of bounds
        launch(*leading)


def test_a_batch_split_count_makes_no_new_decode_specialisation():
    """Dense decode's runs per request follow the batch; the workspace stride they set must
    not be specialised on, or a kernel built ahead would miss batches of another count
    (9 query heads: 16 runs make the stride a multiple of 16, 15 do not)."""
    from fullcg.ops.kernels.decode import plan_decode

    q = torch.zeros(2, 9, 64)
    cache = fullcg.KVCache.allocate(4, 16, 3, 64)
    keys = set()
    for splits in (15, 16):
        planned = plan_decode(
            q, cache.k, cache.v, torch.zeros(2, 9, 64), torch.zeros(2, 9), query_start_loc=torch.tensor([0, 1, 2]),
            is_decode=torch.ones(2, dtype=torch.bool), scale=0.125, factor=None, tile_kv=16, split_tiles=None,
            max_kv_len=1024, page_table=torch.zeros(2, 64, dtype=torch.int32), seq_lens=torch.tensor([5, 5]),
            num_splits=splits,
        ).launch
        leading = (q, cache.k, cache.v, torch.zeros(2, 9, 64), torch.zeros(2, 9), torch.zeros(2, 9), q, q)
        keys.add(_specialisation(planned.launcher.fn, (*leading, *planned.tail), planned.constexprs,
                                 planned.num_warps, planned.num_stages))
    assert len(keys) == 1


def test_the_manifest_lists_kernels_built_into_the_kernel_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)
    config = fullcg.FullCGConfig(cache_dir=str(tmp_path))
    directory = kernel_build.kernel_dir(config)
    assert directory == tmp_path / "kernels" and (tmp_path / "kernels").stat().st_mode & 0o077 == 0
    kernel = _plan(_llama(), attention_impl="triton")[0]  # the k/v save
    files = directory / "triton" / "abc"
    files.mkdir(parents=True)
    (files / "_save_kv_kernel.json").write_text("{}")

    class Compiled:
        metadata_group = {"_save_kv_kernel.json": str(files / "_save_kv_kernel.json"),
                          "_save_kv_kernel.cubin": str(files / "_save_kv_kernel.cubin")}

    class Elsewhere:
        metadata_group = {"_save_kv_kernel.json": "/elsewhere/_save_kv_kernel.json"}

    manifest = kernel_build._Manifest(directory, torch.device("cuda", 0))
    manifest.record(kernel, [Elsewhere()])
    assert not manifest.has(kernel), "compiled outside the directory: the next process would not find it there"
    manifest.record(kernel, [Compiled()])
    manifest.save()
    again = kernel_build._Manifest(directory, torch.device("cuda", 0))
    assert again.has(kernel)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: BLACKWELL)
    assert not kernel_build._Manifest(directory, torch.device("cuda", 0)).has(kernel), "another GPU: not built"
    (files / "_save_kv_kernel.json").unlink()
    assert not again.has(kernel), "its files gone: not built"


# ---------------------------------------------------------------------------------- the command line


def test_build_kernels_without_a_gpu_says_how_to_run_it(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["build-kernels", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: build-kernels builds for the GPU it runs on, but torch sees no CUDA device")
    assert "CUDA build of torch" in err and len(err.strip().splitlines()) == 1


def _dry_run(argv: list[str], capsys) -> str:
    """What ``build-kernels ... --attention-impl triton --dry-run --capability 9.0`` prints."""
    assert main(["build-kernels", *argv, "--attention-impl", "triton", "--dry-run", "--capability", "9.0"]) == 0
    return capsys.readouterr().out


def _planned_fused(argv: list[str], capsys) -> set[str]:
    """The fused kernels a dry run lists, by name."""
    return {line.strip() for line in _dry_run(argv, capsys).splitlines() if "Triton fused" in line}


def test_build_kernels_without_a_compiler_plans_the_fused_kernels_a_prepared_hf_model_launches(capsys, monkeypatch):
    hf_models = pytest.importorskip("hf_models")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FULLCG_COMPILER", raising=False)
    for arch, form in (("llama", []), ("qwen2", ["--norm-form", "llama"])):
        _, model, _ = hf_models.build_pair(arch)
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        argv = ["--head-dim", str(head_dim), "--num-heads", str(cfg.num_attention_heads), "--num-kv-heads",
                str(cfg.num_key_value_heads), "--dtype", "float32", "--compiler", "none", "--hidden-size",
                str(cfg.hidden_size), "--intermediate-size", str(cfg.intermediate_size), *form]
        assert _planned_fused(argv, capsys) == {k.name for k in kernel_build.fused_kernels(model)}, arch
    # Under Inductor the fused kernels never run: none are planned.
    assert _planned_fused(["--model", "smollm2", "--compiler", "inductor"], capsys) == set()


def test_build_kernels_plans_fullcgs_own_llama_and_gemmas_norm_form(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FULLCG_COMPILER", raising=False)
    own = LlamaModel(LlamaConfig.tiny(head_dim=64), dtype=torch.bfloat16)
    assert _planned_fused(["--model", "tiny", "--compiler", "none"], capsys) == {
        k.name for k in kernel_build.fused_kernels(own)}, "norms multiplied in float32, no fused rotary"
    gemma = _planned_fused(["--head-dim", "64", "--num-heads", "4", "--compiler", "none", "--hidden-size", "256",
                            "--norm-form", "gemma"], capsys)
    assert kernel_build.fused_kernel("rms_norm", torch.bfloat16, 256, False).name in gemma
    assert kernel_build.fused_kernel("rms_norm", torch.bfloat16, 256, True).name not in gemma
    assert kernel_build.fused_kernel("rms_norm", torch.bfloat16, 256, True) \
        != kernel_build.fused_kernel("rms_norm", torch.bfloat16, 256, False), "the form is part of the kernel"
    # Latent attention rotates q and k itself: no fused rotary for it.
    latent = _planned_fused(["--mla-rank", "512", "--mla-rope", "64", "--num-heads", "16", "--compiler", "none",
                             "--hidden-size", "2048", "--intermediate-size", "1024"], capsys)
    assert {name.split(" (")[0] for name in latent} == {"Triton fused rms_norm", "Triton fused silu_mul"}


def test_build_kernels_without_a_compiler_says_which_widths_are_missing(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--head-dim", "64", "--num-heads", "4", "--compiler", "none"]
    out = _dry_run(argv, capsys)
    fused = [line.strip() for line in out.splitlines() if "Triton fused" in line]
    assert fused == ["Triton fused rotate_half (bfloat16, 4 query heads of 64)"], "the head dims are enough for it"
    assert "not planned without --hidden-size (fused RMSNorm) and --intermediate-size (fused SiLU-and-multiply)" in out
    out = _dry_run([*argv, "--hidden-size", "256"], capsys)
    assert "not planned without --intermediate-size (fused SiLU-and-multiply): a model's first capture builds it" in out


def test_build_kernels_says_when_latent_layers_have_too_few_heads_for_the_mha_form(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--mla-rank", "512", "--mla-rope", "64", "--num-heads", "16"]
    out = _dry_run(argv, capsys)
    assert "given k/v" not in out and "16 heads, fewer than mla_mha_min_heads (64)" in out
    out = _dry_run([*argv, "--mla-mha-min-heads", "16"], capsys)
    assert "Triton prefill (given k/v" in out and "mla_mha_min_heads" not in out
    assert main(["build-kernels", *argv, "--mla-mha-min-heads", "0", "--dry-run", "--capability", "9.0"]) == 2
    assert "mla_mha_min_heads must be a positive integer, got 0" in capsys.readouterr().err


def test_build_kernels_lists_for_a_capability_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FULLCG_ATTENTION_IMPL", "triton")
    assert main(["build-kernels", "--head-dim", "128", "--num-heads", "32", "--num-kv-heads", "8", "--dry-run",
                 "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "on SM90 (planned, not built): 4 kernel(s)" in out and "Triton decode+save (bfloat16, 32/8 heads of 128" in out
    assert main(["build-kernels", "--model", "tiny", "--capability", "9.0"]) == 2
    assert "add --dry-run" in capsys.readouterr().err
    assert main(["build-kernels", "--model", "tiny", "--dry-run", "--capability", "sm90"]) == 2
    assert "is not MAJOR.MINOR" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "say which layers: --model smollm2|tiny, or --head-dim and --num-heads"),
    (["--head-dim", "128"], "say which layers"),
    (["--model", "tiny", "--head-dim", "128"], "--model tiny gives the shapes; drop --head-dim"),
    (["--head-dim", "128", "--num-heads", "6", "--num-kv-heads", "4"], "must be a multiple of --num-kv-heads (4)"),
    (["--model", "tiny", "--page-size", "0"], "--page-size must be a positive integer, got 0"),
    (["--model", "tiny", "--dtype", "int8"], "--dtype 'int8' is not one fullcg attends in"),
    (["--mla-rank", "512", "--num-heads", "16"], "needs both --mla-rank and --mla-rope"),
    (["--mla-rank", "512", "--mla-rope", "64"], "--mla-rank needs --num-heads"),
    (["--mla-rank", "512", "--mla-rope", "64", "--num-heads", "16", "--sliding-window", "8"],
     "drop --sliding-window and --logit-softcap"),
    (["--model", "tiny", "--attention-impl", "nope"], "unknown --attention-impl 'nope'; choose auto, flashinfer"),
    (["--head-dim", "64", "--num-heads", "4", "--hidden-size", "64", "--compiler", "inductor"],
     "--hidden-size describes the fused element-wise kernels that steps without a compiler run; add --compiler none"),
    (["--model", "tiny", "--compiler", "none", "--norm-form", "gemma"], "(--modules fullcg) multiplies by the weight"),
    (["--model", "tiny", "--compiler", "none", "--intermediate-size", "96"], "--model tiny gives the shapes"),
    (["--mla-rank", "512", "--mla-rope", "64", "--num-heads", "16", "--compiler", "none", "--modules", "fullcg"],
     "fullcg's DeepSeek model (latent attention) builds its fused kernels at its first capture"),
    (["--head-dim", "64", "--num-heads", "4", "--compiler", "none", "--hidden-size", "0"],
     "--hidden-size must be a positive integer, got 0"),
])
def test_build_kernels_refuses_bad_flags_naming_the_fix(argv, message, capsys):
    assert main(["build-kernels", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_build_kernels_refuses_what_argparse_cannot_parse(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["build-kernels", "--head-dim", "big"])
    assert exit_.value.code == 2 and "invalid int value: 'big'" in capsys.readouterr().err


def _fake_gpu(monkeypatch, built: list) -> None:
    """A GPU for the command's flow: Hopper, FlashInfer and Triton present, builds recorded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)
    real_plan = kernel_build.plan_kernels
    monkeypatch.setattr(kernel_build, "plan_kernels",
                        lambda *a, **kw: real_plan(*a, **{**kw, "flashinfer": True, "triton": True}))

    def build(kernels, device, config=None):
        built.append((tuple(kernels), device, config))
        return kernel_build.BuildResult(tuple(kernels[:1]), tuple(kernels[1:]), 0.5)

    monkeypatch.setattr(kernel_build, "build_kernels", build)


def test_build_kernels_lists_and_builds_what_the_layers_need(capsys, monkeypatch):
    built: list = []
    _fake_gpu(monkeypatch, built)
    monkeypatch.delenv("FULLCG_ATTENTION_IMPL", raising=False)
    monkeypatch.delenv("FULLCG_COMPILER", raising=False)
    assert main(["build-kernels", "--head-dim", "128", "--num-heads", "32", "--num-kv-heads", "8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "fullcg build-kernels: attention_impl=auto, compiler=inductor on Fake H200 (SM90): 3 kernel(s)",
        "  FlashInfer FA2 prefill/decode module (bfloat16, head dim 128)",
        "  FlashInfer FMHAv2 Q_PAGED_KV_NHD module (bfloat16)",
        "  Triton k/v save (bfloat16, rows of 1024/1024)",
    ]
    assert not built, "--dry-run builds nothing"
    assert main(["build-kernels", "--model", "tiny", "--attention-impl", "triton"]) == 0
    (kernels, device, config), = built
    assert [k.what for k in kernels] == DENSE_TRITON and device == torch.device("cuda", 0)
    assert config.attention_impl == "triton"
    out = capsys.readouterr().out
    assert out.splitlines()[1:3] == ["  Triton k/v save (bfloat16, rows of 128/128): built",
                                     "  Triton prefill (bfloat16, 4/2 heads of 64, page 4): ready already"]
    assert "built 1, 3 ready already" in out


def test_build_kernels_describes_latent_attention(capsys, monkeypatch):
    _fake_gpu(monkeypatch, [])
    mha_form = "FlashInfer FA2 prefill/decode module (bfloat16, head dim 192/128)"
    for heads, takes_mha_form in (("128", True), ("16", False)):  # FullCGConfig.mla_mha_min_heads: 64
        argv = ["build-kernels", "--mla-rank", "512", "--mla-rope", "64", "--num-heads", heads, "--dry-run",
                "--attention-impl", "auto"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "FlashInfer MLA module" in out and (mha_form in out) == takes_mha_form, heads


def test_build_kernels_reports_a_failed_build_with_status_1(capsys, monkeypatch):
    _fake_gpu(monkeypatch, [])

    def fail(kernels, device, config=None):
        raise kernel_build.KernelBuildError("building attention kernels ahead failed: FlashInfer (...): ninja")

    monkeypatch.setattr(kernel_build, "build_kernels", fail)
    assert main(["build-kernels", "--model", "tiny"]) == 1
    assert "error: building attention kernels ahead failed" in capsys.readouterr().err


def test_build_kernels_with_the_reference_builds_nothing(capsys, monkeypatch):
    _fake_gpu(monkeypatch, [])
    assert main(["build-kernels", "--model", "smollm2", "--attention-impl", "reference"]) == 0
    assert "nothing to build" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- the hook


def _ctx(model, config=None):
    md = fullcg.AttentionMetadata.build([2], [0], torch.zeros(1, 1, dtype=torch.int32), 16)
    return fullcg.context.ForwardContext(md, fullcg.context._collect_kv_caches(model),
                                         config or fullcg.FullCGConfig())


def test_before_capture_does_nothing_on_the_cpu(monkeypatch):
    monkeypatch.setattr(kernel_build, "plan_for", lambda *a, **kw: pytest.fail("planned for a CPU model"))
    kernel_build.before_capture(_ctx(_llama()), fullcg.FullCGConfig())


@pytest.fixture
def on_a_gpu(monkeypatch):
    """``before_capture`` taking a CPU model for one on cuda:0; builds recorded, not run."""
    builds: list = []
    monkeypatch.setattr(kernel_build, "_done", set())
    monkeypatch.setattr(kernel_build, "_cuda_device", lambda caches: torch.device("cuda", 0))
    monkeypatch.setattr(kernel_build, "plan_for", lambda shapes, config, device, table_pages=1: plan_kernels(
        shapes, config, capability=HOPPER, flashinfer=True, triton=True, table_pages=table_pages))
    monkeypatch.setattr(kernel_build, "build_kernels",
                        lambda kernels, device, config=None, when="": builds.append(kernels))
    return builds


def test_before_capture_builds_once_per_kernel_set(on_a_gpu):
    model = _llama()
    ctx = _ctx(model)
    for _ in range(3):
        kernel_build.before_capture(ctx, fullcg.FullCGConfig())
    assert len(on_a_gpu) == 1 and [k.what for k in on_a_gpu[0]] == ["fa2", "fmha_v2", "save_kv"], \
        "the model is found from the context's caches"
    kernel_build.before_capture(_ctx(copy.deepcopy(model)), fullcg.FullCGConfig())
    assert len(on_a_gpu) == 1, "another model of the same kernels: nothing more"
    kernel_build.before_capture(ctx, fullcg.FullCGConfig(attention_impl="triton"))
    assert len(on_a_gpu) == 2 and [k.what for k in on_a_gpu[1]] == DENSE_TRITON, \
        "compiled pieces: no fused element-wise kernels"


def test_before_capture_warns_and_goes_on_when_a_build_fails(on_a_gpu, monkeypatch, caplog):
    def fail(kernels, device, config=None, when=""):
        raise kernel_build.KernelBuildError("building attention kernels ahead failed: nvcc not found")

    monkeypatch.setattr(kernel_build, "build_kernels", fail)
    with caplog.at_level(logging.WARNING, logger="fullcg.kernel_build"):
        kernel_build.before_capture(_ctx(_llama()), fullcg.FullCGConfig())
    assert "building attention kernels ahead failed, so they are built on first use" in caplog.text
    assert "nvcc not found" in caplog.text


@interpreted
def test_capture_without_a_compiler_builds_before_its_first_run(on_a_gpu, monkeypatch):
    from emulated_graphs import EmulatedGraphs

    from fullcg.eager_capture import EagerCaptureModel

    calls = []
    real = kernel_build.before_capture
    monkeypatch.setattr(kernel_build, "before_capture", lambda *a: calls.append(a) or real(*a))
    model = LlamaModel(LlamaConfig.tiny(head_dim=64), seed=0)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    config = fullcg.FullCGConfig(compiler="none", graph_mode="piecewise", capture_sizes=(4,), attention_impl="triton")
    run = EagerCaptureModel(model, config, graphs=EmulatedGraphs)
    for q_lens, p_lens in (([3], [0]), ([1], [3])):
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, torch.tensor([[0, 1]], dtype=torch.int32), 4)
        with torch.inference_mode(), fullcg.forward_context(md, model):
            run(torch.arange(q_lens[0]), torch.arange(p_lens[0], p_lens[0] + q_lens[0]))
    assert len(calls) == 2, "before the probe run, and at the runner's first step"
    assert len(on_a_gpu) == 1, "built once"
    assert [k.what for k in on_a_gpu[0]] == [*DENSE_TRITON, "rms_norm", "silu_mul"], \
        "with the fused kernels its eager steps launch"


def test_a_model_run_on_the_cpu_never_asks(monkeypatch):
    monkeypatch.setattr(kernel_build, "before_capture", lambda *a: pytest.fail("asked on the CPU"))
    model = LlamaModel(LlamaConfig.tiny(), seed=0)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    run = fullcg.compile(model, compiler="none")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), 4)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        run(torch.arange(3), torch.arange(3))


# ---------------------------------------------------------------------------------- on a GPU

def _compiles(monkeypatch, counting=lambda: True) -> list[str]:
    """The names of fullcg's Triton kernels Triton compiles or loads from disk from now on
    (while ``counting()``): a launch that finds its kernel in the process's cache is neither."""
    import triton

    seen: list[str] = []
    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        if fn is not None and str(getattr(fn, "module", "")).startswith("fullcg.") and counting():
            seen.append(fn.name)
        return previous(*args, **kwargs) if previous is not None else False

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    return seen


def _cuda_llama(impl: str, tmp_path, monkeypatch) -> tuple[LlamaModel, fullcg.FullCGConfig]:
    monkeypatch.setenv("FULLCG_CACHE_DIR", str(tmp_path))
    model = LlamaModel(LlamaConfig.tiny(head_dim=64), seed=0, device="cuda", dtype=torch.bfloat16)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    return model, fullcg.FullCGConfig(attention_impl=impl)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="builds kernels for a CUDA GPU")
# ``auto`` builds FlashInfer's modules where FlashInfer is installed (minutes on a fresh
# machine): marked so that ``-k flashinfer`` runs it with the FlashInfer tests.
@pytest.mark.parametrize("impl", ["triton", pytest.param("auto", marks=pytest.mark.flashinfer)])
def test_on_a_gpu_a_build_leaves_nothing_for_the_steps_to_compile(impl, tmp_path, monkeypatch):
    model, config = _cuda_llama(impl, tmp_path, monkeypatch)
    shapes = layer_shapes(model, config)
    # The model runs eagerly below: its norms and activation launch the fused kernels too.
    kernels = kernel_build.plan_for(shapes, config, torch.device("cuda", 0), 16) + kernel_build.fused_kernels(model)
    assert kernels, "a GPU config needs kernels"
    first = kernel_build.build_kernels(kernels, "cuda", config)
    assert set(first.built) | set(first.ready) == set(kernels)
    compiled = _compiles(monkeypatch)
    kernel_build.build_kernels(kernels, "cuda", config)
    assert compiled == [], "a second build compiles and loads nothing"
    # Prefill, decode and mixed steps, eager, on the implementation: nothing left to compile.
    page = 4
    for q_lens, p_lens in (([5, 3], [0, 0]), ([1, 1], [5, 3]), ([2, 1], [6, 4])):
        table = torch.tensor([[r * 8 + i for i in range(8)] for r in range(len(q_lens))], dtype=torch.int32)
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table, page, device="cuda")
        positions = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)]).cuda()
        with torch.inference_mode(), fullcg.forward_context(md, model, config=config):
            model(torch.arange(sum(q_lens), device="cuda") % 200, positions)
    torch.cuda.synchronize()
    assert compiled == [], f"the steps compiled {compiled}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_on_a_gpu_capture_builds_first_and_captures_without_compiling(tmp_path, monkeypatch):
    model, config = _cuda_llama("triton", tmp_path, monkeypatch)
    monkeypatch.setattr(kernel_build, "_done", set())
    built: list = []
    real_build = kernel_build.build_kernels

    def build(kernels, *args, **kwargs):
        result = real_build(kernels, *args, **kwargs)
        built.append(kernels)
        return result

    monkeypatch.setattr(kernel_build, "build_kernels", build)
    run = fullcg.compile(model, config.replace(compiler="none", capture_sizes=(1, 2, 4)))
    compiled = _compiles(monkeypatch, counting=lambda: bool(built))  # from the end of the build on
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), 4, device="cuda")
    fullcg.capture(run, md, model, torch.arange(3, device="cuda"), torch.arange(3, device="cuda"))
    torch.cuda.synchronize()
    assert len(built) == 1 and [k.what for k in built[0]] == [*DENSE_TRITON, "rms_norm", "silu_mul"]
    assert compiled == [], f"capture compiled {compiled}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="builds FlashInfer modules for a CUDA GPU")
def test_on_a_gpu_flashinfer_modules_are_built_once(tmp_path, monkeypatch):
    pytest.importorskip("flashinfer")
    model, config = _cuda_llama("flashinfer", tmp_path, monkeypatch)
    kernels = kernel_build.plan_for(layer_shapes(model, config), config, torch.device("cuda", 0))
    modules = [k for k in kernels if k.library == "flashinfer"]
    assert modules and modules[0].what == "fa2"
    kernel_build.build_kernels(kernels, "cuda", config)
    assert all(kernel_build._flashinfer_built(k) for k in modules)
    # (A Triton kernel this worker compiled for an earlier test is not in this test's kernel
    # directory, so it counts as built again: only the modules are this test's subject.)
    assert [k for k in kernel_build.build_kernels(kernels, "cuda", config).built if k.library == "flashinfer"] == []



def test_builds_in_two_threads_leave_the_triton_cache_variable_as_it_was(tmp_path, monkeypatch):
    # The variable is the process's: each build points it at the kernel directory for its
    # compiles, one at a time, and puts back what was there.
    import threading
    import time

    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    seen: list[str] = []

    def build(directory):
        with kernel_build._triton_cache_in(directory):
            seen.append(os.environ["TRITON_CACHE_DIR"])
            time.sleep(0.05)
            seen.append(os.environ["TRITON_CACHE_DIR"])

    threads = [threading.Thread(target=build, args=(tmp_path / name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"
    assert seen[0] == seen[1] and seen[2] == seen[3]  # each build saw only its own directory


class _FakeJIT:
    """Stands in for a Triton kernel's JIT function: ``warmup`` compiles as Triton's does,
    through the active asynchronous compile mode when there is one (a future then)."""

    def __init__(self, name: str, threads: list[str], fail: bool = False, load_fails: bool = False) -> None:
        self.name, self.threads, self.fail, self.load_fails = name, threads, fail, load_fails
        self.barrier = None  # a threading.Barrier the compile waits at, where a test gives one
        self.finalize_fails = False  # as a post-compile hook that raises, when the compile is taken in

    def warmup(self, *args, **kwargs):
        import threading

        from triton.runtime import _async_compile

        def compile_():
            self.threads.append(threading.current_thread().name)
            if self.barrier is not None:
                self.barrier.wait()
            if self.fail:
                raise RuntimeError(f"{self.name} does not compile")
            return _FakeCompiled(self.name, self.threads, self.load_fails)

        mode = _async_compile.active_mode.get()
        if mode is None:
            return compile_()
        def finalize(kernel):
            if self.finalize_fails:
                raise RuntimeError("post-compile hook failed")

        return mode.submit(self.name, compile_, finalize)


class _FakeCompiled:
    """A compiled kernel: equal to ``"compiled <name>"``; its first launch's loading noted."""

    def __init__(self, name: str, threads: list[str], load_fails: bool) -> None:
        self.name, self.threads, self.load_fails, self.loaded = name, threads, load_fails, 0

    def _init_handles(self) -> None:
        import threading

        self.threads.append("load " + threading.current_thread().name)
        self.loaded += 1
        if self.load_fails:
            raise RuntimeError(f"{self.name} needs more shared memory than the GPU has")

    def __eq__(self, other: object) -> bool:
        return other == f"compiled {self.name}"

    __hash__ = None  # type: ignore[assignment]


def _fake_launch(jit: _FakeJIT):
    import types

    launcher = types.SimpleNamespace(fn=jit, constexpr_names=())
    return types.SimpleNamespace(launcher=launcher, tail=(), grid=(1,), num_warps=4, num_stages=1, constexprs=())


@pytest.fixture
def compiled_builds(monkeypatch):
    """Builds that compile (as on a GPU, not under the interpreter), with no background
    work of Triton's to wait for: the fake launches stand for Triton."""
    from fullcg import source_keys

    monkeypatch.setattr(kernel_build, "_interpreted", lambda: False)
    monkeypatch.setattr(source_keys, "wait_for_triton", lambda: None)


def _fake_plan(names, threads, failing=(), failing_load=()):
    kernels = [Kernel("triton", name, (), name) for name in names]
    return [(k, [(_fake_launch(_FakeJIT(k.what, threads, fail=k.what in failing, load_fails=k.what in failing_load)), ())])
            for k in kernels]


def test_triton_kernels_compile_side_by_side_on_build_threads(compiled_builds, monkeypatch):
    pytest.importorskip("triton.runtime._async_compile")
    import threading

    monkeypatch.setattr(kernel_build.os, "cpu_count", lambda: 4)
    threads: list[str] = []
    planned = _fake_plan([f"k{i}" for i in range(6)], threads)
    # The first four compiles meet at a barrier: one at a time, it would break (time out).
    together = threading.Barrier(4, timeout=30)
    for _, launches in planned[:4]:
        launches[0][0].launcher.fn.barrier = together
    failures: list[str] = []
    done = kernel_build._compile_all(planned, failures)
    assert failures == []
    assert [(k.what, compiled) for k, compiled in done] == [(f"k{i}", [f"compiled k{i}"]) for i in range(6)]
    compiles = [t for t in threads if not t.startswith("load ")]
    loads = [t.removeprefix("load ") for t in threads if t.startswith("load ")]
    assert all(name.startswith("fullcg-triton-build") for name in compiles + loads), threads
    assert len(set(compiles)) == 4, "as many threads as the CPU has cores, at most"
    assert len(loads) == 6 and all(c[0].loaded == 1 for _, c in done), "each kernel loaded once, on the build's threads"


def test_a_kernel_that_fails_to_compile_is_named_and_the_others_still_compile(compiled_builds, monkeypatch):
    pytest.importorskip("triton.runtime._async_compile")
    threads: list[str] = []
    failures: list[str] = []
    done = kernel_build._compile_all(_fake_plan(["a", "b", "c"], threads, failing={"b"}), failures)
    assert [k.what for k, _ in done] == ["a", "c"]
    assert len(failures) == 1 and failures[0].startswith("b: RuntimeError: b does not compile")


def test_a_kernel_that_fails_to_load_is_named_and_left_out_of_the_built(compiled_builds, monkeypatch):
    pytest.importorskip("triton.runtime._async_compile")
    failures: list[str] = []
    done = kernel_build._compile_all(_fake_plan(["a", "b"], [], failing_load={"a"}), failures)
    assert [k.what for k, _ in done] == ["b"]
    assert failures == ["a: RuntimeError: a needs more shared memory than the GPU has"]


def test_under_a_callers_compile_mode_the_kernels_compile_on_the_builds_threads(compiled_builds, monkeypatch):
    # Triton keeps its asynchronous mode in a context variable: a build inside a caller's
    # mode (an Inductor compile) neither hands its compiles to it nor leaves it changed.
    _async_compile = pytest.importorskip("triton.runtime._async_compile")
    from concurrent.futures import ThreadPoolExecutor

    threads: list[str] = []
    failures: list[str] = []
    with ThreadPoolExecutor(2, thread_name_prefix="caller") as pool, _async_compile.AsyncCompileMode(pool) as mode:
        done = kernel_build._compile_all(_fake_plan(["a", "b"], threads), failures)
        one = kernel_build._compile_all(_fake_plan(["c"], threads), failures)  # one launch: this thread
        assert _async_compile.active_mode.get() is mode and mode.raw_futures == []
    assert [c for _, c in one] == [["compiled c"]]
    assert failures == [] and [c for _, c in done] == [["compiled a"], ["compiled b"]]
    import threading

    me = threading.current_thread().name
    assert all(name.startswith("fullcg-triton-build") or name == me for name in threads if not name.startswith("load "))
    assert not any(name.startswith("caller") for name in threads)


def test_a_hook_failing_as_compiles_finish_is_reported_and_leaves_no_compile_mode_behind(compiled_builds, monkeypatch):
    _async_compile = pytest.importorskip("triton.runtime._async_compile")
    planned = _fake_plan(["a", "b"], [])
    planned[0][1][0][0].launcher.fn.finalize_fails = True
    failures: list[str] = []
    kernel_build._compile_all(planned, failures)
    assert any("finishing Triton's compiles: RuntimeError: post-compile hook failed" in f for f in failures), failures
    assert _async_compile.active_mode.get() is None, "no mode left active for the caller's later compiles"
    again: list[str] = []
    assert [k.what for k, _ in kernel_build._compile_all(_fake_plan(["c"], []), again)] == ["c"] and again == []


def test_a_build_waits_for_the_background_work_before_its_first_compile(monkeypatch):
    from fullcg import source_keys

    monkeypatch.setattr(kernel_build, "_interpreted", lambda: False)
    order: list[str] = []
    monkeypatch.setattr(source_keys, "wait_for_triton", lambda: order.append("wait"))
    kernel_build._compile_all(_fake_plan(["a", "b"], order), [])
    assert order[0] == "wait" and len(order) > 1


def test_a_kernel_whose_load_failed_loads_again_at_its_first_launch():
    # Triton sets the launcher before loading the module: left set after a failed load, the
    # first launch would call it without a function instead of raising the load's error.
    class Compiled:
        module = None
        _run = None

        def _init_handles(self):
            self._run = "a launcher"
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")

    compiled = Compiled()
    assert kernel_build._load(compiled, None) == "RuntimeError: CUDA_ERROR_OUT_OF_MEMORY"
    assert compiled._run is None

    import functools

    class OverLimits(Compiled):
        def _init_handles(self):  # as Triton does for a kernel over the GPU's shared memory
            self._run = functools.partial(print, "raises OutOfResources at every launch")
            raise RuntimeError("OutOfResources")

    over = OverLimits()
    kernel_build._load(over, None)
    assert isinstance(over._run, functools.partial), "Triton's launcher that raises the limit's error is kept"


def test_one_launch_compiles_on_the_calling_thread(compiled_builds, monkeypatch):
    import threading

    threads: list[str] = []
    done = kernel_build._compile_all(_fake_plan(["a"], threads), [])
    me = threading.current_thread().name
    assert [c for _, c in done] == [["compiled a"]] and threads == [me, f"load {me}"]
