// The receiver: one walk of the protocol (docs/protocol.md, "Receivers")
// for every kind of receiver. The walk decides what to apply and when, acks
// and commits; a ReceiverTarget holds the bits (a checkpoint directory, or
// one rank's buffers) and its journal. Follower and RankFollower are this
// walk over their targets. Not public API.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>

#include "dcr/receiver.h"
#include "dcr/run_keys.h"
#include "dcr/run_records.h"
#include "fetcher.h"
#include "held_chunks.h"
#include "protocol/internal.h"
#include "receiver_metrics.h"

namespace dcr::receiver_internal {

using namespace protocol_internal;  // the protocol's store reads, attempts, snapshots

// The clock the options inject (RealClock() when none).
inline Clock& ClockOf(const FollowOptions& o) { return o.clock ? *o.clock : RealClock(); }

// The frame objects of `a` in `prefetched` not yet in `*seen`, now added to
// it: those listed, and (given `relayed`) those under a's prefix that the
// relay delivered. None once the attempt is fenced, re-read when
// `check_fence` (the listing may be older).
Result<std::vector<std::string>> StreamedObjectsToApply(Store& store, uint64_t v, const AttemptInfo& a,
                                                        const std::map<std::string, std::string>& prefetched,
                                                        const std::set<std::string>* relayed, bool check_fence,
                                                        std::set<std::string>* seen);
// Calls fn on each frame of frame object `key` in order, each checked: it
// parses (its checksum), has a mode of `attempt`'s class, and names a chunk
// of the run (`layout`) with its tensor's dtype.
// Stops at the first that does not, logging why: the manifest decides.
// Returns whether fn saw every frame of the object.
bool ForEachStreamedFrame(const std::string& key, const std::string& blob, const DeltaManifest& layout,
                          const AttemptRecord& attempt, const std::function<void(const FrameView&, size_t offset)>& fn,
                          const std::function<void(const std::string&)>& log);

// A receiver's record receivers/<id>.json: written now by Set, and every
// `every` by a thread between Start and Stop (the destructor stops it).
class Heartbeat {
 public:
  // Records carry `clock`'s time; the thread writes one every `every` of real time.
  Heartbeat(Store& store, std::string id, EngineRank engine, std::chrono::milliseconds every, Clock& clock,
            std::function<void(const std::string&)> log);
  ~Heartbeat() { Stop(); }
  // Records the state now, unless the last record written says the same
  // (state, version, frames held): the thread keeps its time fresh.
  Status Set(const std::string& state);
  void SetVersion(uint64_t v);  // the next record's version
  void SetFramesHeld(uint64_t bytes);  // the next record's frames_held_bytes
  void SetMasterBytes(uint64_t bytes);  // every record's master_bytes
  void SetVerified(const Digest& digest, double at);  // the next record's verified_digest, verified_at
  void Start();
  void Stop();

 private:
  ReceiverRecord Record();
  // Writes `r`; on success remembers what it said, for Set.
  Status Write(const ReceiverRecord& r);
  Store& store_;
  const std::string id_;
  const EngineRank engine_;
  const std::chrono::milliseconds every_;
  Clock& clock_;
  const std::function<void(const std::string&)> log_;
  std::mutex mu_;
  std::string state_ = "joining";
  uint64_t version_ = 0, frames_held_ = 0, master_bytes_ = 0;
  Digest verified_digest_;
  double verified_at_ = 0;
  std::string written_;  // what the last record written says, its time aside
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A follower's progress line: to o.log, or stderr with its id.
void FollowLog(const FollowOptions& o, const std::string& line);

// A follower's outer loop: `start` (store failures that outlast the driver's
// retries are waited out), then heartbeats and `step` until `done` or
// `stop`; records "stopped" at the end (best effort).
Status FollowLoop(Heartbeat& heartbeat, const FollowOptions& o, const std::function<Status()>& start,
                  const std::function<Status()>& step, const std::function<bool()>& done,
                  const std::function<bool()>& stop, const std::function<void(const std::string&)>& log);

// ---- The walk ----------------------------------------------------------------

// Frames applied, found already at their target, left to the manifest.
struct ApplyCounts {
  uint64_t applied = 0, already = 0, left = 0;
};

// What a receiver applies versions to. It owns its bits and its journal;
// the walk calls it from one thread.
class ReceiverTarget {
 public:
  virtual ~ReceiverTarget() = default;

