"""What `launch/gpu_check.sh` hands back: one archive and one summary file, rewritten after every phase.

    python tools/gpu_check_pack.py --work WORK_DIR --out OUT_DIR --seconds N

The phases write their files (a JSON each, per-test reports, benchmark folders, install.log,
exit_codes.txt) into WORK_DIR; this packs all of them into OUT_DIR/gpu_check.tar.gz and writes
OUT_DIR/summary.json (each phase's status, reason or error, seconds and exit code; "pending" for a
phase that has not ended; the reach: each claim of the docs' GPU section, exercised here or not
exercisable on this machine and why, gpu_check.reach; the archive's members). The lent GPU machine hands back at most 8 files
from $OUT, and a run cut short by its limit hands back what $OUT holds then: so OUT_DIR holds
exactly these two files, each replaced atomically (written beside, then renamed) after each phase.

Standard library only: it runs between phases, in well under a second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import PHASES, reach  # noqa: E402 - tools/ is no package: the phases and claims, from their one home

ARCHIVE = "gpu_check.tar.gz"
SUMMARY = "summary.json"
TOP = "gpu_check"  # the archive's one top-level folder: unpacks as gpu_check/<phase>.json, ...


def summarize(work: Path, seconds: int) -> dict:
    """Per phase its status (from WORK/<phase>.json; "pending" before it ends) and exit code; the
    reach of each claim of the docs' GPU section in this run."""
    codes_file = work / "exit_codes.txt"
    codes = dict(line.split() for line in codes_file.read_text().splitlines() if line.strip()) if codes_file.exists() else {}
    phases, results = {}, {}
    for phase in PHASES:
        path = work / f"{phase}.json"
        if not path.exists():
            phases[phase] = {"status": "pending"}
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            result = {"status": "failed", "error": f"unreadable: {e}"}
        results[phase] = result
        phases[phase] = {**{k: result[k] for k in ("status", "reason", "error", "seconds") if k in result},
                         "exit_code": int(codes[phase]) if phase in codes else None}
    return {"seconds": seconds, "complete": all(p["status"] != "pending" for p in phases.values()), "phases": phases,
            "reach": reach(results)}


def pack(work: Path, out: Path, seconds: int) -> dict:
    """OUT/gpu_check.tar.gz (every file under WORK) and OUT/summary.json; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    members = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
    summary = {**summarize(work, seconds), "archive": ARCHIVE, "archive_members": [f"{TOP}/{m}" for m in members]}
    partial = out / f".{ARCHIVE}.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for member in members:
            tar.add(work / member, arcname=f"{TOP}/{member}")
    os.replace(partial, out / ARCHIVE)
    partial = out / f".{SUMMARY}.partial"
    partial.write_text(json.dumps(summary, indent=1))
    os.replace(partial, out / SUMMARY)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, type=Path, help="where the phases wrote their files")
    p.add_argument("--out", required=True, type=Path, help="what is handed back: the archive and the summary")
    p.add_argument("--seconds", required=True, type=int, help="the check's wall time so far")
    args = p.parse_args()
    summary = pack(args.work, args.out, args.seconds)
    print(json.dumps({k: summary[k] for k in ("seconds", "complete", "phases")}))
    for claim in summary["reach"]:
        print(f"[gpu_check] {claim['reach']}: {claim['claim']}" + (f" ({claim['why']})" if "why" in claim else ""))


if __name__ == "__main__":
    main()
