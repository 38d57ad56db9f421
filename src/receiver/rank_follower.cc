// A rank of an engine following the run into its own buffers
// (docs/protocol.md, "Engines of several ranks").
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "dcr/layout_apply.h"
#include "journals.h"
#include "receiver.h"

namespace dcr {

using namespace receiver_internal;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kRankJournal = ".dcr-rank.json";
constexpr std::string_view kJoining = "snapshot";  // the journal's attempt while a join runs
constexpr std::string_view kSnapshotDir = ".dcr-snapshot";
constexpr std::string_view kFrameLog = ".dcr-rank-frames";

std::string JournalPath(const std::string& dir) { return (fs::path(dir) / kRankJournal).string(); }

Result<std::optional<RankJournal>> ReadRankJournal(const std::string& dir) {
  const std::string path = JournalPath(dir);
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<RankJournal>();
  DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path, false));
  DCR_ASSIGN_OR_RETURN(RankJournal j, ParseRankJournal(AsText(f), path));
  return std::optional<RankJournal>(std::move(j));
}

Status WriteRankJournal(const std::string& dir, const RankJournal& j) {
  return WriteFileAtomically(JournalPath(dir), RankJournalJson(j));
}

std::string FrameLogPath(const std::string& dir) { return (fs::path(dir) / kFrameLog).string(); }

Status StartFrameLog(const std::string& dir, const std::string& attempt) {
  return WriteFileAtomically(FrameLogPath(dir), FrameLogHeader(attempt));
}

Status AppendFrameLog(const std::string& dir, const std::string& lines) {
  const std::string path = FrameLogPath(dir);
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open " + path);
  const ssize_t n = ::write(fd, lines.data(), lines.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(lines.size())) return ErrnoError(n < 0 ? err : EIO, "cannot append to " + path);
  return Status::Ok();
}

// The chunks the log records for `attempt` (nullopt: no log of that attempt).
std::optional<FrameLog> ReadFrameLog(const std::string& dir, const std::string& attempt) {
  auto f = MappedFile::Open(FrameLogPath(dir), false);
  if (!f.ok()) return std::nullopt;
  return ParseFrameLog(AsText(*f), attempt);
}

// The map's tensors must be run tensors with the same dtype and shape.
Status CheckMapFitsRun(const CompiledLayout& layout, const RunRecord& run) {
  for (const LayoutTensor& t : layout.map().tensors) {
    auto it =
        std::find_if(run.tensors.begin(), run.tensors.end(), [&](const DeltaTensor& r) { return r.name == t.name; });
    if (it == run.tensors.end())
      return InvalidArgument(
          fmt::format("the rank's map names tensor '{}', which run {} does not hold; generate the map "
                      "for this model",
                      t.name, run.run_id));
    if (it->dtype != t.dtype || it->shape != t.shape)
      return InvalidArgument(fmt::format("tensor '{}' is {} [{}] in the rank's map but {} [{}] in run {}", t.name,
                                         Name(t.dtype), fmt::join(t.shape, ", "), Name(it->dtype),
                                         fmt::join(it->shape, ", "), run.run_id));
  }
  return Status::Ok();
}

// A rank with an FP8 master (`memory`'s MasterBytes) quantizes as this dcr
// does (Fp8Scheme{}): a run naming another scheme is refused.
Status CheckFp8Scheme(const BufferMemory* memory, const RunRecord& run) {
  if (!memory || memory->MasterBytes() == 0 || !run.fp8 || *run.fp8 == Fp8Scheme{}) return Status::Ok();
  return FailedPrecondition(
      fmt::format("run {} quantizes its FP8 engines as {}, and this dcr quantizes as {}; follow it with a dcr that "
                  "implements the run's scheme",
                  run.run_id, run.fp8->ToJson(), Fp8Scheme{}.ToJson()));
}

// One rank's buffers as a receiver's target. The rank holds only some
// elements of each chunk, so it cannot check a frame's whole-chunk base or
// target digest: it tracks its partial digests, applies xor frames only to
// buffers no other attempt touched, and logs every chunk an attempt writes
// (before and after) so that a restart applies no frame twice. The
// engine-level check of the partials is the coordinator's, at the ack.
class RankTarget final : public ReceiverTarget {
 public:
  // `given`: the rank's buffers in memory (the caller's), or null for
  // buffer files in `dir`. `changed`: the map tensors written, by index.
  RankTarget(const CompiledLayout& layout, std::string dir, std::optional<PlacedRank> given, EngineRank rank,
             std::string id, std::vector<bool>* changed, std::function<void(const std::string&)> log)
      : layout_(layout),
        dir_(std::move(dir)),
        given_(std::move(given)),
        rank_(std::move(rank)),
        id_(std::move(id)),
        changed_(changed),
        log_(std::move(log)) {}

