// The publisher: coordinator and senders in one process (docs/protocol.md).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "ack_tally.h"
#include "dcr/contribution.h"
#include "dcr/json.h"
#include "dcr/layout_apply.h"
#include "dcr/progress.h"
#include "internal.h"

namespace dcr {

using namespace protocol_internal;
namespace fs = std::filesystem;

namespace {

std::string DefaultId() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return fmt::format("{}-{}", host, ::getpid());
}

std::string RandomHex(int digits) {
  std::random_device rd;
  uint64_t x = (uint64_t{rd()} << 32) ^ rd();
  return fmt::format("{:0{}x}", x & ((digits >= 16) ? ~0ull : ((1ull << (4 * digits)) - 1)), digits);
}

// The id and class of a version's attempt number `seq`: the first is xor
// class; every retry (and a version someone already tried) is overwrite,
// which repairs receivers whatever part of a failed attempt they applied.
std::string NextAttempt(size_t seq, DeltaClass* cls) {
  *cls = seq == 0 ? DeltaClass::kXorClass : DeltaClass::kOverwrite;
  return fmt::format("{:04}-{}", seq, RandomHex(8));
}

Status Fault(const PublishOptions& o, std::string_view point) { return o.fault ? o.fault(point) : Status::Ok(); }

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
  if (options_.coordinator_id.empty()) options_.coordinator_id = DefaultId();
}

namespace {

// One publish call's working state.
class PublishRun {
 public:
  PublishRun(Store& store, const std::string& state_dir, const PublishOptions& options, Progress* progress)
      : store_(store), state_dir_(state_dir), o_(options), progress_(progress) {}

  Result<PublishReport> PublishSnapshot(const Checkpoint& next);
  Result<PublishReport> PublishDelta(uint64_t v, const Checkpoint& next, const RunRecord& run);
  friend class ShardRun;

 private:
  struct AttemptResult {
    bool committed = false;
    Status failure;  // why the attempt was fenced
  };
  Result<AttemptResult> RunAttempt(uint64_t v, const std::string& id, DeltaClass cls, const Checkpoint& baseline,
                                   const Checkpoint& next, const DeltaManifest& layout,
                                   const ChunkDigestTable& base_digests, PublishReport* report,
                                   DeltaManifest* manifest_out, ChunkDigestTable* target_digests_out);
  // Waits for the acks of attempt `id` (manifest `m`, written), then commits.
  Result<AttemptResult> AwaitAcksAndCommit(uint64_t v, const std::string& id, DeltaManifest m, PublishReport* report,
                                           DeltaManifest* manifest_out);
  Status Fence(uint64_t v, const std::string& id, const Status& why);
  // After attempt `id`: true when it committed; false when it failed and was
  // fenced (`*last_failure` says why: retry); an error that retrying cannot
  // help (another coordinator's bits, a wrong version or baseline).
  Result<bool> Settle(uint64_t v, const std::string& id, Result<AttemptResult> result, Status* last_failure);
  Status CatchUpBaseline(Checkpoint& baseline, uint64_t from, uint64_t to, ChunkDigestTable* digests);
  // Opens the baseline (recorded at version `at`), catches it up to `want`
  // and checks its digest.
  Status LoadBaseline(uint64_t at, const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout,
                      std::optional<Checkpoint>* out, ChunkDigestTable* digests);
  Status RebuildBaseline(const CommitRecord& want, const RunRecord& run, const DeltaManifest& layout);

