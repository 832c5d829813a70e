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
// batch_isend_irecv does explicitly. Unlike MPI's and Gloo's, a send here is not buffered:
// if rank A sends to B and then starts a collective, while B runs that collective before its
// receive, both wait until the timeout. Post matching sends and receives before the next
// collective, as every strategy in Tessera does.
//
// Half is reduced by NCCL in fp16 on the GPU (the other backends accumulate it in float), so a
// long fp16 sum rounds more; Avg multiplies by 1/size first, so it does not overflow. BHalf is
// ncclBfloat16 (NCCL 2.10; ncclConfig_t already needs 2.14), reduced in bfloat16 on the GPU likewise.
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
#include <atomic>
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
#include <type_traits>
#include <vector>

#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/core.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/monitor.hpp"
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
  else if constexpr (std::is_same_v<T, Half>) return ncclFloat16;  // IEEE binary16
  else return ncclBfloat16;  // BHalf: bfloat16, the top half of a float32
}

// NCCL's ncclAvg is sum/size for every type: floating types multiply by 1/size before summing
// (so fp16 values near 65504 do not overflow), integers divide the sum, truncating like C++.
//
// One rank: Avg is Sum. NCCL up to 2.29.6 runs a one-rank ncclAvg (any premultiplied op)
// through its oneRankReduce kernel, whose per-block range rounds nElts / blocks down and so
// leaves the last nElts % blocks elements unwritten (NVIDIA/nccl#1950, fixed in 2.29.7; seen here
// on an H200 with 2.28: a reduce_scatter of 65537 doubles lost its last element). A sum over one
// rank is a copy, which NCCL does with cudaMemcpy, and x / 1 == x exactly for every type.
inline ncclRedOp_t nccl_op(ReduceOp op, int ranks) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ranks == 1 ? ncclSum : ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  throw ArgumentError("NcclComm: unknown ReduceOp");
}

