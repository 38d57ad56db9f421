// dcr relay: the relay daemon, and its keys, plans and a manual push.
#include <fmt/format.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "dcr/json.h"
#include "dcr/store.h"

#include "cli.h"
#include "dcr/progress.h"
#include "dcr/relay.h"
#include "dcr/signing.h"
#include "fault_hooks.h"

namespace dcr::cli {

Result<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

std::atomic<bool> g_relay_stop{false};
void OnRelaySignal(int) { g_relay_stop = true; }

struct RelayArgs {
  std::string id, listen, stats, key, relay_pub, allow, window = "64MiB", cache = "1GiB", spool, spool_bytes = "4GiB";
  bool insecure = false;
  std::vector<std::string> parents;
  double ping = 0.25, dead_after = 1.5, link_mbps = 0;
  std::string pull_store, store;
  double pull_every = 0.02;
  std::string metrics;  // HOST:PORT
};

// The relay's options from its arguments (sizes, timings, keys); errors
// name the flag.
Result<RelayOptions> DaemonOptions(const RelayArgs& a) {
  RelayOptions o;
  o.id = a.id;
  o.listen = a.listen;
  o.upstream = a.parents;
  auto window = ParseBytes(a.window), cache = ParseBytes(a.cache), spool_bytes = ParseBytes(a.spool_bytes);
  if (!window.ok()) return window.status().WithContext("--window");
  if (!cache.ok()) return cache.status().WithContext("--cache");
  if (!spool_bytes.ok()) return spool_bytes.status().WithContext("--spool-bytes");
  o.window_bytes = *window;
  o.cache_bytes = *cache;
  o.spool_dir = a.spool;
  o.spool_bytes = *spool_bytes;
  o.stats_path = a.stats;
  o.link_bytes_per_second = a.link_mbps * 1e6;
  o.ping_every = std::chrono::milliseconds(static_cast<int64_t>(a.ping * 1000));
  o.dead_after = std::chrono::milliseconds(static_cast<int64_t>(a.dead_after * 1000));
  DCR_ASSIGN_OR_RETURN(o.security, LoadRelaySecurity(a.key, a.relay_pub, a.allow, a.insecure,
                                                     {"--key", "--relay-pub", "--allow", "--insecure"}));
  if (o.security.enabled() && o.security.allowed.empty())
    return InvalidArgument("--key without --allow: no peer could attach; list their public keys in a file");
  // A root that pulls from the store pushes with its own pair, as a sender.
  if (!a.pull_store.empty() && o.security.enabled())
    o.security.allowed[o.security.own->public_key] |= RoleBit(RelayRole::kSender);
  return o;
}

int RunRelayDaemon(const RelayArgs& a) {
  auto options = DaemonOptions(a);
  if (!options.ok()) return Fail("relay", options.status());
  RelayOptions& o = *options;
  // --store (else --pull-store's): objects are kept only when their
  // publisher's signature verifies against the key that store records.
  std::unique_ptr<Store> verify_store;
  std::optional<FrameObjectVerifier> verifier;
  if (const std::string& url = a.store.empty() ? a.pull_store : a.store; !url.empty()) {
    auto opened = OpenStore(url);
    if (!opened.ok()) return Fail("relay", opened.status().WithContext(a.store.empty() ? "--pull-store" : "--store"));
    verify_store = std::move(*opened);
    verifier.emplace(*verify_store);
    o.verify_object = [&verifier](const std::string& key, std::string_view bytes) {
      return verifier->Verify(key, bytes);
    };
    std::cerr << "dcr relay [" << a.id << "] objects are kept only when their publisher's signature verifies against "
              << verify_store->url() << std::endl;
  }
  o.arrival_fault = RelayArrivalHook();
  std::signal(SIGINT, OnRelaySignal);
  std::signal(SIGTERM, OnRelaySignal);
  // --pull-store: a thread fetches the frame objects from the store and
  // pushes them into this relay as a sender would, with its own key pair
  // (admitted above as a sender).
  std::unique_ptr<Store> store;
  std::unique_ptr<RelaySender> puller;
  std::thread pulling;
  if (!a.pull_store.empty()) {
    if (!a.parents.empty())
      return Fail("relay", InvalidArgument("--pull-store is for a root (no --parent): it takes the senders' place"));
    auto opened = OpenStore(a.pull_store);
    if (!opened.ok()) return Fail("relay", opened.status().WithContext("--pull-store"));
    store = std::move(*opened);
    RelayClientOptions po;
    po.id = "store-puller-" + a.id;
    po.addresses = {a.listen};
    po.security = o.security;
    if (po.security.enabled()) po.security.server_public = po.security.own->public_key;
    auto started = RelaySender::Start(po);
    if (!started.ok()) return Fail("relay", started.status());
    puller = std::move(*started);
    pulling = std::thread([&] {
      Status ps = PullFrameObjects(
          *store, *puller, std::chrono::milliseconds(static_cast<int64_t>(a.pull_every * 1000)),
          [] { return g_relay_stop.load(); },
          [&](const std::string& line) { std::cerr << "dcr relay [" << a.id << "] " << line << std::endl; });
      if (!ps.ok()) std::cerr << "dcr relay [" << a.id << "] pulling stopped: " << ps.ToString() << std::endl;
    });
  }
  auto metrics = ServeMetrics("relay", a.metrics);
  if (!metrics.ok()) return Fail("relay", metrics.status());
  Status s = RunRelay(o, [] { return g_relay_stop.load(); });
  g_relay_stop = true;
  if (pulling.joinable()) pulling.join();
  if (!s.ok()) return Fail("relay", s);
  return kExitOk;
}

}  // namespace

