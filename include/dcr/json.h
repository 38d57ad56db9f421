// The JSON dcr reads and writes (records, manifests, layout maps, reports),
// without exceptions: text that never throws, and typed access to the
// fields of a parsed object that returns an error instead.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/status.h"

namespace dcr {

// `doc` as text, indented by `indent` spaces per level (-1: one line).
// nlohmann's dump() throws on a string that is not valid UTF-8 (a name,
// path, id or error message that came from a file or a peer); JsonText
// writes such bytes as U+FFFD.
template <class BasicJson>
std::string JsonText(const BasicJson& doc, int indent = -1) {
  return doc.dump(indent, ' ', false, BasicJson::error_handler_t::replace);
}

// `text` parsed as a JSON object, or bad("not a JSON object").
Result<nlohmann::ordered_json> ParseJsonObject(std::string_view text,
                                               const std::function<Status(std::string_view what)>& bad);

// The fields of one JSON object. Each getter returns the field, or the
// error `bad` makes of what is wrong with it (for instance "'version' must
// be a non-negative integer"): each kind of document words its own errors.
class JsonFields {
 public:
  using Json = nlohmann::ordered_json;
  using Bad = std::function<Status(std::string_view what)>;
  JsonFields(const Json& object, Bad bad) : object_(object), bad_(std::move(bad)) {}

  Result<uint64_t> U64(const char* key) const;
  Result<double> Number(const char* key) const;
  Result<std::string> String(const char* key) const;
  Result<bool> Bool(const char* key) const;
  Result<std::vector<std::string>> Strings(const char* key) const;
  // An array of at most `at_most` non-negative integers.
  Result<std::vector<uint64_t>> U64s(const char* key, size_t at_most) const;
  Result<const Json*> Array(const char* key) const;
  // The error for something else wrong with the object.
  Status Error(std::string_view what) const { return bad_(what); }

 private:
  const Json* Find(const char* key) const;
  const Json& object_;
  Bad bad_;
};

}  // namespace dcr
