// GPT (models/gpt.hpp): nanoGPT's state dict keys, PyTorch reference cases (tests/data/gpt.safetensors
// from tools/reference/gen_gpt.py, nanoGPT's model.py rebuilt) in float64 and float32, float64
// central differences for every parameter, nanoGPT's initialization, the tie, and errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/gpt.hpp"

using namespace tessera;
using tessera::testing::T64;

static_assert(Layer<GPTBlock<CpuLocal>>);

namespace {

const SafetensorsFile& gpt_reference() {
  static const SafetensorsFile f = SafetensorsFile::load(std::string(TESSERA_REFERENCE_DATA_DIR) + "/gpt.safetensors");
  return f;
}

struct GptCase {
  const char* name;
  GPTConfig config;
  std::int64_t batch, t, ignored;
  std::string str() const {
    return "block_size=" + std::to_string(config.block_size) + " vocab_size=" + std::to_string(config.vocab_size) +
           " n_layer=" + std::to_string(config.n_layer) + " n_head=" + std::to_string(config.n_head) +
           " n_embd=" + std::to_string(config.n_embd) + " bias=" + std::to_string(config.bias) +
           " B=" + std::to_string(batch) + " T=" + std::to_string(t) + " ignored=" + std::to_string(ignored);
  }
};
const GptCase kGptCases[] = {
    {"gpt_tiny", {.block_size = 8, .vocab_size = 11, .n_layer = 2, .n_head = 2, .n_embd = 8, .bias = true}, 2, 6, 2},
    {"gpt_nobias_full_block", {.block_size = 8, .vocab_size = 13, .n_layer = 1, .n_head = 4, .n_embd = 8, .bias = false},
     2, 8, 0},
};

// Every name a visit hands out, parameters and buffers, in order.
template <class S>
struct GptKeyLister {
  std::vector<std::string> names;
  std::vector<std::string> parameters;
  void parameter(const std::string& n, Parameter<S, Cpu>&) {
    names.push_back(n);
    parameters.push_back(n);
  }
  void buffer(const std::string& n, Tensor<S>&) { names.push_back(n); }
};

// Loads "<case>.<key>" into every parameter and buffer (the tied buffer gets the same values again).
template <class S>
struct GptReferenceLoader {
  std::string prefix;
  void parameter(const std::string& n, Parameter<S, Cpu>& p) { buffer(n, p.value); }
  void buffer(const std::string& n, Tensor<S>& t) {
    const Tensor<S> v = gpt_reference().tensor<double>(prefix + n).template cast<S>();
    REQUIRE(v.shape() == t.shape());
    t = v;
  }
};

// Checks every parameter's gradient against "<case>.d<key>".
template <class S>
struct GptGradChecker {
  std::string prefix;
  void parameter(const std::string& n, Parameter<S, Cpu>& p) {
    testing::expect_matches(gpt_reference(), p.grad, prefix + "d" + n, {.case_ends_at_first_dot = true});
  }
  void buffer(const std::string&, Tensor<S>&) {}
};

template <class S>
void run_gpt_reference(const GptCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.str() << ")");
  REQUIRE(gpt_reference().metadata().at(n) == k.str());
  Rng rng(3);
  GPT<E> model(k.config, rng);
  GptKeyLister<S> keys;
  model.visit(keys);
  std::string joined;
  for (const auto& key : keys.names) joined += (joined.empty() ? "" : ",") + key;
  CHECK(joined == gpt_reference().metadata().at(n + ".keys"));  // nanoGPT's state_dict keys, in its order
  GptReferenceLoader<S> loader{n + "."};
  model.visit(loader);
  const auto idx = testing::load_labels(gpt_reference(), n + ".idx");
  const auto targets = testing::load_labels(gpt_reference(), n + ".targets");
  typename GPT<E>::Cache c;
  const testing::MatchOptions first_dot{.case_ends_at_first_dot = true};
  const Tensor<S>& logits = model.forward(idx, k.batch, k.t, c);
  testing::expect_matches(gpt_reference(), logits, n + ".logits", first_dot);
  CrossEntropyLoss<E> loss(Reduction::Mean, 0.0, /*ignore_index=*/-1);
  typename CrossEntropyLoss<E>::Cache lc;
  const S value = loss.forward(logits, targets, lc);
  testing::expect_matches(gpt_reference(), Tensor<S>({1}, value), n + ".loss", first_dot);
  model.backward(loss.backward(lc), c);
  GptGradChecker<S> grads{n + "."};
  model.visit(grads);
}