  Store& store_;
  const std::string& state_dir_;
  const PublishOptions& o_;
  Progress* progress_;
  bool cancelled_ = false;  // o_.cancel stopped an attempt's wait: no retry
};

Result<PublishReport> PublishRun::PublishSnapshot(const Checkpoint& next) {
  const auto start = ClockOf(o_).Now();
  PublishReport report;
  DCR_ASSIGN_OR_RETURN(DeltaManifest layout, StartDelta(next, next, o_.delta));
  RunRecord run;
  run.run_id = RandomHex(16);
  run.chunk_elements = layout.chunk_elements;
  run.tensors = layout.tensors;
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
  // The baseline: a copy of the checkpoint's files.
  const std::string dir = BaselineDir(state_dir_);
  std::error_code ec;
  DropDigestCache(state_dir_);
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir);
  std::vector<std::pair<fs::path, fs::path>> copies;  // from, to
  if (fs::is_regular_file(next.path())) {
    copies.emplace_back(next.path(), fs::path(dir) / "model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(next.path(), ec))
      if (e.is_regular_file() && !e.path().filename().string().starts_with("."))
        copies.emplace_back(e.path(), fs::path(dir) / e.path().filename());
    if (ec) return ErrnoError(ec.value(), "cannot list " + next.path());
  }
  uint64_t need = 0;
  for (const auto& [from, to] : copies) need += fs::file_size(from, ec);
  const std::string what = "the publisher's baseline (a copy of version 0; or give it another state directory)";
  DCR_RETURN_IF_ERROR(CheckFreeSpace(dir, need, what));
  for (const auto& [from, to] : copies)
    if (!fs::copy_file(from, to, ec) || ec)
      return IsNoSpace(ec.value()) ? NoSpace(dir, need, what)
                                   : ErrnoError(ec.value(), "cannot copy " + from.string() + " into " + dir);
  DCR_RETURN_IF_ERROR(WriteBaseline(state_dir_, {run.run_id, 0}));
  if (auto baseline = Checkpoint::Open(dir); baseline.ok()) WriteDigestCache(state_dir_, 0, *baseline, chunk_digests);
  report.version = 0;
  report.attempts = 1;
  report.total_seconds = SecondsSince(ClockOf(o_), start);
  return report;
}

Result<bool> PublishRun::Settle(uint64_t v, const std::string& id, Result<AttemptResult> result, Status* last_failure) {
  if (!result.ok()) {
    // The store or this process failed mid-attempt; fence it (best effort) and retry.
    *last_failure = result.status();
    Fence(v, id, *last_failure).IgnoreError();
    const Code code = last_failure->code();
    if (code == Code::kAlreadyExists || code == Code::kFailedPrecondition || cancelled_) return *last_failure;
    return false;
  }
  if (!result->committed) {
    *last_failure = result->failure;
    DCR_RETURN_IF_ERROR(Fence(v, id, *last_failure));
    return false;
  }
  return true;
}

Status PublishRun::Fence(uint64_t v, const std::string& id, const Status& why) {
  // Never fence a committed attempt (its commit's response may have been lost).
  if (auto c = ReadCommit(store_, v); c.ok() && c->attempt == id) return Status::Ok();
  const FenceRecord fence{why.ToString(), ClockOf(o_).UnixSeconds()};
  DCR_RETURN_IF_ERROR(store_.Put(run_keys::Attempt(v, id) + "fence", fence.ToJson()));
  // The store's fence is the one receivers obey; the relays' copy only lets
  // them drop the attempt's frames early.
  if (o_.relay) o_.relay->Fence(run_keys::Attempt(v, id));
  return Status::Ok();
}

Status PublishRun::CatchUpBaseline(Checkpoint& baseline, uint64_t from, uint64_t to, ChunkDigestTable* digests) {
  for (uint64_t v = from + 1; v <= to; ++v) {
    DCR_ASSIGN_OR_RETURN(CommitRecord c, ReadCommit(store_, v));
    DCR_ASSIGN_OR_RETURN(DeltaReader delta, LoadAttempt(store_, v, c.attempt));
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
  DCR_RETURN_IF_ERROR(CatchUpBaseline(baseline, at, want.version, digests));
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
    DCR_RETURN_IF_ERROR(CatchUpBaseline(rebuilt, snap.version, want.version, &digests));
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

Result<PublishReport> PublishRun::PublishDelta(uint64_t v, const Checkpoint& next, const RunRecord& run) {
  const auto start = ClockOf(o_).Now();
  PublishReport report;
  report.version = v;
  DCR_RETURN_IF_ERROR(CheckRunTensors(next, run));
  const DeltaManifest layout = LayoutOf(run);
  report.total_bytes = 0;
  for (const auto& t : next.tensors()) report.total_bytes += t.nbytes;

  // The baseline must hold v-1: caught up from committed deltas when it is
  // behind; rebuilt from the store when the state holds no baseline of this
  // run below v (new, lost in a reboot, another run's) or a damaged one.
  const auto baseline_start = ClockOf(o_).Now();
  DCR_ASSIGN_OR_RETURN(CommitRecord base_commit, ReadCommit(store_, v - 1));
  std::optional<Checkpoint> opened;
  ChunkDigestTable base_digests;
  auto load = [&]() -> Status {
    DCR_ASSIGN_OR_RETURN(auto state, ReadBaseline(state_dir_));
    if (!state) return NotFound(state_dir_ + " holds no baseline");
    if (state->run_id != run.run_id)
      return FailedPrecondition(fmt::format("{} holds the baseline of run {}", state_dir_, state->run_id));
    if (state->version >= v)
      return FailedPrecondition(fmt::format("{} holds version {}, not below {}", state_dir_, state->version, v));
    return LoadBaseline(state->version, base_commit, run, layout, &opened, &base_digests);
  };
  Status ready = load();
  if (!ready.ok() && !Transient(ready)) {
    // Also a publisher killed while its baseline moved (a chunk half copied),
    // or deltas GC removed.
    fmt::print(stderr, "dcr publish: rebuilding the baseline of version {} from {} ({})\n", v - 1, store_.url(),
               ready.ToString());
    opened.reset();
    Status rebuilt = RebuildBaseline(base_commit, run, layout);
    if (!rebuilt.ok())
      return rebuilt.WithContext(ready.ToString() + "; rebuilding the baseline from the store failed too");
    ready = LoadBaseline(v - 1, base_commit, run, layout, &opened, &base_digests);
  }
  DCR_RETURN_IF_ERROR(ready);
  report.baseline_seconds = SecondsSince(ClockOf(o_), baseline_start);
  Checkpoint& baseline = *opened;
  report.memory.baseline_bytes = baseline.total_bytes();
  report.memory.baseline_in_memory = OnMemoryFilesystem(state_dir_);
  for (const auto& chunks : base_digests) report.memory.digest_bytes += chunks.size() * sizeof(Digest);
  // A scheduled snapshot of v-1 whose upload failed after v-1's commit is
  // uploaded now, from the baseline (which holds v-1 exactly).
  if (o_.snapshot_every > 0 && v - 1 > 0 && (v - 1) % o_.snapshot_every == 0) {
    auto snap = NewestSnapshot(store_, v - 1);
    if (!snap.ok() && Transient(snap.status())) return snap.status();
    if (!snap.ok() || snap->version != v - 1)
      DCR_RETURN_IF_ERROR(UploadSnapshot(store_, v - 1, baseline, Total(base_digests), progress_)
                              .WithContext(fmt::format("uploading the missed snapshot of version {}", v - 1)));
  }

  DCR_ASSIGN_OR_RETURN(auto prior, ListAttempts(store_, v));
  Status last_failure;
  for (uint32_t n = 0; n < std::max<uint32_t>(o_.max_attempts, 1); ++n) {
    DeltaClass cls;
    const std::string id = NextAttempt(prior.size() + n, &cls);
    DeltaManifest manifest;
    ChunkDigestTable target_digests;
    ++report.attempts;
    DCR_ASSIGN_OR_RETURN(
        bool committed,
        Settle(v, id, RunAttempt(v, id, cls, baseline, next, layout, base_digests, &report, &manifest, &target_digests),
               &last_failure));
    if (!committed) continue;
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
    report.advance_seconds = SecondsSince(ClockOf(o_), advance_start);
    if (o_.snapshot_every > 0 && v % o_.snapshot_every == 0)
      DCR_RETURN_IF_ERROR(UploadSnapshot(store_, v, next, manifest.target_digest, nullptr));
    // Best effort: v is committed whatever GC meets, and the next publish collects again.
    CollectGarbage(store_, o_.keep_versions, o_.heartbeat_timeout, ClockOf(o_)).IgnoreError();
    report.total_seconds = SecondsSince(ClockOf(o_), start);
    return report;
  }
  return Aborted(fmt::format("version {} was not committed after {} attempts; last failure: {}", v, report.attempts,
                             last_failure.ToString()));
}

namespace {

// Frame bytes written into objects not yet closed, and their peak (what the
// store's writers and the relay's copies hold at most; any thread).
class FramesInFlight {
 public:
  void Add(uint64_t n) {
    const uint64_t now = held_.fetch_add(n) + n;
    uint64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void Remove(uint64_t n) { held_.fetch_sub(n); }
  uint64_t peak() const { return peak_.load(); }

 private:
  std::atomic<uint64_t> held_{0}, peak_{0};
};

// A sender's frame stream cut into objects frames/s<K>-<NNNN>.bin of about
// `segment_bytes` each, at frame boundaries. Each object is visible (and can
// be downloaded) as soon as it is closed, while the next is being written.
// Closing (the file store's fsyncs and rename, S3's last part and complete)
// runs on a closer thread, so the encoder keeps streaming into the next
// object meanwhile; at most kClosesInFlight objects wait to be closed. The
// first error of any close is returned by the next Write or Close. With
// `relay`, each object is also handed to it once it is in the store (the
// segment's bytes are kept in memory until then).
class SegmentedFrameWriter {
 public:
  SegmentedFrameWriter(Store& store, std::string prefix, uint32_t sender, uint64_t segment_bytes,
                       const ObjectSigner& signer, FrameObjectSink* relay, FramesInFlight& in_flight)
      : store_(store),
        prefix_(std::move(prefix)),
        sender_(sender),
        segment_bytes_(std::max<uint64_t>(segment_bytes, 1)),
        signer_(signer),
        relay_(relay),
        in_flight_(in_flight) {}
  // Without Close (an attempt that failed): nothing more is published.
  ~SegmentedFrameWriter() {
    if (writer_) {
      writer_->Abort();
      in_flight_.Remove(in_segment_);
    }
    std::unique_lock lock(mu_);
    stopping_ = aborting_ = true;
    cv_.notify_all();
    lock.unlock();
    if (closer_.joinable()) closer_.join();
  }

  Status Write(std::string_view frame) {
    if (!writer_ || in_segment_ >= segment_bytes_) {
      DCR_RETURN_IF_ERROR(Rotate());
      names_.push_back(fmt::format("frames/s{}-{:04}.bin", sender_, names_.size()));
      starts_.push_back(written_);
      DCR_ASSIGN_OR_RETURN(writer_, store_.OpenWriter(prefix_ + names_.back(), WriteMode::kOverwrite));
      signing_ = signer_.Begin(prefix_ + names_.back());
      in_segment_ = 0;
    }
    DCR_RETURN_IF_ERROR(writer_->Write(frame));
    signing_.Update(frame);
    if (relay_) buffer_.append(frame);
    in_segment_ += frame.size();
    in_flight_.Add(frame.size());
    written_ += frame.size();
    return Status::Ok();
  }

  // Closes the current object and waits for every close to finish.
  Status Close() {
    Status s = Rotate();
    std::unique_lock lock(mu_);
    stopping_ = true;
    cv_.notify_all();
    lock.unlock();
    if (closer_.joinable()) closer_.join();
    lock.lock();
    return s.ok() ? failure_ : s;
  }

  // Turns an entry's offset in the whole stream (EncodeFrames' object 0)
  // into its segment (an index into names()) and the offset there.
  void Locate(DeltaFrameEntry* f) const {
    const size_t seg =
        static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), f->offset) - starts_.begin()) - 1;
    f->object = static_cast<uint32_t>(seg);
    f->offset -= starts_[seg];
  }

  const std::vector<std::string>& names() const { return names_; }

 private:
  static constexpr size_t kClosesInFlight = 4;
  struct Pending {
    std::unique_ptr<ObjectWriter> writer;
    std::string key, bytes;  // bytes: only with a relay
    uint64_t size = 0;  // counted in in_flight_ until closed
  };

  // Hands the current object (if any) to the closer thread.
  Status Rotate() {
    std::unique_lock lock(mu_);
    if (!failure_.ok()) return failure_;
    if (!writer_) return Status::Ok();
    const std::string trailer = signing_.Trailer();
    if (Status s = writer_->Write(trailer); !s.ok()) return failure_ = s;
    if (relay_) buffer_.append(trailer);
    in_flight_.Add(trailer.size());
    cv_.wait(lock, [&] { return pending_.size() < kClosesInFlight; });
    pending_.push_back({std::move(writer_), prefix_ + names_.back(), std::move(buffer_), in_segment_ + trailer.size()});
    buffer_.clear();
    if (!closer_.joinable()) closer_ = std::thread([this] { CloseLoop(); });
    cv_.notify_all();
    return failure_;
  }

  void CloseLoop() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !pending_.empty() || stopping_; });
      if (pending_.empty()) return;
      Pending p = std::move(pending_.front());
      const bool abort = aborting_ || !failure_.ok();
      lock.unlock();
      Status s;
      if (abort) {
        p.writer->Abort();
      } else {
        s = p.writer->Close();
        if (s.ok() && relay_) relay_->Object(p.key, p.bytes);
      }
      lock.lock();
      in_flight_.Remove(pending_.front().size);
      pending_.pop_front();
      if (!s.ok() && failure_.ok()) failure_ = s;
      cv_.notify_all();
    }
  }

  Store& store_;
  const std::string prefix_;
  const uint32_t sender_;
  const uint64_t segment_bytes_;
  const ObjectSigner& signer_;
  ObjectSigner::Object signing_;  // of the open segment
  FrameObjectSink* const relay_;
  FramesInFlight& in_flight_;
  std::string buffer_;  // the open segment's bytes, with a relay
  std::unique_ptr<ObjectWriter> writer_;
  std::vector<std::string> names_;
  std::vector<uint64_t> starts_;  // stream offset where each segment begins
  uint64_t in_segment_ = 0, written_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;  // front: being closed
  bool stopping_ = false, aborting_ = false;
  Status failure_;
  std::thread closer_;
};

}  // namespace

