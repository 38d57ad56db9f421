// The refit protocol (DESIGN section 5; docs/protocol.md): a publisher (a
// coordinator and its senders) moves a run from committed version v to v+1
// through a store, and receivers (dcr/receiver.h) apply every committed
// version in place. The store is the control plane: every decision is an
// object.
//
//   run.json                                  the run: id, format, chunking, tensors
//   snapshots/v<N>/snapshot.json, files/...   a full checkpoint (start, join, rejoin)
//   snapshots/v<N>/parts/...                  trainer processes' parts while they take one
//   attempts/v<N>/<attempt>/attempt.json      class, delta id, signing key, coordinator (created first)
//   attempts/v<N>/<attempt>/frames/s<K>-<NNNN>.bin  sender (or trainer process) K's frames, in segments
//   attempts/v<N>/<attempt>/contrib/p<F>-p<T>.bin  trainer process F's contributions for process T
//   attempts/v<N>/<attempt>/procs/p<P>.json   trainer process P's frames, chunk digests, partials
//   attempts/v<N>/<attempt>/manifest.bin      the delta manifest (written when every sender is done)
//   attempts/v<N>/<attempt>/acks/<R>.json     receiver R applied and verified it (or failed)
//   attempts/v<N>/<attempt>/fence             the attempt is obsolete
//   commits/v<N>.json                         written once, create-if-absent
//   receivers/<R>.json                        heartbeat: version, state, time
//
// <N> is zero-padded to 10 digits so listings sort by version; <attempt> is
// "<seq:04>-<random hex>" so listings sort by age.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/clock.h"
#include "dcr/delta.h"
#include "dcr/frame_transport.h"
#include "dcr/store.h"

