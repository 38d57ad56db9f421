// The receiver's walk of the protocol (receiver.h; docs/protocol.md, "Receivers").
#include "receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace dcr::receiver_internal {

ReceiverWalk::ReceiverWalk(Store& store, ReceiverTarget& target, FollowOptions options)
    : store_(store),
      target_(target),
      o_(std::move(options)),
      fetcher_(store, o_.fetch_ahead),
      heartbeat_(store, o_.id, target.Engine(), o_.heartbeat_every, ClockOf(o_),
                 [this](const std::string& l) { Log(l); }),
      metrics_(o_.id) {
  heartbeat_.SetMasterBytes(target.MasterBytes());
}

Status ReceiverWalk::Run(std::optional<uint64_t> until, const std::function<bool()>& stop) {
  Status s = FollowLoop(
      heartbeat_, o_, [&] { return started_ ? Recheck(stop) : Start(stop); }, [&] { return Step(); },
      [&] { return until && version_ >= *until; }, stop, [this](const std::string& l) { Log(l); });
  // After an error the target is reopened by the next Run: what it holds is
  // whatever its journal and bits say.
  started_ = s.ok();
  return s;
}

Status ReceiverWalk::Start(const std::function<bool()>& stop) {
  RunState state;
  for (;;) {  // wait for the run to exist
    DCR_ASSIGN_OR_RETURN(state, ReadRunState(store_));
    if (state.run && state.latest) break;
    if (stop && stop()) return Aborted("stopped before the run started");
    ClockOf(o_).Sleep(o_.poll);
  }
  run_ = *state.run;
  shape_ = TensorTableOf(run_);
  handled_.clear();
  commit_failures_.clear();
  ForgetAttempts();
  std::string why;
  DCR_ASSIGN_OR_RETURN(auto held, target_.Resume(store_, run_, *state.latest, &why));
  if (!held) DCR_RETURN_IF_ERROR(Join(*state.latest, why));
  else {
    version_ = *held;
    heartbeat_.SetVersion(version_);
  }
  return Status::Ok();
}

// A Run that continues: with FollowOptions::recheck, the bits are read
// again. Chunks changed outside dcr since the last version make the walk
// start over (the target, reopened, no longer holds its journal's version:
// it rejoins from the newest snapshot and catches up), so that no version
// is acked or reported on top of bits dcr did not write.
Status ReceiverWalk::Recheck(const std::function<bool()>& stop) {
  if (!o_.recheck) return Status::Ok();
  outside_changes_.clear();
  DCR_ASSIGN_OR_RETURN(std::string changed, target_.Recheck());
  if (changed.empty()) {
    if (target_.Open()) heartbeat_.SetVerified(target_.AckDigest(), ClockOf(o_).UnixSeconds());
    return Status::Ok();
  }
  outside_changes_ = changed;
  metrics_.ChangedOutside();
  Log(fmt::format("the bits of version {} were changed outside dcr: {}; rejoining", version_, changed));
  started_ = false;  // a transient failure of Start is retried as a start
  return Start(stop);
}

// Replaces the target's bits with the newest snapshot at or below `at_most`.
Status ReceiverWalk::Join(uint64_t at_most, const std::string& why) {
  DCR_ASSIGN_OR_RETURN(SnapshotRecord snap, NewestSnapshot(store_, at_most));
  Log(fmt::format("joining from the snapshot of version {} ({})", snap.version, why));
  SetState("joining").IgnoreError();
  {
    StageTimer timer(metrics_, Stage::kJoin);
    DCR_RETURN_IF_ERROR(target_.Join(store_, run_, snap));
  }
  return Commit(snap.version, /*joined=*/true);
}

