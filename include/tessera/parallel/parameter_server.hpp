// ParameterServer: asynchronous and stale-synchronous SGD with parameter-server ranks (Dean et al.
// 2012, "Downpour SGD"; Ho et al. 2013, "Stale Synchronous Parallel"; Li et al. 2014, "Parameter
// Server"), over any communicator with point-to-point messages (threads, MPI, Gloo).
//
//   ParameterServer ps(model, comm, {.num_servers = 1, .staleness_bound = 2});   // ParameterServer<E>
//   if (ps.is_server()) {
//     Sgd<E> sgd(ps.server_parameters(), {.lr = 0.05, .momentum = 0.9});
//     ps.serve(sgd);                                  // until every worker has called done()
//   } else {
//     ps.pull();                                      // the servers' parameters into the model
//     for (each batch) { zero grads; forward; backward; if (!ps.push_pull()) break; }
//     ps.done();
//   }
//   ps.gather_parameters();                           // collective: every rank gets the final model
//
// Roles. Ranks [0, num_servers) are servers, the others workers; the constructor (collective)
// gives every rank rank 0's parameters and buffers. The parameters are split into
// num_servers shards of whole tensors, balanced by size; server k keeps shard k and the
// optimizer state for it (the optimizer is built on server_parameters(), so any optimizer works).
// A worker holds the whole model, computes gradients on its own data, pushes each shard's part to
// its server and pulls fresh parameters back. There is no global barrier: every server handles the
// workers' messages in the order they arrive.
//
// Consistency (the staleness bound s; a worker's clock is the number of gradients it has pushed):
//   s = kAsynchronous   every gradient is applied as it arrives, scaled by 1/W (W workers), so a
//                       round of W gradients moves the parameters as far as one synchronous step;
//                       the reply comes at once.
//   s >= 1 (SSP)        the same per-gradient updates, but a worker's reply (its fresh parameters)
//                       waits until it is at most s clocks ahead of the slowest active worker.
//   s = 0 (BSP)         the server waits for the gradient of every active worker for this clock,
//                       averages them (in worker order) and applies one optimizer step: exactly
//                       synchronous data-parallel SGD, momentum and weight decay included.
// The staleness of an applied gradient is the number of updates the server applied between the
// worker's read of the parameters and this gradient's arrival (0 in BSP); every one is recorded
// (staleness()). Workers that called done() no longer hold the others back.
//
// Budgets. serve(opt, max_gradients) tells every worker to stop (push_pull() returns false) once
// that many gradients have arrived, so fast workers process more batches than slow ones; without
// it the workers decide when to stop. serve() returns when every worker has called done(); it may
// be called again (per epoch, say), with pull() opening each session on the workers.
//
// Timeline (options.timeline or set_timeline): a worker's "push gradients" and "pull parameters"
// (from the push's end until the reply, so the time a staleness bound holds it back shows) on
// the communication lane; a server's optimizer updates on the compute lane, each asynchronous
// one with the gradient's staleness.
//
// Failures. A worker whose communicator reports an error (ThreadComm: a rank failed; Gloo: the
// connection dropped), or that sends nothing for options.worker_timeout while the server is not
// holding it back, makes serve() throw CommError naming that worker's rank: the servers do not
// hang, and the job stops with a named error (the communicator is unusable afterwards, as after
// any CommError; continuing without the worker is not supported). Under MPI, mpirun ends the job
// when a process dies. Ranks launched with different settings (server count, staleness bound,
// parameter shapes) are refused at construction on every rank.
//
// Checkpoints. A server's state is its shard (under the model's parameter names), its update count
// and its staleness record; ps.visit() hands them to a checkpoint visitor, so
//   save_checkpoint(path_for_this_server, ps, sgd, state)   /   load_checkpoint(..., ps, sgd)
// save and restore a server with its optimizer state, between sessions.
//
// Wire format, all int64 headers: worker -> server {kind, read_version, clock, 0} (+ the gradient
// shard after a push); server -> worker {version, stop, 0, 0} + the parameter shard.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

