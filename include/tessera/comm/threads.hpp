// ThreadComm: N ranks as N threads of one process, talking through shared memory.
//
//   ThreadWorld world(4);                       // 4 ranks
//   world.run([](ThreadComm& comm) {            // spawns 4 threads, rank r on thread r, joins
//     std::vector<float> g(1000, comm.rank());
//     comm.all_reduce(std::span(g), ReduceOp::Sum);
//   });
//
// or, with threads of your own, `ThreadComm comm = world.comm(r);` on each (adopt).
//
// How the collectives work: every rank publishes a pointer to its buffer and its CallSignature,
// all meet at a barrier, then each rank does its share straight on the other ranks' memory and
// they meet again before anyone returns (so no buffer is reused while a peer still reads it).
// all_reduce of n elements over p ranks: rank r reduces elements [r n/p, (r+1) n/p) of all p
// buffers and writes the result into that range of all p buffers, so each element is read p
// times and written p times in total, with no intermediate copies: one pass over memory.
// Because the signatures are in shared memory anyway, ThreadComm always checks that all ranks
// called the same collective with the same type and count (the debug check of other backends).
// Argument checks, the broken state and error texts are the communicator core's (comm/core.hpp),
// one core per rank of a group, all sharing the group's broken state; the barrier is its own.
//
// Failure: if a rank's function throws inside ThreadWorld::run, every rank waiting at a barrier
// throws CommError naming that rank; a rank that stalls makes the others throw after the timeout,
// naming the ranks that did not arrive. run() rethrows the first (root-cause) exception.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/async_worker.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/core.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

namespace detail {

// State shared by every group (the world and its splits): the first failure, which wakes all.
struct ThreadWorldState {
  std::atomic<bool> failed{false};
  std::mutex mutex;
  int failed_rank = -1;
  std::string reason;
};

// One communicator group: its barrier, the published slots and the point-to-point mailboxes.
class ThreadGroup {
 public:
  ThreadGroup(int size, CommOptions options, std::shared_ptr<ThreadWorldState> world);

  int size() const { return size_; }
  const CommOptions& options() const { return options_; }

  template <CommScalar T>
  void all_reduce(int rank, std::span<T> buf, ReduceOp op);

  template <CommScalar T>
  void broadcast(int rank, std::span<T> buf, int root);

  template <CommScalar T>
  void all_gather(int rank, std::span<const T> in, std::span<T> out);

  template <CommScalar T>
  void reduce_scatter(int rank, std::span<const T> in, std::span<T> out, ReduceOp op);

  void barrier(int rank);

  // Point-to-point. A send is eager: it hands its bytes to the oldest receive the peer has posted,
  // or copies them into the mailbox if none is posted yet, and returns. A receive is posted at
  // once (taking a waiting message if there is one) and completed by wait_recv. Neither touches
  // the async worker's queue, so `recv_async` then `send`, and rings of blocking sends, cannot
  // deadlock; matching is in order per (sender, receiver), as in MPI.
  struct PostedRecv {
    void* buffer;
    CommDType dtype;
    std::size_t count;
    bool done = false;
    std::string error;  // a type or count mismatch, reported by wait_recv
  };

  template <CommScalar T>
  void send(int rank, std::span<const T> buf, int peer);

  template <CommScalar T>
  std::shared_ptr<PostedRecv> post_recv(int rank, std::span<T> buf, int peer);

  // Done, or never going to be because a rank failed: either way wait() returns at once (and
  // throws in the second case), as torch's Work.is_completed() is true for a failed operation.
  bool recv_done(int rank, int peer, const PostedRecv& posted);

  void wait_recv(int rank, int peer, const std::shared_ptr<PostedRecv>& posted);

  // MPI_Comm_split semantics: ranks with equal color form a group, ordered by (key, old rank).
  std::shared_ptr<ThreadGroup> split(int rank, int color, int key, int& new_rank);

  template <class What>
  void check_usable(int rank, const What& what) const {
    cores_[rank].check_usable(what);
  }

 private:
  struct Slot {
    const void* pointer = nullptr;
    CallSignature signature;
    int color = 0;
    int key = 0;
    // Bytes this rank's collectives read from or wrote into other ranks' buffers, and its sends
    // (its main thread and its async worker both add: atomic).
    std::atomic<std::int64_t> peer_bytes{0};
  };
  void count_peer_bytes(int rank, std::size_t bytes);

