// Time as the protocol's loops see it, injected so that tests decide it: a
// monotonic instant for deadlines and durations, wall-clock seconds for what
// records say (heartbeats, commit and fence times), and sleeping.
#pragma once

#include <chrono>
#include <mutex>

namespace dcr {

class Clock {
 public:
  using Instant = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  virtual Instant Now() = 0;
  virtual double UnixSeconds() = 0;
  virtual void Sleep(std::chrono::milliseconds d) = 0;
};

// The machine's clocks (steady_clock, system_clock, sleep_for); thread-safe.
Clock& RealClock();

// A clock for tests: time stands still until someone sleeps or calls
// Advance, which move it forward by that much, at once (no real waiting).
// Thread-safe, but every sleeper moves the one time: meant for loops that
// run on one thread.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(double unix_start = 1.8e9) : unix_start_(unix_start) {}
  Instant Now() override;
  double UnixSeconds() override;
  void Sleep(std::chrono::milliseconds d) override { Advance(d); }
  void Advance(std::chrono::nanoseconds d);

 private:
  std::mutex mu_;
  std::chrono::nanoseconds elapsed_{0};
  const double unix_start_;
};

}  // namespace dcr
