// The protocol end to end in one process: a publisher and followers on
// threads over the mem and file stores, with faults injected at the named
// points. Every receiver is compared with the published checkpoint byte for
// byte. (tests/python/test_refit.py runs the same with real processes.)
#include "dcr/publisher.h"
#include "dcr/receiver.h"
#include "dcr/run_keys.h"
#include "dcr/run_records.h"
#include "dcr/run_status.h"
#include "dcr/shard_publisher.h"
#include "dcr/signing.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "dcr/compare.h"
#include "dcr/contribution.h"
#include "dcr/hash.h"
#include "dcr/layout.h"
#include "dcr/layout_apply.h"
#include "dcr/layout_families.h"
#include "dcr/synth.h"
#include "internal.h"
#include "testing/hook_store.h"
#include "testing/temp_dir.h"

namespace dcr {
namespace {

namespace fs = std::filesystem;
using testing::HookStore;

// The manifest at `key`, decoded against the run's tensor table.
Result<DeltaManifest> StoredManifest(Store& store, const std::string& key) {
  DCR_ASSIGN_OR_RETURN(RunState state, ReadRunState(store));
  if (!state.run) return NotFound("no run.json");
  DCR_ASSIGN_OR_RETURN(std::string bytes, store.Get(key));
  return DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
                               protocol_internal::TensorTableOf(*state.run), key);
}

// A rank's buffers held in memory (as a serving process holds its weights),
// zero-filled, and their placement.
struct RankInMemory {
  explicit RankInMemory(const CompiledLayout& layout) : placed{&layout, {}} {
    for (size_t b = 0; b < layout.map().buffers.size(); ++b) memory.emplace_back(layout.BufferBytes(b));
    for (auto& b : memory) placed.buffers.emplace_back(b);
  }
  RankInMemory(const RankInMemory&) = delete;  // placed points into memory
  std::vector<std::vector<uint8_t>> memory;
  PlacedRank placed;
};

class ProtocolTest : public testing::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    GenOptions g;
    g.shape = shape_;
    g.versions = 4;
    g.update = UpdateModel::kTraining;
    g.rate = 0.03;
    g.seed = 11;
    auto r = GenerateVersions(Path("gen"), g);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    store_url_ = "mem://" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto s = OpenStore(store_url_);
    ASSERT_TRUE(s.ok());
    store_ = std::move(*s);
  }
  void TearDown() override {
    ResetMemStore(store_url_.substr(6));
    TempDirTest::TearDown();
  }

  Checkpoint Version(int v) {
    auto c = Checkpoint::Open(Path("gen/v" + std::to_string(v)));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(*c);
  }
  PublishOptions Fast() {
    PublishOptions o;
    o.delta.chunk_elements = 1 << 14;
    o.senders = 3;
    // Generous: no test here waits for these to pass, they only keep a
    // receiver that is slow on a busy machine from being retired or counted
    // dead (a test that needs a receiver retired sets its own ack_timeout,
    // and its receiver is dead, so only the deadline's length is timed).
    o.ack_timeout = kGuard;
    o.heartbeat_timeout = kGuard;
    return o;
  }
  FollowOptions Receiver(const std::string& id) {
    FollowOptions o;
    o.id = id;
    o.poll = std::chrono::milliseconds(5);
    o.heartbeat_every = std::chrono::milliseconds(100);
    o.log = [](const std::string&) {};
    return o;
  }
  void ExpectIdentical(const std::string& target, int v) {
    auto a = Checkpoint::Open(target);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    Checkpoint b = Version(v);
    EXPECT_TRUE(DiffCheckpoints(*a, b).identical()) << target << " differs from v" << v;
    // And the files themselves, byte for byte.
    for (const auto& e : fs::directory_iterator(Path("gen/v" + std::to_string(v)))) {
      if (e.path().extension() != ".safetensors" && e.path().extension() != ".json") continue;
      auto read = [](const fs::path& p) {
        std::ifstream in(p, std::ios::binary);
        return std::string((std::istreambuf_iterator<char>(in)), {});
      };
      EXPECT_TRUE(read(e.path()) == read(fs::path(target) / e.path().filename())) << e.path().filename();
    }
  }
  // How long a test waits for something that must happen before it calls
  // it a hang: only a guard, so generous enough for a busy machine.
  static constexpr std::chrono::milliseconds kGuard{120'000};
  // Whether `cond` became true within kGuard.
  static bool WaitFor(const std::function<bool()>& cond) {
    const auto deadline = std::chrono::steady_clock::now() + kGuard;
    while (std::chrono::steady_clock::now() < deadline) {
      if (cond()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return cond();
  }
  // The first of `lines` that starts with `prefix` (empty if none).
  static std::string FirstLine(const std::vector<std::string>& lines, const std::string& prefix) {
    for (const auto& l : lines)
      if (l.starts_with(prefix)) return l;
    return std::string();
  }
  // Waits until `n` receivers have registered.
  void WaitForReceivers(size_t n) {
    if (!WaitFor([&] {
          auto l = store_->List("receivers/");
          return l.ok() && l->size() >= n;
        }))
      FAIL() << "receivers did not register";
  }

  // Publishes version v with `o` while receiver `fo` (the only one, its
  // target Path(fo.id)) follows to it on a thread, registered before the
  // publish starts; `*followed` is what its Run returned.
  Result<PublishReport> PublishWhileFollowing(const FollowOptions& fo, const PublishOptions& o, int v,
                                              Status* followed) {
    std::thread t([&] {
      Follower f(*store_, Path(fo.id), fo);
      *followed = f.Run(v);
    });
    WaitForReceivers(1);
    auto r = Publisher(*store_, Path("state"), o).Publish(v, Version(v));
    t.join();
    return r;
  }

  // Starts receiver `fo` (its target Path(fo.id)) on a thread, following to
  // `until` through `store` in relay tree `tree` with a backstop of an hour;
  // returns once it has registered. `*followed` is what its Run returned.
  std::thread FollowInTree(Store& store, FrameObjectSource& tree, FollowOptions fo, int until, Status* followed) {
    fo.relay = &tree;
    fo.relay_poll = std::chrono::hours(1);
    std::thread t([this, &store, fo, until, followed] {
      Follower f(store, Path(fo.id), fo);
      *followed = f.Run(until);
    });
    WaitForReceivers(1);
    return t;
  }

  // The maps of the ranks of a vLLM-style tensor-parallel engine of `tp` ranks
  // (experts spread over them with `expert_parallel`).
  std::vector<std::unique_ptr<CompiledLayout>> TpLayouts(uint32_t tp, bool expert_parallel = false) {
    ServingParallel par;
    par.tp = tp;
    par.expert_parallel = expert_parallel;
    std::vector<std::unique_ptr<CompiledLayout>> layouts;
    for (uint32_t r = 0; r < tp; ++r) {
      auto m = VllmLayout(shape_, par, r);
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      auto c = CompiledLayout::Compile(std::move(*m));
      EXPECT_TRUE(c.ok()) << c.status().ToString();
      layouts.push_back(std::make_unique<CompiledLayout>(std::move(*c)));
    }
    return layouts;
  }
  // A dense load of version v through `layout`, buffer by buffer.
  std::vector<std::vector<uint8_t>> DenseRank(const CompiledLayout& layout, int v) {
    std::vector<std::vector<uint8_t>> buffers;
    PlacedRank p{&layout, {}};
    for (size_t b = 0; b < layout.map().buffers.size(); ++b) buffers.emplace_back(layout.BufferBytes(b));
    for (auto& b : buffers) p.buffers.emplace_back(b);
    Checkpoint c = Version(v);
    EXPECT_TRUE(LoadDense(CheckpointBytes(c), p).ok());
    return buffers;
  }

  // The map's tensors (in map order) that attempt `attempt` of version v
  // has a frame for.
  std::vector<std::string> FramedTensors(uint64_t v, const std::string& attempt, const CompiledLayout& layout) {
    auto m = StoredManifest(*store_, run_keys::Manifest(v, attempt));
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    std::set<std::string> framed;
    for (const DeltaFrameEntry& e : m->frames) framed.insert(m->tensors[e.tensor].name);
    std::vector<std::string> out;
    for (const LayoutTensor& t : layout.map().tensors)
      if (framed.count(t.name)) out.push_back(t.name);
    return out;
  }

  void CheckRanksReadOnlyTheirObjects(bool expert_parallel);

  ModelShape shape_ = ShapeForSize(Family::kQwen3Moe, 1 << 20);
  std::string store_url_;
  std::unique_ptr<Store> store_;
};

TEST_F(ProtocolTest, ReceiversFollowEveryVersionBitExactly) {
  Publisher pub(*store_, Path("state"), Fast());
  auto r0 = pub.Publish(0, Version(0));
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  std::vector<std::thread> threads;
  std::vector<Status> results(3);
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      Follower f(*store_, Path("r" + std::to_string(i)), Receiver("r" + std::to_string(i)));
      results[i] = f.Run(3);
    });
  }
  WaitForReceivers(3);
  for (int v = 1; v <= 3; ++v) {
    auto r = pub.Publish(v, Version(v));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->attempts, 1u);
    EXPECT_EQ(r->acked.size(), 3u);
    EXPECT_TRUE(r->retired.empty());
    EXPECT_GT(r->frame_bytes, 0u);
    EXPECT_LT(r->frame_bytes, r->total_bytes / 5);
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].ToString();
    ExpectIdentical(Path("r" + std::to_string(i)), 3);
  }
  // A late joiner catches up from the snapshot and the committed deltas.
  Follower late(*store_, Path("late"), Receiver("late"));
  ASSERT_TRUE(late.Run(3).ok());
  ExpectIdentical(Path("late"), 3);
  // Publishing a committed version again with the same bits is a no-op.
  auto again = pub.Publish(3, Version(3));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->already_committed);
  // ... with other bits it is refused.
  EXPECT_EQ(pub.Publish(3, Version(2)).status().code(), Code::kAlreadyExists);
}

// What the publisher and a receiver hold beside the bits is reported: in the
// publish report and the commit record (the baseline whole; frames in flight
// only the segments being written and closed, not the delta) and in the
// receiver's record (a few objects at a time, and the headers of the frames
// it applied: not the delta), whether it follows the version as it streams
// or catches up after its commit.
TEST_F(ProtocolTest, MemoryHeldByThePublisherAndReceiversIsReported) {
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  const std::string shm = fmt::format("/dev/shm/dcr-protocol-test-{}", ::getpid());
  struct Remove {
    std::string dir;
    ~Remove() { fs::remove_all(dir); }
  } remove{shm};
  // 8 MB: enough frames and objects that a few objects and the headers are
  // a small part of the delta.
  GenOptions g;
  g.shape = ShapeForSize(Family::kQwen3Moe, 8 << 20);
  g.versions = 2;
  g.update = UpdateModel::kTraining;
  g.rate = 0.03;
  g.seed = 12;
  ASSERT_TRUE(GenerateVersions(Path("big"), g).ok());
  auto version = [&](int v) {
    auto c = Checkpoint::Open(Path("big/v" + std::to_string(v)));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(*c);
  };
  auto expect_identical = [&](const std::string& dir) {
    auto c = Checkpoint::Open(dir);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE(DiffCheckpoints(*c, version(1)).identical()) << dir;
  };
  PublishOptions o = Fast();
  o.segment_bytes = 1024;
  ASSERT_TRUE(Publisher(*store_, shm, o).Publish(0, version(0)).ok());
  std::optional<Result<PublishReport>> r;
  Status followed;
  // Receivers that download at most 3 frame objects ahead of what they applied.
  auto fetching_three = [&](const std::string& id) {
    FollowOptions f = Receiver(id);
    f.fetch_ahead = 3;
    return f;
  };
  std::thread follower([&] { followed = Follower(*store_, Path("r"), fetching_three("r")).Run(1); });
  WaitForReceivers(1);
  r = Publisher(*store_, shm, o).Publish(1, version(1));
  follower.join();
  ASSERT_TRUE(r->ok()) << r->status().ToString();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  expect_identical(Path("r"));
  const PublisherMemory& m = (*r)->memory;
  EXPECT_EQ(m.baseline_bytes, version(0).total_bytes());
  EXPECT_TRUE(m.baseline_in_memory) << shm;
  EXPECT_EQ(m.staging_bytes, 0u);
  auto parsed = StoredManifest(*store_, run_keys::Manifest(1, (*r)->attempt));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const DeltaManifest& manifest = *parsed;
  uint64_t chunks = 0, largest_frame = 0;
  for (size_t t = 0; t < manifest.tensors.size(); ++t) chunks += manifest.ChunkCount(t);
  for (const auto& f : manifest.frames) largest_frame = std::max(largest_frame, f.bytes);
  EXPECT_EQ(m.digest_bytes, chunks * sizeof(Digest));
  // A sender's segment is filled to segment_bytes before it is closed; at
  // most 4 wait to be closed while the next is written.
  EXPECT_GE(m.frames_in_flight_bytes, o.segment_bytes);
  EXPECT_LE(m.frames_in_flight_bytes, 5 * (o.segment_bytes + largest_frame + kObjectTrailerBytes));
  ASSERT_GT(manifest.frame_bytes, 4 * m.frames_in_flight_bytes)
      << "too small a delta to tell segments from it; largest frame " << largest_frame;
  auto commit = store_->Get(run_keys::Commit(1));
  ASSERT_TRUE(commit.ok());
  auto record = CommitRecord::FromJson(*commit, "commit");
  ASSERT_TRUE(record.ok()) << record.status().ToString();
  EXPECT_EQ(record->publisher_memory, m);
  // A late receiver: joins from version 0's snapshot and catches up.
  ASSERT_TRUE(Follower(*store_, Path("late"), fetching_three("late")).Run(1).ok());
  expect_identical(Path("late"));
  // Each held at most 3 objects of frames not yet applied, and the headers
  // of those it applied; the delta is several times that.
  const uint64_t bound =
      3 * (o.segment_bytes + largest_frame + kObjectTrailerBytes) + manifest.frames.size() * kMaxFrameHeaderBytes;
  const uint64_t delta = manifest.frame_bytes + manifest.objects.size() * kObjectTrailerBytes;
  ASSERT_GT(delta, 2 * bound) << "too small a delta to tell objects in flight from it";
  auto status = ReadRunStatus(*store_, kGuard);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  ASSERT_EQ(status->receivers.size(), 2u);
  for (const auto& receiver : status->receivers) {
    EXPECT_GT(receiver.record.frames_held_bytes, 0u) << receiver.record.id;
    EXPECT_LE(receiver.record.frames_held_bytes, bound) << receiver.record.id;
    // What it verified: the committed version's digest.
    EXPECT_EQ(receiver.record.verified_digest, record->target_digest) << receiver.record.id;
    EXPECT_GT(receiver.record.verified_at, 0) << receiver.record.id;
  }
}

// What a relay with store access runs: an object is its attempt's
// publisher's only as signed by the key the store records.
TEST_F(ProtocolTest, FrameObjectVerifierAcceptsOnlyThePublishersObjects) {
  PublishOptions o = Fast();
  ASSERT_TRUE(Publisher(*store_, Path("state"), o).Publish(0, Version(0)).ok());
  auto r = Publisher(*store_, Path("state"), o).Publish(1, Version(1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::string prefix = run_keys::Attempt(1, r->attempt);
  auto listing = store_->List(prefix + "frames/");
  ASSERT_TRUE(listing.ok() && !listing->empty());
  FrameObjectVerifier verifier(*store_);
  for (const auto& obj : *listing) {
    auto bytes = store_->Get(obj.key);
    ASSERT_TRUE(bytes.ok());
    EXPECT_TRUE(verifier.Verify(obj.key, *bytes).ok()) << obj.key;
    std::string forged = *bytes;
    forged[forged.size() / 3] ^= 1;
    EXPECT_EQ(verifier.Verify(obj.key, forged).code(), Code::kDataLoss) << obj.key;
    // The publisher's bytes under another object's name.
    EXPECT_FALSE(verifier.Verify(prefix + "frames/s9-0000.bin", *bytes).ok());
  }
  const std::string genuine = *store_->Get(listing->front().key);
  EXPECT_EQ(verifier.Verify(run_keys::Attempt(1, "0009-0123abcd") + "frames/s0-0000.bin", genuine).code(),
            Code::kNotFound);
  for (const char* bad : {"attempts/v1/x/frames/s0-0000.bin", "run.json", "attempts/v0000000001/"})
    EXPECT_EQ(verifier.Verify(bad, genuine).code(), Code::kInvalidArgument) << bad;
}

TEST_F(ProtocolTest, ReceiversDownloadSegmentsWhileTheAttemptStreams) {
  PublishOptions o = Fast();
  o.segment_bytes = 2048;  // many frame objects per sender
  // Per receiver: how often it read each frame object.
  struct Reads {
    std::mutex mu;
    std::map<std::string, int> n;
  };
  std::vector<Reads> reads(2);
  std::vector<std::unique_ptr<HookStore>> views;
  for (int i = 0; i < 2; ++i)
    views.push_back(std::make_unique<HookStore>(*store_, [&, i](std::string_view op, std::string_view key, bool after) {
      if (op == "read" && !after && key.find("/frames/") != std::string_view::npos) {
        std::lock_guard lock(reads[i].mu);
        ++reads[i].n[std::string(key)];
      }
      return Status::Ok();
    }));
  auto frame_objects = [&] {
    std::vector<std::string> keys;
    auto listed = store_->List("attempts/v0000000001/");
    EXPECT_TRUE(listed.ok()) << listed.status().ToString();
    if (listed.ok())
      for (const auto& info : *listed)
        if (info.key.find("/frames/") != std::string::npos) keys.push_back(info.key);
    return keys;
  };
  // Every sender has written its frames, the manifest not yet: the receivers
  // must be able to fetch every frame object already.
  bool prefetched_all = false;
  size_t objects = 0;
  o.fault = [&](std::string_view point) {
    if (point != "frames-written") return Status::Ok();
    const auto keys = frame_objects();
    objects = keys.size();
    prefetched_all = WaitFor([&] {
      bool all = true;
      for (auto& r : reads) {
        std::lock_guard lock(r.mu);
        for (const auto& k : keys) all = all && r.n.count(k) == 1;
      }
      return all;
    });
    return Status::Ok();
  };
  Publisher pub(*store_, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::vector<std::thread> threads;
  std::vector<Status> results(2);
  for (int i = 0; i < 2; ++i)
    threads.emplace_back([&, i] {
      Follower f(*views[i], Path("r" + std::to_string(i)), Receiver("r" + std::to_string(i)));
      results[i] = f.Run(1);
    });
  WaitForReceivers(2);
  auto r = pub.Publish(1, Version(1));
  for (auto& t : threads) t.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT(objects, 2 * size_t{o.senders}) << "segments were not cut";
  EXPECT_TRUE(prefetched_all) << "receivers did not download frame objects before the manifest";
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].ToString();
    ExpectIdentical(Path("r" + std::to_string(i)), 1);
    for (const auto& [key, n] : reads[i].n)
      EXPECT_EQ(n, 1) << "receiver " << i << " read " << key << " " << n << " times";
    EXPECT_EQ(reads[i].n.size(), objects);
  }
}

// A receiver downloads several frame objects at once (fetch_ahead): its
// frame reads wait inside the store until three are there together, which
// one download at a time would never reach (the guard then lets them go).
TEST_F(ProtocolTest, AReceiverDownloadsSeveralFrameObjectsAtOnce) {
  PublishOptions o = Fast();
  o.segment_bytes = 2048;  // many frame objects per sender
  std::mutex mu;
  std::condition_variable cv;
  int inside = 0;
  bool together = false;
  HookStore view(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op != "read" || after || key.find("/frames/") == std::string_view::npos) return Status::Ok();
    std::unique_lock lock(mu);
    ++inside;
    if (inside >= 3) together = true;
    cv.notify_all();
    cv.wait_for(lock, kGuard, [&] { return together; });
    --inside;
    return Status::Ok();
  });
  Publisher pub(*store_, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  Status followed;
  std::thread follower([&] {
    FollowOptions f = Receiver("r");
    f.fetch_ahead = 3;
    followed = Follower(view, Path("r"), f).Run(1);
  });
  WaitForReceivers(1);
  auto r = pub.Publish(1, Version(1));
  follower.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  EXPECT_TRUE(together) << "no three frame objects were downloaded at once";
  ExpectIdentical(Path("r"), 1);
}

