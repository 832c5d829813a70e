// read_idx: the IDX format of MNIST and Fashion-MNIST, gzip-compressed or plain.
//
// Format: bytes 0 0 <type> <rank>, then <rank> big-endian uint32 extents, then the row-major
// payload of prod(extents) elements. Only type 0x08 (unsigned byte) is supported: it is all the
// MNIST family uses.
//
// Requires: zlib (link with -lz). Ensures: the returned array has dims.size() == rank (1..4) and
// data.size() == prod(dims). Any other input (bad magic, unsupported type, bad rank, truncated
// header or payload, trailing bytes, corrupt or truncated gzip) throws IoError naming the path and
// what was expected. Memory grows with the data actually present (at most twice it), never with
// the extents a header claims, so hostile or corrupt files fail cleanly instead of exhausting memory.
//
// read_idx(file, max_records) keeps only the first max_records entries along the first extent
// (0: all). A gzip file is then inflated only that far, which is what makes a run with --limit
// start in milliseconds instead of inflating and converting all 60,000 images first; the rest of
// a gzip file is not read, so its CRC-32 is not checked (a plain file's size still is).
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera {

struct IdxArray {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data;  // row-major, prod(dims) bytes
  std::int64_t records_in_file = 0;  // the header's first extent (dims[0] unless cut by max_records)

  std::int64_t numel() const { return static_cast<std::int64_t>(data.size()); }
};

namespace detail {

TESSERA_LINKAGE std::string idx_type_name(unsigned type);

TESSERA_LINKAGE std::string hex_byte(unsigned b);

// A byte stream over a file, inflating it when it is gzip. read() returns fewer bytes than asked
// only at the end of the data; errors (I/O, zlib) throw IoError with the path.
class IdxByteSource {
 public:
  explicit IdxByteSource(const std::string& path);
  ~IdxByteSource();
  IdxByteSource(const IdxByteSource&) = delete;
  IdxByteSource& operator=(const IdxByteSource&) = delete;

  bool gzip() const;
  const std::string& path() const;

  std::size_t read(std::uint8_t* dst, std::size_t n);

  // Bytes left in a plain file (exact); for gzip, whether at least one more byte decompresses.
  std::uint64_t remaining_plain();

 private:
  static constexpr std::size_t kChunk = std::size_t{1} << 16;

  void refill();

  // Makes at least two input bytes visible when the file has them (to test for a gzip magic).
  void ensure_two_input_bytes();

  std::size_t inflate_into(std::uint8_t* dst, std::size_t n);

  std::string path_;
  std::FILE* file_ = nullptr;
  bool gzip_ = false;
  bool file_eof_ = false;
  bool stream_end_ = false;
  std::uint64_t produced_ = 0;
  z_stream zs_{};
  std::vector<Bytef> in_;
};

}  // namespace detail

TESSERA_LINKAGE IdxArray read_idx(const std::filesystem::path& file, std::int64_t max_records = 0);

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE auto detail::idx_type_name(unsigned type) -> std::string {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "";
  }
}

TESSERA_LINKAGE auto detail::hex_byte(unsigned b) -> std::string {
  static constexpr char digits[] = "0123456789abcdef";
  return std::string("0x") + digits[(b >> 4) & 0xF] + digits[b & 0xF];
}

