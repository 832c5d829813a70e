// Small helpers shared by the test sources (one unity chunk may hold several of them, so a helper
// defined in two sources would clash: tests/meson.build).
#pragma once

#include <string>
#include <vector>

namespace tessera::testing {

// The lines, each ending in a newline: a failure list as one INFO message.
inline std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

}  // namespace tessera::testing
