// Fashion-MNIST as every example uses it: the train and test splits from `data_dir` (empty: the
// default locations), the training set cut to its first `limit` images when limit > 0 (read no
// further than that: a short run starts without inflating all 60,000), both normalized with the training set's mean and standard deviation.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/data/dataset.hpp"
#include "tessera/data/fashion_mnist.hpp"

namespace examples {

struct FashionMnist {
  tessera::Dataset train, test;
};

inline FashionMnist load_normalized_fashion_mnist(const std::string& data_dir, std::int64_t limit) {
  using namespace tessera;
  FashionMnist d{load_fashion_mnist(Split::Train, data_dir, limit), load_fashion_mnist(Split::Test, data_dir)};
  normalize(d.train, {kFashionMnistMean}, {kFashionMnistStd});
  normalize(d.test, {kFashionMnistMean}, {kFashionMnistStd});
  return d;
}

}  // namespace examples
