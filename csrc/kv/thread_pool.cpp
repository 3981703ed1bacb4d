#include "thread_pool.h"

#include <algorithm>

namespace pddcore {

void ThreadPool::resize(size_t num_threads) {
  std::lock_guard<std::mutex> run_guard(run_mutex_);
  stop_workers();
  stopping_ = false;
  for (size_t i = 1; i < std::max<size_t>(num_threads, 1); ++i) workers_.emplace_back([this] { worker_loop(); });
}

void ThreadPool::run(size_t num_tasks, const std::function<void(size_t)>& fn) {
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

void ThreadPool::drain() {
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

void ThreadPool::worker_loop() {
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

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

}  // namespace pddcore
