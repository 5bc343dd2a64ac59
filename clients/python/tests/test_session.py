"""The connection's bookkeeping without sockets: answers routed by id, grants nobody waits for
given back, expiry, and what a broken connection means for waiters and holders. The races that
are hard to time over a real socket (a grant delivered just before the waiter gave up) are
driven here step by step."""

import itertools
import json
import unittest

from gpuguard import PermitRefused, ProtocolError
from gpuguard._session import ConnectionLevelError, Lost, Permit, Session

GIB = 1 << 30


def line(**message):
    return json.dumps(message).encode() + b"\n"


def sent(lines):
    return [json.loads(raw) for raw in lines]


class SessionTest(unittest.TestCase):
    def setUp(self):
        self.session = Session(itertools.count(1).__next__, owner="conn")

    def acquire(self, **fields):
        request, raw = self.session.open_acquire(fields)
        message = json.loads(raw)
        self.assertEqual(message["type"], "acquire")
        self.assertEqual(message["version"], 1)
        self.assertEqual(message["id"], request.id)
        return request

    def grant(self, request, permit=500, gpu_bytes=3 * GIB):
        return self.session.on_line(
            line(
                type="granted",
                id=request.id,
                permit=permit,
                gpu=0,
                gpu_bytes=gpu_bytes,
                ram_bytes=0,
                waited_ms=1500,
                ttl_ms=60000,
            )
        )

    def test_answers_reach_their_own_request(self):
        first, second = self.acquire(gpu_bytes=GIB), self.acquire(gpu_bytes=2 * GIB)
        woken, lines = self.grant(second, permit=7, gpu_bytes=2 * GIB)
        self.assertEqual((woken, lines), ([second], []))
        self.assertIsInstance(second.outcome, Permit)
        self.assertEqual((second.outcome.id, second.outcome.gpu_bytes), (7, 2 * GIB))
        self.assertEqual(second.outcome.waited, 1.5)
        self.assertEqual(second.outcome.ttl, 60.0)
        self.assertIs(first.outcome, first.PENDING)
        woken, _ = self.session.on_line(
            line(
                type="refused",
                id=first.id,
                reason="timeout",
                message="m",
                retry_after_ms=2500,
                needed={"gpu_bytes": GIB},
                free={"gpu_bytes": 5},
            )
        )
        self.assertEqual(woken, [first])
        refused = first.outcome
        self.assertIsInstance(refused, PermitRefused)
        self.assertEqual(
            (refused.reason, refused.message, refused.retry_after), ("timeout", "m", 2.5)
        )
        self.assertEqual((refused.needed, refused.free), ({"gpu_bytes": GIB}, {"gpu_bytes": 5}))
        self.assertEqual(list(self.session.held), [7])

    def test_a_grant_nobody_waits_for_is_given_back(self):
        request = self.acquire()
        self.assertEqual(
            sent(self.session.abandon(request)),
            [{"version": 1, "type": "cancel", "id": request.id}],
        )
        woken, lines = self.grant(request, permit=9)
        self.assertEqual(woken, [])
        [release] = sent(lines)
        self.assertEqual((release["type"], release["permit"]), ("release_permit", 9))
        self.assertEqual(self.session.held, {})
        # A grant for an id this connection never used is given back too.
        _, lines = self.session.on_line(line(type="granted", id=12345, permit=10, gpu_bytes=1))
        self.assertEqual([m["permit"] for m in sent(lines)], [10])

    def test_a_grant_delivered_but_not_taken_is_released_by_abandon(self):
        # The grant arrived, then the waiter was interrupted before it took the permit.
        request = self.acquire()
        self.grant(request, permit=11)
        permit = request.outcome
        [release] = sent(self.session.abandon(request))
        self.assertEqual((release["type"], release["permit"]), ("release_permit", 11))
        self.assertTrue(permit.released)
        self.assertEqual(self.session.held, {})
        self.assertEqual(self.session.abandon(request), [])  # twice is harmless

    def test_cancel_is_sent_once_and_the_answer_still_comes(self):
        request = self.acquire()
        self.assertEqual(len(self.session.cancel(request)), 1)
        self.assertEqual(self.session.cancel(request), [])
        woken, _ = self.session.on_line(
            line(type="refused", id=request.id, reason="cancelled", message="x")
        )
        self.assertEqual(woken, [request])
        self.assertEqual(request.outcome.reason, "cancelled")

    def test_expired_permit_release_is_a_no_op(self):
        request = self.acquire()
        self.grant(request, permit=21)
        permit = request.outcome
        self.session.on_line(line(type="expired", permit=21, message="held past its TTL of 1s"))
        self.assertTrue(permit.expired)
        self.assertFalse(permit.active)
        self.assertEqual(permit.expired_message, "held past its TTL of 1s")
        self.assertEqual(self.session.open_release(permit), (None, []))

    def test_release_crossing_an_expiry_succeeds(self):
        request = self.acquire()
        self.grant(request, permit=22)
        release, lines = self.session.open_release(request.outcome)
        self.assertEqual(sent(lines)[0]["permit"], 22)
        # The daemon expired it before it read the release: expired, then an error for the release.
        self.session.on_line(line(type="expired", permit=22, message="ttl"))
        woken, _ = self.session.on_line(line(type="error", id=release.id, message="not held"))
        self.assertEqual(woken, [release])
        self.assertIsNone(release.outcome)
        self.assertEqual(self.session.held, {})

    def test_release_error_without_expiry_is_reported(self):
        request = self.acquire()
        self.grant(request, permit=23)
        release, _ = self.session.open_release(request.outcome)
        self.session.on_line(line(type="error", id=release.id, message="not held"))
        self.assertIsInstance(release.outcome, ProtocolError)
        self.assertIn("not held", str(release.outcome))

    def test_malformed_answers(self):
        request = self.acquire()
        # A grant with a bad size: the waiter gets a ProtocolError and the permit is given back.
        woken, lines = self.session.on_line(
            line(type="granted", id=request.id, permit=31, gpu_bytes=-1)
        )
        self.assertIsInstance(request.outcome, ProtocolError)
        self.assertEqual(sent(lines)[0]["permit"], 31)
        for garbage in [b"not json\n", b"[1,2]\n", b'{"id": 1}\n', b'{"type": 3}\n']:
            with self.subTest(garbage=garbage):
                self.assertRaises(ProtocolError, self.session.on_line, garbage)
        # Unhashable or unknown ids and unknown types are ignored, not crashes.
        for harmless in [
            line(type="granted", id=[1], permit=[2]),
            line(type="refused", id={"a": 1}),
            line(type="expired", permit=[3]),
            line(type="released", id=999),
            line(type="queued", id=1),
            line(type="error", id=[1], message="x"),
        ]:
            with self.subTest(harmless=harmless):
                self.assertEqual(self.session.on_line(harmless), ([], []))

    def test_error_without_id_and_nothing_held_is_about_the_connection(self):
        self.acquire()
        with self.assertRaises(ConnectionLevelError) as caught:
            self.session.on_line(line(type="error", message="unknown type 'acquire'"))
        self.assertIn("unknown type", str(caught.exception))

    def test_error_without_id_goes_to_the_oldest_release(self):
        first, second = self.acquire(), self.acquire()
        self.grant(first, permit=51)
        self.grant(second, permit=52)
        release_first, _ = self.session.open_release(first.outcome)
        release_second, _ = self.session.open_release(second.outcome)
        woken, _ = self.session.on_line(line(type="error", message="permit 51 is not held"))
        self.assertEqual(woken, [release_first])
        self.assertIsInstance(release_first.outcome, ProtocolError)
        self.assertIs(release_second.outcome, release_second.PENDING)

    def test_error_without_id_never_costs_held_permits(self):
        holder, waiter = self.acquire(), self.acquire()
        self.grant(holder, permit=61)
        with self.assertLogs("gpuguard", "WARNING"):
            self.assertEqual(self.session.on_line(line(type="error", message="huh")), ([], []))
        self.assertTrue(holder.outcome.active)
        self.assertIs(waiter.outcome, waiter.PENDING)

    def test_lost_connection_with_nothing_held_is_retryable(self):
        request = self.acquire()
        self.assertEqual(self.session.connection_lost("idle"), [request])
        self.assertIsInstance(request.outcome, Lost)
        self.assertTrue(request.outcome.retryable)

    def test_lost_connection_with_permits_held_marks_them_lost(self):
        holder, waiter = self.acquire(), self.acquire()
        self.grant(holder, permit=41)
        permit = holder.outcome
        self.session.connection_lost("daemon restarted")
        self.assertTrue(permit.lost)
        self.assertFalse(permit.active)
        self.assertIsInstance(waiter.outcome, Lost)
        self.assertFalse(waiter.outcome.retryable)
        self.assertEqual(self.session.open_release(permit), (None, []))

    def test_lost_connection_with_a_protocol_error(self):
        request = self.acquire()
        fatal = ProtocolError("garbage")
        self.session.connection_lost("garbage", fatal)
        self.assertIs(request.outcome, fatal)


if __name__ == "__main__":
    unittest.main()
