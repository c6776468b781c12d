"""One process of the warm-start tests: ``fullcg.compile`` a tiny Llama, run prefill and
decode steps against eager, and print as one JSON line what the compile cache did and how
many frames Dynamo traced.

Run as ``python tests/warm_start_worker.py <model dir> [layers] [device]`` with
``FULLCG_CACHE_DIR`` set (on ``cuda``, steps run in CUDA graphs, ``full_and_piecewise``);
``<model dir>/warm_model.py`` defines ``Model``, a ``LlamaModel`` whose forward calls
``warm_helper.py`` beside it (the tests edit these files).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import sys

import torch
from torch._dynamo.utils import counters

import fullcg
from fullcg.compile_cache import cache_stats
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, sys.argv[1])
    model_class = importlib.import_module("warm_model").Model
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
    model = model_class(LlamaConfig.tiny(num_layers=layers), seed=0).to(device)
    model.allocate_kv_cache(num_pages=16, page_size=4)
    eager = copy.deepcopy(model)
    compiled = fullcg.compile(model, graph_mode="none" if device.type == "cpu" else "full_and_piecewise",
                              compiler="inductor", capture_sizes=[1, 2, 4, 8])
    s_eager, s_comp = (Scheduler([[1, 2, 3, 4, 5], [6, 7]], 3, num_pages=16, page_size=4, device=device)
                       for _ in range(2))
    worst = 0.0
    with torch.inference_mode():
        while (step := s_eager.next_step()) is not None:
            step_c = s_comp.next_step()
            with fullcg.forward_context(step.metadata, eager):
                expected = eager(step.input_ids, step.positions)
            with fullcg.forward_context(step_c.metadata, model):
                got = compiled(step_c.input_ids, step_c.positions)
            worst = max(worst, (expected - got).abs().max().item())
            s_eager.commit(step, expected)
            s_comp.commit(step_c, expected)
    print(json.dumps({
        "fullcg": dict(cache_stats()),
        "dynamo_frames": counters["frames"].get("total", 0),
        "graphs": len(compiled.runners),
        "steps": dict(compiled.step_counts()),
        "max_abs_diff": worst,
    }))


if __name__ == "__main__":
    main()
