// The image pipeline: decoding against PIL (tests/data/images.safetensors, made by
// tools/reference/gen_images.py), broken files, torchvision-equal crops and resizes, the random
// crop's parameters, ImageFolder (order, labels, index files, bad files, cache) and the DataLoader
// over it (sharding, determinism across worker counts and prefetch, retry after an error).
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <zlib.h>

#include "tessera/data/fashion_mnist.hpp"
#include "tessera/data/image.hpp"
#include "tessera/data/image_folder.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/transforms.hpp"
#include "tessera/io/safetensors.hpp"
#include "support/temp_dir.hpp"

namespace fs = std::filesystem;
using namespace tessera;
using tessera::testing::TempDir;

namespace {

const std::string kImages = std::string(TESSERA_REFERENCE_DATA_DIR) + "/images/";

const SafetensorsFile& images_reference() {
  static const SafetensorsFile file = SafetensorsFile::load(std::string(TESSERA_REFERENCE_DATA_DIR) + "/images.safetensors");
  return file;
}

// The reference's (H, W, C) bytes.
std::vector<std::uint8_t> reference_bytes(const std::string& name, std::vector<std::int64_t>* shape = nullptr) {
  const TensorInfo& info = images_reference().info(name);
  REQUIRE(info.dtype == DType::U8);
  const auto* p = reinterpret_cast<const std::uint8_t*>(images_reference().raw(name));
  if (shape) shape->assign(info.shape.begin(), info.shape.end());
  return {p, p + info.shape.numel()};
}

std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string error_of(const auto& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A small image with distinct pixels, for folders made by the tests.
Image pattern(std::int64_t h, std::int64_t w, std::int64_t c, int seed) {
  Image im;
  im.resize(h, w, c);
  for (std::size_t i = 0; i < im.pixels.size(); ++i) im.pixels[i] = static_cast<std::uint8_t>((i * 37 + seed * 101) % 251);
  return im;
}

// root/<class>/<k>.png|jpg: `per_class` images of 20x24 per class, alternately PNG and JPEG.
void make_folder(const fs::path& root, int classes, int per_class, std::int64_t channels = 3) {
  for (int c = 0; c < classes; ++c) {
    fs::create_directories(root / ("class_" + std::to_string(c)));
    for (int k = 0; k < per_class; ++k) {
      const Image im = pattern(20 + k % 3, 24 + c, channels, c * 100 + k);
      const bool jpeg = k % 2 == 1;
      const fs::path path = root / ("class_" + std::to_string(c)) / (std::to_string(k) + (jpeg ? ".jpg" : ".png"));
      write_file_bytes(path.string(), jpeg ? encode_jpeg(im, 90) : encode_png(im));
    }
  }
}

std::vector<float> drain(DataLoader<float>& loader, std::int64_t epoch, std::vector<std::int64_t>* labels = nullptr) {
  std::vector<float> all;
  loader.start_epoch(epoch);
  Batch<float> batch;
  while (loader.next(batch)) {
    all.insert(all.end(), batch.images.data(), batch.images.data() + batch.images.numel());
    if (labels) labels->insert(labels->end(), batch.labels.begin(), batch.labels.end());
  }
  return all;
}

}  // namespace

TEST_CASE("decode_image: every colour type gives PIL's convert(\"RGB\") and convert(\"L\") pixels exactly",
          "[data][image]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  int checked = 0;
  for (const std::string& name : images_reference().names()) {
    if (name.rfind("decode.", 0) != 0) continue;
    const std::string rest = name.substr(7);
    const std::string file = rest.substr(0, rest.rfind('.'));
    const bool grey = rest.substr(rest.rfind('.') + 1) == "l";
    std::vector<std::int64_t> shape;
    const auto want = reference_bytes(name, &shape);
    const Image got = read_image(kImages + file, grey ? 1 : 3);
    INFO(file << (grey ? " as grey" : " as RGB"));
    REQUIRE(got.height == shape[0]);
    REQUIRE(got.width == shape[1]);
    REQUIRE(got.channels == shape[2]);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < want.size(); ++i) differ += got.pixels[i] != want[i];
    CHECK(differ == 0);
    ++checked;
  }
  CHECK(checked >= 25);
}

