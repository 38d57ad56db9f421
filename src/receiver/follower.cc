// The follower: a receiver that keeps a checkpoint directory at the newest
// committed version (docs/protocol.md, "Receivers").
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "dcr/apply.h"
#include "journals.h"
#include "receiver.h"

namespace dcr {

using namespace receiver_internal;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kJournal = ".dcr-follow.json";
// The journal's attempt while a join downloads a snapshot (attempt ids are
// "<seq>-<hex>", so it names none).
constexpr std::string_view kJoining = "snapshot";

using Journal = FollowJournal;

Result<std::optional<Journal>> ReadJournal(const std::string& target) {
  const std::string path = (fs::path(target) / kJournal).string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<Journal>();
  DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path, false));
  DCR_ASSIGN_OR_RETURN(Journal j, ParseFollowJournal(AsText(f), path));
  return std::optional<Journal>(std::move(j));
}

Status WriteJournal(const std::string& target, const Journal& j) {
  return WriteFileAtomically((fs::path(target) / kJournal).string(), FollowJournalJson(j));
}

bool HoldsCheckpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

// A checkpoint directory as a receiver's target: every chunk's digest is
// tracked, so a frame is applied only to a chunk proven to be its base
// (ChunkApplier checks the result before a byte is written), and a restart
// knows from the digests which chunks an attempt finished.
class CheckpointTarget final : public ReceiverTarget {
 public:
  CheckpointTarget(std::string dir, std::string id, std::function<void(const std::string&)> log)
      : dir_(std::move(dir)), id_(std::move(id)), log_(std::move(log)) {}

  Result<std::optional<uint64_t>> Resume(Store& store, const RunRecord& run, uint64_t latest,
                                         std::string* join_why) override;
  Status Join(Store& store, const RunRecord& run, const SnapshotRecord& snap) override;
  bool Open() const override { return ckpt_.has_value(); }
  Status Commit(uint64_t v) override {
    journal_.version = v;
    journal_.attempt.clear();
    return WriteJournal(dir_, journal_);
  }
  bool AtCommit(const CommitRecord& c) const override { return Total(digests_) == c.target_digest; }
  Digest AckDigest() const override { return Total(digests_); }
  EngineRank Engine() const override { return {}; }
  bool MayStream(const std::string&, DeltaClass) const override { return true; }
  Status Begin(const std::string& id) override {
    if (journal_.attempt == id) return Status::Ok();
    journal_.attempt = id;
    return WriteJournal(dir_, journal_);
  }
  Status ApplyAttempt(const std::string& id, const DeltaReader& delta, ApplyCounts* counts) override;
  Status ApplyStreamed(const DeltaManifest& shape, std::span<const FrameView> frames, ApplyCounts* counts) override;

 private:
  Status OpenTarget(const RunRecord& run);

  const std::string dir_, id_;
  const std::function<void(const std::string&)> log_;
  Journal journal_;
  std::optional<Checkpoint> ckpt_;
  DeltaManifest layout_;  // the run's tensors and chunking
  ChunkDigestTable digests_;  // of every chunk, as the checkpoint holds it
  std::vector<size_t> target_index_;  // per run tensor: its index in ckpt_
};

Status CheckpointTarget::OpenTarget(const RunRecord& run) {
  ckpt_.reset();
  DCR_ASSIGN_OR_RETURN(Checkpoint c, Checkpoint::Open(dir_, OpenMode::kReadWrite));
  DCR_RETURN_IF_ERROR(CheckRunTensors(c, run));
  ckpt_.emplace(std::move(c));
  layout_ = TensorTableOf(run);
  target_index_.clear();
  for (const auto& t : layout_.tensors) target_index_.push_back(static_cast<size_t>(ckpt_->Find(t.name)));
  digests_ = ChunkDigests(*ckpt_, layout_);
  return Status::Ok();
}

Status CheckpointTarget::Join(Store& store, const RunRecord& run, const SnapshotRecord& snap) {
  ckpt_.reset();
  // Journal the join before the download: a receiver killed in the middle
  // (some files of the snapshot in place, some not) finds the journal and
  // joins again instead of refusing a checkpoint it does not recognize.
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir_);
  journal_ = Journal{run.run_id, id_, std::string(kJoining), snap.version};
  DCR_RETURN_IF_ERROR(WriteJournal(dir_, journal_));
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store, snap, dir_, nullptr));
  DCR_RETURN_IF_ERROR(OpenTarget(run));
  if (Total(digests_) != snap.digest) {
    ckpt_.reset();
    return DataLoss(
        fmt::format("{}: the snapshot of version {} does not have its recorded digest", store.url(), snap.version));
  }
  return Status::Ok();
}

