// Fuzz target: read_idx (include/tessera/data/idx.hpp), plain and gzip IDX files.
// Expected: an IdxArray whose data holds prod(dims) bytes with rank 1..4, or an IoError. Anything
// else (a crash, a sanitizer report, another exception, a broken invariant) is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fuzz_util.hpp"
#include "tessera/data/idx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = tessera_fuzz::mem_file().write(data, size);
  try {
    const tessera::IdxArray a = tessera::read_idx(path);
    std::uint64_t total = 1;
    for (auto d : a.dims) total *= static_cast<std::uint64_t>(d);
    if (a.dims.empty() || a.dims.size() > 4 || total != a.data.size()) {
      std::fprintf(stderr, "read_idx returned %zu dims and %zu bytes for prod(dims) = %llu\n", a.dims.size(),
                   a.data.size(), static_cast<unsigned long long>(total));
      std::abort();
    }
  } catch (const tessera::IoError&) {
  }
  return 0;
}
