// s3:// URLs, the AWS environment variables and the AWS config files, resolved
// into S3Options (precedence in include/dcr/s3.h).
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "dcr/s3.h"
#include "sigv4.h"

namespace dcr {
namespace {

using Section = std::map<std::string, std::string>;  // key -> value; nested "s3" keys as "s3.key"

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

// An AWS INI file: "[section]" headers, "key = value" lines, '#'/';'
// comments, and indented "sub = value" lines under a "key =" with no value
// (e.g. "s3 =\n  addressing_style = path"). A missing file is an empty map.
Result<std::map<std::string, Section>> ReadIni(const std::string& path) {
  std::map<std::string, Section> out;
  std::ifstream in(path);
  if (!in) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return out;
    return PermissionDenied(fmt::format("cannot read AWS config file {}", path));
  }
  std::string line, section, parent;
  bool in_section = false;
  while (std::getline(in, line)) {
    const bool indented = !line.empty() && (line[0] == ' ' || line[0] == '\t');
    std::string_view l = Trim(line);
    if (l.empty() || l[0] == '#' || l[0] == ';') continue;
    if (!indented && l.front() == '[') {
      if (l.back() != ']') return InvalidArgument(fmt::format("AWS config file {}: bad section line '{}'", path, l));
      section = std::string(Trim(l.substr(1, l.size() - 2)));
      // "[profile  x]" -> "profile x"
      if (section.starts_with("profile ")) section = "profile " + std::string(Trim(section.substr(8)));
      out[section];
      in_section = true;
      parent.clear();
      continue;
    }
    if (!in_section) continue;
    const size_t eq = l.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string key = Lower(Trim(l.substr(0, eq)));
    const std::string value(Trim(l.substr(eq + 1)));
    if (indented && !parent.empty()) {
      out[section][parent + "." + key] = value;
    } else {
      out[section][key] = value;
      parent = value.empty() ? key : "";
    }
  }
  return out;
}

Result<uint64_t> ParseBytes(std::string_view name, std::string_view v) {
  uint64_t n = 0;
  size_t i = 0;
  for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
    if (n > (uint64_t{1} << 50)) break;
    n = n * 10 + static_cast<uint64_t>(v[i] - '0');
  }
  std::string_view suffix = v.substr(i);
  uint64_t mul = 1;
  if (suffix == "k" || suffix == "K" || suffix == "KiB") mul = uint64_t{1} << 10;
  else if (suffix == "m" || suffix == "M" || suffix == "MiB") mul = uint64_t{1} << 20;
  else if (suffix == "g" || suffix == "G" || suffix == "GiB") mul = uint64_t{1} << 30;
  else if (!suffix.empty()) i = 0;
  if (i == 0 || n == 0 || n > (uint64_t{1} << 50) / mul)
    return InvalidArgument(fmt::format("{}={}: expected a positive byte count such as 8388608 or 8m", name, v));
  return n * mul;
}

Result<uint64_t> ParseCount(std::string_view name, std::string_view v, uint64_t max) {
  uint64_t n = 0;
  bool ok = !v.empty();
  for (char c : v) {
    if (c < '0' || c > '9' || n > max) {
      ok = false;
      break;
    }
    n = n * 10 + static_cast<uint64_t>(c - '0');
  }
  if (!ok || n == 0 || n > max)
    return InvalidArgument(fmt::format("{}={}: expected an integer in [1, {}]", name, v, max));
  return n;
}

Result<bool> ParseBool(std::string_view name, std::string_view v) {
  if (v == "1" || v == "true") return true;
  if (v == "0" || v == "false") return false;
  return InvalidArgument(fmt::format("{}={}: expected 0 or 1", name, v));
}

Result<S3Addressing> ParseAddressing(std::string_view v) {
  if (v == "path") return S3Addressing::kPath;
  if (v == "virtual") return S3Addressing::kVirtual;
  if (v == "auto") return S3Addressing::kAuto;
  return InvalidArgument(fmt::format("addressing={}: expected path, virtual or auto", v));
}

// Checks an endpoint URL and drops a trailing '/'.
Result<std::string> NormalizeEndpoint(std::string_view e, std::string_view source) {
  std::string s(Trim(e));
  while (s.ends_with("/")) s.pop_back();
  const std::string lower = Lower(s);
  size_t host = 0;
  if (lower.starts_with("http://")) host = 7;
  else if (lower.starts_with("https://")) host = 8;
  else return InvalidArgument(fmt::format("endpoint '{}' (from {}): must start with http:// or https://", e, source));
  if (host == s.size() || s.find_first_of("/?#@", host) != std::string::npos)
    return InvalidArgument(
        fmt::format("endpoint '{}' (from {}): expected scheme://host[:port] with no path, query or user", e, source));
  return lower.substr(0, host) + s.substr(host);
}

