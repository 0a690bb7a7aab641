"""The host-memory transport: one learner pipeline stage -> every replica's `mas_cpu` engine,
written top to bottom as the bytes go: the sender, the bucket a payload is, the shared-memory
segment it travels in.

    sender = HostMemorySender(pool.urls, pool.key, timeout_s=..., bucket_bytes=..., transport="auto")  # once per run
    result = sender.push(stream, urls=opened)      # each sync, into the replicas that opened it (weights/update.py)

A sync is one vLLM weight update (weight-transfer API: start / update* / finish; weights/update.py
runs the phases and builds the stream: the stage's HF-named tensors, cast, deltas where the push
is one); this sender only carries it (the interface: weights/update.py's `WeightSender`).

Bucketing and naming are the same for every carrier (`iter_buckets`: weights/update.py's
`group_by_cap` over HF names, each group packed as one `Bucket`); the carrier is how a bucket's
bytes reach the replica's `mas_cpu` engine (weights/engines.py), `rollout.weight_transport`:
- shm: packed into one of two reused /dev/shm segments (`ShmSegment`); the request carries only
  its path, size and CRC32. `auto` picks it for a replica at a loopback address (unless /dev/shm
  cannot hold two buckets).
- http: the payload base64-encoded in the request's JSON body (replicas on other hosts).
Both work for GPU replicas too. `nccl` (vLLM's own NCCL backend, GPU to GPU) and `gloo` are the
other sender: weights/broadcast.py.

The sender lives as long as the run: its shared-memory segments are reserved once (64 MB each
by default: reserving them costs ~0.1 s), not per sync.

Pipelining and memory: `named_tensors` is consumed lazily with one bucket in flight: while the
replicas load bucket k, the sender packs bucket k+1 (into the other shm segment), and sends it
once every replica answered k. The sender holds at most two buckets' bytes.

Failure: every request is bounded by `timeout_s`. A replica that fails a bucket is dropped from
the rest of this push and reported in `PushResult.failed`; rank 0 does not publish the version
on it, so it stays out of dispatch until a later full push (the pool restarts it if it died).
The sender always drains `named_tensors`: the stage's other ranks take part in the gathers
behind that iterator, and stopping early would leave them blocked in a collective.

A bucket (`iter_buckets` turns a lazy iterator of (hf_name, tensor) into `Bucket`s without ever
materialising the model):
- Laziness: the input iterator is advanced one tensor at a time and a bucket is yielded as soon
  as the next tensor would overflow it, so the caller holds at most one bucket's tensors, one
  look-ahead tensor and the serialised bytes of that bucket (about two caps plus one tensor).
- Cap: a bucket's tensor bytes never exceed `cap_bytes`, except a single tensor larger than the
  cap, which travels alone in its own bucket.
- Order: buckets follow the input order (`Bucket.names` too); inside one payload tensors are laid
  out by falling element size (every tensor stays aligned), which loading does not depend on.
- Layout: a payload is a valid safetensors file (8-byte header length, JSON header padded to 8
  bytes, raw data), written straight into a buffer the carrier provides (`alloc`: a bytearray
  for http, the shared-memory segment for shm), and read back zero-copy by `unpack_bucket`
  (torch.frombuffer views into the payload).
- Integrity: each bucket carries a CRC32 of its payload, verified by the replica before anything
  from it loads; `unpack_bucket` refuses a payload whose CRC32 differs (`BucketChecksumError`).
  Authenticity comes from the replica's key, not from the checksum. Two scopes (`checksum`):
  - full: every byte (~3 GB/s here: a third of a SmolLM2 sync on each side). The first push to a
    replica, every push after one of its failures (or after `forget`), and every http push;
  - sampled (`sample_offset` given), over shm once a replica has taken a full-checksum sync from
    this sender: the length, the whole safetensors header, and 4 KiB of every 256 KiB of tensor
    data from the offset on, plus the last 4 KiB (1/64 of the bytes). It catches what a carrier
    gets wrong (a truncated or wrong segment, a segment rewritten by the next bucket, a header of
    other shapes or offsets), not a flipped bit in an unsampled page (the bytes of an shm bucket
    never leave this host's memory); the sender varies the offset per push and bucket.

A shared-memory segment (`ShmSegment`, the sender's; `open_segment`, the replica's): a file in
/dev/shm, mode 0600, sized for a bucket and reused for the sender's life; the replica maps it
read-only and loads the bucket's tensors from it. The bytes never cross a socket.
- No bucket is overwritten while it is read: the sender rewrites a segment only after every
  replica answered the bucket in it, and the engine copies out what vLLM still holds of it.
- Cleanup: `ShmSegment.close()` (and a `weakref.finalize` at garbage collection or interpreter
  exit) unlinks the file; a replica's mapping then lives until it drops it at the end of the update.
  A run stopped at once (`run/stop.py`: os._exit runs no finalizers) calls `unlink_live_segments`
  first. Only a SIGKILLed sender leaves a `mas-wsync-<pid>-*` file behind, and the next run on the
  host removes it (`sweep_dead_segments`: ours by name and owner, whose pid no longer runs).
- Space: tmpfs pages are reserved up front (`posix_fallocate`), so a full /dev/shm is an error
  here, not a SIGBUS on a later write.
- Only files named `mas-wsync-*` directly under /dev/shm are opened on the replica side.
"""
from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import secrets
import struct
import time
import warnings
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from megatron_async.rollout.replica import ReplicaClient, ReplicaError
from megatron_async.transports import carrier_for
from megatron_async.weights.update import PushResult, group_by_cap

