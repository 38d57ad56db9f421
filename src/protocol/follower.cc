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

#include "internal.h"
#include "journals.h"

namespace dcr {

using namespace protocol_internal;
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

std::string DefaultReceiverId() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return fmt::format("{}-{}", host, ::getpid());
}

// One Run() call's state.
class FollowRun {
 public:
  FollowRun(Store& store, const std::string& target, const FollowOptions& o, uint64_t* version)
      : store_(store), target_(target), o_(o), version_(*version), version_out_(version),
        heartbeat_(store, o.id, EngineRank{}, o.heartbeat_every, [this](const std::string& l) { Log(l); }) {}

  Status Run(std::optional<uint64_t> until, const std::function<bool()>& stop);

 private:
  void Log(const std::string& line) { FollowLog(o_, line); }
  Status Fault(std::string_view point) { return o_.fault ? o_.fault(point) : Status::Ok(); }
  bool Stopped(const std::function<bool()>& stop) { return stop && stop(); }
  void Sleep() { std::this_thread::sleep_for(o_.poll); }

  Status Start(const std::function<bool()>& stop);
  Status Join(uint64_t at_most, const std::string& why);
  Status OpenTarget();
  Status Commit(uint64_t v);  // the target holds committed v
  Status SetState(const std::string& state) { return heartbeat_.Set(state); }
  Status Step();
  void TakeFromRelay(const std::string& prefix);
  // Waits for the relay to deliver `objects`; `arrived` runs after each take.
  Status AwaitRelay(const std::string& prefix, const std::vector<std::string>& objects,
                    const std::function<Status()>& arrived);
  // The objects (and bytes) under `prefix` in prefetched_ that the relay delivered.
  std::pair<size_t, uint64_t> Relayed(const std::string& prefix) const;
  // Applies the frames of attempt `a` of version v that are in prefetched_
  // and not yet looked at, ahead of the manifest's apply (while the attempt
  // streams, or while the relay still delivers); see its definition.
  Status StreamApply(uint64_t v, const AttemptInfo& a);

  Store& store_;
  const std::string& target_;
  const FollowOptions& o_;
  uint64_t& version_;
  uint64_t* version_out_;
  RunRecord run_;
  Journal journal_;
  std::optional<Checkpoint> ckpt_;
  ChunkDigestTable digests_;
  std::set<std::string> handled_;  // attempts acked (or nacked) by this run
  std::map<uint64_t, int> commit_failures_;  // committed versions that failed to apply
  // Frame objects of version_ + 1's streaming attempts, downloaded before
  // their manifest (full key -> bytes); LoadAttempt takes them from here.
  std::map<std::string, std::string> prefetched_;
  std::set<std::string> from_relay_;  // keys in prefetched_ that the relay delivered
  // Streaming apply: per attempt of version_ + 1, what its attempt.json
  // says and which frame objects were applied before the manifest.
  struct Streamed {
    StreamedAttempt attempt;
    std::set<std::string> objects;  // frame objects looked at
    uint64_t applied = 0, already = 0, left = 0;  // frames
  };
  std::map<std::string, Streamed> streamed_;
  DeltaManifest layout_;               // the run's tensors and chunking
  std::vector<DigestKey> keys_;        // per run tensor
  std::vector<size_t> target_index_;   // per run tensor: its index in ckpt_
  ChunkApplier applier_;

  Heartbeat heartbeat_;
};

Status FollowRun::OpenTarget() {
  ckpt_.reset();
  DCR_ASSIGN_OR_RETURN(Checkpoint c, Checkpoint::Open(target_, OpenMode::kReadWrite));
  DCR_RETURN_IF_ERROR(CheckRunTensors(c, run_));
  ckpt_.emplace(std::move(c));
  layout_ = LayoutOf(run_);
  keys_.clear();
  target_index_.clear();
  for (const auto& t : layout_.tensors) {
    keys_.push_back(MakeDigestKey(t.name));
    target_index_.push_back(static_cast<size_t>(ckpt_->Find(t.name)));
  }
  digests_ = ChunkDigests(*ckpt_, layout_);
  return Status::Ok();
}

