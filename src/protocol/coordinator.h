// The coordinator's part of a publish, shared by the publisher of a
// checkpoint (publisher.cc) and of trainer processes' shards
// (shard_publisher.cc): attempt ids, fences, the wait for acks and the
// commit (docs/protocol.md). Not public API.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "dcr/publisher.h"

namespace dcr::protocol_internal {

std::string DefaultCoordinatorId();  // host-pid
std::string RandomHex(int digits);
// A random nonzero delta id.
uint64_t NewDeltaId();

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

  // Runs attempts of version v, each under the next attempt id and class,
  // until one commits (Ok) or max_attempts were fenced (kAborted naming the
  // last failure), counting them in report->attempts. `after_fenced` runs
  // after each fenced attempt: an error stops the retries.
  using Attempt = std::function<Result<AttemptResult>(const std::string& id, DeltaClass cls)>;
  Status RunAttempts(uint64_t v, PublishReport* report, const Attempt& attempt,
                     const std::function<Status()>& after_fenced = nullptr);
  // Writes attempt `id`'s attempt.json (create-if-absent) and tells the
  // relay tree, whose receivers then look at the store.
  Status OpenAttempt(uint64_t v, const std::string& id, const AttemptRecord& record);
  // Attempt `id`'s frames are written: reports the manifest's sizes, writes
  // it (fault points "frames-written" before, "manifest-written" after) and
  // commits as AwaitAcksAndCommit.
  Result<AttemptResult> PublishManifest(uint64_t v, const std::string& id, DeltaManifest m, PublishReport* report,
                                        DeltaManifest* manifest_out);

 private:
  // Waits for the acks of attempt `id` (manifest `m`, written), then commits.
  Result<AttemptResult> AwaitAcksAndCommit(uint64_t v, const std::string& id, DeltaManifest m, PublishReport* report,
                                           DeltaManifest* manifest_out);
  // After attempt `id`: true when it committed; false when it failed and was
  // fenced (`*last_failure` says why: retry); an error that retrying cannot
  // help (another coordinator's bits, a wrong version or baseline).
  Result<bool> Settle(uint64_t v, const std::string& id, Result<AttemptResult> result, Status* last_failure);
  Status Fence(uint64_t v, const std::string& id, const Status& why);

  Store& store_;
  const PublishOptions& o_;
  bool cancelled_ = false;  // o_.cancel stopped an attempt's wait: no retry
};

}  // namespace dcr::protocol_internal