namespace dcr {

class CompiledLayout;
namespace protocol_internal {
struct ShardsMemo;
class ShardCall;
}  // namespace protocol_internal
struct PlacedRank;
class Progress;
class ThreadPool;

// ---- Keys ------------------------------------------------------------------

namespace run_keys {
inline constexpr std::string_view kRun = "run.json";
std::string VersionDir(uint64_t v);  // "v0000000042"
std::string Commit(uint64_t v);
std::string Attempts(uint64_t v);  // prefix, ends in '/'
std::string Attempt(uint64_t v, std::string_view attempt);  // prefix, ends in '/'
std::string Acks(uint64_t v, std::string_view attempt);  // prefix, ends in '/'
std::string Ack(uint64_t v, std::string_view attempt, std::string_view receiver);
// Objects of attempt `attempt` of version v.
std::string AttemptRecord(uint64_t v, std::string_view attempt);  // attempt.json
std::string Manifest(uint64_t v, std::string_view attempt);  // manifest.bin
std::string Fence(uint64_t v, std::string_view attempt);
// Frame object `index` of sender `sender`, relative to its attempt (the
// name manifests list). A sender writes its frames in (tensor, chunk)
// order, so each object after its first is named by its first frame's
// chunk: frames/s<sender>-<NNNN>-t<T>c<C>.bin; the first is
// frames/s<sender>-<NNNN>.bin. Object i then holds chunks from its name's
// (the first: from the start) up to object i + 1's, which lets a rank of a
// sharded engine skip objects without its chunks before the manifest.
std::string FrameObject(uint32_t sender, size_t index, std::optional<ChunkId> first = std::nullopt);
// What a frame object's name (relative to its attempt) says; nullopt when it
// is not one of FrameObject's names.
struct FrameObjectName {
  uint32_t sender = 0;
  uint64_t index = 0;
  std::optional<ChunkId> first;  // nullopt: the sender's first object (or an older publisher's)
};
std::optional<FrameObjectName> ParseFrameObject(std::string_view name);
// Of an attempt of trainer processes: process p's record, its frame-object
// signing key (relative to the attempt: procs/p<P>.pub), and the
// contributions process `from` sends process `to`.
std::string Process(uint64_t v, std::string_view attempt, uint32_t p);
std::string ProcessSigner(uint32_t p);
std::string Contribution(uint64_t v, std::string_view attempt, uint32_t from, uint32_t to);
inline constexpr std::string_view kSnapshots = "snapshots/";  // prefix
std::string Snapshot(uint64_t v);  // prefix, ends in '/'
// Of a snapshot taken by trainer processes: the elements process `from`
// sends process `to` (the owner of their tensors), and process p's record
// of the file it wrote (a SnapshotRecord of its tensors).
std::string SnapshotPart(uint64_t v, uint32_t from, uint32_t to);
std::string SnapshotProcess(uint64_t v, uint32_t p);
inline constexpr std::string_view kReceivers = "receivers/";  // prefix
std::string Receiver(std::string_view id);
}  // namespace run_keys

// ---- Records (JSON objects in the store) -----------------------------------
// Each FromJson validates fully and names `where` in errors (kInvalidArgument,
// "does not parse", with the way forward).

struct RunRecord {
  std::string run_id;
  uint64_t chunk_elements = kDefaultChunkElements;
  std::vector<DeltaTensor> tensors;  // name, dtype, shape (digests unused)
  std::string ToJson() const;
  static Result<RunRecord> FromJson(std::string_view json, const std::string& where);
};

// What a publisher held beside the trainer's tensors while publishing one
// version (docs/protocol.md, "Memory").
struct PublisherMemory {
  // The previous version's bits (files in the state directory), and whether
  // that directory is in memory (tmpfs, ramfs): then they are memory too.
  uint64_t baseline_bytes = 0;
  bool baseline_in_memory = false;
  uint64_t staging_bytes = 0;  // host buffers device tensors are staged into
  // Peak of frame bytes written into objects not yet closed in the store
  // (what the store's writers and the relay's copies can hold at most):
  // about senders x 5 segments with a single publisher, the process's whole
  // share with trainer processes (one object each).
  uint64_t frames_in_flight_bytes = 0;
  uint64_t digest_bytes = 0;  // chunk digest tables kept between versions
  friend bool operator==(const PublisherMemory&, const PublisherMemory&) = default;
};

struct CommitRecord {
  uint64_t version = 0, base_version = 0;
  std::string attempt;  // empty for version 0 (the snapshot)
  Digest target_digest;
  std::vector<std::string> acked, retired;  // receivers
  double time = 0;  // unix seconds
  std::optional<PublisherMemory> publisher_memory;  // of the committing publisher (absent: an older one)
  std::string ToJson() const;
  static Result<CommitRecord> FromJson(std::string_view json, const std::string& where);
};

struct ReceiverRecord {
  std::string id, state;  // state: joining, following, applying, retired, stopped
  uint64_t version = 0;  // committed version it holds
  double heartbeat = 0;  // unix seconds
  EngineRank engine;  // a rank of an engine, or ranks == 0
  // The most frame bytes it held at once (downloaded or relayed objects not
  // yet applied, and the headers of frames applied) while applying the last
  // version it applied (docs/protocol.md, "Memory"). 0 before the first.
  uint64_t frames_held_bytes = 0;
  std::string ToJson() const;
  static Result<ReceiverRecord> FromJson(std::string_view json, const std::string& where);
};

// What an attempt is, written first when it opens:
// attempts/v<N>/<attempt>/attempt.json. Receivers apply its frames before the
// manifest exists by its delta id and class, and check relayed frame
// objects against the key that signs them: `object_key` (one publisher), or
// with `processes` > 0 (trainer processes) each process's own key,
// procs/p<P>.pub.
struct AttemptRecord {
  uint64_t version = 0;
  DeltaClass cls = DeltaClass::kXorClass;
  uint64_t delta_id = 0;  // non-zero
  std::string object_key;  // hex Ed25519 public key; empty with processes > 0
  std::string coordinator;
  uint64_t processes = 0, senders = 0;  // trainer processes and their senders; 0 for one publisher
  double time = 0;  // unix seconds
  std::string ToJson() const;
  static Result<AttemptRecord> FromJson(std::string_view json, const std::string& where);
};

// A trainer process's part of an attempt (ShardPublisher over several
// processes): attempts/v<N>/<attempt>/procs/p<P>.json. Its frames lie in
// its own objects (names relative to the attempt); `chunks` are the chunks
// its senders own, in (tensor, chunk) order; the partials are over the
// canonical elements its senders' primary copies hold.
struct ProcessRecord {
  std::string attempt;
  uint32_t process = 0, processes = 0;
  std::vector<uint32_t> senders;  // global sender indices it holds, ascending
  Digest baseline_digest, target_digest;  // its senders' partials at v-1 and v
  std::vector<std::string> objects;
  std::vector<DeltaFrameEntry> frames;  // object: index into `objects`
  struct Chunk {
    uint32_t tensor = 0, chunk = 0;
    Digest base, target;
  };
  std::vector<Chunk> chunks;
  std::string ToJson() const;
  static Result<ProcessRecord> FromJson(std::string_view json, const std::string& where);
};

// Completes `manifest` (StartLayoutDelta's, of the attempt) from every
// process's record: objects (each process's, in process order), frames (in
// (tensor, chunk) order, object indices remapped), chunk digests, totals.
// kFailedPrecondition naming the chunk when one is owned by no process or by
// two, or a frame lies outside its record's chunks; kInvalidArgument when a
// record names a chunk outside the manifest or an object it lacks.
Status AssembleLayoutManifest(DeltaManifest& manifest, std::span<const ProcessRecord> records);

// Why an attempt is obsolete: attempts/v<N>/<attempt>/fence. Its existence
// is what receivers and relays obey; the record says why and when.
struct FenceRecord {
  std::string reason;
  double time = 0;  // unix seconds
  std::string ToJson() const;
  static Result<FenceRecord> FromJson(std::string_view json, const std::string& where);
};

struct SnapshotRecord {
  uint64_t version = 0;
  Digest digest;
  struct File {
    std::string name;
    uint64_t bytes = 0;
  };
  // Relative to the snapshot's files/ prefix; at least one in snapshot.json
  // (a trainer process's record of its part may have none).
  std::vector<File> files;
  std::string ToJson() const;
  static Result<SnapshotRecord> FromJson(std::string_view json, const std::string& where);
};

// ---- Plans -----------------------------------------------------------------

// Which sender owns which chunks: contiguous runs of the (tensor, chunk)
// order, balanced by bytes. Deterministic from the tensor list, the chunking
// and the sender count; every chunk has exactly one owner.
std::vector<std::vector<ChunkId>> PlanOwnership(const DeltaManifest& layout, uint32_t senders);

// The committed state of a run, read from the store.
struct RunState {
  std::optional<RunRecord> run;
  std::optional<uint64_t> latest;  // newest committed version
};
Result<RunState> ReadRunState(Store& store);

// ---- Frame object signatures (docs/format.md, "Frame objects") -------------
// Every frame object an attempt writes ends with a trailer: the Ed25519
// signature, by a key its publisher made for the attempt, of BLAKE2b-256 over
// the object's key and frames. The public half is in the store (attempt.json,
// or procs/p<P>.pub for a trainer process); receivers verify every object
// that did not come from the store before using it. The secret half never
// leaves the publisher's process.

class ObjectSigner {
 public:
  // A fresh key pair (libsodium). Errors: kInternal when libsodium cannot start.
  static Result<ObjectSigner> Generate();
  // The public key as 64 lowercase hex digits (what the store records).
  const std::string& public_hex() const { return public_hex_; }

