// The receivers' local journals: round trips, and the files a crash, a disk
// or a person can leave, refused (journals.h).
#include "journals.h"

#include <gtest/gtest.h>

#include <string>

namespace dcr::receiver_internal {
namespace {

const char* kD = "0123456789abcdef0123456789abcdef";
const char* kE = "00000000000000010000000000000002";

Digest D(const char* hex) {
  Digest d;
  EXPECT_TRUE(Digest::FromHex(hex, &d));
  return d;
}

TEST(JournalsTest, FollowJournalRoundTripsAndRefusesWhatItDoesNotWrite) {
  const FollowJournal j{"r-1", "e0", "0001-0123abcd", 7};
  auto back = ParseFollowJournal(FollowJournalJson(j), "p");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, j);
  for (const char* bad : {"", "{", "[]", "null", R"({"run_id":"r","receiver":"e","attempt":""})",
                          R"({"run_id":"r","receiver":"e","attempt":"","version":-1})",
                          R"({"run_id":"r","receiver":"e","attempt":"","version":1.5})",
                          R"({"run_id":1,"receiver":"e","attempt":"","version":1})",
                          R"({"run_id":"r","receiver":"e","attempt":null,"version":1})"}) {
    auto r = ParseFollowJournal(bad, "/t/.dcr-follow.json");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("/t/.dcr-follow.json: does not parse"), std::string::npos);
  }
}

TEST(JournalsTest, RankJournalRoundTripsAndRefusesBadRanksAndDigests) {
  RankJournal j{"r-1", "eng-r1", EngineRank{"eng", 1, 2}, 3, D(kD), "0001-0123abcd", "applying", D(kE)};
  const std::string json = RankJournalJson(j);
  auto back = ParseRankJournal(json, "p");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->rank, j.rank);
  EXPECT_EQ(back->digest, j.digest);
  EXPECT_EQ(back->attempt_digest, j.attempt_digest);
  EXPECT_EQ(RankJournalJson(*back), json);
  auto with = [&](const char* key, const std::string& value) {
    std::string s = json;
    const std::string k = std::string("\"") + key + "\": ";
    const size_t at = s.find(k) + k.size();
    s.replace(at, s.find_first_of(",\n", at) - at, value);
    return s;
  };
  for (const std::string& bad :
       {with("rank", "2"), with("rank", "4294967296"), with("ranks", "0"), with("ranks", "-2"),
        with("digest", "\"0123\""), with("digest", "\"ffffffffffffffffffffffffffffffff\""),  // lanes above the prime
        with("attempt_digest", "1"), with("engine", "null"), with("version", "\"3\""), std::string("{}")}) {
    auto r = ParseRankJournal(bad, "/r/.dcr-rank.json");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  }
}

TEST(JournalsTest, FrameLogKeepsWholeLinesOfItsAttemptOnly) {
  const std::string a = "0001-0123abcd";
  const std::string log = FrameLogHeader(a) + FrameLogLine('b', {0, 0}, D(kD)) + FrameLogLine('b', {2, 7}, D(kE)) +
                          FrameLogLine('t', {0, 0}, D(kE));
  auto parsed = ParseFrameLog(log, a);
  ASSERT_TRUE(parsed);
  ASSERT_EQ(parsed->size(), 2u);
  EXPECT_EQ(parsed->at({0, 0}), (LoggedChunk{D(kD), D(kE)}));
  EXPECT_EQ(parsed->at({2, 7}), (LoggedChunk{D(kE), std::nullopt}));
  // A torn last line (a process killed mid-append) is ignored.
  auto torn = ParseFrameLog(log + "t 2 7 0000", a);
  ASSERT_TRUE(torn);
  EXPECT_EQ(*torn, *parsed);
  // Another attempt's log, or one holding a line this code does not write: nothing is known.
  EXPECT_FALSE(ParseFrameLog(log, "0002-0123abcd"));
  for (const std::string& line : {std::string("t 5 5 ") + kD + "\n",  // a target without its base line
                                  std::string("x 0 0 ") + kD + "\n", std::string("b -1 0 ") + kD + "\n",
                                  std::string("b 4294967296 0 ") + kD + "\n", std::string("b 0 0 ") + kD + "0\n",
                                  std::string("b  0 0 ") + kD + "\n", std::string("b 0 0\n"), std::string("\n")})
    EXPECT_FALSE(ParseFrameLog(log + line, a)) << line;
}

}  // namespace
}  // namespace dcr::receiver_internal
