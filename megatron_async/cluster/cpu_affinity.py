"""CPU pinning of the learner and the vLLM replicas (the CPU analogue of separate GPUs).

    parallel.learner_cpus: "0"     # learner rank(s): os.sched_setaffinity + torch.set_num_threads
    rollout.replica_cpus: "1"      # every replica's processes: pinned from the start (env REPLICA_CPUS_ENV)

Empty strings mean no pinning. On a 2-core machine, unpinned OpenMP threads of the learner and of
vLLM fight over both cores; pinned, they overlap with little contention (each side runs at nearly
its speed alone: `megatron-async bench async --contention`, figures in docs/performance.md).

Unset, both keys are "auto" and `plan_cpus` decides, once per learner rank at launch
(run/launch.py, through placement.cpu_plan): without CUDA, with the replicas on this node, the
CPUs this process may use are split into two disjoint sets, the first max(local learner ranks,
n // 2) for the learner ranks and the rest for the replicas (2 CPUs: learner "0", replicas "1",
as the shipped configs set them); fewer than local ranks + 1 CPUs, CUDA, or no replicas here:
no pinning. An explicit key wins; the other "auto" key then takes the CPUs it leaves. The decision
is logged on one line.

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
from dataclasses import dataclass
from typing import Iterator

import torch

REPLICA_CPUS_ENV = "MEGATRON_ASYNC_CPUS"
CPUS_AUTO = "auto"  # parallel.learner_cpus / rollout.replica_cpus unset: `plan_cpus` picks
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


@dataclass(frozen=True)
class CpuPlan:
    """The CPU lists a run applies (each "" = no pinning) and, in words, how they were chosen."""
    learner: str  # parallel.learner_cpus as applied
    replica: str  # rollout.replica_cpus as applied
    why: str

    def describe(self) -> str:
        where = lambda cpus: f"CPUs {cpus}" if cpus else "unpinned"  # noqa: E731
        return f"CPU placement: learner {where(self.learner)}, replicas {where(self.replica)} ({self.why})"


def plan_cpus(learner_cpus: int | str, replica_cpus: int | str, *, cpus: list[int], cuda: bool,
              learner_ranks: int, replicas_here: bool) -> CpuPlan:
    """Resolve "auto" keys over `cpus` (this process's CPUs), for `learner_ranks` local learner
    ranks and, if `replicas_here`, the replicas of this node. Explicit values are kept as given."""
    learner, replica, cpus = str(learner_cpus), str(replica_cpus), sorted(cpus)
    if CPUS_AUTO not in (learner, replica):
        return CpuPlan(learner, replica, "set by the config")
    unpinned_if_auto = lambda v: "" if v == CPUS_AUTO else v  # noqa: E731
    if cuda:
        return CpuPlan(unpinned_if_auto(learner), unpinned_if_auto(replica),
                       "auto: CUDA, the GPUs keep the learner and the replicas apart")
    if not replicas_here:
        return CpuPlan(unpinned_if_auto(learner), unpinned_if_auto(replica), "auto: no replica runs on this node")
    if learner != replica:  # one key set: the other takes the CPUs it leaves ("" leaves none: it uses them all)
        key, given = ("parallel.learner_cpus", learner) if replica == CPUS_AUTO else ("rollout.replica_cpus", replica)
        rest = format_cpu_list(set(cpus) - set(parse_cpu_list(given))) if given else ""
        return CpuPlan(learner if learner != CPUS_AUTO else rest, replica if replica != CPUS_AUTO else rest,
                       f"auto: the CPUs {key} = {given!r} leaves" + ("" if rest else ": none"))
    n = len(cpus)
    if n < learner_ranks + 1:
        return CpuPlan("", "", f"auto: {n} CPU(s) cannot give {learner_ranks} learner rank(s) and the replicas one each")
    split = max(learner_ranks, n // 2)
    return CpuPlan(format_cpu_list(cpus[:split]), format_cpu_list(cpus[split:]),
                   f"auto: of {n} CPUs the first max(learner ranks, n // 2) = {split} for {learner_ranks} learner "
                   "rank(s), the rest for the replicas")


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
    the CPUs it had before pinning (SFT runs faster on every core than on the learner's share),
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
