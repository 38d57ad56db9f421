// The receivers' local journals: parsing and formatting (journals.h).
#include "journals.h"

#include <fmt/format.h>

#include <charconv>
#include <limits>
#include <nlohmann/json.hpp>

#include "dcr/json.h"
#include "protocol/internal.h"

namespace dcr::receiver_internal {

using protocol_internal::DigestField;

namespace {

using json = nlohmann::ordered_json;

// A decimal uint32 with nothing else (from_chars: no sign, no spaces).
bool ParseU32(std::string_view s, uint32_t* out) {
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

Result<FollowJournal> ParseFollowJournal(std::string_view text, const std::string& path) {
  // Any flaw is the same advice: the journal cannot be trusted.
  const auto bad = [&](std::string_view what) {
    return InvalidArgument(
        fmt::format("{}: does not parse ({}); remove it and the checkpoint to rejoin from a snapshot", path, what));
  };
  DCR_ASSIGN_OR_RETURN(const json doc, ParseJsonObject(text, bad));
  const JsonFields f(doc, bad);
  FollowJournal j;
  DCR_ASSIGN_OR_RETURN(j.run_id, f.String("run_id"));
  DCR_ASSIGN_OR_RETURN(j.receiver, f.String("receiver"));
  DCR_ASSIGN_OR_RETURN(j.attempt, f.String("attempt"));
  DCR_ASSIGN_OR_RETURN(j.version, f.U64("version"));
  return j;
}

std::string FollowJournalJson(const FollowJournal& j) {
  json doc = {{"run_id", j.run_id}, {"receiver", j.receiver}, {"version", j.version}, {"attempt", j.attempt}};
  return JsonText(doc, 1) + "\n";
}

Result<RankJournal> ParseRankJournal(std::string_view text, const std::string& path) {
  const auto bad = [&](std::string_view what) {
    return InvalidArgument(
        fmt::format("{}: does not parse ({}); remove the directory's files to rejoin from a snapshot", path, what));
  };
  DCR_ASSIGN_OR_RETURN(const json doc, ParseJsonObject(text, bad));
  const JsonFields f(doc, bad);
  RankJournal j;
  DCR_ASSIGN_OR_RETURN(j.run_id, f.String("run_id"));
  DCR_ASSIGN_OR_RETURN(j.receiver, f.String("receiver"));
  DCR_ASSIGN_OR_RETURN(j.rank.engine, f.String("engine"));
  DCR_ASSIGN_OR_RETURN(const uint64_t rank, f.U64("rank"));
  DCR_ASSIGN_OR_RETURN(const uint64_t ranks, f.U64("ranks"));
  if (ranks > std::numeric_limits<uint32_t>::max() || rank >= ranks)
    return bad(fmt::format("rank {} of {} ranks", rank, ranks));
  j.rank.rank = static_cast<uint32_t>(rank);
  j.rank.ranks = static_cast<uint32_t>(ranks);
  DCR_ASSIGN_OR_RETURN(j.version, f.U64("version"));
  DCR_ASSIGN_OR_RETURN(j.digest, DigestField(f, "digest"));
  DCR_ASSIGN_OR_RETURN(j.attempt, f.String("attempt"));
  DCR_ASSIGN_OR_RETURN(j.attempt_state, f.String("attempt_state"));
  DCR_ASSIGN_OR_RETURN(j.attempt_digest, DigestField(f, "attempt_digest"));
  return j;
}

std::string RankJournalJson(const RankJournal& j) {
  json doc = {{"run_id", j.run_id},
              {"receiver", j.receiver},
              {"engine", j.rank.engine},
              {"rank", j.rank.rank},
              {"ranks", j.rank.ranks},
              {"version", j.version},
              {"digest", j.digest.ToHex()},
              {"attempt", j.attempt},
              {"attempt_state", j.attempt_state},
              {"attempt_digest", j.attempt_digest.ToHex()}};
  return JsonText(doc, 1) + "\n";
}

std::string FrameLogHeader(const std::string& attempt) { return "dcr-rank-frames " + attempt + "\n"; }

std::string FrameLogLine(char kind, const ChunkKey& chunk, const Digest& d) {
  return fmt::format("{} {} {} {}\n", kind, chunk.first, chunk.second, d.ToHex());
}

std::optional<FrameLog> ParseFrameLog(std::string_view text, const std::string& attempt) {
  const std::string header = FrameLogHeader(attempt);
  if (!text.starts_with(header)) return std::nullopt;
  text.remove_prefix(header.size());
  FrameLog out;
  // Whole lines only: what follows the last newline is a torn write.
  for (size_t nl; (nl = text.find('\n')) != std::string_view::npos; text.remove_prefix(nl + 1)) {
    const std::string_view line = text.substr(0, nl);
    // "K TENSOR CHUNK HEX", single spaces.
    const size_t s1 = line.find(' '), s2 = line.find(' ', s1 + 1), s3 = line.find(' ', s2 + 1);
    if (s1 != 1 || s2 == std::string_view::npos || s3 == std::string_view::npos) return std::nullopt;
    ChunkKey key;
    Digest d;
    if (!ParseU32(line.substr(2, s2 - 2), &key.first) || !ParseU32(line.substr(s2 + 1, s3 - s2 - 1), &key.second) ||
        !Digest::FromHex(line.substr(s3 + 1), &d))
      return std::nullopt;
    if (line[0] == 'b') out[key] = LoggedChunk{d, std::nullopt};
    else if (line[0] == 't' && out.count(key)) out[key].target = d;
    else return std::nullopt;
  }
  return out;
}

}  // namespace dcr::receiver_internal
