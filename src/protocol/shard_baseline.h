// A trainer process's baseline: its local senders' shards at a committed
// version. Not public API.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dcr/layout_apply.h"
#include "dcr/run_records.h"
#include "dcr/shard_publisher.h"
#include "dcr/store.h"
#include "internal.h"

namespace dcr::protocol_internal {

// What a ShardPublisher's last publish left in its state directory: the
// shards record it wrote, and the shard files, still open. While the record
// names the same version, senders and digest, the next publish trusts the
// files without a digest pass and without mapping them again (the directory
// is locked while publishing). Forgotten when a publish fails, so that a
// damaged baseline is found.
struct ShardsMemo {
  bool valid = false;
  std::string dir;
  ShardsState state;
  std::vector<RankBufferFiles> shards;
};

// The local senders' shards at a committed version: buffer files under
// `state_dir`/shards/s<K> (K: the global sender index), and the shards record
// naming the run, version, senders and their partial digest. Opened (trusted
// from the memo, else checked against the record's digest), caught up from
// the committed deltas, or rebuilt from the newest snapshot through the maps.
// With every sender local, each load is checked against the commit's digest;
// with several processes, by the coordinator's sum of their partials.
class ShardBaseline {
 public:
  ShardBaseline(Store& store, const std::string& state_dir, const RunRecord& run, std::span<const ShardSource> local,
                const std::vector<uint32_t>& local_ids, bool every_sender, ShardsMemo& memo)
      : store_(store),
        state_dir_(state_dir),
        run_(run),
        local_(local),
        local_ids_(local_ids),
        every_sender_(every_sender),
        memo_(memo) {}

  // The shards at committed version `want`, opened, caught up or rebuilt.
  Status Load(const CommitRecord& want);
  // The local senders' current buffers (which hold v) become the baseline at
  // v, whose partial digest is `partial`.
  Status Move(uint64_t v, const Digest& partial);
  // The shards are created anew from the current buffers, which hold
  // committed version `version` (digest checked by the caller).
  Status Adopt(uint64_t version, const Digest& digest);
  // After a publish that succeeded: the shards stay open in the memo.
  void KeepOpen();

  PlacedRank Placed(size_t local_sender) { return shards_[local_sender].placed(); }
  std::vector<PlacedRank> Placed();
  uint64_t bytes();

 private:
  Status OpenOrRebuild(const CommitRecord& want);
  // The shards the record names, opened and caught up to `want`; false when
  // there are none or they cannot be trusted (then they are rebuilt).
  Result<bool> OpenRecorded(const CommitRecord& want, std::vector<RankBufferFiles> remembered);
  Status ApplyCommitted(uint64_t from, uint64_t to);
  Status WriteRecord(uint64_t version, const Digest& digest);
  Status CreateShards();
  void CopyCurrent();
  Digest SendersDigest();

  Store& store_;
  const std::string& state_dir_;
  const RunRecord& run_;
  std::span<const ShardSource> local_;
  const std::vector<uint32_t>& local_ids_;  // global index of each local sender
  const bool every_sender_;
  ShardsMemo& memo_;  // the publisher's, across its publishes
  std::vector<RankBufferFiles> shards_;
};

}  // namespace dcr::protocol_internal
