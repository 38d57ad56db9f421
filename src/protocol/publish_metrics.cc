#include "publish_metrics.h"

#include <fmt/format.h>

#include "dcr/metrics.h"
#include "dcr/run_keys.h"
#include "dcr/run_records.h"

namespace dcr::protocol_internal {

namespace {

Counter versions_committed("dcr_publish_versions_committed_total",
                           "Publish calls of this process that returned with their version committed.");
Counter publish_failures("dcr_publish_failures_total", "Publish calls of this process that returned an error.");
Counter attempts("dcr_publish_attempts_total", "Attempts this process's publish calls took, committed or not.");
Counter retries("dcr_publish_retries_total", "Attempts after the first of a publish call (each in overwrite class).");
Counter fences("dcr_publish_fences_total", "Attempts this process fenced.");
Counter sent_bytes("dcr_publish_sent_bytes_total",
                   "Frame object bytes this process sent, by link: store (every frame object) and relay (also "
                   "handed to the relay tree's roots).",
                   {"link"});
Counter changed_words("dcr_publish_changed_words_total",
                      "Changed words of the committed versions this process published.");
Counter relay_acks("dcr_publish_relay_acks_total", "Acks of committed attempts that came up the relay tree first.");
Histogram stage_seconds("dcr_publish_stage_seconds",
                        "Seconds of a publish call by stage: baseline (made to hold the previous version), staging "
                        "(device buffers copied to the host), encode (frames made and uploaded), ack_wait, commit, "
                        "advance (the baseline moved to the version), total (the call).",
                        {"stage"});
Gauge version("dcr_publish_version", "The newest version this process published and saw committed.");
Gauge receivers("dcr_publish_receivers",
                "Receivers of the last committed version this process published: acked, and retired (silent past "
                "the ack timeout).",
                {"state"});

}  // namespace

namespace {

void WriteTimeline(Store& store, const std::string& process, const std::string& role, const PublishReport& r) {
  if (r.attempts == 0 || r.already_committed || r.attempt.empty()) return;  // not this call's commit
  TimelineRecord t{process, role, r.version, r.total_seconds, r.spans};
  const std::string key = run_keys::Timeline(r.version, r.attempt, process);
  Status s = ValidateKey(key);
  if (s.ok()) s = store.Put(key, t.ToJson());
  if (!s.ok())
    fmt::print(stderr, "dcr publish: the timeline record of version {} was not written: {}\n", r.version, s.ToString());
}

}  // namespace

void RecordPublish(Store& store, const std::string& process, const std::string& role,
                   const Result<PublishReport>& report) {
  if (!report.ok()) {
    publish_failures.Add(1);
    return;
  }
  const PublishReport& r = *report;
  WriteTimeline(store, process, role, r);
  versions_committed.Add(1);
  attempts.Add(r.attempts);
  retries.Add(r.attempts > 1 ? r.attempts - 1 : 0);
  if (r.attempts > 0) changed_words.Add(static_cast<double>(r.changed_words));
  relay_acks.Add(static_cast<double>(r.relay_acks));
  const std::pair<const char*, double> stages[] = {{"baseline", r.baseline_seconds}, {"staging", r.staging_seconds},
                                                   {"encode", r.encode_seconds},     {"ack_wait", r.wait_seconds},
                                                   {"commit", r.commit_seconds},     {"advance", r.advance_seconds},
                                                   {"total", r.total_seconds}};
  for (const auto& [stage, seconds] : stages) stage_seconds.Observe(seconds, {stage});
  version.Set(static_cast<double>(r.version));
  receivers.Set(static_cast<double>(r.acked.size()), {"acked"});
  receivers.Set(static_cast<double>(r.retired.size()), {"retired"});
}

void CountSentBytes(std::string_view link, uint64_t bytes) { sent_bytes.Add(static_cast<double>(bytes), {link}); }

void CountFence() { fences.Add(1); }

}  // namespace dcr::protocol_internal
