// Agreement check of collective calls: every rank shares what it is about to call (which
// collective, element type, count, root or op) through the backend's own all_gather of fixed
// size, which cannot mismatch, and throws on every rank if they differ. A mismatch would
// otherwise hang (different collectives), crash inside the backend or silently return wrong
// numbers (different counts, types, ops or roots), far from the bug. On by default (CallLedger:
// the first calls and then a sample, with a running hash so nothing slips through unnoticed);
// TESSERA_COMM_DEBUG=1 or TESSERA_COMM_CHECK_EVERY=1 compares every call.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/linkage.hpp"  // non-template functions: defined at the end (inline) or once in tessera_kernels

namespace tessera::detail {

enum class CollectiveKind : std::int64_t { AllReduce = 1, Broadcast, AllGather, ReduceScatter, Barrier, Split };

std::string_view to_string(CollectiveKind k);

struct CallSignature {
  CollectiveKind kind = CollectiveKind::Barrier;
  CommDType dtype = CommDType::F32;
  std::int64_t count = 0;  // elements of the per-rank input
  std::int64_t extra = 0;  // root for broadcast, ReduceOp for reductions

  std::array<std::int64_t, 4> encode() const {
    return {static_cast<std::int64_t>(kind), static_cast<std::int64_t>(dtype), count, extra};
  }
  static CallSignature decode(const std::int64_t* v) {
    return {static_cast<CollectiveKind>(v[0]), static_cast<CommDType>(v[1]), v[2], v[3]};
  }
  bool operator==(const CallSignature&) const = default;

  std::string describe() const;
};

// Error texts are built only when something failed: describing a call on every call would cost
// about a microsecond, as much as a small shared-memory collective.
inline const std::string& describe(const std::string& what) { return what; }
inline std::string describe(const CallSignature& what) { return what.describe(); }

// The call check's own exchange before `call` (named so in errors, and counted as part of it).
struct CallCheckOf {
  CallSignature call;
};
std::string describe(const CallCheckOf& what);

// all_signatures holds size x 4 int64 gathered from every rank. Throws CommError on this rank
// when any rank's signature differs from rank 0's, listing every rank's call.
void check_signatures(std::string_view backend, int rank, std::span<const std::int64_t> all_signatures);

// CallLedger: the default-on agreement check of the process backends (MPI, Gloo, NCCL).
//
// Every collective is recorded here before it runs: a running 64-bit hash of all signatures so
// far, and the last kWindow signatures. On chosen calls the ranks compare (count, hash) through
// one fixed-size all_gather of 4 int64, which cannot itself mismatch. Which calls are checked
// depends only on the call's index on this communicator, so every rank checks at the same index
// and the check exchange always meets the check exchange of the others, even when the ranks'
// real calls differ. Checked: the first `check_first` calls (a mismatched program nearly always
// shows itself there) and then every `check_every`-th. Because the hash covers every call, a
// mismatch at an unchecked call is still caught at the next checked one; then the ranks exchange
// their windows and the error names the first call where they differ, every rank's version of it.
//
// Cost: the hash is a few multiplications per call; a check is one all_gather of 32 bytes per
// rank. With check_every = 16 that is at most one small collective per 16 (the overhead on a
// 4 KiB all_reduce is measured in bench/collectives.py --check-overhead).
class CallLedger {
 public:
  static constexpr std::int64_t kWindow = 64;

  CallLedger(std::int64_t check_first, std::int64_t check_every)
      : first_(check_first < 0 ? 0 : check_first), every_(check_every < 0 ? 0 : std::min(check_every, kWindow)) {}

  // Records the call; true when the ranks must compare notes before it runs.
  bool record(const CallSignature& sig);

  std::int64_t calls() const { return calls_; }

  // This rank's contribution to the check: [calls, hash, kind, count of the current call].
  std::array<std::int64_t, 4> summary() const;
  static bool summaries_agree(std::span<const std::int64_t> all);

  // The window, oldest first: kWindow x 4 int64 (calls before the first are Barrier with count -1).
  std::vector<std::int64_t> window() const;

  // all_windows: size x window() from every rank. Builds the error every rank throws: the first
  // call (oldest first) where the ranks' signatures differ, with each rank's version.
  std::string mismatch_text(std::string_view backend, int rank, int size,
                            std::span<const std::int64_t> all_windows) const;

 private:
  std::int64_t first_, every_;
  std::int64_t calls_ = 0;
  std::uint64_t hash_ = 0xcbf29ce484222325ull;
  std::array<CallSignature, kWindow> window_{};
};

// The check itself, for a backend that gives a blocking all_gather of int64 (fixed size, so
// it cannot mismatch). Throws the same CommError text on every rank.
template <class Gather>
void run_call_check(const CallLedger& ledger, std::string_view backend, int rank, int size, Gather&& all_gather) {
  const auto mine = ledger.summary();
  std::vector<std::int64_t> all(4 * static_cast<std::size_t>(size));
  all_gather(std::span<const std::int64_t>(mine.data(), 4), std::span<std::int64_t>(all));
  if (CallLedger::summaries_agree(all)) return;
  const auto window = ledger.window();
  std::vector<std::int64_t> windows(window.size() * static_cast<std::size_t>(size));
  all_gather(std::span<const std::int64_t>(window), std::span<std::int64_t>(windows));
  throw CommError(ledger.mismatch_text(backend, rank, size, windows));
}

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::string_view to_string(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce: return "all_reduce";
    case CollectiveKind::Broadcast: return "broadcast";
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::ReduceScatter: return "reduce_scatter";
    case CollectiveKind::Barrier: return "barrier";
    case CollectiveKind::Split: return "split";
  }
  return "?";
}

