"""What the caller's GPU allocator keeps cached, sent with each permit request (`cache_bytes` in
docs/protocol.md) so the daemon lets the caller's own cache serve its next permits.

PyTorch's caching allocator keeps the blocks a request freed inside the process: NVML keeps
showing them used, and the daemon, seeing only NVML, cannot tell that cache from the weights
(when it first saw the process with its cache already warm, after a restart of either). The
allocator knows: what it holds (`torch.cuda.memory_reserved()`) beyond what was allocated when
this client last held no permit (the weights), less its free blocks inside segments that are
partly in use (`inactive_split_bytes` in `torch.cuda.memory_stats()`: a request larger than such
a block cannot use it, and it cannot be given back to the driver to make room). The daemon
counts it only up to what NVML shows the process holding, and sets this process's permits
against it.

No dependency on torch: it is read only when torch is already imported and CUDA initialised in
this process (a process that never touched CUDA has nothing cached); anything else reports
nothing, and the request goes out as it would without it.

The other way round, the daemon may send `trim` when another process of the same model waits
for GPU memory that this process may keep cached unused (a forked worker's cache serves no other
worker): the client then calls `torch.cuda.empty_cache()` if torch is loaded with CUDA
initialised, with `allocator="torch"` or none at all (a PyTorch server's workers starve each
other otherwise: freed blocks stay in the process until its own `cudaMalloc` fails). A caller
that names a function of its own for its allocator empties nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, Optional, Union

#: Reads what the allocator holds for work, in bytes, or None when there is nothing to say;
#: called with `idle=True` when this client holds no permit.
CacheReader = Callable[..., Optional[int]]


class TorchCache:
    """PyTorch's caching allocator on the current CUDA device, read for `cache_bytes`: what it
    holds (`memory_reserved`) beyond what was allocated the last time this client held no
    permit (the weights), less its free blocks stranded in segments partly in use
    (`inactive_split_bytes`): the memory this process's permits use or may reuse. Read relative
    to that idle moment, not as what is unused right now, it does not go stale while permits come
    and go between two requests. Before any idle moment: what is unused now."""

    def __init__(self) -> None:
        self.idle_allocated: Dict[int, int] = {}

    def __call__(self, idle: bool = False) -> Optional[int]:
        torch: Any = sys.modules.get("torch")
        if torch is None:
            return None
        try:
            cuda = torch.cuda
            if not cuda.is_initialized():
                return None
            device = cuda.current_device()
            reserved = int(cuda.memory_reserved(device))
            allocated = int(cuda.memory_allocated(device))
            stats = cuda.memory_stats(device) if hasattr(cuda, "memory_stats") else {}
            stranded = int(stats.get("inactive_split_bytes.all.current", 0))
        except Exception:  # a broken or partial torch install reports nothing, never fails a permit
            return None
        if idle:
            self.idle_allocated[device] = allocated
        base = self.idle_allocated.get(device, allocated)
        return max(reserved - base - stranded, 0)


def torch_cache_bytes() -> Optional[int]:
    """PyTorch's cached-but-unallocated bytes on the current CUDA device (less the stranded
    ones), or None (torch not imported, CUDA not initialised, or torch failed to answer)."""
    return TorchCache()()


def cache_reader(allocator: Union[None, str, CacheReader]) -> Optional[CacheReader]:
    """The `allocator=` option of `Client` and `AsyncClient`: None (report nothing), "torch"
    (PyTorch's caching allocator), or a function returning the bytes its allocator holds for
    work (called without arguments)."""
    if allocator is None:
        return None
    if allocator == "torch":
        return TorchCache()
    if callable(allocator):
        function = allocator
        return lambda idle=False: function()
    raise ValueError(f'allocator: {allocator!r} is not None, "torch" or a function')


def torch_empty_cache() -> None:
    """Gives PyTorch's unused cached blocks back to the driver (`torch.cuda.empty_cache()`), if
    torch is imported and CUDA initialised."""
    torch: Any = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def cache_trimmer(allocator: Union[None, str, CacheReader]) -> Optional[Callable[[], None]]:
    """What gives the cache back when the daemon asks (`trim`): PyTorch's, for "torch" and for
    no allocator named (it does nothing unless torch is loaded with CUDA initialised); nothing
    for a function of the caller's own."""
    return torch_empty_cache if allocator in (None, "torch") else None


def with_cache(fields: dict, reader: Optional[CacheReader], idle: bool) -> dict:
    """`fields` of an acquire, with what `reader` says is cached (if it says anything sane) and
    when it was read (`cache_read_at_ns`, CLOCK_MONOTONIC: the daemon voids a report read before
    NVML last showed this process's memory change, as the allocator may have given some back
    since); `idle`: the client holds no permit now."""
    if reader is None:
        return fields
    read_at = time.monotonic_ns()
    try:
        cached = reader(idle=idle)
    except Exception:
        return fields
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < 2**63:
        return fields
    return {**fields, "cache_bytes": cached, "cache_read_at_ns": read_at}
