// Checkpoints: round trip, all-or-nothing loading, truncated and tampered files, exact resume;
// stale temporaries of killed saves, format versions, non-finite values, metadata out of range,
// resuming at another world size, and every rank's generators under data parallelism.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/io/state_dict.hpp"
#include "tessera/parallel/data_parallel.hpp"
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
fs::path checkpoint_temp_dir() {
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

const Dataset& checkpoint_images() {
  static const Dataset d = SyntheticImages(96, 1, 10, 10, 4, 5);
  return d;
}

std::string read_file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }
// `bytes` with the first `from` replaced by `to` (same length: the header length stays valid).
std::string edited(std::string bytes, const std::string& from, const std::string& to) {
  REQUIRE(from.size() == to.size());
  const auto at = bytes.find(from);
  REQUIRE(at != std::string::npos);
  return bytes.replace(at, from.size(), to);
}
std::vector<std::string> temporaries_of(const fs::path& dir, const std::string& file) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (name.rfind(file + ".tmp.", 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}
// The message of the exception `fn` throws as E ("" if none).
template <class E, class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("Checkpoint: save then load restores parameters, buffers and optimizer state", "[train]") {
  const auto dir = checkpoint_temp_dir();
  Run a(1);
  DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});
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
  const auto dir = checkpoint_temp_dir();
  Run straight(3);
  DataLoader<float> loader1(checkpoint_images(), {.batch_size = 16, .seed = 1});
  straight.trainer.fit(loader1);

  {
    Run first(2, (dir / "two.safetensors").string());
    DataLoader<float> loader2(checkpoint_images(), {.batch_size = 16, .seed = 1});
    first.trainer.fit(loader2);
  }
  Run resumed(3);
  resumed.trainer.load((dir / "two.safetensors").string());
  DataLoader<float> loader3(checkpoint_images(), {.batch_size = 16, .seed = 1});
  resumed.trainer.fit(loader3);
  CHECK(identical(snapshot(straight.model), snapshot(resumed.model)));
  CHECK(resumed.trainer.state().global_step == straight.trainer.state().global_step);
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint: truncated or tampered files give an IoError and load nothing", "[train]") {
  const auto dir = checkpoint_temp_dir();
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

TEST_CASE("Checkpoint of another model names the mismatches and loads nothing", "[train]") {
  const auto dir = checkpoint_temp_dir();
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
    // The first dozen problems by name, then the rest counted (LeNet-5's fc1.weight among them).
    CHECK_THAT(msg, Catch::Contains("tensor 'conv1.weight': file has F32 (6, 1, 5, 5), model has F32 (16, 1, 3, 3)") &&
                        Catch::Contains("missing tensor 'bn1.weight'") &&
                        Catch::Contains(" in the file not in this model") && Catch::Contains("nothing was loaded"));
  }
  CHECK(identical(before, snapshot(b.model)));
  fs::remove_all(dir);
}

// ResNet-20's checkpoint loaded into LeNet-5 once gave one line per tensor (213 for ResNet-50's):
// now a dozen, then a count by kind that says what it means.
TEST_CASE("Checkpoint of a much larger model: a dozen problems listed, the rest counted", "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const auto path = (dir / "resnet20.safetensors").string();
  auto r20 = resnet20<E>({.in_channels = 1, .num_classes = 10});
  auto r20_named = named_tensors(r20);
  Sgd<E> r20_sgd(r20_named, {.lr = 0.1});
  save_checkpoint(path, r20, r20_sgd, TrainState{});
  auto lenet = lenet5<E>(1, 28, 10);
  auto named = named_tensors(lenet);
  Sgd<E> sgd(named, {.lr = 0.1});
  const std::string msg = error_of<IoError>([&] { load_checkpoint(path, lenet, sgd); });
  CHECK(static_cast<std::size_t>(std::count(msg.begin(), msg.end(), '\n')) <= detail::kMaxListedProblems + 1);
  CHECK_THAT(msg, Catch::Contains("nothing was loaded") && Catch::Contains("more: ") &&
                      Catch::Contains("in the file not in this model") &&
                      Catch::Contains("is the checkpoint of another model?"));
  fs::remove_all(dir);
}

