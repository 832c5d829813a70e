// DataParallel on GPUs over NCCL against one GPU: every rank trains on its shard of each global
// batch with DataParallel<CudaNccl>; each must end with the parameters of one
// process (CudaLocal) training on the whole batch, and all ranks with identical parameters.
// Cases: LeNet-5 with SGD + momentum; LeNet-5 with 4 accumulated micro-steps, both ways DataParallel
// offers (the loss / k of PyTorch DDP, and average_micro_steps); a small ResNet with
// SyncBatchNorm (running statistics compared too); LeNet-5 under FullyShardedDataParallel (ZeRO-2
// and ZeRO-3, parameters gathered back; and their 16-bit wires, cast on the GPU). One process per
// GPU, launched by tessera-run (the NCCL id through its file store); exits 77 without a GPU.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/comm/local_cuda.cuh"
#include "tessera/comm/nccl.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/parallel/fully_sharded.hpp"
#include "tessera/parallel/sync_batch_norm.hpp"

using namespace tessera;

namespace {

using Reference = CudaLocal;  // one GPU, the whole batch
using E = CudaNccl;           // one GPU per rank, DataParallel over NCCL

struct Data {
  std::int64_t image;
  std::vector<float> images;
  std::vector<std::int64_t> labels;
  Data(std::int64_t samples, std::int64_t channels, std::int64_t image_size)
      : image(channels * image_size * image_size),
        images(static_cast<std::size_t>(samples * channels * image_size * image_size)),
        labels(static_cast<std::size_t>(samples)) {
    Rng rng(2024);
    for (auto& v : images) v = static_cast<float>(rng.normal());
    for (auto& l : labels) l = static_cast<std::int64_t>(rng.uniform() * 10) % 10;
  }
};

template <class Model>
void forward_backward(Model& model, const Data& data, const Shape& sample, std::int64_t first, std::int64_t n,
                      float loss_scale = 1) {
  Shape shape = sample;
  shape[0] = n;
  Tensor<float, Cpu> host(shape);
  std::copy_n(data.images.begin() + first * data.image, n * data.image, host.data());
  const auto x = to_device<Cuda>(host);
  using ModelEnv = typename Model::Env;
  typename Model::Cache cache{};
  CrossEntropyLoss<ModelEnv> loss;
  typename CrossEntropyLoss<ModelEnv>::Cache loss_cache;
  loss.forward(model.forward(x, cache), std::span<const std::int64_t>(data.labels).subspan(first, n), loss_cache);
  auto dy = loss.backward(loss_cache);
  if (loss_scale != 1) scale_elements(Cuda{}, dy.data(), dy.numel(), loss_scale, dy.data());
  model.backward(dy, cache);
}

// Largest relative difference between two lists of device tensors, and the sum of `mine` as a
// fingerprint for the cross-rank comparison.
double compare(const std::vector<std::pair<std::string, Tensor<float, Cuda>*>>& mine,
               const std::vector<std::pair<std::string, Tensor<float, Cuda>*>>& want, double& fingerprint) {
  double worst = 0;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const auto a = to_host(*mine[i].second), b = to_host(*want[i].second);
    for (std::int64_t k = 0; k < a.numel(); ++k) {
      worst = std::max(worst, std::abs(double(a[k]) - double(b[k])) / std::max(1.0, std::abs(double(b[k]))));
      fingerprint += double(a[k]) * double(k % 7 + 1);
    }
  }
  return worst;
}

// The reference of every case: one GPU, SGD with momentum on each whole global batch.
constexpr SgdOptions kSgd{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};
template <class Model>
NamedTensors<Reference> train_reference(Model& reference, const Data& data, const Shape& sample, std::int64_t global,
                                        int steps) {
  auto named = named_tensors(reference);
  Sgd<Reference> sgd(named, kSgd);
  for (int s = 0; s < steps; ++s) {
    sgd.zero_grad();
    forward_backward(reference, data, sample, s * global, global);
    sgd.step();
  }
  return named;
}

