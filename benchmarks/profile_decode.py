"""A captured full decode step, kernel by kernel: its time, the bytes it must move, its share of bandwidth.

    python benchmarks/profile_decode.py --batch 1 64 --context 1024 [--impl triton] [--out profile.json]
    python benchmarks/profile_decode.py --smoke      # CPU: the tiny model's shapes, a synthetic replay

Builds the Llama-3-8B-shaped model of ``decode.py`` in bf16 (torch's default initialisation,
drawn on the GPU: kernel times do not depend on the values, and the seeded draw takes a
minute and a half on the CPU), compiles it with ``graph_mode="full"``, captures the decode
graph of each ``--batch`` at ``--context`` and profiles ``--steps`` replays with the torch
profiler. It prints a markdown table of the step's kernels, a row per kernel name and role:
launches per step, microseconds per step (all its launches), its share of the step, the
bytes it must move per step and its own share of the copy bandwidth measured in the same
process (bytes / time / bandwidth; the copy's bytes count reads and writes alike, so a
kernel that mostly reads can pass 100%); then the step's total, the floor (weights and KV
bytes over that bandwidth, ``decode.floor_bytes``) and the replay's CUDA-event time.
``--out`` writes it all as JSON, with one replay's launches in order.

Kernels in a replayed graph carry no shapes, so bytes are attributed by position: a
replay's kernel sequence is fixed and repeats per layer. The GEMM launches, in order, are
the model's linear layers in forward order (per layer ``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``; then ``lm_head``), each moving its weight and its input
and output rows. Each attention launch moves its layer's keys and values of every request
(``context + 1`` tokens, as the floor counts them), its queries and outputs, and the new
token's keys and values written when no separate save kernel does. These are minimums
("min"). Inductor's RMSNorm and SiLU-mul kernels get an estimate ("est.": the activation
rows they touch); the other kernels' bytes (rotary, split-K reductions, fills) are not
estimated ("-") and the total leaves them out. When the launches do not fit the pattern
(another GEMM count, replays that differ), the table shows times only, with a warning.

``--keep-residual-addmm`` measures the step with Inductor's mm + add -> addmm fusion of the
residual add into the o_proj and down GEMMs, which fullcg undoes by default
(``fullcg/passes/residual_addmm.py``): an A/B of that pass.
``--inductor NAME=VALUE ...`` sets Inductor options for the run (``combo_kernels=True``), an
A/B of a setting; both flags compile without fullcg's caches.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import json
import re
import statistics
from collections.abc import Sequence

import torch

import fullcg
from decode import PAGE, captured_full_graph, copy_bandwidth, decode_metadata, floor_bytes, time_ms
from fullcg.models.llama import LlamaConfig, LlamaModel

#: The linear layers of a decoder layer, in the order its forward runs them.
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

# Kernel-name fragments (lower case) by role. Attention is looked for before GEMMs: some
# attention kernels carry an architecture tag in their names as GEMMs do (fmha_v2's "_sm90_").
GEMM_REDUCE_KEYS = ("splitkreduce", "splitk_reduce")
KV_SAVE_KEYS = ("_save_kv_kernel", "_latent_save_kernel", "appendpagedkvcache")
MERGE_KEYS = ("mergestate", "merge_state", "_merge")
ATTENTION_KEYS = ("_decode_kernel", "_prefill_kernel", "_mla_kernel", "flashinfer", "batchdecode", "batchprefill",
                  "fmha")
GEMM_KEYS = ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "s16816", "sm80_", "sm90_", "sm100_")

#: What the bytes of a row are, weakest last: a row folding several kinds shows the weakest.
BYTES_KINDS = ("min", "est.", "-")

#: The copy bandwidth ``--smoke`` assumes (an H200's, measured), so its figures read like a GPU's.
SMOKE_BANDWIDTH = 4.2e12


def kernel_role(name: str) -> str:
    """What a kernel does in a decode step, from its name alone."""
    low = name.lower()
    if low.startswith("triton_"):
        # Inductor's kernels are named by the ops fused into them ("triton_red_fused_add_mean_..._3");
        # an op name can look like a role ("attention" in the rotary kernels), so the op list decides.
        ops = set(re.split(r"_+", low))
        if low.startswith("triton_tem_"):
            return "gemm"
        # Before the matmul test: a norm fused with the add of an (unfused) addmm names it.
        if {"rsqrt", "mean"} <= ops:
            return "rmsnorm"
        if ops & {"mm", "addmm", "bmm"}:
            return "gemm"
        if "silu" in ops:
            return "silu_mul"
        if {"cos", "sin"} <= ops:
            return "rotary"
        return "elementwise"
    if any(k in low for k in GEMM_REDUCE_KEYS) or ("cublas" in low and "reduce" in low):
        return "gemm_reduce"
    if any(k in low for k in KV_SAVE_KEYS):
        return "kv_save"
    if any(k in low for k in MERGE_KEYS):
        return "attention_merge"
    if any(k in low for k in ATTENTION_KEYS):
        return "attention"
    if any(k in low for k in GEMM_KEYS):
        return "gemm"
    return "other"


def _strip_templates(name: str) -> str:
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def short_name(name: str, width: int = 64) -> str:
    """A kernel's name as a row shows it.

    C++ kernels lose their return type, template arguments and parameters (an elementwise
    kernel keeps its functor, which says what it does); Inductor's lose their serial
    number, so kernels fusing the same ops share a row.
    """
    if name.startswith("triton_"):
        short = re.sub(r"_\d+$", "", name)
    else:
        short = name.removeprefix("void ").replace("(anonymous namespace)::", "")
        functor = re.search(r"(\w+Functor)", short)
        short = _strip_templates(short).split("(", 1)[0].strip() or name
        if functor:
            short += f"<{functor.group(1)}>"
    return short if len(short) <= width else short[: width - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Weight:
    """A linear layer's weight, as its GEMM launch reads it."""

    name: str  # "layers.3.mlp.down_proj"
    kind: str  # "down_proj": the same in every layer
    out_features: int
    in_features: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one decode step of a model must move, part by part."""

    batch: int
    context: int
    num_layers: int
    hidden: int
    intermediate: int
    element_size: int
    #: The GEMMs' weights, in the order the forward runs them.
    weights: tuple[Weight, ...]
    #: A layer's keys and values of ``context + 1`` tokens of every request (what the floor reads).
    kv_bytes_per_layer: int
    #: A layer's keys and values of every request's new token (written to the cache).
    new_kv_bytes_per_layer: int
    #: A layer's queries read and attention outputs written.
    qo_bytes_per_layer: int
    #: ``decode.floor_bytes``: every weight but the embedding, and the keys and values.
    floor_bytes: int


def _weight(name: str, weight: torch.Tensor) -> Weight:
    out_features, in_features = weight.shape
    return Weight(name, name.rsplit(".", 1)[-1], out_features, in_features, weight.numel() * weight.element_size())


def step_shape(model: LlamaModel, batch: int, context: int) -> StepShape:
    """The bytes a decode step of ``batch`` requests at ``context`` moves in ``model``, by part."""
    cfg = model.cfg
    weights = [_weight(f"layers.{i}.{path}", layer.get_submodule(path).weight)
               for i, layer in enumerate(model.layers) for path in LAYER_LINEARS]
    weights.append(_weight("lm_head", model.lm_head.weight))
    elem = model.lm_head.weight.element_size()  # the KV cache is allocated in the model's dtype
    attn = model.layers[0].self_attn
    kv_token = 2 * attn.num_kv_heads * cfg.head_dim * elem
    return StepShape(
        batch=batch, context=context, num_layers=cfg.num_layers, hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size, element_size=elem, weights=tuple(weights),
        kv_bytes_per_layer=batch * (context + 1) * kv_token, new_kv_bytes_per_layer=batch * kv_token,
        qo_bytes_per_layer=2 * batch * attn.num_heads * cfg.head_dim * elem,
        floor_bytes=floor_bytes(model, batch, context),
    )


@dataclasses.dataclass
class Launch:
    """One kernel launch of a replay, with the bytes attributed to it."""

    name: str
    role: str
    us: float
    bytes: int | None = None
    bytes_kind: str = "-"  # one of BYTES_KINDS
    what: str = ""  # what the bytes are: "layers.0.self_attn.qkv_proj", "KV of layer 3"


def attribute(sequence: Sequence[tuple[str, float]], shape: StepShape | None) -> tuple[list[Launch], list[str]]:
    """One replay's ``(kernel name, us)`` launches, in order, with their roles and bytes; and warnings.

    Without ``shape``, or when the GEMM launches are not one per weight, no launch gets
    bytes: an attribution by position is only as good as the pattern it assumes.
    """
    launches = [Launch(name, kernel_role(name), us) for name, us in sequence]
    if shape is None:
        return launches, []
    gemms = [launch for launch in launches if launch.role == "gemm"]
    if len(gemms) != len(shape.weights):
        return launches, [
            f"{len(gemms)} GEMM launches in a replay, expected {len(shape.weights)} ({len(LAYER_LINEARS)} per layer "
            f"x {shape.num_layers} layers + lm_head): bytes not attributed, times only"]
    warnings = []
    kernels_by_kind: dict[str, set[str]] = collections.defaultdict(set)
    for launch, weight in zip(gemms, shape.weights):
        launch.role = f"gemm {weight.kind}"
        launch.bytes = weight.nbytes + shape.batch * (weight.in_features + weight.out_features) * shape.element_size
        launch.bytes_kind = "min"
        launch.what = weight.name
        kernels_by_kind[weight.kind].add(launch.name)
    for kind, names in kernels_by_kind.items():
        # The same shape gets the same kernel in every layer; two kernels suggest the order is off.
        if len(names) > 1:
            warnings.append(f"{kind} runs {len(names)} different GEMM kernels across layers: check the order")

    layers = shape.num_layers
    saves = [launch for launch in launches if launch.role == "kv_save"]
    attention = [launch for launch in launches if launch.role == "attention"]
    if len(attention) == layers:
        # Without a save kernel of its own, the attention kernel writes the new token's k and v.
        written = 0 if len(saves) == layers else shape.new_kv_bytes_per_layer
        for i, launch in enumerate(attention):
            launch.bytes = shape.kv_bytes_per_layer + shape.qo_bytes_per_layer + written
            launch.bytes_kind, launch.what = "min", f"KV of layer {i}"
    elif attention:
        warnings.append(f"{len(attention)} attention launches for {layers} layers: their bytes not attributed")
    if len(saves) == layers:
        for i, launch in enumerate(saves):
            launch.bytes = 2 * shape.new_kv_bytes_per_layer  # the new k and v read, and written to the cache
            launch.bytes_kind, launch.what = "min", f"new KV of layer {i}"
    elif saves:
        warnings.append(f"{len(saves)} KV save launches for {layers} layers: their bytes not attributed")

    rows = shape.batch * shape.element_size
    for launch in launches:
        if launch.role == "rmsnorm":
            # Residual and the sublayer's output in, their sum and the normed rows out; the norm's weight.
            launch.bytes = (4 * rows + shape.element_size) * shape.hidden
            launch.bytes_kind, launch.what = "est.", "4 rows of hidden + weight"
        elif launch.role == "silu_mul":
            launch.bytes = 3 * rows * shape.intermediate  # gate and up in, their product out
            launch.bytes_kind, launch.what = "est.", "3 rows of intermediate"
    return launches, warnings


@dataclasses.dataclass
class Row:
    """The launches of one kernel name in one role, per step."""

    kernel: str
    role: str
    count: float
    us: float
    bytes: int | None
    bytes_kind: str
    names: list[str]  # the full kernel names folded into the row


def group_rows(launches: Sequence[Launch], steps: int = 1) -> list[Row]:
    """Launches folded into rows by (short name, role), per step (``steps`` replays), slowest first."""
    rows: dict[tuple[str, str], Row] = {}
    for launch in launches:
        key = (short_name(launch.name), launch.role)
        row = rows.get(key)
        if row is None:
            row = rows[key] = Row(key[0], key[1], 0, 0.0, 0, launch.bytes_kind, [])
        row.count += 1 / steps
        row.us += launch.us / steps
        row.bytes = None if row.bytes is None or launch.bytes is None else row.bytes + launch.bytes
        row.bytes_kind = max(row.bytes_kind, launch.bytes_kind, key=BYTES_KINDS.index)
        if launch.name not in row.names:
            row.names.append(launch.name)
    for row in rows.values():
        if row.bytes is None:
            row.bytes_kind = "-"
        else:
            row.bytes //= steps
    return sorted(rows.values(), key=lambda r: -r.us)


def replay_sequence(events: Sequence[tuple[str, float, float]], steps: int
                    ) -> tuple[list[tuple[str, float]] | None, str | None]:
    """One replay's ``(kernel, us)`` in launch order, each its median over ``steps`` replays.

    ``events`` are ``(name, start, duration)`` of every kernel profiled over ``steps``
    back-to-back replays. Returns None and why when they do not split into equal replays.
    """
    ordered = sorted(events, key=lambda e: e[1])
    if not ordered or len(ordered) % steps:
        return None, f"{len(ordered)} kernels over {steps} replays: not one sequence per replay"
    n = len(ordered) // steps
    runs = [ordered[i * n:(i + 1) * n] for i in range(steps)]
    names = [e[0] for e in runs[0]]
    if any([e[0] for e in run] != names for run in runs[1:]):
        return None, "the replays' kernel sequences differ"
    return [(name, statistics.median(run[i][2] for run in runs)) for i, name in enumerate(names)], None


def step_floor(shape: StepShape, bandwidth: float) -> dict:
    """The step's floor: its bytes, weights and KV apart, and its microseconds at ``bandwidth``."""
    kv = shape.num_layers * shape.kv_bytes_per_layer
    return {"bytes": shape.floor_bytes, "weight_bytes": shape.floor_bytes - kv, "kv_bytes": kv,
            "us": shape.floor_bytes / bandwidth * 1e6}


