// The transformer layers: LayerNorm, RMSNorm, Embedding, ScaledDotProductAttention, SelfAttention
// (nanoGPT's block) and CrossEntropyLoss over (B, T, V): float64 central-difference checks, PyTorch
// reference data (tests/data/transformer.safetensors from tools/reference/gen_transformer.py) in
// float64 and float32, and errors that name the layer and the index.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/kernels/attention.hpp"
#include "tessera/kernels/dropout_key.hpp"
#include "tessera/layers/attention.hpp"
#include "tessera/layers/embedding.hpp"
#include "tessera/layers/norm.hpp"
#include "tessera/losses/cross_entropy.hpp"

using namespace tessera;
using tessera::testing::T64;

static_assert(Layer<LayerNorm<CpuLocal>>);
static_assert(Layer<RMSNorm<CpuLocal64>>);
static_assert(Layer<SelfAttention<CpuLocal>>);

namespace {

using E64 = Env<Cpu, LocalComm, double>;

const SafetensorsFile& transformer_reference() {
  static const SafetensorsFile f =
      SafetensorsFile::load(std::string(TESSERA_REFERENCE_DATA_DIR) + "/transformer.safetensors");
  return f;
}

template <class S>
Tensor<S> transformer_load(const std::string& name) {
  return transformer_reference().tensor<double>(name).cast<S>();
}

bool transformer_has(const std::string& name) { return transformer_reference().has(name); }

std::string dims_str(std::initializer_list<std::int64_t> dims) {
  std::string s;
  for (auto d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

using testing::fmt_g;

// The generator's tables, repeated: each case's configuration string must equal the file's.
struct NormCase {
  const char* name;
  std::initializer_list<std::int64_t> shape, normalized;
  std::optional<double> eps;
  bool affine, bias;
  double offset;
};
const NormCase kLayerNorms[] = {
    {"ln_3d", {2, 3, 8}, {8}, 1e-5, true, true, 0.0},
    {"ln_two_dims", {2, 3, 4, 5}, {4, 5}, 1e-3, true, true, 0.0},
    {"ln_nobias", {4, 6}, {6}, 1e-5, true, false, 0.0},
    {"ln_noaffine", {3, 7}, {7}, 1e-5, false, false, 0.0},
    {"ln_offset", {5, 16}, {16}, 1e-5, true, true, 1000.0},
};
const NormCase kRmsNorms[] = {
    {"rms_3d", {2, 3, 8}, {8}, std::nullopt, true, false, 0.0},
    {"rms_eps", {4, 6}, {6}, 1e-5, true, false, 0.0},
    {"rms_noaffine", {3, 5, 4}, {5, 4}, 1e-6, false, false, 0.0},
};
std::string ln_config(const NormCase& k) {
  return "shape=" + dims_str(k.shape) + " normalized=" + dims_str(k.normalized) + " eps=" + fmt_g(*k.eps) +
         " affine=" + std::to_string(k.affine) + " bias=" + std::to_string(k.bias) + " offset=" + fmt_g(k.offset);
}
std::string rms_config(const NormCase& k) {
  return "shape=" + dims_str(k.shape) + " normalized=" + dims_str(k.normalized) +
         " eps=" + (k.eps ? fmt_g(*k.eps) : std::string("none")) + " affine=" + std::to_string(k.affine);
}

struct EmbeddingCase {
  const char* name;
  std::int64_t num, dim;
  std::initializer_list<std::int64_t> ids;
  std::optional<std::int64_t> padding;
  std::string config() const {
    return "num=" + std::to_string(num) + " dim=" + std::to_string(dim) + " ids=" + dims_str(ids) +
           " padding_idx=" + (padding ? std::to_string(*padding) : std::string("none"));
  }
};
const EmbeddingCase kEmbeddings[] = {
    {"emb_plain", 10, 4, {2, 5}, std::nullopt},
    {"emb_padding", 7, 3, {3, 4}, 2},
    {"emb_padding_negative", 6, 5, {9}, -1},
};

struct AttentionCase {
  const char* name;
  std::initializer_list<std::int64_t> q;
  std::int64_t keys, value_dim;
  bool causal;
  std::optional<double> scale;
  std::string config() const {
    return "q=" + dims_str(q) + " S=" + std::to_string(keys) + " dv=" + std::to_string(value_dim) +
           " causal=" + std::to_string(causal) + " scale=" + (scale ? fmt_g(*scale) : std::string("default"));
  }
};
const AttentionCase kAttentions[] = {
    {"sdpa_small", {2, 3, 5, 4}, 5, 4, false, std::nullopt},
    {"sdpa_causal", {2, 2, 9, 8}, 9, 8, true, std::nullopt},
    {"sdpa_cross", {2, 7, 4}, 11, 3, false, std::nullopt},
    {"sdpa_causal_tiles", {1, 2, 150, 16}, 150, 16, true, std::nullopt},  // 3 query and 3 key tiles
    {"sdpa_scale", {3, 6, 5}, 6, 5, false, 0.3},
    {"sdpa_causal_rect", {2, 6, 4}, 10, 4, true, std::nullopt},  // T < S: torch's top-left triangle
};

struct SelfAttentionCase {
  const char* name;
  std::int64_t batch, t, channels, heads;
  bool bias;
  std::string config() const {
    return "B=" + std::to_string(batch) + " T=" + std::to_string(t) + " C=" + std::to_string(channels) +
           " n_head=" + std::to_string(heads) + " bias=" + std::to_string(bias);
  }
};
const SelfAttentionCase kSelfAttentions[] = {
    {"attn_small", 2, 7, 12, 3, true},
    {"attn_tiles_nobias", 1, 70, 16, 2, false},
};

struct CeBtvCase {
  const char* name;
  std::int64_t batch, t, vocab, ignore_index, ignored;
  std::string config() const {
    return "B=" + std::to_string(batch) + " T=" + std::to_string(t) + " V=" + std::to_string(vocab) +
           " ignore_index=" + std::to_string(ignore_index) + " ignored=" + std::to_string(ignored);
  }
};
const CeBtvCase kCeBtvCases[] = {
    {"ce_btv_ignore", 2, 5, 7, -1, 3},
    {"ce_btv_default", 3, 4, 6, -100, 0},
};

template <class S>
void run_layer_norm(const NormCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << ln_config(k) << ")");
  REQUIRE(transformer_reference().metadata().at(n) == ln_config(k));
  LayerNorm<E> layer(Shape(k.normalized), *k.eps, k.affine, k.bias);
  if (k.affine) layer.weight().value = transformer_load<S>(n + ".weight");
  if (k.bias) layer.bias().value = transformer_load<S>(n + ".bias");
  typename LayerNorm<E>::Cache c;
  const Tensor<S> x = transformer_load<S>(n + ".x");
  testing::expect_matches(transformer_reference(), layer.forward(x, c), n + ".y");
  testing::expect_matches(transformer_reference(), layer.backward(transformer_load<S>(n + ".g"), c), n + ".dx");
  if (k.affine) testing::expect_matches(transformer_reference(), layer.weight().grad, n + ".dweight");
  if (k.bias) testing::expect_matches(transformer_reference(), layer.bias().grad, n + ".dbias");
  CHECK(transformer_has(n + ".dweight") == k.affine);
  CHECK(transformer_has(n + ".dbias") == k.bias);
}

template <class S>
void run_rms_norm(const NormCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << rms_config(k) << ")");
  REQUIRE(transformer_reference().metadata().at(n) == rms_config(k));
  RMSNorm<E> layer(Shape(k.normalized), k.eps, k.affine);
  if (k.affine) layer.weight().value = transformer_load<S>(n + ".weight");
  typename RMSNorm<E>::Cache c;
  const Tensor<S> x = transformer_load<S>(n + ".x");
  testing::expect_matches(transformer_reference(), layer.forward(x, c), n + ".y");
  testing::expect_matches(transformer_reference(), layer.backward(transformer_load<S>(n + ".g"), c), n + ".dx");
  if (k.affine) testing::expect_matches(transformer_reference(), layer.weight().grad, n + ".dweight");
}

template <class S>
void run_embedding(const EmbeddingCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(transformer_reference().metadata().at(n) == k.config());
  Rng rng(1);
  Embedding<E> emb(k.num, k.dim, rng, k.padding);
  if (k.padding) {
    const std::int64_t row = *k.padding < 0 ? *k.padding + k.num : *k.padding;
    for (std::int64_t j = 0; j < k.dim; ++j) CHECK(emb.weight().value[row * k.dim + j] == S(0));  // starts at 0
  }
  emb.weight().value = transformer_load<S>(n + ".weight");
  typename Embedding<E>::Cache c;
  const std::vector<std::int64_t> ids = testing::load_labels(transformer_reference(), n + ".ids");
  testing::expect_matches(transformer_reference(), emb.forward(ids, Shape(k.ids), c), n + ".y");
  emb.backward(transformer_load<S>(n + ".g"), c);
  testing::expect_matches(transformer_reference(), emb.weight().grad, n + ".dweight");
}

template <class S>
void run_attention(const AttentionCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(transformer_reference().metadata().at(n) == k.config());
  ScaledDotProductAttention<E> attention(k.causal, k.scale);
  typename ScaledDotProductAttention<E>::Cache c;
  const Tensor<S> q = transformer_load<S>(n + ".q"), key = transformer_load<S>(n + ".k"), v = transformer_load<S>(n + ".v");
  testing::expect_matches(transformer_reference(), attention.forward(q, key, v, c), n + ".out");
  const auto grads = attention.backward(transformer_load<S>(n + ".g"), c);
  testing::expect_matches(transformer_reference(), grads.dq, n + ".dq");
  testing::expect_matches(transformer_reference(), grads.dk, n + ".dk");
  testing::expect_matches(transformer_reference(), grads.dv, n + ".dv");
}

template <class S>
void run_self_attention(const SelfAttentionCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(transformer_reference().metadata().at(n) == k.config());
  Rng rng(2);
  SelfAttention<E> block(k.channels, k.heads, rng, /*causal=*/true, k.bias);
  std::vector<std::string> names;
  struct Loader {
    std::string case_name;
    std::vector<std::string>* names;
    void parameter(const std::string& name, Parameter<S, Cpu>& p) {
      names->push_back(name);
      p.value = transformer_load<S>(case_name + "." + name);
    }
  } loader{n, &names};
  block.visit(loader, "");
  CHECK(names == (k.bias ? std::vector<std::string>{"c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"}
                         : std::vector<std::string>{"c_attn.weight", "c_proj.weight"}));
  typename SelfAttention<E>::Cache c;
  const Tensor<S> x = transformer_load<S>(n + ".x");
  const testing::MatchOptions first_dot{.case_ends_at_first_dot = true};
  testing::expect_matches(transformer_reference(), block.forward(x, c), n + ".y", first_dot);
  testing::expect_matches(transformer_reference(), block.backward(transformer_load<S>(n + ".g"), c), n + ".dx", first_dot);
  testing::expect_matches(transformer_reference(), block.c_attn().weight().grad, n + ".dc_attn.weight", first_dot);
  testing::expect_matches(transformer_reference(), block.c_proj().weight().grad, n + ".dc_proj.weight", first_dot);
  if (k.bias) {
    testing::expect_matches(transformer_reference(), block.c_attn().bias().grad, n + ".dc_attn.bias", first_dot);
    testing::expect_matches(transformer_reference(), block.c_proj().bias().grad, n + ".dc_proj.bias", first_dot);
  }
}

template <class S>
void run_cross_entropy(const CeBtvCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(transformer_reference().metadata().at(n) == k.config());
  CrossEntropyLoss<E> loss(Reduction::Mean, 0.0, k.ignore_index);
  typename CrossEntropyLoss<E>::Cache c;
  const S value = loss.forward(transformer_load<S>(n + ".logits"), testing::load_labels(transformer_reference(), n + ".labels"), c);
  testing::expect_matches(transformer_reference(), Tensor<S>({1}, value), n + ".loss");
  const Tensor<S>& dlogits = loss.backward(c);
  CHECK(dlogits.shape() == Shape{k.batch, k.t, k.vocab});
  testing::expect_matches(transformer_reference(), dlogits, n + ".dlogits");
}

}  // namespace

