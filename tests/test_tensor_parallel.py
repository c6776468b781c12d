"""Tensor parallelism on the CPU (gloo, two processes): a sharded Llama equals the
single-device one in every graph mode, ``fullcg::all_reduce`` stays inside compiled
pieces, and a rank that fails makes every rank fail instead of hanging."""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue as queue_module
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fullcg
from fullcg.distributed import (
    ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TensorParallel, tp_rank, tp_size,
)
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2
SEED = 3
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7], list(range(20, 33))]


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the sharded model against the single-device one."""

    id: str
    compile: dict[str, str] | None  # fullcg.compile options; None: the model run eagerly
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # LlamaConfig changes


CASES = [
    Case("eager", None),
    Case("compiler-none", {"compiler": "none"}),
    *(Case(mode, {"compiler": "eager", "graph_mode": mode}) for mode in ("piecewise", "full", "full_and_piecewise", "auto")),
    # One KV head for two ranks: replicated, each rank keeping it; sinks split by query head.
    Case("replicated-kv-sinks-eager", None, {"num_kv_heads": 1, "attention_sinks": True}),
    Case("replicated-kv-sinks-piecewise", {"compiler": "eager", "graph_mode": "piecewise"},
         {"num_kv_heads": 1, "attention_sinks": True}),
    Case("chunked-prefix-piecewise", {"compiler": "eager", "graph_mode": "piecewise"}, {"chunked_prefix": True}),
]


# --- what each rank runs ------------------------------------------------------------------


def _init(rank: int, init_file: str, timeout_s: float) -> TensorParallel:
    torch.set_num_threads(1)  # two processes on two cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallel()


def _run_case(case: Case, tp: TensorParallel) -> dict[str, Any]:
    """Steps of the sharded model against the single-device one (built here from the same
    seed); the failures per step (never raised mid-run: the other rank would wait in a
    collective), the forward modes covered and the local head counts."""
    torch._dynamo.reset()
    cfg = LlamaConfig.tiny(**case.model)
    reference = LlamaModel(cfg, seed=SEED)
    model = LlamaModel(cfg, seed=SEED, tp=tp)
    for m in (reference, model):
        m.allocate_kv_cache(num_pages=64, page_size=4)
    run = model if case.compile is None else fullcg.compile(model, **case.compile)
    scheds = [Scheduler(PROMPTS, 4, num_pages=64, page_size=4, prefill_chunk=6, prefix_chunk_tokens=8) for _ in range(2)]
    failures, modes = [], []
    with torch.inference_mode():
        while (step := scheds[0].next_step()) is not None:
            step_tp = scheds[1].next_step()
            with fullcg.forward_context(step.metadata, reference):
                want = reference(step.input_ids, step.positions)
            with fullcg.forward_context(step_tp.metadata, model):
                got = run(step_tp.input_ids, step_tp.positions)
            try:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            except AssertionError as e:
                failures.append(f"step {len(modes)} ({sorted(m.value for m in step.modes)}): {e}")
            modes.append(sorted({m.value for m in step.modes}))
            for s in scheds:  # both follow the reference's tokens
                s.commit(step if s is scheds[0] else step_tp, want)
    attn = model.layers[0].self_attn.attn
    return {"failures": failures, "modes": modes, "heads": (attn.num_heads, attn.num_kv_heads),
            "cache_heads": attn.kv_cache.num_kv_heads}


def _split_of_sharded_model(tp: TensorParallel) -> dict[str, Any]:
    """Where the all-reduce nodes land when the sharded model's Dynamo graph is split."""
    from fullcg.passes import AttributesPass, PassManager, SplitPointsPass, split_graph

    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = LlamaModel(LlamaConfig.tiny(), seed=SEED, tp=tp)
    model.allocate_kv_cache(8, 4)
    step = Scheduler([[1, 2, 3, 4, 5]], 1, num_pages=8, page_size=4).next_step()
    with fullcg.forward_context(step.metadata, model), torch.inference_mode():
        torch.compile(model, backend=keep)(step.input_ids, step.positions)
    gm = graphs[0]
    PassManager([AttributesPass(fullcg.SkipSoftmaxConfig()), SplitPointsPass()])(gm.graph)
    split = split_graph(gm)
    reduce_op = torch.ops.fullcg.all_reduce.default

    def count(piece):
        return sum(1 for n in piece.graph_module.graph.nodes if n.op == "call_function" and n.target is reduce_op)

    return {
        "pieces": len(split.pieces),
        "breakable": sum(p.breakable for p in split.pieces),
        "reduces_in_compiled": sum(count(p) for p in split.pieces if not p.breakable),
        "reduces_in_breakable": sum(count(p) for p in split.pieces if p.breakable),
    }


