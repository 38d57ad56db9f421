// What the follower and the rank follower share to apply frames before
// their attempt's manifest exists (docs/protocol.md, "Streaming").
#include <fmt/format.h>

#include <charconv>
#include <nlohmann/json.hpp>

#include "internal.h"

namespace dcr::protocol_internal {

Result<std::optional<StreamedAttempt>> ReadStreamedAttempt(Store& store, uint64_t v, const std::string& id,
                                                           const std::function<void(const std::string&)>& log) {
  const std::string prefix = run_keys::Attempt(v, id);
  DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store, run_keys::AttemptRecord(v, id)));
  if (!text) return std::optional<StreamedAttempt>();  // not yet visible: look again next time
  StreamedAttempt st;
  auto record = AttemptRecord::FromJson(*text, StoreContext(store.url(), run_keys::AttemptRecord(v, id)));
  if (record.ok() && record->version == v) st = std::move(*record);
  else
    log(
        fmt::format("{}attempt.json does not name this version's delta id, class and signing keys ({}); its frames are "
                    "applied once its manifest exists",
                    prefix, record.ok() ? "another version" : record.status().message()));
  return std::optional<StreamedAttempt>(std::move(st));
}

Result<std::optional<std::string>> ObjectSignerOf(Store& store, const std::string& attempt_prefix,
                                                  const StreamedAttempt& st, const std::string& key) {
  if (!st) return std::optional<std::string>("");
  if (!st->object_key.empty() || st->processes == 0) return std::optional<std::string>(st->object_key);
  // frames/s<P>-<NNNN>.bin: process P's object.
  const std::string_view name = std::string_view(key).substr(std::min(key.size(), attempt_prefix.size()));
  const size_t dash = name.find('-');
  if (!name.starts_with("frames/s") || dash == std::string_view::npos) return std::optional<std::string>("");
  uint32_t process = 0;
  const std::string_view digits = name.substr(8, dash - 8);
  const auto parsed = std::from_chars(digits.data(), digits.data() + digits.size(), process);
  if (digits.empty() || parsed.ec != std::errc() || parsed.ptr != digits.data() + digits.size())
    return std::optional<std::string>("");
  DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store, attempt_prefix + run_keys::ProcessSigner(process)));
  if (!text) return std::optional<std::string>();
  while (!text->empty() && text->back() == '\n') text->pop_back();
  return std::optional<std::string>(std::move(*text));
}

Status PrefetchFrameObjects(Store& store, const AttemptInfo& a, std::map<std::string, std::string>* prefetched,
                            size_t at_most, const std::function<bool(const std::string&)>& have, bool* progressed) {
  size_t held = 0;
  for (const auto& key : a.frame_objects) held += prefetched->count(key);
  for (const auto& key : a.frame_objects) {
    if (held >= at_most) break;
    if (prefetched->count(key) || have(key)) continue;
    auto blob = store.Get(key);
    if (!blob.ok()) {
      if (Transient(blob.status())) return blob.status();
      break;  // LoadAttempt reports it, once the manifest says the object is needed
    }
    (*prefetched)[key] = std::move(*blob);
    ++held;
    *progressed = true;
  }
  return Status::Ok();
}

Result<std::vector<std::string>> StreamedObjectsToApply(Store& store, uint64_t v, const AttemptInfo& a,
                                                        const std::map<std::string, std::string>& prefetched,
                                                        std::set<std::string>* seen) {
  std::vector<std::string> todo;
  for (const auto& key : a.frame_objects)
    if (prefetched.count(key) && !seen->count(key)) todo.push_back(key);
  if (todo.empty()) return todo;
  // The listing may be older than a fence written since.
  DCR_ASSIGN_OR_RETURN(auto fence, GetIfPresent(store, run_keys::Fence(v, a.id)));
  if (fence) return std::vector<std::string>();
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

}  // namespace dcr::protocol_internal

namespace dcr {

Status FrameObjectVerifier::Verify(const std::string& key, std::string_view bytes) {
  using namespace protocol_internal;
  // attempts/v<10 digits>/<attempt>/frames/<name>
  const std::string_view k = key;
  const size_t id_end = k.find('/', 21);
  uint64_t v = 0;
  const auto digits = k.substr(std::min<size_t>(10, k.size()), 10);
  const auto parsed = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (!k.starts_with("attempts/v") || k.size() < 21 || k[20] != '/' || parsed.ec != std::errc() ||
      parsed.ptr != digits.data() + digits.size() || id_end == std::string_view::npos ||
      !k.substr(id_end + 1).starts_with("frames/"))
    return InvalidArgument(fmt::format("{}: not a frame object's key", key));
  const std::string id(k.substr(21, id_end - 21));
  const std::string prefix(k.substr(0, id_end + 1));
  const size_t dash = k.find('-', id_end + 1);
  const std::string signer_of(k.substr(0, dash == std::string_view::npos ? k.size() : dash));
  auto it = signers_.find(signer_of);
  if (it == signers_.end()) {
    DCR_ASSIGN_OR_RETURN(auto attempt, ReadStreamedAttempt(store_, v, id, [](const std::string&) {}));
    if (!attempt) return NotFound(fmt::format("{}attempt.json is not in {} (yet)", prefix, store_.url()));
    DCR_ASSIGN_OR_RETURN(auto signer, ObjectSignerOf(store_, prefix, *attempt, key));
    if (!signer) return NotFound(fmt::format("{}: its trainer process's key is not in {} (yet)", key, store_.url()));
    if (signer->empty())
      return FailedPrecondition(fmt::format("{}: its attempt names no signing key (an older publisher)", key));
    if (signers_.size() >= 4096) signers_.clear();  // keys of attempts long gone
    it = signers_.emplace(signer_of, std::move(*signer)).first;
  }
  return VerifyObjectSignature(it->second, key, bytes);
}

}  // namespace dcr
