#!/usr/bin/env bash
# The main job: set up (install, build), then train LeNet-5 on Fashion-MNIST for 5 epochs on this
# CPU with a progress display and the final test accuracy. Extra flags go to the example, e.g.
#   scripts/train.sh --epochs=1        scripts/train.sh --threads=4 --metrics=run.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh 01_fashion_mnist_lenet
exec build/examples/01_fashion_mnist_lenet "$@"
