// Data pipeline: IDX reader (good, malformed and fuzzed files), Fashion-MNIST loading and
// directory resolution, Dataset helpers, the DataLoader (order, resume, distributed split,
// prefetch equivalence, errors, allocation) and the synthetic dataset.
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "tessera/core/random.hpp"
#include "tessera/data/dataset.hpp"
#include "tessera/data/fashion_mnist.hpp"
#include "tessera/data/idx.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "support/scoped_env.hpp"
#include "support/temp_dir.hpp"

namespace fs = std::filesystem;
using namespace tessera;
using tessera::testing::TempDir;
using tessera::testing::ScopedEnv;

namespace {

using Bytes = std::vector<std::uint8_t>;

Bytes idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims, const Bytes& payload) {
  Bytes out = {0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(d >> shift));
  }
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Bytes counting_payload(std::size_t n) {
  Bytes p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::uint8_t>(i * 7 + 3);
  return p;
}

// Files are removed before being rewritten: truncating an existing file makes ext4 flush it to
// disk on close (auto_da_alloc), which turns the fuzz loop from milliseconds into seconds.
void write_plain(const std::string& path, const Bytes& bytes) {
  fs::remove(path);
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

void write_gzip(const std::string& path, const Bytes& bytes) {
  fs::remove(path);
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

Bytes read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The IoError message of read_idx(path); fails the test if it parses or throws anything else.
std::string idx_error(const std::string& path) {
  try {
    read_idx(path);
  } catch (const IoError& e) {
    return e.what();
  }
  FAIL("read_idx(" << path << ") should have thrown IoError");
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

#define CHECK_HAS(text, part)                            \
  do {                                                   \
    INFO("message: " << (text));                         \
    CHECK(contains((text), (part)));                     \
  } while (0)

// Sample i has every pixel equal to i + k / 1000 (k = pixel index) and label i % classes, so a
// batch tells exactly which samples it holds.
Dataset indexed_dataset(std::int64_t n, std::int64_t c = 1, std::int64_t h = 2, std::int64_t w = 3,
                        std::int64_t classes = 7) {
  Dataset ds;
  ds.name = "indexed";
  ds.num_classes = classes;
  ds.images.resize({n, c, h, w});
  const std::int64_t per = c * h * w;
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t k = 0; k < per; ++k) ds.images[i * per + k] = static_cast<float>(i) + static_cast<float>(k) / 1000.0f;
    ds.labels.push_back(i % classes);
  }
  return ds;
}

// Checks a batch against the dataset and returns the sample ids it holds, in order.
template <class S>
std::vector<std::int64_t> batch_samples(const Batch<S>& b, const Dataset& ds) {
  std::vector<std::int64_t> ids;
  const std::int64_t per = ds.sample_numel();
  REQUIRE(b.images.rank() == 4);
  REQUIRE(b.images.dim(0) == static_cast<std::int64_t>(b.labels.size()));
  for (std::int64_t i = 0; i < b.images.dim(0); ++i) {
    const auto id = static_cast<std::int64_t>(std::lround(b.images[i * per]));
    REQUIRE(id >= 0);
    REQUIRE(id < ds.size());
    for (std::int64_t k = 0; k < per; ++k) REQUIRE(b.images[i * per + k] == static_cast<S>(ds.images[id * per + k]));
    REQUIRE(b.labels[static_cast<std::size_t>(i)] == ds.labels[static_cast<std::size_t>(id)]);
    ids.push_back(id);
  }
  return ids;
}

// The epoch's sample ids in order, and the batch sizes.
template <class S>
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> run_epoch(DataLoader<S>& loader, const Dataset& ds,
                                                                          std::int64_t epoch) {
  loader.start_epoch(epoch);
  std::vector<std::int64_t> ids, sizes;
  Batch<S> b;
  std::int64_t expected_index = 0;
  while (loader.next(b)) {
    REQUIRE(b.index == expected_index++);
    const auto got = batch_samples(b, ds);
    ids.insert(ids.end(), got.begin(), got.end());
    sizes.push_back(static_cast<std::int64_t>(got.size()));
  }
  REQUIRE(expected_index == loader.batches_per_epoch());
  REQUIRE_FALSE(loader.next(b));  // stays exhausted
  return {ids, sizes};
}

const char* kRealDir = "/usr/share/datasets/fashion-mnist";

bool real_dataset_present() {
  if (fs::exists(fs::path(kRealDir) / "train-images-idx3-ubyte.gz")) return true;
  WARN("SKIP: " << kRealDir << " is missing (apt-get install dataset-fashion-mnist); real-data checks skipped");
  return false;
}

}  // namespace

TEST_CASE("read_idx parses plain and gzip IDX files of rank 1 to 4", "[data][idx]") {
  TempDir dir;
  const std::vector<std::vector<std::uint32_t>> shapes = {{5}, {2, 3, 4}, {1, 2, 2, 3}, {3, 7}, {0, 28, 28}};
  for (const auto& dims : shapes) {
    std::size_t n = 1;
    for (auto d : dims) n *= d;
    const Bytes payload = counting_payload(n);
    const Bytes file = idx_bytes(0x08, dims, payload);
    for (const bool gz : {false, true}) {
      const std::string path = dir / (std::string("good") + (gz ? ".gz" : ""));
      gz ? write_gzip(path, file) : write_plain(path, file);
      const IdxArray a = read_idx(path);
      REQUIRE(a.dims.size() == dims.size());
      for (std::size_t i = 0; i < dims.size(); ++i) CHECK(a.dims[i] == static_cast<std::int64_t>(dims[i]));
      CHECK(a.data == payload);
    }
  }

  SECTION("a multi-megabyte gzip payload (several input chunks, buffer growth)") {
    Bytes payload(1'500'017);
    Rng rng(5);
    for (auto& b : payload) b = static_cast<std::uint8_t>(rng.below(7));  // compressible but not trivially
    write_gzip(dir / "big.gz", idx_bytes(0x08, {1'500'017}, payload));
    const IdxArray a = read_idx(dir / "big.gz");
    CHECK(a.dims == std::vector<std::int64_t>{1'500'017});
    CHECK(a.data == payload);
  }

  SECTION("concatenated gzip members form one stream, as gzip(1) reads them") {
    const Bytes file = idx_bytes(0x08, {4, 4}, counting_payload(16));
    write_gzip(dir / "a.gz", Bytes(file.begin(), file.begin() + 9));
    write_gzip(dir / "b.gz", Bytes(file.begin() + 9, file.end()));
    Bytes joined = read_bytes(dir / "a.gz");
    const Bytes second = read_bytes(dir / "b.gz");
    joined.insert(joined.end(), second.begin(), second.end());
    write_plain(dir / "joined.gz", joined);
    const IdxArray a = read_idx(dir / "joined.gz");
    CHECK(a.dims == std::vector<std::int64_t>{4, 4});
    CHECK(a.data == counting_payload(16));
  }
}