TEST_CASE("decode_image: broken files give an IoError naming the file and the reason", "[data][image]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"broken_truncated.jpg", "truncated JPEG"}, {"broken_truncated.png", "truncated"},
      {"broken_empty.png", "empty file"},         {"broken_garbage.jpg", "unsupported image format"},
      {"broken_header.jpg", "JPEG"},              {"broken_crc.png", "corrupt or truncated PNG"},
      {"broken_bmp_named.png", "unsupported image format"}};
  for (const auto& [file, reason] : cases) {
    INFO(file);
    const std::string message = error_of([&file = file] { read_image(kImages + file, 3); });
    CHECK_THAT(message, Catch::Contains(kImages + file));
    CHECK_THAT(message, Catch::Contains(reason));
    CHECK_THROWS_AS(read_image(kImages + file, 3), IoError);
  }
  CHECK_THAT(error_of([&] { read_image(kImages + "no_such_file.png", 3); }), Catch::Contains("cannot open"));
  CHECK_THROWS_AS(read_image(kImages + "rgb.png", 2), ArgumentError);
}

namespace {
// A PNG of 57 bytes whose header declares width x height RGB pixels: signature, IHDR, an empty
// IDAT and IEND, each with its CRC (libpng checks them), and no pixel data.
std::vector<std::uint8_t> png_header_only(std::uint32_t width, std::uint32_t height) {
  std::vector<std::uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  auto be32 = [&](std::vector<std::uint8_t>& v, std::uint32_t x) {
    for (int shift = 24; shift >= 0; shift -= 8) v.push_back(static_cast<std::uint8_t>(x >> shift));
  };
  auto chunk = [&](const char* type, const std::vector<std::uint8_t>& data) {
    be32(out, static_cast<std::uint32_t>(data.size()));
    std::vector<std::uint8_t> body(type, type + 4);
    body.insert(body.end(), data.begin(), data.end());
    out.insert(out.end(), body.begin(), body.end());
    be32(out, static_cast<std::uint32_t>(crc32(0, body.data(), static_cast<uInt>(body.size()))));
  };
  std::vector<std::uint8_t> ihdr;
  be32(ihdr, width);
  be32(ihdr, height);
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, no filter method, no interlace
  chunk("IHDR", ihdr);
  chunk("IDAT", {});
  chunk("IEND", {});
  return out;
}
}  // namespace

