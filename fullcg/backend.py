"""The ``fullcg`` compile backend: passes, split, compiled pieces, and the step runner.

``torch.compile(model, backend="fullcg")`` (through the ``torch_dynamo_backends`` entry
point) or ``torch.compile(model, backend=fullcg.Backend(config))``. For each graph Dynamo
hands over, the backend retargets attention nodes to the breakable ops, splits the graph
at them and compiles every other piece (Inductor, or eager), each distinct piece once. The
split graph serves both variants the graph mode may run:

- *piecewise*: each piece replays its own CUDA graph, attention runs eagerly between them;
- *full*: the same pieces and attention run inside one CUDA graph;

and the backend returns a :class:`fullcg.runner.StepRunner` that picks a variant per step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

import fullcg.ops  # noqa: F401  (registers torch.ops.fullcg)
from fullcg import compile_cache
from fullcg.compat import lazy_graph_modules, make_graph_module
from fullcg.diagnostics import log_once
from fullcg.frontend import device_of, note_device
from fullcg.ops.attention import EAGER_KERNELS
from fullcg.config import FullCGConfig, GraphMode
from fullcg.errors import ConfigTypeError, FullCGError, InvalidConfigError, through_dynamo
from fullcg.cudagraph import BridgedPiece, CapturedPiece
from fullcg.debug import GraphDump, decompiled_caller_source, split_report
from fullcg.eager_capture import EagerCaptureModel
from fullcg.passes import AttributesPass, PassManager, SplitGraph, SplitPointsPass, split_graph
from fullcg.passes.attributes import resolve_layer_keys
from fullcg.passes.piece_key import piece_key
from fullcg.passes.sibling_linears import FuseSiblingLinearsPass
from fullcg.passes.skinny_linear import SkinnyLinearPass
from fullcg.passes.split import Piece, reads_host_plan
from fullcg.dispatch import CompiledModel
from fullcg.regions import check_region_calls, inline_regions, region_calls
from fullcg.runner import InputStager, PieceCall, StepRunner
from fullcg.telemetry import StepCounts, model_counts

__all__ = ["Backend", "CompiledModel", "compile", "fullcg_backend"]

logger = logging.getLogger(__name__)


class PieceFallbacks(dict):
    """Pieces Inductor failed on, by name, with the error; they run as traced instead.

    ``in_cache_session``: the pieces are compiled inside a compile-cache session, where a
    loaded artifact may be what broke a piece. A piece that fails there is compiled once
    more with the caches off: if that works, the cache was to blame (``cache_blamed``, and
    the entry is discarded); if it fails too, the compiler was, and the piece falls back.
    Only the failing piece is compiled twice, never the whole graph.
    """

    def __init__(self, in_cache_session: bool = False) -> None:
        super().__init__()
        self.in_cache_session = in_cache_session
        self.cache_blamed = False


def _compile_piece(
    name: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], compiler: str, fallbacks: PieceFallbacks
) -> PieceCall:
    if compiler == "eager":
        return PieceCall(name, gm)
    try:
        return _inductor_piece(name, gm, example_inputs)
    except FullCGError:
        raise  # fullcg refused something while Inductor traced: the user's error, not Inductor's
    except Exception as exc:
        error = exc
    if fallbacks.in_cache_session:
        try:
            with compile_cache.uncached_compile():
                call = _inductor_piece(name, gm, example_inputs)
        except FullCGError:
            raise
        except Exception as exc:
            if _error_line(exc) != _error_line(error):
                logger.warning("fullcg: %s failed with the caches on (%s), and again with them off", name, _error_line(error))
            error = exc
        else:
            fallbacks.cache_blamed = True
            logger.warning("fullcg: %s compiled only with the caches off (%s); the cache entry is discarded",
                           name, _error_line(error))
            return call
    if "CantSplit" in _error_line(error):
        call = _retiled_piece(name, gm, example_inputs, error)
        if call is not None:
            return call
    # A compiler bug in one piece (torch 2.11's Inductor cannot tile some reductions over
    # size-oblivious token counts) must not stop the model: that piece runs as traced,
    # still inside CUDA graphs, and the split report names it.
    fallbacks[name] = _error_line(error)
    logger.warning("fullcg: Inductor failed on %s (%s); it runs as traced, without Inductor", name, fallbacks[name])
    return PieceCall(name, gm)


#: Inductor settings tried in turn on a piece Inductor could not tile (``CantSplit``: torch
#: 2.11 fuses a kernel over a symbolic token count whose loops it then cannot split) before
#: the piece runs as traced. Each keeps more of Inductor than running the piece as traced.
TILING_RETRIES: tuple[dict[str, Any], ...] = (
    {"loop_ordering_after_fusion": False},
    {"loop_ordering_after_fusion": False, "split_reductions": False, "triton.persistent_reductions": False},
)


def check_inductor_config(config: FullCGConfig) -> None:
    """Refuse ``config.inductor_config`` names that this torch's Inductor does not have."""
    if not config.inductor_config:
        return
    from fullcg.bytecode import warn_if_uncached

    warn_if_uncached()  # (once a process) before Inductor's config module brings most of torch's compiler
    import torch._inductor.config as inductor_config

    known = getattr(inductor_config, "_config", None)
    unknown = [name for name, _ in config.inductor_config
               if (name not in known if isinstance(known, dict) else not hasattr(inductor_config, name))]
    if unknown:
        raise InvalidConfigError(
            f"inductor_config names settings Inductor (torch {torch.__version__}) does not have: {unknown}; "
            "see torch._inductor.config for the names"
        )


