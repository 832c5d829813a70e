// Models: parameter counts against torchvision / torch twins, whole-model forward + backward
// against PyTorch with the same weights loaded by name (checks architecture and names together),
// and load_state_dict / save_state_dict with torch-written files (names, strictness, dtypes,
// all-or-nothing), up to a torchvision ResNet-50 whose logits must equal PyTorch's.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/gradcheck.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/io/state_dict.hpp"

using namespace tessera;
using E = CpuLocal;
using E64 = CpuLocal64;

static_assert(Layer<ResNet<E, Bottleneck>>, "models satisfy the Layer concept, so they nest and pipeline");
static_assert(Layer<Mlp<E>>);
static_assert(Layer<LeNet5<E>>);

namespace {
const SafetensorsFile& models_reference() {
  static const SafetensorsFile f = SafetensorsFile::load(TESSERA_REFERENCE_DATA_DIR "/models.safetensors");
  return f;
}
template <class M>
std::int64_t parameter_count(M& model) {
  return static_cast<std::int64_t>(count_parameters(named_tensors(model)));
}
std::int64_t torch_count(const std::string& name) {
  return models_reference().tensor<std::int64_t>("count." + name)[0];
}
}  // namespace

TEST_CASE("ResNet-50 at 1000 classes has exactly 25,557,032 parameters", "[models]") {
  auto net = resnet50<E>();
  CHECK(parameter_count(net) == 25557032);
  CHECK(net.name() == "ResNet-50");
}

TEST_CASE("Parameter counts equal torchvision's and the torch twins'", "[models]") {
  auto r18 = resnet18<E>();
  auto r34 = resnet34<E>();
  auto r101 = resnet101<E>();
  auto r152 = resnet152<E>();
  auto r20 = resnet20<E>({.in_channels = 3, .num_classes = 10});
  auto r56 = resnet56<E>({.in_channels = 3, .num_classes = 10});
  auto lenet = lenet5<E>(1, 28, 10);
  Mlp<E> mlp(784, {512, 256}, 10);
  CHECK(parameter_count(r18) == torch_count("resnet18"));
  CHECK(parameter_count(r34) == torch_count("resnet34"));
  CHECK(parameter_count(r101) == torch_count("resnet101"));
  CHECK(parameter_count(r152) == torch_count("resnet152"));
  CHECK(parameter_count(r20) == torch_count("resnet20"));
  CHECK(parameter_count(r56) == torch_count("resnet56"));
  CHECK(parameter_count(lenet) == torch_count("lenet"));
  CHECK(parameter_count(mlp) == torch_count("mlp"));
  CHECK(r20.name() == "CIFAR ResNet-20");
  CHECK_THROWS_AS(cifar_resnet<E>(21), ArgumentError);
}

// Loads "<prefix>.init.<name>" into every parameter and buffer, runs train forward, CE loss and
// backward, then compares logits, loss, every gradient, the BN running statistics and eval logits.
void expect_close(const Tensor<double>& got, const Tensor<double>& want, double tolerance, const std::string& what) {
  const double err = testing::relative_error(got, want);
  testing::report_error("reference-f64", what, err);
  INFO(what << ": relative error " << err);
  CHECK(err < tolerance);
}

