// Safetensors files (the format of Hugging Face's `safetensors`, readable from Python and numpy):
//
//   [8 bytes: N, little-endian u64] [N bytes: JSON header] [data buffer]
//   header: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"key": "value"}}      offsets are relative to the data buffer.
//
// SafetensorsFile::load validates everything before handing out data: header length against the
// file size, the JSON itself, dtypes, shape x dtype size == end - begin, offsets inside the buffer
// and not overlapping. Any violation is an IoError naming the file and the entry, never a crash.
// SafetensorsWriter::write writes atomically: temporary file, fsync, rename, fsync of the directory,
// so a crash mid-write leaves the previous file intact. The temporary of a writer killed mid-write
// (kill -9, power loss) is removed by the next write to the same path (see remove_stale_temporaries).
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/half.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, Bool };

inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::Bool: return 1;
  }
  return 0;
}

inline std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "F64"; case DType::F32: return "F32"; case DType::F16: return "F16";
    case DType::BF16: return "BF16"; case DType::I64: return "I64"; case DType::I32: return "I32";
    case DType::I16: return "I16"; case DType::I8: return "I8"; case DType::U8: return "U8";
    case DType::Bool: return "BOOL";
  }
  return "?";
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>) return DType::F64;
  else if constexpr (std::is_same_v<T, float>) return DType::F32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::I64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::I32;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return DType::U8;
  else static_assert(sizeof(T) == 0, "dtype_of: unsupported element type");
}

struct TensorInfo {
  DType dtype;
  Shape shape;
  std::size_t begin, end;  // byte offsets into the data buffer
};

namespace detail {

// A strict parser for the subset of JSON a safetensors header uses: objects, arrays, strings,
// non-negative integers. Throws IoError with the byte position on anything else.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string path);

  void parse(std::map<std::string, TensorInfo>& tensors, std::map<std::string, std::string>& metadata);

 private:
  TensorInfo entry(const std::string& name);

  DType parse_dtype(const std::string& s, const std::string& name);

  std::vector<std::uint64_t> integers();

  std::string string();

  void skip_ws();
  char peek();
  void expect(char c);
  void finish();
  [[noreturn]] void fail(const std::string& msg);

  std::string_view s_;
  std::string path_;
  std::size_t i_ = 0;
};


template <class Dst>
void convert_elements(const std::byte* src, DType t, Dst* dst, std::size_t n) {
  if (t == DType::F16 || t == DType::BF16) {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t v;
      std::memcpy(&v, src + i * 2, 2);
      dst[i] = static_cast<Dst>(t == DType::F16 ? detail::half_bits_to_float(v) : detail::bhalf_bits_to_float(v));
    }
    return;
  }
  auto run = [&](auto tag) {
    using Src = decltype(tag);
    for (std::size_t i = 0; i < n; ++i) {
      Src v;
      std::memcpy(&v, src + i * sizeof(Src), sizeof(Src));
      dst[i] = static_cast<Dst>(v);
    }
  };
  switch (t) {
    case DType::F64: return run(double{});
    case DType::F32: return run(float{});
    case DType::I64: return run(std::int64_t{});
    case DType::I32: return run(std::int32_t{});
    case DType::I16: return run(std::int16_t{});
    case DType::I8: return run(std::int8_t{});
    case DType::U8: case DType::Bool: return run(std::uint8_t{});
    default: throw IoError(cat("safetensors: cannot convert dtype ", dtype_name(t)));
  }
}

}  // namespace detail

class SafetensorsFile {
 public:
  static SafetensorsFile load(const std::string& path);
  // The header only (names, dtypes, shapes, metadata; validated as load() does against the file's
  // size), without reading the data: raw() and the readers then throw. For a reader that first
  // decides which of many files it needs (a sharded checkpoint's loader).
  static SafetensorsFile load_header(const std::string& path);
  bool has_data() const { return has_data_; }

