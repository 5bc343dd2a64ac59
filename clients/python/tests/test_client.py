"""The blocking client against the fake daemon over a real unix socket: grants, refusals with
every field, the client's own timeout and cancel races, KeyboardInterrupt, expiry, reconnects,
lost connections and 16 threads sharing one connection."""

import itertools
import os
import signal
import threading
import unittest
from pathlib import Path

import gpuguard
from gpuguard import Client, DaemonUnavailable, PermitRefused, ProtocolError
from support import GIB, MIB, FakeDaemonCase


class Background(threading.Thread):
    """Runs `function` on a thread; `result()` returns its value or raises its exception."""

    def __init__(self, function):
        super().__init__(daemon=True)
        self._function = function
        self._value = self._error = None
        self.start()

    def run(self):
        try:
            self._value = self._function()
        except BaseException as err:  # noqa: B902 - handed to the test's thread
            self._error = err

    def result(self):
        self.join(120)
        assert not self.is_alive(), "background call hung"
        if self._error is not None:
            raise self._error
        return self._value


class Grants(FakeDaemonCase):
    daemon_options = dict(gpu_capacity=8 * GIB)

    def setUp(self):
        super().setUp()
        self.client = Client(self.socket)
        self.addCleanup(self.client.close)

    def test_permit_is_held_inside_the_block_and_released_after(self):
        with self.client.permit(
            gpu_bytes="3GiB", ram_bytes=512 * MIB, model="qwen", timeout=5, ttl=30
        ) as permit:
            self.assertEqual(self.daemon.held(), 1)
            self.assertEqual(
                (permit.gpu, permit.gpu_bytes, permit.ram_bytes), (0, 3 * GIB, 512 * MIB)
            )
            self.assertEqual(permit.ttl, 30.0)
            self.assertTrue(permit.active)
        self.assertEqual(self.daemon.held(), 0)
        self.assertTrue(permit.released)
        [acquire] = self.daemon.messages("acquire")
        self.assertEqual(
            {k: acquire[k] for k in ("model", "gpu_bytes", "ram_bytes", "timeout_ms", "ttl_ms")},
            {
                "model": "qwen",
                "gpu_bytes": 3 * GIB,
                "ram_bytes": 512 * MIB,
                "timeout_ms": 5000,
                "ttl_ms": 30000,
            },
        )
        self.assertEqual(self.received("release_permit", permit=permit.id)[0]["version"], 1)

    def test_released_when_the_block_raises(self):
        with self.assertRaises(ZeroDivisionError):
            with self.client.permit(gpu_bytes=GIB, timeout=5):
                1 / 0
        self.assertEqual(self.daemon.held(), 0)
        self.assertEqual(len(self.daemon.messages("release_permit")), 1)

    def test_acquire_and_release_as_methods_and_double_release(self):
        permit = self.client.acquire(GIB, timeout=5)
        self.client.release(permit)
        self.client.release(permit)
        self.assertEqual(len(self.daemon.messages("release_permit")), 1)

    def test_a_waiter_gets_the_memory_a_holder_releases(self):
        holder = self.client.acquire(6 * GIB, timeout=5)
        waiter = Background(lambda: self.client.acquire(4 * GIB, timeout=60))
        self.daemon.wait_for(lambda: self.daemon.waiting() == 1)
        self.client.release(holder)
        permit = waiter.result()
        self.assertEqual(permit.gpu_bytes, 4 * GIB)
        self.assertEqual(self.daemon.held(), 1)

    def test_refusal_carries_every_field(self):
        self.client.acquire(7 * GIB, timeout=5)
        with self.assertRaises(PermitRefused) as caught:
            self.client.acquire(2 * GIB, timeout=0.05)
        refused = caught.exception
        self.assertEqual(refused.reason, "timeout")
        self.assertEqual(refused.retry_after, 1.0)
        self.assertEqual(refused.needed, {"gpu_bytes": 2 * GIB, "ram_bytes": 0, "gpu": None})
        self.assertEqual(refused.free, {"gpu_bytes": GIB, "ram_bytes": 64 * GIB})
        self.assertIn("did not fit in time", refused.message)
        self.assertTrue(refused.transient)
        self.assertIn("timeout", str(refused))

    def test_a_draining_host_is_a_transient_refusal(self):
        # A load balancer should send the request elsewhere (503 + Retry-After), not fail it.
        for reason in ("host_maintenance", "preempted"):
            refused = PermitRefused(reason, "GCE announced host maintenance", retry_after=60.0)
            self.assertTrue(refused.transient, reason)
        self.assertFalse(PermitRefused("too_large", "never fits").transient)

    def test_too_large_is_refused_at_once(self):
        # The daemon says what can never fit (the client checks no size itself): its answer
        # comes at once, however long the request may wait.
        with self.assertRaises(PermitRefused) as caught:
            self.client.acquire("100GiB", timeout=600)
        self.assertEqual(caught.exception.reason, "too_large")
        self.assertFalse(caught.exception.transient)
        self.assertIsNone(caught.exception.retry_after)
        self.assertEqual(len(self.received("acquire", gpu_bytes=100 * GIB)), 1)

    def test_status(self):
        with self.client.permit(GIB):
            self.assertEqual(self.client.status()["permits"]["held"], 1)


