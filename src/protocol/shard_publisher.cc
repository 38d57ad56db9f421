// The publisher of trainer processes' shards (ShardPublisher): each process
// projects its senders' shards onto chunks, the chunks' owners encode them,
// and process 0 coordinates the attempt (docs/protocol.md, "Publishing from
// shards"); each process's baseline is its senders' shard files.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "coordinator.h"
#include "dcr/contribution.h"
#include "dcr/layout_apply.h"
#include "dcr/run_keys.h"
#include "dcr/run_status.h"
#include "dcr/shard_publisher.h"
#include "dcr/signing.h"
#include "dcr/thread_pool.h"
#include "internal.h"
#include "publish_metrics.h"
#include "segment_writer.h"
#include "shard_baseline.h"
#include "shard_staging.h"

namespace dcr {

using namespace protocol_internal;

namespace {

std::vector<TensorInfo> RunTensorInfos(const RunRecord& run) {
  std::vector<TensorInfo> out;
  for (const DeltaTensor& t : run.tensors)
    out.push_back({t.name, t.dtype, t.shape, t.elements, t.elements * BitsPerElement(t.dtype) / 8});
  return out;
}

// attempt.json of an attempt of trainer processes.
Result<AttemptRecord> ParseProcessesAttempt(std::string_view text, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(AttemptRecord a, AttemptRecord::FromJson(text, where));
  if (a.processes == 0)
    return InvalidArgument(where + ": an attempt of one publisher, not of trainer processes (processes, senders)");
  return a;
}

}  // namespace

namespace {

// One ShardPublisher::Publish call of one process of a trainer.
class ShardRun {
 public:
  ShardRun(AttemptCoordinator& coordinator, Store& store, const std::string& state_dir, const PublishOptions& o,
           const RunRecord& record, std::span<const CompiledLayout* const> maps, std::span<const ShardSource> local,
           ShardProcesses procs, ShardsMemo& memo, ShardStaging& staging)
      : coordinator_(coordinator),
        store_(store),
        state_dir_(state_dir),
        o_(o),
        record_(record),
        maps_(maps.begin(), maps.end()),
        local_(local),
        procs_(std::move(procs)),
        staging_(staging),
        baseline_(store, state_dir, record, local, local_ids_, procs_.processes == 1, memo) {}

  Status Prepare();
  Result<PublishReport> Coordinate(uint64_t v);
  Result<PublishReport> Work(uint64_t v);
  // The local senders' current shards, which hold committed version `c`,
  // become the baseline (ShardPublisher::Adopt).
  Status AdoptCurrent(const CommitRecord& c);
  // After a publish that succeeded: the baseline stays open in the memo.
  void KeepShardsOpen() { baseline_.KeepOpen(); }

 private:
  enum class Outcome { kRecorded, kAbandoned, kStalled };
  struct Participation {
    Outcome outcome = Outcome::kAbandoned;
    ProcessRecord record;
  };
  // Takes part in attempt `id`: projects the local senders, exchanges
  // contribution objects, encodes the chunks they own, writes the frame
  // object and the process record. Waits for peers until `deadline`: then
  // the coordinator fails (kUnavailable), a worker reports kStalled.
  Result<Participation> Participate(uint64_t v, const std::string& id, const AttemptRecord& doc,
                                    Clock::Instant deadline);
  // The local senders' contributions, by the process that owns their chunk
  // (`to[Me()]`: this process's own, direct ones among them), with the
  // partial digests of the others added to `rec`.
  struct Projected {
    std::vector<std::vector<ChunkContribution>> to;
    std::set<ChunkId> direct;
  };
  Result<Projected> ProjectLocal(const DeltaManifest& m, ProcessRecord* rec);
  // Writes each peer's contributions and collects the peers' for this
  // process into `to[Me()]`: kRecorded once all are here.
  Result<Outcome> ExchangeContributions(uint64_t v, const std::string& id, const AttemptRecord& doc,
                                        const DeltaManifest& m, Projected* projected, Clock::Instant deadline);
  // Encodes the chunks this process owns (`projected->to[Me()]`, consumed)
  // in batches, streaming their frames into this process's frame objects:
  // segments, each signed and closed (and handed to the relay) while the
  // next batch encodes, so receivers download them before the manifest.
  // Their frames and chunk digests go into `rec`.
  Status EncodeOwnedFrames(uint64_t v, const std::string& id, const DeltaManifest& m, const EncodeOptions& encode,
                           Projected* projected, ProcessRecord* rec);
  // One batch's frames and digests: into `rec` and the segments (signed
  // with `signer`, whose public half goes into the store before the first).
  Status WriteBatch(const OwnedFrames& owned, const std::set<ChunkId>& direct, const std::string& prefix,
                    const ObjectSigner& signer, SegmentedFrameWriter& segments, ProcessRecord* rec);
  // Process 0: attempt `id` of v from attempt.json to the commit; `partial`:
  // this process's senders' digest at v.
  Result<AttemptCoordinator::AttemptResult> CoordinateAttempt(uint64_t v, const std::string& id, DeltaClass cls,
                                                              const CommitRecord& base_commit, Digest* partial);
  // The other processes' records of attempt `id` into `records`; the first
  // process silent past the peer timeout, if any.
  Result<std::optional<uint32_t>> AwaitProcessRecords(uint64_t v, const std::string& id,
                                                      std::vector<ProcessRecord>* records);
  // A worker's step once v is committed (`c`): the baseline moves to v
  // (`recorded`: the attempts this process recorded, and its partial at
  // v), and the snapshot is taken when due.
  Status FollowCommit(uint64_t v, const CommitRecord& c, const std::map<std::string, Digest>& recorded);
  // Fenced, superseded by a newer attempt, or v committed.
  Result<bool> Abandoned(uint64_t v, const std::string& id);
  // The local senders' baseline at committed version `want` (opened,
  // caught up, or rebuilt), into baseline_.
  Status LoadShards(const CommitRecord& want);  // timed into report_.baseline_seconds
  // Commit of an attempt this process recorded: the baseline becomes the
  // current shards, at `partial`.
  Status MoveBaseline(uint64_t v, const Digest& partial);
  // Takes committed version v's snapshot from the baseline shards (which
  // hold v) when the options' schedule names v and it is not in the store.
  Status SnapshotIfDue(uint64_t v);
  uint32_t P() const { return procs_.processes; }
  uint32_t Me() const { return procs_.process; }