// A negative "optim.step" used to load: SGD then took its momentum buffer for empty and overwrote
// it on the next step, a silent restart of the momentum.
TEST_CASE("Checkpoint: a negative optimizer step is refused, not taken for a fresh start", "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  Run a(2);
  DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});
  a.trainer.fit(loader);
  REQUIRE(a.sgd.steps() == 12);
  const std::string path = (dir / "negative.safetensors").string();
  a.trainer.save(path);
  write_bytes(path, edited(read_file_text(path), "\"optim.step\":\"12\"", "\"optim.step\":\"-1\""));
  Run b(1);
  const auto before = snapshot(b.model);
  CHECK_THAT(error_of<IoError>([&] { b.trainer.load(path); }),
             Catch::Contains("metadata entry 'optim.step' = -1 is out of range: a count of steps or updates is never "
                             "negative"));
  CHECK(b.sgd.steps() == 0);
  CHECK(identical(before, snapshot(b.model)));
  fs::remove_all(dir);
}

TEST_CASE("Resume is exact with Dropout: its generator state is in the checkpoint", "[train]") {
  const auto dir = checkpoint_temp_dir();
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
  DataLoader<float> l1(checkpoint_images(), {.batch_size = 16, .seed = 1});
  straight.trainer.fit(l1);
  {
    DropoutRun first((dir / "drop.safetensors").string());
    DataLoader<float> l2(checkpoint_images(), {.batch_size = 16, .seed = 1});
    first.trainer.fit(l2, nullptr, /*stop_after=*/2);
  }
  DropoutRun resumed;
  resumed.trainer.load((dir / "drop.safetensors").string());
  CHECK(SafetensorsFile::load((dir / "drop.safetensors").string()).metadata().count("3.rng") == 1);
  DataLoader<float> l3(checkpoint_images(), {.batch_size = 16, .seed = 1});
  resumed.trainer.fit(l3);
  CHECK(identical(snapshot(straight.model), snapshot(resumed.model)));
  fs::remove_all(dir);
}