// Frames are applied as their objects arrive: while the coordinator is held
// before it writes the manifest, the receivers already hold the new bits. A
// receiver killed between two batches of streamed frames restarts, finds the
// chunks it did in their digests, and applies no frame twice.
TEST_F(ProtocolTest, ReceiversApplyFramesBeforeTheManifestExists) {
  PublishOptions o = Fast();
  o.segment_bytes = 4096;  // many frame objects per sender
  // Whether `dir` holds a checkpoint, and it is (is not) version v.
  auto holds = [&](const std::string& dir, int v, bool is = true) {
    auto c = Checkpoint::Open(dir);
    return c.ok() && DiffCheckpoints(*c, Version(v)).identical() == is;
  };
  // Sender 1 opens its first object once receiver r1 applied some of the
  // other senders' frames (a handshake: r1 reached a batch of streamed
  // frames, so it has joined, and its bits are no longer v0); r1 is killed
  // at its first batch after that, which must come, since it cannot hold
  // version 1 without sender 1's frames and the manifest waits for that.
  std::atomic<int> r1_batches{0};
  std::atomic<bool> r1_started{false};
  HookStore pub_store(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "write" && !after && key.find("/frames/s1-") != std::string_view::npos && !r1_started)
      r1_started = WaitFor([&] { return r1_batches > 0 && holds(Path("r1"), 0, false); });
    return Status::Ok();
  });
  bool before_manifest = false;
  std::string journal_attempt;
  o.fault = [&](std::string_view point) {
    if (point != "frames-written") return Status::Ok();
    before_manifest = WaitFor([&] { return holds(Path("r0"), 1) && holds(Path("r1"), 1); });
    std::ifstream in(fs::path(Path("r0")) / ".dcr-follow.json");
    auto doc = nlohmann::json::parse(in, nullptr, false);
    if (doc.is_object() && doc["attempt"].is_string()) journal_attempt = doc["attempt"].get<std::string>();
    return Status::Ok();
  };
  Publisher pub(pub_store, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::mutex mu;
  std::vector<std::string> lines;
  std::atomic<bool> killed{false};
  Status r0, r1_first, r1_again;
  std::thread t0([&] {
    FollowOptions fo = Receiver("r0");
    fo.log = [&](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back("r0: " + l);
    };
    Follower f(*store_, Path("r0"), fo);
    r0 = f.Run(1);
  });
  std::thread t1([&] {
    FollowOptions fo = Receiver("r1");
    fo.fault = [&](std::string_view point) {
      if (point != "stream-applying") return Status::Ok();
      ++r1_batches;
      return r1_started && !killed.exchange(true) ? Aborted("injected: killed") : Status::Ok();
    };
    fo.log = [&](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back("r1 first life: " + l);
    };
    {
      Follower f(*store_, Path("r1"), fo);
      r1_first = f.Run(1);
    }
    fo.fault = nullptr;
    fo.log = [&](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back("r1: " + l);
    };
    Follower again(*store_, Path("r1"), fo);
    r1_again = again.Run(1);
  });
  WaitForReceivers(2);
  auto r = pub.Publish(1, Version(1));
  t0.join();
  t1.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r1_started) << "r1 applied nothing of sender 0's frames before sender 1's";
  EXPECT_EQ(r1_first.code(), Code::kAborted) << r1_first.ToString() << " " << fmt::format("{}", fmt::join(lines, "\n"));
  EXPECT_TRUE(before_manifest) << "the receivers did not hold version 1 before its manifest was written";
  EXPECT_EQ(journal_attempt, r->attempt) << "the journal did not name the attempt being applied";
  ASSERT_TRUE(r0.ok()) << r0.ToString();
  ASSERT_TRUE(r1_again.ok()) << r1_again.ToString();
  ExpectIdentical(Path("r0"), 1);
  ExpectIdentical(Path("r1"), 1);
  // The restarted r1 found what its first life applied already done.
  std::lock_guard lock(mu);
  auto applied = [&](const std::string& who) { return FirstLine(lines, who + ": applied version 1"); };
  EXPECT_NE(applied("r0").find(" 0 already done, 0 left to the manifest"), std::string::npos) << applied("r0");
  const std::string again = applied("r1");
  EXPECT_EQ(again.find(" 0 already done"), std::string::npos) << again;
  EXPECT_NE(again.find(", 0 left to the manifest"), std::string::npos) << again;
}

TEST_F(ProtocolTest, ASnapshotThatFailedAfterItsCommitIsUploadedByTheNextPublish) {
  PublishOptions o = Fast();
  o.snapshot_every = 2;
  bool failed_once = false;
  HookStore flaky(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "write" && !after && key == "snapshots/v0000000002/snapshot.json" && !failed_once) {
      failed_once = true;
      return Unavailable("injected: the snapshot record is lost");
    }
    return Status::Ok();
  });
  Publisher pub(flaky, Path("state"), o);
  for (int v = 0; v <= 1; ++v) ASSERT_TRUE(pub.Publish(v, Version(v)).ok());
  // v2 commits; its snapshot does not make it.
  EXPECT_FALSE(pub.Publish(2, Version(2)).ok());
  ASSERT_TRUE(failed_once);
  EXPECT_FALSE(store_->Head("snapshots/v0000000002/snapshot.json").ok());
  auto committed = store_->Head("commits/v0000000002.json");
  ASSERT_TRUE(committed.ok()) << committed.status().ToString();
  // The next publish uploads it first, from the baseline at v2.
  auto r3 = pub.Publish(3, Version(3));
  ASSERT_TRUE(r3.ok()) << r3.status().ToString();
  ASSERT_TRUE(store_->Head("snapshots/v0000000002/snapshot.json").ok());
  // A joiner starts from that snapshot and catches up to v3 exactly.
  std::vector<std::string> lines;
  FollowOptions fo = Receiver("late");
  fo.log = [&](const std::string& line) { lines.push_back(line); };
  Follower late(*store_, Path("late"), fo);
  ASSERT_TRUE(late.Run(3).ok());
  ExpectIdentical(Path("late"), 3);
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("snapshot of version 2") != std::string::npos;
  })) << "the joiner did not start from the v2 snapshot";
}

TEST_F(ProtocolTest, CoordinatorFailureBeforeCommitIsRepairedByAnOverwriteRetry) {
  PublishOptions o = Fast();
  std::atomic<int> failures{0};
  o.fault = [&](std::string_view point) {
    if (point == "before-commit" && failures.fetch_add(1) == 0) return Unavailable("injected: coordinator dies");
    return Status::Ok();
  };
  Publisher pub(*store_, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  Status follow;
  std::thread t([&] {
    Follower f(*store_, Path("r"), Receiver("r"));
    follow = f.Run(1);
  });
  WaitForReceivers(1);
  auto r = pub.Publish(1, Version(1));
  t.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->attempts, 2u);
  ASSERT_TRUE(follow.ok()) << follow.ToString();
  ExpectIdentical(Path("r"), 1);
}

TEST_F(ProtocolTest, ReceiverCrashMidApplyRestartsAndIsRepaired) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  // First life: dies right after applying (before acking).
  FollowOptions crash = Receiver("r");
  crash.fault = [](std::string_view point) { return point == "applied" ? Aborted("injected: killed") : Status::Ok(); };
  Status first;
  std::thread t([&] {
    Follower f(*store_, Path("r"), crash);
    first = f.Run(1);
  });
  WaitForReceivers(1);
  PublishOptions o = Fast();
  o.ack_timeout = std::chrono::milliseconds(1500);  // the dead receiver is retired
  Publisher pub2(*store_, Path("state"), o);
  auto r = pub2.Publish(1, Version(1));
  t.join();
  EXPECT_EQ(first.code(), Code::kAborted);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->retired, std::vector<std::string>{"r"});
  // Second life: resumes from its journal and catches up.
  Follower again(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(again.Run(1).ok());
  ExpectIdentical(Path("r"), 1);
}

TEST_F(ProtocolTest, ReceiverWithWrongBitsRejoinsFromTheSnapshot) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  ASSERT_TRUE(pub.Publish(1, Version(1)).ok());
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(1).ok());
  {  // Flip a byte behind dcr's back.
    auto c = Checkpoint::Open(Path("r"), OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok());
    c->MutableData(0)[0] ^= 0x40;
    ASSERT_TRUE(c->Sync().ok());
  }
  ASSERT_TRUE(pub.Publish(2, Version(2)).ok());
  Follower again(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(again.Run(2).ok());
  ExpectIdentical(Path("r"), 2);
}

TEST_F(ProtocolTest, BadInputIsRefusedWithAWayForward) {
  Publisher pub(*store_, Path("state"), Fast());
  // Out of order.
  auto early = pub.Publish(1, Version(1));
  EXPECT_EQ(early.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("version 0 first"), std::string::npos) << early.status().message();
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  EXPECT_EQ(pub.Publish(2, Version(2)).status().code(), Code::kFailedPrecondition);
  // A checkpoint with other tensors.
  GenOptions g;
  g.shape = ShapeForSize(Family::kLlama, 1 << 20);
  g.versions = 1;
  ASSERT_TRUE(GenerateVersions(Path("other"), g).ok());
  auto other = Checkpoint::Open(Path("other/v1"));
  ASSERT_TRUE(other.ok());
  auto wrong = pub.Publish(1, *other);
  EXPECT_EQ(wrong.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("new run"), std::string::npos) << wrong.status().message();
  // A record that does not parse.
  ASSERT_TRUE(store_->Put("commits/v0000000000.json", "{not json").ok());
  auto broken = pub.Publish(1, Version(1));
  EXPECT_EQ(broken.status().code(), Code::kInvalidArgument);
  EXPECT_NE(broken.status().message().find("does not parse"), std::string::npos) << broken.status().message();
  // A receiver of another run.
  ASSERT_TRUE(fs::create_directories(Path("foreign")));
  {
    std::ofstream j(Path("foreign/.dcr-follow.json"));
    j << R"({"run_id": "someone-else", "receiver": "x", "version": 0, "attempt": ""})";
  }
  auto fixed = OpenStore("mem://bad-input-fresh");
  ASSERT_TRUE(fixed.ok());
  Publisher pub2(**fixed, Path("state2"), Fast());
  ASSERT_TRUE(pub2.Publish(0, Version(0)).ok());
  Follower f(**fixed, Path("foreign"), Receiver("x"));
  Status s = f.Run(0);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition);
  EXPECT_NE(s.message().find("empty directory"), std::string::npos) << s.message();
  ResetMemStore("bad-input-fresh");
}

TEST_F(ProtocolTest, TwoCoordinatorsCommitEachVersionOnce) {
  // Two publishers with their own baselines publish the same checkpoints at once.
  Publisher a(*store_, Path("state-a"), Fast());
  ASSERT_TRUE(a.Publish(0, Version(0)).ok());
  fs::copy(Path("state-a"), Path("state-b"), fs::copy_options::recursive);
  Publisher b(*store_, Path("state-b"), Fast());
  Status fa, fb;
  bool a_committed = false, b_committed = false;
  std::string a_attempt, b_attempt;
  std::thread ta([&] {
    auto r = a.Publish(1, Version(1));
    fa = r.status();
    a_committed = r.ok() && !r->already_committed;
    if (r.ok()) a_attempt = r->attempt;
  });
  std::thread tb([&] {
    auto r = b.Publish(1, Version(1));
    fb = r.status();
    b_committed = r.ok() && !r->already_committed;
    if (r.ok()) b_attempt = r->attempt;
  });
  ta.join();
  tb.join();
  ASSERT_TRUE(fa.ok()) << fa.ToString();
  ASSERT_TRUE(fb.ok()) << fb.ToString();
  EXPECT_TRUE(a_committed != b_committed) << "exactly one coordinator commits";
  // Both report the attempt that is committed (the loser too, not its own).
  auto status = ReadRunStatus(*store_, std::chrono::milliseconds(2000));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  ASSERT_EQ(status->versions.size(), 2u);
  ASSERT_TRUE(status->versions[1].commit.has_value());
  EXPECT_EQ(a_attempt, status->versions[1].commit->attempt);
  EXPECT_EQ(b_attempt, status->versions[1].commit->attempt);
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(1).ok());
  ExpectIdentical(Path("r"), 1);
}

// Regression: `dcr status` listed no attempts at all (it looked for the '/'
// after "attempts/v<10 digits>" one byte early).
TEST_F(ProtocolTest, StatusListsTheAttemptsOfEachVersion) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  auto published = pub.Publish(1, Version(1));
  ASSERT_TRUE(published.ok()) << published.status().ToString();
  PublishOptions o = Fast();
  o.max_attempts = 1;
  o.fault = [](std::string_view point) { return point == "manifest-written" ? Aborted("injected") : Status::Ok(); };
  Publisher failing(*store_, Path("state"), o);
  EXPECT_EQ(failing.Publish(2, Version(2)).status().code(), Code::kAborted);
  auto status = ReadRunStatus(*store_, std::chrono::milliseconds(2000));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  ASSERT_EQ(status->versions.size(), 3u);
  const VersionStatus& v1 = status->versions[1];
  ASSERT_EQ(v1.attempts.size(), 1u);
  EXPECT_EQ(v1.attempts[0].state, "committed");
  EXPECT_EQ(v1.attempts[0].id, v1.commit->attempt);
  EXPECT_EQ(v1.attempts[0].mode, "xor");
  EXPECT_GT(v1.attempts[0].frame_bytes, 0u);
  // What a receiver downloads for v1: every object of the attempt but the
  // acks and the publisher's timeline record, and the commit record.
  uint64_t download = 0, manifest = 0;
  const std::string prefix = run_keys::Attempt(1, v1.commit->attempt);
  auto objects = store_->List(prefix);
  ASSERT_TRUE(objects.ok());
  for (const ObjectInfo& obj : *objects) {
    if (obj.key.starts_with(run_keys::Acks(1, v1.commit->attempt)) ||
        obj.key.starts_with(run_keys::Timelines(1, v1.commit->attempt)))
      continue;
    download += obj.size;
    if (obj.key == run_keys::Manifest(1, v1.commit->attempt)) manifest = obj.size;
  }
  auto commit = store_->Get(run_keys::Commit(1));
  ASSERT_TRUE(commit.ok());
  download += commit->size();
  EXPECT_GT(manifest, 0u);
  EXPECT_EQ(v1.attempts[0].manifest_bytes, manifest);
  EXPECT_EQ(v1.attempts[0].download_bytes, download);
  EXPECT_EQ(published->manifest_bytes, manifest);
  EXPECT_EQ(published->download_bytes, download);
  EXPECT_GT(download, v1.attempts[0].frame_bytes + manifest);
  const VersionStatus& v2 = status->versions[2];
  EXPECT_FALSE(v2.committed);
  ASSERT_EQ(v2.attempts.size(), 1u);
  EXPECT_EQ(v2.attempts[0].state, "fenced");
  EXPECT_NE(v2.attempts[0].fence_reason.find("injected"), std::string::npos);
}