TESSERA_LINKAGE IdxArray read_idx(const std::filesystem::path& file, std::int64_t max_records) {
  const std::string path = file.string();
  TESSERA_CHECK(max_records >= 0, ArgumentError, "read_idx(", path, "): max_records is ", max_records,
                "; it must be >= 0 (0 reads every record)");
  detail::IdxByteSource src(path);
  const std::string where = "read_idx(" + path + (src.gzip() ? ", gzip" : "") + "): ";

  std::array<std::uint8_t, 4> magic{};
  const auto got_magic = src.read(magic.data(), magic.size());
  TESSERA_CHECK(got_magic == magic.size(), IoError, where, "file too short for the 4-byte IDX magic (",
                got_magic, " bytes)");
  TESSERA_CHECK(magic[0] == 0 && magic[1] == 0, IoError, where, "bad magic ", detail::hex_byte(magic[0]), " ",
                detail::hex_byte(magic[1]), ": an IDX file starts with 0x00 0x00 <type> <rank>; not an IDX file?");
  const unsigned type = magic[2];
  const std::string type_name = detail::idx_type_name(type);
  TESSERA_CHECK(!type_name.empty(), IoError, where, "invalid element type code ", detail::hex_byte(type),
                " (IDX defines 0x08, 0x09, 0x0b, 0x0c, 0x0d, 0x0e)");
  TESSERA_CHECK(type == 0x08, IoError, where, "unsupported element type ", detail::hex_byte(type), " (",
                type_name, "); only 0x08 (unsigned byte) is supported");
  const int rank = magic[3];
  TESSERA_CHECK(rank >= 1 && rank <= 4, IoError, where, "rank ", rank, " is outside 1..4");

  std::array<std::uint8_t, 16> header{};
  const auto header_bytes = static_cast<std::size_t>(4 * rank);
  const auto got_header = src.read(header.data(), header_bytes);
  TESSERA_CHECK(got_header == header_bytes, IoError, where, "truncated header: expected ", header_bytes,
                " bytes of extents for rank ", rank, ", got ", got_header);

  IdxArray out;
  std::uint64_t total = 1;
  std::string dims_text = "(";
  for (int i = 0; i < rank; ++i) {
    const std::uint8_t* b = header.data() + 4 * i;
    const std::uint64_t d = (std::uint64_t{b[0]} << 24) | (std::uint64_t{b[1]} << 16) | (std::uint64_t{b[2]} << 8) | b[3];
    out.dims.push_back(static_cast<std::int64_t>(d));
    dims_text += (i ? ", " : "") + std::to_string(d);
    // Extents are < 2^32, so the product overflows 2^62 only past a size no file can have.
    TESSERA_CHECK(d == 0 || total <= (std::uint64_t{1} << 62) / d, IoError, where, "extents ", dims_text,
                  "...) describe an impossibly large array");
    total *= d;
  }
  dims_text += ")";
  out.records_in_file = out.dims[0];
  // The bytes kept: the first max_records records when that cuts the file, else all of them.
  const bool cut = max_records > 0 && max_records < out.dims[0];
  const std::uint64_t keep = cut ? total / static_cast<std::uint64_t>(out.dims[0]) * static_cast<std::uint64_t>(max_records)
                                 : total;
  if (cut) out.dims[0] = max_records;

  const std::size_t header_total = 4 + header_bytes;
  if (!src.gzip()) {
    // A plain file's size is known: check before allocating, so a bogus header costs nothing.
    const std::uint64_t left = src.remaining_plain();
    TESSERA_CHECK(left >= total, IoError, where, "truncated payload: extents ", dims_text, " need ", total,
                  " bytes after the ", header_total, "-byte header, but the file holds only ", left);
    TESSERA_CHECK(left == total, IoError, where, left - total, " trailing bytes after the ", total,
                  "-byte payload of extents ", dims_text, " (wrong extents in the header?)");
    out.data.resize(keep);
    const auto got = src.read(out.data.data(), keep);
    TESSERA_CHECK(got == keep, IoError, where, "truncated payload: expected ", keep, " bytes, got ", got);
    return out;
  }

  // gzip: the decompressed size is unknown until read, so the buffer grows with the data that
  // actually arrives (a header that lies about its extents cannot make us allocate gigabytes).
  std::uint64_t have = 0;
  while (have < keep) {
    const std::uint64_t want = std::min<std::uint64_t>(keep - have, std::clamp<std::uint64_t>(have, 1 << 20, 1 << 30));
    out.data.resize(have + want);
    const auto got = src.read(out.data.data() + have, want);
    have += got;
    if (got < want) break;
  }
  TESSERA_CHECK(have == keep, IoError, where, "truncated payload: extents ", dims_text, " need ", total,
                " bytes after the ", header_total, "-byte header, but the decompressed file holds only ", have);
  if (cut) return out;  // the first max_records records are all that was asked for
  std::uint8_t extra = 0;
  // Reading one more byte also drives zlib through the gzip trailer, which verifies the CRC-32.
  TESSERA_CHECK(src.read(&extra, 1) == 0, IoError, where, "trailing bytes after the ", total,
                "-byte payload of extents ", dims_text, " (wrong extents in the header?)");
  return out;
}

TESSERA_LINKAGE detail::IdxByteSource::IdxByteSource(const std::string& path) : path_(path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  TESSERA_CHECK(!ec && std::filesystem::exists(status), IoError, "read_idx(", path_, "): file not found");
  TESSERA_CHECK(!std::filesystem::is_directory(status), IoError, "read_idx(", path_,
                "): is a directory, expected an IDX file");
  in_.resize(kChunk);
  file_ = std::fopen(path.c_str(), "rb");
  TESSERA_CHECK(file_ != nullptr, IoError, "read_idx(", path_, "): cannot open the file: ", std::strerror(errno));
  std::array<unsigned char, 2> magic{};
  const auto got = std::fread(magic.data(), 1, magic.size(), file_);
  gzip_ = got == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  std::rewind(file_);
  if (gzip_) {
    // 15 + 16: a gzip wrapper only (the magic said so), with its CRC-32 and length checked.
    if (inflateInit2(&zs_, 15 + 16) != Z_OK) {
      std::fclose(file_);
      throw IoError(detail::cat("read_idx(", path_, "): zlib inflateInit2 failed: ", zs_.msg ? zs_.msg : "out of memory"));
    }
  }
}

