// Example 02: train the CIFAR-style ResNet-20 (He et al., option-B shortcuts) on Fashion-MNIST.
//   ./02_fashion_mnist_resnet [--epochs=5] [--batch=128] [--lr=0.1] [--warmup=1] [--threads=N]
//                             [--precision=float32|bfloat16] ...
#include "common/fashion_mnist_run.hpp"

int main(int argc, char** argv) {
  examples::Recipe recipe{.epochs = 5, .batch_size = 128, .lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4,
                          .warmup_epochs = 0.5, .min_accuracy = 0.915};  // measured 93.06%
  return examples::run_fashion_mnist(argc, argv, "02_fashion_mnist_resnet", recipe, []<class E>(std::uint64_t seed) {
    return tessera::resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = seed});
  });
}
