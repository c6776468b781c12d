"""The example scheduler: every request at once, a fixed prompt chunk, greedy sampling.

:class:`Scheduler` is :class:`fullcg.engine.BatchScheduler` configured the simplest
way: no step budget and no request limit, so every request runs from the first step,
each feeding at most ``prefill_chunk`` prompt tokens per step (prefill, then extend);
``commit`` samples greedily. Steps may mix prefill, extend and decode requests. The demo,
the tests and the benchmarks drive models with it; :func:`fullcg.generate` is the engine
(token budget, requests joining as others finish, sampling, compilation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import fullcg
from fullcg.engine import BatchScheduler, Request, Step

__all__ = ["Request", "Step", "Scheduler", "greedy_generate"]


class Scheduler(BatchScheduler):
    """Schedules all requests together with a per-request prompt chunk (chunked prefill).

    Args:
        prompts: token ids per request.
        max_new_tokens: tokens to generate per request.
        num_pages, page_size: size of the paged KV cache the model holds.
        prefill_chunk: most prompt tokens a request feeds in one step; a longer prompt is
            prefilled over several steps (prefill, then extend).
        prefix_chunk_tokens: rows of one gathered prefix chunk (chunked-prefix attention).
        device: where step tensors live.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        num_pages: int,
        page_size: int,
        prefill_chunk: int = 1 << 30,
        prefix_chunk_tokens: int = 4096,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(
            prompts, max_new_tokens, num_pages=num_pages, page_size=page_size, prefill_chunk=prefill_chunk,
            prefix_chunk_tokens=prefix_chunk_tokens, device=device,
        )

    def commit(self, step: Step, logits: torch.Tensor) -> list[int | None]:
        """Advance requests after ``step`` ran: greedy-sample where a token is due."""
        rows = [row for row in step.sample_rows if row is not None]
        # One argmax and one copy to the host for the step, not one per row.
        picked = iter(logits[rows].argmax(dim=-1).tolist() if rows else [])
        sampled = [next(picked) if row is not None else None for row in step.sample_rows]
        self.advance(step, sampled)
        return sampled


def greedy_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill_chunk: int = 1 << 30,
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    config: fullcg.FullCGConfig | None = None,
) -> list[list[int]]:
    """Greedy decoding of ``prompts``; ``run`` (default: ``model``) computes logits of a step.

    ``model`` must hold KV caches (``model.allocate_kv_cache``) large enough for all requests.
    """
    run = run or model
    layer = next(m for m in model.modules() if isinstance(m, fullcg.Attention))
    if layer.kv_cache is None:
        raise RuntimeError("allocate the model's KV cache first (model.allocate_kv_cache)")
    sched = Scheduler(
        prompts, max_new_tokens, num_pages=layer.kv_cache.num_pages, page_size=layer.kv_cache.page_size,
        prefill_chunk=prefill_chunk, device=layer.kv_cache.k.device,
    )
    while (step := sched.next_step()) is not None:
        with fullcg.forward_context(step.metadata, model, config=config):
            logits = run(step.input_ids, step.positions)
        sched.commit(step, logits)
    return [r.generated for r in sched.requests]
