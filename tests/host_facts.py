"""What the compile cache's host facts do on this machine, for tests that count them."""

from __future__ import annotations

from pathlib import Path

from fullcg import compile_cache
from fullcg.compile_cache import HostFacts


def isa_taken_from_entry(entry: Path) -> bool:
    """Whether a fresh process loading graph entry ``entry`` takes its recorded instruction
    set unprobed here (an x86 CPU that reports the set, whose flags the recorded verdicts
    rebuild; not a set such as AMX whose flags Inductor caches)."""
    from torch._inductor import cpu_vec_isa

    payload = entry.read_bytes().split(b"\n", 4)[4]
    facts = HostFacts.decode(payload.partition(b"\n")[0])
    if facts is None or facts.vec_isa is None:
        return False
    isa_list = cpu_vec_isa.valid_vec_isa_list
    probed = isa_list.cache_info().currsize
    if probed:
        isa_list.cache_clear()  # as in a fresh process
    try:
        with compile_cache._recorded_vec_isa(cpu_vec_isa, facts) as offered:
            return offered
    finally:
        if probed:
            isa_list.cache_clear()
