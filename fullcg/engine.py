"""Offline generation with continuous batching: :func:`generate` and its scheduler.

:class:`BatchScheduler` turns prompts into steps the way an inference engine does: each
step has a token budget; requests already decoding get one token each first, then prompts
are fed in chunks that fit what is left (chunked prefill: prefill, then extend); waiting
requests join as soon as the budget, the request limit and the KV cache allow; a
finished request's pages go back to the pool and are reused. Every step's inputs and
:class:`fullcg.AttentionMetadata` are built here; a step may mix prefill, extend and
decode requests.

:func:`generate` drives any model built on :class:`fullcg.Attention` (or a Hugging Face
causal LM prepared with :func:`fullcg.integrations.transformers.prepare`) through those
steps: it compiles the model with the fullcg backend, captures CUDA graphs up front on a
GPU, and samples (greedy by default; temperature, top-k and top-p with a seed).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fullcg.backend import compile as compile_model
from fullcg.config import FullCGConfig, GraphMode
from fullcg.context import forward_context
from fullcg.frontend import progress_bar
from fullcg.host_copy import upload
from fullcg.layer import Attention
from fullcg.metadata import AttentionMetadata, ForwardMode
from fullcg.ownership import PageOwnership
from fullcg.runner import capture

__all__ = ["Request", "Step", "BatchScheduler", "Sampler", "GenerateStats", "generate"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    """One sequence: its prompt, what it generated, and where its KV lives."""

    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose k/v are in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    stopped: bool = False  # generated a stop token
    #: Tokens sampled on the device whose values the host has not read yet (at most one
    #: step's, two for the moment between launching a step and recording the one before),
    #: and where the newest sits in its step's sampled tokens: a decode step scheduled now
    #: takes its input token from there, on the device.
    in_flight: int = 0
    pending_index: int | None = None
    retired: bool = False  # finished; tokens still in flight for it are dropped

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return self.stopped or len(self.generated) >= self.max_new_tokens

    @property
    def in_prompt(self) -> bool:
        return self.num_cached < len(self.prompt)

    @property
    def kv_capacity(self) -> int:
        """Most tokens whose k/v this request ever stores (its last token is never fed back)."""
        return len(self.prompt) + max(self.max_new_tokens - 1, 0)


@dataclasses.dataclass
class Step:
    """One model call: inputs, metadata, and which requests sample a token from which row."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    requests: list[Request]
    sample_rows: list[int | None]  # row of the logits each request samples from, None mid-prompt
    #: Decode inputs still on the device: ``input_ids[fill_rows] = previous step's sampled
    #: tokens[fill_from]`` (None when every input is known on the host).
    fill_rows: torch.Tensor | None = None
    fill_from: torch.Tensor | None = None

    @property
    def modes(self) -> tuple[ForwardMode, ...]:
        return self.metadata.forward_modes

    def fill_inputs(self, previous_sampled: torch.Tensor | None) -> None:
        """Put the decode input tokens sampled by the step before (still on the device) in place."""
        if self.fill_rows is None:
            return
        if previous_sampled is None:
            raise RuntimeError("this step decodes tokens the previous step sampled; pass its sampled tokens")
        self.input_ids[self.fill_rows] = previous_sampled[self.fill_from]