TEST_CASE("read_idx with max_records keeps the first records and reads no further", "[data][idx]") {
  TempDir dir;
  const Bytes payload = counting_payload(5 * 3 * 2);
  const Bytes file = idx_bytes(0x08, {5, 3, 2}, payload);
  for (const bool gz : {false, true}) {
    const std::string path = dir / (std::string("cut") + (gz ? ".gz" : ""));
    gz ? write_gzip(path, file) : write_plain(path, file);
    const IdxArray a = read_idx(path, 2);
    CHECK(a.dims == std::vector<std::int64_t>{2, 3, 2});
    CHECK(a.records_in_file == 5);
    CHECK(a.data == Bytes(payload.begin(), payload.begin() + 12));
    // Asking for as many or more than the file has reads it whole, with every check.
    for (const std::int64_t max : {0, 5, 9}) {
      const IdxArray whole = read_idx(path, max);
      CHECK(whole.dims == std::vector<std::int64_t>{5, 3, 2});
      CHECK(whole.data == payload);
    }
    CHECK_THROWS_AS(read_idx(path, -1), ArgumentError);
  }
  // A gzip file cut inside the kept records is still truncated; cut after them, the kept records
  // read (the rest is not inflated); a plain file's size is checked either way.
  const Bytes gz_whole = [&] {
    write_gzip(dir / "w.gz", idx_bytes(0x08, {4000}, counting_payload(4000)));
    return read_bytes(dir / "w.gz");
  }();
  write_plain(dir / "short.gz", Bytes(gz_whole.begin(), gz_whole.begin() + static_cast<std::ptrdiff_t>(gz_whole.size() / 2)));
  CHECK_THROWS_AS(read_idx(dir / "short.gz", 3999), IoError);
  CHECK(read_idx(dir / "short.gz", 10).data == counting_payload(10));
  write_plain(dir / "short", Bytes(file.begin(), file.end() - 1));
  CHECK_HAS(idx_error(dir / "short"), "truncated payload");
  CHECK_THROWS_AS(read_idx(dir / "short", 1), IoError);
}

