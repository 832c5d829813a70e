// State dicts: a model's parameters and buffers by their PyTorch names, in a safetensors file, so
// weights move between Tessera and PyTorch / torchvision in both directions.
//
//   save_state_dict(path, model)                  what torch.save(model.state_dict()) holds, as safetensors:
//                                                 parameters and buffers under their names, in model
//                                                 order, BatchNorm's num_batches_tracked as an I64
//                                                 scalar; metadata {"format": "pt"} as safetensors.torch
//                                                 writes it. Atomic (temporary file + rename).
//   load_state_dict(path_or_file, model, strict)  model.load_state_dict(state_dict, strict) by name.
//
// Loading follows torch.nn.Module.load_state_dict:
//   - strict (default): every model key must be in the file and every file key in the model;
//     otherwise one IoError lists all of them, as PyTorch does:
//       Missing key(s) in state_dict: "fc.weight", "fc.bias".
//       Unexpected key(s) in state_dict: "head.weight".
//     strict = false returns them instead (StateDictKeys, torch's _IncompatibleKeys) and loads the rest.
//   - a shape mismatch is an error in both modes and names the key and both shapes:
//       size mismatch for fc.weight: copying a param with shape (10, 2048) from checkpoint, the shape
//       in current model is (1000, 2048).
//   - dtypes convert to the model's scalar: F64, F32, F16 and BF16 into float or double parameters
//     and buffers (torch's copy_ converts the same way); an integer or bool tensor for a
//     floating-point one is an error. num_batches_tracked takes any integer dtype.
//   - num_batches_tracked may be absent (older PyTorch, files written without it): the counter is
//     left as it is, as torch's BatchNorm does for a state_dict without version metadata.
//   - all or nothing: every tensor is checked and converted into host memory first; only when the
//     whole file matches is anything copied into the model. A failed load leaves the model as it was.
// Random generators (Dropout) are not part of a state dict, as in PyTorch; checkpoints
// (train/checkpoint.hpp) keep them.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/concepts.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/io/safetensors.hpp"

namespace tessera {

// The keys a non-strict load did not match (empty vectors after a strict load).
struct StateDictKeys {
  std::vector<std::string> missing_keys;     // in the model, not in the file (left unchanged)
  std::vector<std::string> unexpected_keys;  // in the file, not in the model (ignored)
};

namespace detail {

inline bool is_float_dtype(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16;
}
inline bool is_integer_dtype(DType t) {
  return t == DType::I64 || t == DType::I32 || t == DType::I16 || t == DType::I8 || t == DType::U8;
}

struct StateDictSaver {
  SafetensorsWriter& writer;
  template <class P>
  void parameter(const std::string& name, P& p) {
    writer.add(name, p.value);
  }
  template <class T>
  void buffer(const std::string& name, T& t) {
    writer.add(name, t);
  }
  void integer_buffer(const std::string& name, std::int64_t& v) {
    writer.add_raw(name, DType::I64, Shape{}, &v, sizeof v);  // torch: a 0-dim int64 tensor
  }
  template <class R>
  void rng(const std::string&, R&) {}
};

// Pass 1 (stage): checks every model key against the file and converts the data into host
// tensors. Pass 2 (commit) copies the staged tensors into the model, in the same visit order.
template <class S>
struct StateDictStager {
  const SafetensorsFile& file;
  std::vector<std::string> missing, problems;
  std::map<std::string, bool> seen;               // model keys
  std::vector<Tensor<S, Cpu>> staged;             // per floating-point tensor found, in visit order
  std::vector<std::int64_t> staged_integers;      // per num_batches_tracked found

