"""Shared set-up for the client tests: a fake daemon on a socket in a fresh temporary directory."""

import os
import shutil
import tempfile
import unittest

from fake_daemon import GIB, FakeDaemon

__all__ = ["GIB", "MIB", "FakeDaemonCase"]

MIB = 1 << 20


class FakeDaemonCase(unittest.TestCase):
    """Each test gets `self.daemon` (started) and `self.socket` (its path); `daemon_options`
    are passed to FakeDaemon."""

    daemon_options: dict = {}

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gpuguard-client-test-")
        self.socket = os.path.join(self.dir, "gpuguard.sock")
        self.daemon = FakeDaemon(self.socket, **self.daemon_options).start()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.addCleanup(self.daemon.stop)

    def received(self, kind, **match):
        """The messages of `kind` the daemon received whose fields equal `match`."""
        return [
            m for m in self.daemon.messages(kind) if all(m.get(k) == v for k, v in match.items())
        ]
