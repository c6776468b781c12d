"""The fullcg compile backend: compiled steps equal eager ones in every graph mode."""

from __future__ import annotations

import copy

import pytest
import torch

import fullcg
from fullcg.backend import Backend
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.passes import AttributesPass, PassManager, SplitPointsPass
from batches import side_by_side
from conftest import FULLCG_INSTALLED

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7], list(range(20, 33))]
SKIP = fullcg.SkipSoftmaxConfig(prefill_scale_factor=2.0, decode_scale_factor=1.5, tile_kv=4, tile_q=2)


def _models(chunked_prefix: bool = False, seed: int = 0) -> tuple[LlamaModel, LlamaModel]:
    eager = LlamaModel(LlamaConfig.tiny(chunked_prefix=chunked_prefix), seed=seed)
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        m.allocate_kv_cache(num_pages=64, page_size=4)
    return eager, compiled


def run_side_by_side(eager, compiled_model, compiled_fn, config, *, prefill_chunk=6, max_new_tokens=4):
    """Drive both models through the same steps (prefill, extend, mixed, decode); returns the
    largest logit difference, and the forward modes of every step."""
    return side_by_side(eager, compiled_model, compiled_fn, config, PROMPTS, max_new_tokens=max_new_tokens,
                        prefill_chunk=prefill_chunk, prefix_chunk_tokens=8)


@pytest.mark.parametrize("graph_mode", fullcg.config.GRAPH_MODES)
@pytest.mark.parametrize("chunked_prefix", [False, True], ids=["cache-attention", "chunked-prefix"])
@pytest.mark.parametrize("skip", [None, SKIP], ids=["dense", "skip-softmax"])
def test_compiled_equals_eager_in_every_graph_mode(graph_mode, chunked_prefix, skip):
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(graph_mode=graph_mode, compiler="eager", **({"skip_softmax": skip} if skip else {}))
    eager, comp = _models(chunked_prefix)
    compiled_fn = torch.compile(comp, backend=Backend(config))
    fullcg.reset_skip_softmax_stats()
    worst, modes = run_side_by_side(eager, comp, compiled_fn, config)
    assert worst < 1e-5
    assert {"prefill"} in modes and {"decode"} in modes, "the run must cover prefill and decode-only steps"
    assert any(len(m) > 1 for m in modes), "the run must cover a mixed batch"
    assert any("extend" in m for m in modes), "the run must cover chunked prefill (extend)"
    if skip is not None and not chunked_prefix:  # chunks are too short to skip in a model this small
        assert sum(s.skipped for s in fullcg.skip_softmax_stats().values()) > 0, "skip-softmax must have skipped tiles"


def test_inductor_pieces_equal_eager_with_chunked_prefix_and_skip_softmax():
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(graph_mode="full_and_piecewise", compiler="inductor", skip_softmax=SKIP)
    eager, comp = _models(chunked_prefix=True)
    fullcg.runner.reset_graph_mode_counts()
    worst, _ = run_side_by_side(eager, comp, torch.compile(comp, backend=Backend(config)), config)
    assert worst < 1e-4
    counts = fullcg.runner.graph_mode_counts()
    assert counts["full:eager"] > 0 and counts["piecewise:eager"] > 0, counts


def test_token_counts_1_to_64_compile_once():
    torch._dynamo.reset()
    compiles = []
    backend = Backend(fullcg.FullCGConfig(graph_mode="piecewise", compiler="inductor"))

    def counting(gm, example_inputs, **kwargs):
        compiles.append(gm)
        return backend(gm, example_inputs, **kwargs)

    _, model = _models()
    compiled = torch.compile(model, backend=counting)
    with torch.inference_mode():
        for n in [5, *range(1, 65)]:
            sched = Scheduler([list(range(1, n + 1))], 1, num_pages=64, page_size=4)
            step = sched.next_step()
            with fullcg.forward_context(step.metadata, model):
                compiled(step.input_ids, step.positions)
            for layer in model.attention_layers():  # fresh cache content each time: no state carried over
                layer.kv_cache.k.zero_()
    assert len(compiles) == 1