// Regression: a commit whose response was lost failed its attempt, which was
// then fenced although committed, and a second attempt waited for acks that
// never came.
TEST_F(ProtocolTest, ALostCommitResponseIsStillThisAttemptsCommit) {
  std::atomic<int> writes{0}, lost{0};
  HookStore hooked(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op != "write" || key != run_keys::Commit(1)) return Status::Ok();
    if (!after) ++writes;
    if (after && lost.fetch_add(1) == 0) return Unavailable("injected: lost response");
    return Status::Ok();
  });
  Publisher pub(hooked, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  auto r = pub.Publish(1, Version(1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(writes.load(), 2) << "the commit is written again (and found present)";
  EXPECT_EQ(r->attempts, 1u);
  EXPECT_FALSE(r->already_committed);
  auto fence = store_->Head(run_keys::Attempt(1, r->attempt) + "fence");
  EXPECT_EQ(fence.status().code(), Code::kNotFound) << "the committed attempt was fenced";
}

// Regression: one failed poll while waiting for acks failed the attempt (and
// re-sent every frame), and a failed GC delete after the commit failed the
// publish of a committed version.
TEST_F(ProtocolTest, StoreFailuresAfterTheFramesDoNotFailTheAttempt) {
  std::atomic<int> list_failures{0};
  HookStore hooked(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (!after && op == "list" && key == "receivers/" && list_failures.fetch_add(1) < 3)
      return Unavailable("injected: list failed");
    if (after && op == "delete") return Unavailable("injected: lost delete response");
    return Status::Ok();
  });
  {
    Publisher pub(*store_, Path("state"), Fast());
    ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  }
  Status follow;
  std::atomic<bool> give_up{false};
  std::thread t([&] {
    Follower f(*store_, Path("r"), Receiver("r"));
    follow = f.Run(2, [&] { return give_up.load(); });
  });
  struct Joiner {  // a failed ASSERT must not leave the follower running
    std::atomic<bool>& stop;
    std::thread& t;
    ~Joiner() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } joiner{give_up, t};
  WaitForReceivers(1);
  PublishOptions o = Fast();
  std::atomic<int> faults{0};
  o.fault = [&](std::string_view point) {  // v2's first attempt fails: GC has one to delete
    return point == "before-commit" && faults.fetch_add(1) == 1 ? Aborted("injected") : Status::Ok();
  };
  Publisher pub(hooked, Path("state"), o);
  auto r1 = pub.Publish(1, Version(1));
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->attempts, 1u);
  EXPECT_EQ(r1->acked, std::vector<std::string>{"r"});
  EXPECT_GE(list_failures.load(), 3);
  auto r2 = pub.Publish(2, Version(2));
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->attempts, 2u);
  t.join();  // it stops by itself at version 2
  ASSERT_TRUE(follow.ok()) << follow.ToString();
  ExpectIdentical(Path("r"), 2);
}

// Regression: a receiver stopped while the store failed exited with an error
// (its last record write failed) although its target was consistent.
TEST_F(ProtocolTest, AReceiverStopsCleanlyWhileTheStoreFails) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::atomic<bool> broken{false};
  HookStore hooked(*store_, [&](std::string_view op, std::string_view key, bool) {
    return broken && op == "write" && key.starts_with("receivers/") ? Unavailable("injected") : Status::Ok();
  });
  Follower f(hooked, Path("r"), Receiver("r"));
  Status s = f.Run(std::nullopt, [&] {
    broken = true;
    return true;
  });
  EXPECT_TRUE(s.ok()) << s.ToString();
  ExpectIdentical(Path("r"), 0);
}

// Regression: a receiver killed while it downloaded a snapshot of several
// files (some in place, no journal yet) refused its own directory on restart;
// and one whose journal names a checkpoint that lost a shard did not rejoin.
TEST_F(ProtocolTest, AReceiverInterruptedWhileJoiningJoinsAgain) {
  GenOptions g;
  g.shape = ShapeForSize(Family::kQwen3Moe, 1 << 20);
  g.versions = 1;
  g.seed = 5;
  g.max_shard_bytes = 300 << 10;
  ASSERT_TRUE(GenerateVersions(Path("sharded"), g).ok());
  auto v0 = Checkpoint::Open(Path("sharded/v0"));
  ASSERT_TRUE(v0.ok());
  std::vector<std::string> shards;
  for (const auto& e : fs::directory_iterator(Path("sharded/v0")))
    if (e.path().extension() == ".safetensors") shards.push_back(e.path().filename().string());
  std::sort(shards.begin(), shards.end());
  ASSERT_GE(shards.size(), 3u);
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, *v0).ok());
  auto expect_v0 = [&](const std::string& dir) {
    auto c = Checkpoint::Open(dir);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE(DiffCheckpoints(*c, *v0).identical());
  };
  // The download dies at the second shard, as a killed receiver would.
  HookStore hooked(*store_, [&](std::string_view op, std::string_view key, bool) {
    return op == "read" && key.ends_with("/" + shards[1]) ? PermissionDenied("injected: killed") : Status::Ok();
  });
  Follower first(hooked, Path("r"), Receiver("r"));
  EXPECT_EQ(first.Run(0).code(), Code::kPermissionDenied);
  ASSERT_TRUE(fs::exists(Path("r/" + shards[0])));
  Follower again(*store_, Path("r"), Receiver("r"));
  Status s = again.Run(0);
  ASSERT_TRUE(s.ok()) << s.ToString();
  expect_v0(Path("r"));
  // A shard lost behind dcr's back: the journal says the directory is ours.
  fs::remove(Path("r/" + shards[2]));
  Follower third(*store_, Path("r"), Receiver("r"));
  s = third.Run(0);
  ASSERT_TRUE(s.ok()) << s.ToString();
  expect_v0(Path("r"));
}

// Regression: a publisher killed while it copied the changed chunks into its
// baseline (after the commit) left a chunk half copied, and every later
// publish failed; it now rebuilds the baseline from the store.
TEST_F(ProtocolTest, APublisherKilledWhileItsBaselineMovedRebuildsIt) {
  {
    Publisher pub(*store_, Path("state"), Fast());
    ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  }
  PublishOptions o = Fast();
  o.fault = [](std::string_view point) { return point == "committed" ? Aborted("injected: killed") : Status::Ok(); };
  Publisher dies(*store_, Path("state"), o);
  EXPECT_EQ(dies.Publish(1, Version(1)).status().code(), Code::kAborted);
  {  // Half of the copy: one changed byte of a chunk, not the next one.
    auto base = Checkpoint::Open(Path("state/baseline"), OpenMode::kReadWrite);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    Checkpoint next = Version(1);
    bool done = false;
    for (size_t t = 0; t < base->tensors().size() && !done; ++t) {
      auto dst = base->MutableData(t);
      auto src = next.Data(static_cast<size_t>(next.Find(base->tensors()[t].name)));
      for (size_t i = 0; i + 1 < dst.size() && !done; ++i) {
        if (dst[i] == src[i]) continue;
        for (size_t j = i + 1; j < std::min(dst.size(), i + 64) && !done; ++j)
          if (dst[j] != src[j]) {
            dst[i] = src[i];
            done = true;
          }
      }
    }
    ASSERT_TRUE(done);
    ASSERT_TRUE(base->Sync().ok());
  }
  Publisher pub(*store_, Path("state"), Fast());
  auto r = pub.Publish(2, Version(2));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(2).ok());
  ExpectIdentical(Path("r"), 2);
  ExpectIdentical(Path("state/baseline"), 2);
}

// The publisher keeps its baseline's chunk digests between publishes
// (state/baseline-digests.json) instead of a digest pass over the baseline;
// a baseline changed behind its back is still caught and rebuilt.
TEST_F(ProtocolTest, APublisherTrustsItsCachedBaselineDigestsOnlyForAnUnchangedBaseline) {
  auto cached_version = [&]() -> int64_t {
    std::ifstream in(Path("state/baseline-digests.json"));
    if (!in) return -1;
    auto doc = nlohmann::json::parse(in, nullptr, false);
    return doc.is_object() && doc["version"].is_number() ? doc["version"].get<int64_t>() : -2;
  };
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  EXPECT_EQ(cached_version(), 0);
  ASSERT_TRUE(pub.Publish(1, Version(1)).ok());
  EXPECT_EQ(cached_version(), 1);
  {
    // It reads back as version 1's chunk digests (the next publish skips the pass).
    auto base = Checkpoint::Open(Path("state/baseline"));
    auto state = ReadRunState(*store_);
    auto commit = protocol_internal::ReadCommit(*store_, 1);
    ASSERT_TRUE(base.ok() && state.ok() && state->run && commit.ok());
    const auto table =
        protocol_internal::ReadDigestCache(Path("state"), 1, *base, protocol_internal::TensorTableOf(*state->run));
    ASSERT_TRUE(table.has_value());
    EXPECT_EQ(protocol_internal::Total(*table), commit->target_digest);
    EXPECT_FALSE(
        protocol_internal::ReadDigestCache(Path("state"), 0, *base, protocol_internal::TensorTableOf(*state->run)));
  }
  // Damage the baseline, with a later modification time than the cache
  // records (set, not waited for: a write within the clock's tick keeps it).
  {
    auto base = Checkpoint::Open(Path("state/baseline"), OpenMode::kReadWrite);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    base->MutableData(0)[0] ^= 0x40;
    ASSERT_TRUE(base->Sync().ok());
  }
  for (const auto& e : std::filesystem::directory_iterator(Path("state/baseline")))
    std::filesystem::last_write_time(e.path(), std::filesystem::last_write_time(e.path()) + std::chrono::seconds(2));
  auto r = pub.Publish(2, Version(2));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(cached_version(), 2);
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(2).ok());
  ExpectIdentical(Path("r"), 2);
  ExpectIdentical(Path("state/baseline"), 2);
  // A cache that does not parse, or names another version, is ignored.
  { std::ofstream(Path("state/baseline-digests.json")) << "{not json"; }
  ASSERT_TRUE(pub.Publish(3, Version(3)).ok());
  EXPECT_EQ(cached_version(), 3);
  ASSERT_TRUE(f.Run(3).ok());
  ExpectIdentical(Path("r"), 3);
}

TEST(DefaultPublisherStateDirTest, IsInMemoryPerStoreWithinAFileName) {
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  const char* set = std::getenv("DCR_STATE_DIR");
  const std::string saved = set ? set : "";
  ::unsetenv("DCR_STATE_DIR");
  auto plain = DefaultPublisherStateDir("file:///tmp/run-1");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(*plain, fmt::format("/dev/shm/dcr-{}/publish/file____tmp_run_1", ::geteuid()));
  // Long URLs (S3 with options) keep a prefix and a hash: distinct, and a valid file name.
  const std::string a = "s3://bucket/" + std::string(300, 'p') + "?region=a",
                    b = "s3://bucket/" + std::string(300, 'p') + "?region=b";
  auto da = DefaultPublisherStateDir(a), db = DefaultPublisherStateDir(b);
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_NE(*da, *db);
  EXPECT_LE(fs::path(*da).filename().string().size(), 128u) << *da;
  ::setenv("DCR_STATE_DIR", "/elsewhere/state", 1);
  EXPECT_EQ(*DefaultPublisherStateDir(a), "/elsewhere/state");
  if (set) ::setenv("DCR_STATE_DIR", saved.c_str(), 1);
  else ::unsetenv("DCR_STATE_DIR");
}

// The state directory is a cache of the store: a publisher without one (a
// new machine; a reboot emptied /dev/shm), with another run's baseline, or
// with a record that does not parse rebuilds its baseline from the store.
// One publisher at a time holds a state directory.
TEST_F(ProtocolTest, APublisherRebuildsAMissingForeignOrDamagedStateFromTheStore) {
  ASSERT_TRUE(Publisher(*store_, Path("state"), Fast()).Publish(0, Version(0)).ok());
  ASSERT_TRUE(Publisher(*store_, Path("state"), Fast()).Publish(1, Version(1)).ok());
  auto fresh = Publisher(*store_, Path("fresh"), Fast()).Publish(2, Version(2));
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(fresh->state_dir, Path("fresh"));
  ExpectIdentical(Path("fresh/baseline"), 2);
  // "state" now holds version 0 of another run.
  auto other = OpenStore("mem://rebuild-other-run");
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(Publisher(**other, Path("state"), Fast()).Publish(0, Version(0)).ok());
  ResetMemStore("rebuild-other-run");
  auto foreign = Publisher(*store_, Path("state"), Fast()).Publish(3, Version(3));
  ASSERT_TRUE(foreign.ok()) << foreign.status().ToString();
  ExpectIdentical(Path("state/baseline"), 3);
  { std::ofstream(Path("fresh/publisher.json")) << "{not json"; }
  auto damaged = Publisher(*store_, Path("fresh"), Fast()).Publish(4, Version(4));
  ASSERT_TRUE(damaged.ok()) << damaged.status().ToString();
  ExpectIdentical(Path("fresh/baseline"), 4);
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(4).ok());
  ExpectIdentical(Path("r"), 4);

  // A state directory another process holds (its lock) is refused, and
  // nothing is published; once it is released, the publish goes on (version
  // 5 has the bits of version 4: a step that changed nothing).
  const Checkpoint v5 = Version(4);
  const int held = ::open(Path("state/lock").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  auto refused = Publisher(*store_, Path("state"), Fast()).Publish(5, v5);
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("in use by another publisher"), std::string::npos)
      << refused.status().message();
  auto status = ReadRunStatus(*store_, std::chrono::milliseconds(2000));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->versions.size(), 5u) << "nothing of version 5 was written";
  ::close(held);
  auto after = Publisher(*store_, Path("state"), Fast()).Publish(5, v5);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
}

}  // namespace
}  // namespace dcr