constexpr std::string_view kSecretParams[] = {"access_key_id", "secret_access_key", "session_token"};
constexpr std::string_view kKnownParams[] = {
    "endpoint",      "region",        "addressing",      "profile", "access_key_id", "secret_access_key",
    "session_token", "part_size",     "parts_in_flight", "threads", "max_attempts",  "create_if_absent_limit",
    "verify_tls",    "create_bucket", "anonymous"};

bool IsSecretParam(std::string_view name) {
  for (auto k : kSecretParams)
    if (k == name) return true;
  return false;
}

// `url` with the values of credential parameters replaced, for messages.
std::string Redacted(std::string_view url) {
  const size_t q = url.find('?');
  if (q == std::string_view::npos) return std::string(url);
  std::string out(url.substr(0, q + 1));
  std::string_view query = url.substr(q + 1);
  size_t start = 0;
  while (start <= query.size()) {
    size_t end = query.find('&', start);
    if (end == std::string_view::npos) end = query.size();
    const std::string_view item = query.substr(start, end - start);
    const size_t eq = item.find('=');
    if (start > 0) out += '&';
    if (eq != std::string_view::npos && IsSecretParam(item.substr(0, eq)))
      out += std::string(item.substr(0, eq)) + "=...";
    else out += item;
    start = end + 1;
  }
  return out;
}

// What ParseS3Url reads besides the URL's path: its query parameters, the
// environment and the AWS profile in effect.
struct UrlSources {
  std::string_view url;
  GetEnvFunction getenv;
  std::map<std::string, std::string> params;
  std::string profile = "default";
  bool profile_from_url = false;
  Section cred_section, config_section;

  Status Bad(std::string_view why) const {
    return InvalidArgument(fmt::format("store URL '{}': {}", Redacted(url), why));
  }
  std::string Env(const char* name) const {
    auto v = getenv(name);
    return v ? *v : std::string();
  }
  const std::string* Param(const char* name) const {
    auto it = params.find(name);
    return it == params.end() ? nullptr : &it->second;
  }
  std::string ProfileValue(const std::string& key) const {
    if (auto it = cred_section.find(key); it != cred_section.end() && !it->second.empty()) return it->second;
    if (auto it = config_section.find(key); it != config_section.end()) return it->second;
    return "";
  }
};

// Bucket and prefix from the URL's path.
Status ParsePath(std::string_view path, const UrlSources& u, S3Options* o) {
  const size_t slash = path.find('/');
  o->bucket = std::string(path.substr(0, slash));
  if (o->bucket.empty()) return u.Bad("no bucket");
  if (o->bucket.find('@') != std::string::npos)
    return u.Bad("credentials go in the query (access_key_id=, secret_access_key=) or the environment, not user@");
  for (unsigned char c : o->bucket)
    if (c <= 0x20 || c >= 0x7f || c == '%' || c == ':') return u.Bad(fmt::format("bad bucket name '{}'", o->bucket));
  if (slash == std::string_view::npos) return Status::Ok();
  std::string prefix;
  if (!sigv4::UriDecode(path.substr(slash + 1), &prefix)) return u.Bad("bad percent escape in the prefix");
  while (prefix.ends_with("/")) prefix.pop_back();
  if (prefix.empty()) return Status::Ok();
  if (prefix.starts_with("/") || prefix.find("//") != std::string::npos) return u.Bad("empty component in the prefix");
  o->prefix = prefix + "/";
  return Status::Ok();
}

// The query's parameters into u->params; returns the query without its
// secrets (for the URL dcr shows).
Result<std::string> ParseQuery(std::string_view query, UrlSources* u) {
  std::string sanitized;
  size_t start = 0;
  while (start < query.size()) {
    size_t end = query.find('&', start);
    if (end == std::string_view::npos) end = query.size();
    const std::string_view item = query.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name(item.substr(0, eq));
    std::string value;
    if (!sigv4::UriDecode(eq == std::string_view::npos ? std::string_view() : item.substr(eq + 1), &value))
      return u->Bad(fmt::format("bad percent escape in '{}'", name));
    bool known = false;
    for (auto k : kKnownParams) known = known || k == name;
    if (!known) {
      std::string names;
      for (auto k : kKnownParams) names += (names.empty() ? "" : ", ") + std::string(k);
      return u->Bad(fmt::format("unknown parameter '{}' (known: {})", name, names));
    }
    if (!u->params.emplace(name, value).second) return u->Bad(fmt::format("parameter '{}' given twice", name));
    if (!IsSecretParam(name)) sanitized += (sanitized.empty() ? "?" : "&") + std::string(item);
  }
  return sanitized;
}

