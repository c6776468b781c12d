"""``attention_impl="auto"`` with two implementations (FlashInfer and Triton on CUDA) runs
each call on the first when it computes the call as asked, on the second otherwise, and
the same one saves and attends. Stand-in implementations record what ran, so the rule is
pinned down without a GPU; ``test_flashinfer.py`` runs it with the real ones on the H200.
"""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl.auto import AutoAttention
from fullcg.ops.impl.base import AttentionImpl

from batches import make_batch


class Recording(AttentionImpl):
    def __init__(self, name: str, serves: bool = True, capture_safe: bool = True) -> None:
        self.name, self._serves, self.capture_safe = name, serves, capture_safe
        self.ran: list[str] = []

    def serves(self, call, ctx, cache) -> bool:
        self.ran.append("serves")
        return self._serves

    def save_kv(self, call, ctx, cache) -> None:
        self.ran.append("save_kv")

    def forward(self, call, ctx, cache):
        self.ran.append("forward")
        call.out.zero_()
        return torch.zeros(call.q.shape[:2]) if call.return_lse else None

    def step_plan(self, call, ctx, cache):
        self.ran.append("step_plan")
        return None

    def plan(self, ctx) -> None:
        self.ran.append("plan")


def run(auto: AutoAttention, dtype: torch.dtype, layers: int = 1, use_kv_cache: bool = True,
        **factors: float) -> list[str]:
    """One step of ``layers`` alike calls through ``auto``, as the ops make them; the
    implementations a replay of this step would plan."""
    b = make_batch([3, 1], [0, 5], dtype=dtype)
    with torch.inference_mode(), fullcg.forward_context(b.metadata, b.layer) as ctx:
        cache = b.layer.kv_cache
        for layer in range(layers):
            call = AttentionCall(
                op="attention", q=b.q, k=b.k, v=b.v, out=torch.empty_like(b.q), layer_id=layer,
                key_value_num_tokens=None, prefill_scale_factor=factors.get("prefill"),
                decode_scale_factor=factors.get("decode"), scale=1.0, use_kv_cache=use_kv_cache, causal=True,
                prefix_chunk=None, save_kv_cache=True, return_lse=False,
            )
            auto.save_kv(call, ctx, cache)
            auto.forward(call, ctx, cache if use_kv_cache else None)
            auto.step_plan(call, ctx, cache)
        for impl in ctx.step.resolved():
            impl.plan(ctx)
        return sorted(impl.name for impl in ctx.step.resolved())


def test_dense_half_precision_calls_run_on_the_first_without_asking_it_and_replays_plan_only_it():
    first, second = Recording("flashinfer", serves=False), Recording("triton")
    assert run(AutoAttention(first, second), torch.bfloat16) == ["flashinfer"]
    assert first.ran == ["save_kv", "forward", "step_plan", "plan"]
    assert second.ran == []


@pytest.mark.parametrize("serves", [True, False])
def test_skip_softmax_calls_run_where_the_first_would_honour_the_factor_else_on_the_second(serves):
    first, second = Recording("flashinfer", serves=serves), Recording("triton")
    planned = run(AutoAttention(first, second), torch.bfloat16, decode=4.0)
    chosen, other = (first, second) if serves else (second, first)
    assert planned == [chosen.name]
    assert [step for step in chosen.ran if step != "serves"] == ["save_kv", "forward", "step_plan", "plan"]
    assert [step for step in other.ran if step != "serves"] == []


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_alike_calls_of_a_step_are_decided_once_so_saving_and_attending_share_an_implementation(use_kv_cache):
    """The first is asked once per step for all its layers' alike calls; with or without
    attending over the cache (the chunked-prefix pattern saves, then attends over given
    k/v), save_kv and forward go to the same implementation."""
    first, second = Recording("flashinfer", serves=False), Recording("triton")
    run(AutoAttention(first, second), torch.bfloat16, layers=4, use_kv_cache=use_kv_cache, prefill=2.0)
    assert first.ran.count("serves") == 1
    assert second.ran.count("save_kv") == second.ran.count("forward") == 4


def test_float32_calls_ask_the_first_even_without_factors():
    first, second = Recording("flashinfer", serves=False), Recording("triton")
    run(AutoAttention(first, second), torch.float32)
    assert "serves" in first.ran
    assert "forward" in second.ran and "forward" not in first.ran


def test_auto_captures_full_graphs_only_when_both_can_be_captured():
    assert AutoAttention(Recording("a"), Recording("b")).capture_safe
    assert not AutoAttention(Recording("a"), Recording("b", capture_safe=False)).capture_safe


class ServesWindows(Recording):
    """A first implementation that serves every window but ``refused`` (and records the windows it ran)."""

    def __init__(self, refused: int) -> None:
        super().__init__("flashinfer")
        self.refused = refused
        self.windows: list[tuple[int | None, float | None]] = []

    def serves(self, call, ctx, cache) -> bool:
        self.ran.append("serves")
        return call.sliding_window != self.refused

    def forward(self, call, ctx, cache):
        self.windows.append((call.sliding_window, call.logit_softcap))
        return super().forward(call, ctx, cache)


def test_windowed_and_softcapped_calls_are_decided_per_window_and_softcap_within_a_step():
    """Sliding and full layers alternate in one step: the first is asked once per distinct
    (window, soft-cap), never for plain dense calls, and what it refuses runs on the second."""
    first, second = ServesWindows(refused=4), Recording("triton")
    auto = AutoAttention(first, second)
    b = make_batch([3, 1], [0, 5], dtype=torch.bfloat16)
    masks = [(8, None), (None, None), (8, None), (4, None), (None, 2.0), (8, 2.0), (None, 2.0)]
    with torch.inference_mode(), fullcg.forward_context(b.metadata, b.layer) as ctx:
        for layer, (window, softcap) in enumerate(masks):
            call = AttentionCall(
                op="attention", q=b.q, k=b.k, v=b.v, out=torch.empty_like(b.q), layer_id=layer,
                key_value_num_tokens=None, prefill_scale_factor=None, decode_scale_factor=None, scale=1.0,
                use_kv_cache=True, causal=True, prefix_chunk=None, save_kv_cache=True, return_lse=False,
                sliding_window=window, logit_softcap=softcap,
            )
            auto.forward(call, ctx, b.layer.kv_cache)
        planned = sorted(impl.name for impl in ctx.step.resolved())
    assert first.ran.count("serves") == 4  # (8, None), (4, None), (None, 2.0), (8, 2.0)
    assert first.windows == [m for m in masks if m != (4, None)]
    assert second.ran == ["forward"]
    assert planned == ["flashinfer", "triton"]