Result<PublishRun::AttemptResult> PublishRun::AwaitAcksAndCommit(uint64_t v, const std::string& id, DeltaManifest m,
                                                                 PublishReport* report, DeltaManifest* manifest_out) {
  const std::string prefix = run_keys::Attempt(v, id);
  // Wait for every live receiver's ack; retire the silent ones at the deadline.
  const auto wait_start = ClockOf(o_).Now();
  const auto deadline = wait_start + o_.ack_timeout;
  AckTally tally(m.target_digest);
  std::set<std::string> retired;
  std::set<std::string> seen;  // ack keys read and counted
  std::vector<std::string> waiting;  // live receivers that have not acked
  bool committed = false;  // commits/v exists (another coordinator, or a lost response)
  // Acks from the store and from the relay tree count alike (a receiver
  // writes its ack to the store before it sends it up the tree).
  auto take = [&](const AckRecord& ack, bool tree) {
    tally.Take(ack, tree);
    std::erase_if(waiting, [&](const std::string& r) { return tally.Acked(r); });
  };
  auto poll = [&]() -> Status {
    waiting.clear();
    DCR_ASSIGN_OR_RETURN(auto acks, store_.List(run_keys::Acks(v, id)));
    for (const auto& o : acks) {
      if (seen.count(o.key)) continue;
      DCR_ASSIGN_OR_RETURN(std::string text, store_.Get(o.key));
      DCR_ASSIGN_OR_RETURN(AckRecord ack, AckRecord::FromJson(text, StoreContext(store_.url(), o.key)));
      seen.insert(o.key);
      take(ack, false);
      if (tally.refused()) return Status::Ok();
    }
    // Live receivers: fresh heartbeat, not retired or stopped.
    DCR_ASSIGN_OR_RETURN(auto regs, store_.List("receivers/"));
    const double now = ClockOf(o_).UnixSeconds(), fresh = std::chrono::duration<double>(o_.heartbeat_timeout).count();
    for (const auto& o : regs) {
      auto text = store_.Get(o.key);
      if (!text.ok()) {
        if (text.status().code() == Code::kNotFound) continue;  // deleted meanwhile
        return text.status();
      }
      auto r = ReceiverRecord::FromJson(*text, StoreContext(store_.url(), o.key));
      if (!r.ok() || r->state == "stopped" || r->state == "retired" || now - r->heartbeat > fresh) continue;
      if (!tally.Acked(r->id)) waiting.push_back(r->id);
    }
    if (!waiting.empty()) {
      // Receivers that moved on to v+1 never ack this attempt: stop waiting
      // once v is committed; the commit below obeys the record.
      DCR_ASSIGN_OR_RETURN(auto record, GetIfPresent(store_, run_keys::Commit(v)));
      committed = record.has_value();
    }
    return Status::Ok();
  };
  // An ack that comes up the relay tree only says where to look: it counts
  // as the store holds it (a receiver writes it there first), never as the
  // tree says. Any peer can send the tree an ack for any receiver id.
  uint64_t tree_refused = 0;
  auto confirm = [&](const AckRecord& tree_ack) -> Status {
    const std::string key = run_keys::Ack(v, id, tree_ack.receiver);
    if (seen.count(key)) return Status::Ok();
    if (tree_ack.receiver.find('/') != std::string::npos || !ValidateKey(key).ok()) {
      ++tree_refused;
      return Status::Ok();
    }
    DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store_, key));
    if (!text) {  // not (yet) in the store: the store poll decides
      ++tree_refused;
      return Status::Ok();
    }
    DCR_ASSIGN_OR_RETURN(AckRecord ack, AckRecord::FromJson(*text, StoreContext(store_.url(), key)));
    seen.insert(key);
    if (ack.receiver != tree_ack.receiver)
      return DataLoss(fmt::format("{}: names receiver '{}', not '{}'", key, ack.receiver, tree_ack.receiver));
    take(ack, true);
    return Status::Ok();
  };
  auto take_tree = [&](std::chrono::milliseconds wait) -> Status {
    for (const auto& ack : o_.relay->TakeAcks(prefix, wait)) {
      DCR_RETURN_IF_ERROR(confirm(ack));
      if (tally.refused()) break;
    }
    return Status::Ok();
  };
  // With acks coming up the relay tree, the store is polled every
  // store_ack_poll and the tree's acks are taken as they arrive (the commit
  // then follows the last ack by a few ms instead of up to a poll period
  // plus a listing and a read per receiver).
  const bool tree_acks = o_.relay && o_.relay_acks && o_.relay->CarriesAcks();
  const auto store_every = tree_acks ? o_.store_ack_poll : std::chrono::milliseconds(0);
  Status polled;
  auto next_poll = wait_start;
  for (;;) {
    // A store failure costs one poll, not the attempt (whose frames may be
    // applied everywhere already), until the deadline.
    if (ClockOf(o_).Now() >= next_poll) {
      polled = poll();
      next_poll = ClockOf(o_).Now() + store_every;
    }
    if (tree_acks && polled.ok()) polled = take_tree(std::chrono::milliseconds(0));
    if (tally.refused()) return AttemptResult{false, *tally.refused()};
    if (polled.ok() && (waiting.empty() || committed)) break;
    if (o_.cancel && o_.cancel()) {
      cancelled_ = true;
      return Aborted(fmt::format("version {} attempt {}: cancelled while waiting for acks ({} receivers had not acked)",
                                 v, id, waiting.size()));
    }
    if (!polled.ok() && !Transient(polled)) return polled;
    if (ClockOf(o_).Now() >= deadline) {
      DCR_RETURN_IF_ERROR(polled);
      retired.insert(waiting.begin(), waiting.end());
      break;
    }
    if (tree_acks) {
      const auto wait = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(next_poll - ClockOf(o_).Now()),
                                   std::chrono::milliseconds(0), std::chrono::milliseconds(20));
      if (Status t = take_tree(wait); !t.ok()) polled = t;
    } else {
      ClockOf(o_).Sleep(std::chrono::milliseconds(20));
    }
  }
  report->wait_seconds += SecondsSince(ClockOf(o_), wait_start);
  DCR_RETURN_IF_ERROR(Fault(o_, "acked"));
  DCR_RETURN_IF_ERROR(Fault(o_, "before-commit"));

  CommitRecord c;
  c.version = v;
  c.base_version = v - 1;
  c.attempt = id;
  c.target_digest = m.target_digest;
  c.acked.assign(tally.acked().begin(), tally.acked().end());
  c.retired.assign(retired.begin(), retired.end());
  c.time = ClockOf(o_).UnixSeconds();
  c.publisher_memory = report->memory;
  Status s = store_.Put(run_keys::Commit(v), c.ToJson(), WriteMode::kCreateIfAbsent);
  // After a transient failure the record may or may not have been written (a
  // lost response): create it again; if it exists and names this attempt, it
  // is ours.
  for (int tries = 1; Transient(s) && tries < 10; ++tries) {
    ClockOf(o_).Sleep(std::chrono::milliseconds(20 * tries));
    s = store_.Put(run_keys::Commit(v), c.ToJson(), WriteMode::kCreateIfAbsent);
  }
  if (s.code() == Code::kAlreadyExists) {
    // Someone else committed v first: obey the record.
    DCR_ASSIGN_OR_RETURN(CommitRecord other, ReadCommit(store_, v));
    if (other.attempt != id) {
      Fence(v, id, Aborted("version committed by attempt " + other.attempt)).IgnoreError();
      if (other.target_digest != m.target_digest)
        return AlreadyExists(fmt::format(
            "version {} was committed by attempt {} of another coordinator with other bits", v, other.attempt));
      report->already_committed = true;
      report->attempt = other.attempt;  // what is committed, not the attempt that lost
      c = other;
    }
  } else {
    DCR_RETURN_IF_ERROR(s);
  }
  report->acked = c.acked;
  report->retired = c.retired;
  report->relay_acks = tally.from_tree();
  report->relay_acks_unconfirmed = tree_refused;
  *manifest_out = std::move(m);
  return AttemptResult{true, Status::Ok()};
}