namespace detail {

// Keeps an object alive until the process exits, reachable (so leak checkers such as
// LeakSanitizer do not report it): buffers a posted receive may still complete into.
inline void keep_until_exit(std::shared_ptr<void> object) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never freed: outlives static destructors
  std::lock_guard lock(mutex);
  kept->push_back(std::move(object));
}

}  // namespace detail

struct ParameterServerOptions {
  static constexpr int kAsynchronous = -1;
  int num_servers = 1;      // ranks [0, num_servers) are servers; at least one worker must remain
  int staleness_bound = 0;  // s >= 0 (0: synchronous), or kAsynchronous
  // A worker that sends nothing for this long while the server is not holding it back is
  // declared dead (CommError naming it). Default: the communicators' timeout (TESSERA_COMM_TIMEOUT).
  std::chrono::milliseconds worker_timeout = CommOptions::default_timeout();
  // Optional (a Timeline): a worker's push and its wait for fresh parameters as spans on the
  // communication lane, a server's optimizer updates on the compute lane (set_timeline likewise).
  SpanSink* timeline = nullptr;
};

// The staleness of every gradient a server applied: histogram[k] counts gradients of staleness k
// (the last bucket collects kHistogramSize - 1 and more).
struct StalenessStats {
  static constexpr int kHistogramSize = 64;
  std::int64_t applied = 0;  // gradients applied
  std::int64_t sum = 0;      // sum of their staleness
  std::int64_t max = 0;
  std::vector<std::int64_t> histogram = std::vector<std::int64_t>(kHistogramSize, 0);

  void record(std::int64_t staleness) {
    ++applied;
    sum += staleness;
    max = std::max(max, staleness);
    ++histogram[static_cast<std::size_t>(std::min<std::int64_t>(staleness, kHistogramSize - 1))];
  }
  double mean() const { return applied == 0 ? 0.0 : static_cast<double>(sum) / static_cast<double>(applied); }
};

// What one serve() session did on this server.
struct ServeResult {
  std::int64_t gradients = 0;  // gradients received
  std::int64_t updates = 0;    // optimizer steps taken (= gradients, or rounds in BSP)
};

template <class E>
class ParameterServer {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Comm = typename E::Comm;
  static constexpr std::int64_t kNoBudget = std::numeric_limits<std::int64_t>::max();

  template <class Model, class C>
  ParameterServer(Model& model, C& comm, ParameterServerOptions options = {})
      : comm_(comm_of_env<E>(comm)), options_(options), named_(parameters_of_env<E>(named_tensors(model))) {
    const int size = comm_.size();
    TESSERA_CHECK(options.num_servers >= 1 && options.num_servers < size, ArgumentError, "ParameterServer on rank ",
                  comm_.rank(), ": num_servers=", options.num_servers, " must be between 1 and world size - 1 (",
                  size - 1, ") so that at least one worker remains");
    TESSERA_CHECK(options.staleness_bound >= 0 || options.staleness_bound == ParameterServerOptions::kAsynchronous,
                  ArgumentError, "ParameterServer: staleness_bound=", options.staleness_bound,
                  " must be >= 0 or ParameterServerOptions::kAsynchronous");
    TESSERA_CHECK(!named_.parameters.empty(), ArgumentError, "ParameterServer: the model has no parameters");
    check_same_settings();
    // Every rank starts from rank 0's parameters and buffers, as DataParallel does.
    for (auto& [name, p] : named_.parameters)
      comm_.broadcast(std::span<S>(p->value.data(), static_cast<std::size_t>(p->value.numel())), 0);
    for (auto& [name, t] : named_.buffers) comm_.broadcast(std::span<S>(t->data(), static_cast<std::size_t>(t->numel())), 0);
    assign_shards();
    if (is_server()) {
      for (std::size_t i : shard_params_[static_cast<std::size_t>(server_index())])
        server_named_.parameters.push_back(named_.parameters[i]);
      workers_.resize(static_cast<std::size_t>(num_workers()));
    }
    const std::int64_t largest = *std::max_element(shard_sizes_.begin(), shard_sizes_.end());
    staging_.resize(static_cast<std::size_t>(is_server() ? shard_sizes_[static_cast<std::size_t>(server_index())]
                                                         : largest));
  }

