// ImageFolder: a labelled image set stored as files, torchvision's convention
//
//   root/<class>/<...>/<file>.{jpg,jpeg,png}     classes sorted by name, class i = the i-th name
//
// or an index file (ImageFolderOptions::index): one sample per line, "path" or "path,class", with
// paths relative to root (or absolute); the class is a name (classes = the sorted distinct names)
// or, without a second column, the path's first directory. Lines starting with '#' and a first
// line "path,class" / "path,label" are skipped. Samples are in torchvision's order (directories
// walked depth-first, each sorted by name, files sorted by name), so sample k is the same file
// here and in torchvision.datasets.ImageFolder.
//
// It is a SampleSource: read(k, epoch, out) decodes file k (image.hpp), applies the transform
// (transforms.hpp) with an Rng seeded by (seed, epoch, k), and writes (C, H, W) floats; a
// DataLoader batches, shuffles and shards it, decoding on its worker threads. Only the samples a
// rank's DataLoader asks for are ever read, so each rank decodes only its shard.
//
// Bad files. Files whose extension is an image format Tessera does not decode (.bmp, .tif, .webp,
// ...; torchvision would list them) make the constructor throw, naming one, unless skip_corrupt.
// Empty, truncated, corrupt or mislabelled-format files throw from read() with the file's path
// (the DataLoader rethrows it from next()). With skip_corrupt, such a file is replaced by the next
// readable sample (k + 1, k + 2, ... wrapping around), the same one every time, and is counted:
// skipped() lists each bad file once with its reason. Other extensions (.txt, .csv) are ignored,
// as torchvision does.
//
// Caches, for data sets small enough to hold decoded (the transform still runs on every read:
// crops differ per epoch):
//  - cache = true: each decoded image is kept in memory the first time it is read, so later
//    epochs skip reading and decoding. It costs the decoded bytes (H x W x C per image);
//    cache_bytes() says how many are held. Workers fill it concurrently without a lock: a sample
//    is claimed by one atomic exchange, written once and published with release ordering.
//  - cache_file = PATH: every image decoded once into one file, memory-mapped read-only. The
//    constructor builds it (decoding on all OpenMP threads, into PATH.<pid>.tmp, then renamed, so
//    ranks building it at once never see a partial file) unless PATH already holds the cache of
//    this exact file list: its header carries a fingerprint of every sample's path, size and
//    modification time, and of the channel count. A later run, or another rank or process on the
//    machine, maps it and shares its pages through the kernel's page cache. Unreadable files are
//    recorded in it as such (skip_corrupt decides, at read time, as without the cache).
//    Layout: "TSIMGC01", u64 count, channels, fingerprint; count x {u64 offset, u32 height,
//    u32 width} (0 x 0: unreadable); the pixels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/data/dataset.hpp"
#include "tessera/data/image.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/transforms.hpp"

