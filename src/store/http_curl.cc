// HttpTransport over libcurl's easy interface. Each Send borrows an easy
// handle from a pool; a handle keeps its connection alive for the next
// request that borrows it (curl_easy_reset keeps live connections). Handles
// share the DNS and TLS session caches.
#include <curl/curl.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "dcr/http.h"

namespace dcr {

namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

}  // namespace

const std::string* FindHeader(const HttpHeaders& headers, std::string_view name) {
  for (const auto& h : headers)
    if (EqualsIgnoreCase(h.name, name)) return &h.value;
  return nullptr;
}

namespace {

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// The CA bundle to verify servers with: $SSL_CERT_FILE when set; else, when
// libcurl was built without a default (the wheel's: its builder cannot know
// where the installing distribution keeps it), the first bundle found where
// Linux distributions keep theirs; else "" (libcurl's default).
const std::string& CaBundle() {
  static const std::string path = [] {
    if (const char* env = std::getenv("SSL_CERT_FILE"); env != nullptr && *env != '\0') return std::string(env);
    const curl_version_info_data* v = curl_version_info(CURLVERSION_NOW);
    if (v->cainfo != nullptr || v->capath != nullptr) return std::string();
    for (const char* p : {"/etc/ssl/certs/ca-certificates.crt",  // Debian, Ubuntu, Arch, Gentoo
                          "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",  // RHEL 7+, Fedora
                          "/etc/pki/tls/certs/ca-bundle.crt",  // older RHEL, Fedora
                          "/etc/ssl/ca-bundle.pem",  // openSUSE
                          "/etc/ssl/cert.pem"})  // Alpine
      if (access(p, R_OK) == 0) return std::string(p);
    return std::string();
  }();
  return path;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n'))
    s.remove_suffix(1);
  return s;
}

// "GET http://host/path" (no query: it may carry tokens) for messages.
std::string Describe(const HttpRequest& r) {
  const size_t q = r.url.find('?');
  return r.method + " " + r.url.substr(0, q);
}

// State of one exchange, reached from curl's callbacks.
struct Exchange {
  const HttpRequest* request = nullptr;
  HttpResponseHandler* handler = nullptr;
  size_t body_offset = 0;  // upload position
  int status = 0;
  HttpHeaders headers;
  bool delivered_headers = false;
  bool handler_abandoned = false;

