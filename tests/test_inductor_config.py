"""FullCGConfig.inductor_config: Inductor settings in effect while fullcg compiles the
pieces, checked when the backend is made, part of the compile cache's key."""

from __future__ import annotations

import copy

import pytest
import torch

import fullcg
from fullcg.backend import Backend
from fullcg.compile_cache import CompileCache
from fullcg.errors import ConfigTypeError, InvalidConfigError
from fullcg.models.llama import LlamaConfig, LlamaModel
from batches import side_by_side


def test_settings_are_kept_as_sorted_pairs_whether_given_as_a_mapping_or_pairs():
    from_mapping = fullcg.FullCGConfig(inductor_config={"max_autotune": False, "combo_kernels": True})
    from_pairs = fullcg.FullCGConfig(inductor_config=[("combo_kernels", True), ("max_autotune", False)])
    assert from_mapping == from_pairs
    assert from_mapping.inductor_config == (("combo_kernels", True), ("max_autotune", False))
    assert hash(from_mapping) == hash(from_pairs), "a config stays hashable"
    assert fullcg.FullCGConfig().inductor_config == ()


@pytest.mark.parametrize("bad, error, message", [
    (3, ConfigTypeError, "must be a mapping of Inductor setting names"),
    ("combo_kernels", ConfigTypeError, "must be a mapping of Inductor setting names"),
    ({"combo_kernels": [True]}, ConfigTypeError, r"inductor_config\['combo_kernels'\] must be a bool, int, float, str"),
    ({1: True}, ConfigTypeError, "names must be non-empty strings"),
    ({"": True}, ConfigTypeError, "names must be non-empty strings"),
    ([("combo_kernels", True), ("combo_kernels", False)], InvalidConfigError, "names a setting twice"),
])
def test_settings_that_are_not_plain_name_value_pairs_are_refused_with_the_fix(bad, error, message):
    with pytest.raises(error, match=message):
        fullcg.FullCGConfig(inductor_config=bad)


@pytest.mark.parametrize("compiler", ["eager", "none"])
def test_settings_without_the_inductor_compiler_are_refused_not_ignored(compiler):
    with pytest.raises(InvalidConfigError, match=f"compiler='inductor' only, got compiler='{compiler}'"):
        fullcg.FullCGConfig(compiler=compiler, inductor_config={"combo_kernels": True})


def test_a_setting_inductor_does_not_have_is_refused_when_the_backend_is_made():
    config = fullcg.FullCGConfig(inductor_config={"combo_kernels": True, "no_such_setting": 1})
    with pytest.raises(InvalidConfigError, match=r"does not have: \['no_such_setting'\]"):
        Backend(config)
    with pytest.raises(InvalidConfigError, match="no_such_setting"):
        fullcg.compile(torch.nn.Linear(2, 2), inductor_config={"no_such_setting": 1})
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(InvalidConfigError, match="no_such_setting"):  # torch.compile(..., options={...})
        Backend()(gm, [torch.zeros(1, 2)], options={"inductor_config": {"no_such_setting": 1}})
    Backend(fullcg.FullCGConfig(inductor_config={"combo_kernels": True, "triton.cudagraphs": False}))  # dotted names


def test_the_settings_hold_while_the_pieces_compile_and_only_then(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config

    seen: list[tuple[bool, int]] = []

    def recording_compile_fx(gm, example_inputs, *args, **kwargs):
        seen.append((inductor_config.combo_kernels, inductor_config.max_fusion_size))
        return gm  # each piece runs as traced: what is pinned here is the settings, not Inductor

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording_compile_fx)
    torch._dynamo.reset()
    before = (inductor_config.combo_kernels, inductor_config.max_fusion_size)
    settings = {"combo_kernels": not before[0], "max_fusion_size": before[1] + 7}
    config = fullcg.FullCGConfig(graph_mode="none", compile_cache=False, warm_start=False, inductor_config=settings)
    eager = LlamaModel(LlamaConfig.tiny(), seed=0)
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.allocate_kv_cache(num_pages=64, page_size=4)
    worst, _ = side_by_side(eager, model, torch.compile(model, backend=Backend(config)), config, [[1, 2, 3, 4], [5, 6]],
                            max_new_tokens=2, prefill_chunk=8, prefix_chunk_tokens=8)
    assert worst < 1e-5
    assert seen and all(s == (settings["combo_kernels"], settings["max_fusion_size"]) for s in seen), seen
    assert (inductor_config.combo_kernels, inductor_config.max_fusion_size) == before, "only while compiling"


def test_the_compile_cache_key_covers_the_settings(tmp_path):
    cache, gm, x = CompileCache(tmp_path), torch.fx.symbolic_trace(torch.nn.Linear(4, 4)), torch.zeros(2, 4)
    base = fullcg.FullCGConfig()
    keys = {cache.key(gm, [x], config, "uuid") for config in (
        base, base.replace(inductor_config={"combo_kernels": True}), base.replace(inductor_config={"combo_kernels": False}),
    )}
    assert len(keys) == 3
    same = base.replace(inductor_config=[("combo_kernels", True), ("max_autotune", False)])
    assert cache.key(gm, [x], same, "uuid") == cache.key(
        gm, [x], base.replace(inductor_config={"max_autotune": False, "combo_kernels": True}), "uuid")
