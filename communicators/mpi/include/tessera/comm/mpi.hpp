// MpiComm: the Communicator concept over MPI (tested with Open MPI 4.1 from Debian).
//
//   auto comm = MpiComm::world();     // MPI_Init_thread if nobody did yet, MPI_COMM_WORLD
//   MpiComm mine(existing_comm);      // or wrap an MPI_Comm the program already has (not freed)
//
// Runs under `mpirun -n 4 ./prog` and under Slurm's `srun -n 4 ./prog` (Open MPI built with PMIx).
//
// Timeouts. The *_async calls use MPI's non-blocking forms (MPI_Iallreduce, MPI_Isend, ...) and
// wait() polls MPI_Test against the deadline, so a stalled peer makes wait() throw CommError.
// The blocking calls use MPI's blocking forms, because Open MPI 4.1's non-blocking collectives
// (libnbc) are much slower: measured on 2 ranks here, MPI_Iallreduce + MPI_Test took far longer
// than MPI_Allreduce from 1 MiB to 64 MiB. A blocking MPI call cannot be interrupted,
// so a watchdog thread enforces the timeout: it prints the CommError text (operation, rank,
// time) and calls MPI_Abort, which ends the job under mpirun or srun, the way PyTorch's NCCL
// watchdog tears a stuck job down. Set TESSERA_MPI_INTERRUPTIBLE=1 (or
// MpiComm::set_interruptible(true)) to run blocking calls through the non-blocking path
// instead and get an exception, at the speed cost above. A killed peer makes mpirun end the job
// at once, naming the rank.
// Half (fp16) and BHalf (bfloat16) travel as 2-byte MPI datatypes with user-defined reduction ops
// (MPI has none; MPI 4's MPIX bfloat16 is not portable), one datatype per type; their Avg divides
// before summing so that the fp16 running sum cannot overflow (bfloat16 does the same, alike).
// The call check (comm/call_check.hpp) exchanges call summaries with a blocking all_gather before
// the checked collectives (the first 32, then every 16th; every one with TESSERA_COMM_DEBUG=1),
// so those *_async collectives synchronize the ranks when issued.
// After any failure the job is broken: at exit the runtime calls MPI_Abort instead of
// MPI_Finalize, which would wait for the dead or stalled peer forever.
#pragma once

// The C API is all we use; skip the deprecated C++ bindings (they also warn under -Wextra).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>

#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/core.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/monitor.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cpu.hpp"

// Where MpiComm's functions are compiled: the pattern of core/linkage.hpp, with this backend's macros.
#if defined(TESSERA_COMPILING_MPI)
#define TESSERA_MPI_DEFINITIONS 1
#define TESSERA_MPI_LINKAGE
#elif defined(TESSERA_COMPILED_MPI)
#define TESSERA_MPI_DEFINITIONS 0
#define TESSERA_MPI_LINKAGE
#else
#define TESSERA_MPI_DEFINITIONS 1
#define TESSERA_MPI_LINKAGE inline
#endif

namespace tessera {

namespace detail {

std::string mpi_error_text(int code);

// Set once any MpiComm operation failed. The job is then broken: MPI_Finalize would wait for the
// failed or stalled peer forever, so the runtime aborts the job at exit instead.
std::atomic<bool>& mpi_job_failed();

// The first failure of the job, said again at exit: whatever the program did with the exception,
// the reason reaches the user (and TESSERA_ERROR_DIR) before MPI_Abort tears the job down.
// Leaked: read by MpiRuntime's destructor, which may run after other statics are destroyed.
std::string& mpi_first_error();
std::mutex& mpi_first_error_mutex();

// Flush, give mpirun's I/O forwarding a moment to pass the text on, then end the job. Without
// the pause the last lines of a rank that calls MPI_Abort were lost in 3 of 5 runs (0 of 6
// with another process busy): the abort races the forwarding of the rank's stderr.
[[noreturn]] void mpi_abort_after(int rank, const std::string& text);

// The watchdog's action when a blocking MPI call passes its timeout.
void mpi_watchdog_timeout(const std::string& text, int rank);

// Initializes MPI on first use when the program has not, and finalizes it at exit in that case
// (or aborts the job, after a failure; see mpi_job_failed).
struct MpiRuntime {
  bool initialized_here = false;
  MpiRuntime();
  ~MpiRuntime();
  static void ensure();
};

// Owns a communicator made by split (freed at the end) or borrows one (never freed), plus the
// per-call protocol (comm/core.hpp) shared by every copy.
struct MpiHandle {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owned = false;
  CommCore core;
  int splits = 0;
  bool interruptible = false;

