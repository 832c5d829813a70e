// NcclElasticGroup: an elastic group (comm/elastic.hpp) whose collectives run over NCCL, with the
// membership agreed by a Gloo elastic group on the host: NCCL has no membership of its own, and
// its communicator cannot shrink (ncclCommShrink is NCCL 2.27 and needs every survivor to call it
// on a communicator that still works; after a timeout it does not). So each generation:
//
//   failure:  the NcclComm is aborted (its destructor calls ncclCommAbort on a broken one), the
//             host group agrees on the survivors through the store (gloo_elastic.hpp), and a new
//             NcclComm is made from the new host communicator (NcclComm::from: rank 0's unique id
//             broadcast over Gloo)
//   growth:   the same, at the step the host group agreed on
//
// Include it where both backends are built (a program linking NCCL and Gloo); it is not part of
// nccl.hpp, which needs no Gloo. Compiled in the meson build (tests/cuda/elastic_nccl.cpp) and run
// only on a machine with GPUs (skipped otherwise): the path after a failure has not run on a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/elastic.hpp"
#include "tessera/comm/gloo_elastic.hpp"
#include "tessera/comm/nccl.hpp"

namespace tessera {

class NcclElasticGroup {
 public:
  using Comm = NcclComm;

  // The host group from the launcher's environment (GlooElasticGroup::from_env), and an NcclComm
  // over it on this process's GPU (the launcher's local rank).
  static NcclElasticGroup from_env(CommOptions comm_options = {}, ElasticOptions options = {}) {
    return NcclElasticGroup(GlooElasticGroup::from_env(comm_options, options), comm_options);
  }
  NcclElasticGroup(GlooElasticGroup host, CommOptions comm_options = {})
      : host_(std::move(host)), comm_options_(comm_options) {
    connect();
  }

  NcclComm& comm() {
    TESSERA_CHECK(comm_.has_value(), CommError, "NcclElasticGroup ", host_.member(), ": no NCCL communicator");
    return *comm_;
  }
  std::int64_t generation() const { return host_.generation(); }
  const std::string& member() const { return host_.member(); }
  bool joined_late() const { return host_.joined_late(); }
  const std::vector<MembershipChange>& history() const { return host_.history(); }
  GlooElasticGroup& host() { return host_; }

  void reform(const std::string& cause) {
    comm_.reset();  // aborts a broken NCCL communicator instead of waiting for peers that are gone
    host_.reform(cause);
    connect();
  }
  bool growth_due(std::int64_t step) { return host_.growth_due(step); }
  void finished(std::int64_t step) { host_.finished(step); }
  void grow(std::int64_t step) {
    comm_.reset();
    host_.grow(step);
    connect();
  }

 private:
  void connect() { comm_.emplace(NcclComm::from(host_.comm(), comm_options_)); }

  GlooElasticGroup host_;
  CommOptions comm_options_;
  std::optional<NcclComm> comm_;
};

template <>
struct ElasticGroupFor<NcclComm> {
  using type = NcclElasticGroup;
};

}  // namespace tessera
