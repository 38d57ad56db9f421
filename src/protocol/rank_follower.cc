// A rank of an engine following the run into its own buffers
// (docs/protocol.md, "Engines of several ranks").
#include <fmt/format.h>
#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "dcr/layout_apply.h"
#include "internal.h"
#include "journals.h"

namespace dcr {

using namespace protocol_internal;
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
    auto it = std::find_if(run.tensors.begin(), run.tensors.end(), [&](const DeltaTensor& r) { return r.name == t.name; });
    if (it == run.tensors.end())
      return InvalidArgument(fmt::format("the rank's map names tensor '{}', which run {} does not hold; generate the map "
                                         "for this model",
                                         t.name, run.run_id));
    if (it->dtype != t.dtype || it->shape != t.shape)
      return InvalidArgument(fmt::format("tensor '{}' is {} [{}] in the rank's map but {} [{}] in run {}", t.name,
                                         Name(t.dtype), fmt::join(t.shape, ", "), Name(it->dtype),
                                         fmt::join(it->shape, ", "), run.run_id));
  }
  return Status::Ok();
}

class RankRun {
 public:
  // `given`: the rank's buffers in memory (the caller's), or null for
  // buffer files in `dir`.
  RankRun(Store& store, const CompiledLayout& layout, const std::string& dir, const PlacedRank* given,
          const EngineRank& rank, const FollowOptions& o, uint64_t* version, bool* holds)
      : store_(store), layout_(layout), dir_(dir), given_(given), rank_(rank), o_(o), version_out_(version),
        holds_out_(holds),
        heartbeat_(store, o.id, rank, o.heartbeat_every, [this](const std::string& l) { Log(l); }) {}

  Status Run(std::optional<uint64_t> until, const std::function<bool()>& stop);

 private:
  void Log(const std::string& line) { FollowLog(o_, line); }
  Status Fault(std::string_view point) { return o_.fault ? o_.fault(point) : Status::Ok(); }
  Digest Partial() const { return Total(tracked_); }

  Status Start(const std::function<bool()>& stop);
  Status Join(uint64_t at_most, const std::string& why);
  // Makes placed_ the rank's buffers: the given ones, or the buffer files
  // (opened; created zero-filled when `create`).
  Status Open(bool create);
  Status Commit(uint64_t v);
  Status Step();
  // Frames applied, found done by this attempt, left to the manifest.
  struct Counts {
    uint64_t applied = 0, already = 0, left = 0;
  };
  // Applies every frame of `delta` (attempt `id`) to the rank's elements,
  // journaling the attempt first; the tracked partials follow each frame.
  Status ApplyAttempt(const std::string& id, const DeltaReader& delta, Counts* counts);
  // Makes attempt `id` the journal's, with a frame log of its own (kept when
  // it is already the journal's and its log is known).
  Status Begin(const std::string& id);
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
  Status ApplyFrames(const DeltaManifest& m, std::span<const FrameView> frames, bool strict, Counts* counts);
  // Frames of attempt `a` of version v that arrived before its manifest.
  Status StreamApply(uint64_t v, const AttemptInfo& a);

  Store& store_;
  const CompiledLayout& layout_;
  const std::string& dir_;
  const PlacedRank* given_;
  const EngineRank& rank_;
  const FollowOptions& o_;
  uint64_t* version_out_;
  bool* holds_out_;
  RunRecord run_;
  DeltaManifest shape_;  // the run's tensors and chunking
  RankJournal journal_;
  std::optional<RankBufferFiles> files_;
  std::optional<PlacedRank> placed_;  // set while the buffers are open and hold a version (or a join is loading them)
  ChunkDigestTable tracked_;  // the rank's partial digest of every chunk, as its buffers hold them
  std::set<std::string> handled_;
  std::map<uint64_t, int> commit_failures_;
  // What the journal's attempt did to the chunks it touched: done (at the
  // logged target) or not (interrupted); logged_: its frame log is known.
  FrameLog touched_;
  bool logged_ = false;
  // Frame objects of version + 1's streaming attempts downloaded before
  // their manifest (full key -> bytes); LoadAttempt takes them from here.
  std::map<std::string, std::string> prefetched_;
  struct Streamed {
    StreamedAttempt attempt;
    DeltaManifest manifest;         // the run's shape with the attempt's delta id and class
    std::set<std::string> objects;  // frame objects looked at
    Counts counts;
  };
  std::map<std::string, Streamed> streamed_;
  Heartbeat heartbeat_;
};