  ~MpiHandle();
};

// What a receive expects (MpiComm::make_work). Outside the class: a nested struct's default member
// initializers are not usable in a default argument of the enclosing class's own members (clang
// refuses `ExpectedCount expected = {}` there, GCC accepts it).
struct MpiExpectedCount {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  long long count = -1;  // checked against the received message when >= 0
};
}  // namespace detail

class MpiComm {
 public:
  static constexpr const char* backend_name = "mpi";
  // MPI_COMM_WORLD, initializing MPI if needed.
  // Refuses to start when the launcher's world size is not MPI's: tessera-run or an srun without
  // MPI support start N independent singleton MPI processes, each of which would train alone
  // and exit 0.
  static MpiComm world(CommOptions options = {});
  // The same as world(): with MPI the launcher (mpirun, srun) already told every process its rank.
  static MpiComm from_env(CommOptions options = {});

  // launch<E>(fn) on MPI: the world, then fn on this rank. A rank whose fn ends with any exception
  // (a corrupt image in its shard as much as a failed call) fails the job: its peers wait in a
  // collective it will never join, and MPI_Finalize at exit would wait for them until their
  // timeout. So the job is marked failed, the exception goes on to the caller, and at exit the
  // runtime ends the job with MPI_Abort (mpirun then stops every rank) after saying this rank's
  // error. A program that opens world() itself and catches its own errors gets the same by
  // calling MpiComm::fail_job(text) before it returns.
  template <class Fn>
  static void launch(const LaunchOptions& options, Fn&& fn) {
    auto comm = world(options.comm);
    check_launched_ranks(options, comm.size(), backend_name);
    try {
      fn(comm);
    } catch (const std::exception& e) {
      fail_job(detail::cat("rank ", comm.rank(), " failed: ", e.what()));
      throw;
    } catch (...) {
      fail_job(detail::cat("rank ", comm.rank(), " failed with an exception that is not a std::exception"));
      throw;
    }
  }

  // Marks the job failed (see launch): at exit the runtime aborts it, saying `text` (the first
  // failure's, when there were several), instead of finalizing.
  static void fail_job(const std::string& text);

  explicit MpiComm(MPI_Comm comm, CommOptions options = {});

  int rank() const { return h_->core.rank(); }
  int size() const { return h_->core.size(); }
  MPI_Comm native() const { return h_->comm; }
  const CommOptions& options() const { return h_->core.options(); }

  template <CommScalar T>
  Work all_reduce_async(std::span<T> buf, ReduceOp op);
  template <CommScalar T>
  Work broadcast_async(std::span<T> buf, int root);
  template <CommScalar T>
  Work all_gather_async(std::span<const T> in, std::span<T> out);
  template <CommScalar T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op);
  template <CommScalar T>
  Work send_async(std::span<const T> buf, int peer);
  template <CommScalar T>
  Work recv_async(std::span<T> buf, int peer);