log = logging.getLogger(__name__)


class HostMemorySender:
    """Streams one pipeline stage's HF-named tensors into every replica's open weight update."""

    def __init__(self, urls: Sequence[str], key: str, *, timeout_s: float = 120.0, bucket_bytes: int = 64 << 20,
                 transport: str = "auto"):
        if not urls:
            raise ValueError("HostMemorySender needs at least one replica URL")
        if not key:
            raise ValueError("HostMemorySender needs the replicas' key")
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._clients = {u: ReplicaClient(u, key, timeout_s=timeout_s) for u in urls}
        self._carrier = {c: carrier_for(transport, c.url) for c in self._clients.values()}
        need = 2 * (bucket_bytes + HEADER_SLACK)
        if transport == "auto" and "shm" in self._carrier.values() and shm_free_bytes() < need:
            log.warning("weight sync: /dev/shm has less than the %d MiB two buckets need; auto uses http", need >> 20)
            self._carrier = {c: "http" for c in self._clients.values()}
        self.carriers = sorted(set(self._carrier.values()))
        # two segments: one being read by the replicas while the next bucket is packed into the other
        self._segments = [ShmSegment(bucket_bytes), ShmSegment(bucket_bytes)] if "shm" in self.carriers else []
        self._pool = ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="weight-sync")
        self._verified: set[str] = set()  # replicas whose last push from here had every byte checked, or a sample since

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], urls: Sequence[str] | None = None,
             keep: bool = False) -> PushResult:
        """Send this stage's tensors into the open update of the replicas at `urls` (None: all)."""
        t0 = time.perf_counter()
        live = list(self._clients.values()) if urls is None else [self._clients[u] for u in urls]
        failed: dict[str, str] = {}
        sampled = self.carriers == ["shm"] and all(c.url in self._verified for c in live)
        send_s = 0.0
        num_buckets = nbytes = 0
        in_flight: list = []

        def collect() -> None:
            nonlocal send_s
            t = time.perf_counter()
            for client, fut in in_flight:
                try:
                    fut.result()
                except (ConnectionError, TimeoutError, ReplicaError) as e:
                    failed[client.url] = str(e)
                    live.remove(client)
            in_flight.clear()
            send_s += time.perf_counter() - t

        for bucket_info, size in self._buckets(named_tensors, secrets.randbelow(SAMPLE_STRIDE) if sampled else None, keep):
            collect()  # NOTE: one bucket in flight; its shm segment is rewritten two buckets later
            in_flight.extend((c, self._pool.submit(c.update_weights, bucket_info[self._carrier[c]])) for c in live)
            num_buckets += 1
            nbytes += size
        collect()
        self._verified |= {c.url for c in live}
        self._verified -= failed.keys()
        return PushResult(bytes=nbytes, replicas=len(live), buckets=num_buckets, calls=num_buckets,
                          seconds=time.perf_counter() - t0, send_seconds=send_s, failed=failed, carriers=self.carriers)

    def _buckets(self, tensors: Iterable[tuple[str, torch.Tensor]], sample_offset: int | None, keep: bool):
        """Per bucket: ({carrier: update_info}, payload bytes); `sample_offset`: sampled checksums."""
        turn: dict[str, Any] = {"count": 0, "segment": None}  # the buckets so far, the segment the last one used

        def alloc(nbytes: int):  # the segment the previous bucket did not use
            turn["segment"] = self._segments[turn["count"] % 2]
            turn["count"] += 1
            return turn["segment"].buffer(nbytes)

        for bucket in iter_buckets(tensors, self.bucket_bytes, alloc if self._segments else bytearray, sample_offset):
            size = len(bucket.payload)
            info = {}
            if "http" in self.carriers:
                info["http"] = {"data": base64.b64encode(bucket.payload).decode("ascii"), "checksum": bucket.checksum,
                                "keep": keep}
            if self._segments:
                info["shm"] = {"shm": turn["segment"].path, "size": size, "checksum": bucket.checksum,
                               "sample_offset": bucket.sample_offset, "keep": keep}
            yield info, size

    def forget(self, urls: Iterable[str]) -> None:
        """The next push to these replicas checks every byte (no connection or group is kept)."""
        self._verified -= set(urls)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        for segment in self._segments:
            segment.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "HostMemorySender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- a bucket

