// dcr._dcr: the protocol: publishers and followers.
#include "bindings.h"

namespace dcr_python {
namespace {

nb::dict PublishReportDict(const dcr::PublishReport& r) {
  nb::dict d;
  d["version"] = r.version;
  d["attempt"] = r.attempt;
  d["attempts"] = r.attempts;
  d["frame_bytes"] = r.frame_bytes;
  d["payload_bytes"] = r.payload_bytes;
  d["manifest_bytes"] = r.manifest_bytes;
  d["download_bytes"] = r.download_bytes;
  d["changed_words"] = r.changed_words;
  d["total_bytes"] = r.total_bytes;
  d["acked"] = r.acked;
  d["retired"] = r.retired;
  d["relay_acks"] = r.relay_acks;
  d["relay_acks_unconfirmed"] = r.relay_acks_unconfirmed;
  d["encode_seconds"] = r.encode_seconds;
  d["wait_seconds"] = r.wait_seconds;
  d["commit_seconds"] = r.commit_seconds;
  d["total_seconds"] = r.total_seconds;
  d["baseline_seconds"] = r.baseline_seconds;
  d["advance_seconds"] = r.advance_seconds;
  d["staging_seconds"] = r.staging_seconds;
  d["state_dir"] = r.state_dir;
  nb::dict memory;
  memory["baseline_bytes"] = r.memory.baseline_bytes;
  memory["baseline_in_memory"] = r.memory.baseline_in_memory;
  memory["staging_bytes"] = r.memory.staging_bytes;
  memory["frames_in_flight_bytes"] = r.memory.frames_in_flight_bytes;
  memory["digest_bytes"] = r.memory.digest_bytes;
  d["memory"] = memory;
  d["already_committed"] = r.already_committed;
  return d;
}

// Relay client options under `id` from the Python arguments; nullopt
// without addresses (then none of the key arguments may be given).
std::optional<dcr::RelayClientOptions> RelayOptions(const std::string& id, const std::vector<std::string>& addresses,
                                                    const std::string& key, const std::string& pub, bool insecure) {
  if (addresses.empty()) {
    if (!key.empty() || !pub.empty() || insecure)
      Raise(dcr::InvalidArgument("relay_key, relay_pub and relay_insecure need relay addresses"));
    return std::nullopt;
  }
  dcr::RelayClientOptions o;
  o.id = id;
  o.addresses = addresses;
  o.security = Take(dcr::LoadRelaySecurity(key, pub, "", insecure, {"relay_key", "relay_pub", "", "relay_insecure"}));
  return o;
}

// A receiver's relay client (frame objects from the relay tree), started
// under the receiver's id; null without addresses.
std::unique_ptr<dcr::RelayReceiver> StartRelay(const std::string& id, const std::vector<std::string>& addresses,
                                               const std::string& key, const std::string& pub, bool insecure,
                                               bool quiet) {
  auto o = RelayOptions(id, addresses, key, pub, insecure);
  if (!o) return nullptr;
  if (quiet) o->log = [](const std::string&) {};
  return Take(dcr::RelayReceiver::Start(std::move(*o)));
}

// A publisher's relay client (frame objects and fences pushed to the roots
// of the relay tree, acks taken from them), under `id`; null without addresses.
std::unique_ptr<dcr::RelaySender> StartRelaySender(const std::string& id, const std::vector<std::string>& addresses,
                                                   const std::string& key, const std::string& pub, bool insecure) {
  auto o = RelayOptions(id, addresses, key, pub, insecure);
  if (!o) return nullptr;
  o->dead_after = std::chrono::seconds(5);  // a root is written off only when really gone (as `dcr publish`)
  o->log = [](const std::string&) {};
  return Take(dcr::RelaySender::Start(std::move(*o)));
}

// The relay (declared first) outlives the follower that takes from it.
struct PyFollower {
  std::unique_ptr<dcr::RelayReceiver> relay;
  std::unique_ptr<dcr::Follower> follower;
};

// One rank of an engine following the run into live buffers (the arrays are
// kept, and the compiled map has a fixed address, so both outlive the follower).
struct PyRankFollower {
  std::unique_ptr<dcr::CompiledLayout> layout;
  std::unique_ptr<PyBuffers> buffers;
  std::unique_ptr<dcr::RelayReceiver> relay;
  std::unique_ptr<dcr::RankFollower> follower;
};

// Ctrl-C while a publish waits for acks: PublishOptions::cancel takes the
// GIL (every 20 ms) to let Python's signal handlers run; once one raised
// (KeyboardInterrupt), the publish stops (its attempt fenced) and the
// exception is re-raised when it returns.
struct Interruptible {
  std::shared_ptr<bool> raised = std::make_shared<bool>(false);

