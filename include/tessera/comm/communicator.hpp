// The communicator vocabulary (after torch.distributed / NCCL): ReduceOp, Work, and the concepts a
// backend satisfies. Buffers are std::span views; all_reduce and broadcast work in place.
//
//   all_reduce(buf, op)        every rank ends with op over all ranks' buf          (count n)
//   broadcast(buf, root)       every rank ends with root's buf                      (count n)
//   all_gather(in, out)        out = concat over ranks r of in_r, in rank order     (n -> size*n)
//   reduce_scatter(in, out, op) out on rank r = op over ranks of in[r*n, (r+1)*n)   (size*n -> n)
//   send(buf, peer) / recv(buf, peer), barrier()
//
// Every blocking call has a timeout and throws CommError naming the operation, the rank and the
// peer on failure.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>

#include "tessera/core/error.hpp"

namespace tessera {

enum class ReduceOp { Sum, Avg, Max, Min };

inline std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

// Handle of an asynchronous operation. wait() blocks until done (rethrowing its error);
// is_completed() polls. A default Work is already complete (what synchronous backends return).
class Work {
 public:
  Work() = default;
  Work(std::function<void()> wait_fn, std::function<bool()> poll_fn)
      : wait_(std::move(wait_fn)), poll_(std::move(poll_fn)) {}
  void wait() {
    if (wait_) {
      auto fn = std::move(wait_);
      wait_ = nullptr;
      poll_ = nullptr;
      fn();
    }
  }
  bool is_completed() const { return !wait_ || (poll_ && poll_()); }

 private:
  std::function<void()> wait_;
  std::function<bool()> poll_;
};

template <class C>
concept Communicator = requires(C& c, std::span<float> f, std::span<const float> cf, std::span<double> d,
                                ReduceOp op, int peer) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce(f, op);
  c.all_reduce(d, op);
  c.broadcast(f, peer);
  c.all_gather(cf, f);
  c.reduce_scatter(cf, f, op);
  c.send(cf, peer);
  c.recv(f, peer);
  c.barrier();
};

template <class C>
concept AsyncCommunicator = Communicator<C> && requires(C& c, std::span<float> f, ReduceOp op) {
  { c.all_reduce_async(f, op) } -> std::same_as<Work>;
};

template <class C>
concept SplittableCommunicator = Communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> std::same_as<C>;
};

}  // namespace tessera