// A small GPT with weights larger than nanoGPT's 0.02, so that every position matters.
template <class E>
GPT<E> scrambled_gpt(const GPTConfig& config, std::uint64_t seed) {
  Rng rng(seed);
  GPT<E> model(config, rng);
  struct Scramble {
    Rng* rng;
    void parameter(const std::string&, Parameter<typename E::Scalar, Cpu>& p) {
      for (auto& v : p.value) v = static_cast<typename E::Scalar>(rng->normal(0.0, 0.5));
    }
    void buffer(const std::string&, Tensor<typename E::Scalar>&) {}
  } scramble{&rng};
  model.visit(scramble);
  return model;
}

// Backward of sum(logits * g) against central differences of it, every parameter (float64).
void check_gpt_gradients(GPT<CpuLocal64>& model, const std::vector<std::int64_t>& idx, std::int64_t batch,
                         std::int64_t t, const T64& g) {
  GPT<CpuLocal64>::Cache c;
  model.forward(idx, batch, t, c);
  model.backward(g, c);
  struct Check {
    GPT<CpuLocal64>* model;
    const std::vector<std::int64_t>* idx;
    const T64* g;
    std::int64_t batch, t;
    void parameter(const std::string& name, Parameter<double, Cpu>& p) {
      INFO("parameter " << name);
      const T64 saved = p.value;
      testing::check_loss_gradient(saved, p.grad, [&](const T64& z) {
        p.value = z;
        GPT<CpuLocal64>::Cache fresh;
        return testing::dot(model->forward(*idx, batch, t, fresh), *g);
      });
      p.value = saved;
    }
    void buffer(const std::string&, T64&) {}
  } check{&model, &idx, &g, batch, t};
  model.visit(check);
}

}  // namespace

TEST_CASE("GPT matches nanoGPT: keys, logits, loss and every gradient (float64 and float32)",
          "[models][gpt][reference]") {
  for (const auto& k : kGptCases) {
    run_gpt_reference<double>(k);
    run_gpt_reference<float>(k);
  }
}

TEST_CASE("GPT gradients by central differences, every parameter (float64)", "[models][gpt]") {
  Rng rng(91);
  // Larger weights than nanoGPT's 0.02: the gradients then depend on every path.
  GPT<CpuLocal64> model =
      scrambled_gpt<CpuLocal64>({.block_size = 5, .vocab_size = 7, .n_layer = 2, .n_head = 2, .n_embd = 4}, 91);
  const std::vector<std::int64_t> idx = {1, 6, 0, 3, 3, 2, 5, 4};  // (2, 4)
  const T64 g = testing::random_tensor({2, 4, 7}, rng);
  check_gpt_gradients(model, idx, 2, 4, g);
}

TEST_CASE("GPT: nanoGPT's initialization, parameter count and tie", "[models][gpt]") {
  Rng rng(92);
  GPTConfig config{.block_size = 64, .vocab_size = 300, .n_layer = 4, .n_head = 4, .n_embd = 64};
  GPT<CpuLocal> model(config, rng);
  const auto stddev = [](const Tensor<float>& t) {
    double s = 0;
    for (float v : t) s += static_cast<double>(v) * v;
    return std::sqrt(s / static_cast<double>(t.numel()));
  };
  CHECK(stddev(model.wte().weight().value) == Approx(0.02).epsilon(0.03));
  CHECK(stddev(model.blocks()[0].mlp_c_fc().weight().value) == Approx(0.02).epsilon(0.03));
  const double residual = 0.02 / std::sqrt(2.0 * 4);
  CHECK(stddev(model.blocks()[1].attn().c_proj().weight().value) == Approx(residual).epsilon(0.05));
  CHECK(stddev(model.blocks()[3].mlp_c_proj().weight().value) == Approx(residual).epsilon(0.05));
  CHECK(stddev(model.blocks()[2].mlp_c_proj().bias().value) == 0.0);
  CHECK(model.ln_f().weight().value.at(5) == 1.0f);
  // nanoGPT's get_num_params(): per block 12 C^2 + 13 C (weights and biases), wte V C, ln_f 2 C;
  // wpe counted only when asked.
  const std::int64_t c = 64, per_block = 12 * c * c + 13 * c;
  CHECK(model.num_params() == 4 * per_block + 300 * c + 2 * c);
  CHECK(model.num_params(false) == 4 * per_block + 300 * c + 2 * c + 64 * c);
  // The tie: lm_head.weight is wte's tensor, visited as a buffer.
  GptKeyLister<float> keys;
  model.visit(keys);
  CHECK(keys.names.back() == "lm_head.weight");
  CHECK(std::count(keys.parameters.begin(), keys.parameters.end(), "lm_head.weight") == 0);
  CHECK(keys.parameters.front() == "transformer.wte.weight");
  CHECK(GPTConfig::gpt2().vocab_size == 50257);
}

