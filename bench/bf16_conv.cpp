// A network's convolutions one by one, forward + backward (dW and dx; the first layer has no dx), in a
// bfloat16 Env on Tessera's own kernels, on oneDNN, and as Auto chooses between them
// (onednn_conv_chosen, kernels/cpu/onednn_conv.hpp), and in float32 for reference: the figures behind
// that choice (bench/README.md, "bfloat16").
//
//   ./bf16_conv [--model=resnet50] [--batch=0] [--threads=2] [--runs=7]
//
// --model: resnet50 (224x224, batch 8 by default), resnet20 or lenet (Fashion-MNIST's 28x28, batch 64
// as train_throughput); --batch=0 takes the model's.
// Per distinct layer shape, the four configurations run in turn, --runs times, so machine noise
// hits them alike; each figure is a median in ms, and the totals weight each shape by how often
// the network has it. Prints one JSON object (stdout) and a table (stderr). Never a timed test.

#include <cstdio>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#include "bf16_configs.hpp"
#include "conv_shapes.hpp"

using namespace tessera;

namespace {

// One forward and backward of a fresh layer of shape s in Env E, after one untimed warm-up pass; ms.
template <class E>
double step_ms(const ConvShape& s, std::int64_t batch, bool first) {
  Rng rng(1);
  Conv2d<E> conv(s.in, s.out, s.kernel, rng, s.stride, s.pad, /*bias=*/false);
  conv.set_needs_input_grad(!first);  // a network's first layer computes no dx
  return layer_step_ms(conv, {batch, s.in, s.size, s.size}, rng);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const ConvBenchSetup setup = conv_bench_setup(argc, argv);
    const std::string& model = setup.model;
    const std::int64_t batch = setup.batch;
    const int threads = setup.threads, runs = setup.runs;
    const std::vector<ConvShape>& shapes = setup.shapes;
    TESSERA_CHECK(onednn_built(), Error, "bf16_conv compares Tessera's bfloat16 kernels with oneDNN's: this build has "
                                         "no oneDNN (meson option onednn; Debian: libdnnl-dev)");
    TESSERA_CHECK(cpu_bf16_active(), Error, "bf16_conv: bfloat16 compute is off here, " + cpu_bf16_kernel() +
                                              ", so both would compute in float");
    const auto& names = kBf16ConfigNames;
    double total[kBf16Configs] = {0, 0, 0, 0};
    std::string rows;
    std::fprintf(stderr, "%-28s %9s %13s %12s %10s\n", "C K size kxk/stride x count", "float32", "bf16 Tessera",
                 "bf16 oneDNN", "bf16 Auto");
    for (const ConvShape& s : shapes) {
      const bool first = &s == &shapes.front();
      const auto m = bf16_config_medians(runs, [&]<class E>() { return step_ms<E>(s, batch, first); });
      for (int i = 0; i < kBf16Configs; ++i) total[i] += m[i] * s.count;
      std::fprintf(stderr, "%4lld %4lld %3lld %lldx%lld/%lld x%lld %12.2f %13.2f %12.2f %10.2f\n", (long long)s.in, (long long)s.out,
                   (long long)s.size, (long long)s.kernel, (long long)s.kernel, (long long)s.stride, (long long)s.count,
                   m[0], m[1], m[2], m[3]);
      char row[400];
      std::snprintf(row, sizeof row,
                    "%s{\"in\": %lld, \"out\": %lld, \"size\": %lld, \"kernel\": %lld, \"stride\": %lld, "
                    "\"pad\": %lld, \"count\": %lld, \"ms\": {\"%s\": %.3f, \"%s\": %.3f, \"%s\": %.3f, \"%s\": %.3f}}",
                    rows.empty() ? "" : ", ", (long long)s.in, (long long)s.out, (long long)s.size, (long long)s.kernel,
                    (long long)s.stride, (long long)s.pad, (long long)s.count, names[0], m[0], names[1], m[1], names[2], m[2], names[3], m[3]);
      rows += row;
    }
    std::fprintf(stderr, "%-28s %12.2f %13.2f %12.2f %10.2f\n", (model + " total (ms)").c_str(), total[0], total[1], total[2],
                 total[3]);
    std::printf("{\"benchmark\": \"bf16_conv\", \"model\": \"%s\", \"batch\": %lld, \"threads\": %d, \"runs\": %d, "
                "\"onednn\": \"%s\", \"total_ms\": {\"%s\": %.2f, \"%s\": %.2f, \"%s\": %.2f, \"%s\": %.2f}, "
                "\"layers\": [%s]}\n",
                model.c_str(), (long long)batch, threads, runs, onednn_cpu_isa().c_str(), names[0], total[0], names[1],
                total[1], names[2], total[2], names[3], total[3], rows.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