  Result<std::optional<uint64_t>> Resume(Store& store, const RunRecord& run, uint64_t latest,
                                         std::string* join_why) override;
  Status Join(Store& store, const RunRecord& run, const SnapshotRecord& snap) override;
  bool Open() const override { return placed_.has_value(); }
  Status Commit(uint64_t v) override;
  bool AtCommit(const CommitRecord& c) const override {
    return journal_.attempt == c.attempt && journal_.attempt_state == "applied";
  }
  Digest AckDigest() const override { return Total(tracked_); }
  EngineRank Engine() const override { return rank_; }
  uint64_t MasterBytes() const override { return given_ && given_->memory ? given_->memory->MasterBytes() : 0; }
  bool MayStream(const std::string& id, DeltaClass cls) const override { return MayApply(id, cls); }
  const HeldChunks* Held() const override { return held_ ? &*held_ : nullptr; }
  // Makes attempt `id` the journal's, with a frame log of its own (kept when
  // it is already the journal's and its log is known).
  Status Begin(const std::string& id) override;
  Status ApplyAttempt(const std::string& id, const DeltaReader& delta, ApplyCounts* counts) override;
  Status ApplyStreamed(const DeltaManifest& shape, std::span<const FrameView> frames, ApplyCounts* counts) override {
    return ApplyFrames(shape, frames, /*strict=*/false, counts);
  }
  Result<std::string> Recheck() override;

 private:
  // Marks the map's tensor of run tensor `t` (every map tensor when nullopt) changed.
  void MarkChanged(std::optional<uint32_t> t) {
    changed_->resize(layout_.map().tensors.size());
    if (!t) {
      std::fill(changed_->begin(), changed_->end(), true);
      return;
    }
    const int64_t i = layout_.FindTensor(shape_.tensors[*t].name);
    if (i >= 0) (*changed_)[static_cast<size_t>(i)] = true;
  }
  // Makes placed_ the rank's buffers: the given ones, or the buffer files
  // (opened; created zero-filled when `create`).
  Status OpenBuffers(bool create);
  // Whether a frame of attempt `id` in class `cls` may be applied: an xor
  // frame needs its base, so only on buffers no other attempt touched (and
  // whose chunks this attempt touched are known from its log).
  bool MayApply(const std::string& id, DeltaClass cls) const {
    return cls == DeltaClass::kOverwrite || journal_.attempt.empty() || (journal_.attempt == id && logged_);
  }
  // Applies `frames` of the journal's attempt (its manifest, or the run's
  // shape with its delta id: `m`) chunk-parallel on the default pool,
  // between frame-log records; tracked_ and touched_ follow. A frame whose
  // chunk this attempt already did is counted, not applied again; an xor
  // frame on a chunk it left in between is refused. `strict` (the manifest's
  // apply): the first error by frame order is returned; otherwise (frames
  // streamed ahead of the manifest) refused frames are logged and left.
  // Frames of chunks the rank holds no element of are passed over (no
  // frame-log lines, no decode): they would change nothing. An overwrite
  // attempt first audits the buffers (Audit).
  Status ApplyFrames(const DeltaManifest& m, std::span<const FrameView> frames, bool strict, ApplyCounts* counts);
  // tracked_ from the buffers themselves (a pass over them); on a read
  // error the buffers are closed (the walk joins again).
  Status Audit();

  const CompiledLayout& layout_;
  const std::string dir_;
  const std::optional<PlacedRank> given_;
  const EngineRank rank_;
  const std::string id_;
  std::vector<bool>* changed_;
  const std::function<void(const std::string&)> log_;
  DeltaManifest shape_;  // the run's tensors and chunking
  std::optional<HeldChunks> held_;  // the chunks of shape_ the map's copies hold elements of
  RankJournal journal_;
  std::optional<RankBufferFiles> files_;
  std::optional<PlacedRank> placed_;  // set while the buffers are open and hold a version (or a join is loading them)
  ChunkDigestTable tracked_;  // the rank's partial digest of every chunk, as its buffers hold them
  // What the journal's attempt did to the chunks it touched: done (at the
  // logged target) or not (interrupted); logged_: its frame log is known.
  FrameLog touched_;
  bool logged_ = false;
  std::string audited_;  // the journal's attempt when tracked_ was last computed from the buffers
};

