// Example 11's self-check, --compare-idx, kept out of its main: the IDX files of Fashion-MNIST in
// the image folder's sample order (the converter names each file by its IDX index, so sample k of
// both is the same image), as an ImageArray with the same transforms; and what it prints about
// the folder (sizes, decoders, skipped files).
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"

namespace examples {

// The IDX training or test set in the folder's sample order: the converter named each file by its
// IDX index, so sample k of both is the same image.
inline tessera::Dataset idx_in_folder_order(const tessera::ImageFolder& folder, const tessera::Dataset& idx) {
  using namespace tessera;
  Dataset ordered;
  ordered.name = idx.name + " in " + folder.root() + "'s order";
  ordered.num_classes = idx.num_classes;
  const std::int64_t per = idx.sample_numel();
  ordered.images.resize({folder.size(), idx.channels(), idx.height(), idx.width()});
  for (std::int64_t k = 0; k < folder.size(); ++k) {
    const std::string& path = folder.samples()[static_cast<std::size_t>(k)].path;
    const std::string stem = std::filesystem::path(path).stem().string();
    std::int64_t i = -1;
    const auto [end, error] = std::from_chars(stem.data(), stem.data() + stem.size(), i);
    TESSERA_CHECK(error == std::errc() && end == stem.data() + stem.size() && i >= 0 && i < idx.size(), ArgumentError,
                  "--compare-idx: ", path, " is not named by an IDX sample index (as idx-to-image-folder names them)");
    TESSERA_CHECK(idx.labels[static_cast<std::size_t>(i)] == folder.samples()[static_cast<std::size_t>(k)].label,
                  ArgumentError, "--compare-idx: ", path, " is in class ", folder.samples()[static_cast<std::size_t>(k)].label,
                  " but IDX sample ", i, " has label ", idx.labels[static_cast<std::size_t>(i)]);
    std::copy_n(idx.images.data() + i * per, per, ordered.images.data() + k * per);
    ordered.labels.push_back(idx.labels[static_cast<std::size_t>(i)]);
  }
  return ordered;
}

// Fashion-MNIST from its IDX files in the folder's order, through the folder's transforms: the
// second training of --compare-idx. Read and matched at construction, so that a wrong --data-dir
// or folder fails in seconds, not after a whole training run.
struct IdxTwin {
  tessera::Dataset train_data, test_data;
  std::optional<tessera::ImageArray> train, test;
  IdxTwin(const tessera::ImageFolder& train_folder, const tessera::ImageFolder& test_folder,
          const tessera::ImageTransform& train_transform, const tessera::ImageTransform& test_transform,
          std::uint64_t seed, const std::string& data_dir, std::int64_t channels, std::int64_t size) {
    using namespace tessera;
    TESSERA_CHECK(channels == 1 && size == 28, ArgumentError,
                  "--compare-idx compares with Fashion-MNIST's 28x28 grey images: use --channels=1 --size=28");
    train_data = idx_in_folder_order(train_folder, load_fashion_mnist(Split::Train, data_dir));
    test_data = idx_in_folder_order(test_folder, load_fashion_mnist(Split::Test, data_dir));
    train.emplace(train_data, train_transform, seed);
    test.emplace(test_data, test_transform, 0);
  }
  IdxTwin(const IdxTwin&) = delete;  // the ImageArrays read the Datasets beside them
  IdxTwin& operator=(const IdxTwin&) = delete;
};

// "N training / M test images in K classes; decoders: ..."
inline std::string describe(const tessera::ImageFolder& train_set, const tessera::ImageFolder& test_set) {
  return std::to_string(train_set.size()) + " training / " + std::to_string(test_set.size()) + " test images in " +
         std::to_string(train_set.num_classes()) + " classes; decoders: " + tessera::image_decoders();
}

// The files --skip-corrupt skipped, if any, and the first of them.
inline void print_skipped(const tessera::ImageFolder& train_set, const tessera::ImageFolder& test_set) {
  if (!train_set.skipped_count() && !test_set.skipped_count()) return;
  std::printf("skipped %zu unreadable training and %zu test files (--skip-corrupt); the first: %s\n",
              train_set.skipped_count(), test_set.skipped_count(),
              (train_set.skipped_count() ? train_set.skipped() : test_set.skipped()).front().path.c_str());
}

}  // namespace examples
