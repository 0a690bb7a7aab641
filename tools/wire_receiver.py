"""The CPU receiving end of gpu_check's `weight_wire` phase (tools/gpu_check.py): what a CPU
replica's engine does with one bucket, without vLLM (the lent GPU machine has none).

    python tools/wire_receiver.py shm PATH SIZE CHECKSUM
    python tools/wire_receiver.py gloo PORT SPEC_JSON      # SPEC_JSON: [[name, dtype, shape], ...]

`shm`: opens the sender's /dev/shm segment and unpacks the bucket (weights/host_memory.py: the CRC32 is
verified first). `gloo`: joins a 2-rank gloo group at 127.0.0.1:PORT as rank 1 and receives each
tensor with weights/broadcast.py's `GlooCommunicator.broadcast`, as the `mas_gloo` engine does. Either
way it prints one line, `RECEIVED {name: sha256 of the received bytes}` (JSON).
"""
from __future__ import annotations

import hashlib
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_async.weights.broadcast import GlooCommunicator  # noqa: E402
from megatron_async.weights.host_memory import open_segment, unpack_bucket  # noqa: E402


MARK = "RECEIVED"


def received(output: str) -> dict | None:
    """The receiver's hashes from its output (None if it printed none)."""
    lines = [line for line in output.splitlines() if line.startswith(MARK + " ")]
    return json.loads(lines[-1].removeprefix(MARK + " ")) if lines else None


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    carrier = sys.argv[1]
    if carrier == "shm":
        segment = open_segment(sys.argv[2])
        tensors = unpack_bucket(memoryview(segment)[:int(sys.argv[3])], int(sys.argv[4]))
        print(MARK, json.dumps({name: digest(t.reshape(-1)) for name, t in tensors.items()}), flush=True)
        return
    port, spec = int(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=timedelta(seconds=60))
    communicator = GlooCommunicator(dist.group.WORLD)
    out = {}
    for name, dtype, shape in spec:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        communicator.broadcast(t, src=0)
        out[name] = digest(t.reshape(-1))
    dist.destroy_process_group()
    print(MARK, json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
