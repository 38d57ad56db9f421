// The relay, its receivers and senders in one process over loopback TCP.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "dcr/relay.h"
#include "test_frames.h"

namespace dcr {
namespace {

using namespace relay_testing;
using namespace std::chrono_literals;

std::string FreeAddress() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return "tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

// Collects log lines (thread-safe).
struct Lines {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> Sink() {
    return [this](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back(l);
    };
  }
  bool Has(std::string_view s) {
    std::lock_guard lock(mu);
    for (const auto& l : lines)
      if (l.find(s) != std::string::npos) return true;
    return false;
  }
};

class RunningRelay {
 public:
  explicit RunningRelay(RelayOptions o) : o_(std::move(o)) {
    o_.log = lines.Sink();
    thread_ = std::thread([this] { status_ = RunRelay(o_, [this] { return stop_.load(); }); });
  }
  ~RunningRelay() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  Status status() const { return status_; }
  Lines lines;

 private:
  RelayOptions o_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  Status status_;
};

RelayOptions Options(std::string id, std::string listen, std::vector<std::string> upstream = {}) {
  RelayOptions o;
  o.id = std::move(id);
  o.listen = std::move(listen);
  o.upstream = std::move(upstream);
  o.ping_every = 50ms;
  o.dead_after = 400ms;
  return o;
}

RelayClientOptions Client(std::string id, std::vector<std::string> addresses, Lines* lines) {
  RelayClientOptions o;
  o.id = std::move(id);
  o.addresses = std::move(addresses);
  o.ping_every = 50ms;
  o.dead_after = 400ms;
  o.log = lines->Sink();
  return o;
}

// How long a test waits for something that must happen before it calls it
// a hang: only a guard, so generous enough for a busy machine.
constexpr std::chrono::milliseconds kGuard = 120s;

// Takes objects under `prefix` until `want` are there or kGuard passes.
std::map<std::string, std::string> TakeAll(RelayReceiver& r, const std::string& prefix, size_t want) {
  std::map<std::string, std::string> got;
  for (auto deadline = std::chrono::steady_clock::now() + kGuard; std::chrono::steady_clock::now() < deadline;) {
    got.merge(r.Take(prefix));
    if (got.size() >= want) break;
    std::this_thread::sleep_for(10ms);
  }
  return got;
}

// Takes objects under `prefix` until `last` is among them (or kGuard
// passes). A sender's objects travel one path in order, so once `last` (sent
// after everything else) is here, anything sent before it that the tree
// forwards is here too: the way to check that something was not forwarded.
std::map<std::string, std::string> TakeThrough(RelayReceiver& r, const std::string& prefix, const std::string& last) {
  std::map<std::string, std::string> got;
  for (auto deadline = std::chrono::steady_clock::now() + kGuard; std::chrono::steady_clock::now() < deadline;) {
    got.merge(r.Take(prefix));
    if (got.count(last)) break;
    std::this_thread::sleep_for(10ms);
  }
  return got;
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds limit = kGuard) {
  for (auto deadline = std::chrono::steady_clock::now() + limit; std::chrono::steady_clock::now() < deadline;) {
    if (cond()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return cond();
}

// A root, a relay below it, a receiver attached to each (near: the root;
// far: the middle relay, then the root), and a sender to the root.
struct DepthTwoTree {
  std::string root_addr = FreeAddress(), mid_addr = FreeAddress();
  RunningRelay root{Options("root", root_addr)};
  RunningRelay mid{Options("mid", mid_addr, {root_addr})};
  Lines log;
  std::unique_ptr<RelayReceiver> near, far;
  std::unique_ptr<RelaySender> sender;
  void Start() {
    auto n = RelayReceiver::Start(Client("near", {root_addr}, &log));
    auto f = RelayReceiver::Start(Client("far", {mid_addr, root_addr}, &log));
    ASSERT_TRUE(n.ok() && f.ok());
    near = std::move(*n);
    far = std::move(*f);
    ASSERT_TRUE(WaitFor([&] { return near->Attached() && far->Attached(); }));
    auto s = RelaySender::Start(Client("pub", {root_addr}, &log));
    ASSERT_TRUE(s.ok());
    sender = std::move(*s);
  }
};

TEST(Relay, ADepthTwoTreeDeliversEveryObjectOnceAndDropsDuplicates) {
  DepthTwoTree tree;
  ASSERT_NO_FATAL_FAILURE(tree.Start());
  RelayReceiver &near = *tree.near, &far = *tree.far;
  RelaySender& sender = *tree.sender;
  std::map<std::string, std::string> sent;
  for (uint32_t s = 0; s < 20; ++s) {
    const std::string key = ObjectKey(1, s), data = MakeFrame(s, static_cast<uint8_t>(s)) + MakeFrame(s + 100, 1);
    sender.Object(key, data);
    sent[key] = data;
  }
  sender.Object(ObjectKey(1, 3), sent[ObjectKey(1, 3)]);  // a second sender's copy
  const std::string last = ObjectKey(1, 20);  // after the copy: once it is here, so would the copy be
  sender.Object(last, sent[last] = MakeFrame(20, 1));
  EXPECT_TRUE(sender.Flush(kGuard));
  EXPECT_EQ(TakeThrough(near, AttemptPrefix(1), last), sent);
  EXPECT_EQ(TakeThrough(far, AttemptPrefix(1), last), sent);
  EXPECT_TRUE(far.Take("").empty()) << "a duplicate was delivered";
  EXPECT_EQ(far.Stats().duplicates, 0u);  // the root dropped it
}

TEST(Relay, ACorruptObjectIsNeverForwarded) {
  const std::string root_addr = FreeAddress(), mid_addr = FreeAddress();
  RelayOptions ro = Options("root", root_addr);
  // The second object is damaged on arrival at the root (called on the relay's thread).
  ro.arrival_fault = [n = 0](const std::string&, std::string& bytes) mutable {
    if (++n == 2 && !bytes.empty()) bytes[bytes.size() / 2] ^= 0x5a;
  };
  RunningRelay root(ro);
  RunningRelay mid(Options("mid", mid_addr, {root_addr}));
  Lines log;
  auto far = RelayReceiver::Start(Client("far", {mid_addr}, &log));
  ASSERT_TRUE(far.ok());
  ASSERT_TRUE(WaitFor([&] { return (*far)->Attached(); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  for (uint32_t s = 0; s < 3; ++s) (*sender)->Object(ObjectKey(1, s), MakeFrame(s, 5));
  // A frame damaged before its envelope CRC was computed: only the frame's own checksum tells.
  std::string bad = MakeFrame(9, 5);
  bad[bad.size() - 10] ^= 0x10;  // in its payload
  (*sender)->Object(ObjectKey(1, 9), bad);
  (*sender)->Object(ObjectKey(1, 10), MakeFrame(10, 5));  // last: once it is here, so would the others be
  EXPECT_TRUE((*sender)->Flush(kGuard));
  auto got = TakeThrough(**far, AttemptPrefix(1), ObjectKey(1, 10));
  got.merge((*far)->Take(""));
  EXPECT_EQ(got.size(), 3u);
  EXPECT_TRUE(got.count(ObjectKey(1, 0)) && got.count(ObjectKey(1, 2)) && got.count(ObjectKey(1, 10)));
  EXPECT_FALSE(got.count(ObjectKey(1, 1)));  // corrupted at the root
  EXPECT_FALSE(got.count(ObjectKey(1, 9)));
  EXPECT_TRUE(WaitFor([&] {
    return root.lines.Has("dropped a corrupt object from sender pub: frame object " + ObjectKey(1, 1) + ": CRC32C");
  }));
  EXPECT_TRUE(WaitFor(
      [&] { return root.lines.Has("frame object " + ObjectKey(1, 9) + ": the frame at offset 0 fails its checks"); }));
  EXPECT_EQ((*far)->Stats().corrupt, 0u);  // nothing damaged reached it
}

// A relay that can check objects (verify_object: the publisher's signature,
// with a store) drops a forged copy sent first and keeps the genuine one
// that follows, which its children then get.
TEST(Relay, AnObjectThatFailsVerificationIsDroppedAndTheGenuineCopyKept) {
  const std::string root_addr = FreeAddress();
  const std::string forged = MakeFrame(7, 9), genuine = MakeFrame(7, 5);
  RelayOptions ro = Options("root", root_addr);
  std::atomic<int> checked{0};
  ro.verify_object = [&](const std::string& key, std::string_view bytes) {
    ++checked;
    return bytes == forged ? DataLoss(key + ": not the publisher's") : Status::Ok();
  };
  RunningRelay root(ro);
  Lines log;
  auto far = RelayReceiver::Start(Client("far", {root_addr}, &log));
  ASSERT_TRUE(far.ok());
  ASSERT_TRUE(WaitFor([&] { return (*far)->Attached(); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 0), forged);  // pushed ahead of the publisher's copy
  (*sender)->Object(ObjectKey(1, 0), genuine);
  (*sender)->Object(ObjectKey(1, 1), genuine);
  EXPECT_TRUE((*sender)->Flush(kGuard));
  auto got = TakeAll(**far, AttemptPrefix(1), 2);
  EXPECT_EQ(got, (std::map<std::string, std::string>{{ObjectKey(1, 0), genuine}, {ObjectKey(1, 1), genuine}}));
  EXPECT_EQ(checked.load(), 3);
  EXPECT_TRUE(WaitFor(
      [&] { return root.lines.Has("refused object " + ObjectKey(1, 0) + " from sender pub (1 refused so far)"); }));
}

// Objects enter the tree at its roots (where --store verifies them): a
// relay with an upstream refuses senders, so it only forwards its upstream's.
TEST(Relay, ARelayWithAnUpstreamRefusesSenders) {
  const std::string root_addr = FreeAddress(), mid_addr = FreeAddress();
  RunningRelay root(Options("root", root_addr));
  RunningRelay mid(Options("mid", mid_addr, {root_addr}));
  Lines log;
  auto far = RelayReceiver::Start(Client("far", {mid_addr}, &log));
  ASSERT_TRUE(far.ok());
  ASSERT_TRUE(WaitFor([&] { return (*far)->Attached(); }));
  auto intruder = RelaySender::Start(Client("intruder", {mid_addr}, &log));
  ASSERT_TRUE(intruder.ok());
  ASSERT_TRUE(WaitFor([&] { return mid.lines.Has("refused HELLO as sender intruder: this relay has an upstream"); }));
  (*intruder)->Object(ObjectKey(1, 0), MakeFrame(0, 9));
  ASSERT_TRUE(WaitFor([&] { return mid.lines.Has("did not say HELLO as a sender sent an object: refused"); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 0), MakeFrame(0, 5));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  EXPECT_EQ(TakeAll(**far, AttemptPrefix(1), 1),
            (std::map<std::string, std::string>{{ObjectKey(1, 0), MakeFrame(0, 5)}}));
  EXPECT_TRUE(root.lines.Has("a root without the run's store keeps the first copy"));
  EXPECT_FALSE(mid.lines.Has("a root without the run's store"));
}

TEST(Relay, AFencedAttemptIsDroppedEverywhere) {
  const std::string root_addr = FreeAddress();
  RunningRelay root(Options("root", root_addr));
  Lines log;
  auto r = RelayReceiver::Start(Client("r", {root_addr}, &log));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(WaitFor([&] { return (*r)->Attached(); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 0, "0000-aaaa"), MakeFrame(0, 1));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  ASSERT_TRUE(WaitFor([&] { return (*r)->Stats().objects == 1; }));
  (*sender)->Fence(AttemptPrefix(1, "0000-aaaa"));
  (*sender)->Object(ObjectKey(1, 1, "0000-aaaa"), MakeFrame(1, 1));  // late, after the fence
  (*sender)->Object(ObjectKey(1, 0, "0001-bbbb"), MakeFrame(0, 2));  // the retry
  EXPECT_TRUE((*sender)->Flush(kGuard));
  // The late object went first: once the retry is here, so would it be.
  auto retry = TakeAll(**r, AttemptPrefix(1, "0001-bbbb"), 1);
  EXPECT_EQ(retry.size(), 1u);
  EXPECT_TRUE((*r)->Take(AttemptPrefix(1, "0000-aaaa")).empty()) << "objects of the fenced attempt were handed out";
  EXPECT_TRUE(WaitFor([&] { return root.lines.Has("fenced"); }));
}

// A sender's notices reach every receiver of a depth-two tree, ahead of
// nothing and kept nowhere, and wake a receiver that waits for news.
TEST(Relay, NoticesReachEveryReceiverAndWakeItsWait) {
  DepthTwoTree tree;
  ASSERT_NO_FATAL_FAILURE(tree.Start());
  RelayReceiver &near = *tree.near, &far = *tree.far;
  RelaySender& sender = *tree.sender;
  // Notices are not kept for children that attach later.
  ASSERT_TRUE(WaitFor([&] { return tree.root.lines.Has("relay mid attached"); }));
  EXPECT_EQ(far.Notices(), 0u);
  const uint64_t seen = far.AwaitNews(0, 0ms);
  std::atomic<uint64_t> woke{seen};
  std::thread waiter([&] { woke = far.AwaitNews(seen, kGuard); });
  sender.Notice(AttemptPrefix(1));
  sender.Notice("commits/v0000000001.json");
  EXPECT_TRUE(sender.Flush(kGuard));
  EXPECT_TRUE(WaitFor([&] { return near.Notices() == 2 && far.Notices() == 2; }))
      << near.Notices() << " and " << far.Notices() << " notices";
  waiter.join();
  EXPECT_GT(woke.load(), seen) << "the wait did not end at the notice";
  EXPECT_TRUE(far.Take("").empty()) << "a notice is no object";
}

TEST(Relay, AReceiverWhoseRelayDiesReattachesUpstreamAndGetsOnlyWhatItLacks) {
  const std::string root_addr = FreeAddress(), mid_addr = FreeAddress();
  RunningRelay root(Options("root", root_addr));
  auto mid = std::make_unique<RunningRelay>(Options("mid", mid_addr, {root_addr}));
  Lines log;
  auto far = RelayReceiver::Start(Client("far", {mid_addr, root_addr}, &log));
  ASSERT_TRUE(far.ok());
  ASSERT_TRUE(WaitFor([&] { return (*far)->Attached(); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  for (uint32_t s = 0; s < 5; ++s) (*sender)->Object(ObjectKey(1, s), MakeFrame(s, 3));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  EXPECT_EQ(TakeAll(**far, AttemptPrefix(1), 5).size(), 5u);
  mid->Stop();
  mid.reset();
  for (uint32_t s = 5; s < 8; ++s) (*sender)->Object(ObjectKey(1, s), MakeFrame(s, 3));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  auto rest = TakeAll(**far, AttemptPrefix(1), 3);
  EXPECT_EQ(rest.size(), 3u);
  EXPECT_TRUE(rest.count(ObjectKey(1, 5)) && rest.count(ObjectKey(1, 7)));
  EXPECT_EQ((*far)->Stats().duplicates, 0u) << "the root re-sent what the receiver had";
  EXPECT_GE((*far)->Stats().reattached, 1u);
  EXPECT_EQ((*far)->Stats().attached, root_addr);
}

// A receiver started and attached to its first address; nullptr when it does not attach within kGuard.
std::unique_ptr<RelayReceiver> AttachedReceiver(std::string id, std::vector<std::string> addresses, Lines* log) {
  auto r = RelayReceiver::Start(Client(std::move(id), std::move(addresses), log));
  if (!r.ok() || !WaitFor([&] { return (*r)->Attached(); })) return nullptr;
  return std::move(*r);
}

AckRecord Ack(std::string receiver, uint64_t lane) {
  AckRecord a;
  a.receiver = std::move(receiver);
  a.digest.lane[0] = lane;
  return a;
}

// Takes the attempt's acks from the sender until `want` receivers' are there or kGuard passes.
std::map<std::string, AckRecord> TakeAcks(RelaySender& s, const std::string& prefix, size_t want) {
  std::map<std::string, AckRecord> got;
  for (auto deadline = std::chrono::steady_clock::now() + kGuard;
       got.size() < want && std::chrono::steady_clock::now() < deadline;)
    for (auto& a : s.TakeAcks(prefix, 50ms)) got[a.receiver] = a;
  return got;
}

TEST(Relay, AcksTravelUpTheTreeToTheSenderOnceEach) {
  const std::string root_addr = FreeAddress(), mid_addr = FreeAddress();
  RunningRelay root(Options("root", root_addr));
  auto mid = std::make_unique<RunningRelay>(Options("mid", mid_addr, {root_addr}));
  Lines log;
  auto near = RelayReceiver::Start(Client("near", {root_addr}, &log));
  auto far = RelayReceiver::Start(Client("far", {mid_addr, root_addr}, &log));
  auto far2 = RelayReceiver::Start(Client("far2", {mid_addr, root_addr}, &log));
  ASSERT_TRUE(near.ok() && far.ok() && far2.ok());
  ASSERT_TRUE(WaitFor([&] { return (*near)->Attached() && (*far)->Attached() && (*far2)->Attached(); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 0), MakeFrame(0, 1));  // says HELLO to the root
  EXPECT_TRUE((*sender)->Flush(kGuard));
  ASSERT_TRUE(WaitFor([&] { return root.lines.Has("sender pub attached"); }));
  EXPECT_TRUE((*sender)->CarriesAcks());
  AckRecord failed = Ack("far2", 0);
  failed.ok = false;
  failed.error = "cannot apply: base digest mismatch";
  (*near)->Ack(AttemptPrefix(1), Ack("near", 5));
  (*far)->Ack(AttemptPrefix(1), Ack("far", 6));
  (*far2)->Ack(AttemptPrefix(1), failed);
  auto got = TakeAcks(**sender, AttemptPrefix(1), 3);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got["near"].digest.lane[0], 5u);
  EXPECT_EQ(got["far"].digest.lane[0], 6u);
  EXPECT_FALSE(got["far2"].ok);
  EXPECT_EQ(got["far2"].error, failed.error);
  EXPECT_TRUE(WaitFor([&] { return mid.get()->lines.Has("receiver far2 (via receiver far2) failed attempt"); }));
  EXPECT_TRUE((*sender)->TakeAcks(AttemptPrefix(2), 0ms).empty());

  // The middle relay dies: its receivers re-attach to the root and send
  // their acks again; the sender hands out none twice, and a new one arrives.
  mid->Stop();
  mid.reset();
  ASSERT_TRUE(WaitFor([&] { return (*far)->Stats().attached == root_addr && (*far)->Attached(); }));
  (*far)->Ack(AttemptPrefix(2), Ack("far", 7));
  auto second = TakeAcks(**sender, AttemptPrefix(2), 1);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second["far"].digest.lane[0], 7u);
  // The acks sent again go right after far's HELLO, before it is attached:
  // once the new one is here, they are too.
  EXPECT_TRUE((*sender)->TakeAcks(AttemptPrefix(1), 0ms).empty()) << "a re-sent ack was handed out twice";
  EXPECT_GE((*far)->Stats().acks, 3u);  // 1, then 1 and 2 again after re-attaching (or 2 once)
}

TEST(Relay, ARestartedRelayIsRejoinedByItsReceiver) {
  const std::string root_addr = FreeAddress(), mid_addr = FreeAddress();
  RunningRelay root(Options("root", root_addr));
  auto mid = std::make_unique<RunningRelay>(Options("mid", mid_addr, {root_addr}));
  Lines log;
  auto far = AttachedReceiver("far", {mid_addr, root_addr}, &log);
  ASSERT_TRUE(far);
  mid->Stop();
  mid.reset();
  ASSERT_TRUE(WaitFor([&] { return far->Stats().attached == root_addr && far->Attached(); }));
  mid = std::make_unique<RunningRelay>(Options("mid", mid_addr, {root_addr}));
  ASSERT_TRUE(WaitFor([&] { return far->Stats().attached == mid_addr && far->Attached(); }));
  EXPECT_TRUE(WaitFor([&] { return log.Has("relay " + mid_addr + " is back; attaching to it again"); }));
  auto sender = RelaySender::Start(Client("pub", {root_addr}, &log));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 0), MakeFrame(0, 8));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  EXPECT_EQ(TakeAll(*far, AttemptPrefix(1), 1).size(), 1u);
  EXPECT_TRUE(WaitFor([&] { return mid->lines.Has("receiver far attached"); }));
}

// A throttled child (its link paced to 100 kB/s) behind a cache of two
// objects: what leaves the cache before it was sent goes to the spool and
// arrives from there; with a spool too small, it is dropped (the store's job).
TEST(Relay, ASlowChildsBacklogGoesToTheSpoolNotTheStore) {
  for (const bool big_spool : {true, false}) {
    SCOPED_TRACE(big_spool ? "a spool for everything" : "a spool for two objects");
    const std::string addr = FreeAddress();
    const std::string spool = ::testing::TempDir() + "/dcr-relay-spool-" + std::to_string(big_spool);
    RelayOptions ro = Options("root", addr);
    const std::string sample = MakeFrame(0, 1) + MakeFrame(1, 1);
    ro.cache_bytes = 2 * sample.size();
    ro.window_bytes = sample.size();
    ro.link_bytes_per_second = 100e3;
    ro.spool_dir = spool;
    ro.spool_bytes = big_spool ? 1 << 20 : 2 * sample.size();
    ro.stats_path = spool + ".stats.json";
    RunningRelay root(ro);
    Lines log;
    auto r = AttachedReceiver("slow", {addr}, &log);
    ASSERT_TRUE(r);
    auto sender = RelaySender::Start(Client("pub", {addr}, &log));
    ASSERT_TRUE(sender.ok());
    std::map<std::string, std::string> sent;
    for (uint32_t s = 0; s < 12; ++s) {
      const std::string data = MakeFrame(s, 2) + MakeFrame(s + 50, static_cast<uint8_t>(s));
      (*sender)->Object(ObjectKey(1, s), data);
      sent[ObjectKey(1, s)] = data;
    }
    EXPECT_TRUE((*sender)->Flush(kGuard));
    auto got = TakeAll(*r, AttemptPrefix(1), big_spool ? 12 : 4);
    if (!big_spool) {
      EXPECT_TRUE(WaitFor([&] { return root.lines.Has("left the cache before it was sent and the spool is full"); }));
    }
    root.Stop();
    got.merge(r->Take(""));  // all the root delivered before it stopped
    if (big_spool) {
      EXPECT_EQ(got, sent);
      EXPECT_FALSE(root.lines.Has("too slow"));
    } else {
      EXPECT_LT(got.size(), sent.size());
      EXPECT_GE(got.size(), 4u);  // the cache's two and the spool's two at least
      for (const auto& [k, v] : got) EXPECT_EQ(v, sent.at(k)) << k;
    }
    std::ifstream stats_file(ro.stats_path);
    const auto stats = nlohmann::json::parse(stats_file, nullptr, false);
    ASSERT_TRUE(stats.is_object());
    if (big_spool) {
      EXPECT_GE(stats["spooled"].get<uint64_t>(), 8u);  // 12 objects, a cache of 2 and a window of 1
      EXPECT_EQ(stats["unspooled"], stats["spooled"]);
      EXPECT_EQ(stats["spool_full"], 0);
    } else {
      EXPECT_GT(stats["spool_full"].get<uint64_t>(), 0u);
    }
    EXPECT_EQ(stats["spool_bytes_in_use"], 0);
    std::error_code ec;
    size_t left = 0;
    for (const auto& e : std::filesystem::directory_iterator(spool, ec)) left += e.path().extension() == ".spool";
    EXPECT_EQ(left, 0u) << "spool files outlived the objects";
  }
}

TEST(Relay, CurveAdmitsListedPeersAndRefusesOthers) {
  auto relay_keys = GenerateCurveKeyPair(), good = GenerateCurveKeyPair(), stranger = GenerateCurveKeyPair();
  ASSERT_TRUE(relay_keys.ok() && good.ok() && stranger.ok());
  const std::string addr = FreeAddress();
  RelayOptions ro = Options("root", addr);
  ro.security.own = *relay_keys;
  ro.security.allowed = {{good->public_key, kAnyRelayRole}};
  RunningRelay root(ro);
  Lines log;
  auto make = [&](const std::string& id, std::optional<CurveKeyPair> keys) {
    RelayClientOptions o = Client(id, {addr}, &log);
    if (keys) {
      o.security.own = keys;
      o.security.server_public = relay_keys->public_key;
    }
    return o;
  };
  auto ok = RelayReceiver::Start(make("ok", *good));
  auto unknown = RelayReceiver::Start(make("unknown", *stranger));
  auto plain = RelayReceiver::Start(make("plain", std::nullopt));
  ASSERT_TRUE(ok.ok() && unknown.ok() && plain.ok());
  RelayClientOptions so = make("pub", *good);
  auto sender = RelaySender::Start(so);
  ASSERT_TRUE(sender.ok());
  ASSERT_TRUE(WaitFor([&] { return (*ok)->Attached(); }));
  (*sender)->Object(ObjectKey(1, 0), MakeFrame(0, 4));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  EXPECT_EQ(TakeAll(**ok, AttemptPrefix(1), 1).size(), 1u);
  // Once the root has refused both, neither can be attached or hold an object.
  EXPECT_TRUE(
      WaitFor([&] { return root.lines.Has("refused peer 127.0.0.1 (CURVE key " + stranger->public_key + ")"); }));
  EXPECT_TRUE(WaitFor([&] { return root.lines.Has("handshake failed"); }));  // the one without keys
  EXPECT_FALSE((*unknown)->Attached());
  EXPECT_FALSE((*plain)->Attached());
  EXPECT_TRUE((*unknown)->Take("").empty());
  EXPECT_TRUE((*plain)->Take("").empty());
}

TEST(Relay, KeyFilesRoundTrip) {
  auto pair = GenerateCurveKeyPair();
  ASSERT_TRUE(pair.ok());
  const std::string stem = ::testing::TempDir() + "/dcr-relay-key-test";
  ASSERT_TRUE(WriteCurveKeyFiles(stem, *pair).ok());
  auto back = ReadCurveKeyPair(stem + ".key");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->secret_key, pair->secret_key);
  EXPECT_EQ(*ReadCurvePublicKey(stem + ".pub"), pair->public_key);
  EXPECT_EQ(*ReadCurvePublicKey(stem + ".key"), pair->public_key);
  auto allow = ReadCurveAllowList(stem + ".pub");
  ASSERT_TRUE(allow.ok());
  EXPECT_EQ(allow->count(pair->public_key), 1u);
  EXPECT_FALSE(ReadCurveKeyPair(stem + ".pub").ok());
  // '#' is a Z85 character: only a line starting with it is a comment.
  const std::string hashed = "0000#0000#0000#0000#0000#0000#0000#0000#";
  {
    std::FILE* f = std::fopen((stem + ".allow").c_str(), "w");
    std::fprintf(f, "# peers\n\n  %s  \n%s\n", hashed.c_str(), pair->public_key.c_str());
    std::fclose(f);
  }
  auto two = ReadCurveAllowList(stem + ".allow");
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(*two, (std::map<std::string, RelayRoles>{{hashed, kAnyRelayRole}, {pair->public_key, kAnyRelayRole}}));
  EXPECT_EQ(ReadCurveKeyPair(stem + ".missing").status().code(), Code::kNotFound);
  // Roles: a key on several lines takes each; an unknown role is refused.
  {
    std::FILE* f = std::fopen((stem + ".roles").c_str(), "w");
    std::fprintf(f, "sender %s\nreceiver\t%s\nrelay %s\n", hashed.c_str(), pair->public_key.c_str(), hashed.c_str());
    std::fclose(f);
  }
  auto roles = ReadCurveAllowList(stem + ".roles");
  ASSERT_TRUE(roles.ok()) << roles.status().ToString();
  EXPECT_EQ(*roles,
            (std::map<std::string, RelayRoles>{{hashed, RoleBit(RelayRole::kSender) | RoleBit(RelayRole::kRelay)},
                                               {pair->public_key, RoleBit(RelayRole::kReceiver)}}));
  EXPECT_EQ(RelayRolesName(roles->at(hashed)), "sender, relay");
  {
    std::FILE* f = std::fopen((stem + ".badrole").c_str(), "w");
    std::fprintf(f, "admin %s\n", hashed.c_str());
    std::fclose(f);
  }
  EXPECT_EQ(ReadCurveAllowList(stem + ".badrole").status().code(), Code::kInvalidArgument);
}

// The secret key file is 0600 from its first byte, and one others may read
// is refused, as ssh does.
TEST(Relay, SecretKeyFilesAreTheOwnersOnly) {
  auto pair = GenerateCurveKeyPair();
  ASSERT_TRUE(pair.ok());
  const std::string stem = ::testing::TempDir() + "/dcr-relay-key-mode-test";
  std::filesystem::remove(stem + ".key");
  ASSERT_TRUE(WriteCurveKeyFiles(stem, *pair).ok());
  EXPECT_EQ(std::filesystem::status(stem + ".key").permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  ASSERT_TRUE(ReadCurveKeyPair(stem + ".key").ok());
  std::filesystem::permissions(stem + ".key", std::filesystem::perms::group_read, std::filesystem::perm_options::add);
  auto refused = ReadCurveKeyPair(stem + ".key");
  EXPECT_EQ(refused.status().code(), Code::kPermissionDenied) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("chmod 600"), std::string::npos) << refused.status().ToString();
  // Written again over it: 0600 again (the old file's mode does not carry over).
  ASSERT_TRUE(WriteCurveKeyFiles(stem, *pair).ok());
  EXPECT_TRUE(ReadCurveKeyPair(stem + ".key").ok());
}

// Roles are tied to keys: a key admitted as a receiver cannot send objects
// or fences, nor attach as a sender; a child's id stays with its key.
TEST(Relay, RolesAreTiedToKeys) {
  auto relay_keys = GenerateCurveKeyPair(), sender_keys = GenerateCurveKeyPair(),
       receiver_keys = GenerateCurveKeyPair(), other_receiver = GenerateCurveKeyPair();
  ASSERT_TRUE(relay_keys.ok() && sender_keys.ok() && receiver_keys.ok() && other_receiver.ok());
  const std::string addr = FreeAddress();
  RelayOptions ro = Options("root", addr);
  ro.security.own = *relay_keys;
  ro.security.allowed = {{sender_keys->public_key, RoleBit(RelayRole::kSender)},
                         {receiver_keys->public_key, RoleBit(RelayRole::kReceiver)},
                         {other_receiver->public_key, RoleBit(RelayRole::kReceiver)}};
  RunningRelay root(ro);
  Lines log;
  auto make = [&](const std::string& id, const CurveKeyPair& keys) {
    RelayClientOptions o = Client(id, {addr}, &log);
    o.security.own = keys;
    o.security.server_public = relay_keys->public_key;
    return o;
  };
  auto good = RelayReceiver::Start(make("good", *receiver_keys));
  ASSERT_TRUE(good.ok());
  ASSERT_TRUE(WaitFor([&] { return root.lines.Has("receiver good attached"); }));
  // A receiver's key pushing objects and a fence, as a sender would.
  auto impostor = RelaySender::Start(make("impostor", *receiver_keys));
  ASSERT_TRUE(impostor.ok());
  (*impostor)->Object(ObjectKey(1, 0), MakeFrame(0, 4));
  (*impostor)->Fence(AttemptPrefix(2));  // another attempt: a fence drops its own attempt's queued objects
  EXPECT_TRUE(WaitFor([&] {
    return root.lines.Has("refused HELLO as sender impostor (CURVE key " + receiver_keys->public_key +
                          "): the allow list admits that key as receiver");
  }));
  EXPECT_TRUE(WaitFor([&] { return root.lines.Has("did not say HELLO as a sender sent an object: refused"); }));
  EXPECT_TRUE(WaitFor([&] { return root.lines.Has("not an attached sender sent a fence: refused"); }));
  // Another admitted receiver key claiming good's id is refused.
  auto takeover = RelayReceiver::Start(make("good", *other_receiver));
  ASSERT_TRUE(takeover.ok());
  EXPECT_TRUE(WaitFor(
      [&] { return root.lines.Has("refused HELLO as receiver good (CURVE key " + other_receiver->public_key); }));
  // The sender's key: its objects reach good, whose attachment stands.
  auto sender = RelaySender::Start(make("pub", *sender_keys));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 1), MakeFrame(1, 4));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  auto got = TakeAll(**good, AttemptPrefix(1), 1);
  EXPECT_EQ(got.size(), 1u);
  EXPECT_EQ(got.count(ObjectKey(1, 1)), 1u) << "an object of the impostor was delivered";
  EXPECT_FALSE(root.lines.Has("attempt " + AttemptPrefix(2) + " fenced"));
  EXPECT_TRUE((*takeover)->Take("").empty());
}

// What peers make a relay keep is bounded: children beyond max_children
// are refused (and logged), the ones attached keep being served.
TEST(Relay, ChildrenBeyondTheLimitAreRefused) {
  const std::string addr = FreeAddress();
  RelayOptions ro = Options("root", addr);
  ro.max_children = 1;
  RunningRelay root(ro);
  Lines log;
  auto first = RelayReceiver::Start(Client("first", {addr}, &log));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(WaitFor([&] { return root.lines.Has("receiver first attached"); }));
  auto second = RelayReceiver::Start(Client("second", {addr}, &log));
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(WaitFor([&] { return root.lines.Has("refused receiver second: 1 children are attached already"); }));
  auto sender = RelaySender::Start(Client("pub", {addr}, &log));
  ASSERT_TRUE(sender.ok());
  (*sender)->Object(ObjectKey(1, 0), MakeFrame(0, 4));
  EXPECT_TRUE((*sender)->Flush(kGuard));
  EXPECT_EQ(TakeAll(**first, AttemptPrefix(1), 1).size(), 1u);
  EXPECT_FALSE(root.lines.Has("receiver second attached"));
}

TEST(Relay, RefusesBadOptions) {
  EXPECT_EQ(RunRelay(Options("", FreeAddress()), [] { return true; }).code(), Code::kInvalidArgument);
  EXPECT_EQ(RunRelay(Options("r", "nonsense://x"), [] { return true; }).code(), Code::kUnavailable);
  Lines log;
  EXPECT_FALSE(RelayReceiver::Start(Client("r", {}, &log)).ok());
}

}  // namespace
}  // namespace dcr
