#include <fmt/format.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "bytes.h"
#include "dcr/delta.h"
#include "dcr/hash.h"
#include "dcr/json.h"
#include "dcr/text.h"

namespace dcr {
namespace {

using json = nlohmann::ordered_json;

Status Bad(const std::string& where, std::string_view what) {
  return InvalidArgument(fmt::format("{}: malformed: {}", where, what));
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

namespace {

json TensorsJson(const DeltaManifest& m) {
  json ts = json::array();
  for (const auto& t : m.tensors) ts.push_back({{"name", t.name}, {"dtype", Name(t.dtype)}, {"shape", t.shape}});
  return ts;
}

// Why `next` may not follow `prev` in a tensor table.
std::string TableOrderError(const std::string& prev, const std::string& next) {
  if (prev < next)  // byte order, as dcr wrote tables before numbers were ordered by value
    return fmt::format(
        "tensors are in byte order ('{}' before '{}'), as an older dcr wrote them; this dcr orders numbers in "
        "names by value (layers.2 before layers.10): remake the delta, or start a new run",
        prev, next);
  return fmt::format("tensors must be sorted by name, numbers by value, and unique ('{}' after '{}')", next, prev);
}

Status RefuseOldVersion(const std::string& where, uint64_t version) {
  return Unimplemented(fmt::format(
      "{}: delta format version {} (this dcr reads {}{})", where, version, kDeltaFormatVersion,
      version < kDeltaFormatVersion ? "; it was written by an older dcr: remake the delta, or start a new run" : ""));
}

// `doc`'s "format" and "format_version" must be `format` and this dcr's.
Status CheckFormat(const json& doc, const char* format, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(std::string f, Str(doc, "format", where));
  if (f != format) return Bad(where, fmt::format("'format' is not \"{}\"", format));
  DCR_ASSIGN_OR_RETURN(uint64_t version, U64(doc, "format_version", where));
  if (version != kDeltaFormatVersion) return RefuseOldVersion(where, version);
  return Status::Ok();
}

// The table's fields of `doc` (chunk_elements, tensors) into `m`.
Status ParseTable(const json& doc, const std::string& where, DeltaManifest* m) {
  DCR_ASSIGN_OR_RETURN(m->chunk_elements, U64(doc, "chunk_elements", where));
  if (m->chunk_elements == 0 || m->chunk_elements % 8 != 0 || m->chunk_elements > (1ull << 28))
    return Bad(where, "'chunk_elements' must be a positive multiple of 8, at most 2^28");
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
    if (!m->tensors.empty() && !TensorNameLess(m->tensors.back().name, dt.name))
      return Bad(where, TableOrderError(m->tensors.back().name, dt.name));
    m->tensors.push_back(std::move(dt));
    m->total_elements += info->numel;
    m->total_bytes += info->nbytes;
  }
  return Status::Ok();
}

// The first chunk's ordinal of every tensor (in AllChunks order), and the
// total after the last.
std::vector<uint64_t> FirstChunkOrdinals(const DeltaManifest& m) {
  std::vector<uint64_t> first(m.tensors.size() + 1, 0);
  for (size_t t = 0; t < m.tensors.size(); ++t) first[t + 1] = first[t] + m.ChunkCount(t);
  return first;
}

}  // namespace

std::string DeltaManifest::ToJson() const {
  json doc;
  doc["format"] = "dcr-delta";
  doc["format_version"] = kDeltaFormatVersion;
  doc["delta_id"] = fmt::format("{:016x}", delta_id);
  doc["class"] = delta_class == DeltaClass::kXorClass ? "xor" : "overwrite";
  doc["chunk_elements"] = chunk_elements;
  doc["base_digest"] = base_digest.ToHex();
  doc["target_digest"] = target_digest.ToHex();
  doc["totals"] = {{"tensors", tensors.size()}, {"frames", frames.size()},        {"elements", total_elements},
                   {"bytes", total_bytes},      {"changed_words", changed_words}, {"payload_bytes", payload_bytes},
                   {"frame_bytes", frame_bytes}};
  doc["tensors"] = TensorsJson(*this);
  if (!tensor_target_digests.empty()) {
    json& ds = doc["tensor_target_digests"] = json::array();
    for (const Digest& d : tensor_target_digests) ds.push_back(d.ToHex());
  }
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
                  {"changed", f.changed},
                  {"payload_bytes", f.payload_bytes}});
  return JsonText(doc, 1) + "\n";
}

