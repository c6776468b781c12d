"""fullcg: LLM attention as a first-class citizen of ``torch.compile`` and CUDA graphs.

The public surface:

- :class:`Attention`: the layer a decoder uses for attention; :class:`MLAAttention`, its
  multi-head latent form (DeepSeek) over a latent cache;
- :func:`compile`: compile a model with fullcg, its token dimension dynamic from the first step;
- :class:`Backend`: the compile backend, configured (``backend="fullcg"`` also works);
- :func:`forward_context`, :class:`AttentionMetadata`, :class:`ForwardMode`: per-step data;
- :class:`KVCache`: a layer's paged KV cache;
- :class:`FullCGConfig`, :class:`SkipSoftmaxConfig`: configuration;
- :func:`merge_attn_states`: exact merge of two partial attention results by LSE;
- :func:`skip_softmax_stats`, :func:`reset_skip_softmax_stats`: skip-softmax counters;
- :func:`calibrate_skip_softmax`, :class:`SkipSoftmaxProbe`: skip-softmax factors measured
  on a model and text, and chosen for a target;
- :class:`TensorParallel`: the tensor-parallel group a model is sharded over (with the
  ``fullcg::all_reduce`` op and the parallel linears in :mod:`fullcg.distributed`);
- :class:`PageOwnership`: a cross-step guard on which request owns each KV-cache page;
- :mod:`fullcg.errors`: the exception types fullcg raises on bad input;
- :func:`capture`: capture CUDA graphs for every capture size up front;
- :func:`graph_mode_counts`: how compiled steps ran (full/piecewise, captured/eager);
- :func:`generate`: offline generation with continuous batching (any fullcg model, or a
  Hugging Face one through :mod:`fullcg.integrations.transformers`); its scheduler and
  sampler are in :mod:`fullcg.engine`.

Importing fullcg registers the ``torch.ops.fullcg`` ops.
"""

from fullcg.backend import Backend, CompiledModel, compile
from fullcg.config import FullCGConfig, SkipSoftmaxConfig
from fullcg.context import forward_context, get_forward_context
from fullcg.metadata import AttentionMetadata, ForwardMode
from fullcg.kv_cache import KVCache
from fullcg.layer import Attention
from fullcg.mla import MLAAttention
from fullcg.ownership import PageOwnership
from fullcg.distributed import TensorParallel
from fullcg import errors
from fullcg.ops import merge_attn_states
from fullcg.runner import capture, graph_mode_counts, reset_graph_mode_counts
from fullcg.telemetry import SkipSoftmaxStats, reset_skip_softmax_stats, skip_softmax_stats
from fullcg.calibrate import (
    SkipSoftmaxCalibration, SkipSoftmaxMeasurement, SkipSoftmaxProbe, calibrate_skip_softmax,
)
from fullcg.engine import GenerateStats, generate

__version__ = "0.1.0"

__all__ = [
    "CompiledModel",
    "compile",
    "Attention",
    "MLAAttention",
    "Backend",
    "AttentionMetadata",
    "ForwardMode",
    "FullCGConfig",
    "KVCache",
    "PageOwnership",
    "TensorParallel",
    "errors",
    "SkipSoftmaxConfig",
    "SkipSoftmaxStats",
    "SkipSoftmaxCalibration",
    "SkipSoftmaxMeasurement",
    "SkipSoftmaxProbe",
    "calibrate_skip_softmax",
    "capture",
    "graph_mode_counts",
    "reset_graph_mode_counts",
    "forward_context",
    "generate",
    "GenerateStats",
    "get_forward_context",
    "merge_attn_states",
    "reset_skip_softmax_stats",
    "skip_softmax_stats",
]
