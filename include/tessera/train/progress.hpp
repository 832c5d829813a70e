// Progress display for rank 0: a one-line bar redrawn in place when stdout is a terminal, plain
// lines at every quarter of the epoch otherwise (logs, CI, pipes), so a log file stays readable.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace tessera {

class Progress {
 public:
  // interactive: -1 = detect (isatty(stdout)), 0 = plain lines, 1 = bar.
  Progress(std::string label, std::int64_t total, int interactive = -1)
      : label_(std::move(label)), total_(total), tty_(interactive < 0 ? ::isatty(STDOUT_FILENO) == 1 : interactive == 1) {}

  // done: steps finished so far; `stats` is appended (e.g. "loss 0.412 acc 85.1% 5230 img/s").
  void update(std::int64_t done, const char* stats) {
    if (tty_) {
      const auto now = std::chrono::steady_clock::now();
      if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;  // ~10 redraws a second
      last_draw_ = now;
      constexpr int kWidth = 30;
      const int filled = total_ > 0 ? static_cast<int>(kWidth * std::min(done, total_) / total_) : kWidth;
      char bar[kWidth + 1];  // on the stack: redrawing inside the training loop must not allocate
      for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '=' : (i == filled ? '>' : ' ');
      bar[kWidth] = '\0';
      std::printf("\r%s [%s] %lld/%lld %s\033[K", label_.c_str(), bar, static_cast<long long>(done),
                  static_cast<long long>(total_), stats);
      if (done >= total_) std::printf("\n");
      std::fflush(stdout);
    } else {
      const std::int64_t quarter = total_ >= 4 ? total_ / 4 : 1;
      if (done % quarter == 0 || done == total_) {
        if (done == last_line_) return;
        last_line_ = done;
        std::printf("%s %lld/%lld %s\n", label_.c_str(), static_cast<long long>(done), static_cast<long long>(total_),
                    stats);
        std::fflush(stdout);
      }
    }
  }

 private:
  std::string label_;
  std::int64_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point last_draw_{};
  std::int64_t last_line_ = -1;
};

}  // namespace tessera