// Every caller has checked the target against version v's commit (or
// snapshot) digest: what it holds is recorded as verified.
Status ReceiverWalk::Commit(uint64_t v, bool joined) {
  metrics_.Commit(v, joined);
  version_ = v;
  heartbeat_.SetVersion(v);
  heartbeat_.SetVerified(target_.AckDigest(), ClockOf(o_).UnixSeconds());
  if (frames_held_peak_ > 0) heartbeat_.SetFramesHeld(frames_held_peak_);  // not after a join
  frames_held_peak_ = 0;
  ForgetAttempts();  // all of v or older (a join may pass several versions)
  if (o_.relay) o_.relay->Take(run_keys::Attempts(v));  // late copies of what it now holds
  return target_.Commit(v);
}

Result<const StreamedAttempt*> ReceiverWalk::AttemptDoc(uint64_t v, const std::string& id) {
  auto it = attempt_docs_.find(id);
  if (it != attempt_docs_.end()) return &it->second;
  DCR_ASSIGN_OR_RETURN(auto attempt, ReadStreamedAttempt(store_, v, id, [this](const std::string& l) { Log(l); }));
  if (!attempt) return static_cast<const StreamedAttempt*>(nullptr);
  return &attempt_docs_.emplace(id, std::move(*attempt)).first->second;
}

Result<std::optional<std::string>> ReceiverWalk::SignerOf(const std::string& prefix, const StreamedAttempt& attempt,
                                                          const std::string& key) {
  const auto name = run_keys::ParseFrameObject(std::string_view(key).substr(prefix.size()));
  const std::string cached = name ? prefix + std::to_string(name->sender) : std::string();
  if (auto it = signers_.find(cached); name && it != signers_.end()) return std::optional<std::string>(it->second);
  DCR_ASSIGN_OR_RETURN(auto signer, ObjectSignerOf(store_, prefix, attempt, key));
  if (name && signer) signers_.emplace(cached, *signer);
  return signer;
}

Status ReceiverWalk::TakeFromRelay(uint64_t v, const std::string& id) {
  if (!o_.relay) return Status::Ok();
  const std::string prefix = run_keys::Attempt(v, id);
  for (auto& [key, bytes] : o_.relay->Take(prefix)) relayed_.insert_or_assign(key, std::move(bytes));
  NoteFramesHeld();
  for (auto it = relayed_.lower_bound(prefix); it != relayed_.end() && it->first.starts_with(prefix);) {
    if (Holds(it->first)) {  // already downloaded from the store
      it = relayed_.erase(it);
      continue;
    }
    DCR_ASSIGN_OR_RETURN(const StreamedAttempt* attempt, AttemptDoc(v, id));
    if (!attempt) return Status::Ok();  // attempt.json is not visible yet
    DCR_ASSIGN_OR_RETURN(auto signer, SignerOf(prefix, *attempt, it->first));
    if (!signer) {  // its process's key is not visible yet
      ++it;
      continue;
    }
    const Status s =
        signer->empty() ? FailedPrecondition(fmt::format("{}: its attempt names no signing key (an older publisher): a "
                                                         "relayed copy cannot be verified",
                                                         it->first))
                        : VerifyObjectSignature(*signer, it->first, it->second);
    if (!s.ok()) {
      const uint64_t n = ++refused_objects_;
      if ((n & (n - 1)) == 0)  // the 1st, 2nd, 4th... refusal
        Log(fmt::format("refused an object the relay delivered ({} so far): {}; the store's copy is used", n,
                        s.ToString()));
    } else {
      metrics_.Received("relay", it->second.size());
      from_relay_.insert(it->first);
      prefetched_.emplace(it->first, std::move(it->second));
    }
    it = relayed_.erase(it);
  }
  return Status::Ok();
}