// A 69-byte PNG once asked for 17 GB before a pixel was read, and failed with a bare
// std::bad_alloc that skip_corrupt did not skip. Headers past kMaxImagePixels are refused first.
TEST_CASE("decode_image: a header declaring a huge image is refused before any allocation, naming the file",
          "[data][image]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  const auto huge_png = png_header_only(65535, 65535);
  CHECK(huge_png.size() == 57u);
  const std::string png_error = error_of([&] { decode_image(huge_png, 3, "bomb.png"); });
  CHECK_THAT(png_error, Catch::StartsWith("bomb.png: PNG header declares 65535x65535 = 4294836225 pixels, more than "
                                          "the decoder's limit of 178956970"));
  CHECK_THROWS_AS(decode_image(huge_png, 3, "bomb.png"), IoError);
  // At the limit the header is fine; only the missing pixel data is wrong.
  CHECK_THAT(error_of([&] { decode_image(png_header_only(8, 8), 3, "small.png"); }),
             Catch::Contains("corrupt or truncated PNG"));

  // A JPEG whose start-of-frame claims 60000 x 60000 (libjpeg itself refuses past 65500): the
  // dimensions patched into a real file. Afterwards this thread's decoder must still work.
  Image small;
  small.resize(8, 8, 3);
  auto jpeg = encode_jpeg(small);
  const std::uint8_t sof_marker[] = {0xff, 0xc0};  // baseline start of frame: length, precision, height, width
  const auto sof = std::search(jpeg.begin(), jpeg.end(), std::begin(sof_marker), std::end(sof_marker));
  REQUIRE(sof != jpeg.end());
  for (int at : {5, 7}) {  // height, then width: 60000 = 0xea60, big-endian
    sof[at] = 0xea;
    sof[at + 1] = 0x60;
  }
  CHECK_THAT(error_of([&] { decode_image(jpeg, 3, "bomb.jpg"); }),
             Catch::StartsWith("bomb.jpg: JPEG header declares 60000x60000 = 3600000000 pixels") &&
                 Catch::Contains("limit"));
  // Past libjpeg's own limit: its error, and a decoder that still decodes the next file.
  std::fill(sof + 5, sof + 9, std::uint8_t{0xff});
  CHECK_THAT(error_of([&] { decode_image(jpeg, 3, "huge.jpg"); }), Catch::StartsWith("huge.jpg: corrupt JPEG header"));
  CHECK(decode_image(encode_jpeg(small), 3, "small.jpg").width == 8);

  // In a folder: an error naming the file, or skipped with skip_corrupt.
  TempDir dir;
  fs::create_directories(dir.path / "a");
  fs::create_directories(dir.path / "b");
  write_file_bytes((dir.path / "a" / "ok.png").string(), encode_png(small));
  { std::ofstream((dir.path / "b" / "bomb.png"), std::ios::binary).write(reinterpret_cast<const char*>(huge_png.data()), 57); }
  const ImageTransform t = ImageTransform::eval(0, 8);
  ImageFolder strict(dir.path.string(), {.transform = t});
  DataLoader<float> loader(strict, {.batch_size = 2, .shuffle = false});
  Batch<float> batch;
  CHECK_THAT(error_of([&] { loader.next(batch); }), Catch::Contains("bomb.png: PNG header declares"));
  ImageFolder lenient(dir.path.string(), {.transform = t, .skip_corrupt = true});
  DataLoader<float> skipping(lenient, {.batch_size = 2, .shuffle = false});
  CHECK(skipping.next(batch));
  CHECK(lenient.skipped_count() == 1);
}

TEST_CASE("encode_png round-trips exactly; encode_jpeg decodes close to its input", "[data][image]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  for (std::int64_t c : {1, 3}) {
    const Image im = pattern(13, 17, c, 3);
    const auto png = encode_png(im);
    CHECK(decode_image(png, c, "memory").pixels == im.pixels);
    Image smooth;
    smooth.resize(16, 16, c);
    for (std::size_t i = 0; i < smooth.pixels.size(); ++i) smooth.pixels[i] = static_cast<std::uint8_t>(100 + (i / c) % 16);
    const Image back = decode_image(encode_jpeg(smooth, 95), c, "memory");
    int worst = 0;
    for (std::size_t i = 0; i < smooth.pixels.size(); ++i)
      worst = std::max(worst, std::abs(int(back.pixels[i]) - int(smooth.pixels[i])));
    CHECK(worst <= 4);
  }
}