 public:
  std::int64_t peer_bytes(int rank) const {
    return slots_[static_cast<std::size_t>(rank)].peer_bytes.load(std::memory_order_relaxed);
  }

 private:
  struct Message {
    std::vector<std::byte> bytes;
    CommDType dtype;
    std::size_t count;
  };
  struct Mailbox {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Message> queue;                         // sent, not yet received
    std::deque<std::shared_ptr<PostedRecv>> posted;  // posted receives, not yet matched
  };

  // Copies a message into a posted receive, or records why it cannot (called with the lock held).
  static void deliver(PostedRecv& to, const void* bytes, CommDType dtype, std::size_t count, int from);

  Mailbox& mailbox(int from, int to) { return *mailboxes_[static_cast<std::size_t>(from * size_ + to)]; }

  std::pair<std::size_t, std::size_t> chunk(std::size_t n, int rank) const;

  template <class T>
  T* const* gather_pointers(int);

  // Publish, meet, and compare signatures: every rank sees the same slots, so either all ranks
  // throw the mismatch or none does.
  void enter(int rank, const void* pointer, const CallSignature& sig);

  void leave(int rank, const CallSignature& sig);

  std::string stopped_reason() const;

  template <class What>
  [[noreturn]] void fail(int rank, const What& what, std::string_view phase, const std::string& reason);

  // Central barrier with a generation counter. A short spin catches the common case of ranks
  // arriving close together (each rank has a core); then the waiter sleeps on the condition
  // variable in slices, checking for a failed rank and the deadline.
  void sync(int rank, const CallSignature& sig, const char* phase);

  int size_;
  CommOptions options_;
  std::shared_ptr<ThreadWorldState> world_;

  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::atomic<std::uint64_t> generation_{0};
  std::vector<char> present_;
  std::vector<Slot> slots_;
  std::vector<std::shared_ptr<ThreadGroup>> split_results_;
  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::vector<CommCore> cores_;  // by rank: checks, error texts, the group's broken state
};

}  // namespace detail

class ThreadWorld;

class ThreadComm {
 public:
  static constexpr const char* backend_name = "threads";
  // Every rank is a thread of one process, so ranks may share memory (Hogwild).
  static constexpr bool ranks_share_memory = true;
  // Spawns options.ranks threads, each running fn(ThreadComm&) (see ThreadWorld::run).
  template <class Fn>
  static void launch(const LaunchOptions& options, Fn&& fn);

  ThreadComm(ThreadComm&&) noexcept = default;
  ThreadComm& operator=(ThreadComm&&) noexcept = default;
  ~ThreadComm() = default;

  int rank() const { return rank_; }
  int size() const { return group_->size(); }
  const CommOptions& options() const { return group_->options(); }

  template <CommScalar T>
  void all_reduce(std::span<T> buf, ReduceOp op);
  template <CommScalar T>
  void broadcast(std::span<T> buf, int root);
  template <CommScalar T>
  void all_gather(std::span<const T> in, std::span<T> out);
  template <CommScalar T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op);
  template <CommScalar T>
  void send(std::span<const T> buf, int peer);
  template <CommScalar T>
  void recv(std::span<T> buf, int peer);
  void barrier();

  // Asynchronous variants run on this rank's worker thread in issue order; the buffers must stay
  // alive and untouched until wait().
  template <CommScalar T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op);
  template <CommScalar T>
  Work broadcast_async(std::span<T> buf, int root);
  template <CommScalar T>
  Work all_gather_async(std::span<const T> in, std::span<T> out);
  template <CommScalar T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op);
  template <CommScalar T>
  Work send_async(std::span<const T> buf, int peer);
  template <CommScalar T>
  Work recv_async(std::span<T> buf, int peer);

  // Bytes this rank's collectives have read from or written into the other ranks' buffers, plus
  // the bytes of its sends (the traffic of threads: what a network would carry; an all_reduce of
  // G bytes over p ranks moves 2(p-1)/p x G, as a bandwidth-optimal ring sends). Counted per
  // group: a split starts at 0.
  std::int64_t peer_bytes() const { return group_->peer_bytes(rank_); }

  ThreadComm split(int color, int key);

 private:
  friend class ThreadWorld;
  ThreadComm(std::shared_ptr<detail::ThreadGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  void drain();
  Work submit(std::function<void()> op);

  std::shared_ptr<detail::ThreadGroup> group_;
  int rank_ = 0;
  std::unique_ptr<detail::AsyncWorker> worker_;  // last member: destroyed (joined) first
};