Status ReceiverWalk::AwaitRelay(uint64_t v, const std::string& id, const std::vector<std::string>& objects,
                                const std::function<Status()>& arrived) {
  if (!o_.relay) return Status::Ok();
  const std::string prefix = run_keys::Attempt(v, id);
  // Real time, as the relay client stamps its deliveries (LastDelivery).
  Clock& clock = RealClock();
  const auto start = clock.Now();
  for (;;) {
    DCR_RETURN_IF_ERROR(TakeFromRelay(v, id));
    DCR_RETURN_IF_ERROR(arrived());
    const bool complete = std::all_of(objects.begin(), objects.end(), [&](const std::string& k) { return Holds(k); });
    // Also while the relay is detached: its client re-attaches upstream
    // within its dead_after, and the new parent sends what is missing.
    if (complete) return Status::Ok();
    const auto now = clock.Now();
    if (now - std::max(start, o_.relay->LastDelivery()) > o_.relay_quiet) {
      Log(fmt::format(
          "the relay delivered nothing for {} ms; downloading the missing frame objects of {} from the store",
          o_.relay_quiet.count(), prefix));
      return Status::Ok();
    }
    clock.Sleep(std::min(o_.stream_poll, o_.poll));
  }
}

void ReceiverWalk::NoteFramesHeld(uint64_t loaded) {
  uint64_t held = loaded;
  for (const auto& [key, bytes] : prefetched_) held += bytes.size();
  for (const auto& [key, bytes] : relayed_) held += bytes.size();
  for (const auto& [key, object] : released_) held += object.headers.size() * kMaxFrameHeaderBytes;
  frames_held_peak_ = std::max(frames_held_peak_, held);
}

std::pair<size_t, uint64_t> ReceiverWalk::Relayed(const std::vector<std::string>& keys) const {
  std::pair<size_t, uint64_t> r{0, 0};
  for (const auto& key : keys) {
    if (!from_relay_.count(key)) continue;
    const auto held = prefetched_.find(key);
    const auto released = released_.find(key);
    if (held == prefetched_.end() && released == released_.end()) continue;  // taken by LoadAttempt: counted there
    ++r.first;
    r.second += held != prefetched_.end() ? held->second.size() : released->second.bytes;
  }
  return r;
}

// Frames of a streaming attempt are applied as their objects arrive (also
// those the relay delivers after the manifest is in). Each is checked by
// ForEachStreamedFrame (header and payload checksums, attempt.json's delta
// id, a mode of its class, the run's shape of its chunk); the target applies
// only what it can prove safe and leaves the rest to the manifest. The
// journal names the attempt before the first write, so a restarted receiver
// knows its bits may be between versions. Nothing is applied once the
// follower knows the attempt is fenced; a frame applied before (in a tree,
// the FENCE may come after it) changes its chunk only from the version's
// base to its target, as the retry's overwrite frames do.
Status ReceiverWalk::StreamApply(uint64_t v, const AttemptInfo& a) {
  Streamed& st = streamed_[a.id];
  if (!st.attempt) {
    DCR_ASSIGN_OR_RETURN(const StreamedAttempt* doc, AttemptDoc(v, a.id));
    if (!doc || !*doc) return Status::Ok();  // not visible yet, or left to the manifest
    st.attempt = &**doc;
    st.shape = shape_;
    st.shape.delta_class = st.attempt->cls;
  }
  if (!target_.MayStream(a.id, st.attempt->cls)) return Status::Ok();
  // In a tree, the relay's objects of the attempt (their signatures verified)
  // are applied before a listing shows them, and the tree's FENCE (then the
  // next look) says when the attempt is fenced: no store request per object.
  const bool in_tree = InTree(v);
  DCR_ASSIGN_OR_RETURN(auto todo, StreamedObjectsToApply(store_, v, a, prefetched_, in_tree ? &from_relay_ : nullptr,
                                                         /*check_fence=*/!in_tree, &st.objects));
  if (todo.empty()) return Status::Ok();
  StageTimer timer(metrics_, Stage::kApply);
  DCR_RETURN_IF_ERROR(target_.Begin(a.id));
  SetState("applying").IgnoreError();
  DCR_RETURN_IF_ERROR(Fault("stream-applying"));
  for (const auto& key : todo) {
    const std::string& blob = prefetched_.at(key);
    std::vector<FrameView> frames;  // views into blob, which stays put until the target applied them
    ReleasedObject headers{blob.size(), {}};
    const bool whole = ForEachStreamedFrame(
        key, blob, st.shape, *st.attempt,
        [&](const FrameView& f, size_t offset) {
          frames.push_back(f);
          auto& header = headers.headers[offset];
          header.fill(0);
          std::copy_n(blob.data() + offset, f.header.header_bytes, header.begin());
        },
        [this](const std::string& l) { Log(l); });
    const uint64_t left = st.counts.left;
    DCR_RETURN_IF_ERROR(target_.ApplyStreamed(st.shape, frames, &st.counts));
    if (whole && st.counts.left == left) {  // every frame applied or found done: the payloads are not needed again
      prefetched_.erase(key);
      released_.insert_or_assign(key, std::move(headers));
    }
  }
  return Status::Ok();
}

