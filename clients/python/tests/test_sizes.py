"""Sizes and durations as callers write them: the bytes and milliseconds that go on the wire,
and errors that name the argument and the bad value."""

import unittest

from gpuguard import parse_size
from gpuguard._session import acquire_fields
from gpuguard.sizes import seconds_to_ms

GIB = 1 << 30


class ParseSize(unittest.TestCase):
    def test_sizes_as_the_daemon_reads_them(self):
        cases = [
            (0, 0),
            (3221225472, 3 * GIB),
            ("3221225472", 3 * GIB),
            ("3GiB", 3 * GIB),
            ("3gib", 3 * GIB),
            ("3G", 3 * GIB),  # a bare G is binary, as in the daemon's config
            ("3Gi", 3 * GIB),
            ("3GB", 3_000_000_000),  # GB is decimal
            ("1.5 GiB", 3 * GIB // 2),
            (" 512MiB ", 512 << 20),
            ("512M", 512 << 20),
            ("4KiB", 4096),
            ("4kb", 4000),
            ("2TiB", 2 << 40),
            ("1PiB", 1 << 50),
            ("7B", 7),
            (".5KiB", 512),
        ]
        for text, want in cases:
            with self.subTest(text=text):
                self.assertEqual(parse_size(text), want)

    def test_bad_sizes_name_the_value(self):
        for bad in ["", "GiB", "3XB", "-1GiB", "3 GiB GiB", "1e3", "10%", "3..5G", "0x10"]:
            with self.subTest(bad=bad):
                with self.assertRaises(ValueError) as caught:
                    parse_size(bad, "gpu_bytes")
                self.assertIn("gpu_bytes", str(caught.exception))
                self.assertIn(repr(bad), str(caught.exception))
        for bad in [-1, 2**64]:
            with self.subTest(bad=bad):
                self.assertRaises(ValueError, parse_size, bad)
        for bad in [True, 3.0, None, b"3GiB", [3]]:
            with self.subTest(bad=bad):
                self.assertRaises(TypeError, parse_size, bad)


class Durations(unittest.TestCase):
    def test_seconds_become_milliseconds_rounded_up(self):
        self.assertEqual(seconds_to_ms(2, "timeout"), 2000)
        self.assertEqual(seconds_to_ms(0.25, "timeout"), 250)
        self.assertEqual(seconds_to_ms(0.0001, "timeout"), 1)  # a tiny wait is still a wait
        self.assertEqual(seconds_to_ms(0, "timeout"), 0)  # "do not wait"
        self.assertIsNone(seconds_to_ms(None, "timeout"))

    def test_bad_durations(self):
        self.assertRaises(ValueError, seconds_to_ms, -1, "timeout")
        self.assertRaises(ValueError, seconds_to_ms, 0, "ttl", allow_zero=False)
        for bad in [float("nan"), float("inf"), "2s", True]:
            with self.subTest(bad=bad):
                self.assertRaises(TypeError, seconds_to_ms, bad, "timeout")


class AcquireFields(unittest.TestCase):
    def test_only_given_fields_are_sent(self):
        self.assertEqual(acquire_fields(None, None, None, None, None, None), {})
        self.assertEqual(
            acquire_fields("3GiB", 1024, "qwen", 1, 2.5, 60),
            {
                "model": "qwen",
                "gpu_bytes": 3 * GIB,
                "ram_bytes": 1024,
                "gpu": 1,
                "timeout_ms": 2500,
                "ttl_ms": 60000,
            },
        )

    def test_bad_arguments_are_named(self):
        cases = [
            (dict(ram_bytes="lots"), "ram_bytes"),
            (dict(model=""), "model"),
            (dict(gpu=-1), "gpu"),
            (dict(gpu=True), "gpu"),
            (dict(gpu=2**32), "gpu"),
            (dict(ttl=0), "ttl"),
            (dict(timeout=-0.5), "timeout"),
        ]
        for kwargs, name in cases:
            arguments = dict(
                gpu_bytes=None, ram_bytes=None, model=None, gpu=None, timeout=None, ttl=None
            )
            arguments.update(kwargs)
            with self.subTest(kwargs=kwargs):
                with self.assertRaises((ValueError, TypeError)) as caught:
                    acquire_fields(**arguments)
                self.assertIn(name, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
