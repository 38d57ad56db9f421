// The publisher of a checkpoint: coordinator and senders in one process
// (docs/protocol.md); its baseline is a checkpoint in its state directory.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "coordinator.h"
#include "dcr/progress.h"
#include "dcr/publisher.h"
#include "dcr/run_keys.h"
#include "dcr/run_status.h"
#include "dcr/signing.h"
#include "internal.h"
#include "publish_metrics.h"
#include "segment_writer.h"

namespace dcr {

using namespace protocol_internal;
namespace fs = std::filesystem;

namespace {

// Copies the bytes of `chunks` from `next` into `baseline` (same layout).
void CopyChunks(Checkpoint& baseline, const Checkpoint& next, const DeltaManifest& layout,
                const std::vector<DeltaFrameEntry>& frames) {
  for (const auto& f : frames) {
    const auto& t = layout.tensors[f.tensor];
    uint64_t first_word, words;
    uint32_t elements;
    layout.ChunkWords(f.tensor, f.chunk, &first_word, &words, &elements);
    const uint64_t wb = WordBytes(t.dtype);
    auto src = next.Data(static_cast<size_t>(next.Find(t.name))).subspan(first_word * wb, words * wb);
    auto dst = baseline.MutableData(static_cast<size_t>(baseline.Find(t.name))).subspan(first_word * wb, words * wb);
    std::copy(src.begin(), src.end(), dst.begin());
  }
}

}  // namespace

Publisher::Publisher(Store& store, std::string state_dir, PublishOptions options)
    : store_(store), state_dir_(std::move(state_dir)), options_(std::move(options)) {
  if (options_.coordinator_id.empty()) options_.coordinator_id = DefaultCoordinatorId();
}

namespace {

// One publish call's working state.
class PublishRun {
 public:
  PublishRun(Store& store, const std::string& state_dir, const PublishOptions& options, Progress* progress)
      : store_(store), state_dir_(state_dir), o_(options), progress_(progress), coordinator_(store, options) {}

  Result<PublishReport> PublishSnapshot(const Checkpoint& next);
  Result<PublishReport> PublishDelta(uint64_t v, const Checkpoint& next, const RunRecord& run);

 private:
  using AttemptResult = AttemptCoordinator::AttemptResult;
  Result<AttemptResult> RunAttempt(uint64_t v, const std::string& id, DeltaClass cls, const Checkpoint& baseline,
                                   const Checkpoint& next, const DeltaManifest& layout,
                                   const ChunkDigestTable& base_digests, PublishReport* report,
                                   DeltaManifest* manifest_out, ChunkDigestTable* target_digests_out);
  // The baseline: a copy of version 0's files, `chunk_digests` cached.
  Status CreateBaseline(const Checkpoint& v0, const std::string& run_id, const ChunkDigestTable& chunk_digests);
  // The baseline at committed version `want` (v-1): opened and caught up
  // from committed deltas when it is behind; rebuilt from the store when
  // the state holds no baseline of this run below v (new, lost in a reboot,
  // another run's) or a damaged one.
  Status OpenBaseline(uint64_t v, const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout,
                      std::optional<Checkpoint>* out, ChunkDigestTable* digests);
  Status CatchUpBaseline(Checkpoint& baseline, uint64_t from, uint64_t to, const DeltaManifest& layout,
                         ChunkDigestTable* digests);
  // Opens the baseline (recorded at version `at`), catches it up to `want`
  // and checks its digest.
  Status LoadBaseline(uint64_t at, const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout,
                      std::optional<Checkpoint>* out, ChunkDigestTable* digests);
  Status RebuildBaseline(const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout);
  // A scheduled snapshot of v whose upload failed after v's commit is
  // uploaded from the baseline (which holds v exactly).
  Status UploadMissedSnapshot(uint64_t v, const Checkpoint& baseline, const Digest& digest);

