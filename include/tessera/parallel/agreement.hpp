// Agreement checks: every rank of a group verifies that the others built a strategy the same way
// (same parameter names and shapes, bucket layout, options) before the strategy issues its first
// collective whose size depends on them. Ranks launched with different settings would otherwise
// call collectives of different sizes, which crashes inside the backend (MPI, Gloo), hangs, or
// trains on silently wrong numbers; here they fail, on every rank, with one sentence:
//
//   DataParallel: ranks disagree on options.bucket_bytes: ranks 0, 2: 1048576; rank 1: 65536
//   (every rank must be launched with the same settings)
//
//   AgreementRecord record("DataParallel");          // ordered (name, value) fields
//   record.add("options.bucket_bytes", options.bucket_bytes);
//   record.add_named_tensors(named);                 // "parameter[i] name", "... shape", buffers
//   check_agreement(comm, record);                   // throws AgreementError on every rank
//
// Cost: each rank hashes every field (64-bit FNV-1a of name and value) and the ranks all_gather
// one fixed-size pair (hash of the whole record, field count): one tiny collective when they
// agree, which is always in a correct program. Only on a mismatch do they exchange the per-field
// hashes (to find the first field that differs) and that field's text, each exchange of a size
// every rank computes from what it already received, so the check itself can never mismatch.
// Every rank ends with the same gathered data and so throws the same text. A group of one rank
// communicates nothing.
//
// The same machinery compares per-tensor checksums of replicas during training
// (check_replicas_agree; DataParallel's consistency_check_every), where the fields are parameter
// names and the values 64-bit checksums of their bytes (checksum64).
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/shape.hpp"

namespace tessera {

// Ranks were built or launched with settings that must be equal and are not, or replicas that
// must be bit-identical have diverged. An ArgumentError: the fix is in how the ranks were started.
class AgreementError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// What the checks need of a group: its size and an all_gather of int64 values. Every
// Communicator has both, and so does CheckpointGroup (a Trainer's ranks).
template <class C>
concept AgreementGroup = requires(C& c, std::span<const std::int64_t> in, std::span<std::int64_t> out) {
  { c.size() } -> std::convertible_to<int>;
  c.all_gather(in, out);
};

namespace detail {
inline constexpr std::uint64_t kFnvOffset = 14695981039346656037ull;
inline constexpr std::uint64_t kFnvPrime = 1099511628211ull;

inline std::uint64_t fnv1a(std::string_view s, std::uint64_t h = kFnvOffset) {
  for (unsigned char c : s) h = (h ^ c) * kFnvPrime;
  return h;
}
inline std::string hex64(std::uint64_t v) {
  char buf[19] = "0x";
  const auto end = std::to_chars(buf + 2, buf + sizeof(buf), v, 16).ptr;
  return std::string(buf, end);
}
// Folds one 64-bit word into a running hash (for hashes of hashes).
inline std::uint64_t fold64(std::uint64_t h, std::uint64_t word) {
  for (int k = 0; k < 8; ++k) h = (h ^ ((word >> (8 * k)) & 0xffu)) * kFnvPrime;
  return h;
}
}  // namespace detail

// 64-bit checksum of `bytes` bytes (bitwise: -0.0 and 0.0, or two NaN payloads, differ). Four
// independent lanes of xxHash64's round over 8-byte words, so it runs at memory speed (several
// GB/s) rather than FNV's byte at a time; not compatible with any published xxHash value.
TESSERA_LINKAGE std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed = 0);

// The checksum of a tensor's elements, on any device (a device tensor is copied to `host`
// scratch first: a GPU's memory is not readable from the host).
template <class S, class D>
std::uint64_t tensor_checksum(const Tensor<S, D>& t, std::vector<S>& host) {
  const auto bytes = static_cast<std::size_t>(t.numel()) * sizeof(S);
  if constexpr (D::host_accessible) {
    return checksum64(t.data(), bytes);
  } else {
    host.resize(static_cast<std::size_t>(t.numel()));
    D::copy_to_host(host.data(), t.data(), bytes);
    D::synchronize();
    return checksum64(host.data(), bytes);
  }
}

