#include "receiver_metrics.h"

#include <algorithm>
#include <chrono>

#include "dcr/metrics.h"

namespace dcr::receiver_internal {

namespace {

Counter versions_applied("dcr_receiver_versions_applied_total",
                         "Versions a receiver applied and verified (joins from a snapshot included).", {"receiver"});
Counter joins("dcr_receiver_joins_total", "Joins from a snapshot (a new, restarted or damaged receiver).",
              {"receiver"});
Counter changed_outside("dcr_receiver_changed_outside_total",
                        "Rechecks between versions that found the bits changed outside dcr (the receiver rejoined "
                        "from a snapshot rather than build on them).",
                        {"receiver"});
Counter acks("dcr_receiver_acks_total", "Acks a receiver wrote, by result: ok, or refused (the attempt did not apply).",
             {"receiver", "result"});
Counter received_bytes("dcr_receiver_received_bytes_total",
                       "Frame object bytes a receiver took, by link: store, relay (verified copies from the relay "
                       "tree).",
                       {"receiver", "link"});
Gauge version("dcr_receiver_version", "The committed version a receiver holds, verified against its digest.",
              {"receiver"});
Gauge behind("dcr_receiver_lag_seconds",
             "Seconds since the oldest committed version a receiver does not hold was committed, when it last "
             "looked; 0 while it holds the newest.",
             {"receiver"});
Histogram stage_seconds("dcr_receiver_stage_seconds",
                        "Seconds a receiver spent on each version by stage: download (waiting for the frame objects "
                        "not yet in once the manifest is), apply (decode, check and write, streamed frames "
                        "included), ack, join (a snapshot).",
                        {"receiver", "stage"});

constexpr const char* kStages[] = {"download", "apply", "ack", "join"};

}  // namespace

namespace {

double UnixNow() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

}  // namespace

std::vector<StageSpan> ReceiverMetrics::AckSpans() const {
  std::vector<StageSpan> out = spans_;
  const double now = UnixNow();
  out.push_back({"ack", now, now});
  return out;
}

void ReceiverMetrics::AddSeconds(Stage stage, double seconds) {
  seconds_[static_cast<size_t>(stage)] += seconds;
  const double end = UnixNow();
  const std::string_view name = kStages[static_cast<size_t>(stage)];
  // Never a span that ends before it starts (the coordinator refuses such
  // an ack), even when the wall clock steps back meanwhile.
  const bool merged = !spans_.empty() && ((spans_.back().stage == name && end - seconds - spans_.back().end < 0.001) ||
                                          spans_.size() >= kMaxSpans);
  if (merged) spans_.back().end = std::max(spans_.back().end, end);
  else spans_.push_back({std::string(name), end - seconds, end});
}

void ReceiverMetrics::Received(std::string_view link, uint64_t bytes) {
  received_bytes.Add(static_cast<double>(bytes), {id_, link});
}

void ReceiverMetrics::Acked(bool ok) { acks.Add(1, {id_, ok ? "ok" : "refused"}); }

void ReceiverMetrics::Commit(uint64_t v, bool joined) {
  versions_applied.Add(1, {id_});
  if (joined) joins.Add(1, {id_});
  version.Set(static_cast<double>(v), {id_});
  for (size_t s = 0; s < seconds_.size(); ++s)
    if (seconds_[s] > 0 || s == static_cast<size_t>(Stage::kApply))
      stage_seconds.Observe(seconds_[s], {id_, kStages[s]});
  seconds_ = {};
  spans_.clear();
}

void ReceiverMetrics::Behind(double seconds) { behind.Set(seconds, {id_}); }

void ReceiverMetrics::ChangedOutside() { changed_outside.Add(1, {id_}); }

}  // namespace dcr::receiver_internal
