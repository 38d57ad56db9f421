// What a receiving process counts for its metrics endpoint (docs/metrics.md,
// "Receivers"), by receiver id. Not public API.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/frame_transport.h"

namespace dcr::receiver_internal {

// The seconds a receiver spends on its way to the next version, by stage,
// observed once per version when it is committed (ReceiverMetrics::Commit).
enum class Stage { kDownload, kApply, kAck, kJoin };

class ReceiverMetrics {
 public:
  explicit ReceiverMetrics(std::string id) : id_(std::move(id)) {}
  // A stage that ends now and took `seconds`: counted, and kept as a span
  // (wall clock) for the next ack's timeline.
  void AddSeconds(Stage stage, double seconds);
  // What an ack carries: the spans since the last commit (merged where one
  // follows another of the same stage within 1 ms, at most kMaxSpans: then
  // the last grows), and the instant "ack" now.
  std::vector<StageSpan> AckSpans() const;
  static constexpr size_t kMaxSpans = 32;  // an ack stays small: the coordinator reads every one
  // Frame object bytes taken from a link ("store", "relay").
  void Received(std::string_view link, uint64_t bytes);
  void Acked(bool ok);
  // Version v is held and verified (`joined`: from a snapshot): the
  // stages' seconds since the last commit are observed and reset.
  void Commit(uint64_t v, bool joined);
  // Seconds since the oldest committed version it does not hold was
  // committed (0: it holds the newest).
  void Behind(double seconds);
  // A recheck found bits changed outside dcr.
  void ChangedOutside();

 private:
  const std::string id_;
  std::array<double, 4> seconds_{};
  std::vector<StageSpan> spans_;
};

// Adds the seconds from its construction to its destruction to a stage.
class StageTimer {
 public:
  StageTimer(ReceiverMetrics& m, Stage stage) : m_(m), stage_(stage), start_(std::chrono::steady_clock::now()) {}
  ~StageTimer() {
    m_.AddSeconds(stage_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  ReceiverMetrics& m_;
  const Stage stage_;
  const std::chrono::steady_clock::time_point start_;
};

}  // namespace dcr::receiver_internal
