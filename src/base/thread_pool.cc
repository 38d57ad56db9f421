#include "dcr/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

namespace dcr {

struct ThreadPool::Job {
  size_t n = 0;
  const std::function<void(size_t)>* fn = nullptr;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  size_t active = 0;  // workers inside Run(); guarded by pool mu_
  std::condition_variable finished;

  // Claims and runs indices until none are left.
  void Run() {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      (*fn)(i);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

ThreadPool::ThreadPool(size_t workers) {
  workers_.reserve(workers);
  for (size_t i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    Job* job = jobs_.front();
    if (job->next.load(std::memory_order_relaxed) >= job->n) {
      // Nothing left to claim: retire the job from the queue.
      jobs_.erase(jobs_.begin());
      continue;
    }
    ++job->active;
    lock.unlock();
    job->Run();
    lock.lock();
    if (--job->active == 0) job->finished.notify_all();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Job job;
  job.n = n;
  job.fn = &fn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(&job);
  }
  cv_.notify_all();
  job.Run();
  std::unique_lock<std::mutex> lock(mu_);
  // Every index is claimed; wait until workers that claimed some are out.
  job.finished.wait(lock, [&] { return job.active == 0 && job.done.load() == n; });
  auto it = std::find(jobs_.begin(), jobs_.end(), &job);
  if (it != jobs_.end()) jobs_.erase(it);
}

size_t DefaultThreadCount() {
  if (const char* env = std::getenv("DCR_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v > 0 && v <= 4096) return static_cast<size_t>(v);
  }
  return std::max<size_t>(1, std::thread::hardware_concurrency());
}

ThreadPool& DefaultPool() {
  static ThreadPool* pool = new ThreadPool(DefaultThreadCount() - 1);  // never destroyed
  return *pool;
}

}  // namespace dcr