Status RankRun::Open(bool create) {
  placed_.reset();
  files_.reset();
  if (given_ != nullptr) {
    placed_ = *given_;
    return Status::Ok();
  }
  auto f = create ? RankBufferFiles::Create(layout_, dir_) : RankBufferFiles::Open(layout_, dir_);
  if (!f.ok()) return f.status();
  files_.emplace(std::move(*f));
  placed_ = files_->placed();
  return Status::Ok();
}

Status RankRun::Commit(uint64_t v) {
  heartbeat_.SetVersion(v);
  *version_out_ = v;
  journal_.version = v;
  journal_.digest = Partial();
  journal_.attempt.clear();
  journal_.attempt_state.clear();
  journal_.attempt_digest = Digest{};
  touched_.clear();
  logged_ = false;
  prefetched_.clear();
  streamed_.clear();
  return WriteRankJournal(dir_, journal_);
}

Status RankRun::Join(uint64_t at_most, const std::string& why) {
  placed_.reset();
  files_.reset();
  DCR_ASSIGN_OR_RETURN(SnapshotRecord snap, NewestSnapshot(store_, at_most));
  Log(fmt::format("joining from the snapshot of version {} ({})", snap.version, why));
  heartbeat_.Set("joining").IgnoreError();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir_);
  journal_ = RankJournal{run_.run_id, o_.id, rank_, snap.version, {}, std::string(kJoining), "", {}};
  DCR_RETURN_IF_ERROR(WriteRankJournal(dir_, journal_));
  // The snapshot beside the buffers, loaded through the map, then removed.
  const std::string tmp = (fs::path(dir_) / kSnapshotDir).string();
  fs::remove_all(tmp, ec);
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store_, snap, tmp, nullptr));
  {
    DCR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(tmp));
    DCR_RETURN_IF_ERROR(CheckRunTensors(ckpt, run_));
    if (Total(ChunkDigests(ckpt, shape_)) != snap.digest)
      return DataLoss(fmt::format("{}: the snapshot of version {} does not have its recorded digest", store_.url(),
                                  snap.version));
    DCR_RETURN_IF_ERROR(Open(/*create=*/true));
    if (Status loaded = LoadDense(CheckpointBytes(ckpt), *placed_); !loaded.ok()) {
      placed_.reset();  // half loaded: the next step joins again
      return loaded;
    }
  }
  fs::remove_all(tmp, ec);
  tracked_ = RankChunkDigests(*placed_, shape_);
  return Commit(snap.version);
}

Status RankRun::Start(const std::function<bool()>& stop) {
  RunState state;
  for (;;) {
    DCR_ASSIGN_OR_RETURN(state, ReadRunState(store_));
    if (state.run && state.latest) break;
    if (stop && stop()) return Aborted("stopped before the run started");
    std::this_thread::sleep_for(o_.poll);
  }
  run_ = *state.run;
  shape_ = LayoutOf(run_);
  DCR_RETURN_IF_ERROR(CheckMapFitsRun(layout_, run_));
  DCR_ASSIGN_OR_RETURN(auto journal, ReadRankJournal(dir_));
  if (!journal) return Join(*state.latest, "new rank");
  if (journal->run_id != run_.run_id)
    return FailedPrecondition(fmt::format("{} follows run {}, but {} holds run {}; follow into an empty directory to "
                                          "join this run",
                                          dir_, journal->run_id, store_.url(), run_.run_id));
  if (journal->rank != rank_)
    return FailedPrecondition(fmt::format("{} holds rank {} of {} of engine '{}', not rank {} of {} of engine '{}'; "
                                          "give each rank its own directory",
                                          dir_, journal->rank.rank, journal->rank.ranks, journal->rank.engine,
                                          rank_.rank, rank_.ranks, rank_.engine));
  journal_ = *journal;
  journal_.receiver = o_.id;
  *version_out_ = journal_.version;
  heartbeat_.SetVersion(journal_.version);
  if (journal_.attempt == kJoining) return Join(*state.latest, "restarted while joining");
  if (Status s = Open(/*create=*/false); !s.ok())
    return Join(*state.latest, "cannot open the buffers: " + s.ToString());
  tracked_ = RankChunkDigests(*placed_, shape_);
  const Digest d = Partial();
  if (journal_.attempt.empty() && d != journal_.digest)
    return Join(*state.latest, fmt::format("the buffers do not hold version {} as the journal claims", journal_.version));
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
    Log(fmt::format("restarted while applying attempt {}; its frame log names {} chunks it touched", journal_.attempt,
                    touched_.size()));
  else if (!journal_.attempt.empty() && !(journal_.attempt_state == "applied" && d == journal_.attempt_digest))
    Log(fmt::format("restarted after attempt {} ({}) touched the buffers; an overwrite attempt or a rejoin repairs them",
                    journal_.attempt, journal_.attempt_state));
  return Status::Ok();
}

