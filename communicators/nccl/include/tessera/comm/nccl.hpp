// NcclComm: the communicator concept over NCCL, for buffers in GPU memory (Tensor<S, Cuda>).
//
//   auto comm = NcclComm::from(MpiComm::world());   // the unique id travels over MPI
//   auto comm = NcclComm::from(GlooComm::from_env()); // ... or over Gloo (its store + TCP)
//   auto comm = NcclComm::from_env();                // ... or through a file:// TESSERA_STORE
//   comm.all_reduce(std::span<float>(grad.data(), grad.numel()), ReduceOp::Avg);
//
// Every constructor first selects the GPU of this process's local rank (Cuda::select_device), so
// with one process per GPU nothing else needs setting. NCCL refuses two ranks of one
// communicator on the same GPU: run at most as many ranks per node as there are GPUs.
//
// Streams. Collectives run on a stream of their own (so they overlap compute), ordered after
// everything already queued on the device's compute stream (Cuda::stream()) by an event; wait()
// on a Work returns once the result is in memory and also orders the compute stream after it.
// Blocking calls are the async call followed by wait(), as in the other backends.
//
// Send/recv. NCCL blocks the GPU in a send until the peer's receive runs, so a ring where every
// rank sends first and then receives deadlocks unless those calls are fused into one NCCL group.
// send_async/recv_async therefore queue the operation and launch it with the next operation on
// this communicator (in one ncclGroupStart/End), or when its Work is waited on or polled: the
// conformance suite's "send_async right, recv left" ring becomes one fused group, as PyTorch's
// batch_isend_irecv does explicitly.
//
// Host buffers work too (for small control messages: step times, metrics): they are copied to
// the GPU and back around the operation.
//
// Failures. The communicator is created non-blocking (ncclConfig_t::blocking = 0), so no NCCL
// call can hang the host: waits poll the completion event and ncclCommGetAsyncError, and after
// CommOptions::timeout (TESSERA_COMM_TIMEOUT) the communicator is aborted (ncclCommAbort) and
// CommError names the operation, the rank and the time waited. After any CommError the
// communicator is broken and every later call throws at once (the same contract as Gloo's).
#pragma once

#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cuda.cuh"

namespace tessera {

namespace detail {

template <CommScalar T>
constexpr ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  else return ncclFloat16;  // Half: IEEE binary16, as ncclFloat16
}

// NCCL's ncclAvg is sum/size for every type: floating types multiply by 1/size before summing
// (so fp16 values near 65504 do not overflow), integers divide the sum, truncating like C++.
inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  throw ArgumentError("NcclComm: unknown ReduceOp");
}

// Everything one communicator needs, shared by copies of the NcclComm and by its Works.
struct NcclState {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  cudaStream_t stream = nullptr;  // NCCL's stream, distinct from the compute stream
  CommOptions options;
  int splits = 0;
  std::mutex mutex;    // one thread issues NCCL calls at a time; Works may wait on other threads
  std::string broken;  // why the communicator is unusable; empty while it works
  std::int64_t* signatures = nullptr;  // debug mode: size x 4 int64 in device memory

  // Send/recv queued by *_async, launched together with the next operation (see the header).
  struct Launch {
    cudaEvent_t done = nullptr;  // recorded on `stream` after the group ran; null until launched
    ~Launch() {
      if (done) (void)cudaEventDestroy(done);
    }
  };
  struct PendingP2p {
    std::function<ncclResult_t(cudaStream_t)> enqueue;
    std::shared_ptr<Launch> launch;
  };
  std::vector<PendingP2p> pending;

