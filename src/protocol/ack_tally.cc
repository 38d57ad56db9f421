#include "ack_tally.h"

#include <fmt/format.h>

namespace dcr::protocol_internal {

void AckTally::Take(const AckRecord& ack, bool via_tree) {
  if (refused_) return;
  if (!ack.ok) {
    refused_ = Aborted(fmt::format("receiver {} failed: {}", ack.receiver, ack.error));
    return;
  }
  if (ack.engine.ranks == 0) {
    if (ack.digest != target_) {
      refused_ = Aborted(fmt::format("receiver {} acked digest {}, not the target {}", ack.receiver, ack.digest.ToHex(),
                                     target_.ToHex()));
      return;
    }
    if (acked_.insert(ack.receiver).second && via_tree) from_tree_.insert(ack.receiver);
    return;
  }
  EngineAcks& e = engines_[ack.engine.engine];
  if (e.ranks.empty()) e.ranks.resize(ack.engine.ranks);
  if (e.ranks.size() != ack.engine.ranks || e.ranks[ack.engine.rank]) {
    refused_ =
        Aborted(fmt::format("engine {}: receiver {} acked as rank {} of {}, which another ack of the engine "
                            "contradicts (rank count {}, or that rank already acked); each rank of an engine "
                            "needs its own rank and the same rank count",
                            ack.engine.engine, ack.receiver, ack.engine.rank, ack.engine.ranks, e.ranks.size()));
    return;
  }
  e.ranks[ack.engine.rank] = ack.receiver;
  e.sum += ack.digest;
  if (++e.acked < e.ranks.size()) return;
  if (e.sum != target_) {
    refused_ = Aborted(fmt::format("engine {}: its {} ranks' partial digests add up to {}, not the target {}",
                                   ack.engine.engine, e.ranks.size(), e.sum.ToHex(), target_.ToHex()));
    return;
  }
  for (const auto& rank_id : e.ranks) acked_.insert(*rank_id);
}

}  // namespace dcr::protocol_internal