template <class Model>
void check_against_torch(Model& model, const std::string& prefix) {
  const auto& f = models_reference();
  auto named = named_tensors(model);
  std::size_t loaded = 0;
  for (auto& [name, p] : named.parameters) {
    p->value = f.tensor<double>(prefix + ".init." + name);
    p->grad.zero();
    ++loaded;
  }
  for (auto& [name, t] : named.buffers) {
    *t = f.tensor<double>(prefix + ".init." + name);
    ++loaded;
  }
  std::size_t in_file = 0;
  for (auto& n : f.names()) in_file += n.rfind(prefix + ".init.", 0) == 0;
  CHECK(loaded == in_file);  // same set of names as torch's state_dict

  const auto x = f.tensor<double>(prefix + ".x");
  const auto labels_t = f.tensor<std::int64_t>(prefix + ".labels");
  std::vector<std::int64_t> labels(labels_t.begin(), labels_t.end());
  typename Model::Cache cache{};
  CrossEntropyLoss<E64> loss;
  CrossEntropyLoss<E64>::Cache loss_cache;
  model.set_mode(Mode::Train);
  const auto& logits = model.forward(x, cache);
  expect_close(logits, f.tensor<double>(prefix + ".logits"), 1e-10, prefix + ".logits");
  const double l = loss.forward(logits, labels, loss_cache);
  CHECK(l == Approx(f.tensor<double>(prefix + ".loss")[0]).epsilon(1e-10));
  model.backward(loss.backward(loss_cache), cache);
  for (auto& [name, p] : named.parameters) {
    expect_close(p->grad, f.tensor<double>(prefix + ".grad." + name), 1e-9, prefix + ".grad." + name);
  }
  for (auto& [name, t] : named.buffers) {
    expect_close(*t, f.tensor<double>(prefix + ".after." + name), 1e-10, prefix + ".after." + name);
  }
  model.set_mode(Mode::Eval);
  const auto& eval_logits = model.forward(x, cache);
  expect_close(eval_logits, f.tensor<double>(prefix + ".eval_logits"), 1e-10, prefix + ".eval_logits");
}

TEST_CASE("CIFAR ResNet-8 matches PyTorch: logits, loss, all gradients, BN statistics", "[models]") {
  auto net = cifar_resnet<E64>(8, {.in_channels = 1, .num_classes = 5});
  check_against_torch(net, "resnet8");
}

TEST_CASE("LeNet-5 matches PyTorch: logits, loss, all gradients", "[models]") {
  auto net = lenet5<E64>(1, 28, 10);
  check_against_torch(net, "lenet");
}

TEST_CASE("CIFAR ResNet-8 in float32 stays within a small multiple of PyTorch's float32 error", "[models]") {
  const auto& f = models_reference();
  auto net = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 5});
  auto named = named_tensors(net);
  for (auto& [name, p] : named.parameters) p->value = f.tensor<float>("resnet8.init." + name);
  for (auto& [name, t] : named.buffers) *t = f.tensor<float>("resnet8.init." + name);
  decltype(net)::Cache cache;
  const auto logits = net.forward(f.tensor<float>("resnet8.x"), cache).cast<double>();
  const double torch_err = f.tensor<double>("resnet8.torch_f32_err")[0];
  const auto ref = f.tensor<double>("resnet8.logits");
  double max_err = 0, max_ref = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    max_err = std::max(max_err, std::abs(logits[i] - ref[i]));
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  INFO("tessera f32 error " << max_err / max_ref << ", torch f32 error " << torch_err);
  CHECK(max_err / max_ref <= 8 * torch_err + 1e-6);
}

TEST_CASE("One ResNet-50 training step at batch 8 on 224x224 runs and gives finite values", "[models]") {
  auto net = resnet50<E>({.zero_init_residual = true, .seed = 1});
  decltype(net)::Cache cache;
  Rng rng(9);
  Tensor<float> x({8, 3, 224, 224});
  for (auto& v : x) v = static_cast<float>(rng.normal());
  const auto& logits = net.forward(x, cache);
  REQUIRE(logits.shape() == Shape{8, 1000});
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache lc;
  std::vector<std::int64_t> labels{0, 1, 2, 3, 4, 5, 6, 7};
  const float l = loss.forward(logits, labels, lc);
  CHECK(std::isfinite(l));
  net.backward(loss.backward(lc), cache);
  auto named = named_tensors(net);
  double norm = 0;
  for (auto& [n, p] : named.parameters)
    for (float g : p->grad) norm += static_cast<double>(g) * g;
  CHECK(std::isfinite(norm));
  CHECK(norm > 0);
}

