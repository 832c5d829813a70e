// Bytes that crossed this host's loopback interface, for the examples' cost models: every rank of
// a job on one host that talks over TCP (Gloo) sends its bytes through `lo`, so the difference of
// two readings around the training steps, divided by ranks and steps, is the measured traffic per
// rank and step. Shared-memory transports (threads, Open MPI's vader) do not show up there; a
// communicator that counts its own traffic (ThreadComm::peer_bytes) reports it through peer_bytes.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace examples {

// Bytes received on `lo` since boot (/proc/net/dev; on loopback received = sent), or -1 where
// the file cannot be read (not Linux).
inline double loopback_bytes() {
  std::FILE* f = std::fopen("/proc/net/dev", "r");
  if (!f) return -1;
  char line[512];
  double bytes = -1;
  while (std::fgets(line, sizeof line, f)) {
    const char* p = line;
    while (*p == ' ') ++p;
    if (std::strncmp(p, "lo:", 3) == 0) bytes = std::strtod(p + 3, nullptr);
  }
  std::fclose(f);
  return bytes;
}

// Bytes this rank's collectives moved between the ranks' buffers, for a communicator that counts
// them (ThreadComm), or -1.
template <class Comm>
double peer_bytes(const Comm& comm) {
  if constexpr (requires { comm.peer_bytes(); }) return static_cast<double>(comm.peer_bytes());
  else return -1;
}

}  // namespace examples
