"""A simulated GPU for the permit scenarios: the card's memory is a model's weights plus the
working memory of the requests in flight, written atomically (temp file + rename) into a fake
NVML state file (tests/fake_nvml/README.md) as device 0 and a `process` line for this process.
A request whose memory does not fit on the card is an overflow: a simulated CUDA OOM.

Other processes on the same card (e.g. a model being launched) can be added with an "others"
file in the fake NVML's syntax, re-read on every write: its `process 0 PID BYTES` lines count
towards device 0's used memory, and all its lines are copied into the state (it must not declare
`device 0` itself; lines for other devices are fine).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple


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


class FakeCard:
    """Device 0 of the fake NVML: `start(size)` puts a request's memory on it (False: it did
    not fit, an overflow), `finish(size)` takes it off. Thread-safe; every change rewrites the
    state file."""

    def __init__(
        self,
        state_path: str,
        total_bytes: int,
        weights_bytes: int,
        others_path: Optional[str] = None,
        pid: Optional[int] = None,
    ) -> None:
        self.state_path = state_path
        self.total_bytes = total_bytes
        self.weights_bytes = weights_bytes
        self.others_path = others_path
        self.pid = pid or os.getpid()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.max_in_flight = 0
        self.max_used_bytes = 0
        self.started = 0
        self.overflows = 0
        self._write()

    def start(self, size: int) -> bool:
        with self._lock:
            others_bytes, _ = self._others()
            if self.weights_bytes + self.in_flight_bytes + others_bytes + size > self.total_bytes:
                self.overflows += 1
                return False
            self.started += 1
            self.in_flight += 1
            self.in_flight_bytes += size
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._write()
            return True

    def finish(self, size: int) -> None:
        with self._lock:
            self.in_flight -= 1
            self.in_flight_bytes -= size
            self._write()

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {
                "card_total_bytes": self.total_bytes,
                "weights_bytes": self.weights_bytes,
                "started": self.started,
                "overflows": self.overflows,
                "max_in_flight": self.max_in_flight,
                "max_used_bytes": self.max_used_bytes,
            }

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

    def _write(self) -> None:
        others_bytes, other_lines = self._others()
        own = self.weights_bytes + self.in_flight_bytes
        used = own + others_bytes
        self.max_used_bytes = max(self.max_used_bytes, used)
        text = (
            "\n".join(
                [
                    "# written by tests/permits/fakegpu.py",
                    f'device 0 name="Fake GPU" total={self.total_bytes} '
                    f"used={min(used, self.total_bytes)}",
                    f"process 0 {self.pid} {own}",
                    *other_lines,
                ]
            )
            + "\n"
        )
        temp = f"{self.state_path}.{self.pid}.tmp"
        with open(temp, "w") as state:
            state.write(text)
        os.replace(temp, self.state_path)