// Ordered (name, value) fields that every rank of a group must hold identically. Values are
// canonical text: integers in decimal, floating point in the shortest form that round-trips (so
// 0.05 and 0.05000001 differ), bool as true/false, shapes as (64, 3, 3, 3).
class AgreementRecord {
 public:
  struct Field {
    std::string name, value;
  };

  // who: the strategy, the first word of every error ("DataParallel").
  explicit AgreementRecord(std::string who);

  AgreementRecord& add(std::string name, std::string value);
  AgreementRecord& add(std::string name, const char* value);
  AgreementRecord& add(std::string name, std::string_view value);
  AgreementRecord& add(std::string name, bool value);
  template <class T>
    requires std::integral<T> && (!std::same_as<T, bool>)
  AgreementRecord& add(std::string name, T value) {
    return add(std::move(name), std::to_string(value));
  }
  template <std::floating_point T>
  AgreementRecord& add(std::string name, T value) {
    char buf[64];
    const auto end = std::to_chars(buf, buf + sizeof(buf), value).ptr;  // shortest round-trip form
    return add(std::move(name), std::string(buf, end));
  }
  AgreementRecord& add(std::string name, const Shape& shape);
  // A list as "[a, b, c]" of the elements' canonical text.
  template <class T>
  AgreementRecord& add_list(std::string name, const std::vector<T>& values) {
    AgreementRecord scratch("");
    std::string text = "[";
    for (std::size_t i = 0; i < values.size(); ++i) {
      scratch.add("", values[i]);
      text += (i ? ", " : "") + scratch.fields_.back().value;
    }
    return add(std::move(name), text + "]");
  }

  // Every parameter's and buffer's name and shape, in visit order ("parameter[3] name" =
  // "layer1.0.conv1.weight", "parameter[3] (layer1.0.conv1.weight) shape" = "(64, 3, 3, 3)"), and
  // the element type.
  template <class E>
  AgreementRecord& add_named_tensors(const NamedTensors<E>& named, const std::string& prefix = "") {
    using S = typename E::Scalar;
    add(prefix + "scalar", std::string(sizeof(S) == 8 ? "float64" : "float32"));
    add(prefix + "parameters", named.parameters.size());
    for (std::size_t i = 0; i < named.parameters.size(); ++i) {
      const std::string key = prefix + "parameter[" + std::to_string(i) + "]";
      add(key + " name", named.parameters[i].first);
      add(key + " (" + named.parameters[i].first + ") shape", named.parameters[i].second->value.shape());
    }
    add(prefix + "buffers", named.buffers.size());
    for (std::size_t i = 0; i < named.buffers.size(); ++i) {
      const std::string key = prefix + "buffer[" + std::to_string(i) + "]";
      add(key + " name", named.buffers[i].first);
      add(key + " (" + named.buffers[i].first + ") shape", named.buffers[i].second->shape());
    }
    return *this;
  }

  // The values themselves, as one checksum64 per parameter and buffer ("checksum of parameter
  // fc.weight" = "0x..."): for state that must be bit-identical on every rank (a layer split from
  // one dense layer built from the same seed, replicas before an update).
  template <class E>
  AgreementRecord& add_checksums(const NamedTensors<E>& named, const std::string& prefix = "") {
    std::vector<typename E::Scalar> host;
    for (const auto& [name, p] : named.parameters)
      add(prefix + "checksum of parameter " + name, detail::hex64(tensor_checksum(p->value, host)));
    for (const auto& [name, t] : named.buffers)
      add(prefix + "checksum of buffer " + name, detail::hex64(tensor_checksum(*t, host)));
    return *this;
  }

