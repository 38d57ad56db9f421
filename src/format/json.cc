#include "dcr/json.h"

#include <fmt/format.h>

namespace dcr {

Result<nlohmann::ordered_json> ParseJsonObject(std::string_view text,
                                               const std::function<Status(std::string_view what)>& bad) {
  auto doc = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return bad("not a JSON object");
  return doc;
}

const JsonFields::Json* JsonFields::Find(const char* key) const {
  if (!object_.is_object()) return nullptr;
  auto it = object_.find(key);
  return it == object_.end() ? nullptr : &*it;
}

Result<uint64_t> JsonFields::U64(const char* key) const {
  const Json* v = Find(key);
  if (!v || !v->is_number_unsigned()) return bad_(fmt::format("'{}' must be a non-negative integer", key));
  return v->get<uint64_t>();
}

Result<double> JsonFields::Number(const char* key) const {
  const Json* v = Find(key);
  if (!v || !v->is_number()) return bad_(fmt::format("'{}' must be a number", key));
  return v->get<double>();
}

Result<std::string> JsonFields::String(const char* key) const {
  const Json* v = Find(key);
  if (!v || !v->is_string()) return bad_(fmt::format("'{}' must be a string", key));
  return v->get<std::string>();
}

Result<bool> JsonFields::Bool(const char* key) const {
  const Json* v = Find(key);
  if (!v || !v->is_boolean()) return bad_(fmt::format("'{}' must be true or false", key));
  return v->get<bool>();
}

Result<std::vector<std::string>> JsonFields::Strings(const char* key) const {
  const Json* v = Find(key);
  const auto error = [&] { return bad_(fmt::format("'{}' must be an array of strings", key)); };
  if (!v || !v->is_array()) return error();
  std::vector<std::string> out;
  for (const Json& s : *v) {
    if (!s.is_string()) return error();
    out.push_back(s.get<std::string>());
  }
  return out;
}

Result<std::vector<uint64_t>> JsonFields::U64s(const char* key, size_t at_most) const {
  const Json* v = Find(key);
  if (!v || !v->is_array()) return bad_(fmt::format("'{}' must be an array of integers", key));
  if (v->size() > at_most)
    return bad_(fmt::format("'{}' has {} entries; at most {} are supported", key, v->size(), at_most));
  std::vector<uint64_t> out;
  for (const Json& d : *v) {
    if (!d.is_number_unsigned()) return bad_(fmt::format("'{}' must hold non-negative integers", key));
    out.push_back(d.get<uint64_t>());
  }
  return out;
}

Result<const JsonFields::Json*> JsonFields::Array(const char* key) const {
  const Json* v = Find(key);
  if (!v || !v->is_array()) return bad_(fmt::format("'{}' must be an array", key));
  return v;
}

}  // namespace dcr
