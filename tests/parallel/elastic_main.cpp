// Elastic resume as a multi-process program (MPI under mpirun, Gloo under tessera-run), driven by
// tests/parallel/elastic_test.py, for DataParallel + SGD, Zero1 + Adam and FullyShardedDataParallel
// (stage 3) + AdamW, whose checkpoint is a directory of per-rank shards (parallel/elastic_resume.hpp):
//
//   elastic_<backend> save PREFIX      at N ranks: an uninterrupted run, whose final loss and
//                                      parameters rank 0 writes to PREFIX.<strategy>.ref, and a run
//                                      stopped at step 8 (mid-epoch 2) with its checkpoint in
//                                      PREFIX.<strategy>.safetensors (FSDP: the directory
//                                      PREFIX.fsdp3.shards, each rank writing its own file)
//   elastic_<backend> resume PREFIX    at M ranks: resumes from that checkpoint and compares with
//                                      the .ref: "<strategy> N -> M: loss ... max |param diff| ..."
//                                      on rank 0; exit 1 beyond 1e-11
//   [--per-rank-batch=B]               resume with B per rank instead of 16 / M (a refusal test)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "comm/program.hpp"
#include "parallel/elastic_resume.hpp"

namespace {

using namespace tessera;
using namespace tessera::testing;

std::string file_name(const std::string& prefix, ElasticStrategy s, const char* ext) {
  if (s == ElasticStrategy::Fsdp3AdamW) return prefix + ".fsdp3" + (std::strcmp(ext, ".ref") == 0 ? ext : ".shards");
  return prefix + (s == ElasticStrategy::DataParallelSgd ? ".dp" : ".zero1") + ext;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::strcmp(argv[1], "save") != 0 && std::strcmp(argv[1], "resume") != 0)) {
    std::fprintf(stderr, "usage: %s save|resume PREFIX [--per-rank-batch=B]\n", argv[0]);
    return 2;
  }
  const bool save = std::strcmp(argv[1], "save") == 0;
  const std::string prefix = argv[2];
  std::int64_t per_rank_batch = 0;
  for (int i = 3; i < argc; ++i)
    if (std::strncmp(argv[i], "--per-rank-batch=", 17) == 0) per_rank_batch = std::atoll(argv[i] + 17);
  return run_ranks([&](TestComm& comm) {
    int failures = 0;
    for (ElasticStrategy strategy : {ElasticStrategy::DataParallelSgd, ElasticStrategy::Zero1Adam, ElasticStrategy::Fsdp3AdamW}) {
      const std::string ckpt = file_name(prefix, strategy, ".safetensors"), ref = file_name(prefix, strategy, ".ref");
      if (save) {
        const ElasticResult straight = elastic_run<double>(comm, {.strategy = strategy});
        const ElasticResult first = elastic_run<double>(comm, {.strategy = strategy, .stop_after_steps = 8, .checkpoint = ckpt});
        if (comm.rank() == 0) {
          std::FILE* f = std::fopen(ref.c_str(), "w");
          if (!f) throw IoError("elastic: cannot write " + ref);
          std::fprintf(f, "%d %.17g %zu\n", comm.size(), straight.losses.back(), straight.params.size());
          for (double p : straight.params) std::fprintf(f, "%.17g\n", p);
          std::fclose(f);
          std::printf("%s at %d ranks: final epoch loss %.17g; stopped at step %lld with %s\n", to_string(strategy),
                      comm.size(), straight.losses.back(), static_cast<long long>(first.global_step), ckpt.c_str());
        }
        if (!straight.ranks_identical || first.global_step != 8) ++failures;
      } else {
        const ElasticResult resumed =
            elastic_run<double>(comm, {.strategy = strategy, .resume = ckpt, .per_rank_batch = per_rank_batch});
        std::ifstream in(ref);
        int saved_ranks = 0;
        double loss = 0;
        std::size_t n = 0;
        in >> saved_ranks >> loss >> n;
        std::vector<double> params(n);
        for (auto& p : params) in >> p;
        if (!in) throw IoError("elastic: cannot read " + ref);
        const double diff = max_difference(params, resumed.params);
        const double loss_diff = std::abs(resumed.losses.back() - loss);
        const bool ok = diff < 1e-11 && loss_diff < 1e-11 && resumed.ranks_identical && resumed.global_step == 18;
        if (comm.rank() == 0)
          std::printf("%s %d -> %d (%s): final epoch loss uninterrupted %.17g, resumed %.17g; max |param diff| %.3g%s\n",
                      to_string(strategy), saved_ranks, comm.size(), backend_name(), loss, resumed.losses.back(), diff,
                      ok ? "" : "  FAILED");
        if (!ok) ++failures;
      }
    }
    std::fflush(stdout);
    comm.barrier();
    return failures == 0 ? 0 : 1;
  }, launch_options(argc, argv));
}