@contextlib.contextmanager
def inductor_settings(config: FullCGConfig) -> Iterator[None]:
    """``config.inductor_config`` in effect inside (the pieces' compiles)."""
    if not config.inductor_config:  # (FullCGConfig allows settings with compiler="inductor" only)
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch(dict(config.inductor_config)):
        yield


def _retiled_piece(name: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   error: BaseException) -> PieceCall | None:
    """``name`` compiled under the first of :data:`TILING_RETRIES` Inductor accepts, or None."""
    import torch._inductor.config as inductor_config

    for settings in TILING_RETRIES:
        try:
            with inductor_config.patch(settings):
                call = _inductor_piece(name, gm, example_inputs)
        except FullCGError:
            raise
        except Exception:
            continue
        logger.warning("fullcg: Inductor could not tile %s (%s); compiled it with Inductor settings %s",
                       name, _error_line(error), settings)
        return call
    return None


def _error_line(exc: BaseException) -> str:
    """``Type: first line of the message``, as logs and the split report show an error."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _inductor_piece(name: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PieceCall:
    from torch._inductor.compile_fx import compile_fx

    from fullcg.passes.residual_addmm import residual_addmm_split

    # Inductor wants graphs that return a tuple; a piece that returns one value is
    # compiled returning (value,) and unwrapped at call time.
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    single = not isinstance(output.args[0], (tuple, list))
    if single:
        gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        output.args = ((output.args[0],),)
        gm.recompile()
    # compile_fx called like this returns a plain (unboxed) callable, whatever its
    # copied-over `_boxed_call` attribute says.
    with residual_addmm_split():
        compiled = compile_fx(gm, list(example_inputs))
    return PieceCall(name, compiled, unwrap_single=single)


def _eager_split_point(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """A split point's code, calling fullcg ops' Python kernels directly (no dispatcher, no
    ``nn.Module.__call__``): it runs eagerly between pieces on every step of every layer."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in EAGER_KERNELS:
            node.target = EAGER_KERNELS[node.target]
    return torch.fx.GraphModule(gm, graph).forward


