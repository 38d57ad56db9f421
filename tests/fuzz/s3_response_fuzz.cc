// Fuzzes the S3 driver (src/store/s3_*.cc) against a server whose every
// reply comes from the input: status codes, Content-Length, Content-Range and
// ETag headers, XML bodies (ListBucketResult pages, Error,
// InitiateMultipartUploadResult, CompleteMultipartUploadResult), bodies cut
// short, refused connections and timeouts. Each operation must end (retries
// are bounded, backoff does not sleep) with an error or a result that is
// consistent: a Get's data as long as its size, a Head with an ETag, a List
// sorted and made of valid keys. Never a crash, a leak, undefined behaviour
// or a read outside a buffer.
//
// Input: text, segments separated by "\n~~\n". The first is the operations,
// space-separated (at most 8):
//   H          Head            G          Get             D       Delete
//   R<o>,<n>   ReadRange of n bytes at o (n <= part size); R<o>,<n>,e with if_match
//   L<prefix>  List            B          CreateS3Bucket
//   P<n>       Put of n bytes  C<n>       Put create-if-absent
//   W<n>       a streaming writer of n bytes, closed; W<n>a aborted instead
// Every later segment is one reply, taken by the requests in order (the
// operations are configured so that requests never run in parallel):
//   "HTTP <status>[ drop <n>]" or "refuse" or "timeout", then "Name: value"
//   header lines, an empty line and the body. "drop n" breaks the connection
//   after n body bytes. When the replies run out, connections are refused.
// Sizes in Content-Length and Content-Range are capped at the part size
// (4096): a real server may announce any size, and the driver then allocates
// it, which is not what this target looks for.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/s3.h"
#include "dcr/store.h"

namespace {

constexpr uint64_t kPartSize = 4096;

std::vector<std::string_view> Split(std::string_view s, std::string_view sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t at = s.find(sep);
    if (at == std::string_view::npos) break;
    out.push_back(s.substr(0, at));
    s.remove_prefix(at + sep.size());
  }
  out.push_back(s);
  return out;
}

uint64_t Number(std::string_view s, size_t* pos) {
  uint64_t v = 0;
  while (*pos < s.size() && s[*pos] >= '0' && s[*pos] <= '9') {
    v = std::min<uint64_t>(v * 10 + static_cast<uint64_t>(s[*pos] - '0'), 1'000'000'000);
    ++*pos;
  }
  return v;
}

// Every run of digits above kPartSize becomes its value mod kPartSize + 1.
std::string CapNumbers(std::string_view v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    if (v[i] < '0' || v[i] > '9') {
      out += v[i++];
      continue;
    }
    const size_t start = i;
    const uint64_t n = Number(v, &i);
    if (n > kPartSize || i - start > 4) out += std::to_string(n % (kPartSize + 1));
    else out += v.substr(start, i - start);
  }
  return out;
}

struct Reply {
  enum Kind { kResponse, kRefuse, kTimeout } kind = kRefuse;
  int status = 0;
  size_t drop_after = SIZE_MAX;
  dcr::HttpHeaders headers;
  std::string body;
};

Reply ParseReply(std::string_view seg) {
  Reply r;
  const size_t eol = std::min(seg.find('\n'), seg.size());
  const std::string_view first = seg.substr(0, eol);
  std::string_view rest = eol < seg.size() ? seg.substr(eol + 1) : std::string_view();
  if (first == "timeout") {
    r.kind = Reply::kTimeout;
    return r;
  }
  if (!first.starts_with("HTTP ")) return r;  // refuse
  size_t pos = 5;
  r.status = static_cast<int>(Number(first, &pos));
  if (r.status < 200 || r.status > 599) return r;  // transports never hand out 1xx or nonsense
  r.kind = Reply::kResponse;
  if (first.substr(pos).starts_with(" drop ")) {
    pos += 6;
    r.drop_after = Number(first, &pos);
  }
  while (!rest.empty()) {
    const size_t nl = std::min(rest.find('\n'), rest.size());
    const std::string_view line = rest.substr(0, nl);
    rest = nl < rest.size() ? rest.substr(nl + 1) : std::string_view();
    if (line.empty()) break;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    std::string name(line.substr(0, colon));
    std::string lower = name;
    for (char& c : lower) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    const bool size = lower == "content-length" || lower == "content-range";
    r.headers.push_back({std::move(name), size ? CapNumbers(value) : std::string(value)});
  }
  r.body = std::string(rest);
  return r;
}

class ScriptedServer final : public dcr::HttpTransport {
 public:
  explicit ScriptedServer(std::vector<Reply> replies)
      : replies_(std::move(replies)), max_requests_(replies_.size() + 1000) {}

