// The acks of one attempt, counted as they are read (docs/protocol.md,
// "Publishing version v" and "Engines of several ranks").
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcr/frame_transport.h"

namespace dcr::protocol_internal {

// Which receivers acked the attempt's target digest, and the first reason it
// cannot commit (a nack, another digest, contradicting ranks). A whole
// receiver counts when its digest is the target; the ranks of an engine
// count together once every rank acked and their partial digests add up to
// the target. After the first refusal nothing more is counted.
class AckTally {
 public:
  explicit AckTally(const Digest& target) : target_(target) {}

  // Counts `ack`, read from the store; `via_tree`: looked up there because
  // the relay tree carried it first.
  void Take(const AckRecord& ack, bool via_tree);

  const std::optional<Status>& refused() const { return refused_; }
  bool Acked(const std::string& receiver) const { return acked_.count(receiver) > 0; }
  const std::set<std::string>& acked() const { return acked_; }
  // Of acked(), those the tree carried before the store poll found them.
  size_t from_tree() const { return from_tree_.size(); }

 private:
  struct EngineAcks {
    std::vector<std::optional<std::string>> ranks;  // receiver id per rank, once acked
    size_t acked = 0;
    Digest sum;  // of the acked ranks' partial digests
  };
  const Digest target_;
  std::set<std::string> acked_, from_tree_;
  std::map<std::string, EngineAcks> engines_;
  std::optional<Status> refused_;
};

}  // namespace dcr::protocol_internal