static_assert(check_communicator<ThreadComm>());
static_assert(BHalfCommunicator<ThreadComm> && comm_concepts::has_async<ThreadComm, BHalf>);

class ThreadWorld {
 public:
  explicit ThreadWorld(int size, CommOptions options = {});

  int size() const { return size_; }

  // Adopt: the communicator for rank r, for a thread the caller owns. Call fail() from a thread
  // that gives up, so the others stop at once instead of after the timeout.
  ThreadComm comm(int rank);

  void fail(int rank, const std::string& reason);

  // Spawn: runs fn(ThreadComm&) as rank r on thread r, r = 0 .. size-1, and joins them all. If
  // any rank throws, the others are stopped and the first exception is rethrown here.
  template <class Fn>
  void run(Fn&& fn) {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size_));
    std::mutex first_mutex;
    int first = -1;
    // The communicator outlives the catch: the other ranks are told of a failure before this
    // rank's worker is joined (its queued operations then fail fast instead of timing out).
    auto body = [&](int rank) {
      ThreadComm comm = this->comm(rank);
      auto record = [&](std::string reason) {
        errors[rank] = std::current_exception();
        std::lock_guard lock(first_mutex);
        if (first < 0 && !state_->failed.load()) first = rank;
        fail(rank, std::move(reason));
      };
      try {
        fn(comm);
      } catch (const std::exception& e) {
        record(e.what());
      } catch (...) {
        record("unknown exception");
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) threads.emplace_back(body, r);
    for (auto& t : threads) t.join();
    if (first >= 0) std::rethrow_exception(errors[first]);
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  int size_;
  std::shared_ptr<detail::ThreadWorldState> state_;
  std::shared_ptr<detail::ThreadGroup> group_;
};

// launch<CpuThreads>(fn, {.ranks = N}): N ranks as threads of this process.
template <class Fn>
void ThreadComm::launch(const LaunchOptions& options, Fn&& fn) {
  TESSERA_CHECK(options.ranks >= 0, ArgumentError, "launch: ranks=", options.ranks, " must be >= 0");
  check_one_process(backend_name);
  ThreadWorld world(options.ranks > 0 ? options.ranks : 1, options.comm);
  world.run(std::forward<Fn>(fn));
}

// The in-process multi-rank bundles.
using CpuThreads = Env<Cpu, ThreadComm, float>;
using CpuThreads64 = Env<Cpu, ThreadComm, double>;
using CpuThreadsBf16 = Env<Cpu, ThreadComm, float, BFloat16>;  // float weights, bfloat16 products (core/env.hpp)

// Compiled once in compiled-kernels mode (core/linkage.hpp explains): the non-template code below
// and the collectives' instances for every CommScalar, which src/kernels_cpu.cpp defines by
// expanding this list (C: ThreadComm); a program sees declarations only and links the library's instances (the
// definitions are not visible to it, so it needs no extern template). The templates over open
// types (launch, run) stay in the header; the helper templates below are used only by code that
// is compiled here.
#define TESSERA_THREAD_COMM_INSTANCES(C, T)                                                                     \
  template void detail::ThreadGroup::all_reduce<T>(int, std::span<T>, ReduceOp);                             \
  template void detail::ThreadGroup::broadcast<T>(int, std::span<T>, int);                                   \
  template void detail::ThreadGroup::all_gather<T>(int, std::span<const T>, std::span<T>);                   \
  template void detail::ThreadGroup::reduce_scatter<T>(int, std::span<const T>, std::span<T>, ReduceOp);     \
  template void detail::ThreadGroup::send<T>(int, std::span<const T>, int);                                  \
  template std::shared_ptr<detail::ThreadGroup::PostedRecv> detail::ThreadGroup::post_recv<T>(int, std::span<T>, \
                                                                                               int);         \
  TESSERA_COMM_COLLECTIVE_INSTANCES(C, T)
#define TESSERA_THREAD_COMM_ALL_INSTANCES() TESSERA_FOR_EACH_COMM_SCALAR(TESSERA_THREAD_COMM_INSTANCES, ThreadComm)