  AttemptCoordinator& coordinator_;
  Store& store_;
  const std::string& state_dir_;
  const PublishOptions& o_;
  const RunRecord& record_;
  std::vector<const CompiledLayout*> maps_;
  std::span<const ShardSource> local_;
  ShardProcesses procs_;
  std::vector<uint32_t> local_ids_;  // global index of each local sender
  std::vector<std::vector<uint32_t>> senders_of_;  // per process
  std::vector<TensorInfo> infos_;
  PublishReport report_;
  ShardStaging& staging_;
  ShardBaseline baseline_;  // after local_ids_, which it reads
};

Status ShardRun::Prepare() {
  infos_ = RunTensorInfos(record_);
  std::vector<std::string> unmapped;
  DCR_RETURN_IF_ERROR(ValidateEngine(maps_, infos_, &unmapped).WithContext("the senders' maps"));
  if (!unmapped.empty())
    return InvalidArgument(
        fmt::format("no sender maps tensor '{}' ({} unmapped); residual tensors are not published "
                    "from shards yet",
                    unmapped.front(), unmapped.size()));
  const size_t senders = maps_.size();
  if (P() == 0 || Me() >= P())
    return InvalidArgument(fmt::format("process {} of {}: need 0 <= process < processes", Me(), P()));
  if (P() > senders)
    return InvalidArgument(fmt::format("{} processes for {} senders: every process needs a sender", P(), senders));
  if (procs_.sender_process.empty())
    for (size_t k = 0; k < senders; ++k) procs_.sender_process.push_back(static_cast<uint32_t>(k * P() / senders));
  if (procs_.sender_process.size() != senders)
    return InvalidArgument(fmt::format("the placement names {} senders' processes, there are {} sender maps",
                                       procs_.sender_process.size(), senders));
  senders_of_.assign(P(), {});
  for (size_t k = 0; k < senders; ++k) {
    if (procs_.sender_process[k] >= P())
      return InvalidArgument(fmt::format("sender {} is placed in process {} of {}", k, procs_.sender_process[k], P()));
    senders_of_[procs_.sender_process[k]].push_back(static_cast<uint32_t>(k));
  }
  for (uint32_t q = 0; q < P(); ++q)
    if (senders_of_[q].empty()) return InvalidArgument(fmt::format("process {} holds no sender", q));
  local_ids_ = senders_of_[Me()];
  if (local_.size() != local_ids_.size())
    return InvalidArgument(fmt::format("process {} holds senders {} ({}), but {} local sources were given", Me(),
                                       fmt::join(local_ids_, ","), local_ids_.size(), local_.size()));
  for (size_t i = 0; i < local_.size(); ++i)
    if (local_[i].layout != maps_[local_ids_[i]] && !(local_[i].layout->map() == maps_[local_ids_[i]]->map()))
      return InvalidArgument(fmt::format("local sender {} (global sender {}) has another map than sender {}'s", i,
                                         local_ids_[i], local_ids_[i]));
  for (const DeltaTensor& t : record_.tensors) report_.total_bytes += t.elements * BitsPerElement(t.dtype) / 8;
  return Status::Ok();
}

Status ShardRun::LoadShards(const CommitRecord& want) {
  const auto start = ClockOf(o_).Now();
  Status s = baseline_.Load(want);
  report_.baseline_seconds += EndStage(&report_, "baseline", ClockOf(o_), start);
  PublisherMemory& mem = report_.memory;
  mem.baseline_bytes = baseline_.bytes();
  mem.staging_bytes = 0;
  mem.baseline_in_memory = OnMemoryFilesystem(state_dir_);
  for (const ShardSource& src : local_)
    if (src.stage)
      for (auto b : src.current) mem.staging_bytes += b.size();
  return s;
}

Status ShardRun::MoveBaseline(uint64_t v, const Digest& partial) {
  DCR_RETURN_IF_ERROR(staging_.AwaitAll());
  const auto start = ClockOf(o_).Now();
  Status written = baseline_.Move(v, partial);
  report_.advance_seconds = EndStage(&report_, "advance", ClockOf(o_), start);
  return written;
}

Status ShardRun::AdoptCurrent(const CommitRecord& c) {
  if (P() != 1)
    return FailedPrecondition(
        "adopting the current shards as the baseline needs every sender in this process; "
        "with several processes each rebuilds its baseline from the store");
  DCR_RETURN_IF_ERROR(staging_.AwaitAll());
  Digest digest;  // of the current shards, before the state is touched
  for (const ShardSource& src : local_) {
    PlacedRank current{src.layout, {}};
    for (auto b : src.current) current.buffers.emplace_back(const_cast<uint8_t*>(b.data()), b.size());  // read only
    digest += *RankDigest(current);  // host memory: no read can fail
  }
  if (digest != c.target_digest)
    return FailedPrecondition(
        fmt::format("the senders' current shards are not version {} (digest {} != {}); adopt "
                    "only the tensors that version was published from",
                    c.version, digest.ToHex(), c.target_digest.ToHex()));
  return baseline_.Adopt(c.version, digest);
}

Status ShardRun::SnapshotIfDue(uint64_t v) {
  if (!SnapshotDue(o_, v)) return Status::Ok();
  ShardSnapshotContext c;
  c.store = &store_;
  c.options = &o_;
  c.run = &record_;
  c.maps = maps_;
  c.sender_process = procs_.sender_process;
  c.senders_of = senders_of_;
  c.process = Me();
  c.processes = P();
  c.local_ids = local_ids_;
  c.local = baseline_.Placed();
  c.scratch_dir = state_dir_;
  return TakeShardSnapshot(c, v);
}

Result<bool> ShardRun::Abandoned(uint64_t v, const std::string& id) {
  DCR_ASSIGN_OR_RETURN(auto commit, GetIfPresent(store_, run_keys::Commit(v)));
  if (commit) return true;
  DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store_, v));
  for (const AttemptInfo& a : attempts)
    if ((a.id == id && a.fenced) || a.id > id) return true;
  return false;
}

