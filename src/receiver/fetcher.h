// Downloads a receiver's frame objects in the background, several at once,
// so that one object's request latency overlaps the others' and the apply
// (docs/protocol.md, "Following"). Not public API.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dcr/store.h"

namespace dcr::receiver_internal {

class FrameFetcher {
 public:
  // `concurrency` downloads run at once (at least 1), each on its own thread.
  FrameFetcher(Store& store, size_t concurrency);
  ~FrameFetcher();  // waits for the downloads in flight; their results are dropped
  FrameFetcher(const FrameFetcher&) = delete;
  FrameFetcher& operator=(const FrameFetcher&) = delete;

  // Queues a download of `key` unless it is already pending.
  void Fetch(const std::string& key);
  // Downloads queued, in flight, or done and not yet taken: all, or those of keys under `prefix`.
  size_t Pending(const std::string& prefix = "") const;
  bool IsPending(const std::string& key) const;
  // Whether a download is queued or in flight (done ones aside).
  bool Busy() const;
  // The downloads done since the last call, successful or not, in the order they were queued.
  std::vector<std::pair<std::string, Result<std::string>>> TakeDone();
  // Blocks until some download is done and not taken, none is Busy, or
  // `at_most` of real time has passed.
  void WaitDone(std::chrono::milliseconds at_most);
  // Forgets the downloads of keys under `prefix`: queued ones do not start,
  // done ones are dropped, those in flight are dropped when they finish.
  void Drop(const std::string& prefix);

 private:
  void Worker();
  bool IsPendingLocked(const std::string& key) const;
  bool BusyLocked() const;

  Store& store_;
  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  uint64_t next_ = 0;  // queue order
  std::deque<std::pair<uint64_t, std::string>> queued_;
  std::map<uint64_t, std::string> in_flight_;  // by queue order
  std::set<uint64_t> dropped_;  // in flight, and dropped
  std::map<uint64_t, std::pair<std::string, Result<std::string>>> finished_;  // by queue order
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace dcr::receiver_internal
