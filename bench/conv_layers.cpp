// A network's float32 convolutions one by one, as training runs them: forward, then backward (dW and
// dx; the first layer has no dx), each timed on its own; bench/compare_conv_layers.py runs this next
// to PyTorch's convolutions (oneDNN) on the same shapes.
//
//   ./conv_layers [--model=resnet50] [--batch=0] [--threads=2] [--runs=7]
//
// --model: resnet50 (224x224, batch 8 by default), resnet20 or lenet (Fashion-MNIST's 28x28, batch 64
// as train_throughput); --batch=0 takes the model's. Per distinct shape a fresh layer (bias off, as in
// the networks), one untimed forward and backward, then --runs timed ones; medians in ms. The totals
// weight each shape by how often the network has it. Prints one JSON object (stdout) and a table
// (stderr). Never a timed test.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#include "conv_shapes.hpp"

using namespace tessera;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct LayerTimes {
  double forward_ms, backward_ms;
};

LayerTimes time_layer(const ConvShape& s, std::int64_t batch, bool first, int runs) {
  Rng rng(1);
  Conv2d<CpuLocal> conv(s.in, s.out, s.kernel, rng, s.stride, s.pad, /*bias=*/false);
  conv.set_needs_input_grad(!first);  // a network's first layer computes no dx
  Tensor<float, Cpu> x(Shape{batch, s.in, s.size, s.size});
  uniform_(x, -1.0, 1.0, rng);
  Conv2d<CpuLocal>::Cache c;
  const auto& y = conv.forward(x, c);
  Tensor<float, Cpu> dy(y.shape());
  uniform_(dy, -1.0, 1.0, rng);
  conv.backward(dy, c);  // workspaces sized, caches filled
  std::vector<double> f, b;
  for (int r = 0; r < runs; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    conv.forward(x, c);
    f.push_back(ms_since(t0));
    t0 = std::chrono::steady_clock::now();
    conv.backward(dy, c);
    b.push_back(ms_since(t0));
  }
  return {median(f), median(b)};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const ConvBenchSetup run = conv_bench_setup(argc, argv);
    double total_forward = 0, total_backward = 0;
    std::string rows;
    std::fprintf(stderr, "%-28s %11s %12s\n", "C K size kxk/stride x count", "forward ms", "backward ms");
    for (const ConvShape& s : run.shapes) {
      const LayerTimes t = time_layer(s, run.batch, &s == &run.shapes.front(), run.runs);
      total_forward += t.forward_ms * s.count;
      total_backward += t.backward_ms * s.count;
      std::fprintf(stderr, "%4lld %4lld %3lld %lldx%lld/%lld x%lld %14.3f %12.3f\n", (long long)s.in, (long long)s.out,
                   (long long)s.size, (long long)s.kernel, (long long)s.kernel, (long long)s.stride, (long long)s.count,
                   t.forward_ms, t.backward_ms);
      char row[320];
      std::snprintf(row, sizeof row,
                    "%s{\"in\": %lld, \"out\": %lld, \"size\": %lld, \"kernel\": %lld, \"stride\": %lld, \"pad\": %lld, "
                    "\"count\": %lld, \"forward_ms\": %.4f, \"backward_ms\": %.4f}",
                    rows.empty() ? "" : ", ", (long long)s.in, (long long)s.out, (long long)s.size, (long long)s.kernel,
                    (long long)s.stride, (long long)s.pad, (long long)s.count, t.forward_ms, t.backward_ms);
      rows += row;
    }
    std::fprintf(stderr, "%-28s %14.2f %12.2f\n", (run.model + " total (ms)").c_str(), total_forward, total_backward);
    std::printf("{\"framework\": \"tessera\", \"benchmark\": \"conv_layers\", \"model\": \"%s\", \"batch\": %lld, "
                "\"threads\": %d, \"runs\": %d, \"gemm\": \"%s\", \"total_ms\": {\"forward\": %.3f, \"backward\": %.3f}, "
                "\"layers\": [%s]}\n",
                run.model.c_str(), (long long)run.batch, run.threads, run.runs, cpu_gemm_kernel().c_str(), total_forward,
                total_backward, rows.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