Status ReceiverWalk::TakeFetched(bool* progressed) {
  Status first_error;
  for (auto& [key, blob] : fetcher_.TakeDone()) {
    if (!blob.ok()) {
      if (Transient(blob.status())) {
        if (first_error.ok()) first_error = blob.status();
      } else {
        unreadable_.insert(key);
      }
      continue;
    }
    if (Holds(key)) continue;  // the relay delivered it meanwhile
    metrics_.Received("store", blob->size());
    prefetched_.emplace(key, std::move(*blob));
    *progressed = true;
  }
  return first_error;
}

Status ReceiverWalk::Prefetch(const AttemptInfo& a, bool* progressed) {
  DCR_RETURN_IF_ERROR(TakeFetched(progressed));
  size_t held = 0;
  for (const auto& key : a.frame_objects) held += prefetched_.count(key) + fetcher_.IsPending(key);
  for (const auto& key : a.frame_objects) {
    if (held >= o_.fetch_ahead) break;
    if (Holds(key) || unreadable_.count(key) || fetcher_.IsPending(key)) continue;
    fetcher_.Fetch(key);
    ++held;
  }
  return Status::Ok();
}

Status ReceiverWalk::StreamRest(uint64_t v, const AttemptInfo& a) {
  const std::string prefix = run_keys::Attempt(v, a.id);
  for (;;) {
    bool progressed = false;
    DCR_RETURN_IF_ERROR(Prefetch(a, &progressed));
    NoteFramesHeld();
    DCR_RETURN_IF_ERROR(StreamApply(v, a));
    if (progressed) continue;
    if (fetcher_.Pending(prefix) == 0) return Status::Ok();
    fetcher_.WaitDone(o_.poll);  // a download in flight: its end is the next event
  }
}

Result<DeltaManifest> ReceiverWalk::ManifestFor(uint64_t v, const AttemptInfo& a, AttemptInfo* needed,
                                                std::vector<bool>* skip) {
  *needed = a;
  skip->clear();
  DCR_ASSIGN_OR_RETURN(DeltaManifest m, ReadAttemptManifest(store_, v, a.id, shape_));
  const HeldChunks* held = target_.Held();
  if (!held) return m;
  *skip = ObjectsWithoutHeldChunks(m, *held);
  const std::string prefix = run_keys::Attempt(v, a.id);
  needed->frame_objects.clear();
  for (size_t o = 0; o < m.objects.size(); ++o)
    if (!(*skip)[o]) needed->frame_objects.push_back(prefix + m.objects[o]);
  Log(fmt::format(
      "version {} attempt {}: {} of {} frame objects hold frames of this rank's chunks; the other {} are "
      "not needed",
      v, a.id, needed->frame_objects.size(), m.objects.size(), m.objects.size() - needed->frame_objects.size()));
  return m;
}

