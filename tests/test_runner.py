"""The step runner's CUDA-graph bookkeeping, checked on the CPU: sizes, staging, static metadata."""

from __future__ import annotations

import logging

import pytest
import torch

import fullcg
from fullcg import cudagraph, runner
from fullcg.ops.impl import AttentionImpl, register_implementation
from fullcg.runner import StepRunner
from batches import make_batch


def test_batches_pad_to_the_next_capture_size_and_larger_ones_run_uncaptured():
    sizes = fullcg.FullCGConfig(max_capture_size=64).sizes_to_capture
    assert sizes[:4] == (1, 2, 4, 8) and sizes[-1] == 64
    assert [runner.padded_size(n, sizes) for n in (1, 3, 4, 9, 64, 65)] == [1, 4, 4, 16, 64, None]


def test_a_graph_captures_only_the_token_counts_its_guards_admit():
    # Dynamo routes a step to a graph whose guards hold, but the runner pads steps to capture
    # sizes behind Dynamo's back: a graph guarded to "not one token" (or to exactly one)
    # must not be captured or run at sizes its guards reject.
    from fullcg.backend import token_count_guard

    served = []

    def backend(gm, example_inputs):
        values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        tokens = next(v for v in values if isinstance(v, torch.Tensor)).shape[0]

        def run(*args):  # guards are complete once compiling ends, as in the fullcg backend
            if len(served) < len(compiled_graphs):
                admits = token_count_guard(tokens)
                served.append(tuple(n for n in (1, 2, 4, 8) if admits(n)))
            return gm(*args)

        compiled_graphs.append(run)
        return run

    def step(x):
        return x * 2 if x.shape[0] == 1 else x + 1

    compiled_graphs: list = []
    fn = torch.compile(step, backend=backend, dynamic=None)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for n in (2, 1, 3):
            x = torch.ones(n)
            torch._dynamo.mark_dynamic(x, 0)
            assert torch.equal(fn(x), step(x))
    torch._dynamo.reset()
    assert served == [(2, 4, 8), (1,)]
    assert [token_count_guard(4)(n) for n in (1, 4)] == [False, True], "a static token count serves itself alone"


def test_inputs_are_staged_into_fixed_buffers_and_size_inputs_become_the_padded_size():
    buffers = {0: torch.zeros(16, dtype=torch.long), 2: torch.zeros(16, 3)}
    stager = runner.InputStager([0, 2], [1], buffers, (1, 2, 4, 8, 16))
    ids, hidden = torch.arange(1, 6), torch.ones(5, 3)
    weight = torch.randn(3, 3)
    assert stager.num_tokens([ids, 5, hidden, weight]) == 5
    assert stager.num_tokens([ids, 4, hidden, weight]) is None, "inconsistent token counts cannot be padded"
    staged = stager.stage([ids, 5, hidden, weight], 5, 8)
    assert staged[1] == 8 and staged[3] is weight
    assert staged[0].data_ptr() == buffers[0].data_ptr() and staged[0].shape == (8,)
    assert torch.equal(staged[0][:5], ids) and torch.equal(staged[2][:5], hidden)


def test_static_metadata_pads_requests_and_keeps_its_addresses():
    static = runner.StaticMetadata(8, runner.StaticTables(8, 6, torch.device("cpu")), torch.device("cpu"))
    addresses = [t.data_ptr() for t in (static.query_start_loc, static.slot_mapping, static.page_table)]
    b = make_batch([3, 1, 1], [0, 5, 9])  # 5 tokens, 3 requests, padded to 8
    md = static.fill(b.metadata)
    assert [t.data_ptr() for t in (md.query_start_loc, md.slot_mapping, md.page_table)] == addresses
    # Real requests, then one-token stand-ins for the 3 padding tokens, then empty requests.
    assert md.query_start_loc.tolist() == [0, 3, 4, 5, 6, 7, 8, 8, 8]
    assert md.seq_lens.tolist() == [3, 6, 10, 1, 1, 1, 0, 0]
    assert md.is_decode.tolist() == [False, True, True, True, True, True, False, False]
    assert md.num_tokens_tensor.item() == 5
    assert md.slot_mapping[:5].tolist() == b.metadata.slot_mapping.tolist() and (md.slot_mapping[5:] == -1).all()
    assert torch.equal(md.page_table[:3, : b.metadata.page_table.shape[1]], b.metadata.page_table)
    assert (md.page_table[3:] == 0).all()
    assert md.query_lens == b.metadata.query_lens, "host fields stay the real batch's, for planning"
    # A smaller batch refills the same buffers.
    md2 = static.fill(make_batch([1], [4]).metadata)
    assert md2.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8] and md2.num_tokens_tensor.item() == 1