class ReasonsAsDocumented(unittest.TestCase):
    """`transient` for every refusal reason is docs/protocol.md's: the reasons `gpuguard launch`
    and `gpuguard permit` exit 75 for (try again later, or elsewhere) and no other."""

    def documented(self):
        doc = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
        if not doc.exists():
            self.skipTest(f"{doc}: not in a gpuguard checkout")
        after = doc.read_text().split("<!-- refusals -->", 1)[1].lstrip().splitlines()
        rows = list(itertools.takewhile(lambda line: line.startswith("|"), after))[2:]
        cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
        return [(reason.strip("`"), int(code), transient) for reason, code, transient, _ in cells]

    def test_transient_is_the_documented_answer_for_every_reason(self):
        rows = self.documented()
        self.assertGreaterEqual(len(rows), 9, rows)
        for reason, code, transient in rows:
            self.assertIn(transient, ("yes", "no"), reason)
            self.assertEqual(PermitRefused(reason, "m").transient, transient == "yes", reason)
            self.assertEqual(transient == "yes", code == 75, f"{reason}: exit {code}")
        self.assertEqual(
            gpuguard.errors.TRANSIENT_REASONS, {r for r, _, t in rows if t == "yes"}
        )
        # A reason this client does not know yet is not worth retrying blindly.
        self.assertFalse(PermitRefused("a_new_reason", "m").transient)


class Cancels(FakeDaemonCase):
    """The daemon does not answer in time: the client cancels, and a grant that comes anyway is
    given back, never leaked."""

    daemon_options = dict(gpu_capacity=8 * GIB)

    def setUp(self):
        super().setUp()
        self.daemon.silent = True  # acquires wait without a daemon-side timeout
        self.client = Client(self.socket, timeout_margin=0.05, cancel_grace=30)
        self.addCleanup(self.client.close)

    def test_client_timeout_sends_cancel_and_reports_the_daemons_refusal(self):
        with self.assertRaises(PermitRefused) as caught:
            self.client.acquire(GIB, timeout=0.05)
        [acquire] = self.daemon.messages("acquire")
        self.assertEqual(len(self.received("cancel", id=acquire["id"])), 1)
        refused = caught.exception
        self.assertEqual(refused.reason, "timeout")  # the daemon said "cancelled"
        self.assertEqual(refused.needed["gpu_bytes"], GIB)
        self.assertEqual(self.daemon.waiting(), 0)

    def test_grant_crossing_the_cancel_is_released(self):
        self.daemon.grant_on_cancel = True
        with self.assertRaises(PermitRefused) as caught:
            self.client.acquire(GIB, timeout=0.05)
        self.assertEqual(caught.exception.reason, "timeout")
        self.daemon.wait_for(
            lambda: self.daemon.held() == 0 and len(self.daemon.messages("release_permit")) == 1
        )

    def test_grant_after_the_client_gave_up_is_released(self):
        self.daemon.ignore_cancel = True
        client = Client(self.socket, timeout_margin=0.05, cancel_grace=0.05)
        self.addCleanup(client.close)
        with self.assertRaises(PermitRefused) as caught:
            client.acquire(GIB, timeout=0.05)
        self.assertIn("no answer from the gpuguard daemon", caught.exception.message)
        self.assertEqual(len(self.daemon.messages("cancel")), 1)
        self.daemon.grant_waiting()  # the grant comes after all
        self.daemon.wait_for(
            lambda: self.daemon.held() == 0 and len(self.daemon.messages("release_permit")) == 1
        )
        # The connection is still good for the next permit.
        self.daemon.silent = False
        with client.permit(GIB, timeout=5) as permit:
            self.assertTrue(permit.active)

    @unittest.skipUnless(
        threading.current_thread() is threading.main_thread(), "needs the main thread"
    )
    def test_keyboard_interrupt_cancels_and_a_late_grant_is_released(self):
        self.daemon.ignore_cancel = True
        # Ctrl-C as Python handles it, whatever this process inherited: a shell that starts a
        # job in the background without job control has it ignore SIGINT, and Python then
        # installs no handler (the interrupt below would be lost and the acquire wait 600 s).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.addCleanup(signal.signal, signal.SIGINT, previous)

        def interrupt():
            self.daemon.wait_for(lambda: self.daemon.waiting() == 1)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        Background(interrupt)
        with self.assertRaises(KeyboardInterrupt):
            self.client.acquire(GIB, timeout=600)
        self.daemon.wait_for(lambda: len(self.daemon.messages("cancel")) == 1)
        self.daemon.grant_waiting()
        self.daemon.wait_for(
            lambda: self.daemon.held() == 0 and len(self.daemon.messages("release_permit")) == 1
        )


