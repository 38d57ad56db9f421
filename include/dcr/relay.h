// The relay tree (DESIGN sections 3 and 5; docs/relay.md): daemons that carry
// the frame objects of the protocol's attempts (attempts/v<N>/<attempt>/
// frames/s<K>-<NNNN>.bin) from the senders into each destination cluster
// once, then down a tree to the receivers, while the store stays the control
// plane (manifests, acks, fences, commits) and the receivers' fallback.
//
//   PlanTree           the tree's shape as data (pure)
//   EncodeMessage /
//   DecodeMessage      the wire messages (pure; fuzzed by tests/fuzz/relay_message_fuzz.cc)
//   VerifyFrameObject  what every hop checks before doing anything with an object
//   RunRelay           the daemon (`dcr relay`)
//   RelayReceiver      a follower's attachment to a relay (FrameObjectSource)
//   RelaySender        a publisher's push into the tree's roots (FrameObjectSink)
//
// Transport: ZeroMQ (libzmq's C API, so that errors stay values) over TCP,
// ROUTER at a relay, DEALER at its clients; CurveZMQ authenticates peers and
// encrypts every message when keys are configured (RelaySecurity).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/frame_transport.h"
#include "dcr/status.h"
#include "dcr/store.h"

namespace dcr {

// ---- Tree plans ---------------------------------------------------------------

struct RelaySpec {
  std::string id;  // unique, [A-Za-z0-9._-]{1,64}
  std::string address;  // where it listens, e.g. tcp://10.0.0.7:7400
  std::string cluster;  // the destination cluster it serves
};

struct TreePlan {
  struct Node {
    RelaySpec relay;
    std::optional<size_t> parent;  // index into nodes; none at a cluster's root
    std::vector<size_t> children;  // indices into nodes
    uint32_t depth = 0;  // 0 at a root
  };
  uint32_t fanout = 0;
  std::vector<Node> nodes;  // clusters in name order, each breadth first from its root
  std::vector<size_t> roots;  // one per cluster, in cluster order
  uint32_t depth = 0;  // the deepest node's depth