def test_decode_only_batches_run_the_full_graph_in_full_and_piecewise_mode():
    torch._dynamo.reset()
    fullcg.runner.reset_graph_mode_counts()
    config = fullcg.FullCGConfig(graph_mode="full_and_piecewise", compiler="eager")
    eager, comp = _models()
    _, modes = run_side_by_side(eager, comp, torch.compile(comp, backend=Backend(config)), config)
    counts = fullcg.runner.graph_mode_counts()
    decode_only = sum(1 for m in modes if m == {"decode"})
    assert counts == {"full:eager": decode_only, "piecewise:eager": len(modes) - decode_only}


@pytest.mark.skipif(not FULLCG_INSTALLED, reason="fullcg is not installed here (pip install -e .): its entry point "
                    "is what makes backend='fullcg' known to torch.compile")
def test_the_backend_name_comes_from_the_package_entry_point():
    torch._dynamo.reset()
    assert "fullcg" in torch._dynamo.list_backends(exclude_tags=())
    assert torch._dynamo.lookup_backend("fullcg") is fullcg.backend.fullcg_backend


def test_backend_by_name_reads_options():
    torch._dynamo.reset()
    eager, comp = _models()
    options = {"graph_mode": "piecewise", "compiler": "eager"}
    compiled = torch.compile(comp, backend="fullcg", options=options)
    worst, _ = run_side_by_side(eager, comp, compiled, fullcg.FullCGConfig())
    assert worst < 1e-5


def test_bad_options_name_the_valid_ones():
    torch._dynamo.reset()
    _, comp = _models()
    compiled = torch.compile(comp, backend="fullcg", options={"graph_mod": "full"})
    step = Scheduler([[1, 2]], 1, num_pages=8, page_size=4).next_step()
    with fullcg.forward_context(step.metadata, comp), pytest.raises(Exception, match="unknown fullcg option.*graph_mode"):
        compiled(step.input_ids, step.positions)


def test_torch_compile_modes_are_refused_with_the_alternative():
    backend = Backend()
    with pytest.raises(ValueError, match="options=\\{'graph_mode'"):
        backend(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.zeros(1)], mode="reduce-overhead")


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(graph_mode="fast"), "graph_mode must be one of"),
        (dict(compiler="tvm"), "compiler must be one of"),
        (dict(capture_sizes=[0, 8]), r"capture sizes must be positive integers, got \[0, 8\]"),
        (dict(max_capture_size=0), "max_capture_size must be a positive integer"),
    ],
)
def test_invalid_backend_config(bad, match):
    with pytest.raises(ValueError, match=match):
        fullcg.FullCGConfig(**bad)


def _traced_graph() -> torch.fx.GraphModule:
    """The Dynamo graph of the two-layer tiny model."""
    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, model = _models()
    step = Scheduler([[1, 2, 3]], 1, num_pages=8, page_size=4).next_step()
    with fullcg.forward_context(step.metadata, model), torch.inference_mode():
        torch.compile(model, backend=keep)(step.input_ids, step.positions)
    return graphs[0]


def test_attribute_pass_writes_factors_on_every_attention_node_and_they_key_the_uuid():
    gm = _traced_graph()
    skip = fullcg.SkipSoftmaxConfig(prefill_scale_factor=587.0, decode_scale_factor=16.5)
    manager = PassManager([AttributesPass(skip), SplitPointsPass()])
    manager(gm.graph)
    nodes = fullcg.passes.attention_nodes(gm.graph)
    assert len(nodes) == 2
    from fullcg.passes.attributes import node_attribute

    for node in nodes:
        assert node_attribute(node, "skip_softmax_prefill_scale_factor") == 587.0
        assert node_attribute(node, "skip_softmax_decode_scale_factor") == 16.5
        assert str(node.target) == "fullcg.breakable_attention.default"
    same = PassManager([AttributesPass(fullcg.SkipSoftmaxConfig(587.0, 16.5)), SplitPointsPass()])
    other = PassManager([AttributesPass(fullcg.SkipSoftmaxConfig(587.0, 16.0)), SplitPointsPass()])
    full = PassManager([AttributesPass(skip)])  # no split points
    assert manager.uuid() == same.uuid()
    assert len({manager.uuid(), other.uuid(), full.uuid()}) == 3


