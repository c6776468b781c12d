"""Configuration: :class:`FullCGConfig`, its parts, and reading them from the environment.

Every option is validated when the config is built, so a bad value fails where it was
written, not deep inside a compiled graph. Explicit values always win over environment
variables; :meth:`FullCGConfig.from_env` fills only what the caller left unset.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from fullcg.compat import env_reader
from fullcg.errors import ConfigTypeError, InvalidConfigError

__all__ = [
    "ENV_SKIP_SOFTMAX_PREFILL",
    "ENV_SKIP_SOFTMAX_DECODE",
    "ENV_ATTENTION_IMPL",
    "ENV_GRAPH_MODE",
    "ENV_COMPILER",
    "ENV_DUMP_DIR",
    "ENV_DEBUG_CHECKS",
    "ATTENTION_IMPLS",
    "SkipSoftmaxConfig",
    "FullCGConfig",
    "GRAPH_MODES",
    "GraphMode",
    "COMPILERS",
    "default_capture_sizes",
    "MAX_CAPTURE_SIZE",
]

ENV_SKIP_SOFTMAX_PREFILL = "FULLCG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR"
ENV_SKIP_SOFTMAX_DECODE = "FULLCG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR"
ENV_ATTENTION_IMPL = "FULLCG_ATTENTION_IMPL"
ENV_GRAPH_MODE = "FULLCG_GRAPH_MODE"
ENV_COMPILER = "FULLCG_COMPILER"
ENV_DUMP_DIR = "FULLCG_DUMP_DIR"
ENV_DEBUG_CHECKS = "FULLCG_DEBUG_CHECKS"

class GraphMode(str, enum.Enum):
    """How compiled steps run on CUDA (on the CPU every mode runs without capture).

    A ``str`` enum: ``GraphMode.AUTO == "auto"``, so options may be given as strings.
    """

    #: Compiled pieces, no CUDA graphs.
    NONE = "none"
    #: Pieces captured; breakable attention runs eagerly between them.
    PIECEWISE = "piecewise"
    #: The whole step in one graph, attention inside (uncaptured when the implementation
    #: cannot be captured or the model gathers prefix chunks).
    FULL = "full"
    #: Decode-only batches in one full graph, every other batch piecewise.
    FULL_AND_PIECEWISE = "full_and_piecewise"
    #: The fastest safe path per step: one full graph for decode-only batches and for other
    #: batches of at most ``FullCGConfig.auto_full_max_tokens`` tokens, piecewise for larger
    #: ones (their attention runs with exact grids, which a full graph's worst-case grids
    #: cannot); piecewise for every batch when the attention implementation cannot be
    #: captured or the model gathers prefix chunks on the host. The default.
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    @property
    def wants_piecewise(self) -> bool:
        """Whether this mode builds the piecewise variant of a graph."""
        return self is not GraphMode.FULL

    @property
    def wants_full(self) -> bool:
        """Whether this mode builds the full variant of a graph."""
        return self in (GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE, GraphMode.AUTO)


GRAPH_MODES = tuple(m.value for m in GraphMode)
#: ``none`` runs no ``torch.compile`` at all: only :func:`fullcg.compile` offers it
#: (:mod:`fullcg.eager_capture`); the compile backend refuses it.
COMPILERS = ("inductor", "eager", "none")

#: Names accepted for ``FullCGConfig.attention_impl``; more can be registered at run time
#: with :func:`fullcg.ops.impl.register_implementation`.
ATTENTION_IMPLS = ("auto", "reference", "flashinfer", "triton")

_UNSET: Any = object()


def check_scale_factor(value: object, name: str) -> float | None:
    """Return ``value`` as a finite, non-negative float (or None for dense attention).

    ``name`` is what the error message calls the value (an option or an env variable),
    so the user knows exactly what to fix.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number or None (dense attention), got {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise InvalidConfigError(
            f"{name} must be a finite number >= 0 (None or unset means dense attention), got {value!r}"
        )
    return value


def _per_layer_factors(value: object) -> tuple[tuple[int, float | None, float | None], ...]:
    """``SkipSoftmaxConfig.per_layer`` as sorted ``(layer_id, prefill, decode)`` triples: a
    hashable, comparable value (configs are compared and hashed, and traced code guards on it)."""
    name = "SkipSoftmaxConfig.per_layer"
    if isinstance(value, Mapping):
        items = [(lid, *pair) if isinstance(pair, (tuple, list)) and len(pair) == 2 else (lid, pair)
                 for lid, pair in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in value]
    else:
        raise ConfigTypeError(
            f"{name} must be a dict {{layer_id: (prefill_factor, decode_factor)}}, got {type(value).__name__}"
        )
    out: dict[int, tuple[float | None, float | None]] = {}
    for item in items:
        if len(item) != 3:
            raise ConfigTypeError(
                f"{name}: each layer needs a layer id and a (prefill_factor, decode_factor) pair, got {item!r}"
            )
        lid, prefill, decode = item
        if isinstance(lid, bool) or not isinstance(lid, int) or lid < 0:
            raise InvalidConfigError(f"{name}: layer ids must be integers >= 0, got {lid!r}")
        if lid in out:
            raise InvalidConfigError(f"{name}: layer {lid} is given twice")
        out[lid] = (check_scale_factor(prefill, f"{name}[{lid}] prefill factor"),
                    check_scale_factor(decode, f"{name}[{lid}] decode factor"))
    return tuple((lid, *out[lid]) for lid in sorted(out))


def layer_factors(
    per_layer: tuple[tuple[int, float | None, float | None], ...], layer_id: int,
    default: tuple[float | None, float | None],
) -> tuple[float | None, float | None]:
    """Layer ``layer_id``'s pair in ``per_layer`` triples, else ``default``. A plain loop:
    traced code calls it, and Dynamo guards on the triples as constants."""
    for lid, prefill, decode in per_layer:
        if lid == layer_id:
            return prefill, decode
    return default


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _factor_from_env(var: str, environ: Mapping[str, str]) -> float | None:
    raw = environ.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidConfigError(f"{var} must be a number (or unset for dense attention), got {raw!r}") from None
    return check_scale_factor(value, var)


@dataclasses.dataclass(frozen=True)
class SkipSoftmaxConfig:
    """Skip-softmax (BLASST) sparse attention settings.

    A KV tile is skipped for a block of query rows when, for every row,
    ``exp(sm_scale * (tile_max - running_max)) < scale_factor / kv_len``.

    Attributes:
        prefill_scale_factor: factor for prefill and extend requests; None = dense.
        decode_scale_factor: factor for decode requests; None = dense. Decode factors
            are usually far smaller than prefill ones.
        tile_kv: keys per tile (the unit that is skipped).
        tile_q: query tokens per row block; a block spans these tokens times all query
            heads of one KV head (a GQA group) and shares one skip decision per tile.
        decode_split_tiles: decode kernels split a request's keys into runs of this many
            tiles; the first tile of each run is never skipped. None = no split.
        per_layer: factors for particular layers, overriding the two above there:
            ``{layer_id: (prefill_factor, decode_factor)}`` (either may be None, dense).
            Layers differ: on SmolLM2-135M at 8k context one factor skips under 1% of
            the tiles of some layers and over 80% of others (docs/configuration.md).
            Stored as sorted ``(layer_id, prefill, decode)`` triples;
            :func:`fullcg.calibrate_skip_softmax` chooses them.
    """

    prefill_scale_factor: float | None = None
    decode_scale_factor: float | None = None
    tile_kv: int = 64
    tile_q: int = 16
    decode_split_tiles: int | None = None
    per_layer: Any = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "prefill_scale_factor",
            check_scale_factor(self.prefill_scale_factor, "SkipSoftmaxConfig.prefill_scale_factor"),
        )
        object.__setattr__(
            self,
            "decode_scale_factor",
            check_scale_factor(self.decode_scale_factor, "SkipSoftmaxConfig.decode_scale_factor"),
        )
        _positive_int(self.tile_kv, "SkipSoftmaxConfig.tile_kv")
        _positive_int(self.tile_q, "SkipSoftmaxConfig.tile_q")
        if self.decode_split_tiles is not None:
            _positive_int(self.decode_split_tiles, "SkipSoftmaxConfig.decode_split_tiles")
        object.__setattr__(self, "per_layer", _per_layer_factors(self.per_layer))

    @property
    def enabled(self) -> bool:
        return any(p is not None or d is not None for _, p, d in self.per_layer) or (
            self.prefill_scale_factor is not None or self.decode_scale_factor is not None
        )

    def factors_for(self, layer_id: int) -> tuple[float | None, float | None]:
        """The (prefill, decode) factors of layer ``layer_id``: its own, or the global pair."""
        return layer_factors(self.per_layer, layer_id, (self.prefill_scale_factor, self.decode_scale_factor))

    @classmethod
    def from_env(
        cls,
        prefill_scale_factor: float | None = _UNSET,
        decode_scale_factor: float | None = _UNSET,
        environ: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> SkipSoftmaxConfig:
        """Build from the environment; explicitly passed factors win (even an explicit None)."""
        env = os.environ if environ is None else environ
        if prefill_scale_factor is _UNSET:
            prefill_scale_factor = _factor_from_env(ENV_SKIP_SOFTMAX_PREFILL, env)
        if decode_scale_factor is _UNSET:
            decode_scale_factor = _factor_from_env(ENV_SKIP_SOFTMAX_DECODE, env)
        return cls(prefill_scale_factor, decode_scale_factor, **kwargs)


#: The largest token count a CUDA graph may be captured for. A step this large is
#: compute-bound, so replaying a graph saves nothing measurable, while every capture size
#: costs a capture (seconds) and graph memory, and the persistent input buffers and the
#: static page table of full graphs have one row per token of the largest size. Larger
#: steps run uncaptured (compiled, not replayed).
MAX_CAPTURE_SIZE = 16384


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's default: 1, 2, 4, then steps of 8 up to 256, then steps of 16, up to ``max_size``."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return tuple(s for s in sizes if s <= max_size)


@dataclasses.dataclass(frozen=True)
class FullCGConfig:
    """Everything fullcg can be told.

    Attributes:
        attention_impl: which attention implementation runs the ops: ``"reference"``
            (plain torch), ``"flashinfer"``, ``"triton"``, or ``"auto"`` (the best one
            available for the device; ``reference`` on CPU).
        skip_softmax: skip-softmax factors and tile sizes.
        graph_mode: a :class:`GraphMode` (or its name); on CPU every mode runs without capture.
        compiler: ``"inductor"`` compiles each piece; ``"eager"`` runs pieces as traced
            (fast start, for debugging); ``"none"`` runs no Dynamo and no Inductor: the
            model runs eagerly and is captured as it runs (``fullcg.compile`` only, see
            :mod:`fullcg.eager_capture`).
        capture_sizes: token counts to capture graphs for; batches are padded up to the
            next one. None = :func:`default_capture_sizes` up to ``max_capture_size``.
        max_capture_size: largest default capture size; larger batches run uncaptured.
        capture_on_compile: capture every size right after compiling (else lazily, the
            first time a size is used).
        dump_dir: where to write graph dumps and the split report; None = no dumps.
        debug_graph_inputs: check on every replay that captured pieces read their inputs
            from the addresses they were captured with (a debugging aid; costs host time).
        debug_checks: repeat, on every attention call of a compiled step, the shape, dtype
            and attribute checks that tracing already did once, and send every step of a
            ``fullcg.compile`` model through Dynamo's guards rather than dispatching it
            directly (a debugging aid; costs host time). Uncompiled (eager) calls are
            always checked in full.
        max_pages_per_request: page-table columns that captured full graphs hold for one
            request (its longest prefix plus new tokens, in pages); None = the KV cache's
            page count. A batch with a longer page table runs uncaptured.
        auto_full_max_tokens: under ``graph_mode="auto"``, the most tokens (after padding to
            a capture size) a batch with prefill or extend requests may have to run as a full
            graph; larger ones run piecewise. Decode-only batches always run full. None =
            every batch full.
        compile_cache: keep what compiling produced on disk and load it back in the next
            process (:mod:`fullcg.compile_cache`); off also with ``FULLCG_DISABLE_COMPILE_CACHE=1``.
        cache_dir: where the compile cache lives; None = ``$FULLCG_CACHE_DIR``, else
            ``~/.cache/fullcg`` (resolved when a graph is compiled).
        trust_shared_cache: load compile cache entries, and hand Inductor its cache
            directory, even where they are owned by another user or writable by others
            (a cache shared on purpose: whoever can write to it can run code in this
            process); on also with ``FULLCG_TRUST_SHARED_CACHE=1`` (read when a graph is
            compiled). Off, only what you or root own and nobody else can write is used
            (:mod:`fullcg.cache_trust`).
        mla_mha_min_tokens: multi-head latent attention runs a step in MHA form (chunked
            prefix) when no request decodes and one has at least this many new tokens; None
            = always absorbed (see :mod:`fullcg.mla`).
        mla_mha_min_heads: only latent layers of at least this many query heads (of one rank)
            take the MHA form; fewer heads attend absorbed in every step (the absorbed
            kernels read each latent once for all heads, which wins at few heads: 16 on an
            H200, where 128 lose to the MHA form on long prompts). 1: every layer.
        trace_layers_once: ``fullcg.compile`` marks a model's repeated layers (a
            ``ModuleList`` of one class holding fullcg attention) as nested compile regions,
            so Dynamo traces one layer and reuses its graph for the others
            (:mod:`fullcg.regions`; torch 2.13 and later, skipped on older versions).
        inductor_config: Inductor settings (names of ``torch._inductor.config``, dotted for
            nested ones such as ``"triton.cudagraphs"``) in effect while fullcg compiles the
            pieces, as a mapping or ``(name, value)`` pairs of plain values (bool, int, float,
            str or None), e.g. ``{"combo_kernels": True}``; stored as sorted pairs. Part of
            the compile cache's key; names Inductor does not have are refused when the
            backend is made. ``compiler="inductor"`` only.
        warm_start: with the compile cache on, ``fullcg.compile`` keeps each graph Dynamo
            traced, with how a step's arguments and the model's tensors map onto it, in
            the cache, and the next process with the same model, step arguments and
            config compiles that graph from the cache and runs its first step without
            Dynamo's tracing (:mod:`fullcg.warm_start`).
        skinny_linears: compiled graphs run their bias-free linears of fp16/bf16 CUDA
            weights as ``fullcg::skinny_linear``: a one-pass GEMV for calls of one row, and
            of up to eight rows for an MLP's gated projection (``silu(gate) * up`` folded
            into it) and narrow weights; the library GEMM for the rest
            (:mod:`fullcg.passes.skinny_linear`).
    """

    attention_impl: str = "auto"
    skip_softmax: SkipSoftmaxConfig = dataclasses.field(default_factory=SkipSoftmaxConfig)
    graph_mode: GraphMode = GraphMode.AUTO
    compiler: str = "inductor"
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int = 256
    capture_on_compile: bool = False
    dump_dir: str | None = None
    debug_graph_inputs: bool = False
    debug_checks: bool = False
    max_pages_per_request: int | None = None
    auto_full_max_tokens: int | None = 128
    compile_cache: bool = True
    cache_dir: str | None = None
    trust_shared_cache: bool = False
    mla_mha_min_tokens: int | None = 2048
    mla_mha_min_heads: int = 64
    trace_layers_once: bool = True
    warm_start: bool = True
    skinny_linears: bool = True
    inductor_config: tuple[tuple[str, bool | int | float | str | None], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.attention_impl, str) or not self.attention_impl:
            raise InvalidConfigError(
                f"attention_impl must name an implementation ({', '.join(ATTENTION_IMPLS)} or a registered one), "
                f"got {self.attention_impl!r}"
            )
        if not isinstance(self.skip_softmax, SkipSoftmaxConfig):
            if isinstance(self.skip_softmax, Mapping):
                object.__setattr__(self, "skip_softmax", SkipSoftmaxConfig(**self.skip_softmax))
            else:
                raise ConfigTypeError(
                    "skip_softmax must be a fullcg.SkipSoftmaxConfig (or a dict of its fields), got "
                    f"{type(self.skip_softmax).__name__}"
                )
        try:
            object.__setattr__(self, "graph_mode", GraphMode(self.graph_mode))
        except ValueError:
            raise InvalidConfigError(f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}") from None
        if self.compiler not in COMPILERS:
            raise InvalidConfigError(f"compiler must be one of {', '.join(COMPILERS)}, got {self.compiler!r}")
        _positive_int(self.max_capture_size, "max_capture_size")
        if self.max_capture_size > MAX_CAPTURE_SIZE:
            raise InvalidConfigError(
                f"max_capture_size must be at most {MAX_CAPTURE_SIZE}, got {self.max_capture_size}: steps that large "
                "are compute-bound, so a CUDA graph saves nothing while each size costs a capture and memory; larger "
                "steps run uncaptured anyway"
            )
        if self.capture_sizes is not None:
            if isinstance(self.capture_sizes, (str, bytes)) or not isinstance(self.capture_sizes, Iterable):
                raise ConfigTypeError(
                    f"capture_sizes must be a sequence of positive integers such as (1, 2, 4, 8), or None for the "
                    f"defaults; got {type(self.capture_sizes).__name__} {self.capture_sizes!r}"
                )
            sizes = list(self.capture_sizes)
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
                raise InvalidConfigError(f"capture sizes must be positive integers, got {sizes}")
            if max(sizes) > MAX_CAPTURE_SIZE:
                raise InvalidConfigError(
                    f"capture sizes must be at most {MAX_CAPTURE_SIZE}, got {max(sizes)}: steps that large are "
                    "compute-bound, so a CUDA graph saves nothing while each size costs a capture and memory"
                )
            object.__setattr__(self, "capture_sizes", tuple(sorted(set(sizes))))
        if self.max_pages_per_request is not None:
            _positive_int(self.max_pages_per_request, "max_pages_per_request")
        if self.auto_full_max_tokens is not None:
            _positive_int(self.auto_full_max_tokens, "auto_full_max_tokens")
        if self.mla_mha_min_tokens is not None:
            _positive_int(self.mla_mha_min_tokens, "mla_mha_min_tokens")
        _positive_int(self.mla_mha_min_heads, "mla_mha_min_heads")
        for name in ("capture_on_compile", "debug_graph_inputs", "debug_checks", "compile_cache", "trace_layers_once",
                     "warm_start", "skinny_linears"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.trust_shared_cache, bool):
            raise ConfigTypeError(
                f"trust_shared_cache must be True or False (FULLCG_TRUST_SHARED_CACHE=1 also turns it on), "
                f"got {self.trust_shared_cache!r}"
            )
        object.__setattr__(self, "inductor_config", _inductor_settings(self.inductor_config))
        if self.inductor_config and self.compiler != "inductor":
            raise InvalidConfigError(
                f"inductor_config applies to compiler='inductor' only, got compiler={self.compiler!r} with "
                f"settings {dict(self.inductor_config)}"
            )
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ConfigTypeError(f"dump_dir must be a path or None, got {self.dump_dir!r}")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise ConfigTypeError(
                    f"cache_dir must be a path or None (FULLCG_CACHE_DIR, else ~/.cache/fullcg), got {self.cache_dir!r}"
                )
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))

    @property
    def sizes_to_capture(self) -> tuple[int, ...]:
        """The capture sizes in effect, ascending."""
        if self.capture_sizes is not None:
            return self.capture_sizes
        return default_capture_sizes(self.max_capture_size)

    def mla_mha_form_for(self, num_heads: int) -> bool:
        """Whether a latent attention layer of ``num_heads`` query heads runs prompt-heavy
        steps in MHA form under this config (``mla_mha_min_tokens`` and ``mla_mha_min_heads``)."""
        return self.mla_mha_min_tokens is not None and num_heads >= self.mla_mha_min_heads

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FullCGConfig:
        """Build a config from ``FULLCG_*`` environment variables; ``overrides`` win."""
        env = os.environ if environ is None else environ
        explicit = set(overrides)
        if "skip_softmax" not in overrides:
            overrides["skip_softmax"] = SkipSoftmaxConfig.from_env(environ=env)
        for field, var in (
            ("attention_impl", ENV_ATTENTION_IMPL),
            ("graph_mode", ENV_GRAPH_MODE),
            ("compiler", ENV_COMPILER),
            ("dump_dir", ENV_DUMP_DIR),
        ):
            if field not in overrides and env.get(var, "").strip():
                overrides[field] = env[var].strip()
        if overrides.get("graph_mode", GRAPH_MODES[0]) not in GRAPH_MODES and "graph_mode" not in explicit:
            raise InvalidConfigError(f"{ENV_GRAPH_MODE} must be one of {', '.join(GRAPH_MODES)}, got {overrides['graph_mode']!r}")
        if overrides.get("compiler", COMPILERS[0]) not in COMPILERS and "compiler" not in explicit:
            raise InvalidConfigError(f"{ENV_COMPILER} must be one of {', '.join(COMPILERS)}, got {overrides['compiler']!r}")
        if "debug_checks" not in overrides and env.get(ENV_DEBUG_CHECKS, "").strip():
            raw = env[ENV_DEBUG_CHECKS].strip().lower()
            if raw not in ("0", "1", "true", "false"):
                raise InvalidConfigError(f"{ENV_DEBUG_CHECKS} must be 0 or 1, got {env[ENV_DEBUG_CHECKS]!r}")
            overrides["debug_checks"] = raw in ("1", "true")
        return cls(**overrides)


    def replace(self, **changes: Any) -> FullCGConfig:
        return dataclasses.replace(self, **changes)


