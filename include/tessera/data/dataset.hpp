// Dataset: an in-memory labelled image set, images (N, C, H, W) float32 and labels (N) in
// [0, num_classes). Loaders (data/loader.hpp) batch it; readers (fashion_mnist.hpp, synthetic.hpp)
// build it.
//
// normalize(ds, mean, std): x[n, c, h, w] = (x[n, c, h, w] - mean[c]) / std[c], in place, like
//   torchvision.transforms.Normalize applied to every sample.
// subset(ds, begin, end): a deep copy of samples [begin, end).
// check_dataset(ds): throws ArgumentError unless the invariants above hold (the loader calls it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

struct Dataset {
  Tensor<float> images;              // (N, C, H, W)
  std::vector<std::int64_t> labels;  // (N), each in [0, num_classes)
  std::int64_t num_classes = 0;
  std::string name;

  std::int64_t size() const { return static_cast<std::int64_t>(labels.size()); }
  std::int64_t channels() const { return images.rank() == 4 ? images.dim(1) : 0; }
  std::int64_t height() const { return images.rank() == 4 ? images.dim(2) : 0; }
  std::int64_t width() const { return images.rank() == 4 ? images.dim(3) : 0; }
  // Elements of one image: C * H * W.
  std::int64_t sample_numel() const { return channels() * height() * width(); }
};

TESSERA_LINKAGE void check_dataset(const Dataset& ds);

TESSERA_LINKAGE void normalize(Dataset& ds, const std::vector<float>& mean, const std::vector<float>& std);

TESSERA_LINKAGE Dataset subset(const Dataset& ds, std::int64_t begin, std::int64_t end);

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE void check_dataset(const Dataset& ds) {
  TESSERA_CHECK(ds.images.rank() == 4, ArgumentError, "Dataset '", ds.name,
                "': images must be (N, C, H, W), got shape ", ds.images.shape());
  TESSERA_CHECK(ds.images.dim(0) == ds.size(), ArgumentError, "Dataset '", ds.name, "': ", ds.images.dim(0),
                " images but ", ds.size(), " labels");
  TESSERA_CHECK(ds.num_classes > 0, ArgumentError, "Dataset '", ds.name, "': num_classes=", ds.num_classes,
                " must be positive");
  for (std::size_t i = 0; i < ds.labels.size(); ++i) {
    TESSERA_CHECK(ds.labels[i] >= 0 && ds.labels[i] < ds.num_classes, ArgumentError, "Dataset '", ds.name,
                  "': label ", ds.labels[i], " of sample ", i, " is outside [0, ", ds.num_classes, ")");
  }
}

TESSERA_LINKAGE void normalize(Dataset& ds, const std::vector<float>& mean, const std::vector<float>& std) {
  TESSERA_CHECK(ds.images.rank() == 4, ArgumentError, "normalize(", ds.name,
                "): images must be (N, C, H, W), got shape ", ds.images.shape());
  const std::int64_t n = ds.images.dim(0), c = ds.images.dim(1), hw = ds.images.dim(2) * ds.images.dim(3);
  TESSERA_CHECK(static_cast<std::int64_t>(mean.size()) == c && static_cast<std::int64_t>(std.size()) == c,
                ArgumentError, "normalize(", ds.name, "): need one mean and one std per channel (", c, "), got ",
                mean.size(), " and ", std.size());
  for (std::int64_t ch = 0; ch < c; ++ch) {
    TESSERA_CHECK(std[static_cast<std::size_t>(ch)] > 0.0f, ArgumentError, "normalize(", ds.name, "): std[", ch,
                  "]=", std[static_cast<std::size_t>(ch)], " must be positive");
  }
  float* x = ds.images.data();
#pragma omp parallel for schedule(static) if (n * c * hw > (1 << 16))
  for (std::int64_t plane = 0; plane < n * c; ++plane) {
    const auto ch = static_cast<std::size_t>(plane % c);
    const float m = mean[ch], s = std[ch];
    float* p = x + plane * hw;
    for (std::int64_t i = 0; i < hw; ++i) p[i] = (p[i] - m) / s;  // division, as torch does: same bits
  }
}

TESSERA_LINKAGE Dataset subset(const Dataset& ds, std::int64_t begin, std::int64_t end) {
  check_dataset(ds);
  TESSERA_CHECK(0 <= begin && begin <= end && end <= ds.size(), ArgumentError, "subset(", ds.name, ", ", begin,
                ", ", end, "): need 0 <= begin <= end <= ", ds.size());
  Dataset out;
  out.images.resize({end - begin, ds.channels(), ds.height(), ds.width()});
  const std::int64_t per = ds.sample_numel();
  std::copy(ds.images.data() + begin * per, ds.images.data() + end * per, out.images.data());
  out.labels.assign(ds.labels.begin() + begin, ds.labels.begin() + end);
  out.num_classes = ds.num_classes;
  out.name = detail::cat(ds.name, "[", begin, ":", end, "]");
  return out;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