TEST_CASE("resized crops and evaluation resizes equal torchvision's (PIL bilinear) byte for byte", "[data][image]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  detail::ResampleScratch scratch;
  ImageTransform identity = ImageTransform::eval(0, 1);  // no normalization: floats are byte / 255
  const auto table = normalize_table(identity);
  int cases = 0;
  for (const auto& [key, value] : images_reference().metadata()) {
    const auto w = words(value);
    std::vector<std::int64_t> shape;
    if (key.rfind("crop.", 0) == 0) {
      const Image img = read_image(kImages + w[0], 3);
      const CropBox box{std::stoll(w[1]), std::stoll(w[2]), std::stoll(w[3]), std::stoll(w[4])};
      const std::int64_t oh = std::stoll(w[5]), ow = std::stoll(w[6]);
      const auto want = reference_bytes(key, &shape);
      std::vector<std::uint8_t> got(static_cast<std::size_t>(oh * ow * 3));
      resize_crop_window(img, box, oh, ow, 0, 0, oh, ow, got.data(), scratch);
      INFO(key << ": " << value);
      CHECK(got == want);
      // Any window of it is the same window of the full output.
      const std::int64_t wy = oh / 3, wx = ow / 4, wh = oh - oh / 3 - oh / 5, ww = ow - ow / 4;
      std::vector<std::uint8_t> part(static_cast<std::size_t>(wh * ww * 3));
      resize_crop_window(img, box, oh, ow, wy, wx, wh, ww, part.data(), scratch);
      bool same = true;
      for (std::int64_t y = 0; y < wh; ++y)
        for (std::int64_t x = 0; x < ww * 3; ++x)
          same = same && part[static_cast<std::size_t>(y * ww * 3 + x)] ==
                             want[static_cast<std::size_t>((wy + y) * ow * 3 + wx * 3 + x)];
      CHECK(same);
      ++cases;
    } else if (key.rfind("eval.", 0) == 0) {
      const Image img = read_image(kImages + w[0], 3);
      ImageTransform t = ImageTransform::eval(std::stoll(w[1]), std::stoll(w[2]));
      const auto want = reference_bytes(key, &shape);
      std::vector<float> got(static_cast<std::size_t>(3 * t.height * t.width));
      Rng rng(1);
      apply_transform(img, t, table, rng, got.data(), scratch);
      std::size_t differ = 0;
      for (std::int64_t y = 0; y < t.height; ++y)
        for (std::int64_t x = 0; x < t.width; ++x)
          for (std::int64_t c = 0; c < 3; ++c)
            differ += got[static_cast<std::size_t>((c * t.height + y) * t.width + x)] !=
                      static_cast<float>(want[static_cast<std::size_t>((y * t.width + x) * 3 + c)]) / 255.0f;
      INFO(key << ": " << value);
      CHECK(differ == 0);
      ++cases;
    } else if (key.rfind("tensor.", 0) == 0) {
      const Image img = read_image(kImages + w[0], 3);
      ImageTransform t = ImageTransform::train(1);
      t.normalize({std::stof(w[7]), std::stof(w[8]), std::stof(w[9])}, {std::stof(w[10]), std::stof(w[11]), std::stof(w[12])});
      const std::int64_t oh = std::stoll(w[5]), ow = std::stoll(w[6]);
      std::vector<float> got(static_cast<std::size_t>(3 * oh * ow));
      resized_crop_to_tensor(img, {std::stoll(w[1]), std::stoll(w[2]), std::stoll(w[3]), std::stoll(w[4])}, oh, ow,
                             /*flip=*/true, normalize_table(t), got.data(), scratch);
      const Tensor<float> want = images_reference().tensor<float>(key);
      REQUIRE(want.numel() == static_cast<std::int64_t>(got.size()));
      std::size_t differ = 0;
      for (std::size_t i = 0; i < got.size(); ++i) differ += got[i] != want.data()[i];  // bit-identical floats
      INFO(key << ": " << value);
      CHECK(differ == 0);
      ++cases;
    }
  }
  CHECK(cases == 11);
}

TEST_CASE("random_resized_crop_box: torchvision's get_params (area and ratio ranges, fallback)", "[data][image]") {
  Rng rng(5);
  int fallback_free = 0;
  for (int i = 0; i < 2000; ++i) {
    const CropBox b = random_resized_crop_box(375, 500, {0.08, 1.0}, {3.0 / 4.0, 4.0 / 3.0}, rng);
    REQUIRE(b.top >= 0);
    REQUIRE(b.left >= 0);
    REQUIRE(b.top + b.height <= 375);
    REQUIRE(b.left + b.width <= 500);
    const double area = static_cast<double>(b.height * b.width) / (375.0 * 500.0);
    const double ratio = static_cast<double>(b.width) / static_cast<double>(b.height);
    // Rounding w and h to integers moves area and ratio slightly outside the drawn values.
    if (area >= 0.07 && area <= 1.01 && ratio >= 0.70 && ratio <= 1.40) ++fallback_free;
  }
  CHECK(fallback_free == 2000);
  // No draw fits a 1 x 100 strip: the centre crop with the ratio clamped to 4/3 -> 1 x 1.
  CHECK(random_resized_crop_box(1, 100, {0.08, 1.0}, {3.0 / 4.0, 4.0 / 3.0}, rng) == CropBox{0, 49, 1, 1});
  CHECK(random_resized_crop_box(100, 1, {0.08, 1.0}, {3.0 / 4.0, 4.0 / 3.0}, rng) == CropBox{49, 0, 1, 1});
  // Scale (1, 1) and ratio (1, 1) on a square: always the whole image.
  CHECK(random_resized_crop_box(64, 64, {1.0, 1.0}, {1.0, 1.0}, rng) == CropBox{0, 0, 64, 64});
  CHECK(resize_shorter_size(375, 500, 256) == std::array<std::int64_t, 2>{256, 341});
  CHECK(resize_shorter_size(500, 375, 256) == std::array<std::int64_t, 2>{341, 256});
}