Result<ShardRun::Participation> ShardRun::Participate(uint64_t v, const std::string& id, const AttemptRecord& doc,
                                                      Clock::Instant deadline) {
  const auto encode_start = ClockOf(o_).Now();
  DeltaOptions options = o_.delta;
  options.encode.delta_class = doc.cls;
  options.chunk_elements = record_.chunk_elements;
  options.delta_id = doc.delta_id;
  const DeltaManifest m = StartLayoutDelta(infos_, options);
  Participation out;
  DCR_RETURN_IF_ERROR(Fault(o_, "projecting"));
  DCR_ASSIGN_OR_RETURN(Projected projected, ProjectLocal(m, &out.record));
  DCR_ASSIGN_OR_RETURN(out.outcome, ExchangeContributions(v, id, doc, m, &projected, deadline));
  if (out.outcome != Outcome::kRecorded) return out;
  DCR_RETURN_IF_ERROR(EncodeOwnedFrames(v, id, m, options.encode, &projected, &out.record));
  report_.encode_seconds += EndStage(&report_, "encode", ClockOf(o_), encode_start);
  return out;
}

Result<ShardRun::Projected> ShardRun::ProjectLocal(const DeltaManifest& m, ProcessRecord* rec) {
  Projected out;
  out.to.resize(P());
  // Chunks this process merges that one local sender holds whole are
  // encoded straight from its shards (direct contributions); their part of
  // the partial digests comes from the encode.
  const auto owned_here = [&](uint32_t tensor, uint32_t chunk) {
    auto owner = ChunkOwner(maps_, m, tensor, chunk);
    return owner.ok() && procs_.sender_process[*owner] == Me();
  };
  for (size_t i = 0; i < local_.size(); ++i) {
    PlacedRank base = baseline_.Placed(i);
    SenderRank rank{local_[i].layout, {}, local_[i].current, staging_.AwaiterFor(i)};
    for (auto b : base.buffers) rank.baseline.push_back(b);
    DCR_ASSIGN_OR_RETURN(auto contributions, ProjectSender(rank, local_ids_[i], m, owned_here));
    for (ChunkContribution& c : contributions) {
      if (c.direct()) {
        out.direct.insert(ChunkId{c.tensor, c.chunk});
        out.to[Me()].push_back(std::move(c));
        continue;
      }
      // The local partials, before and after: the target is the baseline's
      // digest with each changed element's term moved from old to new bits.
      const DeltaTensor& t = m.tensors[c.tensor];
      const DigestKey key = MakeDigestKey(t.name);
      const uint64_t eb = BitsPerElement(t.dtype) / 8, first = uint64_t{c.chunk} * m.chunk_elements;
      rec->baseline_digest += c.base_digest;
      rec->target_digest += c.base_digest;
      for (size_t j = 0; j < c.positions.size(); ++j) {
        const uint64_t at = (first + c.positions[j]) * eb;
        rec->target_digest -= DigestBytes(key, at, {c.old_bits.data() + j * eb, eb});
        rec->target_digest += DigestBytes(key, at, {c.new_bits.data() + j * eb, eb});
      }
      DCR_ASSIGN_OR_RETURN(uint32_t owner, ChunkOwner(maps_, m, c.tensor, c.chunk));
      out.to[procs_.sender_process[owner]].push_back(std::move(c));
    }
  }
  return out;
}

