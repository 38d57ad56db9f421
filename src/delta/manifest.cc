#include <fmt/format.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "dcr/delta.h"
#include "dcr/json.h"

namespace dcr {
namespace {

using json = nlohmann::ordered_json;

Status Bad(const std::string& where, std::string_view what) {
  return InvalidArgument(fmt::format("{}: malformed delta manifest: {}", where, what));
}

// Typed field access that never throws, in this document's wording.
JsonFields Fields(const json& obj, const std::string& where) {
  return JsonFields(obj, [where](std::string_view what) { return Bad(where, what); });
}
Result<uint64_t> U64(const json& obj, const char* key, const std::string& where) { return Fields(obj, where).U64(key); }
Result<std::string> Str(const json& obj, const char* key, const std::string& where) {
  return Fields(obj, where).String(key);
}
Result<Digest> Dig(const json& obj, const char* key, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(std::string hex, Str(obj, key, where));
  Digest d;
  if (!Digest::FromHex(hex, &d)) return Bad(where, fmt::format("'{}' must be 32 lowercase hex digits", key));
  return d;
}

// A name relative to the manifest: non-empty '/'-separated components, none
// empty, "." or "..", no control bytes or backslashes.
bool IsRelativeName(std::string_view name) {
  if (name.empty() || name.size() > 1024) return false;
  for (unsigned char c : name)
    if (c < 0x20 || c == 0x7f || c == '\\') return false;
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    std::string_view part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

}  // namespace

uint64_t DeltaManifest::ChunkCount(size_t t) const {
  const uint64_t n = tensors[t].elements;
  return n == 0 ? 0 : (n + chunk_elements - 1) / chunk_elements;
}

void DeltaManifest::ChunkWords(size_t t, uint64_t c, uint64_t* first_word, uint64_t* words, uint32_t* elements) const {
  const DeltaTensor& tensor = tensors[t];
  const uint64_t bits = BitsPerElement(tensor.dtype), wb = WordBytes(tensor.dtype);
  const uint64_t first = c * chunk_elements;
  const uint64_t count = std::min(chunk_elements, tensor.elements - first);
  *first_word = first * bits / (8 * wb);
  *words = count * bits / (8 * wb);
  *elements = static_cast<uint32_t>(count);
}

std::string DeltaManifest::ToJson() const {
  json doc;
  doc["format"] = "dcr-delta";
  doc["format_version"] = 1;
  doc["delta_id"] = fmt::format("{:016x}", delta_id);
  doc["class"] = delta_class == DeltaClass::kXorClass ? "xor" : "overwrite";
  doc["chunk_elements"] = chunk_elements;
  doc["base_digest"] = base_digest.ToHex();
  doc["target_digest"] = target_digest.ToHex();
  doc["totals"] = {{"tensors", tensors.size()}, {"frames", frames.size()},        {"elements", total_elements},
                   {"bytes", total_bytes},      {"changed_words", changed_words}, {"payload_bytes", payload_bytes},
                   {"frame_bytes", frame_bytes}};
  json& ts = doc["tensors"] = json::array();
  for (const auto& t : tensors)
    ts.push_back({{"name", t.name},
                  {"dtype", Name(t.dtype)},
                  {"shape", t.shape},
                  {"base_digest", t.base_digest.ToHex()},
                  {"target_digest", t.target_digest.ToHex()}});
  doc["objects"] = objects;
  json& fs = doc["frames"] = json::array();
  for (const auto& f : frames)
    fs.push_back({{"tensor", f.tensor},
                  {"chunk", f.chunk},
                  {"object", f.object},
                  {"offset", f.offset},
                  {"bytes", f.bytes},
                  {"mode", ModeName(f.mode)},
                  {"codec", CodecName(f.codec)},
                  {"changed", f.changed}});
  return JsonText(doc, 1) + "\n";
}

Result<DeltaManifest> DeltaManifest::FromJson(std::string_view text, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(json doc, ParseJsonObject(text, [&](std::string_view what) { return Bad(where, what); }));
  DCR_ASSIGN_OR_RETURN(std::string format, Str(doc, "format", where));
  if (format != "dcr-delta") return Bad(where, "'format' is not \"dcr-delta\"");
  DCR_ASSIGN_OR_RETURN(uint64_t version, U64(doc, "format_version", where));
  if (version != 1) return Unimplemented(fmt::format("{}: delta format version {} (this dcr reads 1)", where, version));
  DeltaManifest m;
  DCR_ASSIGN_OR_RETURN(std::string id, Str(doc, "delta_id", where));
  if (id.size() != 16 || id.find_first_not_of("0123456789abcdef") != std::string::npos)
    return Bad(where, "'delta_id' must be 16 lowercase hex digits");
  m.delta_id = std::strtoull(id.c_str(), nullptr, 16);
  DCR_ASSIGN_OR_RETURN(std::string cls, Str(doc, "class", where));
  if (cls == "xor") m.delta_class = DeltaClass::kXorClass;
  else if (cls == "overwrite") m.delta_class = DeltaClass::kOverwrite;
  else return Bad(where, "'class' must be \"xor\" or \"overwrite\"");
  DCR_ASSIGN_OR_RETURN(m.chunk_elements, U64(doc, "chunk_elements", where));
  if (m.chunk_elements == 0 || m.chunk_elements % 8 != 0 || m.chunk_elements > (1ull << 28))
    return Bad(where, "'chunk_elements' must be a positive multiple of 8, at most 2^28");
  DCR_ASSIGN_OR_RETURN(m.base_digest, Dig(doc, "base_digest", where));
  DCR_ASSIGN_OR_RETURN(m.target_digest, Dig(doc, "target_digest", where));

  auto ts = doc.find("tensors");
  if (ts == doc.end() || !ts->is_array()) return Bad(where, "'tensors' must be an array");
  for (const auto& t : *ts) {
    if (!t.is_object()) return Bad(where, "each tensor must be an object");
    DeltaTensor dt;
    DCR_ASSIGN_OR_RETURN(dt.name, Str(t, "name", where));
    DCR_ASSIGN_OR_RETURN(std::string dtype, Str(t, "dtype", where));
    const auto parsed = ParseDType(dtype);
    if (!parsed) return Bad(where, fmt::format("tensor '{}': unknown dtype '{}'", dt.name, dtype));
    dt.dtype = *parsed;
    auto sh = t.find("shape");
    if (sh == t.end() || !sh->is_array())
      return Bad(where, fmt::format("tensor '{}': 'shape' must be an array", dt.name));
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned())
        return Bad(where, fmt::format("tensor '{}': shape must hold non-negative integers", dt.name));
      dt.shape.push_back(d.get<uint64_t>());
    }
    auto info = MakeTensorInfo(dt.name, dt.dtype, dt.shape);
    if (!info.ok()) return info.status().WithContext(where);
    if (info->numel >= (1ull << 60) / 8) return Bad(where, fmt::format("tensor '{}' is too large", dt.name));
    dt.elements = info->numel;
    DCR_ASSIGN_OR_RETURN(dt.base_digest, Dig(t, "base_digest", where));
    DCR_ASSIGN_OR_RETURN(dt.target_digest, Dig(t, "target_digest", where));
    if (!m.tensors.empty() && !(m.tensors.back().name < dt.name))
      return Bad(where, fmt::format("tensors must be sorted by name and unique ('{}')", dt.name));
    m.tensors.push_back(std::move(dt));
    m.total_elements += info->numel;
    m.total_bytes += info->nbytes;
  }
  auto objs = doc.find("objects");
  if (objs == doc.end() || !objs->is_array()) return Bad(where, "'objects' must be an array");
  for (const auto& o : *objs) {
    if (!o.is_string() || !IsRelativeName(o.get<std::string>()))
      return Bad(where, "each of 'objects' must be a relative name ('/'-separated, no '.' or '..' components)");
    m.objects.push_back(o.get<std::string>());
  }
  auto fs = doc.find("frames");
  if (fs == doc.end() || !fs->is_array()) return Bad(where, "'frames' must be an array");
  for (const auto& f : *fs) {
    if (!f.is_object()) return Bad(where, "each frame must be an object");
    DeltaFrameEntry e;
    DCR_ASSIGN_OR_RETURN(uint64_t tensor, U64(f, "tensor", where));
    DCR_ASSIGN_OR_RETURN(uint64_t chunk, U64(f, "chunk", where));
    DCR_ASSIGN_OR_RETURN(uint64_t object, U64(f, "object", where));
    if (object >= m.objects.size())
      return Bad(where, fmt::format("frame (tensor {}, chunk {}) names object {} of {}", tensor, chunk, object,
                                    m.objects.size()));
    e.object = static_cast<uint32_t>(object);
    DCR_ASSIGN_OR_RETURN(e.offset, U64(f, "offset", where));
    DCR_ASSIGN_OR_RETURN(e.bytes, U64(f, "bytes", where));
    DCR_ASSIGN_OR_RETURN(uint64_t changed, U64(f, "changed", where));
    DCR_ASSIGN_OR_RETURN(std::string mode, Str(f, "mode", where));
    DCR_ASSIGN_OR_RETURN(std::string codec, Str(f, "codec", where));
    if (tensor >= m.tensors.size())
      return Bad(where, fmt::format("frame names tensor {} of {}", tensor, m.tensors.size()));
    e.tensor = static_cast<uint32_t>(tensor);
    if (chunk >= m.ChunkCount(e.tensor))
      return Bad(where, fmt::format("frame names chunk {} of tensor '{}', which has {}", chunk,
                                    m.tensors[e.tensor].name, m.ChunkCount(e.tensor)));
    e.chunk = static_cast<uint32_t>(chunk);
    if (changed > 0xFFFFFFFFu || e.bytes < kFrameHeaderBytes || e.offset > (1ull << 62) || e.bytes > (1ull << 32))
      return Bad(where, fmt::format("frame (tensor {}, chunk {}) has impossible sizes", tensor, chunk));
    e.changed = static_cast<uint32_t>(changed);
    if (!ModeFromName(mode, &e.mode)) return Bad(where, fmt::format("frame mode '{}'", mode));
    if (!CodecFromName(codec, &e.codec)) return Bad(where, fmt::format("frame codec '{}'", codec));
    if (!m.frames.empty()) {
      const auto& prev = m.frames.back();
      if (std::pair(prev.tensor, prev.chunk) >= std::pair(e.tensor, e.chunk))
        return Bad(where, fmt::format("frames must be sorted by (tensor, chunk) and unique (tensor {}, chunk {})",
                                      tensor, chunk));
    }
    m.frames.push_back(e);
    m.changed_words += e.changed;
    m.payload_bytes += e.bytes - kFrameHeaderBytes;
    m.frame_bytes += e.bytes;
  }
  return m;
}

}  // namespace dcr
