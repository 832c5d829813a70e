// 03_collectives: every operation of the Communicator concept, with each rank's values printed
// before and after, and checked. One source; Meson builds one binary per communicator:
//
//   build/examples/03_collectives_threads --ranks 4          4 threads of one process
//   mpirun -n 4 build/examples/03_collectives_mpi            4 MPI processes
//   tools/tessera-run -n 4 build/examples/03_collectives_gloo 4 processes over Gloo/TCP
//
// The code never names a backend: the build picks tessera::BuildEnv, whose Comm is the
// communicator, and launch<E> opens its world. Rank 0 prints every rank's values, all_gathered
// first (common/collective_print.hpp), and every rank checks its own result.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tessera/build_env.hpp"
#include "tessera/io/flags.hpp"
#include "common/collective_print.hpp"

using namespace tessera;

namespace {

// The collectives: reductions (every rank ends with the same combination of all ranks' values),
// broadcast, and moving blocks (concatenating every rank's, summing then keeping one per rank).
template <class Comm>
void show_collectives(Comm& comm) {
  const int r = comm.rank(), p = comm.size();
  const float rf = static_cast<float>(r), pf = static_cast<float>(p);
  const auto title = [&](const char* text) {
    if (r == 0) std::printf("%s\n", text);
  };

  title("all_reduce(sum): every rank ends with the element-wise sum over ranks");
  std::vector<float> x = {rf + 1, 10 * (rf + 1)};
  examples::print_all(comm, "before", x);
  comm.all_reduce(std::span<float>(x), ReduceOp::Sum);
  examples::print_all(comm, "after", x);
  examples::verify(comm, "sum of 1..p and 10..10p", x[0] == pf * (pf + 1) / 2 && x[1] == 10 * pf * (pf + 1) / 2);

  title("all_reduce(max) and all_reduce(avg)");
  std::vector<float> m = {rf, -rf}, a = {rf, 2 * rf};
  comm.all_reduce(std::span<float>(m), ReduceOp::Max);
  comm.all_reduce(std::span<float>(a), ReduceOp::Avg);
  examples::print_all(comm, "max", m);
  examples::print_all(comm, "avg", a);
  examples::verify(comm, "max = [p-1, 0], avg = [(p-1)/2, p-1]", m[0] == pf - 1 && m[1] == 0 && a[0] == (pf - 1) / 2 && a[1] == pf - 1);

  title("broadcast(root = last rank): everyone gets the root's values");
  std::vector<float> b = {rf, rf * rf};
  examples::print_all(comm, "before", b);
  comm.broadcast(std::span<float>(b), p - 1);
  examples::print_all(comm, "after", b);
  examples::verify(comm, "every rank holds the root's [p-1, (p-1)^2]", b[0] == pf - 1 && b[1] == (pf - 1) * (pf - 1));

  title("all_gather: concatenation of every rank's input, in rank order (2 -> 2p values)");
  const std::vector<float> g_in = {10 * rf, 10 * rf + 1};
  std::vector<float> g_out(2 * static_cast<std::size_t>(p));
  comm.all_gather(std::span<const float>(g_in), std::span<float>(g_out));
  examples::print_all(comm, "input", g_in);
  if (r == 0) {
    std::printf("  output  (same on every rank): [");
    for (std::size_t i = 0; i < g_out.size(); ++i) std::printf(i ? " %g" : "%g", g_out[i]);
    std::printf("]\n");
  }
  bool gathered = true;
  for (int q = 0; q < p; ++q) gathered = gathered && g_out[2 * q] == 10.0f * q && g_out[2 * q + 1] == 10.0f * q + 1;
  examples::verify(comm, "block q of the output is rank q's input", gathered);

  title("reduce_scatter(sum): sum over ranks, then rank q keeps block q (2p -> 2 values)");
  std::vector<float> rs_in(2 * static_cast<std::size_t>(p)), rs_out(2);
  for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = 100 * rf + static_cast<float>(i);
  comm.reduce_scatter(std::span<const float>(rs_in), std::span<float>(rs_out), ReduceOp::Sum);
  examples::print_all(comm, "block", rs_out);
  const float sum100 = 100 * pf * (pf - 1) / 2;  // sum over ranks of 100 r
  examples::verify(comm, "rank q holds [sum 100r + 2q p, ... + 1]",
         rs_out[0] == sum100 + pf * (2 * rf) && rs_out[1] == sum100 + pf * (2 * rf + 1));
}

// Point to point, asynchronous collectives and groups.
template <class Comm>
void show_others(Comm& comm) {
  const int r = comm.rank(), p = comm.size();
  const float rf = static_cast<float>(r), pf = static_cast<float>(p);
  const auto title = [&](const char* text) {
    if (r == 0) std::printf("%s\n", text);
  };

  if (p > 1) {
    title("send/recv around a ring: send to the right, receive from the left (send_async avoids deadlock)");
    const int right = (r + 1) % p, left = (r + p - 1) % p;
    const std::vector<float> mine = {rf};
    std::vector<float> got = {-1};
    Work sent = comm.send_async(std::span<const float>(mine), right);
    comm.recv(std::span<float>(got), left);
    sent.wait();
    examples::print_all(comm, "got", got);
    examples::verify(comm, "each rank received its left neighbour's rank", got[0] == static_cast<float>(left));
  }

  title("all_reduce_async: start it, do other work, wait");
  std::vector<float> big(1 << 20, 1.0f);
  Work work = comm.all_reduce_async(std::span<float>(big), ReduceOp::Sum);
  double local = 0;
  for (int i = 0; i < 1000000; ++i) local += 1e-6;  // overlaps with the reduction
  work.wait();
  std::vector<float> first = {big[0], static_cast<float>(local > 0)};
  examples::print_all(comm, "after", first);
  examples::verify(comm, "1M ones summed over p ranks", big[0] == pf && big[(1 << 20) - 1] == pf);

  title("split(color = rank % 2, key = rank): even and odd ranks form two groups");
  Comm half = comm.split(r % 2, r);
  std::vector<float> h = {rf};
  half.all_reduce(std::span<float>(h), ReduceOp::Sum);
  std::vector<float> info = {static_cast<float>(half.rank()), static_cast<float>(half.size()), h[0]};
  examples::print_all(comm, "g.rank/size/sum", info);
  float want = 0;
  for (int q = r % 2; q < p; q += 2) want += static_cast<float>(q);
  examples::verify(comm, "group sums are over even or over odd ranks only", h[0] == want && half.rank() == r / 2);

  comm.barrier();
  if (r == 0) std::printf("%s\n", examples::failures == 0 ? "all collectives verified" : "SOME RESULTS WERE WRONG");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // --ranks: threads build (ranks are threads, so bounded like threads: 1 .. max_threads()).
    Flags flags(argc, argv);
    const int ranks = flags.ranks("ranks", 4, !SharedMemoryCommunicator<BuildEnv::Comm>,
                                  "ranks to run (the threads build: threads of this process)");
    flags.finish();
    using Comm = BuildEnv::Comm;
    TESSERA_CHECK(ranks <= max_threads() || !SharedMemoryCommunicator<Comm>, ArgumentError, "--ranks=", ranks,
                  ": must be <= ", max_threads(), " (ranks are threads of this process)");
    launch<BuildEnv>(
        [](Comm& comm) {
          if (comm.rank() == 0)
            std::printf("03_collectives over %s, %d ranks\n\n", Comm::backend_name, comm.size());
          show_collectives(comm);
          show_others(comm);
        },
        {.ranks = ranks});
    return examples::failures > 0 ? 1 : 0;  // counted on rank 0
  } catch (const std::exception& e) {
    std::fprintf(stderr, "03_collectives: %s\n", e.what());
    return 1;
  }
}
