// P2pComm: a test-only communicator whose collectives are built from point-to-point messages
// alone, the situation of a transport that offers send and recv and nothing else (a socket layer,
// a fabric library without collectives). It exists to prove docs/adding-a-communicator.md: it was
// added exactly as that page says (this folder, its meson.build, one entry in the backend list of
// the top-level meson.build) and passes the same conformance suite as every shipped backend.
//
// Transport: two ThreadComm groups of the same ranks (threads of one process). One carries the
// user's send/recv, the other the collectives' own messages, so a user's send_async can never be
// matched by a collective's recv. Timeouts come from ThreadComm underneath.
//
// The per-call protocol is the communicator core's (comm/core.hpp), as for every backend: the
// argument checks, the call check (its fixed-size all_gather of int64 is this class's own
// all_gather over the internal group), the progress board, the broken state, and error texts
// that name P2pComm, the operation, the call number and the rank ("P2pComm all_reduce(float32 x
// 4, sum) on rank 1 of 3 (call #5): ThreadComm recv(...) from rank 0 ...: timed out ...").
//
// Algorithms: simple and exact rather than fast.
//   all_reduce      rank 0 receives every rank's buffer, reduces them in rank order with
//                   detail::reduce_many (Half in float, Avg divided once), sends the result back
//   broadcast       the root sends to every other rank
//   all_gather      rank 0 collects the blocks in rank order and sends the whole to everyone
//   reduce_scatter  an all_reduce of a copy of the input; rank r keeps block r
//   barrier         an all_reduce of one integer
// Asynchronous collectives run in issue order on one detail::AsyncWorker thread and blocking
// collectives drain it first (docs/adding-a-communicator.md, rule 6); point-to-point async
// operations go straight to the transport.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "tessera/comm/async_worker.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/core.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera::testing {

class P2pComm {
 public:
  static constexpr const char* backend_name = "p2p";

  // launch<CpuP2p>(fn, {.ranks = n}): n threads, each with its rank's P2pComm.
  template <class Fn>
  static void launch(const LaunchOptions& options, Fn&& fn) {
    ThreadComm::launch(options, [&](ThreadComm& world) {
      ThreadComm user = world.split(0, world.rank());
      ThreadComm internal = world.split(0, world.rank());
      P2pComm comm(std::move(user), std::move(internal));
      fn(comm);
    });
  }

  P2pComm(ThreadComm user, ThreadComm internal)
      : user_(std::move(user)),
        internal_(std::move(internal)),
        core_(std::make_shared<detail::CommCore>("P2pComm", user_.rank(), user_.size(), user_.options())),
        worker_(std::make_unique<detail::AsyncWorker>()) {}
  P2pComm(P2pComm&&) noexcept = default;

  int rank() const { return core_->rank(); }
  int size() const { return core_->size(); }
  const CommOptions& options() const { return core_->options(); }