class _PieceCompiler(torch.fx.Interpreter):
    """Compiles each non-breakable piece of the split graph with the (symbolic) inputs it
    receives: those Dynamo recorded on the piece's placeholders, or else (a placeholder
    without them) the ones a run of the split graph on fake inputs produces."""

    def __init__(
        self, split: SplitGraph, compiler: str, dump: GraphDump, fallbacks: PieceFallbacks
    ) -> None:
        super().__init__(split.graph_module)
        self.split = split
        self.compiler = compiler
        self.fallbacks = fallbacks
        self.dump = dump
        self.calls: dict[str, PieceCall] = {}
        #: For a compiled piece that reuses another's compilation: the name of that piece.
        self.shared_with: dict[str, str] = {}
        self._compiled: dict[str, PieceCall] = {}  # piece_key -> the first piece compiled with it

    def compile_all(self, fake_mode: Any, example_inputs: Sequence[Any]) -> None:
        recorded = [_recorded_inputs(piece.graph_module) for piece in self.split.pieces]
        if all(args is not None for args in recorded):
            # No second run over fake inputs: it would evaluate sizes outside Dynamo's
            # guard suppression (torch 2.11's matmul and diff read them as ints) and
            # specialize the token count.
            for piece, args in zip(self.split.pieces, recorded):
                self._compile(piece, args)
            return
        with fake_mode:
            self.run(*_fake_inputs(fake_mode, example_inputs))

    def call_module(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._compile(next(p for p in self.split.pieces if p.name == target), args)
        return super().call_module(target, args, kwargs)

    def _compile(self, piece: Piece, args: Sequence[Any]) -> None:
        target = piece.name
        self.dump.graph(f"piecewise/{piece.name}.py", piece.graph_module)
        if piece.breakable:
            self.calls[target] = PieceCall(target, _eager_split_point(piece.graph_module))
            return
        # The layers' pieces are one graph on different weights (weights are inputs):
        # compile the first, and let the identical others call its artifact.
        key = piece_key(piece.graph_module, args)
        first = self._compiled.get(key)
        if first is None:
            first = self._compiled[key] = _compile_piece(target, piece.graph_module, args, self.compiler, self.fallbacks)
        else:
            self.shared_with[target] = first.name
        self.calls[target] = PieceCall(target, first.fn, unwrap_single=first.unwrap_single)


def _recorded_inputs(gm: torch.fx.GraphModule) -> list[Any] | None:
    """The example values Dynamo recorded for ``gm``'s inputs, or None if one lacks them."""
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if value is None:
            return None
        values.append(value)
    return values


def _fake_inputs(fake_mode: Any, example_inputs: Sequence[Any]) -> list[Any]:
    """Fake versions of the inputs; inside Dynamo's tracing context they keep their symbolic sizes."""
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


def _token_layout(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: FullCGConfig, device: torch.device
) -> tuple[InputStager | None, tuple[bool, ...] | None]:
    """Which inputs and outputs carry the (symbolic) token dimension, which token counts
    the graph serves, and (when it will be captured) persistent buffers for the inputs,
    sized for the largest capture size."""
    captures = device.type == "cuda" and config.graph_mode is not GraphMode.NONE
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    token_args, size_args, buffers = [], [], {}
    for i, (node, real) in enumerate(zip(placeholders, example_inputs)):
        fake = node.meta.get("example_value")
        if isinstance(real, torch.SymInt) or isinstance(fake, torch.SymInt):
            size_args.append(i)
        elif isinstance(fake, torch.Tensor) and fake.dim() >= 1 and isinstance(fake.shape[0], torch.SymInt):
            if any(isinstance(d, torch.SymInt) for d in fake.shape[1:]):
                return None, None  # more than one dynamic dimension: not a token layout we can pad
            token_args.append(i)
            if captures:
                with torch.inference_mode(False):  # persistent: written by every step, whatever its mode
                    buffers[i] = torch.zeros(
                        (config.sizes_to_capture[-1], *fake.shape[1:]), dtype=fake.dtype, device=real.device
                    )
    if not token_args:
        return None, None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    token_outputs = tuple(
        isinstance(o, torch.fx.Node)
        and isinstance(v := o.meta.get("example_value"), torch.Tensor)
        and v.dim() >= 1
        and isinstance(v.shape[0], torch.SymInt)
        for o in outs
    )
    admits = token_count_guard(placeholders[token_args[0]].meta["example_value"].shape[0])
    sizes = tuple(s for s in config.sizes_to_capture if admits(s)) if captures else ()
    if captures and sizes != config.sizes_to_capture:
        logger.info("fullcg: Dynamo's guards admit this graph at capture sizes %s only (of %s); it is captured at "
                    "those", list(sizes), list(config.sizes_to_capture))
    return InputStager(token_args, size_args, buffers, sizes, admits), token_outputs


def token_count_guard(tokens: torch.SymInt | int) -> Callable[[int], bool]:
    """Whether a graph whose token dimension was traced as ``tokens`` may run at a token
    count: whether the count satisfies every guard on that dimension alone.

    Dynamo routes each step to a graph whose guards hold for it, but the runner pads a
    step to a capture size, and captures every size up front, behind Dynamo's back (and
    :class:`fullcg.dispatch.DirectDispatch` skips Dynamo altogether). The guards tracing
    and Inductor add narrow what a graph serves: traced at two tokens and told ``tokens !=
    1`` (a stride that only matters for one token), it serves 2 and up; the graph Dynamo
    then compiles for a one-token step is guarded to exactly 1 token, and its buffers may
    be sized for one. Running a graph past its guards would run it on a shape it was not
    compiled for. Build it once the graph is compiled, so Inductor's guards count.
    """
    if not isinstance(tokens, torch.SymInt):
        return int(tokens).__eq__
    import sympy  # here, not at import: it costs `import fullcg` about a second and is loaded by now

    env = tokens.node.shape_env
    symbol = env.replacements.get(tokens.node.expr, tokens.node.expr)
    if symbol.is_number:
        return int(symbol).__eq__
    # Guard expressions as recorded (simplifying them against the environment would use
    # the guards themselves as axioms and turn every one of them true).
    conditions = [g.expr.xreplace(env.replacements) for g in env.guards]
    conditions = [c for c in conditions if c.free_symbols == {symbol}]
    bounds = env.var_to_range.get(symbol)

    def admits(count: int) -> bool:
        if bounds is not None and not (bool(bounds.lower <= count) and bool(count <= bounds.upper)):
            return False
        return all(c.xreplace({symbol: sympy.Integer(count)}) != sympy.false for c in conditions)

    return admits


#: Python's in-place operators (``x += y`` traces to ``operator.iadd``) and item assignment.
_IN_PLACE_OPERATORS = frozenset(
    getattr(operator, name) for name in dir(operator)
    if name.startswith("i") and (name[1:] in dir(operator) or name[1:] + "_" in dir(operator))
) | {operator.setitem, operator.delitem}


def _keeps(node: torch.fx.Node) -> bool:
    """Whether dead-code elimination must keep ``node`` although nothing reads its result.

    FX's own test calls a method pure, so it would drop an unused ``cache.index_copy_(...)``
    (a write the model relies on). Only calls that cannot write anything go: no in-place
    method or operator (a trailing ``_``), no ``out=``, no mutable schema, nothing FX
    knows as effectful. fullcg's ops always stay: they write the KV cache and their outputs.
    """
    if node.op not in ("call_function", "call_method") or node.is_impure() or "out" in node.kwargs:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace == "fullcg"
    if target in _IN_PLACE_OPERATORS:
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _graph_after_passes(gm: torch.fx.GraphModule, manager: PassManager) -> torch.fx.GraphModule:
    """A copy of ``gm`` after dead-code removal and ``manager``'s passes, whose Python code is
    generated only if something runs or reads it (:func:`fullcg.compat.lazy_graph_modules`:
    the graph after the passes is never run, its pieces are)."""
    graph = copy.deepcopy(gm.graph)
    # Dynamo leaves unused computations in the graph (a transformers model's packed-sequence
    # detection, for one). Running them again on fake inputs while pieces compile can
    # specialize the token count on torch 2.11 (torch.diff's decomposition reads sizes as
    # ints), so they go before the passes, the split and any compiler see them.
    graph.eliminate_dead_code(is_impure_node=_keeps)
    manager(graph)
    with lazy_graph_modules():
        out = make_graph_module(gm, graph)
    out.meta.update(gm.meta)
    return out


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: FullCGConfig,
                  counts: StepCounts | None = None, *, regions: tuple[int, int] | None = None,
                  keep_source: bool = False) -> StepRunner:
    """Compile ``gm`` as pieces and return a runner over the variants ``config.graph_mode`` needs,
    counting its steps in ``counts`` (the compiled model's; default: counts of its own).
    ``regions``: (layer calls, distinct regions) of a graph whose regions were inlined
    already (a warm start's); by default they are counted, checked and inlined here.

    fullcg compiles inference steps: pieces are compiled and run without autograd. With
    ``keep_source`` (a model that keeps warm-start entries, with the compile cache on), the
    runner's ``source`` holds the graph it was compiled from and its example inputs until
    the entry is written from them (:mod:`fullcg.warm_start`).
    """
    if torch.is_grad_enabled():
        log_once(
            "compiled with autograd", logger, logging.WARNING,
            "fullcg: the model was compiled with autograd enabled; fullcg compiles inference steps and runs "
            "them without recording gradients (wrap steps in torch.inference_mode() to silence this)"
        )
    if regions is None:
        regions = region_calls(gm)
        if regions[0]:
            check_region_calls(gm, list(example_inputs))
            logger.info("fullcg: Dynamo traced %d distinct layer region(s) for %d layer calls", regions[1], regions[0])
        with lazy_graph_modules():  # its code is generated only if something reads it (the compile cache's key)
            gm = inline_regions(gm, make_graph_module)
    resolve_layer_keys(gm, example_inputs)
    runner = _cached_compile(gm, example_inputs, config, counts, regions)
    runner.regions = regions
    if keep_source and config.warm_start and compile_cache.cache_for(config) is not None:
        runner.source = (gm, list(example_inputs))
    return runner