  ParameterServer(const ParameterServer&) = delete;
  ParameterServer& operator=(const ParameterServer&) = delete;
  ~ParameterServer() {
    // A receive still posted (a session that ended in an error) may complete later into these
    // buffers: they are left allocated rather than freed under the communicator.
    if (session_ && session_open_) detail::keep_until_exit(session_);
  }

  bool is_server() const { return comm_.rank() < options_.num_servers; }
  bool is_worker() const { return !is_server(); }
  int num_servers() const { return options_.num_servers; }
  int num_workers() const { return comm_.size() - options_.num_servers; }
  int server_index() const { return comm_.rank(); }                       // on a server
  int worker_index() const { return comm_.rank() - options_.num_servers; }  // on a worker
  const ParameterServerOptions& options() const { return options_; }

  // Server: the parameters of this server's shard, to build its optimizer on.
  NamedTensors<E>& server_parameters() {
    TESSERA_CHECK(is_server(), Error, "ParameterServer::server_parameters on rank ", comm_.rank(),
                  ", which is a worker");
    return server_named_;
  }
  // Which server holds parameter i of the model (in visiting order).
  int server_of(std::size_t parameter) const { return owner_[parameter]; }

  // ---- worker side ----

  // Opens a session: fetches every shard into the model (blocking).
  void pull() {
    require_worker("pull");
    post_replies();
    for (int s = 0; s < num_servers(); ++s) send_header(s, kPull);
    receive_parameters();
  }

  // Pushes the model's gradients, then waits for fresh parameters (which, under a staleness
  // bound, may mean waiting for slower workers). Returns false when the servers' budget is spent:
  // the parameters are fresh, and the worker should call done().
  bool push_pull() {
    require_worker("push_pull");
    post_replies();  // before sending: no send ever waits on a receive that is not posted yet
    const auto pushing = SpanSink::Clock::now();
    for (int s = 0; s < num_servers(); ++s) {
      send_header(s, kPush);
      pack(s, Which::Grad);
      comm_.send(std::span<const S>(staging_.data(), static_cast<std::size_t>(shard_sizes_[s])), s);
    }
    ++clock_;
    const auto pulling = SpanSink::Clock::now();
    const bool go_on = receive_parameters();
    if (options_.timeline) {
      const auto elements = std::accumulate(shard_sizes_.begin(), shard_sizes_.end(), std::int64_t{0});
      const std::string kib = std::to_string(static_cast<std::size_t>(elements) * sizeof(S) / 1024) + " KiB";
      options_.timeline->add("push gradients, " + kib, "communication", pushing, pulling, SpanSink::kCommunication);
      options_.timeline->add("pull parameters, " + kib + " (waits while the servers hold it back)", "communication",
                             pulling, SpanSink::Clock::now(), SpanSink::kCommunication);
    }
    return go_on;
  }

  // Records later pushes and pulls (a worker) or updates (a server) into `timeline`; nullptr stops.
  void set_timeline(SpanSink* timeline) { options_.timeline = timeline; }

  // Leaves the session.
  void done() {
    require_worker("done");
    for (int s = 0; s < num_servers(); ++s) send_header(s, kDone);
    clock_ = 0;
  }

  // Steps this worker has pushed in the current session, and the parameter versions it last read.
  std::int64_t clock() const { return clock_; }

  // ---- server side ----