  const std::string& path() const;
  bool has(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const;
  const std::byte* raw(const std::string& name) const;

  // The tensor converted to S (from any float, half, bfloat16 or integer dtype).
  template <class S>
  Tensor<S> tensor(const std::string& name) const {
    const TensorInfo& i = info(name);
    Tensor<S> out(i.shape);
    detail::convert_elements(raw(name), i.dtype, out.data(), static_cast<std::size_t>(i.shape.numel()));
    return out;
  }

  // Reads into an existing tensor, requiring the exact shape and dtype (what checkpoint loading
  // wants: a float32 model must not silently load float64 data and vice versa).
  template <class S, class D>
  void read_into(const std::string& name, Tensor<S, D>& dst) const {
    const TensorInfo& i = info(name);
    TESSERA_CHECK(i.shape == dst.shape(), IoError, "safetensors: '", path_, "': tensor '", name, "' has shape ",
                  i.shape, " in the file but ", dst.shape(), " in the model");
    TESSERA_CHECK(i.dtype == dtype_of<S>(), IoError, "safetensors: '", path_, "': tensor '", name, "' has dtype ",
                  dtype_name(i.dtype), " in the file but ", dtype_name(dtype_of<S>()), " in the model");
    D::copy_to_device(dst.data(), raw(name), i.end - i.begin);  // a plain copy on the CPU
    D::synchronize();
  }

 private:
  std::string path_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::byte> data_;
  bool has_data_ = false;
  static SafetensorsFile read(const std::string& path, bool with_data);
};

class SafetensorsWriter {
 public:
  template <class S, class D>
  void add(const std::string& name, const Tensor<S, D>& t) {
    if constexpr (D::host_accessible) {
      add_raw(name, dtype_of<S>(), t.shape(), t.data(), t.bytes());
    } else {
      const Tensor<S, Cpu> host = to_host(t);  // device memory: through a host copy
      add_raw(name, dtype_of<S>(), t.shape(), host.data(), host.bytes());
    }
  }
  void add_raw(const std::string& name, DType dtype, const Shape& shape, const void* data, std::size_t bytes);
  void set_metadata(const std::string& key, const std::string& value);

  // Atomic: write a fresh <path>.tmp.XXXXXX (mkostemp), fsync, rename over path, fsync the directory.
  void write(const std::string& path) const;

  // Removes the temporaries <path>.tmp.XXXXXX (exactly mkostemp's six letters or digits) that a
  // writer killed mid-write left behind: each is as large as the checkpoint, and a job killed at
  // every epoch would otherwise fill the disk. Called by write() before it creates its own.
  //
  // Which temporaries are stale: those whose flock can be taken. A live writer, in this process
  // (thread ranks) or another, holds the lock on its temporary from mkostemp until after the
  // rename; the kernel drops it when the writer dies, however it dies. An age threshold instead
  // would either wait long after a crash or delete a slow writer's file (a large checkpoint on
  // slow storage), and clocks differ between hosts on a shared file system. The one window, a
  // writer between mkostemp and its flock, is closed on the writer's side: it takes the lock
  // blocking and starts over when it finds its file unlinked. Files that are not regular files
  // (symlinks, directories) and other names are never touched. Best effort: errors are ignored.
  static void remove_stale_temporaries(const std::string& path);

