"""A simulated GPU for the permit scenarios, with the allocators real model servers use.

The card is device 0 of a fake NVML state file (tests/fake_nvml/README.md), shared by every
process of a scenario (a server's forked workers each hold their own memory on it): each process
keeps what the driver gave it in `STATE.procs/PID`, changed under an exclusive `flock` of
`STATE.lock`, and every change rewrites the state file atomically (temp file + rename) with the
device's used memory and one `process` line per holder. A `cudaMalloc` that does not fit in the
card's free memory fails: with the releasing allocator that is a CUDA OOM at once; the caching one
first gives its unused segments back and tries again, as PyTorch does.

The allocators, as each engine holds memory (shared/DESIGN.md, "How real servers hold GPU memory"):

- `release`: every request's memory is `cudaMalloc`ed and `cudaFree`d (what the first fakes did,
  and what no PyTorch server does).
- `caching`: PyTorch's caching allocator. Freed blocks stay in the process (NVML keeps showing
  them used); a request takes the smallest free cached block that holds it (splitting it), else
  a new segment from the driver; when the driver has no room the allocator frees its wholly unused
  segments (`release_cached_blocks`) and tries once more, then fails (CUDA OOM). Blocks are
  rounded to 2 MiB; a hole left in a segment that is partly in use cannot be given back, so mixed
  sizes fragment the cache the way they do in PyTorch without `expandable_segments`.
- `prealloc`: vLLM, SGLang and JAX: `--prealloc` of the card (vLLM's `gpu_memory_utilization`,
  JAX's 75 %) taken at start for weights and a KV pool; requests draw from the pool and wait inside
  the engine when it is full (the engine's own admission). The driver never sees a request.

Other processes on the same card (e.g. a model being launched) can be added with an "others"
file in the fake NVML's syntax, re-read on every write: its `process 0 PID BYTES` lines count
towards device 0's used memory, and all its lines are copied into the state (it must not declare
`device 0` itself; lines for other devices are fine).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

MIB = 1 << 20
# PyTorch rounds large allocations up to 2 MiB and gives each new one a segment of its own.
BLOCK_ROUND = 2 * MIB
ALLOCATORS = ("release", "caching", "prealloc")


def import_gpuguard() -> Any:
    """The gpuguard client: installed (the tests' venv), else from this repository's checkout."""
    try:
        import gpuguard
    except ImportError:
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, os.path.join(here, "..", "..", "clients", "python", "src"))
        import gpuguard
    return gpuguard


def parse_size_range(text: str) -> Tuple[int, int]:
    """ "3GiB" -> (3 GiB, 3 GiB); "1GiB-4GiB" -> (1 GiB, 4 GiB)."""
    parse_size = import_gpuguard().parse_size
    low, sep, high = text.partition("-")
    bounds = (parse_size(low), parse_size(high) if sep else parse_size(low))
    if bounds[0] > bounds[1] or bounds[1] == 0:
        raise ValueError(f"request size {text!r}: give a size or a range LOW-HIGH with LOW <= HIGH")
    return bounds


def _trace(text: str) -> None:
    """With FAKEGPU_TRACE=PATH, every change to the card (and every failed cudaMalloc, with who
    held what) is appended to PATH with its UTC time, to set beside the daemon's debug log."""
    path = os.environ.get("FAKEGPU_TRACE")
    if path:
        import datetime

        now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S.%f")
        with open(path, "a") as f:
            f.write(f"{now} {text}\n")


class Card:
    """Device 0 as the driver keeps it: what each process holds, shared by every process of the
    scenario through `STATE.procs/` and a lock file. `malloc` and `free` are the driver calls."""

    def __init__(self, state_path: str, total_bytes: int, others_path: Optional[str] = None):
        self.state_path = state_path
        self.total_bytes = total_bytes
        self.others_path = others_path
        self.procs_dir = state_path + ".procs"
        os.makedirs(self.procs_dir, exist_ok=True)
        self._thread_lock = threading.Lock()
        self.max_used_bytes = 0
        self.max_in_flight = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self.state_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _holders(self) -> Dict[int, Tuple[int, int]]:
        """pid -> (bytes held, requests in flight) of every process on the card."""
        holders = {}
        for name in os.listdir(self.procs_dir):
            if not name.isdigit():
                continue
            try:
                with open(os.path.join(self.procs_dir, name)) as f:
                    held, in_flight = (int(w) for w in f.read().split())
            except (OSError, ValueError):
                continue
            holders[int(name)] = (held, in_flight)
        return holders

    def _change(self, pid: int, held_delta: int, flight_delta: int, must_fit: bool) -> bool:
        with self._locked():
            holders = self._holders()
            others_bytes, other_lines = self._others()
            used = sum(h for h, _ in holders.values()) + others_bytes
            if must_fit and used + held_delta > self.total_bytes:
                held_mib = {p: h >> 20 for p, (h, _) in holders.items()}
                _trace(f"OOM pid {pid} wants {held_delta >> 20} MiB, used {used >> 20} MiB, {held_mib}")
                return False
            _trace(f"pid {pid} {held_delta >> 20:+} MiB, {flight_delta:+} in flight, used {(used + held_delta) >> 20} MiB")
            held, in_flight = holders.get(pid, (0, 0))
            holders[pid] = (max(held + held_delta, 0), max(in_flight + flight_delta, 0))
            path = os.path.join(self.procs_dir, str(pid))
            with open(path + ".tmp", "w") as f:
                f.write(f"{holders[pid][0]} {holders[pid][1]}\n")
            os.replace(path + ".tmp", path)
            used += holders[pid][0] - held
            self.max_used_bytes = max(self.max_used_bytes, used)
            self.max_in_flight = max(self.max_in_flight, sum(f for _, f in holders.values()))
            self._write(holders, used, other_lines)
            return True

    def malloc(self, pid: int, nbytes: int) -> bool:
        """cudaMalloc: False (out of memory) when the card's free memory is short."""
        return self._change(pid, nbytes, 0, must_fit=True)

    def free(self, pid: int, nbytes: int) -> None:
        """cudaFree."""
        self._change(pid, -nbytes, 0, must_fit=False)

    def flight(self, pid: int, delta: int) -> None:
        """A request of `pid` starts (+1) or ends (-1) its work (counted across processes)."""
        self._change(pid, 0, delta, must_fit=False)

    def exit(self, pid: int) -> None:
        """The process ended: the driver takes back everything it held."""
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.procs_dir, str(pid)))
            holders = self._holders()
            others_bytes, other_lines = self._others()
            used = sum(h for h, _ in holders.values()) + others_bytes
            self._write(holders, used, other_lines)

    def _others(self) -> Tuple[int, List[str]]:
        """The others file's bytes on device 0 and its lines (nothing when it is absent)."""
        if not self.others_path:
            return 0, []
        try:
            with open(self.others_path) as others:
                lines = [line.strip() for line in others if line.strip()]
        except FileNotFoundError:
            return 0, []
        used = 0
        for line in lines:
            words = line.split()
            if len(words) >= 4 and words[0] == "process" and words[1] == "0" and words[3].isdigit():
                used += int(words[3])
        return used, lines

    def _write(self, holders: Dict[int, Tuple[int, int]], used: int, other_lines: List[str]) -> None:
        text = "\n".join(
            [
                "# written by tests/permits/fakegpu.py",
                f'device 0 name="Fake GPU" total={self.total_bytes} '
                f"used={min(used, self.total_bytes)}",
                *(f"process 0 {pid} {held}" for pid, (held, _) in sorted(holders.items()) if held),
                *other_lines,
            ]
        )
        temp = f"{self.state_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temp, "w") as state:
            state.write(text + "\n")
        os.replace(temp, self.state_path)