  std::function<bool()> Hook() const {
    return [raised = raised] {
      if (*raised) return true;  // an exception is pending: no more Python calls
      nb::gil_scoped_acquire acquire;
      return *raised = PyErr_CheckSignals() != 0;
    };
  }
  template <typename F>
  auto Run(F&& publish) {
    *raised = false;
    dcr::Result<dcr::PublishReport> r = dcr::Internal("not run");
    {
      nb::gil_scoped_release release;
      r = publish();
    }
    if (*raised) throw nb::python_error();
    return PublishReportDict(Take(std::move(r)));
  }
};

struct PyPublisher {
  dcr::Publisher publisher;
  Interruptible interrupt;
};

// A trainer's senders publishing live shards: their compiled maps, fixed at
// construction; the buffers are given with each publish. One process of
// several (processes > 1): `layouts` are this process's senders, `all` every
// sender's map (global order) and `procs` the placement.
struct PyShardPublisher {
  std::vector<std::unique_ptr<dcr::CompiledLayout>> layouts, all;
  dcr::ShardProcesses procs;
  std::unique_ptr<dcr::RelaySender> relay;  // declared first: outlives the publisher
  std::unique_ptr<dcr::ShardPublisher> publisher;
  Interruptible interrupt;
};

// The senders' sources for one call: their buffers (checked against the
// maps), and where given, a stage function run on the publisher's copy
// thread (stagers[k](b) fills buffer b's host memory; under the GIL).
std::vector<dcr::ShardSource> ShardSources(PyShardPublisher& p, const std::vector<std::vector<nb::ndarray<>>>& buffers,
                                           const std::vector<nb::object>& stagers, const std::string& who) {
  if (buffers.size() != p.layouts.size() || (!stagers.empty() && stagers.size() != p.layouts.size()))
    Raise(dcr::InvalidArgument(who + ": " + std::to_string(buffers.size()) + " senders' buffers and " +
                               std::to_string(stagers.size()) + " stagers given, it has " +
                               std::to_string(p.layouts.size()) + " senders"));
  std::vector<dcr::ShardSource> sources;
  for (size_t k = 0; k < buffers.size(); ++k) {
    dcr::ShardSource src{p.layouts[k].get(), {}, {}};
    for (auto span : RankBuffers(*p.layouts[k], buffers[k], "ShardPublisher: sender " + std::to_string(k)))
      src.current.emplace_back(span);
    if (!stagers.empty() && !stagers[k].is_none())
      src.stage = [stage = stagers[k]](size_t b) -> dcr::Status {
        nb::gil_scoped_acquire acquire;
        try {
          stage(b);
          return dcr::Status::Ok();
        } catch (nb::python_error& e) {
          return dcr::Aborted(std::string("the stage function raised: ") + e.what());
        }
      };
    sources.push_back(std::move(src));
  }
  return sources;
}

dcr::PublishOptions MakePublishOptions(uint32_t senders, uint32_t max_attempts, double ack_timeout_s,
                                       double heartbeat_timeout_s, uint64_t snapshot_every, uint64_t chunk_elements) {
  dcr::PublishOptions o;
  o.senders = senders;
  o.max_attempts = max_attempts;
  o.ack_timeout = std::chrono::milliseconds(static_cast<int64_t>(ack_timeout_s * 1000));
  o.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(heartbeat_timeout_s * 1000));
  o.snapshot_every = snapshot_every;
  o.delta = MakeDeltaOptions("xor", chunk_elements, 0);
  return o;
}

// Failures injected on purpose (tests of retries): each "point:n" makes the
// n-th time the publisher reaches fault point `point` fail as a transient
// store error would (the attempt is fenced and retried).
std::function<dcr::Status(std::string_view)> InjectedFailures(const std::vector<std::string>& specs) {
  if (specs.empty()) return {};
  auto counts = std::make_shared<std::map<std::string, uint64_t>>();
  std::map<std::string, uint64_t> at;
  for (const std::string& spec : specs) {
    const size_t colon = spec.rfind(':');
    uint64_t n = 0;
    const char* first = colon == std::string::npos ? nullptr : spec.data() + colon + 1;
    const char* last = spec.data() + spec.size();
    if (!first || first == last || std::from_chars(first, last, n).ptr != last || n == 0)
      Raise(dcr::InvalidArgument("inject_failures: '" + spec + "' is not POINT:N (N >= 1)"));
    at[spec.substr(0, colon)] = n;
  }
  return [counts, at](std::string_view point) {
    const std::string p(point);
    auto it = at.find(p);
    if (it != at.end() && ++(*counts)[p] == it->second)
      return dcr::Unavailable("injected failure at " + p + " (inject_failures)");
    return dcr::Status::Ok();
  };
}

dcr::FollowOptions MakeFollowOptions(const std::string& id, double poll_s, double relay_poll_s, bool quiet) {
  if (!(relay_poll_s >= 0.001 && relay_poll_s <= 3600))
    Raise(dcr::InvalidArgument("relay_poll_s must be in [0.001, 3600] seconds, not " + std::to_string(relay_poll_s)));
  dcr::FollowOptions o;
  o.id = id;
  o.poll = std::chrono::milliseconds(static_cast<int64_t>(poll_s * 1000));
  o.relay_poll = std::chrono::milliseconds(static_cast<int64_t>(relay_poll_s * 1000));
  if (quiet) o.log = [](const std::string&) {};
  return o;
}

// Runs a follower (dcr::Follower or dcr::RankFollower) without the GIL.
// The loop polls `stop` after every step (each poll of the store): it takes
// the GIL there to let Python signal handlers run (Ctrl-C raises
// KeyboardInterrupt, which stops the loop cleanly) and to call
// on_version(version) after each version applied (a RankFollower: also after
// the version it joined or reopened). An exception from either stops the loop
// and is re-raised once Run has returned.
template <typename F>
uint64_t RunFollowing(F& follower, const std::string& who, std::optional<uint64_t> until,
                      std::optional<double> timeout_s, nb::object on_version) {
  dcr::Status s;
  bool timed_out = false, py_error = false;
  std::optional<uint64_t> seen;
  // A RankFollower reports the version it joins or reopens, but not again
  // the one a previous call already reported (a call continuing it).
  if constexpr (requires { follower.holds_version(); }) {
    if (follower.holds_version()) seen = follower.version();
  } else {
    seen = follower.version();
  }
  auto poll_python = [&]() -> bool {
    if (py_error) return true;  // an exception is pending: no more Python calls
    nb::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() != 0) return py_error = true;
    if constexpr (requires { follower.holds_version(); })
      if (!follower.holds_version()) return false;
    const uint64_t v = follower.version();
    if (v != seen && !on_version.is_none()) {
      seen = v;
      PyObject* r = PyObject_CallOneArg(on_version.ptr(), nb::int_(v).ptr());
      if (r == nullptr) return py_error = true;
      Py_DECREF(r);
    }
    seen = v;
    return false;
  };
  {
    nb::gil_scoped_release release;
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(timeout_s.value_or(0) * 1000));
    s = follower.Run(until, [&] {
      if (poll_python()) return true;
      if (!timeout_s || std::chrono::steady_clock::now() < deadline) return false;
      timed_out = true;
      return true;
    });
    if (!py_error && s.ok()) poll_python();  // the last version, when `until` ended the loop
  }
  if (py_error) throw nb::python_error();
  if (timed_out)  // the stop callback makes Run return ABORTED; say why instead
    Raise(dcr::DeadlineExceeded(who + ": " + std::to_string(*timeout_s) + " s passed at version " +
                                std::to_string(follower.version())));
  Check(s);
  return follower.version();
}

}  // namespace