TEST_CASE("read_idx rejects malformed files with a message naming the problem", "[data][idx]") {
  TempDir dir;
  const Bytes good = idx_bytes(0x08, {4, 4}, counting_payload(16));

  SECTION("missing file, directory, empty file") {
    const std::string missing = dir / "nope.gz";
    std::string m = idx_error(missing);
    CHECK_HAS(m, "file not found");
    CHECK_HAS(m, missing);
    m = idx_error(dir.path.string());
    CHECK_HAS(m, "is a directory");
    write_plain(dir / "empty", {});
    CHECK_HAS(idx_error(dir / "empty"), "too short");
    write_gzip(dir / "empty.gz", {});
    CHECK_HAS(idx_error(dir / "empty.gz"), "too short");
  }

  SECTION("wrong magic") {
    Bytes bad = good;
    bad[0] = 0x01;
    for (const bool gz : {false, true}) {
      const std::string path = dir / (gz ? "magic.gz" : "magic");
      gz ? write_gzip(path, bad) : write_plain(path, bad);
      const std::string m = idx_error(path);
      CHECK_HAS(m, "bad magic 0x01 0x00");
      CHECK_HAS(m, path);
    }
    write_plain(dir / "text", Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
    CHECK_HAS(idx_error(dir / "text"), "not an IDX file");
  }

  SECTION("unsupported and invalid element types") {
    write_plain(dir / "float", idx_bytes(0x0D, {4}, Bytes(16)));
    std::string m = idx_error(dir / "float");
    CHECK_HAS(m, "unsupported element type 0x0d (float32)");
    CHECK_HAS(m, "only 0x08 (unsigned byte)");
    write_gzip(dir / "int32.gz", idx_bytes(0x0C, {4}, Bytes(16)));
    CHECK_HAS(idx_error(dir / "int32.gz"), "unsupported element type 0x0c (int32)");
    write_plain(dir / "invalid", idx_bytes(0x07, {4}, Bytes(4)));
    CHECK_HAS(idx_error(dir / "invalid"), "invalid element type code 0x07");
  }

  SECTION("rank outside 1..4") {
    write_plain(dir / "rank0", Bytes{0, 0, 8, 0});
    CHECK_HAS(idx_error(dir / "rank0"), "rank 0 is outside 1..4");
    write_gzip(dir / "rank0.gz", Bytes{0, 0, 8, 0, 1, 2, 3});
    CHECK_HAS(idx_error(dir / "rank0.gz"), "rank 0 is outside 1..4");
    write_plain(dir / "rank5", idx_bytes(0x08, {1, 1, 1, 1, 1}, Bytes{7}));
    CHECK_HAS(idx_error(dir / "rank5"), "rank 5 is outside 1..4");
  }

  SECTION("truncated header") {
    write_plain(dir / "header", Bytes{0, 0, 8, 3, 0, 0, 0, 2, 0});
    const std::string m = idx_error(dir / "header");
    CHECK_HAS(m, "truncated header: expected 12 bytes");
    CHECK_HAS(m, "got 5");
  }

  SECTION("truncated payload: expected vs got bytes and the path") {
    const Bytes short_file(good.begin(), good.end() - 6);  // 10 of 16 payload bytes
    for (const bool gz : {false, true}) {
      const std::string path = dir / (gz ? "short.gz" : "short");
      gz ? write_gzip(path, short_file) : write_plain(path, short_file);
      const std::string m = idx_error(path);
      CHECK_HAS(m, "truncated payload");
      CHECK_HAS(m, "(4, 4) need 16 bytes");
      CHECK_HAS(m, "holds only 10");
      CHECK_HAS(m, path);
    }
  }

  SECTION("extents larger than any file are caught before allocating") {
    const Bytes huge = idx_bytes(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, Bytes(100, 1));
    write_plain(dir / "huge", huge);
    CHECK_HAS(idx_error(dir / "huge"), "impossibly large");
    const Bytes big = idx_bytes(0x08, {60000, 28, 28}, Bytes(100, 1));
    write_plain(dir / "big", big);
    CHECK_HAS(idx_error(dir / "big"), "need 47040000 bytes");
    write_gzip(dir / "big.gz", big);
    CHECK_HAS(idx_error(dir / "big.gz"), "holds only 100");
  }

  SECTION("trailing bytes after the payload") {
    Bytes longer = good;
    longer.insert(longer.end(), {9, 9, 9});
    write_plain(dir / "long", longer);
    CHECK_HAS(idx_error(dir / "long"), "3 trailing bytes after the 16-byte payload");
    write_gzip(dir / "long.gz", longer);
    CHECK_HAS(idx_error(dir / "long.gz"), "trailing bytes after the 16-byte payload");
    // Garbage after a complete gzip stream (not another gzip member).
    write_gzip(dir / "ok.gz", good);
    Bytes garbage = read_bytes(dir / "ok.gz");
    garbage.insert(garbage.end(), {'j', 'u', 'n', 'k'});
    write_plain(dir / "garbage.gz", garbage);
    CHECK_HAS(idx_error(dir / "garbage.gz"), "trailing bytes after the end of the gzip stream");
  }

  SECTION("truncated gzip: in the deflate data and in the trailer") {
    Bytes payload(4096);
    Rng rng(1);
    for (auto& b : payload) b = static_cast<std::uint8_t>(rng.next_u64());
    write_gzip(dir / "full.gz", idx_bytes(0x08, {64, 64}, payload));
    const Bytes full = read_bytes(dir / "full.gz");
    write_plain(dir / "half.gz", Bytes(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(full.size() / 2)));
    std::string m = idx_error(dir / "half.gz");
    CHECK_HAS(m, "gzip stream ends early");
    CHECK_HAS(m, "truncated");
    write_plain(dir / "notrailer.gz", Bytes(full.begin(), full.end() - 4));
    m = idx_error(dir / "notrailer.gz");
    CHECK_HAS(m, "gzip stream ends early after 4108 decompressed bytes");
  }

  SECTION("corrupt gzip: zlib's own message") {
    write_gzip(dir / "ok.gz", good);
    const Bytes ok = read_bytes(dir / "ok.gz");
    Bytes bad_crc = ok;
    bad_crc[bad_crc.size() - 8] ^= 0xFF;  // first byte of the CRC-32 trailer
    write_plain(dir / "crc.gz", bad_crc);
    std::string m = idx_error(dir / "crc.gz");
    CHECK_HAS(m, "corrupt gzip data (zlib: incorrect data check)");
    Bytes bad_block = ok;
    bad_block[10] |= 0x06;  // first deflate block header: BTYPE = 3 is reserved
    write_plain(dir / "block.gz", bad_block);
    m = idx_error(dir / "block.gz");
    CHECK_HAS(m, "zlib: invalid block type");
    CHECK_HAS(m, dir / "block.gz");
  }
}

TEST_CASE("read_idx never crashes on mutated files: it parses them or throws IoError", "[data][idx]") {
  TempDir dir;
  Rng rng(2024);
  const Bytes base = idx_bytes(0x08, {3, 5, 4}, counting_payload(60));
  write_gzip(dir / "base.gz", base);
  const Bytes base_gz = read_bytes(dir / "base.gz");
  int parsed = 0, rejected = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    const bool gz = trial % 2 == 1;
    Bytes bytes = gz ? base_gz : base;
    switch (rng.below(4)) {
      case 0:  // flip a few bytes
        for (std::uint64_t k = 0, flips = 1 + rng.below(4); k < flips; ++k) {
          bytes[rng.below(bytes.size())] ^= static_cast<std::uint8_t>(1 + rng.below(255));
        }
        break;
      case 1:  // truncate
        bytes.resize(rng.below(bytes.size()));
        break;
      case 2:  // append random bytes
        for (std::uint64_t k = 0, extra = 1 + rng.below(20); k < extra; ++k) {
          bytes.push_back(static_cast<std::uint8_t>(rng.next_u64()));
        }
        break;
      default:  // random header bytes over a good payload
        for (std::size_t k = 0; k < 8 && k < bytes.size(); ++k) {
          if (rng.below(3) == 0) bytes[k] = static_cast<std::uint8_t>(rng.next_u64());
        }
    }
    const std::string path = dir / "fuzz";
    write_plain(path, bytes);
    try {
      const IdxArray a = read_idx(path);
      std::int64_t n = 1;
      for (auto d : a.dims) n *= d;
      REQUIRE(a.numel() == n);
      REQUIRE(a.dims.size() >= 1);
      REQUIRE(a.dims.size() <= 4);
      ++parsed;
    } catch (const IoError&) {
      ++rejected;
    }
  }
  INFO("parsed " << parsed << ", rejected " << rejected);
  CHECK(rejected > 900);  // the mutations mostly break the file, and each of those must be an IoError
}