class BatchScheduler:
    """Continuous batching over a paged KV cache of ``num_pages`` pages of ``page_size`` tokens.

    Args:
        prompts: token ids per request.
        max_new_tokens: tokens to generate, for every request or one count per request.
        num_pages, page_size: the paged KV cache the model holds.
        max_num_tokens: token budget of one step (None: unlimited). Decoding requests are
            served first, one token each; prompts fill what is left, in chunks.
        max_num_seqs: most requests in flight at once (None: unlimited).
        prefill_chunk: most prompt tokens one request feeds in a step (None: only the
            budget limits it).
        stop_token_ids: a request ends after generating one of these (it is kept in the output).
        prefix_chunk_tokens, device: passed on to :meth:`fullcg.AttentionMetadata.build`
            and used for step tensors.
        check_page_ownership: track which request owns each page
            (:class:`fullcg.PageOwnership`) and check every step against it before it
            runs (a debugging aid; costs a host pass over the page table per step).

    A request joins only when pages for its whole sequence (prompt plus
    ``max_new_tokens``) are free, so nothing is ever preempted; its pages return to the
    pool when it finishes.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        num_pages: int,
        page_size: int,
        max_num_tokens: int | None = None,
        max_num_seqs: int | None = None,
        prefill_chunk: int | None = None,
        stop_token_ids: Iterable[int] = (),
        prefix_chunk_tokens: int = 4096,
        device: torch.device | str = "cpu",
        check_page_ownership: bool = False,
    ) -> None:
        if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("every request needs a non-empty prompt")
        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(counts) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(counts)} counts for {len(prompts)} prompts; give one per prompt")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"max_new_tokens must be positive integers, got {max_new_tokens!r}")
        for name, value in (("max_num_tokens", max_num_tokens), ("max_num_seqs", max_num_seqs),
                            ("prefill_chunk", prefill_chunk), ("num_pages", num_pages), ("page_size", page_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.requests = [Request(list(p), c) for p, c in zip(prompts, counts)]
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self.device = torch.device(device)
        for i, req in enumerate(self.requests):
            if self._pages_for(req) > num_pages:
                raise RuntimeError(
                    f"request {i} needs {self._pages_for(req)} KV-cache pages ({req.kv_capacity} tokens) but the cache "
                    f"has {num_pages}; allocate more pages or shorten the prompt / max_new_tokens"
                )
        self.waiting: collections.deque[Request] = collections.deque(self.requests)
        self.running: list[Request] = []
        self._free_pages: collections.deque[int] = collections.deque(range(num_pages))
        self.ownership = PageOwnership(num_pages) if check_page_ownership else None
        self._ids = {id(req): i for i, req in enumerate(self.requests)}

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """Queue one more request (an arrival while others run); it joins like the first ones."""
        if len(prompt) == 0:
            raise ValueError("every request needs a non-empty prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        req = Request(list(prompt), max_new_tokens)
        if self._pages_for(req) > self.num_pages:
            raise RuntimeError(
                f"the request needs {self._pages_for(req)} KV-cache pages ({req.kv_capacity} tokens) but the cache has "
                f"{self.num_pages}; allocate more pages or shorten the prompt / max_new_tokens"
            )
        self._ids[id(req)] = len(self.requests)
        self.requests.append(req)
        self.waiting.append(req)
        return req

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def _pages_for(self, req: Request) -> int:
        return math.ceil(req.kv_capacity / self.page_size)

    def _admit(self) -> Request | None:
        """The next waiting request, with its pages, if the request limit and the cache allow."""
        if not self.waiting or (self.max_num_seqs is not None and len(self.running) >= self.max_num_seqs):
            return None
        req = self.waiting[0]
        need = self._pages_for(req)
        if need > len(self._free_pages):
            return None
        self.waiting.popleft()
        req.pages = [self._free_pages.popleft() for _ in range(need)]
        if self.ownership is not None:
            self.ownership.claim(self._ids[id(req)], req.pages)
        self.running.append(req)
        return req

    def next_step(self) -> Step | None:
        """The next batch of work, or None when every request is done, or (with tokens in
        flight, see :meth:`launched`) when nothing can run before they are recorded."""
        if self.finished:
            return None
        budget = self.max_num_tokens if self.max_num_tokens is not None else math.inf
        plan: list[tuple[Request, int]] = []  # (request, new tokens this step)
        # Decodes first: one token each keeps every started request moving. A request whose
        # tokens in flight already reach max_new_tokens waits for them to be recorded.
        for req in self.running:
            if not req.in_prompt and budget >= 1 and len(req.generated) + req.in_flight < req.max_new_tokens:
                plan.append((req, 1))
                budget -= 1
        # Then prompts: requests mid-prompt, then newcomers, in chunks that fit the budget.
        prompting = [r for r in self.running if r.in_prompt]
        while budget >= 1:
            if prompting:
                req = prompting.pop(0)
            elif (req := self._admit()) is None:
                break
            chunk = len(req.prompt) - req.num_cached
            if self.prefill_chunk is not None:
                chunk = min(chunk, self.prefill_chunk)
            chunk = int(min(chunk, budget))
            plan.append((req, chunk))
            budget -= chunk
        if not plan:
            if any(req.in_flight for req in self.running):
                return None  # the tokens in flight decide what comes next
            raise RuntimeError("no request could be scheduled; this is a bug in BatchScheduler")
        # The budget went to decodes first; the batch itself lists requests in the order they joined.
        order = {id(req): i for i, req in enumerate(self.running)}
        plan.sort(key=lambda entry: order[id(entry[0])])
        return self._build(plan)

    def _build(self, plan: list[tuple[Request, int]]) -> Step:
        ids: list[int] = []
        pos: list[int] = []
        q_lens, p_lens, modes, rows = [], [], [], []
        fill_rows: list[int] = []
        fill_from: list[int] = []
        for req, n in plan:
            prefix = req.num_cached
            if req.in_prompt:
                new = req.prompt[prefix : prefix + n]
                mode = ForwardMode.PREFILL if prefix == 0 else ForwardMode.EXTEND
            elif req.in_flight:
                # The input is the token the step in flight samples: filled in on the device.
                fill_rows.append(len(ids))
                fill_from.append(req.pending_index)
                new = [0]
                mode = ForwardMode.DECODE
            else:
                new = [req.tokens[-1]]
                mode = ForwardMode.DECODE
            ids += new
            pos += range(prefix, prefix + len(new))
            q_lens.append(len(new))
            p_lens.append(prefix)
            modes.append(mode)
            rows.append(len(ids) - 1 if prefix + len(new) >= len(req.prompt) else None)
        width = max(len(req.pages) for req, _ in plan)
        table = torch.zeros(len(plan), width, dtype=torch.int32)
        for i, (req, _) in enumerate(plan):
            table[i, : len(req.pages)] = torch.tensor(req.pages, dtype=torch.int32)
        md = AttentionMetadata.build(
            q_lens, p_lens, table, self.page_size, modes, prefix_chunk_tokens=self.prefix_chunk_tokens,
            device=self.device, num_pages=self.num_pages,
        )
        if self.ownership is not None:
            self.ownership.check(md, [self._ids[id(req)] for req, _ in plan])
        # Copies that never make the host wait for the GPU (see host_copy). The model's two
        # inputs get a buffer each: inputs sharing one would make Dynamo guard on the aliasing.
        input_ids = upload([np.array(ids, dtype=np.int64)], self.device)[0]
        positions = upload([np.array(pos, dtype=np.int64)], self.device)[0]
        mark_token_dim(input_ids, positions)
        step = Step(input_ids, positions, md, [req for req, _ in plan], rows)
        if fill_rows:
            step.fill_rows, step.fill_from = upload(
                [np.array(fill_rows, dtype=np.int64), np.array(fill_from, dtype=np.int64)], self.device)
        return step

    def advance(self, step: Step, tokens: Sequence[int | None]) -> list[Request]:
        """Record that ``step`` ran and what it sampled (one entry per request, None mid-prompt):
        :meth:`launched` then :meth:`record`. Returns the requests that finished; their pages
        are back in the pool."""
        self.launched(step)
        return self.record(step, tokens)

    def launched(self, step: Step) -> None:
        """``step`` runs: its tokens' k/v are in the cache, and the tokens it samples are in
        flight until :meth:`record`. The next step can be scheduled before that: a request's
        next input is then taken from this step's sampled tokens on the device
        (:meth:`Step.fill_inputs`)."""
        index = 0
        for req, q_len, row in zip(step.requests, step.metadata.query_lens, step.sample_rows):
            req.num_cached += q_len
            if row is not None:
                req.in_flight += 1
                req.pending_index = index
                index += 1

    def record(self, step: Step, tokens: Sequence[int | None]) -> list[Request]:
        """The tokens ``step`` sampled (one entry per request, None mid-prompt), read back.

        Returns the requests that finished; their pages are back in the pool. A token
        sampled for a request that had already finished (a stop token was in flight when
        the step was scheduled) is dropped.
        """
        if len(tokens) != len(step.requests) or any(
                token is None for row, token in zip(step.sample_rows, tokens) if row is not None):
            raise ValueError(
                f"record needs one token per request of the step ({len(step.requests)}, None only for requests "
                f"mid-prompt), got {list(tokens)}"
            )
        finished = []
        for req, row, token in zip(step.requests, step.sample_rows, tokens):
            if row is None:
                continue
            req.in_flight -= 1
            if req.in_flight == 0:
                req.pending_index = None
            if req.retired:
                continue
            req.generated.append(int(token))
            req.stopped = int(token) in self.stop_token_ids
            if req.done:
                finished.append(req)
        for req in finished:
            req.retired = True
            self.running.remove(req)
            if self.ownership is not None:
                self.ownership.release(self._ids[id(req)], req.pages)
            # Reused by the next requests to join; a step still in flight writes into them
            # first, on the same stream.
            self._free_pages.extend(req.pages)
            req.pages = []
        return finished

    def sample_keys(self, step: Step) -> torch.Tensor:
        """``int64 [R, 2]``: (request number, index of the token drawn) of each request that
        samples in ``step``, in row order, for :class:`Sampler`'s batch-independent draws.
        Call before :meth:`launched`."""
        keys = [(self._ids[id(req)], len(req.generated) + req.in_flight)
                for req, row in zip(step.requests, step.sample_rows) if row is not None]
        return torch.tensor(keys, dtype=torch.long).view(-1, 2)


class Sampler:
    """Picks each request's next token from its logits row, on the logits' device.

    ``temperature == 0`` is greedy (argmax; ``top_k``/``top_p`` are then ignored).
    Otherwise the logits are divided by ``temperature``, cut to the ``top_k`` largest and
    to the smallest set whose probability reaches ``top_p``, and sampled from (the
    Gumbel-max trick: the argmax of logits plus Gumbel noise). With a ``seed`` the noise
    of a row is a function of the seed, the row's key (request number, index of the
    token drawn; see :meth:`BatchScheduler.sample_keys`) and the token id alone, so a
    request draws the same tokens whatever it is batched with and whichever step loop
    runs it; None draws from torch's global generator.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> None:
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer or None, got {seed!r}")
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self._calls = 0  # draws without keys: (row, call number), so successive calls differ

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [R, V]`` -> token ids ``int64 [R]``; ``keys`` ``int64 [R, 2]`` name the draws
        (default: the row number and how many keyless calls came before)."""
        if self.greedy:  # a half-precision value widens exactly, so its argmax is the float32 one's
            return logits.argmax(dim=-1)
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the more likely ones already reach top_p (the first always stays).
            drop = probs.cumsum(dim=-1) - probs >= self.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
        if self.seed is None:
            uniform = torch.rand(logits.shape, device=logits.device, dtype=torch.float64)
        else:
            if keys is None:
                keys = torch.stack([torch.arange(logits.shape[0]),
                                    torch.full((logits.shape[0],), self._calls, dtype=torch.long)], 1)
                self._calls += 1
            uniform = _keyed_uniform(self.seed, keys.to(logits.device), logits.shape[-1])
        gumbel = -torch.log(-torch.log(uniform))
        return (logits.double() + gumbel).argmax(dim=-1)


#: splitmix64's constants as signed int64 (torch multiplies int64 with wraparound).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (logical shifts emulated on signed int64)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _keyed_uniform(seed: int, keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``float64 [R, vocab]`` strictly inside (0, 1): a hash of (seed, key, token id), the
    same on every device. 52 bits plus a half: exact in float64, never 0 or 1."""
    row = _mix(_mix(keys[:, 0] * _GOLDEN + seed) + keys[:, 1] * _GOLDEN)
    x = _mix(row[:, None] + torch.arange(1, vocab + 1, device=keys.device, dtype=torch.long)[None, :] * _GOLDEN)
    return (((x >> 12) & ((1 << 52) - 1)).double() + 0.5) / float(1 << 52)