Result<DeltaManifest> DeltaManifest::FromJson(std::string_view text, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(json doc, ParseJsonObject(text, [&](std::string_view what) { return Bad(where, what); }));
  DCR_RETURN_IF_ERROR(CheckFormat(doc, "dcr-delta", where));
  DeltaManifest m;
  DCR_ASSIGN_OR_RETURN(std::string id, Str(doc, "delta_id", where));
  if (id.size() != 16 || id.find_first_not_of("0123456789abcdef") != std::string::npos)
    return Bad(where, "'delta_id' must be 16 lowercase hex digits");
  m.delta_id = std::strtoull(id.c_str(), nullptr, 16);
  DCR_ASSIGN_OR_RETURN(std::string cls, Str(doc, "class", where));
  if (cls == "xor") m.delta_class = DeltaClass::kXorClass;
  else if (cls == "overwrite") m.delta_class = DeltaClass::kOverwrite;
  else return Bad(where, "'class' must be \"xor\" or \"overwrite\"");
  DCR_ASSIGN_OR_RETURN(m.base_digest, Dig(doc, "base_digest", where));
  DCR_ASSIGN_OR_RETURN(m.target_digest, Dig(doc, "target_digest", where));
  DCR_RETURN_IF_ERROR(ParseTable(doc, where, &m));
  if (auto ds = doc.find("tensor_target_digests"); ds != doc.end()) {
    if (!ds->is_array() || ds->size() != m.tensors.size())
      return Bad(where, "'tensor_target_digests' must be an array with one digest per tensor");
    Digest sum;
    for (const auto& d : *ds) {
      Digest parsed;
      if (!d.is_string() || !Digest::FromHex(d.get<std::string>(), &parsed))
        return Bad(where, "'tensor_target_digests' must hold 32 lowercase hex digits each");
      m.tensor_target_digests.push_back(parsed);
      sum += parsed;
    }
    if (sum != m.target_digest) return Bad(where, "'tensor_target_digests' do not add up to 'target_digest'");
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
    DCR_ASSIGN_OR_RETURN(e.offset, U64(f, "offset", where));
    DCR_ASSIGN_OR_RETURN(e.bytes, U64(f, "bytes", where));
    DCR_ASSIGN_OR_RETURN(uint64_t changed, U64(f, "changed", where));
    DCR_ASSIGN_OR_RETURN(uint64_t payload, U64(f, "payload_bytes", where));
    DCR_ASSIGN_OR_RETURN(std::string mode, Str(f, "mode", where));
    DCR_ASSIGN_OR_RETURN(std::string codec, Str(f, "codec", where));
    if (changed > 0xFFFFFFFFu || payload >= e.bytes)
      return Bad(where, fmt::format("frame (tensor {}, chunk {}) has impossible sizes", tensor, chunk));
    e.changed = static_cast<uint32_t>(changed);
    e.payload_bytes = static_cast<uint32_t>(payload);
    if (!ModeFromName(mode, &e.mode)) return Bad(where, fmt::format("frame mode '{}'", mode));
    if (!CodecFromName(codec, &e.codec)) return Bad(where, fmt::format("frame codec '{}'", codec));
    DCR_RETURN_IF_ERROR(m.AddFrame(tensor, chunk, object, e, where));
    m.changed_words += e.changed;
    m.payload_bytes += e.payload_bytes;
  }
  return m;
}

Status DeltaManifest::AddFrame(uint64_t tensor, uint64_t chunk, uint64_t object, DeltaFrameEntry e,
                               const std::string& where) {
  if (object >= objects.size())
    return Bad(where,
               fmt::format("frame (tensor {}, chunk {}) names object {} of {}", tensor, chunk, object, objects.size()));
  e.object = static_cast<uint32_t>(object);
  if (tensor >= tensors.size()) return Bad(where, fmt::format("frame names tensor {} of {}", tensor, tensors.size()));
  e.tensor = static_cast<uint32_t>(tensor);
  if (chunk >= ChunkCount(e.tensor))
    return Bad(where, fmt::format("frame names chunk {} of tensor '{}', which has {}", chunk, tensors[e.tensor].name,
                                  ChunkCount(e.tensor)));
  e.chunk = static_cast<uint32_t>(chunk);
  if (e.bytes < kMinFrameHeaderBytes || e.offset > (1ull << 62) || e.bytes > (1ull << 32))
    return Bad(where, fmt::format("frame (tensor {}, chunk {}) has impossible sizes", tensor, chunk));
  if (!frames.empty() && std::pair(frames.back().tensor, frames.back().chunk) >= std::pair(e.tensor, e.chunk))
    return Bad(where,
               fmt::format("frames must be sorted by (tensor, chunk) and unique (tensor {}, chunk {})", tensor, chunk));
  frames.push_back(e);
  frame_bytes += e.bytes;
  return Status::Ok();
}