  // The node with this id, or nullptr.
  const Node* Find(std::string_view id) const;
  // The addresses `id` attaches to, in order: its parent, then each ancestor
  // up to its root (empty at a root). A child whose parent dies attaches to
  // the next; past the root it falls back to the store.
  std::vector<std::string> Upstream(std::string_view id) const;
  std::string ToJson() const;
};

// The tree: one root per cluster (the senders push each frame object once
// into every root, so the payload crosses into each destination cluster
// once), and within a cluster, in id order, node i's parent is node
// (i - 1) / fanout (a complete fanout-ary tree, depth ceil(log_fanout)).
// Pure: the same relays in any order and fanout give the same plan. To
// replan after losing a node, plan again without it (PlanTreeWithout).
// Errors: kInvalidArgument (fanout 0, an empty list, an id that is empty,
// malformed or repeated, an empty address or cluster, a repeated address).
Result<TreePlan> PlanTree(std::vector<RelaySpec> relays, uint32_t fanout);
Result<TreePlan> PlanTreeWithout(const std::vector<RelaySpec>& relays, const std::set<std::string>& lost,
                                 uint32_t fanout);
// A relay list as JSON: [{"id", "address", "cluster"}, ...] (`dcr relay plan`).
Result<std::vector<RelaySpec>> ParseRelayList(std::string_view json, const std::string& where);

// ---- Wire messages (docs/relay.md, byte by byte) --------------------------------

inline constexpr uint32_t kRelayMagic = 0x4C524344;  // "DCRL" little-endian
inline constexpr uint8_t kRelayWireVersion = 1;
inline constexpr size_t kRelayMaxIdBytes = 128;
inline constexpr size_t kRelayMaxKeyBytes = 1024;
inline constexpr uint32_t kRelayMaxHave = 1 << 16;
inline constexpr uint64_t kRelayMaxObjectBytes = 1ull << 30;
inline constexpr uint32_t kRelayMaxAcks = 1 << 16;  // entries in one ACK
// Per socket: no part of a message may be larger (ZMQ_MAXMSGSIZE; a peer
// that sends one is disconnected before anything is allocated for it), and
// a message of more parts is read, dropped and counted malformed.
inline constexpr uint64_t kRelayMaxPartBytes = kRelayMaxObjectBytes + (64ull << 20);
inline constexpr size_t kRelayMaxParts = 4;  // route, header, data, and one to tell a longer message
inline constexpr size_t kRelayMaxAckErrorBytes = 1024;  // a failed ack's error, truncated to this

enum class RelayMessageType : uint8_t {
  kHello = 1,  // client -> relay: who I am, which objects I already hold
  kObject = 2,  // a frame object (parent -> child, sender -> root)
  kCredit = 3,  // receiver of objects -> their sender: window returned
  kFence = 4,  // an attempt is obsolete: drop its objects (sender -> root -> down)
  kPing = 5,  // liveness, both ways
  kAck = 6,  // receivers' acks of an attempt (receiver -> relay -> up -> root -> senders)
  kNotice = 7,  // a record receivers wait for is in the store (sender -> root -> down); a hint, never trusted
};
enum class RelayRole : uint8_t { kRelay = 1, kReceiver = 2, kSender = 3 };
std::string_view RelayRoleName(RelayRole role);

struct RelayMessage {
  RelayMessageType type = RelayMessageType::kPing;
  // kHello
  RelayRole role = RelayRole::kReceiver;
  std::string id;
  std::vector<std::string> have;  // object keys
  // kObject: key, and the data's size and CRC32C as the sender computed them
  // (checked by VerifyFrameObject, not by DecodeMessage).
  std::string key;
  uint64_t size = 0;
  uint32_t crc = 0;
  std::string_view data;  // into the decoded parts
  // kCredit
  uint64_t credit_bytes = 0;
  uint32_t credit_objects = 0;
  // kFence: key holds the attempt prefix (attempts/v<N>/<attempt>/).
  // kNotice: key holds what was written: an attempt prefix (the attempt
  // opened, or its manifest written) or a commit record's key (commits/v<N>.json).
  // kAck: key holds the attempt prefix; the acks of receivers below the
  // sending peer (AckRecord: receiver id, ok, digest, error).
  std::vector<AckRecord> acks;
};

// The message's parts: [header] or, for kObject, [header, data].
std::vector<std::string> EncodeMessage(const RelayMessage& m);
// Parses parts received from a peer. Validates everything that needs no
// other state: magic, version, type, lengths, limits, and that keys are
// frame object keys (kObject, kHello's have) or attempt prefixes (kFence,
// kAck; an ACK's entries: ids of 1-128 bytes, digest lanes below the prime,
// errors of at most kRelayMaxAckErrorBytes, no receiver twice).
// Errors: kInvalidArgument (malformed, naming the field), kUnimplemented
// (a newer wire version).
Result<RelayMessage> DecodeMessage(std::span<const std::string_view> parts);

// "attempts/v<10 digits>/<4+ digits>-<hex>/frames/s<digits>-<digits>.bin":
// the attempt prefix ("attempts/v.../<attempt>/"), or kInvalidArgument.
Result<std::string> FrameObjectPrefix(std::string_view key);
// "attempts/v<10 digits>/<4+ digits>-<hex>/", or kInvalidArgument.
Status ValidateAttemptPrefix(std::string_view prefix);
// An attempt prefix or "commits/v<10 digits>.json", or kInvalidArgument.
Status ValidateNoticeKey(std::string_view key);

// What every hop checks before storing, forwarding or handing out an
// object: the data has the size and CRC32C the message claims, and it is a
// sequence of whole frames each of which parses with valid header and
// payload checksums (ParseFrame), then the publisher's signature trailer if
// any (checked by receivers, who hold the key: VerifyObjectSignature).
// kDataLoss naming the key and the offset.
Status VerifyFrameObject(const RelayMessage& object);

// ---- Security -------------------------------------------------------------------

struct CurveKeyPair {
  std::string public_key, secret_key;  // Z85, 40 characters each
};
Result<CurveKeyPair> GenerateCurveKeyPair();
// STEM.key (the pair, created mode 0600, atomically) and STEM.pub (the public key).
Status WriteCurveKeyFiles(const std::string& stem, const CurveKeyPair& pair);
// A .key file written by WriteCurveKeyFiles. Refused (kPermissionDenied,
// as ssh does) when others than its owner may read it.
Result<CurveKeyPair> ReadCurveKeyPair(const std::string& path);
// A .pub file, or the public key of a .key file.
Result<std::string> ReadCurvePublicKey(const std::string& path);
// The roles a peer's key may take at a relay: a bit per RelayRole.
using RelayRoles = uint8_t;
constexpr RelayRoles RoleBit(RelayRole role) { return static_cast<RelayRoles>(1u << static_cast<uint8_t>(role)); }
inline constexpr RelayRoles kAnyRelayRole =
    RoleBit(RelayRole::kRelay) | RoleBit(RelayRole::kReceiver) | RoleBit(RelayRole::kSender);
// "sender, receiver", "any role", "no role".
std::string RelayRolesName(RelayRoles roles);

// The peers a relay admits, one per line: "ROLE KEY" (ROLE: sender, relay or
// receiver; a key on several lines takes each role), or a bare "KEY", which
// takes any role. Lines starting with '#' are comments (Z85 keys may contain
// '#' themselves); blank lines are allowed.
Result<std::map<std::string, RelayRoles>> ReadCurveAllowList(const std::string& path);

// No keys: plain TCP, anyone who can connect is served (trusted networks
// only). With keys: every connection is CurveZMQ (authenticated, encrypted),
// and a relay takes a HELLO in a role only from a key its allow list admits
// in that role.
struct RelaySecurity {
  std::optional<CurveKeyPair> own;  // this process's keys
  std::string server_public;  // the relays it connects to (clients)
  std::map<std::string, RelayRoles> allowed;  // client keys a relay admits, and as what (servers)
  bool enabled() const { return own.has_value(); }
};

// From key files (empty names: not given): `key_file` this process's pair,
// `server_public_file` the relays' public key (default: the pair's own, for
// relays sharing one pair), `allow_file` the admitted peers (relays).
// Secure by default: no key file is refused unless `insecure` (plain TCP,
// no authentication; the relay and its clients warn at every start), and
// then neither other file may be given; a key file with `insecure` is refused.
// Errors name the inputs as `names` says (the caller's flags or arguments).
struct RelaySecurityNames {
  std::string key = "this process's key pair file", server_public = "the relays' public key file",
              allow = "the allow list", insecure = "insecure links";
};
Result<RelaySecurity> LoadRelaySecurity(const std::string& key_file, const std::string& server_public_file,
                                        const std::string& allow_file, bool insecure,
                                        const RelaySecurityNames& names = {});
// The line the relay and its clients log at every start without keys.
inline constexpr std::string_view kRelayInsecureWarning =
    "WARNING: insecure relay link (plain TCP): no peer is authenticated and nothing is encrypted; anyone who can "
    "connect can attach in any role (bits stay safe: receivers verify every object's signature). Use CURVE keys "
    "(dcr relay keygen) outside a trusted network";

// ---- The daemon ----------------------------------------------------------------

struct RelayOptions {
  std::string id;  // for logs, stats and HELLO
  std::string listen;  // bind address (tcp://host:port)
  std::vector<std::string> upstream;  // parent first, then ancestors; empty at a root
  RelaySecurity security;
  // Per child: bytes sent and not yet credited back (the in-memory window).
  uint64_t window_bytes = 64ull << 20;
  // Objects kept for re-attaching children and children whose window is
  // full; the oldest are evicted beyond this. A child that had not got an
  // evicted object fetches it from the store (drop and refetch).
  uint64_t cache_bytes = 1ull << 30;
  // With a directory: an object evicted from the cache while still queued
  // for a child is written here (at most spool_bytes in all) and sent from
  // disk when the child's window opens, instead of being dropped; past the
  // bound it is dropped (the store as last resort). Files are removed once
  // no child needs them, and any left from an earlier run at start.
  std::string spool_dir;
  uint64_t spool_bytes = 4ull << 30;
  std::chrono::milliseconds ping_every{250};
  std::chrono::milliseconds dead_after{1500};  // an upstream silent this long is left
  std::string stats_path;  // JSON rewritten about every second, and at exit
  // Bounds on what peers make a relay keep: attached children (HELLOs
  // beyond are refused), senders heard from, and the per-peer link counters
  // kept for stats (detached links are forgotten first beyond it).
  size_t max_children = 1024;
  size_t max_senders = 64;
  size_t max_links = 4096;
  // Benchmarks: pace each child link to this many bytes per second (an
  // in-process throttle standing in for a network link); 0: unlimited.
  double link_bytes_per_second = 0;
  std::function<void(const std::string&)> log;  // default stderr
  // When set, an object (from a sender or the upstream) is kept and
  // forwarded only if this returns OK for its key and bytes; others are
  // dropped, counted (stats: dropped_unverified) and logged. `dcr relay
  // --store` checks the publisher's signature (FrameObjectVerifier), so
  // that a forged copy pushed first cannot take the publisher's place.
  // Called on the relay's thread.
  std::function<Status(const std::string& key, std::string_view bytes)> verify_object;
  // Fault injection (the failure campaigns' corrupting link): called on the
  // relay's thread with each arriving object's key and bytes before they are
  // verified, and may change the bytes. The installed dcr never sets it.
  std::function<void(const std::string& key, std::string& bytes)> arrival_fault;
};

// Runs the relay until `stop` returns true (checked every few ms). Errors:
// kInvalidArgument (bad options), kUnavailable (cannot bind, naming the
// address); once running, peers' failures are logged, never fatal.
Status RunRelay(const RelayOptions& options, const std::function<bool()>& stop);

// ---- Clients ---------------------------------------------------------------------

struct RelayClientOptions {
  std::string id;
  std::vector<std::string> addresses;  // receivers: relay, then ancestors; senders: every root
  RelaySecurity security;
  std::chrono::milliseconds ping_every{250};
  std::chrono::milliseconds dead_after{1500};
  uint64_t window_bytes = 64ull << 20;  // senders: uncredited bytes per root
  double link_bytes_per_second = 0;  // senders: pace each root link (benchmarks); 0: unlimited
  // Senders: queued per root before the oldest are dropped. Receivers:
  // verified objects kept until taken, the oldest dropped beyond it.
  uint64_t max_queue_bytes = 1ull << 30;
  std::function<void(const std::string&)> log;
};

struct RelayClientStats {
  uint64_t objects = 0, bytes = 0;  // received (receivers) or credited (senders)
  uint64_t corrupt = 0, duplicates = 0, fenced = 0, dropped = 0, reattached = 0;
  uint64_t acks = 0;  // sent up (receivers; each once more after a re-attachment) or received from roots (senders)
  std::string attached;  // the address in use (receivers)
};

// A follower's attachment: runs a thread that attaches to addresses[0]
// (HELLO with the keys it holds), verifies every object, keeps it until the
// follower takes it, and moves to the next address when the current one is
// silent for dead_after (cycling, so a restarted relay is used again).
class RelayReceiver final : public FrameObjectSource {
 public:
  static Result<std::unique_ptr<RelayReceiver>> Start(RelayClientOptions options);
  ~RelayReceiver() override;
  std::map<std::string, std::string> Take(std::string_view prefix) override;
  bool Attached() override;
  std::chrono::steady_clock::time_point LastDelivery() override;
  uint64_t Notices() override;
  uint64_t AwaitNews(uint64_t seen, std::chrono::milliseconds wait) override;
  // Queues the ack for the relay (sent by the thread; the last 16 are sent
  // again after each re-attachment, since a relay that died may have lost them).
  void Ack(const std::string& attempt_prefix, const AckRecord& ack) override;
  RelayClientStats Stats();