def _step_module(model: nn.Module) -> nn.Module:
    """The module to run steps with: ``model`` itself, or a transformers model's packed wrapper."""
    if hasattr(getattr(model, "config", None), "_attn_implementation"):  # a transformers PreTrainedModel
        from fullcg.integrations.transformers import PackedCausalLM

        return PackedCausalLM(model)
    return model


class _CompiledCache(dict):
    """Compiled step modules of one model, by config; a copy of the model starts without any
    (the compiled modules would still point at the original)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _CompiledCache:
        return _CompiledCache()


def _compiled_step(model: nn.Module, config: FullCGConfig) -> tuple[nn.Module, Callable[..., Any], bool]:
    """(step module, its compiled form, whether it is new), reused across calls for one model and config.

    Kept in a plain dict on the model (not a submodule, so module walks never see it), so a
    second :func:`generate` call neither recompiles nor recaptures. The one attribute
    fullcg sets on a model it did not create, because the compiled step must live exactly
    as long as the model: it holds the model, so a fullcg-side map keyed by the model
    would keep every model alive.
    """
    cache: dict[FullCGConfig, tuple[nn.Module, Callable[..., Any]]] = model.__dict__.setdefault(
        "_fullcg_compiled", _CompiledCache()
    )
    if config in cache:
        return (*cache[config], False)
    module = _step_module(model)
    compiled = compile_model(module, config)
    cache[config] = (module, compiled)
    return module, compiled, True


def mark_token_dim(*tensors: torch.Tensor) -> None:
    """Tell Dynamo that dimension 0 (tokens) changes every step, so one graph serves all.

    For models compiled with plain ``torch.compile`` (``fullcg.compile`` marks it itself).
    Nothing to tell when Dynamo was never imported (eager models, ``compiler="none"``), and
    importing it for this would cost seconds of startup.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        for t in tensors:
            dynamo.mark_dynamic(t, 0)


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """What a :func:`generate` run did and where its time went.

    Attributes:
        steps: model calls.
        tokens: tokens returned (the prompts excluded).
        wall_s: the step loop's wall time (first compile and capture excluded).
        host_ms_per_step: host time per step that was not spent waiting for the GPU
            (scheduling, metadata, the forward's Python, launches).
        gpu_idle_fraction: on CUDA, the fraction of the span from the first step's GPU
            work to the last's in which the GPU ran no step (it waited for the host); None
            on the CPU.
        overlap: whether step ``n + 1`` was prepared while step ``n`` ran.
        step_shapes: per step, (new tokens, keys in the cache it reads: each request's
            prefix plus new tokens, query-key pairs it attends: each request's new tokens
            times its prefix plus half its new tokens), what a roofline of the run needs
            (``benchmarks/generate.py``).
    """

    steps: int
    tokens: int
    wall_s: float
    host_ms_per_step: float
    gpu_idle_fraction: float | None
    overlap: bool
    step_shapes: tuple[tuple[int, int, float], ...] = ()


