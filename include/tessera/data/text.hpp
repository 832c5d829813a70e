// Text for language models: a byte-level tokenizer, token files as nanoGPT writes them, memory-mapped
// and sharded per rank, random training windows, and corpora from Debian packages.
//
//   ByteTokenizer         one token per byte: vocabulary 256, no files; decode(encode(s)) == s for
//                         any bytes (UTF-8 text is several tokens per non-ASCII character).
//   write_token_file      ids as little-endian uint16 with no header: nanoGPT's train.bin / val.bin
//                         (np.array(ids, dtype=np.uint16).tofile). Atomic (temporary file + rename).
//   TokenFile             such a file, memory-mapped read-only. Opening checks the size (a whole
//                         number of uint16, at least one) and, given a vocabulary size, every token:
//                         a corrupt file fails there, naming the file and the token's index.
//   TokenFile::shard      rank r of w: the contiguous tokens [n r / w, n (r + 1) / w) (data parallel
//                         ranks each draw windows from their own part).
//   TokenWindows          nanoGPT's get_batch: B windows at offsets drawn uniformly from
//                         [0, n - T), x = tokens[i, i + T) and y = tokens[i + 1, i + T + 1] (the next
//                         token at every position), as int64 ids (B, T) row-major.
//   TextCorpus            a Debian package's text files (fortunes: /usr/share/games/fortunes), read
//                         in name order; a missing package is an IoError that names it and the
//                         apt-get command. prepare_byte_corpus writes train.bin and val.bin (the last
//                         val_fraction of the bytes, nanoGPT's shakespeare_char split).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/random.hpp"

namespace tessera {

class ByteTokenizer {
 public:
  static constexpr std::int64_t vocab_size = 256;
  static std::vector<std::int64_t> encode(std::string_view text) {
    std::vector<std::int64_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  // Ids outside [0, 256) are an ArgumentError naming the first such index.
  static std::string decode(std::span<const std::int64_t> ids) {
    std::string text(ids.size(), '\0');
    for (std::size_t i = 0; i < ids.size(); ++i) {
      TESSERA_CHECK(ids[i] >= 0 && ids[i] < vocab_size, ArgumentError, "ByteTokenizer::decode: ids[", i, "] = ", ids[i],
                    " is not a byte (expected [0, 256))");
      text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
    }
    return text;
  }
};

// A contiguous run of a token file: tokens [offset, offset + size) of the file.
struct TokenSpan {
  const std::uint16_t* data = nullptr;
  std::int64_t size = 0;
  std::int64_t offset = 0;
  std::int64_t operator[](std::int64_t i) const { return data[i]; }
};

TESSERA_LINKAGE void write_token_file(const std::filesystem::path& path, std::span<const std::int64_t> ids);

class TokenFile {
 public:
  // vocab_size > 0: every token is checked against it (one pass over the file).
  TESSERA_LINKAGE explicit TokenFile(const std::filesystem::path& path, std::int64_t vocab_size = 0);
  TESSERA_LINKAGE ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  TESSERA_LINKAGE TokenFile(TokenFile&& other) noexcept;
  TESSERA_LINKAGE TokenFile& operator=(TokenFile&& other) noexcept;

  std::int64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  TokenSpan all() const { return {data_, size_, 0}; }
  TESSERA_LINKAGE TokenSpan shard(int rank, int world) const;

 private:
  std::filesystem::path path_;
  const std::uint16_t* data_ = nullptr;
  std::int64_t size_ = 0;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
};

class TokenWindows {
 public:
  TESSERA_LINKAGE TokenWindows(TokenSpan tokens, std::int64_t block_size, std::uint64_t seed);
  // x and y: batch * block_size ids each, row-major (B, T).
  TESSERA_LINKAGE void next(std::int64_t batch, std::vector<std::int64_t>& x, std::vector<std::int64_t>& y);
  std::int64_t block_size() const { return block_; }