  const std::string& who() const;
  const std::vector<Field>& fields() const;
  // Hash of field i's name and value (never 0: 0 stands for "no such field" in the exchange).
  std::uint64_t field_hash(std::size_t i) const;

 private:
  std::string who_;
  std::vector<Field> fields_;
};

// Where the ranks disagree: the first field (index) whose hash is not the same on every rank, its
// name and value as each rank holds them (nullopt: that rank has fewer fields), and how many
// fields differ in all.
struct Disagreement {
  std::size_t index = 0;
  std::size_t fields_differing = 0;
  std::vector<std::optional<AgreementRecord::Field>> per_rank;

  // "options.bucket_bytes: ranks 0, 2: 1048576; rank 1: 65536" (the field's name once when every
  // rank that has the field calls it the same, else "name = value" per group).
  std::string describe() const;

  // "rank 1", "ranks 0, 2", "ranks 0-30, 32" (runs of three or more as ranges).
  static std::string rank_list(const std::vector<int>& ranks);
};

namespace detail {
// all_gather of fixed-size uint64 words (as int64, which every backend moves).
template <AgreementGroup C>
std::vector<std::uint64_t> all_gather_u64(C& comm, const std::vector<std::uint64_t>& mine) {
  std::vector<std::int64_t> in(mine.size()), out(mine.size() * static_cast<std::size_t>(comm.size()));
  for (std::size_t i = 0; i < mine.size(); ++i) in[i] = std::bit_cast<std::int64_t>(mine[i]);
  comm.all_gather(std::span<const std::int64_t>(in), std::span<std::int64_t>(out));
  std::vector<std::uint64_t> result(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) result[i] = std::bit_cast<std::uint64_t>(out[i]);
  return result;
}

// Every rank's string: the lengths first (one word each), then the bytes padded to the longest,
// 8 to a word. Strings are cut at `limit` bytes so that one field cannot make a huge message.
template <AgreementGroup C>
std::vector<std::string> all_gather_text(C& comm, std::string mine, std::size_t limit = 4096) {
  if (mine.size() > limit) mine = mine.substr(0, limit) + "...";
  const auto ranks = static_cast<std::size_t>(comm.size());
  const auto lengths = all_gather_u64(comm, {static_cast<std::uint64_t>(mine.size())});
  const std::size_t longest = static_cast<std::size_t>(*std::max_element(lengths.begin(), lengths.end()));
  const std::size_t words = (longest + 7) / 8;
  std::vector<std::uint64_t> packed(words, 0);
  if (!mine.empty()) std::memcpy(packed.data(), mine.data(), mine.size());
  const auto all = words == 0 ? std::vector<std::uint64_t>() : all_gather_u64(comm, packed);
  std::vector<std::string> out(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    out[r].resize(static_cast<std::size_t>(lengths[r]));
    if (lengths[r] > 0) std::memcpy(out[r].data(), all.data() + r * words, out[r].size());
  }
  return out;
}
}  // namespace detail