 private:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<std::byte> bytes;
  };
  static std::string quote(const std::string& s);

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE detail::HeaderParser::HeaderParser(std::string_view text, std::string path) : s_(text), path_(std::move(path)) {}

TESSERA_LINKAGE auto detail::HeaderParser::parse(std::map<std::string, TensorInfo>& tensors, std::map<std::string, std::string>& metadata) -> void {
  expect('{');
  if (peek() == '}') { ++i_; return finish(); }
  for (;;) {
    std::string key = string();
    expect(':');
    if (key == "__metadata__") {
      expect('{');
      if (peek() != '}') {
        for (;;) {
          std::string k = string();
          expect(':');
          metadata[k] = string();
          if (peek() == ',') { ++i_; continue; }
          break;
        }
      }
      expect('}');
    } else {
      if (tensors.count(key)) fail("duplicate tensor name '" + key + "'");
      tensors[key] = entry(key);
    }
    if (peek() == ',') { ++i_; continue; }
    break;
  }
  expect('}');
  finish();
}

TESSERA_LINKAGE auto detail::HeaderParser::entry(const std::string& name) -> TensorInfo {
  TensorInfo info{DType::F32, Shape{}, 0, 0};
  bool has_dtype = false, has_shape = false, has_offsets = false;
  expect('{');
  for (;;) {
    std::string field = string();
    expect(':');
    if (field == "dtype") {
      info.dtype = parse_dtype(string(), name);
      has_dtype = true;
    } else if (field == "shape") {
      auto dims = integers();
      if (dims.size() > static_cast<std::size_t>(Shape::kMaxRank)) fail("tensor '" + name + "' has too many dimensions");
      try {
        for (auto d : dims) {
          if (d > static_cast<std::uint64_t>(INT64_MAX)) fail("tensor '" + name + "' has an extent beyond 2^63");
          info.shape.push_back(static_cast<std::int64_t>(d));
        }
      } catch (const ShapeError& e) {
        fail("tensor '" + name + "': " + e.what());
      }
      has_shape = true;
    } else if (field == "data_offsets") {
      auto off = integers();
      if (off.size() != 2) fail("tensor '" + name + "': data_offsets must have two entries");
      info.begin = off[0];
      info.end = off[1];
      has_offsets = true;
    } else {
      fail("tensor '" + name + "': unknown field '" + field + "'");
    }
    if (peek() == ',') { ++i_; continue; }
    break;
  }
  expect('}');
  if (!(has_dtype && has_shape && has_offsets)) fail("tensor '" + name + "' lacks dtype, shape or data_offsets");
  return info;
}

TESSERA_LINKAGE auto detail::HeaderParser::parse_dtype(const std::string& s, const std::string& name) -> DType {
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::I16, DType::I8,
                  DType::U8, DType::Bool})
    if (s == dtype_name(t)) return t;
  fail("tensor '" + name + "': unsupported dtype '" + s + "'");
  return DType::F32;
}

TESSERA_LINKAGE auto detail::HeaderParser::integers() -> std::vector<std::uint64_t> {
  std::vector<std::uint64_t> out;
  expect('[');
  if (peek() == ']') { ++i_; return out; }
  for (;;) {
    skip_ws();
    if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') fail("expected a non-negative integer");
    std::uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      if (v > (UINT64_MAX - 9) / 10) fail("integer overflow");
      v = v * 10 + static_cast<std::uint64_t>(s_[i_++] - '0');
    }
    out.push_back(v);
    if (peek() == ',') { ++i_; continue; }
    break;
  }
  expect(']');
  return out;
}

TESSERA_LINKAGE auto detail::HeaderParser::string() -> std::string {
  expect('"');
  std::string out;
  while (i_ < s_.size() && s_[i_] != '"') {
    char c = s_[i_++];
    if (c == '\\') {
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          unsigned code = 0;
          for (int h = 0; h < 4; ++h) {
            const char x = s_[i_++];
            const int digit = (x >= '0' && x <= '9') ? x - '0' : (x >= 'a' && x <= 'f') ? x - 'a' + 10
                            : (x >= 'A' && x <= 'F') ? x - 'A' + 10 : -1;
            if (digit < 0) fail("bad hex digit in \\u escape");
            code = code * 16 + static_cast<unsigned>(digit);
          }
          if (code < 0x80) out += static_cast<char>(code);
          else if (code < 0x800) { out += static_cast<char>(0xC0 | (code >> 6)); out += static_cast<char>(0x80 | (code & 0x3F)); }
          else { out += static_cast<char>(0xE0 | (code >> 12)); out += static_cast<char>(0x80 | ((code >> 6) & 0x3F)); out += static_cast<char>(0x80 | (code & 0x3F)); }
          break;
        }
        default: fail("bad escape");
      }
    } else {
      out += c;
    }
  }
  expect('"');
  return out;
}

TESSERA_LINKAGE auto detail::HeaderParser::skip_ws() -> void {
  while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
}

TESSERA_LINKAGE auto detail::HeaderParser::peek() -> char {
  skip_ws();
  return i_ < s_.size() ? s_[i_] : '\0';
}

TESSERA_LINKAGE auto detail::HeaderParser::expect(char c) -> void {
  if (peek() != c) fail(std::string("expected '") + c + "'");
  ++i_;
}

