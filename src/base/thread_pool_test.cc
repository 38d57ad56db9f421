#include "dcr/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace dcr {
namespace {

// Runs ParallelFor(n) and checks that every index ran exactly once.
void ExpectEachIndexOnce(ThreadPool& pool, size_t n) {
  std::vector<std::atomic<int>> hits(n);
  std::atomic<size_t> calls{0};
  pool.ParallelFor(n, [&](size_t i) {
    ASSERT_LT(i, n);
    hits[i].fetch_add(1, std::memory_order_relaxed);
    calls.fetch_add(1, std::memory_order_relaxed);
  });
  EXPECT_EQ(calls.load(), n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
}

TEST(ThreadPoolTest, Size) {
  EXPECT_EQ(ThreadPool(0).size(), 0u);
  EXPECT_EQ(ThreadPool(3).size(), 3u);
}

TEST(ThreadPoolTest, EveryIndexRunsExactlyOnce) {
  for (size_t workers : {0, 1, 2, 4, 7}) {
    ThreadPool pool(workers);
    for (size_t n : {0, 1, 2, 3, 10, 100, 1000, 10007}) {
      SCOPED_TRACE("workers=" + std::to_string(workers) + " n=" + std::to_string(n));
      ExpectEachIndexOnce(pool, n);
    }
  }
}

TEST(ThreadPoolTest, ZeroAndOneRunOnCaller) {
  ThreadPool pool(4);
  int calls = 0;
  pool.ParallelFor(0, [&](size_t) { ++calls; });
  EXPECT_EQ(calls, 0);

  const auto caller = std::this_thread::get_id();
  std::thread::id ran_on;
  pool.ParallelFor(1, [&](size_t i) {
    EXPECT_EQ(i, 0u);
    ran_on = std::this_thread::get_id();
    ++calls;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(ran_on, caller);
}

TEST(ThreadPoolTest, NoWorkersRunsInOrderOnCaller) {
  ThreadPool pool(0);
  const auto caller = std::this_thread::get_id();
  std::vector<size_t> order;
  pool.ParallelFor(50, [&](size_t i) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    order.push_back(i);  // no synchronisation needed: one thread
  });
  ASSERT_EQ(order.size(), 50u);
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], i);
}

TEST(ThreadPoolTest, UsesWorkerThreads) {
  // While one item is held until another thread has run an item, workers
  // must pick some up: more than one thread runs (a handshake, not a race
  // against the caller; the wait is only a guard against a hang).
  ThreadPool pool(3);
  std::mutex mu;
  std::condition_variable cv;
  std::set<std::thread::id> threads;
  pool.ParallelFor(64, [&](size_t i) {
    std::unique_lock<std::mutex> lock(mu);
    threads.insert(std::this_thread::get_id());
    cv.notify_all();
    if (i == 0) cv.wait_for(lock, std::chrono::seconds(120), [&] { return threads.size() > 1; });
  });
  EXPECT_GT(threads.size(), 1u);
  EXPECT_LE(threads.size(), 4u);  // 3 workers + the caller
}

TEST(ThreadPoolTest, ReturnsOnlyAfterAllItemsFinished) {
  ThreadPool pool(4);
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> finished{0};
    pool.ParallelFor(16, [&](size_t i) {
      if (i % 4 == 3) std::this_thread::sleep_for(std::chrono::microseconds(200));
      finished.fetch_add(1);
    });
    ASSERT_EQ(finished.load(), 16) << round;
  }
}

TEST(ThreadPoolTest, ResultsInSlotsAreDeterministic) {
  ThreadPool pool(3);
  std::vector<uint64_t> out(5000);
  pool.ParallelFor(out.size(), [&](size_t i) { out[i] = i * i + 1; });
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], i * i + 1);
}

TEST(ThreadPoolTest, ConcurrentCallersFromSeveralThreads) {
  ThreadPool pool(3);
  constexpr int kCallers = 6;
  constexpr int kRounds = 30;
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int r = 0; r < kRounds; ++r) {
        const size_t n = static_cast<size_t>(1 + (c * 37 + r * 11) % 300);
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
        for (size_t i = 0; i < n; ++i)
          if (hits[i].load() != 1) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPoolTest, DestroyWhileIdleAndAfterUse) {
  for (int i = 0; i < 20; ++i) {
    ThreadPool idle(4);  // never used: destructor must still join
    ThreadPool used(2);
    std::atomic<int> sum{0};
    used.ParallelFor(10, [&](size_t k) { sum.fetch_add(static_cast<int>(k)); });
    EXPECT_EQ(sum.load(), 45);
  }
}

// Sets DCR_THREADS for the scope, restoring the previous value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

TEST(DefaultThreadCountTest, ParsesDcrThreads) {
  const size_t hw = std::max<size_t>(1, std::thread::hardware_concurrency());
  {
    ScopedEnv env("DCR_THREADS", nullptr);
    EXPECT_EQ(DefaultThreadCount(), hw);
  }
  struct Case {
    const char* value;
    size_t expected;  // 0: hardware concurrency
  };
  const Case cases[] = {
      {"1", 1},  {"3", 3}, {"17", 17}, {"4096", 4096}, {"4097", 0}, {"0", 0},
      {"-2", 0}, {"", 0},  {"abc", 0}, {"4x", 0},      {"2.5", 0},  {"99999999999999999999", 0},
  };
  for (const auto& c : cases) {
    ScopedEnv env("DCR_THREADS", c.value);
    EXPECT_EQ(DefaultThreadCount(), c.expected ? c.expected : hw) << "DCR_THREADS='" << c.value << "'";
  }
}

TEST(DefaultPoolTest, IsSingletonAndWorks) {
  ThreadPool& a = DefaultPool();
  ThreadPool& b = DefaultPool();
  EXPECT_EQ(&a, &b);
  ExpectEachIndexOnce(a, 12345);
}

}  // namespace
}  // namespace dcr