namespace dcr {
namespace {

double UnixNowForTest() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The coordinator's rule for engines of several ranks, with the ranks played
// by the test: an engine is acked once all its ranks acked with partial
// digests adding up to the target; a sum that does not fails the attempt,
// and the overwrite retry commits once the partials add up.
TEST_F(ProtocolTest, AnEngineIsAckedWhenItsRanksPartialDigestsAddUpToTheTarget) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::atomic<bool> done{false};
  std::thread beats([&] {
    while (!done) {
      for (uint32_t r = 0; r < 2; ++r) {
        ReceiverRecord rec{fmt::format("e-r{}", r), "following", 0, UnixNowForTest(), EngineRank{"e", r, 2}};
        store_->Put(run_keys::Receiver(rec.id), rec.ToJson()).IgnoreError();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  WaitForReceivers(2);
  std::thread ranks([&] {
    std::set<std::string> answered;
    while (!done) {
      auto objects = store_->List(run_keys::Attempts(1));
      if (objects.ok())
        for (const ObjectInfo& o : *objects) {
          if (!o.key.ends_with("/manifest.bin") || answered.count(o.key)) continue;
          auto m = StoredManifest(*store_, o.key);
          ASSERT_TRUE(m.ok()) << m.status().ToString();
          const std::string prefix = o.key.substr(0, o.key.size() - std::string("manifest.bin").size());
          // The first attempt's partials are off by one; the retry's add up.
          Digest part;
          part.lane[0] = 12345;
          part.lane[1] = 678;
          Digest rest = m->target_digest - part;
          if (answered.empty()) rest.lane[0] = (rest.lane[0] + 1) % kDigestPrime;
          for (uint32_t r = 0; r < 2; ++r) {
            AckRecord ack;
            ack.receiver = fmt::format("e-r{}", r);
            ack.digest = r == 0 ? part : rest;
            ack.engine = EngineRank{"e", r, 2};
            ASSERT_TRUE(store_->Put(prefix + "acks/" + ack.receiver + ".json", ack.ToJson()).ok());
          }
          answered.insert(o.key);
        }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  auto r = pub.Publish(1, Version(1));
  done = true;
  beats.join();
  ranks.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->attempts, 2u);
  EXPECT_EQ(r->acked, (std::vector<std::string>{"e-r0", "e-r1"}));
  // The ack records round-trip their engine member; a bad one is refused.
  AckRecord a;
  a.receiver = "x";
  a.engine = EngineRank{"e", 1, 2};
  auto back = AckRecord::FromJson(a.ToJson(), "ack");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->engine, a.engine);
  std::string bad = a.ToJson();
  bad.replace(bad.find("\"rank\": 1"), 9, "\"rank\": 2");
  EXPECT_EQ(AckRecord::FromJson(bad, "ack").status().code(), Code::kInvalidArgument);
}

// The ranks of an engine over buffers in memory (a serving process's live
// weights): two vLLM-style tensor-parallel ranks follow versions into their
// buffers, each equal to a dense load of the version through its map. Then
// both restart with their journals: rank 0 with its buffers intact continues
// without a join, rank 1 with zeroed buffers rejoins from the snapshot.
TEST_F(ProtocolTest, RanksOverBuffersInMemoryFollowAndRestartFromTheirJournals) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  auto layouts = TpLayouts(2);
  std::vector<std::vector<std::vector<uint8_t>>> memory(2), dense(2);
  for (uint32_t r = 0; r < 2; ++r) {
    for (size_t b = 0; b < layouts[r]->map().buffers.size(); ++b) {
      memory[r].emplace_back(layouts[r]->BufferBytes(b));
      dense[r].emplace_back(layouts[r]->BufferBytes(b));
    }
  }
  auto placed = [&](std::vector<std::vector<uint8_t>>& buffers, uint32_t r) {
    PlacedRank p{layouts[r].get(), {}};
    for (auto& b : buffers) p.buffers.emplace_back(b);
    return p;
  };
  auto expect_dense = [&](int v) {
    Checkpoint c = Version(v);
    for (uint32_t r = 0; r < 2; ++r) {
      PlacedRank want = placed(dense[r], r);
      ASSERT_TRUE(LoadDense(CheckpointBytes(c), want).ok());
      for (size_t b = 0; b < memory[r].size(); ++b)
        EXPECT_TRUE(memory[r][b] == dense[r][b]) << "version " << v << ": rank " << r << " buffer "
                                                 << layouts[r]->map().buffers[b].id << " differs from a dense load";
    }
  };
  std::mutex mu;
  std::vector<std::string> lines[2];
  auto follow_all = [&](uint64_t until, int publish_from) {
    std::vector<std::thread> threads;
    std::vector<Status> results(2);
    for (uint32_t r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        FollowOptions o = Receiver(fmt::format("e-r{}", r));
        o.log = [&, r](const std::string& l) {
          std::lock_guard<std::mutex> lock(mu);
          lines[r].push_back(l);
        };
        RankFollower f(*store_, placed(memory[r], r), Path(fmt::format("rank{}", r)), EngineRank{"e", r, 2}, o);
        results[r] = f.Run(until);
      });
    WaitForReceivers(2);
    for (uint64_t v = publish_from; v <= until; ++v) {
      auto p = pub.Publish(v, Version(static_cast<int>(v)));
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      EXPECT_EQ(p->acked, (std::vector<std::string>{"e-r0", "e-r1"}));
    }
    for (auto& t : threads) t.join();
    for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(results[r].ok()) << results[r].ToString();
  };
  follow_all(2, 1);
  expect_dense(2);
  for (auto& l : lines) l.clear();
  for (auto& b : memory[1]) std::fill(b.begin(), b.end(), 0);
  follow_all(3, 3);
  expect_dense(3);
  auto joined = [&](uint32_t r) {
    return std::any_of(lines[r].begin(), lines[r].end(),
                       [](const std::string& l) { return l.starts_with("joining from the snapshot"); });
  };
  EXPECT_FALSE(joined(0));
  EXPECT_TRUE(joined(1));
  // Buffers that do not fit the map are refused, naming the buffer.
  memory[0][0].pop_back();
  RankFollower bad(*store_, placed(memory[0], 0), Path("rank0"), EngineRank{"e", 0, 2}, Receiver("e-r0"));
  Status s = bad.Run(3);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(layouts[0]->map().buffers[0].id), std::string::npos) << s.ToString();
}

// Rank followers apply frames as their objects arrive, like followers:
// while the coordinator is held before it writes the manifest, both ranks of
// a tensor-parallel engine already hold their share of the new bits. A rank
// killed between two batches restarts, finds the chunks it did in its frame
// log, and applies no frame twice (the first attempt commits).
TEST_F(ProtocolTest, RanksApplyFramesBeforeTheManifestExists) {
  PublishOptions o = Fast();
  o.segment_bytes = 4096;  // many frame objects per sender
  auto layouts = TpLayouts(2);
  std::vector<std::vector<std::vector<uint8_t>>> dense[2];
  for (int v = 0; v < 2; ++v)
    for (uint32_t r = 0; r < 2; ++r) dense[v].push_back(DenseRank(*layouts[r], v));
  auto dir = [&](uint32_t r) { return Path(fmt::format("rank{}", r)); };
  // Whether rank r's buffer files hold (do not hold) version v.
  auto holds = [&](uint32_t r, int v, bool is = true) {
    auto f = RankBufferFiles::Open(*layouts[r], dir(r));
    if (!f.ok()) return false;
    PlacedRank p = f->placed();
    bool same = true;
    for (size_t b = 0; b < p.buffers.size(); ++b)
      same = same && std::equal(p.buffers[b].begin(), p.buffers[b].end(), dense[v][r][b].begin());
    return same == is;
  };
  // Sender 1 opens its first object once rank 1 applied some of the other
  // senders' frames (a handshake: rank 1 reached a batch of streamed frames,
  // so it has joined (its record is written while it joins), and its
  // buffers no longer hold v0); rank 1 is killed at its first batch after
  // that, which must come, since it cannot hold version 1 without sender
  // 1's frames and the manifest waits for that.
  std::atomic<int> r1_batches{0};
  std::atomic<bool> r1_started{false};
  HookStore pub_store(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "write" && !after && key.find("/frames/s1-") != std::string_view::npos && !r1_started)
      r1_started = WaitFor([&] { return r1_batches > 0 && holds(1, 0, false); });
    return Status::Ok();
  });
  bool before_manifest = false;
  o.fault = [&](std::string_view point) {
    if (point == "frames-written") before_manifest = WaitFor([&] { return holds(0, 1) && holds(1, 1); });
    return Status::Ok();
  };
  Publisher pub(pub_store, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::mutex mu;
  std::vector<std::string> lines;
  auto log_as = [&](std::string who) {
    return [&, who](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back(who + ": " + l);
    };
  };
  std::atomic<bool> killed{false};
  Status r0, r1_first, r1_again;
  std::thread t0([&] {
    FollowOptions fo = Receiver("e-r0");
    fo.log = log_as("r0");
    RankFollower f(*store_, *layouts[0], dir(0), EngineRank{"e", 0, 2}, fo);
    r0 = f.Run(1);
  });
  std::thread t1([&] {
    FollowOptions fo = Receiver("e-r1");
    fo.fault = [&](std::string_view point) {
      if (point != "stream-applying") return Status::Ok();
      ++r1_batches;
      return r1_started && !killed.exchange(true) ? Aborted("injected: killed") : Status::Ok();
    };
    fo.log = log_as("r1 first life");
    {
      RankFollower f(*store_, *layouts[1], dir(1), EngineRank{"e", 1, 2}, fo);
      r1_first = f.Run(1);
    }
    fo.fault = nullptr;
    fo.log = log_as("r1");
    RankFollower again(*store_, *layouts[1], dir(1), EngineRank{"e", 1, 2}, fo);
    r1_again = again.Run(1);
  });
  WaitForReceivers(2);
  auto r = pub.Publish(1, Version(1));
  t0.join();
  t1.join();
  std::lock_guard lock(mu);
  const std::string all = fmt::format("{}", fmt::join(lines, "\n"));
  ASSERT_TRUE(r.ok()) << r.status().ToString() << "\n" << all;
  EXPECT_EQ(r->attempts, 1u) << all;
  EXPECT_EQ(r->acked, (std::vector<std::string>{"e-r0", "e-r1"}));
  EXPECT_TRUE(r1_started) << "rank 1 applied nothing of sender 0's frames before sender 1's";
  EXPECT_EQ(r1_first.code(), Code::kAborted) << r1_first.ToString() << "\n" << all;
  EXPECT_TRUE(before_manifest) << "the ranks did not hold version 1 before its manifest was written\n" << all;
  ASSERT_TRUE(r0.ok()) << r0.ToString();
  ASSERT_TRUE(r1_again.ok()) << r1_again.ToString();
  EXPECT_TRUE(holds(0, 1)) << "rank 0 differs from a dense load of version 1";
  EXPECT_TRUE(holds(1, 1)) << "rank 1 differs from a dense load of version 1";
  auto applied = [&](const std::string& who) { return FirstLine(lines, who + ": applied version 1"); };
  EXPECT_NE(applied("r0").find(" 0 already done, 0 left to the manifest"), std::string::npos) << applied("r0");
  // The restarted rank 1 found what its first life applied already done.
  const std::string again = applied("r1");
  EXPECT_EQ(again.find(" 0 already done"), std::string::npos) << again << "\n" << all;
  EXPECT_NE(again.find(", 0 left to the manifest"), std::string::npos) << again;
}

// PublishOptions::cancel stops a publish that waits for a silent receiver's
// ack: the attempt is fenced, nothing is committed, no retry is made, and
// the next publish of the version commits once the receiver is gone.
TEST_F(ProtocolTest, ACancelledPublishFencesItsAttemptAndCommitsNothing) {
  PublishOptions o = Fast();
  o.ack_timeout = std::chrono::minutes(10);  // far beyond the bound below: only the cancel ends the wait
  ASSERT_TRUE(Publisher(*store_, Path("state"), o).Publish(0, Version(0)).ok());
  ReceiverRecord rec{"silent", "following", 0, UnixNowForTest(), {}};
  ASSERT_TRUE(store_->Put(run_keys::Receiver(rec.id), rec.ToJson()).ok());
  const auto start = std::chrono::steady_clock::now();
  int polls = 0;
  o.cancel = [&] { return ++polls > 10; };
  auto r = Publisher(*store_, Path("state"), o).Publish(1, Version(1));
  EXPECT_LT(std::chrono::steady_clock::now() - start, o.ack_timeout / 10) << "the publish waited for the ack deadline";
  ASSERT_EQ(r.status().code(), Code::kAborted) << r.status().ToString();
  EXPECT_NE(r.status().message().find("cancelled while waiting for acks"), std::string::npos) << r.status().ToString();
  EXPECT_EQ(store_->Head(run_keys::Commit(1)).status().code(), Code::kNotFound);
  auto objects = store_->List(run_keys::Attempts(1));
  ASSERT_TRUE(objects.ok());
  std::vector<std::string> started, fenced;
  for (const ObjectInfo& i : *objects) {
    if (i.key.ends_with("/attempt.json")) started.push_back(i.key.substr(0, i.key.size() - 12));
    if (i.key.ends_with("/fence")) fenced.push_back(i.key.substr(0, i.key.size() - 5));
  }
  ASSERT_EQ(started.size(), 1u);  // not retried
  EXPECT_EQ(fenced, started);
  rec.state = "stopped";
  ASSERT_TRUE(store_->Put(run_keys::Receiver(rec.id), rec.ToJson()).ok());
  o.cancel = nullptr;
  auto again = Publisher(*store_, Path("state"), o).Publish(1, Version(1));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(started.front().find(again->attempt), std::string::npos) << started.front();
}

}  // namespace
}  // namespace dcr

