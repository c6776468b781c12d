"""What the compile cache's host facts do on this machine, for tests that count them."""

from __future__ import annotations

from pathlib import Path

from fullcg import compile_cache
from fullcg.compile_cache import HostFacts


def isa_taken_from_entry(entry: Path) -> bool:
    """Whether a fresh process loading graph entry ``entry`` takes its recorded instruction
    set unprobed here (an x86 CPU whose set is a plain one such as AVX2, not AVX-512)."""
    from torch._inductor import cpu_vec_isa

    payload = entry.read_bytes().split(b"\n", 4)[4]
    recorded = HostFacts.decode(payload.partition(b"\n")[0]).vec_isa
    if recorded is None:
        return False
    isa_list = cpu_vec_isa.valid_vec_isa_list
    probed = isa_list.cache_info().currsize
    if probed:
        isa_list.cache_clear()  # as in a fresh process
    try:
        return compile_cache._proven_vec_isa_list(cpu_vec_isa, recorded) is not None
    finally:
        if probed:
            isa_list.cache_clear()
