// Receivers (docs/protocol.md, "Receivers"): a Follower keeps a checkpoint
// directory at the newest committed version; a RankFollower keeps one rank
// of an engine's buffers there. Both are one walk of the protocol
// (src/receiver) over their targets, from the store and, optionally, a relay.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/clock.h"
#include "dcr/frame_transport.h"
#include "dcr/layout_apply.h"

namespace dcr {

class Store;
namespace receiver_internal {
class ReceiverTarget;
class ReceiverWalk;
}  // namespace receiver_internal

// ---- Follower (receiver) -----------------------------------------------------

struct FollowOptions {
  std::string id;  // default host-pid
  std::chrono::milliseconds poll{100};
  // While an attempt is streaming (started, no manifest yet): how often to
  // look for its next frame objects.
  std::chrono::milliseconds stream_poll{20};
  // Frame objects downloaded from the store at once, in the background: at
  // most this many of an attempt are in flight or held before they are
  // applied (the relay's deliveries aside).
  size_t fetch_ahead = 8;
  std::chrono::milliseconds heartbeat_every{1000};
  // Frame objects from a relay (not owned, must outlive Run). While it is
  // attached the follower downloads no frame objects from the store during
  // streaming; once the manifest exists it waits for the missing ones while
  // the relay keeps delivering (at most `relay_quiet` without a new object),
  // then downloads from the store only what it still lacks.
  FrameObjectSource* relay = nullptr;
  std::chrono::milliseconds relay_quiet{3000};  // above the relay clients' dead_after (1.5 s)
  // A relay tree that carries the coordinator's notices (FrameObjectSource::
  // Notices) tells the follower when an attempt opens, when its manifest is
  // written and when a version is committed. While it is attached, the
  // store is looked at on each notice or fence, else only every
  // `relay_poll` (a lost notice costs at most that), and what the tree
  // delivers in between is applied; `poll` and `stream_poll` without notices.
  std::chrono::milliseconds relay_poll{1000};
  // A Run that continues a follower's earlier Run (the bits in memory since)
  // first reads the bits again and compares every chunk's digest with the
  // one tracked through dcr's own writes: O(the rank's bytes) per Run. Bits
  // changed outside dcr are named in the log and counted, and the follower
  // rejoins from the newest snapshot instead of applying, acking or
  // reporting a version on top of them. Off: O(changed elements) per
  // version, trusting that only dcr writes the buffers between Runs.
  bool recheck = false;
  // Fault injection for tests, as PublishOptions::fault ("applying", "applied", "acked").
  std::function<Status(std::string_view point)> fault;
  std::function<void(const std::string& line)> log;  // progress lines; default stderr
  // Deadlines, heartbeat times and polling waits (tests: a ManualClock);
  // null: RealClock(). The heartbeat thread keeps real time for its pace.
  Clock* clock = nullptr;
};

// The receiver id a Follower takes when none is given: "<host>-<pid>".
std::string DefaultReceiverId();

// A receiver holding a checkpoint directory `target` that it updates in
// place. An empty or missing directory joins from the newest snapshot.
class Follower {
 public:
  Follower(Store& store, std::string target, FollowOptions options);
  Follower(Follower&&) noexcept;  // only before Run
  ~Follower();

  // Follows until version `until` is committed and applied (forever when
  // nullopt, or until `stop` returns true). Survives restarts: its journal
  // (TARGET/.dcr-follow.json) says what it holds. A Run after one that
  // returned OK continues where it stopped, without reading the target
  // again; after an error, Run reopens it.
  Status Run(std::optional<uint64_t> until, const std::function<bool()>& stop = {});

  uint64_t version() const;

 private:
  Store& store_;
  std::string target_;
  FollowOptions options_;
  std::unique_ptr<receiver_internal::ReceiverTarget> checkpoint_;
  std::unique_ptr<receiver_internal::ReceiverWalk> walk_;
};

// ---- A rank of an engine (docs/protocol.md, "Engines of several ranks") -------

// Follows the run into one rank's buffers: `layout` is the rank's receiver
// map, `buffers_dir` holds its buffer files (RankBufferFiles) and its
// journal (.dcr-rank.json). Each rank of an engine runs its own follower
// (its own process); each applies every frame to the elements it holds
// (ApplyRankFrame) and acks its partial digest, and the coordinator counts
// the engine as acknowledged once all `rank.ranks` ranks have acked and
// their partials add up to the target. A directory without a journal joins
// from the newest snapshot (downloaded beside the buffers, loaded through
// the map, removed). `layout` must outlive the follower. With options.relay,
// frame objects come from the relay as for a Follower; acks (partial
// digests) go to the store only.
class RankFollower {
 public:
  RankFollower(Store& store, const CompiledLayout& layout, std::string buffers_dir, EngineRank rank,
               FollowOptions options);
  // The same over buffers the caller holds in memory (a serving process's
  // live weights): `buffers` (its layout and buffer spans or BufferMemory,
  // not owned, outliving Run) is applied in place; `state_dir` holds only the journal
  // (and a joining snapshot, briefly). A restarted process whose buffers do
  // not hold the journal's version (their partial digest differs) rejoins
  // from the newest snapshot, loaded into the buffers through the map.
  RankFollower(Store& store, const PlacedRank& buffers, std::string state_dir, EngineRank rank, FollowOptions options);

  // As Follower::Run. Errors: kInvalidArgument (the map does not fit the
  // run, or rank.ranks == 0), kFailedPrecondition (the directory belongs to
  // another run, engine or rank), store errors that are not transient.
  Status Run(std::optional<uint64_t> until, const std::function<bool()>& stop = {});

  // Before Run: the rank's buffers were loaded elsewhere (a serving engine
  // loading a checkpoint from disk) and its engine's ranks found that their
  // partial digests (RankDigest) add up to `engine_digest`. Records in the
  // journal that the buffers hold committed `version`, so that Run continues
  // from it (the deltas after it) instead of downloading a snapshot.
  // Refused (kFailedPrecondition, nothing written) unless `version` is
  // committed with target digest `engine_digest` and, for an engine of one
  // rank, that is this rank's digest; kNotFound when the run or the version
  // is not in the store. Replaces the journal the state directory holds.
  Status Adopt(uint64_t version, const Digest& engine_digest);

  RankFollower(RankFollower&&) noexcept;  // only before Run
  ~RankFollower();
  uint64_t version() const;
  // Whether the buffers hold version() (Run has joined or reopened them).
  bool holds_version() const;
  // The map's tensors whose elements Run may have written since the last
  // call (a frame applied to them; every tensor when Run joined from a
  // snapshot or reopened the buffers), in map order; then forgets them. For
  // Run's `stop` callback (Run's thread) or while Run is not running.
  std::vector<std::string> TakeChangedTensors();
  // What the last Run's recheck (FollowOptions::recheck) found changed
  // outside dcr, e.g. "tensor 'w' chunk 0 (elements 0..1023)"; empty if nothing.
  std::string OutsideChanges() const;

 private:
  Store& store_;
  const CompiledLayout& layout_;
  std::string dir_;
  EngineRank rank_;
  FollowOptions options_;
  bool in_memory_ = false;
  PlacedRank given_;  // in memory: the caller's buffers (host, or a BufferMemory)
  std::vector<bool> changed_;  // by map tensor index, since TakeChangedTensors
  std::unique_ptr<receiver_internal::ReceiverTarget> target_;
  std::unique_ptr<receiver_internal::ReceiverWalk> walk_;
};

}  // namespace dcr