TEST_CASE("LayerNorm and RMSNorm gradients by central differences (float64)", "[layers][norm]") {
  Rng rng(81);
  const T64 x = testing::random_tensor({2, 3, 6}, rng, 2.0);
  for (bool affine : {true, false})
    for (bool bias : {true, false}) {
      INFO("affine " << affine << " bias " << bias);
      LayerNorm<E64> ln(6, 1e-5, affine, bias);
      if (affine) testing::normal_fill(ln.weight().value, rng);  // away from 1: a forgotten weight fails
      if (affine && bias) testing::normal_fill(ln.bias().value, rng);
      testing::check_gradients(ln, x, rng);
    }
  LayerNorm<E64> two_dims(Shape{3, 6}, 1e-3);
  testing::normal_fill(two_dims.weight().value, rng);
  testing::check_gradients(two_dims, x, rng);
  for (bool affine : {true, false}) {
    INFO("RMSNorm affine " << affine);
    RMSNorm<E64> rms(6, 1e-6, affine);
    if (affine) testing::normal_fill(rms.weight().value, rng);
    testing::check_gradients(rms, x, rng);
  }
}

TEST_CASE("LayerNorm and RMSNorm match PyTorch (float64 and float32)", "[layers][norm][reference]") {
  for (const auto& k : kLayerNorms) {
    run_layer_norm<double>(k);
    run_layer_norm<float>(k);
  }
  for (const auto& k : kRmsNorms) {
    run_rms_norm<double>(k);
    run_rms_norm<float>(k);
  }
}