Status RankTarget::OpenBuffers(bool create) {
  placed_.reset();
  files_.reset();
  if (given_) {
    placed_ = *given_;
    return Status::Ok();
  }
  auto f = create ? RankBufferFiles::Create(layout_, dir_) : RankBufferFiles::Open(layout_, dir_);
  if (!f.ok()) return f.status();
  files_.emplace(std::move(*f));
  placed_ = files_->placed();
  return Status::Ok();
}

Status RankTarget::Commit(uint64_t v) {
  journal_.version = v;
  journal_.digest = Total(tracked_);
  journal_.attempt.clear();
  journal_.attempt_state.clear();
  journal_.attempt_digest = Digest{};
  touched_.clear();
  logged_ = false;
  return WriteRankJournal(dir_, journal_);
}

Status RankTarget::Join(Store& store, const RunRecord& run, const SnapshotRecord& snap) {
  placed_.reset();
  files_.reset();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir_);
  journal_ = RankJournal{run.run_id, id_, rank_, snap.version, {}, std::string(kJoining), "", {}};
  DCR_RETURN_IF_ERROR(WriteRankJournal(dir_, journal_));
  // The snapshot beside the buffers, loaded through the map, then removed.
  const std::string tmp = (fs::path(dir_) / kSnapshotDir).string();
  fs::remove_all(tmp, ec);
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store, snap, tmp, nullptr));
  {
    DCR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(tmp));
    DCR_RETURN_IF_ERROR(CheckRunTensors(ckpt, run));
    if (Total(ChunkDigests(ckpt, shape_)) != snap.digest)
      return DataLoss(
          fmt::format("{}: the snapshot of version {} does not have its recorded digest", store.url(), snap.version));
    DCR_RETURN_IF_ERROR(OpenBuffers(/*create=*/true));
    MarkChanged(std::nullopt);
    if (Status loaded = LoadDense(CheckpointBytes(ckpt), *placed_); !loaded.ok()) {
      placed_.reset();  // half loaded: the next step joins again
      return loaded;
    }
  }
  fs::remove_all(tmp, ec);
  return Audit();
}

Result<std::optional<uint64_t>> RankTarget::Resume(Store& store, const RunRecord& run, uint64_t /*latest*/,
                                                   std::string* join_why) {
  placed_.reset();
  files_.reset();
  shape_ = TensorTableOf(run);
  DCR_RETURN_IF_ERROR(CheckMapFitsRun(layout_, run));
  DCR_RETURN_IF_ERROR(CheckFp8Scheme(given_ ? given_->memory : nullptr, run));
  held_.emplace(shape_, RankHeldChunks(layout_, shape_));
  auto join = [&](std::string why) -> std::optional<uint64_t> {
    *join_why = std::move(why);
    return std::nullopt;
  };
  DCR_ASSIGN_OR_RETURN(auto journal, ReadRankJournal(dir_));
  if (!journal) return join("new rank");
  if (journal->run_id != run.run_id)
    return FailedPrecondition(
        fmt::format("{} follows run {}, but {} holds run {}; follow into an empty directory to "
                    "join this run",
                    dir_, journal->run_id, store.url(), run.run_id));
  if (journal->rank != rank_)
    return FailedPrecondition(fmt::format(
        "{} holds rank {} of {} of engine '{}', not rank {} of {} of engine '{}'; "
        "give each rank its own directory",
        dir_, journal->rank.rank, journal->rank.ranks, journal->rank.engine, rank_.rank, rank_.ranks, rank_.engine));
  journal_ = *journal;
  journal_.receiver = id_;
  touched_.clear();
  logged_ = false;
  if (journal_.attempt == kJoining) return join("restarted while joining");
  if (Status s = OpenBuffers(/*create=*/false); !s.ok()) return join("cannot open the buffers: " + s.ToString());
  if (Status s = Audit(); !s.ok()) return join("cannot read the buffers: " + s.ToString());
  MarkChanged(std::nullopt);  // reopened: the caller has not seen these bits through Run
  const Digest d = Total(tracked_);
  if (journal_.attempt.empty() && d != journal_.digest) {
    placed_.reset();
    return join(fmt::format("the buffers do not hold version {} as the journal claims", journal_.version));
  }
  if (!journal_.attempt.empty()) {
    // Chunks the attempt finished are at their logged target; one logged
    // but not finished is still at its base (nothing written) or in between.
    auto logged = ReadFrameLog(dir_, journal_.attempt);
    logged_ = logged.has_value();
    if (logged)
      for (const auto& [key, c] : *logged) {
        if (key.first >= tracked_.size() || key.second >= tracked_[key.first].size()) continue;
        const Digest& now = tracked_[key.first][key.second];
        if (c.target && now == *c.target) touched_[key] = c;
        else if (now != c.base) touched_[key] = LoggedChunk{c.base, std::nullopt};
      }
  }
  if (logged_ && journal_.attempt_state == "applying")
    log_(fmt::format("restarted while applying attempt {}; its frame log names {} chunks it touched", journal_.attempt,
                     touched_.size()));
  else if (!journal_.attempt.empty() && !(journal_.attempt_state == "applied" && d == journal_.attempt_digest))
    log_(fmt::format(
        "restarted after attempt {} ({}) touched the buffers; an overwrite attempt or a rejoin repairs them",
        journal_.attempt, journal_.attempt_state));
  return std::optional<uint64_t>(journal_.version);
}

