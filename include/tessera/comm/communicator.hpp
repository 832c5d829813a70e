// The communicator vocabulary (after torch.distributed / NCCL): ReduceOp, CommDType, Work, and the
// concepts a backend satisfies. Buffers are std::span views; all_reduce and broadcast work in place.
//
//   all_reduce(buf, op)         every rank ends with op over all ranks' buf            (n -> n)
//   broadcast(buf, root)        every rank ends with root's buf                        (n -> n)
//   all_gather(in, out)         out = concat over ranks r of in_r, in rank order       (n -> size*n)
//   reduce_scatter(in, out, op) out on rank r = op over ranks of in[r*n, (r+1)*n)      (size*n -> n)
//   send(buf, peer) / recv(buf, peer), barrier()
//   *_async(...) -> Work        the same, started now; Work::wait() finishes it
//   split(color, key)           ranks with the same color form a new communicator, ordered by key
//
// Element types: float, double, int32_t, int64_t, Half (IEEE fp16) and BHalf (bfloat16), the
// 16-bit ones reduced in float (NCCL reduces them in 16 bits on the GPU).
// The Communicator concept requires Half but not BHalf, so that a third-party communicator written
// before BHalf still satisfies it; code that sends BHalf requires BHalfCommunicator as well.
// Every Tessera communicator supports BHalf.
// ReduceOp::Avg is sum / size; for integers it truncates toward zero like C++ division (and the
// sum is formed first, so it can overflow where the mean would fit).
//
// Every blocking call has a timeout (CommOptions) and throws CommError naming the operation, the
// rank and the peer or phase on failure. After a CommError a communicator is broken: later calls
// throw at once (the same contract as NCCL and Gloo), because the ranks no longer agree on where
// in the sequence of collectives they are.
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string_view>
#include <type_traits>

#include "tessera/core/error.hpp"
#include "tessera/core/half.hpp"
#include "tessera/core/linkage.hpp"  // non-template functions: defined at the end (inline) or once in tessera_kernels

