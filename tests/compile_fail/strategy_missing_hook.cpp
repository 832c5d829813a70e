// A strategy written without StrategyBase that forgot the hooks around the optimizer step: the
// Trainer would have nowhere to wait for its gradients, so it does not compile.
// expect: Tessera Strategy: missing `void before_optimizer_step()` and `void after_optimizer_step()`
// max-lines: 16
#include "tessera/tessera.hpp"

struct EveryOtherStep {
  using Env = tessera::CpuLocal;
  static constexpr bool kOwnsMicroBatchLoop = false;
  static constexpr bool kHooksGradients = false;
  std::string name() const { return "EveryOtherStep"; }
  void start() {}
  void before_forward(const tessera::MicroBatch&) {}
  void before_backward(const tessera::MicroBatch&) {}
  void after_backward(const tessera::MicroBatch&) {}
  double run_micro_batches(const tessera::Batch<float>& b, const tessera::MicroStep<float>& step) {
    return step(b, {});
  }
  void save_state(tessera::StrategyState&) const {}
  void load_state(const tessera::StrategyState&) {}
  void set_timeline(tessera::SpanSink*) {}
};

int main() {
  using namespace tessera;
  auto model = lenet5<CpuLocal>(1, 28, 10, 1);
  Sgd<CpuLocal> sgd(named_tensors(model), {.lr = 0.1});
  EveryOtherStep strategy;
  Trainer trainer(model, sgd, strategy, [](double) { return 0.1; }, {});
}