  ~NcclState() {
    if (comm == nullptr) return;
    (void)cudaSetDevice(device);
    if (!broken.empty()) {
      (void)ncclCommAbort(comm);  // a finalize would wait for peers that may be gone
    } else {
      // Finalize flushes outstanding work; on a non-blocking comm it returns at once and the
      // state is polled. If it does not settle within the timeout, abort instead of hanging.
      ncclResult_t state = ncclCommFinalize(comm);
      const auto deadline = std::chrono::steady_clock::now() + options.timeout;
      while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
        (void)ncclCommGetAsyncError(comm, &state);
      }
      if (state == ncclSuccess) (void)ncclCommDestroy(comm);
      else (void)ncclCommAbort(comm);
    }
    if (signatures) (void)cudaFree(signatures);
    if (stream) (void)cudaStreamDestroy(stream);
  }
};

inline std::string nccl_error_text(ncclResult_t status, ncclComm_t comm) {
  std::string text = detail::cat(ncclGetErrorString(status));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += detail::cat(": ", last);
  return text;
}

}  // namespace detail

class NcclComm {
 public:
  // The id travels over any host communicator of the same ranks (MpiComm, GlooComm, ThreadComm):
  // rank 0 creates it, a broadcast of its 128 bytes hands it to the others. The GPU is the
  // launcher's local rank (LaunchEnv) modulo the visible devices.
  // local_rank < 0: the launcher's (LaunchEnv); threads of one process pass their own.
  template <Communicator Host>
  static NcclComm from(Host& host, CommOptions options = {}, int local_rank = -1) {
    const int device = Cuda::select_device(local_rank >= 0 ? local_rank : LaunchEnv::from_environment().local_rank);
    ncclUniqueId id{};
    if (host.rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0, nullptr);
    std::array<std::int64_t, (sizeof(id) + 7) / 8> words{};
    std::memcpy(words.data(), &id, sizeof(id));
    host.broadcast(std::span<std::int64_t>(words), 0);
    std::memcpy(&id, words.data(), sizeof(id));
    return NcclComm(id, host.rank(), host.size(), device, options);
  }
  template <Communicator Host>
  static NcclComm from(Host&& host, CommOptions options = {}, int local_rank = -1) {
    Host keep(std::move(host));
    return from(keep, options, local_rank);
  }

  // Rank, size and local rank from the launcher (LaunchEnv); the id through the directory of a
  // file:// TESSERA_STORE (tessera-run makes a fresh one per run): rank 0 writes it atomically
  // (write, then rename), the others poll for it until the timeout. One rank needs no store.
  static NcclComm from_env(CommOptions options = {}) {
    const LaunchEnv env = LaunchEnv::from_environment();
    const int device = Cuda::select_device(env.local_rank);
    ncclUniqueId id{};
    if (env.rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0, nullptr);
    if (env.size > 1) exchange_id_through_file_store(env, options, id);
    return NcclComm(id, env.rank, env.size, device, options);
  }

