"""compiler="none": the model runs eagerly (no Dynamo, no Inductor) and is captured as it runs.

On the CPU every step runs eagerly, counted as the runner counts compiled steps. With
emulated graphs (``emulated_graphs.py``: replays re-run the recorded ops on the tensors of
the capture, so anything not staged or bridged replays stale) the segment logic runs on
the CPU too: piecewise steps are captured in segments between breakable ops and replayed.
On a GPU (``-m cuda``) the same checks run with real CUDA graphs.
"""

from __future__ import annotations

import collections
import copy
import importlib.util

import pytest
import torch

import fullcg
from fullcg import errors
from fullcg.context import num_prefix_chunks
from fullcg.eager_capture import EagerCaptureModel, SegmentedGraph
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel
from batches import cuda_side_by_side, side_by_side
from emulated_graphs import EmulatedGraphs
from serving import ServingLoop, play_side_by_side

MODES = ["piecewise", "full", "full_and_piecewise", "auto"]
SIZES = (1, 2, 4, 8, 16)  # the serving loop's steps reach 24 tokens: some run uncaptured
PROMPTS = [list(range(3, 20)), [40, 41], list(range(50, 61)), [7] * 6]


def _pair(loop: ServingLoop | None = None, *, chunked: bool = False) -> tuple[LlamaModel, LlamaModel]:
    """An eager model and an identical copy with its own KV cache."""
    eager = LlamaModel(LlamaConfig.tiny(chunked_prefix=chunked), seed=0)
    model = copy.deepcopy(eager)
    pages, page = (loop.num_pages, loop.page_size) if loop is not None else (64, 4)
    for m in (eager, model):
        m.allocate_kv_cache(num_pages=pages, page_size=page)
    return eager, model


def _play(loop: ServingLoop, eager: torch.nn.Module, model: torch.nn.Module, run, config) -> list:
    """Every step of ``loop`` through ``eager`` and ``run``; their logits must agree (fp32)."""
    return play_side_by_side(loop, eager, model, run, config, atol=1e-5)


def _expected_counts(steps: list[fullcg.AttentionMetadata], mode: str, captures: bool) -> collections.Counter:
    """How the runner counts each step with the reference implementation (never captured
    in a full graph): the variant by the graph mode's policy, captured when the step fits."""
    counts: collections.Counter = collections.Counter()
    for md in steps:
        if mode == "full" or (mode == "full_and_piecewise" and md.is_decode_only):
            counts["full:eager"] += 1
        else:
            fits = captures and md.num_tokens <= SIZES[-1]
            counts["piecewise:captured" if fits else "piecewise:eager"] += 1
    return counts


def _emulated(model, config) -> tuple[EagerCaptureModel, list[EmulatedGraphs]]:
    made: list[EmulatedGraphs] = []

    def graphs(device: torch.device) -> EmulatedGraphs:
        made.append(EmulatedGraphs(device))
        return made[-1]

    return EagerCaptureModel(model, config, graphs=graphs), made


# ---------------------------------------------------------------------------------- the API


