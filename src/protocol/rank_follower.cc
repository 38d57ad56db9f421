// A rank of an engine following the run into its own buffers
// (docs/protocol.md, "Engines of several ranks").
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "dcr/layout_apply.h"
#include "internal.h"

namespace dcr {

using namespace protocol_internal;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kRankJournal = ".dcr-rank.json";
constexpr std::string_view kJoining = "snapshot";  // the journal's attempt while a join runs
constexpr std::string_view kSnapshotDir = ".dcr-snapshot";

// DIR/.dcr-rank.json: what the rank's buffers hold. `digest` is the rank's
// partial digest at `version` (its share of the committed digest). `attempt`
// names the attempt of version + 1 that last touched the buffers (empty:
// none), with its state (applying: it may be half applied; applied; failed)
// and the partial digest it left.
struct RankJournal {
  std::string run_id, receiver;
  EngineRank rank;
  uint64_t version = 0;
  Digest digest;
  std::string attempt, attempt_state;
  Digest attempt_digest;
};

std::string JournalPath(const std::string& dir) { return (fs::path(dir) / kRankJournal).string(); }

Result<std::optional<RankJournal>> ReadRankJournal(const std::string& dir) {
  const std::string path = JournalPath(dir);
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<RankJournal>();
  DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path, false));
  auto doc = nlohmann::json::parse(f.data().begin(), f.data().end(), nullptr, false);
  RankJournal j;
  auto bad = [&] {
    return InvalidArgument(path + ": does not parse; remove the directory's files to rejoin from a snapshot");
  };
  if (doc.is_discarded() || !doc.is_object()) return bad();
  for (const char* k : {"run_id", "receiver", "engine", "digest", "attempt", "attempt_state", "attempt_digest"})
    if (!doc[k].is_string()) return bad();
  for (const char* k : {"rank", "ranks", "version"})
    if (!doc[k].is_number_unsigned()) return bad();
  j.run_id = doc["run_id"];
  j.receiver = doc["receiver"];
  j.rank.engine = doc["engine"];
  j.rank.rank = doc["rank"].get<uint32_t>();
  j.rank.ranks = doc["ranks"].get<uint32_t>();
  j.version = doc["version"];
  j.attempt = doc["attempt"];
  j.attempt_state = doc["attempt_state"];
  if (!Digest::FromHex(doc["digest"].get<std::string>(), &j.digest) ||
      !Digest::FromHex(doc["attempt_digest"].get<std::string>(), &j.attempt_digest))
    return bad();
  return std::optional<RankJournal>(j);
}

Status WriteRankJournal(const std::string& dir, const RankJournal& j) {
  nlohmann::json doc = {{"run_id", j.run_id},        {"receiver", j.receiver},
                        {"engine", j.rank.engine},   {"rank", j.rank.rank},
                        {"ranks", j.rank.ranks},     {"version", j.version},
                        {"digest", j.digest.ToHex()}, {"attempt", j.attempt},
                        {"attempt_state", j.attempt_state}, {"attempt_digest", j.attempt_digest.ToHex()}};
  return WriteFileAtomically(JournalPath(dir), doc.dump(1) + "\n");
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
  // Applies every frame of `delta` (attempt `id`) to the rank's elements,
  // journaling the attempt first; the tracked partials follow each frame.
  Status ApplyAttempt(const std::string& id, const DeltaReader& delta);

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
  std::vector<uint8_t> scratch_;
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
  if (!journal_.attempt.empty() && !(journal_.attempt_state == "applied" && d == journal_.attempt_digest))
    Log(fmt::format("restarted after attempt {} ({}) touched the buffers; an overwrite attempt or a rejoin repairs them",
                    journal_.attempt, journal_.attempt_state));
  return Status::Ok();
}

Status RankRun::ApplyAttempt(const std::string& id, const DeltaReader& delta) {
  journal_.attempt = id;
  journal_.attempt_state = "applying";
  DCR_RETURN_IF_ERROR(WriteRankJournal(dir_, journal_));
  const DeltaManifest& m = delta.manifest();
  if (m.tensors.size() != shape_.tensors.size() || m.chunk_elements != shape_.chunk_elements)
    return InvalidArgument(fmt::format("attempt {}: its manifest's tensors or chunking are not the run's", id));
  PlacedRank& placed = *placed_;
  Status s;
  for (size_t i = 0; s.ok() && i < m.frames.size(); ++i) {
    auto frame = delta.Frame(i);
    if (!frame.ok()) {
      s = frame.status();
      break;
    }
    Digest& tracked = tracked_[frame->header.tensor][frame->header.chunk];
    auto r = ApplyRankFrame(placed, m, *frame, &scratch_, &tracked);
    if (r.ok()) tracked = r->target;
    s = r.status();
  }
  journal_.attempt_state = s.ok() ? "applied" : "failed";
  journal_.attempt_digest = Partial();
  DCR_RETURN_IF_ERROR(WriteRankJournal(dir_, journal_));
  return s;
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
      auto delta = LoadAttempt(store_, v, c.attempt);
      Status s = delta.status();
      if (Transient(s)) return s;
      if (s.ok() && delta->manifest().delta_class == DeltaClass::kXorClass && !journal_.attempt.empty())
        s = FailedPrecondition(fmt::format("attempt {} ({}) touched the buffers and the committed attempt {} is xor class",
                                           journal_.attempt, journal_.attempt_state, c.attempt));
      else if (s.ok())
        s = ApplyAttempt(c.attempt, *delta);
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
  bool progressed = false;
  for (const auto& a : attempts) {
    if (a.fenced || !a.has_manifest || handled_.count(a.id) ||
        std::find(a.acks.begin(), a.acks.end(), o_.id) != a.acks.end())
      continue;
    auto delta = LoadAttempt(store_, v, a.id);
    if (Transient(delta.status())) return delta.status();
    heartbeat_.Set("applying").IgnoreError();
    DCR_RETURN_IF_ERROR(Fault("applying"));
    Status s = delta.status();
    // An attempt applied before a restart but not acked yet is acked again.
    const bool applied = journal_.attempt == a.id && journal_.attempt_state == "applied";
    if (s.ok() && !applied) {
      if (delta->manifest().delta_class == DeltaClass::kXorClass && !journal_.attempt.empty())
        s = FailedPrecondition(fmt::format("attempt {} ({}) touched this rank's buffers, so an xor attempt cannot be "
                                           "applied on them; the overwrite retry repairs them",
                                           journal_.attempt, journal_.attempt_state));
      else
        s = ApplyAttempt(a.id, *delta);
    }
    DCR_RETURN_IF_ERROR(Fault("applied"));
    AckRecord ack;
    ack.receiver = o_.id;
    ack.ok = s.ok();
    ack.digest = Partial();
    ack.error = s.ok() ? "" : s.ToString();
    ack.engine = rank_;
    Log(s.ok() ? fmt::format("applied version {} attempt {} (rank {} of {} of engine {})", v, a.id, rank_.rank,
                             rank_.ranks, rank_.engine)
               : fmt::format("cannot apply version {} attempt {}: {}", v, a.id, s.ToString()));
    DCR_RETURN_IF_ERROR(store_.Put(run_keys::Attempt(v, a.id) + "acks/" + o_.id + ".json", ack.ToJson()));
    DCR_RETURN_IF_ERROR(Fault("acked"));
    handled_.insert(a.id);
    progressed = true;
    heartbeat_.Set("following").IgnoreError();
  }
  if (!progressed) std::this_thread::sleep_for(o_.poll);
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
