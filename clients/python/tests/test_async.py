"""The asyncio client against the fake daemon over a real unix socket: grants and refusals, 64
concurrent tasks on one connection, cancelled tasks that never leak a permit, the client's own
timeout, expiry, reconnects and lost connections."""

import asyncio
import unittest

from gpuguard import AsyncClient, DaemonUnavailable, PermitRefused
from support import GIB, MIB, FakeDaemonCase


class AsyncCase(FakeDaemonCase):
    client_options: dict = {}

    def run_async(self, test):
        """Runs `test(client)` in a fresh event loop with a client that is closed after."""

        async def main():
            client = AsyncClient(self.socket, **self.client_options)
            try:
                return await test(client)
            finally:
                await client.aclose()

        return asyncio.run(main())

    async def until(self, predicate):
        """Waits (off the event loop, so the client keeps reading) until the daemon state
        satisfies `predicate`."""
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.wait_for, predicate)

    def released_all(self, count):
        return (
            lambda: self.daemon.held() == 0 and len(self.daemon.messages("release_permit")) == count
        )


class Grants(AsyncCase):
    daemon_options = dict(gpu_capacity=8 * GIB)

    def test_permit_held_inside_the_block_and_released_after(self):
        async def test(client):
            async with client.permit(
                gpu_bytes="2GiB", ram_bytes="1GiB", model="m", timeout=5, ttl=9
            ) as permit:
                self.assertEqual(self.daemon.held(), 1)
                self.assertEqual(
                    (permit.gpu_bytes, permit.ram_bytes, permit.ttl), (2 * GIB, GIB, 9.0)
                )
            return permit

        permit = self.run_async(test)
        self.assertTrue(permit.released)
        self.assertEqual(self.daemon.held(), 0)
        [acquire] = self.daemon.messages("acquire")
        self.assertEqual(
            (acquire["model"], acquire["timeout_ms"], acquire["ttl_ms"]), ("m", 5000, 9000)
        )

    def test_released_when_the_block_raises_or_is_cancelled(self):
        async def test(client):
            with self.assertRaises(KeyError):
                async with client.permit(GIB, timeout=5):
                    raise KeyError("boom")
            entered = asyncio.Event()

            async def hold():
                async with client.permit(GIB, timeout=5):
                    entered.set()
                    await asyncio.sleep(3600)

            task = asyncio.ensure_future(hold())
            await entered.wait()
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task

        self.run_async(test)
        self.assertEqual(self.daemon.held(), 0)
        self.assertEqual(len(self.daemon.messages("release_permit")), 2)

    def test_refusal_carries_every_field(self):
        async def test(client):
            await client.acquire(7 * GIB)
            with self.assertRaises(PermitRefused) as caught:
                await client.acquire(2 * GIB, timeout=0.05)
            return caught.exception

        refused = self.run_async(test)
        self.assertEqual((refused.reason, refused.retry_after), ("timeout", 1.0))
        self.assertEqual(refused.needed, {"gpu_bytes": 2 * GIB, "ram_bytes": 0, "gpu": None})
        self.assertEqual(refused.free, {"gpu_bytes": GIB, "ram_bytes": 64 * GIB})
        self.assertIn("did not fit in time", refused.message)

    def test_status(self):
        async def test(client):
            async with client.permit(GIB):
                return await client.status()

        self.assertEqual(self.run_async(test)["permits"]["held"], 1)

    def test_one_client_across_event_loops(self):
        client = AsyncClient(self.socket)

        async def once():
            async with client.permit(GIB, timeout=5) as permit:
                return permit.gpu_bytes

        self.assertEqual(asyncio.run(once()), GIB)
        self.assertEqual(asyncio.run(once()), GIB)
        asyncio.run(client.aclose())
        self.assertEqual(self.daemon.connections, 2)


class ManyTasks(AsyncCase):
    # First fit: later, smaller requests are granted before earlier ones, so answers come back
    # in another order than the requests went out.
    daemon_options = dict(gpu_capacity=4 * GIB, first_fit=True)

    def test_sixty_four_tasks_share_one_connection(self):
        tasks, rounds = 64, 3

        async def worker(client, task):
            got = []
            for round_ in range(rounds):
                size = (task * rounds + round_ + 1) * 16 * MIB  # unique per request; they queue
                async with client.permit(gpu_bytes=size, timeout=60) as permit:
                    got.append((size, permit.gpu_bytes, permit.id))
                    await asyncio.sleep(0)
            return got

        async def test(client):
            return await asyncio.gather(*(worker(client, t) for t in range(tasks)))

        pairs = [pair for got in self.run_async(test) for pair in got]
        self.assertEqual(len(pairs), tasks * rounds)
        for asked, granted, _ in pairs:
            self.assertEqual(asked, granted)
        self.assertEqual(len({permit_id for _, _, permit_id in pairs}), tasks * rounds)
        self.assertEqual(self.daemon.connections, 1)
        self.assertEqual(self.daemon.held(), 0)
        self.assertLessEqual(self.daemon.max_held_gpu_bytes, 4 * GIB)