// Publisher and Follower: checkpoints through a store.
void BindPublishers(nb::module_& m) {
  nb::class_<PyPublisher>(m, "Publisher")
      .def(
          "__init__",
          [](PyPublisher* self, PyStore& store, const std::string& state_dir, uint32_t senders, uint32_t max_attempts,
             double ack_timeout_s, double heartbeat_timeout_s, uint64_t snapshot_every, uint64_t chunk_elements) {
            Interruptible interrupt;
            dcr::PublishOptions o = MakePublishOptions(senders, max_attempts, ack_timeout_s, heartbeat_timeout_s,
                                                       snapshot_every, chunk_elements);
            o.cancel = interrupt.Hook();
            new (self) PyPublisher{dcr::Publisher(*store.store, state_dir, std::move(o)), interrupt};
          },
          "store"_a, "state_dir"_a, "senders"_a, "max_attempts"_a, "ack_timeout_s"_a, "heartbeat_timeout_s"_a,
          "snapshot_every"_a, "chunk_elements"_a, nb::keep_alive<1, 2>())
      .def(
          "publish",
          [](PyPublisher& p, uint64_t version, const PyCheckpoint& next) {
            return p.interrupt.Run([&] { return p.publisher.Publish(version, next.ckpt); });
          },
          "version"_a, "checkpoint"_a);

  nb::class_<PyFollower>(m, "Follower")
      .def(
          "__init__",
          [](PyFollower* self, PyStore& store, const std::string& target, const std::string& id, double poll_s,
             bool quiet, const std::vector<std::string>& relay, const std::string& relay_key,
             const std::string& relay_pub, bool relay_insecure, double relay_poll_s) {
            dcr::FollowOptions o =
                MakeFollowOptions(id.empty() ? dcr::DefaultReceiverId() : id, poll_s, relay_poll_s, quiet);
            auto relayed = StartRelay(o.id, relay, relay_key, relay_pub, relay_insecure, quiet);
            o.relay = relayed.get();
            auto follower = std::make_unique<dcr::Follower>(*store.store, target, std::move(o));
            new (self) PyFollower{std::move(relayed), std::move(follower)};
          },
          "store"_a, "target"_a, "id"_a, "poll_s"_a, "quiet"_a, "relay"_a, "relay_key"_a, "relay_pub"_a,
          "relay_insecure"_a, "relay_poll_s"_a, nb::keep_alive<1, 2>())
      .def(
          "run",
          [](PyFollower& f, std::optional<uint64_t> until, std::optional<double> timeout_s, nb::object on_version) {
            return RunFollowing(*f.follower, "Follower.run", until, timeout_s, on_version);
          },
          "until"_a = nb::none(), "timeout_s"_a = nb::none(), "on_version"_a = nb::none())
      .def_prop_ro("version", [](const PyFollower& f) { return f.follower->version(); });
}