Status FollowRun::Commit(uint64_t v) {
  version_ = v;
  heartbeat_.SetVersion(v);
  *version_out_ = v;
  prefetched_.clear();
  from_relay_.clear();
  streamed_.clear();
  if (o_.relay) o_.relay->Take(run_keys::Attempts(v));  // late copies of what it now holds
  journal_.version = v;
  journal_.attempt.clear();
  return WriteJournal(target_, journal_);
}

// Replaces the target with the newest snapshot at or below `at_most`.
Status FollowRun::Join(uint64_t at_most, const std::string& why) {
  ckpt_.reset();
  DCR_ASSIGN_OR_RETURN(SnapshotRecord snap, NewestSnapshot(store_, at_most));
  Log(fmt::format("joining from the snapshot of version {} ({})", snap.version, why));
  SetState("joining").IgnoreError();
  // Journal the join before the download: a receiver killed in the middle
  // (some files of the snapshot in place, some not) finds the journal and
  // joins again instead of refusing a checkpoint it does not recognize.
  std::error_code ec;
  fs::create_directories(target_, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + target_);
  journal_ = Journal{run_.run_id, o_.id, std::string(kJoining), snap.version};
  DCR_RETURN_IF_ERROR(WriteJournal(target_, journal_));
  DCR_RETURN_IF_ERROR(DownloadSnapshot(store_, snap, target_, nullptr));
  DCR_RETURN_IF_ERROR(OpenTarget());
  if (Total(digests_) != snap.digest)
    return DataLoss(fmt::format("{}: the snapshot of version {} does not have its recorded digest", store_.url(),
                                snap.version));
  return Commit(snap.version);
}

Status FollowRun::Start(const std::function<bool()>& stop) {
  // Wait for the run to exist.
  RunState state;
  for (;;) {
    DCR_ASSIGN_OR_RETURN(state, ReadRunState(store_));
    if (state.run && state.latest) break;
    if (Stopped(stop)) return Aborted("stopped before the run started");
    Sleep();
  }
  run_ = *state.run;
  DCR_ASSIGN_OR_RETURN(auto journal, ReadJournal(target_));
  if (journal && journal->run_id != run_.run_id)
    return FailedPrecondition(fmt::format(
        "{} follows run {}, but {} holds run {}; follow into an empty directory to join this run", target_,
        journal->run_id, store_.url(), run_.run_id));
  if (!journal) {
    if (!HoldsCheckpoint(target_)) return Join(*state.latest, "new receiver");
    // An existing checkpoint: adopt it if it is a committed version.
    DCR_RETURN_IF_ERROR(OpenTarget());
    const Digest d = Total(digests_);
    for (uint64_t v = *state.latest + 1; v-- > 0;) {
      auto c = ReadCommit(store_, v);
      if (c.ok() && c->target_digest == d) {
        journal_ = Journal{run_.run_id, o_.id, "", v};
        Log(fmt::format("{} holds committed version {}", target_, v));
        return Commit(v);
      }
    }
    return FailedPrecondition(fmt::format(
        "{} holds a checkpoint that is no committed version of run {} in {}; follow into an empty directory to join "
        "from a snapshot",
        target_, run_.run_id, store_.url()));
  }
  journal_ = *journal;
  journal_.receiver = o_.id;
  version_ = journal_.version;
  heartbeat_.SetVersion(version_);
  *version_out_ = version_;
  if (journal_.attempt == kJoining) return Join(*state.latest, "restarted while joining");
  if (!HoldsCheckpoint(target_)) return Join(*state.latest, "the journal's checkpoint is missing");
  if (Status s = OpenTarget(); !s.ok()) return Join(*state.latest, "cannot open the checkpoint: " + s.ToString());
  auto c = ReadCommit(store_, version_);
  if (!c.ok()) return c.status().WithContext("the version " + target_ + " claims to hold");
  if (Total(digests_) != c->target_digest) {
    if (!journal_.attempt.empty()) {
      Log(fmt::format("restarted while applying attempt {}; the next attempt or the commit repairs it", journal_.attempt));
      return Status::Ok();
    }
    return Join(*state.latest, fmt::format("{} does not hold version {} as its journal claims", target_, version_));
  }
  return Status::Ok();
}