class Ends(FakeDaemonCase):
    """Expiry, idle close and reconnect, and a connection lost while permits are held."""

    daemon_options = dict(gpu_capacity=4 * GIB, idle_close_s=0.2)

    def setUp(self):
        super().setUp()
        self.client = Client(self.socket)
        self.addCleanup(self.client.close)

    def test_expired_permit_is_marked_and_its_release_is_a_no_op(self):
        with self.client.permit(GIB, ttl=60) as permit:
            self.daemon.expire_all()
            self.daemon.wait_for(lambda: self.daemon.held() == 0)
            # An answer on the same connection comes after the expiry notice, so by now the
            # client has read it.
            self.client.release(self.client.acquire(GIB, timeout=5))
            self.assertTrue(permit.expired)
            self.assertFalse(permit.active)
            self.assertIn("TTL", permit.expired_message)
        self.assertEqual(self.received("release_permit", permit=permit.id), [])

    def test_reconnects_after_the_daemon_closed_an_idle_connection(self):
        self.client.release(self.client.acquire(GIB, timeout=5))
        self.daemon.wait_for(lambda: self.daemon.closed_connections == 1)
        with self.client.permit(GIB, timeout=5) as permit:
            self.assertTrue(permit.active)
        self.assertEqual(self.daemon.connections, 2)

    def test_a_wait_cut_by_a_drop_with_nothing_held_is_sent_again(self):
        self.daemon.silent = True
        waiter = Background(lambda: self.client.acquire(GIB, timeout=60))
        self.daemon.wait_for(lambda: self.daemon.waiting() == 1)
        self.daemon.silent = False
        self.daemon.drop_connections()
        self.assertEqual(waiter.result().gpu_bytes, GIB)
        self.assertEqual(len(self.daemon.messages("acquire")), 2)
        self.assertEqual(self.daemon.connections, 2)

    def test_a_drop_while_permits_are_held_is_not_hidden(self):
        held = self.client.acquire(3 * GIB, timeout=5)
        waiter = Background(lambda: self.client.acquire(3 * GIB, timeout=60))
        self.daemon.wait_for(lambda: self.daemon.waiting() == 1)
        self.daemon.drop_connections()
        with self.assertRaises(DaemonUnavailable) as caught:
            waiter.result()
        self.assertIn("permits held on it are lost", str(caught.exception))
        self.assertTrue(held.lost)
        self.assertFalse(held.active)
        self.client.release(held)  # no-op, no error
        # A new permit comes on a new connection.
        with self.client.permit(GIB, timeout=5):
            self.assertEqual(self.daemon.connections, 2)


class ManyThreads(FakeDaemonCase):
    daemon_options = dict(gpu_capacity=2 * GIB, first_fit=True)  # answers out of order

    def test_sixteen_threads_share_one_connection(self):
        client = Client(self.socket)
        self.addCleanup(client.close)
        rounds = 8
        results = {}

        def worker(thread):
            got = []
            for round_ in range(rounds):
                size = (thread * rounds + round_ + 1) * MIB  # unique per request
                with client.permit(gpu_bytes=size, timeout=60) as permit:
                    got.append((size, permit.gpu_bytes, permit.id))
            results[thread] = got

        threads = [Background(lambda t=t: worker(t)) for t in range(16)]
        for thread in threads:
            thread.result()
        pairs = [pair for got in results.values() for pair in got]
        self.assertEqual(len(pairs), 16 * rounds)
        for asked, granted, _ in pairs:
            self.assertEqual(asked, granted)
        self.assertEqual(len({permit_id for _, _, permit_id in pairs}), 16 * rounds)
        self.assertEqual(self.daemon.connections, 1)
        self.assertEqual(self.daemon.held(), 0)
        self.assertLessEqual(self.daemon.max_held_gpu_bytes, 2 * GIB)


