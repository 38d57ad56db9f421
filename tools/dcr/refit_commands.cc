// dcr publish | follow | status: the refit protocol over a store.
#include <fmt/format.h>

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "dcr/checkpoint.h"
#include "dcr/json.h"
#include "dcr/layout.h"
#include "dcr/layout_apply.h"
#include "dcr/mapped_file.h"
#include "dcr/progress.h"
#include "dcr/publisher.h"
#include "dcr/receiver.h"
#include "dcr/relay.h"
#include "dcr/run_records.h"
#include "dcr/run_status.h"
#include "dcr/shard_publisher.h"
#include "fault_hooks.h"

namespace dcr::cli {
namespace {

using json = nlohmann::ordered_json;

json MemoryJson(const PublisherMemory& m) {
  return {{"baseline_bytes", m.baseline_bytes},
          {"baseline_in_memory", m.baseline_in_memory},
          {"staging_bytes", m.staging_bytes},
          {"frames_in_flight_bytes", m.frames_in_flight_bytes},
          {"digest_bytes", m.digest_bytes}};
}

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

struct PublishArgs {
  std::string store, checkpoint, state;
  uint64_t version = 0;
  uint32_t senders = 1, attempts = 3;
  std::string chunk = "1048576", segment = "auto";
  double ack_timeout = 60, heartbeat_timeout = 10;
  uint64_t snapshot_every = 0;
  bool json = false;
  std::vector<std::string> relays;  // tree roots
  std::string relay_key, relay_pub;
  bool relay_insecure = false;
  double relay_mbps = 0;
  bool no_relay_acks = false;
  std::vector<std::string> shard_senders;  // [K:]MAP=DIR: publish from trainer shards
  // Trainer senders in several processes: "p/P", every sender's map, the
  // placement (process per sender; empty: contiguous blocks).
  std::string process, maps, sender_processes;
  std::string metrics;  // HOST:PORT
  double peer_timeout = 60;
};

// "a,b,c" -> {a, b, c}; empty parts are refused by the callers' checks.
std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  for (;;) {
    const size_t comma = s.find(',', at);
    out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

Result<uint32_t> ParseIndex(const std::string& s, const std::string& what) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos)
    return InvalidArgument(fmt::format("{}: '{}' is not an index", what, s));
  return static_cast<uint32_t>(std::stoul(s));
}

Result<std::unique_ptr<CompiledLayout>> LoadMap(const std::string& path) {
  DCR_ASSIGN_OR_RETURN(LayoutMap map, ReadLayoutFile(path));
  auto compiled = CompiledLayout::Compile(std::move(map));
  if (!compiled.ok()) return compiled.status().WithContext(path);
  return std::make_unique<CompiledLayout>(std::move(*compiled));
}

// Publishes as one process of a trainer: --process p/P, --maps (every
// sender's map, in global order), --sender K:MAP=DIR for each local sender K
// (MAP must be the same map as the K-th of --maps).
Result<PublishReport> PublishFromProcess(const PublishArgs& a, Store& store, const std::string& state,
                                         const PublishOptions& o) {
  ShardProcesses procs;
  const size_t slash = a.process.find('/');
  if (slash == std::string::npos) return InvalidArgument(fmt::format("--process '{}': expected p/P", a.process));
  DCR_ASSIGN_OR_RETURN(procs.process, ParseIndex(a.process.substr(0, slash), "--process"));
  DCR_ASSIGN_OR_RETURN(procs.processes, ParseIndex(a.process.substr(slash + 1), "--process"));
  if (procs.processes == 0 || procs.process >= procs.processes)
    return InvalidArgument(fmt::format("--process '{}': need 0 <= p < P", a.process));
  if (a.maps.empty()) return InvalidArgument("--process needs --maps M0.json,M1.json,... (every sender's map)");
  std::vector<std::unique_ptr<CompiledLayout>> layouts;
  std::vector<const CompiledLayout*> maps;
  for (const std::string& path : SplitCommas(a.maps)) {
    if (path.empty()) return InvalidArgument(fmt::format("--maps '{}': an empty map path", a.maps));
    DCR_ASSIGN_OR_RETURN(auto l, LoadMap(path));
    maps.push_back(l.get());
    layouts.push_back(std::move(l));
  }
  if (!a.sender_processes.empty())
    for (const std::string& q : SplitCommas(a.sender_processes)) {
      DCR_ASSIGN_OR_RETURN(uint32_t x, ParseIndex(q, "--sender-processes"));
      procs.sender_process.push_back(x);
    }
  std::map<uint32_t, RankBufferFiles> files;  // by global sender index
  for (const std::string& spec : a.shard_senders) {
    const size_t colon = spec.find(':'), eq = spec.find('=');
    if (colon == std::string::npos || eq == std::string::npos || eq < colon || eq == colon + 1 || eq + 1 == spec.size())
      return InvalidArgument(fmt::format("--sender '{}': with --process, expected K:MAP.json=DIR", spec));
    DCR_ASSIGN_OR_RETURN(uint32_t k, ParseIndex(spec.substr(0, colon), "--sender " + spec));
    if (k >= maps.size())
      return InvalidArgument(fmt::format("--sender '{}': sender {} of the {} in --maps", spec, k, maps.size()));
    const std::string map_path = spec.substr(colon + 1, eq - colon - 1), dir = spec.substr(eq + 1);
    DCR_ASSIGN_OR_RETURN(auto l, LoadMap(map_path));
    if (!(l->map() == maps[k]->map()))
      return InvalidArgument(fmt::format("--sender '{}': {} is not the map of sender {} in --maps", spec, map_path, k));
    auto opened = RankBufferFiles::Open(*maps[k], dir);
    if (!opened.ok()) return opened.status().WithContext("--sender " + spec);
    if (!files.emplace(k, std::move(*opened)).second)
      return InvalidArgument(fmt::format("--sender '{}': sender {} given twice", spec, k));
  }
  std::vector<ShardSource> local;
  for (auto& [k, f] : files) {
    ShardSource src{maps[k], {}};
    for (auto b : f.placed().buffers) src.current.push_back(b);
    local.push_back(std::move(src));
  }
  ShardPublisher publisher(store, state, o);
  return publisher.Publish(a.version, maps, local, procs);
}

// Publishes from trainer shards: each --sender MAP=DIR is one sender's map
// and its shard buffer files (as dcr layout load writes them).
Result<PublishReport> PublishFromShards(const PublishArgs& a, Store& store, const std::string& state,
                                        const PublishOptions& o) {
  std::vector<std::unique_ptr<CompiledLayout>> layouts;
  std::vector<RankBufferFiles> files;
  std::vector<ShardSource> senders;
  for (const std::string& spec : a.shard_senders) {
    const size_t eq = spec.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size())
      return InvalidArgument(fmt::format("--sender '{}': expected MAP.json=DIR", spec));
    const std::string map_path = spec.substr(0, eq), dir = spec.substr(eq + 1);
    DCR_ASSIGN_OR_RETURN(LayoutMap map, ReadLayoutFile(map_path));
    auto compiled = CompiledLayout::Compile(std::move(map));
    if (!compiled.ok()) return compiled.status().WithContext(map_path);
    layouts.push_back(std::make_unique<CompiledLayout>(std::move(*compiled)));
    auto opened = RankBufferFiles::Open(*layouts.back(), dir);
    if (!opened.ok()) return opened.status().WithContext("--sender " + spec);
    files.push_back(std::move(*opened));
  }
  for (size_t k = 0; k < files.size(); ++k) {
    ShardSource src{layouts[k].get(), {}};
    for (auto b : files[k].placed().buffers) src.current.push_back(b);
    senders.push_back(std::move(src));
  }
  ShardPublisher publisher(store, state, o);
  return publisher.Publish(a.version, senders);
}