TESSERA_LINKAGE auto detail::HeaderParser::finish() -> void {
  skip_ws();
  if (i_ != s_.size()) fail("trailing characters after the header object");
}

[[noreturn]] TESSERA_LINKAGE auto detail::HeaderParser::fail(const std::string& msg) -> void {
  throw IoError(cat("safetensors: ", path_, ": malformed header at byte ", i_, ": ", msg));
}

TESSERA_LINKAGE SafetensorsFile SafetensorsFile::load(const std::string& path) { return read(path, true); }
TESSERA_LINKAGE SafetensorsFile SafetensorsFile::load_header(const std::string& path) { return read(path, false); }

TESSERA_LINKAGE SafetensorsFile SafetensorsFile::read(const std::string& path, bool with_data) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, IoError, "safetensors: cannot open '", path, "': ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const auto file_size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  TESSERA_CHECK(file_size >= 8, IoError, "safetensors: '", path, "' is ", file_size,
                " bytes, shorter than the 8-byte header length (truncated file?)");
  std::uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  TESSERA_CHECK(header_len <= file_size - 8, IoError, "safetensors: '", path, "' declares a ", header_len,
                "-byte header but only ", file_size - 8, " bytes follow (truncated or not a safetensors file)");
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));

  SafetensorsFile f;
  f.path_ = path;
  detail::HeaderParser(header, path).parse(f.tensors_, f.metadata_);

  const std::uint64_t data_size = file_size - 8 - header_len;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (auto& [name, info] : f.tensors_) {
    const auto expected = static_cast<std::uint64_t>(info.shape.numel()) * dtype_size(info.dtype);
    TESSERA_CHECK(info.begin <= info.end && info.end - info.begin == expected, IoError, "safetensors: '", path,
                  "': tensor '", name, "' of shape ", info.shape, " and dtype ", dtype_name(info.dtype), " needs ",
                  expected, " bytes but data_offsets [", info.begin, ", ", info.end, "] span ",
                  info.end - info.begin);
    TESSERA_CHECK(info.end <= data_size, IoError, "safetensors: '", path, "': tensor '", name, "' ends at byte ",
                  info.end, " of a ", data_size, "-byte data buffer (truncated file?)");
    ranges.emplace_back(info.begin, info.end);
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    TESSERA_CHECK(ranges[i].first >= ranges[i - 1].second, IoError, "safetensors: '", path,
                  "': tensors overlap at byte ", ranges[i].first);

  if (!with_data) return f;
  f.has_data_ = true;
  f.data_.resize(data_size);
  in.read(reinterpret_cast<char*>(f.data_.data()), static_cast<std::streamsize>(data_size));
  TESSERA_CHECK(static_cast<std::uint64_t>(in.gcount()) == data_size, IoError, "safetensors: '", path,
                "': read ", in.gcount(), " of ", data_size, " data bytes");
  return f;
}

TESSERA_LINKAGE const std::string& SafetensorsFile::path() const { return path_; }

TESSERA_LINKAGE bool SafetensorsFile::has(const std::string& name) const { return tensors_.count(name) != 0; }

TESSERA_LINKAGE const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  TESSERA_CHECK(it != tensors_.end(), IoError, "safetensors: '", path_, "' has no tensor '", name, "'");
  return it->second;
}

TESSERA_LINKAGE std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (auto& [name, info] : tensors_) out.push_back(name);
  return out;
}

TESSERA_LINKAGE const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return metadata_; }

TESSERA_LINKAGE const std::byte* SafetensorsFile::raw(const std::string& name) const {
  TESSERA_CHECK(has_data_, Error, "safetensors: '", path_, "' was read with load_header(): its tensor '", name,
                "' has no data here (read the file with load())");
  return data_.data() + info(name).begin;
}

TESSERA_LINKAGE void SafetensorsWriter::add_raw(const std::string& name, DType dtype, const Shape& shape, const void* data, std::size_t bytes) {
  TESSERA_CHECK(bytes == static_cast<std::size_t>(shape.numel()) * dtype_size(dtype), IoError,
                "SafetensorsWriter: '", name, "' has ", bytes, " bytes for shape ", shape);
  for (auto& e : entries_)
    TESSERA_CHECK(e.name != name, IoError, "SafetensorsWriter: duplicate tensor name '", name, "'");
  const auto* p = static_cast<const std::byte*>(data);
  entries_.push_back({name, dtype, shape, std::vector<std::byte>(p, p + bytes)});
}