// The AWS profile in effect (profile=, $AWS_PROFILE, else "default"), read
// from the shared credentials and config files.
Status LoadProfile(UrlSources* u) {
  bool explicit_profile = false;
  if (const auto* p = u->Param("profile")) {
    u->profile = *p;
    explicit_profile = u->profile_from_url = true;
  } else if (std::string ep = u->Env("AWS_PROFILE"); !ep.empty()) {
    u->profile = ep;
    explicit_profile = true;
  }
  const std::string home = u->Env("HOME");
  std::string cred_path = u->Env("AWS_SHARED_CREDENTIALS_FILE");
  if (cred_path.empty() && !home.empty()) cred_path = home + "/.aws/credentials";
  std::string config_path = u->Env("AWS_CONFIG_FILE");
  if (config_path.empty() && !home.empty()) config_path = home + "/.aws/config";
  bool found = false;
  if (!cred_path.empty()) {
    DCR_ASSIGN_OR_RETURN(auto ini, ReadIni(cred_path));
    if (auto it = ini.find(u->profile); it != ini.end()) u->cred_section = it->second, found = true;
  }
  if (!config_path.empty()) {
    DCR_ASSIGN_OR_RETURN(auto ini, ReadIni(config_path));
    auto it = ini.find("profile " + u->profile);
    if (it == ini.end() && u->profile == "default") it = ini.find("default");
    if (it != ini.end()) u->config_section = it->second, found = true;
  }
  if (explicit_profile && !found)
    return u->Bad(fmt::format("AWS profile '{}' not found in {} or {}", u->profile, cred_path.empty() ? "-" : cred_path,
                              config_path.empty() ? "-" : config_path));
  return Status::Ok();
}