Result<ShardRun::Outcome> ShardRun::ExchangeContributions(uint64_t v, const std::string& id, const AttemptRecord& doc,
                                                          const DeltaManifest& m, Projected* projected,
                                                          Clock::Instant deadline) {
  std::vector<ChunkContribution>& mine = projected->to[Me()];
  // One object per peer, written even when empty (the peer waits for it).
  for (uint32_t q = 0; q < P(); ++q) {
    if (q == Me()) continue;
    DCR_ASSIGN_OR_RETURN(std::string bytes, WriteContributions({doc.delta_id, doc.cls, Me(), q}, m, projected->to[q]));
    DCR_RETURN_IF_ERROR(store_.Put(run_keys::Contribution(v, id, Me(), q), bytes));
  }
  DCR_RETURN_IF_ERROR(Fault(o_, "contributions-written"));
  std::set<uint32_t> missing;
  for (uint32_t q = 0; q < P(); ++q)
    if (q != Me()) missing.insert(q);
  for (;;) {
    for (auto it = missing.begin(); it != missing.end();) {
      const std::string key = run_keys::Contribution(v, id, *it, Me());
      DCR_ASSIGN_OR_RETURN(auto bytes, GetIfPresent(store_, key));
      if (!bytes) {
        ++it;
        continue;
      }
      DCR_ASSIGN_OR_RETURN(
          auto records,
          ParseContributions({reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()},
                             {doc.delta_id, doc.cls, *it, Me()}, m, senders_of_[*it], StoreContext(store_.url(), key)));
      for (ChunkContribution& c : records) {
        DCR_ASSIGN_OR_RETURN(uint32_t owner, ChunkOwner(maps_, m, c.tensor, c.chunk));
        if (procs_.sender_process[owner] != Me())
          return InvalidArgument(fmt::format("{}: a contribution to tensor {} chunk {}, which process {} does not own",
                                             StoreContext(store_.url(), key), c.tensor, c.chunk, Me()));
        mine.push_back(std::move(c));
      }
      it = missing.erase(it);
    }
    if (missing.empty()) return Outcome::kRecorded;
    DCR_ASSIGN_OR_RETURN(bool abandoned, Abandoned(v, id));
    if (abandoned) return Outcome::kAbandoned;
    if (ClockOf(o_).Now() >= deadline) {
      if (Me() != 0) return Outcome::kStalled;
      return Unavailable(
          fmt::format("process {} wrote no contributions for attempt {} within the peer timeout ({} "
                      "ms); is it running, as process {} of {}?",
                      *missing.begin(), id, o_.peer_timeout.count(), *missing.begin(), P()));
    }
    ClockOf(o_).Sleep(o_.peer_poll);
  }
}

