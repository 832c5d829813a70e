// LeNet-5 (LeCun et al. 1998) in its common modern form: ReLU and max-pooling.
//   x (N, C, H, W) -> conv5x5(6, pad 2) -> ReLU -> maxpool 2 -> (N, 6, H/2, W/2)
//   -> conv5x5(16) -> ReLU -> maxpool 2 -> (N, 16, (H/2-4)/2, (W/2-4)/2) -> flatten
//   -> fc 120 -> ReLU -> fc 84 -> ReLU -> fc classes
// For 28x28 inputs the flattened size is 16*5*5 = 400, as in the original 32x32 design.
// Names follow torch.nn.Sequential: "0.weight" (conv1), "3.weight" (conv2), "7.weight" (fc1), ...
#pragma once

#include <string>

#include "tessera/layers/activation.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/layers/sequential.hpp"

namespace tessera {

template <class E>
using LeNet5 = Sequential<Conv2d<E>, ReLU<E>, MaxPool2d<E>, Conv2d<E>, ReLU<E>, MaxPool2d<E>, Flatten<E>, Linear<E>,
                          ReLU<E>, Linear<E>, ReLU<E>, Linear<E>>;

template <class E>
LeNet5<E> lenet5(std::int64_t in_channels = 1, std::int64_t image_size = 28, std::int64_t num_classes = 10,
                 std::uint64_t seed = 0) {
  const std::int64_t after = ((image_size / 2) - 4) / 2;  // spatial size after the second pool
  TESSERA_CHECK(after >= 1, ArgumentError, "lenet5: image size ", image_size, " is too small (need >= 12)");
  Rng rng(seed);
  // Braces: list-initialization evaluates the layers (and their draws from rng) left to right on
  // every compiler; a parenthesized call would leave the order unspecified.
  LeNet5<E> net{Conv2d<E>(in_channels, 6, 5, rng, 1, 2), ReLU<E>(), MaxPool2d<E>(2, 2, 0),
                Conv2d<E>(6, 16, 5, rng), ReLU<E>(), MaxPool2d<E>(2, 2, 0), Flatten<E>(),
                Linear<E>(16 * after * after, 120, rng), ReLU<E>(), Linear<E>(120, 84, rng), ReLU<E>(),
                Linear<E>(84, num_classes, rng)};
  net.set_needs_input_grad(false);
  return net;
}

}  // namespace tessera