TEST_CASE("LayerNorm and RMSNorm defaults are torch's", "[layers][norm]") {
  LayerNorm<CpuLocal> ln(4);
  CHECK(ln.eps() == 1e-5);
  CHECK(ln.weight().value.at(3) == 1.0f);
  CHECK(ln.bias().value.at(3) == 0.0f);
  RMSNorm<CpuLocal> rms(4);
  CHECK(rms.eps() == static_cast<double>(std::numeric_limits<float>::epsilon()));  // torch's eps=None
  RMSNorm<CpuLocal64> rms64(4);
  CHECK(rms64.eps() == std::numeric_limits<double>::epsilon());
}

TEST_CASE("LayerNorm and RMSNorm reject bad shapes, naming the layer", "[layers][norm][errors]") {
  LayerNorm<E64> ln(Shape{3, 4});
  LayerNorm<E64>::Cache c;
  CHECK_THROWS_WITH(ln.forward(T64({2, 4, 3}), c), Catch::Contains("LayerNorm(normalized_shape=(3, 4))") &&
                                                      Catch::Contains("(*, 3, 4)") && Catch::Contains("(2, 4, 3)"));
  CHECK_THROWS_WITH(ln.backward(T64({2, 3, 4}), c), Catch::Contains("before forward"));
  const T64 x({2, 3, 4}, 1.0);  // the cache points to it until backward
  ln.forward(x, c);
  CHECK_THROWS_WITH(ln.backward(T64({3, 4}), c), Catch::Contains("dy (3, 4)") && Catch::Contains("(2, 3, 4)"));
  CHECK_THROWS_AS(LayerNorm<E64>(Shape{3, 0}), ArgumentError);
  CHECK_THROWS_AS(LayerNorm<E64>(4, -1.0), ArgumentError);
  RMSNorm<E64> rms(5);
  RMSNorm<E64>::Cache rc;
  CHECK_THROWS_WITH(rms.forward(T64({5, 4}), rc), Catch::Contains("RMSNorm") && Catch::Contains("(5, 4)"));
}

