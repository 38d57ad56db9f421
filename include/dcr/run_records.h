// The records a run keeps in the store (JSON objects), the run's state read from them, and its chunk plans.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/delta.h"
#include "dcr/frame_transport.h"
#include "dcr/status.h"

namespace dcr {

class Store;

// ---- Records (JSON objects in the store) -----------------------------------
// Each FromJson validates fully and names `where` in errors (kInvalidArgument,
// "does not parse", with the way forward).

// How the FP8 engine ranks of a run quantize their BF16 master (docs/layouts.md,
// "FP8 engines"): each field names one choice. Fp8Scheme{} is the scheme this
// dcr implements (QuantizeFp8Block); a rank that would quantize otherwise
// refuses the run, so every FP8 engine of a run and a fresh load of the FP8
// checkpoint the scheme makes from the trainer's BF16 hold the same bits.
struct Fp8Scheme {
  std::string format = "e4m3fn";  // OCP E4M3: no infinities, largest 448
  uint64_t block_rows = 128, block_cols = 128;  // a scale per block of the last two dimensions
  std::string scale = "f32 weight_scale_inv = amax / 448 over the block's finite magnitudes; 1 when it has none";
  std::string rounding = "nearest, ties to even; subnormals kept";
  std::string specials = "NaN stays NaN; infinities and magnitudes above 448 saturate to 448";
  std::string ToJson() const;  // one line
  friend bool operator==(const Fp8Scheme&, const Fp8Scheme&) = default;
};

struct RunRecord {
  std::string run_id;
  uint64_t chunk_elements = kDefaultChunkElements;
  std::vector<DeltaTensor> tensors;  // name, dtype, shape (digests unused)
  // The FP8 scheme of the run's FP8 engines: written by every publisher that
  // creates a run; absent in runs created before it (read as Fp8Scheme{}).
  std::optional<Fp8Scheme> fp8;
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
  // Host memory of a BF16 master it keeps of an FP8 engine's weights
  // (docs/layouts.md, "FP8 engines"); 0 for any other receiver.
  uint64_t master_bytes = 0;
  // The digest it held when it last verified a committed version (a rank:
  // its partial) and when (unix seconds); 0 before the first.
  Digest verified_digest;
  double verified_at = 0;
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

// A publishing process's stages for one version (docs/metrics.md,
// "Timeline"): attempts/v<N>/<attempt>/timeline/<process>.json under the
// committed attempt, written once the publish call returns (best effort:
// a record for operators, never read by the protocol).
struct TimelineRecord {
  std::string process;  // the coordinator id, or a trainer process's
  std::string role;  // "publisher" (the coordinator) or "trainer-process"
  uint64_t version = 0;
  double total_seconds = 0;  // the publish call
  std::vector<StageSpan> spans;
  std::string ToJson() const;
  static Result<TimelineRecord> FromJson(std::string_view json, const std::string& where);
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

}  // namespace dcr
