// Top-1 accuracy of a model over a whole loader, in eval mode (BatchNorm uses its running
// statistics) and forward only (Mode::Inference), for the examples that measure accuracy outside a
// Trainer.
#pragma once

#include <cstdint>

#include "tessera/core/concepts.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/losses/cross_entropy.hpp"

namespace examples {

template <class Model>
double accuracy(Model& model, tessera::DataLoader<float>& loader) {
  model.set_mode(tessera::Mode::Inference);
  typename Model::Cache cache;
  tessera::Batch<float> batch;
  loader.start_epoch(0);
  std::int64_t correct = 0, seen = 0;
  while (loader.next(batch)) {
    correct += tessera::count_correct(model.forward(batch.images, cache), batch.labels);
    seen += static_cast<std::int64_t>(batch.labels.size());
  }
  model.set_mode(tessera::Mode::Train);
  return seen == 0 ? 0.0 : static_cast<double>(correct) / static_cast<double>(seen);
}

}  // namespace examples