TEST_CASE("Resume refuses a data loader with other settings than the checkpoint's", "[train]") {
  const auto dir = checkpoint_temp_dir();
  {
    Run first(3, (dir / "a.safetensors").string());
    DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});
    first.trainer.fit(loader, nullptr, 1);
  }
  Run resumed(3);
  resumed.trainer.load((dir / "a.safetensors").string());
  DataLoader<float> other_batch(checkpoint_images(), {.batch_size = 8, .seed = 1});
  CHECK_THROWS_WITH(resumed.trainer.fit(other_batch), Catch::Contains("batch size 16"));
  DataLoader<float> other_seed(checkpoint_images(), {.batch_size = 16, .seed = 2});
  CHECK_THROWS_WITH(resumed.trainer.fit(other_seed), Catch::Contains("seed 1"));
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint: a save removes the temporaries that saves killed mid-write left, and nothing else",
          "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "c.safetensors").string();
  // A real orphan: a child process saving a 32 MiB file over and over, killed (SIGKILL) while a
  // temporary exists.
  std::vector<float> big(8u << 20, 1.0f);
  SafetensorsWriter writer;
  writer.add_raw("w", DType::F32, Shape{static_cast<std::int64_t>(big.size())}, big.data(), big.size() * 4);
  std::vector<std::string> orphans;
  for (int attempt = 0; attempt < 5 && orphans.empty(); ++attempt) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      for (;;) writer.write(path);
    }
    // Killed once a temporary holds at least 1 MiB: mid-write, as the orphans users found were.
    auto partly_written = [&] {
      for (const auto& name : temporaries_of(dir, "c.safetensors")) {
        std::error_code ec;
        if (fs::file_size(dir / name, ec) >= (1u << 20) && !ec) return true;
      }
      return false;
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!partly_written() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    orphans = temporaries_of(dir, "c.safetensors");
  }
  REQUIRE(orphans.size() == 1);
  CHECK(fs::file_size(dir / orphans[0]) > 0);
  // An orphan made by hand, a writer alive in this process (its temporary locked, as write() keeps
  // its own), and names that only look alike: only the two orphans may go.
  write_bytes((dir / "c.safetensors.tmp.Stale9").string(), "stale");
  const int live = ::open((dir / "c.safetensors.tmp.LIVE01").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  REQUIRE(live >= 0);
  REQUIRE(::flock(live, LOCK_EX | LOCK_NB) == 0);
  const std::vector<std::string> keep = {"c.safetensors.tmp.AB12c", "c.safetensors.tmp.AB12cde", "c.safetensors.tmp.AB_2cd",
                                         "d.safetensors.tmp.AB12cd", "c.safetensorsXtmp.AB12cd"};
  for (const auto& name : keep) write_bytes((dir / name).string(), "not ours");
  fs::create_directory(dir / "c.safetensors.tmp.Dir123");

  Run a(1);
  a.trainer.save(path);
  const auto left = temporaries_of(dir, "c.safetensors");
  CHECK(std::find(left.begin(), left.end(), orphans[0]) == left.end());
  CHECK(std::find(left.begin(), left.end(), "c.safetensors.tmp.Stale9") == left.end());
  CHECK(std::find(left.begin(), left.end(), "c.safetensors.tmp.LIVE01") != left.end());
  CHECK(std::find(left.begin(), left.end(), "c.safetensors.tmp.Dir123") != left.end());
  for (const auto& name : keep) CHECK(fs::exists(dir / name));
  ::close(live);
  Run b(1);
  b.trainer.load(path);
  CHECK(identical(snapshot(a.model), snapshot(b.model)));
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint: the format is checked and the error says what the file is", "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string good = (dir / "good.safetensors").string();
  Run a(1);
  a.trainer.save(good);
  const std::string bytes = read_file_text(good);
  Run b(1);
  const auto before = snapshot(b.model);
  auto load_error = [&](const std::string& p) { return error_of<IoError>([&] { b.trainer.load(p); }); };

  // No format at all: the same tensors, written without metadata (as another program might).
  const std::string bare = (dir / "x.safetensors").string();
  {
    SafetensorsWriter w;
    for (auto& [n, p] : a.named.parameters) w.add(n, p->value);
    w.write(bare);
  }
  CHECK_THAT(load_error(bare), Catch::Contains("'" + bare + "' is a safetensors file without Tessera checkpoint "
                                               "metadata (format missing); was it written by save_state_dict or by "
                                               "another program?"));
  const std::string state_dict = (dir / "sd.safetensors").string();
  save_state_dict(state_dict, a.model);
  CHECK_THAT(load_error(state_dict), Catch::Contains("is a state dict (format 'pt'") && Catch::Contains("load_state_dict"));
  const std::string newer = (dir / "newer.safetensors").string();
  write_bytes(newer, edited(bytes, "tessera-checkpoint-2", "tessera-checkpoint-7"));
  CHECK_THAT(load_error(newer),
             Catch::Contains("format 'tessera-checkpoint-7' is newer than this build reads (tessera-checkpoint-2)"));
  const std::string other = (dir / "other.safetensors").string();
  write_bytes(other, edited(bytes, "tessera-checkpoint-2", "keras-checkpoint-2xx"));
  CHECK_THAT(load_error(other), Catch::Contains("'keras-checkpoint-2xx', which is not a Tessera checkpoint format"));
  CHECK(identical(before, snapshot(b.model)));
  // Version 1 (no train.ranks) is still read.
  const std::string v1 = (dir / "v1.safetensors").string();
  write_bytes(v1, edited(edited(bytes, "tessera-checkpoint-2", "tessera-checkpoint-1"), "\"train.ranks\"", "\"x_ignored__\""));
  b.trainer.load(v1);
  CHECK(identical(snapshot(a.model), snapshot(b.model)));
  fs::remove_all(dir);
}

namespace {
// Sets element `index` of the optimizer state tensor `name` (visit_state's names) to `value`.
struct PokeState {
  std::string name;
  std::int64_t index;
  float value;
  template <class T>
  void buffer(const std::string& n, T& t) {
    if (n == name) t.data()[index] = value;
  }
  void integer(const std::string&, std::int64_t&) {}
};
}  // namespace

