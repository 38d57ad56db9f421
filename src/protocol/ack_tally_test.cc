// The ack tally of an attempt (ack_tally.h): whole receivers and engines of
// several ranks counted, every way an attempt is refused.
#include "ack_tally.h"

#include <gtest/gtest.h>

namespace dcr::protocol_internal {
namespace {

Digest D(const char* hex) {
  Digest d;
  EXPECT_TRUE(Digest::FromHex(hex, &d));
  return d;
}

const Digest kTarget = D("0123456789abcdef0123456789abcdef");
const Digest kPart = D("00000000000000010000000000000002");

AckRecord Ack(const std::string& id, Digest digest, bool ok = true) {
  AckRecord a;
  a.receiver = id;
  a.ok = ok;
  a.digest = digest;
  a.error = ok ? "" : "cannot apply";
  return a;
}

AckRecord Rank(const std::string& id, uint32_t rank, uint32_t ranks, Digest partial) {
  AckRecord a = Ack(id, partial);
  a.engine = {"eng", rank, ranks};
  return a;
}

TEST(AckTallyTest, WholeReceiversCountOnceAndTreeAcksAreTold) {
  AckTally t(kTarget);
  t.Take(Ack("a", kTarget), false);
  t.Take(Ack("b", kTarget), true);
  t.Take(Ack("b", kTarget), false);  // the same ack again, from the store poll
  t.Take(Ack("a", kTarget), true);  // the tree after the store: not counted as the tree's
  EXPECT_FALSE(t.refused());
  EXPECT_EQ(t.acked(), (std::set<std::string>{"a", "b"}));
  EXPECT_EQ(t.from_tree(), 1u);
}

TEST(AckTallyTest, AnEngineCountsOnceEveryRankAckedWithPartialsAddingUpToTheTarget) {
  AckTally t(kTarget);
  t.Take(Rank("r1", 1, 2, kTarget - kPart), false);
  EXPECT_FALSE(t.Acked("r1")) << "one rank of two";
  t.Take(Rank("r0", 0, 2, kPart), false);
  EXPECT_FALSE(t.refused());
  EXPECT_TRUE(t.Acked("r0") && t.Acked("r1"));
}

TEST(AckTallyTest, EveryWayAnAttemptIsRefused) {
  struct Case {
    const char* name;
    std::vector<AckRecord> acks;
    const char* says;
  } cases[] = {
      {"nack", {Ack("a", kTarget), Ack("b", kTarget, false)}, "receiver b failed: cannot apply"},
      {"other digest", {Ack("a", kPart)}, "receiver a acked digest"},
      {"partials off", {Rank("r0", 0, 2, kPart), Rank("r1", 1, 2, kPart)}, "partial digests add up to"},
      {"rank twice", {Rank("r0", 0, 2, kPart), Rank("x", 0, 2, kPart)}, "acked as rank 0 of 2"},
      {"rank counts differ", {Rank("r0", 0, 2, kPart), Rank("r1", 1, 3, kPart)}, "acked as rank 1 of 3"},
  };
  for (const Case& c : cases) {
    AckTally t(kTarget);
    for (const AckRecord& a : c.acks) t.Take(a, false);
    ASSERT_TRUE(t.refused()) << c.name;
    EXPECT_EQ(t.refused()->code(), Code::kAborted) << c.name;
    EXPECT_NE(t.refused()->message().find(c.says), std::string::npos) << c.name << ": " << t.refused()->message();
    t.Take(Ack("late", kTarget), false);  // nothing counts after a refusal
    EXPECT_FALSE(t.Acked("late")) << c.name;
  }
}

}  // namespace
}  // namespace dcr::protocol_internal
