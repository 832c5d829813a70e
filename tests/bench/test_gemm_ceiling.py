#!/usr/bin/env python3
"""bench/gemm_ceiling.py's arithmetic: the MLP step's products and their FLOP count, and (where
numpy and OpenBLAS are installed) one timing pass whose products are checked against numpy's.

    python3 tests/bench/test_gemm_ceiling.py
"""
import json
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gemm_ceiling  # noqa: E402
import peer  # noqa: E402


class Products(unittest.TestCase):
    def test_mlp_step_flops(self):
        products = gemm_ceiling.mlp_products()
        # 3 forward, 3 weight gradients, 2 input gradients (the first layer's input is data).
        self.assertEqual(len(products), 8)
        b = 128
        self.assertEqual(gemm_ceiling.step_flops(products),
                         2 * b * (2 * 784 * 512 + 3 * 512 * 256 + 3 * 256 * 10))
        self.assertIn(("forward 0", False, True, b, 512, 784), products)
        self.assertIn(("weight grad 0", True, False, 512, 784, b), products)
        self.assertIn(("input grad 1", False, False, b, 512, 256), products)
        self.assertNotIn("input grad 0", [p[0] for p in products])

    def test_the_mlp_is_the_benchmarks(self):
        # The C++ benchmark's MLP must be the one whose products are counted here.
        with open(os.path.join(ROOT, "bench", "train_throughput.cpp")) as f:
            self.assertIn("Mlp<E> net(784, {512, 256}, 10, 1);", f.read())
        self.assertEqual(gemm_ceiling.LAYERS, [(784, 512), (512, 256), (256, 10)])

    def test_one_timing_pass(self):
        try:
            import numpy  # noqa: F401
        except ImportError:
            self.skipTest("numpy is not installed")
        try:
            setup = peer.Peer()
        except peer.PeerSetupError as e:
            self.skipTest(str(e))
        if not setup.openblas:
            self.skipTest("no OpenBLAS library")
        env = setup.env()
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gemm_ceiling.py"), "--child",
                              setup.openblas, "--repeats", "2"], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        result = json.loads(out.stdout)
        self.assertGreater(result["mlp_step_products_s"], 0)
        self.assertEqual(set(result["mlp_product_us"]), {p[0] for p in gemm_ceiling.mlp_products()})


if __name__ == "__main__":
    unittest.main()