// The collective core: `count` fields per rank with hashes hash_of(i) (non-zero) and text
// field_of(i). One all_gather of (total hash, count) when every rank agrees (returns nullopt);
// otherwise the per-field hashes and the first differing field's text, on every rank alike.
template <AgreementGroup C, class HashOf, class FieldOf>
std::optional<Disagreement> find_disagreement(C& comm, std::size_t count, HashOf hash_of, FieldOf field_of) {
  if (comm.size() == 1) return std::nullopt;
  const auto ranks = static_cast<std::size_t>(comm.size());
  std::uint64_t total = detail::fold64(detail::kFnvOffset, count);
  for (std::size_t i = 0; i < count; ++i) total = detail::fold64(total, hash_of(i));
  const auto summary = detail::all_gather_u64(comm, {total, static_cast<std::uint64_t>(count)});
  bool agree = true;
  std::size_t most = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    agree = agree && summary[2 * r] == summary[0] && summary[2 * r + 1] == summary[1];
    most = std::max(most, static_cast<std::size_t>(summary[2 * r + 1]));
  }
  if (agree) return std::nullopt;
  // Every rank knows `most` now: the per-field hashes go out padded to it (0 = no such field).
  std::vector<std::uint64_t> mine(most, 0);
  for (std::size_t i = 0; i < count; ++i) mine[i] = hash_of(i);
  const auto hashes = detail::all_gather_u64(comm, mine);
  Disagreement d;
  d.index = most;
  for (std::size_t i = 0; i < most; ++i) {
    bool same = true;
    for (std::size_t r = 1; r < ranks; ++r) same = same && hashes[r * most + i] == hashes[i];
    if (!same) {
      if (d.fields_differing == 0) d.index = i;
      ++d.fields_differing;
    }
  }
  // Totals differ but every field hash agrees: a 64-bit collision in the totals, not possible
  // in practice; report nothing rather than a wrong field.
  if (d.fields_differing == 0) return std::nullopt;
  const bool have = d.index < count;
  AgreementRecord::Field f;
  if (have) f = field_of(d.index);
  // One text per rank: a marker byte (has the field or not), the name, a NUL, the value.
  const auto texts = detail::all_gather_text(comm, have ? "1" + f.name + std::string(1, '\0') + f.value : std::string("0"));
  d.per_rank.resize(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    if (texts[r].empty() || texts[r][0] != '1') continue;
    const auto nul = texts[r].find('\0');
    d.per_rank[r] = AgreementRecord::Field{texts[r].substr(1, nul == std::string::npos ? std::string::npos : nul - 1),
                                           nul == std::string::npos ? std::string() : texts[r].substr(nul + 1)};
  }
  return d;
}

// Throws AgreementError on every rank unless every rank of `comm` holds the same record.
// hint: what to do about it, appended in parentheses.
template <AgreementGroup C>
void check_agreement(C& comm, const AgreementRecord& record,
                     std::string_view hint = "every rank must be launched with the same settings and build the same model") {
  const auto& fields = record.fields();
  const auto d = find_disagreement(comm, fields.size(), [&](std::size_t i) { return record.field_hash(i); },
                                   [&](std::size_t i) { return fields[i]; });
  if (!d) return;
  std::string more;
  if (d->fields_differing > 1)
    more = "; " + std::to_string(d->fields_differing - 1) + " later field" + (d->fields_differing > 2 ? "s" : "") +
           " differ" + (d->fields_differing > 2 ? "" : "s") + " too";
  throw AgreementError(record.who() + ": ranks disagree on " + d->describe() + more + " (" + std::string(hint) + ")");
}

// Per-item checksums that must be equal on every rank (replicas of the same parameters): throws
// AgreementError on every rank naming the first item that differs, the ranks holding each
// checksum, and `what_then` (likely causes). names[i] names item i; every rank passes the same
// number of items (a construction-time agreement check guarantees it).
template <AgreementGroup C>
void check_replicas_agree(C& comm, std::span<const std::uint64_t> checksums, std::span<const std::string> names,
                          std::string_view prefix, std::string_view what_then) {
  const auto d = find_disagreement(
      comm, checksums.size(), [&](std::size_t i) { return checksums[i] == 0 ? std::uint64_t{1} : checksums[i]; },
      [&](std::size_t i) { return AgreementRecord::Field{names[i], "checksum " + detail::hex64(checksums[i])}; });
  if (!d) return;
  std::string more;
  if (d->fields_differing > 1) more = " (the first of " + std::to_string(d->fields_differing) + " that differ)";
  throw AgreementError(std::string(prefix) + ": parameter " + d->describe() + more + ". " + std::string(what_then));
}

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed) {
  constexpr std::uint64_t p1 = 11400714785074694791ull, p2 = 14029467366897019727ull, p3 = 1609587929392839161ull,
                          p4 = 9650029242287828579ull, p5 = 2870177450012600261ull;
  auto round = [](std::uint64_t acc, std::uint64_t word) { return std::rotl(acc + word * p2, 31) * p1; };
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lane[4] = {seed + p1 + p2, seed + p2, seed, seed - p1};
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int k = 0; k < 4; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = round(lane[k], w);
    }
  std::uint64_t h = std::rotl(lane[0], 1) + std::rotl(lane[1], 7) + std::rotl(lane[2], 12) + std::rotl(lane[3], 18);
  for (int k = 0; k < 4; ++k) h = (h ^ round(0, lane[k])) * p1 + p4;
  h += static_cast<std::uint64_t>(bytes);
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = std::rotl(h ^ round(0, w), 27) * p1 + p4;
  }
  for (; i < bytes; ++i) h = std::rotl(h ^ (p[i] * p5), 11) * p1;
  h ^= h >> 33;  // final avalanche
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  h ^= h >> 32;
  return h;
}