// Relay client options from the CLI's flags (shared by publish and follow).
Result<RelayClientOptions> RelayClient(const std::string& id, const std::vector<std::string>& addresses,
                                       const std::string& key, const std::string& pub, bool insecure) {
  RelayClientOptions o;
  o.id = id;
  o.addresses = addresses;
  DCR_ASSIGN_OR_RETURN(
      o.security, LoadRelaySecurity(key, pub, "", insecure, {"--relay-key", "--relay-pub", "", "--relay-insecure"}));
  return o;
}

// The publish options from the arguments; errors name the flag.
Result<PublishOptions> PublishOptionsOf(const PublishArgs& a) {
  PublishOptions o;
  o.senders = a.senders;
  o.max_attempts = a.attempts;
  auto chunk = ParseBytes(a.chunk);
  if (!chunk.ok()) return chunk.status().WithContext("--chunk");
  o.delta.chunk_elements = *chunk;
  if (a.segment != "auto") {
    auto segment = ParseBytes(a.segment);
    if (!segment.ok()) return segment.status().WithContext("--segment");
    if (*segment == 0) return InvalidArgument("--segment: must be at least one byte");
    o.segment_bytes = *segment;
  }
  o.ack_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.ack_timeout * 1000));
  o.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.heartbeat_timeout * 1000));
  o.snapshot_every = a.snapshot_every;
  o.fault = FaultPointHook([] { return g_stop.load(); });
  o.peer_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.peer_timeout * 1000));
  return o;
}

