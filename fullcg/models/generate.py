"""A minimal scheduler that turns prompts into steps: prefill, extend (chunked prefill), decode.

It owns page allocation and builds each step's inputs and :class:`fullcg.AttentionMetadata`;
a step may mix requests in different forward modes. It is what the demo, the benchmarks
and the tests drive models with, and a readable example of what an engine does around
fullcg.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

import fullcg
from fullcg.metadata import AttentionMetadata, ForwardMode

__all__ = ["Request", "Step", "Scheduler", "greedy_generate"]


@dataclasses.dataclass
class Request:
    """One sequence: its prompt, what it generated, and where its KV lives."""

    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose k/v are in the cache
    pages: list[int] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def in_prompt(self) -> bool:
        return self.num_cached < len(self.prompt)


@dataclasses.dataclass
class Step:
    """One model call: inputs, metadata, and which requests sample a token from which row."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    requests: list[Request]
    sample_rows: list[int | None]  # row of the logits each request samples from, None mid-prompt

    @property
    def modes(self) -> tuple[ForwardMode, ...]:
        return self.metadata.forward_modes


class Scheduler:
    """Schedules requests into steps with a per-request prompt chunk (chunked prefill).

    Args:
        prompts: token ids per request.
        max_new_tokens: tokens to generate per request.
        num_pages, page_size: size of the paged KV cache the model holds.
        prefill_chunk: most prompt tokens a request feeds in one step; a longer prompt is
            prefilled over several steps (prefill, then extend).
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
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every request needs a non-empty prompt")
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk}")
        self.requests = [Request(list(p), max_new_tokens) for p in prompts]
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self.device = torch.device(device)
        self._free_pages = list(range(num_pages))

    def _reserve(self, req: Request, length: int) -> None:
        need = math.ceil(length / self.page_size) - len(req.pages)
        if need > len(self._free_pages):
            raise RuntimeError("the KV cache is out of pages; allocate more (num_pages)")
        for _ in range(need):
            req.pages.append(self._free_pages.pop(0))

    def next_step(self) -> Step | None:
        """The next batch of work, or None when every request is done."""
        active = [r for r in self.requests if not r.done]
        if not active:
            return None
        ids: list[int] = []
        pos: list[int] = []
        q_lens, p_lens, modes, rows = [], [], [], []
        for req in active:
            prefix = req.num_cached
            if req.in_prompt:
                new = req.prompt[prefix : prefix + self.prefill_chunk]
                mode = ForwardMode.PREFILL if prefix == 0 else ForwardMode.EXTEND
            else:
                new = [req.tokens[-1]]
                mode = ForwardMode.DECODE
            self._reserve(req, prefix + len(new))
            ids += new
            pos += range(prefix, prefix + len(new))
            q_lens.append(len(new))
            p_lens.append(prefix)
            modes.append(mode)
            finishes_prompt = prefix + len(new) >= len(req.prompt)
            rows.append(len(ids) - 1 if finishes_prompt else None)
        width = max(len(r.pages) for r in active)
        table = torch.zeros(len(active), width, dtype=torch.int32)
        for i, req in enumerate(active):
            table[i, : len(req.pages)] = torch.tensor(req.pages, dtype=torch.int32)
        md = AttentionMetadata.build(
            q_lens, p_lens, table, self.page_size, modes, prefix_chunk_tokens=self.prefix_chunk_tokens,
            device=self.device,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        # The token count changes every step: tell Dynamo up front, so one graph serves all.
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        return Step(input_ids, positions, md, active, rows)

    def commit(self, step: Step, logits: torch.Tensor) -> list[int | None]:
        """Advance requests after ``step`` ran: greedy-sample where a token is due."""
        sampled: list[int | None] = []
        for req, q_len, row in zip(step.requests, step.metadata.query_lens, step.sample_rows):
            req.num_cached += q_len
            token = None
            if row is not None:
                token = int(logits[row].argmax())
                req.generated.append(token)
            sampled.append(token)
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
    assert layer.kv_cache is not None, "allocate the model's KV cache first"
    sched = Scheduler(
        prompts, max_new_tokens, num_pages=layer.kv_cache.num_pages, page_size=layer.kv_cache.page_size,
        prefill_chunk=prefill_chunk, device=layer.kv_cache.k.device,
    )
    while (step := sched.next_step()) is not None:
        with fullcg.forward_context(step.metadata, model, config=config):
            logits = run(step.input_ids, step.positions)
        sched.commit(step, logits)
    return [r.generated for r in sched.requests]
