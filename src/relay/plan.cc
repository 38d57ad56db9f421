// Tree plans as data (include/dcr/relay.h).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "dcr/json.h"
#include "dcr/relay.h"

namespace dcr {

namespace {

bool ValidId(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

}  // namespace

Result<TreePlan> PlanTree(std::vector<RelaySpec> relays, uint32_t fanout) {
  if (fanout == 0) return InvalidArgument("relay tree: fanout must be at least 1");
  if (relays.empty()) return InvalidArgument("relay tree: no relays; list at least one per destination cluster");
  std::set<std::string> ids, addresses;
  for (const auto& r : relays) {
    if (!ValidId(r.id))
      return InvalidArgument(fmt::format("relay tree: relay id '{}' must be 1-64 of [A-Za-z0-9._-]", r.id));
    if (r.address.empty()) return InvalidArgument(fmt::format("relay tree: relay {} has no address", r.id));
    if (r.cluster.empty()) return InvalidArgument(fmt::format("relay tree: relay {} has no cluster", r.id));
    if (!ids.insert(r.id).second) return InvalidArgument(fmt::format("relay tree: relay id {} is listed twice", r.id));
    if (!addresses.insert(r.address).second)
      return InvalidArgument(fmt::format("relay tree: address {} is listed twice (relay {})", r.address, r.id));
  }
  std::sort(relays.begin(), relays.end(), [](const RelaySpec& a, const RelaySpec& b) {
    return std::tie(a.cluster, a.id) < std::tie(b.cluster, b.id);
  });
  TreePlan plan;
  plan.fanout = fanout;
  size_t begin = 0;
  while (begin < relays.size()) {
    size_t end = begin;
    while (end < relays.size() && relays[end].cluster == relays[begin].cluster) ++end;
    plan.roots.push_back(begin);
    for (size_t i = begin; i < end; ++i) {
      TreePlan::Node n;
      n.relay = relays[i];
      const size_t local = i - begin;
      if (local > 0) {
        const size_t parent = begin + (local - 1) / fanout;
        n.parent = parent;
        n.depth = plan.nodes[parent].depth + 1;
        plan.nodes[parent].children.push_back(i);
      }
      plan.depth = std::max(plan.depth, n.depth);
      plan.nodes.push_back(std::move(n));
    }
    begin = end;
  }
  return plan;
}

Result<TreePlan> PlanTreeWithout(const std::vector<RelaySpec>& relays, const std::set<std::string>& lost,
                                 uint32_t fanout) {
  std::vector<RelaySpec> alive;
  for (const auto& r : relays)
    if (!lost.count(r.id)) alive.push_back(r);
  for (const auto& id : lost)
    if (std::none_of(relays.begin(), relays.end(), [&](const RelaySpec& r) { return r.id == id; }))
      return InvalidArgument(fmt::format("relay tree: lost relay {} is not in the relay list", id));
  return PlanTree(std::move(alive), fanout);
}

const TreePlan::Node* TreePlan::Find(std::string_view id) const {
  for (const auto& n : nodes)
    if (n.relay.id == id) return &n;
  return nullptr;
}

std::vector<std::string> TreePlan::Upstream(std::string_view id) const {
  std::vector<std::string> out;
  const Node* n = Find(id);
  while (n && n->parent) {
    n = &nodes[*n->parent];
    out.push_back(n->relay.address);
  }
  return out;
}

std::string TreePlan::ToJson() const {
  nlohmann::ordered_json doc;
  doc["format"] = "dcr-relay-plan";
  doc["fanout"] = fanout;
  doc["depth"] = depth;
  auto& roots_json = doc["roots"] = nlohmann::ordered_json::array();
  for (size_t r : roots) roots_json.push_back(nodes[r].relay.id);
  auto& ns = doc["relays"] = nlohmann::ordered_json::array();
  for (const auto& n : nodes) {
    nlohmann::ordered_json j = {{"id", n.relay.id},
                                {"address", n.relay.address},
                                {"cluster", n.relay.cluster},
                                {"depth", n.depth},
                                {"parent", n.parent ? nlohmann::ordered_json(nodes[*n.parent].relay.id) : nullptr},
                                {"upstream", Upstream(n.relay.id)}};
    auto& cs = j["children"] = nlohmann::ordered_json::array();
    for (size_t c : n.children) cs.push_back(nodes[c].relay.id);
    ns.push_back(std::move(j));
  }
  return JsonText(doc, 1) + "\n";
}

Result<std::vector<RelaySpec>> ParseRelayList(std::string_view json, const std::string& where) {
  auto doc = nlohmann::json::parse(json.begin(), json.end(), nullptr, false);
  const std::string how = "; expected [{\"id\": ..., \"address\": \"tcp://host:port\", \"cluster\": ...}, ...]";
  if (doc.is_discarded() || !doc.is_array()) return InvalidArgument(where + ": not a JSON array" + how);
  std::vector<RelaySpec> out;
  for (size_t i = 0; i < doc.size(); ++i) {
    const auto& e = doc[i];
    if (!e.is_object() || !e.contains("id") || !e["id"].is_string() || !e.contains("address") ||
        !e["address"].is_string() || !e.contains("cluster") || !e["cluster"].is_string())
      return InvalidArgument(fmt::format("{}: entry {} needs string fields id, address and cluster{}", where, i, how));
    out.push_back({e["id"].get<std::string>(), e["address"].get<std::string>(), e["cluster"].get<std::string>()});
  }
  return out;
}

}  // namespace dcr