  // Hands the final status and headers to the handler once.
  bool Deliver() {
    if (delivered_headers) return true;
    delivered_headers = true;
    if (!handler->OnHeaders(status, std::move(headers))) {
      handler_abandoned = true;
      return false;
    }
    return true;
  }
};

size_t HeaderCallback(char* data, size_t size, size_t n, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const size_t bytes = size * n;
  std::string_view line(data, bytes);
  if (line.starts_with("HTTP/")) {  // a new status line: an interim response may precede the final one
    ex->headers.clear();
    ex->status = 0;
    const size_t sp = line.find(' ');
    if (sp != std::string_view::npos) {
      int code = 0;
      for (size_t i = sp + 1; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i)
        code = code * 10 + (line[i] - '0');
      ex->status = code;
    }
    return bytes;
  }
  const std::string_view trimmed = Trim(line);
  if (trimmed.empty()) {  // end of a header block
    if (ex->status >= 200 && !ex->Deliver()) return 0;
    return bytes;
  }
  const size_t colon = trimmed.find(':');
  if (colon != std::string_view::npos)
    ex->headers.push_back({std::string(Trim(trimmed.substr(0, colon))), std::string(Trim(trimmed.substr(colon + 1)))});
  return bytes;
}

size_t WriteCallback(char* data, size_t size, size_t n, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const size_t bytes = size * n;
  if (!ex->Deliver()) return 0;
  if (!ex->handler->OnBody(std::string_view(data, bytes))) {
    ex->handler_abandoned = true;
    return 0;
  }
  return bytes;
}

size_t ReadCallback(char* buffer, size_t size, size_t n, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const std::string_view body = ex->request->body;
  const size_t len = std::min(size * n, body.size() - ex->body_offset);
  std::memcpy(buffer, body.data() + ex->body_offset, len);
  ex->body_offset += len;
  return len;
}

// curl rewinds the body when it resends a request on a fresh connection.
int SeekCallback(void* user, curl_off_t offset, int origin) {
  auto* ex = static_cast<Exchange*>(user);
  if (origin != SEEK_SET || offset < 0 || static_cast<size_t>(offset) > ex->request->body.size())
    return CURL_SEEKFUNC_FAIL;
  ex->body_offset = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

class CurlTransport final : public HttpTransport {
 public:
  explicit CurlTransport(const CurlTransportOptions& options) : options_(options) {
    GlobalInit();
    share_ = curl_share_init();
    curl_share_setopt(share_, CURLSHOPT_LOCKFUNC, &CurlTransport::Lock);
    curl_share_setopt(share_, CURLSHOPT_UNLOCKFUNC, &CurlTransport::Unlock);
    curl_share_setopt(share_, CURLSHOPT_USERDATA, this);
    curl_share_setopt(share_, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    curl_share_setopt(share_, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  }

  ~CurlTransport() override {
    for (CURL* h : idle_) curl_easy_cleanup(h);
    curl_share_cleanup(share_);
  }

  Status Send(const HttpRequest& request, HttpResponseHandler& handler) override {
    CURL* h = Acquire();
    if (h == nullptr) return Internal("curl_easy_init failed");
    Exchange ex;
    ex.request = &request;
    ex.handler = &handler;
    char errbuf[CURL_ERROR_SIZE] = {0};

    curl_slist* headers = nullptr;
    bool has_content_type = false;
    for (const auto& hd : request.headers) {
      // "Name;" is curl's way to send a header with an empty value.
      const std::string line = hd.value.empty() ? hd.name + ";" : hd.name + ": " + hd.value;
      headers = curl_slist_append(headers, line.c_str());
      if (EqualsIgnoreCase(hd.name, "content-type")) has_content_type = true;
    }
    headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip
    if (!has_content_type) headers = curl_slist_append(headers, "Content-Type:");

    curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PATH_AS_IS, 1L);
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 512L * 1024);
    curl_easy_setopt(h, CURLOPT_UPLOAD_BUFFERSIZE, 512L * 1024);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.connect_timeout.count()));
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, options_.low_speed_bytes);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(options_.low_speed_time.count()));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.request_timeout.count()));
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, options_.verify_tls ? 1L : 0L);
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, options_.verify_tls ? 2L : 0L);
    if (options_.verify_tls && !CaBundle().empty()) curl_easy_setopt(h, CURLOPT_CAINFO, CaBundle().c_str());
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &HeaderCallback);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &ex);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &WriteCallback);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &ex);

    const std::string& m = request.method;
    if (m == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (m == "PUT" || m == "POST") {
      curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
      curl_easy_setopt(h, CURLOPT_READFUNCTION, &ReadCallback);
      curl_easy_setopt(h, CURLOPT_READDATA, &ex);
      curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, &SeekCallback);
      curl_easy_setopt(h, CURLOPT_SEEKDATA, &ex);
      if (m == "POST") curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "POST");
    } else if (m != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, m.c_str());
    }

    const CURLcode rc = curl_easy_perform(h);
    // A response without a body ends its header block without a write call.
    if (rc == CURLE_OK && !ex.delivered_headers && ex.status >= 200) ex.Deliver();
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
    curl_slist_free_all(headers);
    Release(h, rc == CURLE_OK);

    if (ex.handler_abandoned) return Aborted(Describe(request) + ": abandoned by the response handler");
    if (rc == CURLE_OK) {
      if (!ex.delivered_headers) return Unavailable(Describe(request) + ": no response status");
      return Status::Ok();
    }
    const std::string cause = errbuf[0] != '\0' ? std::string(Trim(errbuf)) : curl_easy_strerror(rc);
    const std::string msg = fmt::format("{}: {} (curl error {})", Describe(request), cause, static_cast<int>(rc));
    switch (rc) {
      case CURLE_OPERATION_TIMEDOUT: return DeadlineExceeded(msg);
      case CURLE_URL_MALFORMAT:
      case CURLE_UNSUPPORTED_PROTOCOL: return InvalidArgument(msg);
      case CURLE_PEER_FAILED_VERIFICATION:
      case CURLE_SSL_CACERT_BADFILE:
      case CURLE_SSL_CERTPROBLEM: return FailedPrecondition(msg);
      case CURLE_OUT_OF_MEMORY: return Internal(msg);
      default: return Unavailable(msg);
    }
  }

 private:
  CURL* Acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        CURL* h = idle_.back();
        idle_.pop_back();
        curl_easy_reset(h);  // keeps the live connection and caches
        curl_easy_setopt(h, CURLOPT_SHARE, share_);
        return h;
      }
    }
    CURL* h = curl_easy_init();
    if (h != nullptr) curl_easy_setopt(h, CURLOPT_SHARE, share_);
    return h;
  }

  void Release(CURL* h, bool reusable) {
    if (reusable) {
      std::lock_guard<std::mutex> lock(mu_);
      if (idle_.size() < options_.max_idle_connections) {
        idle_.push_back(h);
        return;
      }
    }
    curl_easy_cleanup(h);
  }

  static void Lock(CURL*, curl_lock_data data, curl_lock_access, void* user) {
    static_cast<CurlTransport*>(user)->share_mu_[static_cast<size_t>(data) % kLocks].lock();
  }
  static void Unlock(CURL*, curl_lock_data data, void* user) {
    static_cast<CurlTransport*>(user)->share_mu_[static_cast<size_t>(data) % kLocks].unlock();
  }

  static constexpr size_t kLocks = 16;
  const CurlTransportOptions options_;
  CURLSH* share_ = nullptr;
  std::array<std::mutex, kLocks> share_mu_;
  std::mutex mu_;
  std::vector<CURL*> idle_;  // guarded by mu_
};

}  // namespace

std::shared_ptr<HttpTransport> NewCurlTransport(const CurlTransportOptions& options) {
  return std::make_shared<CurlTransport>(options);
}

}  // namespace dcr
