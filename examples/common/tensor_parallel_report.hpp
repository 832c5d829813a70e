// What example 07 (tensor parallelism) checks and prints, kept out of its main: the split MLP
// against the dense network of the same seed on the first batch, and the cost model (the logits'
// all-reduce per step, memory per rank) beside the measured figures.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>

#include "common/device_batch.hpp"
#include "common/memory.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// The first batch through the dense network (same seed) and the split one.
template <class Model, class Comm>
void check_split_mlp_against_dense(Model& tp, Comm& comm, const tessera::Batch<float>& b, std::int64_t hidden, std::uint64_t seed) {
  using namespace tessera;
  using E = typename Model::Env;
  using Device = typename E::Device;
  Rng rng(seed);
  Linear<E> fc1(784, hidden, rng), fc2(hidden, 10, rng);
  Flatten<E> flatten;
  ReLU<E> relu;
  typename Flatten<E>::Cache cf;
  typename Linear<E>::Cache c1, c2;
  typename ReLU<E>::Cache cr;
  CrossEntropyLoss<E> loss;
  typename CrossEntropyLoss<E>::Cache lc_dense, lc_tp;
  DeviceBatch<Device> images;
  const float expected = loss.forward(
      fc2.forward(relu.forward(fc1.forward(flatten.forward(images(b.images), cf), c1), cr), c2), b.labels, lc_dense);
  fc1.backward(relu.backward(fc2.backward(loss.backward(lc_dense), c2), cr), c1);
  typename Model::Cache cache;
  const float got = loss.forward(tp.forward(images(b.images), cache), b.labels, lc_tp);
  tp.backward(loss.backward(lc_tp), cache);
  // Rank r holds rows [r h/p, (r+1) h/p) of fc1 and columns [r h/p, (r+1) h/p) of fc2.
  auto named = named_tensors(tp);
  const std::int64_t w = hidden / comm.size(), first = w * comm.rank();
  double worst = 0;
  const auto g1 = to_host(named.parameters[0].second->grad);  // "0.weight" (w, 784)
  const auto dense_g1 = to_host(fc1.weight().grad);
  for (std::int64_t k = 0; k < g1.numel(); ++k)
    worst = std::max(worst, static_cast<double>(std::abs(g1[k] - dense_g1[first * 784 + k])));
  const auto g2 = to_host(named.parameters[2].second->grad);  // "2.weight" (10, w)
  const auto dense_g2 = to_host(fc2.weight().grad);
  for (std::int64_t i = 0; i < 10; ++i)
    for (std::int64_t j = 0; j < w; ++j)
      worst = std::max(worst, static_cast<double>(std::abs(g2[i * w + j] - dense_g2[i * hidden + first + j])));
  std::array<double, 1> all{worst};
  comm.all_reduce(std::span<double>(all), ReduceOp::Max);
  TESSERA_CHECK(std::abs(got - expected) < 1e-5f && all[0] < 1e-5, Error, "07_tensor_parallel: differs from the dense "
                "network: loss ", got, " vs ", expected, ", gradients by ", all[0]);
  if (comm.rank() == 0)
    std::printf("check: first batch = the dense network (loss %.6f vs %.6f, gradient slices within %.1e)\n", got,
                expected, all[0]);
  for (auto& [name, p] : named.parameters) p->grad.zero();
}