Status RankRun::Begin(const std::string& id) {
  if (journal_.attempt == id && logged_) return Status::Ok();
  // The log first: a journal naming the attempt always has its log.
  DCR_RETURN_IF_ERROR(StartFrameLog(dir_, id));
  touched_.clear();
  logged_ = true;
  journal_.attempt = id;
  journal_.attempt_state = "applying";
  return WriteRankJournal(dir_, journal_);
}

Status RankRun::ApplyFrames(const DeltaManifest& m, std::span<const FrameView> frames, bool strict, Counts* counts) {
  std::vector<size_t> todo;
  std::set<ChunkKey> batch;
  std::string before, after;
  Status first;
  auto refuse = [&](size_t i, Status s) {
    if (strict) {
      if (first.ok()) first = s;
    } else {
      Log(fmt::format("frame {} of a streamed object: not applied before the manifest: {}", i, s.ToString()));
      ++counts->left;
    }
  };
  for (size_t i = 0; i < frames.size() && (first.ok() || !strict); ++i) {
    const FrameHeader& h = frames[i].header;
    const ChunkKey key{h.tensor, h.chunk};
    if (h.tensor >= tracked_.size() || h.chunk >= tracked_[h.tensor].size()) {
      refuse(i, InvalidArgument(fmt::format("a frame names tensor {} chunk {}, which the run does not have", h.tensor,
                                            h.chunk)));
      continue;
    }
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
  if (!todo.empty()) {
    DCR_RETURN_IF_ERROR(AppendFrameLog(dir_, before));
    for (size_t i : todo) {
      const FrameHeader& h = frames[i].header;
      touched_[{h.tensor, h.chunk}] = LoggedChunk{tracked_[h.tensor][h.chunk], std::nullopt};
    }
    std::vector<FrameView> batch_frames;
    std::vector<const Digest*> bases;
    for (size_t i : todo) {
      batch_frames.push_back(frames[i]);
      bases.push_back(&tracked_[frames[i].header.tensor][frames[i].header.chunk]);
    }
    auto results = ApplyRankFrames(*placed_, m, batch_frames, bases);
    for (size_t j = 0; j < todo.size(); ++j) {
      const FrameHeader& h = frames[todo[j]].header;
      if (!results[j].ok()) {
        // Refused before a byte was written: the chunk is still at its base.
        touched_.erase({h.tensor, h.chunk});
        refuse(todo[j], results[j].status());
        continue;
      }
      tracked_[h.tensor][h.chunk] = results[j]->target;
      touched_[{h.tensor, h.chunk}].target = results[j]->target;
      after += FrameLogLine('t', {h.tensor, h.chunk}, results[j]->target);
      ++counts->applied;
    }
    if (!after.empty()) DCR_RETURN_IF_ERROR(AppendFrameLog(dir_, after));
  }
  return first;
}

Status RankRun::ApplyAttempt(const std::string& id, const DeltaReader& delta, Counts* counts) {
  const DeltaManifest& m = delta.manifest();
  if (m.tensors.size() != shape_.tensors.size() || m.chunk_elements != shape_.chunk_elements)
    return InvalidArgument(fmt::format("attempt {}: its manifest's tensors or chunking are not the run's", id));
  DCR_RETURN_IF_ERROR(Begin(id));
  std::vector<FrameView> frames;
  Status s;
  for (size_t i = 0; s.ok() && i < m.frames.size(); ++i) {
    auto frame = delta.Frame(i);
    if (frame.ok()) frames.push_back(*frame);
    s = frame.status();
  }
  if (s.ok()) s = ApplyFrames(m, frames, /*strict=*/true, counts);
  journal_.attempt_state = s.ok() ? "applied" : "failed";
  journal_.attempt_digest = Partial();
  DCR_RETURN_IF_ERROR(WriteRankJournal(dir_, journal_));
  return s;
}

// Frames streamed ahead of the manifest: each checked as the follower
// checks them (ForEachStreamedFrame: checksums, attempt.json's delta id, a
// mode of its class, the run's chunk shape), then applied through the
// rank's map (ApplyRankFrame: the rank's elements at the partial digest it
// tracks, the payload decoding in full), journaled and logged as above. The
// engine-level check of the partials is the coordinator's, at the ack.
Status RankRun::StreamApply(uint64_t v, const AttemptInfo& a) {
  auto it = streamed_.find(a.id);
  if (it == streamed_.end()) {
    DCR_ASSIGN_OR_RETURN(auto attempt, ReadStreamedAttempt(store_, v, a.id, [this](const std::string& l) { Log(l); }));
    if (!attempt) return Status::Ok();
    Streamed st{*attempt, shape_, {}, {}};
    st.manifest.delta_id = attempt->delta_id;
    st.manifest.delta_class = attempt->cls;
    it = streamed_.emplace(a.id, std::move(st)).first;
  }
  Streamed& st = it->second;
  if (!st.attempt.usable || !MayApply(a.id, st.attempt.cls)) return Status::Ok();
  DCR_ASSIGN_OR_RETURN(auto todo, StreamedObjectsToApply(store_, v, a, prefetched_, &st.objects));
  if (todo.empty()) return Status::Ok();
  DCR_RETURN_IF_ERROR(Begin(a.id));
  heartbeat_.Set("applying").IgnoreError();
  DCR_RETURN_IF_ERROR(Fault("stream-applying"));
  std::vector<FrameView> frames;
  for (const auto& key : todo)
    ForEachStreamedFrame(
        key, prefetched_.at(key), shape_, st.attempt, [&](const FrameView& f, size_t) { frames.push_back(f); },
        [this](const std::string& l) { Log(l); });
  return ApplyFrames(st.manifest, frames, /*strict=*/false, &st.counts);
}

Status RankRun::Step() {
  if (!placed_) {
    DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
    return Join(*state.latest, "resuming an interrupted join");
  }
  const uint64_t v = journal_.version + 1;
  DCR_ASSIGN_OR_RETURN(auto commit_text, GetIfPresent(store_, run_keys::Commit(v)));
  if (commit_text) {
    DCR_ASSIGN_OR_RETURN(CommitRecord c,
                         CommitRecord::FromJson(*commit_text, StoreContext(store_.url(), run_keys::Commit(v))));
    if (!(journal_.attempt == c.attempt && journal_.attempt_state == "applied")) {
      // Catch up through the committed attempt: an xor attempt only on
      // buffers no attempt of v has touched (it cannot be applied twice).
      auto delta = LoadAttempt(store_, v, c.attempt, &prefetched_);
      Status s = delta.status();
      if (Transient(s)) return s;
      Counts counts;
      if (s.ok() && !MayApply(c.attempt, delta->manifest().delta_class))
        s = FailedPrecondition(fmt::format("attempt {} ({}) touched the buffers and the committed attempt {} is xor class",
                                           journal_.attempt, journal_.attempt_state, c.attempt));
      else if (s.ok())
        s = ApplyAttempt(c.attempt, *delta, &counts);
      if (Transient(s)) return s;
      if (!s.ok()) {
        if (++commit_failures_[v] > 1)
          return DataLoss(fmt::format("{}: committed version {} (attempt {}) cannot be applied even after rejoining "
                                      "from a snapshot: {}",
                                      store_.url(), v, c.attempt, s.ToString()));
        DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
        return Join(*state.latest, "cannot apply committed version " + std::to_string(v) + ": " + s.ToString());
      }
    }
    DCR_RETURN_IF_ERROR(Commit(v));
    heartbeat_.Set("following").IgnoreError();
    Log(fmt::format("at version {} (attempt {})", v, c.attempt.empty() ? "snapshot" : c.attempt));
    return Status::Ok();
  }
  DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store_, v));
  bool progressed = false, streaming = false;
  for (const auto& a : attempts) {
    if (a.fenced || handled_.count(a.id) || std::find(a.acks.begin(), a.acks.end(), o_.id) != a.acks.end()) {
      std::erase_if(prefetched_, [&](const auto& kv) { return kv.first.starts_with(run_keys::Attempt(v, a.id)); });
      continue;
    }
    if (!a.has_manifest) {
      // Streaming: download the frame objects written so far and apply the
      // newest attempt's (an older one is being replaced).
      streaming = true;
      DCR_RETURN_IF_ERROR(PrefetchFrameObjects(store_, a, &prefetched_, &progressed));
      if (a.id == attempts.back().id) DCR_RETURN_IF_ERROR(StreamApply(v, a));
      continue;
    }
    auto delta = LoadAttempt(store_, v, a.id, &prefetched_);
    if (Transient(delta.status())) return delta.status();
    heartbeat_.Set("applying").IgnoreError();
    DCR_RETURN_IF_ERROR(Fault("applying"));
    Status s = delta.status();
    // An attempt applied before a restart but not acked yet is acked again.
    const bool applied = journal_.attempt == a.id && journal_.attempt_state == "applied";
    Counts counts;
    if (s.ok() && !applied) {
      if (!MayApply(a.id, delta->manifest().delta_class))
        s = FailedPrecondition(fmt::format("attempt {} ({}) touched this rank's buffers, so an xor attempt cannot be "
                                           "applied on them; the overwrite retry repairs them",
                                           journal_.attempt, journal_.attempt_state));
      else
        s = ApplyAttempt(a.id, *delta, &counts);
    }
    DCR_RETURN_IF_ERROR(Fault("applied"));
    AckRecord ack;
    ack.receiver = o_.id;
    ack.ok = s.ok();
    ack.digest = Partial();
    ack.error = s.ok() ? "" : s.ToString();
    ack.engine = rank_;
    const Counts& st = streamed_[a.id].counts;
    Log(s.ok() ? fmt::format("applied version {} attempt {} (rank {} of {} of engine {}; streamed frames: {} applied "
                             "as they arrived, {} already done, {} left to the manifest)",
                             v, a.id, rank_.rank, rank_.ranks, rank_.engine, st.applied, st.already, st.left)
               : fmt::format("cannot apply version {} attempt {}: {}", v, a.id, s.ToString()));
    DCR_RETURN_IF_ERROR(store_.Put(run_keys::Attempt(v, a.id) + "acks/" + o_.id + ".json", ack.ToJson()));
    DCR_RETURN_IF_ERROR(Fault("acked"));
    handled_.insert(a.id);
    progressed = true;
    heartbeat_.Set("following").IgnoreError();
  }
  if (!progressed) std::this_thread::sleep_for(streaming ? std::min(o_.stream_poll, o_.poll) : o_.poll);
  return Status::Ok();
}

