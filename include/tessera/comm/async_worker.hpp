// AsyncWorker: one background thread per communicator that runs asynchronous operations in the
// order they were issued (what ProcessGroupGloo does). Issue order is what makes collectives
// match across ranks, so the queue is strictly FIFO; a blocking call drains the queue first.
//
// Used by backends whose library has no non-blocking collectives (Gloo) or whose collectives are
// plain code (ThreadComm). Each operation carries its own timeout, so wait() needs none.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/linkage.hpp"  // non-template functions: defined at the end (inline) or once in tessera_kernels

namespace tessera::detail {

// A one-shot "finished, maybe with an error" flag shared by an operation running on another
// thread and the Work that waits for it.
class Completion {
 public:
  // Runs op, records how it ended and wakes the waiters.
  template <class Op>
  void run(Op&& op) {
    std::exception_ptr error;
    try {
      op();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mutex_);
      error_ = error;
      done_ = true;
    }
    cv_.notify_all();
  }

  static Work work_for(const std::shared_ptr<Completion>& c);

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class AsyncWorker {
 public:
  AsyncWorker() = default;
  AsyncWorker(const AsyncWorker&) = delete;
  AsyncWorker& operator=(const AsyncWorker&) = delete;
  ~AsyncWorker();

  Work submit(std::function<void()> op);

  // Blocks until every submitted operation has finished (successfully or not).
  void drain();

 private:
  struct Task {
    std::function<void()> op;
    std::shared_ptr<Completion> completion;
  };

  void loop();

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<Task> queue_;
  int pending_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE Work Completion::work_for(const std::shared_ptr<Completion>& c) {
  return Work(
      [c] {
        std::unique_lock lock(c->mutex_);
        c->cv_.wait(lock, [&] { return c->done_; });
        if (c->error_) std::rethrow_exception(c->error_);
      },
      [c] {
        std::lock_guard lock(c->mutex_);
        return c->done_;
      });
}

TESSERA_LINKAGE AsyncWorker::~AsyncWorker() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();  // finishes what was queued: each op has a timeout
}

TESSERA_LINKAGE Work AsyncWorker::submit(std::function<void()> op) {
  auto completion = std::make_shared<Completion>();
  {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    queue_.push_back({std::move(op), completion});
    ++pending_;
  }
  wake_.notify_all();
  return Completion::work_for(completion);
}

TESSERA_LINKAGE void AsyncWorker::drain() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return pending_ == 0; });
}

TESSERA_LINKAGE void AsyncWorker::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task.completion->run(task.op);
    {
      std::lock_guard lock(mutex_);
      --pending_;
    }
    idle_.notify_all();
  }
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera::detail