TESSERA_LINKAGE detail::IdxByteSource::~IdxByteSource() {
  if (gzip_) inflateEnd(&zs_);
  if (file_) std::fclose(file_);
}

TESSERA_LINKAGE auto detail::IdxByteSource::gzip() const -> bool { return gzip_; }

TESSERA_LINKAGE auto detail::IdxByteSource::path() const -> const std::string& { return path_; }

TESSERA_LINKAGE auto detail::IdxByteSource::read(std::uint8_t* dst, std::size_t n) -> std::size_t {
  if (!gzip_) {
    const auto got = std::fread(dst, 1, n, file_);
    TESSERA_CHECK(got == n || !std::ferror(file_), IoError, "read_idx(", path_, "): read error");
    return got;
  }
  return inflate_into(dst, n);
}

TESSERA_LINKAGE auto detail::IdxByteSource::remaining_plain() -> std::uint64_t {
  const long here = std::ftell(file_);
  std::fseek(file_, 0, SEEK_END);
  const long end = std::ftell(file_);
  std::fseek(file_, here, SEEK_SET);
  return here >= 0 && end >= here ? static_cast<std::uint64_t>(end - here) : 0;
}

TESSERA_LINKAGE auto detail::IdxByteSource::refill() -> void {
  const auto got = std::fread(in_.data(), 1, in_.size(), file_);
  TESSERA_CHECK(got > 0 || !std::ferror(file_), IoError, "read_idx(", path_, "): read error");
  if (got == 0) file_eof_ = true;
  zs_.next_in = in_.data();
  zs_.avail_in = static_cast<uInt>(got);
}

TESSERA_LINKAGE auto detail::IdxByteSource::ensure_two_input_bytes() -> void {
  if (zs_.avail_in >= 2 || file_eof_) return;
  if (zs_.avail_in == 1) in_[0] = *zs_.next_in;
  const std::size_t kept = zs_.avail_in;
  const auto got = std::fread(in_.data() + kept, 1, in_.size() - kept, file_);
  TESSERA_CHECK(got > 0 || !std::ferror(file_), IoError, "read_idx(", path_, "): read error");
  if (got == 0) file_eof_ = true;
  zs_.next_in = in_.data();
  zs_.avail_in = static_cast<uInt>(kept + got);
}

TESSERA_LINKAGE auto detail::IdxByteSource::inflate_into(std::uint8_t* dst, std::size_t n) -> std::size_t {
  zs_.next_out = dst;
  zs_.avail_out = static_cast<uInt>(n);
  while (zs_.avail_out > 0) {
    if (stream_end_) {
      // A gzip file may hold several members back to back (as `cat a.gz b.gz` makes); anything
      // else after the end of the stream is garbage.
      ensure_two_input_bytes();
      if (zs_.avail_in == 0) break;
      TESSERA_CHECK(zs_.avail_in >= 2 && zs_.next_in[0] == 0x1f && zs_.next_in[1] == 0x8b, IoError,
                    "read_idx(", path_, "): trailing bytes after the end of the gzip stream that are not "
                    "another gzip member (corrupt file?)");
      inflateReset(&zs_);
      stream_end_ = false;
    }
    if (zs_.avail_in == 0 && !file_eof_) refill();
    if (zs_.avail_in == 0 && file_eof_) {
      throw IoError(cat("read_idx(", path_, "): the gzip stream ends early after ",
                        produced_ + (n - zs_.avail_out), " decompressed bytes (file truncated?)"));
    }
    const int ret = ::inflate(&zs_, Z_NO_FLUSH);
    if (ret == Z_STREAM_END) {
      stream_end_ = true;
    } else if (ret != Z_OK && !(ret == Z_BUF_ERROR && zs_.avail_in == 0)) {
      throw IoError(cat("read_idx(", path_, "): corrupt gzip data (zlib: ", zs_.msg ? zs_.msg : zError(ret),
                        ") after ", produced_ + (n - zs_.avail_out), " decompressed bytes"));
    }
  }
  produced_ += n - zs_.avail_out;
  return n - zs_.avail_out;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
