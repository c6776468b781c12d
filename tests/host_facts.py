"""What the compile cache's host facts do on this machine, for tests that count them."""

from __future__ import annotations

from pathlib import Path

from fullcg import compile_cache
from fullcg.compile_cache import HostFacts


def isa_taken_from_entry(entry: Path) -> bool:
    """Whether a fresh process loading graph entry ``entry`` takes its recorded instruction
    set unprobed here (an x86 CPU that reports the set and the extensions its verdicts name,
    whose flags the recorded verdicts rebuild; never an AMX set)."""
    from torch._inductor import cpu_vec_isa

    payload = entry.read_bytes().split(b"\n", 4)[4]
    facts = HostFacts.decode(payload.partition(b"\n")[0])
    if facts is None or facts.vec_isa is None:
        return False
    # As in a fresh process: no probe's list or verdicts (this process's probes run again
    # when next needed).
    classes = [type(i) for i in cpu_vec_isa.supported_vec_isa_list]
    for cache in [cpu_vec_isa.valid_vec_isa_list, *compile_cache.probe_caches(classes)]:
        cache.cache_clear()
    with compile_cache._recorded_vec_isa(cpu_vec_isa, facts) as offered:
        return offered
