"""The permit scenario's card when it is a real GPU: `seed_server.py --real-gpu` serves its
requests with real PyTorch tensors on `cuda:0`, through PyTorch's own caching allocator, so the
scenario runs against what fakegpu.py only imitates (the cache NVML keeps seeing, the retry after
`release_cached_blocks`, the CUDA context, a real `torch.cuda.OutOfMemoryError`).

`RealCard` has FakeCard's interface (`start`, `finish`, `close`, `stats`): a request's memory is
one `torch.empty(size, dtype=uint8)` written once (so it is really there), freed into PyTorch's
cache at `finish`. The card's size is whatever the driver has free: `bench/gpu/real-permits.sh`
leaves a given amount free with a ballast process. Needs torch with CUDA; used only on a machine
with a GPU, never by the test suite.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional


class RealCard:
    """One server process on the real GPU 0: its weights are a resident tensor, each request a
    tensor of its size from PyTorch's caching allocator (None: CUDA OOM, counted as an overflow).
    Thread-safe."""

    def __init__(self, weights_bytes: int) -> None:
        import torch  # only here: the fake scenarios never import it

        self.torch = torch
        self.device = torch.device("cuda:0")
        self.weights_bytes = weights_bytes
        self.weights = torch.empty(weights_bytes, dtype=torch.uint8, device=self.device)
        self.weights.fill_(1)
        torch.cuda.synchronize(self.device)
        self._lock = threading.Lock()
        self.started = self.overflows = self.in_flight = self.max_in_flight = 0
        self.max_reserved = torch.cuda.memory_reserved(self.device)
        # What the allocator looked like at each CUDA OOM, and what the client reported
        # caching (the first few of each, for the run's report).
        self.ooms: list = []
        self.reports: list = []

    def start(self, size: int) -> Optional[Any]:
        torch = self.torch
        try:
            tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            tensor.fill_(1)
            torch.cuda.synchronize(self.device)
        except torch.cuda.OutOfMemoryError:
            with self._lock:
                self.overflows += 1
                if len(self.ooms) < 5:
                    self.ooms.append(self._allocator_state(size))
            return None
        with self._lock:
            self.started += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.max_reserved = max(self.max_reserved, torch.cuda.memory_reserved(self.device))
        return tensor

    def _allocator_state(self, size: int) -> Dict[str, Any]:
        """The request that failed, the allocator's figures and its segments (size, in use)."""
        torch = self.torch
        stats = torch.cuda.memory_stats(self.device)
        segments = [
            (s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()
        ]
        return {
            "size": size,
            "in_flight": self.in_flight,
            "free": torch.cuda.mem_get_info(self.device)[0],
            "reserved": torch.cuda.memory_reserved(self.device),
            "allocated": torch.cuda.memory_allocated(self.device),
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0),
            "segments": sorted(segments, reverse=True),
        }

    def traced(self, reader: Any) -> Any:
        """`reader` (the client's cache reader), recording what it reports."""

        def read(idle: bool = False) -> Any:
            value = reader(idle=idle)
            with self._lock:
                if len(self.reports) < 40:
                    self.reports.append((idle, value, self.in_flight))
            return value

        return read

    def finish(self, handle: Any) -> None:
        with self._lock:
            self.in_flight -= 1
        del handle  # back into PyTorch's cache, not to the driver

    def close(self) -> None:
        self.weights = None

    def stats(self) -> Dict[str, Any]:
        torch = self.torch
        free, total = torch.cuda.mem_get_info(self.device)
        with self._lock:
            return {
                "card_total_bytes": total,
                "weights_bytes": self.weights_bytes,
                "allocator": "torch-cuda",
                "started": self.started,
                "overflows": self.overflows,
                "max_in_flight": self.max_in_flight,
                # What this process took from the driver at most (PyTorch's reserved memory).
                "max_used_bytes": self.max_reserved,
                "allocator_reserved_bytes": torch.cuda.memory_reserved(self.device),
                "allocator_allocated_bytes": torch.cuda.memory_allocated(self.device),
                "free_at_end_bytes": free,
                "ooms": self.ooms,
                "cache_reports": self.reports,
            }