namespace tessera {

struct ImageFolderOptions {
  ImageTransform transform;   // what read() makes of each image (its channels decide RGB or grey)
  std::uint64_t seed = 0;     // of the random crops and flips
  std::string index;          // optional file list / CSV (see above); empty: walk root
  bool skip_corrupt = false;  // replace unreadable files by the next readable sample, and count them
  bool cache = false;         // keep decoded images in memory
  std::string cache_file;     // or: decoded images in one memory-mapped file (built once, reused)
};

struct ImageSample {
  std::string path;
  std::int64_t label = 0;
};

struct SkippedFile {
  std::string path, reason;
};

namespace detail {

// A directory's identity through any links to it: (device, inode) of what stat() reaches.
struct DirectoryId {
  std::uint64_t device = 0, inode = 0;
  bool operator==(const DirectoryId&) const = default;
};
inline DirectoryId directory_id(const std::string& path) {
  struct stat st {};
  TESSERA_CHECK(::stat(path.c_str(), &st) == 0, IoError, "ImageFolder: cannot stat ", path, ": ", std::strerror(errno));
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}


inline std::string lower_extension(const std::filesystem::path& p) {
  std::string ext = p.extension().string();
  for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext;
}
inline bool decodable_extension(const std::string& ext) { return ext == ".jpg" || ext == ".jpeg" || ext == ".png"; }
// torchvision's IMG_EXTENSIONS that Tessera does not decode.
inline bool other_image_extension(const std::string& ext) {
  return ext == ".ppm" || ext == ".bmp" || ext == ".pgm" || ext == ".tif" || ext == ".tiff" || ext == ".webp";
}

inline std::string trim(std::string s) {
  const auto not_space = [](unsigned char ch) { return !std::isspace(ch); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  return s;
}

}  // namespace detail

// The Rng seed of sample k's augmentation in epoch e: the same wherever and whenever it is read.
inline std::uint64_t sample_seed(std::uint64_t seed, std::int64_t epoch, std::int64_t k) {
  return epoch_seed(epoch_seed(seed, epoch), k);
}

class ImageFolder final : public SampleSource {
 public:
  ImageFolder(std::string root, ImageFolderOptions options) : root_(std::move(root)), opt_(std::move(options)) {
    namespace fs = std::filesystem;
    opt_.transform.check(detail::cat("ImageFolder(", root_, ")"));
    table_ = normalize_table(opt_.transform);
    std::error_code ec;
    TESSERA_CHECK(fs::is_directory(root_, ec), IoError, "ImageFolder: ", root_,
                  fs::exists(root_, ec) ? " is not a directory" : " does not exist");
    if (opt_.index.empty()) {
      scan();
    } else {
      read_index();
    }
    TESSERA_CHECK(!samples_.empty(), IoError, "ImageFolder(", root_, "): no .jpg, .jpeg or .png files found",
                  opt_.index.empty() ? " in its class directories" : detail::cat(" in the index ", opt_.index));
    TESSERA_CHECK(!(opt_.cache && !opt_.cache_file.empty()), ArgumentError, "ImageFolder(", root_,
                  "): choose cache (memory) or cache_file, not both");
    if (opt_.cache) {
      cache_ = std::make_unique<CacheEntry[]>(samples_.size());
    }
    if (!opt_.cache_file.empty()) open_or_build_cache_file();
    bad_ = std::make_unique<std::atomic<std::uint8_t>[]>(samples_.size());
    for (std::size_t i = 0; i < samples_.size(); ++i) bad_[i].store(0, std::memory_order_relaxed);
  }

  ~ImageFolder() override {
    if (mapped_ != nullptr) ::munmap(mapped_, mapped_bytes_);
  }
  ImageFolder(const ImageFolder&) = delete;
  ImageFolder& operator=(const ImageFolder&) = delete;

  // SampleSource
  std::int64_t size() const override { return static_cast<std::int64_t>(samples_.size()); }
  std::array<std::int64_t, 3> sample_shape() const override {
    return {opt_.transform.channels, opt_.transform.height, opt_.transform.width};
  }
  std::int64_t num_classes() const override { return static_cast<std::int64_t>(classes_.size()); }
  std::string name() const override { return "ImageFolder(" + root_ + ")"; }

  std::int64_t read(std::int64_t index, std::int64_t epoch, float* out) const override {
    TESSERA_CHECK(index >= 0 && index < size(), ArgumentError, name(), ": sample ", index, " outside [0, ", size(),
                  ")");
    thread_local Scratch scratch;
    const std::int64_t n = size();
    for (std::int64_t tries = 0; tries < n; ++tries) {
      const std::int64_t k = (index + tries) % n;
      if (bad_[static_cast<std::size_t>(k)].load(std::memory_order_relaxed)) continue;
      ImageView image;
      try {
        image = decoded(k, scratch);
      } catch (const IoError& e) {
        if (!opt_.skip_corrupt) throw;
        mark_bad(k, e.what());
        continue;
      }
      Rng rng(sample_seed(opt_.seed, epoch, k));
      apply_transform(image, opt_.transform, table_, rng, out, scratch.resample);
      return samples_[static_cast<std::size_t>(k)].label;
    }
    throw IoError(detail::cat(name(), ": none of its ", n, " files can be read (skip_corrupt found every one bad; ",
                              "the first: ", skipped().empty() ? std::string("?") : skipped().front().path, ": ",
                              skipped().empty() ? std::string("?") : skipped().front().reason, ")"));
  }

