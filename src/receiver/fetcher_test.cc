// FrameFetcher: downloads run at once up to its concurrency, one at a time
// they come back in queue order, dropped downloads never come back. Every
// test orders events with a gate that holds reads inside the store until it
// is opened.
#include "fetcher.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>

#include "testing/hook_store.h"

namespace dcr::receiver_internal {
namespace {

// A memory store whose reads wait inside until the gate lets that many
// through (Open), counting how many are inside at once.
class Gate {
 public:
  Gate()
      : inner_(OpenMemStore("fetcher-test")),
        store_(*inner_, [this](std::string_view op, std::string_view, bool after) {
          if (op == "read" && !after) Pass();
          return Status::Ok();
        }) {
    ResetMemStore("fetcher-test");
  }
  Store& store() { return store_; }

  // Waits (a guard against hangs, not an ordering) until `n` reads are inside.
  bool AwaitInside(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, std::chrono::seconds(60), [&] { return inside_ >= n; });
  }
  void Open(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    passes_ += n;
    changed_.notify_all();
  }
  int max_inside() {
    std::lock_guard<std::mutex> lock(mu_);
    return max_inside_;
  }

 private:
  void Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    ++inside_;
    max_inside_ = std::max(max_inside_, inside_);
    changed_.notify_all();
    changed_.wait(lock, [&] { return passes_ > 0; });
    --passes_;
    --inside_;
  }

  std::unique_ptr<Store> inner_;
  testing::HookStore store_;
  std::mutex mu_;
  std::condition_variable changed_;
  int inside_ = 0, max_inside_ = 0, passes_ = 0;
};

// Takes downloads until none is pending (at most a minute: a guard against hangs).
std::vector<std::pair<std::string, Result<std::string>>> TakeAll(FrameFetcher& f) {
  std::vector<std::pair<std::string, Result<std::string>>> all;
  for (int i = 0; f.Pending() > 0 && i < 6000; ++i) {
    f.WaitDone(std::chrono::milliseconds(10));
    for (auto& d : f.TakeDone()) all.push_back(std::move(d));
  }
  return all;
}

TEST(FrameFetcher, RunsItsConcurrencyAtOnce) {
  Gate gate;
  for (const char* k : {"v/a", "v/b", "v/c", "v/d"})
    ASSERT_TRUE(gate.store().Put(k, std::string("bytes of ") + k).ok());
  FrameFetcher f(gate.store(), 4);
  for (const char* k : {"v/d", "v/b", "v/missing", "v/a"}) f.Fetch(k);
  f.Fetch("v/b");  // already pending: not queued twice
  EXPECT_EQ(f.Pending(), 4u);
  EXPECT_TRUE(f.IsPending("v/b"));
  EXPECT_FALSE(f.IsPending("v/c"));
  ASSERT_TRUE(gate.AwaitInside(4));  // all four inside the store at once
  gate.Open(4);
  std::map<std::string, Result<std::string>> done;  // they finish in any order
  for (auto& [key, blob] : TakeAll(f)) done.emplace(key, std::move(blob));
  ASSERT_EQ(done.size(), 4u);
  EXPECT_EQ(*done.at("v/d"), "bytes of v/d");
  EXPECT_EQ(*done.at("v/b"), "bytes of v/b");
  EXPECT_EQ(*done.at("v/a"), "bytes of v/a");
  EXPECT_EQ(done.at("v/missing").status().code(), Code::kNotFound);
  EXPECT_EQ(f.Pending(), 0u);
  EXPECT_EQ(gate.max_inside(), 4);
}

TEST(FrameFetcher, NeverRunsMoreThanItsConcurrency) {
  Gate gate;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(gate.store().Put("k" + std::to_string(i), "x").ok());
  FrameFetcher f(gate.store(), 2);
  for (int i = 0; i < 6; ++i) f.Fetch("k" + std::to_string(i));
  EXPECT_TRUE(f.Busy());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(gate.AwaitInside(2));
    gate.Open(2);
  }
  while (f.Busy()) f.WaitDone(std::chrono::milliseconds(10));
  EXPECT_EQ(f.Pending(), 6u);  // done, not taken: pending, no longer busy
  EXPECT_EQ(TakeAll(f).size(), 6u);
  EXPECT_EQ(gate.max_inside(), 2);
}

TEST(FrameFetcher, DroppedDownloadsNeverComeBackTheRestInQueueOrder) {
  Gate gate;
  for (const char* k : {"v1/a", "v1/b", "v2/a", "v2/b"}) ASSERT_TRUE(gate.store().Put(k, "x").ok());
  FrameFetcher f(gate.store(), 1);
  for (const char* k : {"v1/a", "v1/b", "v2/a", "v2/b"}) f.Fetch(k);
  ASSERT_TRUE(gate.AwaitInside(1));  // v1/a in flight, the rest queued
  f.Drop("v1/");
  EXPECT_EQ(f.Pending("v1/"), 0u);
  EXPECT_EQ(f.Pending(), 2u);
  f.Fetch("v1/a");  // asked for again while the dropped download is in flight: a new one
  EXPECT_EQ(f.Pending(), 3u);
  gate.Open(4);
  auto done = TakeAll(f);
  ASSERT_EQ(done.size(), 3u);
  EXPECT_EQ(done[0].first, "v2/a");
  EXPECT_EQ(done[1].first, "v2/b");
  EXPECT_EQ(done[2].first, "v1/a");
}

}  // namespace
}  // namespace dcr::receiver_internal