TESSERA_LINKAGE AgreementRecord::AgreementRecord(std::string who) : who_(std::move(who)) {}

TESSERA_LINKAGE AgreementRecord& AgreementRecord::add(std::string name, std::string value) {
  fields_.push_back({std::move(name), std::move(value)});
  return *this;
}

TESSERA_LINKAGE AgreementRecord& AgreementRecord::add(std::string name, const char* value) { return add(std::move(name), std::string(value)); }

TESSERA_LINKAGE AgreementRecord& AgreementRecord::add(std::string name, std::string_view value) { return add(std::move(name), std::string(value)); }

TESSERA_LINKAGE AgreementRecord& AgreementRecord::add(std::string name, bool value) { return add(std::move(name), std::string(value ? "true" : "false")); }

TESSERA_LINKAGE AgreementRecord& AgreementRecord::add(std::string name, const Shape& shape) { return add(std::move(name), shape.str()); }

TESSERA_LINKAGE const std::string& AgreementRecord::who() const { return who_; }

TESSERA_LINKAGE auto AgreementRecord::fields() const -> const std::vector<Field>& { return fields_; }

TESSERA_LINKAGE std::uint64_t AgreementRecord::field_hash(std::size_t i) const {
  const std::uint64_t h = detail::fnv1a(fields_[i].value, detail::fnv1a(std::string_view("\0", 1), detail::fnv1a(fields_[i].name)));
  return h == 0 ? 1 : h;
}

TESSERA_LINKAGE std::string Disagreement::describe() const {
  std::optional<std::string> common_name;
  bool same_name = true;
  for (const auto& f : per_rank)
    if (f) {
      if (!common_name) common_name = f->name;
      else if (*common_name != f->name) same_name = false;
    }
  // Ranks grouped by what they hold, in order of first appearance.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    const auto& f = per_rank[r];
    std::string text = !f ? "(no such field: this rank has " + std::to_string(index) + " fields)"
                          : (same_name ? f->value : f->name + " = " + f->value);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == text; });
    if (it == groups.end()) groups.emplace_back(std::move(text), std::vector<int>{static_cast<int>(r)});
    else it->second.push_back(static_cast<int>(r));
  }
  std::string out = same_name && common_name ? *common_name + ": " : "field " + std::to_string(index) + ": ";
  for (std::size_t g = 0; g < groups.size(); ++g)
    out += (g ? "; " : "") + rank_list(groups[g].second) + ": " + groups[g].first;
  return out;
}

TESSERA_LINKAGE std::string Disagreement::rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    // Appended piece by piece: gcc 12 warns (-Wrestrict, a false positive) on "lit" + to_string().
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
    if (j >= i + 2) out.append("-").append(std::to_string(ranks[j]));
    else if (j == i + 1) out.append(", ").append(std::to_string(ranks[j]));
    i = j + 1;
  }
  return out;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
