"""fullcg's compiles keep a residual add out of the matmul before it (Inductor folds it in
as ``addmm``, which on a decode GEMM costs a copy of the residual into its output);
a bias keeps its ``addmm``, and a post-grad pass the user configured still runs."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fullcg.passes.residual_addmm as residual_addmm
from fullcg.backend import _inductor_piece


class ResidualBlock(torch.nn.Module):
    """``residual + o(x)`` (the add Inductor folds) and ``b(x)`` with a bias (an addmm of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.o = torch.nn.Linear(64, 32, bias=False)
        self.b = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + self.o(x)
        return h * 2, self.b(x)


def _matmul_calls(codes: list[str]) -> list[str]:
    return re.findall(r"extern_kernels\.(addmm|mm)\(", "\n".join(codes))


def _compiled(module: torch.nn.Module, inputs: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], list[str]]:
    torch._dynamo.reset()
    gm = torch.fx.symbolic_trace(module)
    with torch.no_grad():
        return run_and_get_code(lambda: _inductor_piece("piece", gm, inputs)(*inputs))


def _inputs(dtype: torch.dtype) -> tuple[ResidualBlock, list[torch.Tensor]]:
    torch.manual_seed(0)
    block = ResidualBlock().to(dtype)
    return block, [torch.randn(8, 64, dtype=dtype), torch.randn(8, 32, dtype=dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_residual_add_leaves_the_matmul_and_the_bias_keeps_its_addmm(dtype: torch.dtype) -> None:
    block, inputs = _inputs(dtype)
    (h2, biased), codes = _compiled(block, inputs)
    assert sorted(_matmul_calls(codes)) == ["addmm", "mm"]
    with torch.no_grad():
        # Unfused, the compiled sum is the eager model's: the matmul rounded, then the add.
        assert torch.equal(h2, (inputs[1] + block.o(inputs[0])) * 2)
        torch.testing.assert_close(biased, block.b(inputs[0]))


def test_with_the_split_off_inductor_folds_the_residual_add_into_an_addmm(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the split undoes: the A/B switch the decode profile uses.
    monkeypatch.setattr(residual_addmm, "ENABLED", False)
    block, inputs = _inputs(torch.float32)
    _, codes = _compiled(block, inputs)
    assert _matmul_calls(codes) == ["addmm", "addmm"]


def test_a_post_grad_pass_the_user_configured_runs_after_the_split() -> None:
    import torch._inductor.config as inductor_config

    seen: list[list[str]] = []

    class UserPass(residual_addmm._custom_pass_base()):  # type: ignore[misc]
        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.append(sorted(str(n.target) for n in graph.nodes if "mm" in str(n.target)))

        def uuid(self) -> str:
            return "user-pass"

    user = UserPass()
    block, inputs = _inputs(torch.float32)
    with inductor_config.patch(post_grad_custom_post_pass=user):
        _, codes = _compiled(block, inputs)
        assert inductor_config.post_grad_custom_post_pass is user, "the user's setting is back after the compile"
    assert seen == [["aten.addmm.default", "aten.mm.default"]]
    assert sorted(_matmul_calls(codes)) == ["addmm", "mm"]


def _takes_pass_lists() -> bool:
    import torch._inductor.custom_graph_pass as custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


@pytest.mark.skipif(not _takes_pass_lists(), reason="this torch's Inductor takes one post-grad pass, not a list")
def test_a_list_of_user_passes_and_an_inference_aware_one_still_run() -> None:
    import torch._inductor.config as inductor_config
    import torch._inductor.custom_graph_pass as custom_graph_pass

    calls: list[str] = []

    class Plain(custom_graph_pass.CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            calls.append("plain")

        def uuid(self) -> str:
            return "plain"

    passes: list = [Plain()]
    aware_base = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)
    if aware_base is not None:
        class Aware(aware_base):  # type: ignore[misc, valid-type]
            def __call__(self, graph: torch.fx.Graph, is_inference: bool) -> None:
                calls.append(f"aware(is_inference={is_inference})")

            def uuid(self) -> str:
                return "aware"

        passes.append(Aware())
    block, inputs = _inputs(torch.float32)
    with inductor_config.patch(post_grad_custom_post_pass=passes):
        _, codes = _compiled(block, inputs)
        assert inductor_config.post_grad_custom_post_pass == passes
    assert sorted(_matmul_calls(codes)) == ["addmm", "mm"], "the split ran, and then the user's passes"
    assert calls == ["plain"] + (["aware(is_inference=True)"] if aware_base is not None else [])


def test_the_split_pass_keys_inductors_cache_on_its_source_the_switch_and_the_users_pass() -> None:
    class Keyless:
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

    alone = residual_addmm.ResidualAddmmSplit()
    assert alone.uuid() == residual_addmm.ResidualAddmmSplit().uuid()
    assert residual_addmm.ResidualAddmmSplit(Keyless()).uuid() is None  # no key: Inductor does not cache
    enabled = alone.uuid()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(residual_addmm, "ENABLED", False)
        assert residual_addmm.ResidualAddmmSplit().uuid() != enabled


def test_the_split_nodes_name_their_own_ops_for_inductors_kernel_names() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    a, b, c = torch.randn(4, 8), torch.randn(8, 6), torch.randn(4, 6)
    gm = make_fx(lambda c, a, b: torch.addmm(c, a, b), tracing_mode="fake")(c, a, b)
    addmm = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)))
    addmm.meta["original_aten"] = torch.ops.aten.addmm.default
    assert residual_addmm.split_residual_addmm(gm.graph) == 1
    gm.recompile()
    mm, add = (next(iter(gm.graph.find_nodes(op="call_function", target=t)))
               for t in (torch.ops.aten.mm.default, torch.ops.aten.add.Tensor))
    assert mm.meta["original_aten"] is torch.ops.aten.mm.default and mm.meta["val"].shape == (4, 6)
    assert add.meta["original_aten"] is torch.ops.aten.add.Tensor
    assert torch.equal(gm(c, a, b), c + a @ b)


def test_a_scaled_addmm_or_one_without_shapes_on_record_is_left_alone() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    a, b, c = torch.randn(4, 8), torch.randn(8, 6), torch.randn(4, 6)
    scaled = make_fx(lambda c, a, b: torch.addmm(c, a, b, beta=0.5), tracing_mode="fake")(c, a, b)
    assert residual_addmm.split_residual_addmm(scaled.graph) == 0
    plain = make_fx(lambda c, a, b: torch.addmm(c, a, b), tracing_mode="fake")(c, a, b)
    addmm = next(iter(plain.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)))
    del addmm.args[1].meta["val"]
    assert residual_addmm.split_residual_addmm(plain.graph) == 0