#if TESSERA_HEADER_DEFINITIONS

namespace detail {

TESSERA_LINKAGE ThreadGroup::ThreadGroup(int size, CommOptions options, std::shared_ptr<ThreadWorldState> world)
    : size_(size),
      options_(options),
      world_(std::move(world)),
      present_(static_cast<std::size_t>(size), 0),
      slots_(static_cast<std::size_t>(size)),
      split_results_(static_cast<std::size_t>(size)) {
  mailboxes_.reserve(static_cast<std::size_t>(size) * static_cast<std::size_t>(size));
  for (int i = 0; i < size * size; ++i) mailboxes_.push_back(std::make_unique<Mailbox>());
  const auto broken = std::make_shared<BrokenState>();  // one failure breaks the whole group
  cores_.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) cores_.emplace_back("ThreadComm", r, size, options, broken);
}

template <class T>
TESSERA_LINKAGE T* const* ThreadGroup::gather_pointers(int) {
  thread_local std::vector<T*> pointers;
  pointers.resize(static_cast<std::size_t>(size_));
  for (int q = 0; q < size_; ++q) pointers[q] = static_cast<T*>(const_cast<void*>(slots_[q].pointer));
  return pointers.data();
}

template <class What>
TESSERA_LINKAGE void ThreadGroup::fail(int rank, const What& what, std::string_view phase, const std::string& reason) {
  cores_[rank].fail(what, reason, phase.empty() ? std::string() : cat("phase '", phase, "'"));
}

template <CommScalar T>
TESSERA_LINKAGE void ThreadGroup::all_reduce(int rank, std::span<T> buf, ReduceOp op) {
  const auto sig = signature_of<T>(CollectiveKind::AllReduce, buf.size(), static_cast<std::int64_t>(op));
  if (size_ == 1) return check_usable(rank, sig);
  enter(rank, buf.data(), sig);
  const auto [lo, hi] = chunk(buf.size(), rank);
  T* const* buffers = gather_pointers<T>(0);
  thread_local std::vector<const T*> sources;
  thread_local std::vector<T*> outputs;
  sources.assign(buffers, buffers + size_);
  outputs.assign(buffers, buffers + size_);
  for (int q = 0; q < size_; ++q) {
    sources[q] += lo;
    outputs[q] += lo;
  }
  reduce_many(sources.data(), size_, outputs.data(), size_, hi - lo, op);
  count_peer_bytes(rank, 2 * static_cast<std::size_t>(size_ - 1) * (hi - lo) * sizeof(T));  // read p-1, written p-1
  leave(rank, sig);
}

template <CommScalar T>
TESSERA_LINKAGE void ThreadGroup::broadcast(int rank, std::span<T> buf, int root) {
  cores_[rank].check_root(root);
  const auto sig = signature_of<T>(CollectiveKind::Broadcast, buf.size(), root);
  if (size_ == 1) return check_usable(rank, sig);
  enter(rank, buf.data(), sig);
  if (rank != root && !buf.empty()) std::memcpy(buf.data(), slots_[root].pointer, buf.size_bytes());
  if (rank != root) count_peer_bytes(rank, buf.size_bytes());
  leave(rank, sig);
}

template <CommScalar T>
TESSERA_LINKAGE void ThreadGroup::all_gather(int rank, std::span<const T> in, std::span<T> out) {
  cores_[rank].check_all_gather(in.size(), out.size());
  const auto sig = signature_of<T>(CollectiveKind::AllGather, in.size());
  if (size_ == 1) {
    check_usable(rank, sig);
    std::copy(in.begin(), in.end(), out.begin());
    return;
  }
  enter(rank, in.data(), sig);
  for (int q = 0; q < size_ && !in.empty(); ++q)
    std::memcpy(out.data() + q * in.size(), slots_[q].pointer, in.size_bytes());
  count_peer_bytes(rank, static_cast<std::size_t>(size_ - 1) * in.size_bytes());
  leave(rank, sig);
}

