// The run's state as `dcr status` shows it.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "dcr/run_keys.h"
#include "dcr/run_status.h"
#include "internal.h"

namespace dcr {

using namespace protocol_internal;

namespace {

// Attempt `a` of version v as status shows it; `commit`: v's, if committed.
Result<AttemptStatus> ReadAttemptStatus(Store& store, uint64_t v, const AttemptInfo& a,
                                        const std::optional<CommitRecord>& commit, const DeltaManifest& table) {
  AttemptStatus as;
  as.id = a.id;
  const std::string prefix = run_keys::Attempt(v, a.id);
  if (a.has_manifest) {
    DCR_ASSIGN_OR_RETURN(std::string text, store.Get(run_keys::Manifest(v, a.id)));
    DCR_ASSIGN_OR_RETURN(DeltaManifest m,
                         DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                                               table, StoreContext(store.url(), run_keys::Manifest(v, a.id))));
    as.mode = m.delta_class == DeltaClass::kXorClass ? "xor" : "overwrite";
    as.frame_bytes = m.frame_bytes;
    as.frames = m.frames.size();
  }
  as.manifest_bytes = a.manifest_bytes;
  as.download_bytes = a.download_bytes + (commit && commit->attempt == a.id ? commit->ToJson().size() : 0);
  for (const auto& r : a.acks) {
    auto text = store.Get(run_keys::Ack(v, a.id, r));
    if (!text.ok()) continue;
    auto ack = AckRecord::FromJson(*text, prefix);
    if (ack.ok() && ack->ok) as.acks.push_back(r);
    else as.nacks.push_back(r);
  }
  if (a.fenced) {
    auto text = store.Get(run_keys::Fence(v, a.id));
    if (text.ok()) {
      auto fence = FenceRecord::FromJson(*text, run_keys::Fence(v, a.id));
      as.fence_reason = fence.ok() ? fence->reason : "(unreadable: " + fence.status().message() + ")";
    }
  }
  if (commit && commit->attempt == a.id) as.state = "committed";
  else if (a.fenced) as.state = "fenced";
  else if (a.has_manifest) as.state = "open";
  else as.state = "starting";
  return as;
}

// Every committed version up to `latest`, and every version with attempts.
Result<std::vector<VersionStatus>> ReadVersions(Store& store, std::optional<uint64_t> latest,
                                                const DeltaManifest& table) {
  std::map<uint64_t, VersionStatus> versions;
  if (latest)
    for (uint64_t v = 0; v <= *latest; ++v) {
      auto c = ReadCommit(store, v);
      if (c.status().code() == Code::kNotFound) continue;
      if (!c.ok()) return c.status();
      versions[v].version = v;
      versions[v].committed = true;
      versions[v].commit = *c;
    }
  DCR_ASSIGN_OR_RETURN(auto objects, store.List("attempts/v"));
  std::set<uint64_t> with_attempts;
  for (const auto& o : objects)
    // "attempts/v" + 10 digits + '/'
    if (o.key.size() > 21 && o.key[20] == '/')
      with_attempts.insert(std::strtoull(o.key.substr(10, 10).c_str(), nullptr, 10));
  for (uint64_t v : with_attempts) {
    VersionStatus& vs = versions[v];
    vs.version = v;
    DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store, v));
    for (const auto& a : attempts) {
      DCR_ASSIGN_OR_RETURN(AttemptStatus as, ReadAttemptStatus(store, v, a, vs.commit, table));
      vs.attempts.push_back(std::move(as));
    }
  }
  std::vector<VersionStatus> out;
  for (auto& [v, vs] : versions) out.push_back(std::move(vs));
  return out;
}

// The receivers' records; one bad record (a stray file, a torn write by
// another tool) must not hide the others: it is reported beside them.
Status ReadReceivers(Store& store, std::chrono::milliseconds heartbeat_timeout, RunStatusReport* report) {
  DCR_ASSIGN_OR_RETURN(auto regs, store.List(run_keys::kReceivers));
  const double now = UnixNow(), fresh = std::chrono::duration<double>(heartbeat_timeout).count();
  for (const auto& o : regs) {
    auto text = store.Get(o.key);
    if (text.status().code() == Code::kNotFound) continue;  // removed since the listing
    if (!text.ok()) {
      report->unreadable_receivers.push_back({o.key, text.status()});
      continue;
    }
    auto parsed = ReceiverRecord::FromJson(*text, StoreContext(store.url(), o.key));
    if (!parsed.ok()) {
      report->unreadable_receivers.push_back({o.key, parsed.status()});
      continue;
    }
    ReceiverRecord r = std::move(*parsed);
    ReceiverStatus rs;
    rs.age_seconds = now - r.heartbeat;
    rs.live = r.state != "stopped" && rs.age_seconds <= fresh;
    rs.behind = report->latest && *report->latest > r.version ? *report->latest - r.version : 0;
    for (const auto& vs : report->versions)
      if (vs.commit && vs.version > r.version &&
          std::find(vs.commit->retired.begin(), vs.commit->retired.end(), r.id) != vs.commit->retired.end())
        rs.retired_at = vs.version;
    rs.record = std::move(r);
    report->receivers.push_back(std::move(rs));
  }
  return Status::Ok();
}

}  // namespace

Result<RunStatusReport> ReadRunStatus(Store& store, std::chrono::milliseconds heartbeat_timeout) {
  RunStatusReport report;
  DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store));
  report.run = state.run;
  report.latest = state.latest;
  DCR_ASSIGN_OR_RETURN(report.snapshots, ListSnapshots(store));
  const DeltaManifest table = state.run ? TensorTableOf(*state.run) : DeltaManifest();
  DCR_ASSIGN_OR_RETURN(report.versions, ReadVersions(store, state.latest, table));
  DCR_RETURN_IF_ERROR(ReadReceivers(store, heartbeat_timeout, &report));
  return report;
}

}  // namespace dcr
