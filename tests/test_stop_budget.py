"""The stop budget every launcher derives from run.stop_deadline_s (run/torchrun.py's stop_budget,
printed by `megatron-async stop-plan`), and the launch scripts that use it.

Fast tier: the derivation and the command's output, in-process. Integration: the real scripts
(launch/single_node.sh, launch/slurm_llama70b.sbatch) run with SLURM's commands and torchrun
replaced by recorders on PATH / in a fake VENV, `megatron-async stop-plan` and `placement` real:
what torchrun and srun would have been given, the requeue's resume decision, the job network, and
the self-armed warning reaching the job step.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_async.cli import main as cli_main
from megatron_async.config import load_config
from megatron_async.run.torchrun import TORCHRUN_GRACE_S, stop_budget, torchrun_stop_flags
from tests.dist import REPO

CFG = str(REPO / "configs" / "cpu_tiny.yaml")


def test_budget_follows_the_deadline():
    b = stop_budget(load_config(CFG, ["run.stop_deadline_s=900.2"]).run)
    assert (b.deadline_s, b.shutdown_timeout_s, b.warning_lead_s) == (901, 901 + TORCHRUN_GRACE_S, 901 + TORCHRUN_GRACE_S)
    cfg = load_config(CFG, ["run.stop_deadline_s=30"])
    assert f"--shutdown-timeout={30 + TORCHRUN_GRACE_S}" in torchrun_stop_flags(cfg)  # our own relaunch: the same


def test_stop_plan_prints_the_budget_and_the_checkpoint_to_resume(tmp_path, capsys):
    args = ["stop-plan", CFG, f"run.out_dir={tmp_path}", "run.name=r", "run.stop_deadline_s=500"]
    assert cli_main(args) == 0
    fresh = capsys.readouterr().out
    assert "STOP_DEADLINE_S=500\nSTOP_WARNING_S=560\nLATEST_CHECKPOINT=''\n" in fresh
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step_000010\n")
    assert cli_main(args) == 0
    assert f"LATEST_CHECKPOINT={tmp_path}/r/checkpoints/step_000010\n" in capsys.readouterr().out


def test_stop_plan_refuses_a_bad_deadline_in_one_line(capsys):
    assert cli_main(["stop-plan", CFG, "run.stop_deadline_s=0"]) == 2
    assert "run.stop_deadline_s" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the scripts (integration)


def _script(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fakes(tmp_path):
    """bin/: srun, squeue, scontrol recorders; venv/bin: the real megatron-async, python = a recorder."""
    bin_dir, venv, log = tmp_path / "bin", tmp_path / "venv" / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    venv.mkdir(parents=True)
    _script(bin_dir / "srun", f'''
if [[ " $* " == *" ip -4 -o addr show dev "* ]]; then echo "2: ib0    inet 10.1.2.3/16 brd 10.1.255.255 scope global ib0"; exit 0; fi
echo "srun $*" >> {log}
trap 'echo "step got USR1" >> {log}; exit 0' USR1
for ((i = 0; i < ${{FAKE_STEP_S:-0}} * 10; i++)); do sleep 0.1; done
''')
    end = tmp_path / "end_epoch"  # the job's end time: FAKE_LEFT_S after squeue's first answer, then fixed
    _script(bin_dir / "squeue", f'[[ -f {end} ]] || echo $(( $(date +%s) + ${{FAKE_LEFT_S:-7200}} )) > {end}\n'
                                f'date -d "@$(cat {end})" +%Y-%m-%dT%H:%M:%S\n')
    _script(bin_dir / "scontrol", f'''
if [[ $1 == show ]]; then echo node0; echo node1; echo node2; exit 0; fi
echo "scontrol $*" >> {log}
''')
    _script(venv / "megatron-async", f'exec {sys.executable} -m megatron_async "$@"\n')
    _script(venv / "python", f'echo "python $*" >> {log}\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VENV": str(tmp_path / "venv"),
           "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", "MEGATRON_ASYNC_ROLLOUT_TOKEN": "t",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "node[0-2]"}
    return env, log


def _run(cmd: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a launch script in a session of its own; after it ends, nothing of that session is left
    (the warning timer's sleep included), waited for with a bound."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = proc.communicate(timeout=timeout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the script left processes behind")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


TINY_70B = ["model.tiny_kv_heads=4", "model.tiny_layers=5"]  # the 70B layout (TP=4 x PP=5) fits the tiny model


@pytest.mark.integration  # starts the scripts and `megatron-async` processes
@pytest.mark.parametrize("script, env", [
    ("single_node.sh", {"CUDA_VISIBLE_DEVICES": "0,1"}),
    ("multi_node.sh", {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "GPUS_PER_NODE": "2"})])
def test_node_scripts_give_torchrun_the_derived_shutdown_timeout(fakes, tmp_path, script, env):
    base, log = fakes
    proc = _run(["bash", f"launch/{script}", CFG, "run.stop_deadline_s=500", f"run.out_dir={tmp_path}"], {**base, **env})
    assert proc.returncode == 0, proc.stderr
    assert "--shutdown-timeout=560 " in log.read_text()


@pytest.mark.integration
def test_requeued_70b_job_resumes_only_from_a_saved_checkpoint(fakes, tmp_path):
    env, log = fakes
    env = {**env, "SLURM_RESTART_COUNT": "1"}
    cmd = ["bash", "launch/slurm_llama70b.sbatch", CFG, *TINY_70B, f"run.out_dir={tmp_path}", "run.name=r"]
    fresh = _run(cmd, env)
    assert fresh.returncode == 0, fresh.stderr
    assert f"[slurm] requeued (restart 1): no checkpoint in {tmp_path}/r/checkpoints yet, starting fresh" in fresh.stdout
    srun = [line for line in log.read_text().splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and "run.resume=true" not in srun[0] and "run.stop_deadline_s=900" in srun[0]
    # the job network, taken once: NCCL, gloo and the replica host from JOB_IFNAME
    assert "[slurm] job network: ib0 (NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0); replicas at 10.1.2.3" in fresh.stdout
    assert "stop warning: USR1 960 s before the time limit (run.stop_deadline_s=900 + 60 s)" in fresh.stdout

    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step_000020\n")
    log.unlink()
    resumed = _run(cmd, env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {tmp_path}/r/checkpoints/step_000020" in resumed.stdout
    assert log.read_text().splitlines()[0].endswith("run.resume=true")


@pytest.mark.integration
def test_70b_job_warns_its_step_stop_budget_before_the_time_limit(fakes, tmp_path):
    """The end time 2 s past the warning lead: the timer's USR1 reaches the job step (forwarded by
    the script's trap), and the job requeues itself. A time limit shorter than the stop is refused."""
    env, log = fakes
    cmd = ["bash", "launch/slurm_llama70b.sbatch", CFG, *TINY_70B, f"run.out_dir={tmp_path}", "run.stop_deadline_s=30"]
    proc = _run(cmd, {**env, "FAKE_LEFT_S": str(90 + 2), "FAKE_STEP_S": "60"})
    assert proc.returncode == 0, proc.stderr
    assert "[slurm] time limit near: checkpoint, stop, requeue" in proc.stdout
    calls = log.read_text()
    assert "step got USR1" in calls and "scontrol requeue 4242" in calls

    short = _run(cmd, {**env, "FAKE_LEFT_S": "60"})
    assert short.returncode == 2 and "raise --time or lower the deadline" in short.stderr