template <CommScalar T>
TESSERA_LINKAGE void ThreadGroup::reduce_scatter(int rank, std::span<const T> in, std::span<T> out, ReduceOp op) {
  cores_[rank].check_reduce_scatter(in.size(), out.size());
  const auto sig = signature_of<T>(CollectiveKind::ReduceScatter, in.size(), static_cast<std::int64_t>(op));
  if (size_ == 1) {
    check_usable(rank, sig);
    std::copy(in.begin(), in.end(), out.begin());
    return;
  }
  enter(rank, in.data(), sig);
  thread_local std::vector<const T*> sources;
  sources.resize(static_cast<std::size_t>(size_));
  for (int q = 0; q < size_; ++q) sources[q] = static_cast<const T*>(slots_[q].pointer) + rank * out.size();
  T* output = out.data();
  reduce_many(sources.data(), size_, &output, 1, out.size(), op);
  count_peer_bytes(rank, static_cast<std::size_t>(size_ - 1) * out.size_bytes());
  leave(rank, sig);
}

TESSERA_LINKAGE void ThreadGroup::barrier(int rank) {
  const CallSignature sig{CollectiveKind::Barrier, CommDType::F32, 0, 0};
  if (size_ == 1) return check_usable(rank, sig);
  enter(rank, nullptr, sig);
  leave(rank, sig);  // a second meeting: nobody may publish the next call while a peer still compares
}

template <CommScalar T>
TESSERA_LINKAGE void ThreadGroup::send(int rank, std::span<const T> buf, int peer) {
  cores_[rank].check_peer(peer, "send");
  check_usable(rank, PeerCall::send<T>(buf.size(), peer));
  Mailbox& box = mailbox(rank, peer);
  {
    std::lock_guard lock(box.mutex);
    if (!box.posted.empty()) {
      deliver(*box.posted.front(), buf.data(), comm_dtype_of<T>, buf.size(), rank);
      box.posted.pop_front();
    } else {
      Message message{std::vector<std::byte>(buf.size_bytes()), comm_dtype_of<T>, buf.size()};
      if (!buf.empty()) std::memcpy(message.bytes.data(), buf.data(), buf.size_bytes());
      box.queue.push_back(std::move(message));
    }
  }
  box.cv.notify_all();
  count_peer_bytes(rank, buf.size_bytes());  // what a network would carry to the peer
}

template <CommScalar T>
TESSERA_LINKAGE auto ThreadGroup::post_recv(int rank, std::span<T> buf, int peer) -> std::shared_ptr<PostedRecv> {
  cores_[rank].check_peer(peer, "recv");
  check_usable(rank, PeerCall::recv<T>(buf.size(), peer));
  auto posted = std::make_shared<PostedRecv>(PostedRecv{buf.data(), comm_dtype_of<T>, buf.size()});
  Mailbox& box = mailbox(peer, rank);
  std::lock_guard lock(box.mutex);
  if (!box.queue.empty()) {
    const Message& message = box.queue.front();
    deliver(*posted, message.bytes.data(), message.dtype, message.count, peer);
    box.queue.pop_front();
  } else {
    box.posted.push_back(posted);
  }
  return posted;
}

TESSERA_LINKAGE bool ThreadGroup::recv_done(int rank, int peer, const PostedRecv& posted) {
  if (world_->failed.load()) return true;
  std::lock_guard lock(mailbox(peer, rank).mutex);
  return posted.done;
}

TESSERA_LINKAGE void ThreadGroup::wait_recv(int rank, int peer, const std::shared_ptr<PostedRecv>& posted) {
  Mailbox& box = mailbox(peer, rank);
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  std::unique_lock lock(box.mutex);
  while (!posted->done) {
    const bool failed = world_->failed.load();
    const bool late = std::chrono::steady_clock::now() >= deadline;
    if (failed || late) {
      // Withdraw the receive so that a late send cannot write into a buffer the caller frees.
      std::erase(box.posted, posted);
      lock.unlock();
      const PeerCall what{false, posted->dtype, static_cast<std::int64_t>(posted->count), peer};
      if (failed) fail(rank, what, "", stopped_reason());
      fail(rank, what, "", cat("timed out after ", seconds_text(options_.timeout), ": rank ", peer, " sent nothing"));
    }
    box.cv.wait_for(lock, std::chrono::milliseconds(20));
  }
  if (!posted->error.empty())  // the message was consumed whole: the communicator stays usable
    throw CommError(cores_[rank].text(PeerCall{false, posted->dtype, static_cast<std::int64_t>(posted->count), peer},
                                      posted->error));
}