class Cancels(AsyncCase):
    """A task cancelled while it waits sends `cancel`; a grant that comes anyway is released."""

    daemon_options = dict(gpu_capacity=8 * GIB)
    client_options = dict(timeout_margin=0.05, cancel_grace=30)

    def setUp(self):
        super().setUp()
        self.daemon.silent = True

    def cancel_a_waiting_task(self):
        async def test(client):
            task = asyncio.ensure_future(client.acquire(GIB, timeout=600))
            await self.until(lambda: self.daemon.waiting() == 1)
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task
            await self.until(lambda: len(self.daemon.messages("cancel")) == 1)
            return client

        return self.run_async(test)

    def test_cancelled_task_sends_cancel(self):
        self.cancel_a_waiting_task()
        self.assertEqual(self.daemon.waiting(), 0)
        self.assertEqual(self.daemon.held(), 0)

    def test_grant_crossing_the_cancel_is_released(self):
        self.daemon.grant_on_cancel = True

        async def test(client):
            task = asyncio.ensure_future(client.acquire(GIB, timeout=600))
            await self.until(lambda: self.daemon.waiting() == 1)
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task
            await self.until(self.released_all(1))

        self.run_async(test)

    def test_wait_for_timeout_on_acquire_never_leaks(self):
        self.daemon.ignore_cancel = True

        async def test(client):
            with self.assertRaises(asyncio.TimeoutError):
                await asyncio.wait_for(client.acquire(GIB, timeout=600), 0.05)
            await self.until(lambda: len(self.daemon.messages("cancel")) == 1)
            self.daemon.grant_waiting()  # the grant comes after all
            await self.until(self.released_all(1))
            self.daemon.silent = False
            async with client.permit(GIB, timeout=5) as permit:  # the connection still works
                self.assertTrue(permit.active)

        self.run_async(test)

    def test_client_timeout(self):
        async def test(client):
            with self.assertRaises(PermitRefused) as caught:
                await client.acquire(GIB, timeout=0.05)
            return caught.exception

        refused = self.run_async(test)
        self.assertEqual(refused.reason, "timeout")
        [acquire] = self.daemon.messages("acquire")
        self.assertEqual(len(self.received("cancel", id=acquire["id"])), 1)


class Ends(AsyncCase):
    daemon_options = dict(gpu_capacity=4 * GIB, idle_close_s=0.2)

    def test_expired_permit_is_marked_and_its_release_is_a_no_op(self):
        async def test(client):
            async with client.permit(GIB) as permit:
                self.daemon.expire_all()
                await self.until(lambda: self.daemon.held() == 0)
                await client.release(await client.acquire(GIB))  # read after the notice
                self.assertTrue(permit.expired)
            return permit

        permit = self.run_async(test)
        self.assertEqual(self.received("release_permit", permit=permit.id), [])

    def test_reconnects_after_idle_close_and_resends_a_cut_wait(self):
        async def test(client):
            await client.release(await client.acquire(GIB))
            await self.until(lambda: self.daemon.closed_connections == 1)
            await client.release(await client.acquire(GIB))
            self.assertEqual(self.daemon.connections, 2)
            self.daemon.silent = True
            task = asyncio.ensure_future(client.acquire(GIB, timeout=60))
            await self.until(lambda: self.daemon.waiting() == 1)
            self.daemon.silent = False
            self.daemon.drop_connections()
            permit = await task
            self.assertEqual(self.daemon.connections, 3)
            return permit

        self.assertEqual(self.run_async(test).gpu_bytes, GIB)

    def test_a_drop_while_permits_are_held_is_not_hidden(self):
        async def test(client):
            held = await client.acquire(3 * GIB)
            waiter = asyncio.ensure_future(client.acquire(3 * GIB, timeout=60))
            await self.until(lambda: self.daemon.waiting() == 1)
            self.daemon.drop_connections()
            with self.assertRaises(DaemonUnavailable):
                await waiter
            self.assertTrue(held.lost)
            await client.release(held)  # a no-op

        self.run_async(test)
        self.assertEqual(self.daemon.messages("release_permit"), [])


if __name__ == "__main__":
    unittest.main()
