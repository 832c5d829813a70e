// Models: parameter counts against torchvision / torch twins, and whole-model forward + backward
// against PyTorch with the same weights loaded by name (checks architecture and names together).
#include <catch2/catch.hpp>

#include "support/gradcheck.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/io/safetensors.hpp"

using namespace tessera;
using E = CpuLocal;
using E64 = CpuLocal64;

static_assert(Layer<ResNet<E, Bottleneck>>, "models satisfy the Layer concept, so they nest and pipeline");
static_assert(Layer<Mlp<E>>);
static_assert(Layer<LeNet5<E>>);

namespace {
const SafetensorsFile& reference() {
  static const SafetensorsFile f = SafetensorsFile::load(TESSERA_REFERENCE_DATA_DIR "/models.safetensors");
  return f;
}
template <class M>
std::int64_t parameter_count(M& model) {
  return static_cast<std::int64_t>(count_parameters(named_tensors(model)));
}
std::int64_t torch_count(const std::string& name) {
  return reference().tensor<std::int64_t>("count." + name)[0];
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
  const auto& f = reference();
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
  const auto& f = reference();
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