AttemptInfo ReceiverWalk::ToStream(uint64_t v, const AttemptInfo& a) const {
  const HeldChunks* held = target_.Held();
  if (!held) return a;
  AttemptInfo s = a;
  s.frame_objects.clear();
  const auto choice = ChooseByNames(a.frame_objects, run_keys::Attempt(v, a.id), *held);
  for (size_t i = 0; i < a.frame_objects.size(); ++i)
    if (choice[i] == ObjectChoice::kFetch) s.frame_objects.push_back(a.frame_objects[i]);
  return s;
}

// Catches up to committed version v through its committed attempt (a late
// or retired receiver); when that fails, once from the newest snapshot.
Status ReceiverWalk::CatchUp(uint64_t v, const CommitRecord& c) {
  const auto start = ClockOf(o_).Now();
  DCR_RETURN_IF_ERROR(TakeFromRelay(v, c.attempt));
  DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store_, v));
  AttemptInfo committed{c.attempt}, needed;
  for (const auto& a : attempts)
    if (a.id == c.attempt) committed = a;
  std::vector<bool> skip;
  auto manifest = ManifestFor(v, committed, &needed, &skip);
  if (Transient(manifest.status())) return manifest.status();
  if (manifest.ok()) DCR_RETURN_IF_ERROR(StreamRest(v, needed));
  uint64_t loaded = 0;
  auto delta = manifest.ok() ? LoadAttempt(store_, v, c.attempt, std::move(*manifest),
                                           HeldObjects{&prefetched_, &released_, std::move(skip), &loaded})
                             : Result<DeltaReader>(manifest.status());
  NoteFramesHeld(loaded);
  metrics_.Received("store", loaded);
  metrics_.AddSeconds(Stage::kDownload, SecondsSince(ClockOf(o_), start));
  Status s = delta.status();
  ApplyCounts counts;
  if (s.ok()) {
    StageTimer timer(metrics_, Stage::kApply);
    s = target_.ApplyAttempt(c.attempt, *delta, &counts);
  }
  if (s.ok() && !target_.AtCommit(c)) s = DataLoss("the committed delta did not reach its digest");
  if (s.ok()) return Commit(v);
  if (Transient(s)) return s;
  // If the committed delta fails again after a rejoin, the store's copy of
  // version v is damaged and rejoining would loop.
  if (++commit_failures_[v] > 1)
    return DataLoss(fmt::format(
        "{}: committed version {} (attempt {}) cannot be applied even after rejoining from a snapshot: {}. The "
        "store's copy of that version is damaged; receivers can only pass it from a newer snapshot",
        store_.url(), v, c.attempt, s.ToString()));
  DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
  return Join(*state.latest, "cannot apply committed version " + std::to_string(v) + ": " + s.ToString());
}

