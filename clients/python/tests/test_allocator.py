"""The PyTorch integration (`allocator="torch"`) against a fake `torch` module in sys.modules:
what each acquire carries as `cache_bytes`, and that nothing is sent (and nothing fails) where
torch is absent, CUDA uninitialised, or torch broken."""

import asyncio
import sys
import time
import types
import unittest

from gpuguard import AsyncClient, Client
from gpuguard.allocator import torch_cache_bytes
from support import GIB, FakeDaemonCase


class FakeCuda:
    """torch.cuda as the caching allocator reports it: per device, reserved and allocated."""

    def __init__(self, reserved, allocated, initialized=True, device=0, split=None):
        self.reserved, self.allocated, self.split = reserved, allocated, split or {}
        self.initialized, self.device = initialized, device
        self.asked = []

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return self.device

    def memory_reserved(self, device):
        self.asked.append(device)
        return self.reserved[device]

    def memory_allocated(self, device):
        return self.allocated[device]

    def memory_stats(self, device):
        return {"inactive_split_bytes.all.current": self.split.get(device, 0)}

    def empty_cache(self):
        self.emptied = getattr(self, "emptied", 0) + 1


class FakeTorch(unittest.TestCase):
    def install(self, cuda):
        torch = types.ModuleType("torch")
        torch.cuda = cuda
        previous = sys.modules.get("torch")
        sys.modules["torch"] = torch
        self.addCleanup(
            lambda: sys.modules.__setitem__("torch", previous)
            if previous is not None
            else sys.modules.pop("torch", None)
        )


class Reading(FakeTorch):
    def test_reserved_minus_allocated_on_the_current_device(self):
        cuda = FakeCuda({0: 13 * GIB, 1: 20 * GIB}, {0: 4 * GIB, 1: 19 * GIB}, device=1)
        self.install(cuda)
        self.assertEqual(torch_cache_bytes(), GIB)
        self.assertEqual(cuda.asked, [1])

    def test_free_blocks_stranded_in_segments_in_use_do_not_count(self):
        self.install(FakeCuda({0: 13 * GIB}, {0: 6 * GIB}, split={0: 2 * GIB}))
        self.assertEqual(torch_cache_bytes(), 5 * GIB)

    def test_nothing_without_torch_or_before_cuda_is_initialised(self):
        sys.modules.pop("torch", None)
        self.assertIsNone(torch_cache_bytes())
        self.assertNotIn("torch", sys.modules, "reading must never import torch")
        self.install(FakeCuda({0: GIB}, {0: 0}, initialized=False))
        self.assertIsNone(torch_cache_bytes())

    def test_a_broken_torch_reports_nothing(self):
        cuda = FakeCuda({}, {})  # every device lookup raises KeyError
        self.install(cuda)
        self.assertIsNone(torch_cache_bytes())