TEST_CASE("GPT rejects bad configurations, sequences and token ids", "[models][gpt][errors]") {
  Rng rng(93);
  CHECK_THROWS_WITH(GPT<CpuLocal64>(GPTConfig{.n_head = 5}, rng), Catch::Contains("multiple of n_head"));
  CHECK_THROWS_WITH(GPT<CpuLocal64>(GPTConfig{.dropout = 1.0}, rng), Catch::Contains("dropout must lie in [0, 1)"));
  CHECK_THROWS_WITH(GPT<CpuLocal64>(GPTConfig{.dropout = -0.1}, rng), Catch::Contains("dropout=-0.1"));
  GPT<CpuLocal64> model({.block_size = 4, .vocab_size = 5, .n_layer = 1, .n_head = 1, .n_embd = 2}, rng);
  GPT<CpuLocal64>::Cache c;
  const std::vector<std::int64_t> five(5, 0);
  CHECK_THROWS_WITH(model.forward(five, 1, 5, c), Catch::Contains("sequence of length 5") &&
                                                      Catch::Contains("block size is only 4"));
  const std::vector<std::int64_t> bad = {0, 1, 2, 3, 4, 5};
  CHECK_THROWS_WITH(model.forward(bad, 2, 3, c), Catch::Contains("ids[1, 2] = 5") && Catch::Contains("[0, 5)"));
  CHECK_THROWS_AS(model.forward(bad, 2, 2, c), ShapeError);
  CHECK_THROWS_WITH(model.backward(T64({1, 2, 5}), c), Catch::Contains("before forward"));
}


TEST_CASE("GPT forward_cached equals the full forward, chunk by chunk", "[models][gpt][generate]") {
  const GPTConfig config{.block_size = 8, .vocab_size = 9, .n_layer = 2, .n_head = 2, .n_embd = 8};
  const std::vector<std::int64_t> idx = {1, 5, 2, 8, 0, 3, 3, 7, 4, 4, 6, 1, 2, 0, 5, 8};  // (2, 8)
  auto check = [&](auto tag, double tolerance) {
    using E = decltype(tag);
    using S = typename E::Scalar;
    GPT<E> model = scrambled_gpt<E>(config, 94);
    typename GPT<E>::Cache full_cache, c;
    const Tensor<S> full = model.forward(idx, 2, 8, full_cache);
    typename GPT<E>::KVState kv;
    std::int64_t done = 0;
    for (std::int64_t chunk : {3, 1, 2, 1, 1}) {  // 3 + 1 + 2 + 1 + 1 = 8 positions
      std::vector<std::int64_t> part;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t i = done; i < done + chunk; ++i) part.push_back(idx[static_cast<std::size_t>(b * 8 + i)]);
      const Tensor<S>& logits = model.forward_cached(part, 2, chunk, kv, c);
      REQUIRE(logits.shape() == Shape{2, chunk, 9});
      T64 want({2, chunk, 9}), got({2, chunk, 9});
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t i = 0; i < chunk; ++i)
          for (std::int64_t j = 0; j < 9; ++j) {
            want.at(b, i, j) = static_cast<double>(full.at(b, done + i, j));
            got.at(b, i, j) = static_cast<double>(logits.at(b, i, j));
          }
      INFO("positions " << done << " to " << done + chunk - 1);
      CHECK(testing::relative_error(got, want) < tolerance);
      done += chunk;
    }
    CHECK(kv.length() == 8);
    const std::vector<std::int64_t> one = {1, 2};
    CHECK_THROWS_WITH(model.forward_cached(one, 2, 1, kv, c), Catch::Contains("block size is only 8"));
    CHECK_THROWS_WITH(model.backward(Tensor<S>({2, 1, 9}), c), Catch::Contains("forward_cached"));
  };
  check(CpuLocal64{}, 1e-13);
  check(CpuLocal{}, 1e-5);
}

