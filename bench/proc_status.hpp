// A process's memory as the kernel reports it, for the benchmarks' memory modes: a "VmHWM:" (peak
// resident set) or "VmRSS:" line of /proc/self/status, in bytes (the kernel writes kB).
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include "tessera/core/error.hpp"

inline long long proc_status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(prefix, 0) == 0) return std::atoll(line.c_str() + prefix.size()) * 1024;
  }
  throw tessera::Error(std::string("/proc/self/status: no ") + key + " line (not Linux?)");
}