Status RankRun::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  return FollowLoop(
      heartbeat_, o_,
      [&] {
        Status s = Start(stop);
        *holds_out_ = s.ok() && placed_.has_value();
        return s;
      },
      [&] {
        Status s = Step();
        *holds_out_ = placed_.has_value();
        return s;
      },
      [&] { return until && journal_.version >= *until; }, stop, [this](const std::string& l) { Log(l); });
}

}  // namespace

RankFollower::RankFollower(Store& store, const CompiledLayout& layout, std::string buffers_dir, EngineRank rank,
                           FollowOptions options)
    : store_(store), layout_(layout), dir_(std::move(buffers_dir)), rank_(std::move(rank)), options_(std::move(options)) {
  if (options_.id.empty()) options_.id = fmt::format("{}-r{}", rank_.engine, rank_.rank);
}

RankFollower::RankFollower(Store& store, const PlacedRank& buffers, std::string state_dir, EngineRank rank,
                           FollowOptions options)
    : RankFollower(store, *buffers.layout, std::move(state_dir), std::move(rank), std::move(options)) {
  in_memory_ = true;
  given_ = buffers.buffers;
}

Status RankFollower::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  if (rank_.ranks == 0 || rank_.rank >= rank_.ranks || rank_.engine.empty())
    return InvalidArgument(fmt::format("rank {} of {} of engine '{}': an engine needs a name and 0 <= rank < ranks",
                                       rank_.rank, rank_.ranks, rank_.engine));
  if (Status s = ValidateKey(run_keys::Receiver(options_.id)); !s.ok())
    return InvalidArgument("receiver id '" + options_.id + "' cannot name an object: " + s.message());
  const PlacedRank given{&layout_, given_};
  if (in_memory_) DCR_RETURN_IF_ERROR(CheckRankBuffers(layout_, given_).WithContext("the rank's buffers"));
  RankRun run(store_, layout_, dir_, in_memory_ ? &given : nullptr, rank_, options_, &version_, &holds_version_);
  return run.Run(until, stop);
}

}  // namespace dcr
