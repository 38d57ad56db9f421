#include <gtest/gtest.h>

#include "dcr/relay.h"

namespace dcr {
namespace {

std::vector<RelaySpec> Relays(const std::vector<std::pair<std::string, std::string>>& id_cluster) {
  std::vector<RelaySpec> out;
  for (const auto& [id, cluster] : id_cluster) out.push_back({id, "tcp://" + id + ":7400", cluster});
  return out;
}

// "id<-parent" for each node in plan order, roots as "id".
std::vector<std::string> Shape(const TreePlan& p) {
  std::vector<std::string> out;
  for (const auto& n : p.nodes) out.push_back(n.parent ? n.relay.id + "<-" + p.nodes[*n.parent].relay.id : n.relay.id);
  return out;
}

struct Case {
  std::string name;
  std::vector<std::pair<std::string, std::string>> relays;
  uint32_t fanout;
  std::set<std::string> lost;
  std::vector<std::string> shape;
  std::vector<std::string> roots;
  uint32_t depth;
};

TEST(PlanTree, TableOfShapes) {
  const std::vector<Case> cases = {
      {"one relay", {{"a", "x"}}, 2, {}, {"a"}, {"a"}, 0},
      {"chain with fanout 1", {{"a", "x"}, {"b", "x"}, {"c", "x"}}, 1, {}, {"a", "b<-a", "c<-b"}, {"a"}, 2},
      {"binary tree of seven, input order ignored",
       {{"g", "x"}, {"b", "x"}, {"a", "x"}, {"d", "x"}, {"c", "x"}, {"f", "x"}, {"e", "x"}},
       2,
       {},
       {"a", "b<-a", "c<-a", "d<-b", "e<-b", "f<-c", "g<-c"},
       {"a"},
       2},
      {"fanout 3 makes it shallower",
       {{"a", "x"}, {"b", "x"}, {"c", "x"}, {"d", "x"}, {"e", "x"}},
       3,
       {},
       {"a", "b<-a", "c<-a", "d<-a", "e<-b"},
       {"a"},
       2},
      {"one root per cluster",
       {{"a1", "east"}, {"b1", "west"}, {"a2", "east"}, {"b2", "west"}, {"b3", "west"}},
       1,
       {},
       {"a1", "a2<-a1", "b1", "b2<-b1", "b3<-b2"},
       {"a1", "b1"},
       2},
      {"losing a middle node: its children move up",
       {{"a", "x"}, {"b", "x"}, {"c", "x"}, {"d", "x"}, {"e", "x"}},
       2,
       {"b"},
       {"a", "c<-a", "d<-a", "e<-c"},
       {"a"},
       2},
      {"losing a root: the next relay of the cluster is the root",
       {{"a", "x"}, {"b", "x"}, {"c", "x"}, {"z", "y"}},
       2,
       {"a"},
       {"b", "c<-b", "z"},
       {"b", "z"},
       1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto plan =
        c.lost.empty() ? PlanTree(Relays(c.relays), c.fanout) : PlanTreeWithout(Relays(c.relays), c.lost, c.fanout);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(Shape(*plan), c.shape);
    std::vector<std::string> roots;
    for (size_t r : plan->roots) roots.push_back(plan->nodes[r].relay.id);
    EXPECT_EQ(roots, c.roots);
    EXPECT_EQ(plan->depth, c.depth);
  }
}

TEST(PlanTree, UpstreamListsParentThenAncestors) {
  auto plan = PlanTree(Relays({{"a", "x"}, {"b", "x"}, {"c", "x"}, {"d", "x"}}), 1);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->Upstream("d"), (std::vector<std::string>{"tcp://c:7400", "tcp://b:7400", "tcp://a:7400"}));
  EXPECT_TRUE(plan->Upstream("a").empty());
  EXPECT_TRUE(plan->Upstream("nobody").empty());
  EXPECT_NE(plan->ToJson().find("\"upstream\""), std::string::npos);
}

TEST(PlanTree, RefusesBadLists) {
  const std::vector<std::pair<std::vector<RelaySpec>, std::string>> bad = {
      {{}, "no relays"},
      {{{"a", "tcp://h:1", "x"}, {"a", "tcp://h:2", "x"}}, "listed twice"},
      {{{"a", "tcp://h:1", "x"}, {"b", "tcp://h:1", "x"}}, "address tcp://h:1 is listed twice"},
      {{{"a b", "tcp://h:1", "x"}}, "must be 1-64"},
      {{{"a", "", "x"}}, "no address"},
      {{{"a", "tcp://h:1", ""}}, "no cluster"},
  };
  for (const auto& [relays, why] : bad) {
    auto plan = PlanTree(relays, 2);
    ASSERT_FALSE(plan.ok()) << why;
    EXPECT_EQ(plan.status().code(), Code::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(why), std::string::npos) << plan.status().message();
  }
  EXPECT_FALSE(PlanTree({{"a", "tcp://h:1", "x"}}, 0).ok());
  EXPECT_FALSE(PlanTreeWithout({{"a", "tcp://h:1", "x"}}, {"zz"}, 2).ok());
}

TEST(PlanTree, ParsesRelayLists) {
  auto list = ParseRelayList(R"([{"id":"r0","address":"tcp://127.0.0.1:1","cluster":"c"}])", "relays.json");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].address, "tcp://127.0.0.1:1");
  auto bad = ParseRelayList(R"([{"id":"r0"}])", "relays.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("relays.json: entry 0"), std::string::npos);
}

}  // namespace
}  // namespace dcr