namespace tessera {

enum class ReduceOp { Sum, Avg, Max, Min };

std::string_view to_string(ReduceOp op);

// The element types a communicator moves. The enum travels between ranks in debug mode, so its
// values are fixed: a new type is appended, never renumbered.
enum class CommDType : std::int8_t { F32 = 0, F64 = 1, I32 = 2, I64 = 3, F16 = 4, BF16 = 5 };

template <class T>
concept CommScalar = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int32_t> ||
                     std::same_as<T, std::int64_t> || std::same_as<T, Half> || std::same_as<T, BHalf>;

// The same set as a list macro, M(ARG, T) once per CommScalar T, for the explicit instantiations of
// the code compiled once (core/linkage.hpp): the shared-memory reductions (reduce.hpp) and the
// backends compiled into a library (ThreadComm in tessera_kernels, GlooComm and MpiComm in theirs).
#define TESSERA_FOR_EACH_COMM_SCALAR(M, ARG) \
  M(ARG, float) M(ARG, double) M(ARG, std::int32_t) M(ARG, std::int64_t) M(ARG, Half) M(ARG, BHalf)
// Communicator class C's public collectives for scalar T, as explicit instantiation definitions.
// A backend compiled once expands TESSERA_FOR_EACH_COMM_SCALAR(TESSERA_COMM_COLLECTIVE_INSTANCES, C)
// in its library's source; its programs see the declarations only and link those instances.
#define TESSERA_COMM_COLLECTIVE_INSTANCES(C, T)                                   \
  template void C::all_reduce<T>(std::span<T>, ReduceOp);                         \
  template void C::broadcast<T>(std::span<T>, int);                               \
  template void C::all_gather<T>(std::span<const T>, std::span<T>);               \
  template void C::reduce_scatter<T>(std::span<const T>, std::span<T>, ReduceOp); \
  template void C::send<T>(std::span<const T>, int);                              \
  template void C::recv<T>(std::span<T>, int);                                    \
  template Work C::all_reduce_async<T>(std::span<T>, ReduceOp);                   \
  template Work C::broadcast_async<T>(std::span<T>, int);                         \
  template Work C::all_gather_async<T>(std::span<const T>, std::span<T>);         \
  template Work C::reduce_scatter_async<T>(std::span<const T>, std::span<T>, ReduceOp); \
  template Work C::send_async<T>(std::span<const T>, int);                        \
  template Work C::recv_async<T>(std::span<T>, int);

template <CommScalar T>
inline constexpr CommDType comm_dtype_of = std::same_as<T, float>          ? CommDType::F32
                                  : std::same_as<T, double>       ? CommDType::F64
                                  : std::same_as<T, std::int32_t> ? CommDType::I32
                                  : std::same_as<T, std::int64_t> ? CommDType::I64
                                  : std::same_as<T, Half>         ? CommDType::F16
                                                                  : CommDType::BF16;

inline std::size_t comm_scalar_bytes(CommDType t) {
  switch (t) {
    case CommDType::F64:
    case CommDType::I64: return 8;
    case CommDType::F16:
    case CommDType::BF16: return 2;
    default: return 4;
  }
}

std::string_view to_string(CommDType t);

// Handle of an asynchronous operation. wait() blocks until done (rethrowing its error, with the
// operation's own timeout); is_completed() polls without blocking. A default Work is already
// complete (what a backend returns when there was nothing to do). Move-only: the operation
// finishes once (an Avg divides once), and a wait() that threw rethrows on every later wait().
class Work {
 public:
  Work() = default;
  Work(std::function<void()> wait_fn, std::function<bool()> poll_fn)
      : wait_(std::move(wait_fn)), poll_(std::move(poll_fn)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  void wait();
  bool is_completed() const { return !wait_ || (poll_ && poll_()); }

 private:
  std::function<void()> wait_;
  std::function<bool()> poll_;
  std::exception_ptr error_;
};

// One concept per member, so that a backend that lacks one fails with that member's name:
// "required for the satisfaction of 'has_reduce_scatter<MyComm, double>'".
namespace comm_concepts {

template <class C>
concept has_rank_and_size = requires(const C& c) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
};
template <class C, class T>
concept has_all_reduce = requires(C& c, std::span<T> buf, ReduceOp op) { c.all_reduce(buf, op); };
template <class C, class T>
concept has_broadcast = requires(C& c, std::span<T> buf, int root) { c.broadcast(buf, root); };
template <class C, class T>
concept has_all_gather = requires(C& c, std::span<const T> in, std::span<T> out) { c.all_gather(in, out); };
template <class C, class T>
concept has_reduce_scatter = requires(C& c, std::span<const T> in, std::span<T> out, ReduceOp op) {
  c.reduce_scatter(in, out, op);
};
template <class C, class T>
concept has_send_recv = requires(C& c, std::span<const T> in, std::span<T> out, int peer) {
  c.send(in, peer);
  c.recv(out, peer);
};
template <class C>
concept has_barrier = requires(C& c) { c.barrier(); };

template <class C, class T>
concept has_async = requires(C& c, std::span<T> buf, std::span<const T> in, ReduceOp op, int peer) {
  { c.all_reduce_async(buf, op) } -> std::same_as<Work>;
  { c.broadcast_async(buf, peer) } -> std::same_as<Work>;
  { c.all_gather_async(in, buf) } -> std::same_as<Work>;
  { c.reduce_scatter_async(in, buf, op) } -> std::same_as<Work>;
  { c.send_async(in, peer) } -> std::same_as<Work>;
  { c.recv_async(buf, peer) } -> std::same_as<Work>;
};

template <class C, class T>
concept has_collectives_for = has_all_reduce<C, T> && has_broadcast<C, T> && has_all_gather<C, T> &&
                              has_reduce_scatter<C, T> && has_send_recv<C, T>;

}  // namespace comm_concepts

template <class C>
concept Communicator =
    comm_concepts::has_rank_and_size<C> && comm_concepts::has_barrier<C> &&
    comm_concepts::has_collectives_for<C, float> && comm_concepts::has_collectives_for<C, double> &&
    comm_concepts::has_collectives_for<C, std::int32_t> && comm_concepts::has_collectives_for<C, std::int64_t> &&
    comm_concepts::has_collectives_for<C, Half>;

template <class C>
concept AsyncCommunicator =
    Communicator<C> && comm_concepts::has_async<C, float> && comm_concepts::has_async<C, double> &&
    comm_concepts::has_async<C, std::int32_t> && comm_concepts::has_async<C, std::int64_t> &&
    comm_concepts::has_async<C, Half>;

// BHalf (bfloat16) is not part of Communicator, so that communicators written before it still
// satisfy the concept: code that sends BHalf (a bf16 gradient codec) requires this as well.
// Every Tessera communicator satisfies it (each asserts so next to its check_communicator).
template <class C>
concept BHalfCommunicator = Communicator<C> && comm_concepts::has_collectives_for<C, BHalf>;

template <class C>
concept SplittableCommunicator = Communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> std::same_as<C>;
};

