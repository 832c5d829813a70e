// GlooComm: the Communicator concept over Gloo's TCP transport (Debian's libgloo-dev).
//
//   auto comm = GlooComm::from_env();   // TESSERA_RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK,
//                                       // the world size likewise, TESSERA_STORE for rendezvous
//
// Rendezvous goes through a real store, as on a cluster:
//   TESSERA_STORE=file:///shared/dir     Gloo's FileStore: a directory every rank can see (NFS,
//                                        Lustre); tessera-run makes a fresh one per job
//   TESSERA_STORE=redis://host:port      Gloo's RedisStore (a redis-server reachable by all)
// TESSERA_STORE_PREFIX keeps jobs that share a store apart (tessera-run and tessera-sbatch set one
// per launch; under srun the job step's id is the default); a rank already in the store is refused.
// Network: TESSERA_GLOO_IFACE=eth0 binds that interface; otherwise TESSERA_GLOO_HOSTNAME, or this
// machine's hostname, or 127.0.0.1 when the hostname does not resolve. Ranks on several hosts
// where one listens on a loopback address (a host name that resolves to 127.0.1.1, as on many
// installs) are refused at the rendezvous, naming TESSERA_GLOO_IFACE: its peers could never reach
// it, and they used to wait out the whole timeout.
// Waiting: a rank pinned to one CPU spins on its sockets while a peer is late, an unpinned one
// sleeps; TESSERA_GLOO_BUSY_POLL=1 or 0 decides instead (see detail::gloo_busy_poll).
//
// Before Gloo's own full-mesh connect, every rank registers under "join.<rank>" and waits for
// all others, so a rank that never starts is named ("rank 3 never joined") instead of leaving a
// bare store timeout.
//
// Collectives are Gloo's own (allreduce, allgather, broadcast, barrier); reduce_scatter is a ring
// over Gloo's unbound buffers (this Gloo has no new-style reduce_scatter). all_reduce up to
// kSyncMaxBytes runs Gloo's halving-doubling on a second mesh of sync-mode pairs, read by the
// calling thread (see GlooState::sync_context: no loop thread to wake between compute phases);
// larger ones use Gloo's ring. Asynchronous collectives run in issue order on a
// worker thread (what ProcessGroupGloo does); send/recv are posted at once from the caller's
// thread on their own slot, so a ring of send_async + recv cannot deadlock behind the worker
// (a helper thread per transfer reports its completion).
// Every operation carries the communicator's timeout; a Gloo error or timeout becomes CommError
// naming the operation, the rank and Gloo's own reason (the peer's address or the phase), and the
// peer's rank where the address can be traced back. Creating a GlooComm sets SIGPIPE to ignored
// if it still has its default action (a write to a dead peer must become an error, not kill the
// process; see ignore_sigpipe_if_default).
#pragma once

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/transport/tcp/device.h>
#include <sched.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tessera/comm/async_worker.hpp"
#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/core.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/monitor.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cpu.hpp"

// Where GlooComm's non-template functions and its collectives' instances are compiled: the scheme
// of core/linkage.hpp with this backend's own macros, since a program may include several
// backends. The meson build defines TESSERA_COMPILED_GLOO on tessera_gloo_dep and links
// tessera_gloo (communicators/gloo/src/gloo.cpp, which defines TESSERA_COMPILING_GLOO); without
// either, as for an installed consumer, everything below is inline.
#if defined(TESSERA_COMPILING_GLOO)
#define TESSERA_GLOO_DEFINITIONS 1
#define TESSERA_GLOO_LINKAGE
#elif defined(TESSERA_COMPILED_GLOO)
#define TESSERA_GLOO_DEFINITIONS 0
#define TESSERA_GLOO_LINKAGE
#else
#define TESSERA_GLOO_DEFINITIONS 1
#define TESSERA_GLOO_LINKAGE inline
#endif

namespace tessera {

namespace detail {

// A store that can say whether keys are there without waiting. Gloo's stores cannot through
// their Store interface: wait(keys, timeout) truncates the time it has waited to whole seconds
// before comparing it with the timeout (gloo/rendezvous/file_store.cc and redis_store.cc), so a
// wait of a millisecond for a missing key lasts a whole second, and a rendezvous, which asks for a
// few missing keys, took seconds even with one rank (docs/testing.md). Their own check(keys)
// answers at once: FileStore's is protected, hence these two subclasses, which the store URL
// opens (open_gloo_store).
class CheckableStore {
 public:
  virtual ~CheckableStore() = default;
  virtual bool has(const std::vector<std::string>& keys) = 0;
};

class CheckableFileStore : public gloo::rendezvous::FileStore, public CheckableStore {
 public:
  explicit CheckableFileStore(const std::string& path) : FileStore(path) {}
  bool has(const std::vector<std::string>& keys) override { return check(keys); }
};

// Keys "<prefix>.<key>": flat names, because FileStore maps a key to a file in one directory.
// While a rendezvous runs, `watch` is called between slices of every wait (Gloo's own full-mesh
// connect included), so that a peer that died meanwhile ends the wait with its name instead of
// the store's timeout. Over a CheckableStore a wait polls has() at Gloo's own polling period and
// keeps its timeout to within that period; over another Store it takes Gloo's timed waits.
class PrefixedStore : public gloo::rendezvous::Store {
 public:
  PrefixedStore(std::shared_ptr<gloo::rendezvous::Store> base, std::string prefix);
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // Whether every key is there now.
  bool has(const std::vector<std::string>& keys);
  // `timeout`: how long a wait without one of its own (get, wait(keys)) lasts meanwhile.
  void set_watch(std::function<void()> watch, std::chrono::milliseconds timeout = {});

 private:
  void wait_watched(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  std::string full(const std::string& key) const;
  std::vector<std::string> full(const std::vector<std::string>& keys) const;
  std::shared_ptr<gloo::rendezvous::Store> base_;
  CheckableStore* checkable_;  // base_ when it is one, else null
  std::string prefix_;
  std::function<void()> watch_;
  std::chrono::milliseconds watch_timeout_{0};
};

// What a rank writes under "join.<rank>": the world size it was started with, and where it runs,
// so that its peers can tell a size that differs from theirs, see whether it is still alive (a
// process on the same host), and whether it listens where they can reach it.
// "size=4 host=node1 pid=1234 loopback=0".
struct JoinRecord {
  int size = 0;
  std::string host;
  long pid = 0;
  bool loopback = false;  // its device listens on a loopback address (127.0.0.0/8, ::1)