namespace dcr {
namespace {

// A rank of a sharded engine downloads only the frame objects that may hold
// frames of its chunks (any copy's, replicas too): before the manifest by the
// objects' names (each names its first chunk), after it by its frames. Both
// ranks of a TP=2 engine follow two versions by catching up (commits in)
// and one while it is published (streaming), from a store that records each
// rank's frame-object reads, and end with a dense load's bytes. Each rank
// reads every object holding a frame of its chunks (found here through the
// map's runs, chunk by chunk), not every object, and at most each sender's
// first and last object besides (their names bound their chunks from the
// start and to the end).
// Two ranks of an engine catch up two versions through commits and follow one
// while it streams; each must end equal to a dense load, read every object
// holding a frame of its chunks and nothing whose name's range holds none.
void ProtocolTest::CheckRanksReadOnlyTheirObjects(bool expert_parallel) {
  PublishOptions o = Fast();
  o.delta.chunk_elements = 1024;  // tensors of several chunks, so that a rank's rows hold some of them
  o.segment_bytes = 1024;  // many frame objects per sender
  Publisher pub(*store_, Path("state"), o);
  for (int v = 0; v <= 2; ++v) ASSERT_TRUE(pub.Publish(v, Version(v)).ok());
  auto layouts = TpLayouts(2, expert_parallel);
  std::mutex mu;
  std::set<std::string> reads[2];
  std::vector<std::unique_ptr<HookStore>> stores;
  std::vector<std::unique_ptr<RankFollower>> ranks;
  for (uint32_t r = 0; r < 2; ++r) {
    stores.push_back(std::make_unique<HookStore>(*store_, [&, r](std::string_view op, std::string_view key, bool) {
      std::lock_guard lock(mu);
      if (op == "read" && key.find("/frames/") != std::string_view::npos) reads[r].emplace(key);
      return Status::Ok();
    }));
    ranks.push_back(std::make_unique<RankFollower>(*stores[r], *layouts[r], Path(fmt::format("rank{}", r)),
                                                   EngineRank{"e", r, 2}, Receiver(fmt::format("e-r{}", r))));
    Status s = ranks[r]->Run(2);  // joins from the snapshot, then catches up
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  Status followed[2];
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) threads.emplace_back([&, r] { followed[r] = ranks[r]->Run(3); });
  auto published = pub.Publish(3, Version(3));
  for (auto& t : threads) t.join();
  ASSERT_TRUE(published.ok()) << published.status().ToString();
  EXPECT_EQ(published->acked, (std::vector<std::string>{"e-r0", "e-r1"}));
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(followed[r].ok()) << followed[r].ToString();
    auto files = RankBufferFiles::Open(*layouts[r], Path(fmt::format("rank{}", r)));
    ASSERT_TRUE(files.ok());
    const auto dense = DenseRank(*layouts[r], 3);
    PlacedRank p = files->placed();
    for (size_t b = 0; b < p.buffers.size(); ++b)
      EXPECT_TRUE(std::equal(p.buffers[b].begin(), p.buffers[b].end(), dense[b].begin(), dense[b].end()))
          << "rank " << r << " buffer " << layouts[r]->map().buffers[b].id;
  }
  // The chunks each rank holds an element of, chunk by chunk through the map's runs.
  std::vector<CopyRun> runs;
  auto holds = [&](const CompiledLayout& l, const DeltaManifest& m, ChunkId id) {
    const int64_t t = l.FindTensor(m.tensors[id.tensor].name);
    if (t < 0) return false;
    for (uint32_t c : l.CopiesOf(static_cast<size_t>(t))) {
      runs.clear();
      l.RunsInRange(c, uint64_t{id.chunk} * m.chunk_elements, m.chunk_elements, &runs);
      if (!runs.empty()) return true;
    }
    return false;
  };
  for (uint64_t v = 1; v <= 3; ++v) {
    auto commit = protocol_internal::ReadCommit(*store_, v);
    ASSERT_TRUE(commit.ok());
    const std::string prefix = run_keys::Attempt(v, commit->attempt);
    auto m = StoredManifest(*store_, run_keys::Manifest(v, commit->attempt));
    ASSERT_TRUE(m.ok());
    // The chunks each object's name bounds: from its own (or the start) up
    // to its sender's next object's (or the end).
    std::map<std::string, std::pair<ChunkId, ChunkId>> named;
    const ChunkId end{static_cast<uint32_t>(m->tensors.size()), 0};
    for (size_t i = 0; i < m->objects.size(); ++i) {
      auto n = run_keys::ParseFrameObject(m->objects[i]);
      ASSERT_TRUE(n) << m->objects[i];
      auto next = i + 1 < m->objects.size() ? run_keys::ParseFrameObject(m->objects[i + 1]) : std::nullopt;
      named[m->objects[i]] = {n->first.value_or(ChunkId{}), next && next->sender == n->sender ? *next->first : end};
    }
    for (uint32_t r = 0; r < 2; ++r) {
      const CompiledLayout& l = *layouts[r];
      // Needed: a frame of its chunks; allowed besides: a held chunk in the name's range.
      std::set<std::string> needed, allowed, read;
      for (const DeltaFrameEntry& f : m->frames)
        if (holds(l, *m, {f.tensor, f.chunk})) needed.insert(prefix + m->objects[f.object]);
      for (const auto& [name, range] : named) {
        bool may = false;
        for (ChunkId c = range.first; c < range.second && !may;
             c = c.chunk + 1 < m->ChunkCount(c.tensor) ? ChunkId{c.tensor, c.chunk + 1} : ChunkId{c.tensor + 1, 0})
          may = holds(l, *m, c);
        if (may || needed.count(prefix + name)) allowed.insert(prefix + name);
      }
      for (const auto& key : reads[r])
        if (key.starts_with(prefix)) read.insert(key);
      for (const auto& key : needed) EXPECT_TRUE(read.count(key)) << "rank " << r << " did not read " << key;
      for (const auto& key : read)
        EXPECT_TRUE(allowed.count(key)) << "rank " << r << " version " << v << " read " << key
                                        << ", whose name's range holds none of its chunks";
      // What it reads is within `allowed` whatever the timing; that must leave some out.
      EXPECT_LT(allowed.size(), m->objects.size()) << "rank " << r << " version " << v << ": meaningless";
      if (v != 3) continue;
      // Experts a rank holds whole lie in one run of each layer's experts in
      // table order (numbers by value), so their frames are adjacent.
      std::map<std::string, std::vector<bool>> held_experts;  // layer -> held, in table order
      for (uint32_t t = 0; t < m->tensors.size() && expert_parallel; ++t) {
        const std::string& name = m->tensors[t].name;
        if (const size_t at = name.find(".mlp.experts."); at != std::string::npos)
          held_experts[name.substr(0, at)].push_back(holds(l, *m, {t, 0}));
      }
      EXPECT_EQ(held_experts.empty(), !expert_parallel);
      for (const auto& [layer, held] : held_experts) {
        size_t blocks = 0;
        for (size_t i = 0; i < held.size(); ++i) blocks += held[i] && (i == 0 || !held[i - 1]);
        EXPECT_EQ(blocks, 1u) << "rank " << r << ", " << layer << ": its experts are not adjacent";
      }
      // The frame log of the last attempt names only chunks the rank holds
      // (frames of the others, in objects it read, are passed over).
      std::ifstream log(Path(fmt::format("rank{}/.dcr-rank-frames", r)));
      std::string line, kind;
      ASSERT_TRUE(std::getline(log, line) && line == "dcr-rank-frames " + commit->attempt) << line;
      size_t logged = 0;
      for (ChunkId c; log >> kind >> c.tensor >> c.chunk >> line; ++logged)
        EXPECT_TRUE(holds(l, *m, c)) << "rank " << r << " logged tensor " << c.tensor << " chunk " << c.chunk;
      EXPECT_GT(logged, 0u);
    }
  }
}

TEST_F(ProtocolTest, RanksDownloadOnlyTheFrameObjectsOfTheirChunks) { CheckRanksReadOnlyTheirObjects(false); }

// With expert parallelism each rank holds half the experts (16 here, so
// `experts.10`..`experts.15` order by number, not between `experts.1` and
// `experts.2`), whole: their frames are adjacent in the stream.
TEST_F(ProtocolTest, ExpertParallelRanksDownloadTheObjectsOfTheirExperts) { CheckRanksReadOnlyTheirObjects(true); }

// RankFollower::TakeChangedTensors: every map tensor after the join, then
// exactly the tensors the committed version's frames wrote, then nothing.
TEST_F(ProtocolTest, ARankSaysWhichTensorsEachVersionChanged) {
  Publisher pub(*store_, Path("state"), Fast());
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  auto layouts = TpLayouts(1);
  RankInMemory held(*layouts[0]);
  RankFollower f(*store_, held.placed, Path("rank"), EngineRank{"e", 0, 1}, Receiver("e-r0"));
  std::vector<std::string> all, joined, again;
  for (const LayoutTensor& t : layouts[0]->map().tensors) all.push_back(t.name);
  std::atomic<bool> taken{false};
  std::optional<Result<PublishReport>> p;
  std::thread publisher([&] {
    while (!taken) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    p = pub.Publish(1, Version(1));
  });
  // From Run's stop callback, as the Python binding calls it: once joined, then after version 1.
  Status run = f.Run(1, [&] {
    if (!taken && f.holds_version()) {
      joined = f.TakeChangedTensors();
      again = f.TakeChangedTensors();
      taken = true;
    }
    return false;
  });
  taken = true;
  publisher.join();
  ASSERT_TRUE(run.ok()) << run.ToString();
  ASSERT_TRUE(p && p->ok()) << (p ? p->status().ToString() : "not published");
  EXPECT_EQ(joined, all);
  EXPECT_TRUE(again.empty());
  const std::vector<std::string> want = FramedTensors(1, (*p)->attempt, *layouts[0]);
  ASSERT_FALSE(want.empty());
  ASSERT_LT(want.size(), all.size());  // the test means something only if some tensors did not change
  EXPECT_EQ(f.TakeChangedTensors(), want);
  EXPECT_TRUE(f.TakeChangedTensors().empty());
}

// A follower run again (for the next version) continues where it stopped:
// it does not reopen its target, which would report every tensor changed,
// and it ends at the version's exact bits. A recheck that finds the bits as
// tracked changes nothing of that (it reads every chunk, and goes on).
TEST_F(ProtocolTest, ARankFollowedAgainContinuesWhereItStopped) {
  Publisher pub(*store_, Path("state"), Fast());
  for (int v = 0; v <= 2; ++v) ASSERT_TRUE(pub.Publish(v, Version(v)).ok());
  auto layouts = TpLayouts(1);
  auto commit = store_->Get(run_keys::Commit(2));
  ASSERT_TRUE(commit.ok());
  auto c = CommitRecord::FromJson(*commit, "commit");
  ASSERT_TRUE(c.ok());
  const std::vector<std::string> changed = FramedTensors(2, c->attempt, *layouts[0]);
  ASSERT_LT(changed.size(), layouts[0]->map().tensors.size());  // meaningful only if some tensors did not change
  const auto dense = DenseRank(*layouts[0], 2);
  for (const bool recheck : {false, true}) {
    SCOPED_TRACE(recheck ? "recheck" : "no recheck");
    RankInMemory held(*layouts[0]);
    FollowOptions o = Receiver(recheck ? "f-r0" : "e-r0");
    o.recheck = recheck;
    RankFollower f(*store_, held.placed, Path(recheck ? "rank-f" : "rank-e"), EngineRank{recheck ? "f" : "e", 0, 1}, o);
    Status s = f.Run(1);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(f.version(), 1u);
    EXPECT_EQ(f.TakeChangedTensors().size(), layouts[0]->map().tensors.size());  // joined from the snapshot
    s = f.Run(2);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(f.version(), 2u);
    EXPECT_EQ(f.OutsideChanges(), "");
    EXPECT_EQ(f.TakeChangedTensors(), changed);
    for (size_t b = 0; b < held.memory.size(); ++b)
      EXPECT_TRUE(held.memory[b] == dense[b])
          << "buffer " << layouts[0]->map().buffers[b].id << " differs from a dense load";
  }
}

// Bits changed behind dcr's back between two Runs (a serving engine's
// parameter written by something else) in a chunk the next version does not
// touch (a chunk it touches is refused by the apply itself: not the frame's
// base). With FollowOptions::recheck the next Run names the chunk, rejoins
// and ends at the version's exact bits; without it the tracked digests
// cannot see the change, and the follower reports the version over bits that
// are not its own (what the recheck is for).
TEST_F(ProtocolTest, ARecheckFindsBitsChangedOutsideDcrAndRejoins) {
  Publisher pub(*store_, Path("state"), Fast());
  for (int v = 0; v <= 2; ++v) ASSERT_TRUE(pub.Publish(v, Version(v)).ok());
  auto layouts = TpLayouts(1);
  const LayoutMap& map = layouts[0]->map();
  auto commit = store_->Get(run_keys::Commit(2));
  ASSERT_TRUE(commit.ok());
  auto c = CommitRecord::FromJson(*commit, "commit");
  ASSERT_TRUE(c.ok());
  const std::vector<std::string> framed = FramedTensors(2, c->attempt, *layouts[0]);
  // The first element of a tensor version 2 leaves alone, in its buffer.
  const BoxCopy* box = nullptr;
  for (const BoxCopy& copy : map.copies)
    if (std::find(framed.begin(), framed.end(), copy.tensor) == framed.end() &&
        std::all_of(copy.offset.begin(), copy.offset.end(), [](uint64_t o) { return o == 0; })) {
      box = &copy;
      break;
    }
  ASSERT_NE(box, nullptr) << "every tensor changes in version 2";
  size_t buffer = 0;
  while (map.buffers[buffer].id != box->buffer) ++buffer;
  uint64_t element = 0;
  for (size_t d = 0; d < box->buffer_offset.size(); ++d)
    element = element * map.buffers[buffer].shape[d] + box->buffer_offset[d];
  const uint64_t byte = element * BitsPerElement(map.buffers[buffer].dtype) / 8;

  const auto dense = DenseRank(*layouts[0], 2);
  for (const bool recheck : {true, false}) {
    SCOPED_TRACE(recheck ? "recheck" : "no recheck");
    RankInMemory held(*layouts[0]);
    auto& memory = held.memory;
    FollowOptions o = Receiver(recheck ? "e-r0" : "f-r0");
    o.recheck = recheck;
    RankFollower f(*store_, held.placed, Path(recheck ? "rank-e" : "rank-f"), EngineRank{recheck ? "e" : "f", 0, 1}, o);
    Status s = f.Run(1);
    ASSERT_TRUE(s.ok()) << s.ToString();
    f.TakeChangedTensors();
    memory[buffer][byte] ^= 0x40;
    s = f.Run(2);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(f.version(), 2u);
    if (recheck) {
      EXPECT_NE(f.OutsideChanges().find("tensor '" + box->tensor + "' chunk 0 (elements 0.."), std::string::npos)
          << f.OutsideChanges();
      EXPECT_EQ(f.TakeChangedTensors().size(), map.tensors.size());  // rejoined: every tensor written
      EXPECT_TRUE(memory[buffer] == dense[buffer]);
    } else {
      EXPECT_EQ(f.OutsideChanges(), "");
      EXPECT_FALSE(memory[buffer] == dense[buffer]);  // version 2 reported over bits that are not its
    }
    for (size_t b = 0; b < memory.size(); ++b) {
      if (b == buffer) continue;
      EXPECT_TRUE(memory[b] == dense[b]) << b;
    }
  }
}

// The publisher's timing decisions follow the injected clock, so that they
// are tested in virtual time: a receiver whose heartbeat is older than
// heartbeat_timeout is not waited for; a live one that never acks is retired
// once ack_timeout (60 s) has passed on the clock, and the commit record
// carries the clock's time. Nothing here waits 60 s of real time.
TEST_F(ProtocolTest, AckTimeoutsAndHeartbeatsFollowTheInjectedClock) {
  ManualClock clock;
  PublishOptions o = Fast();
  o.clock = &clock;
  o.ack_timeout = std::chrono::seconds(60);
  o.heartbeat_timeout = std::chrono::seconds(10);
  Publisher pub(*store_, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  auto put_receiver = [&](const std::string& id, double heartbeat) {
    ReceiverRecord r;
    r.id = id;
    r.state = "following";
    r.heartbeat = heartbeat;
    ASSERT_TRUE(store_->Put(run_keys::Receiver(id), r.ToJson()).ok());
  };
  put_receiver("silent", clock.UnixSeconds() + 3600);  // fresh for the whole wait, and never acks
  put_receiver("stale", clock.UnixSeconds() - 11);  // quiet for 11 s: not waited for
  const Clock::Instant start = clock.Now();
  const double unix_start = clock.UnixSeconds();
  auto r = pub.Publish(1, Version(1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->retired, std::vector<std::string>{"silent"});
  EXPECT_TRUE(r->acked.empty());
  EXPECT_GE(clock.Now() - start, std::chrono::seconds(60));
  EXPECT_LT(clock.Now() - start, std::chrono::seconds(61));  // the 20 ms polls: retired at the first past 60 s
  EXPECT_GE(r->wait_seconds, 60.0);
  auto text = store_->Get(run_keys::Commit(1));
  ASSERT_TRUE(text.ok());
  auto c = CommitRecord::FromJson(*text, "commit");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_GE(c->time, unix_start + 60);
  EXPECT_EQ(c->retired, std::vector<std::string>{"silent"});
}

// The ack wait polls the store every 20 ms, and receivers rewrite their
// records at every heartbeat: a record is read again only when the listing
// shows it replaced (its etag), not at every poll (at scale, a GET per
// receiver per poll). A rewrite in the middle of the wait is read, so a
// receiver that stops is no longer waited for.
TEST_F(ProtocolTest, TheAckWaitReadsAReceiverRecordAgainOnlyWhenItIsReplaced) {
  ManualClock clock;
  std::atomic<int> record_reads{0};
  std::atomic<bool> waited{false};  // then the garbage collection reads it too
  HookStore counted(*store_, [&](std::string_view op, std::string_view key, bool) {
    if (op == "read" && key == run_keys::Receiver("silent") && !waited) ++record_reads;
    return Status::Ok();
  });
  int polls = 0;
  std::function<void(const std::string&)> put_receiver;
  PublishOptions o = Fast();
  o.clock = &clock;
  o.ack_timeout = std::chrono::seconds(60);
  o.cancel = [&] {  // called at every poll of the wait
    if (++polls == 100) put_receiver("stopped");
    return false;
  };
  o.fault = [&](std::string_view point) {
    if (point == "acked") waited = true;
    return Status::Ok();
  };
  Publisher pub(counted, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  ASSERT_EQ(polls, 0);
  put_receiver = [&](const std::string& state) {
    ReceiverRecord r;
    r.id = "silent";
    r.state = state;
    r.heartbeat = clock.UnixSeconds() + 3600;  // fresh for the whole wait
    ASSERT_TRUE(store_->Put(run_keys::Receiver("silent"), r.ToJson()).ok());
  };
  put_receiver("following");
  const Clock::Instant start = clock.Now();
  auto r = pub.Publish(1, Version(1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(polls, 100) << "the wait ended at the poll that read the stopped record";
  EXPECT_TRUE(r->retired.empty()) << "a stopped receiver is not retired, only not waited for";
  EXPECT_LT(clock.Now() - start, std::chrono::seconds(60));
  EXPECT_EQ(record_reads.load(), 2) << "read once as following, once as stopped; not at each of the " << polls
                                    << " polls";
}

// An engine whose ranks loaded a committed version themselves (a serving
// engine reading the checkpoint from disk) adopts it: with the sum of the
// ranks' partial digests, each rank records the version in its journal and
// follows from there through the deltas, downloading no snapshot (the store
// has none left here). A sum that is not the version's, or a version never
// committed, is refused and writes no journal.
TEST_F(ProtocolTest, AnEngineThatLoadedACommittedVersionAdoptsItWithoutASnapshot) {
  Publisher pub(*store_, Path("state"), Fast());
  for (int v = 0; v <= 2; ++v) ASSERT_TRUE(pub.Publish(v, Version(v)).ok());
  auto snapshots = store_->List("snapshots/");
  ASSERT_TRUE(snapshots.ok() && !snapshots->empty());
  for (const auto& o : *snapshots) ASSERT_TRUE(store_->Delete(o.key).ok());
  auto layouts = TpLayouts(2);
  std::vector<std::vector<uint8_t>> memory[2];
  PlacedRank placed[2];
  Digest engine;
  for (uint32_t r = 0; r < 2; ++r) {
    memory[r] = DenseRank(*layouts[r], 1);
    placed[r] = PlacedRank{layouts[r].get(), {}};
    for (auto& b : memory[r]) placed[r].buffers.emplace_back(b);
    engine += *RankDigest(placed[r]);
  }
  auto follower = [&](uint32_t r) {
    return RankFollower(*store_, placed[r], Path(fmt::format("rank{}", r)), EngineRank{"e", r, 2},
                        Receiver(fmt::format("e-r{}", r)));
  };
  auto journal = [&](uint32_t r) { return fs::exists(fs::path(Path(fmt::format("rank{}", r))) / ".dcr-rank.json"); };
  Status s = follower(0).Adopt(2, engine);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("do not hold version 2"), std::string::npos) << s.ToString();
  s = follower(0).Adopt(7, engine);
  EXPECT_EQ(s.code(), Code::kNotFound) << s.ToString();
  EXPECT_FALSE(journal(0));
  for (uint32_t r = 0; r < 2; ++r) {
    RankFollower f = follower(r);
    ASSERT_TRUE(f.Adopt(1, engine).ok());
    s = f.Run(2);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(f.version(), 2u);
    const auto dense = DenseRank(*layouts[r], 2);
    for (size_t b = 0; b < memory[r].size(); ++b)
      EXPECT_TRUE(memory[r][b] == dense[b]) << "rank " << r << " buffer " << layouts[r]->map().buffers[b].id;
  }
}

// ---- Trainer senders in several processes -----------------------------------

// A trainer of 4 Megatron-style senders (tp 2 x pp 2), each sender's shard
// buffers a dense load of a version through its map.
class ShardProcessTest : public ProtocolTest {
 protected:
  // A small Llama-like model whose every tensor-parallel split divides at 2.
  ShardProcessTest() {
    shape_ = ModelShape{};
    shape_.family = Family::kLlama;
    shape_.hidden_size = 256;
    shape_.num_layers = 2;
    shape_.vocab_size = 512;
    shape_.num_heads = 8;
    shape_.num_kv_heads = 4;
    shape_.head_dim = 32;
    shape_.intermediate_size = 256;
  }
  void SetUp() override {
    ProtocolTest::SetUp();
    const TrainerParallel par{2, 2, 1, false, 8};
    for (const TrainerRank& r : TrainerRanks(par)) {
      auto m = MegatronLayout(shape_, par, r);
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      auto c = CompiledLayout::Compile(std::move(*m));
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      senders_.push_back(std::make_unique<CompiledLayout>(std::move(*c)));
      maps_.push_back(senders_.back().get());
    }
    ASSERT_EQ(senders_.size(), 4u);
  }
  PublishOptions Trainer() {
    PublishOptions o = Fast();
    o.peer_poll = std::chrono::milliseconds(5);
    o.peer_timeout = kGuard;  // a guard: no test here has a live peer timed out
    return o;
  }
  // Every sender's shards at version v.
  std::vector<std::vector<std::vector<uint8_t>>> Shards(int v) {
    std::vector<std::vector<std::vector<uint8_t>>> out;
    for (const auto& l : senders_) out.push_back(DenseRank(*l, v));
    return out;
  }
  // Every sender's sources, in one process.
  std::vector<ShardSource> All(std::vector<std::vector<std::vector<uint8_t>>>& shards) {
    std::vector<ShardSource> out;
    for (size_t k = 0; k < maps_.size(); ++k) {
      ShardSource src{maps_[k], {}, {}};
      for (auto& b : shards[k]) src.current.emplace_back(b);
      out.push_back(std::move(src));
    }
    return out;
  }
  // Process p's sources. Senders are (pp 0, tp 0), (0, 1), (1, 0), (1, 1);
  // the placement puts each stage's tp ranks in different processes, so that
  // contributions cross processes both ways: senders 0, 3 in process 0; 1 in
  // 1; 2 in 2.
  static inline const std::vector<uint32_t> kPlacement = {0, 1, 2, 0};
  std::vector<ShardSource> Local(std::vector<std::vector<std::vector<uint8_t>>>& shards, uint32_t p) {
    static const std::vector<std::vector<uint32_t>> kHeld = {{0, 3}, {1}, {2}};
    std::vector<ShardSource> out;
    for (uint32_t k : kHeld[p]) {
      ShardSource s{maps_[k], {}};
      for (auto& b : shards[k]) s.current.emplace_back(b);
      out.push_back(std::move(s));
    }
    return out;
  }
  // Whether a publish ended by an injected kill (a fault point's
  // "injected: ..." kAborted), not by the protocol giving up (also kAborted:
  // attempts exhausted), which a restart would only repeat.
  static bool Killed(const Status& s) {
    return s.code() == Code::kAborted && s.message().find("injected") != std::string_view::npos;
  }
  // Publishes v from three processes (threads, each its own ShardPublisher
  // and state directory); `store_of(p)` and `options(p)` vary them; a
  // process whose publish fails is run again while `restart(p, status)`.
  struct Round {
    std::vector<Result<PublishReport>> results;
  };
  Round PublishFromProcesses(int v, const std::function<Store&(uint32_t)>& store_of,
                             const std::function<PublishOptions(uint32_t)>& options,
                             const std::function<bool(uint32_t, const Status&)>& restart = {}) {
    auto shards = Shards(v);
    Round round;
    round.results.assign(3, Aborted("not run"));
    std::vector<std::thread> threads;
    for (uint32_t p = 0; p < 3; ++p)
      threads.emplace_back([&, p] {
        std::vector<ShardSource> local = Local(shards, p);
        for (;;) {
          ShardPublisher pub(store_of(p), Path(fmt::format("trainer-p{}", p)), options(p));
          round.results[p] = pub.Publish(v, maps_, local, ShardProcesses{p, 3, kPlacement});
          if (round.results[p].ok() || !restart || !restart(p, round.results[p].status())) return;
        }
      });
    for (auto& t : threads) t.join();
    return round;
  }

  std::vector<std::unique_ptr<CompiledLayout>> senders_;
  std::vector<const CompiledLayout*> maps_;
};

// Four senders in three processes publish three versions; a follower (a
// whole checkpoint) and a two-rank engine follow, each byte-identical to a
// dense copy of every version. Version 2: a worker dies right after its
// contributions and restarts at once, joining the same attempt.
TEST_F(ShardProcessTest, FourSendersInThreeProcessesPublishEveryVersionBitExactly) {
  Publisher canonical(*store_, Path("state"), Fast());
  ASSERT_TRUE(canonical.Publish(0, Version(0)).ok());
  auto engine = TpLayouts(2);
  std::vector<std::vector<std::vector<uint8_t>>> memory(2);
  for (uint32_t r = 0; r < 2; ++r)
    for (size_t b = 0; b < engine[r]->map().buffers.size(); ++b) memory[r].emplace_back(engine[r]->BufferBytes(b));
  for (int v = 1; v <= 3; ++v) {
    std::vector<std::thread> receivers;
    std::vector<Status> results(3);
    receivers.emplace_back([&, v] { results[0] = Follower(*store_, Path("dense"), Receiver("dense")).Run(v); });
    for (uint32_t r = 0; r < 2; ++r)
      receivers.emplace_back([&, r, v] {
        PlacedRank p{engine[r].get(), {}};
        for (auto& b : memory[r]) p.buffers.emplace_back(b);
        RankFollower f(*store_, p, Path(fmt::format("rank{}", r)), EngineRank{"e", r, 2},
                       Receiver(fmt::format("e-r{}", r)));
        results[1 + r] = f.Run(v);
      });
    WaitForReceivers(3);
    std::atomic<int> crashes{0};
    auto round = PublishFromProcesses(
        v, [&](uint32_t) -> Store& { return *store_; },
        [&](uint32_t p) {
          PublishOptions o = Trainer();
          if (v == 2 && p == 1)
            o.fault = [&](std::string_view point) {
              return point == "contributions-written" && crashes.fetch_add(1) == 0 ? Aborted("injected: killed")
                                                                                   : Status::Ok();
            };
          return o;
        },
        [&](uint32_t, const Status& s) { return Killed(s); });
    for (auto& t : receivers) t.join();
    for (uint32_t p = 0; p < 3; ++p)
      ASSERT_TRUE(round.results[p].ok()) << p << ": " << round.results[p].status().ToString();
    for (const Status& s : results) ASSERT_TRUE(s.ok()) << s.ToString();
    const PublishReport& coord = *round.results[0];
    EXPECT_EQ(coord.attempts, 1u) << "version " << v;
    EXPECT_EQ(coord.acked.size(), 3u);
    EXPECT_GT(coord.frame_bytes, 0u);
    EXPECT_EQ(round.results[1]->attempt, coord.attempt);
    EXPECT_EQ(round.results[2]->attempt, coord.attempt);
    if (v == 2) {
      EXPECT_EQ(crashes.load(), 2);
    }
    ExpectIdentical(Path("dense"), v);
    for (uint32_t r = 0; r < 2; ++r) {
      auto want = DenseRank(*engine[r], v);
      for (size_t b = 0; b < want.size(); ++b)
        EXPECT_TRUE(memory[r][b] == want[b]) << "version " << v << ": rank " << r << " buffer " << b;
    }
    // The attempt's objects: one contribution object per pair, one record per process.
    auto objects = store_->List(run_keys::Attempt(v, coord.attempt));
    ASSERT_TRUE(objects.ok());
    std::set<std::string> names;
    for (const auto& o : *objects) names.insert(o.key.substr(run_keys::Attempt(v, coord.attempt).size()));
    // Records do cross processes (both tp ranks of a stage are in different ones).
    for (const char* pair : {"contrib/p1-p0.bin", "contrib/p0-p2.bin"}) {
      auto bytes = store_->Get(run_keys::Attempt(v, coord.attempt) + pair);
      ASSERT_TRUE(bytes.ok()) << pair;
      EXPECT_GT(bytes->size(), kContributionHeaderBytes + 8) << pair << " holds no records";
    }
    for (uint32_t from = 0; from < 3; ++from) {
      EXPECT_TRUE(names.count(fmt::format("procs/p{}.json", from))) << from;
      for (uint32_t to = 0; to < 3; ++to)
        if (to != from) {
          EXPECT_TRUE(names.count(fmt::format("contrib/p{}-p{}.bin", from, to))) << from << "->" << to;
        }
    }
  }
  // Each process keeps only its own senders' baseline shards.
  EXPECT_TRUE(fs::exists(Path("trainer-p0/shards/s0")) && fs::exists(Path("trainer-p0/shards/s3")));
  EXPECT_FALSE(fs::exists(Path("trainer-p0/shards/s1")));
  EXPECT_TRUE(fs::exists(Path("trainer-p1/shards/s1")) && !fs::exists(Path("trainer-p1/shards/s0")));
  EXPECT_TRUE(fs::exists(Path("trainer-p2/shards/s2")));
  // Each process's shards.json holds its senders' partial digest (computed
  // from the change records at the commit), so the next publish trusts the
  // files without a rebuild.
  for (uint32_t p = 0; p < 3; ++p) {
    std::ifstream in(Path(fmt::format("trainer-p{}/shards.json", p)));
    auto doc = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(doc.is_object()) << p;
    EXPECT_EQ(doc["version"], 3) << p;
    Digest recorded, files;
    ASSERT_TRUE(Digest::FromHex(doc["digest"].get<std::string>(), &recorded));
    for (uint32_t k = 0; k < 4; ++k) {
      if (kPlacement[k] != p) continue;
      auto f = RankBufferFiles::Open(*maps_[k], Path(fmt::format("trainer-p{}/shards/s{}", p, k)));
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      files += *RankDigest(f->placed());
    }
    EXPECT_EQ(files, recorded) << "process " << p;
  }
  // A process told another placement is refused.
  auto shards = Shards(3);
  std::vector<ShardSource> mine = Local(shards, 0);
  ShardProcesses two{0, 2, {0, 1, 1, 1}};
  ShardPublisher wrong(*store_, Path("trainer-p0"), Trainer());
  auto refused = wrong.Publish(4, maps_, mine, two);
  EXPECT_EQ(refused.status().code(), Code::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("process 0 holds senders 0 (1), but 2 local sources were given"),
            std::string::npos)
      << refused.status().ToString();
}

// The fences a coordinator writes (GC removes fenced attempts once the
// version commits), read back as they are written.
struct FenceLog {
  explicit FenceLog(Store& inner)
      : inner_(inner), store(inner, [this](std::string_view op, std::string_view key, bool after) {
          if (op == "write" && after && key.ends_with("/fence")) {
            auto text = inner_.Get(key);
            std::lock_guard lock(mu_);
            reasons_.push_back(text.ok() ? *text : text.status().ToString());
          }
          return Status::Ok();
        }) {}
  std::vector<std::string> reasons() {
    std::lock_guard lock(mu_);
    return reasons_;
  }
  Store& inner_;
  std::mutex mu_;
  std::vector<std::string> reasons_;
  HookStore store;
};

// A worker that dies mid-attempt and comes back only after the coordinator
// gave up on it: the attempt is fenced, the overwrite retry commits, and the
// receivers end bit-exact. The coordinator's short peer timeout is the only
// clock in play and times only the dead worker: before each of its waits the
// coordinator is held until the live processes' objects are in the store.
TEST_F(ShardProcessTest, AWorkerFailingMidAttemptIsFencedAndTheOverwriteRetryCommits) {
  Publisher canonical(*store_, Path("state"), Fast());
  ASSERT_TRUE(canonical.Publish(0, Version(0)).ok());
  Status followed;
  std::thread receiver([&] { followed = Follower(*store_, Path("dense"), Receiver("dense")).Run(1); });
  WaitForReceivers(1);
  std::atomic<bool> failed{false};
  FenceLog fences(*store_);
  // The prefix of the newest attempt of version 1 ("" when none).
  auto newest_attempt = [&] {
    std::string newest;
    auto listed = store_->List(run_keys::Attempts(1));
    if (listed.ok())
      for (const ObjectInfo& i : *listed)
        if (i.key.ends_with("/attempt.json")) newest = std::max(newest, i.key.substr(0, i.key.size() - 12));
    return newest;
  };
  auto round = PublishFromProcesses(
      1, [&](uint32_t p) -> Store& { return p == 0 ? fences.store : *store_; },
      [&](uint32_t p) {
        PublishOptions o = Trainer();
        if (p == 0) {
          o.peer_timeout = std::chrono::milliseconds(2000);
          o.fault = [&](std::string_view point) {
            // The newest attempt is the coordinator's own. Process 2 wrote its
            // contributions in both attempts, its record only in the retry.
            const std::string a = newest_attempt();
            const bool retry = !a.empty() && !a.starts_with(run_keys::Attempts(1) + "0000-");
            std::vector<std::string> wait;
            if (point == "contributions-written") wait = {"contrib/p1-p0.bin", "contrib/p2-p0.bin"};
            if (point == "record-written")
              wait = retry ? std::vector<std::string>{"procs/p1.json", "procs/p2.json"}
                           : std::vector<std::string>{"procs/p1.json"};
            for (const auto& k : wait) EXPECT_TRUE(WaitFor([&] { return store_->Head(a + k).ok(); })) << a << k;
            return Status::Ok();
          };
        }
        if (p == 2)
          o.fault = [&](std::string_view point) {
            return point == "contributions-written" && !failed.exchange(true) ? Aborted("injected: killed")
                                                                              : Status::Ok();
          };
        return o;
      },
      [&](uint32_t, const Status& s) {
        // Restarted once the coordinator has fenced the attempt.
        if (!Killed(s)) return false;
        return WaitFor([&] {
          auto a = store_->List(run_keys::Attempts(1));
          return a.ok() &&
                 std::any_of(a->begin(), a->end(), [](const ObjectInfo& o) { return o.key.ends_with("/fence"); });
        });
      });
  receiver.join();
  for (uint32_t p = 0; p < 3; ++p)
    ASSERT_TRUE(round.results[p].ok()) << p << ": " << round.results[p].status().ToString();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  EXPECT_EQ(round.results[0]->attempts, 2u);
  EXPECT_TRUE(round.results[0]->attempt.starts_with("0001-")) << round.results[0]->attempt;
  ASSERT_EQ(fences.reasons().size(), 1u);
  EXPECT_NE(fences.reasons()[0].find("process 2 wrote no record"), std::string::npos) << fences.reasons()[0];
  auto manifest = StoredManifest(*store_, run_keys::Manifest(1, round.results[0]->attempt));
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_EQ(manifest->delta_class, DeltaClass::kOverwrite);
  ExpectIdentical(Path("dense"), 1);
}

// A contribution object forged between two processes (a sender index its
// writer does not hold, checksum made to match) is refused: the attempt is
// fenced before any manifest names it, the retry commits.
// A ShardPublisher keeps its baseline shards open between publishes and
// trusts the shards record it wrote itself; once another publisher has
// rebuilt the state (new files under the same names), it opens and checks
// them again instead of using the files it holds.
// Each trainer process streams its frames in segments, as the publisher
// of a checkpoint does: with small segments every process writes several
// frame objects, each signed with its process's key, and the receiver has
// downloaded every one of them, once, before the coordinator writes the
// manifest (it holds there until then). Small chunks: each process
// encodes its chunks in several batches. The receiver ends bit-exact.
TEST_F(ShardProcessTest, EachProcessStreamsItsFramesInSegmentsBeforeTheManifest) {
  PublishOptions small_chunks = Fast();
  small_chunks.delta.chunk_elements = 1 << 10;
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), small_chunks).Publish(0, Version(0)).ok());
  std::mutex mu;
  std::map<std::string, int> reads;  // frame object -> downloads by the receiver
  HookStore view(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "read" && !after && key.find("/frames/") != std::string_view::npos) {
      std::lock_guard lock(mu);
      ++reads[std::string(key)];
    }
    return Status::Ok();
  });
  Status followed;
  std::thread receiver([&] { followed = Follower(view, Path("dense"), Receiver("dense")).Run(1); });
  WaitForReceivers(1);
  std::vector<std::string> objects;  // every frame object, when the manifest is next
  bool downloaded_all = false;
  auto round = PublishFromProcesses(
      1, [&](uint32_t) -> Store& { return *store_; },
      [&](uint32_t p) {
        PublishOptions o = Trainer();
        o.segment_bytes = 1024;
        if (p == 0)
          o.fault = [&](std::string_view point) {
            if (point != "frames-written") return Status::Ok();
            auto listed = store_->List("attempts/v0000000001/");
            if (!listed.ok()) return listed.status();
            for (const auto& info : *listed)
              if (info.key.find("/frames/") != std::string::npos) objects.push_back(info.key);
            downloaded_all = WaitFor([&] {
              std::lock_guard lock(mu);
              for (const auto& k : objects)
                if (!reads.count(k)) return false;
              return true;
            });
            return Status::Ok();
          };
        return o;
      });
  receiver.join();
  for (uint32_t p = 0; p < 3; ++p)
    ASSERT_TRUE(round.results[p].ok()) << p << ": " << round.results[p].status().ToString();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  ExpectIdentical(Path("dense"), 1);
  for (uint32_t p = 0; p < 3; ++p) {
    const std::string mark = fmt::format("/frames/s{}-", p);
    EXPECT_GE(std::count_if(objects.begin(), objects.end(),
                            [&](const std::string& k) { return k.find(mark) != std::string::npos; }),
              2)
        << "process " << p << " cut no segments";
    EXPECT_TRUE(store_->Get(run_keys::Attempt(1, round.results[0]->attempt) + run_keys::ProcessSigner(p)).ok()) << p;
  }
  EXPECT_TRUE(downloaded_all) << "the receiver did not download the segments before the manifest";
  for (const auto& k : objects) EXPECT_EQ(reads[k], 1) << k;
}