  const std::vector<std::string>& classes() const { return classes_; }
  const std::vector<ImageSample>& samples() const { return samples_; }
  const std::string& root() const { return root_; }
  const ImageFolderOptions& options() const { return opt_; }
  // Files skipped so far (skip_corrupt), each once, with why; and files of image formats not
  // decoded here that skip_corrupt left out of samples().
  std::vector<SkippedFile> skipped() const {
    std::lock_guard<std::mutex> lock(skipped_mutex_);
    return skipped_;
  }
  std::size_t skipped_count() const {
    std::lock_guard<std::mutex> lock(skipped_mutex_);
    return skipped_.size();
  }
  // Decoded bytes held by the cache (in memory, or mapped from cache_file).
  std::size_t cache_bytes() const { return cache_bytes_.load(std::memory_order_relaxed); }
  // Whether cache_file was built by this constructor (false: an existing one was reused, or none).
  bool cache_file_built() const { return cache_file_built_; }

 private:
  struct Scratch {
    std::vector<std::uint8_t> bytes, convert;
    Image image;
    detail::ResampleScratch resample;
  };
  struct CacheEntry {
    std::atomic<int> state{0};  // 0 empty, 1 being written, 2 ready
    Image image;
  };

  // Sample k's decoded image: from a cache, or read and decoded into the scratch (and cached).
  ImageView decoded(std::int64_t k, Scratch& s) const {
    const auto i = static_cast<std::size_t>(k);
    if (mapped_ != nullptr) {
      const CacheFileEntry& e = file_entries_[i];
      TESSERA_CHECK(e.height > 0, IoError, samples_[i].path, ": unreadable (recorded so in the cache file ",
                    opt_.cache_file, " when it was built)");
      return {static_cast<const std::uint8_t*>(mapped_) + e.offset, e.height, e.width, opt_.transform.channels};
    }
    if (cache_ && cache_[i].state.load(std::memory_order_acquire) == 2) return cache_[i].image;
    const std::string& path = samples_[i].path;
    read_file_bytes(path, s.bytes);
    decode_image(s.bytes, opt_.transform.channels, path, s.image, s.convert);
    if (cache_) {
      int expected = 0;
      if (cache_[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
        cache_[i].image = s.image;
        cache_bytes_.fetch_add(s.image.pixels.size(), std::memory_order_relaxed);
        cache_[i].state.store(2, std::memory_order_release);
      }
    }
    return s.image;
  }

  struct CacheFileEntry {
    std::uint64_t offset = 0;
    std::uint32_t height = 0, width = 0;
  };
  static constexpr char kCacheMagic[8] = {'T', 'S', 'I', 'M', 'G', 'C', '0', '1'};

  // FNV-1a over every sample's path, size and modification time, and the channel count.
  std::uint64_t fingerprint() const {
    std::uint64_t h = 1469598103934665603ULL;
    const auto mix = [&](const void* p, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ULL;
    };
    for (const auto& sample : samples_) {
      struct stat st {};
      if (::stat(sample.path.c_str(), &st) != 0) st = {};
      const std::int64_t stamp[3] = {static_cast<std::int64_t>(st.st_size), static_cast<std::int64_t>(st.st_mtim.tv_sec),
                                     static_cast<std::int64_t>(st.st_mtim.tv_nsec)};
      mix(sample.path.data(), sample.path.size() + 1);
      mix(stamp, sizeof stamp);
    }
    mix(&opt_.transform.channels, sizeof opt_.transform.channels);
    return h;
  }

  // Maps cache_file if it holds this folder's cache; false if it is missing or of another file list.
  bool map_cache_file(std::uint64_t want) {
    const int fd = ::open(opt_.cache_file.c_str(), O_RDONLY);
    if (fd < 0) return false;
    struct stat st {};
    const std::size_t n = samples_.size();
    const std::size_t header = 8 + 3 * 8 + n * sizeof(CacheFileEntry);
    void* p = MAP_FAILED;
    if (::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) >= header) {
      p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    }
    ::close(fd);
    if (p == MAP_FAILED) return false;
    const auto* bytes = static_cast<const std::uint8_t*>(p);
    std::uint64_t fields[3];
    std::memcpy(fields, bytes + 8, sizeof fields);
    bool ok = std::memcmp(bytes, kCacheMagic, 8) == 0 && fields[0] == n &&
              fields[1] == static_cast<std::uint64_t>(opt_.transform.channels) && fields[2] == want;
    if (ok) {
      file_entries_.resize(n);
      std::memcpy(file_entries_.data(), bytes + 32, n * sizeof(CacheFileEntry));
      std::size_t total = 0;
      for (const auto& e : file_entries_) {
        const std::size_t size = std::size_t{e.height} * e.width * static_cast<std::size_t>(opt_.transform.channels);
        ok = ok && e.offset >= header && e.offset + size <= static_cast<std::size_t>(st.st_size);
        total += size;
      }
      cache_bytes_.store(total);
    }
    if (!ok) {
      ::munmap(p, static_cast<std::size_t>(st.st_size));
      file_entries_.clear();
      return false;
    }
    mapped_ = p;
    mapped_bytes_ = static_cast<std::size_t>(st.st_size);
    return true;
  }