// Completion events, reused: after warm-up a training step's collectives create none. Shared
// by a communicator's state and its Works' launches (either may be destroyed first).
class NcclEventPool {
 public:
  cudaEvent_t take() {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  // Only once nothing waits on it any more (a stream wait already enqueued keeps its own copy
  // of the event's state, so re-recording it later is safe).
  void give(cudaEvent_t event) noexcept {
    std::lock_guard lock(mutex_);
    try {
      free_.push_back(event);
    } catch (...) {
      (void)cudaEventDestroy(event);
    }
  }
  ~NcclEventPool() {
    for (cudaEvent_t event : free_) (void)cudaEventDestroy(event);
  }

 private:
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// Everything one communicator needs, shared by copies of the NcclComm and by its Works.
struct NcclState {
  ncclComm_t comm = nullptr;
  int device = 0;
  cudaStream_t stream = nullptr;  // NCCL's stream, distinct from the compute stream
  // The per-call protocol (comm/core.hpp): checks, ledger, board, broken state. Its broken hook
  // aborts `comm` (taking the mutex, which is recursive for that: most failures are found by a
  // thread that holds it already).
  CommCore core;
  int splits = 0;
  std::recursive_mutex mutex;  // one thread issues NCCL calls at a time; Works may wait on other threads
  // size x CallLedger::kWindow x 4 int64 on the GPU: the call check's exchanges, barrier word
  std::int64_t* signatures = nullptr;
  // Re-recorded at every use: compute -> NCCL ordering, and NCCL -> compute before staging
  // copies go back to the cache.
  cudaEvent_t compute_ready = nullptr, nccl_queued = nullptr;
  std::shared_ptr<NcclEventPool> events = std::make_shared<NcclEventPool>();

  // Send/recv queued by *_async, launched together with the next operation (see the header).
  struct Launch {
    // Recorded on `stream` after the group ran; null until launched. Set under the mutex, read
    // without it (a poll must not wait for another thread's long call).
    std::atomic<cudaEvent_t> done{nullptr};
    std::shared_ptr<NcclEventPool> pool;  // where `done` goes back
    explicit Launch(std::shared_ptr<NcclEventPool> from, cudaEvent_t event = nullptr)
        : done(event), pool(std::move(from)) {}
    ~Launch() {
      if (cudaEvent_t event = done.load()) pool->give(event);
    }
  };
  struct PendingP2p {
    // Captures its buffers by value, never the NcclComm (which may be gone when it launches).
    std::function<ncclResult_t(ncclComm_t, cudaStream_t)> enqueue;
    std::shared_ptr<Launch> launch;
    std::shared_ptr<void> keep_alive;  // host-buffer staging copies, freed once launched
  };
  std::vector<PendingP2p> pending;

  ~NcclState() {
    (void)cudaSetDevice(device);
    if (comm == nullptr) {
      // Already aborted (fail) or never created: nothing of NCCL's to release.
    } else if (core.broken()) {
      (void)ncclCommAbort(comm);  // a finalize would wait for peers that may be gone
    } else {
      // Finalize flushes outstanding work; on a non-blocking comm it returns at once and the
      // state is polled. If it does not settle within the timeout, abort instead of hanging.
      ncclResult_t state = ncclCommFinalize(comm);
      const auto deadline = std::chrono::steady_clock::now() + core.options().timeout;
      while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
        (void)ncclCommGetAsyncError(comm, &state);
      }
      if (state == ncclSuccess) (void)ncclCommDestroy(comm);
      else (void)ncclCommAbort(comm);
    }
    if (signatures) (void)cudaFree(signatures);
    if (compute_ready) (void)cudaEventDestroy(compute_ready);
    if (nccl_queued) (void)cudaEventDestroy(nccl_queued);
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
  static constexpr const char* backend_name = "nccl";
  // Env<D, NcclComm> is valid for the Cuda device only (checked where the Env is used).
  template <class D>
  static consteval bool accepts_device() {
    static_assert(std::is_same_v<D, Cuda>, "NcclComm moves GPU memory only: pair it with the Cuda device "
                                           "(Env<Cuda, NcclComm>, alias CudaNccl); on the CPU use MpiComm or "
                                           "GlooComm (CpuMpi, CpuGloo)");
    return true;
  }
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
  // Each call of a process uses its own file (the n-th from_env of every rank meet), named with
  // SLURM_JOB_ID when there is one, and rank 0 removes it once all ranks have joined. A file left
  // by a crashed run in a reused directory could still be read: give each job its own store
  // directory or TESSERA_STORE_PREFIX (tessera-run makes a fresh directory per run).
  static NcclComm from_env(CommOptions options = {}) {
    const LaunchEnv env = LaunchEnv::from_environment();
    const int device = Cuda::select_device(env.local_rank);
    ncclUniqueId id{};
    if (env.rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0, nullptr);
    static std::atomic<int> calls{0};
    const int call = calls.fetch_add(1);
    std::filesystem::path id_file;
    if (env.size > 1) id_file = exchange_id_through_file_store(env, options, call, id);
    NcclComm comm(id, env.rank, env.size, device, options);
    if (env.rank == 0 && !id_file.empty()) {
      std::error_code ignored;  // every rank has read it: init only completes once all joined
      std::filesystem::remove(id_file, ignored);
    }
    return comm;
  }

  // Explicit: every rank passes the same id (from ncclGetUniqueId on one of them), its rank,
  // the size and its GPU.
  NcclComm(const ncclUniqueId& id, int rank, int size, int device, CommOptions options = {})
      : s_(std::make_shared<detail::NcclState>()) {
    TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, ArgumentError, "NcclComm: rank ", rank, " and size ", size,
                  " are inconsistent: need 0 <= rank < size");
    s_->device = device;
    start_core(*s_, rank, size, options);
    TESSERA_CUDA_CHECK(cudaSetDevice(device));
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclUniqueId copy = id;
    const ncclResult_t started = ncclCommInitRankConfig(&s_->comm, size, copy, rank, &config);
    settle(*s_, started, "ncclCommInitRankConfig (rendezvous of all ranks)");
    allocate_resources(*s_, "nccl:world");
  }

  int rank() const { return s_->core.rank(); }
  int size() const { return s_->core.size(); }
  int device() const { return s_->device; }
  ncclComm_t handle() const { return s_->comm; }
  cudaStream_t stream() const { return s_->stream; }

  template <CommScalar T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op) {
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>(buf, buf, [&](auto, std::span<T> d, auto) { return all_reduce_async(d, op); });
    const ncclRedOp_t red = detail::nccl_op(op, size());
    return collective(detail::signature_of<T>(detail::CollectiveKind::AllReduce, buf.size(), static_cast<std::int64_t>(op)),
                      [=](ncclComm_t nccl, cudaStream_t st) {
                        return ncclAllReduce(buf.data(), buf.data(), buf.size(), detail::nccl_type<T>(),
                                             red, nccl, st);
                      });
  }
  template <CommScalar T>
  Work broadcast_async(std::span<T> buf, int root) {
    s_->core.check_root(root);
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>(buf, buf, [&](auto, std::span<T> d, auto) { return broadcast_async(d, root); });
    return collective(detail::signature_of<T>(detail::CollectiveKind::Broadcast, buf.size(), root),
                      [=](ncclComm_t nccl, cudaStream_t st) {
                        return ncclBroadcast(buf.data(), buf.data(), buf.size(), detail::nccl_type<T>(), root,
                                             nccl, st);
                      });
  }
  template <CommScalar T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    s_->core.check_all_gather(in.size(), out.size());
    if (!on_device(in.data(), in.size_bytes()) || !on_device(out.data(), out.size_bytes()))
      return through_device<T>(in, out, [&](std::span<const T> a, std::span<T> b, auto) { return all_gather_async(a, b); });
    return collective(detail::signature_of<T>(detail::CollectiveKind::AllGather, in.size()),
                      [=](ncclComm_t nccl, cudaStream_t st) {
                        return ncclAllGather(in.data(), out.data(), in.size(), detail::nccl_type<T>(), nccl, st);
                      });
  }
  template <CommScalar T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
    s_->core.check_reduce_scatter(in.size(), out.size());
    if (!on_device(in.data(), in.size_bytes()) || !on_device(out.data(), out.size_bytes()))
      return through_device<T>(in, out,
                               [&](std::span<const T> a, std::span<T> b, auto) { return reduce_scatter_async(a, b, op); });
    const ncclRedOp_t red = detail::nccl_op(op, size());
    return collective(detail::signature_of<T>(detail::CollectiveKind::ReduceScatter, in.size(), static_cast<std::int64_t>(op)),
                      [=](ncclComm_t nccl, cudaStream_t st) {
                        return ncclReduceScatter(in.data(), out.data(), out.size(), detail::nccl_type<T>(),
                                                 red, nccl, st);
                      });
  }
  template <CommScalar T>
  Work send_async(std::span<const T> buf, int peer) {
    s_->core.check_peer(peer, "send", /*self_allowed=*/true);
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>(buf, {}, [&](std::span<const T> d, auto, std::shared_ptr<void> keep) {
        return queue_send(d, peer, std::move(keep));
      });
    return queue_send(buf, peer, nullptr);
  }
  template <CommScalar T>
  Work recv_async(std::span<T> buf, int peer) {
    s_->core.check_peer(peer, "recv", /*self_allowed=*/true);
    if (!on_device(buf.data(), buf.size_bytes()))
      return through_device<T>({}, buf, [&](auto, std::span<T> d, std::shared_ptr<void> keep) {
        return queue_recv(d, peer, std::move(keep));
      });
    return queue_recv(buf, peer, nullptr);
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
    std::int64_t* word = s_->signatures;  // the debug scratch: its value does not matter here
    collective(detail::CallSignature{detail::CollectiveKind::Barrier, CommDType::I64, 1, 0}, [=](ncclComm_t nccl, cudaStream_t st) {
      return ncclAllReduce(word, word, 1, ncclInt64, ncclSum, nccl, st);
    }).wait();
  }

  // ncclCommSplit: ranks with the same color form a new communicator ordered by (key, rank),
  // on the same GPU, created non-blocking like the parent. Collective over the parent.
  NcclComm split(int color, int key) {
    s_->core.check_split_color(color);
    auto& s = *s_;
    NcclComm child;
    child.s_ = std::make_shared<detail::NcclState>();
    auto& c = *child.s_;
    c.device = s.device;
    c.core = detail::CommCore("NcclComm", s.core.rank(), s.core.size(), s.core.options());  // until NCCL says otherwise
    const std::string label = detail::cat(s.core.label(), "/split", s.splits + 1, ".color", color);
    std::lock_guard lock(s.mutex);
    s.core.check_usable("split");
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    flush_pending(s);
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const std::string what = detail::cat("ncclCommSplit(color ", color, ", key ", key, ")");
    settle_split(s, c, ncclCommSplit(s.comm, color, key, &c.comm, &config), what);
    ++s.splits;
    int rank = 0, size = 1;
    check(ncclCommUserRank(c.comm, &rank), "ncclCommUserRank", s.core.rank(), c.comm);
    check(ncclCommCount(c.comm, &size), "ncclCommCount", s.core.rank(), c.comm);
    start_core(c, rank, size, s.core.options());
    allocate_resources(c, label);
    return child;
  }

 private:
  NcclComm() = default;

  static void check(ncclResult_t status, const std::string& what, int rank, ncclComm_t comm) {
    if (status == ncclSuccess) return;
    throw CommError(detail::cat("NcclComm ", what, " on rank ", rank, ": NCCL error ", detail::nccl_error_text(status, comm)));
  }

  // The core, with the broken hook that aborts the communicator so no peer waits on it forever.
  static void start_core(detail::NcclState& s, int rank, int size, const CommOptions& options) {
    s.core = detail::CommCore("NcclComm", rank, size, options);
    s.core.on_broken([state = &s](const std::string&) {
      std::lock_guard lock(state->mutex);
      if (state->comm == nullptr) return;
      (void)ncclCommAbort(state->comm);
      state->comm = nullptr;
    });
  }

  // A call on a non-blocking communicator may return ncclInProgress: the core's wait polls it
  // until it settles (NCCL forbids other calls on the communicator meanwhile) and aborts at the
  // timeout.
  template <class What>
  static void settle(detail::NcclState& s, ncclResult_t status, const What& what) {
    if (status == ncclInProgress)
      s.core.wait(what, 0, [&] {
        if (s.comm == nullptr) return true;
        if (const ncclResult_t query = ncclCommGetAsyncError(s.comm, &status); query != ncclSuccess) status = query;
        return status != ncclInProgress;
      }, "; the communicator is aborted", "a peer is missing, dead or hung");
    if (status != ncclSuccess) [[unlikely]]
      s.core.fail(what, detail::cat("NCCL error ", detail::nccl_error_text(status, s.comm)));
  }

  // A non-blocking ncclCommSplit runs as a job of the parent: the parent reports ncclInProgress
  // until it is done, and the child handle may stay null until then (NCCL fills it in at the
  // end), so both are polled. On failure or timeout both are aborted and the parent is broken.
  static void settle_split(detail::NcclState& parent, detail::NcclState& child, ncclResult_t status,
                           const std::string& what) {
    const auto start = std::chrono::steady_clock::now();
    // Marked broken too: the parent's abort waits for the split job, which may still write a
    // half-built child into child.comm; the destructor then aborts it rather than finalizing.
    const auto abort_child = [&] {
      child.core.mark_broken("ncclCommSplit failed");
      if (child.comm != nullptr) (void)ncclCommAbort(child.comm);
      child.comm = nullptr;
    };
    for (;;) {
      if (status != ncclSuccess && status != ncclInProgress) {
        abort_child();
        parent.core.fail(what, detail::cat("NCCL error ", detail::nccl_error_text(status, parent.comm)));
      }
      ncclResult_t child_status = ncclInProgress;
      if (status == ncclSuccess && child.comm != nullptr) {
        if (const ncclResult_t query = ncclCommGetAsyncError(child.comm, &child_status); query != ncclSuccess)
          child_status = query;
        if (child_status == ncclSuccess) return;
        if (child_status != ncclInProgress) {
          abort_child();
          parent.core.fail(what, detail::cat("the new communicator failed: ", detail::nccl_error_text(child_status, nullptr)));
        }
      }
      if (std::chrono::steady_clock::now() - start > parent.core.options().timeout) {
        abort_child();
        parent.core.fail(what, detail::cat("timed out after ", detail::seconds_text(parent.core.options().timeout),
                                           status == ncclSuccess && child.comm == nullptr
                                               ? " (NCCL returned no communicator for this rank)"
                                               : " (a peer is missing, dead or hung)"));
      }
      std::this_thread::yield();
      if (status == ncclInProgress)
        if (const ncclResult_t query = ncclCommGetAsyncError(parent.comm, &status); query != ncclSuccess) status = query;
    }
  }

  // NCCL reads and writes GPU memory only (a host pointer would fault inside its kernel), and
  // only this communicator's GPU. cudaPointerGetAttributes tells them apart in about a
  // microsecond; host memory (pageable or pinned) is staged through the GPU.
  bool on_device(const void* p, std::size_t bytes) const {
    if (bytes == 0) return true;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (attributes.type == cudaMemoryTypeManaged) return true;
    if (attributes.type != cudaMemoryTypeDevice) return false;
    TESSERA_CHECK(attributes.device == s_->device, ArgumentError, "NcclComm on rank ", rank(), ": a buffer lives on GPU ",
                  attributes.device, " but this communicator runs on GPU ", s_->device,
                  " (allocate it after Cuda::select_device, on the communicator's GPU)");
    return true;
  }

  // A host buffer's stand-in in GPU memory (from the device's cache) for one operation. The
  // cache reuses blocks in the order of the compute stream, but NCCL works on its own stream:
  // before the block goes back, the compute stream waits for everything NCCL has queued so far
  // (by then the operation is queued: a pending send/recv keeps its copies alive until launch).
  template <class T>
  struct DeviceCopy {
    T* data = nullptr;
    std::size_t size = 0;
    std::weak_ptr<detail::NcclState> state;
    DeviceCopy(std::size_t n, std::weak_ptr<detail::NcclState> owner) : size(n), state(std::move(owner)) {
      if (n) data = static_cast<T*>(Cuda::allocate(n * sizeof(T)));
    }
    ~DeviceCopy() {
      if (!data) return;
      // Locking fails only inside ~NcclState, after its finalize or abort ended NCCL's work.
      if (const auto s = state.lock(); s && s->stream) {
        try {
          stream_wait(Cuda::stream(), s->stream, s->nccl_queued);
        } catch (...) {
          return;  // the GPU is failing: leaking the block is safer than reusing it
        }
      }
      Cuda::deallocate(data, size * sizeof(T));
    }
    DeviceCopy(const DeviceCopy&) = delete;
    DeviceCopy& operator=(const DeviceCopy&) = delete;
  };

  // Host buffers, for control messages (step times, metrics, a BN count): `run` gets device
  // copies, `in` copied over first, `out` copied back when the Work is waited on; in-place
  // operations pass the same span as both. Costs two copies and an allocation from the cache:
  // keep large tensors on the GPU. run's third argument owns the copies (for queued send/recv).
  template <class T, class Run>
  Work through_device(std::span<const T> in, std::span<T> out, Run&& run) {
    TESSERA_CUDA_CHECK(cudaSetDevice(s_->device));
    const bool in_place = !in.empty() && static_cast<const void*>(in.data()) == static_cast<const void*>(out.data());
    auto in_copy =
        std::make_shared<DeviceCopy<T>>(in_place || on_device(in.data(), in.size_bytes()) ? 0 : in.size(), s_);
    auto out_copy = std::make_shared<DeviceCopy<T>>(on_device(out.data(), out.size_bytes()) ? 0 : out.size(), s_);
    if (in_copy->data) Cuda::copy_to_device(in_copy->data, in.data(), in.size_bytes());
    if (in_place) Cuda::copy_to_device(out_copy->data, in.data(), in.size_bytes());
    const std::span<const T> device_in = in_place ? std::span<const T>(out_copy->data, out.size())
                                         : in_copy->data ? std::span<const T>(in_copy->data, in.size()) : in;
    const std::span<T> device_out = out_copy->data ? std::span<T>(out_copy->data, out.size()) : out;
    std::shared_ptr<void> keep = std::make_shared<std::array<std::shared_ptr<void>, 2>>(
        std::array<std::shared_ptr<void>, 2>{in_copy, out_copy});
    auto inner = std::make_shared<Work>(run(device_in, device_out, keep));
    const std::span<T> host_out = out_copy->data ? out : std::span<T>();
    return Work(
        [inner, keep, out_copy, host_out] {
          inner->wait();
          if (host_out.empty()) return;
          Cuda::copy_to_host(host_out.data(), out_copy->data, host_out.size_bytes());
          Cuda::synchronize();
        },
        [inner] { return inner->is_completed(); });
  }

  // Made with the communicator: the barrier's word and the call check's scratch (size x 64 x 4
  // int64), the two ordering events, and the progress board published to the peers.
  static void allocate_resources(detail::NcclState& s, std::string label) {
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    TESSERA_CUDA_CHECK(cudaMalloc(&s.signatures, sizeof(std::int64_t) * 4 * detail::CallLedger::kWindow *
                                                     static_cast<std::size_t>(s.core.size())));
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&s.compute_ready, cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&s.nccl_queued, cudaEventDisableTiming));
    std::lock_guard lock(s.mutex);
    s.core.connect_monitor(std::move(label), [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      gather_int64(s, in, out, "status-server address exchange");
    });
  }

  // Records an event on `stream` and returns a Work that waits for it (with the timeout and the
  // async-error check) and then orders the compute stream after it.
  template <class What>
  Work completion(cudaEvent_t done, What what, std::int64_t call = 0) {
    auto event = std::make_shared<detail::NcclState::Launch>(s_->events, done);
    return completion_of(s_, event, std::move(what), call);
  }
  template <class What>
  static Work completion_of(std::shared_ptr<detail::NcclState> state, std::shared_ptr<detail::NcclState::Launch> launch,
                            What what, std::int64_t call = 0) {
    auto launched = [state, launch] {
      if (launch->done.load() != nullptr) return;
      std::lock_guard lock(state->mutex);
      if (launch->done.load() != nullptr) return;
      state->core.check_usable("pending send/recv");
      flush_pending(*state);
    };
    auto wait = [state, launch, launched, what, call] {
      launched();
      TESSERA_CUDA_CHECK(cudaSetDevice(state->device));
      wait_event(*state, launch->done.load(), what, /*caller_holds_mutex=*/false, call);
      TESSERA_CUDA_CHECK(cudaStreamWaitEvent(Cuda::stream(), launch->done.load(), 0));
    };
    auto poll = [state, launch, launched] {
      launched();
      // An abort ends NCCL's kernels, completing every event: a broken communicator's work
      // is never reported complete (wait() then throws).
      return !state->core.broken() && cudaEventQuery(launch->done.load()) == cudaSuccess;
    };
    return Work(std::move(wait), std::move(poll));
  }

  // Waits until `event` (on NCCL's stream) has completed: the core's wait loop over the event and
  // ncclCommGetAsyncError; on an NCCL or CUDA error, or at the timeout, the communicator breaks
  // (the core's hook aborts it) and CommError names the operation. Without the mutex held, it is
  // taken per poll only, so other threads may launch meanwhile (a send another thread posts may
  // be what this wait needs).
  // call > 0: a collective's number on the board, for the stall warning and the timeout's report.
  template <class What>
  static void wait_event(detail::NcclState& s, cudaEvent_t event, const What& what, bool caller_holds_mutex,
                         std::int64_t call = 0) {
    s.core.wait(what, call, [&] {
      const cudaError_t query = cudaEventQuery(event);
      std::unique_lock lock(s.mutex, std::defer_lock);
      if (!caller_holds_mutex) lock.lock();
      // First: after an abort (another Work's timeout) NCCL's kernels exit and every event
      // completes, with garbage in the buffers.
      s.core.check_usable(what);
      if (query == cudaSuccess) return true;
      if (query != cudaErrorNotReady)
        s.core.fail(what, detail::cat("CUDA error ", cudaGetErrorName(query), ": ", cudaGetErrorString(query)),
                    s.core.call_context(call));
      ncclResult_t async_error = ncclSuccess;
      if (const ncclResult_t r = ncclCommGetAsyncError(s.comm, &async_error); r != ncclSuccess) async_error = r;
      if (async_error != ncclSuccess && async_error != ncclInProgress)
        s.core.fail(what, detail::cat("NCCL error ", detail::nccl_error_text(async_error, s.comm)),
                    s.core.call_context(call));
      return false;
    }, "; the communicator is aborted");
  }

  // One collective: queued sends/recvs first (one group), then the core's enter and call check,
  // then the collective on NCCL's stream after the compute stream's work so far.
  template <class Enqueue>
  Work collective(const detail::CallSignature& signature, Enqueue&& enqueue) {
    auto& s = *s_;
    std::lock_guard lock(s.mutex);
    s.core.check_usable(signature);
    TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
    flush_pending(s);
    const std::int64_t call = s.core.enter(signature);
    s.core.check_call(signature, [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      gather_int64(s, in, out, detail::CallCheckOf{signature});
    });
    order_after_compute(s);
    settle(s, enqueue(s.comm, s.stream), signature);
    cudaEvent_t done = record(s);
    auto inner = std::make_shared<Work>(completion(done, signature, call));
    // The board counts the call finished when this rank has seen it complete.
    auto finished = std::make_shared<std::atomic<bool>>(false);
    auto mark = [state = s_, finished] {
      if (!finished->exchange(true)) state->core.finish();
    };
    return Work(
        [inner, mark] {
          inner->wait();
          mark();
        },
        [inner, mark] {
          const bool done_now = inner->is_completed();
          if (done_now) mark();
          return done_now;
        });
  }

  template <CommScalar T>
  Work queue_send(std::span<const T> buf, int peer, std::shared_ptr<void> keep_alive) {
    return queue_p2p([=](ncclComm_t nccl, cudaStream_t st) {
      return ncclSend(buf.data(), buf.size(), detail::nccl_type<T>(), peer, nccl, st);
    }, detail::PeerCall::send<T>(buf.size(), peer), std::move(keep_alive));
  }
  template <CommScalar T>
  Work queue_recv(std::span<T> buf, int peer, std::shared_ptr<void> keep_alive) {
    return queue_p2p([=](ncclComm_t nccl, cudaStream_t st) {
      return ncclRecv(buf.data(), buf.size(), detail::nccl_type<T>(), peer, nccl, st);
    }, detail::PeerCall::recv<T>(buf.size(), peer), std::move(keep_alive));
  }
  Work queue_p2p(std::function<ncclResult_t(ncclComm_t, cudaStream_t)> enqueue, const detail::PeerCall& what,
                 std::shared_ptr<void> keep_alive) {
    auto& s = *s_;
    std::lock_guard lock(s.mutex);
    s.core.check_usable(what);
    auto launch = std::make_shared<detail::NcclState::Launch>(s.events);
    s.pending.push_back({std::move(enqueue), launch, std::move(keep_alive)});
    return completion_of(s_, launch, what);
  }

  // Launches every queued send/recv in one NCCL group (the caller holds the mutex).
  static void flush_pending(detail::NcclState& s) {
    if (s.pending.empty()) return;
    auto pending = std::move(s.pending);
    s.pending.clear();
    // Any failure here leaves these Works unlaunchable: the communicator is broken, so their
    // waits throw instead of querying an event that was never recorded.
    try {
      TESSERA_CUDA_CHECK(cudaSetDevice(s.device));
      order_after_compute(s);
      check(ncclGroupStart(), "ncclGroupStart", s.core.rank(), s.comm);
      for (auto& op : pending) {
        const ncclResult_t status = op.enqueue(s.comm, s.stream);
        if (status != ncclSuccess && status != ncclInProgress) {
          (void)ncclGroupEnd();
          s.core.fail("send/recv", detail::cat("NCCL error ", detail::nccl_error_text(status, s.comm)));
        }
      }
      settle(s, ncclGroupEnd(), detail::cat(pending.size(), " grouped send/recv"));
      // Every Work of the group waits on the same point of the stream; each needs its own event
      // object because each Launch owns one (and gives it back to the pool).
      for (auto& op : pending) op.launch->done.store(record(s));
    } catch (const CommError&) {
      throw;  // the core's fail() already marked it broken
    } catch (const std::exception& e) {
      s.core.fail("send/recv", e.what());
    }
  }

  // `waiter` runs nothing more until everything queued so far on `producer` has run.
  static void stream_wait(cudaStream_t waiter, cudaStream_t producer, cudaEvent_t scratch) {
    TESSERA_CUDA_CHECK(cudaEventRecord(scratch, producer));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(waiter, scratch, 0));
  }
  static void order_after_compute(detail::NcclState& s) { stream_wait(s.stream, Cuda::stream(), s.compute_ready); }
  // An event from the pool, recorded on NCCL's stream (the caller owns it: pool->give).
  static cudaEvent_t record(detail::NcclState& s) {
    cudaEvent_t done = s.events->take();
    if (const cudaError_t status = cudaEventRecord(done, s.stream); status != cudaSuccess) {
      s.events->give(done);
      TESSERA_CUDA_CHECK(status);
    }
    return done;
  }

  // A blocking all_gather of at most CallLedger::kWindow x 4 int64 per rank through the GPU
  // scratch (the caller holds the mutex): the core's call check and monitor exchange. Waits with
  // the timeout and aborts, never a bare synchronize: a mismatched or dead peer is exactly what
  // its users are for.
  template <class What>
  static void gather_int64(detail::NcclState& s, std::span<const std::int64_t> in, std::span<std::int64_t> out,
                           const What& what) {
    const auto wait_for_stream = [&s](const auto& step) {
      cudaEvent_t done = record(s);
      try {
        wait_event(s, done, step, /*caller_holds_mutex=*/true);
      } catch (...) {
        s.events->give(done);
        throw;
      }
      s.events->give(done);
    };
    std::int64_t* slot = s.signatures + in.size() * static_cast<std::size_t>(s.core.rank());
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(slot, in.data(), in.size_bytes(), cudaMemcpyHostToDevice, s.stream));
    settle(s, ncclAllGather(slot, s.signatures, in.size(), ncclInt64, s.comm, s.stream), what);
    wait_for_stream(what);
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.data(), s.signatures, out.size_bytes(), cudaMemcpyDeviceToHost, s.stream));
    wait_for_stream(detail::describe(what) + " read-back");
  }

  static std::filesystem::path exchange_id_through_file_store(const LaunchEnv& env, const CommOptions& options, int call,
                                                              ncclUniqueId& id) {
    const std::string prefix = "file://";
    TESSERA_CHECK(env.store.rfind(prefix, 0) == 0, ArgumentError, "NcclComm::from_env on rank ", env.rank, " of ",
                  env.size, ": needs TESSERA_STORE=file:///shared/dir to pass NCCL's id (got '", env.store,
                  "'); with mpirun or a Redis store use NcclComm::from(MpiComm::world()) or "
                  "NcclComm::from(GlooComm::from_env())");
    const std::filesystem::path dir = env.store.substr(prefix.size());
    const char* store_prefix = std::getenv("TESSERA_STORE_PREFIX");
    const std::string name = detail::cat(store_prefix != nullptr && *store_prefix ? store_prefix : "tessera", ".nccl_unique_id.",
                                        std::getenv("SLURM_JOB_ID") != nullptr ? std::getenv("SLURM_JOB_ID") : "", ".", call);
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
      return path;
    }
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      std::ifstream in(path, std::ios::binary);
      if (in && in.read(reinterpret_cast<char*>(&id), sizeof(id)) && in.gcount() == sizeof(id)) return path;
      TESSERA_CHECK(std::chrono::steady_clock::now() - start < options.timeout, CommError, "NcclComm::from_env on rank ",
                    env.rank, " of ", env.size, ": rank 0 did not publish NCCL's id at ", path, " within ",
                    detail::seconds_text(options.timeout));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  std::shared_ptr<detail::NcclState> s_;
};

static_assert(check_communicator<NcclComm>());
static_assert(BHalfCommunicator<NcclComm> && comm_concepts::has_async<NcclComm, BHalf>);

// One process per GPU, gradients reduced by NCCL.
using CudaNccl = Env<Cuda, NcclComm, float>;
using CudaNccl64 = Env<Cuda, NcclComm, double>;
using CudaNcclBf16 = Env<Cuda, NcclComm, float, BFloat16>;  // float weights, bfloat16 products (core/env.hpp)

}  // namespace tessera