std::string DeltaManifest::TableJson() const {
  json doc;
  doc["format"] = "dcr-tensors";
  doc["format_version"] = kDeltaFormatVersion;
  doc["chunk_elements"] = chunk_elements;
  doc["tensors"] = TensorsJson(*this);
  return JsonText(doc, 1) + "\n";
}

Result<DeltaManifest> DeltaManifest::FromTableJson(std::string_view text, const std::string& where,
                                                   const char* format) {
  DCR_ASSIGN_OR_RETURN(json doc, ParseJsonObject(text, [&](std::string_view what) { return Bad(where, what); }));
  DCR_RETURN_IF_ERROR(CheckFormat(doc, format, where));
  DeltaManifest m;
  DCR_RETURN_IF_ERROR(ParseTable(doc, where, &m));
  return m;
}

uint64_t DeltaManifest::TableId() const {
  std::string bytes;
  ByteWriter w(bytes);
  w.Varint(chunk_elements);
  w.Varint(tensors.size());
  for (const auto& t : tensors) {
    w.Varint(t.name.size());
    w.Bytes(t.name);
    w.Fixed<uint8_t>(static_cast<uint8_t>(t.dtype));
    w.Varint(t.shape.size());
    for (uint64_t d : t.shape) w.Varint(d);
  }
  return Xxh3_64(bytes.data(), bytes.size(), kManifestMagic);
}

std::string DeltaManifest::Encode() const {
  const std::vector<uint64_t> first = FirstChunkOrdinals(*this);
  // Offsets are implied when each object's frames lie back to back from 0.
  std::vector<uint64_t> next_offset(objects.size(), 0);
  bool implied = true;
  for (const auto& f : frames) {
    implied = implied && f.offset == next_offset[f.object];
    next_offset[f.object] = f.offset + f.bytes;
  }
  std::string out;
  ByteWriter w(out);
  w.Fixed<uint32_t>(kManifestMagic);
  w.Fixed<uint8_t>(kDeltaFormatVersion);
  w.Fixed<uint8_t>(delta_class == DeltaClass::kXorClass ? 1 : 2);
  w.Fixed<uint8_t>(implied ? 0 : kExplicitOffsets);
  w.Fixed<uint8_t>(0);
  w.Fixed<uint64_t>(delta_id);
  w.Fixed<uint64_t>(TableId());
  for (const Digest* d : {&base_digest, &target_digest}) w.Fixed(d->lane[0]), w.Fixed(d->lane[1]);
  w.Varint(objects.size());
  for (const auto& o : objects) w.Varint(o.size()), w.Bytes(o);
  w.Varint(frames.size());
  w.Varint(changed_words);
  w.Varint(payload_bytes);
  uint64_t next = 0;  // the ordinal after the previous frame's
  for (const auto& f : frames) {
    const uint64_t ordinal = first[f.tensor] + f.chunk;
    w.Varint(ordinal - next);
    next = ordinal + 1;
    if (objects.size() > 1) w.Varint(f.object);
    if (!implied) w.Varint(f.offset);
    w.Varint(f.bytes);
  }
  w.Fixed<uint32_t>(Crc32c(out.data(), out.size()));
  return out;
}