// Version v's snapshot, downloaded into `dir`: a checkpoint byte-identical to `want`.
void ExpectSnapshotOf(Store& store, uint64_t v, const std::string& dir, const Checkpoint& want) {
  auto snap = protocol_internal::ReadSnapshot(store, v);
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_TRUE(protocol_internal::DownloadSnapshot(store, *snap, dir, nullptr).ok());
  auto got = Checkpoint::Open(dir);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(DiffCheckpoints(*got, want).identical()) << "the snapshot of version " << v << " differs";
}

// Trainer processes take the scheduled snapshots: every tensor is written
// whole by the process owning its first chunk, from its own senders and the
// parts the others send it; the files, the index and snapshot.json make a
// checkpoint byte-identical to the version, the parts are removed, and a
// receiver joining later starts from it. The checkpoint's other files
// (its config) come along from version 0's snapshot.
TEST_F(ShardProcessTest, ProcessesTakeTheScheduledSnapshotsAndAJoinerStartsFromOne) {
  const std::string config = "{\"model_type\": \"llama\"}\n";
  std::ofstream(Path("gen/v0/config.json")) << config;
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), Fast()).Publish(0, Version(0)).ok());
  for (int v = 1; v <= 3; ++v) {
    auto round = PublishFromProcesses(
        v, [&](uint32_t) -> Store& { return *store_; },
        [&](uint32_t) {
          PublishOptions o = Trainer();
          o.snapshot_every = 2;
          return o;
        });
    for (uint32_t p = 0; p < 3; ++p)
      ASSERT_TRUE(round.results[p].ok()) << v << "/" << p << ": " << round.results[p].status().ToString();
  }
  EXPECT_EQ(protocol_internal::ReadSnapshot(*store_, 1).status().code(), Code::kNotFound);
  EXPECT_EQ(protocol_internal::ReadSnapshot(*store_, 3).status().code(), Code::kNotFound);
  auto snap = protocol_internal::ReadSnapshot(*store_, 2);
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  std::set<std::string> files;
  for (const auto& f : snap->files) files.insert(f.name);
  EXPECT_TRUE(files.count("model.safetensors.index.json"));
  EXPECT_TRUE(files.count("config.json"));
  EXPECT_TRUE(files.count("model-00001-of-00003.safetensors"));
  EXPECT_GE(files.size(), 3u) << "one process wrote every tensor";
  auto parts = store_->List(run_keys::Snapshot(2) + "parts/");
  ASSERT_TRUE(parts.ok());
  EXPECT_TRUE(parts->empty()) << parts->front().key;
  ExpectSnapshotOf(*store_, 2, Path("snap2"), Version(2));
  // A receiver joining now starts from the snapshot of version 2.
  std::atomic<int> snapshot_reads{0};
  HookStore view(*store_, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "read" && !after && key.starts_with(run_keys::Snapshot(2) + "files/")) ++snapshot_reads;
    return Status::Ok();
  });
  ASSERT_TRUE(Follower(view, Path("late"), Receiver("late")).Run(3).ok());
  EXPECT_GT(snapshot_reads.load(), 0);
  // Its files are the snapshot's (three shards and the index), its tensors v3's.
  auto late = Checkpoint::Open(Path("late"));
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_TRUE(DiffCheckpoints(*late, Version(3)).identical());
  EXPECT_GE(late->files().size(), 2u);
  std::ifstream in(Path("late/config.json"));
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), {}), config);
}

// One process holding every sender writes the snapshot as one file,
// model.safetensors, and no index.
TEST_F(ShardProcessTest, OneProcessWritesItsSnapshotAsOneFile) {
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), Fast()).Publish(0, Version(0)).ok());
  PublishOptions o = Trainer();
  o.snapshot_every = 1;
  auto shards = Shards(1);
  auto r = ShardPublisher(*store_, Path("trainer"), o).Publish(1, All(shards));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto snap = protocol_internal::ReadSnapshot(*store_, 1);
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_EQ(snap->files.size(), 1u);
  EXPECT_EQ(snap->files[0].name, "model.safetensors");
  ExpectSnapshotOf(*store_, 1, Path("snap1"), Version(1));
}

// A snapshot the coordinator did not finish (killed after sending its
// parts) is taken by every process at the next publish, before its attempt.
// One whose files do not add up to the version (a process's shards changed
// behind its back) is not recorded: the coordinator fails with kDataLoss.
TEST_F(ShardProcessTest, AMissedSnapshotIsTakenNextTimeAndABadOneIsNotRecorded) {
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), Fast()).Publish(0, Version(0)).ok());
  // Publishes v from the three processes, snapshots every second version;
  // `fault(p, point)` and `shards` vary them.
  auto shards = Shards(1);
  auto publish = [&](int v, const std::function<Status(uint32_t, std::string_view)>& fault) {
    shards = Shards(v);
    std::vector<Result<PublishReport>> results(3, Aborted("not run"));
    std::vector<std::thread> threads;
    for (uint32_t p = 0; p < 3; ++p)
      threads.emplace_back([&, p] {
        std::vector<ShardSource> local = Local(shards, p);
        PublishOptions o = Trainer();
        o.snapshot_every = 2;
        o.fault = [&, p](std::string_view point) { return fault(p, point); };
        results[p] = ShardPublisher(*store_, Path(fmt::format("trainer-p{}", p)), o)
                         .Publish(v, maps_, local, ShardProcesses{p, 3, kPlacement});
      });
    for (auto& t : threads) t.join();
    return results;
  };
  const auto none = [](uint32_t, std::string_view) { return Status::Ok(); };
  auto r1 = publish(1, none);
  for (uint32_t p = 0; p < 3; ++p) ASSERT_TRUE(r1[p].ok()) << p << ": " << r1[p].status().ToString();
  auto r2 = publish(2, [](uint32_t p, std::string_view point) {
    return p == 0 && point == "snapshot-parts-written" ? Aborted("injected: killed") : Status::Ok();
  });
  EXPECT_EQ(r2[0].status().code(), Code::kAborted) << r2[0].status().ToString();
  ASSERT_TRUE(r2[1].ok() && r2[2].ok());
  EXPECT_EQ(protocol_internal::ReadSnapshot(*store_, 2).status().code(), Code::kNotFound);
  auto r3 = publish(3, none);
  for (uint32_t p = 0; p < 3; ++p) ASSERT_TRUE(r3[p].ok()) << p << ": " << r3[p].status().ToString();
  ExpectSnapshotOf(*store_, 2, Path("snap2"), Version(2));

  // Version 4: process 1's shards change after the commit, before they
  // become its baseline.
  auto r4 = publish(4, [&](uint32_t p, std::string_view point) {
    if (p == 1 && point == "committed") shards[1][0][0] ^= 0x40;
    return Status::Ok();
  });
  EXPECT_EQ(r4[0].status().code(), Code::kDataLoss) << r4[0].status().ToString();
  EXPECT_NE(r4[0].status().message().find("add up to"), std::string::npos) << r4[0].status().ToString();
  EXPECT_EQ(protocol_internal::ReadSnapshot(*store_, 4).status().code(), Code::kNotFound);
  auto parts = store_->List(run_keys::Snapshot(4) + "parts/");
  ASSERT_TRUE(parts.ok());
  EXPECT_TRUE(parts->empty()) << "the failed round's parts are left for the next one: " << parts->front().key;
  auto state = ReadRunState(*store_);
  ASSERT_TRUE(state.ok() && state->latest);
  EXPECT_EQ(*state->latest, 4u) << "the version itself is committed";
}