  template <CommScalar T>
  void all_reduce(std::span<T> buf, ReduceOp op);
  template <CommScalar T>
  void broadcast(std::span<T> buf, int root);
  template <CommScalar T>
  void all_gather(std::span<const T> in, std::span<T> out);
  template <CommScalar T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op);
  // Point-to-point always goes through the non-blocking path: the peer is known, so a timeout
  // can name it, and there is no speed difference.
  template <CommScalar T>
  void send(std::span<const T> buf, int peer);
  template <CommScalar T>
  void recv(std::span<T> buf, int peer);

  void barrier();

  // Blocking calls use the non-blocking path and throw on timeout instead of ending the job.
  void set_interruptible(bool on) { h_->interruptible = on; }

  MpiComm split(int color, int key);

 private:
  static constexpr int kPointToPointTag = 4711;

  template <class Call>
  void blocking(const detail::CallSignature& sig, Call&& mpi_call);

  // Half/BHalf Avg over reduce_scatter: the input is const, so the pre-divided values go to a copy.
  template <CommScalar T>
  std::shared_ptr<std::vector<T>> prescaled_input(std::span<const T> in, ReduceOp& op) const;

  MpiComm(MPI_Comm comm, CommOptions options, bool owned, std::string label = "");

  template <class What>
  int count(std::size_t n, const What& what) const;

  // The core's enter and call check (comm/core.hpp), the check's exchange a non-blocking
  // all_gather waited with the timeout. Returns the call's number on this communicator.
  std::int64_t begin(const detail::CallSignature& sig);

  template <class What>
  void call(const What& what, int code);

  // The core's broken hook: the whole job is failed (see mpi_job_failed), and its first failure
  // is said again at exit.
  static void mark_job_failed(const std::string& text);

  using ExpectedCount = detail::MpiExpectedCount;

  // wait() is the core's wait loop over MPI_Test. The deadline counts from the start of wait(),
  // not from the issue: MPI's non-blocking collectives progress only inside MPI calls, so a
  // caller that computes for a long time before waiting has not been stalled by a peer. The
  // finishing step (Avg's division) runs once, on whichever of poll and wait first sees the
  // completion.
  template <class What>
  Work make_work(MPI_Request request, What what, std::function<void()> finish, ExpectedCount expected = {});

  std::shared_ptr<detail::MpiHandle> h_;
};

#if TESSERA_MPI_DEFINITIONS

namespace detail {

TESSERA_MPI_LINKAGE std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return cat("MPI error ", code);
  return std::string(text, static_cast<std::size_t>(length));
}

// The datatype and reductions of a 16-bit float type T (Half, BHalf), created once after MPI_Init.
// Each T has its own MPI datatype, so that a mismatch between ranks is a type error for MPI too.
// (Here with mpi_type and mpi_op, out of a compiled-mode program's sight: only the definitions
// below use them.)
template <class T>
struct MpiHalfTypes {
  static_assert(is_16bit_float_v<T>);
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL, max = MPI_OP_NULL, min = MPI_OP_NULL;

  template <ReduceOp Op>
  static void apply(void* in, void* inout, int* count, MPI_Datatype*) {
    reduce_into(static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*count), Op);
  }
  static const MpiHalfTypes& get() {
    static const MpiHalfTypes types = [] {
      MpiHalfTypes t;
      MPI_Type_contiguous(2, MPI_BYTE, &t.type);
      MPI_Type_commit(&t.type);
      MPI_Op_create(&apply<ReduceOp::Sum>, 1, &t.sum);
      MPI_Op_create(&apply<ReduceOp::Max>, 1, &t.max);
      MPI_Op_create(&apply<ReduceOp::Min>, 1, &t.min);
      return t;
    }();
    return types;
  }
};

template <CommScalar T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else return MpiHalfTypes<T>::get().type;
}

// Avg is reduced as a sum and divided afterwards (finish_avg), as MPI has no average.
template <CommScalar T>
MPI_Op mpi_op(ReduceOp op) {
  if constexpr (is_16bit_float_v<T>) {
    const auto& h = MpiHalfTypes<T>::get();
    return op == ReduceOp::Max ? h.max : op == ReduceOp::Min ? h.min : h.sum;
  } else {
    return op == ReduceOp::Max ? MPI_MAX : op == ReduceOp::Min ? MPI_MIN : MPI_SUM;
  }
}

TESSERA_MPI_LINKAGE std::atomic<bool>& mpi_job_failed() {
  static std::atomic<bool> failed{false};
  return failed;
}

TESSERA_MPI_LINKAGE std::string& mpi_first_error() {
  static std::string* text = new std::string();
  return *text;
}
TESSERA_MPI_LINKAGE std::mutex& mpi_first_error_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}

