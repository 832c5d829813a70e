// Checkpoints: round trip, all-or-nothing loading, truncated and tampered files, exact resume.
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tessera/comm/local.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/layers/dropout.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/sequential.hpp"
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
  auto named = named_tensors(model);
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
  NamedTensors<CpuLocal> named = named_tensors(model);
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
  // BatchNorm's num_batches_tracked too: one per training batch (96 samples / 16), an I64 scalar as in torch.
  CHECK(b.model.stem_bn().num_batches_tracked() == 6);
  CHECK(SafetensorsFile::load((dir / "a.safetensors").string()).info("bn1.num_batches_tracked").dtype == DType::I64);
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

  // A crafted header whose shape product overflows 64 bits must not pass the size check.
  auto crafted = [&](const std::string& json) {
    std::string out(8, '\0');
    const std::uint64_t n = json.size();
    std::memcpy(out.data(), &n, 8);
    return write("crafted.safetensors", out + json);
  };
  expect_error(crafted(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
               "more elements than fit");
  expect_error(crafted(R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,0]}})"), "2^63");
  expect_error(crafted(R"({"\u00zz":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})"), "hex digit");
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint of another model lists every mismatch and loads nothing", "[train]") {
  const auto dir = temp_dir();
  const auto path = (dir / "lenet.safetensors").string();
  auto lenet = lenet5<E>(1, 28, 10);
  auto named = named_tensors(lenet);
  Sgd<E> sgd(named, {.lr = 0.1});
  save_checkpoint(path, lenet, sgd, TrainState{});
  Run b(1);
  const auto before = snapshot(b.model);
  try {
    b.trainer.load(path);
    FAIL("expected IoError");
  } catch (const IoError& e) {
    const std::string msg = e.what();
    // LeNet-5 and ResNet-8 share the name conv1.weight but not its shape.
    CHECK_THAT(msg, Catch::Contains("tensor 'conv1.weight': file has F32 (6, 1, 5, 5), model has F32 (16, 1, 3, 3)") &&
                        Catch::Contains("missing tensor 'bn1.weight'") &&
                        Catch::Contains("unexpected tensor 'fc1.weight'") && Catch::Contains("nothing was loaded"));
  }
  CHECK(identical(before, snapshot(b.model)));
  fs::remove_all(dir);
}

TEST_CASE("Resume is exact with Dropout: its generator state is in the checkpoint", "[train]") {
  const auto dir = temp_dir();
  using Net = Sequential<Flatten<E>, Linear<E>, ReLU<E>, Dropout<E>, Linear<E>>;
  struct DropoutRun {
    Rng rng{4};
    Net model{Flatten<E>(), Linear<E>(100, 32, rng), ReLU<E>(), Dropout<E>(0.5, 77), Linear<E>(32, 4, rng)};
    NamedTensors<CpuLocal> named = named_tensors(model);
    Sgd<E> sgd{named, {.lr = 0.05, .momentum = 0.9}};
    Trainer<Net, Sgd<E>> trainer;
    explicit DropoutRun(const std::string& ckpt = "")
        : trainer(model, sgd, ConstantLr{0.05}, {.epochs = 3, .checkpoint_path = ckpt, .verbose = false}) {}
  };
  DropoutRun straight;
  DataLoader<float> l1(data(), {.batch_size = 16, .seed = 1});
  straight.trainer.fit(l1);
  {
    DropoutRun first((dir / "drop.safetensors").string());
    DataLoader<float> l2(data(), {.batch_size = 16, .seed = 1});
    first.trainer.fit(l2, nullptr, /*stop_after=*/2);
  }
  DropoutRun resumed;
  resumed.trainer.load((dir / "drop.safetensors").string());
  CHECK(SafetensorsFile::load((dir / "drop.safetensors").string()).metadata().count("3.rng") == 1);
  DataLoader<float> l3(data(), {.batch_size = 16, .seed = 1});
  resumed.trainer.fit(l3);
  CHECK(identical(snapshot(straight.model), snapshot(resumed.model)));
  fs::remove_all(dir);
}

TEST_CASE("Resume refuses a data loader with other settings than the checkpoint's", "[train]") {
  const auto dir = temp_dir();
  {
    Run first(3, (dir / "a.safetensors").string());
    DataLoader<float> loader(data(), {.batch_size = 16, .seed = 1});
    first.trainer.fit(loader, nullptr, 1);
  }
  Run resumed(3);
  resumed.trainer.load((dir / "a.safetensors").string());
  DataLoader<float> other_batch(data(), {.batch_size = 8, .seed = 1});
  CHECK_THROWS_WITH(resumed.trainer.fit(other_batch), Catch::Contains("batch size 16"));
  DataLoader<float> other_seed(data(), {.batch_size = 16, .seed = 2});
  CHECK_THROWS_WITH(resumed.trainer.fit(other_seed), Catch::Contains("seed 1"));
  fs::remove_all(dir);
}