// RankFollower: one rank of an engine following the run into live buffers.
void BindRankFollower(nb::module_& m) {
  nb::class_<PyRankFollower>(m, "RankFollower")
      .def(
          "__init__",
          [](PyRankFollower* self, PyStore& store, const std::string& layout_json, std::vector<nb::ndarray<>> buffers,
             const std::string& state_dir, const std::string& engine, uint32_t rank, uint32_t ranks,
             const std::string& id, double poll_s, bool quiet, const std::vector<std::string>& relay,
             const std::string& relay_key, const std::string& relay_pub, bool relay_insecure, double relay_poll_s,
             bool recheck, nb::object memory) {
            auto layout = std::make_unique<dcr::CompiledLayout>(CompileJson(layout_json, "receiver layout"));
            auto held = std::make_unique<PyBuffers>(*layout, std::move(buffers), std::move(memory), "Receiver.follow");
            const dcr::PlacedRank placed = held->placed;
            dcr::FollowOptions o =
                MakeFollowOptions(id.empty() ? engine + "-r" + std::to_string(rank) : id, poll_s, relay_poll_s, quiet);
            o.recheck = recheck;
            auto relayed = StartRelay(o.id, relay, relay_key, relay_pub, relay_insecure, quiet);
            o.relay = relayed.get();
            auto follower = std::make_unique<dcr::RankFollower>(*store.store, placed, state_dir,
                                                                dcr::EngineRank{engine, rank, ranks}, std::move(o));
            new (self) PyRankFollower{std::move(layout), std::move(held), std::move(relayed), std::move(follower)};
          },
          "store"_a, "layout"_a, "buffers"_a, "state_dir"_a, "engine"_a, "rank"_a, "ranks"_a, "id"_a, "poll_s"_a,
          "quiet"_a, "relay"_a, "relay_key"_a, "relay_pub"_a, "relay_insecure"_a, "relay_poll_s"_a, "recheck"_a = false,
          "memory"_a = nb::none(), nb::keep_alive<1, 2>())
      .def(
          "run",
          [](PyRankFollower& f, std::optional<uint64_t> until, std::optional<double> timeout_s, nb::object on_version) {
            return RunFollowing(*f.follower, "Receiver.follow", until, timeout_s, on_version);
          },
          "until"_a = nb::none(), "timeout_s"_a = nb::none(), "on_version"_a = nb::none())
      .def(
          "adopt",
          [](PyRankFollower& f, uint64_t version, const std::string& engine_digest) {
            const dcr::Digest d = ParseDigest(engine_digest, "Receiver.adopt: engine_digest");
            dcr::Status s;
            {
              nb::gil_scoped_release release;
              s = f.follower->Adopt(version, d);
            }
            Check(s);
          },
          "version"_a, "engine_digest"_a)
      .def_prop_ro("version", [](const PyRankFollower& f) { return f.follower->version(); })
      .def_prop_ro("outside_changes", [](const PyRankFollower& f) { return f.follower->OutsideChanges(); })
      .def(
          "take_changed", [](PyRankFollower& f) { return f.follower->TakeChangedTensors(); },
          "The map's tensors Run may have written since the last call (from run's on_version, or after run).");
}

