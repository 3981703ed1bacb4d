// A small persistent thread pool for memcpy-bound work: the caller thread takes part,
// so run(n, fn) with one worker costs no thread hand-off at all.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pddcore {

class ThreadPool {
 public:
  explicit ThreadPool(size_t num_threads) { resize(num_threads); }
  ~ThreadPool() { stop_workers(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }

  // Sets the total number of threads, the caller included.
  void resize(size_t num_threads) {
    std::lock_guard<std::mutex> run_guard(run_mutex_);
    stop_workers();
    stopping_ = false;
    for (size_t i = 1; i < std::max<size_t>(num_threads, 1); ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  // Calls fn(t) for t in [0, num_tasks) across the pool and returns when all are done.
  void run(size_t num_tasks, const std::function<void(size_t)>& fn) {
    if (num_tasks == 0) return;
    if (num_tasks == 1 || workers_.empty()) {
      for (size_t t = 0; t < num_tasks; ++t) fn(t);
      return;
    }
    std::lock_guard<std::mutex> run_guard(run_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      num_tasks_ = num_tasks;
      next_task_ = 0;
      pending_ = num_tasks;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void drain() {
    for (;;) {
      size_t t;
      const std::function<void(size_t)>* job;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (job_ == nullptr || next_task_ >= num_tasks_) return;
        t = next_task_++;
        job = job_;
      }
      (*job)(t);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_all();
    }
  }

  void worker_loop() {
    size_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      drain();
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t num_tasks_ = 0, next_task_ = 0, pending_ = 0, generation_ = 0;
  bool stopping_ = false;
};

}  // namespace pddcore
