#include "shard_baseline.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "dcr/run_keys.h"
#include "dcr/run_status.h"

namespace dcr::protocol_internal {

namespace fs = std::filesystem;

namespace {

std::string ShardsDir(const std::string& state_dir) { return (fs::path(state_dir) / "shards").string(); }
std::string ShardDir(const std::string& state_dir, size_t k) {
  return (fs::path(ShardsDir(state_dir)) / fmt::format("s{}", k)).string();
}

}  // namespace

std::vector<PlacedRank> ShardBaseline::Placed() {
  std::vector<PlacedRank> out;
  for (RankBufferFiles& f : shards_) out.push_back(f.placed());
  return out;
}

uint64_t ShardBaseline::bytes() {
  uint64_t n = 0;
  for (RankBufferFiles& f : shards_)
    for (auto b : f.placed().buffers) n += b.size();
  return n;
}

Digest ShardBaseline::SendersDigest() {
  Digest d;
  for (RankBufferFiles& f : shards_) d += *RankDigest(f.placed());  // host memory: no read can fail
  return d;
}

Status ShardBaseline::WriteRecord(uint64_t version, const Digest& digest) {
  const ShardsState state{run_.run_id, version, local_ids_, digest};
  DCR_RETURN_IF_ERROR(WriteShardsState(state_dir_, state));
  memo_.valid = true;
  memo_.dir = state_dir_;
  memo_.state = state;
  return Status::Ok();
}

void ShardBaseline::KeepOpen() {
  if (memo_.valid) memo_.shards = std::move(shards_);
}

Status ShardBaseline::ApplyCommitted(uint64_t from, uint64_t to) {
  if (from >= to) return Status::Ok();
  // The senders' baseline shards are the ranks of the trainer's "engine",
  // each with its partial chunk digests (SendersDigest checks the whole).
  const DeltaManifest shape = TensorTableOf(run_);
  std::vector<ChunkDigestTable> tracked;
  for (RankBufferFiles& f : shards_) tracked.push_back(*RankChunkDigests(f.placed(), shape));  // host: cannot fail
  for (uint64_t v = from + 1; v <= to; ++v) {
    DCR_ASSIGN_OR_RETURN(CommitRecord c, ReadCommit(store_, v));
    DCR_ASSIGN_OR_RETURN(DeltaReader delta, LoadAttempt(store_, v, c.attempt, shape));
    std::vector<FrameView> frames;
    for (size_t i = 0; i < delta.manifest().frames.size(); ++i) {
      DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
      frames.push_back(frame);
    }
    for (size_t k = 0; k < shards_.size(); ++k) {
      PlacedRank placed = shards_[k].placed();
      std::vector<Digest> current;
      for (const FrameView& f : frames) current.push_back(tracked[k][f.header.tensor][f.header.chunk]);
      const auto applied = ApplyRankFrames(placed, delta.manifest(), frames, current);
      for (size_t i = 0; i < frames.size(); ++i) {
        DCR_RETURN_IF_ERROR(applied[i].status);
        tracked[k][frames[i].header.tensor][frames[i].header.chunk] = applied[i].after;
      }
    }
  }
  return Status::Ok();
}

Status ShardBaseline::Load(const CommitRecord& want) {
  shards_.clear();
  std::vector<RankBufferFiles> remembered = std::move(memo_.shards);  // used when the record is the one remembered
  memo_.shards.clear();
  // The recorded baseline, when its files still hold the recorded digest.
  DCR_ASSIGN_OR_RETURN(const bool opened, OpenRecorded(want, std::move(remembered)));
  if (opened) return Status::Ok();
  return OpenOrRebuild(want);
}

Result<bool> ShardBaseline::OpenRecorded(const CommitRecord& want, std::vector<RankBufferFiles> remembered) {
  // A record that does not parse, or of another run or senders, is rebuilt over.
  auto read = ReadShardsState(state_dir_);
  if (!read.ok() || !*read) return false;
  const ShardsState& recorded = **read;
  if (recorded.run_id != run_.run_id || recorded.version > want.version || recorded.senders != local_ids_) return false;
  const uint64_t at = recorded.version;
  // This publisher wrote the record and nothing has touched the files
  // since (the directory is locked while publishing): no digest pass.
  const bool known =
      memo_.valid && memo_.dir == state_dir_ && memo_.state == recorded && remembered.size() == local_ids_.size();
  if (known) shards_ = std::move(remembered);
  for (size_t i = shards_.size(); i < local_ids_.size(); ++i) {
    auto opened = RankBufferFiles::Open(*local_[i].layout, ShardDir(state_dir_, local_ids_[i]));
    if (!opened.ok()) return false;
    shards_.push_back(std::move(*opened));
  }
  if (!known && SendersDigest() != recorded.digest) return false;
  Status caught = ApplyCommitted(at, want.version);
  if (Transient(caught)) return caught;
  const bool at_target =
      at == want.version ? recorded.digest == want.target_digest : SendersDigest() == want.target_digest;
  if (!caught.ok() || (every_sender_ && !at_target)) return false;
  if (at < want.version) DCR_RETURN_IF_ERROR(WriteRecord(want.version, SendersDigest()));
  return true;
}

Status ShardBaseline::CreateShards() {
  memo_ = {};
  shards_.clear();
  std::error_code ec;
  fs::remove(ShardsRecordPath(state_dir_), ec);
  fs::remove_all(ShardsDir(state_dir_), ec);
  for (size_t i = 0; i < local_ids_.size(); ++i) {
    DCR_ASSIGN_OR_RETURN(RankBufferFiles f,
                         RankBufferFiles::Create(*local_[i].layout, ShardDir(state_dir_, local_ids_[i])));
    shards_.push_back(std::move(f));
  }
  return Status::Ok();
}

Status ShardBaseline::OpenOrRebuild(const CommitRecord& want) {
  // Rebuilt: the newest snapshot through the maps, then the committed deltas.
  DCR_RETURN_IF_ERROR(CreateShards());
  DCR_ASSIGN_OR_RETURN(SnapshotRecord snap, NewestSnapshot(store_, want.version));
  const std::string tmp = (fs::path(state_dir_) / "shards.snapshot").string();
  std::error_code ec;
  fs::remove_all(tmp, ec);
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store_, snap, tmp, nullptr));
  {
    DCR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(tmp));
    DCR_RETURN_IF_ERROR(CheckRunTensors(ckpt, run_));
    for (RankBufferFiles& f : shards_) {
      PlacedRank placed = f.placed();
      DCR_RETURN_IF_ERROR(LoadDense(CheckpointBytes(ckpt), placed));
    }
  }
  fs::remove_all(tmp, ec);
  DCR_RETURN_IF_ERROR(ApplyCommitted(snap.version, want.version));
  const Digest digest = SendersDigest();
  if (every_sender_ && digest != want.target_digest)
    return DataLoss(
        fmt::format("{}: the senders' shards rebuilt from the snapshot of version {} and the committed "
                    "deltas do not add up to version {}'s digest",
                    store_.url(), snap.version, want.version));
  return WriteRecord(want.version, digest);
}

void ShardBaseline::CopyCurrent() {
  for (size_t i = 0; i < local_.size(); ++i) {
    PlacedRank base = shards_[i].placed();
    for (size_t b = 0; b < base.buffers.size(); ++b)
      std::copy(local_[i].current[b].begin(), local_[i].current[b].end(), base.buffers[b].begin());
  }
}

Status ShardBaseline::Move(uint64_t v, const Digest& partial) {
  memo_.valid = false;
  std::error_code ec;
  fs::remove(ShardsRecordPath(state_dir_), ec);
  CopyCurrent();
  return WriteRecord(v, partial);
}

Status ShardBaseline::Adopt(uint64_t version, const Digest& digest) {
  DCR_RETURN_IF_ERROR(CreateShards());
  CopyCurrent();
  return WriteRecord(version, digest);
}

}  // namespace dcr::protocol_internal
