"""The permit scenarios of tests/permits/ run as real processes against the fake daemon: the seed
model server (threads and asyncio, fixed and variable request sizes, with and without permits)
and the FastAPI example under bursts of HTTP requests. The same scripts run against the real
daemon and the fake NVML in the Rust integration tests; here they check the client side."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import unittest

from support import GIB, FakeDaemonCase

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PERMITS = os.path.join(REPO, "tests", "permits")
HANG_GUARD_S = 600  # only against a hung script; never a measurement


def run_json(script, *args):
    """Runs tests/permits/`script` with this interpreter and returns its JSON line."""
    done = subprocess.run(
        [sys.executable, os.path.join(PERMITS, script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"{script} exited {done.returncode}: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class SeedServer(FakeDaemonCase):
    # The card is 16 GiB with 4 GiB of weights: the fake daemon lets permits take the other 12.
    daemon_options = dict(gpu_capacity=12 * GIB)

    def seed(self, *args):
        return run_json(
            "seed_server.py",
            "--state",
            os.path.join(self.dir, "nvml-state"),
            "--socket",
            self.socket,
            "--card-total",
            "16GiB",
            "--weights",
            "4GiB",
            *args,
        )

    def assert_backpressure_only(self, result):
        """Every request served or refused with a Retry-After; nothing overflowed."""
        self.assertEqual(result["overflows"], 0, result)
        self.assertEqual(result["errors"], 0, result)
        self.assertEqual(result["served"] + result["refused"], result["requests"], result)
        self.assertEqual(result["refused_without_retry_after"], 0, result)
        self.assertLessEqual(result["max_used_bytes"], 16 * GIB, result)
        self.assertEqual(self.daemon.held(), 0)

    def test_permits_serve_every_burst_without_overflow(self):
        result = self.seed("--burst", 10, "--bursts", 3, "--work", 0.2, "--permit-timeout", 60)
        self.assert_backpressure_only(result)
        self.assertEqual(result["served"], 30, result)
        self.assertEqual(result["fit"], 4)
        self.assertLessEqual(result["max_in_flight"], 4, result)
        self.assertEqual(len(self.daemon.messages("acquire")), 30)

    def test_variable_sizes_with_asyncio_and_a_bounded_queue(self):
        self.daemon.queue_max = 3  # some requests are refused at once: queue_full + Retry-After
        result = self.seed(
            "--client",
            "async",
            "--request-size",
            "1GiB-4GiB",
            "--seed",
            7,
            "--burst",
            10,
            "--bursts",
            3,
            "--work",
            0.3,
            "--permit-timeout",
            60,
        )
        self.assert_backpressure_only(result)
        self.assertEqual(result["requests"], 30)
        self.assertGreaterEqual(result["served"], 1, result)
        self.assertEqual(set(result["refused_by_reason"]) - {"queue_full"}, set(), result)
        sizes = {m["gpu_bytes"] for m in self.daemon.messages("acquire")}
        self.assertGreater(len(sizes), 1)  # sizes were drawn, not fixed
        self.assertTrue(all(GIB <= size <= 4 * GIB for size in sizes), sizes)

    def test_without_permits_the_burst_overflows_the_card(self):
        result = self.seed("--no-permits", "--burst", 10, "--bursts", 1, "--work", 1.0)
        self.assertGreater(result["overflows"], 0, result)
        self.assertEqual(self.daemon.messages("acquire"), [])

    def test_the_state_file_shows_weights_and_this_process(self):
        state = os.path.join(self.dir, "nvml-state")
        ready = os.path.join(self.dir, "ready")
        go = os.path.join(self.dir, "go")
        process = subprocess.Popen(
            [
                sys.executable,
                os.path.join(PERMITS, "seed_server.py"),
                "--state",
                state,
                "--socket",
                self.socket,
                "--bursts",
                "1",
                "--burst",
                "1",
                "--work",
                "0",
                "--ready-file",
                ready,
                "--go-file",
                go,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            while not os.path.exists(ready):  # the script creates it once the state is written
                self.assertIsNone(process.poll(), "seed_server.py exited before it was ready")
                time.sleep(0.01)
            with open(ready) as ready_file:
                pid = int(ready_file.read())
            with open(state) as state_file:
                lines = [line.split() for line in state_file if not line.startswith("#")]
            self.assertIn(["process", "0", str(pid), str(4 * GIB)], lines)
            self.assertIn(f"total={16 * GIB}", lines[0])
            self.assertIn(f"used={4 * GIB}", lines[0])
            self.assertEqual(self.daemon.messages("acquire"), [])  # waits for the go file
            open(go, "w").close()
            out, _ = process.communicate(timeout=HANG_GUARD_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.assertEqual(json.loads(out)["served"], 1)


@unittest.skipUnless(
    importlib.util.find_spec("fastapi") and importlib.util.find_spec("uvicorn"),
    "FastAPI and uvicorn are not installed (scripts/test installs them)",
)
class FastApiExample(FakeDaemonCase):
    # 12 GiB for permits of 3 GiB: 4 at a time; a queue of 2 refuses the rest of a burst of 10
    # at once (queue_full), which the example answers 503 + Retry-After.
    daemon_options = dict(gpu_capacity=12 * GIB, queue_max=2, retry_after_ms=2500)

    def test_burst_gets_200s_and_503s_with_retry_after_and_no_overflow(self):
        port_file = os.path.join(self.dir, "port")
        server = subprocess.Popen(
            [
                sys.executable,
                os.path.join(PERMITS, "fastapi_server.py"),
                "--state",
                os.path.join(self.dir, "nvml-state"),
                "--socket",
                self.socket,
                "--gpu-mem",
                "3GiB",
                "--permit-timeout",
                "60",
                "--model",
                "example",
                "--work",
                "1.0",
                "--port-file",
                port_file,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            result = run_json(
                "http_burst.py", "--port-file", port_file, "--burst", 10, "--bursts", 2
            )
        finally:
            server.terminate()
            _, stderr = server.communicate(timeout=HANG_GUARD_S)
        # uvicorn shuts down cleanly on SIGTERM, then re-raises it (exit by the signal).
        self.assertIn(server.returncode, (0, -signal.SIGTERM), stderr)
        self.assertNotIn("Traceback", stderr)
        self.assertEqual(result["requests"], 20)
        self.assertEqual(result["errors"], 0, result)
        self.assertEqual(result["other_status"], {}, result)
        self.assertEqual(result["ok"] + result["unavailable"], 20, result)
        self.assertGreaterEqual(result["ok"], 1, result)
        self.assertGreaterEqual(result["unavailable"], 1, result)
        self.assertEqual(result["unavailable_with_retry_after"], result["unavailable"], result)
        self.assertEqual(result["retry_after_s"], {"min": 3.0, "max": 3.0})  # 2.5 s rounded up
        self.assertEqual(result["server"]["overflows"], 0, result)
        self.assertLessEqual(result["server"]["max_in_flight"], 4, result)
        self.assertEqual(result["server"]["started"], result["ok"])
        acquires = self.daemon.messages("acquire")
        self.assertTrue(
            all(m["model"] == "example" and m["gpu_bytes"] == 3 * GIB for m in acquires)
        )
        self.assertEqual(self.daemon.held(), 0)


if __name__ == "__main__":
    unittest.main()