TEST_F(ShardProcessTest, APublisherTrustsOnlyTheShardsItRecordedItself) {
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), Fast()).Publish(0, Version(0)).ok());
  auto all = [&](auto& shards) { return All(shards); };
  ShardPublisher a(*store_, Path("trainer"), Trainer()), b(*store_, Path("trainer"), Trainer());
  auto v1 = Shards(1), v2 = Shards(2), v3 = Shards(3), v4 = Shards(4);
  auto r1 = a.Publish(1, all(v1));
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  fs::remove(Path("trainer/shards.json"));  // b rebuilds the shards from the store: new files
  auto r2 = b.Publish(2, all(v2));
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  auto r3 = a.Publish(3, all(v3));
  ASSERT_TRUE(r3.ok()) << r3.status().ToString();
  auto r4 = a.Publish(4, all(v4));  // with the files a recorded itself
  ASSERT_TRUE(r4.ok()) << r4.status().ToString();
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(4).ok());
  ExpectIdentical(Path("r"), 4);
}

// Staged senders (device tensors): each buffer is copied into host memory
// by its stage function on a copy thread, and the encode starts before the
// copies end. Deterministic: the last copy waits until the publisher has
// reached its projection (fault point "projecting"), which a publisher that
// staged everything first never would. A failing copy fails the publish.
TEST_F(ShardProcessTest, StagedShardsAreCopiedWhileTheEncodeRuns) {
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), Fast()).Publish(0, Version(0)).ok());
  auto device = Shards(1);  // what the "device" holds
  std::vector<std::vector<std::vector<uint8_t>>> host;
  size_t buffers = 0;
  for (auto& sender : device) {
    host.emplace_back();
    for (auto& b : sender) host.back().emplace_back(b.size(), 0xEE), ++buffers;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool projecting = false;
  size_t copies = 0;
  std::string fail_at;  // a buffer id whose copy fails
  std::vector<ShardSource> sources;
  for (size_t k = 0; k < maps_.size(); ++k) {
    ShardSource src{maps_[k], {}, {}};
    for (auto& b : host[k]) src.current.emplace_back(b);
    src.stage = [&, k](size_t b) -> Status {
      std::unique_lock lock(mu);
      if (maps_[k]->map().buffers[b].id == fail_at) return Unavailable("injected: the copy engine failed");
      if (++copies == buffers && !cv.wait_for(lock, kGuard, [&] { return projecting; }))
        return DeadlineExceeded("the publisher did not start encoding before the last copy");
      host[k][b] = device[k][b];
      return Status::Ok();
    };
    sources.push_back(std::move(src));
  }
  PublishOptions o = Trainer();
  o.fault = [&](std::string_view point) {
    if (point == "projecting") {
      std::lock_guard lock(mu);
      projecting = true;
      cv.notify_all();
    }
    return Status::Ok();
  };
  ShardPublisher pub(*store_, Path("trainer"), o);
  auto r = pub.Publish(1, sources);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(copies, buffers) << "every buffer staged once";
  EXPECT_GT(r->staging_seconds, 0);
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(1).ok());
  ExpectIdentical(Path("r"), 1);

  // A copy that fails fails the publish, naming the buffer; nothing is committed.
  device = Shards(2);
  copies = 0;
  projecting = false;
  fail_at = maps_[2]->map().buffers[0].id;
  auto failed = pub.Publish(2, sources);
  EXPECT_EQ(failed.status().code(), Code::kUnavailable) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find(fail_at), std::string::npos) << failed.status().message();
  auto status = ReadRunStatus(*store_, std::chrono::milliseconds(2000));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->latest, std::optional<uint64_t>(1));
  fail_at.clear();
  copies = 0;
  auto again = pub.Publish(2, sources);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ASSERT_TRUE(f.Run(2).ok());
  ExpectIdentical(Path("r"), 2);
}

// Adopt: the senders' shards that hold a committed version become the
// baseline without a download (the trainer that just published the
// snapshot from them); shards with other bits are refused and nothing kept.
TEST_F(ShardProcessTest, AdoptedShardsAreTheBaselineWithoutADownload) {
  ASSERT_TRUE(Publisher(*store_, Path("snapshot"), Fast()).Publish(0, Version(0)).ok());
  std::atomic<int> snapshot_reads{0};
  HookStore counted(*store_, [&](std::string_view op, std::string_view key, bool) {
    if (op == "read" && key.starts_with("snapshots/") && key.find("/files/") != std::string_view::npos)
      ++snapshot_reads;  // the snapshot's bytes (its record is read by everyone)
    return Status::Ok();
  });
  ShardPublisher pub(counted, Path("trainer"), Trainer());
  auto v0 = Shards(0), v1 = Shards(1), v2 = Shards(2);
  Status wrong = pub.Adopt(0, All(v1));
  EXPECT_EQ(wrong.code(), Code::kFailedPrecondition) << wrong.ToString();
  EXPECT_NE(wrong.message().find("not version 0"), std::string::npos) << wrong.message();
  EXPECT_FALSE(fs::exists(Path("trainer/shards")));
  Status adopted = pub.Adopt(0, All(v0));
  ASSERT_TRUE(adopted.ok()) << adopted.ToString();
  for (int v : {1, 2}) {
    auto r = pub.Publish(v, All(v == 1 ? v1 : v2));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_EQ(snapshot_reads.load(), 0) << "the publisher downloaded the snapshot";
  Follower f(*store_, Path("r"), Receiver("r"));
  ASSERT_TRUE(f.Run(2).ok());
  ExpectIdentical(Path("r"), 2);
}

TEST_F(ShardProcessTest, AForgedContributionObjectIsRefused) {
  Publisher canonical(*store_, Path("state"), Fast());
  ASSERT_TRUE(canonical.Publish(0, Version(0)).ok());
  Status followed;
  std::thread receiver([&] { followed = Follower(*store_, Path("dense"), Receiver("dense")).Run(1); });
  WaitForReceivers(1);
  std::atomic<bool> forged{false};
  FenceLog fences(*store_);
  HookStore coordinator(fences.store, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "read" && !after && key.find("/0000-") != std::string_view::npos && key.ends_with("contrib/p1-p0.bin") &&
        !forged) {
      auto bytes = store_->Get(key);
      if (!bytes.ok()) return Status::Ok();  // not written yet
      forged = true;
      EXPECT_GE(bytes->size(), kContributionHeaderBytes + 48) << "process 1 contributes nothing to process 0";
      if (bytes->size() < kContributionHeaderBytes + 48) return Status::Ok();
      std::string b = *bytes;
      const uint32_t sender = 3;  // process 2's
      std::memcpy(b.data() + kContributionHeaderBytes + 8, &sender, 4);
      const uint64_t sum = Xxh3_64(b.data(), b.size() - 8);
      std::memcpy(b.data() + b.size() - 8, &sum, 8);
      EXPECT_TRUE(store_->Put(key, b).ok());
    }
    return Status::Ok();
  });
  auto round = PublishFromProcesses(
      1, [&](uint32_t p) -> Store& { return p == 0 ? static_cast<Store&>(coordinator) : *store_; },
      [&](uint32_t) { return Trainer(); });
  receiver.join();
  for (uint32_t p = 0; p < 3; ++p)
    ASSERT_TRUE(round.results[p].ok()) << p << ": " << round.results[p].status().ToString();
  ASSERT_TRUE(forged.load());
  EXPECT_EQ(round.results[0]->attempts, 2u);
  ASSERT_EQ(fences.reasons().size(), 1u);
  EXPECT_NE(fences.reasons()[0].find("sender 3 is not one of process 1's senders"), std::string::npos)
      << fences.reasons()[0];
  // The refused attempt never got a manifest: nothing of it was committed.
  auto attempts = store_->List(run_keys::Attempts(1));
  ASSERT_TRUE(attempts.ok());
  for (const auto& o : *attempts)
    EXPECT_FALSE(o.key.find("/0000-") != std::string::npos && o.key.ends_with("manifest.bin"));
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  ExpectIdentical(Path("dense"), 1);
}

// The manifest from the processes' records: objects in process order,
// frames remapped to them, every chunk owned exactly once.
TEST(AssembleLayoutManifestTest, BuildsTheManifestFromEveryProcessRecord) {
  std::vector<TensorInfo> tensors = {{"a", DType::kBF16, {40}, 40, 80}, {"b", DType::kBF16, {8}, 8, 16}};
  DeltaOptions opt;
  opt.chunk_elements = 16;
  opt.delta_id = 7;
  const DeltaManifest layout = StartLayoutDelta(tensors, opt);
  auto dig = [](uint64_t x) {
    Digest d;
    d.lane[0] = x;
    d.lane[1] = 2 * x;
    return d;
  };
  ProcessRecord p0, p1;
  p0.process = 0;
  p1.process = 1;
  p0.processes = p1.processes = 2;
  p0.objects = {"frames/p0.bin"};
  p0.frames = {{0, 1, 0, 0, 120, Mode::kXor, Codec::kSparse, 2}};
  p0.chunks = {{0, 0, dig(1), dig(1)}, {0, 1, dig(2), dig(3)}};
  p1.objects = {"frames/p1.bin"};
  p1.frames = {{0, 2, 0, 0, 100, Mode::kAdd, Codec::kRaw, 1}, {1, 0, 0, 100, 110, Mode::kXor, Codec::kSparse, 1}};
  p1.chunks = {{0, 2, dig(4), dig(5)}, {1, 0, dig(6), dig(8)}};
  DeltaManifest m = layout;
  const ProcessRecord both[] = {p0, p1};
  ASSERT_TRUE(AssembleLayoutManifest(m, both).ok());
  EXPECT_EQ(m.objects, (std::vector<std::string>{"frames/p0.bin", "frames/p1.bin"}));
  ASSERT_EQ(m.frames.size(), 3u);
  EXPECT_EQ(m.frames[0].object, 0u);
  EXPECT_EQ(m.frames[1].object, 1u);
  EXPECT_EQ(m.frames[2].object, 1u);
  EXPECT_EQ(m.frames[2].offset, 100u);
  EXPECT_EQ(m.base_digest, dig(13));
  EXPECT_EQ(m.target_digest, dig(17));
  ASSERT_EQ(m.tensor_target_digests.size(), m.tensors.size());
  EXPECT_EQ(m.tensor_target_digests[1], dig(8));
  EXPECT_EQ(m.frame_bytes, 330u);
  // The manifest parses back as a delta manifest.
  const std::string bytes = m.Encode();
  EXPECT_TRUE(
      DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), m, "assembled")
          .ok());
  // Every chunk exactly once; frames only of owned chunks.
  ProcessRecord twice = p1;
  twice.chunks.insert(twice.chunks.begin(), {0, 1, dig(2), dig(3)});
  const ProcessRecord doubled[] = {p0, twice};
  DeltaManifest m2 = layout;
  Status s = AssembleLayoutManifest(m2, doubled);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition);
  EXPECT_NE(s.message().find("tensor 'a' chunk 1 is owned by processes 0 and 1"), std::string::npos) << s.ToString();
  const ProcessRecord one[] = {p0};
  s = AssembleLayoutManifest(m2, one);
  EXPECT_NE(s.message().find("tensor 'a' chunk 2 is owned by no process"), std::string::npos) << s.ToString();
  ProcessRecord stray = p1;
  stray.frames.insert(stray.frames.begin(), {0, 0, 0, 0, 100, Mode::kXor, Codec::kSparse, 1});
  const ProcessRecord strays[] = {p0, stray};
  s = AssembleLayoutManifest(m2, strays);
  EXPECT_NE(s.message().find("frame of tensor 0 chunk 0, which it does not own"), std::string::npos) << s.ToString();
  ProcessRecord outside = p1;
  outside.chunks.push_back({1, 5, dig(1), dig(1)});
  const ProcessRecord outsides[] = {p0, outside};
  EXPECT_EQ(AssembleLayoutManifest(m2, outsides).code(), Code::kInvalidArgument);
}

// A store written by the previous format (JSON manifests, 96-byte frame
// headers; its run.json has no format_version) is refused, naming the
// version, by everything that reads run.json: publishers and receivers alike.
TEST(RunRecordTest, AStoreOfTheOldFormatIsRefusedNamingItsVersion) {
  RunRecord r;
  r.run_id = "r";
  r.chunk_elements = 1024;
  r.tensors.push_back({"w", DType::kBF16, {4, 4}, 16});
  auto back = RunRecord::FromJson(r.ToJson(), "run.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->tensors.size(), 1u);
  auto doc = nlohmann::json::parse(r.ToJson());
  for (const auto& version : {nlohmann::json(), nlohmann::json(1), nlohmann::json(3)}) {
    if (version.is_null()) doc.erase("format_version");
    else doc["format_version"] = version;
    auto old = RunRecord::FromJson(doc.dump(), "run.json");
    ASSERT_FALSE(old.ok());
    EXPECT_EQ(old.status().code(), Code::kUnimplemented) << old.status().ToString();
    const std::string named = version.is_null() ? "1" : version.dump();
    EXPECT_NE(old.status().message().find("format version " + named), std::string::npos) << old.status().message();
  }
  // Through the store, as a receiver meets it.
  auto store = OpenStore("mem://old-format-run");
  ASSERT_TRUE(store.ok());
  doc.erase("format_version");
  ASSERT_TRUE((*store)->Put(run_keys::kRun, doc.dump()).ok());
  auto state = ReadRunState(**store);
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().code(), Code::kUnimplemented) << state.status().ToString();
}

// run.json names the FP8 scheme of the run's FP8 engines: it round-trips,
// a record without it (an older run) reads as none, and a malformed one is
// refused naming the field.
TEST(RunRecordTest, TheFp8SchemeRoundTripsAndMalformedOnesAreRefused) {
  RunRecord r;
  r.run_id = "r";
  r.tensors.push_back({"w", DType::kBF16, {4, 4}, 16});
  auto without = RunRecord::FromJson(r.ToJson(), "run.json");
  ASSERT_TRUE(without.ok()) << without.status().ToString();
  EXPECT_FALSE(without->fp8);
  r.fp8 = Fp8Scheme{};
  r.fp8->block_rows = 64;
  auto back = RunRecord::FromJson(r.ToJson(), "run.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_TRUE(back->fp8);
  EXPECT_EQ(*back->fp8, *r.fp8);
  EXPECT_NE(*back->fp8, Fp8Scheme{});
  auto doc = nlohmann::json::parse(r.ToJson());
  for (const auto& [field, bad] :
       {std::pair<std::string, nlohmann::json>{"", 7}, {"block_rows", "many"}, {"scale", 448}, {"format", nullptr}}) {
    auto broken = doc;
    if (field.empty()) broken["fp8"] = bad;
    else broken["fp8"][field] = bad;
    auto parsed = RunRecord::FromJson(broken.dump(), "run.json");
    ASSERT_FALSE(parsed.ok()) << field;
    EXPECT_EQ(parsed.status().code(), Code::kInvalidArgument) << parsed.status().ToString();
    EXPECT_NE(parsed.status().message().find(field.empty() ? "'fp8'" : field), std::string::npos)
        << parsed.status().message();
  }
}

TEST(TimelineRecordTest, SpansRoundTripInAcksAndTimelinesAndMalformedOnesAreRefused) {
  AckRecord ack;
  ack.receiver = "rx";
  EXPECT_EQ(ack.ToJson().find("spans"), std::string::npos);  // none: as before timelines
  ack.spans = {{"download", 1764648000.25, 1764648000.5}, {"ack", 1764648000.75, 1764648000.75}};
  auto back = AckRecord::FromJson(ack.ToJson(), "ack");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->spans, ack.spans);
  TimelineRecord t{"host-1", "publisher", 3, 0.75, {{"encode", 1764648000.0, 1764648000.5}}};
  auto again = TimelineRecord::FromJson(t.ToJson(), "timeline");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->spans, t.spans);
  EXPECT_EQ(again->ToJson(), t.ToJson());
  auto doc = nlohmann::json::parse(t.ToJson());
  for (const nlohmann::json& bad :
       {nlohmann::json(7), nlohmann::json::array({7}), nlohmann::json::array({{{"stage", "x"}, {"start", 2}}}),
        nlohmann::json::array({{{"stage", "x"}, {"start", 2}, {"end", 1}}}),
        nlohmann::json::array({{{"stage", ""}, {"start", 1}, {"end", 2}}})}) {
    auto broken = doc;
    broken["spans"] = bad;
    auto parsed = TimelineRecord::FromJson(broken.dump(), "timeline");
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), Code::kInvalidArgument) << parsed.status().ToString();
  }
}

TEST(AttemptRecordTest, RoundTripsAndRefusesBadRecords) {
  AttemptRecord one;
  one.version = 4;
  one.cls = DeltaClass::kOverwrite;
  one.delta_id = 0x0123456789abcdefull;
  one.object_key = std::string(64, 'e');
  one.coordinator = "host:7";
  one.time = 1764648000.5;
  AttemptRecord procs = one;
  procs.object_key.clear();
  procs.processes = 2;
  procs.senders = 3;
  for (const AttemptRecord& r : {one, procs}) {
    auto back = AttemptRecord::FromJson(r.ToJson(), "a");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->ToJson(), r.ToJson());
    EXPECT_EQ(back->delta_id, r.delta_id);
    EXPECT_EQ(back->object_key, r.object_key);
    EXPECT_EQ(back->processes, r.processes);
  }
  const std::string good = one.ToJson();
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  for (const std::string& bad :
       {edit("\"overwrite\"", "\"add\""), edit("0123456789abcdef", "0123456789ABCDEF"),
        edit("0123456789abcdef", "0000000000000000"), edit("0123456789abcdef", "123"), edit(std::string(64, 'e'), "ee"),
        edit("\"format\": \"dcr-attempt\"", "\"format\": \"dcr-commit\""),
        edit("\"object_key\"", "\"processes\": 1, \"senders\": 1, \"object_key\""), std::string("{}")})
    EXPECT_EQ(AttemptRecord::FromJson(bad, "a").status().code(), Code::kInvalidArgument) << bad;
  procs.senders = 1;  // fewer senders than processes
  EXPECT_FALSE(AttemptRecord::FromJson(procs.ToJson(), "a").ok());
}