TEST_CASE("Models reject wrong input shapes with the model name and both shapes", "[models]") {
  auto net = resnet20<E>({.in_channels = 1, .num_classes = 10});
  decltype(net)::Cache cache;
  Tensor<float> bad({2, 3, 28, 28});
  try {
    net.forward(bad, cache);
    FAIL("expected ShapeError");
  } catch (const ShapeError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("ResNet-20") && Catch::Contains("(2, 3, 28, 28)"));
  }
}

namespace {
namespace fs = std::filesystem;

fs::path models_temp_dir() {
  auto dir = fs::temp_directory_path() / ("tessera_models_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

// Every key the state-dict visit reaches, with its shape, in visit order (num_batches_tracked included).
struct KeyLister {
  std::vector<std::string> keys;
  template <class P>
  void parameter(const std::string& n, P& p) {
    keys.push_back(n + "|F32|" + dims(p.value.shape()));
  }
  template <class T>
  void buffer(const std::string& n, T& t) {
    keys.push_back(n + "|F32|" + dims(t.shape()));
  }
  void integer_buffer(const std::string& n, std::int64_t&) { keys.push_back(n + "|I64|"); }
  template <class R>
  void rng(const std::string&, R&) {}
  static std::string dims(const Shape& s) {
    std::string out;
    for (int i = 0; i < s.rank(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
    return out;
  }
};

// Every value of the model (parameters, buffers, num_batches_tracked) in visit order: "unchanged" checks.
struct StateSnapshot {
  std::vector<double> values;
  template <class P>
  void parameter(const std::string& n, P& p) {
    buffer(n, p.value);
  }
  template <class T>
  void buffer(const std::string&, T& t) {
    for (auto v : t) values.push_back(static_cast<double>(v));
  }
  void integer_buffer(const std::string&, std::int64_t& v) { values.push_back(static_cast<double>(v)); }
  template <class R>
  void rng(const std::string&, R&) {}
};
template <class M>
std::vector<double> parameter_values(M& model) {
  StateSnapshot s;
  model.visit(s, "");
  return s.values;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

const std::string kResnet8State = TESSERA_REFERENCE_DATA_DIR "/models_resnet8_state.safetensors";

// A copy of a safetensors file with `edit` applied to each entry (return false to drop it) and
// `extra` called to add entries.
template <class Edit, class Extra>
std::string rewrite(const std::string& src, const std::string& dst, Edit edit, Extra extra) {
  const auto f = SafetensorsFile::load(src);
  SafetensorsWriter w;
  for (const auto& name : f.names()) {
    const TensorInfo& i = f.info(name);
    if (edit(name, i, f, w)) w.add_raw(name, i.dtype, i.shape, f.raw(name), i.end - i.begin);
  }
  extra(w);
  w.write(dst);
  return dst;
}
auto keep = [](const std::string&, const TensorInfo&, const SafetensorsFile&, SafetensorsWriter&) { return true; };
auto nothing = [](SafetensorsWriter&) {};

template <class M>
std::string expect_load_error(const std::string& path, M& model, bool strict = true) {
  const auto before = parameter_values(model);
  std::string msg;
  try {
    load_state_dict(path, model, strict);
    FAIL("expected IoError from " << path);
  } catch (const IoError& e) {
    msg = e.what();
  }
  CHECK(parameter_values(model) == before);  // all or nothing: a failed load changes nothing
  INFO(msg);
  CHECK_THAT(msg, Catch::Contains("load_state_dict") && Catch::Contains(path));
  return msg;
}

// The generator of gen_models.py's ResNet-50 weights, bit for bit:
// u = (splitmix64(seed + (i + 1) * golden) >> 40) * 2^-24, value = float(lo + span * u).
double splitmix_uniform(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 40) * 0x1p-24;
}
}  // namespace

TEST_CASE("Built-in models name parameters and buffers as torchvision and the torch twins do", "[models]") {
  // ResNet-50: torchvision's state_dict keys, shapes and dtypes in torch's order, num_batches_tracked included.
  auto net = resnet50<E>({.num_classes = 10});
  KeyLister tessera_keys;
  net.visit(tessera_keys, "");
  std::vector<std::string> torch_keys;
  for (auto l : lines(models_reference().metadata().at("resnet50.keys"))) {
    if (l.find("|I64|") != std::string::npos) l = l.substr(0, l.find("|I64|") + 5);  // shape () for I64
    torch_keys.push_back(l);
  }
  REQUIRE(torch_keys.size() == 320);
  CHECK(tessera_keys.keys == torch_keys);
  // LeNet-5: the classic layout.
  auto lenet = lenet5<E>(1, 28, 10);
  KeyLister lenet_keys;
  lenet.visit(lenet_keys, "");
  CHECK(lenet_keys.keys == std::vector<std::string>{"conv1.weight|F32|6,1,5,5", "conv1.bias|F32|6",
                                                    "conv2.weight|F32|16,6,5,5", "conv2.bias|F32|16",
                                                    "fc1.weight|F32|120,400", "fc1.bias|F32|120",
                                                    "fc2.weight|F32|84,120", "fc2.bias|F32|84",
                                                    "fc3.weight|F32|10,84", "fc3.bias|F32|10"});
  CHECK(lenet.unit_name(2) == "pool1");
}

TEST_CASE("BatchNorm counts num_batches_tracked as torch does: training forwards only", "[models]") {
  auto net = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 5});
  decltype(net)::Cache cache;
  Tensor<float> x({2, 1, 8, 8}, 0.5f);
  x[3] = -1.0f;
  net.forward(x, cache);
  net.forward(x, cache);
  net.set_mode(Mode::Eval);
  net.forward(x, cache);
  CHECK(net.stem_bn().num_batches_tracked() == 2);
  CHECK(net.blocks()[0].main().get<1>().num_batches_tracked() == 2);
}

TEST_CASE("load_state_dict: a torch-written CIFAR ResNet-8 state gives PyTorch's eval logits", "[models]") {
  // The twin's state after its training step: running statistics updated, num_batches_tracked = 1.
  auto net = cifar_resnet<E64>(8, {.in_channels = 1, .num_classes = 5});
  const StateDictKeys keys = load_state_dict(kResnet8State, net);
  CHECK(keys.missing_keys.empty());
  CHECK(keys.unexpected_keys.empty());
  CHECK(net.stem_bn().num_batches_tracked() == 1);
  net.set_mode(Mode::Eval);
  decltype(net)::Cache cache;
  const auto& logits = net.forward(models_reference().tensor<double>("resnet8.x"), cache);
  expect_close(logits, models_reference().tensor<double>("resnet8.eval_logits"), 1e-10, "resnet8 state_dict eval logits");

  // Into float32 (F64 -> F32 on load): equal to the float64 file rounded once.
  auto net32 = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 5});
  load_state_dict(kResnet8State, net32);
  const auto file = SafetensorsFile::load(kResnet8State);
  const auto w = file.tensor<double>("layer2.0.downsample.0.weight");
  const auto& got = net32.blocks()[1].projection()->get<0>().weight().value;
  for (std::int64_t i = 0; i < w.numel(); ++i) REQUIRE(got[i] == static_cast<float>(w[i]));
}