Status FollowRun::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  return FollowLoop(
      heartbeat_, o_, [&] { return Start(stop); }, [&] { return Step(); },
      [&] { return until && version_ >= *until; }, stop, [this](const std::string& l) { Log(l); });
}

void FollowRun::TakeFromRelay(const std::string& prefix) {
  if (!o_.relay) return;
  for (auto& [key, bytes] : o_.relay->Take(prefix)) {
    if (prefetched_.count(key)) continue;  // already downloaded from the store
    from_relay_.insert(key);
    prefetched_.emplace(key, std::move(bytes));
  }
}

Status FollowRun::AwaitRelay(const std::string& prefix, const std::vector<std::string>& objects,
                             const std::function<Status()>& arrived) {
  if (!o_.relay) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    TakeFromRelay(prefix);
    DCR_RETURN_IF_ERROR(arrived());
    const bool complete =
        std::all_of(objects.begin(), objects.end(), [&](const std::string& k) { return prefetched_.count(k) > 0; });
    // Also while the relay is detached: its client re-attaches upstream
    // within its dead_after, and the new parent sends what is missing.
    if (complete) return Status::Ok();
    const auto now = std::chrono::steady_clock::now();
    if (now - std::max(start, o_.relay->LastDelivery()) > o_.relay_quiet) {
      Log(fmt::format("the relay delivered nothing for {} ms; downloading the missing frame objects of {} from the store",
                      o_.relay_quiet.count(), prefix));
      return Status::Ok();
    }
    std::this_thread::sleep_for(std::min(o_.stream_poll, o_.poll));
  }
}

std::pair<size_t, uint64_t> FollowRun::Relayed(const std::string& prefix) const {
  std::pair<size_t, uint64_t> r{0, 0};
  for (const auto& [key, bytes] : prefetched_)
    if (key.starts_with(prefix) && from_relay_.count(key)) {
      ++r.first;
      r.second += bytes.size();
    }
  return r;
}

// Frames of a streaming attempt are applied as their objects arrive (also
// those the relay delivers after the manifest is in), each
// one fully checked: the object parses frame by frame (header and payload
// checksums), every frame carries attempt.json's delta id, a mode of its
// class, and the run's shape of its chunk, and is applied only to a chunk
// that is its base (ChunkApplier verifies the result's digest before a byte
// is written); a chunk already at the frame's target is left alone, and one
// in any other state is left to the manifest (ApplyDelta repairs it with an
// overwrite frame, or the attempt is nacked). The journal names the attempt
// before the first write, so a restarted follower knows its bits may be
// between versions; which chunks are done is in their digests, so no xor
// frame is ever applied twice. Nothing is applied once the attempt is fenced.
Status FollowRun::StreamApply(uint64_t v, const AttemptInfo& a) {
  auto it = streamed_.find(a.id);
  if (it == streamed_.end()) {
    DCR_ASSIGN_OR_RETURN(auto attempt, ReadStreamedAttempt(store_, v, a.id, [this](const std::string& l) { Log(l); }));
    if (!attempt) return Status::Ok();
    it = streamed_.emplace(a.id, Streamed{*attempt}).first;
  }
  Streamed& st = it->second;
  if (!st.attempt.usable) return Status::Ok();
  DCR_ASSIGN_OR_RETURN(auto todo, StreamedObjectsToApply(store_, v, a, prefetched_, &st.objects));
  if (todo.empty()) return Status::Ok();
  if (journal_.attempt != a.id) {
    journal_.attempt = a.id;
    DCR_RETURN_IF_ERROR(WriteJournal(target_, journal_));
  }
  SetState("applying").IgnoreError();
  DCR_RETURN_IF_ERROR(Fault("stream-applying"));
  for (const auto& key : todo) {
    auto apply = [&](const FrameView& frame, size_t offset) {
      const FrameHeader& h = frame.header;
      Digest& now = digests_[h.tensor][h.chunk];
      if (now == h.target_digest) {
        ++st.already;
        return;
      }
      if (now != h.base_digest) {
        ++st.left;
        return;
      }
      uint64_t first_word = 0, words = 0;
      uint32_t elements = 0;
      layout_.ChunkWords(h.tensor, h.chunk, &first_word, &words, &elements);
      const uint64_t wb = WordBytes(h.dtype);
      auto chunk = ckpt_->MutableData(target_index_[h.tensor]).subspan(first_word * wb, words * wb);
      Digest after;
      auto outcome = applier_.Apply(frame, keys_[h.tensor], first_word, chunk, now, &after);
      if (!outcome.ok()) {
        Log(fmt::format("{} at offset {}: not applied before the manifest: {}", key, offset,
                        outcome.status().ToString()));
        ++st.left;
        return;
      }
      now = after;
      ++st.applied;
    };
    ForEachStreamedFrame(key, prefetched_.at(key), layout_, st.attempt, apply, [this](const std::string& l) { Log(l); });
  }
  return Status::Ok();
}

