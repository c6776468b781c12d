"""Skip-softmax factors measured on a model and text: accuracy against dense, and calibration.

A factor means different sparsity at different context lengths, in different layers and
for different models, so it is chosen by measuring. :func:`measure_skip_softmax` runs a
model over token sequences twice, dense and with a :class:`SkipSoftmaxConfig`, and reports
the tiles skipped (overall and per layer) and what skipping cost: perplexity, top-1
agreement with dense and KL(dense || skip). :func:`calibrate_skip_softmax` searches for
the factors that reach a target skipped fraction, or the most skipping that keeps a
target top-1 agreement.

The two phases are measured apart, as the two factors act apart:

- ``"prefill"``: each sequence prefilled in one step; every position is scored (up to
  ``max_eval_positions`` per sequence, evenly spaced).
- ``"decode"``: each sequence but its last ``decode_steps + 1`` tokens prefilled densely,
  then ``decode_steps`` teacher-forced decode steps (all sequences batched in each step),
  each fed the true next token and scored against a dense decode of the same steps.

Perplexity alone misleads (it can fall while the top-1 agreement drops), so all three
measures are reported; calibration constrains top-1 agreement.

The model is any module ``model(input_ids [T], positions [T]) -> logits [T, vocab]``
whose :class:`fullcg.Attention` layers hold KV caches large enough for every sequence at
once (a :class:`fullcg.integrations.transformers.PackedCausalLM`, a fullcg model). Pass
the uncompiled model: every measurement runs a new factor, which a compiled model would
compile anew. Skipped tiles are counted by the reference and Triton implementations;
FlashInfer counts none, so it is refused here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from fullcg import telemetry
from fullcg.config import FullCGConfig, SkipSoftmaxConfig
from fullcg.context import forward_context
from fullcg.layer import Attention
from fullcg.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class SkipSoftmaxMeasurement:
    """What one skip-softmax configuration did in one phase, against dense.

    ``factor`` is the phase's global factor (None: dense, or per-layer factors only);
    ``layer_tiles`` maps each layer that counted tiles to its (visited, skipped) tiles.
    """

    phase: Phase
    factor: float | None
    skipped_fraction: float
    perplexity: float
    dense_perplexity: float
    top1_agreement: float
    kl: float
    config: SkipSoftmaxConfig
    layer_tiles: dict[int, tuple[int, int]] = dataclasses.field(repr=False)

    @property
    def layer_skipped(self) -> dict[int, float]:
        """Each layer's skipped fraction of its visited tiles."""
        return {lid: skipped / visited for lid, (visited, skipped) in self.layer_tiles.items()}

    def row(self) -> dict[str, object]:
        """The measurement as a flat results row (the benchmark's JSON shape)."""
        return {
            "phase": self.phase, "factor": self.factor, "skipped_fraction": self.skipped_fraction,
            "perplexity": self.perplexity, "dense_perplexity": self.dense_perplexity,
            "top1_agreement": self.top1_agreement, "kl": self.kl,
            "layer_skipped": {str(k): v for k, v in sorted(self.layer_skipped.items())},
        }


@dataclasses.dataclass(frozen=True)
class SkipSoftmaxCalibration:
    """:func:`calibrate_skip_softmax`'s answer: ``config`` to use, with what it measured
    (``prefill`` / ``decode``, None for a phase not calibrated) and every measurement the
    search made (``history``)."""

    config: SkipSoftmaxConfig
    prefill: SkipSoftmaxMeasurement | None
    decode: SkipSoftmaxMeasurement | None
    history: tuple[SkipSoftmaxMeasurement, ...]


class _Scores:
    """Running sums of the three measures over scored positions."""

    def __init__(self) -> None:
        self.nll = self.dense_nll = self.agree = self.kl = 0.0
        self.count = 0

    def add(self, logits: torch.Tensor, dense_logp: torch.Tensor, targets: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float(), -1)
        self.nll += float(-logp.gather(-1, targets[:, None]).sum())
        self.dense_nll += float(-dense_logp.gather(-1, targets[:, None]).sum())
        self.agree += float((logp.argmax(-1) == dense_logp.argmax(-1)).sum())
        self.kl += float((dense_logp.exp() * (dense_logp - logp)).sum())
        self.count += targets.numel()


