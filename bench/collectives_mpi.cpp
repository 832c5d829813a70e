// Collectives over MpiComm next to the raw MPI calls (bench/collectives.hpp has the driver).
#include "tessera/comm/mpi.hpp"
#include "collectives.hpp"

using namespace collectives_bench;
int main(int argc, char** argv) {
  using namespace tessera;
  const Options o = parse(argc, argv);
  auto comm = MpiComm::world();
  const int rank = comm.rank(), n = comm.size();
  if (rank == 0) header();
  auto barrier = [] { MPI_Barrier(MPI_COMM_WORLD); };
  auto max_over = [](double t) {
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return t;
  };
  auto impls_for = [&](const std::string& op) {
    std::vector<Impl> impls = {tessera_impl(comm, op)};
    if (op == "all_reduce")
      impls.push_back({"raw MPI_Allreduce", [](Buffers& b, std::size_t) {
                         MPI_Allreduce(MPI_IN_PLACE, b.a.data(), static_cast<int>(b.a.size()), MPI_FLOAT, MPI_SUM,
                                       MPI_COMM_WORLD);
                       }});
    else if (op == "all_gather")
      impls.push_back({"raw MPI_Allgather", [](Buffers& b, std::size_t) {
                         MPI_Allgather(b.a.data(), static_cast<int>(b.a.size()), MPI_FLOAT, b.b.data(),
                                       static_cast<int>(b.a.size()), MPI_FLOAT, MPI_COMM_WORLD);
                       }});
    else if (op == "reduce_scatter")
      impls.push_back({"raw MPI_Reduce_scatter_block", [](Buffers& b, std::size_t) {
                         MPI_Reduce_scatter_block(b.a.data(), b.b.data(), static_cast<int>(b.b.size()), MPI_FLOAT,
                                                  MPI_SUM, MPI_COMM_WORLD);
                       }});
    else
      impls.push_back({"raw MPI_Bcast", [n](Buffers& b, std::size_t) {
                         MPI_Bcast(b.a.data(), static_cast<int>(b.a.size()), MPI_FLOAT, n - 1, MPI_COMM_WORLD);
                       }});
    return impls;
  };
  run_all("mpi", rank, n, o, impls_for, barrier, max_over);
  return 0;
}