class Sent(FakeDaemonCase, FakeTorch):
    daemon_options = dict(gpu_capacity=8 * GIB)

    def test_each_acquire_carries_the_cache_as_it_is_then(self):
        cuda = FakeCuda({0: 13 * GIB}, {0: 4 * GIB})
        self.install(cuda)
        client = Client(self.socket, allocator="torch")
        self.addCleanup(client.close)
        with client.permit(gpu_bytes="3GiB", timeout=5):
            pass
        cuda.allocated[0] = 7 * GIB
        with client.permit(gpu_bytes="3GiB", timeout=5):
            pass
        acquires = self.daemon.messages("acquire")
        self.assertEqual([m.get("cache_bytes") for m in acquires], [9 * GIB, 6 * GIB])
        # With when the allocator was read, on the daemon's clock (CLOCK_MONOTONIC): the
        # daemon voids a report read before NVML last showed the process's memory change.
        read_at = [m["cache_read_at_ns"] for m in acquires]
        self.assertTrue(read_at[0] < read_at[1] <= time.monotonic_ns(), read_at)

    def test_while_permits_are_out_it_counts_from_the_idle_allocation(self):
        # Idle, 4 GiB allocated (the weights), 13 GiB held: 9 GiB for work. A permit's work then
        # allocates 3 GiB out of the cache: still 9 GiB for this process's permits, not 6.
        cuda = FakeCuda({0: 13 * GIB}, {0: 4 * GIB})
        self.install(cuda)
        client = Client(self.socket, allocator="torch")
        self.addCleanup(client.close)
        with client.permit(gpu_bytes="3GiB", timeout=5):
            cuda.allocated[0] = 7 * GIB
            with client.permit(gpu_bytes="3GiB", timeout=5):
                pass
        sent = [m.get("cache_bytes") for m in self.daemon.messages("acquire")]
        self.assertEqual(sent, [9 * GIB, 9 * GIB])

    def test_the_async_client_too(self):
        self.install(FakeCuda({0: 5 * GIB}, {0: 4 * GIB}))

        async def run():
            client = AsyncClient(self.socket, allocator="torch")
            async with client.permit(gpu_bytes="1GiB", timeout=5):
                pass
            await client.aclose()

        asyncio.run(run())
        [acquire] = self.daemon.messages("acquire")
        self.assertEqual(acquire["cache_bytes"], GIB)

    def test_without_the_option_or_without_cuda_nothing_is_sent(self):
        self.install(FakeCuda({0: 13 * GIB}, {0: 4 * GIB}, initialized=False))
        for allocator in (None, "torch"):
            client = Client(self.socket, allocator=allocator)
            with client.permit(gpu_bytes="1GiB", timeout=5):
                pass
            client.close()
        for acquire in self.daemon.messages("acquire"):
            self.assertNotIn("cache_bytes", acquire)
            self.assertNotIn("cache_read_at_ns", acquire)

    def test_a_reader_that_fails_or_lies_is_ignored(self):
        for reader in (lambda: 1 / 0, lambda: -5, lambda: "9GiB", lambda: True):
            client = Client(self.socket, allocator=reader)
            with client.permit(gpu_bytes="1GiB", timeout=5):
                pass
            client.close()
        for acquire in self.daemon.messages("acquire"):
            self.assertNotIn("cache_bytes", acquire)
            self.assertNotIn("cache_read_at_ns", acquire)

    def test_a_trim_from_the_daemon_empties_the_cache_and_breaks_nothing(self):
        cuda = FakeCuda({0: 13 * GIB}, {0: 4 * GIB})
        self.install(cuda)
        client = Client(self.socket, allocator="torch")
        self.addCleanup(client.close)
        with client.permit(gpu_bytes="1GiB", timeout=5):
            self.daemon.send_all({"type": "trim", "gpu": 0, "bytes": 9 * GIB})
            self.daemon.send_all({"type": "trim", "gpu": -1, "bytes": "all"})  # malformed
            with client.permit(gpu_bytes="1GiB", timeout=5):  # the connection still works
                pass
        self.assertEqual(getattr(cuda, "emptied", 0), 1)
        client.close()
        # Without the option too: a PyTorch server's forked workers starve each other if the
        # one holding a cache never gives it back (issue #22: 15/30 served on two workers).
        # A function of the caller's own for its allocator: its cache is none of PyTorch's.
        for allocator, emptied in ((None, 2), (lambda: GIB, 2)):
            other = Client(self.socket, allocator=allocator)
            self.addCleanup(other.close)
            with other.permit(gpu_bytes="1GiB", timeout=5):
                self.daemon.send_all({"type": "trim", "gpu": 0, "bytes": GIB})
                with other.permit(gpu_bytes="1GiB", timeout=5):  # the trim was read before
                    pass
            self.assertEqual(cuda.emptied, emptied, allocator)
            other.close()

    def test_the_async_client_empties_it_too(self):
        cuda = FakeCuda({0: 5 * GIB}, {0: 4 * GIB})
        self.install(cuda)

        async def run():
            client = AsyncClient(self.socket, allocator="torch")
            async with client.permit(gpu_bytes="1GiB", timeout=5):
                self.daemon.send_all({"type": "trim", "gpu": 0, "bytes": GIB})
                async with client.permit(gpu_bytes="1GiB", timeout=5):
                    pass
            await client.aclose()

        asyncio.run(run())
        self.assertEqual(getattr(cuda, "emptied", 0), 1)

    def test_an_unknown_allocator_is_refused_at_once(self):
        with self.assertRaisesRegex(ValueError, "allocator"):
            Client(self.socket, allocator="jax")


if __name__ == "__main__":
    unittest.main()