Status ShardRun::EncodeOwnedFrames(uint64_t v, const std::string& id, const DeltaManifest& m,
                                   const EncodeOptions& encode, Projected* projected, ProcessRecord* rec) {
  const std::string prefix = run_keys::Attempt(v, id);
  std::vector<ChunkContribution>& mine = projected->to[Me()];
  const auto chunk_of = [](const ChunkContribution& c) { return ChunkId{c.tensor, c.chunk}; };
  std::stable_sort(mine.begin(), mine.end(),
                   [&](const ChunkContribution& a, const ChunkContribution& b) { return chunk_of(a) < chunk_of(b); });
  // Signed by a key of this process for this attempt: receivers verify relayed copies.
  DCR_ASSIGN_OR_RETURN(const ObjectSigner signer, ObjectSigner::Generate());
  FramesInFlight in_flight;
  SegmentedFrameWriter segments(store_, prefix, Me(), SegmentBytes(o_, report_.total_bytes), signer, o_.relay,
                                in_flight);
  // Batches of whole chunks, enough to keep every thread of the pool busy.
  const size_t batch_chunks = std::max<size_t>(32, 8 * DefaultPool().size());
  for (size_t begin = 0; begin < mine.size();) {
    size_t end = begin, chunks = 0;
    for (; end < mine.size(); ++end)
      if (end == begin || chunk_of(mine[end]) != chunk_of(mine[end - 1])) {
        if (chunks == batch_chunks) break;
        ++chunks;
      }
    const std::span<const ChunkContribution> batch(mine.data() + begin, end - begin);
    DCR_ASSIGN_OR_RETURN(OwnedFrames owned, EncodeOwnedChunks(m, batch, encode));
    DCR_RETURN_IF_ERROR(WriteBatch(owned, projected->direct, prefix, signer, segments, rec));
    for (size_t i = begin; i < end; ++i) mine[i] = {};  // merged: their change lists are not needed again
    begin = end;
  }
  DCR_RETURN_IF_ERROR(segments.Close());
  for (DeltaFrameEntry& f : rec->frames) segments.Locate(&f);
  rec->objects = segments.names();
  report_.memory.frames_in_flight_bytes = std::max(report_.memory.frames_in_flight_bytes, in_flight.peak());
  rec->attempt = id;
  rec->process = Me();
  rec->processes = P();
  rec->senders = local_ids_;
  DCR_RETURN_IF_ERROR(store_.Put(run_keys::Process(v, id, Me()), rec->ToJson()));
  return Fault(o_, "record-written");
}

Status ShardRun::WriteBatch(const OwnedFrames& owned, const std::set<ChunkId>& direct, const std::string& prefix,
                            const ObjectSigner& signer, SegmentedFrameWriter& segments, ProcessRecord* rec) {
  for (size_t i = 0; i < owned.chunks.size(); ++i) {
    const ChunkId c = owned.chunks[i];
    rec->chunks.push_back({c.tensor, c.chunk, owned.base_digests[i], owned.target_digests[i]});
    if (direct.count(c)) {
      rec->baseline_digest += owned.base_digests[i];
      rec->target_digest += owned.target_digests[i];
    }
    if (owned.frame_of[i] < 0) continue;
    const std::string& f = owned.frames[static_cast<size_t>(owned.frame_of[i])];
    DCR_ASSIGN_OR_RETURN(FrameView fv, ParseFrame({reinterpret_cast<const uint8_t*>(f.data()), f.size()}));
    const uint64_t offset = segments.written();  // in this process's frame stream
    rec->frames.push_back({c.tensor, c.chunk, 0, offset, f.size(), fv.header.mode, fv.header.codec, fv.header.changed,
                           fv.header.payload_bytes});
    if (offset == 0)  // before the first object
      DCR_RETURN_IF_ERROR(store_.Put(prefix + run_keys::ProcessSigner(Me()), signer.public_hex() + "\n"));
    DCR_RETURN_IF_ERROR(segments.Write(f));
  }
  return Status::Ok();
}

Result<PublishReport> ShardRun::Coordinate(uint64_t v) {
  const auto start = ClockOf(o_).Now();
  const double start_unix = ClockOf(o_).UnixSeconds();
  report_.version = v;
  DCR_ASSIGN_OR_RETURN(CommitRecord base_commit, ReadCommit(store_, v - 1));
  DCR_RETURN_IF_ERROR(LoadShards(base_commit));
  DCR_RETURN_IF_ERROR(SnapshotIfDue(v - 1));  // missed when v - 1 was published
  Digest partial;  // this process's senders at v, of the committed attempt
  DCR_RETURN_IF_ERROR(coordinator_.RunAttempts(
      v, &report_,
      [&](const std::string& id, DeltaClass cls) { return CoordinateAttempt(v, id, cls, base_commit, &partial); },
      // The attempt is fenced; another would fail the same way.
      [&] { return staging_.Failure(); }));
  DCR_RETURN_IF_ERROR(Fault(o_, "committed"));
  DCR_RETURN_IF_ERROR(MoveBaseline(v, partial));
  const auto snapshot_start = ClockOf(o_).Now();
  DCR_RETURN_IF_ERROR(SnapshotIfDue(v));
  EndStage(&report_, "snapshot", ClockOf(o_), snapshot_start);
  const auto gc_start = ClockOf(o_).Now();
  CollectGarbage(store_, o_.keep_versions, o_.heartbeat_timeout, ClockOf(o_)).IgnoreError();
  EndStage(&report_, "gc", ClockOf(o_), gc_start);
  report_.staging_seconds = staging_.seconds();
  if (report_.staging_seconds > 0)
    report_.spans.push_back({"staging", start_unix, start_unix + report_.staging_seconds});
  report_.total_seconds = SecondsSince(ClockOf(o_), start);
  return report_;
}