def test_dump_dir_holds_graphs_pieces_report_and_decompiled_source(tmp_path):
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(graph_mode="full_and_piecewise", compiler="eager", dump_dir=str(tmp_path))
    eager, comp = _models()
    run_side_by_side(eager, comp, torch.compile(comp, backend=Backend(config)), config)
    graph_dir = next(tmp_path.glob("graph_*"))
    names = {p.relative_to(graph_dir).as_posix() for p in graph_dir.rglob("*.py")} | {"split_report.txt"}
    for expected in ["before_passes.py", "after_passes.py", "decompiled.py",
                     "piecewise/submod_0.py", "piecewise/submod_1.py", "split_report.txt"]:
        assert expected in names, f"{expected} missing from {sorted(names)}"
    report = (graph_dir / "split_report.txt").read_text()
    assert "graph mode: full_and_piecewise" in report and "capture sizes (35)" in report
    assert "variants: piecewise (each piece its own CUDA graph" in report
    assert "full (the same pieces and attention inside one CUDA graph)" in report
    assert report.count("breakable attention (eager, split point)") == 2
    decompiled = (graph_dir / "decompiled.py").read_text()
    assert "def " in decompiled and "__compiled_fn" in decompiled


class _UnusedWork(torch.nn.Module):
    """A model that computes something it never uses, as transformers models do (their
    packed-sequence detection): ``torch.diff`` of the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaModel(LlamaConfig.tiny())
        self.model.allocate_kv_cache(num_pages=64, page_size=4)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        (torch.diff(positions) != 1).cumsum(-1)
        return self.model(input_ids, positions)


def test_unused_computations_are_dropped_but_attention_whose_result_is_unused_stays(tmp_path):
    torch._dynamo.reset()
    module = _UnusedWork()
    config = fullcg.FullCGConfig(graph_mode="full_and_piecewise", compiler="eager", dump_dir=str(tmp_path))
    compiled = fullcg.compile(module, config)
    md = fullcg.AttentionMetadata.build([5], [0], torch.arange(16, dtype=torch.int32)[None], 4)
    ids, pos = torch.arange(5), torch.arange(5)
    with torch.inference_mode(), fullcg.forward_context(md, module.model):
        got = compiled(ids, pos)
    reference = LlamaModel(LlamaConfig.tiny())
    reference.allocate_kv_cache(num_pages=64, page_size=4)
    with torch.inference_mode(), fullcg.forward_context(md, reference):
        torch.testing.assert_close(got, reference(ids, pos))
    graph_dir = next(tmp_path.glob("graph_*"))
    assert "torch.diff" in (graph_dir / "before_passes.py").read_text()
    text = (graph_dir / "after_passes.py").read_text()
    assert "torch.diff" not in text and "cumsum" not in text
    # The attention ops' results are unused (they write their outputs in place); they stay.
    assert text.count("torch.ops.fullcg.") >= 2


def test_pieces_compile_from_the_inputs_dynamo_recorded_without_a_second_fake_run(monkeypatch):
    # A second run over fake inputs would read sizes outside Dynamo's guard suppression
    # (on torch 2.11 that specialized a transformers model's token count).
    import fullcg.backend

    def no_fake_run(self, *args, **kwargs):
        raise AssertionError("the split graph was run again on fake inputs")

    monkeypatch.setattr(fullcg.backend._PieceCompiler, "run", no_fake_run)
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="eager")
    eager, comp = _models()
    worst, _ = run_side_by_side(eager, comp, torch.compile(comp, backend=Backend(config)), config)
    assert worst < 1e-4


class _WritesBuffers(torch.nn.Module):
    """A model whose writes to its own buffers are never read in the step: in-place methods,
    item assignment, ``out=`` and ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaModel(LlamaConfig.tiny())
        self.model.allocate_kv_cache(num_pages=64, page_size=4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(64))
        self.register_buffer("total", torch.zeros(()))
        self.register_buffer("last", torch.zeros(()))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.seen[positions] = 1.0
        torch.add(self.steps, 1.0, out=self.last)
        total = self.total
        total += positions.sum()
        return self.model(input_ids, positions)


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_dead_code_removal_keeps_writes_whose_results_are_unused(graph_mode):
    torch._dynamo.reset()
    module = _WritesBuffers()
    compiled = fullcg.compile(module, compiler="eager", graph_mode=graph_mode)
    md = fullcg.AttentionMetadata.build([5], [0], torch.arange(16, dtype=torch.int32)[None], 4)
    with torch.inference_mode(), fullcg.forward_context(md, module.model):
        compiled(torch.arange(5), torch.arange(5))
    assert module.steps.item() == 1 and module.last.item() == 2
    assert module.seen[:5].tolist() == [1.0] * 5 and module.seen[5:].sum() == 0
    assert module.total.item() == 10