def _inductor_settings(value: Any) -> tuple[tuple[str, bool | int | float | str | None], ...]:
    """``FullCGConfig.inductor_config`` as sorted ``(name, value)`` pairs (see its field)."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif (isinstance(value, (tuple, list))
          and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value)):
        pairs = [tuple(p) for p in value]
    else:
        raise ConfigTypeError(
            f"inductor_config must be a mapping of Inductor setting names to values, such as "
            f"{{'combo_kernels': True}}, or (name, value) pairs; got {type(value).__name__} {value!r}"
        )
    names = [name for name, _ in pairs]
    for name, setting in pairs:
        if not isinstance(name, str) or not name:
            raise ConfigTypeError(f"inductor_config names must be non-empty strings, got {name!r}")
        if not isinstance(setting, (bool, int, float, str, type(None))):
            raise ConfigTypeError(
                f"inductor_config[{name!r}] must be a bool, int, float, str or None, got {type(setting).__name__} "
                f"{setting!r}"
            )
    if len(set(names)) != len(names):
        raise InvalidConfigError(f"inductor_config names a setting twice: {sorted(names)}")
    return tuple(sorted(pairs))


#: Every variable :meth:`FullCGConfig.from_env` reads.
ENV_VARS = (ENV_SKIP_SOFTMAX_PREFILL, ENV_SKIP_SOFTMAX_DECODE, ENV_ATTENTION_IMPL, ENV_GRAPH_MODE, ENV_COMPILER,
            ENV_DUMP_DIR, ENV_DEBUG_CHECKS)
_env_configs: dict[tuple[object, ...], FullCGConfig] = {}  # a cache: one config per set of values
_read_env = env_reader(ENV_VARS)


def env_config() -> FullCGConfig:
    """``FullCGConfig.from_env()`` for the environment as it is now, built once per distinct
    set of values: a step's context entry without a config calls it, and building a config
    costs tens of microseconds where looking the variables up costs one or two."""
    key = _read_env()
    config = _env_configs.get(key)
    if config is None:
        config = _env_configs[key] = FullCGConfig.from_env()
    return config