Result<AttemptCoordinator::AttemptResult> ShardRun::CoordinateAttempt(uint64_t v, const std::string& id, DeltaClass cls,
                                                                      const CommitRecord& base_commit,
                                                                      Digest* partial) {
  AttemptRecord doc;
  doc.version = v;
  doc.cls = cls;
  doc.delta_id = NewDeltaId();
  doc.coordinator = o_.coordinator_id;
  doc.processes = P();
  doc.senders = maps_.size();
  doc.time = ClockOf(o_).UnixSeconds();
  DCR_RETURN_IF_ERROR(coordinator_.OpenAttempt(v, id, doc));
  EndStageAfterLast(&report_, "open", ClockOf(o_));
  DCR_ASSIGN_OR_RETURN(Participation own, Participate(v, id, doc, ClockOf(o_).Now() + o_.peer_timeout));
  if (own.outcome != Outcome::kRecorded)
    return AttemptCoordinator::AttemptResult{false, Aborted("the attempt was fenced or superseded while it ran")};
  *partial = own.record.target_digest;
  std::vector<ProcessRecord> records(P());
  records[Me()] = std::move(own.record);
  DCR_ASSIGN_OR_RETURN(std::optional<uint32_t> silent, AwaitProcessRecords(v, id, &records));
  if (silent)
    return AttemptCoordinator::AttemptResult{
        false, Unavailable(fmt::format("process {} wrote no record for attempt {} within the peer timeout ({} ms)",
                                       *silent, id, o_.peer_timeout.count()))};
  Digest base_sum, target_sum;
  for (const ProcessRecord& r : records) base_sum += r.baseline_digest, target_sum += r.target_digest;
  if (base_sum != base_commit.target_digest) {
    std::string parts;
    for (const ProcessRecord& r : records) parts += fmt::format(" p{}={}", r.process, r.baseline_digest.ToHex());
    return FailedPrecondition(fmt::format(
        "the processes' baseline partial digests ({}) add up to {}, not version {}'s digest {}: a process's "
        "baseline shards are not version {}; remove that process's state directory (it is rebuilt from the store)",
        parts.substr(1), base_sum.ToHex(), v - 1, base_commit.target_digest.ToHex(), v - 1));
  }
  DeltaOptions options = o_.delta;
  options.encode.delta_class = cls;
  options.chunk_elements = record_.chunk_elements;
  options.delta_id = doc.delta_id;
  DeltaManifest m = StartLayoutDelta(infos_, options);
  DCR_RETURN_IF_ERROR(AssembleLayoutManifest(m, records));
  if (m.base_digest != base_commit.target_digest || m.target_digest != target_sum)
    return AttemptCoordinator::AttemptResult{
        false, Aborted(fmt::format("attempt {}: the chunk digests of the processes' records disagree with their "
                                   "partials (base {} vs {}, target {} vs {})",
                                   id, m.base_digest.ToHex(), base_commit.target_digest.ToHex(),
                                   m.target_digest.ToHex(), target_sum.ToHex()))};
  DeltaManifest committed;
  return coordinator_.PublishManifest(v, id, std::move(m), &report_, &committed);
}

Result<std::optional<uint32_t>> ShardRun::AwaitProcessRecords(uint64_t v, const std::string& id,
                                                              std::vector<ProcessRecord>* records) {
  const auto deadline = ClockOf(o_).Now() + o_.peer_timeout;
  for (uint32_t q = 1; q < P();) {
    const std::string key = run_keys::Process(v, id, q);
    DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store_, key));
    if (!text) {
      if (ClockOf(o_).Now() >= deadline) return std::optional<uint32_t>(q);
      ClockOf(o_).Sleep(o_.peer_poll);
      continue;
    }
    DCR_ASSIGN_OR_RETURN(ProcessRecord r, ProcessRecord::FromJson(*text, StoreContext(store_.url(), key)));
    if (r.attempt != id || r.process != q || r.processes != P() || r.senders != senders_of_[q])
      return FailedPrecondition(fmt::format(
          "{}: the record is of attempt {}, process {} of {}, senders {}; expected attempt {}, process {} of {}, "
          "senders {}: give every process the same layout maps and placement",
          StoreContext(store_.url(), key), r.attempt, r.process, r.processes, fmt::join(r.senders, ","), id, q, P(),
          fmt::join(senders_of_[q], ",")));
    (*records)[q] = std::move(r);
    ++q;
  }
  return std::optional<uint32_t>();
}