TESSERA_LINKAGE std::shared_ptr<ThreadGroup> ThreadGroup::split(int rank, int color, int key, int& new_rank) {
  cores_[rank].check_split_color(color);
  const CallSignature sig{CollectiveKind::Split, CommDType::I64, 0, 0};
  slots_[rank].color = color;
  slots_[rank].key = key;
  enter(rank, nullptr, sig);
  std::vector<int> members;
  for (int q = 0; q < size_; ++q)
    if (slots_[q].color == color) members.push_back(q);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return slots_[a].key < slots_[b].key; });
  new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  if (new_rank == 0)
    split_results_[rank] = std::make_shared<ThreadGroup>(static_cast<int>(members.size()), options_, world_);
  sync(rank, sig, "create");
  std::shared_ptr<ThreadGroup> group = split_results_[members.front()];
  sync(rank, sig, "adopt");
  if (new_rank == 0) split_results_[rank].reset();
  return group;
}

TESSERA_LINKAGE void ThreadGroup::count_peer_bytes(int rank, std::size_t bytes) {
  slots_[static_cast<std::size_t>(rank)].peer_bytes.fetch_add(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
}

TESSERA_LINKAGE void ThreadGroup::deliver(PostedRecv& to, const void* bytes, CommDType dtype, std::size_t count, int from) {
  if (dtype != to.dtype || count != to.count) {
    to.error = cat("expected ", to_string(to.dtype), " x ", to.count, " from rank ", from, ", got ",
                   to_string(dtype), " x ", count);
  } else if (count > 0) {
    std::memcpy(to.buffer, bytes, count * comm_scalar_bytes(dtype));
  }
  to.done = true;
}

TESSERA_LINKAGE std::pair<std::size_t, std::size_t> ThreadGroup::chunk(std::size_t n, int rank) const {
  const std::size_t p = static_cast<std::size_t>(size_);
  return {n * static_cast<std::size_t>(rank) / p, n * static_cast<std::size_t>(rank + 1) / p};
}

TESSERA_LINKAGE void ThreadGroup::enter(int rank, const void* pointer, const CallSignature& sig) {
  check_usable(rank, sig);
  slots_[rank].pointer = pointer;
  slots_[rank].signature = sig;
  sync(rank, sig, "start");
  for (int q = 0; q < size_; ++q) {
    if (slots_[q].signature == sig) continue;
    std::string text = cat("ranks called different collectives:");
    for (int r = 0; r < size_; ++r) text += cat("\n  rank ", r, ": ", slots_[r].signature.describe());
    fail(rank, sig, "", text);
  }
}

TESSERA_LINKAGE void ThreadGroup::leave(int rank, const CallSignature& sig) { sync(rank, sig, "finish"); }

TESSERA_LINKAGE std::string ThreadGroup::stopped_reason() const {
  std::lock_guard lock(world_->mutex);
  return cat("stopped because rank ", world_->failed_rank, " failed: ", world_->reason);
}

TESSERA_LINKAGE void ThreadGroup::sync(int rank, const CallSignature& sig, const char* phase) {
  std::unique_lock lock(mutex_);
  const std::uint64_t generation = generation_.load();
  present_[rank] = 1;
  if (++arrived_ == size_) {
    arrived_ = 0;
    std::fill(present_.begin(), present_.end(), 0);
    generation_.store(generation + 1);
    lock.unlock();
    cv_.notify_all();
    return;
  }
  lock.unlock();
  for (int spin = 0; spin < 2000 && generation_.load(std::memory_order_acquire) == generation; ++spin)
    std::this_thread::yield();
  if (generation_.load(std::memory_order_acquire) != generation) return;
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  lock.lock();
  while (generation_.load() == generation) {
    if (world_->failed.load()) {
      lock.unlock();
      fail(rank, sig, phase, stopped_reason());
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string missing;
      for (int q = 0; q < size_; ++q)
        if (!present_[q]) missing += cat(missing.empty() ? "" : ", ", q);
      lock.unlock();
      fail(rank, sig, phase, cat("timed out after ", seconds_text(options_.timeout), " waiting for rank(s) ", missing));
    }
    cv_.wait_for(lock, std::chrono::milliseconds(20));
  }
}

}  // namespace detail