TEST_CASE("Embedding: gradient by central differences, padding row and repeated ids (float64)",
          "[layers][embedding]") {
  Rng rng(82);
  Embedding<E64> emb(6, 3, rng, /*padding_idx=*/4);
  const std::vector<std::int64_t> ids = {1, 4, 1, 0, 5, 4};  // 1 twice, the padding row twice
  const Shape shape{2, 3};
  const T64 g = testing::random_tensor({2, 3, 3}, rng);
  Embedding<E64>::Cache c;
  emb.forward(ids, shape, c);
  emb.backward(g, c);
  for (std::int64_t j = 0; j < 3; ++j) {
    CHECK(emb.weight().grad.at(4, j) == 0.0);                                  // padding: no gradient
    CHECK(emb.weight().grad.at(1, j) == g[0 * 3 + j] + g[2 * 3 + j]);          // repeated: summed
    CHECK(emb.weight().grad.at(2, j) == 0.0);                                  // unused
  }
  // The table's gradient against central differences of L(W) = sum(y(W) g), padding row excluded
  // (torch leaves it out of the gradient, so the numbers there differ by design).
  const T64 analytic = emb.weight().grad;
  T64 w = emb.weight().value;
  Embedding<E64> probe(6, 3, rng);
  testing::check_loss_gradient(w, analytic, [&](const T64& z) {
    T64 masked = z;
    for (std::int64_t j = 0; j < 3; ++j) masked.at(4, j) = w.at(4, j);  // hold the padding row
    probe.weight().value = masked;
    Embedding<E64>::Cache fresh;
    return testing::dot(probe.forward(ids, shape, fresh), g);
  });
}

