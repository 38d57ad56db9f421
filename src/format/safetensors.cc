#include "dcr/safetensors.h"
#include "dcr/json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace dcr {
namespace {

using json = nlohmann::json;
// Parsed headers keep keys in file order (__metadata__ is reported in file
// order); nlohmann::json would sort them.
using ordered_json = nlohmann::ordered_json;

Status Malformed(std::string_view what) {
  return InvalidArgument(fmt::format("malformed safetensors header: {}", what));
}

Result<uint64_t> AsUint(const ordered_json& v, std::string_view tensor, std::string_view field) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    return Malformed(
        fmt::format("tensor '{}': {} must hold non-negative integers, got {}", tensor, field, JsonText(v)));
  return v.get<uint64_t>();
}

Result<SafetensorsEntry> ParseEntry(const std::string& name, const ordered_json& v) {
  if (!v.is_object())
    return Malformed(fmt::format("tensor '{}': entry must be an object, got {}", name, v.type_name()));
  const auto dt = v.find("dtype");
  const auto sh = v.find("shape");
  const auto off = v.find("data_offsets");
  if (dt == v.end() || sh == v.end() || off == v.end())
    return Malformed(fmt::format("tensor '{}': needs dtype, shape and data_offsets", name));
  if (!dt->is_string()) return Malformed(fmt::format("tensor '{}': dtype must be a string", name));
  const auto dtype = ParseDType(dt->get_ref<const std::string&>());
  if (!dtype)
    return InvalidArgument(fmt::format("tensor '{}': unknown dtype '{}'", name, dt->get_ref<const std::string&>()));
  if (!sh->is_array()) return Malformed(fmt::format("tensor '{}': shape must be an array", name));
  std::vector<uint64_t> shape;
  shape.reserve(sh->size());
  for (const auto& d : *sh) {
    DCR_ASSIGN_OR_RETURN(uint64_t dim, AsUint(d, name, "shape"));
    shape.push_back(dim);
  }
  if (!off->is_array() || off->size() != 2)
    return Malformed(fmt::format("tensor '{}': data_offsets must be [begin, end]", name));
  DCR_ASSIGN_OR_RETURN(uint64_t begin, AsUint((*off)[0], name, "data_offsets"));
  DCR_ASSIGN_OR_RETURN(uint64_t end, AsUint((*off)[1], name, "data_offsets"));
  if (end < begin)
    return InvalidArgument(fmt::format("tensor '{}': data_offsets [{}, {}) end before begin", name, begin, end));
  DCR_ASSIGN_OR_RETURN(TensorInfo info, MakeTensorInfo(name, *dtype, std::move(shape)));
  if (end - begin != info.nbytes)
    return InvalidArgument(
        fmt::format("tensor '{}': data_offsets [{}, {}) hold {} bytes but {} with {} elements needs {}", name, begin,
                    end, end - begin, Name(*dtype), info.numel, info.nbytes));
  return SafetensorsEntry{std::move(info), begin};
}

}  // namespace