// One step towards version_ + 1: apply its commit, or the open attempts.
Status FollowRun::Step() {
  if (!ckpt_) {  // a join was interrupted by a store failure
    DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
    return Join(*state.latest, "resuming an interrupted join");
  }
  const uint64_t v = version_ + 1;
  DCR_ASSIGN_OR_RETURN(auto commit_text, GetIfPresent(store_, run_keys::Commit(v)));
  if (commit_text) {
    DCR_ASSIGN_OR_RETURN(CommitRecord c, CommitRecord::FromJson(*commit_text, StoreContext(store_.url(), run_keys::Commit(v))));
    if (std::find(c.retired.begin(), c.retired.end(), o_.id) != c.retired.end())
      Log(fmt::format("retired from version {} (no ack before the deadline): catching up from the committed delta, "
                      "or the newest snapshot if that is impossible",
                      v));
    if (Total(digests_) != c.target_digest) {
      // Catch up through the committed attempt (a late or retired receiver).
      TakeFromRelay(run_keys::Attempt(v, c.attempt));
      auto delta = LoadAttempt(store_, v, c.attempt, &prefetched_);
      Status s = delta.status();
      if (delta.ok()) {
        journal_.attempt = c.attempt;
        DCR_RETURN_IF_ERROR(WriteJournal(target_, journal_));
        auto applied = ApplyDelta(*ckpt_, *delta, nullptr, nullptr, &digests_, /*sync=*/false);
        s = applied.status();
        if (s.ok() && Total(digests_) != c.target_digest) s = DataLoss("the committed delta did not reach its digest");
      }
      if (Transient(s)) return s;
      if (!s.ok()) {
        // Once from a snapshot; if the committed delta fails again the store's
        // copy of version v is damaged and rejoining would loop.
        if (++commit_failures_[v] > 1)
          return DataLoss(fmt::format(
              "{}: committed version {} (attempt {}) cannot be applied even after rejoining from a snapshot: {}. The "
              "store's copy of that version is damaged; receivers can only pass it from a newer snapshot (publish "
              "with --snapshot-every)",
              store_.url(), v, c.attempt, s.ToString()));
        DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
        return Join(*state.latest, "cannot apply committed version " + std::to_string(v) + ": " + s.ToString());
      }
    }
    DCR_RETURN_IF_ERROR(Commit(v));
    SetState("following").IgnoreError();
    Log(fmt::format("at version {} (attempt {})", v, c.attempt.empty() ? "snapshot" : c.attempt));
    return Status::Ok();
  }
  DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store_, v));
  bool progressed = false, streaming = false;
  for (const auto& a : attempts) {
    if (a.fenced || handled_.count(a.id) || std::find(a.acks.begin(), a.acks.end(), o_.id) != a.acks.end()) {
      std::erase_if(prefetched_, [&](const auto& kv) { return kv.first.starts_with(run_keys::Attempt(v, a.id)); });
      if (o_.relay) o_.relay->Take(run_keys::Attempt(v, a.id));  // dropped
      continue;
    }
    const std::string prefix = run_keys::Attempt(v, a.id);
    if (!a.has_manifest) {
      // Streaming: take what the relay delivered; without one attached,
      // download the frame objects written so far, so that only the last
      // one or two remain when the manifest appears.
      streaming = true;
      const size_t before = prefetched_.size();
      TakeFromRelay(prefix);
      if (prefetched_.size() != before) progressed = true;
      if (!o_.relay || !o_.relay->Attached())
        DCR_RETURN_IF_ERROR(PrefetchFrameObjects(store_, a, &prefetched_, &progressed));
      // Only the newest attempt: an older one is being replaced (a takeover
      // or retry), and its frames would only be overwritten.
      if (a.id == attempts.back().id) DCR_RETURN_IF_ERROR(StreamApply(v, a));
      continue;
    }
    // The manifest may be in long before the relay tree delivers the last
    // objects (the store is not the tree's link): apply them as they come.
    DCR_RETURN_IF_ERROR(AwaitRelay(prefix, a.frame_objects, [&] { return StreamApply(v, a); }));
    const auto [relayed, relayed_bytes] = Relayed(prefix);
    auto delta = LoadAttempt(store_, v, a.id, &prefetched_);
    const auto ready = std::chrono::steady_clock::now();  // the manifest and every frame object are here
    if (Transient(delta.status())) return delta.status();
    if (o_.relay && delta.ok()) {
      const uint64_t frame_bytes = delta->manifest().frame_bytes;
      Log(fmt::format("version {} attempt {}: frame objects {}/{} ({} bytes) from the relay, {} ({} bytes) from the store",
                      v, a.id, relayed, a.frame_objects.size(), relayed_bytes,
                      a.frame_objects.size() - std::min(a.frame_objects.size(), relayed),
                      frame_bytes - std::min(frame_bytes, relayed_bytes)));
    }
    journal_.attempt = a.id;
    DCR_RETURN_IF_ERROR(WriteJournal(target_, journal_));
    SetState("applying").IgnoreError();
    DCR_RETURN_IF_ERROR(Fault("applying"));
    Status s = delta.status();
    if (delta.ok()) {
      auto applied = ApplyDelta(*ckpt_, *delta, nullptr, nullptr, &digests_, /*sync=*/false);
      s = applied.status();
      if (s.ok() && Total(digests_) != delta->manifest().target_digest)
        s = DataLoss("applied every frame but the checkpoint's digest is not the target's");
    }
    DCR_RETURN_IF_ERROR(Fault("applied"));
    AckRecord ack;
    ack.receiver = o_.id;
    ack.ok = s.ok();
    ack.digest = Total(digests_);
    ack.error = s.ok() ? "" : s.ToString();
    const Streamed& st = streamed_[a.id];
    Log(s.ok() ? fmt::format("applied version {} attempt {} ({:.3f} s after the manifest and frame objects were in; "
                             "streamed frames: {} applied as they arrived, {} already done, {} left to "
                             "the manifest)",
                             v, a.id, std::chrono::duration<double>(std::chrono::steady_clock::now() - ready).count(),
                             st.applied, st.already, st.left)
               : fmt::format("cannot apply version {} attempt {}: {}", v, a.id, s.ToString()));
    DCR_RETURN_IF_ERROR(store_.Put(run_keys::Attempt(v, a.id) + "acks/" + o_.id + ".json", ack.ToJson()));
    // In the store first (the record), then up the relay tree (the fast path to the coordinator).
    if (o_.relay) o_.relay->Ack(prefix, ack);
    DCR_RETURN_IF_ERROR(Fault("acked"));
    handled_.insert(a.id);
    progressed = true;
    SetState("following").IgnoreError();
  }
  if (!progressed) std::this_thread::sleep_for(streaming ? std::min(o_.stream_poll, o_.poll) : o_.poll);
  return Status::Ok();
}

}  // namespace

Follower::Follower(Store& store, std::string target, FollowOptions options)
    : store_(store), target_(std::move(target)), options_(std::move(options)) {
  if (options_.id.empty()) options_.id = DefaultReceiverId();
}

Status Follower::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  if (Status s = ValidateKey(run_keys::Receiver(options_.id)); !s.ok())
    return InvalidArgument("receiver id '" + options_.id + "' cannot name an object: " + s.message());
  FollowRun run(store_, target_, options_, &version_);
  return run.Run(until, stop);
}

}  // namespace dcr