 private:
  TokenSpan tokens_;
  std::int64_t block_;
  Rng rng_;
};

// Where a package installs its text, and which package that is.
struct TextCorpus {
  std::string name;            // "fortunes"
  std::string package;         // the Debian package to install
  std::filesystem::path dir;   // its text files (regular files; *.dat indexes and symlinks skipped)
  static TextCorpus fortunes() { return {"fortunes", "fortunes", "/usr/share/games/fortunes"}; }
};

// The corpus's text, its files concatenated in name order.
TESSERA_LINKAGE std::string read_text_corpus(const TextCorpus& corpus);

struct PreparedCorpus {
  std::filesystem::path train, val;
  std::int64_t train_tokens = 0, val_tokens = 0;
};
// Byte tokens of the corpus into out_dir/train.bin and out_dir/val.bin (the last val_fraction).
TESSERA_LINKAGE PreparedCorpus prepare_byte_corpus(const TextCorpus& corpus, const std::filesystem::path& out_dir,
                                                   double val_fraction = 0.1);

}  // namespace tessera

#if TESSERA_HEADER_DEFINITIONS
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

namespace tessera {

TESSERA_LINKAGE void write_token_file(const std::filesystem::path& path, std::span<const std::int64_t> ids) {
  std::vector<std::uint16_t> words(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    TESSERA_CHECK(ids[i] >= 0 && ids[i] <= 0xFFFF, ArgumentError, "write_token_file(", path.string(), "): ids[", i,
                  "] = ", ids[i], " does not fit a uint16 token");
    const auto v = static_cast<std::uint16_t>(ids[i]);
    const unsigned char le[2] = {static_cast<unsigned char>(v & 0xFF), static_cast<unsigned char>(v >> 8)};
    std::memcpy(&words[i], le, 2);  // little-endian on any host, as numpy's '<u2'
  }
  // A temporary name of this process's own: two programs preparing the same corpus at once (the
  // threads, MPI and Gloo builds of one example in a parallel test run) each rename a whole file.
  const std::filesystem::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out.good(), IoError, "write_token_file: cannot create ", tmp.string(), ": ", std::strerror(errno));
    out.write(reinterpret_cast<const char*>(words.data()), static_cast<std::streamsize>(words.size() * 2));
    out.flush();
    TESSERA_CHECK(out.good(), IoError, "write_token_file: writing ", tmp.string(), " failed: ", std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  TESSERA_CHECK(!ec, IoError, "write_token_file: cannot rename ", tmp.string(), " to ", path.string(), ": ",
                ec.message());
}

TESSERA_LINKAGE TokenFile::TokenFile(const std::filesystem::path& path, std::int64_t vocab_size) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, IoError, "token file ", path.string(), ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw IoError(detail::cat("token file ", path.string(), ": cannot stat: ", std::strerror(e)));
  }
  const auto bytes = static_cast<std::int64_t>(st.st_size);
  if (bytes <= 0 || bytes % 2 != 0) {
    ::close(fd);
    throw IoError(detail::cat("token file ", path.string(), ": corrupt: ", bytes,
                              " bytes is not a whole, non-zero number of uint16 tokens"));
  }
  void* map = ::mmap(nullptr, static_cast<std::size_t>(bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);  // the mapping keeps the file
  TESSERA_CHECK(map != MAP_FAILED, IoError, "token file ", path.string(), ": cannot map: ", std::strerror(e));
  map_ = map;
  map_bytes_ = static_cast<std::size_t>(bytes);
  data_ = static_cast<const std::uint16_t*>(map);
  size_ = bytes / 2;
  if (vocab_size > 0) {
    const auto* bad = std::find_if(data_, data_ + size_, [&](std::uint16_t t) { return t >= vocab_size; });
    if (bad != data_ + size_) {
      const std::int64_t at = bad - data_, value = *bad;
      ::munmap(map_, map_bytes_);
      map_ = nullptr;
      throw IoError(detail::cat("token file ", path.string(), ": corrupt: token ", at, " is ", value,
                                ", outside the vocabulary of ", vocab_size));
    }
  }
}

TESSERA_LINKAGE TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

TESSERA_LINKAGE TokenFile::TokenFile(TokenFile&& o) noexcept
    : path_(std::move(o.path_)), data_(o.data_), size_(o.size_), map_(o.map_), map_bytes_(o.map_bytes_) {
  o.map_ = nullptr;
  o.data_ = nullptr;
  o.size_ = 0;
}

TESSERA_LINKAGE TokenFile& TokenFile::operator=(TokenFile&& o) noexcept {
  if (this != &o) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(o.path_);
    data_ = o.data_;
    size_ = o.size_;
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    o.map_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

TESSERA_LINKAGE TokenSpan TokenFile::shard(int rank, int world) const {
  TESSERA_CHECK(world > 0 && rank >= 0 && rank < world, ArgumentError, "token file ", path_.string(), ": shard ", rank,
                " of ", world, " does not exist");
  const std::int64_t begin = size_ * rank / world, end = size_ * (rank + 1) / world;
  return {data_ + begin, end - begin, begin};
}

TESSERA_LINKAGE TokenWindows::TokenWindows(TokenSpan tokens, std::int64_t block_size, std::uint64_t seed)
    : tokens_(tokens), block_(block_size), rng_(seed) {
  TESSERA_CHECK(block_size > 0 && tokens.size > block_size, ArgumentError, "TokenWindows: ", tokens.size,
                " tokens (from offset ", tokens.offset, ") hold no window of ", block_size,
                " tokens plus its next token");
}

TESSERA_LINKAGE void TokenWindows::next(std::int64_t batch, std::vector<std::int64_t>& x,
                                        std::vector<std::int64_t>& y) {
  TESSERA_CHECK(batch > 0, ArgumentError, "TokenWindows::next: batch=", batch, " must be positive");
  x.resize(static_cast<std::size_t>(batch * block_));
  y.resize(x.size());
  const auto starts = static_cast<std::uint64_t>(tokens_.size - block_);  // offsets [0, n - T)
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto i = static_cast<std::int64_t>(rng_.below(starts));
    for (std::int64_t t = 0; t < block_; ++t) {
      x[static_cast<std::size_t>(b * block_ + t)] = tokens_[i + t];
      y[static_cast<std::size_t>(b * block_ + t)] = tokens_[i + t + 1];
    }
  }
}

TESSERA_LINKAGE std::string read_text_corpus(const TextCorpus& corpus) {
  std::error_code ec;
  TESSERA_CHECK(std::filesystem::is_directory(corpus.dir, ec), IoError, "the text corpus '", corpus.name,
                "' is not installed (no directory ", corpus.dir.string(), "): apt-get install ", corpus.package);
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(corpus.dir, ec)) {
    const auto ext = entry.path().extension();
    if (entry.is_symlink() || !entry.is_regular_file() || ext == ".dat" || ext == ".u8") continue;
    files.push_back(entry.path());
  }
  TESSERA_CHECK(!ec, IoError, "the text corpus '", corpus.name, "': cannot list ", corpus.dir.string(), ": ",
                ec.message());
  TESSERA_CHECK(!files.empty(), IoError, "the text corpus '", corpus.name, "' has no text files in ",
                corpus.dir.string(), ": reinstall it (apt-get install --reinstall ", corpus.package, ")");
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    TESSERA_CHECK(in.good(), IoError, "the text corpus '", corpus.name, "': cannot read ", f.string());
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return text;
}

TESSERA_LINKAGE PreparedCorpus prepare_byte_corpus(const TextCorpus& corpus, const std::filesystem::path& out_dir,
                                                   double val_fraction) {
  TESSERA_CHECK(val_fraction > 0 && val_fraction < 1, ArgumentError, "prepare_byte_corpus: val_fraction=",
                val_fraction, " must lie in (0, 1)");
  const std::vector<std::int64_t> ids = ByteTokenizer::encode(read_text_corpus(corpus));
  const auto n = static_cast<std::int64_t>(ids.size());
  const auto n_train = static_cast<std::int64_t>(static_cast<double>(n) * (1.0 - val_fraction));
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  TESSERA_CHECK(!ec, IoError, "prepare_byte_corpus: cannot create ", out_dir.string(), ": ", ec.message());
  PreparedCorpus p{out_dir / "train.bin", out_dir / "val.bin", n_train, n - n_train};
  write_token_file(p.train, std::span<const std::int64_t>(ids).first(static_cast<std::size_t>(n_train)));
  write_token_file(p.val, std::span<const std::int64_t>(ids).subspan(static_cast<std::size_t>(n_train)));
  return p;
}

}  // namespace tessera
#endif  // TESSERA_HEADER_DEFINITIONS
