"""The README's demo runs and checks every compiled step against eager."""

from __future__ import annotations

import torch

from fullcg.__main__ import main


def test_demo_passes_and_reports_its_steps_and_split(capsys):
    torch._dynamo.reset()
    assert main(["demo", "--compiler", "eager", "--chunked-prefix"]) == 0
    out = capsys.readouterr().out
    assert "extend:8, decode:1, decode:1" in out, "the demo must show a chunked-prefill step in a mixed batch"
    assert "-> OK" in out and "variants: piecewise" in out and "prefix-chunk attention and merge (eager, split point)" in out
