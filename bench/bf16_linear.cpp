// A network's Linear layers one by one, forward + backward (dW and dx; the first layer has no dx), in
// a bfloat16 Env on Tessera's own kernel (gemm_bf16), on oneDNN's matmul, and as Auto chooses
// between them (onednn_gemm_chosen, kernels/cpu/onednn_gemm.hpp), and in float32 for reference: the
// figures behind that choice (bench/README.md, "bfloat16"). The products' counterpart of bf16_conv.
//
//   ./bf16_linear [--model=mlp] [--threads=2] [--runs=7]
//
// --model: mlp (784-512-256-10, batch 128, as train_throughput), lenet (LeNet-5's three, batch 64),
// gpt (examples/15_gpt's defaults: width 128, 4 blocks, 16 windows of 64 tokens: 1,024 rows) or
// gpt2 (one GPT-2 small block, width 768, 512 rows).
// Per distinct layer shape the four configurations run in turn, --runs times, so machine noise hits
// them alike; each figure is a median in ms, and the totals weight each shape by how often the
// network has it. Prints one JSON object (stdout) and a table (stderr). Never a timed test.

#include <cstdio>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#include "bf16_configs.hpp"

using namespace tessera;

namespace {

struct LinearShape {
  std::int64_t in, out, count;  // features in and out, layers of this shape
};

struct Model {
  std::int64_t rows;
  std::vector<LinearShape> layers;  // the first computes no dx
};

Model model_named(const std::string& name) {
  if (name == "mlp") return {128, {{784, 512, 1}, {512, 256, 1}, {256, 10, 1}}};
  if (name == "lenet") return {64, {{400, 120, 1}, {120, 84, 1}, {84, 10, 1}}};
  // A block: the attention's qkv and output projections, the MLP's two; then the vocabulary head.
  if (name == "gpt") return {1024, {{128, 384, 4}, {128, 128, 4}, {128, 512, 4}, {512, 128, 4}, {128, 256, 1}}};
  return {512, {{768, 2304, 1}, {768, 768, 1}, {768, 3072, 1}, {3072, 768, 1}}};  // gpt2
}

// One forward and backward of a fresh layer of this shape in Env E, after one untimed pass; ms.
template <class E>
double step_ms(const LinearShape& s, std::int64_t rows, bool first) {
  Rng rng(1);
  Linear<E> layer(s.in, s.out, rng);
  layer.set_needs_input_grad(!first);
  return layer_step_ms(layer, {rows, s.in}, rng);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const std::string name = flags.choice("model", "mlp", {"mlp", "lenet", "gpt", "gpt2"});
    const int threads = flags.threads("threads", 2);
    const int runs = flags.get("runs", 7, {.min = 1});
    flags.finish();
    const Model model = model_named(name);
    Cpu::set_num_threads(threads);
    TESSERA_CHECK(onednn_built(), Error, "bf16_linear compares Tessera's bfloat16 kernel with oneDNN's: this build has "
                                         "no oneDNN (meson option onednn; Debian: libdnnl-dev)");
    TESSERA_CHECK(cpu_bf16_active(), Error, "bf16_linear: bfloat16 compute is off here, " + cpu_bf16_kernel() +
                                              ", so both would compute in float");
    const auto& names = kBf16ConfigNames;
    double total[kBf16Configs] = {0, 0, 0, 0};
    std::string rows;
    std::fprintf(stderr, "%-22s %9s %13s %12s %10s\n", "in out x count", "float32", "bf16 Tessera", "bf16 oneDNN",
                 "bf16 Auto");
    for (const LinearShape& s : model.layers) {
      const bool first = &s == &model.layers.front();
      const auto m = bf16_config_medians(runs, [&]<class E>() { return step_ms<E>(s, model.rows, first); });
      for (int i = 0; i < kBf16Configs; ++i) total[i] += m[i] * s.count;
      std::fprintf(stderr, "%5lld %5lld x%lld %15.3f %13.3f %12.3f %10.3f\n", (long long)s.in, (long long)s.out,
                   (long long)s.count, m[0], m[1], m[2], m[3]);
      char row[300];
      std::snprintf(row, sizeof row,
                    "%s{\"in\": %lld, \"out\": %lld, \"count\": %lld, \"ms\": {\"%s\": %.4f, \"%s\": %.4f, \"%s\": %.4f, "
                    "\"%s\": %.4f}}",
                    rows.empty() ? "" : ", ", (long long)s.in, (long long)s.out, (long long)s.count, names[0], m[0],
                    names[1], m[1], names[2], m[2], names[3], m[3]);
      rows += row;
    }
    std::fprintf(stderr, "%-22s %9.3f %13.3f %12.3f %10.3f\n", (name + " total (ms)").c_str(), total[0], total[1],
                 total[2], total[3]);
    std::printf("{\"benchmark\": \"bf16_linear\", \"model\": \"%s\", \"batch\": %lld, \"threads\": %d, \"runs\": %d, "
                "\"onednn\": \"%s\", \"total_ms\": {\"%s\": %.3f, \"%s\": %.3f, \"%s\": %.3f, \"%s\": %.3f}, "
                "\"layers\": [%s]}\n",
                name.c_str(), (long long)model.rows, threads, runs, onednn_cpu_isa().c_str(), names[0], total[0],
                names[1], total[1], names[2], total[2], names[3], total[3], rows.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
