// Sharded checkpoints: every rank writes the part of the model and of the optimizer state that it
// owns (FullyShardedDataParallel's shard), with no gather to one rank, and a run at another world
// size loads them back (resharding), as PyTorch's distributed checkpoint does for FSDP.
//
//   save_sharded_checkpoint(dir, model, optimizer, state, comm);  // every rank
//   state = load_sharded_checkpoint(dir, model, optimizer, comm); // every rank, any world size M
//   consolidate_sharded_checkpoint(dir, "whole.safetensors");     // one process: one ordinary file
//
// A directory saved by N ranks:
//   dir/shard-00000-of-00004.safetensors ... dir/shard-00003-of-00004.safetensors   one per rank
//   dir/index.json                                                                 written last
// A shard file holds pieces: runs of a whole tensor's flattened elements, as 1-D tensors under the
// whole tensor's name ("layer1.0.conv1.weight", "optim.exp_avg.layer1.0.conv1.weight"), each with
// metadata "piece.<name>" = "<first element> <whole shape>" (e.g. "432 16,3,3,3") and, as for every
// tensor of the file, "checksum.<name>" (checksum64 of its bytes: a flipped bit is caught, which
// safetensors alone does not do). Also: this rank's random generators ("rng.<name>"), the training
// position and the optimizer's integers (the same in every file), "shard.save" (an id that the
// files of one save share), "shard.rank" and "shard.ranks". Rank 0's file also holds the model's
// buffers (BatchNorm's running statistics), whole: rank 0's, as every checkpoint of replicas does;
// a buffer that is a parameter's own tensor (GPT's lm_head.weight, the tie) is written as
// "alias.<buffer>" = "<parameter>" instead, and loads with the parameter's pieces.
//
// Commit. Rank 0 removes the old index; the ranks agree that it is gone; each writes its file
// (atomically, SafetensorsWriter::write); the ranks agree that all succeeded; then rank 0 writes
// index.json (atomically), naming the save id, N and each file's size, and removes shard files of
// another world size that an earlier save into the same directory left. A save cut short leaves no
// index, and a directory without one is refused as incomplete, never half-loaded.
//
// Load, on every rank of M: the index; every shard's header (all N files must be there, of the
// sizes the index gives, of its save, with the pieces of every tensor tiling it exactly); the
// elastic-resume rule of train/checkpoint.hpp (the global batch must split over M ranks); then the
// files that hold elements of this rank's pieces (and rank 0's, for the buffers), read whole, every
// tensor's checksum verified; then a check pass over every name, shape and dtype. Only when every
// rank found no problem does any rank copy (the ranks agree first), so a wrong directory never
// half-loads. Generators: rank r < N takes shard r's, ranks N .. M - 1 keep their own (as an
// elastic resume of train/checkpoint.hpp does).
//
// The optimizer's side (FullyShardedOptimizer has it):
//   visit_shards(v)   v.piece(name, whole_shape, first, tensor) for each piece this rank owns, of
//                     the model's parameters and of the optimizer's state (1-D tensors), and
//                     v.integer(name, value) for the optimizer's integers ("optim.step")
//   shards_loaded()   after a load: the pieces hold new values (gathered copies are stale)
// Model parameters are not read from the model (under ZeRO-3 they are released between steps):
// model.visit gives the buffers, integer buffers and generators only.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/io/json.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/train/checkpoint.hpp"

