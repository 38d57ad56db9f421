// The relay daemon's message handling driven by a script instead of a
// network (the fuzz target tests/fuzz/relay_daemon_fuzz.cc): messages from
// scripted peers go straight to the daemon's handlers, in order, and what it
// sends them arrives on real in-process sockets, where it is checked.
// Test-only: built into dcr_relay_testing, never into the dcr binary.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dcr/relay.h"

namespace dcr::relay_internal {

class ScriptedRelay {
 public:
  // A relay with options `o` (its listen address is replaced by a private
  // in-process one; with o.upstream, the upstream is an in-process address
  // nobody serves) and `peers` connected peers, routes "p0", "p1", ...
  // Timers are set far out, so that a script runs the same way every time.
  ScriptedRelay(RelayOptions o, size_t peers);
  ~ScriptedRelay();
  ScriptedRelay(const ScriptedRelay&) = delete;
  ScriptedRelay& operator=(const ScriptedRelay&) = delete;
  Status status() const { return status_; }  // of the set-up

  // Message `parts` from peer `peer` whose CURVE key is `key` (empty: none).
  void FromPeer(size_t peer, const std::string& key, std::vector<std::string> parts);
  // Message `parts` from the upstream (only with o.upstream).
  void FromUpstream(std::vector<std::string> parts);
  // One turn of the daemon's loop (sends, acks, timers).
  void Turn();
  // The messages peer `peer` received since the last call (each a list of parts).
  std::vector<std::vector<std::string>> Received(size_t peer);
  // The daemon's bounds and bookkeeping hold: children, senders, link
  // counters and refusal lines within their limits; the cache's byte count
  // is its objects'. Internal (naming what broke) otherwise.
  Status CheckInvariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Status status_;
};

}  // namespace dcr::relay_internal