TEST_CASE("Embedding matches PyTorch (float64 and float32)", "[layers][embedding][reference]") {
  for (const auto& k : kEmbeddings) {
    run_embedding<double>(k);
    run_embedding<float>(k);
  }
}

TEST_CASE("Embedding rejects bad ids and arguments, naming the position", "[layers][embedding][errors]") {
  Rng rng(83);
  Embedding<E64> emb(5, 2, rng);
  Embedding<E64>::Cache c;
  const std::vector<std::int64_t> ids = {0, 1, 2, 3, 5, 4};
  CHECK_THROWS_WITH(emb.forward(ids, Shape{2, 3}, c),
                    Catch::Contains("Embedding(5, 2)") && Catch::Contains("ids[1, 1] = 5") && Catch::Contains("[0, 5)"));
  const std::vector<std::int64_t> negative = {0, -1};
  CHECK_THROWS_WITH(emb.forward(negative, Shape{2}, c), Catch::Contains("ids[1] = -1"));
  CHECK_THROWS_AS(emb.forward(ids, Shape{2, 2}, c), ShapeError);
  CHECK_THROWS_WITH(emb.backward(T64({2, 2}), c), Catch::Contains("before forward"));
  CHECK_THROWS_WITH((Embedding<E64>(5, 2, rng, 5)), Catch::Contains("padding_idx=5"));
  CHECK_THROWS_AS((Embedding<E64>(0, 2, rng)), ArgumentError);
  Embedding<E64> negative_padding(5, 2, rng, -2);
  CHECK(negative_padding.padding_idx() == 3);  // torch counts a negative padding_idx from the end
}

TEST_CASE("ScaledDotProductAttention gradients by central differences (float64)", "[layers][attention]") {
  Rng rng(84);
  struct Shapes {
    std::int64_t heads, t, s, d, dv;
  };
  for (const Shapes& sh : {Shapes{2, 4, 4, 3, 3}, Shapes{1, 5, 7, 2, 3}, Shapes{1, 66, 66, 2, 2}})
    for (bool causal : {false, true}) {
      INFO("heads " << sh.heads << " T " << sh.t << " S " << sh.s << " causal " << causal);
      ScaledDotProductAttention<E64> attention(causal);
      const T64 q = testing::random_tensor({sh.heads, sh.t, sh.d}, rng);
      const T64 k = testing::random_tensor({sh.heads, sh.s, sh.d}, rng);
      const T64 v = testing::random_tensor({sh.heads, sh.s, sh.dv}, rng);
      const T64 g = testing::random_tensor({sh.heads, sh.t, sh.dv}, rng);
      ScaledDotProductAttention<E64>::Cache c;
      attention.forward(q, k, v, c);
      const auto grads = attention.backward(g, c);
      const auto loss = [&](const T64& qq, const T64& kk, const T64& vv) {
        ScaledDotProductAttention<E64>::Cache fresh;
        return testing::dot(attention.forward(qq, kk, vv, fresh), g);
      };
      testing::check_loss_gradient(q, grads.dq, [&](const T64& z) { return loss(z, k, v); });
      testing::check_loss_gradient(k, grads.dk, [&](const T64& z) { return loss(q, z, v); });
      testing::check_loss_gradient(v, grads.dv, [&](const T64& z) { return loss(q, k, z); });
    }
}

TEST_CASE("SelfAttention gradients by central differences (float64)", "[layers][attention]") {
  Rng rng(85);
  for (bool causal : {true, false}) {
    INFO("causal " << causal);
    SelfAttention<E64> block(8, 2, rng, causal);
    testing::check_gradients(block, testing::random_tensor({2, 5, 8}, rng), rng);
  }
  SelfAttention<E64> tiles(4, 1, rng, /*causal=*/true, /*bias=*/false);  // 70 > one 64-row tile
  testing::check_gradients(tiles, testing::random_tensor({1, 70, 4}, rng), rng);
}

namespace {
// SelfAttention with nanoGPT's two dropouts on and their keys fixed (one training step's masks):
// a deterministic function of x, so central differences apply.
struct KeyedSelfAttention {
  using Env = E64;
  using Tensor = T64;
  using Cache = SelfAttention<E64>::Cache;
  SelfAttention<E64> attention;
  DropoutKey attn_key, resid_key;
  const T64& forward(const T64& x, Cache& c) {
    c.attn_dropout = attn_key;
    c.resid_dropout = resid_key;
    return attention.forward(x, c);
  }
  const T64& backward(const T64& dy, Cache& c) { return attention.backward(dy, c); }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    attention.visit(v, prefix);
  }
  void set_mode(Mode m) { attention.set_mode(m); }
};
}  // namespace