TEST_CASE("Checkpoint: NaN and Inf are refused on save and on load unless allowed, naming tensor and index",
          "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "nan.safetensors").string();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  Run a(1);
  DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});
  a.trainer.fit(loader);
  auto& fc = *a.named.parameters.back().second;  // fc.bias (4)
  auto& fc_weight = *a.named.parameters[a.named.parameters.size() - 2].second;
  REQUIRE(a.named.parameters[a.named.parameters.size() - 2].first == "fc.weight");
  fc_weight.value.data()[70] = nan;  // (4, 64): row 1, column 6
  fc_weight.value.data()[71] = inf;
  CHECK_THAT(error_of<ArgumentError>([&] { a.trainer.save(path); }),
             Catch::Contains("'" + path + "': tensor 'fc.weight' (4, 64) holds NaN at flat index 70 = [1, 6]") &&
                 Catch::Contains("allow_non_finite"));
  CHECK_FALSE(fs::exists(path));
  fc_weight.value.data()[70] = 0.5f;
  fc_weight.value.data()[71] = 0.5f;
  // Buffers and optimizer state too.
  a.model.stem_bn().running_var().data()[3] = -inf;
  CHECK_THAT(error_of<ArgumentError>([&] { a.trainer.save(path); }),
             Catch::Contains("tensor 'bn1.running_var' (16) holds -Inf at flat index 3 = [3]"));
  a.model.stem_bn().running_var().data()[3] = 1.0f;
  PokeState poke{"optim.momentum_buffer.fc.bias", 2, inf};
  a.sgd.visit_state(poke);
  CHECK_THAT(error_of<ArgumentError>([&] { a.trainer.save(path); }),
             Catch::Contains("tensor 'optim.momentum_buffer.fc.bias' (4) holds +Inf at flat index 2 = [2]"));
  poke.value = 0.0f;
  a.sgd.visit_state(poke);

  // Allowed: written, and then refused on load unless allowed there too.
  fc.value.data()[1] = nan;
  save_checkpoint(path, a.model, a.sgd, a.trainer.state(), CheckpointOptions{.allow_non_finite = true});
  Run b(1);
  const auto before = snapshot(b.model);
  CHECK_THAT(error_of<IoError>([&] { b.trainer.load(path); }),
             Catch::Contains("'" + path + "': nothing was loaded") &&
                 Catch::Contains("tensor 'fc.bias' (4) holds NaN at flat index 1 = [1]"));
  CHECK(identical(before, snapshot(b.model)));
  load_checkpoint(path, b.model, b.sgd, CheckpointOptions{.allow_non_finite = true});
  CHECK(std::isnan(b.model.fc().bias().value.data()[1]));
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint: training metadata out of range names the file and the key, and loads nothing",
          "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  Run a(1);
  Run b(1);
  const auto before = snapshot(b.model);
  auto expect = [&](const std::string& name, TrainState st, const std::string& needle, std::string from = "",
                    std::string to = "") {
    const std::string path = (dir / name).string();
    save_checkpoint(path, a.model, a.sgd, st);
    if (!from.empty()) write_bytes(path, edited(read_file_text(path), from, to));
    INFO(name);
    CHECK_THAT(error_of<IoError>([&] { b.trainer.load(path); }),
               Catch::Contains("load_checkpoint: '" + path + "'") && Catch::Contains(needle));
    CHECK(b.trainer.state().global_step == 0);  // nothing taken: the caller never prints "resumed"
    CHECK(identical(before, snapshot(b.model)));
  };
  expect("epoch.safetensors", {.epoch = -3}, "metadata entry 'train.epoch' = -3 is out of range");
  expect("step.safetensors", {.global_step = -1}, "'train.global_step' = -1");
  expect("world.safetensors", {.loader_world_size = -2}, "'train.loader_world_size' = -2");
  expect("batch.safetensors",
         {.epoch = 1, .global_step = 7, .loader_epoch = 1, .loader_next_batch = 99, .loader_batch_size = 16,
          .loader_seed = 1, .loader_samples = 96, .loader_world_size = 1},
         "'train.loader_next_batch' = 99 is out of range: an epoch of 96 samples on 1 rank in batches of 16 has at "
         "most 6 batches");
  expect("ahead.safetensors", {.epoch = 1, .loader_epoch = 5}, "'train.loader_epoch' = 5");
  expect("sample.safetensors",
         {.epoch = 1, .global_step = 8, .loader_epoch = 1, .loader_next_batch = 2, .loader_batch_size = 8,
          .loader_seed = 1, .loader_samples = 96, .loader_world_size = 2, .loader_next_sample = 33},
         "'train.loader_next_sample' = 33 is out of range: it must equal train.loader_next_batch x "
         "train.loader_batch_size x train.loader_world_size = 2 x 8 x 2 = 32");
  expect("ranks.safetensors", {}, "'train.ranks' = 0", "\"train.ranks\":\"1\"", "\"train.ranks\":\"0\"");
  expect("text.safetensors", {}, "'train.epoch' = 'x' is not an integer", "\"train.epoch\":\"0\"",
         "\"train.epoch\":\"x\"");
  // Files written before "train.loader_next_sample" existed: the position in samples is derived.
  const std::string old = (dir / "old.safetensors").string();
  save_checkpoint(old, a.model, a.sgd,
                  {.epoch = 1, .global_step = 8, .loader_epoch = 1, .loader_next_batch = 2, .loader_batch_size = 8,
                   .loader_seed = 1, .loader_samples = 96, .loader_world_size = 2});
  write_bytes(old, edited(read_file_text(old), "\"train.loader_next_sample\"", "\"train.loader_next_sampl_\""));
  CHECK(load_checkpoint(old, b.model, b.sgd).loader_next_sample == 32);
  fs::remove_all(dir);
}