Status RankTarget::Begin(const std::string& id) {
  if (journal_.attempt == id && logged_) return Status::Ok();
  // The log first: a journal naming the attempt always has its log.
  DCR_RETURN_IF_ERROR(StartFrameLog(dir_, id));
  touched_.clear();
  logged_ = true;
  journal_.attempt = id;
  journal_.attempt_state = "applying";
  return WriteRankJournal(dir_, journal_);
}

Status RankTarget::Audit() {
  auto digests = RankChunkDigests(*placed_, shape_);
  if (!digests.ok()) {
    placed_.reset();
    return digests.status();
  }
  tracked_ = std::move(*digests);
  audited_ = journal_.attempt;
  return Status::Ok();
}

Result<std::string> RankTarget::Recheck() {
  if (!placed_ || !journal_.attempt.empty()) return std::string();  // Resume audits these
  DCR_ASSIGN_OR_RETURN(ChunkDigestTable now, RankChunkDigests(*placed_, shape_));
  if (now.size() != tracked_.size()) return std::string("the chunk table changed");
  std::vector<std::string> named;
  size_t differ = 0;
  for (size_t t = 0; t < now.size(); ++t)
    for (size_t c = 0; c < now[t].size() && c < tracked_[t].size(); ++c) {
      if (now[t][c] == tracked_[t][c]) continue;
      if (++differ > 3) continue;
      const uint64_t first = c * shape_.chunk_elements;
      const uint64_t end = std::min(first + shape_.chunk_elements, shape_.tensors[t].elements);
      named.push_back(fmt::format("tensor '{}' chunk {} (elements {}..{})", shape_.tensors[t].name, c, first, end - 1));
    }
  if (differ == 0) return std::string();
  std::string out = fmt::format("{}", fmt::join(named, ", "));
  if (differ > named.size()) out += fmt::format(" and {} more chunks", differ - named.size());
  return out;
}

