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

namespace tessera::detail {

class AsyncWorker {
 public:
  AsyncWorker() = default;
  AsyncWorker(const AsyncWorker&) = delete;
  AsyncWorker& operator=(const AsyncWorker&) = delete;
  ~AsyncWorker() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();  // finishes what was queued: each op has a timeout
  }

  Work submit(std::function<void()> op) {
    auto state = std::make_shared<State>();
    {
      std::lock_guard lock(mutex_);
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      queue_.push_back({std::move(op), state});
      ++pending_;
    }
    wake_.notify_all();
    return Work(
        [state] {
          std::unique_lock lock(state->mutex);
          state->cv.wait(lock, [&] { return state->done; });
          if (state->error) std::rethrow_exception(state->error);
        },
        [state] {
          std::lock_guard lock(state->mutex);
          return state->done;
        });
  }

  // Blocks until every submitted operation has finished (successfully or not).
  void drain() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  struct Task {
    std::function<void()> op;
    std::shared_ptr<State> state;
  };

  void loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        task.op();
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(task.state->mutex);
        task.state->error = error;
        task.state->done = true;
      }
      task.state->cv.notify_all();
      {
        std::lock_guard lock(mutex_);
        --pending_;
      }
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<Task> queue_;
  int pending_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace tessera::detail
