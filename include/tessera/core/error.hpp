// Error types. Every error says what went wrong, where, and (when known) how to fix it.
//
// Contract: library code never calls exit() or abort() on bad input; it throws a type derived from
// tessera::Error so a caller can catch everything Tessera throws with one handler.
#pragma once

#if __cplusplus < 202002L
#error "Tessera needs C++20: compile with -std=c++20 (Meson: cpp_std=c++20)"
#endif

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A tensor reached a layer or kernel with a shape it cannot take.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A file could not be read or written, or its contents are not what the format promises.
class IoError : public Error {
 public:
  using Error::Error;
};

// An argument is out of its documented range (a negative learning rate, zero channels, ...).
class ArgumentError : public Error {
 public:
  using Error::Error;
};

// A collective or point-to-point operation failed, timed out or was called inconsistently.
class CommError : public Error {
 public:
  using Error::Error;
};

// Memory ran out: the allocator's limit (BasicCachingAllocator::set_limit, TESSERA_MEMORY_LIMIT)
// would be passed, or the system or device had no more. The text says how much was asked for, for
// what (the innermost MemoryScope), and how much was in use.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Parts>
std::string cat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

// Throws E with the parts streamed together: TESSERA_CHECK(n > 0, ArgumentError, "Linear: in_features=", n).
#define TESSERA_CHECK(cond, ErrorType, ...)                        \
  do {                                                             \
    if (!(cond)) throw ErrorType(::tessera::detail::cat(__VA_ARGS__)); \
  } while (0)

}  // namespace tessera