Status RankTarget::ApplyFrames(const DeltaManifest& m, std::span<const FrameView> frames, bool strict,
                               ApplyCounts* counts) {
  // A retry (an overwrite attempt) starts from the bits themselves: tracked
  // partials see only what this rank wrote, and the failure may have been
  // bits changed behind its back.
  if (m.delta_class == DeltaClass::kOverwrite && audited_ != journal_.attempt) DCR_RETURN_IF_ERROR(Audit());
  std::vector<size_t> todo;
  std::set<ChunkKey> batch;
  std::string before, after;
  Status first;
  auto refuse = [&](size_t i, Status s) {
    if (strict) {
      if (first.ok()) first = s;
    } else {
      log_(fmt::format("frame {} of a streamed object: not applied before the manifest: {}", i, s.ToString()));
      ++counts->left;
    }
  };
  for (size_t i = 0; i < frames.size() && (first.ok() || !strict); ++i) {
    const FrameHeader& h = frames[i].header;
    const ChunkKey key{h.tensor, h.chunk};
    if (h.tensor >= tracked_.size() || h.chunk >= tracked_[h.tensor].size()) {
      refuse(i, InvalidArgument(
                    fmt::format("a frame names tensor {} chunk {}, which the run does not have", h.tensor, h.chunk)));
      continue;
    }
    if (held_ && !held_->Holds({h.tensor, h.chunk})) continue;  // none of its elements here: it changes nothing
    const Digest& now = tracked_[h.tensor][h.chunk];
    if (!batch.insert(key).second) {
      refuse(i, InvalidArgument(fmt::format("two frames of tensor {} chunk {}", h.tensor, h.chunk)));
      continue;
    }
    if (auto t = touched_.find(key); t != touched_.end()) {
      if (t->second.target && now == *t->second.target) {
        ++counts->already;
        continue;
      }
      if (h.mode != Mode::kOverwrite) {
        refuse(i, FailedPrecondition(fmt::format("tensor '{}' chunk {}: an earlier apply of this attempt was "
                                                 "interrupted there; an overwrite frame repairs it",
                                                 shape_.tensors[h.tensor].name, h.chunk)));
        continue;
      }
    }
    todo.push_back(i);
    before += FrameLogLine('b', {h.tensor, h.chunk}, now);
  }
  if (todo.empty()) return first;
  DCR_RETURN_IF_ERROR(AppendFrameLog(dir_, before));
  std::vector<FrameView> batch_frames;
  std::vector<Digest> current;
  for (size_t i : todo) {
    const FrameHeader& h = frames[i].header;
    touched_[{h.tensor, h.chunk}] = LoggedChunk{tracked_[h.tensor][h.chunk], std::nullopt};
    batch_frames.push_back(frames[i]);
    current.push_back(tracked_[h.tensor][h.chunk]);
  }
  const auto results = ApplyRankFrames(*placed_, m, batch_frames, current);
  for (size_t j = 0; j < todo.size(); ++j) {
    const FrameHeader& h = frames[todo[j]].header;
    if (!results[j].status.ok()) {
      // Refused before a byte was written, the chunk is still at its base;
      // torn (the memory failed part way), it is in between.
      if (!results[j].torn) touched_.erase({h.tensor, h.chunk});
      refuse(todo[j], results[j].status);
      continue;
    }
    tracked_[h.tensor][h.chunk] = results[j].after;
    touched_[{h.tensor, h.chunk}].target = results[j].after;
    MarkChanged(h.tensor);
    after += FrameLogLine('t', {h.tensor, h.chunk}, results[j].after);
    ++(results[j].outcome == ApplyOutcome::kApplied ? counts->applied : counts->already);
  }
  if (!after.empty()) DCR_RETURN_IF_ERROR(AppendFrameLog(dir_, after));
  return first;
}

Status RankTarget::ApplyAttempt(const std::string& id, const DeltaReader& delta, ApplyCounts* counts) {
  // Applied before a restart but not acked (or committed) yet: done.
  if (journal_.attempt == id && journal_.attempt_state == "applied") return Status::Ok();
  const DeltaManifest& m = delta.manifest();
  if (!MayApply(id, m.delta_class))
    return FailedPrecondition(
        fmt::format("attempt {} ({}) touched this rank's buffers, so an xor attempt cannot be "
                    "applied on them; an overwrite attempt or a rejoin repairs them",
                    journal_.attempt, journal_.attempt_state));
  if (m.tensors.size() != shape_.tensors.size() || m.chunk_elements != shape_.chunk_elements)
    return InvalidArgument(fmt::format("attempt {}: its manifest's tensors or chunking are not the run's", id));
  DCR_RETURN_IF_ERROR(Begin(id));
  std::vector<FrameView> frames;
  Status s;
  for (size_t i = 0; s.ok() && i < m.frames.size(); ++i) {
    if (delta.Skipped(i)) {  // the walk skips only objects without this rank's chunks
      if (held_ && held_->Holds({m.frames[i].tensor, m.frames[i].chunk}))
        s =
            Internal(fmt::format("attempt {}: the frame object of tensor {} chunk {}, which this rank holds, was "
                                 "not fetched",
                                 id, m.frames[i].tensor, m.frames[i].chunk));
      continue;
    }
    auto frame = delta.Frame(i);
    if (frame.ok()) frames.push_back(*frame);
    s = frame.status();
  }
  if (s.ok()) s = ApplyFrames(m, frames, /*strict=*/true, counts);
  journal_.attempt_state = s.ok() ? "applied" : "failed";
  journal_.attempt_digest = Total(tracked_);
  DCR_RETURN_IF_ERROR(WriteRankJournal(dir_, journal_));
  return s;
}

}  // namespace