TEST_CASE("Dropout keys: the share dropped is p, kept values scaled by 1/(1-p), a mask per global position",
          "[layers][dropout]") {
  const std::int64_t batch = 64, t = 10, width = 100;
  const std::vector<double> ones(static_cast<std::size_t>(batch * t * width), 1.0);
  for (double p : {0.1, 0.5}) {
    INFO("p " << p);
    const DropoutKey key{.p = p, .key = 42};
    std::vector<double> y(ones.size());
    dropout_rows(Cpu{}, key, batch, t, width, ones.data(), y.data());
    std::int64_t dropped = 0;
    for (double v : y) {
      dropped += v == 0.0;
      if (v != 0.0) CHECK(v == 1.0 / (1.0 - p));
    }
    // 64,000 draws: the share's standard deviation is at most 0.002, so 0.01 is 5 of them.
    CHECK(static_cast<double>(dropped) / static_cast<double>(y.size()) == Approx(p).margin(0.01));
    // Rows [32, 64) alone with batch_offset 32, and positions [4, 10) with seq_offset 4: the very
    // values of the whole call (a pipeline's micro-batch, a sequence-parallel rank's positions).
    std::vector<double> part(static_cast<std::size_t>(32 * t * width));
    DropoutKey rows = key;
    rows.batch_offset = 32;
    dropout_rows(Cpu{}, rows, 32, t, width, ones.data(), part.data());
    CHECK(std::equal(part.begin(), part.end(), y.begin() + 32 * t * width));
    DropoutKey positions = key;
    positions.seq_offset = 4;
    std::vector<double> tail(static_cast<std::size_t>(6 * width));
    dropout_rows(Cpu{}, positions, 1, 6, width, ones.data(), tail.data());
    CHECK(std::equal(tail.begin(), tail.end(), y.begin() + 4 * width));
    // Another site's key: another mask (they agree on about p^2 + (1-p)^2 of the elements).
    std::vector<double> other(ones.size());
    dropout_rows(Cpu{}, DropoutKey{.p = p, .key = DropoutKey::site_key(42, 1)}, batch, t, width, ones.data(),
                 other.data());
    std::int64_t same = 0;
    for (std::size_t i = 0; i < y.size(); ++i) same += (y[i] == 0.0) == (other[i] == 0.0);
    CHECK(static_cast<double>(same) / static_cast<double>(y.size()) == Approx(p * p + (1 - p) * (1 - p)).margin(0.01));
  }
  std::vector<double> y(ones.size());
  dropout_rows(Cpu{}, DropoutKey{}, batch, t, width, ones.data(), y.data());  // p = 0: the identity
  CHECK(y == ones);
}

TEST_CASE("Attention dropout: the fused kernel computes (softmax o M) v, and its gradients by central differences",
          "[layers][attention][dropout]") {
  Rng rng(89);
  // By hand, on 70 queries and keys (two tiles each way), at a batch and head offset.
  const std::int64_t heads = 2, t = 70, d = 3;
  const T64 q = testing::random_tensor({heads, t, d}, rng), k = testing::random_tensor({heads, t, d}, rng),
            v = testing::random_tensor({heads, t, d}, rng);
  const auto layout = AttentionLayout::contiguous(heads, t, d);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    AttentionDims n{1, heads, t, t, d, d};
    n.dropout = {.p = 0.25, .key = 1234, .batch_offset = 3, .head_offset = 5};
    T64 out({heads, t, d}), lse({heads, t});
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    attention_forward(Cpu{}, n, q.data(), layout, k.data(), layout, v.data(), layout, scale, causal, out.data(),
                      layout, lse.data());
    std::vector<double> p(static_cast<std::size_t>(t)), mask(static_cast<std::size_t>(t));
    double worst = 0;
    std::int64_t dropped = 0, visible = 0;
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < t; ++i) {
        const std::int64_t keys = causal ? i + 1 : t;
        double mx = -1e300, sum = 0;
        for (std::int64_t j = 0; j < keys; ++j) {
          double s = 0;
          for (std::int64_t e = 0; e < d; ++e) s += q[(h * t + i) * d + e] * k[(h * t + j) * d + e];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        for (std::int64_t j = 0; j < keys; ++j) sum += (p[j] = std::exp(p[j] - mx));
        dropout_row_mask(n.dropout.row(0, h, i), n.dropout.threshold(), 1.0 / 0.75, 0, keys, mask.data());
        for (std::int64_t j = 0; j < keys; ++j) dropped += mask[j] == 0.0;
        visible += keys;
        for (std::int64_t e = 0; e < d; ++e) {
          double o = 0;
          for (std::int64_t j = 0; j < keys; ++j) o += p[j] / sum * mask[j] * v[(h * t + j) * d + e];
          worst = std::max(worst, std::abs(o - out[(h * t + i) * d + e]));
        }
      }
    CHECK(worst < 1e-12);
    CHECK(static_cast<double>(dropped) / static_cast<double>(visible) == Approx(0.25).margin(0.03));
  }
  // Central differences through SelfAttention with both dropouts, over one tile and over two.
  KeyedSelfAttention small{SelfAttention<E64>(8, 2, rng, true), {.p = 0.3, .key = 77}, {.p = 0.3, .key = 78}};
  testing::check_gradients(small, testing::random_tensor({2, 5, 8}, rng), rng);
  KeyedSelfAttention tiles{SelfAttention<E64>(4, 1, rng, false, false), {.p = 0.5, .key = 79}, {.p = 0.1, .key = 80}};
  testing::check_gradients(tiles, testing::random_tensor({1, 70, 4}, rng), rng);
}