TEST_CASE("ImageFolder: classes sorted, torchvision's file order, labels, index files", "[data][image_folder]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  TempDir dir;
  make_folder(dir.path, 3, 4);
  fs::create_directories(dir.path / "class_1" / "nested");
  write_file_bytes((dir.path / "class_1" / "nested" / "a.PNG").string(), encode_png(pattern(20, 25, 3, 9)));
  write_file_bytes((dir.path / "class_0" / "notes.txt").string(), std::vector<std::uint8_t>{'h', 'i'});
  ImageFolder folder(dir.path.string(), {.transform = ImageTransform::eval(0, 20)});
  CHECK(folder.classes() == std::vector<std::string>{"class_0", "class_1", "class_2"});
  REQUIRE(folder.size() == 13);  // notes.txt ignored, nested/a.PNG included
  // os.walk sorted: a class's own files come before its subdirectories' (by directory path).
  CHECK(fs::path(folder.samples()[4].path).filename() == "0.png");
  CHECK(fs::path(folder.samples()[8].path).filename() == "a.PNG");
  CHECK(folder.samples()[8].label == 1);
  CHECK(folder.samples()[12].label == 2);
  CHECK(folder.num_classes() == 3);

  // The same samples from an index file, with and without a class column.
  const fs::path index = dir.path / "index.csv";
  {
    std::ofstream out(index);
    out << "path,class\n# a comment\nclass_2/0.png\nclass_0/1.jpg,zebra\n" << (dir.path / "class_1/2.png").string()
        << ",ant\n";
  }
  ImageFolder indexed(dir.path.string(), {.transform = ImageTransform::eval(0, 20), .index = index.string()});
  CHECK(indexed.classes() == std::vector<std::string>{"ant", "class_2", "zebra"});
  REQUIRE(indexed.size() == 3);
  CHECK(indexed.samples()[0].label == 1);
  CHECK(indexed.samples()[1].label == 2);
  CHECK(indexed.samples()[2].label == 0);
  {
    std::ofstream out(index);
    out << "class_2/missing.png\n";
  }
  CHECK_THAT(error_of([&] { ImageFolder(dir.path.string(), {.index = index.string()}); }),
             Catch::Contains("index.csv:1") && Catch::Contains("does not exist"));

  CHECK_THAT(error_of([&] { ImageFolder((dir.path / "nope").string(), {}); }), Catch::Contains("does not exist"));
  fs::create_directories(dir.path / "class_3");
  CHECK_THAT(error_of([&] { ImageFolder(dir.path.string(), {}); }),
             Catch::Contains("class_3") && Catch::Contains("no .jpg, .jpeg or .png"));
}

TEST_CASE("ImageFolder: PNG files give back the IDX bytes exactly (Fashion-MNIST converted)", "[data][image_folder]") {
  if (!kHavePng) { WARN("built without " << image_decoders()); return; }
  Dataset fm;
  try {
    fm = load_fashion_mnist(Split::Test);
  } catch (const IoError&) {
    { WARN("Fashion-MNIST is not installed"); return; }
  }
  TempDir dir;
  const int n = 60;
  for (int i = 0; i < n; ++i) {
    Image im;
    im.resize(28, 28, 1);
    for (int p = 0; p < 28 * 28; ++p)
      im.pixels[static_cast<std::size_t>(p)] = static_cast<std::uint8_t>(std::lround(fm.images.data()[i * 784 + p] * 255.0f));
    const fs::path cls = dir.path / std::to_string(fm.labels[static_cast<std::size_t>(i)]);
    fs::create_directories(cls);
    char name[16];
    std::snprintf(name, sizeof name, "%05d.png", i);
    write_file_bytes((cls / name).string(), encode_png(im));
  }
  ImageTransform t = ImageTransform::eval(28, 28);
  t.grey();
  ImageFolder folder(dir.path.string(), {.transform = t});
  REQUIRE(folder.size() == n);
  std::vector<float> image(784);
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t label = folder.read(k, 0, image.data());
    const int i = std::stoi(fs::path(folder.samples()[static_cast<std::size_t>(k)].path).stem().string());
    CHECK(label == fm.labels[static_cast<std::size_t>(i)]);
    CHECK(std::equal(image.begin(), image.end(), fm.images.data() + i * 784));  // byte / 255, as the IDX reader
  }
}

