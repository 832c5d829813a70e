// GlooComm's store layer (detail::PrefixedStore) over the stores a store URL opens, one process:
// has() answers at once whether keys are there, and a wait with a timeout keeps it. Gloo's own
// timed wait rounds the time it has waited down to whole seconds before comparing, so a short
// wait for a missing key lasted a whole second, and so did every rendezvous step that asks for a
// missing key (gloo.hpp, CheckableStore; the figures are in docs/testing.md). Checked over the file
// store of open_gloo_store, and over a plain Gloo FileStore, which still works through Gloo's
// waits. Exit 0 when every check passes.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "tessera/comm/gloo.hpp"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok    " : "FAILED", what.c_str());
  failures += ok ? 0 : 1;
}

// Runs f, which must throw a CommError whose text names `key`; returns the seconds it took.
template <class F>
double expect_timeout(F f, const std::string& key, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    f();
  } catch (const tessera::CommError& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not a CommError: ") + e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  expect(message.find(key) != std::string::npos && message.find("not a CommError") == std::string::npos,
         what + " throws a CommError naming the key (" + message + ")");
  return seconds;
}

void check_store(std::shared_ptr<gloo::rendezvous::Store> base, const std::string& label, bool checkable) {
  tessera::detail::PrefixedStore store(std::move(base), "job");
  expect(!store.has({"missing"}), label + ": has() of a missing key is false");
  const std::string value = "size=2";
  store.set("present", std::vector<char>(value.begin(), value.end()));
  expect(store.has({"present"}), label + ": has() of a written key is true");
  expect(!store.has({"present", "missing"}), label + ": has() of a written and a missing key is false");
  store.wait({"present"}, std::chrono::milliseconds(50));
  const auto got = store.get("present");
  expect(std::string(got.begin(), got.end()) == value, label + ": get() returns what set() wrote");
  if (!checkable) return;  // Gloo's own timed waits: a second at least, and its own exception
  // The timeout is kept to within the polling period; the bound is loose, and Gloo's rounding to
  // whole seconds is what it rules out.
  const double waited = expect_timeout([&] { store.wait({"missing"}, std::chrono::milliseconds(50)); }, "missing",
                                       label + ": a 50 ms wait for a missing key");
  expect(waited >= 0.05 && waited < 0.9, label + ": that wait lasted " + std::to_string(waited) + " s, its timeout");
  // A watched wait (a rendezvous) calls the watch while it waits; one that throws ends the wait.
  int calls = 0;
  store.set_watch([&calls] {
    if (++calls == 3) throw tessera::CommError("rank 1 exited while the ranks were connecting");
  }, std::chrono::seconds(5));
  expect_timeout([&] { store.wait({"missing"}); }, "rank 1 exited", label + ": a watched wait whose watch throws");
  expect(calls == 3, label + ": the watch ran until it threw (" + std::to_string(calls) + " calls)");
}

}  // namespace

int main() {
  const auto dir = std::filesystem::temp_directory_path() / ("tessera-store-test-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "url");
  std::filesystem::create_directories(dir / "plain");
  try {
    check_store(tessera::detail::open_gloo_store("file://" + (dir / "url").string()), "file:// store", true);
    check_store(std::make_shared<gloo::rendezvous::FileStore>((dir / "plain").string()), "plain Gloo FileStore",
                false);
  } catch (const std::exception& e) {
    expect(false, std::string("unexpected exception: ") + e.what());
  }
  std::filesystem::remove_all(dir);
  std::printf("%d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