Status ReceiverWalk::ApplyAndAck(uint64_t v, const AttemptInfo& a) {
  const auto start = ClockOf(o_).Now();
  const std::string prefix = run_keys::Attempt(v, a.id);
  AttemptInfo needed;
  std::vector<bool> skip;
  auto manifest = ManifestFor(v, a, &needed, &skip);
  if (Transient(manifest.status())) return manifest.status();
  // The manifest may be in long before the relay tree delivers the last
  // objects (the store is not the tree's link): apply them as they come.
  DCR_RETURN_IF_ERROR(AwaitRelay(v, a.id, needed.frame_objects, [&] { return StreamApply(v, a); }));
  DCR_RETURN_IF_ERROR(StreamRest(v, needed));
  const auto [relayed, relayed_bytes] = Relayed(needed.frame_objects);
  uint64_t loaded = 0;
  auto delta = manifest.ok() ? LoadAttempt(store_, v, a.id, std::move(*manifest),
                                           HeldObjects{&prefetched_, &released_, std::move(skip), &loaded})
                             : Result<DeltaReader>(manifest.status());
  NoteFramesHeld(loaded);
  metrics_.Received("store", loaded);
  const auto ready = ClockOf(o_).Now();  // the manifest and every frame object are here
  metrics_.AddSeconds(Stage::kDownload, std::chrono::duration<double>(ready - start).count());
  if (Transient(delta.status())) return delta.status();
  if (o_.relay && delta.ok()) {
    uint64_t frame_bytes = 0;  // of the objects it needed
    const DeltaManifest& m = delta->manifest();
    for (size_t i = 0; i < m.frames.size(); ++i) frame_bytes += delta->Skipped(i) ? 0 : m.frames[i].bytes;
    const size_t total = needed.frame_objects.size();
    Log(
        fmt::format("version {} attempt {}: frame objects {}/{} ({} bytes) from the relay, {} ({} bytes) from the "
                    "store; {} relayed objects refused so far (signatures that do not verify)",
                    v, a.id, relayed, total, relayed_bytes, total - std::min(total, relayed),
                    frame_bytes - std::min(frame_bytes, relayed_bytes), refused_objects_));
  }
  SetState("applying").IgnoreError();
  DCR_RETURN_IF_ERROR(Fault("applying"));
  Status s = delta.status();
  ApplyCounts counts;
  if (s.ok()) {
    StageTimer timer(metrics_, Stage::kApply);
    s = target_.ApplyAttempt(a.id, *delta, &counts);
  }
  DCR_RETURN_IF_ERROR(Fault("applied"));
  AckRecord ack;
  ack.receiver = o_.id;
  ack.ok = s.ok();
  ack.digest = target_.AckDigest();
  ack.error = s.ok() ? "" : s.ToString();
  ack.engine = target_.Engine();
  ack.spans = metrics_.AckSpans();
  const ApplyCounts& st = streamed_[a.id].counts;
  Log(s.ok() ? fmt::format("applied version {} attempt {} ({:.3f} s after the manifest and frame objects were in; "
                           "streamed frames: {} applied as they arrived, {} already done, {} left to the manifest)",
                           v, a.id, std::chrono::duration<double>(ClockOf(o_).Now() - ready).count(), st.applied,
                           st.already, st.left)
             : fmt::format("cannot apply version {} attempt {}: {}", v, a.id, s.ToString()));
  {
    StageTimer timer(metrics_, Stage::kAck);
    DCR_RETURN_IF_ERROR(store_.Put(run_keys::Ack(v, a.id, o_.id), ack.ToJson()));
    // In the store first (the record), then up the relay tree (the fast
    // path to the coordinator). A rank's partial ack goes through the store
    // only: the tree's ACK carries no engine.
    if (o_.relay && ack.engine.ranks == 0) o_.relay->Ack(prefix, ack);
  }
  metrics_.Acked(ack.ok);
  DCR_RETURN_IF_ERROR(Fault("acked"));
  handled_.insert(a.id);
  SetState("following").IgnoreError();
  return Status::Ok();
}

void ReceiverWalk::ForgetAttempts() {
  fetcher_.Drop("");
  prefetched_.clear();
  released_.clear();
  from_relay_.clear();
  relayed_.clear();
  streamed_.clear();  // points into attempt_docs_
  attempt_docs_.clear();
  signers_.clear();
}

void ReceiverWalk::Forget(const std::string& prefix) {
  std::erase_if(prefetched_, [&](const auto& kv) { return kv.first.starts_with(prefix); });
  std::erase_if(released_, [&](const auto& kv) { return kv.first.starts_with(prefix); });
  std::erase_if(relayed_, [&](const auto& kv) { return kv.first.starts_with(prefix); });
  fetcher_.Drop(prefix);
  if (o_.relay) o_.relay->Take(prefix);  // dropped
}