TEST_CASE("ScaledDotProductAttention dropout_p: Train drops, Eval does not, backward uses forward's masks (float64)",
          "[layers][attention][dropout]") {
  Rng rng(90);
  const T64 q = testing::random_tensor({3, 9, 4}, rng), k = testing::random_tensor({3, 11, 4}, rng),
            v = testing::random_tensor({3, 11, 5}, rng), g = testing::random_tensor({3, 9, 5}, rng);
  const auto values = [](const T64& t) { return std::vector<double>(t.begin(), t.end()); };
  ScaledDotProductAttention<E64> plain(false), dropped(false, std::nullopt, 0.4, 7);
  ScaledDotProductAttention<E64>::Cache cp, cd;
  const std::vector<double> reference = values(plain.forward(q, k, v, cp));
  dropped.set_mode(Mode::Eval);
  CHECK(values(dropped.forward(q, k, v, cd)) == reference);
  CHECK(!cd.dims.dropout.active());
  dropped.set_mode(Mode::Train);
  const std::vector<double> first = values(dropped.forward(q, k, v, cd));
  const AttentionDims n = cd.dims;  // this forward's key
  REQUIRE(n.dropout.active());
  CHECK(first != reference);
  const auto grads = dropped.backward(g, cd);
  // Central differences of sum(out * g) under the forward's masks: the kernel with its dims.
  const auto loss = [&](const T64& qq, const T64& kk, const T64& vv) {
    T64 out({3, 9, 5}), lse({3, 9});
    attention_forward(Cpu{}, n, qq.data(), AttentionLayout::contiguous(3, 9, 4), kk.data(),
                      AttentionLayout::contiguous(3, 11, 4), vv.data(), AttentionLayout::contiguous(3, 11, 5), cd.scale,
                      false, out.data(), AttentionLayout::contiguous(3, 9, 5), lse.data());
    return testing::dot(out, g);
  };
  double forward_loss = 0;
  for (std::size_t i = 0; i < first.size(); ++i) forward_loss += first[i] * g[static_cast<std::int64_t>(i)];
  CHECK(loss(q, k, v) == Approx(forward_loss).epsilon(1e-14));
  testing::check_loss_gradient(q, grads.dq, [&](const T64& z) { return loss(z, k, v); });
  testing::check_loss_gradient(k, grads.dk, [&](const T64& z) { return loss(q, z, v); });
  testing::check_loss_gradient(v, grads.dv, [&](const T64& z) { return loss(q, k, z); });
  ScaledDotProductAttention<E64>::Cache again;
  CHECK(values(dropped.forward(q, k, v, again)) != first);  // the next forward draws a new key
  CHECK_THROWS_WITH((ScaledDotProductAttention<E64>(false, std::nullopt, 1.0)), Catch::Contains("dropout_p=1"));
}

