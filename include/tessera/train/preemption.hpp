// StopSignals: a cluster's "stop soon" turned into a flag that the training loop reads between
// steps, so that a job checkpoints where it is instead of losing the work since its last epoch.
//
// Slurm sends SIGUSR1 a chosen time before a job's limit (`sbatch --signal=USR1@T`, which
// tools/tessera-sbatch --signal-before writes), and SIGTERM at the limit, on preemption and on
// `scancel` (then SIGKILL after KillWait, 30 s by default). While a StopSignals lives, those
// signals only record themselves; Trainer (TrainOptions::stop_signals) reads the record after
// every optimizer step, the ranks agree on the first step after which any of them saw a signal,
// save the checkpoint there (mid-epoch, with the data loader's position, as stop_after_steps
// does) and return. The program then exits kExitStoppedForResume (75, sysexits' EX_TEMPFAIL:
// "try again"), which tessera-sbatch's script answers with `scontrol requeue`; the requeued job
// resumes at the next sample. PyTorch's nearest: Lightning's SLURM auto-requeue on SIGUSR1.
//
// One StopSignals per process (a second one, even in another thread, is refused): the handlers
// are process-wide, and the ranks of an in-process communicator share the one record. The
// previous handlers come back when it is destroyed; a signal received meanwhile stays recorded
// for received() until then. The handler only stores the signal number in a lock-free atomic,
// which is all a signal handler may safely do.
#pragma once

#include <signal.h>

#include <atomic>
#include <csignal>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera {

// The exit status of a program that stopped on a signal after saving its checkpoint: run it again
// with --resume to continue.
inline constexpr int kExitStoppedForResume = 75;

namespace detail {
// The first stop signal received (0: none); whether a StopSignals is alive.
inline std::atomic<int> stop_signal_received{0};
inline std::atomic<bool> stop_signals_alive{false};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");
}  // namespace detail

class StopSignals {
 public:
  // The signals to catch; the default is Slurm's pair. Each must be a signal a process may catch
  // (not SIGKILL or SIGSTOP).
  explicit StopSignals(std::vector<int> signals = {SIGUSR1, SIGTERM});
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first of the signals received since construction, or 0.
  int received() const;
  const std::vector<int>& signals() const { return signals_; }

  // "SIGUSR1", "SIGTERM", ... ("signal 42" for others).
  static std::string name(int signal);

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE StopSignals::StopSignals(std::vector<int> signals) : signals_(std::move(signals)) {
  for (int s : signals_)
    TESSERA_CHECK(s > 0 && s < NSIG && s != SIGKILL && s != SIGSTOP, ArgumentError, "StopSignals: ", name(s),
                  " cannot be caught (give signals such as SIGUSR1 and SIGTERM)");
  bool expected = false;
  TESSERA_CHECK(detail::stop_signals_alive.compare_exchange_strong(expected, true), ArgumentError,
                "StopSignals: one already exists in this process (signal handlers are process-wide: make one in "
                "main and give every rank's TrainOptions a pointer to it)");
  detail::stop_signal_received.store(0);
  struct sigaction action {};
  action.sa_handler = [](int s) {
    int none = 0;
    detail::stop_signal_received.compare_exchange_strong(none, s);
  };
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a read or write the signal lands in carries on
  previous_.resize(signals_.size());
  for (std::size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &action, &previous_[i]);
}

TESSERA_LINKAGE StopSignals::~StopSignals() {
  for (std::size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  detail::stop_signals_alive.store(false);
}

TESSERA_LINKAGE int StopSignals::received() const { return detail::stop_signal_received.load(); }

TESSERA_LINKAGE std::string StopSignals::name(int signal) {
  switch (signal) {
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    case SIGKILL: return "SIGKILL";
    case SIGSTOP: return "SIGSTOP";
    default: return "signal " + std::to_string(signal);
  }
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
