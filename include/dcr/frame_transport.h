// What travels between the refit protocol and the transports that carry
// frame objects beside the store (the relay tree, include/dcr/relay.h): the
// objects' trailer, the acks, and the interfaces a transport implements.
// Part of the protocol module; dcr/run_records.h and dcr/publisher.h include it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/digest.h"
#include "dcr/status.h"

namespace dcr {

// Which rank of which engine a receiver is (docs/protocol.md, "Engines of
// several ranks"). ranks == 0: a receiver that holds the whole checkpoint
// (an engine of one rank, the JSON has no "engine" member).
struct EngineRank {
  std::string engine;
  uint32_t rank = 0, ranks = 0;
  friend bool operator==(const EngineRank&, const EngineRank&) = default;
};

// One stage of a process's way through a version (docs/metrics.md,
// "Timeline"): its name and its wall-clock unix seconds (each process's own
// clock).
struct StageSpan {
  std::string stage;
  double start = 0, end = 0;
  friend bool operator==(const StageSpan&, const StageSpan&) = default;
};

struct AckRecord {
  std::string receiver;
  bool ok = true;
  // The receiver's whole digest after applying; for a rank of an engine
  // (engine.ranks > 0), its partial digest over the canonical elements its
  // primary copies hold: the engine's ranks must add up to the target.
  Digest digest;
  std::string error;  // when !ok
  EngineRank engine;
  // The receiver's stages towards this version so far (download, apply,
  // and "ack": the instant it began writing this record). Store only: the
  // relay tree's ACK does not carry them.
  std::vector<StageSpan> spans;
  std::string ToJson() const;
  static Result<AckRecord> FromJson(std::string_view json, const std::string& where);
};

// The trailer every frame object an attempt writes ends with (docs/format.md
// section 4; signing: dcr/signing.h).
inline constexpr size_t kObjectTrailerBytes = 72;  // magic u32, version u8, algorithm u8, reserved u16, signature

// The frames of a frame object: all of it but its trailer, if it has one.
std::string_view ObjectFrames(std::string_view object);

// ---- Other transports for frame objects (the relay tree, include/dcr/relay.h) --
// The store stays the control plane (manifests, acks, fences, commits) and
// the record of every frame object; these interfaces let a faster transport
// carry the frame objects (attempts/v<N>/<attempt>/frames/...) beside it.

// Where a publisher hands each frame object once it is in the store, and
// each fence once written. Calls come from the publisher's threads and must
// not block for long (queue and return); a transport that cannot keep up
// drops objects, since receivers fetch what they lack from the store.
class FrameObjectSink {
 public:
  virtual ~FrameObjectSink() = default;
  virtual void Object(const std::string& key, std::string_view bytes) = 0;
  // `attempt_prefix` is run_keys::Attempt(v, attempt).
  virtual void Fence(const std::string& attempt_prefix) = 0;
  // A record that receivers wait for is in the store: an attempt opened or
  // its manifest written (its prefix), or a version committed (its commit
  // record's key). The
  // transport tells its receivers, who then look at the store instead of
  // polling it often; a transport without notices ignores it.
  virtual void Notice(const std::string& key) { (void)key; }
  // Acks of the attempt that came back through this transport and were not
  // taken yet, waiting up to `wait` for one when there are none. A
  // transport that carries no acks returns none at once (CarriesAcks false).
  virtual bool CarriesAcks() { return false; }
  virtual std::vector<AckRecord> TakeAcks(const std::string& attempt_prefix, std::chrono::milliseconds wait) {
    (void)attempt_prefix;
    (void)wait;
    return {};
  }
};

// Where a follower takes frame objects from before it downloads them from
// the store. Every object handed out has been verified (its checksum and
// every frame's). Thread-safe.
class FrameObjectSource {
 public:
  virtual ~FrameObjectSource() = default;
  // Moves out every object received so far whose key starts with `prefix`
  // (full key -> bytes).
  virtual std::map<std::string, std::string> Take(std::string_view prefix) = 0;
  // True while the source is attached to a peer that answers: objects may
  // still be on their way.
  virtual bool Attached() = 0;
  // When the last object arrived (steady clock; epoch when none has).
  virtual std::chrono::steady_clock::time_point LastDelivery() = 0;
  // How many notices (FrameObjectSink::Notice) and fences arrived so far; 0
  // for a transport that carries none. Either only says when to look at the
  // store.
  virtual uint64_t Notices() { return 0; }
  // Waits up to `wait` until more than `seen` arrivals (objects, fences,
  // notices) are counted, and returns the count (call again with it). A
  // transport that carries no notices returns `seen` at once.
  virtual uint64_t AwaitNews(uint64_t seen, std::chrono::milliseconds wait) {
    (void)wait;
    return seen;
  }
  // The follower's ack of an attempt, after it is in the store: a transport
  // may carry it to the coordinator (the relay tree does). Must not block.
  virtual void Ack(const std::string& attempt_prefix, const AckRecord& ack) {
    (void)attempt_prefix;
    (void)ack;
  }
};

}  // namespace dcr
