// Helpers for the examples' --trace flags: one trace file per run of a program that trains more
// than once.
#pragma once

#include <string>

namespace examples {

// PATH with ".<tag>" before its extension: trace.json -> trace.k4.json (no extension: appended).
inline std::string tagged_path(const std::string& path, const std::string& tag) {
  const auto dot = path.find_last_of('.'), slash = path.find_last_of('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + "." + tag;
  return path.substr(0, dot) + "." + tag + path.substr(dot);
}

}  // namespace examples
