// A run as operators see and tidy it: what `dcr status` reads from the store
// (the run's state, a version's timeline), and garbage collection.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dcr/clock.h"
#include "dcr/run_records.h"
#include "dcr/status.h"

namespace dcr {

class Store;

struct AttemptStatus {
  std::string id, state;  // state: committed, fenced, open (manifest written), starting
  std::string mode;  // xor / overwrite (from the manifest), or empty
  uint64_t frame_bytes = 0, frames = 0;
  // What a receiver downloads for this attempt (AttemptDownload; with the
  // commit record when it is the committed one).
  uint64_t manifest_bytes = 0, download_bytes = 0;
  std::vector<std::string> acks, nacks;
  std::string fence_reason;
};
struct VersionStatus {
  uint64_t version = 0;
  bool committed = false;
  std::optional<CommitRecord> commit;
  std::vector<AttemptStatus> attempts;
};
struct ReceiverStatus {
  ReceiverRecord record;
  double age_seconds = 0;  // since the last heartbeat
  bool live = false;
  uint64_t behind = 0;  // committed versions it lacks
  // The newest committed version whose commit retired it (no ack before the
  // deadline), when it does not hold that version yet; a follower that runs
  // again catches up by itself (committed deltas, or the newest snapshot).
  std::optional<uint64_t> retired_at;
};
// A record that is there but cannot be read or parsed.
struct UnreadableRecord {
  std::string key;
  Status error;
};
struct RunStatusReport {
  std::optional<RunRecord> run;
  std::optional<uint64_t> latest;
  std::vector<uint64_t> snapshots;
  std::vector<VersionStatus> versions;  // those with a commit or attempts in the store, ascending
  std::vector<ReceiverStatus> receivers;
  // Receiver records (receivers/*.json) that do not read or parse: shown,
  // not fatal, since the publisher skips them too and the others still count.
  std::vector<UnreadableRecord> unreadable_receivers;
};
// What `dcr status` shows, read from the store (records that do not parse
// are reported as errors, except receiver records: unreadable_receivers).
Result<RunStatusReport> ReadRunStatus(Store& store, std::chrono::milliseconds heartbeat_timeout);

// GC: removes attempts of versions below min(newest snapshot, every live
// receiver's version) - keep_versions, fenced attempts of committed
// versions, and snapshots older than the newest one below that floor.
// A receiver is live when its heartbeat is within heartbeat_timeout of
// `clock`'s time.
Status CollectGarbage(Store& store, uint64_t keep_versions, std::chrono::milliseconds heartbeat_timeout,
                      Clock& clock = RealClock());

// ---- A version's timeline (docs/metrics.md, "Timeline") ------------------

// One process's stages for a version: a publishing process (its timeline
// record) or a receiver (the spans of its ack), for one attempt.
struct TimelineRow {
  std::string role;  // "publisher", "trainer-process" or "receiver"
  std::string process;  // coordinator id, or receiver id
  std::string attempt;
  std::vector<StageSpan> spans;  // wall-clock unix seconds, each process's own clock
};
struct VersionTimeline {
  uint64_t version = 0;
  std::string attempt;  // the committed one
  double commit_time = 0;  // the commit record's
  double start = 0;  // the earliest span's start (or the commit's): where the trace's times count from
  double publish_seconds = 0;  // the committing publisher's publish call (0: no record)
  std::vector<TimelineRow> rows;  // publishing processes first, then receivers by id
};

// Gathers committed version v's timeline from the store: the timeline
// records and acks of each of its attempts. Errors: kFailedPrecondition
// (v is not committed, or is version 0, the snapshot), kDataLoss naming a
// record that does not parse, store errors.
Result<VersionTimeline> ReadVersionTimeline(Store& store, uint64_t v);

// The timeline as a Chrome / Perfetto trace (the Trace Event Format's JSON:
// one process per row, each stage a complete event, the commit an instant;
// times in microseconds from the earliest span; "otherData" holds the
// version, the committed attempt and the publish call's seconds).
std::string TimelineTraceJson(const VersionTimeline& timeline);

}  // namespace dcr
