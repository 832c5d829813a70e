// CommCore: the per-call protocol every communicator shares, written once. A backend's handle
// owns one and keeps only what is its own: moving bytes through its library, its rendezvous, its
// split (docs/adding-a-communicator.md, "The core").
//
// What the core holds: the backend's display name ("MpiComm"), rank, size and CommOptions, the
// call ledger (comm/call_check.hpp), the progress board (comm/monitor.hpp) and the broken state
// (the first failure's text). What it does:
//
//   check_root / check_peer / check_all_gather / check_reduce_scatter / count_as_int /
//   check_split_color
//       argument checks, one wording for every backend; they throw (CommError, ArgumentError for
//       the color) and do not break the communicator (nothing has moved yet)
//   enter(sig) -> call number; check_call(sig, gather); begin(sig, gather) = both; finish()
//       the usable check, the board, the ledger and the agreement check, whose exchange is the
//       backend's fixed-size all_gather of int64
//   check_usable(what), fail(what, reason), mark_broken(text), on_broken(hook)
//       the broken state: the first failure is kept and every later call throws "unusable after
//       an earlier error: <first failure>"; the hook runs once, for what the backend must do
//       beyond this communicator (MPI: the whole job is failed; NCCL: abort the communicator)
//   wait(what, call, poll)
//       the wait loop: polls until done, warns once at the stall warning and fails at the timeout
//       with the stall report (which ranks reached call #n)
//   guard(what, call, fn, explain)
//       runs a library call that throws, turning its exception into the core's error text
//   text(what, reason, context)
//       "<Backend> <what> on rank R of N (<context>): <reason>", the shape of every error
//
// Cost on the hot path: check_usable is one atomic load, enter/finish a few relaxed stores,
// record a few multiplications; nothing is formatted or allocated unless a call fails.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/monitor.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/core/linkage.hpp"  // non-template functions: defined at the end (inline) or once in tessera_kernels

namespace tessera::detail {

// The signature of a collective on T elements (count: the per-rank input).
template <CommScalar T>
CallSignature signature_of(CollectiveKind kind, std::size_t count, std::int64_t extra = 0) {
  return {kind, comm_dtype_of<T>, static_cast<std::int64_t>(count), extra};
}

// A point-to-point operation, described only when an error needs it: "send(float32 x 4) to rank 1".
struct PeerCall {
  bool is_send = true;
  CommDType dtype = CommDType::F32;
  std::int64_t count = 0;
  int peer = 0;

  template <CommScalar T>
  static PeerCall send(std::size_t n, int peer) {
    return {true, comm_dtype_of<T>, static_cast<std::int64_t>(n), peer};
  }
  template <CommScalar T>
  static PeerCall recv(std::size_t n, int peer) {
    return {false, comm_dtype_of<T>, static_cast<std::int64_t>(n), peer};
  }
  std::string describe() const;
};
inline std::string describe(const PeerCall& what) { return what.describe(); }
inline std::string describe(const char* what) { return what; }
inline std::string describe(std::string_view what) { return std::string(what); }

// The first failure of a communicator, shared where several handles form one communicator
// (ThreadComm: every rank's handle of a group sees the group broken).
struct BrokenState {
  std::atomic<bool> broken{false};
  std::mutex mutex;
  std::string reason;
};

class CommCore {
 public:
  CommCore() = default;
  CommCore(const char* backend, int rank, int size, CommOptions options,
           std::shared_ptr<BrokenState> broken = nullptr);

