// Memory per rank for the examples' cost models, measured from the device allocator's own
// counters: bytes handed out and not returned, and their high-water mark (what PyTorch reports as
// torch.cuda.memory_allocated and max_memory_allocated). Host and device alike: Device::allocator()
// is the CachingAllocator of the build's device.
//
// A phase is measured between barriers, so every rank's allocations of the phase fall inside it.
// Thread ranks share their process's allocator: there the figure is the process's divided by its
// ranks (the average rank); on a process backend it is this rank's own.
//
// The allocator rounds a request below 1 MiB up to a power of two (at most 2x) and a larger one
// up to 64 KiB: both are reported, the bytes requested (what a formula of tensor sizes predicts)
// and the blocks that hold them (what the memory costs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/allocator.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/core/concepts.hpp"

namespace examples {

template <class Device, class Comm>
class RankMemory {
 public:
  explicit RankMemory(Comm& comm) : comm_(comm) {}

  // Ranks whose allocations this process's counters hold together.
  int ranks_per_process() const { return tessera::SharedMemoryCommunicator<Comm> ? comm_.size() : 1; }

  // Starts a phase: the bytes in use now are its baseline, and the high-water mark restarts here.
  // Collective: every rank calls it.
  void start() {
    comm_.barrier();
    if (reads()) {
      const auto stats = Device::allocator().stats();
      baseline_ = {stats.requested_bytes_in_use, stats.bytes_in_use};
      Device::allocator().reset_peak();
    }
    comm_.barrier();
  }

  // Restarts the high-water mark here, keeping the phase's baseline (to leave a phase's start,
  // e.g. building a model, out of the peak of what follows). Collective.
  void restart_peak() {
    comm_.barrier();
    if (reads()) Device::allocator().reset_peak();
    comm_.barrier();
  }

  // Bytes in use now above the phase's baseline, per rank: as requested (the tensors' own sizes)
  // and as held in the allocator's rounded blocks. Collective; the values are rank 0's, and on a
  // process backend every rank's own.
  struct Bytes {
    double requested = 0, blocks = 0;
  };
  Bytes held() {
    return read([](const tessera::AllocatorStats& s) { return s.requested_bytes_in_use; },
                [](const tessera::AllocatorStats& s) { return s.bytes_in_use; });
  }
  // The most bytes in use at once since start(), above the baseline, per rank. Collective.
  Bytes peak() {
    return read([](const tessera::AllocatorStats& s) { return s.peak_requested_bytes_in_use; },
                [](const tessera::AllocatorStats& s) { return s.peak_bytes_in_use; });
  }

 private:
  // One thread reads a shared allocator; on a process backend every rank reads its own.
  bool reads() const { return !tessera::SharedMemoryCommunicator<Comm> || comm_.rank() == 0; }

  template <class Requested, class Blocks>
  Bytes read(Requested requested, Blocks blocks) {
    comm_.barrier();
    Bytes bytes;
    if (reads()) {
      const auto stats = Device::allocator().stats();
      const auto above = [&](std::size_t now, std::size_t base) {
        return static_cast<double>(now > base ? now - base : 0) / ranks_per_process();
      };
      bytes = {above(requested(stats), baseline_.requested), above(blocks(stats), baseline_.blocks)};
    }
    comm_.barrier();
    return bytes;
  }

  Comm& comm_;
  struct {
    std::size_t requested = 0, blocks = 0;
  } baseline_;
};

// The first steps' memory, record()ed from the Trainer's before_step hook (after backward, before
// the update): after step 1 the peak since start() (activations, their gradients, workspaces)
// and what stays held; after step 2, the optimizer state step 1's update created (held then minus
// held at step 1: momentum). Collective, as RankMemory's reads are.
template <class Device, class Comm>
struct FirstStepsMemory {
  using Bytes = typename RankMemory<Device, Comm>::Bytes;
  RankMemory<Device, Comm>& memory;
  Bytes step_peak{}, optimizer{}, first_held{};
  std::int64_t steps = 0;
  void record() {
    if (++steps == 1) {
      step_peak = memory.peak();
      first_held = memory.held();
    } else if (steps == 2) {
      const auto now = memory.held();
      optimizer = {now.requested - first_held.requested, now.blocks - first_held.blocks};
    }
  }
};

// Values per sample that each unit of the model (a layer: Sequential::forward_units) leaves
// behind for backward, by the formula "every unit keeps its output": the outputs' sizes for one
// sample (shapes only: one zero sample through the units in Eval mode, in a cache of its own).
template <class Device, class Model>
std::vector<std::int64_t> unit_output_values_per_sample(Model& model, const tessera::Shape& sample) {
  model.set_mode(tessera::Mode::Eval);
  typename Model::Cache cache{};
  tessera::Tensor<float> zeros(sample);
  zeros.zero();
  const auto x = tessera::to_device<Device>(zeros);
  const auto* current = &x;
  std::vector<std::int64_t> values;
  for (std::size_t u = 0; u < model.unit_count(); ++u) {
    current = &model.forward_units(*current, cache, u, u + 1);
    values.push_back(current->numel());
  }
  model.set_mode(tessera::Mode::Train);
  return values;
}

}  // namespace examples