TEST_CASE("Fashion-MNIST: the real training and test sets", "[data][fashion_mnist]") {
  if (!real_dataset_present()) return;
  const IdxArray raw_labels = read_idx(std::string(kRealDir) + "/train-labels-idx1-ubyte.gz");
  CHECK(raw_labels.dims == std::vector<std::int64_t>{60000});

  struct Expect {
    Split split;
    std::int64_t n, first_image_byte_sum, all_bytes_sum;
  };
  // Byte sums computed independently with Python's gzip + numpy.
  for (const Expect e : {Expect{Split::Train, 60000, 76247, 3431114169LL}, Expect{Split::Test, 10000, 33456, 573469082LL}}) {
    const Dataset ds = load_fashion_mnist(e.split, kRealDir);
    REQUIRE(ds.images.shape() == Shape{e.n, 1, 28, 28});
    REQUIRE(ds.size() == e.n);
    CHECK(ds.num_classes == 10);
    CHECK(ds.labels[0] == 9);  // ankle boot, in both splits
    CHECK(kFashionMnistClassNames[static_cast<std::size_t>(ds.labels[0])] == "Ankle boot");
    std::map<std::int64_t, std::int64_t> per_class;
    for (auto l : ds.labels) per_class[l]++;
    REQUIRE(per_class.size() == 10);
    for (const auto& [label, count] : per_class) {
      CHECK(label >= 0);
      CHECK(label < 10);
      CHECK(count == e.n / 10);  // Fashion-MNIST is balanced
    }
    std::int64_t first = 0, all = 0, not_byte_over_255 = 0;
    double sum = 0, sum_sq = 0;
    float lo = 1, hi = 0;
    for (std::int64_t i = 0; i < ds.images.numel(); ++i) {
      const float x = ds.images[i];
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      const auto byte = std::lround(x * 255.0f);
      not_byte_over_255 += x != static_cast<float>(byte) / 255.0f;  // exactly byte / 255, like ToTensor
      all += byte;
      if (i < 784) first += byte;
      sum += x;
      sum_sq += static_cast<double>(x) * x;
    }
    CHECK(not_byte_over_255 == 0);
    CHECK(lo == 0.0f);
    CHECK(hi == 1.0f);
    CHECK(first == e.first_image_byte_sum);
    CHECK(all == e.all_bytes_sum);
    if (e.split == Split::Train) {
      const double mean = sum / static_cast<double>(ds.images.numel());
      const double stddev = std::sqrt(sum_sq / static_cast<double>(ds.images.numel()) - mean * mean);
      CHECK(mean == Approx(kFashionMnistMean).margin(1e-4));
      CHECK(stddev == Approx(kFashionMnistStd).margin(1e-4));
      // A limit keeps the first samples exactly as the whole load has them.
      const Dataset first_100 = load_fashion_mnist(e.split, kRealDir, 100);
      REQUIRE(first_100.images.shape() == Shape{100, 1, 28, 28});
      CHECK(std::equal(first_100.labels.begin(), first_100.labels.end(), ds.labels.begin()));
      CHECK(std::equal(first_100.images.data(), first_100.images.data() + first_100.images.numel(), ds.images.data()));
    }
  }
}

TEST_CASE("Fashion-MNIST: directory resolution, missing files and inconsistent files", "[data][fashion_mnist]") {
  const std::string missing = "/nonexistent/tessera-no-such-dir";
  SECTION("a missing directory names the paths tried and how to get the data") {
    try {
      load_fashion_mnist(Split::Train, missing);
      FAIL("expected IoError");
    } catch (const IoError& e) {
      const std::string m = e.what();
      CHECK_HAS(m, missing + "/train-images-idx3-ubyte.gz");
      CHECK_HAS(m, missing + "/fashion-mnist/train-images-idx3-ubyte");
      CHECK_HAS(m, "the directory does not exist");
      CHECK_HAS(m, "apt-get install dataset-fashion-mnist");
      CHECK_HAS(m, "TESSERA_DATA_DIR (or --data-dir)");
      CHECK_HAS(m, "(from the dir argument;");
    }
    ScopedEnv env("TESSERA_DATA_DIR", missing.c_str());
    try {
      load_fashion_mnist(Split::Test);
      FAIL("expected IoError");
    } catch (const IoError& e) {
      CHECK_HAS(std::string(e.what()), missing + "/t10k-images-idx3-ubyte.gz");
      CHECK_HAS(std::string(e.what()), "(from TESSERA_DATA_DIR;");
    }
  }

  // A tiny fake Fashion-MNIST: 5 training images, images gzip-compressed, labels plain.
  TempDir dir;
  Bytes pixels(5 * 28 * 28);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<std::uint8_t>(i % 256);
  write_gzip(dir / "train-images-idx3-ubyte.gz", idx_bytes(0x08, {5, 28, 28}, pixels));
  write_plain(dir / "train-labels-idx1-ubyte", idx_bytes(0x08, {5}, Bytes{3, 1, 4, 1, 5}));
  const auto check_fake = [&](const Dataset& ds) {
    REQUIRE(ds.images.shape() == Shape{5, 1, 28, 28});
    CHECK(ds.labels == std::vector<std::int64_t>{3, 1, 4, 1, 5});
    for (std::size_t i = 0; i < pixels.size(); ++i) {
      REQUIRE(ds.images[static_cast<std::int64_t>(i)] == static_cast<float>(pixels[i]) / 255.0f);
    }
    CHECK(ds.name == "fashion-mnist/train");
  };

  SECTION("explicit directory, then TESSERA_DATA_DIR, then FASHION_MNIST_DIR") {
    check_fake(load_fashion_mnist(Split::Train, dir.path.string()));
    {
      ScopedEnv a("TESSERA_DATA_DIR", dir.path.string().c_str());
      ScopedEnv b("FASHION_MNIST_DIR", missing.c_str());
      CHECK(resolve_fashion_mnist_dir().source == "TESSERA_DATA_DIR");
      check_fake(load_fashion_mnist(Split::Train));
      CHECK(resolve_fashion_mnist_dir("/x").path == "/x");  // the argument wins over the environment
    }
    {
      ScopedEnv a("TESSERA_DATA_DIR", nullptr);
      ScopedEnv b("FASHION_MNIST_DIR", dir.path.string().c_str());
      check_fake(load_fashion_mnist(Split::Train));
    }
    {
      ScopedEnv a("TESSERA_DATA_DIR", "");
      ScopedEnv b("FASHION_MNIST_DIR", nullptr);
      CHECK(resolve_fashion_mnist_dir().path == std::string(kFashionMnistDefaultDir));
      CHECK(resolve_fashion_mnist_dir().source == "default");
    }
  }

  SECTION("files in a fashion-mnist/ subdirectory are found") {
    TempDir parent;
    fs::create_directories(parent.path / "fashion-mnist");
    fs::copy(dir.path / "train-images-idx3-ubyte.gz", parent.path / "fashion-mnist");
    fs::copy(dir.path / "train-labels-idx1-ubyte", parent.path / "fashion-mnist");
    check_fake(load_fashion_mnist(Split::Train, parent.path.string()));
  }

  SECTION("a missing label file, count mismatch, bad labels, wrong image size") {
    fs::remove(dir.path / "train-labels-idx1-ubyte");
    try {
      load_fashion_mnist(Split::Train, dir.path.string());
      FAIL("expected IoError");
    } catch (const IoError& e) {
      const std::string m = e.what();
      CHECK_HAS(m, "cannot find train-labels-idx1-ubyte[.gz]");
      CHECK_HAS(m, dir / "train-labels-idx1-ubyte.gz");
      CHECK_FALSE(contains(m, "does not exist"));
    }
    write_gzip(dir / "train-labels-idx1-ubyte.gz", idx_bytes(0x08, {4}, Bytes{1, 2, 3, 4}));
    try {
      load_fashion_mnist(Split::Train, dir.path.string());
      FAIL("expected IoError");
    } catch (const IoError& e) {
      CHECK_HAS(std::string(e.what()), "holds 5 images but");
      CHECK_HAS(std::string(e.what()), "holds 4 labels");
    }
    write_gzip(dir / "train-labels-idx1-ubyte.gz", idx_bytes(0x08, {5}, Bytes{1, 2, 10, 4, 5}));
    try {
      load_fashion_mnist(Split::Train, dir.path.string());
      FAIL("expected IoError");
    } catch (const IoError& e) {
      CHECK_HAS(std::string(e.what()), "label 10 of sample 2 is outside [0, 10)");
    }
    write_gzip(dir / "train-labels-idx1-ubyte.gz", idx_bytes(0x08, {2}, Bytes{1, 2}));
    write_gzip(dir / "train-images-idx3-ubyte.gz", idx_bytes(0x08, {2, 27, 28}, Bytes(2 * 27 * 28)));
    try {
      load_fashion_mnist(Split::Train, dir.path.string());
      FAIL("expected IoError");
    } catch (const IoError& e) {
      CHECK_HAS(std::string(e.what()), "27x28 images; Fashion-MNIST images are 28x28");
    }
  }
}

