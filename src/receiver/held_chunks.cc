// Which frame objects a rank of a sharded engine downloads (held_chunks.h).
#include "held_chunks.h"

#include <algorithm>
#include <map>

#include "dcr/run_keys.h"

namespace dcr::receiver_internal {

HeldChunks::HeldChunks(const DeltaManifest& shape, const ChunkRanges& ranges) {
  first_.push_back(0);
  for (size_t t = 0; t < shape.tensors.size(); ++t) first_.push_back(first_.back() + shape.ChunkCount(t));
  for (size_t t = 0; t < ranges.size() && t < shape.tensors.size(); ++t)
    for (const auto& [first, end] : ranges[t]) {
      const uint64_t lo = Global(static_cast<uint32_t>(t), first), hi = Global(static_cast<uint32_t>(t), end);
      if (lo < hi) held_.emplace_back(lo, hi);
    }
  std::sort(held_.begin(), held_.end());
}

uint64_t HeldChunks::Global(uint32_t tensor, uint64_t chunk) const {
  if (size_t{tensor} + 1 >= first_.size()) return first_.back();
  return first_[tensor] + std::min(chunk, first_[tensor + 1] - first_[tensor]);
}

bool HeldChunks::AnyIn(ChunkId from, std::optional<ChunkId> to) const {
  const uint64_t lo = Global(from.tensor, from.chunk), hi = to ? Global(to->tensor, to->chunk) : first_.back();
  // The first held range ending after lo: does it start before hi?
  auto it = std::upper_bound(held_.begin(), held_.end(), lo,
                             [](uint64_t x, const std::pair<uint64_t, uint64_t>& r) { return x < r.second; });
  return lo < hi && it != held_.end() && it->first < hi;
}

std::vector<ObjectChoice> ChooseByNames(const std::vector<std::string>& keys, const std::string& prefix,
                                        const HeldChunks& held) {
  std::vector<std::optional<run_keys::FrameObjectName>> names;
  // (sender, index) of every object listed -> the chunk its name gives.
  std::map<std::pair<uint32_t, uint64_t>, std::optional<ChunkId>> listed;
  for (const auto& key : keys) {
    names.push_back(key.starts_with(prefix) ? run_keys::ParseFrameObject(std::string_view(key).substr(prefix.size()))
                                            : std::nullopt);
    if (names.back()) listed[{names.back()->sender, names.back()->index}] = names.back()->first;
  }
  std::vector<ObjectChoice> choice(keys.size(), ObjectChoice::kFetch);
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& n = names[i];
    if (!n || (n->index > 0 && !n->first)) continue;  // an older publisher's name: fetched
    const ChunkId from = n->first.value_or(ChunkId{});
    const auto next = listed.find({n->sender, n->index + 1});
    if (next != listed.end()) {
      if (next->second && !held.AnyIn(from, *next->second)) choice[i] = ObjectChoice::kSkip;
    } else if (!n->first || !held.Holds(from)) {
      choice[i] = ObjectChoice::kWait;
    }
  }
  return choice;
}

std::vector<bool> ObjectsWithoutHeldChunks(const DeltaManifest& m, const HeldChunks& held) {
  std::vector<bool> without(m.objects.size(), true);
  for (const DeltaFrameEntry& f : m.frames)
    if (f.object < without.size() && held.Holds({f.tensor, f.chunk})) without[f.object] = false;
  return without;
}

}  // namespace dcr::receiver_internal
