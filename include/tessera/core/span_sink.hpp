// SpanSink: where timed spans of work go (the profiler, train/timeline.hpp's Timeline, implements
// it). Strategies such as Pipeline report each micro-batch's forward and backward here without
// depending on the profiler: parallel/ sits below train/ in the include graph.
#pragma once

#include <chrono>
#include <string>

namespace tessera {

struct SpanSink {
  using Clock = std::chrono::steady_clock;
  enum Lane : int { kCompute = 0, kCommunication = 1 };

  // A complete span [begin, end) on a lane; implementations are thread-safe.
  virtual void add(std::string name, const char* category, Clock::time_point begin, Clock::time_point end,
                   int lane) = 0;

 protected:
  ~SpanSink() = default;
};

}  // namespace tessera