// The publisher's relay client with --relay (frame objects pushed into the
// roots, acks taken from them); null without.
Result<std::unique_ptr<RelaySender>> StartPublishRelay(const PublishArgs& a, PublishOptions* o) {
  if (a.relays.empty()) return std::unique_ptr<RelaySender>();
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  DCR_ASSIGN_OR_RETURN(RelayClientOptions ro, RelayClient(fmt::format("publish-{}-{}", host, ::getpid()), a.relays,
                                                          a.relay_key, a.relay_pub, a.relay_insecure));
  // A root is written off only when it is really gone; a busy one is waited for.
  ro.dead_after = std::chrono::seconds(5);
  ro.link_bytes_per_second = a.relay_mbps * 1e6;
  o->relay_acks = !a.no_relay_acks;
  DCR_ASSIGN_OR_RETURN(std::unique_ptr<RelaySender> relay, RelaySender::Start(ro));
  o->relay = relay.get();
  return relay;
}

void PrintPublishReport(const PublishArgs& a, const PublishReport& r) {
  if (a.json) {
    json doc = {{"version", r.version},
                {"attempt", r.attempt},
                {"attempts", r.attempts},
                {"already_committed", r.already_committed},
                {"total_bytes", r.total_bytes},
                {"frame_bytes", r.frame_bytes},
                {"payload_bytes", r.payload_bytes},
                {"manifest_bytes", r.manifest_bytes},
                {"download_bytes", r.download_bytes},
                {"download_bytes_per_changed_word", PerChange(r.download_bytes, r.changed_words)},
                {"changed_words", r.changed_words},
                {"acked", r.acked},
                {"retired", r.retired},
                {"relay_acks", r.relay_acks},
                {"relay_acks_unconfirmed", r.relay_acks_unconfirmed},
                {"encode_seconds", r.encode_seconds},
                {"wait_seconds", r.wait_seconds},
                {"commit_seconds", r.commit_seconds},
                {"baseline_seconds", r.baseline_seconds},
                {"advance_seconds", r.advance_seconds},
                {"total_seconds", r.total_seconds},
                {"state_dir", r.state_dir},
                {"memory", MemoryJson(r.memory)}};
    std::cout << JsonText(doc, 1) << "\n";
  } else if (r.already_committed) {
    fmt::print("version {} was already committed ({})\n", r.version,
               r.attempt.empty() ? "snapshot" : "attempt " + r.attempt);
  } else if (r.version == 0) {
    fmt::print("committed version 0: the run and its snapshot of {} ({:.2f} s)\n", FormatBytes(r.total_bytes),
               r.total_seconds);
  } else {
    fmt::print(
        "committed version {} (attempt {}, {} tries): {} of frames ({} downloaded per receiver with the manifest and "
        "records) for {} ({:.2f}%), {} receivers acked{}, {:.2f} s\n",
        r.version, r.attempt.empty() ? "snapshot" : r.attempt, r.attempts, FormatBytes(r.frame_bytes),
        FormatBytes(r.download_bytes), FormatBytes(r.total_bytes),
        r.total_bytes ? 100.0 * r.frame_bytes / r.total_bytes : 0.0, r.acked.size(),
        r.retired.empty() ? "" : fmt::format(", {} retired", r.retired.size()), r.total_seconds);
  }
}

int RunPublish(const PublishArgs& a) {
  auto store = OpenStore(a.store);
  if (!store.ok()) return Fail("publish", store.status());
  if (a.checkpoint.empty() == a.shard_senders.empty())
    return Fail("publish", InvalidArgument("give either a checkpoint or --sender MAP=DIR (one per trainer sender)"));
  auto options = PublishOptionsOf(a);
  if (!options.ok()) return Fail("publish", options.status());
  auto metrics = ServeMetrics("publish", a.metrics);
  if (!metrics.ok()) return Fail("publish", metrics.status());
  PublishOptions& o = *options;
  auto relay = StartPublishRelay(a, &o);
  if (!relay.ok()) return Fail("publish", relay.status());
  const std::string& state = a.state;  // empty: the default (DefaultPublisherStateDir)
  Result<PublishReport> r = Aborted("not published");
  if (!a.process.empty()) {
    r = PublishFromProcess(a, **store, state, o);
  } else if (!a.maps.empty() || !a.sender_processes.empty()) {
    return Fail("publish", InvalidArgument("--maps and --sender-processes go with --process p/P"));
  } else if (!a.shard_senders.empty()) {
    r = PublishFromShards(a, **store, state, o);
  } else {
    auto ckpt = Checkpoint::Open(a.checkpoint);
    if (!ckpt.ok()) return Fail("publish", ckpt.status());
    Publisher publisher(**store, state, o);
    Progress progress(fmt::format("publish v{}", a.version), ckpt->total_bytes());
    r = publisher.Publish(a.version, *ckpt, &progress);
    progress.Finish();
  }
  if (!r.ok()) return Fail("publish", r.status());
  PrintPublishReport(a, *r);
  // Fault point "reported": the report is out, the metrics endpoint still serves.
  if (o.fault) o.fault("reported").IgnoreError();
  return kExitOk;
}