Result<PublishRun::AttemptResult> PublishRun::RunAttempt(uint64_t v, const std::string& id, DeltaClass cls,
                                                         const Checkpoint& baseline, const Checkpoint& next,
                                                         const DeltaManifest& layout,
                                                         const ChunkDigestTable& base_digests, PublishReport* report,
                                                         DeltaManifest* manifest_out,
                                                         ChunkDigestTable* target_digests_out) {
  const std::string prefix = run_keys::Attempt(v, id);
  // The delta id is in attempt.json so that receivers can check (and apply)
  // frames that arrive before the manifest.
  // So is the public key that signs its frame objects, made for this
  // attempt: receivers verify what any other transport brings.
  const uint64_t delta_id = std::strtoull(RandomHex(16).c_str(), nullptr, 16) | 1;
  DCR_ASSIGN_OR_RETURN(const ObjectSigner signer, ObjectSigner::Generate());
  AttemptRecord attempt;
  attempt.version = v;
  attempt.cls = cls;
  attempt.delta_id = delta_id;
  attempt.object_key = signer.public_hex();
  attempt.coordinator = o_.coordinator_id;
  attempt.time = ClockOf(o_).UnixSeconds();
  DCR_RETURN_IF_ERROR(store_.Put(prefix + "attempt.json", attempt.ToJson(), WriteMode::kCreateIfAbsent));
  DCR_RETURN_IF_ERROR(Fault(o_, "attempt-opened"));

  // Senders: each encodes the chunks it owns, streaming frames into its object.
  const auto encode_start = ClockOf(o_).Now();
  DeltaOptions options = o_.delta;
  options.encode.delta_class = cls;
  options.chunk_elements = layout.chunk_elements;
  DeltaManifest m = layout;
  m.delta_class = cls;
  m.delta_id = delta_id;
  const auto plan = PlanOwnership(layout, o_.senders);
  const uint64_t segment_bytes =
      o_.segment_bytes ? o_.segment_bytes : std::clamp<uint64_t>(next.total_bytes() / 4096, 256 << 10, 16 << 20);
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
  report->encode_seconds += SecondsSince(ClockOf(o_), encode_start);
  report->memory.frames_in_flight_bytes = std::max(report->memory.frames_in_flight_bytes, in_flight.peak());
  report->attempt = id;
  report->frame_bytes = m.frame_bytes;
  report->payload_bytes = m.payload_bytes;
  report->changed_words = m.changed_words;
  DCR_RETURN_IF_ERROR(Fault(o_, "frames-written"));
  DCR_RETURN_IF_ERROR(store_.Put(prefix + std::string(kManifestFileName), m.ToJson(), WriteMode::kCreateIfAbsent));
  DCR_RETURN_IF_ERROR(Fault(o_, "manifest-written"));

  return AwaitAcksAndCommit(v, id, std::move(m), report, manifest_out);
}

}  // namespace

