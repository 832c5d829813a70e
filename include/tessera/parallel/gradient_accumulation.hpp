// GradientAccumulation: a strategy in one header (docs/adding-a-strategy.md walks through it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/parallel/strategy.hpp"

namespace tessera {

// GradientAccumulation: k micro-batches, then one optimizer step (PyTorch: k backward passes,
// each loss divided by k, then optimizer.step()). Each batch of n samples is split into k
// contiguous micro-batches of n/k (the first n mod k one larger, as torch.tensor_split does);
// micro-batch i's loss is weighted by n_i / n, so the accumulated gradient is the gradient of the
// batch's mean loss: the step equals one step on the whole batch up to summation order, with the
// activations of one micro-batch in memory instead of k. Under DataParallel (stack(dp, accum))
// only the last micro-batch's backward communicates (DataParallel::before_backward).
template <class E>
class GradientAccumulation : public StrategyBase<E> {
 public:
  using S = typename E::Scalar;
  static constexpr bool kOwnsMicroBatchLoop = true;

  explicit GradientAccumulation(int micro_batches) : count_(micro_batches) {
    TESSERA_CHECK(micro_batches >= 1, ArgumentError, "GradientAccumulation: micro_batches=", micro_batches,
                  " must be >= 1");
  }
  std::string name() const { return "GradientAccumulation(" + std::to_string(count_) + ")"; }
  int micro_batches() const { return count_; }

  // Splits the batch's samples (images, or a language model's token windows with their T labels
  // each) into count_ contiguous micro-batches.
  double run_micro_batches(const Batch<S>& batch, const MicroStep<S>& step) {
    const bool tokens = batch.tokens.numel() > 0;
    const Tensor<S>* images = &batch.images;
    const std::int64_t n = batch.samples();
    TESSERA_CHECK(n >= count_, ArgumentError, "GradientAccumulation: a batch of ", n, " samples cannot be split into ",
                  count_, " micro-batches (at least one sample each)");
    // Per sample: the input row's length and how many labels it has (T for token windows).
    const std::int64_t labels_per = static_cast<std::int64_t>(batch.labels.size()) / std::max<std::int64_t>(n, 1);
    TESSERA_CHECK(tokens ? batch.tokens.rank() == 2 && labels_per * n == static_cast<std::int64_t>(batch.labels.size())
                         : images->dim(0) == n,
                  ArgumentError, "GradientAccumulation: the batch has ", batch.labels.size(), " labels but ",
                  tokens ? "tokens " : "images ", tokens ? batch.tokens.shape() : images->shape());
    const std::int64_t row = (tokens ? batch.tokens.numel() : images->numel()) / std::max<std::int64_t>(n, 1);
    slices_.resize(static_cast<std::size_t>(count_));
    double loss = 0;
    std::int64_t begin = 0;
    for (int i = 0; i < count_; ++i) {
      const std::int64_t size = n / count_ + (i < n % count_ ? 1 : 0);
      Batch<S>& micro = slices_[static_cast<std::size_t>(i)];
      if (tokens) {
        micro.tokens.resize({size, batch.tokens.dim(1)});
        std::copy_n(batch.tokens.data() + begin * row, size * row, micro.tokens.data());
      } else {
        Shape shape = images->shape();
        shape[0] = size;
        micro.images.resize(shape);
        std::copy_n(images->data() + begin * row, size * row, micro.images.data());
      }
      micro.labels.assign(batch.labels.begin() + begin * labels_per, batch.labels.begin() + (begin + size) * labels_per);
      micro.index = batch.index;
      const MicroBatch mb{i, count_, static_cast<double>(size) / static_cast<double>(n)};
      loss += mb.weight * step(micro, mb);
      begin += size;
    }
    return loss;
  }

 private:
  int count_;
  std::vector<Batch<S>> slices_;  // kept: after the first step a split allocates nothing
};

}  // namespace tessera