TEST_CASE("Dataset: per-channel normalization, subset, invariants", "[data]") {
  Dataset ds = indexed_dataset(4, 3, 2, 2, 5);
  const Dataset before = ds;
  const std::vector<float> mean = {0.5f, 1.0f, -2.0f}, stddev = {2.0f, 0.25f, 3.0f};
  normalize(ds, mean, stddev);
  for (std::int64_t n = 0; n < 4; ++n) {
    for (std::int64_t c = 0; c < 3; ++c) {
      for (std::int64_t h = 0; h < 2; ++h) {
        for (std::int64_t w = 0; w < 2; ++w) {
          const float expected = (before.images.at(n, c, h, w) - mean[static_cast<std::size_t>(c)]) /
                                 stddev[static_cast<std::size_t>(c)];
          REQUIRE(ds.images.at(n, c, h, w) == expected);
        }
      }
    }
  }
  CHECK(ds.labels == before.labels);
  CHECK_THROWS_AS(normalize(ds, {0.5f}, {1.0f}), ArgumentError);
  CHECK_THROWS_AS(normalize(ds, {0.f, 0.f, 0.f}, {1.f, 0.f, 1.f}), ArgumentError);

  SECTION("Fashion-MNIST constants standardize the real training set") {
    if (!real_dataset_present()) return;
    Dataset train = load_fashion_mnist(Split::Train, kRealDir);
    normalize(train, {kFashionMnistMean}, {kFashionMnistStd});
    double sum = 0, sum_sq = 0;
    for (float x : train.images.span()) {
      sum += x;
      sum_sq += static_cast<double>(x) * x;
    }
    const double m = sum / static_cast<double>(train.images.numel());
    CHECK(std::abs(m) < 1e-3);
    CHECK(std::sqrt(sum_sq / static_cast<double>(train.images.numel()) - m * m) == Approx(1.0).margin(1e-3));
  }

  SECTION("subset") {
    const Dataset part = subset(before, 1, 3);
    REQUIRE(part.images.shape() == Shape{2, 3, 2, 2});
    CHECK(part.labels == std::vector<std::int64_t>{1, 2});
    CHECK(part.num_classes == 5);
    for (std::int64_t i = 0; i < part.images.numel(); ++i) CHECK(part.images[i] == before.images[12 + i]);
    CHECK(subset(before, 2, 2).size() == 0);
    CHECK_THROWS_AS(subset(before, 3, 5), ArgumentError);
    CHECK_THROWS_AS(subset(before, -1, 2), ArgumentError);
  }

  SECTION("check_dataset catches inconsistent datasets") {
    Dataset bad = before;
    bad.labels[2] = 5;
    CHECK_THROWS_WITH(check_dataset(bad), Catch::Contains("label 5 of sample 2 is outside [0, 5)"));
    bad = before;
    bad.labels.pop_back();
    CHECK_THROWS_WITH(check_dataset(bad), Catch::Contains("4 images but 3 labels"));
  }
}

TEST_CASE("DataLoader: each sample once per epoch, order a pure function of (seed, epoch)", "[data][loader]") {
  const Dataset ds = indexed_dataset(103);
  LoaderOptions opt{.batch_size = 10, .seed = 17};
  DataLoader<float> a(ds, opt), b(ds, opt);
  REQUIRE(a.batches_per_epoch() == 11);
  std::vector<std::vector<std::int64_t>> orders;
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
    const auto [ids, sizes] = run_epoch(a, ds, epoch);
    CHECK(sizes == std::vector<std::int64_t>{10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 3});
    std::vector<std::int64_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> all(103);
    std::iota(all.begin(), all.end(), 0);
    CHECK(sorted == all);
    CHECK(ids == epoch_permutation(103, 17, epoch));
    orders.push_back(ids);
  }
  CHECK(orders[0] != orders[1]);
  CHECK(orders[1] != orders[2]);
  // Another loader, epochs in another order: the same permutation per epoch.
  CHECK(run_epoch(b, ds, 2).first == orders[2]);
  CHECK(run_epoch(b, ds, 0).first == orders[0]);
  // Another seed: another order.
  DataLoader<float> c(ds, LoaderOptions{.batch_size = 10, .seed = 18});
  CHECK(run_epoch(c, ds, 0).first != orders[0]);
  CHECK(epoch_permutation(103, 17, 0) != epoch_permutation(103, 18, 0));

  SECTION("shuffle off: dataset order every epoch") {
    DataLoader<double> plain(ds, LoaderOptions{.batch_size = 32, .shuffle = false});
    std::vector<std::int64_t> all(103);
    std::iota(all.begin(), all.end(), 0);
    CHECK(run_epoch(plain, ds, 0).first == all);
    CHECK(run_epoch(plain, ds, 4).first == all);
  }
  SECTION("next() without start_epoch runs epoch 0") {
    DataLoader<float> fresh(ds, opt);
    Batch<float> batch;
    REQUIRE(fresh.next(batch));
    const auto ids = batch_samples(batch, ds);
    CHECK(ids == std::vector<std::int64_t>(orders[0].begin(), orders[0].begin() + 10));
  }
}