TEST_CASE("Resume at another world size keeps the global batch: allowed when it divides, else refused by name",
          "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "w2.safetensors").string();
  {
    // Rank 0 of 2 with a global batch of 16 (8 per rank), stopped mid-epoch 2 (6 steps per epoch).
    Run first(3, path);
    DataLoader<float> loader(checkpoint_images(), {.batch_size = 8, .seed = 1, .rank = 0, .world_size = 2});
    Trainer<ResNet<E, BasicBlock>, Sgd<E>> stopping(first.model, first.sgd, CosineLr{0.05, 3.0, 0.0},
                                                    {.epochs = 3, .checkpoint_path = path, .verbose = false,
                                                     .stop_after_steps = 9});
    CHECK(stopping.fit(loader).size() == 1);
    CHECK(stopping.state().loader_next_batch == 3);
    CHECK(stopping.state().loader_next_sample == 48);
  }
  // The same global batch on 1 rank: an elastic resume, at batch 48 / 16 = 3 of epoch 2.
  Run resumed(3);
  DataLoader<float> one_rank(checkpoint_images(), {.batch_size = 16, .seed = 1});
  resumed.trainer.load(path, one_rank);
  CHECK(resumed.trainer.state().loader_next_batch == 3);
  CHECK(resumed.trainer.state().loader_world_size == 1);
  CHECK(resumed.trainer.state().loader_batch_size == 16);
  const auto epochs = resumed.trainer.fit(one_rank);
  CHECK(epochs.size() == 2);
  CHECK(resumed.trainer.state().global_step == 9 + 3 + 6);
  // 1 rank with 8 per sample would halve the global batch: refused naming what it must be.
  Run halved(3);
  DataLoader<float> eight(checkpoint_images(), {.batch_size = 8, .seed = 1});
  CHECK_THAT(error_of<ArgumentError>([&] { halved.trainer.load(path, eight); }),
             Catch::Contains("'" + path + "' was saved at world size 2 with a global batch of 16 (2 x 8)") &&
                 Catch::Contains("at world size 1 the loader's batch_size must be 16, but it is 8"));
  // 3 ranks cannot split 16.
  Run three(3);
  DataLoader<float> rank0_of_3(checkpoint_images(), {.batch_size = 5, .seed = 1, .rank = 0, .world_size = 3});
  CHECK_THAT(error_of<ArgumentError>([&] { three.trainer.load(path, rank0_of_3); }),
             Catch::Contains("'" + path + "' was saved by a run at world size 2 (2 ranks) with a global batch of 16 (8 "
                             "per rank); this run has world size 3, which does not divide the global batch 16") &&
                 Catch::Contains("resume at a world size that divides it (1, 2, 4, 8, 16)"));
  CHECK_THROWS_WITH(check_resume_world_size("'x'", 4, 6, 64), Catch::Contains("world size 6, which does not divide"));
  CHECK_NOTHROW(check_resume_world_size("'x'", 4, 8, 64));
  CHECK_THROWS_WITH(check_resume_world_size("'x'", 4, 3, 4096),
                    Catch::Contains("(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, ..., 4096)"));
  CHECK_NOTHROW(check_resume_world_size("'x'", 4, 6, 0));  // no batch recorded: nothing to re-split
  fs::remove_all(dir);
}

