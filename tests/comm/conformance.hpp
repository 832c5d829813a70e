// The communicator conformance suite: one set of checks that every backend (Local, Threads, MPI,
// Gloo with a file or Redis store) must pass at every world size. It is collective: every rank
// runs the same checks in the same order. Failures are collected as text instead of using Catch2
// macros, so the same code runs on threads of one process (Catch2 is not thread-safe) and in
// plain multi-process programs.
//
// Inputs are small integers, x_r[i] = ((7 i + 3 r) mod 11) - 5, so sums over up to a few
// hundred ranks are exact in every element type, Half included, and results are compared exactly
// (Avg with a rounding tolerance, since backends may divide or multiply by 1/p). BHalf (bfloat16,
// 8 significant bits) holds the integers up to 256 exactly, so its sums are exact up to 51 ranks
// (every partial sum is at most 5 per rank) and get a rounding tolerance beyond (see close()).
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"

namespace tessera::testing {

// Where the buffers a communicator sees live. Host backends take the test's vectors themselves;
// a GPU backend (NCCL) gets device copies through a policy with the same shape (see
// tests/cuda/device_buffers.hpp): Buffer<T>(vector) stages the vector, span() is what the
// communicator sees, fetch() brings the result back into the vector.
struct HostBuffers {
  template <class T>
  class Buffer {
   public:
    explicit Buffer(std::vector<T>& host) : host_(host) {}
    std::span<T> span() { return host_; }
    void fetch() {}

   private:
    std::vector<T>& host_;
  };
};

struct ConformanceOptions {
  std::size_t large_bytes = 64u << 20;  // the ">= 64 MiB" case; 0 skips it
  bool verbose = false;                 // rank 0 prints each section as it starts
};

template <class Comm, class Memory = HostBuffers>
class Conformance {
  template <class T>
  using Buffer = typename Memory::template Buffer<T>;

 public:
  Conformance(Comm& comm, ConformanceOptions options) : c_(comm), o_(options) {}