  static std::string this_host();
  static JoinRecord mine(int size, bool loopback);
  std::string text() const;
  static JoinRecord parse(const std::vector<char>& bytes);
  // False only when it surely exited: a process of this host that no longer exists.
  bool alive() const;
  std::string where() const;
};

// Gloo's Redis store, logged in with TESSERA_REDIS_PASSWORD when that is set (a Redis server
// that other users of the cluster can reach needs a password: tessera-sbatch --store redis starts
// one with a fresh password). The password never goes into the URL, which messages print.
class AuthRedisStore : public gloo::rendezvous::RedisStore, public CheckableStore {
 public:
  AuthRedisStore(const std::string& host, int port, const std::string& url);
  bool has(const std::vector<std::string>& keys) override { return check(keys); }
};

// What to do about a store's error, when its text says: a Redis server that wants a password.
std::string store_error_hint(const std::string& what);

std::shared_ptr<gloo::rendezvous::Store> open_gloo_store(const std::string& url);

// The first address `host` resolves to for a TCP socket (the one Gloo binds), if it is a loopback
// address: "127.0.1.1"; empty otherwise or when it does not resolve.
std::string loopback_address_of(const std::string& host);

// The TCP device, and in *loopback why it listens on a loopback address ("host name 'node1'
// resolves to 127.0.1.1"), empty when it does not.
std::shared_ptr<gloo::transport::Device> make_gloo_device(std::string* loopback);

// Gloo writes to its sockets without MSG_NOSIGNAL, so a write to a peer that just died raises
// SIGPIPE, whose default action kills this process silently (exit by signal 13) instead of
// letting Gloo report EPIPE. Python ignores SIGPIPE, which is why PyTorch never meets this; a C++
// program must do it itself. Only the default action is replaced, never a handler of the user's.
void ignore_sigpipe_if_default();

// Whether the sync pairs spin on their sockets (recv with MSG_DONTWAIT until the timeout) rather
// than sleep in read() while a peer is late. Spinning is right when this rank owns its core: it
// is pinned to one CPU (tessera-run --bind-to core, srun --cpu-bind=cores, mpirun's default
// binding), so a spinning wait takes nothing from another rank, and MPI's shared-memory
// transport waits the same way. A sleeping read pays a wake-up each time the peer's data
// arrives, and on a virtual machine waking an idle virtual CPU is slow: LeNet-5 on 2 ranks bound
// to the 2 cores of this VM trained faster spinning than sleeping (bench/README.md, "Data-parallel
// scaling"). Unpinned ranks sleep: spinning there gained nothing and would starve an
// oversubscribed machine. TESSERA_GLOO_BUSY_POLL=1 or 0 decides instead.
bool gloo_busy_poll();

// Everything the worker thread and the Works need, shared so a GlooComm can move freely.
struct GlooState {
  std::shared_ptr<detail::PrefixedStore> store;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::string store_url;
  CommCore core;  // the per-call protocol: checks, ledger, board, broken state (comm/core.hpp)
  std::uint32_t next_tag = 1;  // advanced in issue order, identically on every rank
  int splits = 0;
  std::vector<std::string> pair_addresses;  // this rank's address for its pair with each peer
  std::string loopback;  // why the device listens on a loopback address; empty: it does not
  // The all_reduce fast path (up to kSyncMaxBytes). A second full mesh whose pairs are in Gloo's
  // sync mode: the thread that runs the collective reads its own sockets, so a collective never
  // waits for a thread of this process or of a peer to be scheduled. On the default (async)
  // pairs every message is read by Gloo's loop thread and handed over; when the peer has already
  // gone back to computing, its loop thread must first preempt its compute thread, and under
  // Linux's EEVDF scheduler that waits for the end of the running thread's slice: between compute
  // phases an all_reduce of LeNet-5's gradients measured many times slower on the async pairs
  // than on sync pairs (bench/README.md, "Gloo latency"). Sync pairs only serve Gloo's algorithm
  // classes, which bind buffers at construction: each (dtype, count) gets one
  // AllreduceHalvingDoubling over a staging buffer, kept while it is used (least recently used
  // ones go past kSyncCacheBytes).
  // Creation and eviction follow the call sequence, the same on every rank, so every rank takes
  // the same Gloo slots.
  std::shared_ptr<gloo::rendezvous::Context> sync_context;
  std::vector<std::string> sync_pair_addresses;
  bool busy_poll = false;  // the sync pairs spin while they wait (detail::gloo_busy_poll)
  struct SyncAllReduce {
    CommDType dtype;
    std::size_t count;
    std::vector<std::byte> staging;
    std::unique_ptr<gloo::Algorithm> algorithm;
    std::uint64_t last_use;
  };
  std::vector<SyncAllReduce> sync_all_reduces;
  std::uint64_t sync_uses = 0;
  // The call check's exchange (CallLedger::summary, 4 int64 per rank) on the sync pairs too: an
  // all_reduce (Sum) of size x 4 int64 where each rank fills only its own 4, which is an
  // all_gather. On the async pairs it waited like any async collective when the peer was
  // computing; even checked every 16th call, that added more to the average all_reduce than the
  // exchange itself (bench/README.md, "Gloo latency"). Built at connect, so it owns the first
  // sync slot on every rank whatever the cache above does later.
  std::vector<std::int64_t> check_staging;
  std::unique_ptr<gloo::Algorithm> check_gather;
  std::vector<std::byte> scratch;            // reduce_scatter's two chunks, grown, never shrunk
};

}  // namespace detail

class GlooComm {
 public:
  static constexpr const char* backend_name = "gloo";
  // all_reduce up to this many bytes runs on the sync pairs (see GlooState::sync_context), larger
  // ones on Gloo's ring over the async pairs (no staging copy; a scheduling stall is small next to
  // the transfer there; the ring beat bcube from 4 MiB on 4 ranks and at 64 MiB on 2). Measured
  // with bench/collectives.py, 2 ranks, no compute between calls, the sync path is faster than the
  // best raw gloo::allreduce at every size it takes (bench/README.md, "Gloo latency"). Cached
  // staging buffers are evicted past kSyncCacheBytes in all.
  static constexpr std::size_t kSyncMaxBytes = 4u << 20;
  static constexpr std::size_t kSyncCacheBytes = 32u << 20;

  // Rank, size and store from the environment (see LaunchEnv).
  // The store's key prefix: TESSERA_STORE_PREFIX (tessera-run and tessera-sbatch set one per
  // launch), else one per Slurm job step, else "tessera". Two jobs under one prefix would pair
  // their ranks: the rendezvous refuses a rank already in the store (see connect).
  static GlooComm from_env(CommOptions options = {});

  // Explicit: store URL, rank and size (for programs that get them elsewhere).
  GlooComm(const std::string& store_url, int rank, int size, CommOptions options = {},
           const std::string& prefix = "tessera");

  GlooComm(GlooComm&&) noexcept = default;
  GlooComm& operator=(GlooComm&&) noexcept = default;

  int rank() const { return s_->core.rank(); }
  int size() const { return s_->core.size(); }
  const CommOptions& options() const { return s_->core.options(); }
  const std::shared_ptr<gloo::rendezvous::Context>& native() const { return s_->context; }
  // Whether the all_reduce fast path spins while it waits for a peer (detail::gloo_busy_poll).
  bool busy_polls() const { return s_->busy_poll; }

  // The collectives: instantiated for every CommScalar in tessera_gloo (TESSERA_GLOO_ALL_INSTANCES
  // below) when the build compiles this backend once.
  template <CommScalar T>
  void all_reduce(std::span<T> buf, ReduceOp op);
  template <CommScalar T>
  void broadcast(std::span<T> buf, int root);
  template <CommScalar T>
  void all_gather(std::span<const T> in, std::span<T> out);
  template <CommScalar T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op);
  void barrier();
  template <CommScalar T>
  void send(std::span<const T> buf, int peer);
  template <CommScalar T>
  void recv(std::span<T> buf, int peer);

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

  // MPI_Comm_split semantics. The members find each other through the same store, under a key
  // prefix unique to this split (split number and color), and connect a new full mesh.
  GlooComm split(int color, int key);

 private:
  // A child communicator of a split: same store and device, a new context.
  GlooComm(const std::shared_ptr<detail::GlooState>& parent, const std::string& prefix, int rank, int size);

