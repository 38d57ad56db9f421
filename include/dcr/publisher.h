// Publishing checkpoints as versions of a run: the options, the report, and the Publisher (coordinator + senders).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/clock.h"
#include "dcr/delta.h"
#include "dcr/frame_transport.h"
#include "dcr/run_records.h"
#include "dcr/status.h"

namespace dcr {

class Progress;
class Store;

struct PublishOptions {
  uint32_t senders = 1;
  DeltaOptions delta;  // chunking and encoder options (class is per attempt)
  uint32_t max_attempts = 3;  // the first in xor class, retries in overwrite
  std::chrono::milliseconds ack_timeout{60000};  // then silent receivers are retired
  std::chrono::milliseconds heartbeat_timeout{10000};  // receivers older than this are not waited for
  uint64_t snapshot_every = 0;  // also publish a snapshot every N versions (0: only v0)
  uint64_t keep_versions = 2;  // GC: keep attempts of this many versions below the floor
  // Each sender's frames go to objects of about this many bytes (a frame is
  // never split), each visible once written, so that receivers download one
  // while the next is encoded and uploaded. 0: the checkpoint's size / 4096,
  // within [256 KiB, 16 MiB] (a 3% delta then spans some 100 objects).
  uint64_t segment_bytes = 0;
  std::string coordinator_id;  // for records; default host:pid
  // Also hand every frame object and fence to this transport (the relay
  // tree's roots); not owned, must outlive Publish. The store still gets
  // every object (the record, and the receivers' fallback).
  FrameObjectSink* relay = nullptr;
  // When `relay` carries acks (CarriesAcks): take them from it as they
  // arrive, and poll the store (acks of receivers outside the tree, the live
  // receivers, a commit by another coordinator) only every
  // `store_ack_poll`; otherwise the store is polled every 20 ms.
  bool relay_acks = true;
  std::chrono::milliseconds store_ack_poll{250};
  // Fault injection for tests: called at named points ("attempt-opened",
  // after attempt.json; "frames-written", "manifest-written", "acked", "before-commit"; and "committed", after the
  // commit and before the baseline moves); a non-OK status fails the attempt
  // (after "committed": the publish) there as a crash would.
  std::function<Status(std::string_view point)> fault;
  // Polled while an attempt waits for acks (every 20 ms): true stops the
  // publish there. The attempt is fenced (best effort; otherwise the next
  // publish of the version settles it) and Publish returns kAborted, without
  // retrying and with nothing committed. Called on the publishing thread.
  std::function<bool()> cancel;
  // ShardPublisher over several processes (docs/protocol.md, "Trainer ranks
  // in separate processes"): how often a process looks for its peers'
  // objects, and how long it waits for them: the coordinator fences an
  // attempt whose contributions or records are missing after peer_timeout
  // (and retries); a worker gives up (kUnavailable) after peer_timeout
  // without an attempt to join, or twice that plus ack_timeout without a
  // commit once it wrote its record. Fault points there: "contributions-
  // written", "record-written" (every process).
  std::chrono::milliseconds peer_poll{50};
  std::chrono::milliseconds peer_timeout{60000};
  // Deadlines, record times and waits (tests: a ManualClock); null: RealClock().
  Clock* clock = nullptr;
};

struct PublishReport {
  uint64_t version = 0;
  std::string attempt;
  uint32_t attempts = 0;  // tries it took
  uint64_t frame_bytes = 0, payload_bytes = 0, changed_words = 0, total_bytes = 0;
  // What a receiver downloads for this version (AttemptDownload): the
  // committed attempt's records, frame objects and manifest, and the commit
  // record; 0 when the store could not list them after the commit.
  uint64_t manifest_bytes = 0, download_bytes = 0;
  std::vector<std::string> acked, retired;
  uint64_t relay_acks = 0;  // of the committing attempt's acks, those that came up the relay tree first
  // Acks the tree carried that the store did not hold when they arrived
  // (forged, or ahead of the store): not counted; the store's record is.
  uint64_t relay_acks_unconfirmed = 0;
  double encode_seconds = 0, wait_seconds = 0, total_seconds = 0;
  double commit_seconds = 0;  // writing the commit record (its retries included)
  // The call's stages as wall-clock spans (unix seconds), in order (staging
  // overlaps the others): what its timeline record holds.
  std::vector<StageSpan> spans;
  // Making the baseline hold the previous version (open, catch up, or
  // rebuild from the store), and moving it to this version after the commit.
  double baseline_seconds = 0, advance_seconds = 0;
  // Trainer shards with staging: from the publish call until the last
  // buffer was staged (the copies overlap everything after the first).
  double staging_seconds = 0;
  std::string state_dir;  // where the baseline is
  PublisherMemory memory;
  bool already_committed = false;  // the commit record existed with this target
};

// Where a publisher keeps its state by default: $DCR_STATE_DIR, else
// /dev/shm/dcr-<uid>/publish/<store> (memory; the user's directory there is
// created 0700 and refused when it is not private), else, without /dev/shm,
// ~/.cache/dcr/publish/<store>.
Result<std::string> DefaultPublisherStateDir(std::string_view store_url);

// Publishes checkpoints as versions of the run in `store`. The baseline (the
// last committed version, which deltas are made against) is a checkpoint
// directory in `state_dir` (empty: DefaultPublisherStateDir), which one
// publisher at a time owns (a lock file; a second is refused). The state is
// a cache of the store: when it holds no baseline of the run at or below the
// previous version, or a damaged one, the publisher rebuilds it from the
// newest snapshot and the committed deltas.
class Publisher {
 public:
  Publisher(Store& store, std::string state_dir, PublishOptions options);

  // Publishes `next` as `version`. Version 0 creates the run (run.json) and
  // its snapshot; version v > 0 needs v-1 committed and the baseline at v-1.
  // Returns once the version is committed. Errors: kAlreadyExists (another
  // coordinator committed this version with other bits), kFailedPrecondition
  // (wrong version, baseline or tensors; the message says what to do),
  // kAborted (every attempt failed), store errors.
  Result<PublishReport> Publish(uint64_t version, const Checkpoint& next, Progress* progress = nullptr);

 private:
  Store& store_;
  std::string state_dir_;
  PublishOptions options_;
};

}  // namespace dcr
