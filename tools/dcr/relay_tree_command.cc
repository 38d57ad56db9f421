// dcr relay tree: runs a whole local relay tree (tests, demos) as child
// processes of this one: every relay of a plan (`dcr relay plan`) and N
// receivers (`dcr follow --relay`) spread over them, and stops them all on
// exit, SIGINT or SIGTERM (and, through PR_SET_PDEATHSIG, if this process is
// killed).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli.h"
#include "dcr/relay.h"

namespace dcr::cli {
namespace {

std::atomic<bool> g_tree_stop{false};
void OnTreeSignal(int) { g_tree_stop = true; }

struct TreeArgs {
  std::string plan, store, dir, key, allow, relay_pub, relay_key, receiver_prefix = "e";
  bool insecure = false;
  uint32_t receivers = 0;
  int64_t until = -1;
  double ping = 0.25, dead_after = 1.5;
  std::vector<std::string> relay_args;  // passed to every relay
};

struct Child {
  std::string name, log;
  pid_t pid = -1;
  bool receiver = false;
  int status = 0;
  bool exited = false;
};

// Starts argv with stdout and stderr to `log`; the child dies with this process.
Result<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Internal(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv("/proc/self/exe", args.data());
    ::_exit(127);
  }
  return pid;
}

// The plan, checked; and the receivers' key, which must not be a sender's:
// receivers could then push objects into the roots and fence attempts.
Result<nlohmann::json> CheckTree(const TreeArgs& a) {
  DCR_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(a.plan));
  auto plan = nlohmann::json::parse(text, nullptr, false);
  if (plan.is_discarded() || !plan.is_object() || plan.value("format", "") != "dcr-relay-plan" ||
      !plan["relays"].is_array() || plan["relays"].empty())
    return InvalidArgument(a.plan + ": not a relay plan (dcr relay plan --relays FILE writes one)");
  for (const auto& n : plan["relays"])
    if (!n.is_object() || !n["id"].is_string() || !n["address"].is_string() || !n["upstream"].is_array())
      return InvalidArgument(a.plan + ": a relay without id, address or upstream");
  if (a.receivers > 0 && a.store.empty())
    return InvalidArgument("--receivers needs --store (where the receivers follow the run)");
  if (!a.insecure && !a.relay_key.empty() && !a.key.empty() && !a.allow.empty()) {
    auto receivers =
        LoadRelaySecurity(a.relay_key, a.relay_pub, "", false, {"--relay-key", "--relay-pub", "", "--insecure"});
    if (!receivers.ok()) return receivers.status().WithContext("--relay-key");
    DCR_ASSIGN_OR_RETURN(
        auto relays, LoadRelaySecurity(a.key, "", a.allow, false, {"--key", "--relay-pub", "--allow", "--insecure"}));
    auto it = relays.allowed.find(receivers->own->public_key);
    if (it != relays.allowed.end() && (it->second & RoleBit(RelayRole::kSender)))
      return InvalidArgument(
          fmt::format("{} admits the receivers' key ({}) as a sender: receivers could push objects and "
                      "fence attempts; give it the line 'receiver KEY' and the publisher its own pair",
                      a.allow, a.relay_key));
  }
  return plan;
}

// The command lines of relay `n` of the plan and of receiver i, under relay `n`.
std::vector<std::string> RelayArgv(const TreeArgs& a, const nlohmann::json& n) {
  const std::string id = n["id"];
  std::vector<std::string> argv = {"dcr",          "relay",
                                   "--id",         id,
                                   "--listen",     n["address"],
                                   "--stats",      a.dir + "/stats-" + id + ".json",
                                   "--ping",       fmt::format("{}", a.ping),
                                   "--dead-after", fmt::format("{}", a.dead_after)};
  for (const auto& up : n["upstream"]) argv.insert(argv.end(), {"--parent", up.get<std::string>()});
  if (!a.key.empty()) argv.insert(argv.end(), {"--key", a.key});
  if (!a.allow.empty()) argv.insert(argv.end(), {"--allow", a.allow});
  if (!a.relay_pub.empty()) argv.insert(argv.end(), {"--relay-pub", a.relay_pub});
  if (a.insecure) argv.push_back("--insecure");
  if (!a.store.empty()) argv.insert(argv.end(), {"--store", a.store});  // relays check signatures too
  argv.insert(argv.end(), a.relay_args.begin(), a.relay_args.end());
  return argv;
}
std::vector<std::string> ReceiverArgv(const TreeArgs& a, const nlohmann::json& n, const std::string& id) {
  std::vector<std::string> argv = {"dcr", "follow", "--store", a.store, "--id", id, "--relay", n["address"]};
  for (const auto& up : n["upstream"]) argv.insert(argv.end(), {"--relay", up.get<std::string>()});
  argv.insert(argv.end(), {"--relay-dead-after", fmt::format("{}", a.dead_after)});
  if (!a.relay_key.empty()) argv.insert(argv.end(), {"--relay-key", a.relay_key});
  if (!a.relay_pub.empty()) argv.insert(argv.end(), {"--relay-pub", a.relay_pub});
  if (a.insecure) argv.push_back("--relay-insecure");
  if (a.until >= 0) argv.insert(argv.end(), {"--until", std::to_string(a.until)});
  argv.push_back(a.dir + "/target-" + id);
  return argv;
}

// The tree's child processes.
struct Children {
  std::vector<Child> children;

  bool Start(Child c, const std::vector<std::string>& argv) {
    auto pid = Spawn(argv, c.log);
    if (!pid.ok()) {
      Fail("relay tree", pid.status());
      return false;
    }
    c.pid = *pid;
    fmt::print("dcr relay tree: started {} (pid {}, log {})\n", c.name, c.pid, c.log);
    children.push_back(std::move(c));
    return true;
  }