class Setup(FakeDaemonCase):
    def test_socket_from_the_environment(self):
        old = os.environ.get("GPUGUARD_SOCKET")
        os.environ["GPUGUARD_SOCKET"] = self.socket
        try:
            with Client() as client:
                self.assertEqual(client.socket_path, self.socket)
                client.release(client.acquire(GIB))
        finally:
            if old is None:
                del os.environ["GPUGUARD_SOCKET"]
            else:
                os.environ["GPUGUARD_SOCKET"] = old
        os.environ.pop("GPUGUARD_SOCKET", None)
        try:
            self.assertEqual(Client().socket_path, gpuguard.DEFAULT_SOCKET)
            self.assertEqual(gpuguard.DEFAULT_SOCKET, "/run/gpuguard/gpuguard.sock")
        finally:
            if old is not None:
                os.environ["GPUGUARD_SOCKET"] = old

    def test_no_daemon(self):
        missing = os.path.join(self.dir, "missing.sock")
        with self.assertRaises(DaemonUnavailable) as caught:
            Client(missing).acquire(GIB)
        self.assertIn(missing, str(caught.exception))

    def test_a_daemon_without_permits(self):
        self.daemon.reject_with_error = True
        with Client(self.socket) as client:
            with self.assertRaises(ProtocolError) as caught:
                client.acquire(GIB, timeout=5)
        self.assertIn("unknown type 'acquire'", str(caught.exception))

    def test_closed_client(self):
        client = Client(self.socket)
        permit = client.acquire(GIB)
        client.close()
        self.assertTrue(permit.lost)
        self.daemon.wait_for(lambda: self.daemon.held() == 0)
        self.assertRaises(gpuguard.GpuguardError, client.acquire, GIB)


if __name__ == "__main__":
    unittest.main()


def skip_unless(need, present, why):
    """`unittest.skipUnless`, unless GPUGUARD_REQUIRE (scripts/test's switch, comma-separated)
    names `need` or `all`: then the test runs, and fails without it."""
    required = {r.strip() for r in os.environ.get("GPUGUARD_REQUIRE", "").split(",")}
    if not present and required & {need, "all"}:
        return lambda test: test
    return unittest.skipUnless(present, why)


@skip_unless("root", os.geteuid() == 0, "needs root: the fake server runs as another user")
class NotTheDaemon(unittest.TestCase):
    """A socket served by another account (nobody, here) is not the daemon: neither client
    believes it, whatever it answers."""

    def test_a_socket_served_by_another_user_is_refused(self):
        import asyncio
        import socket
        import tempfile

        directory = tempfile.mkdtemp()
        os.chmod(directory, 0o777)
        path = os.path.join(directory, "gpuguard.sock")
        ready_r, ready_w = os.pipe()
        child = os.fork()
        if child == 0:  # the other user's fake server: answers any line with a grant
            try:
                os.setgid(65534)
                os.setuid(65534)
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                server.bind(path)
                server.listen(8)
                os.write(ready_w, b"r")
                while True:
                    conn, _ = server.accept()
                    try:
                        conn.recv(65536)
                        conn.sendall(b'{"type": "granted", "id": 1, "permit": 1}\n')
                    except OSError:
                        pass
                    conn.close()
            finally:
                os._exit(0)
        self.addCleanup(lambda: (os.kill(child, signal.SIGKILL), os.waitpid(child, 0)))
        self.assertEqual(os.read(ready_r, 1), b"r")
        client = Client(path, connect_timeout=5)
        self.addCleanup(client.close)
        for attempt in (client.status, lambda: client.permit(gpu_bytes="1GiB").__enter__()):
            with self.assertRaises(DaemonUnavailable) as raised:
                attempt()
            self.assertIn("served by uid 65534", str(raised.exception))

        async def run():
            aclient = gpuguard.AsyncClient(path, connect_timeout=5)
            try:
                async with aclient.permit(gpu_bytes="1GiB"):
                    pass
            finally:
                await aclient.aclose()

        with self.assertRaises(DaemonUnavailable) as raised:
            asyncio.run(run())
        self.assertIn("served by uid 65534", str(raised.exception))