def _equivalence_worker(rank: int, init_file: str, queue: Any) -> None:
    results: dict[str, Any] = {}
    try:
        tp = _init(rank, init_file, timeout_s=60)
        results["tp"] = (tp.rank, tp.size, tp_rank(tp), tp_size(tp))
        for case in CASES:
            try:
                results[case.id] = _run_case(case, tp)
            except Exception:
                results[case.id] = {"error": traceback.format_exc()}
        try:
            results["split"] = _split_of_sharded_model(tp)
        except Exception:
            results["split"] = {"error": traceback.format_exc()}
    except Exception:
        results["setup"] = traceback.format_exc()
    finally:
        queue.put((rank, results))
        if dist.is_initialized():
            dist.destroy_process_group()


class _Injected(RuntimeError):
    pass


GROUP_TIMEOUT_S = 3
LINGER_S = 15


def _failing_worker(rank: int, init_file: str, queue: Any, linger: bool) -> None:
    """Rank 1 raises inside a step; with ``linger`` it catches its error and stays alive
    (as a server that logs a failed step might), so rank 0 cannot learn of it from a
    closed connection, only from the group's timeout."""
    tp = _init(rank, init_file, timeout_s=GROUP_TIMEOUT_S)
    model = LlamaModel(LlamaConfig.tiny(), seed=SEED, tp=tp)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    if rank == 1:
        def fail(module, args):
            raise _Injected("rank 1 fails inside the step")

        # After layer 0's all-reduces: rank 0 goes on into layer 1's, which rank 1 never joins.
        model.layers[1].register_forward_pre_hook(fail)
    step = Scheduler(PROMPTS, 1, num_pages=16, page_size=4).next_step()
    start = time.monotonic()
    try:
        with torch.inference_mode(), fullcg.forward_context(step.metadata, model):
            model(step.input_ids, step.positions)
    except Exception as e:
        queue.put((rank, (f"{type(e).__name__}: {str(e)[:300]}", time.monotonic() - start)))
        if linger and rank == 1:
            time.sleep(LINGER_S)
        raise
    queue.put((rank, ("finished the step", time.monotonic() - start)))


def _generate_worker(rank: int, init_file: str, queue: Any) -> None:
    """fullcg.generate on the sharded model, every rank with the same arguments: greedy
    (against the single-device model) and unseeded sampling (each rank would draw its own
    tokens; the first rank's are broadcast)."""
    try:
        tp = _init(rank, init_file, timeout_s=60)
        model = LlamaModel(LlamaConfig.tiny(), seed=SEED, tp=tp)
        model.allocate_kv_cache(num_pages=32, page_size=4)
        reference = LlamaModel(LlamaConfig.tiny(), seed=SEED)
        reference.allocate_kv_cache(num_pages=32, page_size=4)
        kw = dict(max_num_tokens=6, compile=False, progress=False)
        greedy = fullcg.generate(model, PROMPTS, 4, **kw)
        expected = fullcg.generate(reference, PROMPTS, 4, **kw)
        torch.manual_seed(rank)  # a different global generator on every rank
        sampled = fullcg.generate(model, PROMPTS, 4, temperature=1.0, **kw)
        # Skip-softmax counters: each rank counts its own heads' tiles; summed over the group.
        fullcg.reset_skip_softmax_stats()
        skip = fullcg.FullCGConfig(attention_impl="reference", skip_softmax=fullcg.SkipSoftmaxConfig(
            prefill_scale_factor=2.0, tile_q=2, tile_kv=2))
        step = Scheduler(PROMPTS, 1, num_pages=32, page_size=4).next_step()
        with torch.inference_mode(), fullcg.forward_context(step.metadata, model, config=skip):
            model(step.input_ids, step.positions)
        local = {lid: dataclasses.astuple(st) for lid, st in fullcg.skip_softmax_stats().items()}
        summed = {lid: dataclasses.astuple(st) for lid, st in fullcg.skip_softmax_stats(tp).items()}
        queue.put((rank, {"greedy": greedy, "expected": expected, "sampled": sampled, "local": local,
                          "summed": summed}))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


# --- the parent ---------------------------------------------------------------------------