namespace tessera {

// An optimizer whose state lives in per-rank pieces and can be saved as shards.
template <class O>
concept ShardedCheckpointOptimizer = requires(O& o) {
  o.shards_loaded();
  { o.sharded_checkpoints() } -> std::convertible_to<bool>;
};

inline constexpr const char* kShardedCheckpointFormat = "tessera-sharded-checkpoint-1";

// "shard-00002-of-00004.safetensors": rank r's file of a save by `ranks` ranks.
TESSERA_LINKAGE std::string shard_file_name(int rank, int ranks);
// Whether `path` is a sharded checkpoint (a directory); a file is an ordinary checkpoint.
TESSERA_LINKAGE bool is_sharded_checkpoint(const std::string& path);
// Writes the sharded checkpoint `dir` as one ordinary checkpoint file (tessera-checkpoint-2, what
// save_checkpoint writes: whole tensors under the same names, every rank's generators), which a
// single process loads with load_checkpoint, or any world size. One process; reads every shard
// (and verifies them as load_sharded_checkpoint does).
TESSERA_LINKAGE void consolidate_sharded_checkpoint(const std::string& dir, const std::string& path);

namespace detail {

// What index.json says.
struct ShardIndex {
  std::string save;  // the id the files of this save share
  int ranks = 0;
  std::vector<std::int64_t> bytes;  // each shard file's size
};
TESSERA_LINKAGE ShardIndex read_shard_index(const std::string& dir);
TESSERA_LINKAGE void write_shard_index(const std::string& dir, const ShardIndex& index);
// Rank 0, after the commit: shard files of another world size (an earlier save into dir).
TESSERA_LINKAGE void remove_other_shard_files(const std::string& dir, int ranks);
// A fresh save id: 16 hex digits from the clock and the random device.
TESSERA_LINKAGE std::int64_t new_save_id();

// One piece as a shard file's metadata gives it.
struct SavedPiece {
  int rank = 0;  // the file
  std::int64_t first = 0, length = 0;
  Shape whole;
  DType dtype = DType::F32;
};
// "432 16,3,3,3" <-> (432, (16, 3, 3, 3)); false when the text is malformed.
TESSERA_LINKAGE std::string piece_entry(std::int64_t first, const Shape& whole);
TESSERA_LINKAGE bool parse_piece_entry(const std::string& text, std::int64_t& first, Shape& whole);

// Every shard file's header, checked against the index and each other; throws IoError listing
// every problem (a missing file is named with the rank that wrote it).
struct ShardSet {
  ShardIndex index;
  std::vector<SafetensorsFile> headers;                    // [rank]
  std::map<std::string, std::vector<SavedPiece>> pieces;   // name -> its pieces, in element order
};
TESSERA_LINKAGE ShardSet open_shard_set(const std::string& dir, const char* who);
// Problems with the tensors of a fully read shard file: any whose checksum differs from its entry.
TESSERA_LINKAGE void verify_shard_checksums(const SafetensorsFile& file, std::vector<std::string>& problems);
TESSERA_LINKAGE std::string shard_problems_text(const char* who, const std::string& dir,
                                               const std::vector<std::string>& problems);

// Writes this rank's file: buffers (rank 0), pieces, integers, generators.
struct ShardSaver {
  SafetensorsWriter& writer;
  const CheckpointOptions& options;
  std::string path;
  bool buffers = false;  // rank 0 writes the model's buffers

  std::map<const void*, std::string> parameter_of;  // each parameter's value tensor -> its name

  template <class P>
  void parameter(const std::string& name, P& p) {  // the parameters come as pieces
    parameter_of[&p.value] = name;
  }
  template <class S, class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    if (!buffers) return;
    // A buffer that is a parameter's own tensor (GPT's lm_head.weight, wte's): its pieces hold it.
    if (const auto it = parameter_of.find(&t); it != parameter_of.end()) {
      writer.set_metadata("alias." + name, it->second);
      return;
    }
    add(name, t);
  }
  void integer_buffer(const std::string& name, std::int64_t& v) {
    if (!buffers) return;
    writer.add_raw(name, DType::I64, Shape{}, &v, sizeof v);
    writer.set_metadata("checksum." + name, hex64(checksum64(&v, sizeof v)));
  }
  void integer(const std::string& name, std::int64_t& v) { writer.set_metadata(name, std::to_string(v)); }
  void optional_integer(const std::string& name, std::int64_t& v) { integer(name, v); }
  void rng(const std::string& name, Rng& r) { writer.set_metadata("rng." + name, rng_to_string(r.state())); }
  template <class S, class D>
  void piece(const std::string& name, const Shape& whole, std::int64_t first, Tensor<S, D>& t) {
    if (t.numel() == 0) return;
    add(name, t);
    writer.set_metadata("piece." + name, piece_entry(first, whole));
  }