  // At start: opens what the target holds for `run` (whose newest committed
  // version is `latest`). Returns the committed version it holds (its bits
  // may be part way to the next: the journal names the attempt), or nullopt
  // and in `*join_why` why it must join from a snapshot. Errors refuse to
  // follow (the directory belongs to another run or rank).
  virtual Result<std::optional<uint64_t>> Resume(Store& store, const RunRecord& run, uint64_t latest,
                                                 std::string* join_why) = 0;
  // Replaces the bits with `snapshot`, checked against its digest; journaled
  // first, so that a kill part way through joins again.
  virtual Status Join(Store& store, const RunRecord& run, const SnapshotRecord& snapshot) = 0;
  // Whether the bits are open (not after a failed join: the walk joins again).
  virtual bool Open() const = 0;
  // The bits are committed version v, which the journal now says.
  virtual Status Commit(uint64_t v) = 0;
  // Whether the bits are already commit `c`'s.
  virtual bool AtCommit(const CommitRecord& c) const = 0;
  // What an ack carries: the whole digest, or a rank's partial and its engine.
  virtual Digest AckDigest() const = 0;
  virtual EngineRank Engine() const = 0;
  virtual uint64_t MasterBytes() const { return 0; }  // the record's master_bytes
  // Whether frames of attempt `id` (class `cls`) may be applied before its
  // manifest: an xor frame needs bits it can prove are its base.
  virtual bool MayStream(const std::string& id, DeltaClass cls) const = 0;
  // Journals attempt `id` as the one about to touch the bits.
  virtual Status Begin(const std::string& id) = 0;
  // Applies attempt `id`'s delta (journaled first). Errors: why the bits are
  // not its target (the attempt is nacked with it), or journal I/O.
  virtual Status ApplyAttempt(const std::string& id, const DeltaReader& delta, ApplyCounts* counts) = 0;
  // The chunks the target holds elements of when not every chunk of the run
  // (a rank of a sharded engine), else null: the walk downloads only frame
  // objects that may hold frames of these, and ApplyAttempt is given the
  // others as skipped (DeltaReader::Skipped).
  virtual const HeldChunks* Held() const { return nullptr; }
  // Applies frames of the journaled attempt that arrived before its manifest
  // (each already checked by ForEachStreamedFrame against `shape`: the run's
  // tensors with the attempt's class). Frames it cannot prove
  // safe are logged and left to the manifest; errors are journal I/O only.
  virtual Status ApplyStreamed(const DeltaManifest& shape, std::span<const FrameView> frames, ApplyCounts* counts) = 0;
  // Between versions (the journal names no attempt): reads the bits again
  // and compares each chunk's digest with the tracked one. Returns the
  // chunks that differ (changed outside dcr), described for a log line;
  // empty when every chunk is as tracked, or the target cannot tell.
  virtual Result<std::string> Recheck() { return std::string(); }
};

// What one step of the walk does, decided by a pure function of what the
// walk holds and what the store shows for version held + 1 (PlanStep;
// tested as a table in receiver_test.cc). The walk gathers the inputs and
// carries the plan out; I/O and waiting stay outside.
struct StepInputs {
  bool target_open = false;  // the target holds a version (a join finished)
  bool committed = false;  // commits/v<held + 1> exists
  bool target_at_commit = false;  // ... and the target applied its attempt already
  struct Attempt {
    bool fenced = false, handled = false, acked_by_me = false, has_manifest = false;
  };
  std::vector<Attempt> attempts;  // of version held + 1, oldest first
  bool relay_attached = false;
};
struct StepPlan {
  enum class Kind {
    kJoin,  // the target holds nothing whole: (re)join from the newest snapshot
    kCommit,  // record the committed version the target already holds
    kCatchUp,  // apply the committed attempt's delta (or rejoin if impossible)
    kAttempts,  // no commit yet: act on each attempt as `attempts` says
  };
  enum class Attempt {
    kDrop,  // fenced, or this receiver is done with it: forget what it holds of it
    kApplyAndAck,  // its manifest is in: apply all of it, verify, ack
    kStream,  // streaming: take the relay's deliveries (and download when no relay is attached)
  };
  struct ForAttempt {
    Attempt what = Attempt::kDrop;
    bool download = false;  // kStream: download objects written so far (no relay attached)
    bool apply_ahead = false;  // kStream: apply its frames before the manifest (the newest attempt only)
  };
  Kind kind = Kind::kAttempts;
  std::vector<ForAttempt> attempts;  // one per input attempt, with kAttempts
  bool streaming = false;  // some attempt streams: poll at the streaming period
};
StepPlan PlanStep(const StepInputs& in);

// The walk: waits for the run, resumes or joins the target, then step by
// step applies version + 1's commit or its open attempts (streamed frames as
// they arrive, from the store or a relay), acks each attempt in the store
// (and up the relay tree for a whole receiver), and commits. It keeps its
// state between Run calls: a Run after a Run that returned OK continues
// without reopening the target.
class ReceiverWalk {
 public:
  ReceiverWalk(Store& store, ReceiverTarget& target, FollowOptions options);