TEST_CASE("GPT generate: the key/value cache gives the tokens the full forward gives", "[models][gpt][generate]") {
  const GPTConfig config{.block_size = 8, .vocab_size = 9, .n_layer = 2, .n_head = 2, .n_embd = 8};
  GPT<CpuLocal> model = scrambled_gpt<CpuLocal>(config, 95);
  const std::vector<std::int64_t> prompt = {1, 5, 2, 4, 4, 6};  // 2 sequences of 3
  for (std::optional<std::int64_t> top_k : {std::optional<std::int64_t>{}, std::optional<std::int64_t>{3}}) {
    INFO("top_k " << (top_k ? *top_k : 0));
    // 3 + 12 = 15 > block_size 8: the window slides for the last 7 tokens.
    GPT<CpuLocal>::GenerateOptions o{.max_new_tokens = 12, .temperature = 0.8, .top_k = top_k, .kv_cache = true};
    Rng cached_rng(7), full_rng(7);
    const auto cached = model.generate(prompt, 2, o, cached_rng);
    o.kv_cache = false;
    const auto full = model.generate(prompt, 2, o, full_rng);
    REQUIRE(cached.size() == 30);
    CHECK(cached == full);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t i = 0; i < 3; ++i) CHECK(cached[static_cast<std::size_t>(b * 15 + i)] == prompt[static_cast<std::size_t>(b * 3 + i)]);
    for (std::int64_t id : cached) CHECK((id >= 0 && id < 9));
  }
  // top_k = 1 is greedy: every new token is the argmax of the full forward's last logits.
  Rng rng(8);
  const auto greedy = model.generate(std::vector<std::int64_t>{3, 1}, 1, {.max_new_tokens = 5, .top_k = 1}, rng);
  for (std::size_t len = 2; len < greedy.size(); ++len) {
    GPT<CpuLocal>::Cache c;
    const std::vector<std::int64_t> context(greedy.begin(), greedy.begin() + static_cast<std::ptrdiff_t>(len));
    const Tensor<float>& logits = model.forward(context, 1, static_cast<std::int64_t>(len), c);
    std::int64_t best = 0;
    for (std::int64_t j = 1; j < 9; ++j)
      if (logits.at(0, static_cast<std::int64_t>(len) - 1, j) > logits.at(0, static_cast<std::int64_t>(len) - 1, best)) best = j;
    CHECK(greedy[len] == best);
  }
  CHECK_THROWS_AS(model.generate(prompt, 2, {.temperature = 0.0}, rng), ArgumentError);
  CHECK_THROWS_AS(model.generate(prompt, 4, {}, rng), ShapeError);
}

TEST_CASE("GPT: nanoGPT's AdamW rule is decay_norm_and_bias = false (2-D tensors are exactly the weights)",
          "[models][gpt]") {
  Rng rng(96);
  GPT<CpuLocal> model({.block_size = 8, .vocab_size = 11, .n_layer = 2, .n_head = 2, .n_embd = 8}, rng);
  struct Kinds {
    int weights = 0, others = 0;
    void parameter(const std::string& name, Parameter<float, Cpu>& p) {
      INFO(name);
      CHECK((p.value.rank() >= 2) == (p.kind == ParamKind::Weight));  // nanoGPT: p.dim() >= 2 decays
      ++(p.kind == ParamKind::Weight ? weights : others);
    }
    void buffer(const std::string&, Tensor<float>&) {}
  } kinds;
  model.visit(kinds);
  CHECK(kinds.weights == 2 + 2 * 4);        // wte, wpe; c_attn, c_proj, c_fc, mlp.c_proj per block
  CHECK(kinds.others == 2 * 8 + 2);         // 4 LayerNorm tensors and 4 biases per block; ln_f's 2
}

