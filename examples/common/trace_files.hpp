// Helpers for the examples' --trace flags: one trace file per run of a program that trains more
// than once, and DataParallel's bucket all-reduces as spans.
#pragma once

#include <cstddef>
#include <string>

#include "tessera/core/span_sink.hpp"

namespace examples {

// PATH with ".<tag>" before its extension: trace.json -> trace.k4.json (no extension: appended).
inline std::string tagged_path(const std::string& path, const std::string& tag) {
  const auto dot = path.find_last_of('.'), slash = path.find_last_of('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + "." + tag;
  return path.substr(0, dot) + "." + tag + path.substr(dot);
}

// DataParallel's buckets of the step just finished (dp.finish() has run), each from its launch
// in backward to its completion, on the communication lane: "all_reduce bucket k (N KiB)".
template <class DataParallel>
void record_buckets(tessera::SpanSink& timeline, const DataParallel& dp) {
  for (std::size_t k = 0; k < dp.buckets().size(); ++k) {
    const auto& b = dp.buckets()[k];
    timeline.add("all_reduce bucket " + std::to_string(k) + " (" + std::to_string(b.flat.bytes() / 1024) + " KiB)",
                 "communication", b.launched_at, b.completed_at, tessera::SpanSink::kCommunication);
  }
}

}  // namespace examples