// ShardPublisher: a trainer's live shards through a store.
void BindShardPublisher(nb::module_& m) {
  nb::class_<PyShardPublisher>(m, "ShardPublisher")
      .def(
          "__init__",
          [](PyShardPublisher* self, PyStore& store, const std::string& state_dir,
             const std::vector<std::string>& layouts, uint32_t senders, uint32_t max_attempts, double ack_timeout_s,
             double heartbeat_timeout_s, uint64_t snapshot_every, uint64_t chunk_elements, uint32_t process,
             uint32_t processes, const std::vector<std::string>& all_layouts, const std::vector<uint32_t>& placement,
             double peer_timeout_s, const std::vector<std::string>& inject_failures,
             const std::vector<std::string>& relay, const std::string& relay_key, const std::string& relay_pub,
             bool relay_insecure) {
            std::vector<std::unique_ptr<dcr::CompiledLayout>> compiled, all;
            for (size_t k = 0; k < layouts.size(); ++k)
              compiled.push_back(std::make_unique<dcr::CompiledLayout>(
                  CompileJson(layouts[k], "sender " + std::to_string(k) + "'s layout")));
            for (size_t k = 0; k < all_layouts.size(); ++k)
              all.push_back(std::make_unique<dcr::CompiledLayout>(
                  CompileJson(all_layouts[k], "global sender " + std::to_string(k) + "'s layout")));
            Interruptible interrupt;
            dcr::PublishOptions o = MakePublishOptions(senders, max_attempts, ack_timeout_s, heartbeat_timeout_s,
                                                       snapshot_every, chunk_elements);
            o.peer_timeout = std::chrono::milliseconds(static_cast<int64_t>(peer_timeout_s * 1000));
            o.cancel = interrupt.Hook();
            o.fault = InjectedFailures(inject_failures);
            auto pushed = StartRelaySender("publish-" + dcr::DefaultReceiverId() + "-p" + std::to_string(process),
                                           relay, relay_key, relay_pub, relay_insecure);
            o.relay = pushed.get();
            auto publisher = std::make_unique<dcr::ShardPublisher>(*store.store, state_dir, std::move(o));
            new (self) PyShardPublisher{
                std::move(compiled), std::move(all),       dcr::ShardProcesses{process, processes, placement},
                std::move(pushed),   std::move(publisher), interrupt};
          },
          "store"_a, "state_dir"_a, "layouts"_a, "senders"_a, "max_attempts"_a, "ack_timeout_s"_a,
          "heartbeat_timeout_s"_a, "snapshot_every"_a, "chunk_elements"_a, "process"_a = 0, "processes"_a = 1,
          "all_layouts"_a = std::vector<std::string>{}, "placement"_a = std::vector<uint32_t>{},
          "peer_timeout_s"_a = 60.0, "inject_failures"_a = std::vector<std::string>{},
          "relay"_a = std::vector<std::string>{}, "relay_key"_a = "", "relay_pub"_a = "", "relay_insecure"_a = false,
          nb::keep_alive<1, 2>())
      .def(
          "adopt",
          [](PyShardPublisher& p, uint64_t version, const std::vector<std::vector<nb::ndarray<>>>& buffers,
             const std::vector<nb::object>& stagers) {
            std::vector<dcr::ShardSource> sources = ShardSources(p, buffers, stagers, "ShardPublisher.adopt");
            dcr::Status s;
            {
              nb::gil_scoped_release release;
              s = p.publisher->Adopt(version, sources);
            }
            Check(s);
          },
          "version"_a, "buffers"_a, "stagers"_a = std::vector<nb::object>{})
      .def(
          "publish",
          [](PyShardPublisher& p, uint64_t version, const std::vector<std::vector<nb::ndarray<>>>& buffers,
             const std::vector<nb::object>& stagers) {
            std::vector<dcr::ShardSource> sources = ShardSources(p, buffers, stagers, "ShardPublisher.publish");
            return p.interrupt.Run([&] {
              if (p.all.empty()) return p.publisher->Publish(version, sources);
              std::vector<const dcr::CompiledLayout*> maps;
              for (const auto& l : p.all) maps.push_back(l.get());
              return p.publisher->Publish(version, maps, sources, p.procs);
            });
          },
          "version"_a, "buffers"_a, "stagers"_a = std::vector<nb::object>{});
}

}  // namespace dcr_python