  // Explicit: every rank passes the same id (from ncclGetUniqueId on one of them), its rank,
  // the size and its GPU.
  NcclComm(const ncclUniqueId& id, int rank, int size, int device, CommOptions options = {})
      : s_(std::make_shared<detail::NcclState>()) {
    TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, ArgumentError, "NcclComm: rank ", rank, " and size ", size,
                  " are inconsistent: need 0 <= rank < size");
    s_->rank = rank;
    s_->size = size;
    s_->device = device;
    s_->options = options;
    TESSERA_CUDA_CHECK(cudaSetDevice(device));
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclUniqueId copy = id;
    const ncclResult_t started = ncclCommInitRankConfig(&s_->comm, size, copy, rank, &config);
    settle(*s_, started, "ncclCommInitRankConfig (rendezvous of all ranks)");
  }

  int rank() const { return s_->rank; }
  int size() const { return s_->size; }
  int device() const { return s_->device; }
  ncclComm_t handle() const { return s_->comm; }
  cudaStream_t stream() const { return s_->stream; }

  template <CommScalar T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op) {
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>(buf, buf, [&](auto, std::span<T> d) { return all_reduce_async(d, op); });
    return collective(detail::CallSignature{detail::CollectiveKind::AllReduce, comm_dtype_of<T>,
                                            static_cast<std::int64_t>(buf.size()), static_cast<std::int64_t>(op)}, [=, this](cudaStream_t st) {
                        return ncclAllReduce(buf.data(), buf.data(), buf.size(), detail::nccl_type<T>(),
                                             detail::nccl_op(op), s_->comm, st);
                      });
  }
  template <CommScalar T>
  Work broadcast_async(std::span<T> buf, int root) {
    check_peer(root, "broadcast root");
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>(buf, buf, [&](auto, std::span<T> d) { return broadcast_async(d, root); });
    return collective(detail::CallSignature{detail::CollectiveKind::Broadcast, comm_dtype_of<T>,
                                            static_cast<std::int64_t>(buf.size()), root}, [=, this](cudaStream_t st) {
                        return ncclBroadcast(buf.data(), buf.data(), buf.size(), detail::nccl_type<T>(), root,
                                             s_->comm, st);
                      });
  }
  template <CommScalar T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    TESSERA_CHECK(out.size() == in.size() * static_cast<std::size_t>(size()), ArgumentError, "NcclComm all_gather on rank ",
                  rank(), ": output holds ", out.size(), " elements, expected ", size(), " x ", in.size());
    if (!on_device(in.data(), in.size_bytes()) || !on_device(out.data(), out.size_bytes()))
      return through_device<T>(in, out, [&](std::span<const T> a, std::span<T> b) { return all_gather_async(a, b); });
    return collective(detail::CallSignature{detail::CollectiveKind::AllGather, comm_dtype_of<T>,
                                            static_cast<std::int64_t>(in.size()), 0}, [=, this](cudaStream_t st) {
                        return ncclAllGather(in.data(), out.data(), in.size(), detail::nccl_type<T>(), s_->comm, st);
                      });
  }
  template <CommScalar T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
    TESSERA_CHECK(in.size() == out.size() * static_cast<std::size_t>(size()), ArgumentError,
                  "NcclComm reduce_scatter on rank ", rank(), ": input holds ", in.size(), " elements, expected ", size(),
                  " x ", out.size());
    if (!on_device(in.data(), in.size_bytes()) || !on_device(out.data(), out.size_bytes()))
      return through_device<T>(in, out,
                               [&](std::span<const T> a, std::span<T> b) { return reduce_scatter_async(a, b, op); });
    return collective(detail::CallSignature{detail::CollectiveKind::ReduceScatter, comm_dtype_of<T>,
                                            static_cast<std::int64_t>(out.size()), static_cast<std::int64_t>(op)}, [=, this](cudaStream_t st) {
                        return ncclReduceScatter(in.data(), out.data(), out.size(), detail::nccl_type<T>(),
                                                 detail::nccl_op(op), s_->comm, st);
                      });
  }
  template <CommScalar T>
  Work send_async(std::span<const T> buf, int peer) {
    check_peer(peer, "send peer");
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>(buf, {}, [&](std::span<const T> d, auto) { return send_async(d, peer); });
    return queue_p2p([=, this](cudaStream_t st) {
      return ncclSend(buf.data(), buf.size(), detail::nccl_type<T>(), peer, s_->comm, st);
    }, detail::cat("send(", to_string(comm_dtype_of<T>), " x ", buf.size(), ") to rank ", peer));
  }
  template <CommScalar T>
  Work recv_async(std::span<T> buf, int peer) {
    check_peer(peer, "recv peer");
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>({}, buf, [&](auto, std::span<T> d) { return recv_async(d, peer); });
    return queue_p2p([=, this](cudaStream_t st) {
      return ncclRecv(buf.data(), buf.size(), detail::nccl_type<T>(), peer, s_->comm, st);
    }, detail::cat("recv(", to_string(comm_dtype_of<T>), " x ", buf.size(), ") from rank ", peer));
  }

  template <CommScalar T>
  void all_reduce(std::span<T> buf, ReduceOp op) { all_reduce_async(buf, op).wait(); }
  template <CommScalar T>
  void broadcast(std::span<T> buf, int root) { broadcast_async(buf, root).wait(); }
  template <CommScalar T>
  void all_gather(std::span<const T> in, std::span<T> out) { all_gather_async(in, out).wait(); }
  template <CommScalar T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op) { reduce_scatter_async(in, out, op).wait(); }
  template <CommScalar T>
  void send(std::span<const T> buf, int peer) { send_async(buf, peer).wait(); }
  template <CommScalar T>
  void recv(std::span<T> buf, int peer) { recv_async(buf, peer).wait(); }

  // An all_reduce of one int on the GPU, waited for: every rank has reached it.
  void barrier() {
    auto& s = *s_;
    if (s.signatures == nullptr) allocate_scratch(s);
    std::int64_t* word = s.signatures;  // the debug scratch: its value does not matter here
    collective(detail::CallSignature{detail::CollectiveKind::Barrier, CommDType::I64, 1, 0}, [=, this](cudaStream_t st) {
      return ncclAllReduce(word, word, 1, ncclInt64, ncclSum, s_->comm, st);
    }).wait();
  }

  // ncclCommSplit: ranks with the same color form a new communicator ordered by (key, rank),
  // on the same GPU, created non-blocking like the parent. Collective over the parent.
  NcclComm split(int color, int key) {
    TESSERA_CHECK(color >= 0, ArgumentError, "NcclComm split on rank ", rank(), ": color ", color, " must be >= 0");
    auto& s = *s_;
    NcclComm child;
    child.s_ = std::make_shared<detail::NcclState>();
    auto& c = *child.s_;
    c.rank = s.rank;  // until NCCL says otherwise, errors name the parent rank
    c.size = s.size;
    c.device = s.device;
    c.options = s.options;
    std::lock_guard lock(s.mutex);
    ensure_usable(s, "split");
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    flush_pending(s);
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t started = ncclCommSplit(s.comm, color, key, &c.comm, &config);
    ++s.splits;
    // The new communicator is being built while the call reports ncclInProgress: poll it.
    settle(c, started, detail::cat("ncclCommSplit(color ", color, ", key ", key, ")"));
    check(ncclCommUserRank(c.comm, &c.rank), "ncclCommUserRank", s.rank, c.comm);
    check(ncclCommCount(c.comm, &c.size), "ncclCommCount", s.rank, c.comm);
    return child;
  }

 private:
  NcclComm() = default;

  static void check(ncclResult_t status, const std::string& what, int rank, ncclComm_t comm) {
    if (status == ncclSuccess) return;
    throw CommError(detail::cat("NcclComm ", what, " on rank ", rank, ": NCCL error ", detail::nccl_error_text(status, comm)));
  }

  // A call on a non-blocking communicator may return ncclInProgress: poll until it settles
  // (NCCL forbids other calls on the communicator meanwhile), abort at the timeout.
  static void settle(detail::NcclState& s, ncclResult_t status, const std::string& what) {
    const auto start = std::chrono::steady_clock::now();
    while (status == ncclInProgress) {
      if (std::chrono::steady_clock::now() - start > s.options.timeout) {
        fail(s, detail::cat("NcclComm ", what, " on rank ", s.rank, " of ", s.size, ": did not complete within ",
                    detail::seconds_text(s.options.timeout), " (a peer is missing, dead or hung)"));
      }
      std::this_thread::yield();
      if (s.comm == nullptr) break;
      if (ncclCommGetAsyncError(s.comm, &status) != ncclSuccess) break;
    }
    if (status != ncclSuccess)
      fail(s, detail::cat("NcclComm ", what, " on rank ", s.rank, " of ", s.size, ": NCCL error ",
                  detail::nccl_error_text(status, s.comm)));
  }

  // Marks the communicator broken, aborts it so no peer waits on it forever, and throws.
  [[noreturn]] static void fail(detail::NcclState& s, const std::string& text) {
    if (s.broken.empty()) s.broken = text;
    if (s.comm != nullptr) {
      (void)ncclCommAbort(s.comm);
      s.comm = nullptr;
    }
    throw CommError(text);
  }

  static void ensure_usable(detail::NcclState& s, const std::string& what) {
    TESSERA_CHECK(s.broken.empty(), CommError, "NcclComm ", what, " on rank ", s.rank,
                  ": communicator is unusable after an earlier error: ", s.broken);
  }

  void check_peer(int peer, const char* role) const {
    TESSERA_CHECK(peer >= 0 && peer < size(), ArgumentError, "NcclComm on rank ", rank(), ": ", role, " ", peer,
                  " is outside 0..", size() - 1);
  }

  // NCCL reads and writes GPU memory only (a host pointer would fault inside its kernel).
  // cudaPointerGetAttributes tells them apart, in about a microsecond.
  static bool on_device(const void* p, std::size_t bytes) {
    if (bytes == 0) return true;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  }

  // A host buffer's stand-in in GPU memory (from the device's cache) for one operation.
  template <class T>
  struct DeviceCopy {
    T* data = nullptr;
    std::size_t size = 0;
    explicit DeviceCopy(std::size_t n) : size(n) {
      if (n) data = static_cast<T*>(Cuda::allocate(n * sizeof(T)));
    }
    ~DeviceCopy() {
      if (data) Cuda::deallocate(data, size * sizeof(T));
    }
    DeviceCopy(const DeviceCopy&) = delete;
    DeviceCopy& operator=(const DeviceCopy&) = delete;
  };

  // Host buffers, for control messages (step times, metrics, a BN count): `run` gets device
  // copies, `in` copied over first, `out` copied back when the Work is waited on; in-place
  // operations pass the same span as both. Costs two copies and an allocation from the cache:
  // keep large tensors on the GPU.
  template <class T, class Run>
  Work through_device(std::span<const T> in, std::span<T> out, Run&& run) {
    TESSERA_CUDA_CHECK(cudaSetDevice(s_->device));
    const bool in_place = !in.empty() && static_cast<const void*>(in.data()) == static_cast<const void*>(out.data());
    auto in_copy = std::make_shared<DeviceCopy<T>>(in_place || on_device(in.data(), in.size_bytes()) ? 0 : in.size());
    auto out_copy = std::make_shared<DeviceCopy<T>>(on_device(out.data(), out.size_bytes()) ? 0 : out.size());
    if (in_copy->data) Cuda::copy_to_device(in_copy->data, in.data(), in.size_bytes());
    if (in_place) Cuda::copy_to_device(out_copy->data, in.data(), in.size_bytes());
    const std::span<const T> device_in = in_place ? std::span<const T>(out_copy->data, out.size())
                                         : in_copy->data ? std::span<const T>(in_copy->data, in.size()) : in;
    const std::span<T> device_out = out_copy->data ? std::span<T>(out_copy->data, out.size()) : out;
    auto inner = std::make_shared<Work>(run(device_in, device_out));
    const std::span<T> host_out = out_copy->data ? out : std::span<T>();
    return Work(
        [inner, in_copy, out_copy, host_out] {
          inner->wait();
          if (host_out.empty()) return;
          Cuda::copy_to_host(host_out.data(), out_copy->data, host_out.size_bytes());
          Cuda::synchronize();
        },
        [inner] { return inner->is_completed(); });
  }

  static void allocate_scratch(detail::NcclState& s) {
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    TESSERA_CUDA_CHECK(cudaMalloc(&s.signatures, sizeof(std::int64_t) * 4 * static_cast<std::size_t>(s.size)));
  }

  // Records an event on `stream` and returns a Work that waits for it (with the timeout and the
  // async-error check) and then orders the compute stream after it.
  Work completion(cudaEvent_t done, std::string what) {
    auto state = s_;
    auto event = std::shared_ptr<detail::NcclState::Launch>(new detail::NcclState::Launch{done});
    return completion_of(state, event, std::move(what));
  }
  static Work completion_of(std::shared_ptr<detail::NcclState> state, std::shared_ptr<detail::NcclState::Launch> launch,
                            std::string what) {
    auto launched = [state, launch] {
      if (launch->done != nullptr) return;
      std::lock_guard lock(state->mutex);
      ensure_usable(*state, "pending send/recv");
      flush_pending(*state);
    };
    auto wait = [state, launch, launched, what] {
      launched();
      TESSERA_CUDA_CHECK(cudaSetDevice(state->device));
      const auto start = std::chrono::steady_clock::now();
      for (;;) {
        const cudaError_t query = cudaEventQuery(launch->done);
        if (query == cudaSuccess) break;
        if (query != cudaErrorNotReady) TESSERA_CUDA_CHECK(query);
        std::lock_guard lock(state->mutex);
        ensure_usable(*state, what);
        ncclResult_t async_error = ncclSuccess;
        (void)ncclCommGetAsyncError(state->comm, &async_error);
        if (async_error != ncclSuccess && async_error != ncclInProgress)
          fail(*state, detail::cat("NcclComm ", what, " on rank ", state->rank, " of ", state->size, ": NCCL error ",
                           detail::nccl_error_text(async_error, state->comm)));
        if (std::chrono::steady_clock::now() - start > state->options.timeout)
          fail(*state, detail::cat("NcclComm ", what, " on rank ", state->rank, " of ", state->size, ": not complete after ",
                           detail::seconds_text(state->options.timeout),
                           " (a peer is dead, hung or called a different collective); communicator aborted"));
        std::this_thread::yield();
      }
      TESSERA_CUDA_CHECK(cudaStreamWaitEvent(Cuda::stream(), launch->done, 0));
    };
    auto poll = [state, launch, launched] {
      launched();
      return cudaEventQuery(launch->done) == cudaSuccess;
    };
    return Work(std::move(wait), std::move(poll));
  }

  // One collective: queued sends/recvs first (one group), then the collective on NCCL's stream
  // after the compute stream's work so far.
  template <class Enqueue>
  Work collective(const detail::CallSignature& signature, Enqueue&& enqueue) {
    auto& s = *s_;
    std::lock_guard lock(s.mutex);
    ensure_usable(s, signature.describe());
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    flush_pending(s);
    if (s.options.debug && s.size > 1) check_signature(s, signature);
    order_after_compute(s);
    settle(s, enqueue(s.stream), signature.describe());
    cudaEvent_t done = record(s);
    return completion(done, signature.describe());
  }

  Work queue_p2p(std::function<ncclResult_t(cudaStream_t)> enqueue, std::string what) {
    auto& s = *s_;
    std::lock_guard lock(s.mutex);
    ensure_usable(s, what);
    auto launch = std::make_shared<detail::NcclState::Launch>();
    s.pending.push_back({std::move(enqueue), launch});
    return completion_of(s_, launch, std::move(what));
  }

  // Launches every queued send/recv in one NCCL group (the caller holds the mutex).
  static void flush_pending(detail::NcclState& s) {
    if (s.pending.empty()) return;
    auto pending = std::move(s.pending);
    s.pending.clear();
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    order_after_compute(s);
    check(ncclGroupStart(), "ncclGroupStart", s.rank, s.comm);
    for (auto& op : pending) {
      const ncclResult_t status = op.enqueue(s.stream);
      if (status != ncclSuccess && status != ncclInProgress) {
        (void)ncclGroupEnd();
        fail(s, detail::cat("NcclComm send/recv on rank ", s.rank, ": NCCL error ", detail::nccl_error_text(status, s.comm)));
      }
    }
    settle(s, ncclGroupEnd(), detail::cat(pending.size(), " grouped send/recv"));
    cudaEvent_t done = record(s);
    // Every Work of the group waits on the same point of the stream; each needs its own event
    // object because each Launch owns (and destroys) one.
    pending.front().launch->done = done;
    for (std::size_t i = 1; i < pending.size(); ++i) pending[i].launch->done = record(s);
  }

  static void order_after_compute(detail::NcclState& s) {
    cudaEvent_t ready = nullptr;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventRecord(ready, Cuda::stream()));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(s.stream, ready, 0));
    TESSERA_CUDA_CHECK(cudaEventDestroy(ready));  // released once the wait is satisfied
  }
  static cudaEvent_t record(detail::NcclState& s) {
    cudaEvent_t done = nullptr;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventRecord(done, s.stream));
    return done;
  }

  // Debug mode: all ranks compare the call they are about to make (an all_gather of 4 int64 per
  // rank through GPU scratch memory, which cannot itself mismatch).
  static void check_signature(detail::NcclState& s, const detail::CallSignature& signature) {
    if (s.signatures == nullptr) allocate_scratch(s);
    const auto mine = signature.encode();
    std::int64_t* slot = s.signatures + 4 * s.rank;
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(slot, mine.data(), sizeof(mine), cudaMemcpyHostToDevice, s.stream));
    settle(s, ncclAllGather(slot, s.signatures, 4, ncclInt64, s.comm, s.stream), "debug signature exchange");
    std::vector<std::int64_t> all(4 * static_cast<std::size_t>(s.size));
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(all.data(), s.signatures, all.size() * sizeof(std::int64_t),
                                       cudaMemcpyDeviceToHost, s.stream));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    try {
      detail::check_signatures("NcclComm", s.rank, all);
    } catch (const CommError& e) {
      fail(s, e.what());
    }
  }

  static void exchange_id_through_file_store(const LaunchEnv& env, const CommOptions& options, ncclUniqueId& id) {
    const std::string prefix = "file://";
    TESSERA_CHECK(env.store.rfind(prefix, 0) == 0, ArgumentError, "NcclComm::from_env on rank ", env.rank, " of ",
                  env.size, ": needs TESSERA_STORE=file:///shared/dir to pass NCCL's id (got '", env.store,
                  "'); with mpirun or a Redis store use NcclComm::from(MpiComm::world()) or "
                  "NcclComm::from(GlooComm::from_env())");
    const std::filesystem::path dir = env.store.substr(prefix.size());
    const char* store_prefix = std::getenv("TESSERA_STORE_PREFIX");
    const std::string name = detail::cat(store_prefix != nullptr && *store_prefix ? store_prefix : "tessera", ".nccl_unique_id");
    const auto path = dir / name;
    if (env.rank == 0) {
      const auto temp = dir / (name + ".tmp");
      {
        std::ofstream out(temp, std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(&id), sizeof(id));
        TESSERA_CHECK(out.good(), IoError, "NcclComm::from_env on rank 0: cannot write ", temp);
      }
      std::error_code ec;
      std::filesystem::rename(temp, path, ec);
      TESSERA_CHECK(!ec, IoError, "NcclComm::from_env on rank 0: cannot rename ", temp, " to ", path, ": ", ec.message());
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      std::ifstream in(path, std::ios::binary);
      if (in && in.read(reinterpret_cast<char*>(&id), sizeof(id)) && in.gcount() == sizeof(id)) return;
      TESSERA_CHECK(std::chrono::steady_clock::now() - start < options.timeout, CommError, "NcclComm::from_env on rank ",
                    env.rank, " of ", env.size, ": rank 0 did not publish NCCL's id at ", path, " within ",
                    detail::seconds_text(options.timeout));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  std::shared_ptr<detail::NcclState> s_;
};

static_assert(check_communicator<NcclComm>());

// One process per GPU, gradients reduced by NCCL.
using CudaNccl = Env<Cuda, NcclComm, float>;
using CudaNccl64 = Env<Cuda, NcclComm, double>;

}  // namespace tessera
