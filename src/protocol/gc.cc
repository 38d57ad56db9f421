// Garbage collection under the retention rule (docs/protocol.md, "GC").
#include <fmt/format.h>

#include <map>
#include <set>

#include "dcr/run_keys.h"
#include "dcr/run_status.h"
#include "internal.h"

namespace dcr {

using namespace protocol_internal;

namespace {

// Version number of a key "<dir>/v<10 digits>/...", or nullopt.
std::optional<uint64_t> VersionOf(std::string_view key, std::string_view dir) {
  if (!key.starts_with(dir) || key.size() < dir.size() + 12 || key[dir.size()] != 'v' || key[dir.size() + 11] != '/')
    return std::nullopt;
  uint64_t v = 0;
  for (char c : key.substr(dir.size() + 1, 10)) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

}  // namespace

Status CollectGarbage(Store& store, uint64_t keep_versions, std::chrono::milliseconds heartbeat_timeout, Clock& clock) {
  DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store));
  if (!state.latest) return Status::Ok();
  // The floor: nothing at or below it is needed by a live receiver (it holds
  // a newer version) or by a joiner (it starts from the newest snapshot).
  uint64_t floor = *state.latest;
  DCR_ASSIGN_OR_RETURN(auto regs, store.List(run_keys::kReceivers));
  const double now = clock.UnixSeconds(), fresh = std::chrono::duration<double>(heartbeat_timeout).count();
  for (const auto& o : regs) {
    auto text = store.Get(o.key);
    if (!text.ok()) continue;
    auto r = ReceiverRecord::FromJson(*text, o.key);
    if (r.ok() && r->state != "stopped" && now - r->heartbeat <= fresh) floor = std::min(floor, r->version);
  }
  auto snapshot = NewestSnapshot(store, floor);
  if (!snapshot.ok()) return snapshot.status().code() == Code::kNotFound ? Status::Ok() : snapshot.status();
  floor = std::min(floor, snapshot->version);

  // Committed attempt per version (fenced and losing attempts of committed
  // versions are never needed).
  DCR_ASSIGN_OR_RETURN(auto attempts, store.List("attempts/"));
  std::map<uint64_t, std::string> committed;
  for (const auto& o : attempts) {
    auto v = VersionOf(o.key, "attempts/");
    if (!v || *v > *state.latest || committed.count(*v)) continue;
    auto c = ReadCommit(store, *v);
    if (c.ok()) committed[*v] = c->attempt;
  }
  for (const auto& o : attempts) {
    auto v = VersionOf(o.key, "attempts/");
    if (!v) continue;
    const bool below_floor = *v + keep_versions <= floor;
    bool losing = false;
    if (auto it = committed.find(*v); it != committed.end()) {
      const std::string prefix = run_keys::Attempt(*v, it->second);
      losing = !o.key.starts_with(prefix);
    }
    if (below_floor || losing) DCR_RETURN_IF_ERROR(store.Delete(o.key));
  }
  DCR_ASSIGN_OR_RETURN(auto snaps, store.List(run_keys::kSnapshots));
  for (const auto& o : snaps) {
    auto v = VersionOf(o.key, run_keys::kSnapshots);
    if (v && *v < snapshot->version) DCR_RETURN_IF_ERROR(store.Delete(o.key));
  }
  return Status::Ok();
}

}  // namespace dcr
