// idx-to-image-folder: writes an IDX image set (Fashion-MNIST, MNIST, or any (N, H, W) / (N)
// file pair) out as an ImageFolder tree of PNG and/or JPEG files, for training from files
// (example 11_image_folder) and for the tests of the image pipeline.
//
//   idx-to-image-folder --out=DIR [--data-dir=DIR] [--format=png|jpeg|mixed] [--quality=90]
//                       [--limit=N] [--test-limit=N] [--rgb]
//       Fashion-MNIST: DIR/train/<class>/<sample>.<ext> and DIR/test/<class>/<sample>.<ext>
//   idx-to-image-folder --out=DIR --images=FILE --labels=FILE [--classes=10] [...]
//       one IDX pair: DIR/<class>/<sample>.<ext>
//
// Class directories are named "<label>_<name>" with the label zero-padded, so that sorting them
// by name (the ImageFolder convention) gives back the original labels; files are named by the
// sample's zero-padded index, so a class's files sort in the IDX order. --format=mixed writes
// even samples as PNG and odd ones as JPEG. --rgb writes 3-channel images (grey replicated), to
// exercise the RGB path. PNG is lossless: decoding it gives back the IDX bytes exactly.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

namespace {

namespace fs = std::filesystem;
using namespace tessera;

struct Settings {
  std::string format = "png";
  int quality = 90;
  bool rgb = false;
};

std::string class_dir_name(std::int64_t label, std::int64_t classes, const std::string& name) {
  const int width = static_cast<int>(std::to_string(std::max<std::int64_t>(classes - 1, 0)).size());
  std::string padded = std::to_string(label);
  padded.insert(0, static_cast<std::size_t>(std::max(0, width - static_cast<int>(padded.size()))), '0');
  std::string clean;
  for (char ch : name) clean += (std::isalnum(static_cast<unsigned char>(ch)) || ch == '-') ? ch : '_';
  return clean.empty() ? padded : padded + "_" + clean;
}

// Writes every sample of one IDX pair under `out`; returns the number written.
std::int64_t convert(const std::string& images_path, const std::string& labels_path, std::int64_t classes,
                     const std::vector<std::string>& names, std::int64_t limit, const fs::path& out,
                     const Settings& s) {
  // Only the first `limit` samples are read (and inflated), so a small folder is quick to make.
  const IdxArray images = read_idx(images_path, limit);
  const IdxArray labels = read_idx(labels_path, limit);
  TESSERA_CHECK(images.dims.size() == 3, IoError, images_path, ": expected (N, H, W) images, got rank ",
                images.dims.size());
  TESSERA_CHECK(labels.dims.size() == 1 && labels.records_in_file == images.records_in_file, IoError, labels_path,
                ": expected ", images.records_in_file, " labels, the file holds ", labels.records_in_file);
  const std::int64_t n = images.dims[0];
  const std::int64_t h = images.dims[1], w = images.dims[2];
  // File names are padded for the whole file's count, so a cut folder names samples as a full one.
  const int index_width = static_cast<int>(std::to_string(images.records_in_file - 1).size());
  for (std::int64_t c = 0; c < classes; ++c) {
    fs::create_directories(out / class_dir_name(c, classes, c < static_cast<std::int64_t>(names.size()) ? names[c] : ""));
  }
  Image image;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t label = labels.data[static_cast<std::size_t>(i)];
    TESSERA_CHECK(label < classes, IoError, labels_path, ": label ", label, " of sample ", i, " is >= --classes=",
                  classes);
    image.resize(h, w, s.rgb ? 3 : 1);
    const std::uint8_t* src = images.data.data() + i * h * w;
    for (std::int64_t p = 0; p < h * w; ++p) {
      for (std::int64_t ch = 0; ch < image.channels; ++ch) image.pixels[static_cast<std::size_t>(p * image.channels + ch)] = src[p];
    }
    const bool jpeg = s.format == "jpeg" || (s.format == "mixed" && i % 2 == 1);
    std::string file = std::to_string(i);
    file.insert(0, static_cast<std::size_t>(std::max(0, index_width - static_cast<int>(file.size()))), '0');
    const fs::path path = out / class_dir_name(label, classes, label < static_cast<std::int64_t>(names.size()) ? names[label] : "") /
                          (file + (jpeg ? ".jpg" : ".png"));
    const std::vector<std::uint8_t> bytes = jpeg ? encode_jpeg(image, s.quality) : encode_png(image);
    write_file_bytes(path.string(), bytes);
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const std::string out = flags.get("out", std::string(), "directory to write the image folder into (required)");
    const std::string data_dir =
        flags.get("data-dir", std::string(), "Fashion-MNIST directory (empty: the default locations)");
    const std::string images = flags.get("images", std::string(), "one IDX image file to convert instead (N, H, W)");
    const std::string labels = flags.get("labels", std::string(), "the IDX label file that goes with --images");
    const std::int64_t classes =
        flags.get("classes", std::int64_t{10}, {.min = 1}, "classes of the --images pair (labels 0 to classes - 1)");
    Settings s;
    s.format = flags.choice("format", "png", {"png", "jpeg", "mixed"}, "file format (mixed: even PNG, odd JPEG)");
    s.quality = flags.get("quality", 90, {.min = 1, .max = 100}, "JPEG quality");
    s.rgb = flags.get("rgb", false, "write 3-channel images (the grey replicated)");
    const std::int64_t limit = flags.get("limit", std::int64_t{0}, {.min = 0},
                                         "training (or --images) samples to write (0: all)");
    const std::int64_t test_limit =
        flags.get("test-limit", std::int64_t{0}, {.min = 0}, "test samples to write (0: all)");
    flags.finish();
    TESSERA_CHECK(!out.empty(), ArgumentError, "--out=DIR is required (where the image folder is written)");
    TESSERA_CHECK(images.empty() == labels.empty(), ArgumentError, "--images and --labels go together");
    if (s.format != "png") TESSERA_CHECK(kHaveJpeg, ArgumentError, "--format=", s.format, ": ", image_decoders());
    if (s.format != "jpeg") TESSERA_CHECK(kHavePng, ArgumentError, "--format=", s.format, ": ", image_decoders());

    if (!images.empty()) {
      const std::int64_t n = convert(images, labels, classes, {}, limit, out, s);
      std::printf("wrote %lld images to %s\n", static_cast<long long>(n), out.c_str());
      return 0;
    }
    const DataDir dir = resolve_fashion_mnist_dir(data_dir);
    std::vector<std::string> names(kFashionMnistClassNames.begin(), kFashionMnistClassNames.end());
    std::int64_t total = 0;
    for (const auto& [split, prefix, n] : {std::tuple{"train", "train", limit}, std::tuple{"test", "t10k", test_limit}}) {
      const std::string img = detail::find_idx_file(dir, std::string(prefix) + "-images-idx3-ubyte", "idx-to-image-folder");
      const std::string lab = detail::find_idx_file(dir, std::string(prefix) + "-labels-idx1-ubyte", "idx-to-image-folder");
      total += convert(img, lab, kFashionMnistClasses, names, n, fs::path(out) / split, s);
    }
    std::printf("wrote %lld Fashion-MNIST images (%s) to %s/{train,test}\n", static_cast<long long>(total),
                s.format.c_str(), out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idx-to-image-folder: error: %s\n", e.what());
    return 1;
  }
}