def test_static_metadata_refills_clear_what_a_larger_batch_left():
    static = runner.StaticMetadata(8, runner.StaticTables(8, 6, torch.device("cpu")), torch.device("cpu"))
    large, small = make_batch([1] * 5, [3, 4, 5, 6, 7]).metadata, make_batch([2], [4]).metadata
    static.fill(large)
    md = static.fill(small)
    assert (md.page_table[1:] == 0).all(), "stand-in and empty requests read page 0"
    assert (md.slot_mapping[2:] == -1).all(), "padding tokens are never saved"
    assert md.seq_lens.tolist() == [6, 1, 1, 1, 1, 1, 1, 0] and md.num_tokens_tensor.item() == 2
    assert md.page_table is static.page_table and small.page_table is not static.page_table
    md = static.fill(large)
    assert md.slot_mapping[:5].tolist() == large.slot_mapping.tolist()
    assert md.is_decode.tolist() == [True] * 8 and md.is_decode_only


def test_stand_in_batches_write_nothing_to_the_cache():
    md = runner.dummy_metadata(4, decode_only=True, page_size=16, device=torch.device("cpu"))
    assert md.is_decode_only and (md.slot_mapping == -1).all()
    md = runner.dummy_metadata(40, decode_only=False, page_size=16, device=torch.device("cpu"))
    assert md.forward_modes == (fullcg.ForwardMode.PREFILL,) and md.num_tokens == 40 and (md.slot_mapping == -1).all()


class _SafeImpl(AttentionImpl):
    name = "capture-safe-stub"
    capture_safe = True

    def forward(self, call, ctx, cache):  # never called here
        raise AssertionError


def test_full_graphs_are_captured_only_with_a_capture_safe_implementation_and_no_gathers(caplog):
    register_implementation(_SafeImpl())

    def runner(impl: str, gathers: bool) -> StepRunner:
        config = fullcg.FullCGConfig(attention_impl=impl, graph_mode="full")
        return StepRunner(config, piecewise=None, full=lambda *a: a, device=torch.device("cpu"), full_capturable=not gathers)

    with caplog.at_level(logging.WARNING):
        assert runner("capture-safe-stub", gathers=False).full_capture_ok()
        assert not runner("reference", gathers=False).full_capture_ok()
        assert "'reference' cannot be captured" in caplog.text
        assert not runner("capture-safe-stub", gathers=True).full_capture_ok()
        assert "gathers prefix chunks on the host" in caplog.text


