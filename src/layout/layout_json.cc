// The JSON form of layout maps (docs/layouts.md).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "dcr/json.h"
#include "dcr/layout.h"

namespace dcr {
namespace {

using json = nlohmann::ordered_json;

Status Bad(const std::string& where, std::string_view what) {
  return InvalidArgument(fmt::format("{}: malformed layout map: {}", where, what));
}

JsonFields Fields(const json& obj, const std::string& where) {
  return JsonFields(obj, [where](std::string_view what) { return Bad(where, what); });
}
Result<std::string> Str(const json& obj, const char* key, const std::string& where) {
  return Fields(obj, where).String(key);
}
Result<std::vector<uint64_t>> Dims(const json& obj, const char* key, const std::string& where) {
  return Fields(obj, where).U64s(key, 16);
}

Result<DType> DTypeField(const json& obj, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(std::string name, Str(obj, "dtype", where));
  auto d = ParseDType(name);
  if (!d) return Bad(where, fmt::format("unknown dtype '{}' (use a safetensors dtype name such as BF16)", name));
  return *d;
}

Result<const json*> Array(const json& doc, const char* key, const std::string& where) {
  return Fields(doc, where).Array(key);
}

}  // namespace

std::string LayoutMapToJson(const LayoutMap& map) {
  json doc;
  doc["format"] = kLayoutFormat;
  doc["format_version"] = kLayoutFormatVersion;
  json& ts = doc["tensors"] = json::array();
  for (const LayoutTensor& t : map.tensors)
    ts.push_back({{"name", t.name}, {"dtype", Name(t.dtype)}, {"shape", t.shape}});
  json& bs = doc["buffers"] = json::array();
  for (const LayoutBuffer& b : map.buffers) bs.push_back({{"id", b.id}, {"dtype", Name(b.dtype)}, {"shape", b.shape}});
  json& cs = doc["copies"] = json::array();
  for (const BoxCopy& c : map.copies) {
    json e = {{"tensor", c.tensor},
              {"offset", c.offset},
              {"extent", c.extent},
              {"buffer", c.buffer},
              {"buffer_offset", c.buffer_offset}};
    if (!c.primary) e["primary"] = false;
    cs.push_back(std::move(e));
  }
  return JsonText(doc, 1) + "\n";
}

Result<LayoutMap> LayoutMapFromJson(std::string_view text, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(json doc, ParseJsonObject(text, [&](std::string_view what) { return Bad(where, what); }));
  DCR_ASSIGN_OR_RETURN(std::string format, Str(doc, "format", where));
  if (format != kLayoutFormat) return Bad(where, fmt::format("'format' is '{}', expected '{}'", format, kLayoutFormat));
  auto v = doc.find("format_version");
  if (v == doc.end() || !v->is_number_unsigned()) return Bad(where, "'format_version' must be a non-negative integer");
  if (v->get<uint64_t>() != kLayoutFormatVersion)
    return Unimplemented(fmt::format("{}: layout map format version {} (this dcr reads version {}); upgrade dcr", where,
                                     v->get<uint64_t>(), kLayoutFormatVersion));
  LayoutMap map;
  DCR_ASSIGN_OR_RETURN(const json* ts, Array(doc, "tensors", where));
  for (size_t i = 0; i < ts->size(); ++i) {
    const json& t = (*ts)[i];
    const std::string w = fmt::format("{}: tensors[{}]", where, i);
    if (!t.is_object()) return Bad(w, "must be an object");
    LayoutTensor out;
    DCR_ASSIGN_OR_RETURN(out.name, Str(t, "name", w));
    DCR_ASSIGN_OR_RETURN(out.dtype, DTypeField(t, w));
    DCR_ASSIGN_OR_RETURN(out.shape, Dims(t, "shape", w));
    map.tensors.push_back(std::move(out));
  }
  DCR_ASSIGN_OR_RETURN(const json* bs, Array(doc, "buffers", where));
  for (size_t i = 0; i < bs->size(); ++i) {
    const json& b = (*bs)[i];
    const std::string w = fmt::format("{}: buffers[{}]", where, i);
    if (!b.is_object()) return Bad(w, "must be an object");
    LayoutBuffer out;
    DCR_ASSIGN_OR_RETURN(out.id, Str(b, "id", w));
    DCR_ASSIGN_OR_RETURN(out.dtype, DTypeField(b, w));
    DCR_ASSIGN_OR_RETURN(out.shape, Dims(b, "shape", w));
    map.buffers.push_back(std::move(out));
  }
  DCR_ASSIGN_OR_RETURN(const json* cs, Array(doc, "copies", where));
  for (size_t i = 0; i < cs->size(); ++i) {
    const json& c = (*cs)[i];
    const std::string w = fmt::format("{}: copies[{}]", where, i);
    if (!c.is_object()) return Bad(w, "must be an object");
    BoxCopy out;
    DCR_ASSIGN_OR_RETURN(out.tensor, Str(c, "tensor", w));
    DCR_ASSIGN_OR_RETURN(out.buffer, Str(c, "buffer", w));
    DCR_ASSIGN_OR_RETURN(out.offset, Dims(c, "offset", w));
    DCR_ASSIGN_OR_RETURN(out.extent, Dims(c, "extent", w));
    DCR_ASSIGN_OR_RETURN(out.buffer_offset, Dims(c, "buffer_offset", w));
    auto p = c.find("primary");
    if (p != c.end()) {
      if (!p->is_boolean()) return Bad(w, "'primary' must be true or false");
      out.primary = p->get<bool>();
    }
    map.copies.push_back(std::move(out));
  }
  Status s = ValidateLayoutMap(map);
  if (!s.ok()) return s.WithContext(where);
  return map;
}

}  // namespace dcr