  struct State;

 private:
  explicit RelayReceiver(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// A publisher's push: Object and Fence queue (copying) and return; a thread
// sends to every root within its credit window. A root that stops answering
// has its unanswered window written off (its receivers fetch from the store).
class RelaySender final : public FrameObjectSink {
 public:
  static Result<std::unique_ptr<RelaySender>> Start(RelayClientOptions options);
  ~RelaySender() override;  // waits up to 2 s for queued objects to be sent
  void Object(const std::string& key, std::string_view bytes) override;
  void Fence(const std::string& attempt_prefix) override;
  void Notice(const std::string& key) override;
  // Waits until every queued object was credited by every live root, or `timeout`.
  bool Flush(std::chrono::milliseconds timeout);
  // Acks that the roots passed up (each receiver's once per attempt).
  bool CarriesAcks() override { return true; }
  std::vector<AckRecord> TakeAcks(const std::string& attempt_prefix, std::chrono::milliseconds wait) override;
  RelayClientStats Stats();

  struct State;

 private:
  explicit RelaySender(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// ---- A root that pulls from the store ------------------------------------------------

// For a root relay inside the destination cluster (`dcr relay --pull-store
// URL`), so that senders only write to the store and the payload crosses
// into the cluster once, as the root's reads: every `every`, lists the
// attempts of the version after the newest committed one and hands each
// frame object not handed yet to `sink` (the root's own RelaySender), each
// attempt's fence once, and notices: each attempt once it is listed and once
// its manifest is, and each newest commit it finds. Store failures are logged and retried next
// round. Returns when `stop` is true.
Status PullFrameObjects(Store& store, FrameObjectSink& sink, std::chrono::milliseconds every,
                        const std::function<bool()>& stop, const std::function<void(const std::string&)>& log);

}  // namespace dcr
