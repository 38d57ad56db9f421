// The receivers' local journals (docs/protocol.md): what a follower's target
// or a rank's buffers hold, and which chunks a rank's attempt has written.
// They are files this process wrote, but a disk, a crash or a person can
// leave anything there: parsing refuses what this code would not write.
// Not public API.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "dcr/frame_transport.h"
#include "dcr/mapped_file.h"

namespace dcr::receiver_internal {

inline std::string_view AsText(const MappedFile& f) {
  return {reinterpret_cast<const char*>(f.data().data()), f.data().size()};
}

// TARGET/.dcr-follow.json: the run, the committed version the target holds,
// and the attempt being applied (empty when none): a restart after a crash
// mid-apply knows the bits may be between versions.
struct FollowJournal {
  std::string run_id, receiver, attempt;
  uint64_t version = 0;
  friend bool operator==(const FollowJournal&, const FollowJournal&) = default;
};
// kInvalidArgument naming `path` unless `text` is such a journal.
Result<FollowJournal> ParseFollowJournal(std::string_view text, const std::string& path);
std::string FollowJournalJson(const FollowJournal& j);

// DIR/.dcr-rank.json: what the rank's buffers hold. `digest` is the rank's
// partial digest at `version` (its share of the committed digest). `attempt`
// names the attempt of version + 1 that last touched the buffers (empty:
// none), with its state (applying: it may be half applied; applied; failed)
// and the partial digest it left.
struct RankJournal {
  std::string run_id, receiver;
  EngineRank rank;
  uint64_t version = 0;
  Digest digest;
  std::string attempt, attempt_state;
  Digest attempt_digest;
};
Result<RankJournal> ParseRankJournal(std::string_view text, const std::string& path);
std::string RankJournalJson(const RankJournal& j);

// DIR/.dcr-rank-frames: what the journal's attempt did to the buffers, chunk
// by chunk, so that a restarted rank applies no frame twice. The first line
// names the attempt; then, before each batch, "b TENSOR CHUNK DIGEST" for
// every chunk it will write (the rank's partial digest before), and after
// it "t TENSOR CHUNK DIGEST" for those written (the partial after). Lines
// are appended whole: a process killed mid-write leaves at most a torn last
// line (no newline), which is ignored.
using ChunkKey = std::pair<uint32_t, uint32_t>;  // tensor, chunk
struct LoggedChunk {
  Digest base;
  std::optional<Digest> target;
  friend bool operator==(const LoggedChunk&, const LoggedChunk&) = default;
};
using FrameLog = std::map<ChunkKey, LoggedChunk>;
std::string FrameLogHeader(const std::string& attempt);
std::string FrameLogLine(char kind, const ChunkKey& chunk, const Digest& d);  // kind 'b' or 't'
// The chunks a log of `attempt` records; nullopt when the log is of another
// attempt or holds a line this code does not write (then nothing is known).
std::optional<FrameLog> ParseFrameLog(std::string_view text, const std::string& attempt);

}  // namespace dcr::receiver_internal