// CUT-PER-RANK (the tests below use CheckpointGroup)
TEST_CASE("Resume under data parallelism is exact when ranks seed their Dropout differently", "[train][checkpoint]") {
  using TE = CpuThreads;
  using Net = Sequential<Flatten<TE>, Linear<TE>, ReLU<TE>, Dropout<TE>, Linear<TE>>;
  const auto dir = checkpoint_temp_dir();
  const std::string ckpt = (dir / "dp.safetensors").string();
  struct Result {
    std::vector<double> losses;  // per epoch, the global batch's (the mean over ranks)
    std::vector<Tensor<float>> params;
  };
  // 2 ranks, global batch 16; rank r's Dropout is seeded 77 + r.
  auto run = [&](std::int64_t stop_after, const std::string& save, const std::string& resume) {
    Result out;
    ThreadWorld world(2);
    world.run([&](ThreadComm& comm) {
      const int rank = comm.rank();
      Rng rng(4);
      Net model{Flatten<TE>(), Linear<TE>(100, 32, rng), ReLU<TE>(), Dropout<TE>(0.5, 77 + static_cast<std::uint64_t>(rank)),
                Linear<TE>(32, 4, rng)};
      DataParallel dp(model, comm);
      Sgd<TE> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
      DataLoader<float> loader(checkpoint_images(), {.batch_size = 8, .seed = 1, .rank = rank, .world_size = 2});
      Trainer trainer(model, sgd, ConstantLr{0.05},
                      {.epochs = 3, .checkpoint_path = save, .verbose = false, .checkpoint_group = CheckpointGroup(comm)});
      if (!resume.empty()) trainer.load(resume);
      for (const auto& r : trainer.fit(loader, nullptr, stop_after)) {
        double loss = r.train_loss;
        comm.all_reduce(std::span<double>(&loss, 1), ReduceOp::Avg);
        if (rank == 0) out.losses.push_back(loss);
      }
      if (rank == 0) out.params = snapshot(model);
    });
    return out;
  };
  const Result straight = run(0, "", "");
  const Result first = run(1, ckpt, "");
  const Result resumed = run(0, "", ckpt);
  REQUIRE(straight.losses.size() == 3);
  REQUIRE(resumed.losses.size() == 2);
  CHECK(first.losses[0] == straight.losses[0]);
  char losses[96];
  std::snprintf(losses, sizeof losses, "epoch 2: straight %.17g, resumed %.17g", straight.losses[1], resumed.losses[0]);
  INFO(losses);
  CHECK(resumed.losses[0] == straight.losses[1]);
  CHECK(resumed.losses[1] == straight.losses[2]);
  CHECK(identical(straight.params, resumed.params));
  const auto meta = SafetensorsFile::load(ckpt).metadata();
  CHECK(meta.at("format") == "tessera-checkpoint-2");
  CHECK(meta.at("train.ranks") == "2");
  CHECK(meta.count("3.rng") == 1);
  CHECK(meta.count("rank1.3.rng") == 1);
  CHECK(meta.at("3.rng") != meta.at("rank1.3.rng"));

  // Elastic: in one process rank 0 takes rank 0's generators; at 4 ranks, ranks 0 and 1 take
  // theirs and ranks 2 and 3 keep the ones their program seeded.
  Rng rng(4);
  Sequential<Flatten<E>, Linear<E>, ReLU<E>, Dropout<E>, Linear<E>> single{Flatten<E>(), Linear<E>(100, 32, rng),
                                                                           ReLU<E>(), Dropout<E>(0.5, 77), Linear<E>(32, 4, rng)};
  auto named = named_tensors(single);
  Sgd<E> sgd(named, {.lr = 0.05, .momentum = 0.9});
  load_checkpoint(ckpt, single, sgd);
  REQUIRE(named.rngs.size() == 1);
  CHECK(detail::rng_to_string(named.rngs[0].second->state()) == meta.at("3.rng"));
  std::vector<std::string> before(4), after(4);
  ThreadWorld four(4);
  four.run([&](ThreadComm& comm) {
    const int rank = comm.rank();
    Rng init(4);
    Net model{Flatten<TE>(), Linear<TE>(100, 32, init), ReLU<TE>(), Dropout<TE>(0.5, 77 + static_cast<std::uint64_t>(rank)),
              Linear<TE>(32, 4, init)};
    auto tensors = named_tensors(model);
    Sgd<TE> opt(tensors, {.lr = 0.05, .momentum = 0.9});
    before[static_cast<std::size_t>(rank)] = detail::rng_to_string(tensors.rngs[0].second->state());
    load_checkpoint(ckpt, model, opt, CheckpointGroup(comm));
    after[static_cast<std::size_t>(rank)] = detail::rng_to_string(tensors.rngs[0].second->state());
  });
  CHECK(after[0] == meta.at("3.rng"));
  CHECK(after[1] == meta.at("rank1.3.rng"));
  CHECK(after[2] == before[2]);
  CHECK(after[3] == before[3]);
  CHECK(before[2] != before[3]);
  fs::remove_all(dir);
}

