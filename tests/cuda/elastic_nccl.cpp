// ElasticTrainer over NCCL (communicators/nccl/include/tessera/comm/nccl_elastic.hpp): LeNet-5 on
// the GPU, DataParallel over an NcclElasticGroup whose membership a Gloo group agrees on, trained
// on synthetic images with a global batch split over the ranks; ends by comparing every rank's
// parameter checksum. Run by meson as `nccl-elastic-2` under tools/tessera-run (skipped with fewer
// than 2 GPUs). No fault is injected: the path after a failure is the Gloo group's and the
// ElasticTrainer's, both tested on the CPU (example_19_elastic_faults, test_elastic.cpp).
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <vector>

#include "tessera/comm/nccl_elastic.hpp"
#include "tessera/core/random.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/optim/schedule.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/train/elastic.hpp"

int main() {
  using namespace tessera;
  using E = CudaNccl;
  try {
    Dataset data;
    data.name = "synthetic";
    data.num_classes = 10;
    data.images.resize({256, 1, 28, 28});
    Rng rng(3);
    for (auto& v : data.images) v = static_cast<float>(rng.normal());
    for (std::int64_t i = 0; i < 256; ++i) data.labels.push_back(i % 10);
    auto group = NcclElasticGroup::from_env();
    auto model = lenet5<E>(1, 28, 10, 1);
    Sgd<E> sgd(named_tensors(model), {.lr = 0.05, .momentum = 0.9});
    ElasticTrainer<NcclElasticGroup, decltype(model), Sgd<E>, DataParallel<E>> trainer(
        group, model, sgd, [&](std::optional<DataParallel<E>>& dp, NcclComm& comm) { dp.emplace(model, comm); },
        ConstantLr{0.05}, {.epochs = 2, .verbose = false});
    trainer.fit(data, {.seed = 5, .global_batch_size = 32}, static_cast<DataLoader<float>*>(nullptr));
    std::uint64_t sum = 0;
    std::vector<float> host;
    for (const auto& [name, p] : named_tensors(model).parameters) sum = sum * 31 + tensor_checksum(p->value, host);
    const auto mine = static_cast<std::int64_t>(sum);
    std::vector<std::int64_t> all(static_cast<std::size_t>(group.comm().size()));
    group.host().comm().all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
    for (const auto other : all)
      if (other != mine) {
        std::fprintf(stderr, "elastic_nccl: the ranks' parameters differ\n");
        return 1;
      }
    std::printf("elastic_nccl: rank %d of %d, parameters %016" PRIx64 ", identical on every rank\n",
                group.comm().rank(), group.comm().size(), sum);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_nccl: %s\n", e.what());
    return 1;
  }
}