def _run_ranks(
    target: Any, workdir: str, timeout_s: float, *args: Any
) -> tuple[dict[int, Any], list[int | None], list[int]]:
    """Run ``target(rank, init_file, queue, *args)`` on every rank; (messages by rank, exit
    codes, ranks still alive at the deadline, which are killed)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(workdir, "init")
    procs = [ctx.Process(target=target, args=(rank, init_file, queue, *args), daemon=True) for rank in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    messages: dict[int, Any] = {}
    # Read before joining: a child does not exit until what it queued is read.
    while len(messages) < WORLD and time.monotonic() < deadline:
        try:
            rank, message = queue.get(timeout=0.5)
            messages[rank] = message
        except queue_module.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return messages, [p.exitcode for p in procs], hung


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> dict[int, dict[str, Any]]:
    messages, exitcodes, hung = _run_ranks(_equivalence_worker, str(tmp_path_factory.mktemp("tp")), timeout_s=240)
    assert not hung, f"ranks {hung} still ran after 240 s (killed); exit codes {exitcodes}"
    assert sorted(messages) == list(range(WORLD)), f"results only from ranks {sorted(messages)}; exit codes {exitcodes}"
    for rank, results in messages.items():
        assert "setup" not in results, f"rank {rank} failed to start:\n{results['setup']}"
    return messages


def test_ranks_see_the_group(tp_results):
    assert [tp_results[r]["tp"] for r in range(WORLD)] == [(r, WORLD, r, WORLD) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sharded_logits_equal_single_device_logits(tp_results, case):
    cfg = LlamaConfig.tiny(**case.model)
    for rank in range(WORLD):
        result = tp_results[rank][case.id]
        assert "error" not in result, f"rank {rank} raised:\n{result['error']}"
        assert not result["failures"], f"rank {rank}:\n" + "\n".join(result["failures"])
        modes = result["modes"]
        assert ["prefill"] in modes and ["decode"] in modes, modes
        assert any(len(m) > 1 for m in modes), f"the run must cover a mixed batch: {modes}"
        assert any("extend" in m for m in modes), f"the run must cover chunked prefill: {modes}"
        local_kv = max(1, cfg.num_kv_heads // WORLD)
        assert result["heads"] == (cfg.num_heads // WORLD, local_kv)
        assert result["cache_heads"] == local_kv, "each rank's KV cache holds its own KV heads only"


def test_all_reduce_stays_inside_compiled_pieces(tp_results):
    layers = LlamaConfig.tiny().num_layers
    for rank in range(WORLD):
        split = tp_results[rank]["split"]
        assert "error" not in split, f"rank {rank} raised:\n{split['error']}"
        # Two all-reduces per layer (o_proj, down_proj), all in compiled pieces; the split
        # points are the attention calls alone, as without tensor parallelism.
        assert split["reduces_in_compiled"] == 2 * layers and split["reduces_in_breakable"] == 0, split
        assert split["breakable"] == layers and split["pieces"] == 2 * layers + 1, split


@pytest.mark.parametrize("linger", [False, True], ids=["failing-rank-exits", "failing-rank-lingers"])
def test_a_rank_that_raises_makes_every_rank_raise(tmp_path, linger):
    messages, exitcodes, hung = _run_ranks(_failing_worker, str(tmp_path), 90, linger)
    assert not hung, f"ranks {hung} hung (killed after 90 s); messages {messages}"
    assert all(code not in (0, None) for code in exitcodes), f"exit codes {exitcodes}; messages {messages}"
    assert 1 in messages and "_Injected" in messages[1][0], messages
    assert 0 in messages and "finished" not in messages[0][0], messages
    if linger:
        # The group's timeout, not the failing rank's exit, ended rank 0's step.
        assert messages[0][1] < GROUP_TIMEOUT_S + 8 < LINGER_S, messages


# --- the op and the modules, in this process -----------------------------------------------


def test_all_reduce_is_not_a_split_point():
    from fullcg.passes.split import is_split_target

    assert not is_split_target(torch.ops.fullcg.all_reduce.default)
    assert not is_split_target(torch.ops.fullcg.all_reduce)


def test_all_reduce_fake_has_the_input_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for x in (torch.empty(5, 7), torch.empty(3, 4, dtype=torch.bfloat16), torch.empty(4, 6).t()):
            y = torch.ops.fullcg.all_reduce.default(x, "any")
            assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield TensorParallel()
    finally:
        dist.destroy_process_group()


def test_all_reduce_opcheck_and_out_of_place(one_rank_group):
    name = one_rank_group.group_name
    assert name, "a group of any size is registered by name"
    x = torch.randn(6, 8)
    torch.library.opcheck(torch.ops.fullcg.all_reduce.default, (x, name))
    before = x.clone()
    y = torch.ops.fullcg.all_reduce.default(x, name)
    assert y.data_ptr() != x.data_ptr() and torch.equal(x, before) and torch.equal(y, x)


def test_all_reduce_of_an_unknown_group_names_the_fix():
    with pytest.raises(RuntimeError, match="no tensor-parallel group named 'nope'.*TensorParallel"):
        torch.ops.fullcg.all_reduce.default(torch.ones(2), "nope")


def test_size_one_needs_no_distributed():
    tp = TensorParallel.single()
    assert (tp.size, tp.rank, tp_size(tp), tp_rank(tp), tp_size(), tp_rank()) == (1, 0, 1, 0, 1, 0)
    x = torch.ones(3)
    assert tp.all_reduce(x) is x
    model = LlamaModel(LlamaConfig.tiny(), tp=tp)
    assert model.tp is None and type(model.layers[0].self_attn.qkv_proj) is torch.nn.Linear
    torch.testing.assert_close(dict(model.state_dict()), dict(LlamaModel(LlamaConfig.tiny()).state_dict()), rtol=0, atol=0)


class _FakeRanks(TensorParallel):
    """A TensorParallel of a given rank and size with no group: enough to build and slice
    the parallel modules in one process (they reduce nothing until run)."""

    def __init__(self, rank: int, size: int) -> None:
        self._set(None, "", rank=rank, size=size)


def test_parallel_linears_slice_full_weights():
    full_w, full_b = torch.randn(12, 8), torch.randn(12)
    parts = []
    for rank in range(2):
        col = ColumnParallelLinear(8, [6, 6], tp=_FakeRanks(rank, 2), bias=True)
        col.load_full(full_w, full_b)
        parts.append(col.weight)
        assert torch.equal(col.bias, torch.cat([full_b[rank * 3 : rank * 3 + 3], full_b[6 + rank * 3 : 9 + rank * 3]]))
    # Section by section: the local output chunks into (gate, up) of the rank.
    assert torch.equal(torch.cat([p[:3] for p in parts]), full_w[:6])
    assert torch.equal(torch.cat([p[3:] for p in parts]), full_w[6:])
    row = RowParallelLinear(8, 5, tp=_FakeRanks(1, 2), bias=True)
    w, b = torch.randn(5, 8), torch.randn(5)
    row.load_full(w, b)
    assert torch.equal(row.weight, w[:, 4:]) and torch.equal(row.bias, b)
    with pytest.raises(ValueError, match=r"the full weight must be \(5, 8\), got \(8, 5\)"):
        row.load_full(w.t(), b)


def test_qkv_keeps_the_kv_heads_its_query_heads_use():
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1.
    for rank in range(4):
        qkv = QKVParallelLinear(16, 2, 8, 2, tp=_FakeRanks(rank, 4))
        kv = rank // 2
        assert (qkv.num_heads, qkv.num_kv_heads, qkv.head_start) == (2, 1, 2 * rank)
        assert qkv.rows == ((4 * rank, 4 * rank + 4), (16 + 2 * kv, 18 + 2 * kv), (20 + 2 * kv, 22 + 2 * kv))


@pytest.mark.parametrize(
    "changes,size,match",
    [
        ({"num_heads": 6, "num_kv_heads": 6}, 4, r"num_heads \(6\) must be divisible by the tensor-parallel size \(4\)"),
        ({"num_heads": 8, "num_kv_heads": 6}, 4, r"num_heads \(8\) must be a multiple of num_kv_heads|num_kv_heads \(6\) must be divisible"),
        ({"num_heads": 6, "num_kv_heads": 2}, 3, r"must be a multiple of num_kv_heads \(2\)"),
        ({"intermediate_size": 130}, 4, r"output section 0 \(130\) must be divisible by the tensor-parallel size \(4\)"),
    ],
)
def test_unshardable_shapes_name_the_fix(changes, size, match):
    with pytest.raises(ValueError, match=match):
        LlamaModel(LlamaConfig.tiny(**changes), tp=_FakeRanks(0, size))


def test_generate_on_a_sharded_model_equals_one_device_every_rank_returns_the_first_ranks_tokens_and_counts_sum(tmp_path):
    messages, exitcodes, hung = _run_ranks(_generate_worker, str(tmp_path), 120)
    assert not hung and sorted(messages) == list(range(WORLD)), (messages, exitcodes)
    for rank in range(WORLD):
        assert "error" not in messages[rank], f"rank {rank} raised:\n{messages[rank]['error']}"
        assert messages[rank]["greedy"] == messages[rank]["expected"]
    assert messages[0]["sampled"] == messages[1]["sampled"], "the first rank samples for every rank"
    local = [messages[r]["local"] for r in range(WORLD)]
    assert local[0] and any(v[0] for v in local[0].values()), "the step counted prefill tiles"
    expected = {lid: tuple(a + b for a, b in zip(local[0][lid], local[1][lid])) for lid in local[0]}
    assert messages[0]["summed"] == messages[1]["summed"] == expected, "skip-softmax counts summed over the ranks"
