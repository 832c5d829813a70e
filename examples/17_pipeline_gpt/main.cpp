// 17_pipeline_gpt: example 15's GPT cut into pipeline stages, one per rank, as GPipe and
// PipeDream-flush (1F1B) cut a transformer: the first stage holds the embeddings and some blocks,
// the last the remaining blocks and the head (ln_f and lm_head), the stages between them blocks
// only. Each batch is cut into micro-batches; activations (B/M, T, C) flow forward from stage to
// stage and their gradients back. lm_head is tied to the token embedding wte, which sits on the
// first stage: the last stage keeps its own copy, and after backward the two stages add each
// other's gradient of it, so both copies take the same step (Megatron-LM's embedding group).
//
//   build/examples/17_pipeline_gpt_threads --ranks=2
//   mpirun -n 4 build/examples/17_pipeline_gpt_mpi --schedule=gpipe
//   tools/tessera-run -n 3 build/examples/17_pipeline_gpt_gloo
//
// Before training it runs one step of the pipeline and of the whole GPT on the same batch and
// compares every stage's gradients, and prints each stage's units and the bytes it sent beside the
// formula. Then the Trainer trains the pipeline (the Pipeline strategy runs forward, loss and
// backward per stage) and prints the validation loss after each interval, and the bubble: the
// share of the step each stage sat idle, beside (P-1)/(M+P-1). It exits 1 unless the step matches
// within --tolerance, the bytes equal the formula, the two copies of wte are bit-identical after
// training and the validation loss ends below the bytes' unigram entropy (or --max-val-loss).
// --trace=trace.json records steps 4-5: every F_i / B_i and every send and receive.
#include <cstdio>
#include <cstring>
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
  int micro_batches = 4;
  std::string schedule = "1f1b";
  double tolerance = 1e-5;
};

// The last stage sends its copy of wte to the first, which compares the bits.
bool tied_copies_identical(Comm& comm, GPT<E>& model) {
  if (comm.size() == 1) return true;
  Tensor<float, Cpu>& wte = model.wte().weight().value;
  const auto n = static_cast<std::size_t>(wte.numel());
  if (comm.rank() == comm.size() - 1) comm.send(std::span<const float>(wte.data(), n), 0);
  if (comm.rank() != 0) return true;
  Tensor<float, Cpu> last(wte.shape());
  comm.recv(std::span<float>(last.data(), n), comm.size() - 1);
  const bool same = std::memcmp(last.data(), wte.data(), wte.bytes()) == 0;
  std::printf("check: the first and the last stage's copies of transformer.wte.weight %s\n",
              same ? "are bit-identical" : "DIFFER");
  return same;
}

int run(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  const PreparedCorpus corpus = examples::fortunes_tokens(comm, o.data_dir);
  const TokenFile train_file(corpus.train, 256), val_file(corpus.val, 256);
  const GPTConfig config{.block_size = o.block, .vocab_size = 256, .n_layer = o.layers, .n_head = o.heads,
                         .n_embd = o.embd, .dropout = o.dropout};
  Rng rng(o.seed), rng_whole(o.seed);
  GPT<E> model(config, rng), whole(config, rng_whole);  // the same weights on every rank; whole: the check's
  const PipelineSchedule schedule = o.schedule == "gpipe" ? PipelineSchedule::GPipe : PipelineSchedule::OneFOneB;
  Pipeline pipe(model, comm, {.micro_batches = o.micro_batches, .schedule = schedule});
  if (comm.rank() == 0)
    std::printf("17_pipeline_gpt: %s in %zu units over %d stages, %s, %d micro-batches of %lld windows\n",
                model.name().c_str(), model.unit_count(), comm.size(), schedule_name(schedule), o.micro_batches,
                static_cast<long long>(o.batch / o.micro_batches));
  // Every stage reads the same windows: stage 0 the token ids, the last stage the labels.
  TokenLoader<float> train(train_file.all(), o.block, {.batch_size = o.batch, .shuffle = true, .seed = o.seed},
                           o.eval_every, "fortunes train");
  TokenLoader<float> val(val_file.all(), o.block, {.batch_size = 32, .shuffle = false}, o.val_batches, "fortunes val");
  Batch<float> first;
  train.start_epoch(0);
  train.next(first);
  const bool step_ok = examples::check_pipeline_step(comm, whole, pipe, first, o.micro_batches, o.tolerance);
  AdamW<E> adamw(pipe.stage_parameters(), {.lr = o.lr, .beta2 = o.beta2, .weight_decay = o.weight_decay,
                                           .decay_norm_and_bias = false});
  const examples::NanoGptLr lr_at{o.lr, o.min_lr, o.warmup, static_cast<double>(o.steps),
                                  static_cast<double>(o.eval_every)};  // nanoGPT's warmup + cosine
  Timeline timeline(comm);
  Trainer trainer(model, adamw, pipe, lr_at,
                  examples::gpt_train_options(comm, o, timeline, 2));
  const auto epochs = trainer.fit(train, &val);
  double idle[1] = {pipe.last_step().idle_fraction()};
  comm.all_reduce(std::span<double>(idle), ReduceOp::Max);
  const bool tie_ok = tied_copies_identical(comm, model);
  const examples::GptRun r = examples::gpt_run(epochs, static_cast<double>(trainer.state().global_step), comm.size(),
                                                o.threads, static_cast<double>(model.num_params(false)), o.batch * o.block);
  if (comm.rank() != 0) return 0;
  std::printf("trained %.0f steps at %.0f tokens/s; the last step's most idle stage sat %.0f%% idle (bubble "
              "(P-1)/(M+P-1) = %.0f%% with equal stages)\n", r.steps, r.tokens_per_second, 100 * idle[0],
              100.0 * (comm.size() - 1) / (o.micro_batches + comm.size() - 1));
  return examples::check_val_loss(r, train_file.all(), o.max_val_loss, "") && step_ok && tie_ok ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  examples::parse_gpt_recipe(flags, o);
  o.batch = flags.get("batch", o.batch, {.min = 1}, "windows per batch (split into the micro-batches)");
  o.block = flags.get("block", o.block, {.min = 2}, "tokens per window (the model's block size)");
  o.heads = flags.get("heads", o.heads, {.min = 1}, "attention heads (divide --embd)");
  o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1}, "micro-batches per batch (divide --batch)");
  o.schedule = flags.choice("schedule", o.schedule, {"1f1b", "gpipe"}, "the pipeline schedule");
  o.tolerance = flags.get("tolerance", o.tolerance, {.above = 0}, "the one-step check against the whole GPT");
  examples::parse_gpt_run<Comm>(flags, o, "pipeline stages, one per rank", "4-5");
  flags.finish();
  TESSERA_CHECK(o.batch % o.micro_batches == 0, ArgumentError, "--batch=", o.batch, " does not split into ",
                o.micro_batches, " equal micro-batches (--micro-batches)");
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("17_pipeline_gpt", argc, argv, parse, run); }