struct FollowArgs {
  std::string store, target, id;
  int64_t until = -1;
  double poll = 0.1, stream_poll = 0.02, heartbeat = 1, relay_quiet = 3, relay_dead_after = 1.5, relay_poll = 1;
  std::vector<std::string> relays;  // its relay, then ancestors
  std::string relay_key, relay_pub;
  bool relay_insecure = false;
  std::string layout, engine;  // a rank of an engine
  uint32_t rank = 0, ranks = 0;
  size_t fetch_ahead = FollowOptions().fetch_ahead;
  std::string metrics;  // HOST:PORT
};

// Follows into a's target: a checkpoint directory, or a rank's buffer files (--layout).
Status Follow(const FollowArgs& a, Store& store, const FollowOptions& o, std::string* holds) {
  const std::optional<uint64_t> until = a.until >= 0 ? std::optional<uint64_t>(a.until) : std::nullopt;
  if (a.layout.empty()) {
    Follower f(store, a.target, o);
    DCR_RETURN_IF_ERROR(f.Run(until, [] { return g_stop.load(); }));
    *holds = fmt::format("{} holds version {}", a.target, f.version());
    return Status::Ok();
  }
  DCR_ASSIGN_OR_RETURN(LayoutMap map, ReadLayoutFile(a.layout));
  auto layout = CompiledLayout::Compile(std::move(map));
  if (!layout.ok()) return layout.status().WithContext(a.layout);
  RankFollower f(store, *layout, a.target, EngineRank{a.engine, a.rank, a.ranks}, o);
  DCR_RETURN_IF_ERROR(f.Run(until, [] { return g_stop.load(); }));
  *holds =
      fmt::format("{} (rank {} of {} of engine {}) holds version {}", a.target, a.rank, a.ranks, a.engine, f.version());
  return Status::Ok();
}

int RunFollow(const FollowArgs& a) {
  if (!a.layout.empty() && (a.engine.empty() || a.ranks == 0))
    return Fail("follow",
                InvalidArgument("--layout needs --engine NAME, --rank R and --ranks N (the engine's rank count)"));
  auto store = OpenStore(a.store);
  if (!store.ok()) return Fail("follow", store.status());
  FollowOptions o;
  // The receiver's id in the store, which the relay knows it by too.
  o.id = a.id;
  if (o.id.empty()) o.id = a.layout.empty() ? DefaultReceiverId() : fmt::format("{}-r{}", a.engine, a.rank);
  o.poll = std::chrono::milliseconds(static_cast<int64_t>(a.poll * 1000));
  o.stream_poll = std::chrono::milliseconds(static_cast<int64_t>(a.stream_poll * 1000));
  o.heartbeat_every = std::chrono::milliseconds(static_cast<int64_t>(a.heartbeat * 1000));
  o.fetch_ahead = a.fetch_ahead;
  o.fault = FaultPointHook([] { return g_stop.load(); });
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  auto metrics = ServeMetrics("follow", a.metrics);
  if (!metrics.ok()) return Fail("follow", metrics.status());
  std::unique_ptr<RelayReceiver> relay;
  if (!a.relays.empty()) {
    auto ro = RelayClient(o.id, a.relays, a.relay_key, a.relay_pub, a.relay_insecure);
    if (!ro.ok()) return Fail("follow", ro.status());
    ro->dead_after = std::chrono::milliseconds(static_cast<int64_t>(a.relay_dead_after * 1000));
    auto started = RelayReceiver::Start(*ro);
    if (!started.ok()) return Fail("follow", started.status());
    relay = std::move(*started);
    o.relay = relay.get();
    o.relay_quiet = std::chrono::milliseconds(static_cast<int64_t>(a.relay_quiet * 1000));
    o.relay_poll = std::chrono::milliseconds(static_cast<int64_t>(a.relay_poll * 1000));
  }
  std::string holds;
  Status s = Follow(a, **store, o, &holds);
  if (relay) {
    const RelayClientStats rs = relay->Stats();
    std::cerr << fmt::format(
                     "dcr follow: relay: {} objects ({} bytes) received, {} corrupt, {} duplicates, {} fenced, "
                     "{} re-attachments, last attached to {}",
                     rs.objects, rs.bytes, rs.corrupt, rs.duplicates, rs.fenced, rs.reattached, rs.attached)
              << std::endl;
  }
  if (!s.ok()) return Fail("follow", s);
  fmt::print("{}\n", holds);
  return kExitOk;
}