  std::vector<std::string> run() {
    section("all_reduce");
    for_each_type([&]<class T>() {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min})
        for (std::size_t n : kSizes) all_reduce<T>(n, op);
    });
    section("half avg range");
    half_avg_near_max();
    section("bfloat16 range");
    bhalf_beyond_half_range();
    section("broadcast");
    for_each_type([&]<class T>() {
      for (int root : {0, c_.size() - 1, c_.size() / 2})
        for (std::size_t n : kSizes) broadcast<T>(n, root);
    });
    section("all_gather");
    for_each_type([&]<class T>() {
      for (std::size_t n : kSizes) all_gather<T>(n);
    });
    section("reduce_scatter");
    for_each_type([&]<class T>() {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min})
        for (std::size_t n : kSizes) reduce_scatter<T>(n, op);
    });
    if (o_.large_bytes > 0) {
      // Many distinct sizes of a few MiB, then the first ones again: a backend that keeps state
      // per size (GlooComm's staged algorithms, evicted past 32 MiB) must recreate it identically
      // on every rank.
      section("all_reduce size sweep (2-4 MiB)");
      for (int pass = 0; pass < 2; ++pass)
        for (std::size_t k = 0; k < (pass == 0 ? 16u : 4u); ++k)
          all_reduce<float>(524288 + 32768 * k, k % 2 ? ReduceOp::Avg : ReduceOp::Max);
      section("large (>= 64 MiB)");
      const std::size_t n = o_.large_bytes / sizeof(float);
      all_reduce<float>(n, ReduceOp::Sum);
      all_gather<float>(n / static_cast<std::size_t>(c_.size()));
      reduce_scatter<float>(n / static_cast<std::size_t>(c_.size()), ReduceOp::Sum);
      broadcast<float>(n, c_.size() - 1);
    }
    if (c_.size() > 1) {
      section("send/recv");
      ring<float>(1000);
      ring<std::int64_t>(1);
      ring<Half>(0);
      ring<BHalf>(0);
      pairwise<double>(777);
      ring_receive_posted_first<float>(4096);
    }
    section("async");
    async_overlap();
    section("split");
    split_groups();
    section("barrier");
    for (int i = 0; i < 3; ++i) c_.barrier();
    return std::move(failures_);
  }

 private:
  static constexpr std::size_t kSizes[] = {0, 1, 7, 1000, 65537};

  template <class F>
  static void for_each_type(F&& f) {
    f.template operator()<float>();
    f.template operator()<double>();
    f.template operator()<std::int32_t>();
    f.template operator()<std::int64_t>();
    f.template operator()<Half>();
    f.template operator()<BHalf>();
  }

  static double value(int rank, std::size_t i) {
    return static_cast<double>(static_cast<long long>((7 * (i % 1000003) + 3 * static_cast<std::size_t>(rank)) % 11)) -
           5.0;
  }
  template <class T>
  static T make(double v) {
    if constexpr (is_16bit_float_v<T>) return T(static_cast<float>(v));
    else return static_cast<T>(v);
  }
  template <class T>
  static double as_double(T v) {
    if constexpr (is_16bit_float_v<T>) return static_cast<float>(v);
    else return static_cast<double>(v);
  }
  template <class T>
  std::vector<T> input(std::size_t n, int rank, std::size_t offset = 0) const {
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(value(rank, offset + i));
    return v;
  }

  template <class T>
  double expected_reduce(ReduceOp op, std::size_t i) const {
    double sum = 0, mx = -1e300, mn = 1e300;
    for (int r = 0; r < c_.size(); ++r) {
      const double v = value(r, i);
      sum += v;
      mx = std::max(mx, v);
      mn = std::min(mn, v);
    }
    switch (op) {
      case ReduceOp::Sum: return sum;
      case ReduceOp::Max: return mx;
      case ReduceOp::Min: return mn;
      case ReduceOp::Avg:
        if constexpr (std::is_integral_v<T>) return std::trunc(sum / c_.size());
        else return sum / c_.size();
    }
    return 0;
  }
  // BHalf's tolerance: bfloat16 has 8 significant bits, so one rounding errs by at most 2^-8 of
  // the value (half an ulp of 2^-7). Threads and Local reduce in float and round once; MPI and
  // Gloo reduce pairwise, rounding once per step (and Avg divides each rank's value first, one
  // more rounding); NCCL sums in bfloat16 on the GPU. Eight roundings, 2^-5, is the same margin as
  // Half's 4e-3 (about eight of its 2^-11 roundings), at bfloat16's coarser precision.
  static constexpr double kBHalfTolerance = 1.0 / 32;

  template <class T>
  bool close(double got, double want, ReduceOp op) const {
    if constexpr (std::is_same_v<T, BHalf>) {
      // Sums of these inputs are exact while every partial sum (at most 5 per rank) is <= 256.
      if (op == ReduceOp::Sum && 5 * c_.size() <= 256) return got == want;
      if (op == ReduceOp::Sum || op == ReduceOp::Avg) return std::abs(got - want) <= kBHalfTolerance * (1 + std::abs(want));
      return got == want;  // Max and Min pick an input, which bfloat16 holds exactly
    }
    if (op != ReduceOp::Avg || std::is_integral_v<T>) return got == want;
    // Half: backends may divide each rank's values before summing (to keep the fp16 sum in
    // range), which rounds once per rank: a few fp16 ulps (2^-10 relative each).
    const double tol = std::is_same_v<T, Half> ? 4e-3 : std::is_same_v<T, float> ? 1e-6 : 1e-14;
    return std::abs(got - want) <= tol * (1 + std::abs(want));
  }

  template <class T>
  void all_reduce(std::size_t n, ReduceOp op) {
    auto buf = input<T>(n, c_.rank());
    attempt(describe<T>("all_reduce", n, std::string(to_string(op))), [&] {
      Buffer<T> staged(buf);
      c_.all_reduce(staged.span(), op);
      staged.fetch();
      for (std::size_t i = 0; i < n; ++i)
        if (!close<T>(as_double(buf[i]), expected_reduce<T>(op, i), op))
          return mismatch(i, as_double(buf[i]), expected_reduce<T>(op, i));
      return std::string();
    });
  }

  // The average of values near fp16's maximum (65504) fits in fp16 although their sum does not.
  void half_avg_near_max() {
    std::vector<Half> buf(8, Half(40000.0f + 1000.0f * static_cast<float>(c_.rank())));
    double want = 0;
    for (int r = 0; r < c_.size(); ++r) want += 40000.0 + 1000.0 * r;
    want /= c_.size();
    attempt("all_reduce(float16 x 8, avg) of values near 65504", [&] {
      Buffer<Half> staged(buf);
      c_.all_reduce(staged.span(), ReduceOp::Avg);
      staged.fetch();
      const double got = static_cast<float>(buf[7]);
      if (!(std::abs(got - want) <= 4e-3 * want)) return mismatch(7, got, want);
      return std::string();
    });
  }

  // bfloat16 has float32's exponent: values far outside fp16's range (max 65504, smallest normal
  // 2^-14) travel and reduce. A backend that sent BHalf as fp16 (NCCL's ncclFloat16, say) would
  // give inf and zeros here. Each value is a power of two times a small integer, exact in bfloat16.
  void bhalf_beyond_half_range() {
    const int p = c_.size();
    for (const double scale : {0x1p80, 0x1p-80}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        std::vector<BHalf> buf(8, BHalf(static_cast<float>(scale * (1 + c_.rank() % 4))));
        double want = 0;
        for (int r = 0; r < p; ++r) {
          const double v = scale * (1 + r % 4);
          want = op == ReduceOp::Max ? std::max(want, v) : want + v;
        }
        if (op == ReduceOp::Avg) want /= p;
        attempt(describe<BHalf>("all_reduce", 8, std::string(to_string(op)) + ", values near 2^" +
                                                     (scale > 1 ? "80" : "-80")),
                [&] {
                  Buffer<BHalf> staged(buf);
                  c_.all_reduce(staged.span(), op);
                  staged.fetch();
                  const double got = static_cast<float>(buf[7]);
                  // Relative error: a few bfloat16 roundings (kBHalfTolerance), scaled to the values.
                  if (!(std::abs(got - want) <= kBHalfTolerance * want)) return mismatch(7, got, want);
                  return std::string();
                });
      }
    }
  }

  template <class T>
  void broadcast(std::size_t n, int root) {
    auto buf = input<T>(n, c_.rank());
    attempt(describe<T>("broadcast", n, "root " + std::to_string(root)), [&] {
      Buffer<T> staged(buf);
      c_.broadcast(staged.span(), root);
      staged.fetch();
      for (std::size_t i = 0; i < n; ++i)
        if (as_double(buf[i]) != value(root, i)) return mismatch(i, as_double(buf[i]), value(root, i));
      return std::string();
    });
  }

  template <class T>
  void all_gather(std::size_t n) {
    auto in = input<T>(n, c_.rank());
    std::vector<T> out(n * static_cast<std::size_t>(c_.size()), make<T>(99));
    attempt(describe<T>("all_gather", n, "rank order"), [&] {
      Buffer<T> staged_in(in), staged_out(out);
      c_.all_gather(std::span<const T>(staged_in.span()), staged_out.span());
      staged_out.fetch();
      for (int r = 0; r < c_.size(); ++r)
        for (std::size_t i = 0; i < n; ++i)
          if (as_double(out[r * n + i]) != value(r, i))
            return mismatch(r * n + i, as_double(out[r * n + i]), value(r, i));
      return std::string();
    });
  }

  // Input of size p*n; rank r's shard is elements [r n, (r+1) n) reduced over ranks.
  template <class T>
  void reduce_scatter(std::size_t n, ReduceOp op) {
    auto in = input<T>(n * static_cast<std::size_t>(c_.size()), c_.rank());
    std::vector<T> out(n, make<T>(99));
    attempt(describe<T>("reduce_scatter", n, std::string(to_string(op)) + ", shard per rank"), [&] {
      Buffer<T> staged_in(in), staged_out(out);
      c_.reduce_scatter(std::span<const T>(staged_in.span()), staged_out.span(), op);
      staged_out.fetch();
      const std::size_t base = static_cast<std::size_t>(c_.rank()) * n;
      for (std::size_t i = 0; i < n; ++i)
        if (!close<T>(as_double(out[i]), expected_reduce<T>(op, base + i), op))
          return mismatch(i, as_double(out[i]), expected_reduce<T>(op, base + i));
      return std::string();
    });
  }

  // Every rank sends to its right neighbour and receives from its left at the same time: the
  // pattern of a pipeline or ring, which needs send_async so it cannot deadlock on any backend.
  template <class T>
  void ring(std::size_t n) {
    const int p = c_.size(), r = c_.rank();
    const int right = (r + 1) % p, left = (r + p - 1) % p;
    auto out = input<T>(n, r);
    std::vector<T> in(n, make<T>(99));
    attempt(describe<T>("ring send/recv", n, "right/left"), [&] {
      Buffer<T> staged_out(out), staged_in(in);
      Work sent = c_.send_async(std::span<const T>(staged_out.span()), right);
      c_.recv(staged_in.span(), left);
      sent.wait();
      staged_in.fetch();
      for (std::size_t i = 0; i < n; ++i)
        if (as_double(in[i]) != value(left, i)) return mismatch(i, as_double(in[i]), value(left, i));
      return std::string();
    });
  }

  // The receive is posted before a blocking send (the other common order), and its completion is
  // observed by polling is_completed() rather than by wait().
  template <class T>
  void ring_receive_posted_first(std::size_t n) {
    const int p = c_.size(), r = c_.rank();
    const int right = (r + 1) % p, left = (r + p - 1) % p;
    auto out = input<T>(n, r);
    std::vector<T> in(n, make<T>(99));
    attempt(describe<T>("recv_async, then blocking send, ring", n, "polled"), [&] {
      Buffer<T> staged_out(out), staged_in(in);
      Work received = c_.recv_async(staged_in.span(), left);
      c_.send(std::span<const T>(staged_out.span()), right);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!received.is_completed())
        if (std::chrono::steady_clock::now() > deadline) return std::string("is_completed() never became true");
      received.wait();
      staged_in.fetch();
      for (std::size_t i = 0; i < n; ++i)
        if (as_double(in[i]) != value(left, i)) return mismatch(i, as_double(in[i]), value(left, i));
      return std::string();
    });
  }

  // Blocking send/recv between pairs (0,1), (2,3), ...: even ranks send first.
  template <class T>
  void pairwise(std::size_t n) {
    const int r = c_.rank();
    const int peer = r % 2 == 0 ? r + 1 : r - 1;
    if (peer >= c_.size()) return;
    auto out = input<T>(n, r);
    std::vector<T> in(n);
    attempt(describe<T>("blocking send/recv", n, "pairs"), [&] {
      Buffer<T> staged_out(out), staged_in(in);
      if (r % 2 == 0) {
        c_.send(std::span<const T>(staged_out.span()), peer);
        c_.recv(staged_in.span(), peer);
      } else {
        c_.recv(staged_in.span(), peer);
        c_.send(std::span<const T>(staged_out.span()), peer);
      }
      staged_in.fetch();
      for (std::size_t i = 0; i < n; ++i)
        if (as_double(in[i]) != value(peer, i)) return mismatch(i, as_double(in[i]), value(peer, i));
      return std::string();
    });
  }

  // Two collectives in flight at once, waited in the opposite order, with a third started
  // before either finished; then the result of each must be right.
  void async_overlap() {
    auto a = input<float>(100000, c_.rank());
    auto g_in = input<double>(333, c_.rank());
    std::vector<double> g_out(333 * static_cast<std::size_t>(c_.size()));
    auto b = input<std::int32_t>(17, c_.rank());
    attempt("async all_reduce + all_gather + broadcast in flight together", [&] {
      Buffer<float> staged_a(a);
      Buffer<double> staged_g_in(g_in), staged_g_out(g_out);
      Buffer<std::int32_t> staged_b(b);
      Work w1 = c_.all_reduce_async(staged_a.span(), ReduceOp::Sum);
      Work w2 = c_.all_gather_async(std::span<const double>(staged_g_in.span()), staged_g_out.span());
      Work w3 = c_.broadcast_async(staged_b.span(), c_.size() - 1);
      w2.wait();
      w1.wait();
      w3.wait();
      staged_a.fetch();
      staged_g_out.fetch();
      staged_b.fetch();
      if (!w1.is_completed() || !w2.is_completed()) return std::string("is_completed() false after wait()");
      for (std::size_t i = 0; i < a.size(); ++i)
        if (a[i] != expected_reduce<float>(ReduceOp::Sum, i)) return "all_reduce: " + mismatch(i, a[i], expected_reduce<float>(ReduceOp::Sum, i));
      for (int r = 0; r < c_.size(); ++r)
        for (std::size_t i = 0; i < 333; ++i)
          if (g_out[r * 333 + i] != value(r, i)) return "all_gather: " + mismatch(r * 333 + i, g_out[r * 333 + i], value(r, i));
      for (std::size_t i = 0; i < b.size(); ++i)
        if (b[i] != value(c_.size() - 1, i)) return "broadcast: " + mismatch(i, b[i], value(c_.size() - 1, i));
      return std::string();
    });
    // Polling until done must terminate (the completion test works without wait()).
    auto d = input<double>(1000, c_.rank());
    attempt("async all_reduce completed by polling is_completed()", [&] {
      Buffer<double> staged(d);
      Work w = c_.all_reduce_async(staged.span(), ReduceOp::Max);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!w.is_completed())
        if (std::chrono::steady_clock::now() > deadline) return std::string("is_completed() never became true");
      w.wait();
      staged.fetch();
      for (std::size_t i = 0; i < d.size(); ++i)
        if (d[i] != expected_reduce<double>(ReduceOp::Max, i)) return mismatch(i, d[i], expected_reduce<double>(ReduceOp::Max, i));
      return std::string();
    });
  }

  // Even and odd ranks form two groups (ordered by descending parent rank through the key) and
  // run different collectives at the same time; then the parent must still work.
  void split_groups() {
    attempt("split(rank % 2, -rank): groups run different collectives at once", [&]() -> std::string {
      const int p = c_.size(), r = c_.rank();
      Comm sub = c_.split(r % 2, -r);
      std::vector<int> members;
      for (int q = p - 1; q >= 0; --q)
        if (q % 2 == r % 2) members.push_back(q);  // key -q: descending parent rank
      const int want_rank = static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
      if (sub.size() != static_cast<int>(members.size()) || sub.rank() != want_rank)
        return "group rank/size " + std::to_string(sub.rank()) + "/" + std::to_string(sub.size()) + ", expected " +
               std::to_string(want_rank) + "/" + std::to_string(members.size());
      if (r % 2 == 0) {
        std::vector<double> v(5000, r);
        Buffer<double> staged(v);
        sub.all_reduce(staged.span(), ReduceOp::Sum);
        staged.fetch();
        double want = 0;
        for (int q : members) want += q;
        if (v[4999] != want) return mismatch(4999, v[4999], want) + " (even group all_reduce)";
      } else {
        std::vector<std::int64_t> in(3, r);
        std::vector<std::int64_t> out(3 * members.size());
        Buffer<std::int64_t> staged_in(in), staged_out(out);
        sub.all_gather(std::span<const std::int64_t>(staged_in.span()), staged_out.span());
        staged_out.fetch();
        for (std::size_t k = 0; k < members.size(); ++k)
          if (out[3 * k] != members[k]) return mismatch(3 * k, out[3 * k], members[k]) + " (odd group all_gather)";
      }
      std::vector<float> after(3, 1.0f);
      Buffer<float> staged_after(after);
      c_.all_reduce(staged_after.span(), ReduceOp::Sum);
      staged_after.fetch();
      if (after[0] != p) return mismatch(0, after[0], p) + " (parent all_reduce after split)";
      return std::string();
    });
  }

  template <class T>
  static std::string describe(const char* what, std::size_t n, const std::string& detail) {
    return std::string(what) + "(" + std::string(to_string(comm_dtype_of<T>)) + " x " + std::to_string(n) + ", " + detail + ")";
  }
  static std::string mismatch(std::size_t i, double got, double want) {
    char text[160];
    std::snprintf(text, sizeof text, "element %zu is %.9g, expected %.9g", i, got, want);
    return text;
  }

  template <class F>
  void attempt(const std::string& what, F&& check) {
    ++checks_;
    std::string problem;
    try {
      problem = check();
    } catch (const std::exception& e) {
      problem = std::string("threw: ") + e.what();
    }
    if (!problem.empty())
      failures_.push_back("rank " + std::to_string(c_.rank()) + " of " + std::to_string(c_.size()) + ": " + what +
                          ": " + problem);
  }

  void section(const char* name) {
    if (o_.verbose && c_.rank() == 0) std::printf("  %s (%d ranks)\n", name, c_.size()), std::fflush(stdout);
  }

  Comm& c_;
  ConformanceOptions o_;
  std::vector<std::string> failures_;
  int checks_ = 0;

 public:
  int checks() const { return checks_; }
};

}  // namespace tessera::testing
