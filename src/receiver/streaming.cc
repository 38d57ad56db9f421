// What the follower and the rank follower share to apply frames before
// their attempt's manifest exists (docs/protocol.md, "Streaming").
#include <fmt/format.h>

#include <charconv>
#include <nlohmann/json.hpp>

#include "receiver.h"

namespace dcr::receiver_internal {

Result<std::vector<std::string>> StreamedObjectsToApply(Store& store, uint64_t v, const AttemptInfo& a,
                                                        const std::map<std::string, std::string>& prefetched,
                                                        const std::set<std::string>* relayed, bool check_fence,
                                                        std::set<std::string>* seen) {
  std::vector<std::string> todo;
  std::set<std::string_view> chosen;
  auto take = [&](const std::string& key) {
    if (!seen->count(key) && chosen.insert(key).second) todo.push_back(key);
  };
  for (const auto& key : a.frame_objects)
    if (prefetched.count(key)) take(key);
  if (relayed) {
    const std::string prefix = run_keys::Attempt(v, a.id);
    for (auto it = prefetched.lower_bound(prefix); it != prefetched.end() && it->first.starts_with(prefix); ++it)
      if (relayed->count(it->first)) take(it->first);
  }
  if (todo.empty()) return todo;
  if (check_fence) {  // the listing may be older than a fence written since
    DCR_ASSIGN_OR_RETURN(auto fence, GetIfPresent(store, run_keys::Fence(v, a.id)));
    if (fence) return std::vector<std::string>();
  }
  seen->insert(todo.begin(), todo.end());
  return todo;
}

bool ForEachStreamedFrame(const std::string& key, const std::string& blob, const DeltaManifest& layout,
                          const AttemptRecord& st, const std::function<void(const FrameView&, size_t offset)>& fn,
                          const std::function<void(const std::string&)>& log) {
  const std::string_view frames = ObjectFrames(blob);
  const auto bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(frames.data()), frames.size());
  size_t offset = 0;
  while (offset < bytes.size()) {
    size_t consumed = 0;
    auto frame = ParseFrame(bytes.subspan(offset), &consumed);
    std::string refused;
    if (!frame.ok()) {
      refused = frame.status().ToString();
    } else {
      const FrameHeader& h = frame->header;
      if ((st.cls == DeltaClass::kOverwrite) != (h.mode == Mode::kOverwrite))
        refused = fmt::format("mode {} in an attempt of the other class", ModeName(h.mode));
      else if (h.tensor >= layout.tensors.size() || h.chunk >= layout.ChunkCount(h.tensor))
        refused = fmt::format("tensor {} chunk {} is not in the run", h.tensor, h.chunk);
      else if (h.dtype != layout.tensors[h.tensor].dtype)
        refused = fmt::format("a {} frame for tensor '{}' of {}", Name(h.dtype), layout.tensors[h.tensor].name,
                              Name(layout.tensors[h.tensor].dtype));
    }
    if (!refused.empty()) {
      // The manifest decides: LoadAttempt and the apply report it if the frame is needed.
      log(fmt::format("{} at offset {}: not applied before the manifest: {}", key, offset, refused));
      return false;
    }
    fn(*frame, offset);
    offset += consumed;
  }
  return true;
}

}  // namespace dcr::receiver_internal