def build_table(sequence: Sequence[tuple[str, float]], shape: StepShape | None, bandwidth: float, *,
                steps: int = 1, warnings: Sequence[str] = ()) -> dict:
    """The kernel table of a replay's ``(kernel, us)`` launches (``steps`` replays of them), as a dict.

    ``shape`` None: times only. ``bandwidth`` in bytes per second, read plus written.
    """
    launches, found = attribute(sequence, shape)
    rows = group_rows(launches, steps)
    total_us = sum(r.us for r in rows)
    total_bytes = sum(r.bytes for r in rows if r.bytes is not None)

    def fraction(nbytes: int | None, us: float) -> float | None:
        return nbytes / (us * 1e-6) / bandwidth if nbytes and us > 0 else None

    table: dict = {
        "bandwidth_TBps": bandwidth / 1e12,
        "attributed": any(r.bytes is not None for r in rows),
        "warnings": [*warnings, *found],
        "rows": [{**dataclasses.asdict(r), "step_fraction": r.us / total_us if total_us else None,
                  "bw_fraction": fraction(r.bytes, r.us)} for r in rows],
        "total": {"count": sum(r.count for r in rows), "us": total_us, "bytes": total_bytes,
                  "us_without_bytes": sum(r.us for r in rows if r.bytes is None),
                  "bw_fraction": fraction(total_bytes, total_us)},
    }
    if shape is not None:
        table["floor"] = step_floor(shape, bandwidth)
    if steps == 1:
        table["sequence"] = [dataclasses.asdict(launch) for launch in launches]
    return table


