// Contribution objects (docs/format.md section 5): the ChunkContribution
// records one trainer process hands another, so that each chunk's owner can
// merge them (EncodeOwnedChunks) when the senders touching the chunk live in
// several processes (docs/protocol.md, "Trainer ranks in separate processes").
//
// One object per (writing process, reading process) pair and attempt. The
// writer canonicalises each record (covered ranges and changed positions
// ascending); the parser is strict: every count is checked against the bytes
// left before anything is allocated, the checksum (XXH3-64) covers every
// byte before it, and each record must name a chunk of the delta, a sender
// the writing process holds, and positions inside its covered ranges.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dcr/delta.h"
#include "dcr/layout_apply.h"
#include "dcr/status.h"

namespace dcr {

inline constexpr uint32_t kContributionFormatVersion = 1;
inline constexpr size_t kContributionHeaderBytes = 48;

// Who wrote an object, for whom, and for which delta (attempt).
struct ContributionHeader {
  uint64_t delta_id = 0;
  DeltaClass delta_class = DeltaClass::kXorClass;
  uint32_t from_process = 0, to_process = 0;
};

// Serialises `records` (any order; each canonicalised: covered ranges and
// changed positions sorted, bits moved along) for `manifest`'s tensors.
// kInvalidArgument when a record does not fit the manifest (tensor, chunk,
// bit lengths) or the header's class disagrees with it.
Result<std::string> WriteContributions(const ContributionHeader& header, const DeltaManifest& manifest,
                                       std::span<const ChunkContribution> records);

// Parses an object written by WriteContributions. `expect` is what the
// reader knows the object must be (delta id, class, from and to process);
// `from_senders` the global sender indices the writing process holds.
// Errors: kDataLoss (truncated, bad magic or checksum), kInvalidArgument
// (another version, header mismatch, a record that does not fit the delta or
// names a sender `from_senders` lacks, positions out of range or not
// increasing), each naming `where`.
Result<std::vector<ChunkContribution>> ParseContributions(std::span<const uint8_t> bytes,
                                                          const ContributionHeader& expect,
                                                          const DeltaManifest& manifest,
                                                          std::span<const uint32_t> from_senders,
                                                          const std::string& where);

}  // namespace dcr
