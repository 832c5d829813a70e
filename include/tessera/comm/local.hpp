// LocalComm: the communicator of a single process (size 1). Every collective is the identity, so
// models and optimizers are already written against the Communicator concept and other backends
// drop in without changing them. send/recv have no peer to talk to and throw.
#pragma once

#include <algorithm>
#include <span>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

class LocalComm {
 public:
  int rank() const { return 0; }
  int size() const { return 1; }

  template <class T>
  void all_reduce(std::span<T>, ReduceOp) {}  // avg over one rank is the value itself
  template <class T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op) {
    all_reduce(buf, op);
    return {};
  }
  template <class T>
  void broadcast(std::span<T>, int root) {
    check_peer(root, "broadcast");
  }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    TESSERA_CHECK(out.size() == in.size(), CommError, "LocalComm::all_gather: output has ", out.size(),
                  " elements, expected ", in.size(), " (size 1 x input)");
    std::copy(in.begin(), in.end(), out.begin());
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp) {
    TESSERA_CHECK(out.size() == in.size(), CommError, "LocalComm::reduce_scatter: output has ", out.size(),
                  " elements, expected ", in.size(), " (input / size 1)");
    std::copy(in.begin(), in.end(), out.begin());
  }
  template <class T>
  void send(std::span<const T>, int peer) {
    throw CommError(detail::cat("LocalComm::send: rank 0 of a size-1 communicator has no peer ", peer));
  }
  template <class T>
  void recv(std::span<T>, int peer) {
    throw CommError(detail::cat("LocalComm::recv: rank 0 of a size-1 communicator has no peer ", peer));
  }
  void barrier() {}
  LocalComm split(int /*color*/, int /*key*/) const { return {}; }

 private:
  static void check_peer(int peer, const char* op) {
    TESSERA_CHECK(peer == 0, CommError, "LocalComm::", op, ": root ", peer, " out of range for size 1");
  }
};

static_assert(Communicator<LocalComm>, "LocalComm must satisfy Communicator");
static_assert(AsyncCommunicator<LocalComm>, "LocalComm must satisfy AsyncCommunicator");
static_assert(SplittableCommunicator<LocalComm>, "LocalComm must satisfy SplittableCommunicator");

// The single-process bundles: float32 for training, float64 for gradient checks.
using CpuLocal = Env<Cpu, LocalComm, float>;
using CpuLocal64 = Env<Cpu, LocalComm, double>;

}  // namespace tessera
