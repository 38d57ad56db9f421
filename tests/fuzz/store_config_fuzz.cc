// Fuzzes what turns text into store settings (src/store/s3_config.cc,
// store.cc, fault_store.cc). The first byte picks the parser:
//
//   's'  ParseS3Url: the rest is "URL\n--\nENV\n--\nCREDENTIALS\n--\nCONFIG",
//        ENV being NAME=VALUE lines and the last two the AWS credentials and
//        config files (given to the parser through $AWS_SHARED_CREDENTIALS_FILE
//        and $AWS_CONFIG_FILE; $HOME is unset).
//   'o'  OpenStore on a file:// or mem:// URL (create_root off: nothing is
//        created), or any other scheme but s3 (s3 is 's').
//   'f'  WrapWithFaults: the rest is a DCR_STORE_FAULTS spec.
//
// Invariants: an accepted s3 URL gives options the driver opens without a
// request (a bucket, a prefix ending in '/', an http(s) endpoint without a
// path, credentials in pairs, a part size S3 allows), and neither Store::url()
// nor any error message shows a credential value (checked by parsing again
// with other credential values in the URL and the environment: what is shown
// must not change).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/s3.h"
#include "dcr/store.h"

namespace {

std::vector<std::string_view> Split(std::string_view s, std::string_view sep, size_t max_parts) {
  std::vector<std::string_view> out;
  while (out.size() + 1 < max_parts) {
    const size_t at = s.find(sep);
    if (at == std::string_view::npos) break;
    out.push_back(s.substr(0, at));
    s.remove_prefix(at + sep.size());
  }
  out.push_back(s);
  return out;
}

// An in-memory file, named by a /proc/self/fd path.
class MemFile {
 public:
  explicit MemFile(std::string_view text) : fd_(::memfd_create("dcr-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
    for (size_t off = 0; off < text.size();) {
      const ssize_t n = ::write(fd_, text.data() + off, text.size() - off);
      if (n <= 0) std::abort();
      off += static_cast<size_t>(n);
    }
  }
  ~MemFile() { ::close(fd_); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

bool IsSecretName(std::string_view name) {
  return name == "access_key_id" || name == "secret_access_key" || name == "session_token";
}

// Each letter and digit moved to the next of its class, hex digits staying
// hex digits: a percent escape stays (in)valid, the length and emptiness
// stay, only the value differs.
std::string Tweak(std::string_view v) {
  static constexpr std::string_view kClasses[] = {"0123456789abcdef", "0123456789ABCDEF", "ghijklmnopqrstuvwxyz",
                                                  "GHIJKLMNOPQRSTUVWXYZ"};
  std::string out(v);
  for (char& c : out) {
    for (std::string_view cls : kClasses) {
      const size_t at = cls.find(c);
      if (at != std::string_view::npos) {
        c = cls[(at + 1) % cls.size()];
        break;
      }
    }
  }
  return out;
}

// `url` with the values of its credential parameters tweaked.
std::string TweakSecrets(std::string_view url) {
  const size_t q = url.find('?');
  if (q == std::string_view::npos) return std::string(url);
  std::string out(url.substr(0, q + 1));
  bool first = true;
  for (std::string_view item : Split(url.substr(q + 1), "&", 1 << 20)) {
    if (!first) out += '&';
    first = false;
    const size_t eq = item.find('=');
    if (eq != std::string_view::npos && IsSecretName(item.substr(0, eq)))
      out += std::string(item.substr(0, eq + 1)) + Tweak(item.substr(eq + 1));
    else out += item;
  }
  return out;
}

// What a parse shows: its error message, or Store::url() of the options.
struct Shown {
  bool ok = false;
  std::string text;
};

Shown Show(std::string_view url, const std::map<std::string, std::string>& env) {
  const dcr::GetEnvFunction getenv = [&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  auto o = dcr::ParseS3Url(url, getenv);
  if (!o.ok()) return {false, o.status().ToString()};
  return {true, o->url + " " + o->bucket + " " + o->prefix + " " + o->endpoint + " " + o->region};
}

void FuzzS3Url(std::string_view input) {
  const auto parts = Split(input, "\n--\n", 4);
  const std::string_view url = parts[0];
  std::map<std::string, std::string> env;
  if (parts.size() > 1) {
    for (std::string_view line : Split(parts[1], "\n", 64)) {
      const size_t eq = line.find('=');
      if (eq == std::string_view::npos) continue;
      env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    }
  }
  // Only our in-memory files are read: no $HOME, no paths from the input.
  env.erase("HOME");
  env.erase("AWS_SHARED_CREDENTIALS_FILE");
  env.erase("AWS_CONFIG_FILE");
  MemFile credentials(parts.size() > 2 ? parts[2] : "");
  MemFile config(parts.size() > 3 ? parts[3] : "");
  env["AWS_SHARED_CREDENTIALS_FILE"] = credentials.path();
  env["AWS_CONFIG_FILE"] = config.path();
  const dcr::GetEnvFunction getenv = [&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };

  // Credentials never show: with other credential values (in the URL and
  // the environment) the message, or the URL and settings, are the same.
  {
    auto tweaked_env = env;
    for (const char* name : {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
      if (auto it = tweaked_env.find(name); it != tweaked_env.end()) it->second = Tweak(it->second);
    const Shown a = Show(url, env), b = Show(TweakSecrets(url), tweaked_env);
    if (a.ok != b.ok || a.text != b.text) {
      std::fprintf(stderr, "credentials change what is shown:\n  %s\n  %s\n", a.text.c_str(), b.text.c_str());
      std::abort();
    }
  }

  auto o = dcr::ParseS3Url(url, getenv);
  if (!o.ok()) {
    if (o.status().code() != dcr::Code::kInvalidArgument && o.status().code() != dcr::Code::kPermissionDenied)
      std::abort();
    return;
  }
  if (o->bucket.empty() || !o->url.starts_with("s3://")) std::abort();
  if (!o->prefix.empty() && (!o->prefix.ends_with("/") || o->prefix.starts_with("/"))) std::abort();
  if (!o->endpoint.empty()) {
    const size_t host = o->endpoint.starts_with("http://") ? 7 : o->endpoint.starts_with("https://") ? 8 : 0;
    if (host == 0 || host == o->endpoint.size() || o->endpoint.find_first_of("/?#@", host) != std::string::npos)
      std::abort();
  }
  if (o->access_key_id.empty() != o->secret_access_key.empty()) std::abort();
  if (o->access_key_id.empty() && !o->session_token.empty()) std::abort();
  if (o->region.empty()) std::abort();

  // The options open without a request (no bucket creation: that would be
  // one), whatever else the URL said.
  dcr::S3Options options = *o;
  options.create_bucket = false;
  struct NoNetwork final : dcr::HttpTransport {
    dcr::Status Send(const dcr::HttpRequest&, dcr::HttpResponseHandler&) override { std::abort(); }
  };
  dcr::S3Runtime runtime;
  runtime.transport = std::make_shared<NoNetwork>();
  auto store = dcr::OpenS3Store(options, runtime);
  if (!store.ok()) std::abort();
  if ((*store)->url() != o->url) std::abort();
}

void FuzzOpenStore(std::string_view url) {
  if (url.starts_with("s3:")) return;  // 's' covers it; OpenStore would read the real environment
  dcr::OpenStoreOptions options;
  options.create_root = false;
  auto store = dcr::OpenStore(url, options);  // errors are errno's (ENAMETOOLONG, ELOOP, ...)
  if (store.ok() && url.starts_with("mem://")) dcr::ResetMemStore(url.substr(6));
}

void FuzzFaultSpec(std::string_view spec) {
  auto store = dcr::WrapWithFaults(dcr::OpenMemStore("fuzz-faults"), spec);
  if (!store.ok() && store.status().code() != dcr::Code::kInvalidArgument) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 4096) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0]) {
    case 's': FuzzS3Url(input); break;
    case 'o': FuzzOpenStore(input); break;
    case 'f': FuzzFaultSpec(input); break;
    default: break;
  }
  return 0;
}