  // Signs one object incrementally: Begin with its key, Update with its
  // frames in order, then Trailer() is the bytes to append.
  class Object {
   public:
    void Update(std::string_view frames);
    std::string Trailer();

   private:
    friend class ObjectSigner;
    const ObjectSigner* signer_ = nullptr;
    alignas(64) std::array<uint8_t, 384> state_{};  // a crypto_generichash_state
  };
  Object Begin(std::string_view key) const;
  // Frames plus trailer, in one call.
  std::string Sign(std::string_view key, std::string frames) const;

 private:
  std::array<uint8_t, 64> secret_{};
  std::string public_hex_;
};

// Whether `object` (stored under `key`) ends with a trailer that public key
// `signer_hex` signed. kDataLoss naming the key: no trailer, or a signature
// that does not verify; kInvalidArgument: `signer_hex` is not a public key.
Status VerifyObjectSignature(std::string_view signer_hex, std::string_view key, std::string_view object);

// Checks that a frame object is its attempt's publisher's: its trailer's
// signature verifies against the key the store records for it
// (attempt.json's object_key, or procs/p<P>.pub of a trainer process). What
// a relay that can read the store runs before it keeps an object (`dcr
// relay --store`): a forged copy pushed ahead of the publisher's is then
// refused, and the publisher's copy is kept. Keys are cached once read; an
// attempt or key not in the store yet is kNotFound (the publisher writes
// them before any object, so nothing genuine is refused for it). Not
// thread-safe.
class FrameObjectVerifier {
 public:
  explicit FrameObjectVerifier(Store& store) : store_(store) {}
  Status Verify(const std::string& key, std::string_view bytes);