namespace {

std::string ShardsDir(const std::string& state_dir) { return (fs::path(state_dir) / "shards").string(); }
std::string ShardDir(const std::string& state_dir, size_t k) {
  return (fs::path(ShardsDir(state_dir)) / fmt::format("s{}", k)).string();
}
std::string ShardsRecord(const std::string& state_dir) { return (fs::path(state_dir) / "shards.json").string(); }
std::string ContribKey(uint32_t from, uint32_t to) { return fmt::format("contrib/p{}-p{}.bin", from, to); }
std::string ProcessKey(uint32_t p) { return fmt::format("procs/p{}.json", p); }

std::vector<TensorInfo> RunTensorInfos(const RunRecord& run) {
  std::vector<TensorInfo> out;
  for (const DeltaTensor& t : run.tensors)
    out.push_back({t.name, t.dtype, t.shape, t.elements, t.elements * BitsPerElement(t.dtype) / 8});
  return out;
}

Digest SendersDigest(std::vector<RankBufferFiles>& files) {
  Digest d;
  for (RankBufferFiles& f : files) d += RankDigest(f.placed());
  return d;
}

// attempt.json of an attempt of trainer processes.
Result<AttemptRecord> ParseProcessesAttempt(std::string_view text, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(AttemptRecord a, AttemptRecord::FromJson(text, where));
  if (a.processes == 0)
    return InvalidArgument(where + ": an attempt of one publisher, not of trainer processes (processes, senders)");
  return a;
}

}  // namespace

namespace protocol_internal {

// What a ShardPublisher's last publish left in its state directory: the
// shards record it wrote, and the shard files, still open. While the record
// names the same version, senders and digest, the next publish trusts the
// files without a digest pass and without mapping them again (the directory
// is locked while publishing). Forgotten when a publish fails, so that a
// damaged baseline is found.
struct ShardsMemo {
  bool valid = false;
  std::string dir, run_id;
  uint64_t version = 0;
  std::vector<uint32_t> senders;
  Digest digest;
  std::vector<RankBufferFiles> shards;
};

}  // namespace protocol_internal

namespace {

// The copy thread of a publish from staged senders (ShardSource::stage):
// stages every local sender's buffers in the order the encode reads them
// (by the first canonical tensor name each holds: manifests sort tensors by
// name), and lets readers wait for one. Senders without `stage` are ready.
class ShardStaging {
 public:
  // Times the copy thread with the real clock (a measurement, on another thread).
  explicit ShardStaging(std::span<const ShardSource> local) : local_(local), start_(RealClock().Now()) {
    bool any = false;
    for (const ShardSource& s : local) {
      // Buffers past the map's are refused by the projection, before any wait.
      const bool staged = s.stage && s.layout && s.current.size() == s.layout->map().buffers.size();
      staged_.push_back(staged);
      ready_.emplace_back(s.current.size(), !staged);
      any = any || staged;
    }
    if (any) thread_ = std::thread([this] { Run(); });
    else done_ = true;
  }
  ~ShardStaging() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Blocks until buffer b of local sender i is staged.
  Status Await(size_t i, size_t b) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready_[i][b] || !failed_.ok(); });
    return ready_[i][b] ? Status::Ok() : failed_;
  }
  // The copy thread's error, if it failed (no attempt can fix it).
  Status Failure() {
    std::lock_guard lock(mu_);
    return failed_;
  }
  Status AwaitAll() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ || !failed_.ok(); });
    return failed_;
  }
  // What ProjectSender calls before reading sender i's buffers (none when unstaged).
  std::function<Status(size_t)> AwaiterFor(size_t i) {
    if (!staged_[i]) return {};
    return [this, i](size_t b) { return Await(i, b); };
  }
  double seconds() {
    std::lock_guard lock(mu_);
    return seconds_;
  }

 private:
  void Run() {
    std::vector<std::tuple<std::string, size_t, size_t>> order;  // first tensor name, sender, buffer
    for (size_t i = 0; i < local_.size(); ++i) {
      if (!staged_[i]) continue;
      const CompiledLayout& l = *local_[i].layout;
      std::vector<std::string> first(l.map().buffers.size(), std::string(1, '\xff'));  // unmapped: last
      for (size_t c = 0; c < l.map().copies.size(); ++c)
        first[l.BufferOf(c)] = std::min(first[l.BufferOf(c)], l.map().copies[c].tensor);
      for (size_t b = 0; b < local_[i].current.size(); ++b) order.emplace_back(first[b], i, b);
    }
    std::sort(order.begin(), order.end());
    for (const auto& [name, i, b] : order) {
      Status staged = stop_ ? Aborted("the publish ended before staging did") : local_[i].stage(b);
      std::lock_guard lock(mu_);
      if (!staged.ok()) {
        failed_ = staged.WithContext(
            fmt::format("staging buffer '{}' of local sender {}", local_[i].layout->map().buffers[b].id, i));
        cv_.notify_all();
        return;
      }
      ready_[i][b] = true;
      cv_.notify_all();
    }
    std::lock_guard lock(mu_);
    done_ = true;
    seconds_ = SecondsSince(RealClock(), start_);
    cv_.notify_all();
  }

  std::span<const ShardSource> local_;
  const Clock::Instant start_;
  std::vector<bool> staged_;  // per sender: has a stage function (fixed at construction)
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<bool>> ready_;
  bool done_ = false;
  Status failed_;
  double seconds_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// One ShardPublisher::Publish call of one process of a trainer.
class ShardRun {
 public:
  ShardRun(PublishRun& run, Store& store, const std::string& state_dir, const PublishOptions& o,
           const RunRecord& record, std::span<const CompiledLayout* const> maps, std::span<const ShardSource> local,
           ShardProcesses procs, ShardsMemo& memo, ShardStaging& staging)
      : run_(run),
        store_(store),
        state_dir_(state_dir),
        o_(o),
        record_(record),
        maps_(maps.begin(), maps.end()),
        local_(local),
        procs_(std::move(procs)),
        memo_(memo),
        staging_(staging) {}

  Status Prepare();
  Result<PublishReport> Coordinate(uint64_t v);
  Result<PublishReport> Work(uint64_t v);
  // The local senders' current shards, which hold committed version `c`,
  // become the baseline (ShardPublisher::Adopt).
  Status AdoptCurrent(const CommitRecord& c);
  // After a publish that succeeded: the baseline stays open in the memo.
  void KeepShardsOpen() {
    if (memo_.valid) memo_.shards = std::move(baseline_);
  }

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
  // Fenced, superseded by a newer attempt, or v committed.
  Result<bool> Abandoned(uint64_t v, const std::string& id);
  // The local senders' baseline at committed version `want` (opened,
  // caught up, or rebuilt), into baseline_.
  Status LoadShards(const CommitRecord& want);  // timed into report_.baseline_seconds
  Status OpenOrRebuildShards(const CommitRecord& want);
  Status ApplyCommitted(uint64_t from, uint64_t to);
  Status WriteShardsRecord(uint64_t version, const Digest& digest);
  // Commit of an attempt this process recorded: the baseline becomes the
  // current shards, at `partial`.
  Status MoveBaseline(uint64_t v, const Digest& partial);
  void CopyCurrentIntoBaseline();
  uint32_t P() const { return procs_.processes; }
  uint32_t Me() const { return procs_.process; }

