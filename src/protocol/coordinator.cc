// The coordinator's part of a publish: attempt ids, fences, the wait for
// acks and the commit (coordinator.h).
#include "coordinator.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "ack_tally.h"
#include "dcr/run_keys.h"
#include "internal.h"
#include "publish_metrics.h"

namespace dcr::protocol_internal {

std::string DefaultCoordinatorId() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return fmt::format("{}-{}", host, ::getpid());
}

std::string RandomHex(int digits) {
  std::random_device rd;
  uint64_t x = (uint64_t{rd()} << 32) ^ rd();
  return fmt::format("{:0{}x}", x & ((digits >= 16) ? ~0ull : ((1ull << (4 * digits)) - 1)), digits);
}

uint64_t NewDeltaId() { return std::strtoull(RandomHex(16).c_str(), nullptr, 16) | 1; }

namespace {

// The id and class of a version's attempt number `seq`: the first is xor
// class; every retry (and a version someone already tried) is overwrite,
// which repairs receivers whatever part of a failed attempt they applied.
std::string NextAttempt(size_t seq, DeltaClass* cls) {
  *cls = seq == 0 ? DeltaClass::kXorClass : DeltaClass::kOverwrite;
  return fmt::format("{:04}-{}", seq, RandomHex(8));
}

}  // namespace

Result<std::string> PublisherStateDir(const std::string& configured, Store& store) {
  if (!configured.empty()) return configured;
  return DefaultPublisherStateDir(store.url());
}

Result<bool> AttemptCoordinator::Settle(uint64_t v, const std::string& id, Result<AttemptResult> result,
                                        Status* last_failure) {
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

Status AttemptCoordinator::Fence(uint64_t v, const std::string& id, const Status& why) {
  // Never fence a committed attempt (its commit's response may have been lost).
  if (auto c = ReadCommit(store_, v); c.ok() && c->attempt == id) return Status::Ok();
  const FenceRecord fence{why.ToString(), ClockOf(o_).UnixSeconds()};
  DCR_RETURN_IF_ERROR(store_.Put(run_keys::Fence(v, id), fence.ToJson()));
  CountFence();
  // The store's fence is the one receivers obey; the relays' copy only lets
  // them drop the attempt's frames early.
  if (o_.relay) o_.relay->Fence(run_keys::Attempt(v, id));
  return Status::Ok();
}

namespace {

// The wait for the acks of one attempt. Acks from the store and from the
// relay tree count alike (a receiver writes its ack to the store before it
// sends it up the tree); an ack that comes up the tree only says where to
// look: it counts as the store holds it, never as the tree says (any peer
// can send the tree an ack for any receiver id).
class AckWait {
 public:
  AckWait(Store& store, const PublishOptions& o, uint64_t v, const std::string& id, const Digest& target)
      : store_(store), o_(o), v_(v), id_(id), tally_(target) {}

  // Until every live receiver has acked (or v is committed: receivers that
  // moved on to v+1 never ack this attempt), a receiver refuses (see
  // refused()), or the deadline passes (the silent receivers are retired).
  // kAborted when o.cancel stops the wait; a store failure that outlasts
  // the deadline, or one that is not transient, is returned.
  Status Run();
  const std::optional<Status>& refused() const { return tally_.refused(); }
  const AckTally& tally() const { return tally_; }
  const std::set<std::string>& retired() const { return retired_; }
  uint64_t tree_refused() const { return tree_refused_; }
  bool cancelled() const { return cancelled_; }

 private:
  void Take(const AckRecord& ack, bool tree) {
    tally_.Take(ack, tree);
    std::erase_if(waiting_, [&](const std::string& r) { return tally_.Acked(r); });
  }
  // The store's acks not yet counted, then the live receivers (fresh
  // heartbeat, not retired or stopped) that have not acked.
  Status PollStore();
  // The receiver record a listing names, read only when its etag changed
  // since the last read (receivers rewrite theirs at every heartbeat; the
  // wait polls far more often). Null for an unreadable or deleted record.
  Result<const ReceiverRecord*> ReceiverAt(const ObjectInfo& listed);
  Status ConfirmTreeAck(const AckRecord& tree_ack);
  Status TakeTreeAcks(std::chrono::milliseconds wait);

  Store& store_;
  const PublishOptions& o_;
  const uint64_t v_;
  const std::string& id_;
  AckTally tally_;
  std::set<std::string> retired_;
  std::set<std::string> seen_;  // ack keys read and counted
  std::vector<std::string> waiting_;  // live receivers that have not acked
  struct ReadRecord {
    std::string etag;
    std::optional<ReceiverRecord> record;  // nullopt: did not parse
  };
  std::map<std::string, ReadRecord> receivers_;  // by key
  bool committed_ = false;  // commits/v exists (another coordinator, or a lost response)
  uint64_t tree_refused_ = 0;  // acks from the tree the store did not confirm
  bool cancelled_ = false;
};

Status AckWait::PollStore() {
  waiting_.clear();
  DCR_ASSIGN_OR_RETURN(auto acks, store_.List(run_keys::Acks(v_, id_)));
  for (const auto& o : acks) {
    if (seen_.count(o.key)) continue;
    DCR_ASSIGN_OR_RETURN(std::string text, store_.Get(o.key));
    DCR_ASSIGN_OR_RETURN(AckRecord ack, AckRecord::FromJson(text, StoreContext(store_.url(), o.key)));
    seen_.insert(o.key);
    Take(ack, false);
    if (refused()) return Status::Ok();
  }
  DCR_ASSIGN_OR_RETURN(auto regs, store_.List(run_keys::kReceivers));
  const double now = ClockOf(o_).UnixSeconds(), fresh = std::chrono::duration<double>(o_.heartbeat_timeout).count();
  for (const auto& o : regs) {
    DCR_ASSIGN_OR_RETURN(const ReceiverRecord* r, ReceiverAt(o));
    if (!r || r->state == "stopped" || r->state == "retired" || now - r->heartbeat > fresh) continue;
    if (!tally_.Acked(r->id)) waiting_.push_back(r->id);
  }
  if (!waiting_.empty()) {
    DCR_ASSIGN_OR_RETURN(auto record, GetIfPresent(store_, run_keys::Commit(v_)));
    committed_ = record.has_value();
  }
  return Status::Ok();
}

Result<const ReceiverRecord*> AckWait::ReceiverAt(const ObjectInfo& listed) {
  auto cached = receivers_.find(listed.key);
  if (cached != receivers_.end() && !listed.etag.empty() && cached->second.etag == listed.etag)
    return cached->second.record ? &*cached->second.record : nullptr;
  ObjectInfo read;
  auto text = store_.Get(listed.key, &read);
  if (!text.ok()) {
    if (text.status().code() == Code::kNotFound) return nullptr;  // deleted meanwhile
    return text.status();
  }
  auto r = ReceiverRecord::FromJson(*text, StoreContext(store_.url(), listed.key));
  // Keyed by the etag the listing gave: a record replaced between the
  // listing and the read is read again at the next poll.
  auto& entry = receivers_[listed.key];
  entry.etag = listed.etag;
  entry.record = r.ok() ? std::optional<ReceiverRecord>(std::move(*r)) : std::nullopt;
  return entry.record ? &*entry.record : nullptr;
}

Status AckWait::ConfirmTreeAck(const AckRecord& tree_ack) {
  const std::string key = run_keys::Ack(v_, id_, tree_ack.receiver);
  if (seen_.count(key)) return Status::Ok();
  if (tree_ack.receiver.find('/') != std::string::npos || !ValidateKey(key).ok()) {
    ++tree_refused_;
    return Status::Ok();
  }
  DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store_, key));
  if (!text) {  // not (yet) in the store: the store poll decides
    ++tree_refused_;
    return Status::Ok();
  }
  DCR_ASSIGN_OR_RETURN(AckRecord ack, AckRecord::FromJson(*text, StoreContext(store_.url(), key)));
  seen_.insert(key);
  if (ack.receiver != tree_ack.receiver)
    return DataLoss(fmt::format("{}: names receiver '{}', not '{}'", key, ack.receiver, tree_ack.receiver));
  Take(ack, true);
  return Status::Ok();
}