TEST_CASE("DataLoader over ImageFolder: same batches for any worker count, prefetch, cache; ranks are disjoint shards",
          "[data][image_folder]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  TempDir dir;
  make_folder(dir.path, 4, 9);
  ImageTransform t = ImageTransform::train(16, {0.3, 1.0});
  t.normalize({0.5f, 0.4f, 0.3f}, {0.2f, 0.25f, 0.3f});
  ImageFolder folder(dir.path.string(), {.transform = t, .seed = 11});
  ImageFolder cached(dir.path.string(), {.transform = t, .seed = 11, .cache = true});
  const LoaderOptions base{.batch_size = 5, .shuffle = true, .seed = 3};
  std::vector<std::int64_t> labels1;
  DataLoader<float> one(folder, base);
  const auto reference_epoch1 = drain(one, 1, &labels1);
  REQUIRE(reference_epoch1.size() == 36u * 3 * 16 * 16);
  for (int workers : {2, 3}) {
    LoaderOptions o = base;
    o.workers = workers;
    DataLoader<float> many(folder, o);
    std::vector<std::int64_t> labels;
    CHECK(drain(many, 1, &labels) == reference_epoch1);
    CHECK(labels == labels1);
  }
  LoaderOptions no_prefetch = base;
  no_prefetch.prefetch = false;
  DataLoader<float> direct(folder, no_prefetch);
  CHECK(drain(direct, 1) == reference_epoch1);
  DataLoader<float> with_cache(cached, base);
  CHECK(drain(with_cache, 0) != reference_epoch1);  // another epoch, other crops ...
  CHECK(drain(with_cache, 1) == reference_epoch1);  // ... and epoch 1 again, from the cache
  CHECK(cached.cache_bytes() > 0);

  // Two ranks: disjoint shards covering every sample, each sample's crop the single process's.
  std::vector<std::int64_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    LoaderOptions o = base;
    o.rank = rank;
    o.world_size = 2;
    o.batch_size = 3;
    DataLoader<float> shard(folder, o);
    shard.start_epoch(1);
    seen.insert(seen.end(), shard.epoch_indices().begin(), shard.epoch_indices().end());
    const auto images = drain(shard, 1);
    const std::size_t per = 3 * 16 * 16;
    std::vector<float> expected(per);
    for (std::size_t i = 0; i < shard.epoch_indices().size(); ++i) {
      folder.read(shard.epoch_indices()[i], 1, expected.data());
      CHECK(std::equal(expected.begin(), expected.end(), images.begin() + static_cast<std::ptrdiff_t>(i * per)));
    }
  }
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
  CHECK(seen.size() == 36u);
}