# safetensors dtype codes
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {code: dtype for dtype, code in ST_DTYPES.items()}


SAMPLE_STRIDE = 256 << 10  # a sampled checksum reads SAMPLE_BYTES of every SAMPLE_STRIDE bytes
SAMPLE_BYTES = 4 << 10


class BucketChecksumError(ValueError):
    """A bucket's payload does not match the checksum it was sent with."""


@dataclass(frozen=True)
class Bucket:
    index: int  # position in this sync's stream, from 0
    payload: bytes | bytearray | memoryview  # the bucket's tensors in the safetensors layout
    checksum: int  # CRC32 of payload, full or sampled (`checksum`)
    sample_offset: int | None  # None: a full checksum
    names: tuple[str, ...]  # HF names, in order


def checksum(payload: bytes | bytearray | memoryview, sample_offset: int | None = None) -> int:
    """CRC32 of a payload as an unsigned int: of every byte, or (`sample_offset`) of the sample
    the module docstring describes."""
    if sample_offset is None:
        return zlib.crc32(payload) & 0xFFFFFFFF
    view = memoryview(payload).cast("B")
    size = len(view)
    (head_len,) = struct.unpack_from("<Q", view) if size >= 8 else (0,)
    start = min(size, 8 + head_len)
    crc = zlib.crc32(struct.pack("<QQ", size, sample_offset), zlib.crc32(view[:start]))
    for lo in range(start + sample_offset % SAMPLE_STRIDE, size, SAMPLE_STRIDE):
        crc = zlib.crc32(view[lo:lo + SAMPLE_BYTES], crc)
    return zlib.crc32(view[max(start, size - SAMPLE_BYTES):], crc) & 0xFFFFFFFF


def pack_bucket(
    index: int, tensors: list[tuple[str, torch.Tensor]], alloc: Callable[[int], memoryview | bytearray] = bytearray,
    sample_offset: int | None = None,
) -> Bucket:
    """Write (hf_name, tensor) pairs into `alloc(size)` in the safetensors layout; one copy per tensor.

    `alloc` returns a writable buffer of exactly `size` bytes. Tensors may live on any device:
    each is copied from where it lives straight into the buffer. `sample_offset`: the checksum's
    scope (None: full).
    """
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket {index} has duplicate tensor names: {sorted(n for n in set(names) if names.count(n) > 1)}")
    unknown = {str(t.dtype) for _, t in tensors if t.dtype not in ST_DTYPES}
    if unknown:
        raise ValueError(f"bucket {index}: dtypes {sorted(unknown)} have no safetensors code")
    # NOTE: largest elements first, and the header padded to 8 bytes: every tensor's data then
    # starts at a multiple of its element size, which the zero-copy views in unpack_bucket need.
    ordered = sorted(tensors, key=lambda nt: -nt[1].element_size())
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in ordered:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    buf = alloc(start + offset)
    view = memoryview(buf)
    view[:8] = struct.pack("<Q", len(head))
    view[8:start] = head
    if offset:
        data = torch.frombuffer(buf, dtype=torch.uint8, count=offset, offset=start)
        for name, t in ordered:
            lo, hi = header[name]["data_offsets"]
            if hi > lo:
                data[lo:hi].copy_(t.detach().reshape(-1).view(torch.uint8))
    return Bucket(index, buf, checksum(buf, sample_offset), sample_offset, tuple(names))