  // As Follower::Run; `version` is set as versions are committed.
  Status Run(std::optional<uint64_t> until, const std::function<bool()>& stop);
  uint64_t version() const { return version_; }
  // What the last Run's recheck (FollowOptions::recheck) found changed
  // outside dcr; empty when it found nothing.
  const std::string& outside_changes() const { return outside_changes_; }

 private:
  void Log(const std::string& line) { FollowLog(o_, line); }
  Status Fault(std::string_view point) { return o_.fault ? o_.fault(point) : Status::Ok(); }
  Status SetState(const std::string& state) { return heartbeat_.Set(state); }

  Status Start(const std::function<bool()>& stop);
  Status Recheck(const std::function<bool()>& stop);
  Status Join(uint64_t at_most, const std::string& why);
  Status Commit(uint64_t v, bool joined = false);
  Status Step();
  // In a relay tree that carries notices (docs/relay.md, "Notices"), the
  // store is looked at only when the tree sends a notice or fence, every
  // o_.relay_poll, or to retry an apply; in between, StepInTree takes what
  // the tree delivers for the attempts the last look found (tree_view_).
  bool InTree(uint64_t v) const;
  bool LookDue() const;
  std::chrono::steady_clock::time_point NoticedLookAt() const;  // the earliest look a notice makes due
  Status StepInTree(uint64_t v);
  // Takes a streaming attempt's objects from the relay (and the store's
  // downloads), and applies them ahead when `f` says so.
  Status StreamStep(uint64_t v, const AttemptInfo& a, const StepPlan::ForAttempt& f, bool* progressed);
  // After a Step that changed nothing: until the next event (in a tree: an
  // arrival; a download's end; else a poll period).
  void Wait(const StepPlan& plan);
  Status CatchUp(uint64_t v, const CommitRecord& c);
  // Applies and acks attempt `a` of version v, whose manifest is in.
  Status ApplyAndAck(uint64_t v, const AttemptInfo& a);
  // Moves the objects of attempt `id` of version v that the relay delivered
  // into prefetched_ once their signatures verify against the keys the
  // store records (relayed_ holds them until those are visible); drops
  // (logged) those that do not verify: the store has the publisher's copy.
  Status TakeFromRelay(uint64_t v, const std::string& id);
  // The key that signs frame object `key` of the attempt at `prefix`
  // (ObjectSignerOf), read once per trainer process and attempt.
  Result<std::optional<std::string>> SignerOf(const std::string& prefix, const StreamedAttempt& attempt,
                                              const std::string& key);
  // What attempt.json of attempt `id` of version v says (cached); nullptr
  // while it is not visible.
  Result<const StreamedAttempt*> AttemptDoc(uint64_t v, const std::string& id);
  // Waits for the relay to deliver `objects`; `arrived` runs after each take.
  Status AwaitRelay(uint64_t v, const std::string& id, const std::vector<std::string>& objects,
                    const std::function<Status()>& arrived);
  // The objects (and bytes) of `keys` in prefetched_ or released_ that the relay delivered.
  std::pair<size_t, uint64_t> Relayed(const std::vector<std::string>& keys) const;
  // Counts the frame bytes held now (prefetched_, relayed_, and `loaded`:
  // those a loaded delta holds) towards this version's peak.
  void NoteFramesHeld(uint64_t loaded = 0);
  // Applies the frames of attempt `a` of version v that are in prefetched_
  // and not yet looked at, ahead of the manifest's apply (while the attempt
  // streams, or while the relay still delivers). An object whose frames
  // are all applied (or found done) moves to released_: its payloads are
  // dropped.
  Status StreamApply(uint64_t v, const AttemptInfo& a);
  // Moves the fetcher's finished downloads into prefetched_ (setting
  // *progressed). Only transient store failures are errors; an object that
  // cannot be read is not asked for again before the next Step (LoadAttempt
  // reports it, once the manifest says it is needed).
  Status TakeFetched(bool* progressed);
  // TakeFetched, then queues a's objects that are neither held, released
  // nor pending, in order, while fewer than o_.fetch_ahead of a's are held
  // or pending.
  Status Prefetch(const AttemptInfo& a, bool* progressed);
  // Once a's manifest is in: its remaining objects a few at a time, each
  // applied and released before the next, so that the manifest's apply
  // reads headers only and the frames held stay O(objects in flight).
  // Where the target cannot apply ahead, the rest is left to LoadAttempt.
  Status StreamRest(uint64_t v, const AttemptInfo& a);
  // Reads the manifest of attempt `a` of version v (an error: why it cannot
  // be applied) and narrows `*needed` (a's copy) to the frame objects the
  // target needs: every one, or (Held) those with a frame of its chunks;
  // `*skip` flags the others by manifest object.
  Result<DeltaManifest> ManifestFor(uint64_t v, const AttemptInfo& a, AttemptInfo* needed, std::vector<bool>* skip);
  // While a streams: its frame objects the target may need, by their names
  // (Held; those whose range is still open wait for the next listing).
  AttemptInfo ToStream(uint64_t v, const AttemptInfo& a) const;
  // Drops what the walk holds or downloads of the attempt at `prefix`.
  void Forget(const std::string& prefix);
  // Drops what the walk holds or downloads of every attempt (the relay's
  // undelivered copies aside).
  void ForgetAttempts();
  bool Holds(const std::string& key) const { return prefetched_.count(key) || released_.count(key); }