// One step towards version_ + 1: apply its commit, or its open attempts.
StepPlan PlanStep(const StepInputs& in) {
  StepPlan plan;
  if (!in.target_open) {
    plan.kind = StepPlan::Kind::kJoin;
    return plan;
  }
  if (in.committed) {
    plan.kind = in.target_at_commit ? StepPlan::Kind::kCommit : StepPlan::Kind::kCatchUp;
    return plan;
  }
  plan.kind = StepPlan::Kind::kAttempts;
  for (size_t i = 0; i < in.attempts.size(); ++i) {
    const auto& a = in.attempts[i];
    StepPlan::ForAttempt f;
    if (a.fenced || a.handled || a.acked_by_me) {
      f.what = StepPlan::Attempt::kDrop;
    } else if (a.has_manifest) {
      f.what = StepPlan::Attempt::kApplyAndAck;
    } else {
      // Streaming: without a relay attached, download the frame objects
      // written so far, so that only the last one or two remain when the
      // manifest appears. Only the newest attempt is applied ahead: an
      // older one is being replaced (a takeover or retry), and its frames
      // would only be overwritten.
      f.what = StepPlan::Attempt::kStream;
      f.download = !in.relay_attached;
      f.apply_ahead = i + 1 == in.attempts.size();
      plan.streaming = true;
    }
    plan.attempts.push_back(f);
  }
  return plan;
}

// In a relay tree that carries notices, between looks at the store: the
// tree's arrivals are taken and applied against what the last look found.
bool ReceiverWalk::InTree(uint64_t v) const { return tree_view_.valid && tree_view_.v == v && o_.relay->Attached(); }

// A notice makes a look due, but no sooner after the last look than the
// polls without a tree would have made one: a peer that floods the tree with
// notices costs the store no more than polling does.
std::chrono::steady_clock::time_point ReceiverWalk::NoticedLookAt() const {
  return tree_view_.at + std::min(o_.stream_poll, o_.poll);
}

bool ReceiverWalk::LookDue() const {
  if (o_.relay->Notices() != tree_view_.notices) return RealClock().Now() >= NoticedLookAt();
  if (RealClock().Now() >= tree_view_.at + o_.relay_poll) return true;  // the backstop
  for (size_t i = 0; i < tree_view_.attempts.size(); ++i)  // an apply that failed (a store error): again
    if (tree_view_.plan.attempts[i].what == StepPlan::Attempt::kApplyAndAck &&
        !handled_.count(tree_view_.attempts[i].id))
      return true;
  return false;
}

