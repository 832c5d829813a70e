#!/usr/bin/env python3
"""bench/gpu_resnet50.py's reading of example 08's output, without a GPU: the steady-state images/s,
the peak memory as the sum of the three 'memory per rank' figures (None when the program printed
fewer), the precision and cuDNN settings handed to the program through its environment, and a clear
error for output without a 'steady state' line.

    python3 tests/bench/test_gpu_resnet50.py
"""
import os
import stat
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_resnet50 as bench  # noqa: E402

# Example 08's lines (examples/08_resnet50/resnet50.hpp, report_memory), as a CudaLocal run prints them.
OUTPUT = """ResNet-50: 25557032 parameters
memory per rank: parameters + gradients + BatchNorm buffers = 4 x (2 x 25557032 + 53120) B = 195.2 MiB | \
195.3 MiB measured (1.00x; 196.0 MiB in blocks)
memory per rank: momentum = 4 x 25557032 B = 97.5 MiB | 97.6 MiB measured (1.00x)
memory per rank: the first step's peak above the model (activations, their gradients, workspaces) | \
5120.5 MiB measured = 40.0 MiB per image of the batch (5200.0 MiB in blocks)
steady state: 1234.5 img/s (all ranks)
"""


class ReadExample08(unittest.TestCase):
    def fake(self, text):
        """A program that prints the environment it got, then `text`."""
        d = tempfile.mkdtemp()
        path = os.path.join(d, "fake_08")
        with open(path, "w") as f:
            f.write("#!/bin/sh\necho \"env $TESSERA_MATH_PRECISION $TESSERA_CUDNN_BENCHMARK $*\"\ncat <<'END'\n"
                    + text + "END\n")
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        return path

    def test_speed_and_peak(self):
        speed, peak = bench.tessera_images_per_second(self.fake(OUTPUT), 128, 11)
        self.assertEqual(speed, 1234.5)
        self.assertAlmostEqual(peak, 195.3 + 97.6 + 5120.5, places=6)

    def test_peak_missing(self):
        lines = [line for line in OUTPUT.splitlines(keepends=True) if "momentum" not in line]
        self.assertIsNone(bench.tessera_images_per_second(self.fake("".join(lines)), 32, 3)[1])

    def test_settings_reach_the_program(self):
        # The fake echoes its environment and arguments first; the error quotes that output.
        with self.assertRaises(RuntimeError) as e:
            bench.tessera_images_per_second(self.fake("no steady state here\n"), 64, 5, cudnn_benchmark=True,
                                            precision="bfloat16")
        self.assertIn("printed no 'steady state' line", str(e.exception))
        self.assertIn("env bfloat16 1 --batch=64 --steps=5", str(e.exception))

if __name__ == "__main__":
    unittest.main()