  void open_or_build_cache_file() {
    const std::uint64_t want = fingerprint();
    if (map_cache_file(want)) return;
    // Decode every sample once, on all threads; an unreadable one is recorded as 0 x 0.
    const std::size_t n = samples_.size();
    std::vector<Image> images(n);
#pragma omp parallel for schedule(dynamic, 16)
    for (std::size_t i = 0; i < n; ++i) {
      thread_local std::vector<std::uint8_t> bytes, convert;
      try {
        read_file_bytes(samples_[i].path, bytes);
        decode_image(bytes, opt_.transform.channels, samples_[i].path, images[i], convert);
      } catch (const std::exception&) {
        images[i] = Image{};  // decoded() reports it when (and if) it is read
      }
    }
    std::vector<CacheFileEntry> entries(n);
    std::uint64_t offset = 8 + 3 * 8 + n * sizeof(CacheFileEntry);
    for (std::size_t i = 0; i < n; ++i) {
      entries[i] = {offset, static_cast<std::uint32_t>(images[i].height), static_cast<std::uint32_t>(images[i].width)};
      offset += images[i].pixels.size();
    }
    const std::string tmp = opt_.cache_file + "." + std::to_string(::getpid()) + "." +
                            std::to_string(reinterpret_cast<std::uintptr_t>(this)) + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      TESSERA_CHECK(out.good(), IoError, "ImageFolder(", root_, "): cannot create the cache file ", tmp, ": ",
                    std::strerror(errno));
      const std::uint64_t fields[3] = {n, static_cast<std::uint64_t>(opt_.transform.channels), want};
      out.write(kCacheMagic, 8);
      out.write(reinterpret_cast<const char*>(fields), sizeof fields);
      out.write(reinterpret_cast<const char*>(entries.data()), static_cast<std::streamsize>(n * sizeof(CacheFileEntry)));
      for (const auto& im : images)
        out.write(reinterpret_cast<const char*>(im.pixels.data()), static_cast<std::streamsize>(im.pixels.size()));
      out.flush();
      TESSERA_CHECK(out.good(), IoError, "ImageFolder(", root_, "): writing the cache file ", tmp, " failed (disk full?)");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, opt_.cache_file, ec);
    if (ec) std::filesystem::remove(tmp, ec);
    TESSERA_CHECK(map_cache_file(want), IoError, "ImageFolder(", root_, "): cannot map the cache file ",
                  opt_.cache_file, " it has just written");
    cache_file_built_ = true;
  }

  void mark_bad(std::int64_t k, const std::string& reason) const {
    if (bad_[static_cast<std::size_t>(k)].exchange(1) != 0) return;
    std::lock_guard<std::mutex> lock(skipped_mutex_);
    skipped_.push_back({samples_[static_cast<std::size_t>(k)].path, reason});
  }

  void refuse_or_skip(const std::string& path, const std::string& ext) {
    TESSERA_CHECK(opt_.skip_corrupt, IoError, "ImageFolder(", root_, "): ", path, " is a ", ext,
                  " image, which Tessera does not decode (only JPEG and PNG); convert it, remove it, or set "
                  "skip_corrupt to skip such files");
    skipped_.push_back({path, "unsupported format " + ext});
  }

