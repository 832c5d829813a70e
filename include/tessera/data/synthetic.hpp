// SyntheticImages: a Dataset of random images for benchmarks and smoke tests, shaped like the
// real thing (e.g. ImageNet: 3 x 224 x 224, 1000 classes) without any file.
//
// Ensures: images (count, channels, height, width) drawn from N(0, 1), labels uniform in
// [0, num_classes), both a pure function of `seed` (independent of the number of OpenMP threads:
// each image has its own generator, seeded from (seed, index)). Building 256 ImageNet-sized images
// (38.5 M values) takes a fraction of a second.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/data/dataset.hpp"

namespace tessera {

struct SyntheticImages : Dataset {
  SyntheticImages(std::int64_t count, std::int64_t channels, std::int64_t height, std::int64_t width,
                  std::int64_t classes, std::uint64_t seed) {
    TESSERA_CHECK(count > 0 && channels > 0 && height > 0 && width > 0 && classes > 0, ArgumentError,
                  "SyntheticImages(count=", count, ", channels=", channels, ", height=", height, ", width=", width,
                  ", num_classes=", classes, "): every argument must be positive");
    name = detail::cat("synthetic-", count, "x", channels, "x", height, "x", width);
    num_classes = classes;
    images.resize({count, channels, height, width});
    const std::int64_t per = channels * height * width;
    float* data = images.data();
#pragma omp parallel for schedule(static) if (count * per > (1 << 16))
    for (std::int64_t i = 0; i < count; ++i) {
      Rng rng(stream_seed(seed, static_cast<std::uint64_t>(i)));
      fill_normal(data + i * per, per, rng);
    }
    Rng label_rng(stream_seed(seed, ~std::uint64_t{0}));
    labels.resize(static_cast<std::size_t>(count));
    for (auto& label : labels) label = static_cast<std::int64_t>(label_rng.below(static_cast<std::uint64_t>(classes)));
  }

 private:
  static std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t stream) {
    std::uint64_t z = seed ^ (stream * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // Box-Muller in float, both values of each pair used: benchmark data needs the shape of N(0, 1),
  // not double precision, and this is several times faster than Rng::normal().
  static void fill_normal(float* out, std::int64_t n, Rng& rng) {
    constexpr float two_pi = 2.0f * std::numbers::pi_v<float>;
    std::int64_t i = 0;
    for (; i + 1 < n; i += 2) {
      const std::uint64_t bits = rng.next_u64();
      // Two 24-bit uniforms; u1 in (0, 1] so the logarithm is finite.
      const float u1 = (static_cast<float>(bits >> 40) + 1.0f) * 0x1.0p-24f;
      const float u2 = static_cast<float>((bits >> 16) & 0xFFFFFF) * 0x1.0p-24f;
      const float radius = std::sqrt(-2.0f * std::log(u1));
      out[i] = radius * std::cos(two_pi * u2);
      out[i + 1] = radius * std::sin(two_pi * u2);
    }
    if (i < n) out[i] = static_cast<float>(rng.normal());
  }
};

}  // namespace tessera