def unpack_bucket(payload: bytes | bytearray | memoryview, expected_checksum: int,
                  sample_offset: int | None = None) -> dict[str, torch.Tensor]:
    """Verify a payload's checksum (full, or sampled from `sample_offset`), then view it as
    {hf_name: tensor} without copying.

    The tensors alias `payload`: a caller keeping one past the payload's lifetime (or past the next
    write into a reused buffer) must clone it.
    """
    got = checksum(payload, sample_offset)
    if got != expected_checksum:
        scope = "full" if sample_offset is None else f"sampled from {sample_offset}"
        raise BucketChecksumError(
            f"bucket checksum mismatch: payload of {len(payload)} bytes has CRC32 ({scope}) {got:#010x}, "
            f"sender said {expected_checksum:#010x}"
        )
    (head_len,) = struct.unpack_from("<Q", payload)
    start = 8 + head_len
    header = json.loads(bytes(memoryview(payload)[8:start]))
    header.pop("__metadata__", None)
    out = {}
    with warnings.catch_warnings():
        # NOTE: an http payload is read-only `bytes`; the views are only read (the engine
        # copies them out), so torch's "buffer is not writable" warning does not apply.
        warnings.simplefilter("ignore", UserWarning)
        for name, info in header.items():
            dtype, shape = TORCH_DTYPES[info["dtype"]], info["shape"]
            lo, hi = info["data_offsets"]
            count = (hi - lo) // torch.empty((), dtype=dtype).element_size()
            out[name] = (
                torch.frombuffer(payload, dtype=dtype, count=count, offset=start + lo).view(shape)
                if count else torch.empty(shape, dtype=dtype)
            )
    return out


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int,
    alloc: Callable[[int], memoryview | bytearray] = bytearray, sample_offset: int | None = None,
) -> Iterator[Bucket]:
    """Lazily pack a stream of (hf_name, tensor) into checksummed, size-capped buckets.

    With a reused `alloc` buffer (shared memory) a bucket is valid only until the next is packed.
    `sample_offset`: sampled checksums, bucket k's from sample_offset + k * SAMPLE_BYTES (None: full).
    """
    for index, group in enumerate(group_by_cap(named_tensors, cap_bytes)):
        yield pack_bucket(index, group, alloc, None if sample_offset is None else sample_offset + index * SAMPLE_BYTES)


# ----------------------------------------------------------------------------- a shared-memory segment

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mas-wsync-"
HEADER_SLACK = 1 << 20  # room for a bucket's safetensors header beyond its tensor bytes


_LIVE_SEGMENTS: set[str] = set()  # this process's segments, for `unlink_live_segments`


def _unlink(path: str) -> None:
    _LIVE_SEGMENTS.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmSegment:
    """Sender side: a reused, owner-only file in /dev/shm; `buffer(n)` returns its first n bytes."""

    def __init__(self, initial_bytes: int):
        self.initial_bytes = initial_bytes + HEADER_SLACK
        self.path: str | None = None
        self.size = 0
        self._mm: mmap.mmap | None = None
        self._finalizer: weakref.finalize | None = None

    def buffer(self, nbytes: int) -> memoryview:
        """A writable view of `nbytes`; replaces the file by a larger one if it does not fit."""
        if self._mm is None or nbytes > self.size:
            self._create(max(nbytes, self.initial_bytes))
        assert self._mm is not None  # made by _create
        return memoryview(self._mm)[:nbytes]

    def _create(self, size: int) -> None:
        self.close()
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _LIVE_SEGMENTS.add(path)
        finalizer = weakref.finalize(self, _unlink, path)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(
                    e.errno, f"cannot reserve {size / 2**20:.0f} MiB in {SHM_DIR} ({shm_free_bytes() / 2**20:.0f} MiB free): "
                    f"lower rollout.sync_bucket_mb or set rollout.weight_transport=http"
                ) from e
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            finalizer()
            raise
        finally:
            os.close(fd)
        self.path, self.size, self._finalizer = path, size, finalizer

    def close(self) -> None:
        """Unlink the file; the mapping goes when the last view of it does."""
        if self._finalizer is not None:
            self._finalizer()
        # NOTE: no mmap.close(): a bucket's memoryview may still be alive (BufferError); dropping
        # the reference unmaps it once the views are gone.
        self._mm, self.path, self.size, self._finalizer = None, None, 0, None


def unlink_live_segments() -> int:
    """Unlink every segment this process still holds (a stop at once); returns how many."""
    paths = list(_LIVE_SEGMENTS)
    for path in paths:
        _unlink(path)
    return len(paths)


def sweep_dead_segments(shm_dir: str = SHM_DIR) -> tuple[int, int]:
    """Remove the segments of senders that are gone: `mas-wsync-<pid>-*` files directly in `shm_dir`,
    owned by this user, whose pid no longer runs. Returns (files, bytes) removed."""
    files = freed = 0
    uid = os.getuid()
    for entry in os.scandir(shm_dir):
        pid_text = entry.name.removeprefix(SHM_PREFIX).split("-", 1)[0]
        if not entry.name.startswith(SHM_PREFIX) or not pid_text.isdigit() or not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        if st.st_uid != uid or _pid_runs(int(pid_text)):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:  # another run's sweep was first
            continue
        files, freed = files + 1, freed + st.st_size
    return files, freed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def shm_free_bytes() -> int:
    """Space left in /dev/shm (a container's is often only 64 MiB)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def open_segment(path: str) -> mmap.mmap:
    """Replica side: map a sender's segment read-only; clear errors for a bad or missing path."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(SHM_PREFIX):
        raise ValueError(f"refusing shared-memory path {path!r}: not a {SHM_DIR}/{SHM_PREFIX}* segment")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {path} not found: the sender closed it, or the replica is not on "
            f"the sender's host (use rollout.weight_transport=http)"
        ) from None
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