Status ReceiverWalk::Step() {
  const uint64_t v = version_ + 1;
  if (InTree(v) && !LookDue()) return StepInTree(v);
  tree_view_.valid = false;
  // Read before the look: a notice that arrives during it makes the next one.
  const uint64_t notices = o_.relay ? o_.relay->Notices() : 0;
  const auto look_at = RealClock().Now();
  unreadable_.clear();
  StepInputs in;
  in.target_open = target_.Open();
  std::optional<CommitRecord> commit;
  std::vector<AttemptInfo> attempts;
  if (in.target_open) {
    DCR_ASSIGN_OR_RETURN(auto commit_text, GetIfPresent(store_, run_keys::Commit(v)));
    if (commit_text) {
      DCR_ASSIGN_OR_RETURN(commit,
                           CommitRecord::FromJson(*commit_text, StoreContext(store_.url(), run_keys::Commit(v))));
      in.committed = true;
      in.target_at_commit = target_.AtCommit(*commit);
    } else {
      DCR_ASSIGN_OR_RETURN(attempts, ListAttempts(store_, v));
      for (const auto& a : attempts)
        in.attempts.push_back({a.fenced, handled_.count(a.id) > 0,
                               std::find(a.acks.begin(), a.acks.end(), o_.id) != a.acks.end(), a.has_manifest});
      in.relay_attached = o_.relay && o_.relay->Attached();
    }
  }
  const StepPlan plan = PlanStep(in);
  switch (plan.kind) {
    case StepPlan::Kind::kJoin: {  // a join was interrupted by a store failure
      DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store_));
      return Join(*state.latest, "resuming an interrupted join");
    }
    case StepPlan::Kind::kCommit:
    case StepPlan::Kind::kCatchUp: {
      const CommitRecord& c = *commit;
      metrics_.Behind(std::max(0.0, ClockOf(o_).UnixSeconds() - c.time));
      if (std::find(c.retired.begin(), c.retired.end(), o_.id) != c.retired.end())
        Log(
            fmt::format("retired from version {} (no ack before the deadline): catching up from the committed delta, "
                        "or the newest snapshot if that is impossible",
                        v));
      if (plan.kind == StepPlan::Kind::kCommit) DCR_RETURN_IF_ERROR(Commit(v));
      else DCR_RETURN_IF_ERROR(CatchUp(v, c));
      if (version_ != v) return Status::Ok();  // rejoined from a snapshot
      SetState("following").IgnoreError();
      Log(fmt::format("at version {} (attempt {})", v, c.attempt.empty() ? "snapshot" : c.attempt));
      return Status::Ok();
    }
    case StepPlan::Kind::kAttempts: metrics_.Behind(0); break;
  }
  if (in.relay_attached && notices > 0) tree_view_ = TreeView{true, v, attempts, plan, notices, look_at};
  bool progressed = false;
  for (size_t i = 0; i < attempts.size(); ++i) {
    const AttemptInfo& a = attempts[i];
    const StepPlan::ForAttempt& f = plan.attempts[i];
    switch (f.what) {
      case StepPlan::Attempt::kDrop: Forget(run_keys::Attempt(v, a.id)); break;
      case StepPlan::Attempt::kApplyAndAck:
        DCR_RETURN_IF_ERROR(ApplyAndAck(v, a));
        progressed = true;
        break;
      case StepPlan::Attempt::kStream: DCR_RETURN_IF_ERROR(StreamStep(v, a, f, &progressed)); break;
    }
  }
  if (!progressed) Wait(plan);
  return Status::Ok();
}

Status ReceiverWalk::StreamStep(uint64_t v, const AttemptInfo& a, const StepPlan::ForAttempt& f, bool* progressed) {
  const size_t before = prefetched_.size();
  DCR_RETURN_IF_ERROR(TakeFromRelay(v, a.id));
  if (prefetched_.size() != before) *progressed = true;
  // Downloads finished before a relay attached are kept all the same.
  DCR_RETURN_IF_ERROR(f.download ? Prefetch(ToStream(v, a), progressed) : TakeFetched(progressed));
  NoteFramesHeld();
  if (f.apply_ahead) DCR_RETURN_IF_ERROR(StreamApply(v, a));
  return Status::Ok();
}

Status ReceiverWalk::StepInTree(uint64_t v) {
  bool progressed = false;
  for (size_t i = 0; i < tree_view_.attempts.size(); ++i)
    if (tree_view_.plan.attempts[i].what == StepPlan::Attempt::kStream)
      DCR_RETURN_IF_ERROR(StreamStep(v, tree_view_.attempts[i], tree_view_.plan.attempts[i], &progressed));
  if (!progressed) Wait(tree_view_.plan);
  return Status::Ok();
}

void ReceiverWalk::Wait(const StepPlan& plan) {
  // In a tree: until something arrives (an object, a fence, a notice), or
  // the look a notice asked for is allowed.
  if (tree_view_.valid && !fetcher_.Busy()) {
    if (o_.relay->Notices() != tree_view_.notices) std::this_thread::sleep_until(NoticedLookAt());
    else news_seen_ = o_.relay->AwaitNews(news_seen_, o_.poll);
    return;
  }
  const auto wait = plan.streaming ? std::min(o_.stream_poll, o_.poll) : o_.poll;
  // A download in flight: its end is the next event (real time, as the store's).
  if (fetcher_.Busy()) fetcher_.WaitDone(wait);
  else ClockOf(o_).Sleep(wait);
}

}  // namespace dcr::receiver_internal