Result<DeltaManifest> DeltaManifest::Decode(std::span<const uint8_t> bytes, const DeltaManifest& table,
                                            const std::string& where) {
  if (!bytes.empty() && bytes[0] == '{') {  // format version 1 was JSON
    auto old = ParseJsonObject(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                               [&](std::string_view what) { return Bad(where, what); });
    uint64_t version = 1;
    if (old.ok() && old->contains("format_version") && (*old)["format_version"].is_number_unsigned())
      version = (*old)["format_version"].get<uint64_t>();
    return RefuseOldVersion(where, version);
  }
  if (bytes.size() < kManifestFixedBytes + 4) return DataLoss(fmt::format("{}: truncated delta manifest", where));
  ByteReader r(bytes);
  if (r.Fixed<uint32_t>() != kManifestMagic) return Bad(where, "not a dcr delta manifest (bad magic)");
  if (const uint8_t version = r.Fixed<uint8_t>(); version != kDeltaFormatVersion)
    return RefuseOldVersion(where, version);
  const size_t body = bytes.size() - 4;
  if (Crc32c(bytes.data(), body) != ByteReader(bytes.subspan(body)).Fixed<uint32_t>())
    return DataLoss(fmt::format("{}: delta manifest checksum mismatch", where));
  r = ByteReader(bytes.first(body));
  r.Fixed<uint32_t>(), r.Fixed<uint8_t>();
  DeltaManifest m;
  m.chunk_elements = table.chunk_elements;
  m.tensors = table.tensors;
  m.total_elements = table.total_elements;
  m.total_bytes = table.total_bytes;
  const uint8_t cls = r.Fixed<uint8_t>(), flags = r.Fixed<uint8_t>(), reserved = r.Fixed<uint8_t>();
  if (cls != 1 && cls != 2) return Bad(where, fmt::format("class {} (1 xor, 2 overwrite)", cls));
  m.delta_class = cls == 1 ? DeltaClass::kXorClass : DeltaClass::kOverwrite;
  if ((flags & ~kExplicitOffsets) != 0 || reserved != 0) return Bad(where, "reserved bits are set");
  m.delta_id = r.Fixed<uint64_t>();
  if (const uint64_t id = r.Fixed<uint64_t>(); id != table.TableId())
    return FailedPrecondition(fmt::format(
        "{}: the manifest is for tensor table {:016x}, not this run's ({:016x}): it belongs to another run or delta",
        where, id, table.TableId()));
  for (Digest* d : {&m.base_digest, &m.target_digest}) {
    d->lane[0] = r.Fixed<uint64_t>(), d->lane[1] = r.Fixed<uint64_t>();
    if (d->lane[0] >= kDigestPrime || d->lane[1] >= kDigestPrime)
      return Bad(where, "a digest lane is not below 2^61-1");
  }
  const uint64_t object_count = r.Varint();
  if (!r.ok() || object_count > r.left() / 2) return Bad(where, "the object count is out of range");
  for (uint64_t o = 0; o < object_count; ++o) {
    const uint64_t n = r.Varint();
    const auto name = r.Bytes(n <= 1024 ? n : ~size_t{0});
    const std::string_view text(reinterpret_cast<const char*>(name.data()), name.size());
    if (!r.ok() || !IsRelativeName(text))
      return Bad(where, "each object must be a relative name ('/'-separated, no '.' or '..' components)");
    m.objects.emplace_back(text);
  }
  const uint64_t frame_count = r.Varint(), changed = r.Varint(), payload = r.Varint();
  if (!r.ok() || frame_count > r.left() / 2) return Bad(where, "the frame count is out of range");
  const std::vector<uint64_t> first = FirstChunkOrdinals(m);
  std::vector<uint64_t> next_offset(m.objects.size(), 0);
  uint64_t next = 0;
  size_t t = 0;
  m.frames.reserve(frame_count);
  for (uint64_t i = 0; i < frame_count; ++i) {
    const uint64_t gap = r.Varint();
    const uint64_t object = m.objects.size() > 1 ? r.Varint() : 0;
    DeltaFrameEntry e;
    if (flags & kExplicitOffsets) e.offset = r.Varint();
    e.bytes = r.Varint();
    if (!r.ok()) return Bad(where, "truncated frame list");
    if (gap >= first.back() - next) return Bad(where, fmt::format("frame {} names a chunk past the last", i));
    const uint64_t ordinal = next + gap;
    next = ordinal + 1;
    while (first[t + 1] <= ordinal) ++t;
    if (object < m.objects.size() && !(flags & kExplicitOffsets)) e.offset = next_offset[object];
    DCR_RETURN_IF_ERROR(m.AddFrame(t, ordinal - first[t], object, e, where));
    next_offset[object] = e.offset + e.bytes;
  }
  if (r.left() != 0) return Bad(where, "bytes after the frame list");
  // The frames' own headers carry these; DeltaReader fills the entries.
  m.changed_words = changed;
  m.payload_bytes = payload;
  return m;
}

}  // namespace dcr