  // label: the rendezvous's name in errors; board_label: the progress board's, the same on every member.
  // Ranks on several hosts, one of which listens on a loopback address: the ranks of other hosts
  // could never connect to it. Every rank reads the same join records, so all of them stop here
  // at once, naming the rank and the fix.
  void check_reachable(const std::vector<detail::JoinRecord>& joined, const std::string& where) const;

  void connect(const std::string& label, std::string board_label);

  // Gloo's errors name a pair's socket address, not a rank; every pair's address is kept on both
  // sides (here and under "<key><rank>" in the store) so that an error can be translated into
  // "peer rank q" (see peer_named_in). Returns this rank's address per peer ("" for itself).
  std::vector<std::string> publish_pair_addresses(gloo::rendezvous::Context& context, gloo::rendezvous::Store& store,
                                                  const char* key);

  std::uint32_t take_tag() { return s_->next_tag++; }

  void drain() {
    if (worker_) worker_->drain();
  }
  Work submit(std::function<void()> op);

  // Runs one Gloo call through the core's guard: its exception becomes CommError naming the
  // operation, Gloo's reason, the peer where Gloo's address can be traced back, and which peers
  // reached the call (asked of their status servers, up to a second).
  template <class What, class Fn>
  static void guarded(const std::shared_ptr<detail::GlooState>& s, const What& what, std::int64_t call, Fn&& fn);

  // " (peer: rank q)" when Gloo's message contains the address of this rank's pair with q, or of
  // q's pair with this rank (published at connect time, read from the store only now, on the error
  // path). Gloo sometimes names another socket address; then the message says so in general terms.
  static std::string peer_named_in(const std::shared_ptr<detail::GlooState>& s, const std::string& message);

  // One collective from the core's point of view: entered on the progress board, watched (a
  // warning naming the ranks that have not reached it after the stall warning; Gloo enforces the
  // timeout itself), and on the calls the ledger picks the call check, whose fixed-size
  // allgathers run on the sync pairs (tagged like the call itself, with a high bit, on the async
  // pairs for the rare window exchange). Runs where the call runs (caller or worker thread), so
  // the ledger sees calls in issue order. The board counts the call finished when this goes.
  class InCall {
   public:
    InCall(const std::shared_ptr<detail::GlooState>& s, const detail::CallSignature& sig, std::uint32_t tag);
    ~InCall() { s_->core.finish(); }
    InCall(const InCall&) = delete;
    InCall& operator=(const InCall&) = delete;
    std::int64_t call() const { return call_; }

   private:
    std::shared_ptr<detail::GlooState> s_;
    std::int64_t call_;
    detail::WatchedCall watched_;
  };

  // The call check's summaries (4 int64 per rank) gathered by GlooState::check_gather.
  static void gather_on_sync_pairs(detail::GlooState& s, std::span<const std::int64_t> in,
                                   std::span<std::int64_t> out);

  template <CommScalar T>
  static void run_all_reduce(const std::shared_ptr<detail::GlooState>& s, std::span<T> buf, ReduceOp op,
                             std::uint32_t tag);

  // all_reduce on the sync pairs: staged through the cached algorithm of its dtype and count.
  template <CommScalar T>
  static void run_sync_all_reduce(detail::GlooState& s, std::span<T> buf, ReduceOp op);

  template <CommScalar T>
  static void run_broadcast(const std::shared_ptr<detail::GlooState>& s, std::span<T> buf, int root,
                            std::uint32_t tag);

  template <CommScalar T>
  static void run_all_gather(const std::shared_ptr<detail::GlooState>& s, std::span<const T> in, std::span<T> out,
                             std::uint32_t tag);

  // Ring reduce-scatter: p - 1 steps; in step k rank r sends its partial sum of chunk
  // (r - k - 1) mod p to the right and receives chunk (r - k - 2) mod p from the left, adding its
  // own contribution; after the last step it holds chunk r reduced over all p ranks. Each rank
  // sends and receives (p - 1)/p of the input: the bandwidth optimum. Step 0 sends straight from
  // the input, each step reduces incoming + own in one pass into the next partial (or, last, into
  // the output), and the two scratch chunks are kept between calls, so a large reduce_scatter
  // costs no page faults and no extra copies.
  template <CommScalar T>
  static void run_reduce_scatter(const std::shared_ptr<detail::GlooState>& s, std::span<const T> in,
                                 std::span<T> out, ReduceOp op, std::uint32_t tag);

  static void run_barrier(const std::shared_ptr<detail::GlooState>& s, std::uint32_t tag);

  // Point-to-point on a fixed slot: Gloo matches sends and receives per (peer, slot) in order.
  // The transfer is posted at once; a short-lived thread waits for it (with the timeout) and
  // records completion, which is what gives is_completed() an answer: Gloo cannot poll an unbound
  // buffer (a zero-timeout wait counts as a timeout and tears the connection down).
  Work post(const detail::PeerCall& what, void* data, std::size_t bytes, int peer, bool is_send);

  static constexpr std::uint8_t kReduceScatterSlotPrefix = 0x20;
  static constexpr std::uint64_t kPointToPointSlot = 0x21ull << 56;