 private:
  Store& store_;
  std::map<std::string, std::string> signers_;  // by attempt prefix + object name up to '-': the key (hex)
};

// ---- Publisher (coordinator + senders) --------------------------------------

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

// ---- Publisher from trainer shards -------------------------------------------

// One sender of a trainer: its map (a sender map, docs/layouts.md) and its
// current shard buffers, indexed like map().buffers. Not owned.
struct ShardSource {
  const CompiledLayout* layout = nullptr;
  std::vector<std::span<const uint8_t>> current;
  // Staging (device tensors): when set, `current` is host memory that
  // stage(b) fills for buffer b (a device -> host copy, returning once it is
  // done). Each publish runs it buffer by buffer, in order, on a copy thread
  // from its start, and reads a buffer only once it is staged: the copies
  // overlap the encode of the buffers staged before. Called once per buffer
  // per publish; an error fails the publish.
  std::function<Status(size_t buffer)> stage;
};

// Where the senders of a trainer live: this process's index among
// `processes` (0 is the coordinator), and the process holding each global
// sender (one entry per sender map; empty: contiguous blocks, sender k in
// process k * processes / senders). Every process must be given the same.
struct ShardProcesses {
  uint32_t process = 0, processes = 1;
  std::vector<uint32_t> sender_process;
};

// Publishes versions v > 0 of a run from trainer shards: every sender
// projects its shards against its own baseline shards (ProjectSender), each
// chunk's owner (ChunkOwner) merges the contributions and encodes the chunk's
// frame (EncodeOwnedChunks); the attempts, acks and commit are the
// Publisher's. Senders may be spread over several processes (each runs its
// own ShardPublisher; contributions travel as contribution objects through
// the store, docs/protocol.md "Trainer ranks in separate processes"). Each
// process's baseline is its own senders' shards (not canonical copies), kept
// as buffer files in `state_dir` (as Publisher's: empty for the default,
// locked while publishing)/shards/s<K>/ (K global) with shards.json
// naming the run, version, senders and their partial digest; when it is
// missing, damaged or not at v-1 it is caught up from the committed deltas or
// rebuilt from the newest snapshot through the maps (ApplyRankFrame on the
// sender maps). The coordinator checks that the processes' baseline partials
// add up to v-1's digest. Version 0 (the snapshot, a canonical checkpoint) is
// published by Publisher. The senders' maps must cover every tensor of the
// run exactly once (no residuals yet).
class ShardPublisher {
 public:
  ShardPublisher(Store& store, std::string state_dir, PublishOptions options);

  // Every sender in this process. Errors: as Publisher::Publish;
  // kInvalidArgument when the maps do not cover the run's tensors exactly
  // once or the buffers do not fit them.
  Result<PublishReport> Publish(uint64_t version, std::span<const ShardSource> senders);

  // One process of several: `maps` are every sender's map (global order),
  // `local` this process's senders (those `procs` places here, ascending,
  // each with its map's layout). The coordinator returns once v is
  // committed; a worker once it saw the commit of an attempt it took part
  // in (or caught its baseline up to a commit it missed). Errors as above,
  // and kUnavailable when a worker's peers stay silent (peer_timeout).
  Result<PublishReport> Publish(uint64_t version, std::span<const CompiledLayout* const> maps,
                                std::span<const ShardSource> local, const ShardProcesses& procs);

  // The senders' current shards hold committed version `version` (the run's
  // snapshot, just published from the same tensors): they become the
  // baseline, without a download from the store. Every sender must be in
  // this process; kFailedPrecondition unless their digest is the commit's
  // (the state is not touched then).
  Status Adopt(uint64_t version, std::span<const ShardSource> senders);

  ~ShardPublisher();

 private:
  friend class protocol_internal::ShardCall;
  Store& store_;
  std::string state_dir_;
  PublishOptions options_;
  std::unique_ptr<protocol_internal::ShardsMemo> memo_;  // what the last publish left
};

// ---- Status -------------------------------------------------------------------

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

}  // namespace dcr