def _cached_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: FullCGConfig,
                    counts: StepCounts | None, regions: tuple[int, int] = (0, 0)) -> StepRunner:
    """:func:`_compile_graph` inside a compile-cache session (when the cache is on), once
    more without any cache if the session fails outside a piece."""
    cache = compile_cache.cache_for(config)
    with torch.no_grad():
        if cache is None:
            return _compile_graph(gm, example_inputs, config, PieceFallbacks(), counts, regions)
        key = cache.key(gm, example_inputs, config, _passes(config).uuid())
        fallbacks = PieceFallbacks(in_cache_session=True)
        try:
            with cache.session(key):
                runner = _compile_graph(gm, example_inputs, config, fallbacks, counts, regions)
        except FullCGError:
            raise  # fullcg refused the graph or its config: no cache is involved
        except Exception as exc:
            # Something in the caches could not be used outside any piece's compile (or the
            # graph cannot be compiled at all): compile once more without any cache; a
            # genuine error raises from there.
            cache.discard(key)
            logger.warning("fullcg: compiling with the compile cache failed (%s: %s); compiling once more without it",
                           type(exc).__name__, exc)
        else:
            if fallbacks.cache_blamed:
                cache.discard(key)  # the next process compiles and stores it afresh
            return runner
        with compile_cache.uncached_compile():
            return _compile_graph(gm, example_inputs, config, PieceFallbacks(), counts, regions)


