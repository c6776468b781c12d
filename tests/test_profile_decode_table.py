"""The kernel table of benchmarks/profile_decode.py: bytes attributed by launch order, and its fallbacks."""

import importlib.util
import pathlib
import sys

import pytest
import torch

from fullcg.models.llama import LlamaConfig, LlamaModel

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"

# A replay of a 2-layer model in the pattern of an H200 run. qkv_proj and o_proj share a
# GEMM kernel, so only the launch order tells their bytes apart.
SHARED = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"
GATE_UP = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT"
DOWN = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT"
HEAD = "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT"
REDUCE = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(int, int)"
NORM = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_{}"


def _layer(i: int) -> list[tuple[str, float]]:
    return [(NORM.format(2 * i), 2.0), (SHARED, 10.0), ("triton_poi_fused_attention_cat_cos_mul_sin_1", 1.0),
            ("_decode_kernel", 20.0), (SHARED, 8.0), (REDUCE, 1.0), (NORM.format(2 * i + 1), 2.0),
            (GATE_UP, 30.0), ("triton_poi_fused_mul_silu_4", 1.0), (DOWN, 15.0), (REDUCE, 1.0)]


SEQUENCE = _layer(0) + _layer(1) + [(NORM.format(9), 2.0), (HEAD, 40.0)]


@pytest.fixture(scope="module")
def bench():
    # The benchmark imports decode.py by module name, as it does when run from benchmarks/.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("benchmark_profile_decode", BENCHMARKS / "profile_decode.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.fixture(scope="module")
def model():
    return LlamaModel(LlamaConfig.tiny(), seed=0, dtype=torch.bfloat16)


def _gemm_bytes(linear: torch.nn.Linear, batch: int) -> int:
    out_features, in_features = linear.weight.shape
    return linear.weight.numel() * 2 + batch * (in_features + out_features) * 2


def test_gemm_bytes_go_to_the_weights_in_forward_order(bench, model):
    batch, context = 2, 16
    shape = bench.step_shape(model, batch, context)
    launches, warnings = bench.attribute(SEQUENCE, shape)
    assert warnings == []
    gemms = [launch for launch in launches if launch.role.startswith("gemm ")]
    linears = [(f"layers.{i}.{path}", layer.get_submodule(path))
               for i, layer in enumerate(model.layers) for path in bench.LAYER_LINEARS] + [("lm_head", model.lm_head)]
    assert [launch.what for launch in gemms] == [name for name, _ in linears]
    assert [launch.bytes for launch in gemms] == [_gemm_bytes(linear, batch) for _, linear in linears]

    table = bench.build_table(SEQUENCE, shape, 1e12)
    assert table["attributed"] and table["warnings"] == []
    rows = {(r["kernel"], r["role"]): r for r in table["rows"]}
    attn = model.layers[0].self_attn
    qkv, o = rows[(SHARED, "gemm qkv_proj")], rows[(SHARED, "gemm o_proj")]
    assert (qkv["count"], qkv["us"], qkv["bytes"]) == (2, 20.0, 2 * _gemm_bytes(attn.qkv_proj, batch))
    assert (o["count"], o["us"], o["bytes"]) == (2, 16.0, 2 * _gemm_bytes(attn.o_proj, batch))
    assert qkv["bw_fraction"] == pytest.approx(qkv["bytes"] / 20e-6 / 1e12)
    # Each layer's keys and values of context + 1 tokens, its queries and outputs, the new k and v written.
    cfg = model.cfg
    kv_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    per_layer = batch * (context + 1) * kv_token + 2 * batch * cfg.num_heads * cfg.head_dim * 2 + batch * kv_token
    assert rows[("_decode_kernel", "attention")]["bytes"] == cfg.num_layers * per_layer
    # Inductor's serial numbers are dropped: the five norms are one row, estimated.
    norm = rows[("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt", "rmsnorm")]
    assert norm["count"] == 5 and norm["bytes_kind"] == "est."
    reduce = rows[("cublasLt::splitKreduce_kernel", "gemm_reduce")]
    assert (reduce["count"], reduce["bytes"], reduce["bytes_kind"]) == (4, None, "-")
    assert table["total"]["bytes"] == sum(r["bytes"] for r in table["rows"] if r["bytes"] is not None)
    assert table["total"]["us"] == pytest.approx(sum(us for _, us in SEQUENCE))
    weights = sum(p.numel() * 2 for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert table["floor"]["bytes"] == weights + cfg.num_layers * batch * (context + 1) * kv_token
    assert "| **step total** |" in bench.format_table(table)


def test_a_replay_off_the_pattern_gets_times_only_with_a_warning(bench, model):
    shape = bench.step_shape(model, 1, 16)
    table = bench.build_table(SEQUENCE[:-1], shape, 1e12)  # no lm_head GEMM
    assert not table["attributed"]
    assert all(r["bytes"] is None and r["bw_fraction"] is None for r in table["rows"])
    assert {r["role"] for r in table["rows"] if r["kernel"] == SHARED} == {"gemm"}
    assert "8 GEMM launches in a replay, expected 9" in table["warnings"][0]
    assert "WARNING: 8 GEMM launches" in bench.format_table(table)

    # Replays that differ cannot be lined up: per kernel name over all of them, per step.
    events = [(name, float(t), us) for t, (name, us) in enumerate(SEQUENCE + SEQUENCE[1:] + SEQUENCE[:1])]
    table = bench.point_table(events, 2, shape, 1e12)
    assert not table["attributed"] and "differ" in table["warnings"][0]
    assert {r["kernel"]: r["count"] for r in table["rows"]}["_decode_kernel"] == 2


def test_replays_split_in_order_with_median_times(bench):
    events = [(name, float(t), us * (1 + step)) for step in range(3) for t, (name, us) in
              enumerate(SEQUENCE, start=100 * step)]
    sequence, why = bench.replay_sequence(events[::-1], 3)  # the profiler's order does not matter
    assert why is None and sequence == [(name, 2 * us) for name, us in SEQUENCE]
    assert bench.replay_sequence(events[:-1], 3)[0] is None


def test_kernel_names_and_roles(bench):
    assert bench.short_name(REDUCE) == "cublasLt::splitKreduce_kernel"
    assert bench.short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, "
                            "std::array<char*, 1ul> >(int)") == "at::native::vectorized_elementwise_kernel<FillFunctor>"
    assert bench.short_name("Memset (Device)") == "Memset"
    roles = {name: bench.kernel_role(name) for name in [
        SHARED, REDUCE, "_decode_kernel", "_save_kv_kernel", "triton_poi_fused_attention_cat_cos_mul_sin_2",
        "triton_tem_fused_mm_0", "void flashinfer::BatchDecodeWithPagedKVCacheKernel<128>(int)", "Memset (Device)",
        "triton_red_fused__to_copy_add_addmm_mean_mul_pow_rsqrt_3", "triton_red_fused_mm_5"]}
    assert list(roles.values()) == ["gemm", "gemm_reduce", "attention", "kv_save", "rotary", "gemm", "attention",
                                    "other", "rmsnorm", "gemm"]


def test_smoke_mode_tabulates_a_synthetic_replay_and_its_fallback(bench, capsys):
    result = bench.main(["--smoke", "--batch", "1"])
    assert [p["attributed"] for p in result["points"]] == [True, False]
    assert "one GEMM dropped" in capsys.readouterr().out
