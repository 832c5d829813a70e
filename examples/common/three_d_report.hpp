// What example 14 (data x pipeline x tensor parallelism) checks and prints, kept out of its main:
// the dense network of the same seed, every rank's gradient slices against it on the first
// global batch, and the cost model of each dimension beside what was measured.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "common/device_batch.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// The unsplit MLP 784-h-h-h-10 drawn from `seed` as the tensor-parallel blocks draw theirs (block1
// = fc1, fc2; block2 = fc3, fc4), on one rank.
template <class E>
struct DenseMlp {
  using Tensor = tessera::Tensor<float, typename E::Device>;
  std::vector<tessera::Linear<E>> fc;
  DenseMlp(std::int64_t hidden, std::uint64_t seed) {
    tessera::Rng rng(seed);
    fc.emplace_back(784, hidden, rng);
    fc.emplace_back(hidden, hidden, rng);
    fc.emplace_back(hidden, hidden, rng);
    fc.emplace_back(hidden, 10, rng);
  }
  // Loss of the whole batch x (N, 784); leaves the gradients in fc[k].weight().grad / bias().grad.
  float loss_and_gradients(const Tensor& x, std::span<const std::int64_t> labels) {
    std::array<typename tessera::Linear<E>::Cache, 4> c;
    std::array<typename tessera::ReLU<E>::Cache, 3> rc;
    tessera::ReLU<E> relu;
    tessera::CrossEntropyLoss<E> loss;
    typename tessera::CrossEntropyLoss<E>::Cache lc;
    const Tensor* h = &x;
    for (std::size_t k = 0; k < 4; ++k) {
      h = &fc[k].forward(*h, c[k]);
      if (k < 3) h = &relu.forward(*h, rc[k]);
    }
    const float l = loss.forward(*h, labels, lc);
    const Tensor* g = &loss.backward(lc);
    for (std::size_t k = 4; k-- > 0;) {
      g = &fc[k].backward(*g, c[k]);
      if (k > 0) g = &relu.backward(*g, rc[k - 1]);
    }
    return l;
  }
  // The first global batch of the training loader (what the replicas' shards make up) through the
  // network: its loss; the gradients stay in the layers.
  float first_batch(const tessera::Dataset& train_set, std::int64_t batch, std::uint64_t seed) {
    tessera::DataLoader<float> all(train_set, {.batch_size = batch, .shuffle = true, .seed = seed, .drop_tail = true});
    tessera::Batch<float> whole;
    all.start_epoch(0);
    TESSERA_CHECK(all.next(whole), tessera::Error, "no training data");
    whole.images.reshape(tessera::Shape{whole.images.dim(0), 784});
    DeviceBatch<typename E::Device> images;
    return loss_and_gradients(images(whole.images), whole.labels);
  }
  // The dense layer that parameter `name` ("block1.0.weight", "block2.2.bias", ...) is a slice of.
  tessera::Linear<E>& layer(const std::string& name) {
    const std::size_t block = name.starts_with("block1.") ? 0 : 2;
    return fc[block + (name.find(".2.") != std::string::npos ? 1 : 0)];
  }
};

// Rank t's slice of a dense tensor, as its tensor-parallel layer holds it: the column layer
// ("<block>.0.*") holds output rows [t w, (t+1) w), the row layer's weight ("<block>.2.weight")
// input columns [t w, (t+1) w), and the row layer's bias all of it. Returns the largest difference.
inline double slice_difference(const std::string& name, const tessera::Tensor<float>& mine,
                               const tessera::Tensor<float>& dense, int t) {
  double worst = 0;
  if (name.ends_with(".2.weight")) {  // (out, w) of (out, w T)
    const std::int64_t out = mine.dim(0), w = mine.dim(1), in = dense.dim(1);
    for (std::int64_t i = 0; i < out; ++i)
      for (std::int64_t j = 0; j < w; ++j)
        worst = std::max(worst, static_cast<double>(std::abs(mine[i * w + j] - dense[i * in + t * w + j])));
  } else {  // ".2.bias": all of it; ".0.weight" (w, in) or ".0.bias" (w): rows [t w, (t+1) w)
    const std::int64_t first = name.ends_with(".2.bias") ? 0 : t * mine.numel();
    for (std::int64_t i = 0; i < mine.numel(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(mine[i] - dense[first + i])));
  }
  return worst;
}

