// Hogwild: lock-free asynchronous SGD for ranks that share one process (Recht et al. 2011,
// "Hogwild!"). All ranks update one shared copy of the parameters without any lock: each rank
// copies the shared values into its model, computes a gradient on its own batch, and writes
//   w <- w - lr (g + weight_decay w)
// element by element into the shared copy, while the other ranks read and write it too. Updates
// may interleave or overwrite each other; for sparse or small gradients that costs little, and
// no rank ever waits for another.
//
//   HogwildStore<float> store;                        // outside launch: one per process
//   launch<CpuThreads>(..., [&](ThreadComm& comm) {
//     auto model = lenet5<CpuThreads>(...);
//     Hogwild hogwild(model, comm, store, {.lr = 0.05});   // rank 0's parameters fill the store
//     loop: hogwild.pull(); zero grads; forward; backward; hogwild.step();
//     hogwild.gather_parameters();                   // collective: the shared values into the model
//   });
//
// Every element is read and written through std::atomic_ref with relaxed order: on x86 and ARM
// these are plain loads and stores (no lock, no fence), but the races are defined behaviour. An
// update is one read-modify-write per element, not an atomic one, so a concurrent update to the
// same element may be lost, exactly as in the paper. Plain SGD only (the paper's algorithm: no
// momentum, whose buffer would be shared state too).
//
// Staleness: the store counts updates; a gradient's staleness is the number of updates other
// ranks finished between this rank's pull() and its step(), recorded in staleness().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/cpu/optim.hpp"
#include "tessera/parallel/parameter_server.hpp"

namespace tessera {

// The shared parameters of one process's Hogwild ranks. Create it before launching the ranks and
// give every rank the same one; it must outlive them.
template <class S>
class HogwildStore {
 public:
  HogwildStore() = default;
  HogwildStore(const HogwildStore&) = delete;
  HogwildStore& operator=(const HogwildStore&) = delete;

  std::int64_t updates() const { return updates_.load(std::memory_order_relaxed); }
  std::size_t size() const { return values_.size(); }

 private:
  template <class E>
  friend class Hogwild;
  std::mutex init_mutex_;
  bool initialized_ = false;
  std::vector<S> values_;
  std::atomic<std::int64_t> updates_{0};
};

struct HogwildOptions {
  double lr = 0.01;
  double weight_decay = 0.0;  // on every parameter (as torch.optim.SGD's weight_decay)
};

template <class E>
class Hogwild {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Comm = typename E::Comm;
  static_assert(SharedMemoryCommunicator<Comm>,
                "Tessera Hogwild: the ranks must share one process (ThreadComm or LocalComm); across "
                "processes use ParameterServer with staleness_bound = kAsynchronous");
  static_assert(D::host_accessible, "Tessera Hogwild: parameters must live in host memory (Cpu device)");

  template <class Model, class C>
  Hogwild(Model& model, C& comm, HogwildStore<S>& store, HogwildOptions options = {})
      : comm_(comm_of_env<E>(comm)), store_(store), options_(options),
        named_(parameters_of_env<E>(named_tensors(model))) {
    TESSERA_CHECK(options.lr >= 0 && options.weight_decay >= 0, ArgumentError, "Hogwild: lr=", options.lr,
                  " and weight_decay=", options.weight_decay, " must be >= 0");
    std::size_t total = 0;
    for (auto& [name, p] : named_.parameters) total += static_cast<std::size_t>(p->value.numel());
    if (comm_.rank() == 0) {
      std::lock_guard lock(store_.init_mutex_);
      store_.values_.resize(total);
      std::size_t offset = 0;
      for (auto& [name, p] : named_.parameters) {
        std::copy(p->value.data(), p->value.data() + p->value.numel(), store_.values_.data() + offset);
        offset += static_cast<std::size_t>(p->value.numel());
      }
      store_.updates_.store(0);
      store_.initialized_ = true;
    }
    comm_.barrier();  // the store is filled before anyone reads it
    std::lock_guard lock(store_.init_mutex_);
    TESSERA_CHECK(store_.initialized_ && store_.values_.size() == total, ArgumentError, "Hogwild on rank ",
                  comm_.rank(), ": the store holds ", store_.values_.size(), " values but this rank's model has ",
                  total, " (ranks built different models, or a store shared by two jobs)");
  }

  // The shared values into the model (each element one relaxed atomic load).
  void pull() {
    read_at_ = store_.updates_.load(std::memory_order_acquire);
    std::size_t offset = 0;
    for (auto& [name, p] : named_.parameters) {
      S* v = p->value.data();
      for (std::int64_t i = 0; i < p->value.numel(); ++i)
        v[i] = std::atomic_ref<S>(store_.values_[offset + static_cast<std::size_t>(i)]).load(std::memory_order_relaxed);
      offset += static_cast<std::size_t>(p->value.numel());
    }
  }

  // One lock-free SGD update of the shared values from the model's gradients.
  void step() {
    staleness_.record(store_.updates_.load(std::memory_order_relaxed) - read_at_);
    const S lr = static_cast<S>(lr_), decay = static_cast<S>(options_.weight_decay);
    std::size_t offset = 0;
    for (auto& [name, p] : named_.parameters) {
      const S* g = p->grad.data();
      for (std::int64_t i = 0; i < p->grad.numel(); ++i) {
        std::atomic_ref<S> w(store_.values_[offset + static_cast<std::size_t>(i)]);
        const S current = w.load(std::memory_order_relaxed);
        // Rounded as Sgd's kernel rounds (fused where the CPU has FMA), so that one rank is plain
        // SGD bit for bit at any optimization level, not only where the compiler fuses it too.
        w.store(detail::mul_add(-lr, detail::mul_add(decay, current, g[i]), current), std::memory_order_relaxed);
      }
      offset += static_cast<std::size_t>(p->grad.numel());
    }
    store_.updates_.fetch_add(1, std::memory_order_release);
    ++steps_;
  }

  // Collective: waits for every rank, then copies the shared values into this rank's model.
  void gather_parameters() {
    comm_.barrier();
    pull();
  }

  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }
  std::int64_t steps() const { return steps_; }
  const StalenessStats& staleness() const { return staleness_; }

 private:
  Comm& comm_;
  HogwildStore<S>& store_;
  HogwildOptions options_;
  NamedTensors<E> named_;
  double lr_ = options_.lr;
  std::int64_t read_at_ = 0;
  std::int64_t steps_ = 0;
  StalenessStats staleness_;
};

template <class Model, class C, class S>
Hogwild(Model&, C&, HogwildStore<S>&, HogwildOptions = {}) -> Hogwild<typename Model::Env>;

}  // namespace tessera
