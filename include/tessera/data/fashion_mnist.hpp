// Fashion-MNIST (Xiao et al., 2017): 28x28 grey images of 10 clothing classes, 60000 for training
// and 10000 for testing, stored as four IDX files.
//
// load_fashion_mnist(split, dir, limit = 0) -> Dataset with images (N, 1, 28, 28) in [0, 1] (byte / 255, as
// torchvision's ToTensor) and labels in 0..9. The directory is, in order: the `dir` argument, the
// environment variable TESSERA_DATA_DIR, then FASHION_MNIST_DIR, then /usr/share/datasets/fashion-mnist.
// In it each file may be gzip-compressed (name.gz) or plain (name), directly or in a fashion-mnist/
// subdirectory. A missing file throws IoError listing every path tried and how to get the data.
// The same reader loads MNIST, whose files share the names and format (load_idx_dataset).
//
// kFashionMnistMean / kFashionMnistStd: the training set's pixel mean and standard deviation, for
// normalize(ds, {kFashionMnistMean}, {kFashionMnistStd}).
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/data/dataset.hpp"
#include "tessera/data/idx.hpp"

namespace tessera {

enum class Split { Train, Test };

inline constexpr float kFashionMnistMean = 0.2860f;
inline constexpr float kFashionMnistStd = 0.3530f;
inline constexpr std::int64_t kFashionMnistClasses = 10;
inline constexpr std::array<std::string_view, 10> kFashionMnistClassNames = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
inline constexpr std::string_view kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";

// Where the data is looked for, and which rule chose it (for error messages).
struct DataDir {
  std::string path;
  std::string source;  // "argument", "TESSERA_DATA_DIR", "FASHION_MNIST_DIR" or "default"
};

TESSERA_LINKAGE DataDir resolve_fashion_mnist_dir(const std::string& dir = "");

namespace detail {

TESSERA_LINKAGE std::string fashion_mnist_help();

// The first existing file among <dir>/<name>.gz, <dir>/<name>, and the same under fashion-mnist/.
TESSERA_LINKAGE std::string find_idx_file(const DataDir& dir, const std::string& name, std::string_view what);

}  // namespace detail

// Reads an (N, H, W) IDX image file and an (N) IDX label file into a Dataset with images
// (N, 1, H, W) = byte / 255 and the labels checked against num_classes. limit > 0 keeps the first
// `limit` samples and reads no further (read_idx's max_records); both files must still say the
// same N.
TESSERA_LINKAGE Dataset load_idx_dataset(const std::string& images_path, const std::string& labels_path,
                                std::int64_t num_classes, std::string name, std::int64_t limit = 0);

TESSERA_LINKAGE Dataset load_fashion_mnist(Split split, std::string dir = "", std::int64_t limit = 0);

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE DataDir resolve_fashion_mnist_dir(const std::string& dir) {
  if (!dir.empty()) return {dir, "argument"};
  for (const char* var : {"TESSERA_DATA_DIR", "FASHION_MNIST_DIR"}) {
    const char* value = std::getenv(var);
    if (value != nullptr && *value != '\0') return {value, var};
  }
  return {std::string(kFashionMnistDefaultDir), "default"};
}

TESSERA_LINKAGE auto detail::fashion_mnist_help() -> std::string {
  return "install it with `apt-get install dataset-fashion-mnist` or point TESSERA_DATA_DIR (or --data-dir) at a "
         "directory holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and "
         "t10k-labels-idx1-ubyte.gz (from https://github.com/zalandoresearch/fashion-mnist)";
}

TESSERA_LINKAGE auto detail::find_idx_file(const DataDir& dir, const std::string& name, std::string_view what) -> std::string {
  namespace fs = std::filesystem;
  std::vector<std::string> tried;
  for (const fs::path& base : {fs::path(dir.path), fs::path(dir.path) / "fashion-mnist"}) {
    for (const std::string& file : {name + ".gz", name}) {
      const fs::path candidate = base / file;
      std::error_code ec;
      if (fs::is_regular_file(candidate, ec)) return candidate.string();
      tried.push_back(candidate.string());
    }
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  std::error_code ec;
  const bool dir_exists = fs::is_directory(dir.path, ec);
  const std::string chosen_by = dir.source == "argument" ? "from the dir argument"
                                : dir.source == "default" ? "the default"
                                                          : "from " + dir.source;
  throw IoError(cat(what, ": cannot find ", name, "[.gz] in ", dir.path, " (", chosen_by,
                    dir_exists ? "" : "; the directory does not exist", "); tried ", list, ". To fix: ",
                    fashion_mnist_help()));
}

TESSERA_LINKAGE Dataset load_idx_dataset(const std::string& images_path, const std::string& labels_path,
                                std::int64_t num_classes, std::string name, std::int64_t limit) {
  TESSERA_CHECK(limit >= 0, ArgumentError, "load_idx_dataset(", images_path, "): limit is ", limit,
                "; it must be >= 0 (0 keeps every sample)");
  const IdxArray images = read_idx(images_path, limit);
  const IdxArray labels = read_idx(labels_path, limit);
  TESSERA_CHECK(images.dims.size() == 3, IoError, "load_idx_dataset: ", images_path,
                " should hold (N, H, W) images, but has rank ", images.dims.size());
  TESSERA_CHECK(labels.dims.size() == 1, IoError, "load_idx_dataset: ", labels_path,
                " should hold (N) labels, but has rank ", labels.dims.size());
  const std::int64_t n = images.dims[0], h = images.dims[1], w = images.dims[2];
  TESSERA_CHECK(labels.records_in_file == images.records_in_file, IoError, "load_idx_dataset: ", images_path,
                " holds ", images.records_in_file, " images but ", labels_path, " holds ", labels.records_in_file,
                " labels");

  Dataset ds;
  ds.name = std::move(name);
  ds.num_classes = num_classes;
  ds.labels.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t label = labels.data[static_cast<std::size_t>(i)];
    TESSERA_CHECK(label < num_classes, IoError, "load_idx_dataset: ", labels_path, ": label ", label, " of sample ",
                  i, " is outside [0, ", num_classes, ")");
    ds.labels[static_cast<std::size_t>(i)] = label;
  }
  ds.images.resize({n, 1, h, w});
  const std::int64_t total = n * h * w;
  const std::uint8_t* src = images.data.data();
  float* dst = ds.images.data();
#pragma omp parallel for schedule(static) if (total > (1 << 16))
  for (std::int64_t i = 0; i < total; ++i) dst[i] = static_cast<float>(src[i]) / 255.0f;
  return ds;
}

TESSERA_LINKAGE Dataset load_fashion_mnist(Split split, std::string dir, std::int64_t limit) {
  const DataDir where = resolve_fashion_mnist_dir(dir);
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::string what = detail::cat("load_fashion_mnist(", split == Split::Train ? "Train" : "Test", ")");
  const std::string images = detail::find_idx_file(where, prefix + "-images-idx3-ubyte", what);
  const std::string labels = detail::find_idx_file(where, prefix + "-labels-idx1-ubyte", what);
  Dataset ds = load_idx_dataset(images, labels, kFashionMnistClasses,
                                split == Split::Train ? "fashion-mnist/train" : "fashion-mnist/test", limit);
  TESSERA_CHECK(ds.height() == 28 && ds.width() == 28, IoError, what, ": ", images, " holds ", ds.height(), "x",
                ds.width(), " images; Fashion-MNIST images are 28x28");
  return ds;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