  std::shared_ptr<detail::GlooState> s_;
  std::unique_ptr<detail::AsyncWorker> worker_;  // last: joined before the state it uses goes
};

#if TESSERA_GLOO_DEFINITIONS

namespace detail {

TESSERA_GLOO_LINKAGE PrefixedStore::PrefixedStore(std::shared_ptr<gloo::rendezvous::Store> base, std::string prefix)
    : base_(std::move(base)), checkable_(dynamic_cast<CheckableStore*>(base_.get())), prefix_(std::move(prefix)) {}
TESSERA_GLOO_LINKAGE void PrefixedStore::set(const std::string& key, const std::vector<char>& data) {
  base_->set(full(key), data);
}
TESSERA_GLOO_LINKAGE std::vector<char> PrefixedStore::get(const std::string& key) {
  if (watch_) wait_watched({key}, watch_timeout_);  // where Gloo's get would wait with the store's own
  return base_->get(full(key));
}
TESSERA_GLOO_LINKAGE void PrefixedStore::wait(const std::vector<std::string>& keys) {
  if (watch_) return wait_watched(keys, watch_timeout_);
  base_->wait(full(keys));
}
TESSERA_GLOO_LINKAGE void PrefixedStore::wait(const std::vector<std::string>& keys,
                                              const std::chrono::milliseconds& timeout) {
  if (watch_ || checkable_ != nullptr) return wait_watched(keys, timeout);
  base_->wait(full(keys), timeout);
}
TESSERA_GLOO_LINKAGE bool PrefixedStore::has(const std::vector<std::string>& keys) {
  if (checkable_ != nullptr) return checkable_->has(full(keys));
  try {
    base_->wait(full(keys), std::chrono::milliseconds(1));  // Gloo waits a second here (CheckableStore)
    return true;
  } catch (const std::exception&) {
    return false;
  }
}
TESSERA_GLOO_LINKAGE void PrefixedStore::set_watch(std::function<void()> watch, std::chrono::milliseconds timeout) {
  watch_ = std::move(watch);
  watch_timeout_ = timeout;
}

TESSERA_GLOO_LINKAGE void PrefixedStore::wait_watched(const std::vector<std::string>& keys,
                                                      std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (checkable_ != nullptr) {
    for (;;) {
      if (watch_) watch_();
      if (checkable_->has(full(keys))) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string names;
        for (const auto& k : keys) names += cat(names.empty() ? "" : ", ", k);
        throw CommError(cat("store: key(s) ", names, " (prefix ", prefix_, ") still missing after ",
                            seconds_text(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  for (;;) {
    watch_();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      base_->wait(full(keys), std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(100))));
      return;
    } catch (const std::exception&) {
      if (left <= std::chrono::milliseconds(100)) throw;
    }
  }
}

TESSERA_GLOO_LINKAGE std::string PrefixedStore::full(const std::string& key) const { return prefix_ + "." + key; }
TESSERA_GLOO_LINKAGE std::vector<std::string> PrefixedStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(full(k));
  return out;
}

TESSERA_GLOO_LINKAGE std::string JoinRecord::this_host() {
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string("?");
}
TESSERA_GLOO_LINKAGE JoinRecord JoinRecord::mine(int size, bool loopback) {
  return {size, this_host(), static_cast<long>(getpid()), loopback};
}
TESSERA_GLOO_LINKAGE std::string JoinRecord::text() const {
  return cat("size=", size, " host=", host, " pid=", pid, " loopback=", loopback ? 1 : 0);
}
TESSERA_GLOO_LINKAGE JoinRecord JoinRecord::parse(const std::vector<char>& bytes) {
  JoinRecord r;
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::string field;
  while (in >> field) {
    if (field.rfind("size=", 0) == 0) r.size = std::atoi(field.c_str() + 5);
    if (field.rfind("host=", 0) == 0) r.host = field.substr(5);
    if (field.rfind("pid=", 0) == 0) r.pid = std::atol(field.c_str() + 4);
    if (field.rfind("loopback=", 0) == 0) r.loopback = field == "loopback=1";
  }
  return r;
}
TESSERA_GLOO_LINKAGE bool JoinRecord::alive() const {
  return host != this_host() || pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH;
}
TESSERA_GLOO_LINKAGE std::string JoinRecord::where() const { return cat("pid ", pid, " on ", host); }

TESSERA_GLOO_LINKAGE AuthRedisStore::AuthRedisStore(const std::string& host, int port, const std::string& url)
    : RedisStore(host, port) {
  const char* password = std::getenv("TESSERA_REDIS_PASSWORD");
  if (password == nullptr || *password == '\0') return;
  auto* reply = static_cast<redisReply*>(redisCommand(redis_, "AUTH %s", password));
  const std::string error = reply == nullptr                     ? std::string(redis_->errstr)
                            : reply->type == REDIS_REPLY_ERROR ? std::string(reply->str, reply->len)
                                                                 : std::string();
  if (reply != nullptr) freeReplyObject(reply);
  TESSERA_CHECK(error.empty(), CommError, "GlooComm: the Redis store ", url,
                " refused the password in TESSERA_REDIS_PASSWORD: ", error);
}

TESSERA_GLOO_LINKAGE std::string store_error_hint(const std::string& what) {
  return what.find("NOAUTH") != std::string::npos ? " (the Redis server wants a password: set TESSERA_REDIS_PASSWORD)"
                                                  : "";
}

TESSERA_GLOO_LINKAGE std::shared_ptr<gloo::rendezvous::Store> open_gloo_store(const std::string& url) {
  TESSERA_CHECK(!url.empty(), ArgumentError,
                "GlooComm: no store given: set TESSERA_STORE=file:///shared/dir or redis://host:port "
                "(tessera-run sets it for you)");
  try {
    if (url.rfind("file://", 0) == 0) {
      const std::string path = url.substr(7);
      TESSERA_CHECK(!path.empty() && path[0] == '/', ArgumentError, "GlooComm: store '", url,
                    "' must be an absolute path: file:///dir");
      return std::make_shared<CheckableFileStore>(path);
    }
    if (url.rfind("redis://", 0) == 0) {
      const std::string rest = url.substr(8);
      const auto colon = rest.rfind(':');
      const std::string host = colon == std::string::npos ? rest : rest.substr(0, colon);
      // The whole port, digits only, in range: atoi would wrap 4294973375 to 6079 and accept "80abc".
      long port = 6379;
      if (colon != std::string::npos) {
        const std::string digits = rest.substr(colon + 1);
        const bool all_digits = !digits.empty() && digits.size() <= 5 &&
                                std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
        port = all_digits ? std::strtol(digits.c_str(), nullptr, 10) : -1;
      }
      TESSERA_CHECK(!host.empty() && port > 0 && port < 65536, ArgumentError, "GlooComm: store '", url,
                    "' is not redis://host:port (port 1 to 65535)");
      return std::make_shared<AuthRedisStore>(host, static_cast<int>(port), url);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(cat("GlooComm: cannot open store '", url, "': ", e.what()));
  }
  throw ArgumentError(cat("GlooComm: store '", url, "' must start with file:// or redis://"));
}

TESSERA_GLOO_LINKAGE std::string loopback_address_of(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* info = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &info) != 0 || info == nullptr) return "";
  std::string text;
  char buf[INET6_ADDRSTRLEN] = {};
  if (info->ai_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(info->ai_addr);
    if ((ntohl(a->sin_addr.s_addr) >> 24) == 127 && inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf)) text = buf;
  } else if (info->ai_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(info->ai_addr);
    if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr) && inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf)) text = buf;
  }
  freeaddrinfo(info);
  return text;
}

TESSERA_GLOO_LINKAGE std::shared_ptr<gloo::transport::Device> make_gloo_device(std::string* loopback) {
  gloo::transport::tcp::attr attr;
  loopback->clear();
  if (const char* iface = std::getenv("TESSERA_GLOO_IFACE"); iface != nullptr && *iface != '\0') {
    attr.iface = iface;
    if (attr.iface == "lo") *loopback = "TESSERA_GLOO_IFACE is lo";
  } else if (const char* host = std::getenv("TESSERA_GLOO_HOSTNAME"); host != nullptr && *host != '\0') {
    attr.hostname = host;
    if (const std::string a = loopback_address_of(host); !a.empty())
      *loopback = cat("TESSERA_GLOO_HOSTNAME '", host, "' resolves to ", a);
  } else {
    char name[256] = {};
    addrinfo* info = nullptr;
    if (gethostname(name, sizeof(name) - 1) == 0 && getaddrinfo(name, nullptr, nullptr, &info) == 0) {
      attr.hostname = name;
      freeaddrinfo(info);
      if (const std::string a = loopback_address_of(name); !a.empty())
        *loopback = cat("its host name '", name, "' resolves to ", a);
    } else {
      attr.hostname = "127.0.0.1";
      *loopback = cat("its host name '", name, "' does not resolve, so it took 127.0.0.1");
    }
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw CommError(cat("GlooComm: cannot create a TCP device on ",
                        attr.iface.empty() ? "host '" + attr.hostname + "'" : "interface '" + attr.iface + "'", ": ",
                        e.what(), " (set TESSERA_GLOO_IFACE or TESSERA_GLOO_HOSTNAME)"));
  }
}

// c = a op b, the signature Gloo's allreduce wants (c may alias a or b). Avg is summed here and
// divided afterwards.
template <CommScalar T, ReduceOp Op>
void gloo_reduce_fn(void* c, const void* a, const void* b, std::size_t n) {
  combine_into(static_cast<T*>(c), static_cast<const T*>(a), static_cast<const T*>(b), n, Op);
}
template <CommScalar T>
gloo::AllreduceOptions::Func gloo_reduce_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max: return &gloo_reduce_fn<T, ReduceOp::Max>;
    case ReduceOp::Min: return &gloo_reduce_fn<T, ReduceOp::Min>;
    default: return &gloo_reduce_fn<T, ReduceOp::Sum>;
  }
}

