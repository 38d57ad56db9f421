// The relay daemon's state and steps (docs/relay.md): one event loop
// thread, a ROUTER for its children and senders, a DEALER to its upstream.
// Internal to src/relay: RunRelay (include/dcr/relay.h) is the interface.
#pragma once

#include <fmt/format.h>
#include <chrono>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "dcr/relay.h"
#include "zmq_io.h"

namespace dcr::relay_internal {

using Clock = std::chrono::steady_clock;

// An object's bytes on disk (the spool); removed with the last reference.
struct SpoolFile {
  std::string path;
  uint64_t bytes = 0;
  std::shared_ptr<uint64_t> used;  // the spool's bytes in use
  ~SpoolFile() {
    ::unlink(path.c_str());
    *used -= bytes;
  }
};

struct Object {
  std::string key, prefix, data;  // data empty when spooled
  uint32_t crc = 0;
  std::shared_ptr<const SpoolFile> spooled;
};
using ObjectPtr = std::shared_ptr<const Object>;

// A peer that receives objects (a relay or a receiver), by its routing id.
struct Child {
  std::string route, id;
  std::string key;  // its CURVE key (empty without CURVE): its id stays its own
  RelayRole role = RelayRole::kReceiver;
  std::set<std::string> have;  // from its HELLO: never send these
  std::deque<ObjectPtr> queue;
  uint64_t inflight = 0;
  Clock::time_point heard;
  Clock::time_point next_send{};  // pacing (link_bytes_per_second)
};

// Cumulative counters of one link (kept across re-attachments, by peer id).
struct Link {
  std::string role;
  bool attached = false;
  uint64_t bytes_in = 0, objects_in = 0, bytes_out = 0, objects_out = 0, evicted = 0, spooled = 0;
};

class RelayServer {
 public:
  explicit RelayServer(const RelayOptions& o) : o_(o) {}
  Status Run(const std::function<bool()>& stop);

 protected:
  // The members below are the daemon's loop steps and state; protected so
  // that the test-only ScriptedRelay (scripted_relay.cc) can drive them.
  // What one turn of the loop does after reading the sockets: sends what
  // children's windows allow, sends acks up, runs the timers.
  void Turn(bool force_acks);
  void Log(const std::string& line) {
    if (o_.log) o_.log(line);
    else std::cerr << "dcr relay [" << o_.id << "] " << line << std::endl;
  }
  // A refused peer retries its handshake every few hundred ms: each distinct
  // line is logged the 1st, 10th, 100th... time.
  void Refused(const std::string& line) {
    ++refused_;
    // Bounded: past 1024 distinct lines, new ones are counted together.
    const bool known = refusals_.count(line) || refusals_.size() < 1024;
    const uint64_t n = ++refusals_[known ? line : "other refusals (too many distinct ones to keep)"];
    for (uint64_t p = 1; p <= n; p *= 10)
      if (p == n) Log(n == 1 ? line : fmt::format("{} ({} times)", line, n));
  }
  Status Attach(size_t index);
  // A message from a peer below (a child or a sender); `key`: its CURVE key.
  void OnRouter(std::vector<std::string> parts, const std::string& key);
  // OnRouter's steps: a HELLO (from a sender, or a child), and an object.
  bool Admitted(const RelayMessage& m, const std::string& key);
  void OnSenderHello(const std::string& route, const std::string& key, const RelayMessage& m);
  void OnChildHello(const std::string& route, const std::string& key, const RelayMessage& m);
  void OnObject(const std::string& route, RelayMessage m);
  void OnUpstream(std::vector<std::string> parts);
  void OnMonitor();
  void Accept(RelayMessage m, const std::string& from, Link* link);
  void ApplyFence(const std::string& prefix);
  void ForwardNotice(const std::string& key);
  void OnAck(RelayMessage m, const Child& from);
  // Sends the acks received since the last flush up (to the upstream, or at
  // a root to every sender), one message per attempt.
  void FlushAcks(bool force);
  void SendAcks(void* socket, const std::string& route, const std::string& prefix, std::vector<AckRecord> acks);
  void Evict();
  // The spooled copy of `old` (written now), or nullptr when the spool is off, full or fails.
  ObjectPtr Spool(const ObjectPtr& old);
  // Reads a spooled object back and checks its CRC32C; nullptr (logged) when it cannot.
  ObjectPtr Unspool(const Object& spooled);
  Status OpenSpool();
  // Sends what the child's window allows; false when the child is gone.
  bool Pump(Child& c);
  void Detach(const std::string& route, const std::string& why);
  // The counters of link `name`, created if new; beyond max_links a
  // detached link's are forgotten to make room.
  Link& LinkOf(const std::string& name);
  // Link `name`'s peer is gone (its counters stay, and may be forgotten).
  void LinkGone(const std::string& name) {
    if (auto it = links_.find(name); it != links_.end()) it->second.attached = false;
  }
  void Timers();
  void WriteStats();
  std::string StatsJson();
  // The counters and levels above into the process's metrics (relay_metrics.cc).
  void ExportMetrics();

  const RelayOptions& o_;
  Context ctx_;
  Socket router_, upstream_, zap_, monitor_;
  std::unique_ptr<Probe> probe_;  // while attached past the parent: is the parent back?
  size_t upstream_index_ = 0;
  Clock::time_point upstream_heard_, upstream_since_, last_ping_, last_stats_;

  std::shared_ptr<uint64_t> spool_used_ = std::make_shared<uint64_t>(0);
  uint64_t spool_seq_ = 0, spooled_ = 0, spooled_bytes_ = 0, spool_full_ = 0, unspooled_ = 0;
  std::deque<ObjectPtr> cache_;
  std::map<std::string, ObjectPtr> index_;
  uint64_t cache_bytes_ = 0;
  std::set<std::string> fenced_;
  std::deque<std::string> fenced_order_;
  std::map<std::string, Child> children_;  // by route
  struct Sender {
    std::string id = "unnamed";  // from its HELLO
    std::string key;
    Clock::time_point heard;
  };
  std::map<std::string, Sender> senders_;  // by route
  std::map<std::string, Link> links_;  // "child:<id>", "sender:<id>", "upstream:<address>"
  // Acks of the subtree by attempt prefix (the last 64 attempts), and those
  // not yet sent up since they arrived (aggregated for kAckLinger).
  std::map<std::string, std::map<std::string, AckRecord>> acks_;
  std::deque<std::string> ack_order_;
  std::map<std::string, std::set<std::string>> ack_pending_;
  Clock::time_point ack_pending_since_{};
  uint64_t acks_in_ = 0, ack_messages_in_ = 0, acks_out_ = 0, ack_messages_out_ = 0;
  uint64_t received_ = 0, accepted_ = 0, accepted_bytes_ = 0, duplicates_ = 0, corrupt_ = 0, unverified_ = 0,
           fenced_drops_ = 0, malformed_ = 0, refused_ = 0, notices_ = 0;
  std::map<std::string, uint64_t> refusals_;
};

}  // namespace dcr::relay_internal
