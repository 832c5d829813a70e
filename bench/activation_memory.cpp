// Activation memory of a GPT training step with and without activation checkpointing (GPT::
// set_activation_checkpointing), against the formula, as JSON. Never a timed test.
//
//   ./activation_memory [--n-layer=4] [--n-embd=128] [--n-head=4] [--batch=8] [--t=256] [--threads=2]
//
// Each mode builds the same model (vocabulary 256, seed 1) and runs one warm-up step (so the
// gradients and the caching allocator's blocks exist), then, with the allocator's peak reset, one
// forward and backward. "activations" is the peak of the bytes requested from the CPU caching
// allocator during that step minus the bytes in use before it (parameters, gradients, the batch):
// what the step's caches and temporaries hold at their most. Formula (float32, per token, C =
// n_embd, H = n_head, L = n_layer, V = vocabulary; models/gpt.hpp lists a block's caches):
//   held by the forward without checkpointing  L (18 C + H + 4) + 3 C + 2 V
//   with checkpointing                         L C + max(18 C + H + 4 + 2 C, 3 C + 2 V)
// where 3 C + 2 V is what lies outside the blocks: the token embeddings and their sum with the
// positions (2 C, held throughout), ln_f's output; the logits and the loss's log-probabilities.
// With checkpointing the one block cache is released before ln_f runs, so the forward's peak is
// the larger of the two moments, not their sum.
// times 4 B T bytes. Backward adds its gradients of the same sizes on top of the forward's caches
// (one block's worth, the gradient of the logits and the carried gradient), so the measured step
// peak is also printed beside the forward-only peak. Also checks the two modes' gradients are
// equal bit for bit.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

using namespace tessera;
using E = CpuLocal;

namespace {

// /proc/cpuinfo's first "model name", for the record (the bytes do not depend on it).
std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

struct Measured {
  std::size_t forward_peak = 0, step_peak = 0;
  std::vector<float> grads;
};

Measured measure(const GPTConfig& config, std::int64_t batch, std::int64_t t, bool checkpointing) {
  Rng rng(1);
  GPT<E> model(config, rng);
  model.set_activation_checkpointing(checkpointing);
  std::vector<std::int64_t> idx(static_cast<std::size_t>(batch * t));
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<std::int64_t>((i * 31 + 7) % 256);
  CrossEntropyLoss<E> loss;
  GPT<E>::Cache cache;
  CrossEntropyLoss<E>::Cache loss_cache;
  auto backward = [&] { model.backward(loss.backward(loss_cache), cache); };
  loss.forward(model.forward(idx, batch, t, cache), idx, loss_cache);  // warm-up
  backward();
  cache = {};
  loss_cache = {};
  struct Zero {
    void parameter(const std::string&, Parameter<float, Cpu>& p) { p.grad.fill(0.0f); }
    void buffer(const std::string&, Tensor<float>&) {}
  } zero;
  model.visit(zero);
  auto& allocator = Cpu::allocator();
  const std::size_t before = allocator.stats().requested_bytes_in_use;
  allocator.reset_peak();
  loss.forward(model.forward(idx, batch, t, cache), idx, loss_cache);
  Measured m;
  m.forward_peak = allocator.stats().peak_requested_bytes_in_use - before;
  backward();
  m.step_peak = allocator.stats().peak_requested_bytes_in_use - before;
  struct Grads {
    std::vector<float>* out;
    void parameter(const std::string&, Parameter<float, Cpu>& p) { out->insert(out->end(), p.grad.begin(), p.grad.end()); }
    void buffer(const std::string&, Tensor<float>&) {}
  } grads{&m.grads};
  model.visit(grads);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    GPTConfig config{.block_size = 256, .vocab_size = 256, .n_layer = 4, .n_head = 4, .n_embd = 128};
    config.n_layer = flags.get("n-layer", config.n_layer, {.min = 1});
    config.n_embd = flags.get("n-embd", config.n_embd, {.min = 1});
    config.n_head = flags.get("n-head", config.n_head, {.min = 1});
    const std::int64_t batch = flags.get("batch", std::int64_t{8}, {.min = 1});
    const std::int64_t t = flags.get("t", std::int64_t{256}, {.min = 1});
    config.block_size = t;
    const int threads = flags.threads("threads", 2);
    flags.finish();
    Cpu::set_num_threads(threads);
    const Measured plain = measure(config, batch, t, false), checkpointed = measure(config, batch, t, true);
    const double tokens = static_cast<double>(batch * t), c = static_cast<double>(config.n_embd);
    const double block = 18 * c + static_cast<double>(config.n_head) + 4, rest = 3 * c + 2 * 256;
    const double layers = static_cast<double>(config.n_layer);
    const double formula_plain = 4 * tokens * (layers * block + rest);
    const double formula_checkpointed = 4 * tokens * (layers * c + std::max(block + 2 * c, rest));
    const bool same = plain.grads == checkpointed.grads;
    std::printf("{\"bench\": \"activation_memory\", \"cpu\": \"%s\", \"model\": \"%s\", \"batch\": %lld, \"t\": %lld, \"threads\": %d, "
                "\"plain\": {\"forward_peak_bytes\": %zu, \"step_peak_bytes\": %zu, \"formula_forward_bytes\": %.0f}, "
                "\"checkpointed\": {\"forward_peak_bytes\": %zu, \"step_peak_bytes\": %zu, \"formula_forward_bytes\": %.0f}, "
                "\"forward_ratio\": %.3f, \"step_ratio\": %.3f, \"goal\": \"forward_ratio >= 2\", "
                "\"gradients_bitwise_equal\": %s}\n",
                cpu_model_name().c_str(), config.str().c_str(), static_cast<long long>(batch), static_cast<long long>(t), threads,
                plain.forward_peak, plain.step_peak, formula_plain, checkpointed.forward_peak, checkpointed.step_peak,
                formula_checkpointed, static_cast<double>(plain.forward_peak) / static_cast<double>(checkpointed.forward_peak),
                static_cast<double>(plain.step_peak) / static_cast<double>(checkpointed.step_peak), same ? "true" : "false");
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
