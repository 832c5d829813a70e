// Shape: the extents of a contiguous, row-major (C order) tensor, up to kMaxRank dimensions.
//
// Kept inline (no heap) so that reshaping or comparing shapes in a training step never allocates.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera {

class Shape {
 public:
  static constexpr int kMaxRank = 6;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  template <class It>
  Shape(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<std::int64_t>(*first));
  }

  int rank() const { return rank_; }
  std::int64_t operator[](int i) const { return dims_[static_cast<std::size_t>(i)]; }
  std::int64_t& operator[](int i) { return dims_[static_cast<std::size_t>(i)]; }
  // Negative indices count from the back, as in Python: shape.dim(-1) is the last extent.
  std::int64_t dim(int i) const { return dims_[static_cast<std::size_t>(i < 0 ? rank_ + i : i)]; }

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
    return n;
  }

  // Requires 0 <= d and numel() * d < 2^62, so numel() can never overflow.
  void push_back(std::int64_t d);

  const std::int64_t* begin() const { return dims_.data(); }
  const std::int64_t* end() const { return dims_.data() + rank_; }

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
    return true;
  }
  friend bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }

  std::string str() const;
  friend std::ostream& operator<<(std::ostream& os, const Shape& s);

 private:
  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

namespace detail {
// Flat index i of a row-major tensor of `shape` as its multi-index, for error messages: "[1, 7]".
inline std::string multi_index(std::int64_t i, const Shape& shape) {
  std::string s = "]";
  for (int d = shape.rank() - 1; d >= 0; --d) {
    const std::int64_t extent = shape[d] > 0 ? shape[d] : 1;
    s = (d > 0 ? ", " : "") + std::to_string(i % extent) + s;
    i /= extent;
  }
  return "[" + s;
}
}  // namespace detail

// Out of line (core/linkage.hpp): compiled once in tessera_kernels rather than expanded, with their
// error texts, at each of the hundreds of places a shape is made.
#if TESSERA_HEADER_DEFINITIONS
TESSERA_LINKAGE Shape::Shape(std::initializer_list<std::int64_t> dims) {
  TESSERA_CHECK(static_cast<int>(dims.size()) <= kMaxRank, ShapeError, "Shape: rank ", dims.size(),
                " exceeds the maximum of ", kMaxRank);
  for (auto d : dims) push_back(d);
}

TESSERA_LINKAGE void Shape::push_back(std::int64_t d) {
  TESSERA_CHECK(rank_ < kMaxRank, ShapeError, "Shape: rank exceeds the maximum of ", kMaxRank);
  TESSERA_CHECK(d >= 0, ShapeError, "Shape: negative extent ", d);
  std::int64_t product = 0;
  TESSERA_CHECK(!__builtin_mul_overflow(numel(), d, &product) && product < (std::int64_t{1} << 62), ShapeError,
                "Shape: ", str(), " x ", d, " has more elements than fit in memory");
  dims_[static_cast<std::size_t>(rank_++)] = d;
}

TESSERA_LINKAGE std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[static_cast<std::size_t>(i)]);
  }
  return s + ")";
}

TESSERA_LINKAGE std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }
#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