  // SIGTERM to each, SIGKILL to those still there after 5 s.
  void StopAll(const std::string& why) {
    for (auto& c : children)
      if (!c.exited) ::kill(c.pid, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (auto& c : children) {
      while (!c.exited) {
        const pid_t r = ::waitpid(c.pid, &c.status, WNOHANG);
        if (r == c.pid || r < 0) {
          c.exited = true;
          break;
        }
        if (std::chrono::steady_clock::now() > deadline) ::kill(c.pid, SIGKILL);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    fmt::print("dcr relay tree: stopped {} processes ({})\n", children.size(), why);
  }

  // Until a signal, or (with --until) every receiver's exit; a relay that
  // exits is reported and left down (its children re-attach upstream).
  // Returns how many exited with a failure.
  int Watch(const TreeArgs& a) {
    int failed = 0;
    for (;;) {
      if (g_tree_stop) {
        StopAll("signal");
        return failed;
      }
      bool receivers_left = false;
      for (auto& c : children) {
        if (!c.exited && ::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
          c.exited = true;
          if (!(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0)) ++failed;
          fmt::print("dcr relay tree: {} exited ({}); log {}\n", c.name,
                     WIFEXITED(c.status) ? fmt::format("status {}", WEXITSTATUS(c.status))
                                         : fmt::format("signal {}", WTERMSIG(c.status)),
                     c.log);
          std::fflush(stdout);
        }
        if (c.receiver && !c.exited) receivers_left = true;
      }
      if (a.until >= 0 && a.receivers > 0 && !receivers_left) {
        StopAll(fmt::format("every receiver reached version {}", a.until));
        return failed;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
};

int RunTree(const TreeArgs& a) {
  auto checked = CheckTree(a);
  if (!checked.ok()) return Fail("relay tree", checked.status());
  const nlohmann::json& plan = *checked;
  std::error_code ec;
  std::filesystem::create_directories(a.dir + "/logs", ec);
  if (ec) return Fail("relay tree", InvalidArgument(fmt::format("cannot create {}/logs: {}", a.dir, ec.message())));
  Children tree;
  std::vector<const nlohmann::json*> relays;
  for (const auto& n : plan["relays"]) {
    relays.push_back(&n);
    const std::string id = n["id"];
    if (!tree.Start({"relay " + id, a.dir + "/logs/relay-" + id + ".log"}, RelayArgv(a, n))) {
      tree.StopAll("a start failed");
      return kExitError;
    }
  }
  for (uint32_t i = 0; i < a.receivers; ++i) {
    const auto& n = *relays[i % relays.size()];
    const std::string id = fmt::format("{}{}", a.receiver_prefix, i);
    Child c{"receiver " + id + " under relay " + n["id"].get<std::string>(), a.dir + "/logs/follow-" + id + ".log"};
    c.receiver = true;
    if (!tree.Start(std::move(c), ReceiverArgv(a, n, id))) {
      tree.StopAll("a start failed");
      return kExitError;
    }
  }
  std::string publish_flags;
  for (const auto& r : plan["roots"])
    for (const auto* n : relays)
      if ((*n)["id"] == r) publish_flags += " --relay " + (*n)["address"].get<std::string>();
  fmt::print("dcr relay tree: {} relays, {} receivers; publish into the roots with dcr publish{}\n", relays.size(),
             a.receivers, publish_flags);
  std::fflush(stdout);
  std::signal(SIGINT, OnTreeSignal);
  std::signal(SIGTERM, OnTreeSignal);
  const int failed = tree.Watch(a);
  if (a.until >= 0 && failed) {
    Fail("relay tree", Aborted(fmt::format("{} processes failed; see their logs under {}/logs", failed, a.dir)));
    return kExitError;
  }
  return kExitOk;
}

}  // namespace

void AddRelayTreeCommand(CLI::App* relay) {
  auto* tree = relay->add_subcommand(
      "tree",
      "Run a whole local tree for tests and demos: every relay of a plan and N receivers, as child processes "
      "stopped on exit or Ctrl-C");
  auto a = std::make_shared<TreeArgs>();
  tree->add_option("--plan", a->plan, "Plan JSON (dcr relay plan --relays FILE)")->required();
  tree->add_option("--dir", a->dir, "Directory for logs/, stats-<relay>.json and the receivers' target-<id>/")
      ->required();
  tree->add_option("--store", a->store,
                   "Store URL the receivers follow; the relays check objects' signatures against it");
  tree->add_option("--receivers", a->receivers, "Receivers to run, spread over the relays in plan order");
  tree->add_option("--receiver-prefix", a->receiver_prefix, "Receiver ids: PREFIX0, PREFIX1, ...");
  tree->add_option("--until", a->until, "Receivers exit once they hold this version; then the tree stops");
  tree->add_option("--key", a->key, "The relays' CURVE key pair file (dcr relay keygen)");
  tree->add_option("--allow", a->allow, "The relays' allow list");
  tree->add_option("--relay-pub", a->relay_pub, "The relays' public key file (relays and receivers)");
  tree->add_option("--relay-key", a->relay_key, "The receivers' CURVE key pair file");
  tree->add_flag("--insecure", a->insecure, "No keys: relays and receivers on plain TCP (trusted networks only)");
  tree->add_option("--ping", a->ping, "Seconds between pings (relays)");
  tree->add_option("--dead-after", a->dead_after, "Seconds of silence before a parent is left (relays, receivers)");
  tree->add_option("--relay-arg", a->relay_args,
                   "An extra argument for every relay (repeat), e.g. --relay-arg=--spool=DIR")
      ->allow_extra_args(false);
  tree->callback([a] { ExitCode() = RunTree(*a); });
}

}  // namespace dcr::cli
