"""Triton kernels for skip-softmax attention (used by the ``triton`` attention implementation).

* :func:`prefill_attention`: prefill/extend over a variable-length batch, from the paged
  KV cache or from ragged k/v, causal or not, GQA-packed row blocks, LSE out.
* :func:`decode_attention`: split-KV decode over the same sources, reduced by LSE.

Both apply the skip-softmax rule of docs/ops.md at the config's tile sizes and add tiles visited
and skipped to a layer's ``int64 [2, 2]`` counter tensor with atomics. Set
``TRITON_INTERPRET=1`` before importing this package to run the kernels on the CPU.
"""

from fullcg.ops.kernels.decode import decode_attention
from fullcg.ops.kernels.prefill import prefill_attention

__all__ = ["prefill_attention", "decode_attention"]