  dcr::Status Send(const dcr::HttpRequest& request, dcr::HttpResponseHandler& handler) override {
    Reply r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++sent_ > max_requests_) std::abort();  // operations end once the replies run out
      if (next_ < replies_.size()) r = replies_[next_++];
    }
    if (r.kind == Reply::kRefuse) return dcr::Unavailable("connection refused (scripted)");
    if (r.kind == Reply::kTimeout) return dcr::DeadlineExceeded("timed out (scripted)");
    if (!handler.OnHeaders(r.status, r.headers)) return dcr::Aborted("abandoned by the handler");
    if (request.method == "HEAD") return dcr::Status::Ok();
    const std::string_view body(r.body);
    const size_t n = std::min(body.size(), r.drop_after);
    // In two pieces, as a network would.
    const size_t half = n / 2;
    if (half > 0 && !handler.OnBody(body.substr(0, half))) return dcr::Aborted("abandoned by the handler");
    if (n > half && !handler.OnBody(body.substr(half, n - half))) return dcr::Aborted("abandoned by the handler");
    if (n < body.size()) return dcr::Unavailable("connection reset (scripted)");
    return dcr::Status::Ok();
  }

 private:
  std::mutex mu_;
  std::vector<Reply> replies_;
  const size_t max_requests_;
  size_t next_ = 0;
  size_t sent_ = 0;
};

void Check(bool ok) {
  if (!ok) std::abort();
}

// DCR_FUZZ_VERBOSE=1: print each operation's outcome (to check seeds).
void Report(std::string_view op, const dcr::Status& s) {
  static const bool verbose = std::getenv("DCR_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(op.size()), op.data(), s.ToString().c_str());
}

void Run(dcr::Store& store, const dcr::S3Options& options, const dcr::S3Runtime& runtime, std::string_view op,
         const std::string& data) {
  const std::string key = "dir/obj";
  size_t pos = 1;
  switch (op.empty() ? ' ' : op[0]) {
    case 'H': {
      auto info = store.Head(key);
      Report(op, info.status());
      if (info.ok()) Check(!info->etag.empty() && info->key == key);
      break;
    }
    case 'G': {
      dcr::ObjectInfo info;
      auto got = store.Get(key, &info);
      Report(op, got.status());
      if (got.ok()) Check(got->size() == info.size && info.key == key);
      break;
    }
    case 'R': {
      const uint64_t offset = Number(op, &pos);
      if (pos < op.size() && op[pos] == ',') ++pos;
      const uint64_t n = std::min(Number(op, &pos), kPartSize);
      dcr::ReadOptions ro;
      if (pos < op.size() && op[pos] == ',') ro.if_match = "\"0123456789abcdef0123456789abcdef\"";
      std::vector<uint8_t> out(n);
      Report(op, store.ReadRange(key, offset, out, ro));
      break;
    }
    case 'L': {
      auto list = store.List(op.substr(1));
      Report(op, list.status());
      if (list.ok()) {
        for (size_t i = 0; i < list->size(); ++i) {
          Check(dcr::ValidateKey((*list)[i].key).ok() && (*list)[i].key.starts_with(op.substr(1)));
          if (i > 0) Check((*list)[i - 1].key <= (*list)[i].key);
        }
      }
      break;
    }
    case 'P':
    case 'C': {
      const uint64_t n = std::min<uint64_t>(Number(op, &pos), data.size());
      Report(op, store.Put(key, std::string_view(data).substr(0, n),
                           op[0] == 'C' ? dcr::WriteMode::kCreateIfAbsent : dcr::WriteMode::kOverwrite));
      break;
    }
    case 'W': {
      const uint64_t n = std::min<uint64_t>(Number(op, &pos), data.size());
      auto w = store.OpenWriter(key, dcr::WriteMode::kOverwrite);
      Check(w.ok());
      dcr::Status s;
      for (uint64_t off = 0; off < n && s.ok(); off += 1000)
        s = (*w)->Write(std::string_view(data).substr(off, std::min<uint64_t>(1000, n - off)));
      if (pos < op.size() && op[pos] == 'a') (*w)->Abort();
      else if (s.ok()) s = (*w)->Close();
      Report(op, s);
      break;
    }
    case 'D': Report(op, store.Delete(key)); break;
    case 'B': Report(op, dcr::CreateS3Bucket(options, runtime)); break;
    default: break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size > 65536) return 0;
  const auto segments = Split(std::string_view(reinterpret_cast<const char*>(bytes), size), "\n~~\n");
  std::vector<Reply> replies;
  for (size_t i = 1; i < segments.size(); ++i) replies.push_back(ParseReply(segments[i]));

  dcr::S3Options options;
  options.bucket = "bkt";
  options.prefix = "pre/";
  options.endpoint = "http://127.0.0.1:9";
  options.region = "us-east-1";
  options.addressing = dcr::S3Addressing::kPath;
  options.access_key_id = "AKIDFUZZ";
  options.secret_access_key = "fuzz/secret";
  options.part_size = kPartSize;
  options.parts_in_flight = 1;  // requests one at a time: replies go to them in order
  options.threads = 1;
  options.max_attempts = 3;
  options.create_if_absent_limit = 3 * kPartSize;
  dcr::S3Runtime runtime;
  runtime.transport = std::make_shared<ScriptedServer>(std::move(replies));
  runtime.sleep = [](std::chrono::milliseconds) {};
  runtime.now = [] { return std::chrono::system_clock::time_point(std::chrono::seconds(1'700'000'000)); };
  auto store = dcr::OpenS3Store(options, runtime);
  Check(store.ok());

  static const std::string data = [] {
    std::string d(4 * kPartSize, '\0');
    for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<char>(i * 7 + 1);
    return d;
  }();
  const auto ops = Split(segments[0], " ");
  for (size_t i = 0; i < ops.size() && i < 8; ++i) Run(**store, options, runtime, ops[i], data);
  return 0;
}
