// Debug-mode agreement check (TESSERA_COMM_DEBUG=1): before a collective, every rank shares a
// CallSignature (which collective, element type, count, root or op) through the backend's own
// all_gather of fixed size, which cannot mismatch, and throws on every rank if they differ.
// A mismatch would otherwise hang (different collectives) or silently read past a buffer or
// return wrong numbers (different counts), far from the bug.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tessera/comm/communicator.hpp"

namespace tessera::detail {

enum class CollectiveKind : std::int64_t { AllReduce = 1, Broadcast, AllGather, ReduceScatter, Barrier, Split };

inline std::string_view to_string(CollectiveKind k) {
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

  std::string describe() const {
    std::string text = cat(to_string(kind), "(");
    if (kind == CollectiveKind::Barrier) return text + ")";
    if (kind == CollectiveKind::Split) return text + ")";
    text += cat(to_string(dtype), " x ", count);
    if (kind == CollectiveKind::Broadcast) text += cat(", root ", extra);
    if (kind == CollectiveKind::AllReduce || kind == CollectiveKind::ReduceScatter)
      text += cat(", ", to_string(static_cast<ReduceOp>(extra)));
    return text + ")";
  }
};

// Error texts are built only when something failed: describing a call on every call would cost
// about a microsecond, as much as a small shared-memory collective.
inline const std::string& describe(const std::string& what) { return what; }
inline std::string describe(const CallSignature& what) { return what.describe(); }

// all_signatures holds size x 4 int64 gathered from every rank. Throws CommError on this rank
// when any rank's signature differs from rank 0's, listing every rank's call.
inline void check_signatures(std::string_view backend, int rank, std::span<const std::int64_t> all_signatures) {
  const int size = static_cast<int>(all_signatures.size() / 4);
  const CallSignature first = CallSignature::decode(all_signatures.data());
  bool same = true;
  for (int r = 1; r < size; ++r) same = same && CallSignature::decode(all_signatures.data() + 4 * r) == first;
  if (same) return;
  std::string text = cat(backend, " debug check on rank ", rank, ": ranks called different collectives:");
  for (int r = 0; r < size; ++r) text += cat("\n  rank ", r, ": ", CallSignature::decode(all_signatures.data() + 4 * r).describe());
  throw CommError(text);
}

}  // namespace tessera::detail