TEST_CASE("ImageFolder: a corrupt file is an error naming it, or skipped and counted with skip_corrupt",
          "[data][image_folder]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  TempDir dir;
  make_folder(dir.path, 2, 5);
  const fs::path bad = dir.path / "class_1" / "2.png";
  {
    std::ifstream in(kImages + "broken_truncated.png", std::ios::binary);
    std::ofstream out(bad, std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
  }
  const ImageTransform t = ImageTransform::eval(0, 8);
  ImageFolder strict(dir.path.string(), {.transform = t});
  for (int workers : {1, 2}) {
    DataLoader<float> loader(strict, {.batch_size = 4, .shuffle = false, .workers = workers});
    Batch<float> batch;
    REQUIRE(loader.next(batch));  // samples 0..3
    CHECK_THAT(error_of([&] { loader.next(batch); }), Catch::Contains(bad.string()) && Catch::Contains("truncated"));
    CHECK_THROWS_AS(loader.next(batch), IoError);  // retried, fails again, still in order
  }
  ImageFolder lenient(dir.path.string(), {.transform = t, .skip_corrupt = true});
  DataLoader<float> loader(lenient, {.batch_size = 4, .shuffle = false, .workers = 2});
  std::vector<std::int64_t> labels;
  const auto images = drain(loader, 0, &labels);
  CHECK(labels.size() == 10u);
  REQUIRE(lenient.skipped_count() == 1);
  CHECK(lenient.skipped()[0].path == bad.string());
  // Sample 7 (class_1/2.png) is replaced by sample 8, the next readable one.
  const std::size_t per = 3 * 8 * 8;
  CHECK(std::equal(images.begin() + 7 * per, images.begin() + 8 * per, images.begin() + 8 * per));

  // A format Tessera does not decode: refused at construction, or skipped.
  std::ifstream bmp_in(kImages + "broken_bmp_named.png", std::ios::binary);
  std::ofstream((dir.path / "class_0" / "x.bmp"), std::ios::binary) << bmp_in.rdbuf();
  CHECK_THAT(error_of([&] { ImageFolder(dir.path.string(), {.transform = t}); }),
             Catch::Contains("x.bmp") && Catch::Contains(".bmp image"));
  ImageFolder skipping(dir.path.string(), {.transform = t, .skip_corrupt = true});
  CHECK(skipping.size() == 10);
  CHECK(skipping.skipped_count() == 1);
}

// A link back to its own class directory once listed the same images dozens of times (until the
// path grew too long) under one class, and training went on to exit 0.
TEST_CASE("ImageFolder: a directory link that loops back is refused naming it, or skipped", "[data][image_folder]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  TempDir dir;
  make_folder(dir.path, 2, 3);
  fs::create_directories(dir.path / "class_1" / "sub");
  fs::create_directory_symlink("../../class_1", dir.path / "class_1" / "sub" / "loop");
  // A link to another directory (not an ancestor) is followed, as torchvision's os.walk does.
  fs::create_directory_symlink("../class_0", dir.path / "class_1" / "alias");
  const ImageTransform t = ImageTransform::eval(0, 8);
  const std::string loop = (dir.path / "class_1" / "sub" / "loop").string();
  CHECK_THAT(error_of([&] { ImageFolder(dir.path.string(), {.transform = t}); }),
             Catch::Contains(loop + " is a link to ../../class_1, which leads back to a directory on its own path"));
  ImageFolder skipping(dir.path.string(), {.transform = t, .skip_corrupt = true});
  CHECK(skipping.size() == 3 + 3 + 3);  // class_0, class_1 and class_1/alias (class_0's three again)
  REQUIRE(skipping.skipped_count() == 1);
  CHECK(skipping.skipped()[0].path == loop);
}

TEST_CASE("DataLoader over a SampleSource: an error is rethrown in order and retried, with several workers",
          "[data][loader]") {
  struct Flaky final : SampleSource {
    mutable std::atomic<int> failures{1};
    std::int64_t size() const override { return 40; }
    std::array<std::int64_t, 3> sample_shape() const override { return {1, 2, 2}; }
    std::int64_t num_classes() const override { return 4; }
    std::string name() const override { return "flaky"; }
    std::int64_t read(std::int64_t index, std::int64_t epoch, float* out) const override {
      if (index == 17 && failures.fetch_sub(1) > 0) throw IoError("sample 17 failed once");
      for (int i = 0; i < 4; ++i) out[i] = static_cast<float>(index * 10 + epoch + i);
      return index % 4;
    }
  } source;
  DataLoader<float> loader(source, {.batch_size = 4, .shuffle = false, .workers = 3});
  Batch<float> batch;
  std::vector<std::int64_t> got;
  bool thrown = false;
  while (true) {
    try {
      if (!loader.next(batch)) break;
    } catch (const IoError& e) {
      CHECK_THAT(e.what(), Catch::Contains("sample 17"));
      CHECK(got.size() == 16u);  // batches 0..3 came first, in order
      thrown = true;
      continue;
    }
    for (std::int64_t i = 0; i < batch.images.dim(0); ++i) got.push_back(static_cast<std::int64_t>(batch.images.data()[i * 4]) / 10);
  }
  CHECK(thrown);
  std::vector<std::int64_t> expected(40);
  std::iota(expected.begin(), expected.end(), 0);
  CHECK(got == expected);
}

TEST_CASE("ImageFolder: cache_file is built once, reused by a matching folder, rebuilt when a file changes",
          "[data][image_folder]") {
  if (!kHaveJpeg || !kHavePng) { WARN("built without " << image_decoders()); return; }
  TempDir dir;
  make_folder(dir.path / "images", 3, 5);
  const std::string cache = (dir.path / "decoded.cache").string();
  ImageTransform t = ImageTransform::train(12, {0.4, 1.0});
  t.normalize({0.5f, 0.5f, 0.5f}, {0.25f, 0.25f, 0.25f});
  const std::string root = (dir.path / "images").string();
  ImageFolder plain(root, {.transform = t, .seed = 4});
  DataLoader<float> plain_loader(plain, {.batch_size = 4, .shuffle = true, .seed = 9});
  const auto want = drain(plain_loader, 2);
  {
    ImageFolder first(root, {.transform = t, .seed = 4, .cache_file = cache});
    CHECK(first.cache_file_built());
    CHECK(fs::exists(cache));
    CHECK(first.cache_bytes() > 0);
    DataLoader<float> loader(first, {.batch_size = 4, .shuffle = true, .seed = 9, .workers = 2});
    CHECK(drain(loader, 2) == want);
  }
  {
    ImageFolder again(root, {.transform = t, .seed = 4, .cache_file = cache});
    CHECK_FALSE(again.cache_file_built());  // mapped, not rebuilt
    DataLoader<float> loader(again, {.batch_size = 4, .shuffle = true, .seed = 9});
    CHECK(drain(loader, 2) == want);
  }
  // A changed file (new contents, new modification time) invalidates the cache.
  const fs::path changed = dir.path / "images" / "class_2" / "3.jpg";
  fs::remove(changed);
  write_file_bytes(changed.string(), encode_png(pattern(22, 26, 3, 77)));  // a PNG with a .jpg name
  {
    ImageFolder rebuilt(root, {.transform = t, .seed = 4, .cache_file = cache});
    CHECK(rebuilt.cache_file_built());
  }
  // A damaged cache file is rebuilt, not trusted.
  { std::ofstream(cache, std::ios::binary | std::ios::trunc) << "garbage"; }
  {
    ImageFolder repaired(root, {.transform = t, .seed = 4, .cache_file = cache});
    CHECK(repaired.cache_file_built());
    std::vector<float> a(3 * 12 * 12), b(3 * 12 * 12);
    ImageFolder direct(root, {.transform = t, .seed = 4});
    for (std::int64_t k = 0; k < direct.size(); ++k) {
      repaired.read(k, 5, a.data());
      direct.read(k, 5, b.data());
      CHECK(a == b);
    }
  }
  // An unreadable file is recorded in the cache and named at read time, or skipped.
  fs::remove(changed);
  write_file_bytes(changed.string(), std::vector<std::uint8_t>{0xff, 0xd8, 0xff, 0x00});
  ImageFolder strict(root, {.transform = t, .seed = 4, .cache_file = cache});
  std::vector<float> out(3 * 12 * 12);
  CHECK_THAT(error_of([&] { strict.read(13, 0, out.data()); }),
             Catch::Contains(changed.string()) && Catch::Contains("cache file"));
  ImageFolder lenient(root, {.transform = t, .seed = 4, .skip_corrupt = true, .cache_file = cache});
  CHECK_FALSE(lenient.cache_file_built());
  CHECK(lenient.read(13, 0, out.data()) == 2);  // sample 14, the next one
  CHECK(lenient.skipped_count() == 1);
  CHECK_THROWS_AS(ImageFolder(root, {.cache = true, .cache_file = cache}), ArgumentError);
}