// Maker::make<Env>(seed) builds the model for an Env: once for the reference, once for the ranks.
template <class Maker>
std::string run_case(NcclComm& comm, Maker, const Shape& sample, std::int64_t per_rank, int steps,
                     int micro_steps, bool sync_bn, bool average_micro_steps = false) {
  const int p = comm.size(), r = comm.rank();
  const std::int64_t global = per_rank * p, piece = per_rank / micro_steps;
  const Data data(global * steps, sample[1], sample[2]);
  auto reference = Maker::template make<Reference>(7);
  const auto reference_named = train_reference(reference, data, sample, global, steps);

  auto model = Maker::template make<E>(r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));  // the broadcast must fix ranks > 0
  if (sync_bn) convert_sync_batch_norm(model, comm);
  DataParallel dp(model, comm, {.bucket_bytes = 64 * 1024, .first_bucket_bytes = 8 * 1024,
                                .average_micro_steps = average_micro_steps});
  // Gradients of k micro-steps are summed, as with PyTorch DDP: each micro-step's loss is scaled
  // by 1/k for the gradient of the mean over the whole batch, unless DataParallel averages them.
  const float loss_scale = average_micro_steps ? 1.0f : 1.0f / static_cast<float>(micro_steps);
  Sgd<E> sgd(dp.parameters(), kSgd);
  for (int s = 0; s < steps; ++s) {
    sgd.zero_grad();
    for (int m = 0; m < micro_steps; ++m) {
      const std::int64_t first = s * global + r * per_rank + m * piece;
      if (m + 1 < micro_steps) {
        auto guard = dp.no_sync();
        forward_backward(model, data, sample, first, piece, loss_scale);
      } else {
        forward_backward(model, data, sample, first, piece, loss_scale);
      }
    }
    dp.finish();
    sgd.step();
  }

  std::vector<std::pair<std::string, Tensor<float, Cuda>*>> mine, want;
  for (std::size_t i = 0; i < dp.parameters().parameters.size(); ++i) {
    mine.emplace_back(dp.parameters().parameters[i].first, &dp.parameters().parameters[i].second->value);
    want.emplace_back(reference_named.parameters[i].first, &reference_named.parameters[i].second->value);
  }
  for (std::size_t i = 0; i < dp.parameters().buffers.size(); ++i) {
    mine.push_back(dp.parameters().buffers[i]);
    want.push_back(reference_named.buffers[i]);
  }
  double fingerprint = 0;
  const double worst = compare(mine, want, fingerprint);
  // Identical on every rank: the fingerprint's max and min over ranks agree.
  Tensor<double, Cpu> host = Tensor<double, Cpu>::from({2}, {fingerprint, -fingerprint});
  auto device = to_device<Cuda>(host);
  comm.all_reduce(device.span(), ReduceOp::Max);
  host = to_host(device);
  std::string problem;
  if (!(worst <= 2e-4)) problem = detail::cat("parameters differ from one GPU by ", worst, " (relative)");
  if (host[0] != -host[1]) problem += detail::cat(problem.empty() ? "" : "; ", "ranks disagree (fingerprints ", -host[1],
                                                  " .. ", host[0], ")");
  return problem;
}

