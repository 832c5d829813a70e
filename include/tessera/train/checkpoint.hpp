// Checkpoints: model parameters, buffers (BN running statistics) and optimizer state in one
// safetensors file, plus the training position (epoch, step, data-loader position, RNG state) in
// its metadata, with the state of every random generator a layer owns (Dropout masks), so that
// resuming continues exactly where the run stopped.
//
// Tensor names are the model's state_dict names ("layer1.0.conv1.weight", BatchNorm's
// "bn1.num_batches_tracked" as an I64 scalar) and the optimizer's
// ("optim.momentum_buffer.layer1.0.conv1.weight"); from Python:
//   tensors, meta = safetensors_io.load("ckpt.safetensors")   (or safetensors.numpy.load_file)
//
// Loading is all-or-nothing: every name, shape and dtype is checked against the model first, and
// only when all match is anything copied. A missing, unexpected or mismatched tensor gives an
// IoError that lists every problem, so a wrong file never half-loads.
#pragma once

#include <cinttypes>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tessera/core/concepts.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/random.hpp"
#include "tessera/io/safetensors.hpp"

namespace tessera {

// Where training stands. Stored in the file's metadata as decimal strings.
struct TrainState {
  std::int64_t epoch = 0;              // epochs completed
  std::int64_t global_step = 0;        // optimizer steps taken
  std::int64_t loader_epoch = 0;       // the data loader's position: epoch being read ...
  std::int64_t loader_next_batch = 0;  // ... and the next batch index within it
  // What the position means: resuming with another batch size, seed, dataset or world size would
  // silently read other samples, so the Trainer checks these against its loader (0 = unknown).
  std::int64_t loader_batch_size = 0, loader_seed = 0, loader_samples = 0, loader_world_size = 0;
};

namespace detail {

inline std::string rng_to_string(const Rng::State& s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %d %a", s.words[0],
                s.words[1], s.words[2], s.words[3], s.has_spare_normal ? 1 : 0, s.spare_normal);
  return buf;
}

inline bool rng_from_string(const std::string& text, Rng::State& s) {
  int spare = 0;
  const int n = std::sscanf(text.c_str(), "%" SCNx64 " %" SCNx64 " %" SCNx64 " %" SCNx64 " %d %la", &s.words[0],
                            &s.words[1], &s.words[2], &s.words[3], &spare, &s.spare_normal);
  s.has_spare_normal = spare != 0;
  return n == 6;
}

struct CheckpointSaver {
  SafetensorsWriter& writer;
  template <class P>
  void parameter(const std::string& name, P& p) {
    writer.add(name, p.value);
  }
  template <class T>
  void buffer(const std::string& name, T& t) {
    writer.add(name, t);
  }
  // BatchNorm's num_batches_tracked: an I64 scalar tensor, as in torch's state_dict.
  void integer_buffer(const std::string& name, std::int64_t& v) {
    writer.add_raw(name, DType::I64, Shape{}, &v, sizeof v);
  }
  void integer(const std::string& name, std::int64_t& v) { writer.set_metadata(name, std::to_string(v)); }
  void rng(const std::string& name, Rng& r) { writer.set_metadata(name, rng_to_string(r.state())); }
};

// Two passes over the same visit: first `check` collects every problem, then `copy` loads.
struct CheckpointLoader {
  const SafetensorsFile& file;
  bool copy = false;
  std::vector<std::string> problems;
  std::set<std::string> seen;

  template <class P>
  void parameter(const std::string& name, P& p) {
    buffer(name, p.value);
  }
  template <class S, class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    seen.insert(name);
    if (!file.has(name)) {
      problems.push_back("missing tensor '" + name + "' (shape " + t.shape().str() + ")");
      return;
    }
    const TensorInfo& info = file.info(name);
    if (info.shape != t.shape() || info.dtype != dtype_of<S>()) {
      problems.push_back(cat("tensor '", name, "': file has ", dtype_name(info.dtype), " ", info.shape,
                             ", model has ", dtype_name(dtype_of<S>()), " ", t.shape()));
      return;
    }
    if (copy) file.read_into(name, t);
  }
  // Absent in checkpoints written before BatchNorm kept it: the counter then stays as it is.
  void integer_buffer(const std::string& name, std::int64_t& v) {
    seen.insert(name);
    if (!file.has(name)) return;
    const TensorInfo& info = file.info(name);
    if (info.shape != Shape{} || info.dtype != DType::I64) {
      problems.push_back(cat("tensor '", name, "': file has ", dtype_name(info.dtype), " ", info.shape,
                             ", model has I64 ()"));
      return;
    }
    if (copy) v = file.tensor<std::int64_t>(name)[0];
  }
  void integer(const std::string& name, std::int64_t& v) {
    auto it = file.metadata().find(name);
    if (it == file.metadata().end()) {
      problems.push_back("missing metadata entry '" + name + "'");
      return;
    }
    try {
      std::size_t used = 0;
      const long long parsed = std::stoll(it->second, &used);
      if (used != it->second.size()) throw std::invalid_argument("trailing characters");
      if (copy) v = parsed;
    } catch (const std::exception&) {
      problems.push_back("metadata entry '" + name + "' = '" + it->second + "' is not an integer");
    }
  }
  void rng(const std::string& name, Rng& r) {
    auto it = file.metadata().find(name);
    Rng::State s;
    if (it == file.metadata().end() || !rng_from_string(it->second, s)) {
      problems.push_back("missing or malformed generator state '" + name + "'");
      return;
    }
    if (copy) r.set_state(s);
  }
};

template <class Model, class Optimizer>
void visit_all(Model& model, Optimizer& optimizer, TrainState& state, auto& v) {
  static_assert(check_visitable<Model>());
  model.visit(v, "");
  optimizer.visit_state(v);
  v.integer("train.epoch", state.epoch);
  v.integer("train.global_step", state.global_step);
  v.integer("train.loader_epoch", state.loader_epoch);
  v.integer("train.loader_next_batch", state.loader_next_batch);
  v.integer("train.loader_batch_size", state.loader_batch_size);
  v.integer("train.loader_seed", state.loader_seed);
  v.integer("train.loader_samples", state.loader_samples);
  v.integer("train.loader_world_size", state.loader_world_size);
}

}  // namespace detail

template <class Model, class Optimizer>
void save_checkpoint(const std::string& path, Model& model, Optimizer& optimizer, TrainState state) {
  SafetensorsWriter writer;
  detail::CheckpointSaver saver{writer};
  detail::visit_all(model, optimizer, state, saver);
  writer.set_metadata("format", "tessera-checkpoint-1");
  writer.write(path);
}

template <class Model, class Optimizer>
TrainState load_checkpoint(const std::string& path, Model& model, Optimizer& optimizer) {
  const SafetensorsFile file = SafetensorsFile::load(path);
  TrainState state;
  detail::CheckpointLoader check{file};
  detail::visit_all(model, optimizer, state, check);
  for (const auto& name : file.names())
    if (!check.seen.count(name)) check.problems.push_back("unexpected tensor '" + name + "' (not in this model)");
  if (!check.problems.empty()) {
    std::string msg = "load_checkpoint: '" + path + "' does not match the model; nothing was loaded:";
    for (const auto& p : check.problems) msg += "\n  - " + p;
    throw IoError(msg);
  }
  detail::CheckpointLoader copy{file, true};
  detail::visit_all(model, optimizer, state, copy);
  return state;
}

}  // namespace tessera
