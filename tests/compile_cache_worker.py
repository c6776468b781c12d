"""One process of the compile-cache tests: compile a tiny Llama, run a prefill and a
decode step, check them against eager, and print what the caches did as one JSON line.

Run as ``python tests/compile_cache_worker.py``, with ``FULLCG_CACHE_DIR`` set.
"""

from __future__ import annotations

import copy
import json
import logging
import time

import torch
from torch._dynamo.utils import counters

import fullcg
from fullcg.backend import Backend
from fullcg.compile_cache import cache_stats
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel


def _count_calls(module: object, name: str, counts: dict[str, int], key: str) -> None:
    """Count the calls of ``module.name`` (left to run as before) in ``counts[key]``."""
    real = getattr(module, name)
    counts[key] = 0

    def spy(*args: object, **kwargs: object) -> object:
        counts[key] += 1
        return real(*args, **kwargs)

    setattr(module, name, spy)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    # What a cache hit can spare Inductor: probing the CPU's instruction sets (a test library
    # built and loaded in a child process per set) and preparing a precompiled header.
    from torch._inductor import codecache, cpu_vec_isa

    learnt: dict[str, int] = {}
    _count_calls(cpu_vec_isa.VecISA, "check_build", learnt, "isa_probes")
    _count_calls(codecache, "_precompile_header", learnt, "header_builds")
    model = LlamaModel(LlamaConfig.tiny(num_layers=3), seed=0)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    eager = copy.deepcopy(model)
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="inductor")
    compiled = torch.compile(model, backend=Backend(config))
    s_eager, s_comp = (Scheduler([[1, 2, 3, 4, 5], [6, 7]], 2, num_pages=16, page_size=4) for _ in range(2))
    worst, first_step_s = 0.0, None
    with torch.inference_mode():
        while (step := s_eager.next_step()) is not None:
            step_c = s_comp.next_step()
            with fullcg.forward_context(step.metadata, eager, config=config):
                expected = eager(step.input_ids, step.positions)
            with fullcg.forward_context(step_c.metadata, model, config=config):
                got = compiled(step_c.input_ids, step_c.positions)
            first_step_s = first_step_s or time.perf_counter() - start
            worst = max(worst, (expected - got).abs().max().item())
            s_eager.commit(step, expected)
            s_comp.commit(step_c, expected)
    print(json.dumps({
        "fullcg": dict(cache_stats()),
        "inductor": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        "max_abs_diff": worst,
        "learnt": learnt,
        "first_step_s": first_step_s,
    }))


if __name__ == "__main__":
    main()