// LeNet-5 under FullyShardedDataParallel at `stage`, SGD + momentum, against one GPU. With a
// 16-bit wire (`wire`: parameters gathered and gradients reduce-scattered in bfloat16, cast on the
// GPU) the parameters differ by the rounding (within 3e-2, as on the CPU) and must differ at all.
std::string run_fsdp_case(NcclComm& comm, int stage, ShardDType wire = ShardDType::Same) {
  const int p = comm.size(), r = comm.rank();
  constexpr std::int64_t per_rank = 8, steps = 3;
  const std::int64_t global = per_rank * p;
  const Shape sample{1, 1, 28, 28};
  const Data data(global * steps, 1, 28);
  auto reference = lenet5<Reference>(1, 28, 10, 7);
  const auto reference_named = train_reference(reference, data, sample, global, steps);
  auto model = lenet5<E>(1, 28, 10, r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));
  FullyShardedDataParallel fsdp(model, comm, {.stage = stage, .param_dtype = wire, .reduce_dtype = wire});
  Sgd<E> sgd(fsdp.shard_parameters(), kSgd);
  FullyShardedOptimizer optimizer(fsdp, sgd);
  for (int s = 0; s < steps; ++s) {
    const std::int64_t first = s * global + r * per_rank;
    Tensor<float, Cpu> host(Shape{per_rank, 1, 28, 28});
    std::copy_n(data.images.begin() + first * data.image, per_rank * data.image, host.data());
    optimizer.zero_grad();
    fsdp.train_step(to_device<Cuda>(host), std::span<const std::int64_t>(data.labels).subspan(first, per_rank));
    optimizer.step();
  }
  fsdp.gather_full();
  auto named = named_tensors(model);
  std::vector<std::pair<std::string, Tensor<float, Cuda>*>> mine, want;
  for (std::size_t i = 0; i < named.parameters.size(); ++i) {
    mine.emplace_back(named.parameters[i].first, &named.parameters[i].second->value);
    want.emplace_back(reference_named.parameters[i].first, &reference_named.parameters[i].second->value);
  }
  double fingerprint = 0;
  const double worst = compare(mine, want, fingerprint);
  if (wire != ShardDType::Same)
    return worst <= 3e-2 && worst > 1e-7 ? std::string()
                                         : detail::cat("with a ", to_string(wire), " wire, parameters differ from one GPU by ",
                                                       worst, " (relative; expected within (1e-7, 3e-2])");
  return worst <= 2e-4 ? std::string() : detail::cat("parameters differ from one GPU by ", worst, " (relative)");
}

struct Lenet {
  template <class Env>
  static auto make(std::uint64_t seed) {
    return lenet5<Env>(1, 28, 10, seed);
  }
};
struct SmallResnet {
  template <class Env>
  static auto make(std::uint64_t seed) {
    return ResNet<Env, BasicBlock>({1, 1}, {8, 16}, false, ResNetOptions{.in_channels = 3, .num_classes = 10, .seed = seed});
  }
};

}  // namespace

int main() {
  if (Cuda::device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  int rank = -1;
  try {
    auto comm = NcclComm::from_env();
    rank = comm.rank();
    const Lenet lenet;
    const SmallResnet resnet;
    struct Case {
      const char* name;
      std::string problem;
    };
    std::vector<Case> cases{
        {"lenet sgd", run_case(comm, lenet, {1, 1, 28, 28}, 8, 3, 1, false)},
        {"lenet accumulation x4", run_case(comm, lenet, {1, 1, 28, 28}, 8, 2, 4, false)},
        {"lenet accumulation x4, averaged", run_case(comm, lenet, {1, 1, 28, 28}, 8, 2, 4, false, true)},
        {"resnet + SyncBatchNorm", run_case(comm, resnet, {1, 3, 16, 16}, 4, 2, 1, true)},
        {"lenet fsdp stage 2", run_fsdp_case(comm, 2)},
        {"lenet fsdp stage 3", run_fsdp_case(comm, 3)},
        {"lenet fsdp stage 3, bfloat16 wire", run_fsdp_case(comm, 3, ShardDType::BFloat16)},
        {"lenet fsdp stage 2, float16 wire", run_fsdp_case(comm, 2, ShardDType::Float16)},
    };
    int failed = 0;
    for (const auto& c : cases) {
      if (rank == 0) std::printf("%-32s %s%s\n", c.name, c.problem.empty() ? "ok" : "FAILED: ", c.problem.c_str());
      failed += !c.problem.empty();
    }
    comm.barrier();
    return failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}
