// Helpers shared by the publisher, the receivers (src/receiver) and GC.
// Not public API.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dcr/json.h"
#include "dcr/layout_apply.h"
#include "dcr/mapped_file.h"
#include "dcr/publisher.h"
#include "dcr/run_records.h"
#include "dcr/signing.h"
#include "dcr/store.h"

namespace dcr::protocol_internal {

double UnixNow();  // the machine's wall clock (dcr status)

// A record's field `key` holding a digest (32 lowercase hex digits).
Result<Digest> DigestField(const JsonFields& f, const char* key);

// The clock the options inject (RealClock() when none).
inline Clock& ClockOf(const PublishOptions& o) { return o.clock ? *o.clock : RealClock(); }
inline double SecondsSince(Clock& clock, Clock::Instant since) {
  return std::chrono::duration<double>(clock.Now() - since).count();
}
// Ends stage `stage` of a publish, begun at `since`: appends its span to the
// report and returns its seconds.
inline double EndStage(PublishReport* report, const char* stage, Clock& clock, Clock::Instant since) {
  const double seconds = SecondsSince(clock, since), end = clock.UnixSeconds();
  report->spans.push_back({stage, end - seconds, end});
  return seconds;
}
// Ends stage `stage`, begun where the report's last span ended (now, when
// none): the steps between named stages are counted too.
inline void EndStageAfterLast(PublishReport* report, const char* stage, Clock& clock) {
  const double now = clock.UnixSeconds(), start = report->spans.empty() ? now : report->spans.back().end;
  report->spans.push_back({stage, start, std::max(start, now)});  // a wall clock may step back
}

// Store failures worth waiting out (the driver's own retries ran out).
bool Transient(const Status& s);

// The object, or nullopt when it does not exist.
Result<std::optional<std::string>> GetIfPresent(Store& store, std::string_view key);

// The run's tensor table: its tensors and chunking as a manifest without
// frames or objects (what chunk plans and digest tables are made over).
DeltaManifest TensorTableOf(const RunRecord& run);

// kFailedPrecondition unless `ckpt` holds exactly the run's tensors.
Status CheckRunTensors(const Checkpoint& ckpt, const RunRecord& run);

Digest Total(const ChunkDigestTable& table);

// Reads the committed record of version v (kNotFound when absent).
Result<CommitRecord> ReadCommit(Store& store, uint64_t v);

// The attempt ids of version v (sorted, oldest first) and, for each, whether
// it has a manifest and whether it is fenced.
struct AttemptInfo {
  std::string id;
  bool has_manifest = false, fenced = false;
  std::vector<std::string> acks;  // receivers
  std::vector<std::string> frame_objects;  // full keys of its frame objects written so far
  // What a receiver downloads of it: attempt.json, the frame objects
  // (signature trailers included), the processes' signing keys and the
  // manifest; `manifest_bytes` of those.
  uint64_t manifest_bytes = 0, download_bytes = 0;
};
Result<std::vector<AttemptInfo>> ListAttempts(Store& store, uint64_t v);

// A frame object a receiver applied as it arrived and then dropped, all
// but its frames' headers (by offset in the object).
struct ReleasedObject {
  uint64_t bytes = 0;  // the object's size
  std::map<uint64_t, std::array<uint8_t, kMaxFrameHeaderBytes>> headers;
};

// The manifest of attempt `attempt` of version v, checked against `table`
// (the run's tensor table, TensorTableOf).
Result<DeltaManifest> ReadAttemptManifest(Store& store, uint64_t v, const std::string& attempt,
                                          const DeltaManifest& table);

// What a receiver holds of an attempt's frame objects before LoadAttempt:
// `prefetched` (full key -> bytes, downloaded while the attempt streamed)
// are moved from it instead of downloaded again; objects in `released`
// whose headers cover every frame the manifest places in them are read
// from those headers (their frames come without payloads). Objects `skip`
// says (by manifest object; empty: none) are not fetched (DeltaReader's
// skipped objects). `object_bytes` is increased by the bytes of the whole
// objects the delta holds.
struct HeldObjects {
  std::map<std::string, std::string>* prefetched = nullptr;
  const std::map<std::string, ReleasedObject>* released = nullptr;
  std::vector<bool> skip;
  uint64_t* object_bytes = nullptr;
};

// The attempt's delta, frames downloaded (kept in memory), from its
// manifest `m` and what the receiver holds.
Result<DeltaReader> LoadAttempt(Store& store, uint64_t v, const std::string& attempt, DeltaManifest m,
                                const HeldObjects& held);
// The same, manifest read (ReadAttemptManifest) and every object downloaded.
Result<DeltaReader> LoadAttempt(Store& store, uint64_t v, const std::string& attempt, const DeltaManifest& table);

// Streaming: frames applied as their objects arrive, before the attempt's
// manifest (src/receiver/streaming.cc; docs/protocol.md). What attempt.json says: the
// class every frame's mode must be of, and who signs its frame objects
// (dcr/signing.h): object_key for all of them, or else, for an attempt of
// `processes` trainer processes, each process its own (procs/p<P>.pub);
// neither: an older publisher that signs nothing. nullopt when it does not parse or names another version: the
// attempt's frames are then applied once its manifest exists.
using StreamedAttempt = std::optional<AttemptRecord>;
// The public key that signs frame object `key` of attempt `st` (prefix
// `attempt_prefix`): empty when the attempt signs nothing, nullopt while the
// store does not show it yet.
Result<std::optional<std::string>> ObjectSignerOf(Store& store, const std::string& attempt_prefix,
                                                  const StreamedAttempt& st, const std::string& key);
// Attempt `id` of version v's attempt.json; nullopt while it is not visible.
Result<std::optional<StreamedAttempt>> ReadStreamedAttempt(Store& store, uint64_t v, const std::string& id,
                                                           const std::function<void(const std::string&)>& log);

// Whether the options' schedule (snapshot_every) gives committed version v
// a snapshot (version 0 always has one: the run's start).
inline bool SnapshotDue(const PublishOptions& o, uint64_t v) {
  return o.snapshot_every > 0 && v > 0 && v % o.snapshot_every == 0;
}

// Snapshots: the regular files of a checkpoint (a file, or the top-level
// files of its directory) as objects under snapshots/v<N>/files/, then
// snapshot.json. Download writes them into `dir` (created) and opens it.
Status UploadSnapshot(Store& store, uint64_t v, const Checkpoint& ckpt, const Digest& digest, Progress* progress);
// One file at `path` as snapshots/v<N>/files/<name> (no record).
Result<SnapshotRecord::File> UploadSnapshotFile(Store& store, uint64_t v, const std::string& path,
                                                const std::string& name, Progress* progress);
// snapshot.json of version v; kInvalidArgument when it names no file.
Result<SnapshotRecord> ReadSnapshot(Store& store, uint64_t v);
// The versions with a complete snapshot (snapshot.json written), ascending.
Result<std::vector<uint64_t>> ListSnapshots(Store& store);
// The newest snapshot at or below `at_most` (kNotFound if none).
Result<SnapshotRecord> NewestSnapshot(Store& store, uint64_t at_most);
Status DownloadSnapshot(Store& store, const SnapshotRecord& snapshot, const std::string& dir, Progress* progress);

// A full disk: FAILED_PRECONDITION (not transient: waiting does not free
// space) naming `dir`, what needs `need` bytes there, and what to do.
// CheckFreeSpace returns it up front when `dir`'s filesystem has less than
// `need` bytes available; NoSpace is for ENOSPC/EDQUOT met while writing.
Status CheckFreeSpace(const std::string& dir, uint64_t need, std::string_view what);
Status NoSpace(const std::string& dir, uint64_t need, std::string_view what,
               std::optional<uint64_t> available = std::nullopt);
bool IsNoSpace(int err);

// Whether `dir` is on a filesystem in memory (tmpfs, ramfs).
bool OnMemoryFilesystem(const std::string& dir);

// A publisher's hold on its state directory (an exclusive flock of
// `state_dir`/lock, released when destroyed); kFailedPrecondition when
// another process or publisher holds it.
class StateDirLock {
 public:
  static Result<StateDirLock> Acquire(const std::string& state_dir);
  StateDirLock(StateDirLock&& o) noexcept;
  StateDirLock& operator=(StateDirLock&&) = delete;
  ~StateDirLock();