  template <class S, class D>
  void add(const std::string& name, const Tensor<S, D>& t) {
    if constexpr (D::host_accessible) {
      add_host(name, t);
    } else {
      add_host(name, to_host(t));
    }
  }
  template <class S>
  void add_host(const std::string& name, const Tensor<S, Cpu>& t) {
    check_finite_for_save("save_sharded_checkpoint", path, options, name, t);
    writer.add(name, t);
    writer.set_metadata("checksum." + name, hex64(checksum64(t.data(), t.bytes())));
  }
};

// A piece this rank asks for.
struct PieceRequest {
  std::string name;
  std::int64_t first = 0, length = 0;
};
struct PiecePlanner {
  std::vector<PieceRequest> requests;
  template <class S, class D>
  void piece(const std::string& name, const Shape&, std::int64_t first, Tensor<S, D>& t) {
    if (t.numel() > 0) requests.push_back({name, first, t.numel()});
  }
  void integer(const std::string&, std::int64_t&) {}
};

// The check and copy passes: pieces from the shard files that hold their elements, buffers and
// integers from rank 0's file (through CheckpointLoader), generators from this rank's.
struct ShardLoader {
  const ShardSet& set;
  const std::map<int, SafetensorsFile>& files;  // fully read: rank 0's and those holding this rank's elements
  CheckpointLoader& whole;                      // rank 0's file: buffers and integers
  CheckpointLoader& rngs;                       // this rank's file (header): generators
  bool copy = false;
  std::vector<std::string> problems;
  std::set<std::string> pieces_seen;

  std::set<const void*> parameter_values;

  template <class P>
  void parameter(const std::string& name, P& p) {
    whole.seen.insert(name);  // a model parameter's name in rank 0's file is a piece, not unexpected
    parameter_values.insert(&p.value);
  }
  template <class S, class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    if (parameter_values.count(&t)) {  // a parameter's own tensor (ShardSaver::buffer): loaded as pieces
      if (!set.headers[0].metadata().count("alias." + name))
        problems.push_back("missing entry 'alias." + name + "' (the buffer '" + name + "' is a parameter's tensor)");
      return;
    }
    whole.buffer(name, t);
  }
  void integer_buffer(const std::string& name, std::int64_t& v) { whole.integer_buffer(name, v); }
  void integer(const std::string& name, std::int64_t& v) { whole.integer(name, v); }
  void optional_integer(const std::string& name, std::int64_t& v) { whole.optional_integer(name, v); }
  void rng(const std::string& name, Rng& r) { rngs.rng(name, r); }

  template <class S, class D>
  void piece(const std::string& name, const Shape& shape, std::int64_t first, Tensor<S, D>& t) {
    if (t.numel() == 0) return;
    pieces_seen.insert(name);
    const auto it = set.pieces.find(name);
    if (it == set.pieces.end()) {
      problems.push_back("missing tensor '" + name + "' (shape " + shape.str() + ")");
      return;
    }
    const SavedPiece& any = it->second.front();
    if (any.whole != shape || any.dtype != dtype_of<S>()) {
      problems.push_back(cat("tensor '", name, "': the shards hold ", dtype_name(any.dtype), " ", any.whole,
                             ", the model has ", dtype_name(dtype_of<S>()), " ", shape));
      return;
    }
    if (!copy) return;
    // The saved pieces tile the whole tensor (open_shard_set checked): copy each overlap.
    std::vector<S> host;
    S* out = t.data();
    if constexpr (!D::host_accessible) {
      host.resize(static_cast<std::size_t>(t.numel()));
      out = host.data();
    }
    const std::int64_t end = first + t.numel();
    for (const SavedPiece& saved : it->second) {
      const std::int64_t from = std::max(first, saved.first), to = std::min(end, saved.first + saved.length);
      if (from >= to) continue;
      const std::byte* data = files.at(saved.rank).raw(name);
      std::memcpy(out + (from - first), data + static_cast<std::size_t>(from - saved.first) * sizeof(S),
                  static_cast<std::size_t>(to - from) * sizeof(S));
    }
    if constexpr (!D::host_accessible) {
      D::copy_to_device(t.data(), host.data(), t.bytes());
      D::synchronize();
    }
  }
};

}  // namespace detail