template <CommScalar T>
TESSERA_LINKAGE void ThreadComm::all_reduce(std::span<T> buf, ReduceOp op) {
  drain();
  group_->all_reduce(rank_, buf, op);
}
template <CommScalar T>
TESSERA_LINKAGE void ThreadComm::broadcast(std::span<T> buf, int root) {
  drain();
  group_->broadcast(rank_, buf, root);
}
template <CommScalar T>
TESSERA_LINKAGE void ThreadComm::all_gather(std::span<const T> in, std::span<T> out) {
  drain();
  group_->all_gather(rank_, in, out);
}
template <CommScalar T>
TESSERA_LINKAGE void ThreadComm::reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op) {
  drain();
  group_->reduce_scatter(rank_, in, out, op);
}
template <CommScalar T>
TESSERA_LINKAGE void ThreadComm::send(std::span<const T> buf, int peer) {
  group_->send(rank_, buf, peer);  // eager, and never queued behind async collectives
}
template <CommScalar T>
TESSERA_LINKAGE void ThreadComm::recv(std::span<T> buf, int peer) {
  recv_async(buf, peer).wait();
}
TESSERA_LINKAGE void ThreadComm::barrier() {
  drain();
  group_->barrier(rank_);
}

template <CommScalar T>
TESSERA_LINKAGE Work ThreadComm::all_reduce_async(std::span<T> buf, ReduceOp op) {
  return submit([g = group_, r = rank_, buf, op] { g->all_reduce(r, buf, op); });
}
template <CommScalar T>
TESSERA_LINKAGE Work ThreadComm::broadcast_async(std::span<T> buf, int root) {
  return submit([g = group_, r = rank_, buf, root] { g->broadcast(r, buf, root); });
}
template <CommScalar T>
TESSERA_LINKAGE Work ThreadComm::all_gather_async(std::span<const T> in, std::span<T> out) {
  return submit([g = group_, r = rank_, in, out] { g->all_gather(r, in, out); });
}
template <CommScalar T>
TESSERA_LINKAGE Work ThreadComm::reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
  return submit([g = group_, r = rank_, in, out, op] { g->reduce_scatter(r, in, out, op); });
}
template <CommScalar T>
TESSERA_LINKAGE Work ThreadComm::send_async(std::span<const T> buf, int peer) {
  group_->send(rank_, buf, peer);  // eager: complete once handed over
  return {};
}
template <CommScalar T>
TESSERA_LINKAGE Work ThreadComm::recv_async(std::span<T> buf, int peer) {
  auto posted = group_->post_recv(rank_, buf, peer);
  return Work([g = group_, r = rank_, peer, posted] { g->wait_recv(r, peer, posted); },
              [g = group_, r = rank_, peer, posted] { return g->recv_done(r, peer, *posted); });
}

TESSERA_LINKAGE ThreadComm ThreadComm::split(int color, int key) {
  drain();
  int new_rank = 0;
  auto group = group_->split(rank_, color, key, new_rank);
  return ThreadComm(std::move(group), new_rank);
}

TESSERA_LINKAGE void ThreadComm::drain() {
  if (worker_) worker_->drain();
}
TESSERA_LINKAGE Work ThreadComm::submit(std::function<void()> op) {
  if (!worker_) worker_ = std::make_unique<detail::AsyncWorker>();
  return worker_->submit(std::move(op));
}

TESSERA_LINKAGE ThreadWorld::ThreadWorld(int size, CommOptions options) : size_(size) {
  TESSERA_CHECK(size >= 1, ArgumentError, "ThreadWorld: size ", size, " must be >= 1");
  state_ = std::make_shared<detail::ThreadWorldState>();
  group_ = std::make_shared<detail::ThreadGroup>(size, options, state_);
}

TESSERA_LINKAGE ThreadComm ThreadWorld::comm(int rank) {
  TESSERA_CHECK(rank >= 0 && rank < size_, ArgumentError, "ThreadWorld::comm: rank ", rank, " out of range [0, ",
                size_, ")");
  return ThreadComm(group_, rank);
}

TESSERA_LINKAGE void ThreadWorld::fail(int rank, const std::string& reason) {
  std::lock_guard lock(state_->mutex);
  if (state_->failed.load()) return;
  state_->failed_rank = rank;
  state_->reason = reason;
  state_->failed.store(true);
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
