"""Host cost of ``AttentionMetadata.build`` for two batch shapes (CPU, no GPU needed).

- decode-64: 64 decode requests on prefixes of 500..1500 tokens;
- mixed-256: 256 requests, a quarter prefill / extend chunks, the rest decodes.

Pages are a random permutation (no page shared). Prints the median of ``--repeats``
timings of ``--number`` builds each, in microseconds per build.

    python benchmarks/build_cost.py [--repeats 21] [--number 200] [--num-pages]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

import fullcg

PAGE = 16


def batch(kind: str, seed: int = 0) -> tuple[list[int], list[int], torch.Tensor]:
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
    table = torch.zeros(len(need), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used : used + n]
        used += n
    return q_lens, prefixes, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--num-pages", action="store_true", help="pass num_pages= (range checks at build)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    has_num_pages = "num_pages" in inspect.signature(fullcg.AttentionMetadata.build).parameters
    for kind in ("decode-64", "mixed-256"):
        q_lens, prefixes, table = batch(kind)
        kwargs = {}
        if args.num_pages and has_num_pages:
            kwargs["num_pages"] = int(table.max()) + 1
        for _ in range(20):
            fullcg.AttentionMetadata.build(q_lens, prefixes, table, PAGE, **kwargs)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.number):
                fullcg.AttentionMetadata.build(q_lens, prefixes, table, PAGE, **kwargs)
            times.append((time.perf_counter() - t0) / args.number * 1e6)
        print(f"{kind}: {statistics.median(times):.1f} us per build ({len(q_lens)} requests, "
              f"{sum(q_lens)} tokens, {table.shape[1]} page columns{', num_pages=' if kwargs else ''}"
              f"{kwargs.get('num_pages', '')})")


if __name__ == "__main__":
    main()