// x = x op y, the signature of Gloo's algorithm classes (the sync all_reduce, see GlooState). The
// op is the running call's, not the algorithm's: a cached algorithm serves every op of its dtype
// and count, so ranks that call different ops (a bug the call check reports) still use the same
// Gloo slots, as they do on the async path, instead of waiting on slots only some ranks set up.
TESSERA_GLOO_LINKAGE thread_local ReduceOp gloo_sync_op = ReduceOp::Sum;
template <CommScalar T>
void gloo_reduce_in_place(T* x, const T* y, std::size_t n) {
  combine_into(x, x, y, n, gloo_sync_op == ReduceOp::Avg ? ReduceOp::Sum : gloo_sync_op);
}
template <CommScalar T>
const gloo::ReductionFunction<T>* gloo_reduction() {
  static const gloo::ReductionFunction<T> fn(gloo::SUM, &gloo_reduce_in_place<T>);
  return &fn;
}

TESSERA_GLOO_LINKAGE void ignore_sigpipe_if_default() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      !(current.sa_flags & SA_SIGINFO)) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  }
}

TESSERA_GLOO_LINKAGE bool gloo_busy_poll() {
  if (const char* v = std::getenv("TESSERA_GLOO_BUSY_POLL"); v != nullptr && *v != '\0') {
    const std::string value = v;
    TESSERA_CHECK(value == "0" || value == "1", ArgumentError, "GlooComm: TESSERA_GLOO_BUSY_POLL='", value,
                  "' must be 1 (spin while waiting) or 0 (sleep)");
    return value == "1";
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) == 1;
}

}  // namespace detail

TESSERA_GLOO_LINKAGE GlooComm GlooComm::from_env(CommOptions options) {
  const LaunchEnv env = LaunchEnv::from_environment();
  const char* prefix = std::getenv("TESSERA_STORE_PREFIX");
  const char* job = std::getenv("SLURM_JOB_ID");
  const char* step = std::getenv("SLURM_STEP_ID");
  std::string chosen = "tessera";
  if (prefix != nullptr && *prefix)
    chosen = prefix;
  else if (job != nullptr && *job && step != nullptr && *step)
    chosen = detail::cat("slurm-", job, ".", step);
  return GlooComm(env.store, env.rank, env.size, options, chosen);
}

TESSERA_GLOO_LINKAGE GlooComm::GlooComm(const std::string& store_url, int rank, int size, CommOptions options,
                                        const std::string& prefix)
    : s_(std::make_shared<detail::GlooState>()) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, ArgumentError, "GlooComm: rank ", rank, " and size ", size,
                " are inconsistent: need 0 <= rank < size");
  s_->store_url = store_url;
  s_->core = detail::CommCore("GlooComm", rank, size, options);
  s_->store = std::make_shared<detail::PrefixedStore>(detail::open_gloo_store(store_url), prefix);
  detail::ignore_sigpipe_if_default();
  detail::install_fatal_handler();
  detail::install_sigterm_reporter();
  s_->device = detail::make_gloo_device(&s_->loopback);
  connect(prefix, "gloo:" + prefix);
}

template <CommScalar T>
void GlooComm::all_reduce(std::span<T> buf, ReduceOp op) {
  drain();
  run_all_reduce(s_, buf, op, take_tag());
}

template <CommScalar T>
void GlooComm::broadcast(std::span<T> buf, int root) {
  drain();
  run_broadcast(s_, buf, root, take_tag());
}

template <CommScalar T>
void GlooComm::all_gather(std::span<const T> in, std::span<T> out) {
  drain();
  run_all_gather(s_, in, out, take_tag());
}

template <CommScalar T>
void GlooComm::reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op) {
  drain();
  run_reduce_scatter(s_, in, out, op, take_tag());
}

TESSERA_GLOO_LINKAGE void GlooComm::barrier() {
  drain();
  run_barrier(s_, take_tag());
}

template <CommScalar T>
void GlooComm::send(std::span<const T> buf, int peer) {
  send_async(buf, peer).wait();
}

template <CommScalar T>
void GlooComm::recv(std::span<T> buf, int peer) {
  recv_async(buf, peer).wait();
}

template <CommScalar T>
Work GlooComm::all_reduce_async(std::span<T> buf, ReduceOp op) {
  return submit([s = s_, buf, op, tag = take_tag()] { run_all_reduce(s, buf, op, tag); });
}

template <CommScalar T>
Work GlooComm::broadcast_async(std::span<T> buf, int root) {
  return submit([s = s_, buf, root, tag = take_tag()] { run_broadcast(s, buf, root, tag); });
}

template <CommScalar T>
Work GlooComm::all_gather_async(std::span<const T> in, std::span<T> out) {
  return submit([s = s_, in, out, tag = take_tag()] { run_all_gather(s, in, out, tag); });
}

template <CommScalar T>
Work GlooComm::reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
  return submit([s = s_, in, out, op, tag = take_tag()] { run_reduce_scatter(s, in, out, op, tag); });
}

template <CommScalar T>
Work GlooComm::send_async(std::span<const T> buf, int peer) {
  s_->core.check_peer(peer, "send");
  return post(detail::PeerCall::send<T>(buf.size(), peer), const_cast<T*>(buf.data()), buf.size_bytes(), peer, true);
}

template <CommScalar T>
Work GlooComm::recv_async(std::span<T> buf, int peer) {
  s_->core.check_peer(peer, "recv");
  return post(detail::PeerCall::recv<T>(buf.size(), peer), buf.data(), buf.size_bytes(), peer, false);
}

TESSERA_GLOO_LINKAGE GlooComm GlooComm::split(int color, int key) {
  s_->core.check_split_color(color);
  drain();
  std::vector<std::int64_t> mine = {color, key}, all(2 * static_cast<std::size_t>(size()));
  all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  std::vector<int> members;
  for (int q = 0; q < size(); ++q)
    if (all[2 * q] == color) members.push_back(q);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
  const std::string prefix = detail::cat("split", ++s_->splits, ".color", color);
  return GlooComm(s_, prefix, new_rank, static_cast<int>(members.size()));
}

TESSERA_GLOO_LINKAGE GlooComm::GlooComm(const std::shared_ptr<detail::GlooState>& parent, const std::string& prefix,
                                        int rank, int size)
    : s_(std::make_shared<detail::GlooState>()) {
  s_->store_url = parent->store_url;
  s_->core = detail::CommCore("GlooComm", rank, size, parent->core.options());
  s_->store = std::make_shared<detail::PrefixedStore>(parent->store, prefix);
  s_->device = parent->device;
  connect(prefix, parent->core.label() + "/" + prefix);
}

TESSERA_GLOO_LINKAGE void GlooComm::check_reachable(const std::vector<detail::JoinRecord>& joined,
                                                    const std::string& where) const {
  std::vector<std::string> hosts;
  for (const auto& j : joined)
    if (std::find(hosts.begin(), hosts.end(), j.host) == hosts.end()) hosts.push_back(j.host);
  if (hosts.size() < 2) return;
  for (std::size_t q = 0; q < joined.size(); ++q) {
    if (!joined[q].loopback) continue;
    std::string list;
    for (const auto& h : hosts) list += (list.empty() ? "" : ", ") + h;
    const bool me = static_cast<int>(q) == rank();
    throw CommError(detail::cat(where, ": the ranks run on ", hosts.size(), " hosts (", list, "), but rank ", q, " (",
                                joined[q].where(), ") listens on a loopback address",
                                me ? " (" + s_->loopback + ")" : "", ", which the ranks of other hosts cannot "
                                "reach: set TESSERA_GLOO_IFACE to the network interface the hosts share "
                                "(tessera-run --iface, tessera-sbatch --iface), or TESSERA_GLOO_HOSTNAME to a name "
                                "of each host that the others can reach"));
  }
}