  Store& store_;
  ReceiverTarget& target_;
  const FollowOptions o_;
  bool started_ = false;
  std::string outside_changes_;  // the last recheck's finding
  uint64_t version_ = 0;
  RunRecord run_;
  DeltaManifest shape_;  // the run's tensors and chunking
  std::set<std::string> handled_;  // attempts acked (or nacked) by this receiver
  std::map<uint64_t, int> commit_failures_;  // committed versions that failed to apply
  // Frame objects of version_ + 1's attempts downloaded before their
  // manifest (full key -> bytes); LoadAttempt takes them from here.
  std::map<std::string, std::string> prefetched_;
  // Objects of prefetched_ whose frames were applied, payloads dropped.
  std::map<std::string, ReleasedObject> released_;
  FrameFetcher fetcher_;  // downloads of frame objects, o_.fetch_ahead at once
  std::set<std::string> unreadable_;  // objects listed but not readable, in this Step
  std::set<std::string> from_relay_;  // keys in prefetched_ or released_ that the relay delivered
  std::map<std::string, std::string> relayed_;  // delivered, waiting for the key that signs them
  std::map<std::string, StreamedAttempt> attempt_docs_;  // by attempt id, of version_ + 1
  std::map<std::string, std::string> signers_;  // attempt prefix + process -> its signing key (SignerOf)
  uint64_t refused_objects_ = 0;  // relayed objects whose signature did not verify
  uint64_t frames_held_peak_ = 0;  // towards version_ + 1: the heartbeat's frames_held_bytes at its commit
  struct Streamed {
    const AttemptRecord* attempt = nullptr;  // in attempt_docs_
    DeltaManifest shape;  // the run's shape with the attempt's class
    std::set<std::string> objects;  // frame objects looked at
    ApplyCounts counts;
  };
  std::map<std::string, Streamed> streamed_;  // per attempt of version_ + 1
  // The last look at the store, kept while the follower is in a relay tree
  // that carries notices (InTree), with the tree's notice count then.
  struct TreeView {
    bool valid = false;
    uint64_t v = 0;
    std::vector<AttemptInfo> attempts;
    StepPlan plan;
    uint64_t notices = 0;
    std::chrono::steady_clock::time_point at{};
  };
  TreeView tree_view_;
  uint64_t news_seen_ = 0;  // the relay's arrivals counted so far (AwaitNews)
  Heartbeat heartbeat_;
  ReceiverMetrics metrics_;
};

}  // namespace dcr::receiver_internal