  // torchvision's find_classes + make_dataset.
  void scan() {
    namespace fs = std::filesystem;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_, fs::directory_options::follow_directory_symlink, ec)) {
      if (entry.is_directory(ec)) classes_.push_back(entry.path().filename().string());
    }
    TESSERA_CHECK(!ec, IoError, "ImageFolder: cannot list ", root_, ": ", ec.message());
    std::sort(classes_.begin(), classes_.end());
    TESSERA_CHECK(!classes_.empty(), IoError, "ImageFolder(", root_,
                  "): no class directories in it (expected root/<class>/<image files>)");
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      const fs::path dir = fs::path(root_) / classes_[c];
      std::vector<std::pair<std::string, std::string>> files;  // (directory, file name): os.walk sorted
      // Symbolic links to directories are followed (as torchvision's os.walk(followlinks=True)),
      // but one that leads back to a directory on its own path is a loop, which would list the
      // same files over and over under this class: refused, or skipped with skip_corrupt.
      std::vector<detail::DirectoryId> path_ids = {detail::directory_id(dir.string())};
      for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_directory(ec)) {
          const auto id = detail::directory_id(it->path().string());
          path_ids.resize(static_cast<std::size_t>(it.depth()) + 1);  // this entry's ancestors
          if (std::find(path_ids.begin(), path_ids.end(), id) != path_ids.end()) {
            std::error_code link_ec;
            const auto target = fs::read_symlink(it->path(), link_ec);
            TESSERA_CHECK(opt_.skip_corrupt, IoError, "ImageFolder(", root_, "): ", it->path().string(),
                          link_ec ? std::string(" leads") : " is a link to " + target.string() + ", which leads",
                          " back to a directory on its own path: a loop, which would list the same images again and "
                          "again (remove the link, or set skip_corrupt to skip it)");
            skipped_.push_back({it->path().string(), "a directory link that loops back to its own path"});
            it.disable_recursion_pending();
            continue;
          }
          path_ids.push_back(id);
        } else if (it->is_regular_file(ec)) {
          files.emplace_back(it->path().parent_path().string(), it->path().filename().string());
        }
      }
      TESSERA_CHECK(!ec, IoError, "ImageFolder: cannot list ", dir.string(), ": ", ec.message());
      std::sort(files.begin(), files.end());
      const std::size_t before = samples_.size();
      for (const auto& [parent, file] : files) {
        const fs::path path = fs::path(parent) / file;
        const std::string ext = detail::lower_extension(path);
        if (detail::decodable_extension(ext)) {
          samples_.push_back({path.string(), static_cast<std::int64_t>(c)});
        } else if (detail::other_image_extension(ext)) {
          refuse_or_skip(path.string(), ext);
        }
      }
      TESSERA_CHECK(samples_.size() > before || opt_.skip_corrupt, IoError, "ImageFolder(", root_,
                    "): class directory ", classes_[c], " holds no .jpg, .jpeg or .png file");
    }
  }

  void read_index() {
    namespace fs = std::filesystem;
    std::ifstream in(opt_.index);
    TESSERA_CHECK(in.good(), IoError, "ImageFolder: cannot open the index ", opt_.index);
    std::vector<std::pair<std::string, std::string>> rows;  // (path, class name)
    std::string line;
    for (std::int64_t number = 1; std::getline(in, line); ++number) {
      line = detail::trim(line);
      if (line.empty() || line[0] == '#') continue;
      if (number == 1 && (line == "path,class" || line == "path,label")) continue;
      const auto comma = line.find(',');
      std::string path = detail::trim(line.substr(0, comma));
      std::string cls = comma == std::string::npos ? "" : detail::trim(line.substr(comma + 1));
      TESSERA_CHECK(!path.empty(), IoError, opt_.index, ":", number, ": empty path");
      if (cls.empty()) {
        const fs::path rel(path);
        TESSERA_CHECK(rel.is_relative() && std::distance(rel.begin(), rel.end()) >= 2, IoError, opt_.index, ":",
                      number, ": '", path, "' has no class column and no class directory (write path,class)");
        cls = rel.begin()->string();
      }
      const fs::path full = fs::path(path).is_absolute() ? fs::path(path) : fs::path(root_) / path;
      const std::string ext = detail::lower_extension(full);
      if (!detail::decodable_extension(ext)) {
        TESSERA_CHECK(opt_.skip_corrupt, IoError, opt_.index, ":", number, ": ", full.string(),
                      " is not a .jpg, .jpeg or .png file (set skip_corrupt to skip such lines)");
        skipped_.push_back({full.string(), "unsupported extension " + ext});
        continue;
      }
      std::error_code ec;
      if (!fs::is_regular_file(full, ec)) {
        TESSERA_CHECK(opt_.skip_corrupt, IoError, opt_.index, ":", number, ": ", full.string(), " does not exist");
        skipped_.push_back({full.string(), "missing"});
        continue;
      }
      rows.emplace_back(full.string(), std::move(cls));
    }
    std::map<std::string, std::int64_t> ids;
    for (const auto& row : rows) ids.emplace(row.second, 0);
    for (auto& [name, id] : ids) {
      id = static_cast<std::int64_t>(classes_.size());
      classes_.push_back(name);
    }
    for (auto& row : rows) samples_.push_back({std::move(row.first), ids.at(row.second)});
  }

  std::string root_;
  ImageFolderOptions opt_;
  std::vector<float> table_;  // normalize_table(transform)
  std::vector<std::string> classes_;
  std::vector<ImageSample> samples_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> bad_;  // per sample: found unreadable (skip_corrupt)
  mutable std::mutex skipped_mutex_;
  mutable std::vector<SkippedFile> skipped_;
  std::unique_ptr<CacheEntry[]> cache_;
  mutable std::atomic<std::size_t> cache_bytes_{0};
  void* mapped_ = nullptr;  // cache_file, mapped read-only
  std::size_t mapped_bytes_ = 0;
  std::vector<CacheFileEntry> file_entries_;
  bool cache_file_built_ = false;
};

