// CommOptions: the settings every communicator takes, with defaults from the environment.
//
//   TESSERA_COMM_TIMEOUT=<seconds>   timeout of every blocking operation (default 300 s, like
//                                    torch.distributed's 5 minutes for Gloo; fractions down to
//                                    0.001 allowed)
//   TESSERA_COMM_STALL_WARNING=<s>   after this long in one operation, warn once on stderr naming
//                                    the ranks that have not reached it (default: the smaller of
//                                    30 s and half the timeout)
//   TESSERA_COMM_CHECK_EVERY=<n>     the ranks compare what they call (operation, type, count,
//                                    root or op) on the first 32 collectives and then on every
//                                    n-th (default 16; 1 = every call; 0 = the first 32 only),
//                                    with a running hash so that a mismatch between checks is
//                                    found at the next one (comm/call_check.hpp)
//   TESSERA_COMM_DEBUG=1             compare every call (the same as TESSERA_COMM_CHECK_EVERY=1)
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tessera/core/error.hpp"

namespace tessera {

struct CommOptions {
  std::chrono::milliseconds timeout = default_timeout();
  bool debug = debug_from_env();
  std::int64_t check_first = 32;
  std::int64_t check_every = check_every_from_env();
  std::chrono::milliseconds stall_warning = stall_warning_from_env();

  // The check interval in effect: debug mode compares every call.
  std::int64_t effective_check_every() const { return debug ? 1 : check_every; }
  // When to warn about a stalled operation: never later than half the timeout.
  std::chrono::milliseconds effective_stall_warning() const {
    if (stall_warning.count() > 0) return std::min(stall_warning, timeout);
    return std::max(std::chrono::milliseconds(1), std::min<std::chrono::milliseconds>(std::chrono::seconds(30), timeout / 2));
  }

  static std::chrono::milliseconds default_timeout() {
    const char* text = std::getenv("TESSERA_COMM_TIMEOUT");
    if (text == nullptr || *text == '\0') return std::chrono::minutes(5);
    return std::chrono::milliseconds(static_cast<long long>(seconds_from_env("TESSERA_COMM_TIMEOUT", text) * 1000.0 + 0.5));
  }
  static std::chrono::milliseconds stall_warning_from_env() {
    const char* text = std::getenv("TESSERA_COMM_STALL_WARNING");
    if (text == nullptr || *text == '\0') return std::chrono::milliseconds(0);  // automatic
    return std::chrono::milliseconds(
        static_cast<long long>(seconds_from_env("TESSERA_COMM_STALL_WARNING", text) * 1000.0 + 0.5));
  }
  static std::int64_t check_every_from_env() {
    const char* text = std::getenv("TESSERA_COMM_CHECK_EVERY");
    if (text == nullptr || *text == '\0') return 16;
    char* end = nullptr;
    const long long n = std::strtoll(text, &end, 10);
    TESSERA_CHECK(end != text && *end == '\0' && n >= 0 && n <= 64, ArgumentError, "TESSERA_COMM_CHECK_EVERY='", text,
                  "' must be an integer in [0, 64] (1 = every call, 0 = only the first 32 calls)");
    return n;
  }
  // A duration in seconds: at least 1 ms (a shorter timeout would round to 0, which Gloo and the
  // watchdogs read as "already expired"), at most 10^7 s.
  static double seconds_from_env(const char* name, const char* text) {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    TESSERA_CHECK(end != text && *end == '\0' && seconds >= 0.001 && seconds < 1e7, ArgumentError, name, "='", text,
                  "' must be a number of seconds in [0.001, 1e7)");
    return seconds;
  }
  static bool debug_from_env() {
    const char* text = std::getenv("TESSERA_COMM_DEBUG");
    return text != nullptr && *text != '\0' && std::string(text) != "0";
  }
};

// What tessera::launch<E> (comm/launch.hpp) passes to the Env's communicator when it opens the
// world. ranks: how many ranks an in-process communicator (ThreadComm) spawns; a communicator
// whose ranks are processes takes the world size from its launcher (mpirun, srun,
// tools/tessera-run) and ignores it. 0 means one rank.
struct LaunchOptions {
  int ranks = 0;
  CommOptions comm = {};
};

namespace detail {
inline std::string seconds_text(std::chrono::milliseconds ms) { return cat(ms.count() / 1000.0, " s"); }
}  // namespace detail

}  // namespace tessera
