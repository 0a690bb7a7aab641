"""CPU pinning of the learner and the vLLM replicas (the CPU analogue of separate GPUs).

    parallel.learner_cpus: "0"     # learner rank(s): os.sched_setaffinity + torch.set_num_threads
    rollout.replica_cpus: "1"      # every replica's processes: pinned from the start (env REPLICA_CPUS_ENV)

Empty strings mean no pinning. On a 2-core machine, unpinned OpenMP threads of the learner and of
vLLM fight over both cores; pinned, they overlap at ~8% contention (measured: vLLM on one core and
a torch training loop on the other each ran at 91-93% of its speed alone).

NOTE mechanism: CPU affinity is inherited at fork, so a replica started by a pinned learner would
inherit the learner's cores. The pool therefore passes the replica's own CPU list in the
environment (`MEGATRON_ASYNC_CPUS`); the launcher (rollout/launcher.py) sets it as the affinity of
the replica's supervisor before it runs anything, so the vLLM server, its engine core and its
workers inherit it, and vLLM's own `VLLM_CPU_OMP_THREADS_BIND` binds its OpenMP threads to those
CPUs. With `replica_cpus` empty and `learner_cpus` set, the replica is given back the CPUs the
learner had before pinning itself.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Iterator

import torch

REPLICA_CPUS_ENV = "MEGATRON_ASYNC_CPUS"
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")

# CPUs this process could use before `pin_learner` narrowed them (given back to unpinned replicas)
_ORIGINAL_AFFINITY: set[int] | None = None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this machine's first CPU (Linux); empty where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


AMX_BF16_FLAG = "amx_bf16"  # AMX tiles multiply bf16 matrices
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", AMX_BF16_FLAG})  # without one, CPU kernels emulate bf16


def parse_cpu_list(text: str) -> list[int]:
    """'0', '0-3', '0,2-3' -> sorted CPU ids; '' -> []. Raises ValueError on anything else."""
    text = str(text).strip()
    if not text:
        return []
    cpus: set[int] = set()
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise ValueError(f"{item.strip()!r} is not a CPU id or range (expected e.g. '0', '0-3', '0,2-3')")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise ValueError(f"range {item.strip()!r} is empty (end before start)")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def available_cpus() -> set[int]:
    """CPUs that exist on this machine (ids 0..cpu_count-1)."""
    return set(range(os.cpu_count() or 1))


def format_cpu_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def pin_current_process(cpus: list[int], set_torch_threads: bool = True) -> None:
    """Pin this process (and threads it creates later) to `cpus`; torch threads = len(cpus)."""
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    if set_torch_threads:
        torch.set_num_threads(len(cpus))


def rank_cpus(cpus: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """This learner rank's share of `cpus`: an even split when there are enough, else all of them."""
    if local_world_size <= 1 or len(cpus) < local_world_size:
        return list(cpus)
    per = len(cpus) // local_world_size
    return list(cpus[local_rank * per:(local_rank + 1) * per])


def pin_learner(learner_cpus: str) -> list[int]:
    """Pin this learner rank per `parallel.learner_cpus` (split over local ranks). [] = unpinned."""
    global _ORIGINAL_AFFINITY
    cpus = parse_cpu_list(learner_cpus)
    if not cpus:
        return []
    if _ORIGINAL_AFFINITY is None:
        _ORIGINAL_AFFINITY = set(os.sched_getaffinity(0))
    mine = rank_cpus(cpus, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    pin_current_process(mine)
    return mine


@contextmanager
def unpinned_before_replicas() -> Iterator[None]:
    """Lift `pin_learner`'s pinning while nothing else runs beside the learner yet (the SFT warm-up,
    before any replica or reward worker starts): a single learner rank on this machine gets back
    the CPUs it had before pinning (measured on 2 cores: SFT at 6.4 steps/s on both, 4.2 on one),
    and its pinning and thread count afterwards. A no-op when unpinned or with several local ranks."""
    if _ORIGINAL_AFFINITY is None or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        yield
        return
    pinned, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    pin_current_process(sorted(_ORIGINAL_AFFINITY))
    try:
        yield
    finally:
        pin_current_process(pinned)
        torch.set_num_threads(threads)


def replica_pin_env(replica_cpus: str) -> dict[str, str]:
    """Environment for replica processes: their CPU list (empty dict = inherit, nothing pinned)."""
    cpus = parse_cpu_list(replica_cpus)
    if not cpus and _ORIGINAL_AFFINITY is not None:  # the learner pinned itself: undo it for replicas
        cpus = sorted(_ORIGINAL_AFFINITY)
    if not cpus:
        return {}
    return {REPLICA_CPUS_ENV: format_cpu_list(cpus), "OMP_NUM_THREADS": str(len(cpus)),
            "VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(cpus)}
