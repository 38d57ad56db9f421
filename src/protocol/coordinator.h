// The coordinator's part of a publish, shared by the publisher of a
// checkpoint (publisher.cc) and of trainer processes' shards
// (shard_publisher.cc): attempt ids, fences, the wait for acks and the
// commit (docs/protocol.md). Not public API.
#pragma once

#include <string>
#include <string_view>

#include "dcr/protocol.h"

namespace dcr::protocol_internal {

std::string DefaultCoordinatorId();  // host-pid
std::string RandomHex(int digits);
// A random nonzero delta id.
uint64_t NewDeltaId();

// The id and class of a version's attempt number `seq`: the first is xor
// class; every retry (and a version someone already tried) is overwrite,
// which repairs receivers whatever part of a failed attempt they applied.
std::string NextAttempt(size_t seq, DeltaClass* cls);

// The injected fault at `point`, if any (PublishOptions::fault).
inline Status Fault(const PublishOptions& o, std::string_view point) { return o.fault ? o.fault(point) : Status::Ok(); }

// The publisher's state directory: `configured`, or the default for the store.
Result<std::string> PublisherStateDir(const std::string& configured, Store& store);

// One publish call's coordination of attempts of a version.
class AttemptCoordinator {
 public:
  struct AttemptResult {
    bool committed = false;
    Status failure;  // why the attempt was fenced
  };
  AttemptCoordinator(Store& store, const PublishOptions& options) : store_(store), o_(options) {}

  // Waits for the acks of attempt `id` (manifest `m`, written), then commits.
  Result<AttemptResult> AwaitAcksAndCommit(uint64_t v, const std::string& id, DeltaManifest m, PublishReport* report,
                                           DeltaManifest* manifest_out);
  // After attempt `id`: true when it committed; false when it failed and was
  // fenced (`*last_failure` says why: retry); an error that retrying cannot
  // help (another coordinator's bits, a wrong version or baseline).
  Result<bool> Settle(uint64_t v, const std::string& id, Result<AttemptResult> result, Status* last_failure);
  Status Fence(uint64_t v, const std::string& id, const Status& why);

 private:
  Store& store_;
  const PublishOptions& o_;
  bool cancelled_ = false;  // o_.cancel stopped an attempt's wait: no retry
};

}  // namespace dcr::protocol_internal