struct StatusArgs {
  std::string store;
  std::vector<std::string> relay_stats;
  double heartbeat_timeout = 10;
  bool json = false;
  int64_t timeline = -1;  // a version
  std::string out;  // the timeline's trace file
};

// `dcr status --timeline V --out FILE`: the version's trace, and each row's stages.
int RunTimeline(const StatusArgs& a, Store& store) {
  if (a.out.empty()) return Fail("status", InvalidArgument("--timeline needs --out FILE (the trace, JSON)"));
  auto t = ReadVersionTimeline(store, static_cast<uint64_t>(a.timeline));
  if (!t.ok()) return Fail("status", t.status());
  if (Status s = WriteFileAtomically(a.out, TimelineTraceJson(*t)); !s.ok()) return Fail("status", s);
  const double t0 = t->start;
  fmt::print("version {} (attempt {}): publish {:.3f} s, committed at +{:.3f} s\n", t->version, t->attempt,
             t->publish_seconds, t->commit_time - t0);
  for (const TimelineRow& r : t->rows) {
    fmt::print("  {} {}{}\n", r.role, r.process, r.attempt == t->attempt ? "" : " (attempt " + r.attempt + ")");
    for (const StageSpan& s : r.spans)
      fmt::print("    {:<10} +{:.3f} s  {:.3f} s\n", s.stage, s.start - t0, s.end - s.start);
  }
  fmt::print(
      "wrote {} (open it in https://ui.perfetto.dev or chrome://tracing; a PNG: python -m dcr.timeline {} "
      "OUT.png)\n",
      a.out, a.out);
  return kExitOk;
}

// `dcr status --json`: the run's state as one document.
json StatusJson(const RunStatusReport& r, const std::string& url, const std::optional<std::string>& relays) {
  json doc;
  doc["store"] = url;
  doc["run_id"] = r.run ? json(r.run->run_id) : json(nullptr);
  doc["latest"] = r.latest ? json(*r.latest) : json(nullptr);
  doc["snapshots"] = r.snapshots;
  json& vs = doc["versions"] = json::array();
  for (const auto& v : r.versions) {
    json jv = {{"version", v.version}, {"committed", v.committed}};
    if (v.commit) {
      jv["attempt"] = v.commit->attempt;
      jv["target_digest"] = v.commit->target_digest.ToHex();
      jv["acked"] = v.commit->acked;
      jv["retired"] = v.commit->retired;
      jv["publisher_memory"] = v.commit->publisher_memory ? MemoryJson(*v.commit->publisher_memory) : json(nullptr);
    }
    json& as = jv["attempts"] = json::array();
    for (const auto& at : v.attempts)
      as.push_back({{"id", at.id},
                    {"state", at.state},
                    {"mode", at.mode},
                    {"frames", at.frames},
                    {"frame_bytes", at.frame_bytes},
                    {"manifest_bytes", at.manifest_bytes},
                    {"download_bytes", at.download_bytes},
                    {"acks", at.acks},
                    {"nacks", at.nacks},
                    {"fence_reason", at.fence_reason}});
    vs.push_back(std::move(jv));
  }
  json& rs = doc["receivers"] = json::array();
  for (const auto& x : r.receivers)
    rs.push_back(
        {{"id", x.record.id},
         {"state", x.record.state},
         {"version", x.record.version},
         {"live", x.live},
         {"heartbeat_age_seconds", x.age_seconds},
         {"behind", x.behind},
         {"retired_at", x.retired_at ? json(*x.retired_at) : json(nullptr)},
         {"frames_held_bytes", x.record.frames_held_bytes},
         {"master_bytes", x.record.master_bytes},
         {"verified_digest", x.record.verified_at > 0 ? json(x.record.verified_digest.ToHex()) : json(nullptr)},
         {"verified_at", x.record.verified_at > 0 ? json(x.record.verified_at) : json(nullptr)},
         {"engine",
          x.record.engine.ranks
              ? json({{"id", x.record.engine.engine}, {"rank", x.record.engine.rank}, {"ranks", x.record.engine.ranks}})
              : json(nullptr)}});
  json& bad = doc["unreadable_receivers"] = json::array();
  for (const auto& u : r.unreadable_receivers) bad.push_back({{"key", u.key}, {"error", u.error.ToString()}});
  if (relays) doc["relays"] = json::parse(*relays);
  return doc;
}

