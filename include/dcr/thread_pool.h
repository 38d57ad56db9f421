// A fixed pool of worker threads, the one place dcr computes in parallel
// (waits on I/O have threads of their own: the heartbeat, the relay clients,
// the receiver's frame fetcher).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dcr {

class ThreadPool {
 public:
  // Starts `workers` threads; with 0, ParallelFor runs on the caller alone.
  explicit ThreadPool(size_t workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size(); }

  // Runs fn(i) for every i in [0, n), spread over the pool's threads and the
  // calling thread, and returns when all have finished. Indices are handed
  // out in increasing order, one at a time, so callers can keep output
  // deterministic by writing results into slot i. Safe to call from several
  // threads at once; must not be called from inside fn (no nesting).
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Job;
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Job*> jobs_;  // guarded by mu_
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// Number of worker threads to use: $DCR_THREADS when set to a positive
// integer, otherwise std::thread::hardware_concurrency() (at least 1).
size_t DefaultThreadCount();

// A process-wide pool of DefaultThreadCount() - 1 workers (the caller is
// the last), created on first use.
ThreadPool& DefaultPool();

}  // namespace dcr