Status ShardRun::FollowCommit(uint64_t v, const CommitRecord& c, const std::map<std::string, Digest>& recorded) {
  report_.attempt = c.attempt;
  report_.acked = c.acked;
  report_.retired = c.retired;
  if (auto it = recorded.find(c.attempt); it != recorded.end()) {
    DCR_RETURN_IF_ERROR(Fault(o_, "committed"));
    DCR_RETURN_IF_ERROR(MoveBaseline(v, it->second));
  } else {
    // Committed without this incarnation's record (an earlier one wrote
    // it): the baseline follows the committed delta.
    DCR_RETURN_IF_ERROR(LoadShards(c));
    report_.already_committed = true;
  }
  return SnapshotIfDue(v);
}

Result<PublishReport> ShardRun::Work(uint64_t v) {
  const auto start = ClockOf(o_).Now();
  report_.version = v;
  DCR_ASSIGN_OR_RETURN(CommitRecord base_commit, ReadCommit(store_, v - 1));
  DCR_RETURN_IF_ERROR(LoadShards(base_commit));
  DCR_RETURN_IF_ERROR(SnapshotIfDue(v - 1));  // missed when v - 1 was published
  std::map<std::string, Digest> recorded;  // attempts this process recorded -> its partial at v
  std::set<std::string> tried;  // attempts it took part in, or refused
  std::string joined;  // the attempt last joined
  auto idle_until = ClockOf(o_).Now() + o_.peer_timeout;
  for (;;) {
    DCR_ASSIGN_OR_RETURN(auto commit_text, GetIfPresent(store_, run_keys::Commit(v)));
    if (commit_text) {
      DCR_ASSIGN_OR_RETURN(CommitRecord c,
                           CommitRecord::FromJson(*commit_text, StoreContext(store_.url(), run_keys::Commit(v))));
      DCR_RETURN_IF_ERROR(FollowCommit(v, c, recorded));
      report_.staging_seconds = staging_.seconds();
      report_.total_seconds = SecondsSince(ClockOf(o_), start);
      return report_;
    }
    DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store_, v));
    const AttemptInfo* newest = nullptr;
    for (const AttemptInfo& a : attempts)
      if (!a.fenced) newest = &a;
    if (newest && !tried.count(newest->id)) {
      const std::string key = run_keys::AttemptRecord(v, newest->id);
      DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store_, key));
      if (text) {
        DCR_ASSIGN_OR_RETURN(AttemptRecord doc, ParseProcessesAttempt(*text, StoreContext(store_.url(), key)));
        if (doc.processes != P() || doc.senders != maps_.size())
          return FailedPrecondition(
              fmt::format("{}: the coordinator runs {} processes of {} senders, this process was "
                          "told {} of {}",
                          StoreContext(store_.url(), key), doc.processes, doc.senders, P(), maps_.size()));
        const std::string id = newest->id;
        if (id != joined) idle_until = ClockOf(o_).Now() + o_.peer_timeout;  // a new attempt: progress
        joined = id;
        auto part = Participate(v, id, doc, ClockOf(o_).Now() + o_.peer_timeout);
        DCR_RETURN_IF_ERROR(staging_.Failure());
        if (!part.ok()) {
          if (!Transient(part.status())) {
            // A bad peer object (or a fault): this attempt cannot be recorded
            // here; the coordinator fences it after its peer timeout.
            fmt::print(stderr, "dcr publish (process {}/{}): attempt {}: {}\n", Me(), P(), id,
                       part.status().ToString());
            if (part.status().code() == Code::kAborted) return part.status();  // an injected fault: as a crash
            tried.insert(id);
          }
          continue;
        }
        if (part->outcome == Outcome::kRecorded) {
          tried.insert(id);
          recorded[id] = part->record.target_digest;
          ++report_.attempts;
          report_.attempt = id;
          idle_until = ClockOf(o_).Now() + 2 * o_.peer_timeout + o_.ack_timeout;
        }
        if (part->outcome == Outcome::kAbandoned) tried.insert(id);
        if (part->outcome != Outcome::kStalled) continue;
      }
    }
    if (ClockOf(o_).Now() >= idle_until)
      return Unavailable(
          fmt::format("process {}/{}: no {} of version {} from the coordinator within the peer timeout; "
                      "is process 0 running?",
                      Me(), P(), recorded.empty() ? "attempt to join" : "commit", v));
    ClockOf(o_).Sleep(o_.peer_poll);
  }
}

}  // namespace

