// Shared pieces of the fuzz harnesses (libFuzzer entry points, one per parser; see README.md).
//
// The parsers under test read files by path, so each input is written to one in-memory file
// (memfd, no disk I/O) that is opened again through /proc/self/fd/N, exactly as a user's path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tessera_fuzz {

// One memfd per process, rewritten for each input; path() names it for the readers.
class MemFile {
 public:
  MemFile() {
    fd_ = ::memfd_create("tessera-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  const std::string& write(const std::uint8_t* data, std::size_t size) {
    if (::ftruncate(fd_, 0) != 0) std::abort();
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) std::abort();
      done += static_cast<std::size_t>(n);
    }
    return path_;
  }

 private:
  int fd_ = -1;
  std::string path_;
};

inline MemFile& mem_file() {
  static MemFile* f = new MemFile();  // leaked: lives as long as the fuzzer
  return *f;
}

}  // namespace tessera_fuzz