TEST_CASE("DataLoader: drop_last", "[data][loader]") {
  const Dataset ds = indexed_dataset(103);
  DataLoader<float> loader(ds, LoaderOptions{.batch_size = 10, .seed = 3, .drop_last = true});
  CHECK(loader.batches_per_epoch() == 10);
  const auto [ids, sizes] = run_epoch(loader, ds, 1);
  CHECK(sizes == std::vector<std::int64_t>(10, 10));
  CHECK(std::set<std::int64_t>(ids.begin(), ids.end()).size() == 100);
  const auto full = epoch_permutation(103, 3, 1);
  CHECK(ids == std::vector<std::int64_t>(full.begin(), full.begin() + 100));

  for (const bool prefetch : {true, false}) {
    DataLoader<float> none(ds, LoaderOptions{.batch_size = 200, .drop_last = true, .prefetch = prefetch});
    CHECK(none.batches_per_epoch() == 0);
    Batch<float> b;
    CHECK_FALSE(none.next(b));
    DataLoader<float> one(ds, LoaderOptions{.batch_size = 200, .drop_last = false, .prefetch = prefetch});
    CHECK(one.batches_per_epoch() == 1);
    CHECK(run_epoch(one, ds, 0).second == std::vector<std::int64_t>{103});
  }
}

TEST_CASE("DataLoader: prefetch on and off give identical batches", "[data][loader]") {
  const Dataset ds = indexed_dataset(157, 2, 3, 3);
  // A transform that depends on (batch index, epoch), as augmentation seeded from them would.
  const auto transform_for = [](auto tag) {
    using S = decltype(tag);
    return [](Batch<S>& b, std::int64_t epoch) {
      for (auto& x : b.images) x = x * S(2) + static_cast<S>(epoch) + static_cast<S>(b.index) / S(8);
    };
  };
  const auto compare = [&](auto tag) {
    using S = decltype(tag);
    for (const bool with_transform : {false, true}) {
      const LoaderOptions base{.batch_size = 16, .seed = 99, .rank = 1, .world_size = 3};
      LoaderOptions on = base, off = base;
      on.prefetch = true;
      off.prefetch = false;
      typename DataLoader<S>::Transform t;
      if (with_transform) t = transform_for(S{});
      DataLoader<S> a(ds, on, t), b(ds, off, t);
      REQUIRE(a.batches_per_epoch() == b.batches_per_epoch());
      Batch<S> x, y;
      for (std::int64_t epoch : {0, 1, 2, 7}) {
        a.start_epoch(epoch);
        b.start_epoch(epoch);
        std::int64_t count = 0;
        while (true) {
          const bool more_a = a.next(x), more_b = b.next(y);
          REQUIRE(more_a == more_b);
          if (!more_a) break;
          ++count;
          REQUIRE(x.index == y.index);
          REQUIRE(x.labels == y.labels);
          REQUIRE(x.images.shape() == y.images.shape());
          REQUIRE(std::equal(x.images.begin(), x.images.end(), y.images.begin()));
          REQUIRE(a.state() == b.state());
          // Abandon epoch 1 half way: the next start_epoch must discard the prefetched batches.
          if (epoch == 1 && count == 3) break;
        }
      }
    }
  };
  compare(float{});
  compare(double{});
}

TEST_CASE("DataLoader: set_state resumes at exactly the next batch", "[data][loader]") {
  const Dataset ds = indexed_dataset(211);
  for (const bool prefetch : {true, false}) {
    const LoaderOptions opt{.batch_size = 16, .seed = 5, .prefetch = prefetch, .rank = 0, .world_size = 2};
    DataLoader<float> original(ds, opt);
    original.start_epoch(3);
    Batch<float> b;
    for (int i = 0; i < 4; ++i) REQUIRE(original.next(b));
    const LoaderState saved = original.state();
    CHECK(saved == LoaderState{3, 4});
    std::vector<std::vector<std::int64_t>> rest;
    while (original.next(b)) rest.push_back(batch_samples(b, ds));
    CHECK(original.state() == LoaderState{3, original.batches_per_epoch()});

    DataLoader<float> resumed(ds, opt);
    resumed.set_state(saved);
    CHECK(resumed.state() == saved);
    std::vector<std::vector<std::int64_t>> got;
    std::int64_t index = saved.next_batch;
    while (resumed.next(b)) {
      CHECK(b.index == index++);
      got.push_back(batch_samples(b, ds));
    }
    CHECK(got == rest);

    // Resuming the same loader mid-epoch, backwards, works too.
    original.set_state({3, 5});
    REQUIRE(original.next(b));
    CHECK(batch_samples(b, ds) == rest[1]);

    // A state at the end of the epoch yields nothing until the next start_epoch.
    resumed.set_state({3, resumed.batches_per_epoch()});
    CHECK_FALSE(resumed.next(b));
    CHECK_THROWS_AS(resumed.set_state({3, resumed.batches_per_epoch() + 1}), ArgumentError);
    CHECK_THROWS_AS(resumed.set_state({-1, 0}), ArgumentError);
    CHECK_THROWS_AS(resumed.start_epoch(-2), ArgumentError);
  }
}

