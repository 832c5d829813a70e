// CommOptions: the settings every communicator takes, with defaults from the environment.
//
//   TESSERA_COMM_TIMEOUT=<seconds>   timeout of every blocking operation (default 300 s, like
//                                    torch.distributed's 5 minutes for Gloo; fractions allowed)
//   TESSERA_COMM_DEBUG=1             before each collective, all ranks compare what they are about
//                                    to call (operation, type, count, root or op) and throw on a
//                                    mismatch instead of hanging or returning wrong numbers
#pragma once

#include <chrono>
#include <cstdlib>
#include <string>

#include "tessera/core/error.hpp"

namespace tessera {

struct CommOptions {
  std::chrono::milliseconds timeout = default_timeout();
  bool debug = debug_from_env();

  static std::chrono::milliseconds default_timeout() {
    const char* text = std::getenv("TESSERA_COMM_TIMEOUT");
    if (text == nullptr || *text == '\0') return std::chrono::minutes(5);
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    TESSERA_CHECK(end != text && *end == '\0' && seconds > 0 && seconds < 1e7, ArgumentError,
                  "TESSERA_COMM_TIMEOUT='", text, "' is not a positive number of seconds");
    return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
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