TEST_CASE("Checkpoint with a group: a failure on one rank fails every rank", "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "g.safetensors").string();
  std::vector<std::string> save_errors(2), load_errors(2);
  ThreadWorld world(2);
  world.run([&](ThreadComm& comm) {
    const int rank = comm.rank();
    auto model = lenet5<CpuThreads>(1, 28, 10, 1);
    auto named = named_tensors(model);
    Sgd<CpuThreads> sgd(named, {.lr = 0.1});
    // Rank 0 (the writer) holds a NaN: nothing is written and both ranks throw.
    if (rank == 0) named.parameters[0].second->value.data()[0] = std::numeric_limits<float>::quiet_NaN();
    try {
      save_checkpoint(path, model, sgd, TrainState{}, CheckpointGroup(comm));
    } catch (const Error& e) {
      save_errors[static_cast<std::size_t>(rank)] = e.what();
    }
    named.parameters[0].second->value.data()[0] = 0.0f;
    save_checkpoint(path, model, sgd, TrainState{}, CheckpointGroup(comm));
    // Rank 1 cannot read its file: neither rank loads.
    try {
      load_checkpoint(rank == 0 ? path : path + ".missing", model, sgd, CheckpointGroup(comm));
    } catch (const IoError& e) {
      load_errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  CHECK_THAT(save_errors[0], Catch::Contains("holds NaN at flat index 0"));
  CHECK_THAT(save_errors[1], Catch::Contains("rank 0 could not write '" + path + "'"));
  CHECK_THAT(load_errors[0], Catch::Contains("rank(s) 1 could not load it") && Catch::Contains("nothing was loaded on any rank"));
  CHECK_THAT(load_errors[1], Catch::Contains("cannot open"));
  fs::remove_all(dir);
}

TEST_CASE("Trainer: with a checkpoint group, an epoch's training figures are over all ranks", "[train]") {
  using TE = CpuThreads;
  using Net = Sequential<Flatten<TE>, Linear<TE>, ReLU<TE>, Linear<TE>>;
  auto make = [] {
    Rng rng(4);
    return Net{Flatten<TE>(), Linear<TE>(100, 32, rng), ReLU<TE>(), Linear<TE>(32, 4, rng)};
  };
  // One process on global batches of 16.
  EpochResult one;
  ThreadWorld(1).run([&](ThreadComm& comm) {
    auto model = make();
    DataParallel dp(model, comm);
    Sgd<TE> sgd(dp.parameters(), {.lr = 0.05});
    DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});
    Trainer trainer(model, sgd, ConstantLr{0.05}, {.epochs = 1, .verbose = false, .checkpoint_group = CheckpointGroup(comm)});
    one = trainer.fit(loader).back();
  });
  // Two ranks, 8 each of the same global batches: the loss and accuracy of all 16 samples.
  std::array<EpochResult, 2> two;
  ThreadWorld(2).run([&](ThreadComm& comm) {
    auto model = make();
    DataParallel dp(model, comm);
    Sgd<TE> sgd(dp.parameters(), {.lr = 0.05});
    DataLoader<float> loader(checkpoint_images(), {.batch_size = 8, .seed = 1, .rank = comm.rank(), .world_size = 2});
    Trainer trainer(model, sgd, ConstantLr{0.05}, {.epochs = 1, .verbose = false, .checkpoint_group = CheckpointGroup(comm)});
    two[static_cast<std::size_t>(comm.rank())] = trainer.fit(loader).back();
  });
  CHECK(one.ranks == 1);
  CHECK(two[0].ranks == 2);
  // The same figures on both ranks, bit for bit, and those of the one-process run (the gradients
  // differ only in summation order).
  CHECK(two[0].train_loss == two[1].train_loss);
  CHECK(two[0].train_accuracy == two[1].train_accuracy);
  CHECK(two[0].seconds == two[1].seconds);
  CHECK(two[0].train_loss == Approx(one.train_loss).epsilon(1e-5));
  CHECK(two[0].train_accuracy == one.train_accuracy);
  // images/s: all ranks' images over the slowest rank's time; each rank's own is about half.
  CHECK(two[0].images_per_second >= two[0].rank_images_per_second);
  CHECK(two[0].images_per_second == Approx(static_cast<double>(checkpoint_images().labels.size()) / two[0].seconds));
}

TEST_CASE("StopSignals: a signal saves the checkpoint at the next step and fit stops there", "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "signal.safetensors").string();
  using Net = Sequential<Flatten<E>, Linear<E>, ReLU<E>, Linear<E>>;
  auto make = [] {
    Rng rng(4);
    return Net{Flatten<E>(), Linear<E>(100, 16, rng), ReLU<E>(), Linear<E>(16, 4, rng)};
  };
  {
    StopSignals stop;
    CHECK_THROWS_WITH(StopSignals(), Catch::Contains("one already exists in this process"));
    Net model = make();
    Sgd<E> sgd(named_tensors(model), {.lr = 0.05, .momentum = 0.9});
    DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});  // 6 steps per epoch
    std::int64_t steps = 0;
    // SIGUSR1 arrives during step 3 (its before_step): the step completes, the checkpoint is saved
    // after it, mid-epoch 1, and fit returns without running step 4.
    Trainer trainer(model, sgd, ConstantLr{0.05},
                    {.epochs = 2, .checkpoint_path = path, .verbose = false,
                     .before_step = [&] { if (++steps == 3) ::raise(SIGUSR1); },
                     .stop_signals = &stop});
    CHECK(trainer.fit(loader).empty());
    CHECK(trainer.stopped_by() == SIGUSR1);
    CHECK(stop.received() == SIGUSR1);
    CHECK(steps == 3);
    Net resumed_model = make();
    Sgd<E> resumed_sgd(named_tensors(resumed_model), {.lr = 0.05, .momentum = 0.9});
    const TrainState saved = load_checkpoint(path, resumed_model, resumed_sgd);
    CHECK(saved.global_step == 3);
    CHECK((saved.epoch == 0 && saved.loader_next_batch == 3));
    CHECK(identical(snapshot(model), snapshot(resumed_model)));
  }
  // Gone, it leaves the previous handler (the default) in place, and a new one may be made.
  struct sigaction now {};
  sigaction(SIGUSR1, nullptr, &now);
  CHECK(now.sa_handler == SIG_DFL);
  CHECK_THROWS_WITH(StopSignals({SIGKILL}), Catch::Contains("SIGKILL cannot be caught"));
  CHECK_NOTHROW(StopSignals({SIGUSR2}));
  CHECK(StopSignals::name(SIGTERM) == "SIGTERM");
  fs::remove_all(dir);
}