// The cost model. Communication: one all-reduce of the partial logits, N x 10 floats, per step
// (backward needs none here, see the README); a bandwidth-optimal all-reduce sends 2(p-1)/p of it
// per rank. Data parallelism on the same ranks would all-reduce every gradient instead. Memory:
// each rank holds 1/p of W1, b1 and W2, and all of b2; gradients and momentum as much. Beside it:
// what the threads build's collectives copied between the ranks' buffers (peer_bytes >= 0), or
// what crossed the loopback interface.
inline void print_tensor_parallel_costs(int p, std::int64_t batch, std::int64_t hidden, double mine, double steps,
                                        double peer_bytes, double loopback) {
  const double logits = static_cast<double>(batch) * 10 * 4, per_rank = 2.0 * (p - 1) / p * logits;
  const double dense = static_cast<double>(784 * hidden + hidden + hidden * 10 + 10);
  std::printf("cost: all-reduce per rank and step = 2(p-1)/p x N x 10 x 4 B = 2 x %d/%d x %.0f B = %.2f KiB "
              "(data parallelism: 2(p-1)/p x %.0f gradients x 4 B = %.1f KiB)\n",
              p - 1, p, logits, per_rank / 1024, dense, 2.0 * (p - 1) / p * dense * 4 / 1024);
  if (peer_bytes >= 0)
    std::printf("cost: measured: %.2f KiB per rank and step moved between the ranks' buffers over %.0f steps (%.2fx "
                "the formula)\n", peer_bytes / steps / 1024, steps, peer_bytes / steps / per_rank);
  else if (loopback >= 0)
    std::printf("cost: measured on the loopback interface: %.2f KiB per rank and step over %.0f steps (0 where the "
                "backend moves bytes through shared memory; TCP headers count too)\n", loopback / p / steps / 1024, steps);
  std::printf("memory per rank: parameters (784 h/p + h/p + 10 h/p + 10) = %.0f by formula, %.0f held; with their "
              "gradients and momentum 3 x 4 B each = %.2f MiB (dense: %.2f MiB)\n",
              (784.0 + 1 + 10) * static_cast<double>(hidden) / p + 10, mine, 12 * mine / (1 << 20), 12 * dense / (1 << 20));
}

// Measured by the allocator (bytes requested; in its rounded blocks after the semicolon), per
// rank: the model's values and gradients (exactly 2 x 4 B per parameter held, or an error: a dense
// copy kept?), the momentum, and the first step's peak: the batch the Trainer holds (N x 784
// images) and the activations, N x (784 flattened + h/p hidden + h/p after ReLU + 10 logits) x 4 B,
// and in backward their gradients, N x (h/p + h/p + 10) x 4 B (the images need none).
template <class Bytes>
void print_tensor_parallel_memory(int p, std::int64_t batch, std::int64_t hidden, double mine, const Bytes& state,
                                  const Bytes& optimizer, const Bytes& step_peak) {
  const std::int64_t kept = 784 + 784 + 2 * hidden / p + 10, gradients = 2 * hidden / p + 10;
  const double activations = static_cast<double>(batch * (kept + gradients)) * 4;
  TESSERA_CHECK(state.requested == 8 * mine, tessera::Error, "the model takes ", state.requested, " bytes per rank, not 2 x ",
                mine, " x 4 (its slices' values and gradients): a dense copy kept?");
  std::printf("memory: parameters + gradients = 2 x %.0f x 4 B = %.1f KiB | %.1f KiB measured (%.2fx; %.1f KiB in "
              "blocks)\n", mine, 8 * mine / 1024, state.requested / 1024, state.requested / (8 * mine), state.blocks / 1024);
  std::printf("memory: momentum = %.0f x 4 B = %.1f KiB | %.1f KiB measured (%.2fx; %.1f KiB in blocks)\n", mine,
              4 * mine / 1024, optimizer.requested / 1024, optimizer.requested / (4 * mine), optimizer.blocks / 1024);
  std::printf("memory: batch + activations + their gradients = N x ((784 + 784 + 2 h/p + 10) + (2 h/p + 10)) x 4 B = "
              "%lld x (%lld + %lld) x 4 B = %.1f KiB | step peak %.1f KiB measured (%.2fx; %.1f KiB in blocks)\n",
              static_cast<long long>(batch), static_cast<long long>(kept), static_cast<long long>(gradients),
              activations / 1024, step_peak.requested / 1024, step_peak.requested / activations, step_peak.blocks / 1024);
}

}  // namespace examples