// Saves this rank's shard into `dir` (created if missing). Every rank of the group calls it; all
// return or all throw. Refuses non-finite values unless options allow them.
template <class Model, ShardedCheckpointOptimizer Optimizer>
void save_sharded_checkpoint(const std::string& dir, Model& model, Optimizer& optimizer, TrainState state,
                             const CheckpointGroup& group = {}, const CheckpointOptions& options = {}) {
  static_assert(check_visitable<Model>());
  if (state.loader_next_sample == 0)
    state.loader_next_sample = state.loader_next_batch * state.loader_batch_size * state.loader_world_size;
  const int rank = group.rank(), ranks = group.size();
  // 1. The directory exists and holds no index (a save cut short from here on is seen as one).
  std::exception_ptr failure;
  if (rank == 0) {
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      TESSERA_CHECK(std::filesystem::is_directory(dir), IoError, "save_sharded_checkpoint: cannot create the directory '",
                    dir, "'", ec ? ": " + ec.message() : std::string(" (a file of that name?)"));
      std::filesystem::remove(std::filesystem::path(dir) / "index.json", ec);
      TESSERA_CHECK(!ec, IoError, "save_sharded_checkpoint: cannot remove the old '", dir, "/index.json': ", ec.message());
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // Rank 0's save id and its verdict, to every rank.
  const std::int64_t mine[2] = {rank == 0 ? detail::new_save_id() : 0, failure ? 0 : 1};
  const auto heads = group.all_gather(mine);
  if (failure) std::rethrow_exception(failure);
  TESSERA_CHECK(heads[1] == 1, IoError, "save_sharded_checkpoint: rank 0 could not prepare '", dir,
                "' (its error says why)");
  const std::string save = detail::hex64(static_cast<std::uint64_t>(heads[0]));
  // 2. Every rank its file.
  const std::string file = (std::filesystem::path(dir) / shard_file_name(rank, ranks)).string();
  std::int64_t bytes = 0;
  try {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);  // ranks on other hosts: a directory there too
    SafetensorsWriter writer;
    detail::ShardSaver saver{writer, options, file, rank == 0};
    model.visit(saver, "");
    optimizer.visit_shards(saver);
    detail::visit_train_state(state, saver);
    writer.set_metadata("format", kShardedCheckpointFormat);
    writer.set_metadata("shard.save", save);
    writer.set_metadata("shard.rank", std::to_string(rank));
    writer.set_metadata("shard.ranks", std::to_string(ranks));
    writer.set_metadata("train.ranks", std::to_string(ranks));
    writer.write(file);
    bytes = static_cast<std::int64_t>(std::filesystem::file_size(file));
  } catch (...) {
    failure = std::current_exception();
  }
  // 3. All written, or every rank throws; rank 0 then commits with the index.
  const std::int64_t report[2] = {failure ? 0 : 1, bytes};
  const auto reports = group.all_gather(report);
  std::string failed;
  detail::ShardIndex index{save, ranks, {}};
  for (int r = 0; r < ranks; ++r) {
    if (reports[2 * static_cast<std::size_t>(r)] == 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    index.bytes.push_back(reports[2 * static_cast<std::size_t>(r) + 1]);
  }
  if (failure) std::rethrow_exception(failure);
  TESSERA_CHECK(failed.empty(), IoError, "save_sharded_checkpoint: rank(s) ", failed, " could not write their shard of '",
                dir, "' (their errors say why); the directory has no index, so nothing loads it as complete");
  if (rank == 0) {
    try {
      detail::write_shard_index(dir, index);
      detail::remove_other_shard_files(dir, ranks);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (ranks > 1) {
    const std::string bad = detail::ranks_that_failed(group, failure != nullptr);
    if (!failure && !bad.empty())
      throw IoError(detail::cat("save_sharded_checkpoint: rank 0 could not write '", dir,
                                "/index.json' (its error says why); the checkpoint is incomplete"));
  }
  if (failure) std::rethrow_exception(failure);
}

// Loads what save_sharded_checkpoint wrote, at this group's world size, all or nothing: if any rank
// finds a problem, every rank throws (the one that found it lists every problem) and none loads.
template <class Model, ShardedCheckpointOptimizer Optimizer>
TrainState load_sharded_checkpoint(const std::string& dir, Model& model, Optimizer& optimizer,
                                   const CheckpointGroup& group = {}, const CheckpointOptions& options = {}) {
  static_assert(check_visitable<Model>());
  constexpr const char* who = "load_sharded_checkpoint";
  TrainState state;
  std::optional<detail::ShardSet> set;
  std::map<int, SafetensorsFile> files;
  std::optional<detail::CheckpointLoader> whole, rngs;
  std::exception_ptr failure;
  auto passes = [&](bool copy, std::vector<std::string>* problems) {
    whole.emplace(detail::CheckpointLoader{files.at(0), copy, "", /*keep_rngs=*/true, options});
    const int rank = group.rank();
    const bool own_rngs = rank < set->index.ranks;
    rngs.emplace(detail::CheckpointLoader{set->headers[static_cast<std::size_t>(own_rngs ? rank : 0)], copy, "rng.",
                                          !own_rngs, options});
    detail::ShardLoader loader{*set, files, *whole, *rngs, copy, {}, {}};
    model.visit(loader, "");
    optimizer.visit_shards(loader);
    detail::visit_train_state(state, loader);
    if (!problems) return;
    *problems = loader.problems;
    problems->insert(problems->end(), whole->problems.begin(), whole->problems.end());
    problems->insert(problems->end(), rngs->problems.begin(), rngs->problems.end());
    // Rank 0's file: what is neither a piece nor one of this model's buffers is unexpected.
    for (const auto& name : files.at(0).names())
      if (!whole->seen.count(name) && !set->pieces.count(name))
        problems->push_back("unexpected tensor '" + name + "' (not in this model)");
    // A saved piece of a tensor this rank asks pieces of but the optimizer does not hold (another
    // optimizer's state: momentum where AdamW is loading).
    std::set<std::string> bases;
    const auto base = [](const std::string& name) {
      if (name.rfind("optim.", 0) != 0) return name;
      const auto dot = name.find('.', 6);
      return dot == std::string::npos ? name : name.substr(dot + 1);
    };
    for (const auto& name : loader.pieces_seen) bases.insert(base(name));
    for (const auto& [name, saved] : set->pieces)
      if (bases.count(base(name)) && !loader.pieces_seen.count(name))
        problems->push_back("unexpected tensor '" + name + "' (this optimizer holds no such state)");
    detail::check_train_metadata(whole->integers, *problems);
  };
  try {
    set.emplace(detail::open_shard_set(dir, who));
    const auto& meta0 = set->headers[0].metadata();
    std::int64_t batch = 0, world = 0;
    try {
      batch = std::stoll(meta0.at("train.loader_batch_size"));
      world = std::stoll(meta0.at("train.loader_world_size"));
    } catch (const std::exception&) {  // the check pass names a missing or malformed entry
    }
    check_resume_world_size("'" + dir + "'", set->index.ranks, group.size(), batch > 0 && world > 0 ? batch * world : 0);
    // The files to read whole: rank 0's (buffers), and those holding elements of this rank's pieces.
    detail::PiecePlanner planner;
    optimizer.visit_shards(planner);
    std::set<int> needed{0};
    for (const auto& request : planner.requests) {
      const auto it = set->pieces.find(request.name);
      if (it == set->pieces.end()) continue;
      for (const auto& saved : it->second)
        if (saved.first < request.first + request.length && request.first < saved.first + saved.length)
          needed.insert(saved.rank);
    }
    std::vector<std::string> problems;
    for (int q : needed) {
      const std::string path = set->headers[static_cast<std::size_t>(q)].path();
      try {
        files.emplace(q, SafetensorsFile::load(path));
        detail::verify_shard_checksums(files.at(q), problems);
      } catch (const IoError& e) {
        problems.push_back(e.what());
      }
    }
    if (problems.empty()) passes(false, &problems);
    if (!problems.empty()) throw IoError(detail::shard_problems_text(who, dir, problems));
  } catch (...) {
    failure = std::current_exception();
  }
  if (group.size() > 1) {
    const std::string failed = detail::ranks_that_failed(group, failure != nullptr);
    if (!failure && !failed.empty())
      throw IoError(detail::cat(who, ": '", dir, "': rank(s) ", failed,
                                " could not load it (their errors say why); nothing was loaded on any rank"));
  }
  if (failure) std::rethrow_exception(failure);
  passes(true, nullptr);
  optimizer.shards_loaded();
  return state;
}

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::string shard_file_name(int rank, int ranks) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05d-of-%05d.safetensors", rank, ranks);
  return name;
}

TESSERA_LINKAGE bool is_sharded_checkpoint(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

TESSERA_LINKAGE std::int64_t detail::new_save_id() {
  std::random_device device;
  const auto now = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  const std::uint64_t id = fold64(fold64(kFnvOffset, now), (static_cast<std::uint64_t>(device()) << 32) ^ device());
  return static_cast<std::int64_t>(id);
}

TESSERA_LINKAGE std::string detail::piece_entry(std::int64_t first, const Shape& whole) {
  std::string text = std::to_string(first) + " ";
  for (int d = 0; d < whole.rank(); ++d) text += (d ? "," : "") + std::to_string(whole[d]);
  return text;
}

TESSERA_LINKAGE bool detail::parse_piece_entry(const std::string& text, std::int64_t& first, Shape& whole) {
  const auto space = text.find(' ');
  if (space == std::string::npos) return false;
  try {
    std::size_t used = 0;
    first = std::stoll(text.substr(0, space), &used);
    if (used != space || first < 0) return false;
    std::vector<std::int64_t> dims;
    std::size_t at = space + 1;
    while (at < text.size()) {
      const auto comma = text.find(',', at);
      const std::string digits = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      dims.push_back(std::stoll(digits, &used));
      if (used != digits.size() || dims.back() < 0) return false;
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    whole = Shape(dims.begin(), dims.end());
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

TESSERA_LINKAGE void detail::write_shard_index(const std::string& dir, const ShardIndex& index) {
  std::string text = cat("{\"format\": \"", kShardedCheckpointFormat, "\", \"save\": \"", index.save,
                         "\", \"ranks\": ", index.ranks, ", \"shards\": [");
  for (int r = 0; r < index.ranks; ++r)
    text += cat(r ? ", " : "", "{\"file\": \"", shard_file_name(r, index.ranks), "\", \"bytes\": ",
                index.bytes[static_cast<std::size_t>(r)], "}");
  text += "]}\n";
  const std::string path = (std::filesystem::path(dir) / "index.json").string(), tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  TESSERA_CHECK(f != nullptr, IoError, "save_sharded_checkpoint: cannot write '", tmp, "': ", std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 &&
                       ::fsync(::fileno(f)) == 0;
  const bool closed = std::fclose(f) == 0;
  TESSERA_CHECK(written && closed && std::rename(tmp.c_str(), path.c_str()) == 0, IoError,
                "save_sharded_checkpoint: cannot write '", path, "': ", std::strerror(errno));
}

TESSERA_LINKAGE auto detail::read_shard_index(const std::string& dir) -> ShardIndex {
  const std::string path = (std::filesystem::path(dir) / "index.json").string();
  std::error_code ec;
  TESSERA_CHECK(std::filesystem::is_directory(dir, ec), IoError, "'", dir, "' is not a directory (a sharded ",
                "checkpoint is one; an ordinary checkpoint file loads with load_checkpoint)");
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, IoError, "'", dir, "' is an incomplete sharded checkpoint: it has no index.json, which rank 0 ",
                "writes last, once every rank's shard is on disk (the save was cut short, or this is not a checkpoint "
                "directory)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ShardIndex index;
  try {
    const JsonValue doc = parse_json(text);
    TESSERA_CHECK(doc.has("format") && doc.at("format").as_string() == kShardedCheckpointFormat, IoError,
                  "its format is not ", kShardedCheckpointFormat);
    index.save = doc.at("save").as_string();
    const double ranks = doc.at("ranks").as_number();
    TESSERA_CHECK(ranks >= 1 && ranks <= 1 << 20 && ranks == static_cast<double>(static_cast<int>(ranks)), IoError,
                  "ranks = ", ranks, " is not a world size");
    index.ranks = static_cast<int>(ranks);
    const JsonValue& shards = doc.at("shards");
    TESSERA_CHECK(shards.kind == JsonValue::Kind::Array && shards.items.size() == static_cast<std::size_t>(index.ranks),
                  IoError, "it lists ", shards.items.size(), " shards for ", index.ranks, " ranks");
    for (int r = 0; r < index.ranks; ++r) {
      const JsonValue& shard = shards.items[static_cast<std::size_t>(r)];
      TESSERA_CHECK(shard.at("file").as_string() == shard_file_name(r, index.ranks), IoError, "shard ", r, " is '",
                    shard.at("file").as_string(), "', not ", shard_file_name(r, index.ranks));
      index.bytes.push_back(static_cast<std::int64_t>(shard.at("bytes").as_number()));
    }
  } catch (const Error& e) {
    throw IoError(cat("'", path, "' is not a sharded checkpoint's index: ", e.what()));
  }
  return index;
}

TESSERA_LINKAGE void detail::remove_other_shard_files(const std::string& dir, int ranks) {
  const std::string suffix = cat("-of-", shard_file_name(0, ranks).substr(15));  // "-of-00004.safetensors"
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    // shard-NNNNN-of-MMMMM.safetensors of another M: an earlier save's, which no index names.
    if (name.size() == 32 && name.rfind("shard-", 0) == 0 && name.compare(11, 4, "-of-") == 0 &&
        name.compare(name.size() - 12, 12, ".safetensors") == 0 && name.compare(11, std::string::npos, suffix) != 0 &&
        entry.is_regular_file(ec))
      std::filesystem::remove(entry.path(), ec);
  }
}

TESSERA_LINKAGE auto detail::open_shard_set(const std::string& dir, const char* who) -> ShardSet {
  ShardSet set;
  try {
    set.index = read_shard_index(dir);
  } catch (const IoError& e) {
    throw IoError(cat(who, ": ", e.what()));
  }
  const int n = set.index.ranks;
  std::vector<std::string> problems;
  for (int r = 0; r < n; ++r) {
    const std::string path = (std::filesystem::path(dir) / shard_file_name(r, n)).string();
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) {
      problems.push_back(cat("missing shard '", path, "' (rank ", r, " of the ", n, " that saved it): ", ec.message()));
      continue;
    }
    if (static_cast<std::int64_t>(size) != set.index.bytes[static_cast<std::size_t>(r)]) {
      problems.push_back(cat("shard '", path, "' has ", size, " bytes, the index says ",
                             set.index.bytes[static_cast<std::size_t>(r)], " (truncated, or written by another save)"));
      continue;
    }
    try {
      SafetensorsFile header = SafetensorsFile::load_header(path);
      const auto& meta = header.metadata();
      const auto entry = [&](const char* key) { return meta.count(key) ? meta.at(key) : std::string("(none)"); };
      if (entry("format") != kShardedCheckpointFormat || entry("shard.rank") != std::to_string(r) ||
          entry("shard.ranks") != std::to_string(n)) {
        problems.push_back(cat("shard '", path, "' says format ", entry("format"), ", rank ", entry("shard.rank"), " of ",
                               entry("shard.ranks"), ": not rank ", r, " of ", n, " of a ", kShardedCheckpointFormat));
        continue;
      }
      if (entry("shard.save") != set.index.save) {
        problems.push_back(cat("shard '", path, "' belongs to save ", entry("shard.save"), ", the index to save ",
                               set.index.save, " (a save was cut short and left files of two saves)"));
        continue;
      }
      for (const auto& [key, value] : meta) {
        if (key.rfind("piece.", 0) != 0) continue;
        const std::string name = key.substr(6);
        SavedPiece piece;
        piece.rank = r;
        if (!header.has(name) || !parse_piece_entry(value, piece.first, piece.whole) ||
            header.info(name).shape.rank() != 1) {
          problems.push_back(cat("shard '", path, "': piece '", name, "' has a malformed entry '", value, "'"));
          continue;
        }
        piece.length = header.info(name).shape[0];
        piece.dtype = header.info(name).dtype;
        set.pieces[name].push_back(piece);
      }
      set.headers.push_back(std::move(header));
    } catch (const IoError& e) {
      problems.push_back(e.what());
    }
  }
  // Each tensor's pieces must tile it: no gap (a shard lost) and no overlap.
  for (auto& [name, pieces] : set.pieces) {
    if (!problems.empty()) break;
    std::sort(pieces.begin(), pieces.end(), [](const SavedPiece& a, const SavedPiece& b) { return a.first < b.first; });
    std::int64_t next = 0;
    for (const SavedPiece& p : pieces) {
      if (p.whole != pieces.front().whole || p.dtype != pieces.front().dtype)
        problems.push_back(cat("tensor '", name, "': shard ", p.rank, " holds a piece of ", dtype_name(p.dtype), " ",
                               p.whole, ", another shard of ", dtype_name(pieces.front().dtype), " ", pieces.front().whole));
      else if (p.first != next)
        problems.push_back(cat("tensor '", name, "': elements [", std::min(next, p.first), ", ", std::max(next, p.first),
                               ") are ", p.first > next ? "in no shard" : "in two shards", " (shard ", p.rank, ")"));
      next = std::max(next, p.first + p.length);
    }
    if (next != pieces.front().whole.numel())
      problems.push_back(cat("tensor '", name, "' ", pieces.front().whole, ": the shards hold its elements up to ", next,
                             " of ", pieces.front().whole.numel()));
  }
  if (!problems.empty()) throw IoError(shard_problems_text(who, dir, problems));
  return set;
}

TESSERA_LINKAGE void detail::verify_shard_checksums(const SafetensorsFile& file, std::vector<std::string>& problems) {
  for (const auto& name : file.names()) {
    const auto& meta = file.metadata();
    const auto it = meta.find("checksum." + name);
    const TensorInfo& info = file.info(name);
    const std::string actual = hex64(checksum64(file.raw(name), info.end - info.begin));
    if (it == meta.end())
      problems.push_back(cat("shard '", file.path(), "': tensor '", name, "' has no checksum entry"));
    else if (it->second != actual)
      problems.push_back(cat("shard '", file.path(), "': tensor '", name, "' is corrupt (checksum ", actual,
                             ", written as ", it->second, ")"));
  }
}

TESSERA_LINKAGE std::string detail::shard_problems_text(const char* who, const std::string& dir,
                                                        const std::vector<std::string>& problems) {
  std::string msg = cat(who, ": '", dir, "': nothing was loaded:");
  for (std::size_t i = 0; i < problems.size() && i < kMaxListedProblems; ++i) msg += "\n  - " + problems[i];
  if (problems.size() > kMaxListedProblems) msg += cat("\n  ... and ", problems.size() - kMaxListedProblems, " more");
  return msg;
}

TESSERA_LINKAGE void consolidate_sharded_checkpoint(const std::string& dir, const std::string& path) {
  constexpr const char* who = "consolidate_sharded_checkpoint";
  const detail::ShardSet set = detail::open_shard_set(dir, who);
  const int n = set.index.ranks;
  std::vector<SafetensorsFile> files;
  std::vector<std::string> problems;
  for (int r = 0; r < n; ++r) {
    files.push_back(SafetensorsFile::load(set.headers[static_cast<std::size_t>(r)].path()));
    detail::verify_shard_checksums(files.back(), problems);
  }
  if (!problems.empty()) throw IoError(detail::shard_problems_text(who, dir, problems));
  SafetensorsWriter writer;
  // Whole tensors from their pieces (and under the names of buffers that alias them); rank 0's
  // other tensors (buffers) as they are.
  std::multimap<std::string, std::string> aliases;  // parameter -> buffer
  for (const auto& [key, value] : files[0].metadata())
    if (key.rfind("alias.", 0) == 0) aliases.emplace(value, key.substr(6));
  for (const auto& [name, pieces] : set.pieces) {
    const std::size_t size = dtype_size(pieces.front().dtype);
    std::vector<std::byte> bytes(static_cast<std::size_t>(pieces.front().whole.numel()) * size);
    for (const auto& p : pieces)
      std::memcpy(bytes.data() + static_cast<std::size_t>(p.first) * size, files[static_cast<std::size_t>(p.rank)].raw(name),
                  static_cast<std::size_t>(p.length) * size);
    writer.add_raw(name, pieces.front().dtype, pieces.front().whole, bytes.data(), bytes.size());
    const auto [first, last] = aliases.equal_range(name);
    for (auto it = first; it != last; ++it) writer.add_raw(it->second, pieces.front().dtype, pieces.front().whole, bytes.data(), bytes.size());
  }
  for (const auto& name : files[0].names()) {
    if (set.pieces.count(name)) continue;
    const TensorInfo& info = files[0].info(name);
    writer.add_raw(name, info.dtype, info.shape, files[0].raw(name), info.end - info.begin);
  }
  // Metadata: rank 0's integers; every rank's generators under save_checkpoint's per-rank names.
  for (const auto& [key, value] : files[0].metadata())
    if (key.rfind("piece.", 0) != 0 && key.rfind("checksum.", 0) != 0 && key.rfind("shard.", 0) != 0 &&
        key.rfind("rng.", 0) != 0 && key.rfind("alias.", 0) != 0 && key != "format")
      writer.set_metadata(key, value);
  for (int r = 0; r < n; ++r)
    for (const auto& [key, value] : files[static_cast<std::size_t>(r)].metadata())
      if (key.rfind("rng.", 0) == 0) writer.set_metadata(detail::rank_rng_key(r, key.substr(4)), value);
  writer.set_metadata("train.ranks", std::to_string(n));
  writer.set_metadata("format", "tessera-checkpoint-" + std::to_string(kCheckpointVersion));
  writer.write(path);
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