TEST_CASE("checkpoint_every_steps saves in the middle of an epoch", "[train][checkpoint]") {
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "every.safetensors").string();
  Run run(1), probe(1);
  // Whether the file exists as each of the epoch's 6 steps runs: first saved after step 4.
  std::vector<bool> existed;
  DataLoader<float> loader(checkpoint_images(), {.batch_size = 16, .seed = 1});
  Trainer<ResNet<E, BasicBlock>, Sgd<E>> trainer(run.model, run.sgd, ConstantLr{0.05},
                                                 {.epochs = 1, .checkpoint_path = path, .verbose = false,
                                                  .before_step = [&] { existed.push_back(fs::exists(path)); },
                                                  .checkpoint_every_steps = 4});
  trainer.fit(loader);
  REQUIRE(existed.size() == 6);
  CHECK(std::count(existed.begin(), existed.begin() + 4, true) == 0);
  CHECK((existed[4] && existed[5]));
  CHECK(load_checkpoint(path, probe.model, probe.sgd).global_step == 6);  // the epoch's end replaced it
  fs::remove_all(dir);
}

TEST_CASE("StopSignals under data parallelism: every rank stops at the same step", "[train][checkpoint]") {
  using TE = CpuThreads;
  using Net = Sequential<Flatten<TE>, Linear<TE>, ReLU<TE>, Linear<TE>>;
  const auto dir = checkpoint_temp_dir();
  const std::string path = (dir / "dp-signal.safetensors").string();
  StopSignals stop;
  std::array<std::int64_t, 2> stopped_at{}, signal_of{};
  ThreadWorld world(2);
  world.run([&](ThreadComm& comm) {
    const int rank = comm.rank();
    Rng rng(4);
    Net model{Flatten<TE>(), Linear<TE>(100, 16, rng), ReLU<TE>(), Linear<TE>(16, 4, rng)};
    DataParallel dp(model, comm);
    Sgd<TE> sgd(dp.parameters(), {.lr = 0.05});
    DataLoader<float> loader(checkpoint_images(), {.batch_size = 8, .seed = 1, .rank = rank, .world_size = 2});
    std::int64_t steps = 0;
    // Only rank 1 raises it, during its step 2; rank 0 may see the flag a step later on its own.
    Trainer trainer(model, sgd, ConstantLr{0.05},
                    {.epochs = 2, .checkpoint_path = path, .verbose = false,
                     .before_step = [&] { if (++steps == 2 && rank == 1) ::raise(SIGUSR1); },
                     .checkpoint_group = CheckpointGroup(comm), .stop_signals = &stop});
    trainer.fit(loader);
    stopped_at[static_cast<std::size_t>(rank)] = trainer.state().global_step;
    signal_of[static_cast<std::size_t>(rank)] = trainer.stopped_by();
  });
  CHECK(stopped_at[0] == stopped_at[1]);
  CHECK(stopped_at[0] == 2);  // the agreement after step 2 already sees rank 1's flag
  CHECK((signal_of[0] == SIGUSR1 && signal_of[1] == SIGUSR1));
  CHECK(fs::exists(path));
  fs::remove_all(dir);
}