[[noreturn]] TESSERA_MPI_LINKAGE void mpi_abort_after(int rank, const std::string& text) {
  report_fatal(rank, text);
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

TESSERA_MPI_LINKAGE void mpi_watchdog_timeout(const std::string& text, int rank) {
  mpi_abort_after(rank, text + "; calling MPI_Abort (a blocking MPI call cannot be interrupted)");
}

TESSERA_MPI_LINKAGE MpiRuntime::MpiRuntime() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // SERIALIZED: async operations are completed from whichever thread calls wait(), one at a time.
    const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    TESSERA_CHECK(code == MPI_SUCCESS, CommError, "MpiComm: MPI_Init_thread failed: ", mpi_error_text(code));
    initialized_here = true;
  }
  install_sigterm_reporter();
}
TESSERA_MPI_LINKAGE MpiRuntime::~MpiRuntime() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!initialized_here || finalized) return;
  if (mpi_job_failed().load()) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::string first;
    {
      std::lock_guard lock(mpi_first_error_mutex());
      first = mpi_first_error();
    }
    mpi_abort_after(rank, cat("tessera: rank ", rank, " ends the MPI job (MPI_Abort, not MPI_Finalize, which would wait "
                              "for the failed peer) after: ", first));
  }
  MPI_Finalize();
}
TESSERA_MPI_LINKAGE void MpiRuntime::ensure() { static MpiRuntime runtime; }

TESSERA_MPI_LINKAGE MpiHandle::~MpiHandle() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned && !finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
}

}  // namespace detail

TESSERA_MPI_LINKAGE MpiComm MpiComm::world(CommOptions options) {
  detail::MpiRuntime::ensure();
  int mpi_size = 1, mpi_rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
  const LaunchEnv env = LaunchEnv::from_environment();
  TESSERA_CHECK(env.size == 1 || env.size == mpi_size, ArgumentError, "MpiComm: ", env.source, " started ", env.size,
                " ranks (this is rank ", env.rank, "), but MPI sees ", mpi_size, " (this is MPI rank ", mpi_rank,
                "): an MPI program must be started by mpirun -n ", env.size, " (or srun with MPI support), ",
                "not by tessera-run or an srun without PMI");
  return MpiComm(MPI_COMM_WORLD, options);
}
TESSERA_MPI_LINKAGE MpiComm MpiComm::from_env(CommOptions options) { return world(options); }

TESSERA_MPI_LINKAGE void MpiComm::fail_job(const std::string& text) { mark_job_failed(text); }

TESSERA_MPI_LINKAGE MpiComm::MpiComm(MPI_Comm comm, CommOptions options) : MpiComm(comm, options, false) {}

template <CommScalar T>
TESSERA_MPI_LINKAGE Work MpiComm::all_reduce_async(std::span<T> buf, ReduceOp op) {
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::AllReduce, buf.size(), static_cast<std::int64_t>(op));
  begin(sig);
  if (detail::prescale_half_avg(buf.data(), buf.size(), op, size())) op = ReduceOp::Sum;
  MPI_Request request;
  call(sig, MPI_Iallreduce(MPI_IN_PLACE, buf.data(), count(buf.size(), sig), detail::mpi_type<T>(),
                           detail::mpi_op<T>(op), h_->comm, &request));
  return make_work(request, sig, [buf, op, n = size()] { detail::finish_avg(buf.data(), buf.size(), op, n); });
}
template <CommScalar T>
TESSERA_MPI_LINKAGE Work MpiComm::broadcast_async(std::span<T> buf, int root) {
  h_->core.check_root(root);
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::Broadcast, buf.size(), root);
  begin(sig);
  MPI_Request request;
  call(sig, MPI_Ibcast(buf.data(), count(buf.size(), sig), detail::mpi_type<T>(), root, h_->comm, &request));
  return make_work(request, sig, {});
}
template <CommScalar T>
TESSERA_MPI_LINKAGE Work MpiComm::all_gather_async(std::span<const T> in, std::span<T> out) {
  h_->core.check_all_gather(in.size(), out.size());
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::AllGather, in.size());
  begin(sig);
  MPI_Request request;
  call(sig, MPI_Iallgather(in.data(), count(in.size(), sig), detail::mpi_type<T>(), out.data(), count(in.size(), sig),
                           detail::mpi_type<T>(), h_->comm, &request));
  return make_work(request, sig, {});
}
template <CommScalar T>
TESSERA_MPI_LINKAGE Work MpiComm::reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op) {
  h_->core.check_reduce_scatter(in.size(), out.size());
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::ReduceScatter, in.size(), static_cast<std::int64_t>(op));
  begin(sig);
  auto scaled = prescaled_input(in, op);  // Half Avg only; kept alive until the work finishes
  MPI_Request request;
  call(sig, MPI_Ireduce_scatter_block(scaled ? scaled->data() : in.data(), out.data(), count(out.size(), sig),
                                      detail::mpi_type<T>(), detail::mpi_op<T>(op), h_->comm, &request));
  return make_work(request, sig,
                   [out, op, n = size(), scaled] { detail::finish_avg(out.data(), out.size(), op, n); });
}
template <CommScalar T>
TESSERA_MPI_LINKAGE Work MpiComm::send_async(std::span<const T> buf, int peer) {
  h_->core.check_peer(peer, "send");
  const auto what = detail::PeerCall::send<T>(buf.size(), peer);
  h_->core.check_usable(what);
  MPI_Request request;
  call(what, MPI_Isend(buf.data(), count(buf.size(), what), detail::mpi_type<T>(), peer, kPointToPointTag, h_->comm,
                       &request));
  return make_work(request, what, {});
}
template <CommScalar T>
TESSERA_MPI_LINKAGE Work MpiComm::recv_async(std::span<T> buf, int peer) {
  h_->core.check_peer(peer, "recv");
  const auto what = detail::PeerCall::recv<T>(buf.size(), peer);
  h_->core.check_usable(what);
  MPI_Request request;
  call(what, MPI_Irecv(buf.data(), count(buf.size(), what), detail::mpi_type<T>(), peer, kPointToPointTag, h_->comm,
                       &request));
  // A shorter message would complete the receive silently: the received count is checked.
  return make_work(request, what, {}, {detail::mpi_type<T>(), static_cast<long long>(buf.size())});
}