TEST(ProcessRecordTest, RoundTripsAndRefusesBadRecords) {
  ProcessRecord r;
  r.attempt = "0000-abcdef01";
  r.process = 1;
  r.processes = 3;
  r.senders = {2, 5};
  r.baseline_digest.lane[0] = 9;
  r.objects = {"frames/p1.bin"};
  r.frames = {{0, 1, 0, 0, 120, Mode::kXor, Codec::kSparse, 2}};
  r.chunks = {{0, 1, Digest(), Digest()}};
  auto back = ProcessRecord::FromJson(r.ToJson(), "p1.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->ToJson(), r.ToJson());
  EXPECT_EQ(back->senders, r.senders);
  EXPECT_EQ(back->frames[0].bytes, 120u);
  auto refused = [&](const std::string& from, const std::string& to) {
    std::string bad = r.ToJson();
    const size_t at = bad.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    bad.replace(at, from.size(), to);
    auto p = ProcessRecord::FromJson(bad, "p1.json");
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument) << from << " -> " << to;
    EXPECT_NE(p.status().message().find("p1.json: does not parse"), std::string::npos) << p.status().ToString();
  };
  refused("\"process\": 1", "\"process\": 3");
  refused("\"frames/p1.bin\"", "\"../p1.bin\"");
  refused("\"sparse\"", "\"lz4\"");
  refused("2,\n  5", "5,\n  2");
  refused("\"dcr-process\"", "\"dcr-ack\"");
}

}  // namespace
}  // namespace dcr

namespace dcr {
namespace {

// Frame object signatures: a round trip, and every way an object can fail.
TEST(ObjectSignatureTest, VerifiesOnlyTheSignersFramesUnderTheirKey) {
  auto signer = ObjectSigner::Generate();
  ASSERT_TRUE(signer.ok()) << signer.status().ToString();
  auto other = ObjectSigner::Generate();
  ASSERT_TRUE(other.ok());
  ASSERT_NE(signer->public_hex(), other->public_hex());
  const std::string key = "attempts/v0000000001/0000-ab/frames/s0-0000.bin";
  const std::string frames = EncodeFrame(FrameHeader{}, {});
  const std::string object = signer->Sign(key, frames);
  ASSERT_EQ(object.size(), frames.size() + kObjectTrailerBytes);
  EXPECT_EQ(ObjectFrames(object), frames);
  EXPECT_EQ(ObjectFrames(frames), frames);  // no trailer: all frames
  // Signed incrementally, the same bytes.
  ObjectSigner::Object parts = signer->Begin(key);
  parts.Update(std::string_view(frames).substr(0, 10));
  parts.Update(std::string_view(frames).substr(10));
  EXPECT_EQ(frames + parts.Trailer(), object);
  EXPECT_TRUE(VerifyObjectSignature(signer->public_hex(), key, object).ok());
  // Another key, another object name, a changed byte anywhere, no trailer.
  EXPECT_EQ(VerifyObjectSignature(other->public_hex(), key, object).code(), Code::kDataLoss);
  EXPECT_EQ(
      VerifyObjectSignature(signer->public_hex(), "attempts/v0000000001/0000-ab/frames/s0-0001.bin", object).code(),
      Code::kDataLoss);
  for (size_t i = 0; i < object.size(); ++i) {
    std::string bad = object;
    bad[i] ^= 1;
    EXPECT_FALSE(VerifyObjectSignature(signer->public_hex(), key, bad).ok()) << "byte " << i;
  }
  const Status unsigned_object = VerifyObjectSignature(signer->public_hex(), key, frames);
  EXPECT_EQ(unsigned_object.code(), Code::kDataLoss);
  EXPECT_NE(unsigned_object.message().find("not signed"), std::string::npos) << unsigned_object.ToString();
  for (const std::string& bad_key : std::vector<std::string>{"", "00", std::string(64, 'g'), std::string(63, '0')})
    EXPECT_EQ(VerifyObjectSignature(bad_key, key, object).code(), Code::kInvalidArgument) << bad_key;
}

// A relay that an attacker feeds: for every frame object key of an attempt
// it delivers a forged object whose frames are valid (the attempt's delta id
// and class, the receiver's base digests, checksums right) but move the
// receiver to the attacker's bits. Three kinds, key by key: unsigned,
// signed by the attacker's own key, and the attacker's frames under a
// genuine trailer copied from the store.
class ForgingRelay final : public FrameObjectSource {
 public:
  ForgingRelay(Store& store, std::function<std::string(const std::string& prefix)> forge)
      : store_(store), forge_(std::move(forge)) {}

  std::map<std::string, std::string> Take(std::string_view prefix) override {
    std::lock_guard lock(mu_);
    std::map<std::string, std::string> out;
    const std::string p(prefix);
    if (!p.ends_with("/") || p.find("/frames/") != std::string::npos) return out;
    auto listed = store_.List(p + "frames/");
    if (!listed.ok()) return out;
    for (const ObjectInfo& o : *listed) {
      if (!delivered_.insert(o.key).second) continue;
      const std::string frames = forge_(p);
      if (frames.empty()) continue;
      std::string object;
      switch ((delivered_.size() - 1) % 3) {
        case 0: object = frames; break;
        case 1: object = attacker_.Sign(o.key, frames); break;
        case 2: {
          auto genuine = store_.Get(o.key);
          if (!genuine.ok() || genuine->size() < kObjectTrailerBytes) continue;
          object = frames + genuine->substr(genuine->size() - kObjectTrailerBytes);
          break;
        }
      }
      out[o.key] = std::move(object);
      last_ = std::chrono::steady_clock::now();
    }
    return out;
  }
  bool Attached() override { return true; }
  std::chrono::steady_clock::time_point LastDelivery() override {
    std::lock_guard lock(mu_);
    return last_;
  }
  size_t delivered() {
    std::lock_guard lock(mu_);
    return delivered_.size();
  }

 private:
  Store& store_;
  std::function<std::string(const std::string&)> forge_;
  ObjectSigner attacker_ = *ObjectSigner::Generate();
  std::mutex mu_;
  std::set<std::string> delivered_;
  std::chrono::steady_clock::time_point last_{};
};

TEST_F(ProtocolTest, ForgedRelayedObjectsAreRefusedAndTheCommittedBitsApplied) {
  PublishOptions o = Fast();
  o.segment_bytes = 4096;  // many frame objects, each forged
  ASSERT_TRUE(Publisher(*store_, Path("state"), o).Publish(0, Version(0)).ok());
  // The attacker's frames: version 3's bits against version 0 (what the
  // receiver holds), in the attempt's chunking, class and delta id.
  auto forge = [&](const std::string& prefix) -> std::string {
    auto text = store_->Get(prefix + "attempt.json");
    if (!text.ok()) return "";
    auto doc = nlohmann::json::parse(*text);
    DeltaOptions d;
    d.chunk_elements = o.delta.chunk_elements;
    d.delta_id = std::strtoull(doc["delta_id"].get<std::string>().c_str(), nullptr, 16);
    d.encode.delta_class = DeltaClass::kXorClass;
    Checkpoint base = Version(0), next = Version(3);
    auto m = StartDelta(base, next, d);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    std::string frames;
    const auto chunks = AllChunks(*m);
    auto enc = EncodeFrames(base, next, *m, chunks, d.encode, [&](std::string_view f) {
      frames.append(f);
      return Status::Ok();
    });
    EXPECT_TRUE(enc.ok()) << enc.status().ToString();
    return frames;
  };
  ForgingRelay relay(*store_, forge);
  std::mutex mu;
  std::vector<std::string> lines;
  FollowOptions fo = Receiver("r");
  fo.relay = &relay;
  fo.relay_quiet = std::chrono::milliseconds(50);  // then the store: the forger never delivers the real objects
  fo.log = [&](const std::string& l) {
    std::lock_guard lock(mu);
    lines.push_back(l);
  };
  Status followed;
  auto r = PublishWhileFollowing(fo, o, 1, &followed);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  EXPECT_EQ(r->attempts, 1u) << "the receiver nacked the first attempt";
  EXPECT_EQ(r->acked, std::vector<std::string>{"r"});
  ExpectIdentical(Path("r"), 1);
  EXPECT_GE(relay.delivered(), 6u) << "too few frame objects to forge every kind";
  std::lock_guard lock(mu);
  const std::string refused = FirstLine(lines, "refused an object the relay delivered");
  EXPECT_NE(refused.find("not signed"), std::string::npos) << fmt::format("{}", fmt::join(lines, "\n"));
  size_t forged_signature = 0;
  for (const auto& l : lines)
    if (l.starts_with("refused an object") && l.find("not by the attempt's publisher") != std::string::npos)
      ++forged_signature;
  EXPECT_GE(forged_signature, 1u) << fmt::format("{}", fmt::join(lines, "\n"));
  const std::string used = FirstLine(lines, "version 1 attempt");
  EXPECT_NE(used.find(": frame objects 0/"), std::string::npos)
      << "an object from the forging relay was used: " << used;
  EXPECT_NE(used.find(fmt::format("; {} relayed objects refused", relay.delivered())), std::string::npos) << used;
}

// A relay tree in one process: what the publisher hands it is delivered to
// the follower at once. Counts the follower's idle waits for news.
class LoopbackTree final : public FrameObjectSink, public FrameObjectSource {
 public:
  void Object(const std::string& key, std::string_view bytes) override {
    std::lock_guard lock(mu_);
    ready_[key] = std::string(bytes);
    last_ = std::chrono::steady_clock::now();
    Arrived();
  }
  void Fence(const std::string&) override {
    std::lock_guard lock(mu_);
    Arrived();
  }
  void Notice(const std::string&) override {
    std::lock_guard lock(mu_);
    ++notices_;
    Arrived();
  }
  std::map<std::string, std::string> Take(std::string_view prefix) override {
    std::lock_guard lock(mu_);
    std::map<std::string, std::string> out;
    for (auto it = ready_.lower_bound(std::string(prefix)); it != ready_.end() && it->first.starts_with(prefix);)
      out.insert(ready_.extract(it++));
    return out;
  }
  bool Attached() override { return attached_.load(); }
  std::chrono::steady_clock::time_point LastDelivery() override {
    std::lock_guard lock(mu_);
    return last_;
  }
  uint64_t Notices() override {
    std::lock_guard lock(mu_);
    return notices_;
  }
  uint64_t AwaitNews(uint64_t seen, std::chrono::milliseconds wait) override {
    std::unique_lock lock(mu_);
    if (news_ == seen) {
      ++idle_waits_;
      cv_.notify_all();
      cv_.wait_for(lock, wait, [&] { return news_ != seen; });
    }
    return news_;
  }
  // Blocks until the follower has waited for news `n` more times than now.
  void AwaitIdleWaits(uint64_t n) {
    std::unique_lock lock(mu_);
    const uint64_t target = idle_waits_ + n;
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(60), [&] { return idle_waits_ >= target; }))
        << "the follower did not wait on the tree (idle waits " << idle_waits_ << ")";
  }
  std::atomic<bool> attached_{true};

 private:
  void Arrived() {
    ++news_;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> ready_;
  std::chrono::steady_clock::time_point last_{};
  uint64_t news_ = 0, notices_ = 0, idle_waits_ = 0;
};

// In a relay tree that carries the coordinator's notices, an idle follower
// does not poll the store: it looks when the tree says an attempt opened or
// a version was committed, or something arrived. Its backstop poll is an
// hour here, so each version is reached through the notices alone; while
// it waits between versions it makes no store request, whatever its `poll`;
// once the tree is detached, it polls the store again.
TEST_F(ProtocolTest, AFollowerInATreeLooksAtTheStoreWhenTheTreeSaysSo) {
  PublishOptions o = Fast();
  o.segment_bytes = 1024;  // dozens of frame objects per version, none of which may cost a request
  LoopbackTree tree;
  o.relay = &tree;
  Publisher pub(*store_, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::atomic<int> looks{0};  // the follower's listings of attempts and reads of commit records
  std::atomic<int> requests{0};  // every read and listing of the follower's
  HookStore counted(*store_, [&](std::string_view op, std::string_view key, bool) {
    if ((op == "list" && key.starts_with("attempts/")) || (op == "read" && key.starts_with("commits/"))) ++looks;
    if (op == "list" || op == "read") ++requests;
    return Status::Ok();
  });
  FollowOptions fo = Receiver("r");
  fo.poll = std::chrono::milliseconds(2);
  Status followed;
  std::thread t = FollowInTree(counted, tree, fo, 4, &followed);
  for (int v = 1; v <= 3; ++v) {
    const int requests_before = requests.load();
    auto r = pub.Publish(v, Version(v));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->acked, std::vector<std::string>{"r"});
    tree.AwaitIdleWaits(2);  // it has looked after the commit's notice, and is idle
    auto objects = store_->List(run_keys::Attempt(v, r->attempt) + "frames/");
    ASSERT_TRUE(objects.ok());
    EXPECT_GE(objects->size(), 20u);
    // From v2 on (v1's first notice is what puts it in the tree's hands):
    // three notices (opened, manifest, committed), at most a look of two
    // requests at each and one at the next version; attempt.json and the
    // manifest; none per frame object.
    if (v >= 2) {
      EXPECT_LE(requests.load() - requests_before, 10)
          << "version " << v << ", " << objects->size() << " frame objects: the follower made "
          << requests.load() - requests_before << " store requests";
    }
    const int before = looks.load();
    tree.AwaitIdleWaits(50);  // at least 100 ms, 50 polls' worth
    EXPECT_EQ(looks.load(), before) << "version " << v << ": the idle follower looked at the store";
  }
  tree.attached_ = false;
  const int detached = looks.load();
  auto r = pub.Publish(4, Version(4));  // the ack needs a look: no wait for news any more
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  t.join();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  EXPECT_GT(looks.load(), detached);
  ExpectIdentical(Path("r"), 4);
}

// Notices are hints that anyone who can send into the tree can repeat: a
// flood of them makes the follower look at the store no more often than
// its polls without a tree would (once per min(stream_poll, poll)), and
// still makes it look.
TEST_F(ProtocolTest, AFloodOfNoticesCostsTheStoreNoMoreThanPolling) {
  PublishOptions o = Fast();
  LoopbackTree tree;
  o.relay = &tree;
  Publisher pub(*store_, Path("state"), o);
  ASSERT_TRUE(pub.Publish(0, Version(0)).ok());
  std::atomic<int> lists{0};
  HookStore counted(*store_, [&](std::string_view op, std::string_view key, bool) {
    if (op == "list" && key.starts_with("attempts/")) ++lists;
    return Status::Ok();
  });
  FollowOptions fo = Receiver("r");
  fo.poll = fo.stream_poll = std::chrono::milliseconds(50);
  Status followed;
  std::thread t = FollowInTree(counted, tree, fo, 2, &followed);
  auto r = pub.Publish(1, Version(1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  tree.AwaitIdleWaits(2);  // in the tree's hands, idle
  const int before = lists.load();
  const auto start = std::chrono::steady_clock::now();
  int sent = 0;
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500)) {
    tree.Notice(run_keys::Commit(2));
    ++sent;
    std::this_thread::yield();
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  tree.AwaitIdleWaits(1);  // the looks the flood made are done
  const int looked = lists.load() - before;
  EXPECT_GE(looked, 1) << "the notices made no look";
  EXPECT_LE(looked, elapsed / std::chrono::milliseconds(50) + 2)
      << sent << " notices in " << std::chrono::duration<double>(elapsed).count() << " s";
  ASSERT_TRUE(pub.Publish(2, Version(2)).ok());
  t.join();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  ExpectIdentical(Path("r"), 2);
}

// Acks that come up the relay tree count only as the store holds them: a
// forged nack does not abort the attempt, and a forged ack for a receiver
// that never acked is not listed in the commit.
class ForgingAckTransport final : public FrameObjectSink {
 public:
  explicit ForgingAckTransport(Store& store) : store_(store) {}
  void Object(const std::string&, std::string_view) override {}
  void Fence(const std::string&) override {}
  bool CarriesAcks() override { return true; }
  std::vector<AckRecord> TakeAcks(const std::string& prefix, std::chrono::milliseconds) override {
    // Once r's real ack is in (so that what the forged nack names is fixed).
    if (forged_.count(prefix) || !store_.Head(prefix + "acks/r.json").ok()) return {};
    forged_.insert(prefix);
    auto m = StoredManifest(store_, prefix + "manifest.bin");
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    AckRecord nack{"r", false, {}, "forged: apply failed", {}};
    AckRecord ghost{"ghost", true, m->target_digest, "", {}};
    AckRecord traversal{"../../../receivers/r", true, m->target_digest, "", {}};
    return {nack, ghost, traversal};
  }

 private:
  Store& store_;
  std::set<std::string> forged_;
};

TEST_F(ProtocolTest, AcksFromTheTreeCountOnlyAsTheStoreHoldsThem) {
  PublishOptions o = Fast();
  ASSERT_TRUE(Publisher(*store_, Path("state"), o).Publish(0, Version(0)).ok());
  ForgingAckTransport tree(*store_);
  o.relay = &tree;
  Status followed;
  auto r = PublishWhileFollowing(Receiver("r"), o, 1, &followed);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(followed.ok()) << followed.ToString();
  EXPECT_EQ(r->attempts, 1u) << "a forged nack aborted the attempt";
  EXPECT_EQ(r->acked, std::vector<std::string>{"r"});
  EXPECT_EQ(r->relay_acks_unconfirmed, 2u);  // ghost and the traversal; r's forged nack led to r's real ack
  auto commit = store_->Get(run_keys::Commit(1));
  ASSERT_TRUE(commit.ok());
  auto c = CommitRecord::FromJson(*commit, "commit");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->acked, std::vector<std::string>{"r"});
  ExpectIdentical(Path("r"), 1);
}

}  // namespace
}  // namespace dcr