TESSERA_GLOO_LINKAGE void GlooComm::connect(const std::string& label, std::string board_label) {
  s_->busy_poll = detail::gloo_busy_poll();  // first: a bad TESSERA_GLOO_BUSY_POLL is the user's error
  const CommOptions& options = s_->core.options();
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options.timeout;
  auto& store = *s_->store;
  const std::string where = detail::cat("GlooComm rendezvous (", label, ") on rank ", rank(), " of ", size(), " at ",
                                        s_->store_url);
  const std::string fresh_store = "give each job its own TESSERA_STORE directory or TESSERA_STORE_PREFIX "
                                  "(tessera-run and tessera-sbatch do)";
  // The store's first answer: a Redis server that wants a password says NOAUTH.
  bool taken = false;
  try {
    taken = store.has({detail::cat("join.", rank())});
  } catch (const std::exception& e) {
    throw CommError(detail::cat(where, ": cannot read the store: ", e.what(), detail::store_error_hint(e.what())));
  }
  // Another job's rank (or an earlier run's) under this store and prefix would pair with this
  // job's ranks: refused before this rank registers.
  if (taken) {
    detail::JoinRecord other;
    try {
      other = detail::JoinRecord::parse(store.get(detail::cat("join.", rank())));
    } catch (const std::exception&) {
    }
    throw CommError(detail::cat(where, ": the store already holds a rank ", rank(), " (", other.where(),
                                other.alive() ? ", still running" : ", no longer running",
                                "): another job, or an earlier run, used this store and prefix; ", fresh_store));
  }
  try {
    const std::string mine = detail::JoinRecord::mine(size(), !s_->loopback.empty()).text();
    store.set(detail::cat("join.", rank()), std::vector<char>(mine.begin(), mine.end()));
  } catch (const std::exception& e) {
    throw CommError(detail::cat("GlooComm rendezvous on rank ", rank(), " of ", size(), " at ", s_->store_url,
                                ": cannot write to the store: ", e.what(), detail::store_error_hint(e.what())));
  }
  // Wait for every rank's join key, polling so that on timeout we can say who is missing, and
  // reading each one that arrives: a rank started with another world size, or one of this host
  // that exited after joining, ends the wait at once with its name.
  std::vector<detail::JoinRecord> joined(static_cast<std::size_t>(size()));
  std::vector<int> missing;
  for (int q = 0; q < size(); ++q) missing.push_back(q);
  auto check_peer = [&](int q, const detail::JoinRecord& r) {
    if (r.size != size())
      throw CommError(detail::cat(where, ": rank ", q, " (", r.where(), ") was started with world size ", r.size,
                                  ", this rank with ", size(), ": every rank must be given the same "
                                  "TESSERA_WORLD_SIZE (or the same -n)"));
  };
  const auto warn_after = options.effective_stall_warning();
  bool warned = false;
  while (!missing.empty()) {
    std::vector<int> still;
    for (int q : missing) {
      if (!store.has({detail::cat("join.", q)})) {
        still.push_back(q);
        continue;
      }
      const auto record = detail::JoinRecord::parse(store.get(detail::cat("join.", q)));
      if (record.size <= 0) {  // not all written yet (a store may show a key before its value)
        still.push_back(q);
        continue;
      }
      joined[static_cast<std::size_t>(q)] = record;
      check_peer(q, record);
    }
    missing.swap(still);
    // A rank past this world's last one: someone was started with a larger world size.
    if (store.has({detail::cat("join.", size())})) {
      const auto r = detail::JoinRecord::parse(store.get(detail::cat("join.", size())));
      if (r.size > 0) throw CommError(detail::cat(where, ": rank ", size(), " (", r.where(), ") joined, which a world of ", size(),
                                  " ranks does not have: it was started with world size ", r.size, "; every rank "
                                  "must be given the same TESSERA_WORLD_SIZE (or the same -n)"));
    }
    if (missing.empty()) break;
    std::string names;
    for (int q : missing) names += detail::cat(names.empty() ? "" : ", ", q);
    // A peer that joined and exited: often one that timed out a moment before this rank, waiting
    // for the same missing ranks, so those are named too (they are the cause).
    for (int q = 0; q < size(); ++q)
      if (joined[static_cast<std::size_t>(q)].pid > 0 && !joined[static_cast<std::size_t>(q)].alive())
        throw CommError(detail::cat(where, ": rank ", q, " (", joined[static_cast<std::size_t>(q)].where(),
                                    ") exited during the rendezvous, and rank(s) ", names, " never joined"));
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      throw CommError(detail::cat(where, ": timed out after ", detail::seconds_text(options.timeout), "; rank(s) ",
                                  names, " never joined"));
    if (!warned && now - start >= warn_after) {
      warned = true;
      std::fprintf(stderr, "warning: %s has waited %s for rank(s) %s to join (the timeout is %s)\n", where.c_str(),
                   detail::seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)).c_str(),
                   names.c_str(), detail::seconds_text(options.timeout).c_str());
      std::fflush(stderr);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  check_reachable(joined, where);
  // Gloo's full-mesh connect waits on the store for each peer's address: a peer of this host
  // that exits meanwhile ends that wait naming it.
  store.set_watch([this, joined, where] {
    for (std::size_t q = 0; q < joined.size(); ++q)
      if (static_cast<int>(q) != rank() && !joined[q].alive())
        throw CommError(detail::cat(where, ": rank ", q, " (", joined[q].where(), ") exited while the ranks were "
                                    "connecting"));
  }, options.timeout);
  struct Unwatch {
    detail::PrefixedStore& store;
    ~Unwatch() { store.set_watch({}); }
  } unwatch{store};
  try {
    s_->context = std::make_shared<gloo::rendezvous::Context>(rank(), size());
    s_->context->setTimeout(options.timeout);
    s_->context->connectFullMesh(store, s_->device);
    s_->pair_addresses = publish_pair_addresses(*s_->context, store, "pairs.");
    if (size() > 1) {
      // The second mesh, for the sync all_reduce; its keys under their own prefix.
      auto sync_store = std::make_shared<detail::PrefixedStore>(s_->store, "sync");
      s_->sync_context = std::make_shared<gloo::rendezvous::Context>(rank(), size());
      s_->sync_context->setTimeout(options.timeout);  // each pair's socket read/write timeout
      s_->sync_context->connectFullMesh(*sync_store, s_->device);
      for (int q = 0; q < size(); ++q)
        if (q != rank()) s_->sync_context->getPair(q)->setSync(true, s_->busy_poll);
      s_->sync_pair_addresses = publish_pair_addresses(*s_->sync_context, store, "syncpairs.");
      s_->check_staging.assign(4 * static_cast<std::size_t>(size()), 0);
      s_->check_gather = std::make_unique<gloo::AllreduceHalvingDoubling<std::int64_t>>(
          s_->sync_context, std::vector<std::int64_t*>{s_->check_staging.data()}, 4 * size(),
          detail::gloo_reduction<std::int64_t>());
    }
    // Tag 0 is never an operation's (next_tag starts at 1).
    s_->core.connect_monitor(std::move(board_label), [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      gloo::AllgatherOptions opts(s_->context);
      opts.setInput(const_cast<std::int64_t*>(in.data()), in.size());
      opts.setOutput(out.data(), out.size());
      opts.setTag(0);
      opts.setTimeout(options.timeout);
      gloo::allgather(opts);
    });
  } catch (const CommError&) {
    throw;  // the watch's: a peer that exited, already named
  } catch (const std::exception& e) {
    throw CommError(detail::cat("GlooComm rendezvous (", label, ") on rank ", rank(), " of ", size(), " at ",
                                s_->store_url, ": connecting the full mesh failed: ", e.what()));
  }
}