Status ResolveRegionAndEndpoint(const UrlSources& u, S3Options* o) {
  if (const auto* r = u.Param("region")) o->region = *r;
  else if (std::string r1 = u.Env("AWS_REGION"); !r1.empty()) o->region = r1;
  else if (std::string r2 = u.Env("AWS_DEFAULT_REGION"); !r2.empty()) o->region = r2;
  else if (std::string r3 = u.ProfileValue("region"); !r3.empty()) o->region = r3;
  if (o->region.empty() || o->region.find_first_of("/ \t") != std::string::npos)
    return u.Bad(fmt::format("bad region '{}'", o->region));
  std::string endpoint, source;
  if (const auto* e = u.Param("endpoint")) {
    endpoint = *e;
    source = "the URL";
  } else {
    for (const char* name : {"DCR_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
      if (std::string e2 = u.Env(name); !e2.empty()) {
        endpoint = e2;
        source = std::string("$") + name;
        break;
      }
    }
    if (endpoint.empty()) {
      endpoint = u.ProfileValue("s3.endpoint_url");
      if (endpoint.empty()) endpoint = u.ProfileValue("endpoint_url");
      source = "profile " + u.profile;
    }
  }
  if (!endpoint.empty()) {
    DCR_ASSIGN_OR_RETURN(o->endpoint, NormalizeEndpoint(endpoint, source));
  }
  return Status::Ok();
}

// Credentials, first found: anonymous=1, the URL, profile= in the URL, the
// environment, the profile in effect.
Status ResolveCredentials(const UrlSources& u, S3Options* o) {
  const std::string* url_key = u.Param("access_key_id");
  const std::string* url_secret = u.Param("secret_access_key");
  if ((url_key == nullptr) != (url_secret == nullptr)) return u.Bad("access_key_id and secret_access_key go together");
  if (const auto* v = u.Param("anonymous")) {
    DCR_ASSIGN_OR_RETURN(o->anonymous, ParseBool("anonymous", *v));
  }
  if (o->anonymous && (url_key != nullptr || u.profile_from_url))
    return u.Bad("anonymous=1 contradicts the credentials (or profile=) given in the URL");
  auto from_profile = [&] {
    o->access_key_id = u.ProfileValue("aws_access_key_id");
    o->secret_access_key = u.ProfileValue("aws_secret_access_key");
    o->session_token = u.ProfileValue("aws_session_token");
    o->credentials_source = "AWS profile " + u.profile;
  };
  if (o->anonymous) {
    o->credentials_source = "none (anonymous=1)";
  } else if (url_key != nullptr) {
    o->access_key_id = *url_key;
    o->secret_access_key = *url_secret;
    if (const auto* t = u.Param("session_token")) o->session_token = *t;
    o->credentials_source = "the URL";
  } else if (u.profile_from_url) {
    from_profile();
  } else if (!u.Env("AWS_ACCESS_KEY_ID").empty() && !u.Env("AWS_SECRET_ACCESS_KEY").empty()) {
    o->access_key_id = u.Env("AWS_ACCESS_KEY_ID");
    o->secret_access_key = u.Env("AWS_SECRET_ACCESS_KEY");
    o->session_token = u.Env("AWS_SESSION_TOKEN");
    o->credentials_source = "$AWS_ACCESS_KEY_ID";
  } else {
    from_profile();
  }
  if (o->access_key_id.empty() != o->secret_access_key.empty())
    return u.Bad(
        fmt::format("incomplete credentials from {}: need both an access key id and a secret", o->credentials_source));
  if (o->access_key_id.empty() && !o->anonymous) {
    o->session_token.clear();
    o->credentials_source = "none found (anonymous requests)";
  }
  return Status::Ok();
}

// Addressing style and the tuning parameters.
Status ResolveTuning(const UrlSources& u, S3Options* o) {
  if (const auto* a = u.Param("addressing")) {
    DCR_ASSIGN_OR_RETURN(o->addressing, ParseAddressing(*a));
  } else if (std::string a2 = u.ProfileValue("s3.addressing_style"); !a2.empty()) {
    DCR_ASSIGN_OR_RETURN(o->addressing, ParseAddressing(a2));
  }
  if (const auto* v = u.Param("part_size")) {
    DCR_ASSIGN_OR_RETURN(o->part_size, ParseBytes("part_size", *v));
    if (o->part_size > (uint64_t{5} << 30))  // what OpenS3Store accepts (found by store_config_fuzz)
      return u.Bad(fmt::format("part_size={}: at most 5g, S3's largest part", *v));
  }
  if (const auto* v = u.Param("create_if_absent_limit")) {
    DCR_ASSIGN_OR_RETURN(o->create_if_absent_limit, ParseBytes("create_if_absent_limit", *v));
  }
  if (const auto* v = u.Param("parts_in_flight")) {
    DCR_ASSIGN_OR_RETURN(o->parts_in_flight, ParseCount("parts_in_flight", *v, 256));
  }
  if (const auto* v = u.Param("threads")) {
    DCR_ASSIGN_OR_RETURN(o->threads, ParseCount("threads", *v, 1024));
  }
  if (const auto* v = u.Param("max_attempts")) {
    DCR_ASSIGN_OR_RETURN(uint64_t n, ParseCount("max_attempts", *v, 100));
    o->max_attempts = static_cast<int>(n);
  }
  if (const auto* v = u.Param("verify_tls")) {
    DCR_ASSIGN_OR_RETURN(o->http.verify_tls, ParseBool("verify_tls", *v));
  }
  if (const auto* v = u.Param("create_bucket")) {
    DCR_ASSIGN_OR_RETURN(o->create_bucket, ParseBool("create_bucket", *v));
  }
  return Status::Ok();
}

}  // namespace

Result<S3Options> ParseS3Url(std::string_view url, const GetEnvFunction& getenv_fn) {
  UrlSources u;
  u.url = url;
  u.getenv = getenv_fn ? getenv_fn : [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
  if (!url.starts_with("s3://")) return u.Bad("expected s3://bucket[/prefix]");
  std::string_view rest = url.substr(5);
  if (rest.find('#') != std::string_view::npos) return u.Bad("fragments ('#') are not allowed");
  const size_t q = rest.find('?');
  const std::string_view query = q == std::string_view::npos ? std::string_view() : rest.substr(q + 1);
  const std::string_view path = rest.substr(0, q);
  S3Options o;
  DCR_RETURN_IF_ERROR(ParsePath(path, u, &o));
  DCR_ASSIGN_OR_RETURN(const std::string sanitized_query, ParseQuery(query, &u));
  o.url = "s3://" + std::string(path) + sanitized_query;
  DCR_RETURN_IF_ERROR(LoadProfile(&u));
  DCR_RETURN_IF_ERROR(ResolveRegionAndEndpoint(u, &o));
  DCR_RETURN_IF_ERROR(ResolveCredentials(u, &o));
  DCR_RETURN_IF_ERROR(ResolveTuning(u, &o));
  return o;
}

}  // namespace dcr