  template <class P>
  void parameter(const std::string& name, P& p) {
    buffer(name, p.value);
  }
  template <class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    seen[name] = true;
    if (!file.has(name)) {
      missing.push_back(name);
      return;
    }
    const TensorInfo& info = file.info(name);
    if (info.shape != t.shape()) {
      problems.push_back(cat("size mismatch for ", name, ": copying a param with shape ", info.shape,
                             " from checkpoint, the shape in current model is ", t.shape(), "."));
      return;
    }
    if (!is_float_dtype(info.dtype)) {
      problems.push_back(cat("dtype mismatch for ", name, ": the checkpoint holds ", dtype_name(info.dtype),
                             ", the model needs a floating-point tensor (F64, F32, F16 or BF16)."));
      return;
    }
    staged.push_back(file.tensor<S>(name));
  }
  void integer_buffer(const std::string& name, std::int64_t&) {
    seen[name] = true;
    if (!file.has(name)) return;  // tolerated, as torch's BatchNorm tolerates it
    const TensorInfo& info = file.info(name);
    if (info.shape != Shape{} || !is_integer_dtype(info.dtype)) {
      problems.push_back(cat("size or dtype mismatch for ", name, ": copying ", dtype_name(info.dtype), " of shape ",
                             info.shape, " from checkpoint, the model holds an integer scalar (I64, shape ())."));
      return;
    }
    staged_integers.push_back(file.tensor<std::int64_t>(name)[0]);
  }
  template <class R>
  void rng(const std::string&, R&) {}
};

template <class S>
struct StateDictCommitter {
  StateDictStager<S>& stage;
  std::size_t next = 0, next_integer = 0;

  template <class P>
  void parameter(const std::string& name, P& p) {
    buffer(name, p.value);
  }
  template <class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    if (!stage.file.has(name)) return;
    const Tensor<S, Cpu>& src = stage.staged[next++];
    D::copy_to_device(t.data(), src.data(), src.bytes());
  }
  void integer_buffer(const std::string& name, std::int64_t& v) {
    if (stage.file.has(name)) v = stage.staged_integers[next_integer++];
  }
  template <class R>
  void rng(const std::string&, R&) {}
};

template <class Model>
std::string model_name(Model& model) {
  if constexpr (requires { std::string(model.name()); }) return std::string(model.name());
  else return "the model";
}

inline std::string quoted_list(const std::vector<std::string>& keys) {
  std::string out;
  for (std::size_t i = 0; i < keys.size(); ++i) out += (i ? ", \"" : "\"") + keys[i] + "\"";
  return out + ".";
}

}  // namespace detail

template <class Model>
void save_state_dict(const std::string& path, Model& model) {
  static_assert(check_visitable<Model>());
  SafetensorsWriter writer;
  detail::StateDictSaver saver{writer};
  model.visit(saver, "");
  writer.set_metadata("format", "pt");
  writer.write(path);
}

template <class Model>
StateDictKeys load_state_dict(const SafetensorsFile& file, Model& model, bool strict = true) {
  static_assert(check_visitable<Model>());
  using S = typename Model::Env::Scalar;
  using D = typename Model::Env::Device;
  detail::StateDictStager<S> stage{file};
  model.visit(stage, "");
  StateDictKeys keys;
  keys.missing_keys = stage.missing;
  for (const auto& name : file.names())
    if (!stage.seen.count(name)) keys.unexpected_keys.push_back(name);

  std::vector<std::string> errors;
  if (strict && !keys.missing_keys.empty())
    errors.push_back("Missing key(s) in state_dict: " + detail::quoted_list(keys.missing_keys));
  if (strict && !keys.unexpected_keys.empty())
    errors.push_back("Unexpected key(s) in state_dict: " + detail::quoted_list(keys.unexpected_keys));
  errors.insert(errors.end(), stage.problems.begin(), stage.problems.end());
  if (!errors.empty()) {
    std::string msg = detail::cat("load_state_dict: '", file.path(), "': Error(s) in loading state_dict for ",
                          detail::model_name(model), " (nothing was loaded):");
    for (const auto& e : errors) msg += "\n  " + e;
    throw IoError(msg);
  }
  detail::StateDictCommitter<S> commit{stage};
  model.visit(commit, "");
  D::synchronize();
  return keys;
}

template <class Model>
StateDictKeys load_state_dict(const std::string& path, Model& model, bool strict = true) {
  std::optional<SafetensorsFile> file;
  try {
    file.emplace(SafetensorsFile::load(path));
  } catch (const IoError& e) {  // unreadable, truncated or malformed: says which call failed
    throw IoError(detail::cat("load_state_dict: ", e.what(), " (nothing was loaded)"));
  }
  return load_state_dict(*file, model, strict);
}

}  // namespace tessera