TEST_CASE("save_state_dict writes torch's names and dtypes and loads back exactly", "[models]") {
  const auto dir = models_temp_dir();
  auto a = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 5, .seed = 4});
  load_state_dict(kResnet8State, a);
  const auto path = (dir / "saved.safetensors").string();
  save_state_dict(path, a);
  const auto saved = SafetensorsFile::load(path);
  const auto torch_file = SafetensorsFile::load(kResnet8State);
  CHECK(saved.names() == torch_file.names());  // the same key set as torch's state_dict
  CHECK(saved.info("bn1.num_batches_tracked").dtype == DType::I64);
  CHECK(saved.info("bn1.num_batches_tracked").shape == Shape{});
  CHECK(saved.tensor<std::int64_t>("bn1.num_batches_tracked")[0] == 1);
  CHECK(saved.info("fc.weight").dtype == DType::F32);
  CHECK(saved.metadata().at("format") == "pt");
  auto b = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 5, .seed = 5});
  CHECK(parameter_values(a) != parameter_values(b));
  load_state_dict(path, b);
  CHECK(parameter_values(a) == parameter_values(b));
  fs::remove_all(dir);
}

TEST_CASE("load_state_dict: missing, unexpected, mis-shaped and mis-typed keys are named; nothing loads", "[models]") {
  const auto dir = models_temp_dir();
  auto net = cifar_resnet<E>(8, {.in_channels = 1, .num_classes = 5, .seed = 6});
  const auto d = [&](const char* name) { return (dir / name).string(); };

  SECTION("missing keys (strict), then strict = false loads the rest and reports them") {
    const auto path = rewrite(kResnet8State, d("missing.safetensors"),
                              [](const std::string& n, auto&&...) { return n != "fc.bias" && n != "bn1.weight"; },
                              nothing);
    const auto msg = expect_load_error(path, net);
    CHECK_THAT(msg, Catch::Contains("Missing key(s) in state_dict: \"bn1.weight\", \"fc.bias\"."));
    CHECK_THAT(msg, !Catch::Contains("Unexpected"));
    const auto fc_bias = net.fc().bias().value;
    const auto keys = load_state_dict(path, net, /*strict=*/false);
    CHECK(keys.missing_keys == std::vector<std::string>{"bn1.weight", "fc.bias"});
    CHECK(keys.unexpected_keys.empty());
    CHECK(std::memcmp(net.fc().bias().value.data(), fc_bias.data(), fc_bias.bytes()) == 0);  // left as it was
    CHECK(net.fc().weight().value[0] == SafetensorsFile::load(path).tensor<float>("fc.weight")[0]);
  }
  SECTION("unexpected keys") {
    const float extra[2] = {1, 2};
    const auto path = rewrite(kResnet8State, d("unexpected.safetensors"), keep, [&](SafetensorsWriter& w) {
      w.add_raw("head.weight", DType::F32, Shape{2}, extra, sizeof extra);
    });
    const auto msg = expect_load_error(path, net);
    CHECK_THAT(msg, Catch::Contains("Unexpected key(s) in state_dict: \"head.weight\"."));
    const auto keys = load_state_dict(path, net, false);
    CHECK(keys.unexpected_keys == std::vector<std::string>{"head.weight"});
  }
  SECTION("a shape mismatch names the key and both shapes, strict or not") {
    std::vector<double> bigger(6 * 64, 0.5);
    const auto path = rewrite(
        kResnet8State, d("shape.safetensors"), [](const std::string& n, auto&&...) { return n != "fc.weight"; },
        [&](SafetensorsWriter& w) {
          w.add_raw("fc.weight", DType::F64, Shape{6, 64}, bigger.data(), bigger.size() * sizeof(double));
        });
    for (bool strict : {true, false}) {
      const auto msg = expect_load_error(path, net, strict);
      CHECK_THAT(msg, Catch::Contains("size mismatch for fc.weight: copying a param with shape (6, 64) from "
                                      "checkpoint, the shape in current model is (5, 64)."));
    }
  }
  SECTION("an integer tensor for a floating-point parameter, a float num_batches_tracked") {
    const std::int64_t ints[5] = {1, 2, 3, 4, 5};
    const float one = 1;
    const auto path = rewrite(
        kResnet8State, d("dtype.safetensors"),
        [](const std::string& n, auto&&...) { return n != "fc.bias" && n != "bn1.num_batches_tracked"; },
        [&](SafetensorsWriter& w) {
          w.add_raw("fc.bias", DType::I64, Shape{5}, ints, sizeof ints);
          w.add_raw("bn1.num_batches_tracked", DType::F32, Shape{}, &one, sizeof one);
        });
    const auto msg = expect_load_error(path, net);
    CHECK_THAT(msg, Catch::Contains("dtype mismatch for fc.bias: the checkpoint holds I64"));
    CHECK_THAT(msg, Catch::Contains("bn1.num_batches_tracked"));
  }
  SECTION("num_batches_tracked may be absent, as torch's BatchNorm allows") {
    const auto path = rewrite(kResnet8State, d("no_nbt.safetensors"),
                              [](const std::string& n, auto&&...) {
                                return n.find("num_batches_tracked") == std::string::npos;
                              },
                              nothing);
    const auto keys = load_state_dict(path, net);
    CHECK(keys.missing_keys.empty());
    CHECK(net.stem_bn().num_batches_tracked() == 0);  // left as it was
  }
  SECTION("a truncated or corrupt file is an IoError naming the file; the model is unchanged") {
    const auto path = d("truncated.safetensors");
    {
      std::ifstream in(kResnet8State, std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
      std::string garbage = bytes;
      garbage[12] = '#';  // inside the JSON header
      std::ofstream(d("corrupt.safetensors"), std::ios::binary)
          .write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
    }
    CHECK_THAT(expect_load_error(path, net), Catch::Contains("truncated"));
    CHECK_THAT(expect_load_error(d("corrupt.safetensors"), net), Catch::Contains("malformed header"));
    CHECK_THAT(expect_load_error(d("absent.safetensors"), net), Catch::Contains("cannot open"));
  }
  fs::remove_all(dir);
}

TEST_CASE("load_state_dict converts F16 and BF16 to the model's scalar exactly", "[models]") {
  const auto dir = models_temp_dir();
  Rng rng(1);
  Sequential<Linear<E64>> model{Linear<E64>(3, 2, rng)};
  // binary16: 1, -2, 65504 (largest), 2^-24 (smallest subnormal), 0x3555 = 0.333251953125, -0.
  const std::uint16_t half[6] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x3555, 0x8000};
  // bfloat16: 1, -3.
  const std::uint16_t bf16[2] = {0x3F80, 0xC040};
  SafetensorsWriter w;
  w.add_raw("0.weight", DType::F16, Shape{2, 3}, half, sizeof half);
  w.add_raw("0.bias", DType::BF16, Shape{2}, bf16, sizeof bf16);
  const auto path = (dir / "half.safetensors").string();
  w.write(path);
  load_state_dict(path, model);
  const auto& weight = model.get<0>().weight().value;
  CHECK(weight[0] == 1.0);
  CHECK(weight[1] == -2.0);
  CHECK(weight[2] == 65504.0);
  CHECK(weight[3] == 0x1p-24);
  CHECK(weight[4] == 0.333251953125);
  CHECK((weight[5] == 0.0 && std::signbit(weight[5])));
  CHECK(model.get<0>().bias().value[0] == 1.0);
  CHECK(model.get<0>().bias().value[1] == -3.0);
  fs::remove_all(dir);
}

