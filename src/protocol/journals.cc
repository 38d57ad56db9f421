// The receivers' local journals: parsing and formatting (journals.h).
#include "journals.h"

#include <fmt/format.h>

#include <charconv>
#include <limits>
#include <nlohmann/json.hpp>

#include "dcr/json.h"

namespace dcr::protocol_internal {

namespace {

nlohmann::json ParseObject(std::string_view text) {
  auto doc = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  return doc.is_object() ? doc : nlohmann::json();
}

bool IsString(const nlohmann::json& doc, const char* key) { return doc.contains(key) && doc[key].is_string(); }

// An unsigned integer member no larger than `max`.
bool GetUnsigned(const nlohmann::json& doc, const char* key, uint64_t max, uint64_t* out) {
  if (!doc.contains(key) || !doc[key].is_number_unsigned()) return false;
  *out = doc[key].get<uint64_t>();
  return *out <= max;
}

// A decimal uint32 with nothing else (from_chars: no sign, no spaces).
bool ParseU32(std::string_view s, uint32_t* out) {
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

Result<FollowJournal> ParseFollowJournal(std::string_view text, const std::string& path) {
  const nlohmann::json doc = ParseObject(text);
  FollowJournal j;
  if (!doc.is_object() || !IsString(doc, "run_id") || !IsString(doc, "receiver") || !IsString(doc, "attempt") ||
      !GetUnsigned(doc, "version", std::numeric_limits<uint64_t>::max(), &j.version))
    return InvalidArgument(path + ": does not parse; remove it and the checkpoint to rejoin from a snapshot");
  j.run_id = doc["run_id"].get<std::string>();
  j.receiver = doc["receiver"].get<std::string>();
  j.attempt = doc["attempt"].get<std::string>();
  return j;
}

std::string FollowJournalJson(const FollowJournal& j) {
  nlohmann::json doc = {{"run_id", j.run_id}, {"receiver", j.receiver}, {"version", j.version}, {"attempt", j.attempt}};
  return JsonText(doc, 1) + "\n";
}

Result<RankJournal> ParseRankJournal(std::string_view text, const std::string& path) {
  const nlohmann::json doc = ParseObject(text);
  auto bad = [&] {
    return InvalidArgument(path + ": does not parse; remove the directory's files to rejoin from a snapshot");
  };
  if (!doc.is_object()) return bad();
  for (const char* k : {"run_id", "receiver", "engine", "digest", "attempt", "attempt_state", "attempt_digest"})
    if (!IsString(doc, k)) return bad();
  RankJournal j;
  uint64_t rank = 0, ranks = 0;
  constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
  if (!GetUnsigned(doc, "rank", kU32, &rank) || !GetUnsigned(doc, "ranks", kU32, &ranks) || rank >= ranks ||
      !GetUnsigned(doc, "version", std::numeric_limits<uint64_t>::max(), &j.version))
    return bad();
  j.run_id = doc["run_id"].get<std::string>();
  j.receiver = doc["receiver"].get<std::string>();
  j.rank.engine = doc["engine"].get<std::string>();
  j.rank.rank = static_cast<uint32_t>(rank);
  j.rank.ranks = static_cast<uint32_t>(ranks);
  j.attempt = doc["attempt"].get<std::string>();
  j.attempt_state = doc["attempt_state"].get<std::string>();
  if (!Digest::FromHex(doc["digest"].get<std::string>(), &j.digest) ||
      !Digest::FromHex(doc["attempt_digest"].get<std::string>(), &j.attempt_digest))
    return bad();
  return j;
}

std::string RankJournalJson(const RankJournal& j) {
  nlohmann::json doc = {{"run_id", j.run_id},
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

}  // namespace dcr::protocol_internal
