// Fuzzes the receivers' local journals (src/receiver/journals.h): a
// follower's .dcr-follow.json, a rank's .dcr-rank.json and its
// .dcr-rank-frames log, which a crash, a disk or a person may leave in any
// state. The first input byte picks the parser; the rest is the file. Any
// input must be refused or parse into a journal that formats back to a file
// parsing to the same journal (nothing lost or invented).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "journals.h"

using namespace dcr::receiver_internal;

namespace {

void FrameLogRoundTrip(std::string_view text) {
  const std::string attempt = "0001-0123abcd";
  auto log = ParseFrameLog(text, attempt);
  if (!log) return;
  // Written back as the rank writes it: the header, every chunk's base line,
  // then the target lines of those written.
  std::string again = FrameLogHeader(attempt);
  for (const auto& [key, chunk] : *log) again += FrameLogLine('b', key, chunk.base);
  for (const auto& [key, chunk] : *log)
    if (chunk.target) again += FrameLogLine('t', key, *chunk.target);
  auto back = ParseFrameLog(again, attempt);
  if (!back || *back != *log) std::abort();
  if (ParseFrameLog(again, "0002-0123abcd")) std::abort();  // another attempt's log says nothing
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: {
      auto j = ParseFollowJournal(text, "fuzz");
      if (!j.ok()) break;
      auto again = ParseFollowJournal(FollowJournalJson(*j), "fuzz-again");
      if (!again.ok() || !(*again == *j)) std::abort();
      break;
    }
    case 1: {
      auto j = ParseRankJournal(text, "fuzz");
      if (!j.ok()) break;
      const std::string json = RankJournalJson(*j);
      auto again = ParseRankJournal(json, "fuzz-again");
      if (!again.ok() || RankJournalJson(*again) != json) std::abort();
      break;
    }
    default: FrameLogRoundTrip(text); break;
  }
  return 0;
}