TEST_CASE("A torchvision ResNet-50 state loads by name and gives PyTorch's logits", "[models]") {
  // gen_models.py built torchvision.models.resnet50(num_classes=10) with generated weights (see its
  // docstring); this writes the same state under torch's keys, in torch's dtypes, as
  // tools/convert_torchvision.py would, then loads it by name.
  const auto& f = models_reference();
  const auto keys = lines(f.metadata().at("resnet50.keys"));
  const auto lo = f.tensor<double>("resnet50.gen.lo");
  const auto span = f.tensor<double>("resnet50.gen.span");
  const auto samples = f.tensor<float>("resnet50.gen.samples");
  REQUIRE(static_cast<std::int64_t>(keys.size()) == lo.numel());
  SafetensorsWriter w;
  std::int64_t floats = 0;
  for (std::size_t k = 0; k < keys.size(); ++k) {
    const auto bar1 = keys[k].find('|'), bar2 = keys[k].find('|', bar1 + 1);
    const std::string name = keys[k].substr(0, bar1), dtype = keys[k].substr(bar1 + 1, bar2 - bar1 - 1);
    Shape shape;
    std::istringstream dims(keys[k].substr(bar2 + 1));
    for (std::string d; std::getline(dims, d, ',');) shape.push_back(std::stoll(d));
    if (dtype == "I64") {
      const auto value = static_cast<std::int64_t>(k);  // gen_models.py: num_batches_tracked = the key's index
      w.add_raw(name, DType::I64, shape, &value, sizeof value);
      continue;
    }
    std::vector<float> v(static_cast<std::size_t>(shape.numel()));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(lo[static_cast<std::int64_t>(k)] +
                                span[static_cast<std::int64_t>(k)] * splitmix_uniform((k + 1) << 32, i));
    const float want[3] = {samples[3 * floats], samples[3 * floats + 1], samples[3 * floats + 2]};
    INFO(name);
    REQUIRE((v.front() == want[0] && v[v.size() / 2] == want[1] && v.back() == want[2]));  // same generator
    ++floats;
    w.add_raw(name, DType::F32, shape, v.data(), v.size() * sizeof(float));
  }
  const auto dir = models_temp_dir();
  const auto path = (dir / "resnet50.safetensors").string();
  w.write(path);

  const auto x = f.tensor<float>("resnet50.x");  // (2, 3, 64, 64)
  const auto want = f.tensor<double>("resnet50.eval_logits");
  {  // float32 model: within a small multiple of PyTorch's own float32 error
    auto net = resnet50<E>({.num_classes = 10, .seed = 1});
    const auto loaded = load_state_dict(path, net);
    CHECK((loaded.missing_keys.empty() && loaded.unexpected_keys.empty()));
    const auto bn3 = std::find_if(keys.begin(), keys.end(), [](const std::string& l) {
      return l.rfind("layer4.2.bn3.num_batches_tracked|", 0) == 0;
    });
    CHECK(net.blocks()[15].main().get<7>().num_batches_tracked() == bn3 - keys.begin());  // its key index
    net.set_mode(Mode::Eval);
    decltype(net)::Cache cache;
    const auto logits = net.forward(x, cache).cast<double>();
    REQUIRE(logits.shape() == Shape{2, 10});
    const auto torch32 = f.tensor<double>("resnet50.torch_f32_eval_logits");
    double err = 0, err_vs_torch32 = 0, scale = 0;
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      err = std::max(err, std::abs(logits[i] - want[i]));
      err_vs_torch32 = std::max(err_vs_torch32, std::abs(logits[i] - torch32[i]));
      scale = std::max(scale, std::abs(want[i]));
    }
    const double torch_err = f.tensor<double>("resnet50.torch_f32_err")[0];
    testing::report_error("reference-f32", "resnet50.eval_logits", err / scale);
    INFO("tessera f32 error " << err / scale << ", torch f32 error " << torch_err << ", tessera vs torch f32 "
                              << err_vs_torch32 / scale);
    CHECK(err / scale <= 8 * torch_err + 1e-6);
    CHECK(err_vs_torch32 / scale <= 1e-5);
  }
  {  // float64 model from the same float32 file (F32 -> F64 is exact): PyTorch's float64 logits
    auto net = resnet50<E64>({.num_classes = 10});
    load_state_dict(path, net);
    net.set_mode(Mode::Eval);
    decltype(net)::Cache cache;
    expect_close(net.forward(x.cast<double>(), cache), want, 1e-10, "resnet50.eval_logits (float64)");
  }
  fs::remove_all(dir);
}