@dataclasses.dataclass
class _Launched:
    """A step whose sampled tokens are on their way to the host."""

    step: Step
    sampled: torch.Tensor | None  # on the device, in sample-row order
    host: torch.Tensor | None  # the host copy (pinned on CUDA), valid once ``ready`` is done
    ready: torch.cuda.Event | None
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None  # the step's GPU work, for stats


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 16,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    max_num_tokens: int = 2048,
    max_num_seqs: int = 256,
    prefill_chunk: int | None = None,
    compile: bool = True,
    config: FullCGConfig | None = None,
    progress: bool = True,
    overlap: bool = True,
    return_stats: bool = False,
) -> list[list[int]] | tuple[list[list[int]], GenerateStats]:
    """Generate tokens for ``prompts`` with continuous batching; returns the new ids per prompt, in order.

    Args:
        model: a model built on :class:`fullcg.Attention`, called as ``model(input_ids [T],
            positions [T]) -> logits [T, vocab]``, with KV caches allocated; or a
            transformers causal LM after :func:`fullcg.integrations.transformers.prepare`.
        prompts: token ids per request.
        max_new_tokens: tokens to generate, for every request or one count per request.
        temperature, top_k, top_p, seed: sampling (see :class:`Sampler`); greedy by default.
        stop_token_ids: a request ends after one of these (kept in its output). None: the
            model's ``generation_config.eos_token_id`` for a transformers model, else none.
        max_num_tokens: token budget of one step (chunked prefill fills what decodes leave).
        max_num_seqs: most requests in flight at once.
        prefill_chunk: most prompt tokens one request feeds in a step (None: the budget).
        compile: run the model through ``fullcg.compile(model, config)`` (compiled once
            per model and config, and reused; ``compiler="none"`` in the config runs it
            eagerly, captured without a compiler); on a GPU, CUDA graphs for
            every capture size are captured before the first step.
        config: the fullcg config (graph mode, compiler, attention implementation);
            default :meth:`fullcg.FullCGConfig.from_env`.
        progress: show a progress bar over finished requests.
        overlap: schedule and launch step ``n + 1`` before reading step ``n``'s sampled
            tokens back (its decode inputs are taken from them on the device), so the GPU
            does not wait for the host between steps. Stop tokens and ``max_new_tokens``
            are then seen one step late: a request that stops may compute one more token,
            which is never returned. Outputs equal ``overlap=False``'s wherever the model's
            numerics do not depend on the batch (the two loops may batch requests differently:
            a finishing request holds its slot and pages one step longer).
        return_stats: also return a :class:`GenerateStats` (logged at INFO either way).

    A model sharded for tensor parallelism (its ``tp`` a :class:`fullcg.TensorParallel` of
    size > 1, as ``LlamaModel(cfg, tp=...)`` has) runs one process per rank, each calling
    ``generate`` with the same arguments; the group's first rank samples and broadcasts its
    tokens, so every rank returns the same outputs.

    The output excludes the prompt. A request stopped by a stop token is shorter than
    ``max_new_tokens``. Greedy output is what the model's own greedy decoding gives.
    """
    config = config or FullCGConfig.from_env()
    sampler = Sampler(temperature, top_k, top_p, seed)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers or any(a.kv_cache is None for a in layers):
        raise RuntimeError(
            f"{type(model).__name__} needs a paged KV cache in every fullcg.Attention layer: allocate it "
            "(e.g. model.allocate_kv_cache(num_pages, page_size)) or, for a transformers model, call "
            "fullcg.integrations.transformers.prepare(model, num_pages=..., page_size=...)"
        )
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    cache = layers[0].kv_cache
    # A model sharded over a tensor-parallel group (every rank runs this same call): the
    # group's first rank samples and the others take its tokens.
    tp = getattr(model, "tp", None)
    tp = tp if getattr(tp, "size", 1) > 1 else None
    if compile:
        module, run, new = _compiled_step(model, config)
    else:
        module = _step_module(model)
        run, new = module, False
    if stop_token_ids is None:
        stop_token_ids = getattr(module, "default_stop_token_ids", ())
    sched = BatchScheduler(
        prompts, max_new_tokens, num_pages=cache.num_pages, page_size=cache.page_size,
        max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk,
        stop_token_ids=stop_token_ids, device=cache.k.device,
    )
    bar = progress_bar(len(sched.requests), "fullcg.generate", "requests") if progress else None
    cuda = cache.k.device.type == "cuda"
    generated = steps = 0
    waited = 0.0  # host seconds spent waiting for the GPU
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    shapes: list[tuple[int, int, float]] = []

    def read_back(done: _Launched) -> None:
        nonlocal generated, waited
        tokens: list[int | None] = [None] * len(done.step.requests)
        if done.sampled is not None:
            t0 = time.perf_counter()
            if done.ready is not None:
                done.ready.synchronize()
            picked = done.host.tolist()
            waited += time.perf_counter() - t0
            it = iter(picked)
            tokens = [next(it) if r is not None else None for r in done.step.sample_rows]
            # Tokens of requests that stopped while this step was in flight are dropped.
            generated += sum(1 for req, r in zip(done.step.requests, done.step.sample_rows)
                             if r is not None and not req.retired)
        finished = len(sched.record(done.step, tokens))
        if bar is not None and finished:
            bar(finished, tokens=generated)

    with torch.inference_mode():
        if new and cuda:
            _first_step(run, module, cache, config)
        started = time.perf_counter()
        pending: _Launched | None = None
        while True:
            step = sched.next_step()
            if step is None:
                if pending is None:
                    break
                read_back(pending)
                pending = None
                continue
            span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if span is not None:
                span[0].record()
            step.fill_inputs(pending.sampled if pending is not None else None)
            rows = [r for r in step.sample_rows if r is not None]
            picks = keys = None
            if rows:  # sent before the forward: copies that never wait for the GPU
                host_rows = [np.array(rows, dtype=np.int64)]
                if not sampler.greedy:
                    host_rows.append(sched.sample_keys(step).numpy())
                picks, *rest = upload(host_rows, cache.k.device)
                keys = rest[0] if rest else None
            with forward_context(step.metadata, module, config=config):
                logits = run(step.input_ids, step.positions)
            sampled = host = ready = None
            if rows:
                sampled = sampler(logits[picks], keys)
                if tp is not None:
                    tp.broadcast_from_first(sampled)  # the first rank samples for all
                if cuda:
                    host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
                    host.copy_(sampled, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()
                else:
                    host = sampled
            if span is not None:
                span[1].record()
                spans.append(span)
            md = step.metadata
            shapes.append((md.num_tokens, sum(md.query_lens) + sum(md.prefix_lens),
                           sum(q * (p + (q + 1) / 2) for q, p in zip(md.query_lens, md.prefix_lens))))
            sched.launched(step)
            steps += 1
            launched = _Launched(step, sampled, host, ready, span)
            if pending is not None:
                read_back(pending)  # step n - 1's tokens, while step n runs
            pending = launched
            if not overlap:
                read_back(pending)
                pending = None
        if cuda:
            t0 = time.perf_counter()
            torch.cuda.synchronize(cache.k.device)
            waited += time.perf_counter() - t0
        wall = time.perf_counter() - started
    if bar is not None:
        bar(0, done=True)
    stats = GenerateStats(
        steps=steps, tokens=generated, wall_s=wall,
        host_ms_per_step=(wall - waited) * 1e3 / max(steps, 1),
        gpu_idle_fraction=_idle_fraction(spans) if spans else None, overlap=overlap, step_shapes=tuple(shapes),
    )
    logger.info("fullcg.generate: %d steps, %d tokens in %.3f s; host %.3f ms a step; GPU idle %s; overlap %s",
                stats.steps, stats.tokens, stats.wall_s, stats.host_ms_per_step,
                "n/a" if stats.gpu_idle_fraction is None else f"{stats.gpu_idle_fraction:.1%}", overlap)
    outputs = [req.generated for req in sched.requests]
    return (outputs, stats) if return_stats else outputs


def _idle_fraction(spans: Sequence[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """The share of the first span's start to the last span's end in which no span ran (the
    events were recorded on one stream, so spans follow one another)."""
    total = spans[0][0].elapsed_time(spans[-1][1])
    busy = sum(start.elapsed_time(end) for start, end in spans)
    return max(0.0, 1.0 - busy / total) if total > 0 else 0.0


def _first_step(run: Callable[..., Any], module: nn.Module, cache: Any, config: FullCGConfig) -> None:
    """Trace the model on stand-in steps and, unless the graph mode is ``none``, capture
    every CUDA-graph size now, so no step pays for a compile or a capture.

    The stand-ins are a two-token prompt, then a one-token one, in the cache's first pages;
    those slots are overwritten before any request reads them (a request's keys are always
    written before they are attended). Both counts, because Inductor may guard a graph to
    "more than one token" (torch 2.11 does for transformers models on CUDA): Dynamo then
    compiles a second graph for one-token steps, now rather than at the first decode step.
    Where one graph serves every count, the second stand-in just runs it.
    """
    device = cache.k.device
    for tokens in (2, 1) if cache.page_size * cache.num_pages >= 2 else (1,):
        table = torch.arange(-(-tokens // cache.page_size), dtype=torch.int32)[None]
        md = AttentionMetadata.build([tokens], [0], table, cache.page_size, device=device)
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        pos = torch.arange(tokens, dtype=torch.long, device=device)
        mark_token_dim(ids, pos)
        if config.graph_mode is not GraphMode.NONE:
            capture(run, md, module, ids, pos)
        else:
            with forward_context(md, module, config=config):
                run(ids, pos)
