// Fuzz target: safetensors parsing (include/tessera/io/safetensors.hpp) and checkpoint loading
// (include/tessera/train/checkpoint.hpp: format, version, metadata, names, shapes, dtypes,
// non-finite values) into a small MLP with Dropout (a generator in the metadata) and SGD with
// momentum (optimizer state). Expected: success or a tessera error (IoError, ArgumentError);
// loading is all or nothing, so a failed load must leave the model's parameters untouched.
//
// Built with -DTESSERA_FUZZ_MAKE_SEED instead, it is an ordinary program that writes a valid
// checkpoint of the same model, after one SGD step (so momentum buffers are in it), to argv[1]:
// scripts/fuzz.sh makes this seed fresh on every run, so it always matches the current format.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/io/state_dict.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/dropout.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/train/checkpoint.hpp"

namespace {

using E = tessera::CpuLocal;
using Net = tessera::Sequential<tessera::Linear<E>, tessera::ReLU<E>, tessera::Dropout<E>, tessera::Linear<E>>;

struct Mlp {
  tessera::Rng rng{4};
  Net model{tessera::Linear<E>(4, 3, rng), tessera::ReLU<E>(), tessera::Dropout<E>(0.5, 7), tessera::Linear<E>(3, 2, rng)};
  tessera::NamedTensors<E> named = tessera::named_tensors(model);
  tessera::Sgd<E> sgd{named, {.lr = 0.05, .momentum = 0.9}};
};

std::vector<std::vector<float>> parameters(Mlp& m) {
  std::vector<std::vector<float>> out;
  for (auto& [name, p] : m.named.parameters) out.emplace_back(p->value.data(), p->value.data() + p->value.numel());
  return out;
}

}  // namespace

#ifdef TESSERA_FUZZ_MAKE_SEED
#include <cstdio>
int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.safetensors\n", argv[0]);
    return 2;
  }
  Mlp m;
  float g = 0.25f;
  for (auto& [name, p] : m.named.parameters)
    for (long i = 0; i < p->grad.numel(); ++i) p->grad.data()[i] = (g = -g * 1.5f);
  m.sgd.step();
  tessera::save_checkpoint(argv[1], m.model, m.sgd, {.epoch = 1, .global_step = 6, .loader_epoch = 1,
                                                     .loader_next_batch = 0, .loader_batch_size = 16,
                                                     .loader_seed = 1, .loader_samples = 96, .loader_world_size = 1});
  return 0;
}
#else
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = tessera_fuzz::mem_file().write(data, size);
  // The file as a user reads it: every tensor converted to float and double, and the metadata.
  try {
    const auto file = tessera::SafetensorsFile::load(path);
    for (const auto& name : file.names()) {
      const auto& info = file.info(name);
      if (info.end < info.begin) __builtin_trap();
      try {
        const auto f = file.tensor<float>(name);
        const auto d = file.tensor<double>(name);
        if (f.numel() != info.shape.numel() || d.numel() != info.shape.numel()) __builtin_trap();
      } catch (const tessera::IoError&) {  // dtypes without a conversion
      }
    }
    std::size_t meta = 0;
    for (const auto& [k, v] : file.metadata()) meta += k.size() + v.size();
    if (meta > size) __builtin_trap();
  } catch (const tessera::IoError&) {
  }
  // As a checkpoint of the MLP: loaded whole or not at all.
  static Mlp* m = new Mlp();  // leaked; loads into it overwrite everything they touch
  const auto before = parameters(*m);
  try {
    (void)tessera::load_checkpoint(path, m->model, m->sgd);
  } catch (const tessera::Error&) {
    if (parameters(*m) != before) __builtin_trap();  // a failed load changed the model
  }
  return 0;
}
#endif
