// Progress lines for long operations: "label  1.2 GB / 4.0 GB  850 MB/s  ETA 3s".
// Shown on stderr only when it is a terminal (or DCR_PROGRESS=1); silent when
// piped (or DCR_PROGRESS=0).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "dcr/status.h"

namespace dcr {

class Progress {
 public:
  // `total_bytes` may be 0 when unknown (no ETA then).
  Progress(std::string label, uint64_t total_bytes);
  ~Progress();  // calls Finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Thread-safe; cheap enough to call per chunk.
  void Add(uint64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  // Prints the final line (when enabled) and stops the printer. Idempotent.
  void Finish();

  static bool Enabled();

 private:
  void Print(bool final);
  void Loop();

  std::string label_;
  uint64_t total_;
  std::atomic<uint64_t> done_{0};
  double start_;
  bool enabled_;
  bool finished_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread printer_;
};

// "1.50 GB", "312 MB", "17 B" (decimal units, as throughput figures use).
std::string FormatBytes(double bytes);
// Parses "64MB", "1.5GiB", "4096", "2e9" into bytes; kInvalidArgument otherwise.
Result<uint64_t> ParseBytes(const std::string& text);
// Seconds since an arbitrary epoch, monotonic.
double MonotonicSeconds();

}  // namespace dcr