TEST_CASE("GPT activation checkpointing gives the same logits and gradients, bit for bit", "[models][gpt]") {
  const GPTConfig config{.block_size = 16, .vocab_size = 12, .n_layer = 3, .n_head = 2, .n_embd = 8};
  std::vector<std::int64_t> idx(2 * 16);
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<std::int64_t>((i * 7 + 3) % 12);
  auto grads_of = [&](bool checkpointing) {
    GPT<CpuLocal> model = scrambled_gpt<CpuLocal>(config, 97);
    model.set_activation_checkpointing(checkpointing);
    CrossEntropyLoss<CpuLocal> loss;
    std::vector<std::vector<float>> out;
    for (int step = 0; step < 2; ++step) {  // twice: the second step reuses the caches
      GPT<CpuLocal>::Cache c;
      CrossEntropyLoss<CpuLocal>::Cache lc;
      const Tensor<float>& logits = model.forward(idx, 2, 16, c);
      out.emplace_back(logits.begin(), logits.end());
      loss.forward(logits, idx, lc);
      model.backward(loss.backward(lc), c);
    }
    struct Grads {
      std::vector<std::vector<float>>* out;
      void parameter(const std::string&, Parameter<float, Cpu>& p) { out->emplace_back(p.grad.begin(), p.grad.end()); }
      void buffer(const std::string&, Tensor<float>&) {}
    } g{&out};
    model.visit(g);
    return out;
  };
  const auto plain = grads_of(false), checkpointed = grads_of(true);
  REQUIRE(plain.size() == checkpointed.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(plain[i] == checkpointed[i]);
}

namespace {
// Every gradient of a model, in visit order.
template <class E>
std::vector<std::vector<typename E::Scalar>> gpt_grads(GPT<E>& model) {
  using S = typename E::Scalar;
  std::vector<std::vector<S>> out;
  struct Grads {
    std::vector<std::vector<S>>* out;
    void parameter(const std::string&, Parameter<S, Cpu>& p) { out->emplace_back(p.grad.begin(), p.grad.end()); }
    void buffer(const std::string&, Tensor<S>&) {}
  } g{&out};
  model.visit(g);
  return out;
}
}  // namespace

TEST_CASE("GPT dropout: weights of p = 0, eval drops nothing, each step new masks, held keys replay",
          "[models][gpt][dropout]") {
  const GPTConfig base{.block_size = 16, .vocab_size = 12, .n_layer = 2, .n_head = 2, .n_embd = 8};
  GPTConfig dropped = base;
  dropped.dropout = 0.2;
  std::vector<std::int64_t> idx(2 * 16);
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<std::int64_t>((i * 5 + 1) % 12);
  Rng r0(7), r1(7);
  GPT<CpuLocal> plain(base, r0), model(dropped, r1);
  GPT<CpuLocal>::Cache c0, c1;
  const Tensor<float>& plain_logits = plain.forward(idx, 2, 16, c0);
  const std::vector<float> reference(plain_logits.begin(), plain_logits.end());
  // The generator is drawn after the weights: they are p = 0's, and in Eval mode so are the logits.
  model.set_mode(Mode::Eval);
  const Tensor<float>& eval = model.forward(idx, 2, 16, c1);
  CHECK(std::vector<float>(eval.begin(), eval.end()) == reference);
  model.set_mode(Mode::Train);
  const Tensor<float>& train1 = model.forward(idx, 2, 16, c1);
  const std::vector<float> step1(train1.begin(), train1.end());
  const Tensor<float>& step2 = model.forward(idx, 2, 16, c1);
  CHECK(step1 != reference);
  CHECK(std::vector<float>(step2.begin(), step2.end()) != step1);  // each training forward draws new masks
  // A held key replays one step's masks; the draw sequence is the generator's, so a model whose
  // generator sits at the same state draws the same key.
  Rng r2(7);
  GPT<CpuLocal> twin(dropped, r2);
  const std::uint64_t key = twin.dropout_rng().next_u64();
  twin.hold_dropout_key(key);
  GPT<CpuLocal>::Cache c2;
  const Tensor<float>& held_logits = twin.forward(idx, 2, 16, c2);
  const std::vector<float> held(held_logits.begin(), held_logits.end());
  twin.release_dropout_key();
  Rng r3(7);
  GPT<CpuLocal> fresh(dropped, r3);
  GPT<CpuLocal>::Cache c3;
  const Tensor<float>& first = fresh.forward(idx, 2, 16, c3);
  CHECK(std::vector<float>(first.begin(), first.end()) == held);
  // Rows keep their masks whatever batch they come in: rows [1, 2) alone with batch_offset 1 give
  // the second row of the two-row forward.
  twin.hold_dropout_key(key, 1);
  GPT<CpuLocal>::Cache c4;
  const Tensor<float>& second_row = twin.forward(std::span<const std::int64_t>(idx).subspan(16), 1, 16, c4);
  twin.release_dropout_key();
  CHECK(std::vector<float>(second_row.begin(), second_row.end()) ==
        std::vector<float>(held.begin() + 16 * 12, held.end()));
  // Generation drops nothing, in whatever mode.
  Rng g1(3), g2(3);
  const std::vector<std::int64_t> prompt = {1, 2};
  CHECK(model.generate(prompt, 1, {.max_new_tokens = 6, .kv_cache = false}, g1) ==
        plain.generate(prompt, 1, {.max_new_tokens = 6, .kv_cache = false}, g2));
  // Checkpoints keep the generator (the state dict does not: nanoGPT's keys only).
  GptKeyLister<float> keys;
  model.visit(keys);
  CHECK(std::count(keys.names.begin(), keys.names.end(), "transformer.drop.rng") == 0);
  struct Rngs {
    std::vector<std::string> names;
    void parameter(const std::string&, Parameter<float, Cpu>&) {}
    void buffer(const std::string&, Tensor<float>&) {}
    void rng(const std::string& name, Rng&) { names.push_back(name); }
  } rngs;
  model.visit(rngs);
  CHECK(rngs.names == std::vector<std::string>{"transformer.drop.rng"});
  plain.visit(rngs);
  CHECK(rngs.names.size() == 1);  // p = 0: no generator to keep
}

TEST_CASE("GPT dropout: central differences with a held key, every parameter (float64)", "[models][gpt][dropout]") {
  Rng rng(95);
  GPT<CpuLocal64> model = scrambled_gpt<CpuLocal64>(
      {.block_size = 5, .vocab_size = 7, .n_layer = 2, .n_head = 2, .n_embd = 4, .dropout = 0.3}, 95);
  model.hold_dropout_key(0x5eed);  // one step's masks, on every evaluation
  const std::vector<std::int64_t> idx = {1, 6, 0, 3, 3, 2, 5, 4};  // (2, 4)
  const T64 g = testing::random_tensor({2, 4, 7}, rng);
  GPT<CpuLocal64>::Cache c;
  model.forward(idx, 2, 4, c);
  std::int64_t zeros = 0;
  for (double v : c.x) zeros += v == 0.0;
  CHECK(zeros > 0);  // transformer.drop dropped some of the 32 embedding values
  check_gpt_gradients(model, idx, 2, 4, g);
}

TEST_CASE("GPT dropout with activation checkpointing: the recompute replays the masks, bit for bit",
          "[models][gpt][dropout]") {
  const GPTConfig config{.block_size = 16, .vocab_size = 12, .n_layer = 3, .n_head = 2, .n_embd = 8, .dropout = 0.25};
  std::vector<std::int64_t> idx(2 * 16);
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<std::int64_t>((i * 7 + 3) % 12);
  auto grads_of = [&](bool checkpointing) {
    GPT<CpuLocal> model = scrambled_gpt<CpuLocal>(config, 98);
    model.set_activation_checkpointing(checkpointing);
    CrossEntropyLoss<CpuLocal> loss;
    std::vector<float> losses;
    for (int step = 0; step < 2; ++step) {  // two steps: two draws
      GPT<CpuLocal>::Cache c;
      CrossEntropyLoss<CpuLocal>::Cache lc;
      losses.push_back(loss.forward(model.forward(idx, 2, 16, c), idx, lc));
      model.backward(loss.backward(lc), c);
    }
    auto grads = gpt_grads(model);
    grads.push_back(losses);
    return grads;
  };
  const auto plain = grads_of(false), checkpointed = grads_of(true);
  REQUIRE(plain.size() == checkpointed.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(plain[i] == checkpointed[i]);
}
