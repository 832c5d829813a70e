// 15_gpt: a GPT (nanoGPT's model) learns English from the fortunes package, one byte per token,
// data-parallel over ranks. The Trainer that drives the image examples drives it: a TokenLoader
// hands it windows of text, the GPT predicts the next byte at every position, DataParallel averages
// the gradients, AdamW steps with nanoGPT's rule (2-D weights decay; biases and LayerNorms do not)
// and schedule (linear warmup, cosine decay to min_lr).
//
//   build/examples/15_gpt_threads --ranks=2
//   mpirun -n 2 build/examples/15_gpt_mpi
//   tools/tessera-run -n 2 build/examples/15_gpt_gloo
//
// It prints a progress bar per evaluation interval, the validation loss over the whole validation
// split after each, the cost model (FLOPs per token, all-reduce bytes per step) beside the measured
// figures, and a sample. It exits 1 unless: the validation loss ends below --max-val-loss (default:
// the entropy of the bytes' frequencies, which a model that ignores context cannot beat); the
// replicas are bit-identical; the sample through the key/value cache equals the full forward's.
// --trace=trace.json records steps 4-7 (DataParallel's bucket all-reduces under backward);
// --json=result.json and --init-out=init.safetensors serve the PyTorch twin (bench/compare_gpt.py).
#include <algorithm>
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/gpt_report.hpp"
#include "common/rank_status.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;

struct Options : examples::GptRecipe {
  std::int64_t sample = 300, top_k = 40;
  double temperature = 0.8;
  std::string prompt, json, init_out;
};

int run(Comm& comm, const Options& o) {
  TESSERA_CHECK(o.batch % comm.size() == 0, ArgumentError, "--batch=", o.batch, " (the global batch, in windows) must "
                "be divisible by the ", comm.size(), " ranks");
  Cpu::set_num_threads(o.threads);
  const PreparedCorpus corpus = examples::fortunes_tokens(comm, o.data_dir);
  const TokenFile train_file(corpus.train, 256), val_file(corpus.val, 256);
  const GPTConfig config{.block_size = o.block, .vocab_size = 256, .n_layer = o.layers, .n_head = o.heads,
                         .n_embd = o.embd, .dropout = o.dropout};
  Rng rng(o.seed);
  GPT<E> model(config, rng);
  const double params = static_cast<double>(model.num_params(false)), non_embedding = static_cast<double>(model.num_params());
  if (comm.rank() == 0) {
    std::printf("15_gpt: %s, %.2fM parameters, on %d rank(s) x %d thread(s); %lld steps of %lld windows x %lld "
                "tokens\n", model.name().c_str(), params / 1e6, comm.size(), o.threads, static_cast<long long>(o.steps),
                static_cast<long long>(o.batch), static_cast<long long>(o.block));
    if (!o.init_out.empty()) save_state_dict(o.init_out, model);  // where the PyTorch twin starts
  }
  DataParallel<E> dp(model, comm);  // rank 0's weights on every rank
  AdamW<E> adamw(dp.parameters(), {.lr = o.lr, .beta2 = o.beta2, .weight_decay = o.weight_decay,
                                   .decay_norm_and_bias = false});
  // An "epoch" is one evaluation interval: the Trainer evaluates on the validation split after each.
  TokenLoader<float> train(train_file.all(), o.block, {.batch_size = o.batch / comm.size(), .shuffle = true,
                           .seed = o.seed, .rank = comm.rank(), .world_size = comm.size()}, o.eval_every, "fortunes train");
  TokenLoader<float> val(val_file.all(), o.block, {.batch_size = 32, .shuffle = false}, o.val_batches, "fortunes val");
  const examples::NanoGptLr lr_at{o.lr, o.min_lr, o.warmup, static_cast<double>(o.steps),
                                  static_cast<double>(o.eval_every)};  // nanoGPT's warmup + cosine
  Timeline timeline(comm);
  Trainer trainer(model, adamw, dp, lr_at,
                  examples::gpt_train_options(comm, o, timeline, 4));
  comm.barrier();
  const double peer0 = examples::peer_bytes(comm), lo0 = comm.rank() == 0 ? examples::loopback_bytes() : -1;
  const auto epochs = trainer.fit(train, &val);
  const double peer1 = examples::peer_bytes(comm), lo1 = comm.rank() == 0 ? examples::loopback_bytes() : -1;
  examples::check_replicas_identical(comm, model, "after training");
  const examples::GptRun r = examples::gpt_run(epochs, static_cast<double>(trainer.state().global_step), comm.size(),
                                                o.threads, params, o.batch * o.block);
  if (comm.rank() != 0) return 0;
  examples::print_gpt_cost(config, params, non_embedding, comm.size(), r.tokens_per_second, r.steps, peer0, peer1, lo0, lo1);
  const bool sample_ok = examples::print_sample(model, o.prompt, o.sample, o.temperature, o.top_k, o.seed);
  const bool loss_ok = examples::check_val_loss(r, train_file.all(), o.max_val_loss, o.json);
  return loss_ok && sample_ok ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  examples::parse_gpt_recipe(flags, o);
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch in windows, split over the ranks");
  o.block = flags.get("block", o.block, {.min = 2}, "tokens per window (the model's block size)");
  o.heads = flags.get("heads", o.heads, {.min = 1}, "attention heads (divide --embd)");
  o.beta2 = flags.get("beta2", o.beta2, {.min = 0, .max = 1}, "AdamW's beta2 (nanoGPT: 0.99 for small data)");
  examples::parse_gpt_run<Comm>(flags, o, "data-parallel ranks", "4-7");
  o.sample = flags.get("sample", o.sample, {.min = 0}, "tokens to generate after training");
  o.temperature = flags.get("temperature", o.temperature, {.above = 0}, "sampling temperature");
  o.top_k = flags.get("top-k", o.top_k, {.min = 1}, "sample among the k likeliest tokens");
  o.prompt = flags.get("prompt", o.prompt, "the sample's start (empty: a newline)");
  o.json = flags.output_path("json", o.json, "the result as one JSON line (bench/compare_gpt.py)");
  o.init_out = flags.output_path("init-out", o.init_out, "the initial weights, nanoGPT's keys (the PyTorch twin's)");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("15_gpt", argc, argv, parse, run); }