template <CommScalar T>
TESSERA_MPI_LINKAGE void MpiComm::all_reduce(std::span<T> buf, ReduceOp op) {
  if (h_->interruptible) return all_reduce_async(buf, op).wait();
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::AllReduce, buf.size(), static_cast<std::int64_t>(op));
  h_->core.check_usable(sig);
  if (detail::prescale_half_avg(buf.data(), buf.size(), op, size())) op = ReduceOp::Sum;
  blocking(sig, [&] {
    return MPI_Allreduce(MPI_IN_PLACE, buf.data(), count(buf.size(), sig), detail::mpi_type<T>(), detail::mpi_op<T>(op),
                         h_->comm);
  });
  detail::finish_avg(buf.data(), buf.size(), op, size());
}
template <CommScalar T>
TESSERA_MPI_LINKAGE void MpiComm::broadcast(std::span<T> buf, int root) {
  if (h_->interruptible) return broadcast_async(buf, root).wait();
  h_->core.check_root(root);
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::Broadcast, buf.size(), root);
  blocking(sig, [&] { return MPI_Bcast(buf.data(), count(buf.size(), sig), detail::mpi_type<T>(), root, h_->comm); });
}
template <CommScalar T>
TESSERA_MPI_LINKAGE void MpiComm::all_gather(std::span<const T> in, std::span<T> out) {
  if (h_->interruptible) return all_gather_async(in, out).wait();
  h_->core.check_all_gather(in.size(), out.size());
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::AllGather, in.size());
  blocking(sig, [&] {
    return MPI_Allgather(in.data(), count(in.size(), sig), detail::mpi_type<T>(), out.data(), count(in.size(), sig),
                         detail::mpi_type<T>(), h_->comm);
  });
}
template <CommScalar T>
TESSERA_MPI_LINKAGE void MpiComm::reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op) {
  if (h_->interruptible) return reduce_scatter_async(in, out, op).wait();
  h_->core.check_reduce_scatter(in.size(), out.size());
  const auto sig = detail::signature_of<T>(detail::CollectiveKind::ReduceScatter, in.size(), static_cast<std::int64_t>(op));
  h_->core.check_usable(sig);
  const auto scaled = prescaled_input(in, op);
  blocking(sig, [&] {
    return MPI_Reduce_scatter_block(scaled ? scaled->data() : in.data(), out.data(), count(out.size(), sig),
                                    detail::mpi_type<T>(), detail::mpi_op<T>(op), h_->comm);
  });
  detail::finish_avg(out.data(), out.size(), op, size());
}
template <CommScalar T>
TESSERA_MPI_LINKAGE void MpiComm::send(std::span<const T> buf, int peer) { send_async(buf, peer).wait(); }
template <CommScalar T>
TESSERA_MPI_LINKAGE void MpiComm::recv(std::span<T> buf, int peer) { recv_async(buf, peer).wait(); }