  PublishRun& run_;
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
  std::vector<RankBufferFiles> baseline_;
  PublishReport report_;
  ShardsMemo& memo_;  // the publisher's, across its publishes
  ShardStaging& staging_;
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

Status ShardRun::WriteShardsRecord(uint64_t version, const Digest& digest) {
  nlohmann::json doc = {
      {"run_id", record_.run_id}, {"version", version}, {"senders", local_ids_}, {"digest", digest.ToHex()}};
  DCR_RETURN_IF_ERROR(WriteFileAtomically(ShardsRecord(state_dir_), JsonText(doc, 1) + "\n"));
  memo_.valid = true;
  memo_.dir = state_dir_;
  memo_.run_id = record_.run_id;
  memo_.version = version;
  memo_.senders = local_ids_;
  memo_.digest = digest;
  return Status::Ok();
}

Status ShardRun::ApplyCommitted(uint64_t from, uint64_t to) {
  std::vector<uint8_t> scratch;
  for (uint64_t v = from + 1; v <= to; ++v) {
    DCR_ASSIGN_OR_RETURN(CommitRecord c, ReadCommit(store_, v));
    DCR_ASSIGN_OR_RETURN(DeltaReader delta, LoadAttempt(store_, v, c.attempt));
    for (size_t i = 0; i < delta.manifest().frames.size(); ++i) {
      DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
      for (RankBufferFiles& f : baseline_) {
        PlacedRank placed = f.placed();
        DCR_RETURN_IF_ERROR(ApplyRankFrame(placed, delta.manifest(), frame, &scratch).status());
      }
    }
  }
  return Status::Ok();
}

Status ShardRun::LoadShards(const CommitRecord& want) {
  const auto start = ClockOf(o_).Now();
  Status s = OpenOrRebuildShards(want);
  report_.baseline_seconds += SecondsSince(ClockOf(o_), start);
  PublisherMemory& mem = report_.memory;
  mem.baseline_bytes = mem.staging_bytes = 0;
  for (RankBufferFiles& f : baseline_) {
    const PlacedRank placed = f.placed();
    for (auto b : placed.buffers) mem.baseline_bytes += b.size();
  }
  mem.baseline_in_memory = OnMemoryFilesystem(state_dir_);
  for (const ShardSource& src : local_)
    if (src.stage)
      for (auto b : src.current) mem.staging_bytes += b.size();
  return s;
}

Status ShardRun::OpenOrRebuildShards(const CommitRecord& want) {
  baseline_.clear();
  std::vector<RankBufferFiles> remembered = std::move(memo_.shards);  // used when the record is the one remembered
  memo_.shards.clear();
  // The recorded baseline, when its files still hold the recorded digest.
  if (auto f = MappedFile::Open(ShardsRecord(state_dir_), false); f.ok()) {
    auto doc = nlohmann::json::parse(f->data().begin(), f->data().end(), nullptr, false);
    Digest recorded;
    if (!doc.is_discarded() && doc.is_object() && doc.value("run_id", "") == record_.run_id &&
        doc["version"].is_number_unsigned() && doc["version"].get<uint64_t>() <= want.version &&
        doc["senders"] == nlohmann::json(local_ids_) && doc["digest"].is_string() &&
        Digest::FromHex(doc["digest"].get<std::string>(), &recorded)) {
      const uint64_t at = doc["version"].get<uint64_t>();
      // This publisher wrote the record and nothing has touched the files
      // since (the directory is locked while publishing): no digest pass.
      const bool known = memo_.valid && memo_.dir == state_dir_ && memo_.run_id == record_.run_id &&
                         memo_.version == at && memo_.senders == local_ids_ && memo_.digest == recorded &&
                         remembered.size() == local_ids_.size();
      if (known) baseline_ = std::move(remembered);
      for (size_t i = baseline_.size(); i < local_ids_.size(); ++i) {
        auto opened = RankBufferFiles::Open(*local_[i].layout, ShardDir(state_dir_, local_ids_[i]));
        if (!opened.ok()) break;
        baseline_.push_back(std::move(*opened));
      }
      if (baseline_.size() == local_ids_.size() && (known || SendersDigest(baseline_) == recorded)) {
        Status caught = ApplyCommitted(at, want.version);
        const bool at_target =
            at == want.version ? recorded == want.target_digest : SendersDigest(baseline_) == want.target_digest;
        if (caught.ok() && (P() > 1 || at_target)) {
          if (at < want.version) DCR_RETURN_IF_ERROR(WriteShardsRecord(want.version, SendersDigest(baseline_)));
          return Status::Ok();
        }
        if (Transient(caught)) return caught;
      }
    }
  }
  // Rebuilt: the newest snapshot through the maps, then the committed deltas.
  memo_.valid = false;
  baseline_.clear();
  std::error_code ec;
  fs::remove(ShardsRecord(state_dir_), ec);
  fs::remove_all(ShardsDir(state_dir_), ec);
  DCR_ASSIGN_OR_RETURN(SnapshotRecord snap, NewestSnapshot(store_, want.version));
  const std::string tmp = (fs::path(state_dir_) / "shards.snapshot").string();
  fs::remove_all(tmp, ec);
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store_, snap, tmp, nullptr));
  {
    DCR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(tmp));
    DCR_RETURN_IF_ERROR(CheckRunTensors(ckpt, record_));
    for (size_t i = 0; i < local_ids_.size(); ++i) {
      DCR_ASSIGN_OR_RETURN(RankBufferFiles f,
                           RankBufferFiles::Create(*local_[i].layout, ShardDir(state_dir_, local_ids_[i])));
      PlacedRank placed = f.placed();
      DCR_RETURN_IF_ERROR(LoadDense(CheckpointBytes(ckpt), placed));
      baseline_.push_back(std::move(f));
    }
  }
  fs::remove_all(tmp, ec);
  DCR_RETURN_IF_ERROR(ApplyCommitted(snap.version, want.version));
  // With every sender here the rebuild is checked now; with several
  // processes, by the coordinator's sum of the processes' partials.
  const Digest digest = SendersDigest(baseline_);
  if (P() == 1 && digest != want.target_digest)
    return DataLoss(
        fmt::format("{}: the senders' shards rebuilt from the snapshot of version {} and the committed "
                    "deltas do not add up to version {}'s digest",
                    store_.url(), snap.version, want.version));
  return WriteShardsRecord(want.version, digest);
}

Status ShardRun::MoveBaseline(uint64_t v, const Digest& partial) {
  DCR_RETURN_IF_ERROR(staging_.AwaitAll());
  const auto start = ClockOf(o_).Now();
  memo_.valid = false;
  std::error_code ec;
  fs::remove(ShardsRecord(state_dir_), ec);
  CopyCurrentIntoBaseline();
  Status written = WriteShardsRecord(v, partial);
  report_.advance_seconds = SecondsSince(ClockOf(o_), start);
  return written;
}

