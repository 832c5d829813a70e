// TempDir: a fresh directory under the system temp dir, removed with its contents at scope exit.
// `dir / "name"` is the path of a file in it.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

#include <unistd.h>

namespace tessera::testing {

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("tessera_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

}  // namespace tessera::testing