def _passes(config: FullCGConfig) -> PassManager:
    """The passes every graph goes through before it is split."""
    skinny = [SkinnyLinearPass()] if config.skinny_linears else []
    return PassManager([FuseSiblingLinearsPass(), *skinny, AttributesPass(config.skip_softmax), SplitPointsPass()])


def _compile_graph(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: FullCGConfig, fallbacks: PieceFallbacks,
    counts: StepCounts | None, regions: tuple[int, int] = (0, 0),
) -> StepRunner:
    device = device_of(example_inputs)
    dump = GraphDump(config.dump_dir)
    dump.graph("before_passes.py", gm)
    note_device(device, config, "graphs are compiled")

    # One memory pool for all CUDA graphs of this compiled graph (pieces, sizes, full graphs).
    pool = torch.cuda.graph_pool_handle() if device.type == "cuda" and config.graph_mode is not GraphMode.NONE else None

    # One graph serves both variants: split at its split points (fullcg.passes.split), its pieces compiled.
    # The piecewise variant replays each piece's own CUDA graph with attention eager between
    # them; the full variant runs the same pieces and attention inside one CUDA graph
    # (captured pieces pass through when the step's variant is full).
    manager = _passes(config)
    passed = _graph_after_passes(gm, manager)
    dump.graph("after_passes.py", passed)
    with lazy_graph_modules():
        split = split_graph(passed)
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    compiler = _PieceCompiler(split, config.compiler, dump, fallbacks)
    with inductor_settings(config):
        compiler.compile_all(detect_fake_mode(example_inputs) or FakeTensorMode(), example_inputs)
    runnable = split.graph_module
    for piece in split.pieces:
        call: Any = compiler.calls[piece.name]
        if pool is not None and config.graph_mode.wants_piecewise:
            call = BridgedPiece(piece.name, call) if piece.breakable else CapturedPiece(
                piece.name, call, device, pool, config.debug_graph_inputs
            )
        # A plain attribute, not a child module: the per-step path skips nn.Module.__call__.
        del runnable._modules[piece.name]
        runnable.__dict__[piece.name] = call
    shared_with = compiler.shared_with
    compiled = sum(not p.breakable for p in split.pieces)
    logger.info("fullcg: %d pieces (%d breakable attention, %d compiled pieces of which %d distinct)",
                len(split.pieces), len(split.pieces) - compiled, compiled, compiled - len(shared_with))
    piecewise_fn = runnable if config.graph_mode.wants_piecewise else None
    full_fn = runnable if config.graph_mode.wants_full else None

    report = split_report(config, str(device), manager.uuid(), split, shared_with, fallbacks, regions)
    dump.write("split_report.txt", report)
    stager, token_outputs = _token_layout(gm, example_inputs, config, device)
    runner = StepRunner(
        config, piecewise=piecewise_fn, full=full_fn, device=device, pool=pool, stager=stager,
        token_outputs=token_outputs, counts=counts,
        full_capturable=not any(n.op == "call_function" and reads_host_plan(n.target) for n in gm.graph.nodes),
    )
    runner.report = report
    if dump.enabled:

        def write_decompiled() -> None:
            source = decompiled_caller_source()
            dump.write("decompiled.py", source if source is not None else "# depyf is not installed: pip install fullcg[debug]\n")

        runner.on_first_call = write_decompiled
    return runner


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(FullCGConfig.__dataclass_fields__))
    if unknown:
        raise InvalidConfigError(
            f"unknown fullcg option(s) {unknown}; valid options: {sorted(FullCGConfig.__dataclass_fields__)}"
        )
    return dict(options)