  const char* backend() const { return backend_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommOptions& options() const { return options_; }
  const std::shared_ptr<ProgressBoard>& board() const { return board_; }
  const std::string& label() const { return board_->label; }

  // Publishes this communicator's progress to its peers (comm/monitor.hpp): starts the process's
  // status server and swaps addresses through `all_gather_int64`, a blocking all_gather of int64
  // on the new communicator. Without it the board is local and stall reports are empty (what a
  // backend whose ranks are threads of one process wants).
  template <class Gather>
  void connect_monitor(std::string label, Gather&& all_gather_int64) {
    board_ = make_progress_board(backend_, std::move(label), rank_, size_, std::forward<Gather>(all_gather_int64));
  }

  // What the backend must do when the communicator breaks, beyond this communicator (called
  // once, with the first failure's text, from whichever thread failed).
  void on_broken(std::function<void(const std::string&)> hook) { on_broken_ = std::move(hook); }

  // ---- error text

  // "<Backend> <what> on rank R of N[ (<context>)]"
  template <class What>
  std::string head(const What& what, std::string_view context = {}) const {
    std::string out = cat(backend_, " ", describe(what), " on rank ", rank_, " of ", size_);
    if (!context.empty()) out += cat(" (", context, ")");
    return out;
  }
  // "<Backend> <what> on rank R of N[ (<context>)]: <reason>"
  template <class What>
  std::string text(const What& what, std::string_view reason, std::string_view context = {}) const {
    return head(what, context) + cat(": ", reason);
  }
  static std::string call_context(std::int64_t call);

  // "; reached call #n: ranks 0, 2; not reached: rank 1 (...)", or "" without peers to ask.
  std::string stall_suffix(std::int64_t call, const CallSignature& sig) const;
  // The same for the call this rank entered last (for errors raised where the call is not known).
  std::string stall_suffix_of_last() const;

  // ---- argument checks: CommError, the communicator stays usable

  void check_root(int root, std::string_view op = "broadcast") const;
  // self_allowed: the library can send to its own rank (NCCL); otherwise that is an error.
  void check_peer(int peer, std::string_view op, bool self_allowed = false) const;
  void check_all_gather(std::size_t in_count, std::size_t out_count) const;
  void check_reduce_scatter(std::size_t in_count, std::size_t out_count) const;
  // split's color: ArgumentError, as MPI_UNDEFINED (a negative color) is not supported.
  void check_split_color(int color) const;
  // For libraries that count elements in an int (MPI).
  template <class What>
  int count_as_int(std::size_t n, const What& what, std::string_view library) const {
    if (n <= static_cast<std::size_t>(INT32_MAX)) [[likely]]
      return static_cast<int>(n);
    throw CommError(text(what, cat(n, " elements exceed ", library, "'s int count (", INT32_MAX, "); split the buffer")));
  }

  // ---- the broken state

  bool broken() const { return broken_->broken.load(std::memory_order_acquire); }
  template <class What>
  void check_usable(const What& what) const {
    if (!broken()) [[likely]]
      return;
    std::string reason;
    {
      std::lock_guard lock(broken_->mutex);
      reason = broken_->reason;
    }
    throw CommError(text(what, "communicator is unusable after an earlier error: " + reason));
  }
  // Remembers the first failure (later ones are consequences), marks the board failed and runs
  // the backend's hook once. Returns the text to throw.
  std::string mark_broken(std::string text);
  template <class What>
  [[noreturn]] void fail(const What& what, std::string_view reason, std::string_view context = {}) {
    throw CommError(mark_broken(text(what, reason, context)));
  }

  // ---- one call

  // Checks that the communicator is usable and publishes the call; returns its number (1-based),
  // as peers' stall reports count it.
  std::int64_t enter(const CallSignature& sig) {
    check_usable(sig);
    return board_->enter(sig);
  }
  // The agreement check (comm/call_check.hpp) on the calls the ledger picks, through the
  // backend's blocking fixed-size all_gather of int64 (it cannot itself mismatch). A mismatch
  // throws the same text on every rank and breaks the communicator.
  template <class Gather>
  void check_call(const CallSignature& sig, Gather&& all_gather_int64) {
    if (!ledger_.record(sig) || size_ == 1) [[likely]]
      return;
    try {
      run_call_check(ledger_, backend_, rank_, size_, std::forward<Gather>(all_gather_int64));
    } catch (const CommError& e) {
      mark_broken(e.what());
      throw;
    }
  }
  template <class Gather>
  std::int64_t begin(const CallSignature& sig, Gather&& all_gather_int64) {
    const std::int64_t call = enter(sig);
    check_call(sig, std::forward<Gather>(all_gather_int64));
    return call;
  }
  void finish() { board_->finish(); }

  // Watches a call that cannot be interrupted (a blocking library call) for its scope: a warning
  // with the stall report at the stall warning, and on_timeout (MPI: report and abort the job)
  // at the timeout if given.
  [[nodiscard]] WatchedCall watch(std::int64_t call, const CallSignature& sig,
                                  void (*on_timeout)(const std::string&, int) = nullptr) const;

  // Polls until poll() returns true (poll may throw, e.g. through fail()). Spins briefly, then
  // yields the core between polls (ranks may outnumber cores). Warns once on stderr at the stall
  // warning; at the timeout the communicator breaks with "timed out after T (<cause>)<consequence>"
  // and, for a collective (call > 0, What a CallSignature or CallCheckOf), the stall report.
  // The deadline counts from the start of the wait.
  template <class What, class Poll>
  void wait(const What& what, std::int64_t call, Poll&& poll, std::string_view consequence = {},
            std::string_view cause = "a peer is dead, stalled, or did not make the same call") {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + options_.timeout;
    const auto warn_at = start + options_.effective_stall_warning();
    bool warned = false;
    for (int spins = 0; !poll(); ++spins) {
      if (spins > 64) std::this_thread::yield();
      if ((spins & 255) != 0) continue;
      const auto now = std::chrono::steady_clock::now();
      if (!warned && now >= warn_at && now < deadline) {
        warned = true;
        std::fprintf(stderr, "tessera: warning: %s has waited %s (timeout %s)%s\n",
                     head(what, call_context(call)).c_str(),
                     seconds_text(options_.effective_stall_warning()).c_str(), seconds_text(options_.timeout).c_str(),
                     report_for(what, call).c_str());
        std::fflush(stderr);
      }
      if (now >= deadline)
        fail(what, cat("timed out after ", seconds_text(options_.timeout), " (", cause, ")", consequence,
                       report_for(what, call)),
             call_context(call));
    }
  }

  // Runs fn, a library call that reports failure by throwing; its exception becomes CommError
  // "<head>: <explain(e)>" and breaks the communicator. explain turns the library's exception into
  // the reason (default: its what()).
  template <class What, class Fn>
  void guard(const What& what, std::int64_t call, Fn&& fn) {
    guard(what, call, std::forward<Fn>(fn), [](const std::exception& e) { return std::string(e.what()); });
  }
  template <class What, class Fn, class Explain>
  void guard(const What& what, std::int64_t call, Fn&& fn, Explain&& explain) {
    check_usable(what);
    try {
      std::forward<Fn>(fn)();
    } catch (const std::exception& e) {
      fail(what, explain(e), call_context(call));
    }
  }

 private:
  template <class What>
  std::string report_for(const What& what, std::int64_t call) const {
    if constexpr (std::is_same_v<What, CallSignature>) return stall_suffix(call, what);
    else if constexpr (std::is_same_v<What, CallCheckOf>) return stall_suffix(call, what.call);
    else return "";
  }

  const char* backend_ = "";
  int rank_ = 0, size_ = 1;
  CommOptions options_;
  CallLedger ledger_{options_.check_first, options_.effective_check_every()};
  std::shared_ptr<ProgressBoard> board_ = std::make_shared<ProgressBoard>();
  std::shared_ptr<BrokenState> broken_ = std::make_shared<BrokenState>();
  std::function<void(const std::string&)> on_broken_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::string PeerCall::describe() const {
  return cat(is_send ? "send(" : "recv(", to_string(dtype), " x ", count, is_send ? ") to rank " : ") from rank ", peer);
}

TESSERA_LINKAGE CommCore::CommCore(const char* backend, int rank, int size, CommOptions options,
                                   std::shared_ptr<BrokenState> broken)
    : backend_(backend),
      rank_(rank),
      size_(size),
      options_(options),
      ledger_(options.check_first, options.effective_check_every()),
      board_(std::make_shared<ProgressBoard>()),
      broken_(broken ? std::move(broken) : std::make_shared<BrokenState>()) {
  board_->backend = backend;
  board_->rank = rank;
  board_->size = size;
}

TESSERA_LINKAGE std::string CommCore::call_context(std::int64_t call) {
  return call > 0 ? cat("call #", call) : std::string();
}

TESSERA_LINKAGE std::string CommCore::stall_suffix(std::int64_t call, const CallSignature& sig) const {
  if (call <= 0 || !board_ || size_ == 1) return "";
  const std::string report = stall_report(*board_, call, sig);
  return report.empty() ? report : "; " + report;
}

TESSERA_LINKAGE std::string CommCore::stall_suffix_of_last() const {
  if (!board_) return "";
  std::int64_t sig[4];
  for (int i = 0; i < 4; ++i) sig[i] = board_->last[i].load(std::memory_order_relaxed);
  return stall_suffix(board_->entered.load(std::memory_order_relaxed), CallSignature::decode(sig));
}

TESSERA_LINKAGE void CommCore::check_root(int root, std::string_view op) const {
  if (root >= 0 && root < size_) [[likely]]
    return;
  throw CommError(text(op, cat("root ", root, " is out of range [0, ", size_, ")")));
}

TESSERA_LINKAGE void CommCore::check_peer(int peer, std::string_view op, bool self_allowed) const {
  if (peer >= 0 && peer < size_ && (self_allowed || peer != rank_)) [[likely]]
    return;
  if (peer == rank_) throw CommError(text(op, cat("peer ", peer, " is this rank: a rank cannot ", op, " to itself")));
  throw CommError(text(op, cat("peer ", peer, " is out of range [0, ", size_, ")")));
}

TESSERA_LINKAGE void CommCore::check_all_gather(std::size_t in_count, std::size_t out_count) const {
  if (out_count == in_count * static_cast<std::size_t>(size_)) [[likely]]
    return;
  throw CommError(text("all_gather", cat("output has ", out_count, " elements, expected ", size_, " x ", in_count,
                                         " (size x input)")));
}

TESSERA_LINKAGE void CommCore::check_reduce_scatter(std::size_t in_count, std::size_t out_count) const {
  if (in_count == out_count * static_cast<std::size_t>(size_)) [[likely]]
    return;
  throw CommError(text("reduce_scatter", cat("input has ", in_count, " elements, expected ", size_, " x ",
                                             out_count, " (size x output)")));
}

TESSERA_LINKAGE void CommCore::check_split_color(int color) const {
  if (color >= 0) [[likely]]
    return;
  throw ArgumentError(text("split", cat("color ", color, " must be >= 0")));
}

TESSERA_LINKAGE std::string CommCore::mark_broken(std::string text) {
  bool first = false;
  {
    std::lock_guard lock(broken_->mutex);
    if (!broken_->broken.load(std::memory_order_relaxed)) {
      broken_->reason = text;
      broken_->broken.store(true, std::memory_order_release);
      first = true;
    }
  }
  mark_board_failed(board_);
  if (first && on_broken_) on_broken_(text);
  return text;
}

TESSERA_LINKAGE WatchedCall CommCore::watch(std::int64_t call, const CallSignature& sig,
                                            void (*on_timeout)(const std::string&, int)) const {
  return WatchedCall({board_, call, sig, backend_, rank_, size_, options_.timeout, options_.effective_stall_warning(),
                      on_timeout});
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera::detail
