// LeNet-5 (LeCun et al. 1998) in its common modern form: ReLU and max-pooling.
//   x (N, C, H, W) -> conv5x5(6, pad 2) -> ReLU -> maxpool 2 -> (N, 6, H/2, W/2)
//   -> conv5x5(16) -> ReLU -> maxpool 2 -> (N, 16, (H/2-4)/2, (W/2-4)/2) -> flatten
//   -> fc 120 -> ReLU -> fc 84 -> ReLU -> fc classes
// For 28x28 inputs the flattened size is 16*5*5 = 400, as in the original 32x32 design.
// Names are the classic LeNet-5 layout, as a torch module with attributes conv1, conv2, fc1, fc2,
// fc3 (or an nn.Sequential built from an OrderedDict of the same names) spells them:
//   conv1.weight (6, C, 5, 5)  conv1.bias (6)     conv2.weight (16, 6, 5, 5)  conv2.bias (16)
//   fc1.weight (120, 16*s*s)   fc1.bias (120)     fc2.weight (84, 120)        fc2.bias (84)
//   fc3.weight (classes, 84)   fc3.bias (classes)
// The parameter-free layers are relu1, pool1, relu2, pool2, flatten, relu3, relu4 (pipeline unit names).
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
  net.set_names(
      {"conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten", "fc1", "relu3", "fc2", "relu4", "fc3"});
  net.set_needs_input_grad(false);
  return net;
}

}  // namespace tessera