TESSERA_MPI_LINKAGE void MpiComm::barrier() {
  const detail::CallSignature sig{detail::CollectiveKind::Barrier, CommDType::F32, 0, 0};
  if (!h_->interruptible) return blocking(sig, [&] { return MPI_Barrier(h_->comm); });
  begin(sig);
  MPI_Request request;
  call(sig, MPI_Ibarrier(h_->comm, &request));
  make_work(request, sig, {}).wait();
}

TESSERA_MPI_LINKAGE MpiComm MpiComm::split(int color, int key) {
  h_->core.check_split_color(color);
  // MPI_Comm_split is blocking with no non-blocking form: the watchdog enforces its timeout.
  MPI_Comm child = MPI_COMM_NULL;
  blocking(detail::CallSignature{detail::CollectiveKind::Split, CommDType::I64, 0, 0},
           [&] { return MPI_Comm_split(h_->comm, color, key, &child); });
  MpiComm result(child, options(), true, detail::cat(h_->core.label(), "/split", ++h_->splits, ".color", color));
  result.h_->interruptible = h_->interruptible;
  return result;
}

template <class Call>
TESSERA_MPI_LINKAGE void MpiComm::blocking(const detail::CallSignature& sig, Call&& mpi_call) {
  const std::int64_t index = begin(sig);
  {
    const auto watched = h_->core.watch(index, sig, &detail::mpi_watchdog_timeout);
    call(sig, mpi_call());
  }
  h_->core.finish();
}

template <CommScalar T>
TESSERA_MPI_LINKAGE std::shared_ptr<std::vector<T>> MpiComm::prescaled_input(std::span<const T> in, ReduceOp& op) const {
  if constexpr (!is_16bit_float_v<T>) {
    return nullptr;
  } else {
    if (op != ReduceOp::Avg || size() == 1) return nullptr;
    auto copy = std::make_shared<std::vector<T>>(in.begin(), in.end());
    detail::prescale_half_avg(copy->data(), copy->size(), op, size());
    op = ReduceOp::Sum;
    return copy;
  }
}

TESSERA_MPI_LINKAGE MpiComm::MpiComm(MPI_Comm comm, CommOptions options, bool owned, std::string label)
    : h_(std::make_shared<detail::MpiHandle>()) {
  h_->comm = comm;
  h_->owned = owned;
  const char* interruptible = std::getenv("TESSERA_MPI_INTERRUPTIBLE");
  h_->interruptible = interruptible != nullptr && *interruptible != '\0' && std::string(interruptible) != "0";
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  h_->core = detail::CommCore("MpiComm", rank, size, options);
  h_->core.on_broken(&mark_job_failed);
  // Return error codes instead of aborting, so failures become CommError with our context.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  // Labels agree across ranks: the world is "world", a split child names its parent and split
  // number, and a communicator the program wrapped is numbered in wrapping order.
  static std::atomic<int> wrapped{0};
  int is_world = 0;
  MPI_Comm_compare(comm, MPI_COMM_WORLD, &is_world);
  if (label.empty())
    label = is_world == MPI_IDENT ? std::string("mpi:world") : detail::cat("mpi:wrapped", wrapped.fetch_add(1));
  h_->core.connect_monitor(std::move(label), [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    call(detail::CallSignature{detail::CollectiveKind::AllGather, CommDType::I64, 3, 0},
         MPI_Allgather(in.data(), static_cast<int>(in.size()), MPI_INT64_T, out.data(), static_cast<int>(in.size()),
                       MPI_INT64_T, comm));
  });
}

template <class What>
TESSERA_MPI_LINKAGE int MpiComm::count(std::size_t n, const What& what) const {
  return h_->core.count_as_int(n, what, "MPI");
}

