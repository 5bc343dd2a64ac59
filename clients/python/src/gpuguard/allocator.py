"""What the caller's GPU allocator keeps cached, sent with each permit request (`cache_bytes` in
docs/protocol.md) so the daemon lets the caller's own cache serve its next permits.

PyTorch's caching allocator keeps the blocks a request freed inside the process: NVML keeps
showing them used, and the daemon, seeing only NVML, cannot tell that cache from the weights
(when it first saw the process with its cache already warm, after a restart of either). The
allocator knows: `torch.cuda.memory_reserved() - torch.cuda.memory_allocated()` on the current
device, less its free blocks inside segments that are partly in use (`inactive_split_bytes` in
`torch.cuda.memory_stats()`: a request larger than such a block cannot use it, and it cannot be
given back to the driver to make room). The daemon counts it only up to what NVML shows the
process holding.

No dependency on torch: it is read only when torch is already imported and CUDA initialised in
this process (a process that never touched CUDA has nothing cached); anything else reports
nothing, and the request goes out as it would without it.

The other way round, the daemon may send `trim` when another process of the same model waits
for GPU memory that this process keeps cached unused (a forked worker's cache serves no other
worker): with "torch" the client then calls `torch.cuda.empty_cache()`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Union

#: Reads the allocator's unused cache in bytes, or None when there is nothing to say.
CacheReader = Callable[[], Optional[int]]


def torch_cache_bytes() -> Optional[int]:
    """PyTorch's cached-but-unallocated bytes on the current CUDA device, or None (torch not
    imported, CUDA not initialised, or torch failed to answer)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        device = cuda.current_device()
        cached = int(cuda.memory_reserved(device)) - int(cuda.memory_allocated(device))
        stats = cuda.memory_stats(device) if hasattr(cuda, "memory_stats") else {}
        cached -= int(stats.get("inactive_split_bytes.all.current", 0))
    except Exception:  # a broken or partial torch install reports nothing, never fails a permit
        return None
    return max(cached, 0)


def cache_reader(allocator: Union[None, str, CacheReader]) -> Optional[CacheReader]:
    """The `allocator=` option of `Client` and `AsyncClient`: None (report nothing), "torch"
    (PyTorch's caching allocator), or a function returning the unused cached bytes."""
    if allocator is None:
        return None
    if allocator == "torch":
        return torch_cache_bytes
    if callable(allocator):
        return allocator
    raise ValueError(f'allocator: {allocator!r} is not None, "torch" or a function')


def torch_empty_cache() -> None:
    """Gives PyTorch's unused cached blocks back to the driver (`torch.cuda.empty_cache()`), if
    torch is imported and CUDA initialised."""
    torch: Any = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def cache_trimmer(allocator: Union[None, str, CacheReader]) -> Optional[Callable[[], None]]:
    """What gives the cache back when the daemon asks (`trim`): PyTorch's for "torch"."""
    return torch_empty_cache if allocator == "torch" else None


def with_cache(fields: dict, reader: Optional[CacheReader]) -> dict:
    """`fields` of an acquire, with what `reader` says is cached (if it says anything sane)."""
    if reader is None:
        return fields
    try:
        cached = reader()
    except Exception:
        return fields
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < 2**63:
        return fields
    return {**fields, "cache_bytes": cached}