 private:
  StateDirLock() = default;
  int fd_ = -1;
};

// ---- The publisher's state directory (publisher_state.cc) -------------------

// state_dir/publisher.json: which run and version the baseline holds.
struct BaselineState {
  std::string run_id;
  uint64_t version = 0;
};
std::string BaselineDir(const std::string& state_dir);  // the baseline checkpoint
// nullopt when there is none; kInvalidArgument when it does not parse.
Result<std::optional<BaselineState>> ReadBaseline(const std::string& state_dir);
Status WriteBaseline(const std::string& state_dir, const BaselineState& s);

// state_dir/shards.json (a ShardPublisher's): which run and version its
// local senders' shard files hold, and their partial digest there.
struct ShardsState {
  std::string run_id;
  uint64_t version = 0;
  std::vector<uint32_t> senders;  // the global indices of the local senders
  Digest digest;
  bool operator==(const ShardsState&) const = default;
};
std::string ShardsRecordPath(const std::string& state_dir);
// nullopt when there is none; kInvalidArgument when it does not parse.
Result<std::optional<ShardsState>> ReadShardsState(const std::string& state_dir);
Status WriteShardsState(const std::string& state_dir, const ShardsState& s);

// state_dir/baseline-digests.json: the baseline's chunk digests at a
// version, trusted only while the baseline's files keep their sizes and
// modification times and the machine has not rebooted (best effort: a cache
// that cannot be written or read costs the next publish a digest pass).
void WriteDigestCache(const std::string& state_dir, uint64_t version, const Checkpoint& baseline,
                      const ChunkDigestTable& digests);
std::optional<ChunkDigestTable> ReadDigestCache(const std::string& state_dir, uint64_t version,
                                                const Checkpoint& baseline, const DeltaManifest& layout);
void DropDigestCache(const std::string& state_dir);

// ---- Snapshots from trainer processes (shard_snapshot.cc) -------------------

// What one trainer process knows of the run and its senders.
struct ShardSnapshotContext {
  Store* store = nullptr;
  const PublishOptions* options = nullptr;
  const RunRecord* run = nullptr;
  std::span<const CompiledLayout* const> maps;  // every sender's
  std::span<const uint32_t> sender_process;  // per sender: its process
  std::span<const std::vector<uint32_t>> senders_of;  // per process: its senders
  uint32_t process = 0, processes = 1;
  std::span<const uint32_t> local_ids;  // global index of each local sender
  std::vector<PlacedRank> local;  // the local senders' shards, holding the version
  std::string scratch_dir;  // where this process assembles its file (its state directory)
};
// Committed version v's snapshot, taken by every trainer process once its
// shards hold v (docs/protocol.md, "Snapshots from trainer shards").
// Returns once this process's file and record are in the store (process 0:
// once snapshot.json is), at once when the snapshot exists. kUnavailable
// when a peer is silent past the peer timeout; kDataLoss when the files do
// not add up to v's digest (no snapshot is recorded).
Status TakeShardSnapshot(const ShardSnapshotContext& context, uint64_t v);

}  // namespace dcr::protocol_internal