def test_auto_runs_decodes_and_small_batches_full_with_a_capture_safe_implementation_and_piecewise_otherwise():
    register_implementation(_SafeImpl())
    decode, mixed, prefill = make_batch([1, 1], [3, 5]), make_batch([4, 1], [0, 5]), make_batch([7], [0])

    def runner(impl: str, gathers: bool = False, mode: str = "auto", **options) -> StepRunner:
        config = fullcg.FullCGConfig(attention_impl=impl, graph_mode=mode, **options)
        return StepRunner(config, piecewise=lambda *a: a, full=lambda *a: a, device=torch.device("cpu"),
                          full_capturable=not gathers)

    def choices(r: StepRunner, tokens: int) -> list[str]:
        return [r.choose(b.metadata.is_decode_only, tokens) for b in (decode, mixed, prefill)]

    limit = fullcg.FullCGConfig().auto_full_max_tokens
    assert choices(runner("capture-safe-stub"), limit) == ["full"] * 3
    assert choices(runner("capture-safe-stub"), limit + 1) == ["full", "piecewise", "piecewise"], (
        "auto: batches with prefill or extend requests above auto_full_max_tokens run piecewise"
    )
    assert choices(runner("capture-safe-stub", auto_full_max_tokens=None), 10**6) == ["full"] * 3
    assert choices(runner("capture-safe-stub", auto_full_max_tokens=4), 5) == ["full", "piecewise", "piecewise"]
    assert choices(runner("reference"), 1) == ["piecewise"] * 3
    assert choices(runner("capture-safe-stub", gathers=True), 1) == ["piecewise"] * 3
    fp = runner("capture-safe-stub", mode="full_and_piecewise")
    assert choices(fp, 1) == ["full", "piecewise", "piecewise"], (
        "full_and_piecewise: decode-only batches full, the rest piecewise, whatever the implementation"
    )


@pytest.mark.parametrize(
    "mode, impl, options, expected",
    [
        ("auto", "capture-safe-stub", {"auto_full_max_tokens": 4},
         [("full", 8, True), ("piecewise", 8, False), ("full", 4, True), ("full", 4, False),
          ("full", 1, True), ("full", 1, False)]),
        ("auto", "capture-safe-stub", {"auto_full_max_tokens": None},
         [("full", 8, True), ("full", 8, False), ("full", 4, True), ("full", 4, False),
          ("full", 1, True), ("full", 1, False)]),
        ("auto", "reference", {}, [("piecewise", 8, False), ("piecewise", 4, False), ("piecewise", 1, False)]),
        ("full_and_piecewise", "capture-safe-stub", {},
         [("full", 8, True), ("piecewise", 8, False), ("full", 4, True), ("piecewise", 4, False),
          ("full", 1, True), ("piecewise", 1, False)]),
        ("piecewise", "capture-safe-stub", {}, [("piecewise", 8, False), ("piecewise", 4, False), ("piecewise", 1, False)]),
        ("full", "reference", {}, []),
    ],
)
def test_capture_all_captures_exactly_what_the_policy_replays(mode, impl, options, expected):
    register_implementation(_SafeImpl())
    config = fullcg.FullCGConfig(attention_impl=impl, graph_mode=mode, capture_sizes=(1, 4, 8), **options)
    step = lambda *a: a  # noqa: E731  (the backend gives both variants one split graph)
    runner = StepRunner(config, piecewise=step if config.graph_mode.wants_piecewise else None,
                        full=step if config.graph_mode.wants_full else None, device=torch.device("cpu"))
    assert runner.capture_jobs() == expected


def test_static_tables_are_shared_by_every_capture_size_and_sized_by_max_pages_per_request():
    tables = runner.StaticTables(16, 3, torch.device("cpu"))
    small = runner.StaticMetadata(4, tables, torch.device("cpu"))
    large = runner.StaticMetadata(16, tables, torch.device("cpu"))
    assert small.page_table.data_ptr() == large.page_table.data_ptr() == tables.page_table.data_ptr()
    fits = make_batch([1, 1], [3, 40], page_size=16).metadata  # 41 tokens: 3 pages of 16
    too_long = make_batch([1], [48], page_size=16).metadata  # 49 tokens: 4 pages
    assert small.fits(fits) and not small.fits(too_long)
    with pytest.raises(ValueError, match="max_pages_per_request"):
        small.fill(too_long)


class _WideOnly(AttentionImpl):
    name = "wide_only"
    capture_safe = True

    def supports(self, head_dim: int, v_head_dim: int) -> bool:
        return head_dim >= 64 and v_head_dim == head_dim