// Every rank's gradient slices (after DataParallel averaged them over the replicas) against the
// dense network's on the whole first global batch. Collective over the world; prints on rank 0.
template <class E, class Parameters, class Comm>
bool check_against_dense(Comm& world, Parameters named, DenseMlp<E>& dense, float dense_loss, int t) {
  std::array<double, 1> worst{0};
  for (auto& [name, p] : named.parameters) {
    tessera::Linear<E>& layer = dense.layer(name);
    const auto& reference = name.ends_with("weight") ? layer.weight().grad : layer.bias().grad;
    worst[0] = std::max(worst[0], slice_difference(name, tessera::to_host(p->grad), tessera::to_host(reference), t));
  }
  world.all_reduce(std::span<double>(worst), tessera::ReduceOp::Max);
  const bool ok = worst[0] < 1e-5;
  if (world.rank() == 0)
    std::printf("check: first step's gradients = the dense network's on the whole batch on one rank (loss %.6f): "
                "every rank's slices within %.1e (tolerance 1e-5): %s\n", static_cast<double>(dense_loss), worst[0],
                ok ? "ok" : "FAIL");
  return ok;
}

// The cost model per rank and step (float32), each dimension with its own formula:
//   tensor: every block's row layer all-reduces its output (n, out) in forward and its column
//     layer dL/d(input) (n, in) in backward (not block1's: the images need none), n = B/D
//     samples per replica: 2(T-1)/T x 4 n (out [+ in]) bytes;
//   pipeline: the boundary after a stage carries activations forward and gradients back,
//     2 x 4 n h plus a 64-byte header per micro-batch;
//   data: DataParallel all-reduces this rank's parameter slices: 2(D-1)/D x 4 x (slice).
// Block1 is unit 1 of the model, block2 unit 3. Collective over the world.
template <class Pipe, class Comm>
void print_3d_costs(Comm& world, Pipe& pipe, int D, int P, int T, std::int64_t batch, std::int64_t hidden,
                    int micro_batches) {
  const double n = static_cast<double>(batch / D), h = static_cast<double>(hidden);
  const std::vector<double> mine{static_cast<double>(tessera::count_parameters(pipe.stage_parameters())),
                                 static_cast<double>(pipe.last_step().bytes_sent_forward),
                                 static_cast<double>(pipe.last_step().bytes_sent_backward)};
  std::vector<double> every(mine.size() * static_cast<std::size_t>(world.size()));
  world.all_gather(std::span<const double>(mine), std::span<double>(every));
  if (world.rank() != 0) return;
  std::printf("\ncost per rank and step (float32), by formula, and measured where the program can count it:\n");
  for (int k = 0; k < P; ++k) {
    const auto begin = pipe.boundaries()[static_cast<std::size_t>(k)], end = pipe.boundaries()[static_cast<std::size_t>(k) + 1];
    const bool block1 = begin <= 1 && 1 < end, block2 = begin <= 3 && 3 < end;
    double tensor_floats = 0, slice = 0;
    if (block1) tensor_floats += h;                                 // block1: forward output only
    if (block2) tensor_floats += 10 + h;                            // block2: forward output and dL/dx
    if (block1) slice += 784 * h / T + h / T + h * h / T + h;       // block1's slices
    if (block2) slice += h * h / T + h / T + 10 * h / T + 10;       // block2's slices
    const double held = every[static_cast<std::size_t>(3 * (k * T))];  // rank (0 P + k) T + 0
    std::printf("  stage %d: parameters %.0f by formula, %.0f held; tensor all-reduces 2(T-1)/T x 4 x %.0f x %.0f = "
                "%.1f KiB; data all-reduce 2(D-1)/D x 4 x %.0f = %.1f KiB\n", k, slice, held, n, tensor_floats,
                2.0 * (T - 1) / T * 4 * n * tensor_floats / 1024, slice, 2.0 * (D - 1) / D * 4 * slice / 1024);
    if (k + 1 < P) {
      const double sent = every[static_cast<std::size_t>(3 * (k * T) + 1)] +
                          every[static_cast<std::size_t>(3 * ((k + 1) * T) + 2)];
      std::printf("  stage %d <-> %d: 2 x 4 x %.0f x %.0f + %d x 64 B = %.1f KiB by formula, %.1f KiB sent in the last "
                  "step\n", k, k + 1, n, h, micro_batches, (8 * n * h + 64.0 * micro_batches) / 1024, sent / 1024);
    }
  }
}

}  // namespace examples
