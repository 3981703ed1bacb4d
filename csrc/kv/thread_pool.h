// A small persistent thread pool for memcpy-bound work: the caller thread takes part,
// so run(n, fn) with one worker costs no thread hand-off at all.
#pragma once

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

  // The total number of threads, the caller included.
  size_t size() const { return workers_.size() + 1; }
  // Sets the total number of threads, the caller included.
  void resize(size_t num_threads);
  // Calls fn(t) for t in [0, num_tasks) across the pool and returns when all are done.
  void run(size_t num_tasks, const std::function<void(size_t)>& fn);

 private:
  // Takes tasks of the current job until none is left.
  void drain();
  void worker_loop();
  void stop_workers();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t num_tasks_ = 0, next_task_ = 0, pending_ = 0, generation_ = 0;
  bool stopping_ = false;
};

}  // namespace pddcore
