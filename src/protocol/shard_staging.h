// The copy thread of a publish from staged senders (ShardSource::stage).
// Not public API.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "dcr/clock.h"
#include "dcr/shard_publisher.h"

namespace dcr::protocol_internal {

// Stages every local sender's buffers in the order the encode reads them (by
// the first canonical tensor name each holds: manifests sort tensors by name,
// TensorNameLess), and lets readers wait for one. Senders without `stage` are
// ready. Times the copy thread with the real clock (a measurement, on another
// thread).
class ShardStaging {
 public:
  explicit ShardStaging(std::span<const ShardSource> local);
  ~ShardStaging();
  // Blocks until buffer b of local sender i is staged.
  Status Await(size_t i, size_t b);
  // The copy thread's error, if it failed (no attempt can fix it).
  Status Failure();
  Status AwaitAll();
  // What ProjectSender calls before reading sender i's buffers (none when unstaged).
  std::function<Status(size_t)> AwaiterFor(size_t i);
  double seconds();

 private:
  void Run();

  std::span<const ShardSource> local_;
  const Clock::Instant start_;
  std::vector<bool> staged_;  // per sender: has a stage function (fixed at construction)
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<bool>> ready_;
  bool done_ = false;
  Status failed_;
  double seconds_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace dcr::protocol_internal