def test_auto_passes_over_an_implementation_that_does_not_take_the_head_dims(monkeypatch):
    from fullcg.ops import impl as impls

    register_implementation(_WideOnly())
    monkeypatch.setattr(impls, "_auto_names", lambda device_type: ("wide_only", "reference"))
    assert impls.resolve_implementation("auto", torch.device("cpu"), 128, 128).name == "wide_only"
    assert impls.resolve_implementation("auto", torch.device("cpu"), 16, 16).name == "reference"
    assert impls.resolve_implementation("auto", torch.device("cpu")).name == "wide_only", "any head dim"
    assert impls.resolve_implementation("wide_only", torch.device("cpu"), 16, 16).name == "wide_only", "asked by name"


def test_captured_and_bridged_pieces_pass_through_inside_a_full_graph_step():
    # The full variant runs the piecewise variant's pieces inside one CUDA graph: there a
    # piece must neither capture a graph of its own nor copy outputs into per-size bridges.
    from fullcg.context import derived_context

    calls = []
    piece = cudagraph.CapturedPiece("submod_0", lambda x: calls.append(x) or (x + 1,), torch.device("cpu"), None, False)
    bridge = cudagraph.BridgedPiece("submod_1", lambda x: (x * 2,))
    x = torch.ones(4)
    md = make_batch([1], [3]).metadata
    with fullcg.forward_context(md, {}) as user:
        with derived_context(user, config=fullcg.FullCGConfig(), variant="full", padded_size=8):
            assert torch.equal(piece(x)[0], x + 1) and len(calls) == 1 and not piece.graphs
            out = bridge(x)
            assert torch.equal(out[0], x * 2) and not bridge.bridges
        with derived_context(user, config=fullcg.FullCGConfig(), variant="piecewise", padded_size=8):
            bridged = bridge(x)
            assert set(bridge.bridges) == {8}, "a piecewise step copies a split point's outputs into the size's bridge"
            assert bridged is bridge.bridges[8]


def test_a_capture_request_no_runner_took_does_not_outlive_the_capture_call():
    # fullcg.capture on something that is not a capturing runner (any model on the CPU, a
    # plain function) must not leave its request to the next model the thread steps: that
    # model would capture every size at its first step.
    from fullcg.models.llama import LlamaConfig, LlamaModel
    from fullcg.runner import _take_capture_request

    model = LlamaModel(LlamaConfig.tiny())
    model.allocate_kv_cache(8, 4)
    md = fullcg.AttentionMetadata.build([2], [0], torch.zeros(1, 1, dtype=torch.int32), 4)
    with torch.inference_mode():
        fullcg.capture(model, md, model, torch.tensor([3, 4]), torch.arange(2))
    assert not _take_capture_request()


class _RecordingGraph:
    """Stands in for a captured CUDA graph: records the forward context its replays see."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def replay(self) -> None:
        self.seen.append(fullcg.context.current_context())


@pytest.mark.parametrize("plans", [False, True], ids=["nothing-to-plan", "host-side-plans"])
def test_a_full_replay_enters_a_context_only_for_implementations_that_plan(plans):
    """A replay runs no Python inside the graph: without a host-side plan to make, it just
    refills the static buffers and replays; a planning implementation gets a context whose
    metadata is those buffers."""
    planned: list[object] = []

    class Planner(AttentionImpl):
        name = "planner-stub"

        def plan(self, ctx):
            planned.append(ctx)

    config = fullcg.FullCGConfig(attention_impl="reference", graph_mode="full", capture_sizes=(4,))
    step = runner.StepRunner(config, piecewise=None, full=lambda *a: a, device=torch.device("cpu"))
    b = make_batch([1, 1], [3, 5])
    graph = _RecordingGraph()
    key = (4, True)
    step.full_graphs[key] = cudagraph.Captured(graph, "out", ())
    step._planners[key] = (Planner(),) if plans else ()
    with fullcg.forward_context(b.metadata, b.layer) as user:
        assert step._replay_full(user, [], 4) == "out"
    static = step.static_metadata[4]
    assert static.num_tokens.item() == 2, "the buffers hold the batch"
    if plans:
        (ctx,) = planned
        assert graph.seen == [ctx] and ctx.metadata.page_table is static.page_table and ctx.variant == "full"
    else:
        assert graph.seen == [user], "the caller's context, no derived one"