def test_fullcg_compile_with_compiler_none_runs_neither_dynamo_nor_inductor(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiler='none' called torch.compile")

    monkeypatch.setattr(torch, "compile", no_compile)
    torch._dynamo.utils.counters.clear()
    eager, model = _pair()
    run = fullcg.compile(model, compiler="none", graph_mode="full_and_piecewise")
    assert isinstance(run, EagerCaptureModel) and run.config.compiler == "none"
    assert repr(run) == "fullcg.compile(LlamaModel, compiler=none, graph_mode=full_and_piecewise)"
    config = run.config
    worst, _ = side_by_side(eager, model, run, config, PROMPTS, max_new_tokens=3, prefill_chunk=5)
    assert worst <= 1e-5
    assert not torch._dynamo.utils.counters["frames"], "Dynamo traced a frame"
    assert len(run.runners) == 1 and "compiler: none" in run.runners[0].report


def test_the_compiler_can_come_from_the_config_or_the_environment(monkeypatch):
    assert isinstance(fullcg.compile(torch.nn.Linear(2, 2), fullcg.FullCGConfig(compiler="none")), EagerCaptureModel)
    monkeypatch.setenv("FULLCG_COMPILER", "none")
    assert fullcg.FullCGConfig.from_env().compiler == "none"
    assert isinstance(fullcg.compile(torch.nn.Linear(2, 2)), EagerCaptureModel)
    assert isinstance(fullcg.compile(torch.nn.Linear(2, 2), compiler="eager"), fullcg.CompiledModel), "options win"
    with pytest.raises(errors.InvalidConfigError, match=r"^compiler must be one of inductor, eager, none, got 'tvm'"):
        fullcg.FullCGConfig(compiler="tvm")
    with pytest.raises(errors.InvalidConfigError, match=r"^unknown fullcg option\(s\) \['graph_mod'\]"):
        fullcg.compile(torch.nn.Linear(2, 2), compiler="none", graph_mod="full")


def _step(model, run, query_lens=(3,), prefix_lens=(0,), table=((0,),)):
    md = fullcg.AttentionMetadata.build(list(query_lens), list(prefix_lens), torch.tensor(table, dtype=torch.int32), 4)
    positions = torch.cat([torch.arange(p, p + q) for q, p in zip(query_lens, prefix_lens)])
    with torch.inference_mode(), fullcg.forward_context(md, model):
        return run(torch.arange(sum(query_lens)) % 200, positions)


@pytest.mark.parametrize("how", ["backend", "options", "environment"])
def test_torch_compile_refuses_compiler_none_and_names_fullcg_compile(how, monkeypatch):
    torch._dynamo.reset()
    _, model = _pair()
    before = model.attention_layers()[0].kv_cache.k.clone()
    if how == "backend":
        run = torch.compile(model, backend=fullcg.Backend(compiler="none"))
    elif how == "options":
        run = torch.compile(model, backend="fullcg", options={"compiler": "none"})
    else:
        monkeypatch.setenv("FULLCG_COMPILER", "none")
        run = torch.compile(model, backend="fullcg")
    with pytest.raises(errors.InvalidConfigError) as e:
        _step(model, run)
    first = str(e.value).splitlines()[0]
    assert first.startswith("compiler='none' runs the model without torch.compile")
    assert 'fullcg.compile(model, compiler="none")' in first
    assert torch.equal(model.attention_layers()[0].kv_cache.k, before)


# ------------------------------------------------------------- the CPU: every step eager


@pytest.mark.parametrize("mode", MODES)
def test_every_step_matches_eager_and_is_counted_as_the_compiled_path_counts_it(mode):
    loop = ServingLoop(seed=1, num_steps=40)
    eager, model = _pair(loop)
    config = fullcg.FullCGConfig(compiler="none", graph_mode=mode, capture_sizes=SIZES)
    run = fullcg.compile(model, config)
    fullcg.reset_graph_mode_counts()
    steps = _play(loop, eager, model, run, config)
    counts = fullcg.graph_mode_counts()
    assert counts == _expected_counts(steps, mode, captures=False), counts
    assert len(run.runners) == 1

    # The compiled path, same steps: the same counts.
    torch._dynamo.reset()
    eager, model = _pair(loop)
    compiled = fullcg.compile(model, config.replace(compiler="eager"))
    fullcg.reset_graph_mode_counts()
    _play(loop, eager, model, compiled, config)
    assert fullcg.graph_mode_counts() == counts


@pytest.mark.parametrize("mode", MODES)
def test_the_chunked_prefix_pattern_matches_eager(mode):
    eager, model = _pair(chunked=True)
    config = fullcg.FullCGConfig(compiler="none", graph_mode=mode)
    run = fullcg.compile(model, config)
    worst, modes = side_by_side(eager, model, run, config, PROMPTS, max_new_tokens=3, prefill_chunk=5,
                                prefix_chunk_tokens=4)
    assert worst <= 1e-5
    assert any("extend" in m for m in modes)


# ------------------------------------------------ emulated graphs: segments on the CPU


@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked_prefix"])
@pytest.mark.parametrize("mode", MODES)
def test_captured_segments_replay_what_eager_computes_over_changing_batches(mode, chunked):
    loop = ServingLoop(seed=3, num_steps=50)
    eager, model = _pair(loop, chunked=chunked)
    config = fullcg.FullCGConfig(compiler="none", graph_mode=mode, capture_sizes=SIZES, debug_graph_inputs=True)
    run, made = _emulated(model, config)
    fullcg.reset_graph_mode_counts()
    steps = _play(loop, eager, model, run, config)
    counts = fullcg.graph_mode_counts()
    assert counts == _expected_counts(steps, mode, captures=True), counts
    (graphs,) = made
    (runner,) = run.runners
    if mode == "full":
        assert graphs.captured == graphs.replayed == 0
        return
    segmented = runner.piecewise
    assert isinstance(segmented, SegmentedGraph) and not segmented.per_chunk_plan
    # One capture per padded size, every later step of that size replays its segments.
    replays = collections.Counter()
    for md in steps:
        size = next((s for s in SIZES if s >= md.num_tokens), None)
        if size is not None and runner.choose(md.is_decode_only, size) == "piecewise":
            replays[size] += 1
    assert set(segmented.entries) == set(replays)
    per_size = {size: sum(g is not None for g, _ in e.segments) for size, e in segmented.entries.items()}
    assert graphs.captured == sum(per_size.values())
    assert graphs.replayed == sum((replays[s] - 1) * per_size[s] for s in replays) > 0
    layers = model.cfg.num_layers
    entry = segmented.entries[max(replays)]
    # Segments end at each breakable op: attention (and the merge of prefix chunks).
    assert entry.num_segments == 1 + layers * (2 if chunked else 1)
    # Between attention and the merge a segment only makes views: nothing to capture.
    assert graphs.empty == (len(segmented.entries) * layers if chunked else 0)


def test_a_segment_of_views_and_allocations_is_empty_but_a_converting_to_is_not():
    from fullcg.eager_capture import launches_nothing

    aten = torch.ops.aten
    x = torch.arange(6)
    assert launches_nothing(aten.view.default, (x, [2, 3]), {}, x.view(2, 3))
    assert launches_nothing(aten.empty.memory_format, ([4],), {}, torch.empty(4))
    assert launches_nothing(aten.to.dtype, (x, torch.int64), {}, x.to(torch.int64)), "no conversion: x itself"
    assert not launches_nothing(aten.to.dtype, (x, torch.float32), {}, x.to(torch.float32)), "a view by schema, a copy"
    assert not launches_nothing(aten.add_.Tensor, (x, x), {}, x), "in place: a kernel"


def test_capture_up_front_then_steps_only_replay():
    eager, model = _pair()
    config = fullcg.FullCGConfig(compiler="none", graph_mode="piecewise", capture_sizes=SIZES)
    run, made = _emulated(model, config)
    step = Scheduler([[1, 2, 3]], 1, num_pages=64, page_size=4).next_step()
    fullcg.reset_graph_mode_counts()
    with torch.inference_mode():
        fullcg.capture(run, step.metadata, model, step.input_ids, step.positions)
    (graphs,) = made
    segmented = run.runners[0].piecewise
    assert set(segmented.entries) == set(SIZES)
    captured = graphs.captured
    for layer in model.attention_layers():  # stand-in batches wrote nothing; start clean anyway
        layer.kv_cache.k.zero_()
        layer.kv_cache.v.zero_()
    worst, _ = side_by_side(eager, model, run, config, [[4, 5, 6, 7, 8], [9, 10]], max_new_tokens=4, prefill_chunk=3)
    assert worst <= 1e-5
    assert graphs.captured == captured, "a step captured again after capture()"
    assert graphs.replayed > 0 and fullcg.graph_mode_counts()["piecewise:captured"] > 0



def test_a_size_whose_full_graph_warmed_the_model_up_is_captured_in_pieces_without_another_warm_up():
    # full_and_piecewise captures a size's full graph first (its own warm-up and capture
    # run the same kernels on the same shapes as the pieces hold), then its pieces.
    eager, model = _pair()
    config = fullcg.FullCGConfig(compiler="none", graph_mode="piecewise", capture_sizes=SIZES)
    run, made = _emulated(model, config)
    _step(model, run)  # the first step builds the runner (3 tokens: captures size 4)
    segmented = run.runners[0].piecewise
    assert set(segmented.entries) == {4}
    runs: list[int] = []
    real = segmented.fn

    def counted(*args):
        runs.append(1)
        return real(*args)

    segmented.fn = counted
    segmented.note_warm(8)
    step = Scheduler([[1, 2, 3]], 1, num_pages=64, page_size=4).next_step()
    with torch.inference_mode():
        fullcg.capture(run, step.metadata, model, step.input_ids, step.positions)
    new_sizes = [s for s in SIZES if s != 4]
    assert len(runs) == 2 * len(new_sizes) - 1, "a warm-up and a capture per new size, no warm-up at 8"
    for layer in model.attention_layers():
        layer.kv_cache.k.zero_()
        layer.kv_cache.v.zero_()
    worst, _ = side_by_side(eager, model, run, config, [[4, 5, 6, 7, 8, 9, 10, 11], [9, 10]], max_new_tokens=4,
                            prefill_chunk=8)
    assert worst <= 1e-5


class _ChunkLoopModel(torch.nn.Module):
    """The chunked-prefix pattern written in the model, one gather per prefix chunk: the
    kernels around the gathers depend on the chunk count (Dynamo would trace a graph per count)."""

    def __init__(self, hidden: int = 32, heads: int = 2, head_dim: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads, self.head_dim = heads, head_dim
        self.embed = torch.nn.Parameter(torch.randn(256, hidden, generator=g))
        self.qkv = torch.nn.Parameter(torch.randn(hidden, 3 * heads * head_dim, generator=g) / hidden**0.5)
        self.out = torch.nn.Parameter(torch.randn(heads * head_dim, 256, generator=g) / hidden**0.5)
        self.attn = fullcg.Attention(heads, head_dim, layer_id=0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed[input_ids] + positions[:, None].float() * 1e-3
        q, k, v = (h @ self.qkv).view(-1, 3 * self.heads, self.head_dim).split(self.heads, dim=1)
        out, lse = self.attn(q, k, v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
        for c in range(num_prefix_chunks()):
            k_c, v_c = self.attn.gather_prefix_chunk(c)
            out_c, lse_c = self.attn(q, k_c, v_c, return_lse=True, use_kv_cache=False, causal=False, prefix_chunk=c)
            merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
            fullcg.merge_attn_states(merged, out_c, lse_c, out, lse, merged_lse)
            out, lse = merged, merged_lse
        return out.flatten(1) @ self.out


@pytest.mark.parametrize("mode", ["piecewise", "auto"])
def test_a_model_that_gathers_chunk_by_chunk_is_captured_per_chunk_plan(mode):
    eager = _ChunkLoopModel()
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.attn.allocate_kv_cache(64, 4)
    config = fullcg.FullCGConfig(compiler="none", graph_mode=mode, capture_sizes=SIZES)
    run, made = _emulated(model, config)
    fullcg.reset_graph_mode_counts()
    # 16 prefix rows per request: decode steps bring one chunk, then two, each several times.
    worst, _ = side_by_side(eager, model, run, config, PROMPTS, max_new_tokens=8, prefill_chunk=5,
                            prefix_chunk_tokens=64)
    assert worst <= 1e-5
    runner = run.runners[0]
    assert not runner.full_capturable, "it reads the chunk plan on the host: no full graph"
    segmented = runner.piecewise
    assert segmented.per_chunk_plan
    chunk_counts = {key[1] for key in segmented.entries}
    assert len(chunk_counts) > 1, f"the steps should bring several chunk counts, got {segmented.entries.keys()}"
    assert made[0].replayed > 0
    counts = fullcg.graph_mode_counts()
    assert counts["piecewise:captured"] > 0 and not counts["full:eager"], counts


# ----------------------------------------------------------------------- bad inputs


def test_a_batch_past_the_cache_is_refused_before_the_step_as_in_the_compiled_path():
    _, model = _pair()
    run = fullcg.compile(model, compiler="none", graph_mode="piecewise")
    _step(model, run)
    before = model.attention_layers()[0].kv_cache.k.clone()
    with pytest.raises(errors.PageOutOfRangeError, match=r"^request 0 reads or writes page 10000"):
        _step(model, run, table=((10_000,),))
    assert torch.equal(model.attention_layers()[0].kv_cache.k, before)


class _BadAttention(torch.nn.Module):
    """Attention told that more key rows are valid than it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = fullcg.Attention(2, 8, layer_id=0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = torch.ones(input_ids.shape[0], 2, 8) * positions[:, None, None]
        return self.attn(x, x, x, use_kv_cache=False, save_kv_cache=False, key_value_num_tokens=10_000)


@pytest.mark.parametrize("compiler", ["none", "eager"])
def test_the_first_step_checks_attention_calls_as_tracing_does(compiler):
    torch._dynamo.reset()
    model = _BadAttention()
    model.attn.allocate_kv_cache(8, 4)
    run = fullcg.compile(model, compiler=compiler, graph_mode="piecewise")
    with pytest.raises(Exception, match=r"key_value_num_tokens must lie in \[0, \w+\] \(rows of k/v\), got 10000"):
        _step(model, run)


def test_arguments_a_captured_graph_cannot_follow_are_refused():
    _, model = _pair()
    run = fullcg.compile(model, compiler="none")
    with pytest.raises(TypeError, match="argument 1 is a 0-d tensor"):
        _step(model, lambda ids, pos: run(ids, torch.tensor(0)))
    with pytest.raises(TypeError, match="non-tensor arguments must be hashable constants"):
        _step(model, lambda ids, pos: run(ids, pos, [1, 2]))
    with pytest.raises(TypeError, match=r"argument 1 holds tensors in a tuple.*an argument of its own"):
        _step(model, lambda ids, pos: run(ids, (pos,)))


def test_a_new_kv_cache_gets_a_runner_of_its_own():
    _, model = _pair()
    run = fullcg.compile(model, compiler="none")
    _step(model, run)
    _step(model, run)
    assert len(run.runners) == 1
    model.allocate_kv_cache(num_pages=64, page_size=4)  # new caches, new addresses
    _step(model, run)
    assert len(run.runners) == 2


# ------------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)")
IMPLS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


def _cuda_pair(chunked: bool = False) -> tuple[LlamaModel, LlamaModel]:
    # Head dim 64: FlashInfer has no kernels for the tiny model's 16.
    eager = LlamaModel(LlamaConfig.tiny(chunked_prefix=chunked, head_dim=64), seed=0, dtype=torch.bfloat16,
                       device="cuda")
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.allocate_kv_cache(num_pages=128, page_size=16)
    return eager, model


def _cuda_run(eager, model, run, config, *, prefill_chunk: int = 16) -> tuple[float, int]:
    return cuda_side_by_side(eager, model, run, config, PROMPTS, prefill_chunk=prefill_chunk)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked_prefix"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graphs_without_a_compiler_match_eager(mode, impl, chunked):
    fullcg.reset_graph_mode_counts()
    config = fullcg.FullCGConfig(compiler="none", attention_impl=impl, graph_mode=mode,
                                 capture_sizes=(1, 2, 4, 8, 16, 32, 64), debug_graph_inputs=True)
    eager, model = _cuda_pair(chunked)
    run = fullcg.compile(model, config)
    worst, steps = _cuda_run(eager, model, run, config)
    assert worst < 3e-2, f"relative difference {worst}"
    counts = fullcg.graph_mode_counts()
    assert sum(counts.values()) == steps, counts
    if chunked and mode in ("full", "full_and_piecewise"):
        # The merge of prefix chunks reads the chunk plan on the host: full steps run uncaptured.
        assert counts["full:captured"] == 0, counts
        assert counts["full:eager"] > 0, counts
    else:
        assert sum(v for k, v in counts.items() if k.endswith(":captured")) == steps, counts
    if mode == "full_and_piecewise":
        assert counts["piecewise:captured"] > 0, counts
    if mode == "auto":
        assert counts["piecewise:captured" if chunked else "full:captured"] == steps, counts
    assert len(run.runners) == 1


@pytest.mark.cuda
@needs_cuda
def test_cuda_capture_up_front_then_replay_without_new_captures():
    for mode in ("full_and_piecewise", "piecewise"):
        config = fullcg.FullCGConfig(compiler="none", attention_impl="triton", graph_mode=mode,
                                     capture_sizes=(1, 4, 16, 64))
        eager, model = _cuda_pair()
        run = fullcg.compile(model, config)
        step = Scheduler([[1, 2, 3]], 1, num_pages=128, page_size=16, device="cuda").next_step()
        with torch.inference_mode():
            fullcg.capture(run, step.metadata, model, step.input_ids, step.positions)
        runner = run.runners[0]
        full_before, pieces_before = dict(runner.full_graphs), dict(runner.piecewise.entries)
        # Each size's full graph is captured first; its pieces then need no warm-up of their own.
        assert runner.piecewise.warm_sizes == ({1, 4, 16, 64} if mode == "full_and_piecewise" else set())
        for layer in model.attention_layers():
            layer.kv_cache.k.zero_()
            layer.kv_cache.v.zero_()
        worst, _ = _cuda_run(eager, model, run, config)
        assert worst < 3e-2
        assert runner.full_graphs.keys() == full_before.keys(), "no full graph captured after the up-front one"
        assert runner.piecewise.entries.keys() == pieces_before.keys(), "no segments captured after the up-front ones"



class _FixedKV(torch.nn.Module):
    """Attention over given k/v that claims 6 valid rows, whatever the step's token count."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = fullcg.Attention(2, 8, layer_id=0)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = torch.ones(ids.shape[0], 2, 8) * pos[:, None, None].float()
        return self.attn(x, x, x, use_kv_cache=False, save_kv_cache=False, key_value_num_tokens=6)


def test_uncaptured_steps_check_every_attention_call_as_eager_does():
    model = _FixedKV()
    model.attn.allocate_kv_cache(8, 4)
    run = fullcg.compile(model, compiler="none", graph_mode="piecewise")

    def step(n: int) -> torch.Tensor:
        md = fullcg.AttentionMetadata.build([n], [0], torch.tensor([[0, 1]], dtype=torch.int32), 4)
        with torch.inference_mode(), fullcg.forward_context(md, model):
            return run(torch.arange(n), torch.arange(n))

    step(6)
    with pytest.raises(ValueError, match=r"key_value_num_tokens must lie in \[0, 4\]"):
        step(4)  # k has 4 rows now


class _DictOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = LlamaModel(LlamaConfig.tiny(), seed=0)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.inner(ids, pos)}


def test_a_model_returning_a_dict_is_refused_naming_the_fix():
    # Its padded token rows could not be cut off (the first step probes the outputs where
    # steps may be captured or the policy chooses, as in auto).
    model = _DictOut()
    model.inner.allocate_kv_cache(64, 4)
    run = fullcg.compile(model, compiler="none", graph_mode="auto")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), 4)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        with pytest.raises(TypeError, match="return a tensor or a tuple of tensors"):
            run(torch.tensor([1, 2, 3]), torch.arange(3))


def test_running_without_a_compiler_never_imports_dynamo():
    import subprocess
    import sys

    code = (
        "import sys, torch, fullcg\n"
        "from fullcg.models.llama import LlamaConfig, LlamaModel\n"
        "m = LlamaModel(LlamaConfig.tiny()); m.allocate_kv_cache(64, 16)\n"
        "run = fullcg.compile(m, compiler='none')\n"
        "md = fullcg.AttentionMetadata.build([4], [0], torch.zeros(1, 1, dtype=torch.int32), 16)\n"
        "with torch.inference_mode(), fullcg.forward_context(md, m):\n"
        "    run(torch.tensor([1, 2, 3, 4]), torch.arange(4))\n"
        "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    # sympy (Dynamo's symbolic shapes) alone costs `import fullcg` about a second.
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stderr


def _stats_of_steps(model, run, config) -> dict:
    """Skip-softmax counters after the same steps (prompts, then greedy decodes) through ``run``."""
    fullcg.reset_skip_softmax_stats()
    sched = Scheduler(PROMPTS, 3, num_pages=64, page_size=4, prefill_chunk=5)
    with torch.inference_mode():
        while (step := sched.next_step()) is not None:
            with fullcg.forward_context(step.metadata, model, config=config):
                logits = run(step.input_ids, step.positions)
            sched.commit(step, logits)
    # Layers other tests counted in (zeroed by the reset) are not this model's.
    return {lid: s for lid, s in fullcg.skip_softmax_stats().items() if lid < len(model.attention_layers())}


def test_skip_softmax_counters_count_real_steps_only_not_probes_or_warm_ups():
    skip = fullcg.SkipSoftmaxConfig(prefill_scale_factor=2.0, decode_scale_factor=2.0, tile_kv=4, tile_q=2)
    eager, model = _pair()
    config = fullcg.FullCGConfig(compiler="none", graph_mode="piecewise", capture_sizes=SIZES, skip_softmax=skip)
    expected = _stats_of_steps(eager, eager, config)
    assert expected and all(s.visited for s in expected.values())
    run, made = _emulated(model, config)
    assert _stats_of_steps(model, run, config) == expected
    assert made[0].captured > 0, "steps were captured (a warm-up run each) and replayed"
    auto = fullcg.compile(copy.deepcopy(eager), config.replace(graph_mode="auto"))  # probes stand-in batches
    assert _stats_of_steps(auto.model, auto, config) == expected