  Store& store_;
  const std::string& state_dir_;
  const PublishOptions& o_;
  Progress* progress_;
  AttemptCoordinator coordinator_;
};

Result<PublishReport> PublishRun::PublishSnapshot(const Checkpoint& next) {
  const auto start = ClockOf(o_).Now();
  PublishReport report;
  DCR_ASSIGN_OR_RETURN(DeltaManifest layout, StartDelta(next, next, o_.delta));
  RunRecord run;
  run.run_id = RandomHex(16);
  run.chunk_elements = layout.chunk_elements;
  run.tensors = layout.tensors;
  run.fp8 = Fp8Scheme{};
  const ChunkDigestTable chunk_digests = ChunkDigests(next, layout);
  const Digest digest = Total(chunk_digests);
  report.total_bytes = layout.total_bytes;

  Status created = store_.Put(run_keys::kRun, run.ToJson(), WriteMode::kCreateIfAbsent);
  if (created.code() == Code::kAlreadyExists) {
    // Someone created the run: fine if it is this model and v0 has these bits.
    DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
    DCR_RETURN_IF_ERROR(CheckRunTensors(next, *state.run));
    auto commit = ReadCommit(store_, 0);
    if (commit.ok() && commit->target_digest == digest) {
      run = *state.run;
      report.already_committed = true;
    } else if (commit.ok()) {
      return AlreadyExists(
          fmt::format("{} already holds a run whose version 0 has other bits; use a new store prefix", store_.url()));
    } else if (commit.status().code() == Code::kNotFound) {
      run = *state.run;  // a publisher died before committing v0: finish its job
    } else {
      return commit.status();
    }
  } else {
    DCR_RETURN_IF_ERROR(created);
  }
  if (!report.already_committed) {
    DCR_RETURN_IF_ERROR(UploadSnapshot(store_, 0, next, digest, progress_));
    CommitRecord c;
    c.version = 0;
    c.target_digest = digest;
    c.time = ClockOf(o_).UnixSeconds();
    Status s = store_.Put(run_keys::Commit(0), c.ToJson(), WriteMode::kCreateIfAbsent);
    if (s.code() == Code::kAlreadyExists) {
      DCR_ASSIGN_OR_RETURN(CommitRecord other, ReadCommit(store_, 0));
      if (other.target_digest != digest)
        return AlreadyExists(store_.url() + ": version 0 was committed with other bits");
    } else {
      DCR_RETURN_IF_ERROR(s);
    }
  }
  DCR_RETURN_IF_ERROR(CreateBaseline(next, run.run_id, chunk_digests));
  report.version = 0;
  report.attempts = 1;
  report.total_seconds = SecondsSince(ClockOf(o_), start);
  return report;
}

Status PublishRun::CatchUpBaseline(Checkpoint& baseline, uint64_t from, uint64_t to, const DeltaManifest& layout,
                                   ChunkDigestTable* digests) {
  for (uint64_t v = from + 1; v <= to; ++v) {
    DCR_ASSIGN_OR_RETURN(CommitRecord c, ReadCommit(store_, v));
    DCR_ASSIGN_OR_RETURN(DeltaReader delta, LoadAttempt(store_, v, c.attempt, layout));
    auto applied = ApplyDelta(baseline, delta, nullptr, nullptr, digests);
    if (!applied.ok())
      return applied.status().WithContext(
          fmt::format("the publisher baseline {} cannot move to committed version {}", baseline.path(), v));
  }
  return Status::Ok();
}

Status PublishRun::LoadBaseline(uint64_t at, const CommitRecord& want, const RunRecord& run,
                                const DeltaManifest& layout, std::optional<Checkpoint>* out,
                                ChunkDigestTable* digests) {
  DCR_ASSIGN_OR_RETURN(Checkpoint baseline, Checkpoint::Open(BaselineDir(state_dir_), OpenMode::kReadWrite));
  DCR_RETURN_IF_ERROR(CheckRunTensors(baseline, run));
  if (auto cached = ReadDigestCache(state_dir_, at, baseline, layout)) *digests = std::move(*cached);
  else *digests = ChunkDigests(baseline, layout);
  DropDigestCache(state_dir_);  // the baseline may change from here on
  DCR_RETURN_IF_ERROR(CatchUpBaseline(baseline, at, want.version, layout, digests));
  if (Total(*digests) != want.target_digest)
    return FailedPrecondition(fmt::format("the publisher baseline {} is not committed version {} (digest {} != {})",
                                          baseline.path(), want.version, Total(*digests).ToHex(),
                                          want.target_digest.ToHex()));
  if (at < want.version) DCR_RETURN_IF_ERROR(WriteBaseline(state_dir_, {run.run_id, want.version}));
  WriteDigestCache(state_dir_, want.version, baseline, *digests);
  out->emplace(std::move(baseline));
  return Status::Ok();
}

Status PublishRun::RebuildBaseline(const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout) {
  // As a receiver joins: the newest snapshot at or below the version, then
  // the committed deltas, into a fresh directory that replaces the baseline.
  const std::string dir = BaselineDir(state_dir_), fresh = dir + ".rebuild";
  std::error_code ec;
  fs::remove_all(fresh, ec);
  DCR_ASSIGN_OR_RETURN(SnapshotRecord snap, NewestSnapshot(store_, want.version));
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store_, snap, fresh, nullptr));
  {
    DCR_ASSIGN_OR_RETURN(Checkpoint rebuilt, Checkpoint::Open(fresh, OpenMode::kReadWrite));
    DCR_RETURN_IF_ERROR(CheckRunTensors(rebuilt, run));
    ChunkDigestTable digests = ChunkDigests(rebuilt, layout);
    DCR_RETURN_IF_ERROR(CatchUpBaseline(rebuilt, snap.version, want.version, layout, &digests));
    if (Total(digests) != want.target_digest)
      return DataLoss(fmt::format("{}: the snapshot of version {} and the committed deltas do not make version {}",
                                  store_.url(), snap.version, want.version));
    DCR_RETURN_IF_ERROR(rebuilt.Sync());
  }
  // A crash from here on leaves no baseline (rebuilt again next time) or the
  // new one under an older record (caught up, or rebuilt, next time).
  fs::remove_all(dir, ec);
  if (!ec) fs::rename(fresh, dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot replace " + dir + " with " + fresh);
  return WriteBaseline(state_dir_, {run.run_id, want.version});
}

Status PublishRun::CreateBaseline(const Checkpoint& v0, const std::string& run_id,
                                  const ChunkDigestTable& chunk_digests) {
  const std::string dir = BaselineDir(state_dir_);
  std::error_code ec;
  DropDigestCache(state_dir_);
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir);
  std::vector<std::pair<fs::path, fs::path>> copies;  // from, to
  if (fs::is_regular_file(v0.path())) {
    copies.emplace_back(v0.path(), fs::path(dir) / "model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(v0.path(), ec))
      if (e.is_regular_file() && !e.path().filename().string().starts_with("."))
        copies.emplace_back(e.path(), fs::path(dir) / e.path().filename());
    if (ec) return ErrnoError(ec.value(), "cannot list " + v0.path());
  }
  uint64_t need = 0;
  for (const auto& [from, to] : copies) need += fs::file_size(from, ec);
  const std::string what = "the publisher's baseline (a copy of version 0; or give it another state directory)";
  DCR_RETURN_IF_ERROR(CheckFreeSpace(dir, need, what));
  for (const auto& [from, to] : copies)
    if (!fs::copy_file(from, to, ec) || ec)
      return IsNoSpace(ec.value()) ? NoSpace(dir, need, what)
                                   : ErrnoError(ec.value(), "cannot copy " + from.string() + " into " + dir);
  DCR_RETURN_IF_ERROR(WriteBaseline(state_dir_, {run_id, 0}));
  if (auto baseline = Checkpoint::Open(dir); baseline.ok()) WriteDigestCache(state_dir_, 0, *baseline, chunk_digests);
  return Status::Ok();
}

Status PublishRun::OpenBaseline(uint64_t v, const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout,
                                std::optional<Checkpoint>* out, ChunkDigestTable* digests) {
  auto load = [&]() -> Status {
    DCR_ASSIGN_OR_RETURN(auto state, ReadBaseline(state_dir_));
    if (!state) return NotFound(state_dir_ + " holds no baseline");
    if (state->run_id != run.run_id)
      return FailedPrecondition(fmt::format("{} holds the baseline of run {}", state_dir_, state->run_id));
    if (state->version >= v)
      return FailedPrecondition(fmt::format("{} holds version {}, not below {}", state_dir_, state->version, v));
    return LoadBaseline(state->version, want, run, layout, out, digests);
  };
  Status ready = load();
  if (!ready.ok() && !Transient(ready)) {
    // Also a publisher killed while its baseline moved (a chunk half copied),
    // or deltas GC removed.
    fmt::print(stderr, "dcr publish: rebuilding the baseline of version {} from {} ({})\n", v - 1, store_.url(),
               ready.ToString());
    out->reset();
    Status rebuilt = RebuildBaseline(want, run, layout);
    if (!rebuilt.ok())
      return rebuilt.WithContext(ready.ToString() + "; rebuilding the baseline from the store failed too");
    ready = LoadBaseline(v - 1, want, run, layout, out, digests);
  }
  return ready;
}

Status PublishRun::UploadMissedSnapshot(uint64_t v, const Checkpoint& baseline, const Digest& digest) {
  auto snap = NewestSnapshot(store_, v);
  if (!snap.ok() && Transient(snap.status())) return snap.status();
  if (snap.ok() && snap->version == v) return Status::Ok();
  return UploadSnapshot(store_, v, baseline, digest, progress_)
      .WithContext(fmt::format("uploading the missed snapshot of version {}", v));
}

Result<PublishReport> PublishRun::PublishDelta(uint64_t v, const Checkpoint& next, const RunRecord& run) {
  const auto start = ClockOf(o_).Now();
  PublishReport report;
  report.version = v;
  DCR_RETURN_IF_ERROR(CheckRunTensors(next, run));
  const DeltaManifest layout = TensorTableOf(run);
  report.total_bytes = 0;
  for (const auto& t : next.tensors()) report.total_bytes += t.nbytes;

  EndStage(&report, "prepare", ClockOf(o_), start);
  const auto baseline_start = ClockOf(o_).Now();
  DCR_ASSIGN_OR_RETURN(CommitRecord base_commit, ReadCommit(store_, v - 1));
  std::optional<Checkpoint> opened;
  ChunkDigestTable base_digests;
  DCR_RETURN_IF_ERROR(OpenBaseline(v, base_commit, run, layout, &opened, &base_digests));
  report.baseline_seconds = EndStage(&report, "baseline", ClockOf(o_), baseline_start);
  Checkpoint& baseline = *opened;
  report.memory.baseline_bytes = baseline.total_bytes();
  report.memory.baseline_in_memory = OnMemoryFilesystem(state_dir_);
  for (const auto& chunks : base_digests) report.memory.digest_bytes += chunks.size() * sizeof(Digest);
  if (SnapshotDue(o_, v - 1)) {
    DCR_RETURN_IF_ERROR(UploadMissedSnapshot(v - 1, baseline, Total(base_digests)));
    EndStageAfterLast(&report, "snapshot", ClockOf(o_));
  }

  DeltaManifest manifest;  // the committed attempt's
  ChunkDigestTable target_digests;
  DCR_RETURN_IF_ERROR(coordinator_.RunAttempts(v, &report, [&](const std::string& id, DeltaClass cls) {
    return RunAttempt(v, id, cls, baseline, next, layout, base_digests, &report, &manifest, &target_digests);
  }));
  // Committed: advance the baseline to v (copy the changed chunks). A
  // crash here leaves the baseline at v-1; the next publish catches it up.
  DCR_RETURN_IF_ERROR(Fault(o_, "committed"));
  // No msync: a killed process leaves the page cache intact, and after an OS
  // crash the baseline's digest check at the next publish rebuilds it.
  const auto advance_start = ClockOf(o_).Now();
  DropDigestCache(state_dir_);
  CopyChunks(baseline, next, layout, manifest.frames);
  DCR_RETURN_IF_ERROR(WriteBaseline(state_dir_, {run.run_id, v}));
  WriteDigestCache(state_dir_, v, baseline, target_digests);
  report.advance_seconds = EndStage(&report, "advance", ClockOf(o_), advance_start);
  const auto snapshot_start = ClockOf(o_).Now();
  if (SnapshotDue(o_, v)) DCR_RETURN_IF_ERROR(UploadSnapshot(store_, v, next, manifest.target_digest, nullptr));
  EndStage(&report, "snapshot", ClockOf(o_), snapshot_start);
  // Best effort: v is committed whatever GC meets, and the next publish collects again.
  const auto gc_start = ClockOf(o_).Now();
  CollectGarbage(store_, o_.keep_versions, o_.heartbeat_timeout, ClockOf(o_)).IgnoreError();
  EndStage(&report, "gc", ClockOf(o_), gc_start);
  report.total_seconds = SecondsSince(ClockOf(o_), start);
  return report;
}

Result<PublishRun::AttemptResult> PublishRun::RunAttempt(uint64_t v, const std::string& id, DeltaClass cls,
                                                         const Checkpoint& baseline, const Checkpoint& next,
                                                         const DeltaManifest& layout,
                                                         const ChunkDigestTable& base_digests, PublishReport* report,
                                                         DeltaManifest* manifest_out,
                                                         ChunkDigestTable* target_digests_out) {
  const std::string prefix = run_keys::Attempt(v, id);
  // attempt.json names the attempt's class and delta id, so that receivers
  // can check (and apply) frames that arrive before the manifest, and the
  // public key that signs its frame objects, made for this attempt:
  // receivers verify what any other transport brings.
  const uint64_t delta_id = NewDeltaId();
  DCR_ASSIGN_OR_RETURN(const ObjectSigner signer, ObjectSigner::Generate());
  AttemptRecord attempt;
  attempt.version = v;
  attempt.cls = cls;
  attempt.delta_id = delta_id;
  attempt.object_key = signer.public_hex();
  attempt.coordinator = o_.coordinator_id;
  attempt.time = ClockOf(o_).UnixSeconds();
  DCR_RETURN_IF_ERROR(coordinator_.OpenAttempt(v, id, attempt));
  DCR_RETURN_IF_ERROR(Fault(o_, "attempt-opened"));
  EndStageAfterLast(report, "open", ClockOf(o_));  // the attempt: its id, key pair and record

  // Senders: each encodes the chunks it owns, streaming frames into its object.
  const auto encode_start = ClockOf(o_).Now();
  DeltaOptions options = o_.delta;
  options.encode.delta_class = cls;
  options.chunk_elements = layout.chunk_elements;
  DeltaManifest m = layout;
  m.delta_class = cls;
  m.delta_id = delta_id;
  const auto plan = PlanOwnership(layout, o_.senders);
  const uint64_t segment_bytes = SegmentBytes(o_, next.total_bytes());
  std::vector<Digest> all_base, all_target;
  FramesInFlight in_flight;
  for (uint32_t k = 0; k < plan.size(); ++k) {
    std::vector<Digest> tracked;
    for (const auto& c : plan[k]) tracked.push_back(base_digests[c.tensor][c.chunk]);
    SegmentedFrameWriter segments(store_, prefix, k, segment_bytes, signer, o_.relay, in_flight);
    DCR_ASSIGN_OR_RETURN(EncodedFrames encoded,
                         EncodeFrames(
                             baseline, next, m, plan[k], options.encode,
                             [&](std::string_view frame) { return segments.Write(frame); }, &tracked, progress_));
    DCR_RETURN_IF_ERROR(segments.Close());
    const uint32_t first_object = static_cast<uint32_t>(m.objects.size());
    for (auto& f : encoded.frames) {
      segments.Locate(&f);
      f.object += first_object;
      m.frames.push_back(f);
    }
    m.objects.insert(m.objects.end(), segments.names().begin(), segments.names().end());
    all_base.insert(all_base.end(), encoded.base_digests.begin(), encoded.base_digests.end());
    all_target.insert(all_target.end(), encoded.target_digests.begin(), encoded.target_digests.end());
  }
  FinishDelta(m, all_base, all_target);
  // The plan's runs are in (tensor, chunk) order, so all_target is too.
  target_digests_out->assign(m.tensors.size(), {});
  for (size_t t = 0, i = 0; t < m.tensors.size(); ++t)
    for (uint64_t c = 0; c < m.ChunkCount(t); ++c) (*target_digests_out)[t].push_back(all_target.at(i++));
  report->encode_seconds += EndStage(report, "encode", ClockOf(o_), encode_start);
  report->memory.frames_in_flight_bytes = std::max(report->memory.frames_in_flight_bytes, in_flight.peak());
  return coordinator_.PublishManifest(v, id, std::move(m), report, manifest_out);
}

Result<PublishReport> PublishVersion(Store& store, const std::string& state_dir, const PublishOptions& options,
                                     uint64_t version, const Checkpoint& next, Progress* progress) {
  PublishRun run(store, state_dir, options, progress);
  DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store));
  if (version == 0) {
    if (state.latest && *state.latest > 0)
      return FailedPrecondition(fmt::format("{} already holds versions up to {}; publish version {}", store.url(),
                                            *state.latest, *state.latest + 1));
    return run.PublishSnapshot(next);
  }
  if (!state.run) return FailedPrecondition(fmt::format("{} holds no run; publish version 0 first", store.url()));
  if (!state.latest || *state.latest < version - 1)
    return FailedPrecondition(fmt::format("version {} is not committed (latest: {}); publish versions in order",
                                          version - 1, state.latest ? std::to_string(*state.latest) : "none"));
  if (*state.latest >= version) {
    // Already committed (a retried publish): fine when it holds these bits.
    DCR_ASSIGN_OR_RETURN(CommitRecord c, ReadCommit(store, version));
    DCR_RETURN_IF_ERROR(CheckRunTensors(next, *state.run));
    if (Total(ChunkDigests(next, TensorTableOf(*state.run))) != c.target_digest)
      return AlreadyExists(fmt::format("version {} is already committed with other bits; publish version {}", version,
                                       *state.latest + 1));
    PublishReport report;
    report.version = version;
    report.attempt = c.attempt;
    report.already_committed = true;
    return report;
  }
  return run.PublishDelta(version, next, *state.run);
}

}  // namespace

Result<PublishReport> Publisher::Publish(uint64_t version, const Checkpoint& next, Progress* progress) {
  DCR_ASSIGN_OR_RETURN(const std::string dir, PublisherStateDir(state_dir_, store_));
  DCR_ASSIGN_OR_RETURN(StateDirLock lock, StateDirLock::Acquire(dir));
  auto r = PublishVersion(store_, dir, options_, version, next, progress);
  if (r.ok()) r->state_dir = dir;
  RecordPublish(store_, options_.coordinator_id, "publisher", r);
  return r;
}

}  // namespace dcr
