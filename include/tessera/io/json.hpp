// JSON string escaping shared by the writers of JSON lines and traces (train/metrics.hpp,
// train/timeline.hpp): quotes and backslashes escaped, control characters as \u00XX, which JSON
// forbids raw (RFC 8259, section 7). Bytes >= 0x80 pass through: the strings are UTF-8 already.
#pragma once

#include <cstdio>
#include <string>

namespace tessera::detail {

inline std::string json_escaped(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace tessera::detail