class Backend:
    """The fullcg compile backend, configured: ``torch.compile(model, backend=fullcg.Backend(config))``.

    ``options={...}`` given to ``torch.compile`` override fields of ``config``.
    """

    def __init__(self, config: FullCGConfig | None = None, **options: Any) -> None:
        base = config if config is not None else FullCGConfig.from_env()
        self.config = base.replace(**_checked_options(options)) if options else base
        check_inductor_config(self.config)
        #: One runner per graph compiled through this backend (each has a ``report``).
        self.runners: list[StepRunner] = []
        #: Steps of every graph compiled through this backend, by how they ran.
        self.counts = model_counts()
        #: Whether runners keep the graph they were compiled from for a warm-start entry
        #: (set by ``fullcg.compile``, whose direct dispatch writes the entries).
        self.keep_sources = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> StepRunner:
        try:
            return self._compile(gm, example_inputs, **kwargs)
        except FullCGError as e:
            # Dynamo would wrap it in BackendCompilerFailed; the user's first line is ours instead.
            raise through_dynamo(e) from None

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> StepRunner:
        options = kwargs.pop("options", None)
        mode = kwargs.pop("mode", None)
        if kwargs:
            raise ConfigTypeError(f"the fullcg backend got unexpected arguments {sorted(kwargs)}")
        if mode not in (None, "default"):
            raise InvalidConfigError(
                f"torch.compile(mode={mode!r}) does not apply to the fullcg backend; "
                "choose CUDA-graph behaviour with options={'graph_mode': ...}"
            )
        config = self.config
        if options:
            config = config.replace(**_checked_options(options))
            check_inductor_config(config)
        if config.compiler == "none":
            raise InvalidConfigError(
                "compiler='none' runs the model without torch.compile, so the fullcg compile backend cannot take it: "
                "use fullcg.compile(model, compiler=\"none\") instead of torch.compile(model, backend=...)"
            )
        runner = compile_graph(gm, example_inputs, config, self.counts, keep_source=self.keep_sources)
        self.runners.append(runner)
        return runner


def fullcg_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> StepRunner:
    """The backend behind ``backend="fullcg"``: configured from the environment and ``options``."""
    try:
        backend = Backend()  # reads FULLCG_* variables: a bad one is the user's error, not the backend's
    except FullCGError as e:
        raise through_dynamo(e) from None
    return backend(gm, example_inputs, **kwargs)


def compile(
    model: torch.nn.Module, config: FullCGConfig | None = None, **options: Any
) -> CompiledModel | EagerCaptureModel:
    """``torch.compile(model, backend=fullcg.Backend(config, **options))`` with the token
    dimension (dimension 0 of every tensor argument) dynamic from the first step.

    Plain ``torch.compile(model, backend="fullcg")`` works too; then Dynamo specialises the
    first step's token count and compiles again at the second (or the caller marks
    dimension 0 dynamic with ``torch._dynamo.mark_dynamic``).

    With ``compiler="none"`` (an option, the config's field or ``FULLCG_COMPILER``) nothing
    is compiled: the model runs eagerly, with the same graph modes, padding and counters,
    and is captured as it runs (:class:`fullcg.eager_capture.EagerCaptureModel`).
    """
    base = config if config is not None else FullCGConfig.from_env()
    config = base.replace(**_checked_options(options)) if options else base
    if config.compiler == "none":
        return EagerCaptureModel(model, config)
    return CompiledModel(model, Backend(config))
