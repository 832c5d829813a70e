// LocalComm: the communicator of a single process (size 1). Every collective is the identity, so
// models and optimizers are already written against the Communicator concept and other backends
// drop in without changing them. send/recv have no peer to talk to and throw.
#pragma once

#include <algorithm>
#include <span>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/local_env.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

class LocalComm {
 public:
  static constexpr const char* backend_name = "local";
  static constexpr bool ranks_share_memory = true;  // the only rank shares memory with itself
  // launch<CpuLocal>(fn): this process is the only rank.
  template <class Fn>
  static void launch(const LaunchOptions& options, Fn&& fn) {
    TESSERA_CHECK(options.ranks <= 1, ArgumentError, "launch: ", options.ranks,
                  " ranks asked of LocalComm, which is one process; build with an Env of several ranks "
                  "(CpuThreads, CpuMpi, CpuGloo)");
    check_one_process(backend_name);
    LocalComm comm;
    fn(comm);
  }

  int rank() const { return 0; }
  int size() const { return 1; }

  template <CommScalar T>
  void all_reduce(std::span<T>, ReduceOp) {}  // any op over one rank is the value itself
  template <CommScalar T>
  void broadcast(std::span<T>, int root) {
    check_root(root);
  }
  template <CommScalar T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    TESSERA_CHECK(out.size() == in.size(), CommError, "LocalComm all_gather: output has ", out.size(),
                  " elements, expected ", in.size(), " (size 1 x input)");
    std::copy(in.begin(), in.end(), out.begin());
  }
  template <CommScalar T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp) {
    TESSERA_CHECK(out.size() == in.size(), CommError, "LocalComm reduce_scatter: output has ", out.size(),
                  " elements, expected ", in.size(), " (input / size 1)");
    std::copy(in.begin(), in.end(), out.begin());
  }
  template <CommScalar T>
  void send(std::span<const T>, int peer) {
    throw CommError(detail::cat("LocalComm send: rank 0 of a size-1 communicator has no peer ", peer));
  }
  template <CommScalar T>
  void recv(std::span<T>, int peer) {
    throw CommError(detail::cat("LocalComm recv: rank 0 of a size-1 communicator has no peer ", peer));
  }
  void barrier() {}

  // Nothing to overlap with: the async forms finish at once and return a completed Work.
  template <CommScalar T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op) {
    all_reduce(buf, op);
    return {};
  }
  template <CommScalar T>
  Work broadcast_async(std::span<T> buf, int root) {
    broadcast(buf, root);
    return {};
  }
  template <CommScalar T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    all_gather(in, out);
    return {};
  }
  template <CommScalar T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
    reduce_scatter(in, out, op);
    return {};
  }
  template <CommScalar T>
  Work send_async(std::span<const T> buf, int peer) {
    send(buf, peer);
    return {};
  }
  template <CommScalar T>
  Work recv_async(std::span<T> buf, int peer) {
    recv(buf, peer);
    return {};
  }

  LocalComm split(int color, int /*key*/) const {
    TESSERA_CHECK(color >= 0, ArgumentError, "LocalComm split: color ", color, " must be >= 0");
    return {};
  }

 private:
  static void check_root(int root) {
    TESSERA_CHECK(root == 0, CommError, "LocalComm broadcast: root ", root, " out of range for size 1");
  }
};

static_assert(check_communicator<LocalComm>());
static_assert(BHalfCommunicator<LocalComm> && comm_concepts::has_async<LocalComm, BHalf>);

// The single-process bundles: float32 for training, float64 for gradient checks.
using CpuLocal = Env<Cpu, LocalComm, float>;
using CpuLocal64 = Env<Cpu, LocalComm, double>;
using CpuLocalBf16 = Env<Cpu, LocalComm, float, BFloat16>;  // float weights, bfloat16 products (core/env.hpp)

}  // namespace tessera