TESSERA_MPI_LINKAGE std::int64_t MpiComm::begin(const detail::CallSignature& sig) {
  return h_->core.begin(sig, [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    MPI_Request request;
    call(sig, MPI_Iallgather(in.data(), count(in.size(), sig), MPI_INT64_T, out.data(), count(in.size(), sig),
                             MPI_INT64_T, h_->comm, &request));
    make_work(request, detail::CallCheckOf{sig}, {}).wait();
  });
}

template <class What>
TESSERA_MPI_LINKAGE void MpiComm::call(const What& what, int code) {
  if (code == MPI_SUCCESS) [[likely]]
    return;
  h_->core.fail(what, detail::mpi_error_text(code));
}

TESSERA_MPI_LINKAGE void MpiComm::mark_job_failed(const std::string& text) {
  detail::mpi_job_failed().store(true);
  std::lock_guard lock(detail::mpi_first_error_mutex());
  if (detail::mpi_first_error().empty()) detail::mpi_first_error() = text;
}

template <class What>
TESSERA_MPI_LINKAGE Work MpiComm::make_work(MPI_Request request, What what, std::function<void()> finish,
                                            ExpectedCount expected) {
  struct State {
    MPI_Request request;
    std::function<void()> finish;
    ExpectedCount expected;
    bool done = false;
    std::string error;  // said again by every later poll
  };
  auto state = std::make_shared<State>(State{request, std::move(finish), expected});
  auto handle = h_;
  auto poll = [state, handle, what]() {
    if (!state->error.empty()) throw CommError(state->error);
    if (state->done) return true;
    int flag = 0;
    MPI_Status status;
    const int code = MPI_Test(&state->request, &flag, &status);
    std::string reason;
    if (code != MPI_SUCCESS) {
      reason = detail::mpi_error_text(code);
    } else if (!flag) {
      return false;
    } else if (state->expected.count >= 0) {
      int received = 0;
      MPI_Get_count(&status, state->expected.type, &received);
      if (received != state->expected.count)
        reason = detail::cat("expected ", state->expected.count, " elements, the message had ", received);
    }
    state->done = true;
    if (!reason.empty()) {
      state->error = handle->core.mark_broken(handle->core.text(what, reason));
      throw CommError(state->error);
    }
    if (state->finish) state->finish();
    if (std::is_same_v<What, detail::CallSignature>) handle->core.finish();
    return true;
  };
  // Collectives carry their call number for stall reports; point-to-point names its peer already.
  constexpr bool collective =
      std::is_same_v<What, detail::CallSignature> || std::is_same_v<What, detail::CallCheckOf>;
  const std::int64_t index = collective ? handle->core.board()->entered.load(std::memory_order_relaxed) : 0;
  // `call = index`: for a point-to-point call index is the constant 0, which clang would not capture.
  auto wait = [handle, what, poll, call = index]() { handle->core.wait(what, call, poll); };
  return Work(std::move(wait), [poll] { return poll(); });
}

#endif  // TESSERA_MPI_DEFINITIONS

// The public collectives for every CommScalar, instantiated once in communicators/mpi/src/mpi.cpp
// (the library tessera_mpi) and declared only in a TESSERA_COMPILED_MPI program, which sees no
// template definitions to instantiate (so it needs no `extern template` either).
#define TESSERA_MPI_ALL_INSTANCES() TESSERA_FOR_EACH_COMM_SCALAR(TESSERA_COMM_COLLECTIVE_INSTANCES, MpiComm)

static_assert(check_communicator<MpiComm>());
static_assert(BHalfCommunicator<MpiComm> && comm_concepts::has_async<MpiComm, BHalf>);

using CpuMpi = Env<Cpu, MpiComm, float>;
using CpuMpi64 = Env<Cpu, MpiComm, double>;

// DataParallel<CpuMpi> is compiled once, in tessera_mpi (src/mpi.cpp), and declared extern in the
// backend's programs when DataParallel's definition precedes this header (as in every program of
// the meson build: parallel/data_parallel.hpp says why here). Elsewhere the program compiles it.
#if defined(TESSERA_COMPILED_MPI) && !defined(TESSERA_COMPILING_MPI) && defined(TESSERA_DATA_PARALLEL_DEFINED)
extern template class DataParallel<CpuMpi>;
#endif

}  // namespace tessera