Status AckWait::TakeTreeAcks(std::chrono::milliseconds wait) {
  for (const auto& ack : o_.relay->TakeAcks(run_keys::Attempt(v_, id_), wait)) {
    DCR_RETURN_IF_ERROR(ConfirmTreeAck(ack));
    if (refused()) break;
  }
  return Status::Ok();
}

Status AckWait::Run() {
  Clock& clock = ClockOf(o_);
  const auto deadline = clock.Now() + o_.ack_timeout;
  // With acks coming up the relay tree, the store is polled every
  // store_ack_poll and the tree's acks are taken as they arrive (the commit
  // then follows the last ack by a few ms instead of up to a poll period
  // plus a listing and a read per receiver).
  const bool tree_acks = o_.relay && o_.relay_acks && o_.relay->CarriesAcks();
  const auto store_every = tree_acks ? o_.store_ack_poll : std::chrono::milliseconds(0);
  Status polled;
  auto next_poll = clock.Now();
  for (;;) {
    // A store failure costs one poll, not the attempt (whose frames may be
    // applied everywhere already), until the deadline.
    if (clock.Now() >= next_poll) {
      polled = PollStore();
      next_poll = clock.Now() + store_every;
    }
    if (tree_acks && polled.ok()) polled = TakeTreeAcks(std::chrono::milliseconds(0));
    if (refused() || (polled.ok() && (waiting_.empty() || committed_))) return Status::Ok();
    if (o_.cancel && o_.cancel()) {
      cancelled_ = true;
      return Aborted(fmt::format("version {} attempt {}: cancelled while waiting for acks ({} receivers had not acked)",
                                 v_, id_, waiting_.size()));
    }
    if (!polled.ok() && !Transient(polled)) return polled;
    if (clock.Now() >= deadline) {
      DCR_RETURN_IF_ERROR(polled);
      retired_.insert(waiting_.begin(), waiting_.end());
      return Status::Ok();
    }
    if (tree_acks) {
      const auto wait = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(next_poll - clock.Now()),
                                   std::chrono::milliseconds(0), std::chrono::milliseconds(20));
      if (Status t = TakeTreeAcks(wait); !t.ok()) polled = t;
    } else {
      clock.Sleep(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace

Status AttemptCoordinator::RunAttempts(uint64_t v, PublishReport* report, const Attempt& attempt,
                                       const std::function<Status()>& after_fenced) {
  DCR_ASSIGN_OR_RETURN(auto prior, ListAttempts(store_, v));
  Status last_failure;
  for (uint32_t n = 0; n < std::max<uint32_t>(o_.max_attempts, 1); ++n) {
    DeltaClass cls;
    const std::string id = NextAttempt(prior.size() + n, &cls);
    ++report->attempts;
    DCR_ASSIGN_OR_RETURN(bool committed, Settle(v, id, attempt(id, cls), &last_failure));
    if (committed) return Status::Ok();
    if (after_fenced) DCR_RETURN_IF_ERROR(after_fenced());
  }
  return Aborted(fmt::format("version {} was not committed after {} attempts; last failure: {}", v, report->attempts,
                             last_failure.ToString()));
}

Status AttemptCoordinator::OpenAttempt(uint64_t v, const std::string& id, const AttemptRecord& record) {
  DCR_RETURN_IF_ERROR(store_.Put(run_keys::AttemptRecord(v, id), record.ToJson(), WriteMode::kCreateIfAbsent));
  if (o_.relay) o_.relay->Notice(run_keys::Attempt(v, id));
  return Status::Ok();
}

Result<AttemptCoordinator::AttemptResult> AttemptCoordinator::PublishManifest(uint64_t v, const std::string& id,
                                                                              DeltaManifest m, PublishReport* report,
                                                                              DeltaManifest* manifest_out) {
  report->attempt = id;
  report->frame_bytes = m.frame_bytes;
  report->payload_bytes = m.payload_bytes;
  report->changed_words = m.changed_words;
  DCR_RETURN_IF_ERROR(Fault(o_, "frames-written"));
  DCR_RETURN_IF_ERROR(store_.Put(run_keys::Manifest(v, id), m.Encode(), WriteMode::kCreateIfAbsent));
  if (o_.relay) o_.relay->Notice(run_keys::Attempt(v, id));  // its manifest: receivers in the tree look now
  DCR_RETURN_IF_ERROR(Fault(o_, "manifest-written"));
  return AwaitAcksAndCommit(v, id, std::move(m), report, manifest_out);
}

Result<AttemptCoordinator::AttemptResult> AttemptCoordinator::AwaitAcksAndCommit(uint64_t v, const std::string& id,
                                                                                 DeltaManifest m, PublishReport* report,
                                                                                 DeltaManifest* manifest_out) {
  const auto wait_start = ClockOf(o_).Now();
  AckWait wait(store_, o_, v, id, m.target_digest);
  if (Status s = wait.Run(); !s.ok()) {
    cancelled_ = wait.cancelled();
    return s;
  }
  if (wait.refused()) return AttemptResult{false, *wait.refused()};
  report->wait_seconds += EndStage(report, "ack_wait", ClockOf(o_), wait_start);
  DCR_RETURN_IF_ERROR(Fault(o_, "acked"));
  DCR_RETURN_IF_ERROR(Fault(o_, "before-commit"));

  CommitRecord c;
  c.version = v;
  c.base_version = v - 1;
  c.attempt = id;
  c.target_digest = m.target_digest;
  c.acked.assign(wait.tally().acked().begin(), wait.tally().acked().end());
  c.retired.assign(wait.retired().begin(), wait.retired().end());
  c.time = ClockOf(o_).UnixSeconds();
  c.publisher_memory = report->memory;
  const auto commit_start = ClockOf(o_).Now();
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
  report->commit_seconds += EndStage(report, "commit", ClockOf(o_), commit_start);
  if (o_.relay) o_.relay->Notice(run_keys::Commit(v));  // receivers in the tree look now
  // Best effort: v is committed whatever the listing meets.
  if (auto attempts = ListAttempts(store_, v); attempts.ok())
    for (const AttemptInfo& a : *attempts)
      if (a.id == c.attempt) {
        report->manifest_bytes = a.manifest_bytes;
        report->download_bytes = a.download_bytes + c.ToJson().size();
      }
  report->acked = c.acked;
  report->retired = c.retired;
  report->relay_acks = wait.tally().from_tree();
  report->relay_acks_unconfirmed = wait.tree_refused();
  *manifest_out = std::move(m);
  return AttemptResult{true, Status::Ok()};
}

}  // namespace dcr::protocol_internal