Result<std::optional<uint64_t>> CheckpointTarget::Resume(Store& store, const RunRecord& run, uint64_t latest,
                                                         std::string* join_why) {
  DCR_ASSIGN_OR_RETURN(auto journal, ReadJournal(dir_));
  if (journal && journal->run_id != run.run_id)
    return FailedPrecondition(
        fmt::format("{} follows run {}, but {} holds run {}; follow into an empty directory to join this run", dir_,
                    journal->run_id, store.url(), run.run_id));
  auto join = [&](std::string why) -> std::optional<uint64_t> {
    *join_why = std::move(why);
    return std::nullopt;
  };
  if (!journal) {
    if (!HoldsCheckpoint(dir_)) return join("new receiver");
    // An existing checkpoint: adopt it if it is a committed version.
    DCR_RETURN_IF_ERROR(OpenTarget(run));
    const Digest d = Total(digests_);
    for (uint64_t v = latest + 1; v-- > 0;) {
      auto c = ReadCommit(store, v);
      if (c.ok() && c->target_digest == d) {
        journal_ = Journal{run.run_id, id_, "", v};
        log_(fmt::format("{} holds committed version {}", dir_, v));
        DCR_RETURN_IF_ERROR(WriteJournal(dir_, journal_));
        return std::optional<uint64_t>(v);
      }
    }
    return FailedPrecondition(fmt::format(
        "{} holds a checkpoint that is no committed version of run {} in {}; follow into an empty directory to join "
        "from a snapshot",
        dir_, run.run_id, store.url()));
  }
  journal_ = *journal;
  journal_.receiver = id_;
  if (journal_.attempt == kJoining) return join("restarted while joining");
  if (!HoldsCheckpoint(dir_)) return join("the journal's checkpoint is missing");
  if (Status s = OpenTarget(run); !s.ok()) return join("cannot open the checkpoint: " + s.ToString());
  auto c = ReadCommit(store, journal_.version);
  if (!c.ok()) return c.status().WithContext("the version " + dir_ + " claims to hold");
  if (Total(digests_) != c->target_digest) {
    if (journal_.attempt.empty())
      return join(fmt::format("{} does not hold version {} as its journal claims", dir_, journal_.version));
    log_(fmt::format("restarted while applying attempt {}; the next attempt or the commit repairs it",
                     journal_.attempt));
  }
  return std::optional<uint64_t>(journal_.version);
}

Status CheckpointTarget::ApplyAttempt(const std::string& id, const DeltaReader& delta, ApplyCounts* counts) {
  DCR_RETURN_IF_ERROR(Begin(id));
  DCR_ASSIGN_OR_RETURN(ApplyReport report, ApplyDelta(*ckpt_, delta, nullptr, nullptr, &digests_, /*sync=*/false));
  counts->applied += report.frames_applied;
  counts->already += report.frames_already_applied;
  if (Total(digests_) != delta.manifest().target_digest)
    return DataLoss("applied every frame but the checkpoint's digest is not the target's");
  return Status::Ok();
}

// A frame is applied only to a chunk it turns into its target (its base:
// the apply loop checks the digest after the change, computed from the
// chunk's own words, before writing); one at its target is done, one in any
// other state is left to the manifest (ApplyDelta repairs it with an
// overwrite frame, or the attempt is nacked). Which chunks are done is in
// their digests, so no xor frame is ever applied twice.
Status CheckpointTarget::ApplyStreamed(const DeltaManifest&, std::span<const FrameView> frames, ApplyCounts* counts) {
  std::vector<FrameView> todo;
  std::vector<Digest> current;
  for (const FrameView& frame : frames) {
    const FrameHeader& h = frame.header;
    if (digests_[h.tensor][h.chunk] == h.target_digest) {
      ++counts->already;
      continue;
    }
    todo.push_back(frame);
    current.push_back(digests_[h.tensor][h.chunk]);
  }
  CheckpointApplyTarget target(*ckpt_, layout_, target_index_);
  const auto applied = ApplyFrames(target, layout_, todo, current);
  for (size_t i = 0; i < todo.size(); ++i) {
    const FrameHeader& h = todo[i].header;
    if (!applied[i].status.ok()) {
      log_(fmt::format("tensor {} chunk {}: a streamed frame not applied before the manifest: {}", h.tensor, h.chunk,
                       applied[i].status.ToString()));
      ++counts->left;
      continue;
    }
    digests_[h.tensor][h.chunk] = applied[i].after;
    ++(applied[i].outcome == ApplyOutcome::kApplied ? counts->applied : counts->already);
  }
  return Status::Ok();
}

}  // namespace

std::string DefaultReceiverId() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return fmt::format("{}-{}", host, ::getpid());
}

Follower::Follower(Store& store, std::string target, FollowOptions options)
    : store_(store), target_(std::move(target)), options_(std::move(options)) {
  if (options_.id.empty()) options_.id = DefaultReceiverId();
}

Follower::Follower(Follower&&) noexcept = default;
Follower::~Follower() = default;

Status Follower::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  if (Status s = ValidateKey(run_keys::Receiver(options_.id)); !s.ok())
    return InvalidArgument("receiver id '" + options_.id + "' cannot name an object: " + s.message());
  if (!walk_) {
    const FollowOptions& o = options_;
    checkpoint_ = std::make_unique<CheckpointTarget>(target_, o.id, [o](const std::string& l) { FollowLog(o, l); });
    walk_ = std::make_unique<ReceiverWalk>(store_, *checkpoint_, options_);
  }
  return walk_->Run(until, stop);
}

uint64_t Follower::version() const { return walk_ ? walk_->version() : 0; }

}  // namespace dcr
