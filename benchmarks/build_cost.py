"""Host cost of ``AttentionMetadata.build`` for two batch shapes (CPU, no GPU needed).

- decode-64: 64 decode requests on prefixes of 500..1500 tokens;
- mixed-256: 256 requests, a quarter prefill / extend chunks, the rest decodes.

Pages are a random permutation (no page shared): of the batch's own pages, or with
``--cache-pages N`` drawn from an N-page cache (ids spread as in a long-running engine).
Prints the median of ``--repeats`` timings of ``--number`` builds each, in microseconds
per build. ``--breakdown`` also times, interleaved with whole builds, the validation alone
on the same host arrays: the page checks (range and shared written pages, on by default)
and the positions check (with ``positions=``), and their share of a batch-64 decode
step's host time (``--step-host-us``, the replay's host time on an H200, plus build).
``--against OLD.py`` times the ``build`` of another copy of ``fullcg/metadata.py`` (say
the previous commit's) interleaved with this one: a before/after that a busy machine
skews less than two separate runs.

    python benchmarks/build_cost.py [--repeats 21] [--number 200] [--num-pages] [--breakdown]
    git show HEAD~1:fullcg/metadata.py > old_metadata.py
    python benchmarks/build_cost.py --breakdown --against old_metadata.py
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

import fullcg
from fullcg import metadata

PAGE = 16


def batch(kind: str, seed: int = 0, cache_pages: int | None = None) -> tuple[list[int], list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "decode-64":
        prefixes = torch.randint(500, 1500, (64,), generator=g).tolist()
        q_lens = [1] * 64
    else:
        prefixes, q_lens = [], []
        for r in range(256):
            kind_r = r % 8
            if kind_r == 0:  # prefill chunk
                prefixes.append(0)
                q_lens.append(int(torch.randint(16, 128, (1,), generator=g)))
            elif kind_r == 1:  # extend chunk
                prefixes.append(int(torch.randint(64, 1024, (1,), generator=g)))
                q_lens.append(int(torch.randint(16, 128, (1,), generator=g)))
            else:
                prefixes.append(int(torch.randint(64, 2048, (1,), generator=g)))
                q_lens.append(1)
    need = [-(-(p + q) // PAGE) for p, q in zip(prefixes, q_lens)]
    width = max(need)
    perm = torch.randperm(sum(need), generator=g).to(torch.int32)
    if cache_pages is not None:
        if cache_pages < sum(need):
            raise SystemExit(f"--cache-pages {cache_pages} is fewer than the {sum(need)} pages {kind} uses")
        perm = torch.randperm(cache_pages, generator=g)[: sum(need)].to(torch.int32)
    table = torch.zeros(len(need), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used : used + n]
        used += n
    return q_lens, prefixes, table


def median_us(fns: dict[str, Callable[[], object]], repeats: int, number: int) -> dict[str, float]:
    """Median microseconds per call of each function, timed in interleaved rounds (so a slow
    spell of a shared machine hits them all alike)."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times[name].append((time.perf_counter() - t0) / number * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def checks(module: ModuleType, q_lens: list[int], prefixes: list[int], table: torch.Tensor,
           num_pages: int | None) -> dict[str, Callable[[], object]]:
    """The validation ``build`` of ``module`` (a ``fullcg/metadata.py``) runs on this batch,
    alone, on the host arrays its ``build`` derives (earlier versions: their page helpers)."""
    q, p = np.array(q_lens, dtype=np.int64), np.array(prefixes, dtype=np.int64)
    seq = q + p
    starts = np.concatenate([[0], np.cumsum(q)])
    pos = np.arange(int(q.sum())) + np.repeat(p - starts[:-1], q)
    positions = torch.from_numpy(pos)
    if hasattr(module, "_check_pages"):
        width = -(-int(seq.max()) // PAGE)
        pt = np.ascontiguousarray(table.numpy()[:, :width], dtype=np.intp)
        entries = np.repeat(np.arange(len(q)) * width, q) + pos // PAGE
        written = pt.take(entries)
        return {
            "page checks": lambda: module._check_pages(pt, seq, PAGE, q, num_pages, entries, written),
            "positions check": lambda: module._check_positions(positions, pos, q),
        }
    # Before the page checks had one entry point: used entries extracted, then two checks.
    req_idx = np.repeat(np.arange(len(q)), q)
    table_np = table.numpy()
    written = table_np.astype(np.int64)[req_idx, pos // PAGE]

    def page_checks() -> None:
        pt, used, used_mask = module._used_pages(table_np, seq, PAGE)
        max_page = module._check_page_range(pt, used, used_mask, num_pages)
        module._check_no_shared_writes(used, used_mask, written, req_idx, max_page)

    return {"page checks": page_checks, "positions check": lambda: module._check_positions(positions, pos, req_idx)}


def load_metadata(path: str) -> ModuleType:
    """Another copy of ``fullcg/metadata.py`` as a module (it imports fullcg's other modules)."""
    spec = importlib.util.spec_from_file_location("_baseline_metadata", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--num-pages", action="store_true", help="pass num_pages= (range checks at build)")
    parser.add_argument("--cache-pages", type=int, default=None, help="draw page ids from a cache of this many pages")
    parser.add_argument("--breakdown", action="store_true", help="also time the checks alone, and build with positions=")
    parser.add_argument("--step-host-us", type=float, default=220.0,
                        help="host time of a batch-64 full-graph decode replay besides build (H200: 220)")
    parser.add_argument("--against", metavar="OLD.py", help="also time build from this copy of fullcg/metadata.py")
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = load_metadata(args.against) if args.against else None
    has_num_pages = "num_pages" in inspect.signature(fullcg.AttentionMetadata.build).parameters
    for kind in ("decode-64", "mixed-256"):
        q_lens, prefixes, table = batch(kind, cache_pages=args.cache_pages)
        kwargs = {}
        if args.num_pages and has_num_pages:
            kwargs["num_pages"] = args.cache_pages or int(table.max()) + 1
        fns = {"build": lambda: fullcg.AttentionMetadata.build(q_lens, prefixes, table, PAGE, **kwargs)}
        if baseline is not None:
            fns["baseline build"] = lambda: baseline.AttentionMetadata.build(q_lens, prefixes, table, PAGE, **kwargs)
        if args.breakdown:
            positions = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, prefixes)])
            fns["build, positions="] = lambda: fullcg.AttentionMetadata.build(
                q_lens, prefixes, table, PAGE, positions=positions, **kwargs)
            fns.update(checks(metadata, q_lens, prefixes, table, kwargs.get("num_pages")))
            if baseline is not None:
                fns.update({f"baseline {name}": fn for name, fn in
                            checks(baseline, q_lens, prefixes, table, kwargs.get("num_pages")).items()})
        us = median_us(fns, args.repeats, args.number)
        print(f"{kind}: {us['build']:.1f} us per build ({len(q_lens)} requests, "
              f"{sum(q_lens)} tokens, {table.shape[1]} page columns{', num_pages=' if kwargs else ''}"
              f"{kwargs.get('num_pages', '')}{f', ids from {args.cache_pages} pages' if args.cache_pages else ''})")
        if baseline is not None:
            print(f"  {args.against}: {us['baseline build']:.1f} us per build")
        if args.breakdown:
            step = us["build"] + args.step_host_us
            print(f"  build with positions=: {us['build, positions=']:.1f} us")
            for name in ("page checks", "positions check"):
                print(f"  {name} alone: {us[name]:.1f} us = {100 * us[name] / us['build']:.1f}% of build, "
                      f"{100 * us[name] / step:.1f}% of build + {args.step_host_us:.0f} us"
                      + (f" ({args.against}: {us['baseline ' + name]:.1f} us)" if baseline is not None else ""))


if __name__ == "__main__":
    main()