void ShardRun::CopyCurrentIntoBaseline() {
  for (size_t i = 0; i < local_.size(); ++i) {
    PlacedRank base = baseline_[i].placed();
    for (size_t b = 0; b < base.buffers.size(); ++b)
      std::copy(local_[i].current[b].begin(), local_[i].current[b].end(), base.buffers[b].begin());
  }
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
    digest += RankDigest(current);
  }
  if (digest != c.target_digest)
    return FailedPrecondition(
        fmt::format("the senders' current shards are not version {} (digest {} != {}); adopt "
                    "only the tensors that version was published from",
                    c.version, digest.ToHex(), c.target_digest.ToHex()));
  memo_ = {};
  baseline_.clear();
  std::error_code ec;
  fs::remove(ShardsRecord(state_dir_), ec);
  fs::remove_all(ShardsDir(state_dir_), ec);
  for (size_t i = 0; i < local_ids_.size(); ++i) {
    DCR_ASSIGN_OR_RETURN(RankBufferFiles f,
                         RankBufferFiles::Create(*local_[i].layout, ShardDir(state_dir_, local_ids_[i])));
    baseline_.push_back(std::move(f));
  }
  CopyCurrentIntoBaseline();
  return WriteShardsRecord(c.version, digest);
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
  const std::string prefix = run_keys::Attempt(v, id);
  const auto encode_start = ClockOf(o_).Now();
  DeltaOptions options = o_.delta;
  options.encode.delta_class = doc.cls;
  options.chunk_elements = record_.chunk_elements;
  options.delta_id = doc.delta_id;
  const DeltaManifest m = StartLayoutDelta(infos_, options);
  // Project the local senders; each record goes to its chunk owner's process.
  std::vector<std::vector<ChunkContribution>> to(P());
  Participation out;
  ProcessRecord& rec = out.record;
  // Chunks this process merges that one local sender holds whole are
  // encoded straight from its shards (direct contributions); their part of
  // the partial digests comes from the encode.
  const auto owned_here = [&](uint32_t tensor, uint32_t chunk) {
    auto owner = ChunkOwner(maps_, m, tensor, chunk);
    return owner.ok() && procs_.sender_process[*owner] == Me();
  };
  std::set<ChunkId> direct;
  DCR_RETURN_IF_ERROR(Fault(o_, "projecting"));
  for (size_t i = 0; i < local_.size(); ++i) {
    PlacedRank base = baseline_[i].placed();
    SenderRank rank{local_[i].layout, {}, local_[i].current, staging_.AwaiterFor(i)};
    for (auto b : base.buffers) rank.baseline.push_back(b);
    DCR_ASSIGN_OR_RETURN(auto contributions, ProjectSender(rank, local_ids_[i], m, owned_here));
    for (ChunkContribution& c : contributions) {
      if (c.direct()) {
        direct.insert(ChunkId{c.tensor, c.chunk});
        to[Me()].push_back(std::move(c));
        continue;
      }
      // The local partials, before and after: the target is the baseline's
      // digest with each changed element's term moved from old to new bits.
      const DeltaTensor& t = m.tensors[c.tensor];
      const DigestKey key = MakeDigestKey(t.name);
      const uint64_t eb = BitsPerElement(t.dtype) / 8, first = uint64_t{c.chunk} * m.chunk_elements;
      rec.baseline_digest += c.base_digest;
      rec.target_digest += c.base_digest;
      for (size_t j = 0; j < c.positions.size(); ++j) {
        const uint64_t at = (first + c.positions[j]) * eb;
        rec.target_digest -= DigestBytes(key, at, {c.old_bits.data() + j * eb, eb});
        rec.target_digest += DigestBytes(key, at, {c.new_bits.data() + j * eb, eb});
      }
      DCR_ASSIGN_OR_RETURN(uint32_t owner, ChunkOwner(maps_, m, c.tensor, c.chunk));
      to[procs_.sender_process[owner]].push_back(std::move(c));
    }
  }
  // One object per peer, written even when empty (the peer waits for it).
  for (uint32_t q = 0; q < P(); ++q) {
    if (q == Me()) continue;
    DCR_ASSIGN_OR_RETURN(std::string bytes, WriteContributions({doc.delta_id, doc.cls, Me(), q}, m, to[q]));
    DCR_RETURN_IF_ERROR(store_.Put(prefix + ContribKey(Me(), q), bytes));
  }
  DCR_RETURN_IF_ERROR(Fault(o_, "contributions-written"));
  std::vector<ChunkContribution> mine = std::move(to[Me()]);
  std::set<uint32_t> missing;
  for (uint32_t q = 0; q < P(); ++q)
    if (q != Me()) missing.insert(q);
  while (!missing.empty()) {
    for (auto it = missing.begin(); it != missing.end();) {
      const std::string key = prefix + ContribKey(*it, Me());
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
    if (missing.empty()) break;
    DCR_ASSIGN_OR_RETURN(bool abandoned, Abandoned(v, id));
    if (abandoned) return out;
    if (ClockOf(o_).Now() >= deadline) {
      if (Me() != 0) {
        out.outcome = Outcome::kStalled;
        return out;
      }
      return Unavailable(
          fmt::format("process {} wrote no contributions for attempt {} within the peer timeout ({} "
                      "ms); is it running, as process {} of {}?",
                      *missing.begin(), id, o_.peer_timeout.count(), *missing.begin(), P()));
    }
    ClockOf(o_).Sleep(o_.peer_poll);
  }
  DCR_ASSIGN_OR_RETURN(OwnedFrames owned, EncodeOwnedChunks(m, mine, options.encode));
  // The frames of the owned chunks, back to back in (tensor, chunk) order.
  std::string bytes;
  for (size_t i = 0; i < owned.chunks.size(); ++i) {
    rec.chunks.push_back(
        {owned.chunks[i].tensor, owned.chunks[i].chunk, owned.base_digests[i], owned.target_digests[i]});
    if (direct.count(owned.chunks[i])) {
      rec.baseline_digest += owned.base_digests[i];
      rec.target_digest += owned.target_digests[i];
    }
    if (owned.frame_of[i] < 0) continue;
    const std::string& f = owned.frames[static_cast<size_t>(owned.frame_of[i])];
    DCR_ASSIGN_OR_RETURN(FrameView fv, ParseFrame({reinterpret_cast<const uint8_t*>(f.data()), f.size()}));
    rec.frames.push_back({owned.chunks[i].tensor, owned.chunks[i].chunk, 0, bytes.size(), f.size(), fv.header.mode,
                          fv.header.codec, fv.header.changed});
    bytes += f;
  }
  if (!bytes.empty()) {
    // Signed by a key of this process for this attempt, whose public half
    // is in the store before the object: receivers verify relayed copies.
    rec.objects = {fmt::format("frames/s{}-0000.bin", Me())};  // a segment name: relays carry it
    DCR_ASSIGN_OR_RETURN(const ObjectSigner signer, ObjectSigner::Generate());
    DCR_RETURN_IF_ERROR(store_.Put(prefix + ProcessSignerKey(Me()), signer.public_hex() + "\n"));
    bytes = signer.Sign(prefix + rec.objects[0], std::move(bytes));
    report_.memory.frames_in_flight_bytes = std::max<uint64_t>(report_.memory.frames_in_flight_bytes, bytes.size());
    DCR_RETURN_IF_ERROR(store_.Put(prefix + rec.objects[0], bytes));
    if (o_.relay) o_.relay->Object(prefix + rec.objects[0], bytes);
  }
  rec.attempt = id;
  rec.process = Me();
  rec.processes = P();
  rec.senders = local_ids_;
  DCR_RETURN_IF_ERROR(store_.Put(prefix + ProcessKey(Me()), rec.ToJson()));
  DCR_RETURN_IF_ERROR(Fault(o_, "record-written"));
  report_.encode_seconds += SecondsSince(ClockOf(o_), encode_start);
  out.outcome = Outcome::kRecorded;
  return out;
}