ShardPublisher::ShardPublisher(Store& store, std::string state_dir, PublishOptions options)
    : store_(store),
      state_dir_(std::move(state_dir)),
      options_(std::move(options)),
      memo_(std::make_unique<ShardsMemo>()) {
  if (options_.coordinator_id.empty()) options_.coordinator_id = DefaultCoordinatorId();
}

ShardPublisher::~ShardPublisher() = default;

Result<PublishReport> ShardPublisher::Publish(uint64_t version, std::span<const ShardSource> senders) {
  std::vector<const CompiledLayout*> maps;
  for (const ShardSource& s : senders) maps.push_back(s.layout);
  return Publish(version, maps, senders, ShardProcesses{});
}

namespace protocol_internal {

// One call of a ShardPublisher: staging started (copies from here on, behind
// what follows), the run read, `check` passed, the state directory locked,
// the senders prepared; then `body`. A failure forgets the memo (the next
// call checks the files: a damaged baseline fails attempts).
class ShardCall {
 public:
  static Result<PublishReport> Run(ShardPublisher& p, std::span<const CompiledLayout* const> maps,
                                   std::span<const ShardSource> local, const ShardProcesses& procs,
                                   const std::function<Status(const RunState&)>& check,
                                   const std::function<Result<PublishReport>(ShardRun&)>& body) {
    if (maps.empty() || local.empty()) return InvalidArgument("no senders given");
    ShardStaging staging(local);
    DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(p.store_));
    if (!state.run) return FailedPrecondition(fmt::format("{} holds no run; publish version 0 first", p.store_.url()));
    DCR_RETURN_IF_ERROR(check(state));
    DCR_ASSIGN_OR_RETURN(const std::string dir, PublisherStateDir(p.state_dir_, p.store_));
    DCR_ASSIGN_OR_RETURN(StateDirLock lock, StateDirLock::Acquire(dir));
    AttemptCoordinator coordinator(p.store_, p.options_);
    ShardRun shards(coordinator, p.store_, dir, p.options_, *state.run, maps, local, procs, *p.memo_, staging);
    const Status prepared = shards.Prepare();
    Result<PublishReport> r = prepared.ok() ? body(shards) : Result<PublishReport>(prepared);
    if (r.ok()) {
      r->state_dir = dir;
      shards.KeepShardsOpen();
    } else {
      *p.memo_ = {};
    }
    return r;
  }
};

}  // namespace protocol_internal

Result<PublishReport> ShardPublisher::Publish(uint64_t version, std::span<const CompiledLayout* const> maps,
                                              std::span<const ShardSource> local, const ShardProcesses& procs) {
  if (version == 0)
    return FailedPrecondition("version 0 is the run's snapshot, a canonical checkpoint: publish it with dcr publish");
  // A worker may find v committed already (restarted after the commit).
  const bool worker = procs.process != 0;
  auto check = [&](const RunState& state) -> Status {
    if (!state.latest || (*state.latest != version - 1 && !(worker && *state.latest == version)))
      return FailedPrecondition(fmt::format("the newest committed version is {}; publish version {}",
                                            state.latest ? std::to_string(*state.latest) : "none",
                                            state.latest ? *state.latest + 1 : 0));
    return Status::Ok();
  };
  auto r = ShardCall::Run(*this, maps, local, procs, check,
                          [&](ShardRun& shards) { return worker ? shards.Work(version) : shards.Coordinate(version); });
  RecordPublish(store_,
                worker ? fmt::format("p{}-{}", procs.process, options_.coordinator_id) : options_.coordinator_id,
                worker ? "trainer-process" : "publisher", r);
  return r;
}

Status ShardPublisher::Adopt(uint64_t version, std::span<const ShardSource> senders) {
  std::vector<const CompiledLayout*> maps;
  for (const ShardSource& s : senders) maps.push_back(s.layout);
  CommitRecord commit;
  auto check = [&](const RunState&) -> Status {
    DCR_ASSIGN_OR_RETURN(commit, ReadCommit(store_, version));
    return Status::Ok();
  };
  return ShardCall::Run(*this, maps, senders, ShardProcesses{}, check,
                        [&](ShardRun& shards) -> Result<PublishReport> {
                          DCR_RETURN_IF_ERROR(shards.AdoptCurrent(commit));
                          PublishReport report;
                          report.version = version;
                          return report;
                        })
      .status();
}

}  // namespace dcr
