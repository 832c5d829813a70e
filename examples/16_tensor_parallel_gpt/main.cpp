// 16_tensor_parallel_gpt: example 15's GPT split over the ranks as Megatron-LM splits it, with
// sequence parallelism (Korthikanti et al. 2022): every rank holds 1/p of each block's attention
// heads and MLP columns, and 1/p of the sequence between them; all ranks train on the same batch.
// Per block an all_gather of the LayerNorm's output over the sequence feeds the column-parallel
// layer (c_attn, c_fc), and a reduce_scatter of the row-parallel layer's partial sums (c_proj)
// hands each rank the sum for its positions; backward swaps the two.
//
//   build/examples/16_tensor_parallel_gpt_threads --ranks=2
//   mpirun -n 4 build/examples/16_tensor_parallel_gpt_mpi
//   tools/tessera-run -n 2 build/examples/16_tensor_parallel_gpt_gloo
//
// Before training it runs one step of the split model and of the dense GPT on every rank and
// compares the logits, the loss and every gradient (each rank's slice), and prints the bytes per
// block by formula beside those measured (the threads build counts what its collectives copy
// between the ranks; Gloo's cross the loopback interface). Then the Trainer trains the split model
// (the TensorParallel strategy) and prints the validation loss after each interval. It exits 1
// unless the step matches the dense one within --tolerance, the counted bytes equal the formula,
// and the validation loss ends below the bytes' unigram entropy (or --max-val-loss).
// --trace=trace.json records steps 4-5: every all_gather and reduce_scatter as a span.
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
  Options() : GptRecipe{.steps = 600, .eval_every = 200} {}
  double tolerance = 1e-5;
};

int run(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  const PreparedCorpus corpus = examples::fortunes_tokens(comm, o.data_dir);
  const TokenFile train_file(corpus.train, 256), val_file(corpus.val, 256);
  const GPTConfig config{.block_size = o.block, .vocab_size = 256, .n_layer = o.layers, .n_head = o.heads,
                         .n_embd = o.embd, .dropout = o.dropout};
  Rng rng(o.seed);
  GPT<E> dense(config, rng);                 // the same weights on every rank (checked)
  TensorParallelGPT<E> model(dense, comm);   // this rank's slices of them
  if (comm.rank() == 0)
    std::printf("16_tensor_parallel_gpt: %s on %d ranks: %lld heads and %lld MLP columns per rank and block, %lld "
                "positions of each window between the blocks' layers\n", model.name().c_str(), comm.size(),
                static_cast<long long>(o.heads / comm.size()), static_cast<long long>(4 * o.embd / comm.size()),
                static_cast<long long>(o.block / comm.size()));
  // Every rank reads the same windows: the batch is not split, the model is.
  TokenLoader<float> train(train_file.all(), o.block, {.batch_size = o.batch, .shuffle = true, .seed = o.seed},
                           o.eval_every, "fortunes train");
  TokenLoader<float> val(val_file.all(), o.block, {.batch_size = 32, .shuffle = false}, o.val_batches, "fortunes val");
  Batch<float> first;
  train.start_epoch(0);
  train.next(first);
  const bool step_ok = examples::check_tensor_parallel_step(comm, dense, model, first, o.tolerance);
  AdamW<E> adamw(named_tensors(model), {.lr = o.lr, .beta2 = o.beta2, .weight_decay = o.weight_decay,
                                        .decay_norm_and_bias = false});
  TensorParallel<E> tensor(comm, model);  // tells the Trainer that all ranks see each sample
  const examples::NanoGptLr lr_at{o.lr, o.min_lr, o.warmup, static_cast<double>(o.steps),
                                  static_cast<double>(o.eval_every)};  // nanoGPT's warmup + cosine
  Timeline timeline(comm);
  Trainer trainer(model, adamw, tensor, lr_at,
                  examples::gpt_train_options(comm, o, timeline, 2));
  const auto epochs = trainer.fit(train, &val);
  const examples::GptRun r = examples::gpt_run(epochs, static_cast<double>(trainer.state().global_step), comm.size(),
                                                o.threads, static_cast<double>(dense.num_params(false)), o.batch * o.block);
  if (comm.rank() != 0) return 0;
  std::printf("trained %.0f steps at %.0f tokens/s (all ranks together: each token once)\n", r.steps,
              r.tokens_per_second);
  return examples::check_val_loss(r, train_file.all(), o.max_val_loss, "") && step_ok ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  examples::parse_gpt_recipe(flags, o);
  o.batch = flags.get("batch", o.batch, {.min = 1}, "windows per batch (every rank sees all of them)");
  o.block = flags.get("block", o.block, {.min = 2}, "tokens per window (divides over the ranks)");
  o.heads = flags.get("heads", o.heads, {.min = 1}, "attention heads (divide over the ranks)");
  o.tolerance = flags.get("tolerance", o.tolerance, {.above = 0}, "the one-step check against the dense GPT");
  examples::parse_gpt_run<Comm>(flags, o, "tensor-parallel ranks", "4-5");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("16_tensor_parallel_gpt", argc, argv, parse, run); }
