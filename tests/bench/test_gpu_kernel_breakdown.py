#!/usr/bin/env python3
"""bench/gpu_kernel_breakdown.py's reading of Nsight Compute's CSV, without a GPU: kernels sorted
into kinds by name, times in any of ncu's units added in nanoseconds, shares that sum to one, and a
clear error for output that holds no kernel.

    python3 tests/bench/test_gpu_kernel_breakdown.py
"""
import os
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_kernel_breakdown as breakdown  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i, name, unit, value, metric="gpu__time_duration.sum"):
    return (f'"{i}","7","08_resnet50_cuda","127.0.0.1","{name}","1","13","(256, 1, 1)","(64, 4, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


SAMPLE = "\n".join([
    "==PROF== Connected to process 7 (/bin/08_resnet50_cuda)",
    "steady state: 812.5 img/s",  # the program's own output, interleaved
    HEADER,
    row(0, "void tessera::cuda_detail::bn_normalize_kernel<float, 4>(const T1 *, tessera::BatchNormShape)",
        "nsecond", "3,000"),
    row(1, "sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x32_cudnn", "usecond",
        "5.5"),
    row(2, "void engines_precompiled::nchwToNhwcKernel<float, float, float, 0, 1, 0>(T1 *, const T2 *)", "nsecond",
        "1000"),
    row(3, "void tessera::cuda_detail::add_relu_forward_kernel<float>(const T1 *, const T1 *, T1 *, long)",
        "nsecond", "250"),
    row(4, "void tessera::cuda_detail::sgd_update_kernel<float>(long, T1 *, const T1 *)", "nsecond", "250"),
    row(5, "void tessera::cuda_detail::fill_kernel<float>(T1 *, long, T1)", "msecond", "0.0005"),
    row(6, "void tessera::cuda_detail::bn_normalize_kernel<float, 4>(const T1 *, tessera::BatchNormShape)",
        "nsecond", "1000"),
    row(7, "void tessera::cuda_detail::max_pool_backward_kernel<float>(const T1 *)", "nsecond", "999",
        metric="sm__throughput.avg.pct_of_peak_sustained_elapsed"),  # another metric: not a time
    "==PROF== Disconnected from process 7",
])


class Breakdown(unittest.TestCase):
    def test_kinds_units_and_shares(self):
        times = breakdown.kernel_times(SAMPLE)
        self.assertEqual(len(times), 7)
        self.assertEqual(times[1][1], 5500.0)  # usecond -> ns
        self.assertEqual(times[5][1], 500.0)  # msecond -> ns
        result = breakdown.summarise(times)
        self.assertEqual(result["launches"], 7)
        self.assertAlmostEqual(result["kernel_ms"], 0.0115)
        kinds = {k["kind"]: k for k in result["by_kind"]}
        self.assertEqual(kinds["batch norm"]["launches"], 2)
        self.assertAlmostEqual(kinds["batch norm"]["ms"], 0.004)
        self.assertAlmostEqual(kinds["cuDNN/cuBLAS"]["ms"], 0.0055)
        self.assertEqual(kinds["layout transform"]["launches"], 1)
        self.assertEqual(kinds["residual add + relu"]["launches"], 1)
        self.assertEqual(kinds["optimizer"]["launches"], 1)
        self.assertEqual(kinds["bias, fill, copies, other Tessera"]["launches"], 1)
        self.assertAlmostEqual(sum(k["share"] for k in result["by_kind"]), 1.0, places=3)
        self.assertEqual(result["by_kind"][0]["kind"], "cuDNN/cuBLAS")  # largest first
        top = result["top_kernels"][0]
        self.assertTrue(top["kernel"].startswith("sm90_xmma_fprop"))

    def test_no_kernels_is_an_error(self):
        with self.assertRaisesRegex(RuntimeError, "no CSV rows"):
            breakdown.kernel_times("==PROF== Connected\n==PROF== Disconnected\n")
        with self.assertRaisesRegex(RuntimeError, "unknown time unit"):
            breakdown.kernel_times(HEADER + "\n" + row(0, "k", "fortnight", "1"))


if __name__ == "__main__":
    unittest.main()
