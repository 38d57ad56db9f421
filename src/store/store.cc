// The store interface's shared parts: key rules, URL dispatch, and the
// default Put/Get built from the primitives.
#include "dcr/store.h"

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>

#include "dcr/s3.h"
#include "dcr/text.h"

namespace dcr {

namespace {

// Why `key` breaks the key rules (store.h), or empty when it does not.
std::string_view KeyProblem(std::string_view key) {
  if (key.empty()) return "empty";
  if (key.size() > 1024) return "longer than 1024 bytes";
  if (key.front() == '/') return "absolute (starts with '/')";
  for (unsigned char c : key) {
    if (c < 0x20 || c == 0x7f) return "contains a control byte";
  }
  if (!IsValidUtf8(key)) return "not valid UTF-8";
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('/', start);
    if (end == std::string_view::npos) end = key.size();
    std::string_view part = key.substr(start, end - start);
    if (part.empty()) return "empty path component";
    if (part == "." || part == "..") return "'.' or '..' component";
    if (part.starts_with(".dcr-")) return "components starting with '.dcr-' are reserved";
    start = end + 1;
  }
  return {};
}

}  // namespace

Status ValidateKey(std::string_view key) {
  if (std::string_view why = KeyProblem(key); !why.empty())
    return InvalidArgument(fmt::format("bad object key '{}': {}", key, why));
  return Status::Ok();
}

Status ValidateKeyPrefix(std::string_view prefix) {
  // Some valid key starts with `prefix` when it is one, or when one more
  // byte makes it one (a partial last component, or a trailing '/').
  if (prefix.empty() || KeyProblem(prefix).empty()) return Status::Ok();
  std::string_view why = KeyProblem(std::string(prefix) + "x");
  if (why.empty()) return Status::Ok();
  return InvalidArgument(fmt::format("bad key prefix '{}': no valid key starts with it ({})", prefix, why));
}

std::string StoreContext(std::string_view url, std::string_view key) { return fmt::format("{}: {}", url, key); }

Status Store::Put(std::string_view key, std::string_view data, WriteMode mode) {
  DCR_ASSIGN_OR_RETURN(auto writer, OpenWriter(key, mode));
  DCR_RETURN_IF_ERROR(writer->Write(data));
  return writer->Close();
}

Result<std::string> Store::Get(std::string_view key, ObjectInfo* info) {
  // Head then one ranged read of that version; if it was replaced in
  // between, read the new one (a few times, then give up).
  for (int tries = 0;; ++tries) {
    DCR_ASSIGN_OR_RETURN(ObjectInfo head, Head(key));
    std::string data(head.size, '\0');
    Status s = ReadRange(key, 0, {reinterpret_cast<uint8_t*>(data.data()), data.size()}, {.if_match = head.etag});
    if (s.code() == Code::kAborted && tries < 3) continue;
    DCR_RETURN_IF_ERROR(s);
    if (info) *info = std::move(head);
    return data;
  }
}

namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

Result<std::string> PercentDecode(std::string_view s, std::string_view url) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    int hi = i + 1 < s.size() ? HexValue(s[i + 1]) : -1;
    int lo = i + 2 < s.size() ? HexValue(s[i + 2]) : -1;
    if (hi < 0 || lo < 0) return InvalidArgument(fmt::format("store URL '{}': bad percent escape", url));
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

}  // namespace

namespace {
Result<std::unique_ptr<Store>> OpenUnwrapped(std::string_view url, const OpenStoreOptions& options);
}  // namespace

Result<std::unique_ptr<Store>> OpenStore(std::string_view url, const OpenStoreOptions& options) {
  DCR_ASSIGN_OR_RETURN(auto store, OpenUnwrapped(url, options));
  if (const char* faults = std::getenv("DCR_STORE_FAULTS"); faults && *faults)
    return WrapWithFaults(std::move(store), faults);
  return store;
}

namespace {

Result<std::unique_ptr<Store>> OpenUnwrapped(std::string_view url, const OpenStoreOptions& options) {
  size_t sep = url.find("://");
  if (sep == std::string_view::npos) {
    // A bare path: the file driver, relative paths made absolute.
    if (url.empty()) return InvalidArgument("empty store URL");
    std::error_code ec;
    auto abs = std::filesystem::absolute(std::filesystem::path(url), ec);
    if (ec) return InvalidArgument(fmt::format("store path '{}': {}", url, ec.message()));
    return OpenFileStore(abs.lexically_normal().string(), options.create_root);
  }
  std::string_view scheme = url.substr(0, sep), rest = url.substr(sep + 3);
  if (scheme == "file") {
    // file:///abs/path (an empty authority) or file://localhost/abs/path.
    if (rest.starts_with("localhost/")) rest.remove_prefix(9);
    if (!rest.starts_with("/"))
      return InvalidArgument(fmt::format("store URL '{}': file URLs need an absolute path (file:///path)", url));
    if (rest.find_first_of("?#") != std::string_view::npos)
      return InvalidArgument(fmt::format("store URL '{}': file URLs take no query", url));
    DCR_ASSIGN_OR_RETURN(std::string path, PercentDecode(rest, url));
    return OpenFileStore(std::filesystem::path(path).lexically_normal().string(), options.create_root);
  }
  if (scheme == "mem") {
    if (rest.empty() || rest.find_first_of("/?#") != std::string_view::npos)
      return InvalidArgument(fmt::format("store URL '{}': expected mem://name", url));
    return OpenMemStore(rest);
  }
  if (scheme == "s3") return OpenS3Store(url);
  return InvalidArgument(fmt::format("store URL '{}': unknown scheme '{}' (file, s3, mem)", url, scheme));
}

}  // namespace

}  // namespace dcr