Result<std::string> FormatRelayTree(const std::vector<std::string>& stats_files, bool as_json) {
  std::vector<nlohmann::json> docs;
  for (const auto& f : stats_files) {
    DCR_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(f));
    auto doc = nlohmann::json::parse(text, nullptr, false);
    if (doc.is_discarded() || !doc.is_object() || doc.value("format", "") != "dcr-relay-stats" ||
        !doc["links"].is_array() || !doc["id"].is_string())
      return InvalidArgument(f + ": not a relay stats file (dcr relay --stats FILE writes one)");
    docs.push_back(std::move(doc));
  }
  if (as_json) return JsonText(nlohmann::json(docs), 1);
  std::map<std::string, std::string> id_of, up_of;  // listen address -> id, id -> upstream address
  for (const auto& d : docs) {
    id_of[d.value("listen", "")] = d.value("id", "");
    up_of[d.value("id", "")] = d["upstream"].is_string() ? d["upstream"].get<std::string>() : "";
  }
  // Roots first, then each depth (the upstream chain among the files given).
  auto depth = [&](const nlohmann::json& d) {
    size_t n = 0;
    for (std::string id = d.value("id", ""); n < docs.size() && id_of.count(up_of[id]); ++n) id = id_of[up_of[id]];
    return n;
  };
  std::stable_sort(docs.begin(), docs.end(), [&](const auto& a, const auto& b) { return depth(a) < depth(b); });
  std::string out;
  for (const auto& d : docs) {
    const std::string up = d["upstream"].is_string() ? d["upstream"].get<std::string>() : "";
    out += fmt::format(
        "relay {} at {}, upstream {}: {} objects ({}) accepted; dropped {} corrupt, {} fenced, {} duplicates; "
        "{} peers refused\n",
        d.value("id", "?"), d.value("listen", "?"),
        up.empty() ? "none (a root)" : (id_of.count(up) ? id_of[up] + " " + up : up), d.value("accepted", 0),
        FormatBytes(d.value("accepted_bytes", 0)), d.value("dropped_corrupt", 0), d.value("dropped_fenced", 0),
        d.value("duplicates", 0), d.value("refused_peers", 0));
    out += fmt::format(
        "  acks: {} in {} messages from below, {} in {} messages up; spool: {} objects ({}) written, {} in use\n",
        d.value("acks_in", 0), d.value("ack_messages_in", 0), d.value("acks_out", 0), d.value("ack_messages_out", 0),
        d.value("spooled", 0), FormatBytes(d.value("spooled_bytes", 0)), FormatBytes(d.value("spool_bytes_in_use", 0)));
    for (const auto& l : d["links"]) {
      const std::string kind = l.value("kind", "?");
      const bool in = kind == "upstream" || kind == "sender";
      std::string extra;
      if (l.value("evicted", 0)) extra += fmt::format(", {} evicted before sending", l.value("evicted", 0));
      if (l.value("spooled", 0)) extra += fmt::format(", {} through the spool", l.value("spooled", 0));
      out += fmt::format("  {} {} {}{}: {} in {} objects{}\n", in ? "<-" : "->", kind, l.value("peer", "?"),
                         l.value("attached", false) ? "" : " (detached)",
                         FormatBytes(in ? l.value("bytes_in", 0) : l.value("bytes_out", 0)),
                         in ? l.value("objects_in", 0) : l.value("objects_out", 0), extra);
    }
  }
  return out;
}