Result<PublishReport> ShardRun::Coordinate(uint64_t v) {
  const auto start = ClockOf(o_).Now();
  report_.version = v;
  DCR_ASSIGN_OR_RETURN(CommitRecord base_commit, ReadCommit(store_, v - 1));
  DCR_RETURN_IF_ERROR(LoadShards(base_commit));
  DCR_ASSIGN_OR_RETURN(auto prior, ListAttempts(store_, v));
  Status last_failure;
  for (uint32_t n = 0; n < std::max<uint32_t>(o_.max_attempts, 1); ++n) {
    DeltaClass cls;
    const std::string id = NextAttempt(prior.size() + n, &cls);
    const std::string prefix = run_keys::Attempt(v, id);
    Digest partial;  // this process's senders at v
    auto attempt = [&]() -> Result<PublishRun::AttemptResult> {
      AttemptRecord doc;
      doc.version = v;
      doc.cls = cls;
      doc.delta_id = std::strtoull(RandomHex(16).c_str(), nullptr, 16) | 1;
      doc.coordinator = o_.coordinator_id;
      doc.processes = P();
      doc.senders = maps_.size();
      doc.time = ClockOf(o_).UnixSeconds();
      DCR_RETURN_IF_ERROR(store_.Put(prefix + "attempt.json", doc.ToJson(), WriteMode::kCreateIfAbsent));
      DCR_ASSIGN_OR_RETURN(Participation own, Participate(v, id, doc, ClockOf(o_).Now() + o_.peer_timeout));
      if (own.outcome != Outcome::kRecorded)
        return PublishRun::AttemptResult{false, Aborted("the attempt was fenced or superseded while it ran")};
      partial = own.record.target_digest;
      // Every process's record.
      std::vector<ProcessRecord> records(P());
      records[Me()] = std::move(own.record);
      const auto deadline = ClockOf(o_).Now() + o_.peer_timeout;
      for (uint32_t q = 1; q < P();) {
        const std::string key = prefix + ProcessKey(q);
        DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store_, key));
        if (!text) {
          if (ClockOf(o_).Now() >= deadline)
            return PublishRun::AttemptResult{
                false,
                Unavailable(fmt::format("process {} wrote no record for attempt {} within the peer timeout ({} ms)", q,
                                        id, o_.peer_timeout.count()))};
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
        records[q] = std::move(r);
        ++q;
      }
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
        return PublishRun::AttemptResult{
            false, Aborted(fmt::format("attempt {}: the chunk digests of the processes' records disagree with their "
                                       "partials (base {} vs {}, target {} vs {})",
                                       id, m.base_digest.ToHex(), base_commit.target_digest.ToHex(),
                                       m.target_digest.ToHex(), target_sum.ToHex()))};
      report_.attempt = id;
      report_.frame_bytes = m.frame_bytes;
      report_.payload_bytes = m.payload_bytes;
      report_.changed_words = m.changed_words;
      DCR_RETURN_IF_ERROR(Fault(o_, "frames-written"));
      DCR_RETURN_IF_ERROR(store_.Put(prefix + std::string(kManifestFileName), m.ToJson(), WriteMode::kCreateIfAbsent));
      DCR_RETURN_IF_ERROR(Fault(o_, "manifest-written"));
      DeltaManifest committed;
      return run_.AwaitAcksAndCommit(v, id, std::move(m), &report_, &committed);
    };
    ++report_.attempts;
    DCR_ASSIGN_OR_RETURN(bool committed, run_.Settle(v, id, attempt(), &last_failure));
    if (!committed) {
      DCR_RETURN_IF_ERROR(staging_.Failure());  // the attempt is fenced; another would fail the same way
      continue;
    }
    DCR_RETURN_IF_ERROR(Fault(o_, "committed"));
    DCR_RETURN_IF_ERROR(MoveBaseline(v, partial));
    CollectGarbage(store_, o_.keep_versions, o_.heartbeat_timeout, ClockOf(o_)).IgnoreError();
    report_.staging_seconds = staging_.seconds();
    report_.total_seconds = SecondsSince(ClockOf(o_), start);
    return report_;
  }
  return Aborted(fmt::format("version {} was not committed after {} attempts; last failure: {}", v, report_.attempts,
                             last_failure.ToString()));
}

Result<PublishReport> ShardRun::Work(uint64_t v) {
  const auto start = ClockOf(o_).Now();
  report_.version = v;
  DCR_ASSIGN_OR_RETURN(CommitRecord base_commit, ReadCommit(store_, v - 1));
  DCR_RETURN_IF_ERROR(LoadShards(base_commit));
  std::map<std::string, Digest> recorded;  // attempts this process recorded -> its partial at v
  std::set<std::string> tried;  // attempts it took part in, or refused
  std::string joined;  // the attempt last joined
  auto idle_until = ClockOf(o_).Now() + o_.peer_timeout;
  for (;;) {
    DCR_ASSIGN_OR_RETURN(auto commit_text, GetIfPresent(store_, run_keys::Commit(v)));
    if (commit_text) {
      DCR_ASSIGN_OR_RETURN(CommitRecord c,
                           CommitRecord::FromJson(*commit_text, StoreContext(store_.url(), run_keys::Commit(v))));
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
      report_.staging_seconds = staging_.seconds();
      report_.total_seconds = SecondsSince(ClockOf(o_), start);
      return report_;
    }
    DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store_, v));
    const AttemptInfo* newest = nullptr;
    for (const AttemptInfo& a : attempts)
      if (!a.fenced) newest = &a;
    if (newest && !tried.count(newest->id)) {
      const std::string key = run_keys::Attempt(v, newest->id) + "attempt.json";
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

namespace {

Result<std::string> StateDir(const std::string& configured, Store& store) {
  if (!configured.empty()) return configured;
  return DefaultPublisherStateDir(store.url());
}

Result<PublishReport> PublishVersion(Store& store, const std::string& state_dir, const PublishOptions& options,
                                     uint64_t version, const Checkpoint& next, Progress* progress);

}  // namespace

ShardPublisher::ShardPublisher(Store& store, std::string state_dir, PublishOptions options)
    : store_(store),
      state_dir_(std::move(state_dir)),
      options_(std::move(options)),
      memo_(std::make_unique<ShardsMemo>()) {
  if (options_.coordinator_id.empty()) options_.coordinator_id = DefaultId();
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
    DCR_ASSIGN_OR_RETURN(const std::string dir, StateDir(p.state_dir_, p.store_));
    DCR_ASSIGN_OR_RETURN(StateDirLock lock, StateDirLock::Acquire(dir));
    PublishRun run(p.store_, dir, p.options_, nullptr);
    ShardRun shards(run, p.store_, dir, p.options_, *state.run, maps, local, procs, *p.memo_, staging);
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
  return ShardCall::Run(*this, maps, local, procs, check,
                        [&](ShardRun& shards) { return worker ? shards.Work(version) : shards.Coordinate(version); });
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

Result<PublishReport> Publisher::Publish(uint64_t version, const Checkpoint& next, Progress* progress) {
  DCR_ASSIGN_OR_RETURN(const std::string dir, StateDir(state_dir_, store_));
  DCR_ASSIGN_OR_RETURN(StateDirLock lock, StateDirLock::Acquire(dir));
  auto r = PublishVersion(store_, dir, options_, version, next, progress);
  if (r.ok()) r->state_dir = dir;
  return r;
}

namespace {

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
    if (Total(ChunkDigests(next, LayoutOf(*state.run))) != c.target_digest)
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
}  // namespace dcr