// A communicator whose ranks are threads of one process (ThreadComm, LocalComm) says so with
// `static constexpr bool ranks_share_memory = true;`: strategies that share memory between ranks
// (Hogwild) need it.
template <class C>
concept SharedMemoryCommunicator = Communicator<C> && requires { requires C::ranks_share_memory; };

// A backend writes `static_assert(check_communicator<MyComm>());` next to its definition: each
// missing piece then fails with a sentence that says what to add.
template <class C>
consteval bool check_communicator() {
  using namespace comm_concepts;
  static_assert(has_rank_and_size<C>, "communicator: needs int rank() const and int size() const");
  static_assert(has_barrier<C>, "communicator: needs void barrier()");
  static_assert(has_all_reduce<C, float> && has_all_reduce<C, double> && has_all_reduce<C, std::int32_t> &&
                    has_all_reduce<C, std::int64_t> && has_all_reduce<C, Half>,
                "communicator: needs all_reduce(std::span<T>, ReduceOp) for T = float, double, int32_t, int64_t, Half");
  static_assert(has_broadcast<C, float> && has_broadcast<C, double> && has_broadcast<C, std::int32_t> &&
                    has_broadcast<C, std::int64_t> && has_broadcast<C, Half>,
                "communicator: needs broadcast(std::span<T>, int root) for every CommScalar T");
  static_assert(has_all_gather<C, float> && has_all_gather<C, double> && has_all_gather<C, std::int32_t> &&
                    has_all_gather<C, std::int64_t> && has_all_gather<C, Half>,
                "communicator: needs all_gather(std::span<const T>, std::span<T>) for every CommScalar T");
  static_assert(has_reduce_scatter<C, float> && has_reduce_scatter<C, double> &&
                    has_reduce_scatter<C, std::int32_t> && has_reduce_scatter<C, std::int64_t> &&
                    has_reduce_scatter<C, Half>,
                "communicator: needs reduce_scatter(std::span<const T>, std::span<T>, ReduceOp) for every CommScalar T");
  static_assert(has_send_recv<C, float> && has_send_recv<C, double> && has_send_recv<C, std::int32_t> &&
                    has_send_recv<C, std::int64_t> && has_send_recv<C, Half>,
                "communicator: needs send(std::span<const T>, int) and recv(std::span<T>, int) for every CommScalar T");
  static_assert(has_async<C, float> && has_async<C, double> && has_async<C, std::int32_t> &&
                    has_async<C, std::int64_t> && has_async<C, Half>,
                "communicator: needs all_reduce_async, broadcast_async, all_gather_async, reduce_scatter_async, "
                "send_async and recv_async returning Work for every CommScalar T");
  static_assert(SplittableCommunicator<C>, "communicator: needs C split(int color, int key)");
  return true;
}

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

TESSERA_LINKAGE std::string_view to_string(CommDType t) {
  switch (t) {
    case CommDType::F32: return "float32";
    case CommDType::F64: return "float64";
    case CommDType::I32: return "int32";
    case CommDType::I64: return "int64";
    case CommDType::F16: return "float16";
    case CommDType::BF16: return "bfloat16";
  }
  return "?";
}

TESSERA_LINKAGE void Work::wait() {
  if (error_) std::rethrow_exception(error_);
  if (!wait_) return;
  auto fn = std::move(wait_);
  wait_ = nullptr;
  poll_ = nullptr;
  try {
    fn();
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