TESSERA_GLOO_LINKAGE std::vector<std::string> GlooComm::publish_pair_addresses(gloo::rendezvous::Context& context,
                                                                            gloo::rendezvous::Store& store,
                                                                            const char* key) {
  std::vector<std::string> addresses(static_cast<std::size_t>(size()));
  std::string joined;
  for (int q = 0; q < size(); ++q) {
    if (q != rank()) addresses[q] = context.getPair(q)->address().str();
    joined += addresses[q] + "|";
  }
  store.set(detail::cat(key, rank()), std::vector<char>(joined.begin(), joined.end()));
  return addresses;
}

TESSERA_GLOO_LINKAGE Work GlooComm::submit(std::function<void()> op) {
  if (!worker_) worker_ = std::make_unique<detail::AsyncWorker>();
  return worker_->submit(std::move(op));
}

template <class What, class Fn>
void GlooComm::guarded(const std::shared_ptr<detail::GlooState>& s, const What& what, std::int64_t call, Fn&& fn) {
  s->core.guard(what, call, std::forward<Fn>(fn), [&](const std::exception& e) {
    // A sync pair's socket timeout reads "Read timeout <address>"; say what it means.
    const std::string_view gloo_text = e.what();
    const bool socket_timeout = gloo_text.find("Read timeout") != std::string_view::npos ||
                                gloo_text.find("Write timeout") != std::string_view::npos;
    return detail::cat(
        socket_timeout ? detail::cat("timed out after ", detail::seconds_text(s->core.options().timeout), ": ") : "",
        e.what(), peer_named_in(s, e.what()), s->core.stall_suffix_of_last());
  });
}

TESSERA_GLOO_LINKAGE std::string GlooComm::peer_named_in(const std::shared_ptr<detail::GlooState>& s,
                                                       const std::string& message) {
  // "[127.0.0.1]:5323" must not match inside "[127.0.0.1]:53230".
  auto mentions = [&](const std::string& address) {
    if (address.empty()) return false;
    for (auto at = message.find(address); at != std::string::npos; at = message.find(address, at + 1)) {
      const std::size_t end = at + address.size();
      if (end == message.size() || !std::isdigit(static_cast<unsigned char>(message[end]))) return true;
    }
    return false;
  };
  auto named = [](int q) { return detail::cat(" (peer: rank ", q, ")"); };
  const int rank = s->core.rank(), size = s->core.size();
  for (const auto* mine : {&s->pair_addresses, &s->sync_pair_addresses})
    for (int q = 0; q < size; ++q)
      if (q != rank && q < static_cast<int>(mine->size()) && mentions((*mine)[q])) return named(q);
  for (const char* key : {"pairs.", "syncpairs."}) {
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      try {
        std::vector<std::string> theirs(1);
        for (char ch : s->store->get(detail::cat(key, q))) {
          if (ch == '|') theirs.emplace_back();
          else theirs.back() += ch;
        }
        if (rank < static_cast<int>(theirs.size()) && mentions(theirs[rank])) return named(q);
      } catch (const std::exception&) {
      }
    }
  }
  return " (a peer died, stalled or did not make the same call)";
}

TESSERA_GLOO_LINKAGE GlooComm::InCall::InCall(const std::shared_ptr<detail::GlooState>& s,
                                              const detail::CallSignature& sig, std::uint32_t tag)
    : s_(s), call_(s->core.enter(sig)), watched_(s->core.watch(call_, sig)) {
  std::uint32_t exchange = 0;
  s->core.check_call(sig, [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    guarded(s, detail::CallCheckOf{sig}, call_, [&] {
      ++exchange;
      if (s->check_gather && 4 * static_cast<std::size_t>(s->core.size()) == out.size())
        return gather_on_sync_pairs(*s, in, out);
      gloo::AllgatherOptions opts(s->context);
      opts.setInput(const_cast<std::int64_t*>(in.data()), in.size());
      opts.setOutput(out.data(), out.size());
      opts.setTag((tag & 0x3fffffffu) | (exchange << 30));
      opts.setTimeout(s->core.options().timeout);
      gloo::allgather(opts);
    });
  });
}

TESSERA_GLOO_LINKAGE void GlooComm::gather_on_sync_pairs(detail::GlooState& s, std::span<const std::int64_t> in,
                                                         std::span<std::int64_t> out) {
  std::fill(s.check_staging.begin(), s.check_staging.end(), 0);
  std::copy(in.begin(), in.end(), s.check_staging.begin() + 4 * s.core.rank());
  detail::gloo_sync_op = ReduceOp::Sum;
  s.check_gather->run();
  std::copy(s.check_staging.begin(), s.check_staging.end(), out.begin());
}

template <CommScalar T>
void GlooComm::run_all_reduce(const std::shared_ptr<detail::GlooState>& s, std::span<T> buf, ReduceOp op,
                              std::uint32_t tag) {
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::AllReduce, buf.size(), static_cast<std::int64_t>(op));
  const InCall in_call(s, sig, tag);
  const int size = s->core.size();
  if (size == 1 || buf.empty()) return;
  if (detail::prescale_half_avg(buf.data(), buf.size(), op, size)) op = ReduceOp::Sum;
  guarded(s, sig, in_call.call(), [&] {
    if (s->sync_context && buf.size_bytes() <= kSyncMaxBytes) return run_sync_all_reduce(*s, buf, op);
    gloo::AllreduceOptions opts(s->context);
    opts.setOutput(buf.data(), buf.size());
    opts.setReduceFunction(detail::gloo_reduce_function<T>(op));
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setTag(tag);
    opts.setTimeout(s->core.options().timeout);
    gloo::allreduce(opts);
  });
  detail::finish_avg(buf.data(), buf.size(), op, size);
}

template <CommScalar T>
void GlooComm::run_sync_all_reduce(detail::GlooState& s, std::span<T> buf, ReduceOp op) {
  auto& cache = s.sync_all_reduces;
  auto it = std::find_if(cache.begin(), cache.end(), [&](const detail::GlooState::SyncAllReduce& a) {
    return a.dtype == comm_dtype_of<T> && a.count == buf.size();
  });
  if (it == cache.end()) {
    // Least recently used first out until the new staging buffer fits the budget.
    auto bytes_in = [&] {
      std::size_t total = buf.size_bytes();
      for (const auto& a : cache) total += a.staging.size();
      return total;
    };
    while (!cache.empty() && bytes_in() > kSyncCacheBytes)
      cache.erase(std::min_element(cache.begin(), cache.end(),
                                   [](const auto& a, const auto& b) { return a.last_use < b.last_use; }));
    detail::GlooState::SyncAllReduce entry{comm_dtype_of<T>, buf.size(), std::vector<std::byte>(buf.size_bytes()),
                                          nullptr, 0};
    entry.algorithm = std::make_unique<gloo::AllreduceHalvingDoubling<T>>(
        s.sync_context, std::vector<T*>{reinterpret_cast<T*>(entry.staging.data())}, static_cast<int>(buf.size()),
        detail::gloo_reduction<T>());
    cache.push_back(std::move(entry));
    it = cache.end() - 1;
  }
  detail::gloo_sync_op = op;
  it->last_use = ++s.sync_uses;
  std::memcpy(it->staging.data(), buf.data(), buf.size_bytes());
  it->algorithm->run();
  std::memcpy(buf.data(), it->staging.data(), buf.size_bytes());
}

