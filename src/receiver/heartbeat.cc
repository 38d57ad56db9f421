// A receiver's record in the store, kept fresh, and the follower's outer
// loop around it (docs/protocol.md, "Receivers").
#include <iostream>
#include <thread>

#include "receiver.h"

namespace dcr::receiver_internal {

Heartbeat::Heartbeat(Store& store, std::string id, EngineRank engine, std::chrono::milliseconds every, Clock& clock,
                     std::function<void(const std::string&)> log)
    : store_(store),
      id_(std::move(id)),
      engine_(std::move(engine)),
      every_(every),
      clock_(clock),
      log_(std::move(log)) {}

ReceiverRecord Heartbeat::Record() {
  ReceiverRecord r;
  r.id = id_;
  r.engine = engine_;
  r.heartbeat = clock_.UnixSeconds();
  std::lock_guard lock(mu_);
  r.state = state_;
  r.version = version_;
  r.frames_held_bytes = frames_held_;
  r.master_bytes = master_bytes_;
  r.verified_digest = verified_digest_;
  r.verified_at = verified_at_;
  return r;
}

namespace {
// What a record says, its time aside.
std::string Says(const ReceiverRecord& r) {
  ReceiverRecord timeless = r;
  timeless.heartbeat = 0;
  return timeless.ToJson();
}
}  // namespace

Status Heartbeat::Write(const ReceiverRecord& r) {
  DCR_RETURN_IF_ERROR(store_.Put(run_keys::Receiver(id_), r.ToJson()));
  std::lock_guard lock(mu_);
  written_ = Says(r);
  return Status::Ok();
}

Status Heartbeat::Set(const std::string& state) {
  {
    std::lock_guard lock(mu_);
    state_ = state;
  }
  const ReceiverRecord r = Record();
  {
    std::lock_guard lock(mu_);
    if (written_ == Says(r)) return Status::Ok();
  }
  return Write(r);
}

void Heartbeat::SetVersion(uint64_t v) {
  std::lock_guard lock(mu_);
  version_ = v;
}

void Heartbeat::SetFramesHeld(uint64_t bytes) {
  std::lock_guard lock(mu_);
  frames_held_ = bytes;
}

void Heartbeat::SetMasterBytes(uint64_t bytes) {
  std::lock_guard lock(mu_);
  master_bytes_ = bytes;
}

void Heartbeat::SetVerified(const Digest& digest, double at) {
  std::lock_guard lock(mu_);
  verified_digest_ = digest;
  verified_at_ = at;
}

void Heartbeat::Start() {
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] {
    auto next = std::chrono::steady_clock::now();
    while (!stop_.load()) {
      if (std::chrono::steady_clock::now() >= next) {
        if (Status s = Write(Record()); !s.ok()) log_("heartbeat: " + s.ToString());
        next = std::chrono::steady_clock::now() + every_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

void Heartbeat::Stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  thread_.join();
}

void FollowLog(const FollowOptions& o, const std::string& line) {
  if (o.log) o.log(line);
  else std::cerr << "dcr follow [" << o.id << "] " << line << std::endl;
}

Status FollowLoop(Heartbeat& heartbeat, const FollowOptions& o, const std::function<Status()>& start,
                  const std::function<Status()>& step, const std::function<bool()>& done,
                  const std::function<bool()>& stop, const std::function<void(const std::string&)>& log) {
  auto stopped = [&] { return stop && stop(); };
  for (;;) {
    Status s = start();
    if (s.ok()) break;
    if (!Transient(s) || stopped()) return s;
    log("store unavailable, retrying: " + s.ToString());
    ClockOf(o).Sleep(o.poll);
  }
  heartbeat.Start();
  heartbeat.Set("following").IgnoreError();
  while (!done() && !stopped()) {
    Status s = step();
    if (s.ok()) continue;
    if (!Transient(s)) return s;
    log("store unavailable, retrying: " + s.ToString());
    ClockOf(o).Sleep(o.poll);
  }
  heartbeat.Stop();
  // Best effort: the target is consistent whatever the store says, and a
  // receiver whose record stays "following" only goes stale.
  Status s = heartbeat.Set("stopped");
  for (int tries = 1; Transient(s) && tries < 5; ++tries) {
    ClockOf(o).Sleep(o.poll);
    s = heartbeat.Set("stopped");
  }
  if (!s.ok()) log("could not record the stop: " + s.ToString());
  return Status::Ok();
}

}  // namespace dcr::receiver_internal
