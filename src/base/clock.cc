#include "dcr/clock.h"

#include <thread>

namespace dcr {
namespace {

class SystemClock final : public Clock {
 public:
  Instant Now() override { return std::chrono::steady_clock::now(); }
  double UnixSeconds() override {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  void Sleep(std::chrono::milliseconds d) override { std::this_thread::sleep_for(d); }
};

}  // namespace

Clock& RealClock() {
  static SystemClock clock;
  return clock;
}

Clock::Instant ManualClock::Now() {
  std::lock_guard lock(mu_);
  return Instant(std::chrono::duration_cast<Instant::duration>(elapsed_));
}

double ManualClock::UnixSeconds() {
  std::lock_guard lock(mu_);
  return unix_start_ + std::chrono::duration<double>(elapsed_).count();
}

void ManualClock::Advance(std::chrono::nanoseconds d) {
  std::lock_guard lock(mu_);
  elapsed_ += d;
}

}  // namespace dcr