// The versions and their attempts, as lines.
void PrintVersions(const RunStatusReport& r) {
  for (const auto& v : r.versions) {
    fmt::print("  v{}: {}", v.version, v.committed ? "committed" : "not committed");
    if (v.commit && v.version > 0)
      fmt::print(" by {} ({} acked{})", v.commit->attempt, v.commit->acked.size(),
                 v.commit->retired.empty() ? "" : fmt::format(", retired: {}", fmt::join(v.commit->retired, " ")));
    if (v.commit && v.commit->publisher_memory) {
      const PublisherMemory& m = *v.commit->publisher_memory;
      fmt::print("; publisher held a baseline of {} ({}), {} staged, {} of frames in flight at most, {} of digests",
                 FormatBytes(m.baseline_bytes), m.baseline_in_memory ? "in memory" : "on disk",
                 FormatBytes(m.staging_bytes), FormatBytes(m.frames_in_flight_bytes), FormatBytes(m.digest_bytes));
    }
    fmt::print("\n");
    for (const auto& at : v.attempts) {
      fmt::print("    attempt {} {:9} {:9} {:>10} in {} frames, {} to download, acks {}{}{}\n", at.id, at.state,
                 at.mode, FormatBytes(at.frame_bytes), at.frames, FormatBytes(at.download_bytes), at.acks.size(),
                 at.nacks.empty() ? "" : fmt::format(", failed: {}", fmt::join(at.nacks, " ")),
                 at.fence_reason.empty() ? "" : " (" + at.fence_reason + ")");
    }
  }
}

// `dcr status`: the run's state as text.
void PrintStatus(const RunStatusReport& r, const std::string& url) {
  if (!r.run) {
    fmt::print("{}: no run (publish version 0 first)\n", url);
    return;
  }
  fmt::print("run {} in {}: latest committed version {}; snapshots: {}\n", r.run->run_id, url,
             r.latest ? std::to_string(*r.latest) : "none", fmt::join(r.snapshots, ", "));
  PrintVersions(r);
  auto line = [](const ReceiverStatus& x) {
    return fmt::format(
        "{}: {} at v{}{}{}, heartbeat {:.1f} s ago{}{}{}", x.record.id, x.record.state, x.record.version,
        x.record.verified_at > 0 ? fmt::format(" (verified digest {})", x.record.verified_digest.ToHex().substr(0, 16))
                                 : "",
        x.behind ? fmt::format(" ({} behind)", x.behind) : "", x.age_seconds, x.live ? "" : " (not live)",
        x.record.frames_held_bytes
            ? fmt::format(", held {} of frames at most for its last version", FormatBytes(x.record.frames_held_bytes))
            : "",
        x.record.master_bytes
            ? fmt::format(", keeps a BF16 master of {} for its FP8 weights", FormatBytes(x.record.master_bytes))
            : "");
  };
  std::map<std::string, std::vector<const ReceiverStatus*>> engines;  // ranks of engines, by rank
  for (const auto& x : r.receivers)
    if (x.record.engine.ranks) engines[x.record.engine.engine].push_back(&x);
    else fmt::print("  receiver {}\n", line(x));
  for (auto& [name, ranks] : engines) {
    std::sort(ranks.begin(), ranks.end(),
              [](auto* x, auto* y) { return x->record.engine.rank < y->record.engine.rank; });
    fmt::print("  engine {} ({} ranks, {} seen)\n", name, ranks.front()->record.engine.ranks, ranks.size());
    for (const ReceiverStatus* x : ranks) fmt::print("    rank {} {}\n", x->record.engine.rank, line(*x));
  }
  for (const auto& x : r.receivers)
    if (x.retired_at)
      fmt::print(
          "  receiver {} was retired from v{} (no ack before the deadline); run `dcr follow` on its target "
          "again and it catches up from committed deltas, or the newest snapshot\n",
          x.record.id, *x.retired_at);
  for (const auto& u : r.unreadable_receivers)
    fmt::print(
        "  receiver record {} is unreadable and not counted (the publisher skips it too): {}; its follower "
        "rewrites it at its next heartbeat, or remove it\n",
        u.key, u.error.ToString());
}