  // Serves workers until every one has called done(); stops them once max_gradients have arrived.
  template <class Optimizer>
  ServeResult serve(Optimizer& optimizer, std::int64_t max_gradients = kNoBudget) {
    TESSERA_CHECK(is_server(), Error, "ParameterServer::serve on rank ", comm_.rank(), ", which is a worker");
    TESSERA_CHECK(max_gradients > 0, ArgumentError, "ParameterServer::serve: max_gradients=", max_gradients,
                  " must be positive");
    session_ = std::make_shared<Session>(static_cast<std::size_t>(num_workers()));
    session_open_ = true;
    budget_ = max_gradients;
    gradients_ = 0;
    ServeResult result;
    Session& ss = *session_;
    // Every worker takes part in every session, from its start: a round (BSP) or the slowest
    // clock (SSP) counts a worker that has not pulled yet, so an early worker cannot run alone.
    for (int w = 0; w < num_workers(); ++w) {
      workers_[static_cast<std::size_t>(w)] = WorkerState{};
      workers_[static_cast<std::size_t>(w)].active = true;
      post_header(w);
    }
    int active = num_workers();
    auto backoff = std::chrono::microseconds(1);
    // A busy server still looks at the silent workers: when one worker keeps the server busy
    // (asynchronous SGD), the loop never idles, and a check only on idle turns would never see
    // the stopped one. A check at an interval far below the stall threshold costs one clock read
    // per turn.
    auto next_timeout_check = Clock::now();
    while (active > 0) {
      bool progressed = false;
      for (int w = 0; w < num_workers(); ++w) {
        WorkerState& ws = workers_[static_cast<std::size_t>(w)];
        Inbox& in = ss.inbox[static_cast<std::size_t>(w)];
        if (!in.posted || !in.header_work.is_completed()) continue;
        in.header_work.wait();  // rethrows the communicator's error, naming the peer
        in.posted = false;
        progressed = true;
        ws.last_heard = Clock::now();
        ws.warned = false;
        const std::int64_t kind = in.header[0];
        if (kind == kPull) {
          ws.joined = true;
          ws.waiting = true;
          post_header(w);
        } else if (kind == kPush) {
          receive_gradient(w, optimizer, result);
          post_header(w);
        } else if (kind == kDone) {
          ws.active = false;
          ws.waiting = false;
          --active;
        } else {
          throw CommError(detail::cat("ParameterServer server ", server_index(), ": unknown message kind ", kind,
                                      " from rank ", worker_rank(w), " (ranks running different programs?)"));
        }
      }
      if (synchronous()) progressed |= apply_round_if_complete(optimizer, result);
      progressed |= release_waiting_workers();
      if (progressed) {
        backoff = std::chrono::microseconds(1);
        if (Clock::now() >= next_timeout_check) {
          check_worker_timeouts();
          next_timeout_check = Clock::now() + std::chrono::milliseconds(50);
        }
        continue;
      }
      check_worker_timeouts();
      next_timeout_check = Clock::now() + std::chrono::milliseconds(50);
      // Nothing arrived: back off from spinning (the workers need the cores), up to 200 us.
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(200));
    }
    for (auto& in : ss.inbox) {
      in.reply_header_work.wait();
      in.reply_work.wait();
    }
    session_open_ = false;
    return result;
  }

  // Server: this server's record of applied-gradient staleness (all sessions).
  const StalenessStats& staleness() const { return staleness_; }
  // Server: optimizer updates applied so far (the parameters' version).
  std::int64_t version() const { return version_; }

  // ---- both ----

  // Collective: every rank's model gets the servers' current parameters (each server broadcasts
  // its shard), and the workers' buffers (BatchNorm running statistics) are averaged over the
  // workers. Call on every rank after the session.
  void gather_parameters() {
    for (std::size_t i = 0; i < named_.parameters.size(); ++i) {
      Tensor<S, D>& v = named_.parameters[i].second->value;
      comm_.broadcast(std::span<S>(v.data(), static_cast<std::size_t>(v.numel())), owner_[i]);
    }
    for (auto& [name, t] : named_.buffers) {
      if (is_server()) t->zero();
      comm_.all_reduce(std::span<S>(t->data(), static_cast<std::size_t>(t->numel())), ReduceOp::Sum);
      scale_(*t, S(1) / static_cast<S>(num_workers()));
    }
  }

  // Collective: server 0's staleness record on every rank (every server sees every gradient).
  StalenessStats gather_staleness() {
    std::vector<std::int64_t> flat(3 + StalenessStats::kHistogramSize, 0);
    if (comm_.rank() == 0) {
      flat[0] = staleness_.applied;
      flat[1] = staleness_.sum;
      flat[2] = staleness_.max;
      std::copy(staleness_.histogram.begin(), staleness_.histogram.end(), flat.begin() + 3);
    }
    comm_.broadcast(std::span<std::int64_t>(flat), 0);
    StalenessStats out;
    out.applied = flat[0];
    out.sum = flat[1];
    out.max = flat[2];
    std::copy(flat.begin() + 3, flat.end(), out.histogram.begin());
    return out;
  }

  // Checkpoint visitor: a server's shard under the model's names, its version and staleness record.
  template <class V>
  void visit(V& v, const std::string& prefix) {
    if (!is_server()) return;
    for (auto& [name, p] : server_named_.parameters) v.parameter(prefix + name, *p);
    v.integer(prefix + "ps.version", version_);
    v.integer(prefix + "ps.staleness.applied", staleness_.applied);
    v.integer(prefix + "ps.staleness.sum", staleness_.sum);
    v.integer(prefix + "ps.staleness.max", staleness_.max);
    for (int k = 0; k < StalenessStats::kHistogramSize; ++k)
      v.integer(prefix + "ps.staleness.histogram." + std::to_string(k),
                staleness_.histogram[static_cast<std::size_t>(k)]);
  }
  void set_mode(Mode) {}

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr std::int64_t kPull = 1, kPush = 2, kDone = 3;
  enum class Which { Value, Grad };

  struct WorkerState {
    bool active = false;   // in the session (not done)
    bool joined = false;   // has pulled
    bool waiting = false;  // owed a reply
    std::int64_t clock = 0;
    std::int64_t read_version = 0;
    Clock::time_point last_heard = Clock::now();
    bool warned = false;  // the stall warning was printed for the current silence
    std::vector<S> pending;  // BSP: this clock's gradient, until the round is complete
    bool has_pending = false;
  };
  // Buffers the communicator may write into or read from asynchronously.
  struct Inbox {
    std::array<std::int64_t, 4> header{};
    bool posted = false;
    Work header_work;
    std::array<std::int64_t, 4> reply_header{};
    std::vector<S> reply;
    Work reply_header_work, reply_work;
  };
  struct Reply {  // a worker's posted receive of one server's reply
    std::array<std::int64_t, 4> header{};
    std::vector<S> values;
    Work header_work, values_work;
  };
  struct Session {
    explicit Session(std::size_t workers) : inbox(workers) {}
    std::vector<Inbox> inbox;
  };

  bool synchronous() const { return options_.staleness_bound == 0; }
  int worker_rank(int w) const { return w + options_.num_servers; }

  void require_worker(const char* what) const {
    TESSERA_CHECK(is_worker(), Error, "ParameterServer::", what, " on rank ", comm_.rank(),
                  ", which is a server (ranks below num_servers serve)");
  }

  // Every rank must run with the same settings and model: compare a small fingerprint.
  void check_same_settings() {
    // FNV-1a over every parameter's shape, unsigned: it wraps by design (signed overflow is UB).
    std::uint64_t shapes = 1469598103934665603ULL;
    for (auto& [name, p] : named_.parameters)
      for (std::int64_t d : p->value.shape()) shapes = (shapes ^ static_cast<std::uint64_t>(d)) * 1099511628211ULL;
    std::vector<std::int64_t> mine = {options_.num_servers, options_.staleness_bound,
                                      static_cast<std::int64_t>(named_.parameters.size()),
                                      static_cast<std::int64_t>(shapes & 0x7fffffffffffULL)};
    std::vector<std::int64_t> lo = mine, hi = mine;
    comm_.all_reduce(std::span<std::int64_t>(lo), ReduceOp::Min);
    comm_.all_reduce(std::span<std::int64_t>(hi), ReduceOp::Max);
    const char* what[] = {"num_servers", "staleness_bound", "parameter count", "parameter shapes"};
    for (std::size_t i = 0; i < mine.size(); ++i)
      TESSERA_CHECK(lo[i] == hi[i], ArgumentError, "ParameterServer on rank ", comm_.rank(),
                    ": ranks were launched with different settings: ", what[i], " differs (this rank ", mine[i],
                    ", others between ", lo[i], " and ", hi[i], ")");
  }

  // Whole tensors to servers, largest first onto the least-loaded server (balanced bytes).
  void assign_shards() {
    const std::size_t n = named_.parameters.size();
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return named_.parameters[a].second->value.numel() > named_.parameters[b].second->value.numel();
    });
    owner_.assign(n, 0);
    shard_sizes_.assign(static_cast<std::size_t>(num_servers()), 0);
    for (std::size_t i : order) {
      const int s = static_cast<int>(std::min_element(shard_sizes_.begin(), shard_sizes_.end()) - shard_sizes_.begin());
      owner_[i] = s;
      shard_sizes_[static_cast<std::size_t>(s)] += named_.parameters[i].second->value.numel();
    }
    shard_params_.assign(static_cast<std::size_t>(num_servers()), {});
    for (std::size_t i = 0; i < n; ++i) shard_params_[static_cast<std::size_t>(owner_[i])].push_back(i);
  }

  // Shard s of the model's values or gradients into staging_ (host), in visiting order, and back.
  void pack(int s, Which which) {
    std::size_t offset = 0;
    for (std::size_t i : shard_params_[static_cast<std::size_t>(s)]) {
      const Parameter<S, D>& p = *named_.parameters[i].second;
      const Tensor<S, D>& t = which == Which::Grad ? p.grad : p.value;
      D::copy_to_host(staging_.data() + offset, t.data(), t.bytes());
      offset += static_cast<std::size_t>(t.numel());
    }
  }
  void unpack_values(int s, const S* from) {
    std::size_t offset = 0;
    for (std::size_t i : shard_params_[static_cast<std::size_t>(s)]) {
      Tensor<S, D>& t = named_.parameters[i].second->value;
      D::copy_to_device(t.data(), from + offset, t.bytes());
      offset += static_cast<std::size_t>(t.numel());
    }
  }

  void send_header(int server, std::int64_t kind) {
    const std::array<std::int64_t, 4> header = {kind, read_version_.empty() ? 0 : read_version_[server], clock_, 0};
    comm_.send(std::span<const std::int64_t>(header), server);
  }

  // Worker: posts the receives of every server's reply (header, then its shard).
  void post_replies() {
    replies_.resize(static_cast<std::size_t>(num_servers()));
    for (int s = 0; s < num_servers(); ++s) {
      Reply& r = replies_[static_cast<std::size_t>(s)];
      r.values.resize(static_cast<std::size_t>(shard_sizes_[static_cast<std::size_t>(s)]));
      r.header_work = comm_.recv_async(std::span<std::int64_t>(r.header), s);
      r.values_work = comm_.recv_async(std::span<S>(r.values), s);
    }
  }

  // Worker: waits for every server's reply; returns false when any server says stop.
  bool receive_parameters() {
    read_version_.resize(static_cast<std::size_t>(num_servers()));
    bool stop = false;
    for (int s = 0; s < num_servers(); ++s) {
      Reply& r = replies_[static_cast<std::size_t>(s)];
      r.header_work.wait();
      r.values_work.wait();
      unpack_values(s, r.values.data());
      read_version_[static_cast<std::size_t>(s)] = r.header[0];
      stop |= r.header[1] != 0;
    }
    return !stop;
  }

  void post_header(int w) {
    Inbox& in = session_->inbox[static_cast<std::size_t>(w)];
    in.header_work = comm_.recv_async(std::span<std::int64_t>(in.header), worker_rank(w));
    in.posted = true;
  }

  template <class Optimizer>
  void receive_gradient(int w, Optimizer& optimizer, ServeResult& result) {
    WorkerState& ws = workers_[static_cast<std::size_t>(w)];
    const Inbox& in = session_->inbox[static_cast<std::size_t>(w)];
    TESSERA_CHECK(ws.joined, CommError, "ParameterServer server ", server_index(), ": rank ", worker_rank(w),
                  " pushed a gradient before pull() opened its session");
    const std::size_t n = staging_.size();
    ws.read_version = in.header[1];
    ++ws.clock;
    ++result.gradients;
    ++gradients_;
    ws.waiting = true;
    if (synchronous()) {
      ws.pending.resize(n);
      receive_payload(w, std::span<S>(ws.pending.data(), n));
      ws.has_pending = true;
      return;
    }
    receive_payload(w, std::span<S>(staging_.data(), n));
    const std::int64_t staleness = version_ - ws.read_version;
    staleness_.record(staleness);
    const S scale = S(1) / static_cast<S>(num_workers());
    for (S& g : staging_) g *= scale;
    const auto began = SpanSink::Clock::now();
    apply(optimizer, staging_.data());
    if (options_.timeline)
      options_.timeline->add("apply rank " + std::to_string(worker_rank(w)) + "'s gradient, staleness " +
                                 std::to_string(staleness),
                             "compute", began, SpanSink::Clock::now(), SpanSink::kCompute);
    ++result.updates;
  }

  // BSP: once every active worker has pushed this clock, average in worker order and step.
  template <class Optimizer>
  bool apply_round_if_complete(Optimizer& optimizer, ServeResult& result) {
    int arrived = 0;
    for (const WorkerState& ws : workers_) {
      if (!ws.active) continue;
      if (!ws.has_pending) return false;
      ++arrived;
    }
    if (arrived == 0) return false;
    std::fill(staging_.begin(), staging_.end(), S(0));
    for (WorkerState& ws : workers_) {
      if (!ws.active) continue;
      for (std::size_t i = 0; i < staging_.size(); ++i) staging_[i] += ws.pending[i];
      ws.has_pending = false;
      staleness_.record(0);
    }
    for (S& g : staging_) g /= static_cast<S>(arrived);
    const auto began = SpanSink::Clock::now();
    apply(optimizer, staging_.data());
    if (options_.timeline)
      options_.timeline->add("apply the round's mean of " + std::to_string(arrived) + " gradients", "compute", began,
                             SpanSink::Clock::now(), SpanSink::kCompute);
    ++result.updates;
    return true;
  }

  template <class Optimizer>
  void apply(Optimizer& optimizer, const S* gradient) {
    std::size_t offset = 0;
    for (auto& [name, p] : server_named_.parameters) {
      D::copy_to_device(p->grad.data(), gradient + offset, p->grad.bytes());
      offset += static_cast<std::size_t>(p->grad.numel());
    }
    optimizer.step();
    ++version_;
  }

  // Replies to every waiting worker the staleness bound lets go: BSP after its round was applied
  // (has_pending cleared), SSP when at most s clocks ahead of the slowest active worker.
  bool release_waiting_workers() {
    std::int64_t slowest = std::numeric_limits<std::int64_t>::max();
    for (const WorkerState& ws : workers_)
      if (ws.active) slowest = std::min(slowest, ws.clock);
    bool released = false;
    for (int w = 0; w < num_workers(); ++w) {
      WorkerState& ws = workers_[static_cast<std::size_t>(w)];
      if (!ws.waiting) continue;
      if (synchronous() && ws.has_pending) continue;
      if (options_.staleness_bound > 0 && ws.clock - slowest > options_.staleness_bound) continue;
      reply(w);
      ws.waiting = false;
      ws.last_heard = Clock::now();
      ws.warned = false;
      released = true;
    }
    return released;
  }

  void reply(int w) {
    Inbox& in = session_->inbox[static_cast<std::size_t>(w)];
    in.reply_header_work.wait();  // the previous reply to this worker has been taken
    in.reply_work.wait();
    in.reply_header = {version_, gradients_ >= budget_ ? 1 : 0, 0, 0};
    in.reply.resize(staging_.size());
    std::size_t offset = 0;
    for (auto& [name, p] : server_named_.parameters) {
      D::copy_to_host(in.reply.data() + offset, p->value.data(), p->value.bytes());
      offset += static_cast<std::size_t>(p->value.numel());
    }
    // Both asynchronous: a server never blocks on one worker while others wait for it.
    in.reply_header_work = comm_.send_async(std::span<const std::int64_t>(in.reply_header), worker_rank(w));
    in.reply_work = comm_.send_async(std::span<const S>(in.reply.data(), in.reply.size()), worker_rank(w));
  }

  void check_worker_timeouts() {
    for (int w = 0; w < num_workers(); ++w) {
      const WorkerState& ws = workers_[static_cast<std::size_t>(w)];
      if (ws.waiting || !session_->inbox[static_cast<std::size_t>(w)].posted) continue;
      check_silence(w);
    }
  }

  // Worker w has sent nothing since ws.last_heard: not silent until the timeout, a warning at the
  // communicators' stall threshold (never later than half the worker timeout) names the worker,
  // as a stalled collective's does; at worker_timeout it is declared dead (CommError).
  void check_silence(int w) {
    WorkerState& ws = workers_[static_cast<std::size_t>(w)];
    const auto warn_after = std::min(CommOptions{.timeout = options_.worker_timeout}.effective_stall_warning(),
                                     options_.worker_timeout / 2);
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - ws.last_heard);
    TESSERA_CHECK(silent < options_.worker_timeout, CommError, "ParameterServer server ", server_index(),
                  ": worker rank ", worker_rank(w), " sent nothing for ", silent.count() / 1000.0,
                  " s (worker_timeout ", options_.worker_timeout.count() / 1000.0, " s): dead or hung");
    if (!ws.warned && silent >= warn_after) {
      ws.warned = true;
      std::fprintf(stderr,
                   "warning: ParameterServer server %d: worker rank %d has sent nothing for %.1f s (stopped, "
                   "hung or slow; declared dead at worker_timeout %.1f s)\n",
                   server_index(), worker_rank(w), static_cast<double>(silent.count()) / 1000.0,
                   static_cast<double>(options_.worker_timeout.count()) / 1000.0);
      std::fflush(stderr);
    }
  }

  // A worker's values after their header, received asynchronously and watched like a silent
  // worker: a worker stopped between the two (SIGSTOP; or a busy-polling transport, which sends
  // only while its process runs) is warned about and declared dead on time, where a blocking
  // receive would hold the server, and with it every other worker, until the transport's timeout.
  void receive_payload(int w, std::span<S> out) {
    Work work = comm_.recv_async(out, worker_rank(w));
    auto backoff = std::chrono::microseconds(1);
    while (!work.is_completed()) {
      check_silence(w);
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(200));
    }
    work.wait();  // rethrows the communicator's error, naming the peer
    WorkerState& ws = workers_[static_cast<std::size_t>(w)];
    ws.last_heard = Clock::now();
    ws.warned = false;
  }

  static void scale_(Tensor<S, D>& t, S factor) {
    if constexpr (D::host_accessible) {
      for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] *= factor;
    } else {
      Tensor<S, Cpu> h = to_host(t);
      for (std::int64_t i = 0; i < h.numel(); ++i) h.data()[i] *= factor;
      t = to_device<D>(h);
    }
  }

  Comm& comm_;
  ParameterServerOptions options_;
  NamedTensors<E> named_;
  NamedTensors<E> server_named_;
  std::vector<int> owner_;                               // parameter index -> server
  std::vector<std::int64_t> shard_sizes_;                // elements per server
  std::vector<std::vector<std::size_t>> shard_params_;  // server -> parameter indices
  std::vector<S> staging_;                               // host copy of one shard
  // worker
  std::int64_t clock_ = 0;
  std::vector<std::int64_t> read_version_;
  std::vector<Reply> replies_;
  // server
  std::vector<WorkerState> workers_;
  std::shared_ptr<Session> session_;
  bool session_open_ = false;
  std::int64_t version_ = 0;
  std::int64_t gradients_ = 0;
  std::int64_t budget_ = kNoBudget;
  StalenessStats staleness_;
};

template <class Model, class C>
ParameterServer(Model&, C&, ParameterServerOptions = {}) -> ParameterServer<typename Model::Env>;

}  // namespace tessera
