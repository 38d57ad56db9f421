// The receiver walk's step decisions (receiver.h, PlanStep), as a table:
// what the walk holds and what the store shows for the next version in,
// what the step does out.
#include "receiver.h"

#include <gtest/gtest.h>

#include <string>

#include "testing/hook_store.h"

namespace dcr::receiver_internal {
namespace {

using Kind = StepPlan::Kind;
using Do = StepPlan::Attempt;

// Attempts as letters, oldest first: O open (streaming), M manifest in,
// F fenced, H handled (acked or nacked by this walk), K its ack in the
// store, X fenced with a manifest.
StepInputs::Attempt Parse(char c) {
  StepInputs::Attempt a;
  a.fenced = c == 'F' || c == 'X';
  a.handled = c == 'H';
  a.acked_by_me = c == 'K';
  a.has_manifest = c == 'M' || c == 'X';
  return a;
}

// A plan's attempts, as the table writes them: "drop", "apply", "stream"
// plus "+download" and "+ahead" where set, space-separated.
std::string Show(const StepPlan& plan) {
  std::string out;
  for (const auto& f : plan.attempts) {
    if (!out.empty()) out += ' ';
    out += f.what == Do::kDrop ? "drop" : f.what == Do::kApplyAndAck ? "apply" : "stream";
    if (f.download) out += "+download";
    if (f.apply_ahead) out += "+ahead";
  }
  return out;
}

struct Row {
  const char* name;
  bool target_open, committed, target_at_commit;
  const char* attempts;
  bool relay_attached;
  Kind kind;
  const char* plan;
  bool streaming;
};

constexpr Row kTable[] = {
    {"a target holding nothing whole joins, whatever the store shows", false, true, false, "O", false, Kind::kJoin, "",
     false},
    {"a commit whose attempt the target applied is recorded", true, true, true, "", false, Kind::kCommit, "", false},
    {"a commit the target did not apply is caught up", true, true, false, "", false, Kind::kCatchUp, "", false},
    {"a commit decides even while attempts are open", true, true, false, "OM", false, Kind::kCatchUp, "", false},
    {"nothing published yet: wait at the normal period", true, false, false, "", false, Kind::kAttempts, "", false},
    {"fenced, handled and acked attempts are dropped", true, false, false, "FHK", false, Kind::kAttempts,
     "drop drop drop", false},
    {"an attempt with its manifest is applied and acked", true, false, false, "M", false, Kind::kAttempts, "apply",
     false},
    {"a streaming attempt is downloaded and applied ahead without a relay", true, false, false, "O", false,
     Kind::kAttempts, "stream+download+ahead", true},
    {"with a relay attached it is not downloaded", true, false, false, "O", true, Kind::kAttempts, "stream+ahead",
     true},
    {"only the newest of two streaming attempts is applied ahead", true, false, false, "OO", false, Kind::kAttempts,
     "stream+download stream+download+ahead", true},
    {"a fenced attempt and its retry: the retry streams", true, false, false, "FO", true, Kind::kAttempts,
     "drop stream+ahead", true},
    {"a fence wins over a manifest", true, false, false, "X", false, Kind::kAttempts, "drop", false},
    {"an older attempt's manifest is applied while the newest streams", true, false, false, "MO", false,
     Kind::kAttempts, "apply stream+download+ahead", true},
};

TEST(PlanStepTest, DecidesEachStepFromWhatTheWalkHoldsAndTheStoreShows) {
  for (const Row& row : kTable) {
    StepInputs in;
    in.target_open = row.target_open;
    in.committed = row.committed;
    in.target_at_commit = row.target_at_commit;
    for (const char* c = row.attempts; *c; ++c) in.attempts.push_back(Parse(*c));
    in.relay_attached = row.relay_attached;
    const StepPlan plan = PlanStep(in);
    EXPECT_EQ(plan.kind, row.kind) << row.name;
    EXPECT_EQ(Show(plan), row.plan) << row.name;
    EXPECT_EQ(plan.streaming, row.streaming) << row.name;
  }
}

// A receiver sets its state at every step that applies (each streamed
// batch): the record is written only when what it says changes (state,
// version, frames held); the heartbeat thread keeps its time fresh.
TEST(HeartbeatTest, SetWritesTheRecordOnlyWhenWhatItSaysChanges) {
  ResetMemStore("heartbeat-test");
  auto mem = OpenMemStore("heartbeat-test");
  int writes = 0;
  testing::HookStore counted(*mem, [&](std::string_view op, std::string_view key, bool after) {
    if (op == "write" && after && key == run_keys::Receiver("r")) ++writes;
    return Status::Ok();
  });
  ManualClock clock;
  Heartbeat hb(counted, "r", EngineRank{}, std::chrono::hours(1), clock, [](const std::string&) {});
  ASSERT_TRUE(hb.Set("following").ok());
  EXPECT_EQ(writes, 1);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(hb.Set("applying").ok());
  EXPECT_EQ(writes, 2) << "the same state five times";
  hb.SetVersion(3);
  ASSERT_TRUE(hb.Set("applying").ok());
  EXPECT_EQ(writes, 3) << "a new version is written";
  ASSERT_TRUE(hb.Set("following").ok());
  EXPECT_EQ(writes, 4);
  auto text = mem->Get(run_keys::Receiver("r"));
  ASSERT_TRUE(text.ok());
  auto r = ReceiverRecord::FromJson(*text, "record");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->state, "following");
  EXPECT_EQ(r->version, 3u);
}

}  // namespace
}  // namespace dcr::receiver_internal