Result<TensorInfo> MakeTensorInfo(std::string name, DType dtype, std::vector<uint64_t> shape) {
  uint64_t numel = 1;
  for (uint64_t d : shape)
    if (__builtin_mul_overflow(numel, d, &numel))
      return InvalidArgument(
          fmt::format("tensor '{}': element count of shape [{}] overflows 64 bits", name, fmt::join(shape, ", ")));
  const auto nbytes = ByteSize(dtype, numel);
  if (!nbytes)
    return InvalidArgument(
        fmt::format("tensor '{}': {} elements of {} ({} bits) {}", name, numel, Name(dtype), BitsPerElement(dtype),
                    BitsPerElement(dtype) % 8 ? "do not fill whole bytes" : "overflow 64-bit byte counts"));
  return TensorInfo{std::move(name), dtype, std::move(shape), numel, *nbytes};
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> prefix, uint64_t file_size) {
  if (file_size < 8 || prefix.size() < 8)
    return DataLoss(
        fmt::format("truncated: {} bytes, a safetensors file starts with an 8-byte header length", file_size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[static_cast<size_t>(i)];
  if (n > kMaxSafetensorsHeaderBytes)
    return InvalidArgument(
        fmt::format("header length {} exceeds the limit of {} bytes", n, kMaxSafetensorsHeaderBytes));
  if (n > file_size - 8)
    return DataLoss(fmt::format("truncated: header length {} runs past the end of the file ({} bytes)", n, file_size));
  if (prefix.size() < 8 + n)
    return Internal(fmt::format("caller passed {} header bytes, need {}", prefix.size(), 8 + n));
  const auto* text = reinterpret_cast<const char*>(prefix.data() + 8);
  if (n == 0 || text[0] != '{') return Malformed("the JSON header must start with '{'");

  // nlohmann keeps the last of duplicate keys; catch them while parsing.
  std::set<std::string> seen;
  std::string duplicate;
  ordered_json::parser_callback_t on_event = [&](int depth, ordered_json::parse_event_t event, ordered_json& parsed) {
    if (depth == 1 && event == ordered_json::parse_event_t::key && duplicate.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) duplicate = key;
    }
    return true;
  };
  ordered_json doc = ordered_json::parse(text, text + n, on_event, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Malformed("not valid UTF-8 JSON");
  if (!duplicate.empty()) return InvalidArgument(fmt::format("duplicate tensor name '{}'", duplicate));
  if (!doc.is_object()) return Malformed("the JSON header must be an object");

  SafetensorsHeader header;
  header.header_bytes = n;
  header.data_bytes = file_size - 8 - n;
  for (auto& [key, value] : doc.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return Malformed("__metadata__ must be an object of strings");
      for (auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) return Malformed(fmt::format("__metadata__ '{}' must be a string", mk));
        header.metadata.emplace_back(mk, mv.get<std::string>());
      }
      continue;
    }
    DCR_ASSIGN_OR_RETURN(SafetensorsEntry entry, ParseEntry(key, value));
    header.entries.push_back(std::move(entry));
  }
  // Sort by (offset, size) so empty tensors come before a tensor at the same
  // offset; then require the ranges to tile [0, data_bytes) exactly.
  std::sort(header.entries.begin(), header.entries.end(), [](const auto& a, const auto& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.info.nbytes < b.info.nbytes;
  });
  uint64_t expected = 0;
  for (const auto& e : header.entries) {
    if (e.offset != expected)
      return InvalidArgument(fmt::format("tensor '{}': data starts at {} but the previous tensor ends at {} ({})",
                                         e.info.name, e.offset, expected, e.offset < expected ? "overlap" : "hole"));
    expected = e.offset + e.info.nbytes;
  }
  if (expected != header.data_bytes) {
    if (expected > header.data_bytes)
      return DataLoss(
          fmt::format("truncated: tensors need {} data bytes but the file holds {}", expected, header.data_bytes));
    return InvalidArgument(fmt::format("{} bytes after the last tensor (data buffer holds {}, tensors {})",
                                       header.data_bytes - expected, header.data_bytes, expected));
  }
  return header;
}

std::string EncodeSafetensorsHeader(std::span<const TensorInfo> tensors, const Metadata& metadata) {
  // nlohmann::json sorts keys; build the text by hand to keep the given order.
  // Strings that are not valid UTF-8 are written with U+FFFD, never thrown.
  auto quote = [](const std::string& s) { return JsonText(json(s)); };
  std::string text = "{";
  bool first = true;
  auto sep = [&] {
    if (!first) text += ',';
    first = false;
  };
  if (!metadata.empty()) {
    sep();
    text += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i) text += ',';
      text += quote(metadata[i].first) + ":" + quote(metadata[i].second);
    }
    text += '}';
  }
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    sep();
    json entry = {
        {"dtype", std::string(Name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    text += quote(t.name) + ":" + JsonText(entry);
    offset += t.nbytes;
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + text;
}

}  // namespace dcr