TEST_CASE("ScaledDotProductAttention and SelfAttention match PyTorch (float64 and float32)",
          "[layers][attention][reference]") {
  for (const auto& k : kAttentions) {
    run_attention<double>(k);
    run_attention<float>(k);
  }
  for (const auto& k : kSelfAttentions) {
    run_self_attention<double>(k);
    run_self_attention<float>(k);
  }
}

TEST_CASE("Attention by hand: one key gives its value, causal row 0 sees only key 0", "[layers][attention]") {
  ScaledDotProductAttention<E64> attention(/*is_causal=*/true);
  ScaledDotProductAttention<E64>::Cache c;
  const T64 q = T64::from({1, 2, 1}, {1.0, 2.0});
  const T64 k = T64::from({1, 2, 1}, {3.0, -1.0});
  const T64 v = T64::from({1, 2, 2}, {10.0, 20.0, 30.0, 40.0});
  const T64& out = attention.forward(q, k, v, c);
  CHECK(out[0] == 10.0);  // row 0: only key 0, whatever the scores
  CHECK(out[1] == 20.0);
  const double p0 = 1.0 / (1.0 + std::exp(2.0 * -1.0 - 2.0 * 3.0));  // row 1: softmax(6, -2)
  CHECK(out[2] == Approx(p0 * 10.0 + (1 - p0) * 30.0).epsilon(1e-14));
}

TEST_CASE("Attention rejects mismatched shapes, naming them", "[layers][attention][errors]") {
  ScaledDotProductAttention<E64> attention;
  ScaledDotProductAttention<E64>::Cache c;
  CHECK_THROWS_WITH(attention.forward(T64({2, 3, 4}), T64({2, 5, 3}), T64({2, 5, 4}), c),
                    Catch::Contains("same last dimension d") && Catch::Contains("k (2, 5, 3)"));
  CHECK_THROWS_WITH(attention.forward(T64({2, 3, 4}), T64({2, 5, 4}), T64({2, 6, 4}), c),
                    Catch::Contains("key count S"));
  CHECK_THROWS_WITH(attention.forward(T64({2, 3, 4}), T64({3, 5, 4}), T64({3, 5, 4}), c),
                    Catch::Contains("leading dimensions"));
  CHECK_THROWS_WITH(attention.backward(T64({2, 3, 4}), c), Catch::Contains("before forward"));
  Rng rng(86);
  CHECK_THROWS_WITH((SelfAttention<E64>(10, 3, rng)), Catch::Contains("n_embd=10") && Catch::Contains("n_head=3"));
  SelfAttention<E64> block(8, 2, rng);
  SelfAttention<E64>::Cache sc;
  CHECK_THROWS_WITH(block.forward(T64({2, 5, 6}), sc), Catch::Contains("(B, T, 8)") && Catch::Contains("(2, 5, 6)"));
}

TEST_CASE("CrossEntropyLoss over (B, T, V): gradient by central differences (float64)", "[losses][cross_entropy]") {
  Rng rng(87);
  const T64 logits = testing::random_tensor({2, 3, 5}, rng, 2.0);
  const std::vector<std::int64_t> labels = {4, -1, 0, 2, 1, -1};
  CrossEntropyLoss<E64> ce(Reduction::Mean, 0.0, /*ignore_index=*/-1);
  CrossEntropyLoss<E64>::Cache c;
  ce.forward(logits, labels, c);
  testing::check_loss_gradient(logits, ce.backward(c), [&](const T64& z) {
    CrossEntropyLoss<E64>::Cache fresh;
    return ce.forward(z, labels, fresh);
  });
  // The same numbers as the (B T, V) view, as nanoGPT computes it.
  T64 flat = logits;
  flat.reshape({6, 5});
  CrossEntropyLoss<E64>::Cache fc;
  CHECK(ce.forward(flat, labels, fc) == ce.forward(logits, labels, c));
  const std::vector<std::int64_t> bad = {4, -1, 0, 2, 5, -1};
  CHECK_THROWS_WITH(ce.forward(logits, bad, c), Catch::Contains("labels[1, 1] = 5"));
  CHECK_THROWS_WITH(ce.forward(logits, std::vector<std::int64_t>(5, 0), c), Catch::Contains("needs 6 labels"));
}

TEST_CASE("CrossEntropyLoss over (B, T, V) matches PyTorch (float64 and float32)",
          "[losses][cross_entropy][reference]") {
  for (const auto& k : kCeBtvCases) {
    run_cross_entropy<double>(k);
    run_cross_entropy<float>(k);
  }
}