def point_table(events: Sequence[tuple[str, float, float]], steps: int, shape: StepShape, bandwidth: float) -> dict:
    """The table of ``steps`` profiled replays' kernel ``events`` (name, start, duration)."""
    sequence, why = replay_sequence(events, steps)
    if sequence is None:
        # Per kernel name over all replays, no order to attribute bytes by.
        table = build_table([(name, us) for name, _, us in events], None, bandwidth, steps=steps,
                            warnings=[f"{why}: bytes not attributed, times only"])
        table["floor"] = step_floor(shape, bandwidth)
        return table
    return build_table(sequence, shape, bandwidth)


def _mb(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    mb = nbytes / 1e6
    return f"{mb:,.1f}" if mb >= 10 else f"{mb:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _us(us: float) -> str:
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def format_table(table: dict, top: int = 0) -> str:
    """The table as markdown, its ``top`` slowest rows (0: all), then the step's total and floor."""
    def count(c: float) -> str:
        return f"{c:.0f}" if abs(c - round(c)) < 1e-9 else f"{c:.2f}"

    lines = ["| kernel | role | per step | us/step | % of step | MB/step | bytes | % of BW |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    rows = table["rows"][:top] if top else table["rows"]
    for r in rows:
        lines.append(f"| `{r['kernel']}` | {r['role']} | {count(r['count'])} | {r['us']:.1f} | "
                     f"{_pct(r['step_fraction'])} | {_mb(r['bytes'])} | {r['bytes_kind']} | {_pct(r['bw_fraction'])} |")
    rest = table["rows"][len(rows):]
    if rest:
        us = sum(r["us"] for r in rest)
        lines.append(f"| ({len(rest)} more rows) | | {count(sum(r['count'] for r in rest))} | {us:.1f} | "
                     f"{_pct(us / table['total']['us'])} | | | |")
    t = table["total"]
    kinds = "/".join(k for k in BYTES_KINDS[:2] if any(r["bytes_kind"] == k for r in table["rows"])) or "-"
    lines.append(f"| **step total** | | {count(t['count'])} | {t['us']:.1f} | 100% | {_mb(t['bytes'] or None)} | "
                 f"{kinds} | {_pct(t['bw_fraction'])} |")
    lines.append("")
    if "floor" in table:
        f = table["floor"]
        lines.append(f"floor: {_mb(f['bytes'])} MB (weights {_mb(f['weight_bytes'])} + KV {_mb(f['kv_bytes'])}) "
                     f"at {table['bandwidth_TBps']:.2f} TB/s copy bandwidth = {_us(f['us'])} us")
    if "replay_us" in table:
        ratio = f"; floor / replay {table['floor']['us'] / table['replay_us']:.0%}" if "floor" in table else ""
        lines.append(f"replay: {_us(table['replay_us'])} us ({table.get('replay_timing', 'CUDA events')}); "
                     f"kernels sum to {_us(t['us'])} us{ratio}")
    if table["attributed"]:
        lines.append(f"bytes: min = the least the kernel must move (weights or KV, plus its rows in and out); "
                     f"est. = activations estimated; - = not estimated, left out of the total "
                     f"({t['us_without_bytes']:.0f} us of kernels)")
    lines += [f"WARNING: {w}" for w in table["warnings"]]
    return "\n".join(lines)


def synthetic_replay(shape: StepShape, bandwidth: float, drop_gemm: bool = False) -> list[tuple[str, float]]:
    """A replay's launches in the pattern of an H200 run (``results/profile_replay_h200.txt``),
    timed from their bytes at made-up efficiencies: what ``--smoke`` tabulates on a CPU."""
    def gemm_us(weight: Weight) -> float:
        return 2.0 + weight.nbytes / (0.85 * bandwidth) * 1e6

    reduce = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16>(int, int)"
    rotary = "triton_poi_fused__to_copy_add_attention_cat_cos_mul_sin_split_split_with_sizes_sub_unsqueeze_view_{}"
    norm = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_{}"
    gemm = {"qkv_proj": "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT",
            "o_proj": "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT",
            "gate_up_proj": "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT",
            "down_proj": "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT",
            "lm_head": "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT"}
    weights = list(shape.weights)
    if drop_gemm:
        del weights[1]
    seq = [("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >"
            "(int, at::native::FillFunctor<int>, std::array<char*, 1ul>)", 0.8)]
    for i, weight in enumerate(weights):
        if weight.kind in ("qkv_proj", "gate_up_proj", "lm_head"):
            seq.append((norm.format(7 + i % 4), 2.5))
        seq.append((gemm[weight.kind], gemm_us(weight)))
        if weight.kind == "qkv_proj":
            attention_bytes = shape.kv_bytes_per_layer + shape.qo_bytes_per_layer + shape.new_kv_bytes_per_layer
            seq += [(rotary.format(1), 1.5), (rotary.format(2), 1.5),
                    ("_decode_kernel", 5.0 + attention_bytes / (0.4 * bandwidth) * 1e6)]
        elif weight.kind in ("o_proj", "down_proj"):
            seq.append((reduce, 1.7))
        elif weight.kind == "gate_up_proj":
            seq.append(("triton_poi_fused_mul_silu_split_4", 1.6))
    return seq


def _events(sequence: Sequence[tuple[str, float]], steps: int) -> list[tuple[str, float, float]]:
    """``steps`` back-to-back replays of ``sequence`` as profiler events (name, start, duration)."""
    events, t = [], 0.0
    for _ in range(steps):
        for name, us in sequence:
            events.append((name, t, us))
            t += us
    return events


def smoke(args: argparse.Namespace) -> dict:
    """The tables on the CPU: the tiny model's shapes and a synthetic replay (times made up)."""
    model = LlamaModel(LlamaConfig.preset("tiny"), seed=0, dtype=torch.bfloat16).eval()
    results: dict = {"smoke": True, "copy_bandwidth_TBps": SMOKE_BANDWIDTH / 1e12, "args": vars(args), "points": []}
    for batch in args.batch:
        shape = step_shape(model, batch, args.context)
        for drop_gemm in (False, True):
            sequence = synthetic_replay(shape, SMOKE_BANDWIDTH, drop_gemm=drop_gemm)
            table = point_table(_events(sequence, args.steps), args.steps, shape, SMOKE_BANDWIDTH)
            table.update(batch=batch, context=args.context, replay_us=sum(us for _, us in sequence),
                         replay_timing="synthetic: the kernels' sum", synthetic=True, gemm_dropped=drop_gemm)
            what = "one GEMM dropped: the fallback" if drop_gemm else "synthetic replay"
            print(f"\n### tiny, batch {batch}, context {args.context}: {what}\n\n{format_table(table, args.top)}")
            results["points"].append(table)
    return results


def profile_gpu(args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    if args.keep_residual_addmm:
        import fullcg.passes.residual_addmm as residual_addmm

        residual_addmm.ENABLED = False
    if args.inductor:
        import torch._inductor.config as inductor_config

        for setting in args.inductor:
            name, _, value = setting.partition("=")
            if not hasattr(inductor_config, name):
                raise SystemExit(f"--inductor {setting}: Inductor has no setting {name!r}")
            setattr(inductor_config, name, ast.literal_eval(value))
    bw = copy_bandwidth(dev)
    results: dict = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "args": vars(args),
                     "copy_bandwidth_TBps": bw / 1e12, "points": []}
    print(f"{results['gpu']}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    cfg = LlamaConfig.preset(args.model)
    with torch.device(dev):
        model = LlamaModel(cfg, seed=None, dtype=torch.bfloat16, device=dev).eval()
    pages = max(args.batch) * -(-(args.context + 1) // PAGE) + 8
    model.allocate_kv_cache(pages, PAGE)
    for layer in model.attention_layers():
        layer.kv_cache.k.normal_()
        layer.kv_cache.v.normal_()
    # An A/B compiles afresh, so neither side's time depends on what a cache held.
    ab = args.keep_residual_addmm or args.inductor or args.no_skinny_linears
    caches = {"compile_cache": False, "warm_start": False} if ab else {}
    config = fullcg.FullCGConfig(attention_impl=args.impl, graph_mode="full", capture_sizes=tuple(args.batch),
                                 skinny_linears=not args.no_skinny_linears, **caches)
    backend = fullcg.Backend(config)
    compiled = torch.compile(model, backend=backend)
    with torch.inference_mode():
        for batch in args.batch:
            md = decode_metadata(batch, args.context, dev)
            ids = torch.zeros(batch, dtype=torch.long, device=dev)
            pos = torch.full((batch,), args.context, dtype=torch.long, device=dev)
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
            for _ in range(2):
                with fullcg.forward_context(md, model, config=config):
                    compiled(ids, pos)
            replay = captured_full_graph(backend, batch)
            if replay is None:
                raise SystemExit(f"no full decode graph of {batch} tokens was captured")
            replay_us = time_ms(replay, args.repeats) * 1e3
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    replay()
                torch.cuda.synchronize()
            events = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA]
            table = point_table(events, args.steps, step_shape(model, batch, args.context), bw)
            table.update(batch=batch, context=args.context, impl=args.impl, replay_us=replay_us,
                         replay_timing=f"CUDA events, median of {args.repeats}")
            print(f"\n### batch {batch}, context {args.context}, impl {args.impl}\n\n{format_table(table, args.top)}",
                  flush=True)
            results["points"].append(table)
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", choices=["tiny", "mid", "llama3_8b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--impl", default="triton")
    ap.add_argument("--steps", type=int, default=10, help="replays profiled")
    ap.add_argument("--repeats", type=int, default=50, help="replays timed with CUDA events")
    ap.add_argument("--top", type=int, default=0, help="print only the slowest rows (0: all)")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    ap.add_argument("--smoke", action="store_true", help="CPU: the tiny model's shapes and a synthetic replay")
    ap.add_argument("--inductor", nargs="+", metavar="NAME=VALUE", default=[],
                    help="Inductor settings for the run, as Python literals (combo_kernels=True): an A/B")
    ap.add_argument("--keep-residual-addmm", action="store_true",
                    help="keep Inductor's fusion of the residual add into the GEMM before it (an A/B of fullcg's split)")
    ap.add_argument("--no-skinny-linears", action="store_true",
                    help="the library GEMM for every linear (an A/B of fullcg's one-pass GEMV)")
    args = ap.parse_args(argv)
    results = smoke(args) if args.smoke else profile_gpu(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