TESSERA_LINKAGE std::string CallSignature::describe() const {
  std::string text = cat(to_string(kind), "(");
  if (kind == CollectiveKind::Barrier) return text + ")";
  if (kind == CollectiveKind::Split) return text + ")";
  text += cat(to_string(dtype), " x ", count);
  if (kind == CollectiveKind::Broadcast) text += cat(", root ", extra);
  if (kind == CollectiveKind::AllReduce || kind == CollectiveKind::ReduceScatter)
    text += cat(", ", to_string(static_cast<ReduceOp>(extra)));
  return text + ")";
}

TESSERA_LINKAGE std::string describe(const CallCheckOf& what) { return what.call.describe() + " call check"; }

TESSERA_LINKAGE void check_signatures(std::string_view backend, int rank,
                                      std::span<const std::int64_t> all_signatures) {
  const int size = static_cast<int>(all_signatures.size() / 4);
  const CallSignature first = CallSignature::decode(all_signatures.data());
  bool same = true;
  for (int r = 1; r < size; ++r) same = same && CallSignature::decode(all_signatures.data() + 4 * r) == first;
  if (same) return;
  std::string text = cat(backend, " call check on rank ", rank, ": ranks called different collectives:");
  for (int r = 0; r < size; ++r) text += cat("\n  rank ", r, ": ", CallSignature::decode(all_signatures.data() + 4 * r).describe());
  throw CommError(text);
}

TESSERA_LINKAGE bool CallLedger::record(const CallSignature& sig) {
  const std::int64_t index = calls_++;
  window_[static_cast<std::size_t>(index % kWindow)] = sig;
  const auto fields = sig.encode();
  for (std::int64_t v : fields) hash_ = (hash_ ^ static_cast<std::uint64_t>(v)) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
  if (index < first_) return true;
  return every_ > 0 && (index - first_) % every_ == every_ - 1;
}

TESSERA_LINKAGE std::array<std::int64_t, 4> CallLedger::summary() const {
  const CallSignature& last = window_[static_cast<std::size_t>((calls_ - 1) % kWindow)];
  return {calls_, static_cast<std::int64_t>(hash_), static_cast<std::int64_t>(last.kind), last.count};
}

TESSERA_LINKAGE bool CallLedger::summaries_agree(std::span<const std::int64_t> all) {
  for (std::size_t i = 4; i + 4 <= all.size(); i += 4)
    if (all[i] != all[0] || all[i + 1] != all[1]) return false;
  return true;
}

TESSERA_LINKAGE std::vector<std::int64_t> CallLedger::window() const {
  std::vector<std::int64_t> out(static_cast<std::size_t>(4 * kWindow), 0);
  for (std::int64_t i = 0; i < kWindow; ++i) {
    const std::int64_t index = calls_ - kWindow + i;
    CallSignature sig{CollectiveKind::Barrier, CommDType::F32, -1, 0};
    if (index >= 0) sig = window_[static_cast<std::size_t>(index % kWindow)];
    const auto e = sig.encode();
    std::copy(e.begin(), e.end(), out.begin() + 4 * i);
  }
  return out;
}

TESSERA_LINKAGE std::string CallLedger::mismatch_text(std::string_view backend, int rank, int size,
                                                      std::span<const std::int64_t> all_windows) const {
  const std::size_t stride = static_cast<std::size_t>(4 * kWindow);
  std::int64_t at = kWindow - 1;
  for (std::int64_t i = 0; i < kWindow; ++i) {
    bool same = true;
    const CallSignature first = CallSignature::decode(all_windows.data() + 4 * i);
    for (int r = 1; r < size; ++r)
      same = same && CallSignature::decode(all_windows.data() + r * stride + 4 * i) == first;
    if (!same) {
      at = i;
      break;
    }
  }
  const std::int64_t index = calls_ - kWindow + at;  // 0-based call index on this communicator
  std::string text = cat(backend, " call check on rank ", rank, " of ", size,
                         ": ranks called different collectives (call #", index + 1, " on this communicator):");
  for (int r = 0; r < size; ++r)
    text += cat("\n  rank ", r, ": ", CallSignature::decode(all_windows.data() + r * stride + 4 * at).describe());
  if (index + 1 < calls_)
    text += cat("\nThat call ran unchecked (calls after the first ", first_, " are compared every ", every_,
                "th; TESSERA_COMM_CHECK_EVERY=1 compares every call): its results on these ranks are wrong.");
  else
    text += "\nIt was stopped before any data moved.";
  return text;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera::detail
