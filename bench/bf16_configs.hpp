// The four configurations bf16_conv and bf16_linear compare for one layer shape: float32, bfloat16
// on Tessera's kernels, on oneDNN, and as Auto chooses (set_cpu_bf16_library). They run in turn,
// `runs` times, so machine noise hits them alike; the result is each one's median, in ms.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <vector>

#include "tessera/tessera.hpp"

inline constexpr int kBf16Configs = 4;
inline constexpr const char* kBf16ConfigNames[kBf16Configs] = {"float32", "bf16_tessera", "bf16_onednn", "bf16_auto"};

// One forward and backward of `layer` on an input of shape x_shape (values and dy drawn from rng),
// after one untimed pass (primitives built, workspaces sized); ms.
template <class Layer>
double layer_step_ms(Layer& layer, tessera::Shape x_shape, tessera::Rng& rng) {
  tessera::Tensor<float, tessera::Cpu> x(x_shape);
  tessera::uniform_(x, -1.0, 1.0, rng);
  typename Layer::Cache c;
  const auto& y = layer.forward(x, c);
  tessera::Tensor<float, tessera::Cpu> dy(y.shape());
  tessera::uniform_(dy, -1.0, 1.0, rng);
  layer.backward(dy, c);
  const auto t0 = std::chrono::steady_clock::now();
  layer.forward(x, c);
  layer.backward(dy, c);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// step.template operator()<E>() times one forward and backward of the layer in Env E, in ms.
template <class Step>
std::array<double, kBf16Configs> bf16_config_medians(int runs, Step&& step) {
  using tessera::Bf16Library;
  std::vector<double> t[kBf16Configs];
  for (int r = 0; r < runs; ++r) {
    t[0].push_back(step.template operator()<tessera::CpuLocal>());
    tessera::set_cpu_bf16_library(Bf16Library::Tessera);
    t[1].push_back(step.template operator()<tessera::CpuLocalBf16>());
    tessera::set_cpu_bf16_library(Bf16Library::OneDnn);
    t[2].push_back(step.template operator()<tessera::CpuLocalBf16>());
    tessera::set_cpu_bf16_library(Bf16Library::Auto);
    t[3].push_back(step.template operator()<tessera::CpuLocalBf16>());
  }
  std::array<double, kBf16Configs> medians{};
  for (int i = 0; i < kBf16Configs; ++i) {
    std::sort(t[i].begin(), t[i].end());
    medians[i] = t[i][t[i].size() / 2];
  }
  return medians;
}
