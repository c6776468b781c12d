"""A seeded random serving loop: the steps an engine would run, for any model and device.

:class:`ServingLoop` plays arrivals over time into a :class:`fullcg.engine.BatchScheduler`
with a per-step token budget (so prompts are prefilled in chunks: prefill, then extend),
decodes, finished requests giving their pages back and later requests reusing them. The
tokens fed back are drawn from the seed, not sampled from a model, so every model sees
the very same steps: run one loop's steps through an eager and a compiled model and
compare them step by step. Page ownership is checked every step (``PageOwnership``).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Iterator

import torch

import fullcg
from fullcg.engine import BatchScheduler, Step
from fullcg.metadata import AttentionMetadata, ForwardMode


@dataclasses.dataclass
class ServingLoop:
    """``num_steps`` steps of a random serving workload; iterate to get the steps.

    Between steps, ``advance(step)`` must be called (iteration does it after the consumer
    has run the step). ``stats`` counts what the steps exercised.
    """

    seed: int = 0
    num_steps: int = 300
    num_pages: int = 48
    page_size: int = 4
    max_num_tokens: int = 24
    max_num_seqs: int = 6
    arrival_rate: float = 0.35  # chance of a new request per step
    prompt_lens: tuple[int, int] = (1, 40)
    new_tokens: tuple[int, int] = (1, 12)
    vocab_size: int = 256
    device: str | torch.device = "cpu"
    stats: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def _arrive(self, sched: BatchScheduler, rng: random.Random) -> None:
        prompt = [rng.randrange(self.vocab_size) for _ in range(rng.randint(*self.prompt_lens))]
        sched.add_request(prompt, rng.randint(*self.new_tokens))
        self.stats["arrivals"] += 1

    def __iter__(self) -> Iterator[Step]:
        rng = random.Random(self.seed)
        first = [[rng.randrange(self.vocab_size) for _ in range(rng.randint(*self.prompt_lens))] for _ in range(3)]
        sched = BatchScheduler(
            first, [rng.randint(*self.new_tokens) for _ in first], num_pages=self.num_pages, page_size=self.page_size,
            max_num_tokens=self.max_num_tokens, max_num_seqs=self.max_num_seqs, device=self.device,
            check_page_ownership=True,
        )
        freed: set[int] = set()
        for _ in range(self.num_steps):
            if rng.random() < self.arrival_rate or sched.finished:
                self._arrive(sched, rng)
            step = sched.next_step()
            self._count(step, freed)
            pages = {id(r): list(r.pages) for r in step.requests}
            yield step
            tokens = [rng.randrange(self.vocab_size) if row is not None else None for row in step.sample_rows]
            for req in sched.advance(step, tokens):
                freed.update(pages[id(req)])
                self.stats["finished"] += 1

    def _count(self, step: Step, freed: set[int]) -> None:
        modes = set(step.modes)
        self.stats["steps"] += 1
        self.stats["tokens"] += step.metadata.num_tokens
        for mode in modes:
            self.stats[mode.value] += 1
        if len(modes) > 1:
            self.stats["mixed"] += 1
        for req, mode in zip(step.requests, step.modes):
            if mode is ForwardMode.PREFILL and freed.intersection(req.pages):
                self.stats["page_reuse"] += 1


def play_side_by_side(
    loop: ServingLoop, eager: torch.nn.Module, model: torch.nn.Module, run, config: fullcg.FullCGConfig,
    *, atol: float = 0.0,
) -> list[AttentionMetadata]:
    """Every step of ``loop`` through ``eager`` and through ``run`` (``model`` compiled, or run
    without a compiler), each model with its own cache; their logits must agree step by step,
    bitwise when ``atol`` is 0. Returns the steps' metadata."""
    seen = []
    with torch.inference_mode():
        for i, step in enumerate(loop):
            with fullcg.forward_context(step.metadata, eager, config=config):
                expected = eager(step.input_ids, step.positions)
            with fullcg.forward_context(step.metadata, model, config=config):
                got = run(step.input_ids, step.positions)
            if atol:
                torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=lambda m: f"step {i} {step.modes}: {m}")
            else:
                assert torch.equal(got, expected), f"step {i} ({step.modes}): logits differ from eager"
            seen.append(step.metadata)
    return seen