class Releasing:
    """cudaMalloc and cudaFree for every request."""

    def __init__(self, card: Card, pid: int) -> None:
        self.card, self.pid = card, pid

    def alloc(self, size: int) -> Optional[Any]:
        return size if self.card.malloc(self.pid, size) else None

    def free(self, handle: Any) -> None:
        self.card.free(self.pid, handle)

    def figures(self) -> Dict[str, int]:
        return {"reserved": 0, "allocated": 0}

    def empty_cache(self) -> None:
        pass


class Caching:
    """PyTorch's caching allocator (see the top of this file): segments from the driver, split into
    blocks; freed blocks stay cached in the process until `empty_cache` or an OOM retry."""

    def __init__(self, card: Card, pid: int) -> None:
        self.card, self.pid = card, pid
        self._lock = threading.Lock()
        # Each segment: [size, blocks], each block [offset, size, in_use], in offset order.
        self.segments: List[List[Any]] = []
        self.peak_allocated = 0

    def alloc(self, size: int) -> Optional[Any]:
        size = -(-size // BLOCK_ROUND) * BLOCK_ROUND
        with self._lock:
            found = self._best_fit(size)
            if found is None:
                if not self.card.malloc(self.pid, size):
                    self._release_cached()
                    if not self.card.malloc(self.pid, size):
                        return None  # CUDA out of memory
                segment: List[Any] = [size, [[0, size, True]]]
                self.segments.append(segment)
                found = (segment, segment[1][0])
            else:
                segment, block = found
                if block[1] > size:  # split: the rest stays a free block of the same segment
                    at = segment[1].index(block)
                    segment[1].insert(at + 1, [block[0] + size, block[1] - size, False])
                    block[1] = size
                block[2] = True
            self.peak_allocated = max(self.peak_allocated, self._allocated())
            return found

    def free(self, handle: Any) -> None:
        segment, block = handle
        with self._lock:
            block[2] = False
            merged: List[List[Any]] = []
            for b in segment[1]:
                if merged and not merged[-1][2] and not b[2]:
                    merged[-1][1] += b[1]
                else:
                    merged.append(b)
            segment[1] = merged

    def empty_cache(self) -> None:
        with self._lock:
            self._release_cached()

    def _best_fit(self, size: int) -> Optional[Tuple[List[Any], List[Any]]]:
        fits = [(b[1], s, b) for s in self.segments for b in s[1] if not b[2] and b[1] >= size]
        if not fits:
            return None
        _, segment, block = min(fits, key=lambda f: f[0])
        return segment, block

    def _release_cached(self) -> None:
        for segment in [s for s in self.segments if not any(b[2] for b in s[1])]:
            self.segments.remove(segment)
            self.card.free(self.pid, segment[0])

    def _allocated(self) -> int:
        return sum(b[1] for s in self.segments for b in s[1] if b[2])

    def figures(self) -> Dict[str, int]:
        """torch.cuda.memory_reserved / memory_allocated / max_memory_allocated, and
        memory_stats()'s inactive_split_bytes (free blocks of segments partly in use)."""
        with self._lock:
            return {
                "reserved": sum(s[0] for s in self.segments),
                "allocated": self._allocated(),
                "peak_allocated": self.peak_allocated,
                "inactive_split": sum(
                    b[1] for s in self.segments if any(x[2] for x in s[1]) for b in s[1] if not b[2]
                ),
            }


class Preallocating:
    """vLLM, SGLang, JAX: a pool taken at start; requests wait in the engine for room in it."""

    def __init__(self, card: Card, pid: int, pool_bytes: int) -> None:
        if pool_bytes <= 0 or not card.malloc(pid, pool_bytes):
            raise RuntimeError("the engine's preallocation does not fit on the card")
        self.pool_bytes = pool_bytes
        self.used = 0
        self._room = threading.Condition()

    def alloc(self, size: int) -> Optional[Any]:
        if size > self.pool_bytes:
            return None  # larger than the whole KV pool: the engine rejects it
        with self._room:
            self._room.wait_for(lambda: self.used + size <= self.pool_bytes)
            self.used += size
        return size

    def free(self, handle: Any) -> None:
        with self._room:
            self.used -= handle
            self._room.notify_all()

    def figures(self) -> Dict[str, int]:
        return {"reserved": 0, "allocated": 0}

    def empty_cache(self) -> None:
        pass  # the pool is the engine's for good


class FakeCard:
    """One server process on the card: its CUDA context and weights loaded at start, then
    `start(size)` takes a request's memory through the allocator (None: CUDA OOM, counted as an
    overflow) and `finish(handle)` gives it back to the allocator. Thread-safe."""

    def __init__(
        self,
        state_path: str,
        total_bytes: int,
        weights_bytes: int,
        others_path: Optional[str] = None,
        allocator: str = "release",
        prealloc: float = 0.9,
        context_bytes: int = 0,
    ) -> None:
        self.card = Card(state_path, total_bytes, others_path)
        self.pid = os.getpid()
        self.total_bytes = total_bytes
        self.weights_bytes = weights_bytes
        self.allocator_name = allocator
        self._lock = threading.Lock()
        self.started = 0
        self.overflows = 0
        # Every process that touches CUDA holds a context (300-500 MiB on current drivers).
        if not self.card.malloc(self.pid, context_bytes):
            raise RuntimeError("the CUDA context does not fit on the card")
        if allocator == "prealloc":
            # The preallocation holds the weights and the KV pool beside them.
            self.allocator: Any = Preallocating(
                self.card, self.pid, int(total_bytes * prealloc) - weights_bytes
            )
            self.card.malloc(self.pid, weights_bytes)
        else:
            if not self.card.malloc(self.pid, weights_bytes):
                raise RuntimeError("the weights do not fit on the card")
            self.allocator = Caching(self.card, self.pid) if allocator == "caching" else (
                Releasing(self.card, self.pid)
            )

    def start(self, size: int) -> Optional[Any]:
        handle = self.allocator.alloc(size)
        with self._lock:
            if handle is None:
                self.overflows += 1
                return None
            self.started += 1
        self.card.flight(self.pid, +1)
        return handle

    def finish(self, handle: Any) -> None:
        self.card.flight(self.pid, -1)
        self.allocator.free(handle)

    def close(self) -> None:
        self.card.exit(self.pid)

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "card_total_bytes": self.total_bytes,
                "weights_bytes": self.weights_bytes,
                "allocator": self.allocator_name,
                "started": self.started,
                "overflows": self.overflows,
                "max_in_flight": self.card.max_in_flight,
                "max_used_bytes": self.card.max_used_bytes,
                **{f"allocator_{k}_bytes": v for k, v in self.allocator.figures().items()},
            }


def install_fake_torch(card: FakeCard) -> None:
    """Puts a `torch` module in sys.modules whose `torch.cuda` answers from `card`'s allocator
    (`memory_reserved`, `memory_allocated`, `max_memory_allocated`), as PyTorch answers from its
    caching allocator: what the client's `allocator="torch"` reads."""
    import types

    def figure(name: str) -> Any:
        return lambda device=None: card.allocator.figures().get(name, 0)

    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        current_device=lambda: 0,
        memory_reserved=figure("reserved"),
        memory_allocated=figure("allocated"),
        max_memory_allocated=figure("peak_allocated"),
        empty_cache=lambda: card.allocator.empty_cache(),
        memory_stats=lambda device=None: {
            "inactive_split_bytes.all.current": card.allocator.figures().get("inactive_split", 0)
        },
    )
    torch = types.ModuleType("torch")
    torch.cuda = cuda  # type: ignore[attr-defined]
    sys.modules["torch"] = torch