#: Which probe's dense decode prefix a model's caches hold (by the model's id; weakly, so
#: a finished calibration frees its probe, its model and its dense results): a probe
#: prefills again when another probe, or its own prefill phase, has written over it.
#: Steps run outside probes, and caches allocated anew, are not seen: do neither between
#: a probe's decode measurements.
_dense_prefix_holder: dict[int, weakref.ref[SkipSoftmaxProbe]] = {}


class SkipSoftmaxProbe:
    """Measures skip-softmax configurations of one model on fixed token sequences.

    Dense results are computed once per phase and reused by every :meth:`measure`. Each
    sequence keeps pages of its own in the model's KV caches (they must hold all of them
    at once), so the dense prefix the decode phase reuses stays there between
    measurements. ``config`` is the base fullcg config (implementation, tile sizes);
    its skip-softmax factors are ignored.
    """

    def __init__(
        self, model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, config: FullCGConfig | None = None,
        decode_steps: int = 32, max_eval_positions: int = 2048,
    ) -> None:
        config = config if config is not None else FullCGConfig.from_env()
        if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 1:
            raise ValueError(f"calibrate_skip_softmax: decode_steps must be a positive integer, got {decode_steps!r}")
        if isinstance(max_eval_positions, bool) or not isinstance(max_eval_positions, int) or max_eval_positions < 1:
            raise ValueError(
                f"calibrate_skip_softmax: max_eval_positions must be a positive integer, got {max_eval_positions!r}"
            )
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not layers:
            raise ValueError("calibrate_skip_softmax: the model has no fullcg.Attention layers")
        cache = layers[0].kv_cache
        if cache is None:
            raise ValueError(
                "calibrate_skip_softmax: the model's attention layers have no KV cache; allocate one first "
                "(fullcg.integrations.transformers.prepare(model, num_pages=..., page_size=...) or "
                "model.allocate_kv_cache(...))"
            )
        if not sequences:
            raise ValueError("calibrate_skip_softmax: token_sequences is empty; give at least one sequence")
        shortest = decode_steps + 2
        for i, seq in enumerate(sequences):
            if len(seq) < shortest:
                raise ValueError(
                    f"calibrate_skip_softmax: sequence {i} has {len(seq)} tokens; every sequence needs at least "
                    f"decode_steps + 2 = {shortest}"
                )
        self.model, self.config = model, config
        self.layer_ids = sorted({m.layer_id for m in layers})
        #: The shortest sliding window of any layer (None: none has one): skipping stops
        #: where ``factor / min(kv_len, window)`` reaches 1.
        self.smallest_window = min((m.sliding_window for m in layers if m.sliding_window is not None), default=None)
        self.device, self.page_size = cache.k.device, cache.page_size
        pages = [-(-len(s) // self.page_size) for s in sequences]
        if sum(pages) > cache.num_pages:
            raise ValueError(
                f"calibrate_skip_softmax: the sequences need {sum(pages)} KV-cache pages of {self.page_size} tokens "
                f"together (each keeps its own), the cache has {cache.num_pages}; allocate more pages or pass "
                "fewer or shorter sequences"
            )
        starts = [sum(pages[:i]) for i in range(len(pages))]
        self.page_rows = [torch.arange(s, s + n, dtype=torch.int32, device=self.device) for s, n in zip(starts, pages)]
        self.sequences = [torch.as_tensor(list(s), dtype=torch.long, device=self.device) for s in sequences]
        self.decode_steps = decode_steps
        # Scored prefill positions: up to max_eval_positions, evenly spaced, each predicting the next token.
        self.eval_rows = [
            torch.linspace(0, len(s) - 2, min(max_eval_positions, len(s) - 1), device=self.device).round().long().unique()
            for s in self.sequences
        ]
        self._dense: dict[Phase, list[torch.Tensor]] = {}

    def _step(self, tokens: list[torch.Tensor], prefixes: list[int], rows: list[int], skip: SkipSoftmaxConfig) -> torch.Tensor:
        q_lens = [t.numel() for t in tokens]
        width = max(self.page_rows[r].numel() for r in rows)
        table = torch.full((len(rows), width), 0, dtype=torch.int32, device=self.device)
        for i, r in enumerate(rows):
            table[i, : self.page_rows[r].numel()] = self.page_rows[r]
        md = AttentionMetadata.build(q_lens, prefixes, table, self.page_size)
        positions = torch.cat([torch.arange(p, p + n, device=self.device) for p, n in zip(prefixes, q_lens)])
        config = dataclasses.replace(self.config, skip_softmax=skip)
        with torch.inference_mode(), forward_context(md, self.model, config=config):
            return self.model(torch.cat(tokens), positions)

    def _prefill_all(self, skip: SkipSoftmaxConfig, lengths: list[int], scorer: Callable[[int, torch.Tensor], None]) -> None:
        for i, seq in enumerate(self.sequences):
            scorer(i, self._step([seq[: lengths[i]]], [0], [i], skip))

    def _decode_all(self, skip: SkipSoftmaxConfig) -> list[torch.Tensor]:
        """Logits [decode_steps, vocab] per sequence, after its dense prefix."""
        n = self.decode_steps
        starts = [len(s) - n - 1 for s in self.sequences]
        holder = _dense_prefix_holder.get(id(self.model))
        if holder is None or holder() is not self:
            dense = dataclasses.replace(skip, prefill_scale_factor=None, decode_scale_factor=None, per_layer=())
            self._prefill_all(dense, starts, lambda i, logits: None)
            _dense_prefix_holder[id(self.model)] = weakref.ref(self)
        out: list[list[torch.Tensor]] = [[] for _ in self.sequences]
        rows = list(range(len(self.sequences)))
        for j in range(n):
            tokens = [s[starts[i] + j : starts[i] + j + 1] for i, s in enumerate(self.sequences)]
            logits = self._step(tokens, [starts[i] + j for i in rows], rows, skip)
            for i in rows:
                out[i].append(logits[i].float())
        return [torch.stack(o) for o in out]

    def _targets(self, phase: Phase, i: int) -> torch.Tensor:
        seq = self.sequences[i]
        if phase == "prefill":
            return seq[self.eval_rows[i] + 1]
        start = len(seq) - self.decode_steps
        return seq[start : start + self.decode_steps]

    def _logits(self, phase: Phase, skip: SkipSoftmaxConfig) -> list[torch.Tensor]:
        if phase == "decode":
            return self._decode_all(skip)
        # A prefill overwrites the dense prefix the decode phase keeps in the cache.
        _dense_prefix_holder.pop(id(self.model), None)
        got: list[torch.Tensor] = []
        self._prefill_all(skip, [len(s) for s in self.sequences], lambda i, logits: got.append(logits[self.eval_rows[i]].float()))
        return got

    def dense(self, phase: Phase) -> list[torch.Tensor]:
        if phase not in self._dense:
            none = SkipSoftmaxConfig(tile_kv=self.config.skip_softmax.tile_kv, tile_q=self.config.skip_softmax.tile_q,
                                     decode_split_tiles=self.config.skip_softmax.decode_split_tiles)
            self._dense[phase] = [torch.log_softmax(x, -1) for x in self._logits(phase, none)]
        return self._dense[phase]

    @property
    def shortest(self) -> int:
        """Tokens of the shortest sequence."""
        return min(s.numel() for s in self.sequences)

    def measure(self, phase: Phase, skip: SkipSoftmaxConfig) -> SkipSoftmaxMeasurement:
        """Run ``phase`` with ``skip`` (its tile sizes are the base config's) and compare it with dense."""
        if phase not in PHASES:
            raise ValueError(f"calibrate_skip_softmax: phase must be one of {PHASES}, got {phase!r}")
        base = self.config.skip_softmax
        skip = dataclasses.replace(skip, tile_kv=base.tile_kv, tile_q=base.tile_q, decode_split_tiles=base.decode_split_tiles)
        dense = self.dense(phase)
        with telemetry.counts_discarded():  # the user's own counters are left as they were
            telemetry.reset_skip_softmax_stats()
            logits = self._logits(phase, skip)
            stats = telemetry.skip_softmax_stats()
        scores = _Scores()
        for i, got in enumerate(logits):
            scores.add(got, dense[i], self._targets(phase, i))
        unmeasured = [lid for lid, s in stats.items() if not s.measured]
        if unmeasured:
            raise ValueError(
                f"calibrate_skip_softmax: layers {unmeasured} ran on kernels that count no skipped tiles (FlashInfer); "
                "measure with attention_impl='triton' or 'reference'"
            )
        attr = "decode" if phase == "decode" else "prefill"
        visited = {lid: getattr(s, f"{attr}_visited") for lid, s in stats.items()}
        skipped = {lid: getattr(s, f"{attr}_skipped") for lid, s in stats.items()}
        total = sum(visited.values())
        m = SkipSoftmaxMeasurement(
            phase=phase,
            factor=skip.decode_scale_factor if phase == "decode" else skip.prefill_scale_factor,
            skipped_fraction=sum(skipped.values()) / total if total else 0.0,
            perplexity=math.exp(scores.nll / scores.count),
            dense_perplexity=math.exp(scores.dense_nll / scores.count),
            top1_agreement=scores.agree / scores.count,
            kl=scores.kl / scores.count,
            layer_tiles={lid: (v, skipped[lid]) for lid, v in visited.items() if v},
            config=skip,
        )
        logger.info("skip-softmax %s factor=%s: skipped %.1f%%, top-1 %.4f, KL %.2e, perplexity %.4f (dense %.4f)",
                    phase, m.factor, 100 * m.skipped_fraction, m.top1_agreement, m.kl, m.perplexity, m.dense_perplexity)
        return m


def _with(skip: SkipSoftmaxConfig, phase: Phase, factor: float | None, per_layer: dict[int, float | None] | None = None) -> SkipSoftmaxConfig:
    """``skip`` with ``phase``'s global factor replaced and its per-layer values dropped, or
    (``per_layer`` given, on a config whose ``phase`` is dense, ``factor`` None) its
    per-layer values set; the other phase's factors are kept, per layer too."""
    assert per_layer is None or factor is None, "per-layer values go on a phase with no global factor"
    other = skip.decode_scale_factor if phase == "prefill" else skip.prefill_scale_factor
    layers = {lid: (p, d) for lid, p, d in skip.per_layer}
    for lid, f in (per_layer or {}).items():
        kept = layers.get(lid, (skip.prefill_scale_factor, skip.decode_scale_factor))
        layers[lid] = (f, kept[1]) if phase == "prefill" else (kept[0], f)
    if per_layer is None:  # this phase global again: drop its per-layer values
        layers = {lid: ((factor, d) if phase == "prefill" else (p, factor)) for lid, (p, d) in layers.items()}
        layers = {lid: pd for lid, pd in layers.items() if pd != ((factor, other) if phase == "prefill" else (other, factor))}
    if phase == "prefill":
        return dataclasses.replace(skip, prefill_scale_factor=factor, per_layer=layers)
    return dataclasses.replace(skip, decode_scale_factor=factor, per_layer=layers)


class _Search:
    """The searches of one phase, every measurement kept."""

    def __init__(self, probe: SkipSoftmaxProbe, phase: Phase, start: SkipSoftmaxConfig, history: list[SkipSoftmaxMeasurement]) -> None:
        self.probe, self.phase, self.start, self.history = probe, phase, start, history
        # lambda = factor / min(kv_len, window) reaches 1 at the shortest context or window:
        # above that a request (a windowed layer) skips nothing.
        keys = probe.shortest if phase == "prefill" else probe.shortest - probe.decode_steps - 1
        self.highest = 0.99 * min(keys, probe.smallest_window or keys)
        self.lowest = 1e-2

    def run(self, skip: SkipSoftmaxConfig) -> SkipSoftmaxMeasurement:
        m = self.probe.measure(self.phase, skip)
        self.history.append(m)
        return m

    def largest(self, ok: Callable[[SkipSoftmaxMeasurement], bool], at: Callable[[float], SkipSoftmaxConfig],
                lo: float, hi: float, ratio: float) -> SkipSoftmaxMeasurement | None:
        """The measurement at the largest ``x`` in [lo, hi] (geometric bisection, to within
        ``ratio``) whose run is ``ok``; None if even ``lo`` is not."""
        top = self.run(at(hi))
        if ok(top):
            return top
        best = self.run(at(lo))
        if not ok(best):
            return None
        while hi / lo > ratio:
            mid = math.sqrt(lo * hi)
            m = self.run(at(mid))
            if ok(m):
                lo, best = mid, m
            else:
                hi = mid
        return best


def _accepts(target_skipped: float | None, min_top1: float | None) -> Callable[[SkipSoftmaxMeasurement], bool]:
    """Whether a measurement is within the targets: skipping at most the target, top-1
    agreement at least the floor."""
    def ok(m: SkipSoftmaxMeasurement) -> bool:
        if min_top1 is not None and m.top1_agreement < min_top1:
            return False
        return target_skipped is None or m.skipped_fraction <= target_skipped
    return ok


def _calibrate_global(search: _Search, ok: Callable[[SkipSoftmaxMeasurement], bool]) -> SkipSoftmaxMeasurement | None:
    return search.largest(ok, lambda f: _with(search.start, search.phase, f), search.lowest, search.highest, 1.05)


def _calibrate_layers(search: _Search, found: SkipSoftmaxMeasurement, ok: Callable[[SkipSoftmaxMeasurement], bool],
                      ladder: Sequence[float]) -> SkipSoftmaxMeasurement | None:
    """Per-layer factors around the global one ``found``: each layer's cost (KL) and gain
    (skipped tiles) at every factor of ``ladder`` (multiples of the global factor), measured
    with that layer alone skipping; then, for a price ``lam`` on KL, each layer takes the
    factor with the best gain - lam * cost (costs add across layers to first order), and
    the price is bisected on real runs of the whole choice."""
    phase, f_g = search.phase, found.factor
    assert f_g is not None
    dense = _with(search.start, phase, None)
    layers = search.probe.layer_ids
    options: dict[int, list[tuple[float | None, int, float]]] = {}
    for lid in layers:
        opts: list[tuple[float | None, int, float]] = [(None, 0, 0.0)]
        for mult in ladder:
            f = min(f_g * mult, search.highest)
            m = search.run(_with(dense, phase, None, {lid: f}))
            visited, skipped = m.layer_tiles.get(lid, (0, 0))
            opts.append((f, skipped, m.kl))
        options[lid] = opts

    def choice(lam: float) -> dict[int, float | None]:
        return {lid: max(opts, key=lambda o: o[1] - lam * o[2])[0] for lid, opts in options.items()}

    priced = [(o[1], o[2]) for opts in options.values() for o in opts if o[1] > 0 and o[2] > 0]
    gains, costs = [g for g, _ in priced], [c for _, c in priced]
    if not priced:
        return None
    # Prices between "every layer at its largest factor" and "every layer dense".
    lo = 1e-3 * min(gains) / max(costs)
    hi = 1e3 * max(gains) / min(costs)
    # The same accuracy as the global factor: its top-1 floor, and no more KL than it has.
    def same_accuracy(m: SkipSoftmaxMeasurement) -> bool:
        return ok(m) and m.kl <= found.kl

    # A higher price is more accurate: search the lowest acceptable price as the largest 1/price.
    return search.largest(same_accuracy, lambda inv: _with(dense, phase, None, choice(1.0 / inv)), 1.0 / hi, 1.0 / lo, 1.5)


def _better(layered: SkipSoftmaxMeasurement, found: SkipSoftmaxMeasurement, *, accuracy_bound: bool) -> bool:
    if accuracy_bound:  # the same accuracy floor: more skipping is better
        return layered.skipped_fraction > found.skipped_fraction
    # The same skipping target: less KL is better, skipping no less.
    return layered.kl < found.kl and layered.skipped_fraction >= found.skipped_fraction - 0.005


def calibrate_skip_softmax(
    model: torch.nn.Module,
    token_sequences: Sequence[Sequence[int]],
    *,
    target_skipped: float | None = None,
    min_top1: float | None = None,
    phases: Sequence[Phase] = PHASES,
    per_layer: bool = False,
    decode_steps: int = 32,
    max_eval_positions: int = 2048,
    config: FullCGConfig | None = None,
) -> SkipSoftmaxCalibration:
    """Skip-softmax factors for ``model`` measured on ``token_sequences`` (the user's text).

    For each phase in ``phases`` (``"prefill"``, ``"decode"``), the largest factor whose
    measurement is within the targets: skipping at most ``target_skipped`` (a fraction of
    tiles) and keeping top-1 agreement with dense at ``min_top1`` or above. Give either
    or both; with both, whichever is reached first decides. The search is a geometric bisection
    that stops within 5% of the factor, so on the calibration text the skipped fraction
    lands just under the target (on SmolLM2 within 2 points; held-out text of the same
    kind within 5, docs/configuration.md).

    With ``per_layer=True`` each layer then gets its own factor from a ladder around the
    global one (0.25x to 16x), chosen by how many tiles it skips for how much KL it adds.
    The per-layer config is kept only where it is better within the same targets: more
    skipping under ``min_top1``, or (``target_skipped`` alone) less KL at no less
    skipping. It costs ``4 * num_layers`` more measurements per phase, plus a
    bisection over the price (about ten).

    Sequences should be as long as the contexts the model will serve: a factor skips more
    at longer contexts. Each measurement runs the model over all sequences; the model is
    the uncompiled one (see the module docstring). Returns the config (tile sizes from
    ``config``) with what it measured; where even the smallest factor breaks ``min_top1``,
    that phase stays dense.
    """
    if target_skipped is None and min_top1 is None:
        raise ValueError("calibrate_skip_softmax: give target_skipped (a fraction of tiles), min_top1, or both")
    for name, value in (("target_skipped", target_skipped), ("min_top1", min_top1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
            raise ValueError(f"calibrate_skip_softmax: {name} must be a fraction in (0, 1], got {value!r}")
    phases = tuple(phases)
    if not phases or any(p not in PHASES for p in phases) or len(set(phases)) != len(phases):
        raise ValueError(f"calibrate_skip_softmax: phases must be distinct names from {PHASES}, got {phases!r}")
    probe = SkipSoftmaxProbe(model, token_sequences, config=config, decode_steps=decode_steps,
                             max_eval_positions=max_eval_positions)
    base = probe.config.skip_softmax
    skip = SkipSoftmaxConfig(tile_kv=base.tile_kv, tile_q=base.tile_q, decode_split_tiles=base.decode_split_tiles)
    history: list[SkipSoftmaxMeasurement] = []
    chosen: dict[Phase, SkipSoftmaxMeasurement | None] = {"prefill": None, "decode": None}
    ok = _accepts(target_skipped, min_top1)
    for phase in phases:
        search = _Search(probe, phase, skip, history)
        found = _calibrate_global(search, ok)
        if found is not None and found.factor is not None and per_layer:
            layered = _calibrate_layers(search, found, ok, ladder=(0.25, 1.0, 4.0, 16.0))
            if layered is not None and _better(layered, found, accuracy_bound=min_top1 is not None):
                logger.info("skip-softmax %s: per-layer factors skip %.1f%% against the global factor's %.1f%%",
                            phase, 100 * layered.skipped_fraction, 100 * found.skipped_fraction)
                found = layered
        if found is None:
            logger.warning("skip-softmax %s: even factor %.2g breaks the targets; the phase stays dense", phase, search.lowest)
        chosen[phase] = found
        skip = found.config if found is not None else _with(skip, phase, None)
    return SkipSoftmaxCalibration(dataclasses.replace(skip, tile_kv=base.tile_kv, tile_q=base.tile_q,
                                                      decode_split_tiles=base.decode_split_tiles),
                                  chosen["prefill"], chosen["decode"], tuple(history))