  template <CommScalar T>
  void all_reduce(std::span<T> buf, ReduceOp op) {
    worker_->drain();
    do_all_reduce(buf, op);
  }
  template <CommScalar T>
  void broadcast(std::span<T> buf, int root) {
    worker_->drain();
    do_broadcast(buf, root);
  }
  template <CommScalar T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    worker_->drain();
    do_all_gather(in, out);
  }
  template <CommScalar T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op) {
    worker_->drain();
    do_reduce_scatter(in, out, op);
  }
  template <CommScalar T>
  void send(std::span<const T> buf, int peer) {
    send_async(buf, peer).wait();
  }
  template <CommScalar T>
  void recv(std::span<T> buf, int peer) {
    recv_async(buf, peer).wait();
  }
  void barrier() {
    worker_->drain();
    do_barrier();
  }

  template <CommScalar T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op) {
    return worker_->submit([this, buf, op] { do_all_reduce(buf, op); });
  }
  template <CommScalar T>
  Work broadcast_async(std::span<T> buf, int root) {
    return worker_->submit([this, buf, root] { do_broadcast(buf, root); });
  }
  template <CommScalar T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    return worker_->submit([this, in, out] { do_all_gather(in, out); });
  }
  template <CommScalar T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
    return worker_->submit([this, in, out, op] { do_reduce_scatter(in, out, op); });
  }
  template <CommScalar T>
  Work send_async(std::span<const T> buf, int peer) {
    core_->check_peer(peer, "send");
    const auto what = detail::PeerCall::send<T>(buf.size(), peer);
    return guarded(what, [&] { return user_.send_async(buf, peer); });
  }
  template <CommScalar T>
  Work recv_async(std::span<T> buf, int peer) {
    core_->check_peer(peer, "recv");
    const auto what = detail::PeerCall::recv<T>(buf.size(), peer);
    return guarded(what, [&] { return user_.recv_async(buf, peer); });
  }

  // MPI_Comm_split semantics, inherited from ThreadComm's split of both groups.
  P2pComm split(int color, int key) {
    core_->check_split_color(color);
    worker_->drain();
    core_->check_usable("split");
    ThreadComm user = user_.split(color, key);
    ThreadComm internal = internal_.split(color, key);
    return P2pComm(std::move(user), std::move(internal));
  }

 private:
  // One collective under the core's protocol: usable check, progress board, call check (its
  // exchange is raw_all_gather over the internal group), and any transport error turned into
  // this communicator's error, which breaks it.
  template <class Fn>
  void collective(const detail::CallSignature& sig, Fn&& move_bytes) {
    const std::int64_t call = core_->enter(sig);
    core_->check_call(sig, [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      core_->guard(detail::CallCheckOf{sig}, call, [&] { raw_all_gather(in, out); });
    });
    core_->guard(sig, call, std::forward<Fn>(move_bytes));
    core_->finish();
  }

  // A point-to-point Work of the user group whose failure breaks this communicator too.
  template <class Post>
  Work guarded(const detail::PeerCall& what, Post&& post) {
    auto inner = std::make_shared<Work>();
    core_->guard(what, 0, [&] { *inner = post(); });
    return Work([core = core_, inner, what] { core->guard(what, 0, [&] { inner->wait(); }); },
                [inner] { return inner->is_completed(); });
  }

  template <CommScalar T>
  void do_all_reduce(std::span<T> buf, ReduceOp op) {
    collective(detail::signature_of<T>(detail::CollectiveKind::AllReduce, buf.size(), static_cast<std::int64_t>(op)),
               [&] { raw_all_reduce(buf, op); });
  }
  template <CommScalar T>
  void do_broadcast(std::span<T> buf, int root) {
    core_->check_root(root);
    collective(detail::signature_of<T>(detail::CollectiveKind::Broadcast, buf.size(), root),
               [&] { raw_broadcast(buf, root); });
  }
  template <CommScalar T>
  void do_all_gather(std::span<const T> in, std::span<T> out) {
    core_->check_all_gather(in.size(), out.size());
    collective(detail::signature_of<T>(detail::CollectiveKind::AllGather, in.size()), [&] { raw_all_gather(in, out); });
  }
  template <CommScalar T>
  void do_reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op) {
    core_->check_reduce_scatter(in.size(), out.size());
    collective(detail::signature_of<T>(detail::CollectiveKind::ReduceScatter, in.size(), static_cast<std::int64_t>(op)),
               [&] {
                 std::vector<T> whole(in.begin(), in.end());
                 raw_all_reduce(std::span<T>(whole), op);
                 const std::size_t n = out.size();
                 const auto mine = whole.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank()) * n);
                 std::copy(mine, mine + static_cast<std::ptrdiff_t>(n), out.begin());
               });
  }
  void do_barrier() {
    collective(detail::CallSignature{detail::CollectiveKind::Barrier, CommDType::F32, 0, 0}, [&] {
      std::int32_t token = 0;
      raw_all_reduce(std::span<std::int32_t>(&token, 1), ReduceOp::Sum);
    });
  }

  // The algorithms themselves: bytes moved over the internal group, nothing checked.
  template <CommScalar T>
  void raw_all_reduce(std::span<T> buf, ReduceOp op) {
    const int p = size();
    if (p == 1 || buf.empty()) return;  // Avg over one rank is the identity
    if (rank() == 0) {
      std::vector<std::vector<T>> others(static_cast<std::size_t>(p - 1), std::vector<T>(buf.size()));
      std::vector<const T*> sources{buf.data()};
      for (int q = 1; q < p; ++q) {
        internal_.recv(std::span<T>(others[static_cast<std::size_t>(q - 1)]), q);
        sources.push_back(others[static_cast<std::size_t>(q - 1)].data());
      }
      T* out = buf.data();
      detail::reduce_many(sources.data(), p, &out, 1, buf.size(), op);
      for (int q = 1; q < p; ++q) internal_.send(std::span<const T>(buf), q);
    } else {
      internal_.send(std::span<const T>(buf), 0);
      internal_.recv(buf, 0);
    }
  }

  template <CommScalar T>
  void raw_broadcast(std::span<T> buf, int root) {
    if (rank() == root) {
      for (int q = 0; q < size(); ++q)
        if (q != root) internal_.send(std::span<const T>(buf), q);
    } else {
      internal_.recv(buf, root);
    }
  }

  template <CommScalar T>
  void raw_all_gather(std::span<const T> in, std::span<T> out) {
    const std::size_t n = in.size();
    if (rank() == 0) {
      std::copy(in.begin(), in.end(), out.begin());
      for (int q = 1; q < size(); ++q) internal_.recv(out.subspan(static_cast<std::size_t>(q) * n, n), q);
    } else {
      internal_.send(in, 0);
    }
    raw_broadcast(out, 0);
  }

  ThreadComm user_;
  ThreadComm internal_;
  std::shared_ptr<detail::CommCore> core_;       // shared with point-to-point Works
  std::unique_ptr<detail::AsyncWorker> worker_;  // last: joined before the groups it uses go
};

static_assert(check_communicator<P2pComm>());
static_assert(BHalfCommunicator<P2pComm> && comm_concepts::has_async<P2pComm, BHalf>);

using CpuP2p = Env<Cpu, P2pComm, float>;
using CpuP2p64 = Env<Cpu, P2pComm, double>;

}  // namespace tessera::testing