TEST_CASE("DataLoader: distributed split is disjoint, covering and balanced like DistributedSampler",
          "[data][loader]") {
  for (const std::int64_t n : {100, 103, 3}) {
    for (const int world : {1, 2, 4, 5}) {
      for (const bool shuffle : {true, false}) {
        const Dataset ds = indexed_dataset(n);
        const std::int64_t per_rank = (n + world - 1) / world;
        const auto perm = shuffle ? epoch_permutation(n, 11, 2) : [&] {
          std::vector<std::int64_t> p(static_cast<std::size_t>(n));
          std::iota(p.begin(), p.end(), 0);
          return p;
        }();
        std::map<std::int64_t, int> seen;
        std::optional<std::int64_t> batches;
        for (int rank = 0; rank < world; ++rank) {
          DataLoader<float> loader(
              ds, LoaderOptions{.batch_size = 8, .shuffle = shuffle, .seed = 11, .rank = rank, .world_size = world});
          CHECK(loader.samples_per_epoch() == per_rank);
          if (batches) CHECK(loader.batches_per_epoch() == *batches);
          batches = loader.batches_per_epoch();
          const auto ids = run_epoch(loader, ds, 2).first;
          REQUIRE(static_cast<std::int64_t>(ids.size()) == per_rank);
          for (std::int64_t i = 0; i < per_rank; ++i) {
            // torch: pad the permutation with its head to world * per_rank, take [rank::world].
            REQUIRE(ids[static_cast<std::size_t>(i)] == perm[static_cast<std::size_t>((rank + i * world) % n)]);
            seen[ids[static_cast<std::size_t>(i)]]++;
          }
        }
        CHECK(static_cast<std::int64_t>(seen.size()) == n);  // covering
        std::int64_t duplicates = 0;
        for (const auto& [id, count] : seen) duplicates += count - 1;
        CHECK(duplicates == per_rank * world - n);  // disjoint except for the padding
      }
    }
  }
  const Dataset ds = indexed_dataset(10);
  CHECK_THROWS_AS((DataLoader<float>(ds, LoaderOptions{.batch_size = 2, .rank = 2, .world_size = 2})), ArgumentError);
  CHECK_THROWS_AS((DataLoader<float>(ds, LoaderOptions{.batch_size = 2, .rank = 0, .world_size = 0})), ArgumentError);
  CHECK_THROWS_AS((DataLoader<float>(ds, LoaderOptions{.batch_size = 0})), ArgumentError);
  const Dataset empty = indexed_dataset(0);
  CHECK_THROWS_AS((DataLoader<float>(empty, LoaderOptions{.batch_size = 2})), ArgumentError);
  static_assert(!std::is_constructible_v<DataLoader<float>, Dataset&&, LoaderOptions>,
                "a loader must not be built on a temporary dataset (it would dangle)");
}

TEST_CASE("DataLoader: drop_tail gives every rank floor(N / W) distinct samples", "[data][loader]") {
  for (const std::int64_t n : {100, 103, 7}) {
    for (const int world : {2, 3, 4}) {
      const Dataset ds = indexed_dataset(n);
      std::map<std::int64_t, int> seen;
      std::optional<std::int64_t> batches;
      for (int rank = 0; rank < world; ++rank) {
        DataLoader<float> loader(ds, LoaderOptions{.batch_size = 4, .seed = 5, .rank = rank, .world_size = world,
                                                   .drop_tail = true});
        CHECK(loader.samples_per_epoch() == n / world);
        if (batches) CHECK(loader.batches_per_epoch() == *batches);
        batches = loader.batches_per_epoch();
        for (auto id : run_epoch(loader, ds, 1).first) seen[id]++;
      }
      CHECK(static_cast<std::int64_t>(seen.size()) == (n / world) * world);
      for (const auto& [id, count] : seen) CHECK(count == 1);  // no duplicates
    }
  }
}

TEST_CASE("DataLoader: an exception while preparing a batch is rethrown from next()", "[data][loader]") {
  const Dataset ds = indexed_dataset(64);
  for (const bool prefetch : {true, false}) {
    std::atomic<int> failures_left{1};
    DataLoader<float> loader(ds, LoaderOptions{.batch_size = 8, .seed = 1, .prefetch = prefetch},
                             [&](Batch<float>& b, std::int64_t) {
                               if (b.index == 2 && failures_left.fetch_sub(1) > 0) {
                                 throw IoError("transform failed on batch 2");
                               }
                             });
    DataLoader<float> reference(ds, LoaderOptions{.batch_size = 8, .seed = 1, .prefetch = false});
    Batch<float> b, r;
    for (int i = 0; i < 2; ++i) {
      REQUIRE(loader.next(b));
      REQUIRE(reference.next(r));
      CHECK(b.labels == r.labels);
    }
    CHECK_THROWS_WITH(loader.next(b), "transform failed on batch 2");
    CHECK(loader.state() == LoaderState{0, 2});
    // Calling next() again retries the batch, which now succeeds.
    REQUIRE(loader.next(b));
    REQUIRE(reference.next(r));
    CHECK(b.index == 2);
    CHECK(b.labels == r.labels);
    CHECK(std::equal(b.images.begin(), b.images.end(), r.images.begin()));
  }
}

TEST_CASE("DataLoader: the destructor stops the prefetch thread at any point", "[data][loader]") {
  const Dataset ds = indexed_dataset(500);
  const auto started = std::chrono::steady_clock::now();
  { DataLoader<float> idle(ds, LoaderOptions{.batch_size = 4}); }
  {
    DataLoader<float> mid(ds, LoaderOptions{.batch_size = 4});
    Batch<float> b;
    REQUIRE(mid.next(b));
  }
  {
    // The worker is inside a slow transform when the loader is destroyed.
    std::atomic<bool> entered{false};
    DataLoader<float> slow(ds, LoaderOptions{.batch_size = 4}, [&](Batch<float>&, std::int64_t) {
      entered = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    });
    while (!entered) std::this_thread::yield();
  }
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(5));
}

TEST_CASE("DataLoader: no allocation in steady state", "[data][loader]") {
  const Dataset ds = indexed_dataset(300, 1, 28, 28, 10);
  for (const bool prefetch : {true, false}) {
    DataLoader<float> loader(ds, LoaderOptions{.batch_size = 32, .seed = 8, .prefetch = prefetch});
    Batch<float> b;
    for (std::int64_t epoch = 0; epoch < 2; ++epoch) {  // warm-up: buffers reach full size
      loader.start_epoch(epoch);
      while (loader.next(b)) {
      }
    }
    const AllocatorStats before = Cpu::allocator().stats();
    const std::size_t label_capacity = b.labels.capacity();
    for (std::int64_t epoch = 2; epoch < 4; ++epoch) {
      loader.start_epoch(epoch);
      while (loader.next(b)) {
      }
    }
    const AllocatorStats after = Cpu::allocator().stats();
    CHECK(after.system_allocations == before.system_allocations);
    CHECK(after.cache_hits == before.cache_hits);  // not even a cached block was requested
    CHECK(b.labels.capacity() == label_capacity);
  }
}

