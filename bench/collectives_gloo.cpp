// Collectives over GlooComm next to the raw gloo algorithms (bench/collectives.hpp has the driver).
#include <gloo/reduce_scatter.h>

#include "tessera/comm/gloo.hpp"
#include "collectives.hpp"

using namespace collectives_bench;
int main(int argc, char** argv) {
  using namespace tessera;
  const Options o = parse(argc, argv);
  auto comm = GlooComm::from_env();
  const int rank = comm.rank(), n = comm.size();
  const auto context = comm.native();
  if (rank == 0) header();
  // Raw calls get tags from a range the communicator never reaches in this run.
  std::uint32_t raw_tag = 0x40000000u;
  auto barrier = [&] {
    gloo::BarrierOptions opts(context);
    opts.setTag(raw_tag++);
    gloo::barrier(opts);
  };
  auto max_over = [&](double t) {
    gloo::AllreduceOptions opts(context);
    opts.setOutput(&t, 1);
    opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<double>));
    opts.setTag(raw_tag++);
    gloo::allreduce(opts);
    return t;
  };
  auto raw_allreduce = [&](gloo::AllreduceOptions::Algorithm algorithm) {
    return [&, algorithm](Buffers& b, std::size_t) {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(b.a.data(), b.a.size());
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setAlgorithm(algorithm);
      opts.setTag(raw_tag++);
      gloo::allreduce(opts);
    };
  };
  // The old-style halving-doubling reduce-scatter is built once per size (as it is meant to be
  // used) and then run; rebuilding it when the buffer changes.
  std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>> rs;
  const float* rs_for = nullptr;
  std::vector<float> rs_work;
  auto impls_for = [&](const std::string& op) {
    std::vector<Impl> impls = {tessera_impl(comm, op)};
    if (op == "all_reduce") {
      impls.push_back({"raw gloo::allreduce ring", raw_allreduce(gloo::AllreduceOptions::Algorithm::RING)});
      impls.push_back({"raw gloo::allreduce bcube", raw_allreduce(gloo::AllreduceOptions::Algorithm::BCUBE)});
    } else if (op == "all_gather") {
      impls.push_back({"raw gloo::allgather", [&](Buffers& b, std::size_t) {
                         gloo::AllgatherOptions opts(context);
                         opts.setInput(b.a.data(), b.a.size());
                         opts.setOutput(b.b.data(), b.b.size());
                         opts.setTag(raw_tag++);
                         gloo::allgather(opts);
                       }});
    } else if (op == "reduce_scatter") {
      impls.push_back({"raw gloo::ReduceScatterHalvingDoubling", [&](Buffers& b, std::size_t) {
                         // In place on a work copy of the input, like the algorithm requires.
                         if (rs_for != b.a.data()) {
                           rs_work = b.a;
                           std::vector<int> counts(static_cast<std::size_t>(n), static_cast<int>(b.b.size()));
                           rs = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
                               context, std::vector<float*>{rs_work.data()}, static_cast<int>(rs_work.size()), counts);
                           rs_for = b.a.data();
                         }
                         rs->run();
                       }});
    } else {
      impls.push_back({"raw gloo::broadcast", [&, n](Buffers& b, std::size_t) {
                         gloo::BroadcastOptions opts(context);
                         opts.setOutput(b.a.data(), b.a.size());
                         opts.setRoot(n - 1);
                         opts.setTag(raw_tag++);
                         gloo::broadcast(opts);
                       }});
    }
    return impls;
  };
  run_all("gloo", rank, n, o, impls_for, barrier, max_over);
  return 0;
}