RankFollower::RankFollower(Store& store, const CompiledLayout& layout, std::string buffers_dir, EngineRank rank,
                           FollowOptions options)
    : store_(store),
      layout_(layout),
      dir_(std::move(buffers_dir)),
      rank_(std::move(rank)),
      options_(std::move(options)) {
  if (options_.id.empty()) options_.id = fmt::format("{}-r{}", rank_.engine, rank_.rank);
}

RankFollower::RankFollower(Store& store, const PlacedRank& buffers, std::string state_dir, EngineRank rank,
                           FollowOptions options)
    : RankFollower(store, *buffers.layout, std::move(state_dir), std::move(rank), std::move(options)) {
  in_memory_ = true;
  given_ = buffers;
}

Status RankFollower::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  if (rank_.ranks == 0 || rank_.rank >= rank_.ranks || rank_.engine.empty())
    return InvalidArgument(fmt::format("rank {} of {} of engine '{}': an engine needs a name and 0 <= rank < ranks",
                                       rank_.rank, rank_.ranks, rank_.engine));
  if (Status s = ValidateKey(run_keys::Receiver(options_.id)); !s.ok())
    return InvalidArgument("receiver id '" + options_.id + "' cannot name an object: " + s.message());
  if (!walk_) {
    if (in_memory_) DCR_RETURN_IF_ERROR(CheckRankBuffers(given_).WithContext("the rank's buffers"));
    const FollowOptions& o = options_;
    target_ = std::make_unique<RankTarget>(layout_, dir_, in_memory_ ? std::optional<PlacedRank>(given_) : std::nullopt,
                                           rank_, o.id, &changed_, [o](const std::string& l) { FollowLog(o, l); });
    walk_ = std::make_unique<ReceiverWalk>(store_, *target_, options_);
  }
  return walk_->Run(until, stop);
}

Status RankFollower::Adopt(uint64_t version, const Digest& engine_digest) {
  if (walk_) return FailedPrecondition("RankFollower::Adopt: the follower already runs");
  if (rank_.ranks == 0 || rank_.rank >= rank_.ranks || rank_.engine.empty())
    return InvalidArgument(fmt::format("rank {} of {} of engine '{}': an engine needs a name and 0 <= rank < ranks",
                                       rank_.rank, rank_.ranks, rank_.engine));
  DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
  if (!state.run) return NotFound(fmt::format("{}: no run to adopt a version of", store_.url()));
  const RunRecord& run = *state.run;
  DCR_RETURN_IF_ERROR(CheckMapFitsRun(layout_, run));
  DCR_RETURN_IF_ERROR(CheckFp8Scheme(in_memory_ ? given_.memory : nullptr, run));
  DCR_ASSIGN_OR_RETURN(CommitRecord commit, ReadCommit(store_, version));
  if (commit.target_digest != engine_digest)
    return FailedPrecondition(fmt::format(
        "the engine's buffers (digest {}) do not hold version {} (digest {}); it joins from a snapshot instead",
        engine_digest.ToHex(), version, commit.target_digest.ToHex()));
  std::optional<RankBufferFiles> files;
  PlacedRank placed = given_;
  if (!in_memory_) {
    DCR_ASSIGN_OR_RETURN(files, RankBufferFiles::Open(layout_, dir_));
    placed = files->placed();
  }
  DCR_ASSIGN_OR_RETURN(const Digest mine, RankDigest(placed));
  if (rank_.ranks == 1 && mine != engine_digest)
    return FailedPrecondition(fmt::format("rank 0 of 1 holds digest {}, not the engine digest {} it was given",
                                          mine.ToHex(), engine_digest.ToHex()));
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir_);
  return WriteRankJournal(dir_, RankJournal{run.run_id, options_.id, rank_, version, mine, "", "", {}});
}

RankFollower::RankFollower(RankFollower&&) noexcept = default;
RankFollower::~RankFollower() = default;
uint64_t RankFollower::version() const { return walk_ ? walk_->version() : 0; }
bool RankFollower::holds_version() const { return target_ && target_->Open(); }

std::string RankFollower::OutsideChanges() const { return walk_ ? walk_->outside_changes() : std::string(); }

std::vector<std::string> RankFollower::TakeChangedTensors() {
  std::vector<std::string> out;
  for (size_t t = 0; t < changed_.size(); ++t)
    if (changed_[t]) out.push_back(layout_.map().tensors[t].name);
  changed_.assign(changed_.size(), false);
  return out;
}

}  // namespace dcr