namespace {

// The daemon's options (dcr relay without a subcommand).
void AddRelayDaemonOptions(CLI::App* relay, RelayArgs* ra) {
  relay->add_option("--id", ra->id, "This relay's id (logs, stats, the plan)");
  relay->add_option("--listen", ra->listen, "Address to listen on, e.g. tcp://0.0.0.0:7400");
  relay->add_option("--parent", ra->parents,
                    "Parent relay address; repeat for its ancestors, in order (used when the parent is silent). "
                    "None: a root, which senders push into");
  relay->add_option("--window", ra->window, "Per child: bytes sent and not yet acknowledged (the in-memory window)");
  relay->add_option("--cache", ra->cache,
                    "Bytes of objects kept for slow and re-attaching children; a child that misses an evicted object "
                    "fetches it from the store");
  relay->add_option("--spool", ra->spool,
                    "Directory for a slow child's backlog beyond the cache: evicted objects it still needs are "
                    "written here and sent from disk, instead of being fetched from the store");
  relay->add_option("--spool-bytes", ra->spool_bytes, "Bound on the spool directory's bytes (beyond: the store)");
  relay->add_option("--stats", ra->stats,
                    "Write per-link byte counters as JSON to this file (every second and at exit)");
  relay->add_option("--metrics", ra->metrics, "Serve Prometheus metrics at http://HOST:PORT/metrics (docs/metrics.md)");
  relay->add_option("--key", ra->key, "CURVE key pair file (dcr relay keygen); enables authentication and encryption");
  relay->add_option("--relay-pub", ra->relay_pub, "Public key of the parent relays (default: this relay's own)");
  relay->add_option("--allow", ra->allow,
                    "File of admitted peers' public keys, one per line with its role: sender KEY, relay KEY or "
                    "receiver KEY");
  relay->add_flag("--insecure", ra->insecure,
                  "No keys: plain TCP, anyone who can connect is served in any role (trusted networks only; warned at "
                  "every start)");
  relay->add_option("--ping", ra->ping, "Seconds between pings to peers");
  relay->add_option("--dead-after", ra->dead_after, "Seconds of silence after which the parent is left for the next");
  relay->add_option(
      "--pull-store", ra->pull_store,
      "A root inside the destination cluster: fetch each attempt's frame objects from this store itself "
      "(senders then only write to the store); with keys, it pushes with its own pair, admitted as a sender");
  relay->add_option("--store", ra->store,
                    "Keep an object only when its publisher's signature verifies against the key this store records "
                    "(default with --pull-store: that store); without it, the first copy of a key is kept and "
                    "receivers verify");
  relay->add_option("--pull-every", ra->pull_every, "Seconds between the store listings of --pull-store");
  relay->add_option("--link-mbps", ra->link_mbps,
                    "Benchmarks: pace each child link to this many MB/s (an in-process throttle); 0: unlimited");
}

void AddRelayKeygen(CLI::App* relay) {
  auto* keygen = relay->add_subcommand("keygen", "Write a CURVE key pair: STEM.key (secret, 0600) and STEM.pub");
  auto stem = std::make_shared<std::string>();
  keygen->add_option("stem", *stem, "Path without extension")->required();
  keygen->callback([stem] {
    auto pair = GenerateCurveKeyPair();
    if (!pair.ok()) {
      ExitCode() = Fail("relay keygen", pair.status());
      return;
    }
    if (Status s = WriteCurveKeyFiles(*stem, *pair); !s.ok()) {
      ExitCode() = Fail("relay keygen", s);
      return;
    }
    fmt::print("{}\n", pair->public_key);
    ExitCode() = kExitOk;
  });
}

void AddRelayPlan(CLI::App* relay) {
  auto* plan = relay->add_subcommand("plan", "Print the tree for a relay list (JSON [{id, address, cluster}])");
  struct PlanArgs {
    std::string relays;
    uint32_t fanout = 2;
    std::vector<std::string> lost;
  };
  auto pa = std::make_shared<PlanArgs>();
  plan->add_option("--relays", pa->relays, "The relay list (JSON file)")->required();
  plan->add_option("--fanout", pa->fanout, "Children per relay")->check(CLI::Range(1, 1024));
  plan->add_option("--lost", pa->lost, "Relays to plan without (lost nodes)");
  plan->callback([pa] {
    auto text = ReadWholeFile(pa->relays);
    if (!text.ok()) {
      ExitCode() = Fail("relay plan", text.status());
      return;
    }
    auto relays = ParseRelayList(*text, pa->relays);
    if (!relays.ok()) {
      ExitCode() = Fail("relay plan", relays.status());
      return;
    }
    auto p = PlanTreeWithout(*relays, std::set<std::string>(pa->lost.begin(), pa->lost.end()), pa->fanout);
    if (!p.ok()) {
      ExitCode() = Fail("relay plan", p.status());
      return;
    }
    std::cout << p->ToJson();
    ExitCode() = kExitOk;
  });
}

void AddRelayPush(CLI::App* relay) {
  auto* push = relay->add_subcommand("push", "Push one frame object from a file into a relay, as a sender does");
  struct PushArgs {
    std::string to, key, relay_pub, object_key, file;
    bool insecure = false;
  };
  auto ua = std::make_shared<PushArgs>();
  push->add_option("--to", ua->to, "Relay address")->required();
  push->add_option("--object-key", ua->object_key, "The object's key, attempts/v<N>/<attempt>/frames/s<K>-<NNNN>.bin")
      ->required();
  push->add_option("--key", ua->key, "CURVE key pair file");
  push->add_option("--relay-pub", ua->relay_pub, "The relay's public key");
  push->add_flag("--insecure", ua->insecure, "No keys: plain TCP (a relay that runs --insecure)");
  push->add_option("file", ua->file, "The object's bytes")->required();
  push->callback([ua] {
    auto data = ReadWholeFile(ua->file);
    if (!data.ok()) {
      ExitCode() = Fail("relay push", data.status());
      return;
    }
    if (auto p = FrameObjectPrefix(ua->object_key); !p.ok()) {
      ExitCode() = Fail("relay push", p.status());
      return;
    }
    auto sec = LoadRelaySecurity(ua->key, ua->relay_pub, "", ua->insecure, {"--key", "--relay-pub", "", "--insecure"});
    if (!sec.ok()) {
      ExitCode() = Fail("relay push", sec.status());
      return;
    }
    RelayClientOptions o;
    o.id = "push";
    o.addresses = {ua->to};
    o.security = *sec;
    auto sender = RelaySender::Start(o);
    if (!sender.ok()) {
      ExitCode() = Fail("relay push", sender.status());
      return;
    }
    (*sender)->Object(ua->object_key, *data);
    // Pushed once the relay credited it: a relay that refuses the peer (its
    // key is not a sender's) or stays silent has it written off.
    if (!(*sender)->Flush(std::chrono::seconds(10)) || (*sender)->Stats().objects == 0) {
      ExitCode() = Fail("relay push", Unavailable(fmt::format("{} did not acknowledge {} within 10 s (is it running, "
                                                              "and are the keys right: a sender's?)",
                                                              ua->to, ua->object_key)));
      return;
    }
    fmt::print("pushed {} ({} bytes) to {}\n", ua->object_key, data->size(), ua->to);
    ExitCode() = kExitOk;
  });
}

void AddRelayStatus(CLI::App* relay) {
  auto* status = relay->add_subcommand(
      "status", "Show relays and per-link byte counters from their --stats files, the tree in upstream order");
  auto files = std::make_shared<std::vector<std::string>>();
  status->add_option("stats", *files, "Stats files written by dcr relay --stats")->required();
  status->callback([files] {
    auto text = FormatRelayTree(*files, false);
    if (!text.ok()) {
      ExitCode() = Fail("relay status", text.status());
      return;
    }
    fmt::print("{}", *text);
    ExitCode() = kExitOk;
  });
}

}  // namespace

void AddRelayCommand(CLI::App& app) {
  auto* relay = app.add_subcommand(
      "relay", "Run a relay of the relay tree (frames in from the parent or senders, out to children and receivers)");
  relay->require_subcommand(0, 1);
  auto ra = std::make_shared<RelayArgs>();
  AddRelayDaemonOptions(relay, ra.get());
  AddRelayKeygen(relay);
  AddRelayPlan(relay);
  AddRelayPush(relay);
  AddRelayTreeCommand(relay);
  AddRelayStatus(relay);
  relay->callback([relay, ra] {
    if (!relay->get_subcommands().empty()) return;  // keygen, plan, push, status or tree ran
    if (ra->id.empty() || ra->listen.empty()) {
      ExitCode() = Fail(
          "relay", InvalidArgument("--id and --listen are needed to run a relay (or use keygen, plan, push, status)"));
      return;
    }
    ExitCode() = RunRelayDaemon(*ra);
  });
}

}  // namespace dcr::cli