TEST_CASE("SyntheticImages: shapes, N(0, 1) pixels, labels in range, deterministic", "[data][synthetic]") {
  const SyntheticImages a(64, 3, 32, 32, 1000, 42);
  REQUIRE(a.images.shape() == Shape{64, 3, 32, 32});
  REQUIRE(a.size() == 64);
  CHECK(a.num_classes == 1000);
  CHECK_NOTHROW(check_dataset(a));
  double sum = 0, sum_sq = 0;
  for (float x : a.images.span()) {
    REQUIRE(std::isfinite(x));
    sum += x;
    sum_sq += static_cast<double>(x) * x;
  }
  const double count = static_cast<double>(a.images.numel());  // 196608 values
  const double mean = sum / count;
  CHECK(std::abs(mean) < 0.01);                                       // 4.4 standard errors
  CHECK(std::sqrt(sum_sq / count - mean * mean) == Approx(1.0).margin(0.01));
  std::set<std::int64_t> distinct(a.labels.begin(), a.labels.end());
  CHECK(distinct.size() > 55);  // 64 draws from 1000 classes rarely collide

  const int threads = Cpu::num_threads();
  Cpu::set_num_threads(1);
  const SyntheticImages single(64, 3, 32, 32, 1000, 42);
  Cpu::set_num_threads(threads);
  CHECK(std::equal(a.images.begin(), a.images.end(), single.images.begin()));
  CHECK(a.labels == single.labels);
  const SyntheticImages other(64, 3, 32, 32, 1000, 43);
  CHECK_FALSE(std::equal(a.images.begin(), a.images.end(), other.images.begin()));

  // ImageNet-shaped, and usable through the loader as a plain Dataset.
  const auto t0 = std::chrono::steady_clock::now();
  const Dataset imagenet = SyntheticImages(64, 3, 224, 224, 1000, 7);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("SyntheticImages(64, 3, 224, 224) took " << seconds << " s");
  CHECK(imagenet.images.shape() == Shape{64, 3, 224, 224});
  DataLoader<float> loader(imagenet, LoaderOptions{.batch_size = 32, .seed = 1});
  Batch<float> b;
  REQUIRE(loader.next(b));
  CHECK(b.images.shape() == Shape{32, 3, 224, 224});
  CHECK_THROWS_AS(SyntheticImages(0, 3, 2, 2, 10, 1), ArgumentError);
}

TEST_CASE("DataLoader: global batches split unevenly cover the same samples at every world size",
          "[data][loader]") {
  for (const std::int64_t n : {100, 103, 17}) {
    for (const std::int64_t global : {8, 10}) {
      const Dataset ds = indexed_dataset(n);
      const auto perm = epoch_permutation(n, 11, 1);
      for (const int world : {1, 2, 3, 4}) {
        INFO("n " << n << ", global batch " << global << ", world " << world);
        const std::int64_t tail = n % global;
        const std::int64_t batches = n / global + (tail >= world ? 1 : 0);
        std::vector<std::vector<std::int64_t>> batch_ids(static_cast<std::size_t>(batches));
        std::vector<double> weight_sum(static_cast<std::size_t>(batches), 0.0);
        for (int rank = 0; rank < world; ++rank) {
          DataLoader<float> loader(ds, LoaderOptions{.shuffle = true, .seed = 11, .rank = rank, .world_size = world,
                                                     .global_batch_size = global});
          REQUIRE(loader.batches_per_epoch() == batches);
          loader.start_epoch(1);
          Batch<float> b;
          while (loader.next(b)) {
            const auto ids = batch_samples(b, ds);
            const std::int64_t size = std::min(global, n - b.index * global);
            // Rank r holds the batch's entries r, r + W, ... of the permutation, in order.
            for (std::size_t j = 0; j < ids.size(); ++j)
              REQUIRE(ids[j] == perm[static_cast<std::size_t>(b.index * global + rank +
                                                              static_cast<std::int64_t>(j) * world)]);
            CHECK(b.weight == static_cast<double>(world) * static_cast<double>(ids.size()) / static_cast<double>(size));
            weight_sum[static_cast<std::size_t>(b.index)] += b.weight / world;
            auto& all = batch_ids[static_cast<std::size_t>(b.index)];
            all.insert(all.end(), ids.begin(), ids.end());
          }
        }
        for (std::int64_t i = 0; i < batches; ++i) {
          // Together: exactly the permutation's entries [i G, (i + 1) G), whatever the world size.
          auto got = batch_ids[static_cast<std::size_t>(i)];
          std::vector<std::int64_t> want(perm.begin() + i * global, perm.begin() + std::min(n, (i + 1) * global));
          std::sort(got.begin(), got.end());
          std::sort(want.begin(), want.end());
          CHECK(got == want);
          CHECK(std::abs(weight_sum[static_cast<std::size_t>(i)] - 1.0) < 1e-12);  // the shares' weights average to 1
        }
      }
    }
  }
  const Dataset ds = indexed_dataset(10);
  CHECK_THROWS_WITH((DataLoader<float>(ds, LoaderOptions{.batch_size = 2, .global_batch_size = 4})),
                    Catch::Contains("not both"));
  CHECK_THROWS_WITH((DataLoader<float>(ds, LoaderOptions{.rank = 0, .world_size = 5, .global_batch_size = 4})),
                    Catch::Contains("smaller than the 5 ranks"));
  CHECK_THROWS_WITH((DataLoader<float>(ds, LoaderOptions{.drop_last = true, .global_batch_size = 11})),
                    Catch::Contains("do not fill one global batch"));
  // A position (epoch, batch) means the same samples at any world size: its batch is G, its world 1.
  const LoaderOptions o{.world_size = 3, .global_batch_size = 12};
  CHECK(position_batch(o) == 12);
  CHECK(position_world(o) == 1);
}