template <CommScalar T>
void GlooComm::run_broadcast(const std::shared_ptr<detail::GlooState>& s, std::span<T> buf, int root,
                             std::uint32_t tag) {
  s->core.check_root(root);
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::Broadcast, buf.size(), root);
  const InCall in_call(s, sig, tag);
  if (s->core.size() == 1 || buf.empty()) return;
  guarded(s, sig, in_call.call(), [&] {
    gloo::BroadcastOptions opts(s->context);
    opts.setOutput(buf.data(), buf.size());
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(s->core.options().timeout);
    gloo::broadcast(opts);
  });
}

template <CommScalar T>
void GlooComm::run_all_gather(const std::shared_ptr<detail::GlooState>& s, std::span<const T> in,
                              std::span<T> out, std::uint32_t tag) {
  s->core.check_all_gather(in.size(), out.size());
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::AllGather, in.size());
  const InCall in_call(s, sig, tag);
  if (s->core.size() == 1 || in.empty()) {
    std::copy(in.begin(), in.end(), out.begin());
    return;
  }
  guarded(s, sig, in_call.call(), [&] {
    gloo::AllgatherOptions opts(s->context);
    opts.setInput(const_cast<T*>(in.data()), in.size());
    opts.setOutput(out.data(), out.size());
    opts.setTag(tag);
    opts.setTimeout(s->core.options().timeout);
    gloo::allgather(opts);
  });
}

template <CommScalar T>
void GlooComm::run_reduce_scatter(const std::shared_ptr<detail::GlooState>& s, std::span<const T> in,
                                  std::span<T> out, ReduceOp op, std::uint32_t tag) {
  const int p = s->core.size(), r = s->core.rank();
  s->core.check_reduce_scatter(in.size(), out.size());
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::ReduceScatter, in.size(), static_cast<std::int64_t>(op));
  const InCall in_call(s, sig, tag);
  if (p == 1 || out.empty()) {
    std::copy(in.begin(), in.end(), out.begin());
    return;
  }
  // Half/BHalf Avg: sum pre-divided values (from a copy, the input is const) so fp16 cannot
  // overflow (BHalf alike, as prescale_half_avg does on every path).
  std::vector<T> scaled;
  if (is_16bit_float_v<T> && op == ReduceOp::Avg) {
    scaled.assign(in.begin(), in.end());
    detail::prescale_half_avg(scaled.data(), scaled.size(), op, p);
    in = std::span<const T>(scaled);
    op = ReduceOp::Sum;
  }
  const std::size_t n = out.size(), bytes = n * sizeof(T);
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  auto index = [p](int c) { return static_cast<std::size_t>((c % p + p) % p); };
  if (s->scratch.size() < 2 * bytes) s->scratch.resize(2 * bytes);
  T* partial = reinterpret_cast<T*>(s->scratch.data());
  T* incoming = reinterpret_cast<T*>(s->scratch.data() + bytes);
  const auto timeout = s->core.options().timeout;
  guarded(s, sig, in_call.call(), [&] {
    auto input_buf = s->context->createUnboundBuffer(const_cast<T*>(in.data()), in.size_bytes());
    auto partial_buf = s->context->createUnboundBuffer(partial, bytes);
    auto incoming_buf = s->context->createUnboundBuffer(incoming, bytes);
    const std::uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    for (int k = 0; k < p - 1; ++k) {
      if (k == 0) input_buf->send(right, slot, index(r - 1) * bytes, bytes);
      else partial_buf->send(right, slot);
      incoming_buf->recv(left, slot);
      incoming_buf->waitRecv(timeout);
      if (k == 0) input_buf->waitSend(timeout);
      else partial_buf->waitSend(timeout);
      // The left neighbour's partial of chunk r - k - 2, plus ours: the next partial, or at
      // the last step the result.
      const T* own = in.data() + index(r - k - 2) * n;
      T* target = k == p - 2 ? out.data() : partial;
      detail::combine_into(target, incoming, own, n, op);
    }
  });
  detail::finish_avg(out.data(), n, op, p);
}

TESSERA_GLOO_LINKAGE void GlooComm::run_barrier(const std::shared_ptr<detail::GlooState>& s, std::uint32_t tag) {
  const detail::CallSignature sig{detail::CollectiveKind::Barrier, CommDType::F32, 0, 0};
  const InCall in_call(s, sig, tag);
  if (s->core.size() == 1) return;
  guarded(s, sig, in_call.call(), [&] {
    gloo::BarrierOptions opts(s->context);
    opts.setTag(tag);
    opts.setTimeout(s->core.options().timeout);
    gloo::barrier(opts);
  });
}

TESSERA_GLOO_LINKAGE Work GlooComm::post(const detail::PeerCall& what, void* data, std::size_t bytes, int peer,
                                         bool is_send) {
  auto s = s_;
  std::shared_ptr<gloo::transport::UnboundBuffer> buffer;
  guarded(s, what, 0, [&] {
    buffer = s->context->createUnboundBuffer(data, bytes);
    if (is_send) buffer->send(peer, kPointToPointSlot);
    else buffer->recv(peer, kPointToPointSlot);
  });
  auto completion = std::make_shared<detail::Completion>();
  std::thread([s, buffer, what, is_send, completion] {
    completion->run([&] {
      guarded(s, what, 0, [&] {
        if (is_send) buffer->waitSend(s->core.options().timeout);
        else buffer->waitRecv(s->core.options().timeout);
      });
    });
  }).detach();  // holds shared_ptrs to everything it touches
  return detail::Completion::work_for(completion);
}

#endif  // TESSERA_GLOO_DEFINITIONS

// The collectives' instances a program calls, for every CommScalar: defined in tessera_gloo
// (communicators/gloo/src/gloo.cpp expands this list), declared only in a program built with
// TESSERA_COMPILED_GLOO, which sees no template definitions to instantiate (so it needs no
// `extern template` either). The private run_* templates they call are instantiated there too.
#define TESSERA_GLOO_ALL_INSTANCES() TESSERA_FOR_EACH_COMM_SCALAR(TESSERA_COMM_COLLECTIVE_INSTANCES, GlooComm)

static_assert(check_communicator<GlooComm>());
static_assert(BHalfCommunicator<GlooComm> && comm_concepts::has_async<GlooComm, BHalf>);

using CpuGloo = Env<Cpu, GlooComm, float>;
using CpuGloo64 = Env<Cpu, GlooComm, double>;

// DataParallel<CpuGloo> is compiled once, in tessera_gloo (src/gloo.cpp), and declared extern in the
// backend's programs when DataParallel's definition precedes this header (as in every program of
// the meson build: parallel/data_parallel.hpp says why here). Elsewhere the program compiles it.
#if defined(TESSERA_COMPILED_GLOO) && !defined(TESSERA_COMPILING_GLOO) && defined(TESSERA_DATA_PARALLEL_DEFINED)
extern template class DataParallel<CpuGloo>;
#endif

}  // namespace tessera

// The elastic group over this backend (comm/elastic.hpp): ElasticGroupOf<GlooComm>.
#include "tessera/comm/gloo_elastic.hpp"
