// Rng: a small, seedable, checkpointable random number generator (xoshiro256**, Blackman & Vigna).
//
// Why not std::mt19937 + std::normal_distribution: the standard distributions are
// implementation-defined, so the same seed would give different initial weights on libstdc++ and
// libc++. Here every draw is specified, and the whole state is four words that a checkpoint stores.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "tessera/core/linkage.hpp"

namespace tessera {

// The draws are inlined wherever they are called, at every -O level. As ordinary inline members
// they could stay calls (clang judged normal() too large), and the linker keeps one copy of each
// for the whole program, the first it meets: the kernels library's -O3 loop below then called
// a -O0 program's normal() and ran at -O0's speed.
#define TESSERA_RNG_INLINE [[gnu::always_inline]] inline

class Rng {
 public:
  explicit Rng(std::uint64_t seed = 0) { reseed(seed); }

  void reseed(std::uint64_t seed) {
    // splitmix64 spreads a small seed over the 256-bit state, as the xoshiro authors recommend.
    for (auto& word : state_) {
      seed += 0x9e3779b97f4a7c15ULL;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      word = z ^ (z >> 31);
    }
    has_spare_normal_ = false;
  }

  TESSERA_RNG_INLINE std::uint64_t next_u64() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  TESSERA_RNG_INLINE double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  TESSERA_RNG_INLINE double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

  // Uniform integer in [0, n), without modulo bias (Lemire's method).
  std::uint64_t below(std::uint64_t n) {
    if (n == 0) return 0;
    unsigned __int128 m = static_cast<unsigned __int128>(next_u64()) * n;
    auto low = static_cast<std::uint64_t>(m);
    if (low < n) {
      const std::uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next_u64()) * n;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

  // Standard normal by Box-Muller; the second value of each pair is kept for the next call.
  TESSERA_RNG_INLINE double normal() {
    if (has_spare_normal_) {
      has_spare_normal_ = false;
      return spare_normal_;
    }
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_normal_ = radius * std::sin(angle);
    has_spare_normal_ = true;
    return radius * std::cos(angle);
  }
  TESSERA_RNG_INLINE double normal(double mean, double stddev) { return mean + stddev * normal(); }

  // n draws in a row, each rounded to the element type: out[i] = normal(mean, stddev) (or
  // uniform(lo, hi)), the same values and the same state after as n single calls. One loop
  // compiled once, in the kernels library (core/linkage.hpp): the examples and most tests build at
  // -O0, where a model's millions of initial weights drawn call by call took most of its
  // construction (a ResNet-152's 60 million).
  void fill_normal(float* out, std::int64_t n, double mean, double stddev);
  void fill_normal(double* out, std::int64_t n, double mean, double stddev);
  void fill_uniform(float* out, std::int64_t n, double lo, double hi);
  void fill_uniform(double* out, std::int64_t n, double lo, double hi);

  // Fisher-Yates shuffle of [first, last).
  template <class It>
  void shuffle(It first, It last) {
    const auto n = static_cast<std::uint64_t>(last - first);
    for (std::uint64_t i = n; i > 1; --i) {
      const auto j = below(i);
      std::swap(first[static_cast<std::ptrdiff_t>(i - 1)], first[static_cast<std::ptrdiff_t>(j)]);
    }
  }

  // The full state, for checkpoints: 4 words of xoshiro state, the spare-normal flag and value.
  struct State {
    std::array<std::uint64_t, 4> words{};
    bool has_spare_normal = false;
    double spare_normal = 0.0;
  };
  State state() const { return {state_, has_spare_normal_, spare_normal_}; }
  void set_state(const State& s) {
    state_ = s.words;
    has_spare_normal_ = s.has_spare_normal;
    spare_normal_ = s.spare_normal;
  }

 private:
  TESSERA_RNG_INLINE static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

  std::array<std::uint64_t, 4> state_{};
  bool has_spare_normal_ = false;
  double spare_normal_ = 0.0;
};
#undef TESSERA_RNG_INLINE

#if TESSERA_HEADER_DEFINITIONS
TESSERA_LINKAGE void Rng::fill_normal(float* out, std::int64_t n, double mean, double stddev) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(normal(mean, stddev));
}
TESSERA_LINKAGE void Rng::fill_normal(double* out, std::int64_t n, double mean, double stddev) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = normal(mean, stddev);
}
TESSERA_LINKAGE void Rng::fill_uniform(float* out, std::int64_t n, double lo, double hi) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(uniform(lo, hi));
}
TESSERA_LINKAGE void Rng::fill_uniform(double* out, std::int64_t n, double lo, double hi) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = uniform(lo, hi);
}
#endif

}  // namespace tessera
