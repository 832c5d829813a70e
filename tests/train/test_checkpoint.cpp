// Checkpoints: round trip, all-or-nothing loading, truncated and tampered files, exact resume.
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tessera/comm/local.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/optim/schedule.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;
using E = CpuLocal;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir() {
  auto dir = fs::temp_directory_path() / ("tessera_ckpt_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

template <class M>
std::vector<Tensor<float>> snapshot(M& model) {
  std::vector<Tensor<float>> out;
  auto named = named_tensors<float, Cpu>(model);
  for (auto& [n, p] : named.parameters) out.push_back(p->value);
  for (auto& [n, t] : named.buffers) out.push_back(*t);
  return out;
}

bool identical(const std::vector<Tensor<float>>& a, const std::vector<Tensor<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].shape() != b[i].shape()) return false;
    if (std::memcmp(a[i].data(), b[i].data(), a[i].bytes()) != 0) return false;
  }
  return true;
}

// A small ResNet (BN buffers, projection shortcuts) trained with SGD + momentum on synthetic data.
struct Run {
  ResNet<E, BasicBlock> model = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 4, .seed = 3});
  NamedTensors<float, Cpu> named = named_tensors<float, Cpu>(model);
  Sgd<E> sgd{named, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4}};
  Trainer<ResNet<E, BasicBlock>, Sgd<E>> trainer;
  Run(std::int64_t epochs, const std::string& ckpt = "")
      : trainer(model, sgd, CosineLr{0.05, 3.0, 0.0}, {.epochs = epochs, .checkpoint_path = ckpt, .verbose = false}) {}
};

const Dataset& data() {
  static const Dataset d = SyntheticImages(96, 1, 10, 10, 4, 5);
  return d;
}
}  // namespace

TEST_CASE("Checkpoint: save then load restores parameters, buffers and optimizer state", "[train]") {
  const auto dir = temp_dir();
  Run a(1);
  DataLoader<float> loader(data(), {.batch_size = 16, .seed = 1});
  a.trainer.fit(loader);
  a.trainer.save((dir / "a.safetensors").string());

  Run b(1);
  CHECK_FALSE(identical(snapshot(a.model), snapshot(b.model)));
  b.trainer.load((dir / "a.safetensors").string());
  CHECK(identical(snapshot(a.model), snapshot(b.model)));
  CHECK(b.trainer.state().epoch == 1);
  CHECK(b.trainer.state().global_step == 6);
  CHECK(b.sgd.steps() == a.sgd.steps());
  fs::remove_all(dir);
}

TEST_CASE("Resume: 2 epochs + save + load + 1 epoch equals 3 epochs straight, bit for bit", "[train]") {
  const auto dir = temp_dir();
  Run straight(3);
  DataLoader<float> loader1(data(), {.batch_size = 16, .seed = 1});
  straight.trainer.fit(loader1);

  {
    Run first(2, (dir / "two.safetensors").string());
    DataLoader<float> loader2(data(), {.batch_size = 16, .seed = 1});
    first.trainer.fit(loader2);
  }
  Run resumed(3);
  resumed.trainer.load((dir / "two.safetensors").string());
  DataLoader<float> loader3(data(), {.batch_size = 16, .seed = 1});
  resumed.trainer.fit(loader3);
  CHECK(identical(snapshot(straight.model), snapshot(resumed.model)));
  CHECK(resumed.trainer.state().global_step == straight.trainer.state().global_step);
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint: truncated or tampered files give an IoError and load nothing", "[train]") {
  const auto dir = temp_dir();
  const auto path = (dir / "good.safetensors").string();
  Run a(1);
  a.trainer.save(path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto write = [&](const std::string& name, const std::string& content) {
    const auto p = (dir / name).string();
    std::ofstream(p, std::ios::binary) << content;
    return p;
  };
  Run b(1);
  const auto before = snapshot(b.model);
  auto expect_error = [&](const std::string& p, const std::string& needle) {
    try {
      b.trainer.load(p);
      FAIL("expected IoError for " << p);
    } catch (const IoError& e) {
      INFO(e.what());
      CHECK_THAT(std::string(e.what()), Catch::Contains(needle));
    }
    CHECK(identical(before, snapshot(b.model)));  // nothing half-loaded
  };
  for (std::size_t cut : {std::size_t{0}, std::size_t{5}, std::size_t{100}, bytes.size() / 2, bytes.size() - 1})
    expect_error(write("cut.safetensors", bytes.substr(0, cut)), "safetensors");

  std::string wrong_shape = bytes;
  const auto pos = wrong_shape.find("\"fc.weight\":{\"dtype\":\"F32\",\"shape\":[4,64]");
  REQUIRE(pos != std::string::npos);
  wrong_shape.replace(wrong_shape.find("[4,64]", pos), 6, "[8,32]");
  expect_error(write("shape.safetensors", wrong_shape), "fc.weight");

  std::string wrong_dtype = bytes;
  wrong_dtype.replace(wrong_dtype.find("\"F32\""), 5, "\"I32\"");
  expect_error(write("dtype.safetensors", wrong_dtype), "I32");

  std::string garbage_header = bytes;
  garbage_header[10] = '#';
  expect_error(write("json.safetensors", garbage_header), "malformed header");

  expect_error((dir / "missing.safetensors").string(), "cannot open");
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint of another model lists every mismatch and loads nothing", "[train]") {
  const auto dir = temp_dir();
  const auto path = (dir / "lenet.safetensors").string();
  auto lenet = lenet5<E>(1, 28, 10);
  auto named = named_tensors<float, Cpu>(lenet);
  Sgd<E> sgd(named, {.lr = 0.1});
  save_checkpoint(path, lenet, sgd, TrainState{});
  Run b(1);
  const auto before = snapshot(b.model);
  try {
    b.trainer.load(path);
    FAIL("expected IoError");
  } catch (const IoError& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("missing tensor 'conv1.weight'") && Catch::Contains("unexpected tensor '0.weight'") &&
                        Catch::Contains("nothing was loaded"));
  }
  CHECK(identical(before, snapshot(b.model)));
  fs::remove_all(dir);
}