TESSERA_LINKAGE void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

TESSERA_LINKAGE void SafetensorsWriter::write(const std::string& path) const {
  std::string header = "{";
  if (!metadata_.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (auto& [k, v] : metadata_) {
      if (!first) header += ",";
      first = false;
      header += quote(k) + ":" + quote(v);
    }
    header += "}";
  }
  std::size_t offset = 0;
  for (auto& e : entries_) {
    if (header.size() > 1) header += ",";
    header += quote(e.name) + ":{\"dtype\":\"" + std::string(dtype_name(e.dtype)) + "\",\"shape\":[";
    for (int i = 0; i < e.shape.rank(); ++i) {
      if (i) header += ',';
      header += std::to_string(e.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + e.bytes.size()) + "]}";
    offset += e.bytes.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';  // keeps the data buffer 8-byte aligned, as the reference writer does

  remove_stale_temporaries(path);
  // A unique temporary beside the target (same file system, so rename is atomic); concurrent
  // writers in one process (thread ranks) never share it. It stays locked (flock) from creation
  // until after the rename, which is how remove_stale_temporaries tells it from a dead writer's.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = path + ".tmp.XXXXXX";
    fd = ::mkostemp(tmp.data(), O_CLOEXEC);
    TESSERA_CHECK(fd >= 0, IoError, "safetensors: cannot create a temporary file next to '", path, "': ",
                  std::strerror(errno));
    // Blocking: another writer's cleanup may hold the lock for the instant between mkostemp and
    // here. If it did, it has unlinked the file by the time we get the lock (st_nlink == 0):
    // start over with a fresh name.
    struct stat st {};
    while (::flock(fd, LOCK_EX) != 0 && errno == EINTR) {}
    if (::fstat(fd, &st) == 0 && st.st_nlink == 0) {
      ::close(fd);
      fd = -1;
      TESSERA_CHECK(attempt < 100, IoError, "safetensors: temporary files next to '", path,
                    "' keep disappearing (another program deleting them?)");
    }
  }
  ::fchmod(fd, 0644);
  auto write_all = [&](const void* p, std::size_t n) {
    const auto* bytes = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd, bytes, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        ::close(fd);
        throw IoError(detail::cat("safetensors: writing '", tmp, "' failed: ", std::strerror(err)));
      }
      bytes += w;
      n -= static_cast<std::size_t>(w);
    }
  };
  const std::uint64_t header_len = header.size();
  write_all(&header_len, 8);
  write_all(header.data(), header.size());
  for (auto& e : entries_) write_all(e.bytes.data(), e.bytes.size());
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    throw IoError(detail::cat("safetensors: flushing '", tmp, "' failed: ", std::strerror(err)));
  }
  // Renamed while still open and locked, so no cleanup can take the temporary in between.
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    throw IoError(detail::cat("safetensors: renaming '", tmp, "' to '", path, "' failed: ", std::strerror(err)));
  }
  ::close(fd);  // releases the lock; the data was synced above, so close has nothing left to report
  auto dir = std::filesystem::path(path).parent_path();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {  // makes the rename itself durable; best effort (some file systems refuse)
    ::fsync(dfd);
    ::close(dfd);
  }
}

TESSERA_LINKAGE void SafetensorsWriter::remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string prefix = target.filename().string() + ".tmp.";
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() != prefix.size() + 6 || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (!std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(), [](char c) {
          return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        }))
      continue;
    const std::string full = (dir / name).string();
    const int fd = ::open(full.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat held {}, now {};
    // Unlink only if the name still refers to the file we locked (not one renamed into place).
    if (::fstat(fd, &held) == 0 && S_ISREG(held.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        ::lstat(full.c_str(), &now) == 0 && now.st_ino == held.st_ino && now.st_dev == held.st_dev)
      ::unlink(full.c_str());
    ::close(fd);
  }
}

TESSERA_LINKAGE std::string SafetensorsWriter::quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