int RunStatus(const StatusArgs& a) {
  auto store = OpenStore(a.store);
  if (!store.ok()) return Fail("status", store.status());
  if (a.timeline >= 0) return RunTimeline(a, **store);
  auto r = ReadRunStatus(**store, std::chrono::milliseconds(static_cast<int64_t>(a.heartbeat_timeout * 1000)));
  if (!r.ok()) return Fail("status", r.status());
  std::optional<std::string> relays;
  if (!a.relay_stats.empty()) {
    auto text = FormatRelayTree(a.relay_stats, a.json);
    if (!text.ok()) return Fail("status", text.status().WithContext("--relay-stats"));
    relays = std::move(*text);
  }
  if (a.json) {
    std::cout << JsonText(StatusJson(*r, (*store)->url(), relays), 1) << "\n";
    return kExitOk;
  }
  PrintStatus(*r, (*store)->url());
  if (r->run && relays) fmt::print("relay tree (from {} stats files):\n{}", a.relay_stats.size(), *relays);
  return kExitOk;
}

}  // namespace

namespace {

void AddPublishCommand(CLI::App& app) {
  auto* pub =
      app.add_subcommand("publish", "Publish a checkpoint as the next version of a run and wait for its commit");
  auto pa = std::make_shared<PublishArgs>();
  pub->add_option("--store", pa->store, "Store URL (file:///path, s3://bucket/prefix, or a directory)")->required();
  pub->add_option("--version", pa->version, "Version number (0 publishes the starting snapshot)")->required();
  pub->add_option("checkpoint", pa->checkpoint, "The checkpoint to publish (or --sender)");
  pub->add_option("--sender", pa->shard_senders,
                  "Publish from trainer shards instead (versions > 0): MAP.json=DIR, a sender map and its shard "
                  "buffer files; repeat for every sender (with --process: K:MAP.json=DIR, this process's senders)");
  pub->add_option("--process", pa->process,
                  "Trainer senders in several processes: this process is p of P (0 coordinates; docs/protocol.md)");
  pub->add_option("--maps", pa->maps, "With --process: every sender's map, comma-separated, in sender order");
  pub->add_option("--sender-processes", pa->sender_processes,
                  "With --process: the process of each sender, comma-separated (default: contiguous blocks)");
  pub->add_option("--peer-timeout", pa->peer_timeout,
                  "With --process: seconds to wait for the other processes' objects");
  pub->add_option("--state", pa->state,
                  "Publisher state directory (the baseline, a cache of the store: rebuilt from it when missing); "
                  "default $DCR_STATE_DIR, else in memory: /dev/shm/dcr-<uid>/publish/<store>");
  pub->add_option("--senders", pa->senders, "Senders (chunk owners)")->check(CLI::Range(1, 1024));
  pub->add_option("--attempts", pa->attempts, "Attempts before giving up (retries are overwrite)")
      ->check(CLI::Range(1, 100));
  pub->add_option("--chunk", pa->chunk, "Chunk size in elements (version 0 fixes it for the run)");
  pub->add_option("--segment", pa->segment,
                  "Bytes of frames per object (receivers download each while the next is written), e.g. 1MiB; "
                  "auto: checkpoint size / 4096 within [256 KiB, 16 MiB]");
  pub->add_option("--ack-timeout", pa->ack_timeout, "Seconds to wait for acks before retiring silent receivers");
  pub->add_option("--heartbeat-timeout", pa->heartbeat_timeout, "Receivers silent longer than this are not waited for");
  pub->add_option("--snapshot-every", pa->snapshot_every, "Also publish a snapshot every N versions");
  pub->add_flag("--json", pa->json, "Print the report as JSON");
  pub->add_option("--metrics", pa->metrics,
                  "Serve Prometheus metrics at http://HOST:PORT/metrics while publishing (docs/metrics.md)");
  pub->add_option("--relay", pa->relays,
                  "Also push every frame object into this relay tree root (repeat: one root per destination cluster); "
                  "the store still gets them");
  pub->add_option("--relay-key", pa->relay_key, "CURVE key pair file for the relays (dcr relay keygen)");
  pub->add_option("--relay-pub", pa->relay_pub, "The relays' public key file");
  pub->add_flag("--relay-insecure", pa->relay_insecure, "No relay keys: plain TCP (relays run with --insecure)");
  pub->add_option("--relay-mbps", pa->relay_mbps,
                  "Benchmarks: pace each link to a root to this many MB/s (an in-process throttle); 0: unlimited");
  pub->add_flag("--no-relay-acks", pa->no_relay_acks,
                "Take acks from the store alone (polled every 20 ms), not from the relay tree (measurements)");
  pub->callback([pa] { ExitCode() = RunPublish(*pa); });
}

void AddFollowCommand(CLI::App& app) {
  auto* fol = app.add_subcommand("follow", "Receive every committed version into a checkpoint directory, in place");
  auto fa = std::make_shared<FollowArgs>();
  fol->add_option("--store", fa->store, "Store URL")->required();
  fol->add_option("target", fa->target,
                  "Checkpoint directory (empty: join from the newest snapshot); with --layout, the rank's buffer "
                  "directory")
      ->required();
  fol->add_option("--layout", fa->layout, "Follow as one rank of an engine: the rank's receiver map (docs/layouts.md)");
  fol->add_option("--engine", fa->engine, "With --layout: the engine's name (shared by its ranks)");
  fol->add_option("--rank", fa->rank, "With --layout: this rank's index");
  fol->add_option("--ranks", fa->ranks, "With --layout: the engine's rank count");
  fol->add_option("--id", fa->id, "Receiver id (default host-pid; with --layout ENGINE-rR)");
  fol->add_option("--until", fa->until, "Exit once this version is applied");
  fol->add_option("--poll", fa->poll, "Seconds between store polls");
  fol->add_option("--stream-poll", fa->stream_poll,
                  "Seconds between looks for new frame objects while an attempt streams");
  fol->add_option("--fetch-ahead", fa->fetch_ahead,
                  "Frame objects downloaded from the store at once, at most held ahead of the apply")
      ->check(CLI::Range(size_t{1}, size_t{1024}));
  fol->add_option("--heartbeat", fa->heartbeat, "Seconds between heartbeats");
  fol->add_option("--metrics", fa->metrics,
                  "Serve Prometheus metrics at http://HOST:PORT/metrics while following (docs/metrics.md)");
  fol->add_option("--relay", fa->relays,
                  "Take frame objects from this relay (repeat: then its ancestors, used in order when it is silent); "
                  "what no relay delivers comes from the store");
  fol->add_option("--relay-key", fa->relay_key, "CURVE key pair file for the relays (dcr relay keygen)");
  fol->add_option("--relay-pub", fa->relay_pub, "The relays' public key file");
  fol->add_flag("--relay-insecure", fa->relay_insecure, "No relay keys: plain TCP (relays run with --insecure)");
  fol->add_option("--relay-quiet", fa->relay_quiet,
                  "Seconds without a new object from the relay after which the missing ones come from the store "
                  "(keep it above --relay-dead-after)");
  fol->add_option("--relay-dead-after", fa->relay_dead_after,
                  "Seconds of silence after which the relay is left for the next --relay address");
  fol->add_option("--relay-poll", fa->relay_poll,
                  "Seconds between store polls while idle in a relay tree that carries the publisher's notices "
                  "(attempt opened, version committed): a lost notice costs at most this")
      ->check(CLI::Range(0.001, 3600.0));
  fol->callback([fa] { ExitCode() = RunFollow(*fa); });
}

void AddStatusCommand(CLI::App& app) {
  auto* st = app.add_subcommand("status", "Versions, attempts, acknowledgements, fences and receivers of a run");
  auto sa = std::make_shared<StatusArgs>();
  st->add_option("--store", sa->store, "Store URL")->required();
  st->add_option("--heartbeat-timeout", sa->heartbeat_timeout, "Receivers silent longer than this are shown not live");
  st->add_flag("--json", sa->json, "Print JSON");
  st->add_option("--relay-stats", sa->relay_stats,
                 "Also show the relay tree from these relays' --stats files (relays, upstreams, per-link progress)");
  st->add_option("--timeline", sa->timeline,
                 "Write committed version V's timeline (every process's stages) as a Chrome/Perfetto trace to --out")
      ->check(CLI::NonNegativeNumber);
  st->add_option("--out", sa->out, "With --timeline: the trace file (JSON)");
  st->callback([sa] { ExitCode() = RunStatus(*sa); });
}

}  // namespace

void AddRefitCommands(CLI::App& app) {
  AddPublishCommand(app);
  AddFollowCommand(app);
  AddStatusCommand(app);
}

}  // namespace dcr::cli
