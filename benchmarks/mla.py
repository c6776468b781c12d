"""Multi-head latent attention on a GPU: absorbed decode against FlashInfer and the bandwidth
floor, extend in MHA form against absorbed, cache bytes, and a small MLA model's decode step.

    python benchmarks/mla.py [--out benchmarks/results/mla_h200.json] [--quick]

DeepSeek-V3's attention dims (latent 512, rope 64, nope 128, v 128), bf16, pages of 64:

- ``decode`` rows: one layer's absorbed decode over the latent cache, new token saved, at
  16 and 128 heads, batch 1/8/64, contexts 4k-32k. ``triton`` is fullcg's kernel as the
  ``triton`` implementation plans it (``fullcg.ops.kernels.mla.plan_mla``), ``flashinfer``
  FlashInfer's ``BatchMLAPagedAttentionWrapper`` (planned once, strided views of the same
  latent cache). Each launch reads another copy of the cache (copies past the L2 several
  times) and a burst of launches is replayed from one CUDA graph, so each figure is GPU time
  per launch from DRAM: the median over repeats of burst time / launches. ``floor_ms`` is
  the latent bytes one launch reads over the device's measured copy bandwidth.
- ``extend`` rows: one request adding 512 tokens to an 8k or 32k cached prefix (and 4096
  tokens to none or 8k) through
  ``fullcg.MLAAttention`` (``attention_impl="auto"``): in MHA form (new tokens up-projected,
  the prefix chunk by chunk), absorbed, and as the defaults (``mla_mha_min_tokens``,
  ``mla_mha_min_heads``) pick; at 16 and 128 heads, or ``--extend-heads``.
  ``floor_ms`` there is the absorbed form's latent bytes over the copy bandwidth.
- ``cache_bytes_per_token``: the latent cache against decompressed keys and values.
- ``model``: a 4-layer DeepSeek-shaped model's decode step at batch 8 (1k context), captured
  without a compiler, as a full graph and piecewise; one row per ``--model-impls``
  implementation (``auto`` by default).

Writes the rows as JSON (``kind``, ``batch``, ``context``, ``heads``, ``floor_ms`` and
``impls`` mapping each implementation to ``{"ms": ...}``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import fullcg
from fullcg.mla import allocate_latent_cache

RANK, ROPE, NOPE, VDIM, PAGE = 512, 64, 128, 128, 64
DTYPE = torch.bfloat16
#: Bytes of cache copies a burst rotates through: several times an H200's 60 MiB L2.
ROTATION_BYTES = 512 << 20
SCALE = 1.0 / math.sqrt(NOPE + ROPE)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second a large device-to-device copy moves (read plus written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def graph_ms(run: Callable[[int], None], calls: int, dev: torch.device, repeats: int = 5) -> float:
    """Median milliseconds per call of ``run(i)`` over ``repeats`` replays of one CUDA graph
    holding ``calls`` calls (GPU time, no host launch cost)."""
    for i in range(3):
        run(i)
    torch.cuda.synchronize(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        run(0)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            run(i)
    graph.replay()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def events_ms(run: Callable[[], None], calls: int, dev: torch.device, repeats: int = 5) -> float:
    """Median milliseconds per call of ``run()`` launched from Python (work large enough
    that the GPU, not the host, sets the pace)."""
    for _ in range(2):
        run()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


class DecodeShape:
    """Latent caches (rotated copies), page table and step tensors of one decode shape."""

    def __init__(self, heads: int, batch: int, context: int, dev: torch.device) -> None:
        self.heads, self.batch, self.context = heads, batch, context
        self.kv_len = context + 1  # the prefix and the new token
        self.pages_per_request = math.ceil(self.kv_len / PAGE)
        num_pages = batch * self.pages_per_request
        cache_bytes = num_pages * PAGE * (RANK + ROPE) * 2
        copies = max(1, math.ceil(ROTATION_BYTES / cache_bytes))
        self.caches = [allocate_latent_cache(num_pages, PAGE, RANK, ROPE, dtype=DTYPE, device=dev) for _ in range(copies)]
        for cache in self.caches:
            cache.k.normal_()
        pages = torch.randperm(num_pages, dtype=torch.int32)  # scattered, as an engine's
        self.page_table = pages.view(batch, self.pages_per_request).to(dev)
        self.kv_indices = pages.to(dev)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((batch,), self.kv_len, dtype=torch.int32, device=dev)
        positions = self.seq_lens.long() - 1
        rows = self.page_table.long().gather(1, (positions // PAGE)[:, None])[:, 0]
        self.slot_mapping = (rows * PAGE + positions % PAGE).to(torch.int32)
        self.q = torch.randn(batch, heads, RANK + ROPE, dtype=DTYPE, device=dev)
        self.k_new = torch.randn(batch, 1, RANK + ROPE, dtype=DTYPE, device=dev)
        self.out = torch.empty(batch, heads, RANK, dtype=DTYPE, device=dev)
        self.lse = torch.empty(batch, heads, dtype=torch.float32, device=dev)

    @property
    def latent_bytes(self) -> int:
        return self.batch * self.kv_len * (RANK + ROPE) * 2


def triton_decode_ms(shape: DecodeShape, dev: torch.device, calls: int) -> float:
    from fullcg.ops.kernels.mla import plan_mla

    s = shape
    workspace: dict = {}
    launch = plan_mla(s.q, s.caches[0].k, s.out, s.lse, query_start_loc=s.query_start_loc, page_table=s.page_table,
                      seq_lens=s.seq_lens, scale=SCALE, slot_mapping=s.slot_mapping,
                      new_kv=(s.k_new, s.k_new[..., :RANK]), workspace=workspace)

    def run(i: int) -> None:
        launch(s.q, s.caches[i % len(s.caches)].k, s.out, s.lse, s.k_new, s.k_new[..., :RANK])

    return graph_ms(run, calls, dev)


def flashinfer_decode_ms(shape: DecodeShape, dev: torch.device, calls: int) -> float:
    import flashinfer

    s = shape
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    wrapper.plan(
        s.query_start_loc.cpu(), (torch.arange(s.batch + 1, dtype=torch.int32) * s.pages_per_request),
        s.kv_indices.cpu(), s.seq_lens.cpu(), num_heads=s.heads, head_dim_ckv=RANK, head_dim_kpe=ROPE,
        page_size=PAGE, causal=True, sm_scale=SCALE, q_data_type=DTYPE, kv_data_type=DTYPE,
    )
    # kv_indptr and kv_indices follow the page table row by row.
    views = [(c.k[:, :, 0, :RANK], c.k[:, :, 0, RANK:]) for c in s.caches]
    q_nope, q_pe = s.q[..., :RANK], s.q[..., RANK:]

    def run(i: int) -> None:
        ckv, kpe = views[i % len(views)]
        wrapper.run(q_nope, q_pe, ckv, kpe, out=s.out, lse=s.lse, return_lse=True)

    return graph_ms(run, calls, dev)


def decode_rows(dev: torch.device, bandwidth: float, quick: bool) -> list[dict]:
    rows = []
    for heads in (16, 128):
        for batch in (1, 8, 64):
            for context in ((8192,) if quick else (4096, 8192, 16384, 32768)):
                shape = DecodeShape(heads, batch, context, dev)
                calls = 20 if batch * context >= 64 * 8192 else 50
                impls = {}
                for name, fn in (("triton", triton_decode_ms), ("flashinfer", flashinfer_decode_ms)):
                    try:
                        impls[name] = {"ms": round(fn(shape, dev, calls), 5)}
                    except Exception as exc:  # noqa: BLE001 - a row says what failed, the sweep goes on
                        impls[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                floor = shape.latent_bytes / bandwidth * 1e3
                row = {"kind": "decode", "batch": batch, "context": context, "heads": heads,
                       "floor_ms": round(floor, 5), "impls": impls}
                for v in impls.values():
                    if "ms" in v:
                        v["floor_fraction"] = round(floor / v["ms"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del shape
                torch.cuda.empty_cache()
    return rows


class _ExtendLayer(torch.nn.Module):
    def __init__(self, heads: int, dev: torch.device) -> None:
        super().__init__()
        self.mla = fullcg.MLAAttention(heads, RANK, NOPE, ROPE, VDIM, layer_id=0)
        self.kv_b = torch.randn(heads * (NOPE + VDIM), RANK, dtype=DTYPE, device=dev) / math.sqrt(RANK)


#: (new tokens, cached prefix) of the extend rows: a 512-token extend on 8k and 32k
#: prefixes, and 4096-token prompts with no prefix and on an 8k one.
EXTENDS = ((512, 8192), (512, 32768), (4096, 0), (4096, 8192))


def extend_rows(dev: torch.device, bandwidth: float, quick: bool, head_counts: tuple[int, ...] = (16, 128)
                ) -> list[dict]:
    rows = []
    for heads in head_counts:
        for new, context in (EXTENDS[:1] if quick else EXTENDS):
            layer = _ExtendLayer(heads, dev)
            pages = math.ceil((context + new) / PAGE)
            layer.mla.allocate_kv_cache(pages, PAGE, dtype=DTYPE, device=dev)
            layer.mla.kv_cache.k.normal_()
            table = torch.arange(pages, dtype=torch.int32)[None]
            md = fullcg.AttentionMetadata.build([new], [context], table, PAGE, device=dev)
            g = torch.Generator(device=dev).manual_seed(0)
            x = {"q_nope": torch.randn(new, heads, NOPE, generator=g, device=dev, dtype=DTYPE),
                 "q_pe": torch.randn(new, heads, ROPE, generator=g, device=dev, dtype=DTYPE),
                 "latent": torch.randn(new, RANK, generator=g, device=dev, dtype=DTYPE),
                 "k_pe": torch.randn(new, ROPE, generator=g, device=dev, dtype=DTYPE)}
            impls = {}
            forms = {"mha": dict(mla_mha_min_tokens=1, mla_mha_min_heads=1), "absorbed": dict(mla_mha_min_tokens=None),
                     "default": {}}
            for name, options in forms.items():
                config = fullcg.FullCGConfig(attention_impl="auto", **options)

                def run() -> None:
                    with fullcg.forward_context(md, layer, config=config):
                        layer.mla(x["q_nope"], x["q_pe"], x["latent"], x["k_pe"], layer.kv_b)

                try:
                    with torch.inference_mode():
                        impls[name] = {"ms": round(events_ms(run, 5, dev), 4)}
                except Exception as exc:  # noqa: BLE001
                    impls[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            floor = (context + new) * (RANK + ROPE) * 2 / bandwidth * 1e3
            row = {"kind": "extend", "batch": 1, "context": context, "new_tokens": new, "heads": heads,
                   "floor_ms": round(floor, 5), "impls": impls}
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def model_rows(dev: torch.device, attention_impl: str = "auto") -> list[dict]:
    from fullcg.models.deepseek import DeepseekConfig, DeepseekModel

    cfg = DeepseekConfig.tiny(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=4, num_heads=16,
        q_lora_rank=None, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VDIM,
        first_k_dense_replace=4,
    )
    batch, context = 8, 1024
    rows = []
    impls = {}
    for mode in ("full", "piecewise"):
        torch.manual_seed(0)
        model = DeepseekModel(cfg, dtype=DTYPE, device=dev)
        pages = batch * math.ceil((context + 1) / PAGE)
        model.allocate_kv_cache(pages, PAGE, dtype=DTYPE, device=dev)
        table = torch.arange(pages, dtype=torch.int32).view(batch, -1)
        md = fullcg.AttentionMetadata.build([1] * batch, [context] * batch, table, PAGE, device=dev)
        run = fullcg.compile(model, compiler="none", graph_mode=mode, attention_impl=attention_impl, capture_sizes=(8,))
        ids = torch.zeros(batch, dtype=torch.long, device=dev)
        positions = torch.full((batch,), context, dtype=torch.long, device=dev)

        def step() -> None:
            with fullcg.forward_context(md, model, config=fullcg.FullCGConfig(attention_impl=attention_impl)):
                run(ids, positions)

        with torch.inference_mode():
            impls[mode] = {"ms": round(events_ms(step, 50, dev), 4), "counts": dict(run.step_counts())}
        torch.cuda.empty_cache()
    row = {"kind": "model_decode_step", "batch": batch, "context": context, "heads": 16, "layers": 4,
           "attention_impl": attention_impl, "floor_ms": None, "impls": impls}
    print(json.dumps(row), flush=True)
    rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="one context per shape")
    parser.add_argument("--parts", nargs="+", default=["decode", "extend", "model"])
    parser.add_argument("--model-impls", nargs="+", default=["auto"],
                        help="attention implementations of the model rows (one row each)")
    parser.add_argument("--extend-heads", type=int, nargs="+", default=[16, 128], help="query heads of the extend rows")
    args = parser.parse_args()
    dev = torch.device("cuda")
    started = time.time()
    bandwidth = copy_bandwidth(dev)
    rows: list[dict] = []
    if "decode" in args.parts:
        rows += decode_rows(dev, bandwidth, args.quick)
    if "extend" in args.parts:
        rows += extend_rows(dev, bandwidth, args.quick, tuple(args.extend_heads))
    if "model" in args.parts:
        for impl in args.model_impls:
            rows += model_rows(dev, impl)
    result = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "command": " ".join(["python benchmarks/mla.py", *sys.argv[1:]]),
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "cache_bytes_per_token": {
            str(h): {"latent": (RANK + ROPE) * 2, "decompressed": h * (NOPE + ROPE + VDIM) * 2} for h in (16, 128)
        },
        "rows": rows,
        "seconds": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