// ImageArray: images already in memory (a Dataset with pixels in [0, 1], such as an IDX set)
// through the same transforms and seeding as ImageFolder: sample k of epoch e gets the crop and
// flip it would get from files, so a run from files and one from memory see the same samples
// (the same pixels too, from PNG files holding the same bytes).
class ImageArray final : public SampleSource {
 public:
  ImageArray(const Dataset& ds, ImageTransform transform, std::uint64_t seed = 0)
      : transform_(std::move(transform)), seed_(seed), labels_(ds.labels), classes_(ds.num_classes), name_(ds.name) {
    check_dataset(ds);
    transform_.check("ImageArray(" + ds.name + ")");
    TESSERA_CHECK(ds.channels() == transform_.channels, ArgumentError, "ImageArray(", ds.name, "): images have ",
                  ds.channels(), " channels but the transform makes ", transform_.channels);
    table_ = normalize_table(transform_);
    images_.resize(static_cast<std::size_t>(ds.size()));
    const std::int64_t c = ds.channels(), h = ds.height(), w = ds.width();
    for (std::int64_t n = 0; n < ds.size(); ++n) {
      Image& im = images_[static_cast<std::size_t>(n)];
      im.resize(h, w, c);
      const float* src = ds.images.data() + n * c * h * w;  // (C, H, W) -> (H, W, C) bytes
      for (std::int64_t ch = 0; ch < c; ++ch)
        for (std::int64_t p = 0; p < h * w; ++p)
          im.pixels[static_cast<std::size_t>(p * c + ch)] =
              static_cast<std::uint8_t>(std::lround(std::clamp(src[ch * h * w + p], 0.0f, 1.0f) * 255.0f));
    }
  }
  std::int64_t size() const override { return static_cast<std::int64_t>(images_.size()); }
  std::array<std::int64_t, 3> sample_shape() const override {
    return {transform_.channels, transform_.height, transform_.width};
  }
  std::int64_t num_classes() const override { return classes_; }
  std::string name() const override { return "ImageArray(" + name_ + ")"; }
  std::int64_t read(std::int64_t index, std::int64_t epoch, float* out) const override {
    TESSERA_CHECK(index >= 0 && index < size(), ArgumentError, name(), ": sample ", index, " outside [0, ", size(), ")");
    thread_local detail::ResampleScratch scratch;
    Rng rng(sample_seed(seed_, epoch, index));
    apply_transform(images_[static_cast<std::size_t>(index)], transform_, table_, rng, out, scratch);
    return labels_[static_cast<std::size_t>(index)];
  }

 private:
  ImageTransform transform_;
  std::uint64_t seed_;
  std::vector<float> table_;
  std::vector<Image> images_;
  std::vector<std::int64_t> labels_;
  std::int64_t classes_;
  std::string name_;
};

}  // namespace tessera
