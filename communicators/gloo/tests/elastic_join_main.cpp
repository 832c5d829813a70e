// GlooElasticGroup's replacement that arrives after the training ended, one process: two members
// (slots 0 and 1, each a thread) form a group over a file store and finish (ElasticTrainer calls
// finished(step) at the end of fit()); a replacement for slot 1 started afterwards must stop at
// once with a CommError that says the group finished, not wait out its timeout and then ask
// whether the group is running (the Slurm elastic campaign's replacements that came too late).
// Exit 0 when every check passes.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include <unistd.h>

#include "tessera/comm/gloo_elastic.hpp"

int main() {
  using namespace tessera;
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("tessera-elastic-join-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string url = "file://" + dir.string();
  const CommOptions options{.timeout = std::chrono::seconds(10)};
  int failures = 0;
  const auto expect = [&](bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "ok    " : "FAILED", what.c_str());
    failures += ok ? 0 : 1;
  };
  {
    std::string errors[2];
    const auto member = [&](int slot) {
      try {
        GlooElasticGroup group(url, slot, 2, "job", false, options);
        group.comm().barrier();
        group.finished(7);  // every member calls it; rank 0 writes the key
        group.comm().barrier();
      } catch (const std::exception& e) {
        errors[slot] = e.what();
      }
    };
    std::thread other(member, 1);
    member(0);
    other.join();
    expect(errors[0].empty() && errors[1].empty(), "two members form a group and finish (" + errors[0] + errors[1] + ")");
  }
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    GlooElasticGroup late(url, 1, 2, "job", true, options);
    message = "no error: the replacement was admitted";
  } catch (const CommError& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  expect(message.find("the group finished training (generation 0, after step 7) before it could admit this "
                      "replacement") != std::string::npos,
         "a replacement after the end is told the group finished (" + message + ")");
  expect(seconds < 2.0, "it is told within 2 s, not after its 10 s timeout (" + std::to_string(seconds) + " s)");
  fs::remove_all(dir);
  std::printf("%s\n", failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
