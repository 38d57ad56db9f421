// dcr_store_bench URL... [--max-size 256MiB] [--min-size 1MiB] [--part-sizes 5MiB,8MiB,16MiB,32MiB,64MiB]
//                        [--parallel 1,2,4,8,16] [--rates 50,200] [--repeat 3] [--grid-size SIZE]
//                        [--no-grid] [--no-overlap] [--after-each SHELL-COMMAND]
//
// Object store throughput (docs/benchmarks.md, "Object stores"), for each
// store URL given (file:///dir, s3://bucket/prefix?..., mem://name):
//
//  1. put, get (Store::Get: a new string) and ReadRange (the whole object into
//     a buffer the caller has) of objects from --min-size to --max-size (x4
//     steps), with the store's defaults, next to a baseline of the same size:
//     for file://, raw write+fsync and pread of plain files in the store's
//     directory (what `cp` plus `sync` costs); for s3://, the same store with
//     one connection (parts_in_flight=1&threads=1: puts send one request at a
//     time; a read larger than a part runs on the caller and the one thread,
//     so two GETs); for mem://, memcpy;
//  2. s3:// only: put and get of one --grid-size object (default --max-size)
//     for every part size x parallel connections (parts_in_flight = threads = N);
//  3. the overlap of a streaming put with its producer: a producer makes
//     --grid-size bytes at a fixed rate (1 MiB pieces, sleep-paced) into an
//     ObjectWriter; the ratio is the put's time (first byte to Close) over the
//     producer's time alone. 1.00 is perfect overlap.
//
// MB/s are 10^6 bytes per second; sizes are MiB. Each figure is the best of
// --repeat runs; objects smaller than 64 MiB are put/got several at a time
// (up to 16, 64 MiB in all) so request latency is averaged. Each line shows
// the 1-minute load average when it was measured: a busy machine understates.
// Progress goes to stderr as each figure is done. --after-each runs a shell
// command after every measured run, untimed: radosgw only frees deleted
// multipart objects in its garbage collection (hours later by default), so
// give it `radosgw-admin -c $DCR_S3_CEPH_CONF gc process --include-all`
// or its in-memory OSD fills up.
//
// For 1 GiB objects: --max-size 1GiB (or --min-size 1GiB --max-size 1GiB
// --no-grid for that size alone); the process then holds about 4 GiB, and
// radosgw's memstore OSD needs room: start it with
// DCR_S3_MEMSTORE_BYTES=4294967296 and pass --after-each as above.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dcr/progress.h"
#include "dcr/s3.h"
#include "dcr/store.h"

namespace {

using namespace dcr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

struct Config {
  std::vector<std::string> urls;
  uint64_t min_size = kMiB;
  uint64_t max_size = 256 * kMiB;
  uint64_t grid_size = 0;  // 0: max_size
  std::vector<uint64_t> part_sizes = {5 * kMiB, 8 * kMiB, 16 * kMiB, 32 * kMiB, 64 * kMiB};
  std::vector<uint64_t> parallel = {1, 2, 4, 8, 16};
  std::vector<double> rates = {50, 200};  // MB/s
  int repeat = 3;
  bool grid = true;
  bool overlap = true;
  std::string after_each;  // shell command run after each measured run (not timed)
};

const Config* g_config = nullptr;

// --after-each: e.g. radosgw's garbage collection, so deleted multipart
// objects do not fill its in-memory OSD.
void AfterEach() {
  if (g_config == nullptr || g_config->after_each.empty()) return;
  if (std::system(g_config->after_each.c_str()) != 0)
    fmt::print(stderr, "dcr_store_bench: warning: --after-each command failed\n");
}

double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double l = 0;
  in >> l;
  return l;
}

std::string Mib(uint64_t bytes) {
  if (bytes % kMiB == 0) return fmt::format("{} MiB", bytes / kMiB);
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / kMiB);
}

// part_size in the URL's own syntax.
std::string PartArg(uint64_t bytes) {
  if (bytes % kMiB == 0) return fmt::format("{}m", bytes / kMiB);
  return std::to_string(bytes);
}

// `url` with the query parameters in `set` replacing any of the same name.
std::string WithQuery(const std::string& url, const std::vector<std::pair<std::string, std::string>>& set) {
  const size_t q = url.find('?');
  std::string base = url.substr(0, q);
  std::vector<std::string> items;
  if (q != std::string::npos) {
    std::string query = url.substr(q + 1);
    size_t start = 0;
    while (start <= query.size()) {
      size_t end = query.find('&', start);
      if (end == std::string::npos) end = query.size();
      std::string item = query.substr(start, end - start);
      start = end + 1;
      if (item.empty()) continue;
      const std::string name = item.substr(0, item.find('='));
      bool replaced = false;
      for (const auto& [k, v] : set) replaced = replaced || k == name;
      if (!replaced) items.push_back(item);
    }
  }
  for (const auto& [k, v] : set) items.push_back(k + "=" + v);
  std::string out = base;
  for (size_t i = 0; i < items.size(); ++i) out += (i == 0 ? "?" : "&") + items[i];
  return out;
}

// Progress on stderr: one line per figure, with elapsed time.
class Steps {
 public:
  explicit Steps(size_t total) : total_(total), start_(MonotonicSeconds()) {}
  void Done(const std::string& what) {
    ++done_;
    const double elapsed = MonotonicSeconds() - start_;
    const double eta = done_ < total_ ? elapsed / static_cast<double>(done_) * static_cast<double>(total_ - done_) : 0;
    fmt::print(stderr, "[{:>3}/{:>3}] {:<60} elapsed {:>5.0f} s, ~{:.0f} s left\n", done_, total_, what, elapsed, eta);
  }

 private:
  size_t total_, done_ = 0;
  double start_;
};

[[noreturn]] void Die(const std::string& what, const Status& s) {
  fmt::print(stderr, "dcr_store_bench: {}: {}\n", what, s.ToString());
  std::exit(1);
}

struct Speed {
  double put = 0, get = 0;  // MB/s
  double load = 0;
  double read = 0;  // MB/s of ReadRange into a buffer that is already mapped
};

// Best-of-`repeat` put and get of `count` objects of `size` bytes each.
size_t ObjectsPerRun(uint64_t size) { return static_cast<size_t>(std::clamp<uint64_t>(64 * kMiB / size, 1, 16)); }

// One buffer for every read into existing memory (raw preads and
// ReadRange), faulted in before any timing: how fast a read into memory is
// depends on where that memory came from (on the development VM a fresh
// mapping took preads to 1.6 GB/s, heap pages to 11+), so baseline and store
// must share it.
std::span<uint8_t> ReadBuffer(uint64_t size) {
  static std::vector<uint8_t> buffer;
  if (buffer.size() < size) buffer.assign(size, 1);
  return {buffer.data(), size};
}

Speed PutGet(Store& store, const std::string& tag, const std::string& data, uint64_t size, int repeat) {
  const size_t count = ObjectsPerRun(size);
  const std::string_view bytes(data.data(), size);
  const std::span<uint8_t> buffer = ReadBuffer(size);
  double best_put = 1e30, best_get = 1e30, best_read = 1e30;
  for (int r = 0; r < repeat; ++r) {
    std::vector<std::string> keys;
    for (size_t i = 0; i < count; ++i) keys.push_back(fmt::format("bench/{}/{}-{}-{}", tag, size, r, i));
    double t0 = MonotonicSeconds();
    for (const auto& k : keys)
      if (Status s = store.Put(k, bytes); !s.ok()) Die("put " + k, s);
    best_put = std::min(best_put, MonotonicSeconds() - t0);
    t0 = MonotonicSeconds();
    for (const auto& k : keys) {
      auto got = store.Get(k);
      if (!got.ok()) Die("get " + k, got.status());
      if (got->size() != size || std::memcmp(got->data(), bytes.data(), 4096 < size ? 4096 : size) != 0)
        Die("get " + k, DataLoss("wrong bytes"));
    }
    best_get = std::min(best_get, MonotonicSeconds() - t0);
    t0 = MonotonicSeconds();
    for (const auto& k : keys) {
      if (Status s = store.ReadRange(k, 0, buffer); !s.ok()) Die("read " + k, s);
      if (std::memcmp(buffer.data() + size - 1, bytes.data() + size - 1, 1) != 0)
        Die("read " + k, DataLoss("wrong bytes"));
    }
    best_read = std::min(best_read, MonotonicSeconds() - t0);
    for (const auto& k : keys)
      if (Status s = store.Delete(k); !s.ok()) Die("delete " + k, s);
    AfterEach();
  }
  const double total = static_cast<double>(size) * static_cast<double>(count);
  return {total / best_put / 1e6, total / best_get / 1e6, LoadAverage(), total / best_read / 1e6};
}

// The producer: `size` bytes at `rate` MB/s in 1 MiB pieces, each handed to
// `sink` no earlier than its time on the schedule. Returns the seconds from
// start until the last piece was handed over.
template <typename Sink>
double Produce(const std::string& data, uint64_t size, double rate, Sink&& sink) {
  const double t0 = MonotonicSeconds();
  for (uint64_t off = 0; off < size; off += kMiB) {
    const uint64_t n = std::min(kMiB, size - off);
    const double due = t0 + static_cast<double>(off + n) / (rate * 1e6);
    const double now = MonotonicSeconds();
    if (now < due) std::this_thread::sleep_for(std::chrono::duration<double>(due - now));
    sink(std::string_view(data.data() + off, n));
  }
  return MonotonicSeconds() - t0;
}

struct Overlap {
  double producer = 0, put = 0, load = 0;  // seconds; put includes Close
};

Overlap StreamingPut(Store& store, const std::string& tag, const std::string& data, uint64_t size, double rate,
                     int repeat) {
  Overlap best{1e30, 1e30, 0};
  for (int r = 0; r < repeat; ++r) {
    best.producer = std::min(best.producer, Produce(data, size, rate, [](std::string_view) {}));
    const std::string key = fmt::format("bench/{}/stream-{}-{}", tag, size, r);
    auto w = store.OpenWriter(key, WriteMode::kOverwrite);
    if (!w.ok()) Die("open writer " + key, w.status());
    const double t0 = MonotonicSeconds();
    Produce(data, size, rate, [&](std::string_view piece) {
      if (Status s = (*w)->Write(piece); !s.ok()) Die("write " + key, s);
    });
    if (Status s = (*w)->Close(); !s.ok()) Die("close " + key, s);
    best.put = std::min(best.put, MonotonicSeconds() - t0);
    if (Status s = store.Delete(key); !s.ok()) Die("delete " + key, s);
    AfterEach();
  }
  best.load = LoadAverage();
  return best;
}

std::unique_ptr<Store> Open(const std::string& url) {
  auto store = OpenStore(url);
  if (!store.ok()) Die("open " + url, store.status());
  return std::move(*store);
}

// memcpy of `size` bytes, best of 3 (both buffers already faulted in).
double MemcpySpeed(const std::string& data, uint64_t size) {
  std::string dst(size, '\0');
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const double t0 = MonotonicSeconds();
    std::memcpy(dst.data(), data.data(), size);
    best = std::min(best, MonotonicSeconds() - t0);
  }
  if (dst[size / 2] != data[size / 2]) std::abort();
  return static_cast<double>(size) / best / 1e6;
}

// Raw write + fsync and pread of the same objects as PutGet, as plain
// files in `dir`: what a file store cannot beat (`cp` then `sync`).
Speed RawFile(const std::string& dir, const std::string& data, uint64_t size, int repeat) {
  const size_t count = ObjectsPerRun(size);
  const std::span<uint8_t> back = ReadBuffer(size);
  double best_w = 1e30, best_r = 1e30;
  for (int r = 0; r < repeat; ++r) {
    std::vector<std::string> paths;
    for (size_t i = 0; i < count; ++i) paths.push_back(fmt::format("{}/.dcr-bench-raw-{}", dir, i));
    double t0 = MonotonicSeconds();
    for (const auto& path : paths) {
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) Die("create " + path, ErrnoError(errno, "open"));
      for (uint64_t off = 0; off < size;) {
        const ssize_t n = ::write(fd, data.data() + off, size - off);
        if (n <= 0) Die("write " + path, ErrnoError(errno, "write"));
        off += static_cast<uint64_t>(n);
      }
      if (::fsync(fd) != 0) Die("fsync " + path, ErrnoError(errno, "fsync"));
      ::close(fd);
    }
    best_w = std::min(best_w, MonotonicSeconds() - t0);
    t0 = MonotonicSeconds();
    for (const auto& path : paths) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      for (uint64_t off = 0; off < size;) {
        const ssize_t n = ::pread(fd, back.data() + off, size - off, static_cast<off_t>(off));
        if (n <= 0) Die("read " + path, ErrnoError(errno, "read"));
        off += static_cast<uint64_t>(n);
      }
      ::close(fd);
    }
    best_r = std::min(best_r, MonotonicSeconds() - t0);
    for (const auto& path : paths) ::unlink(path.c_str());
  }
  const double total = static_cast<double>(size) * static_cast<double>(count);
  return {total / best_w / 1e6, total / best_r / 1e6, LoadAverage(), total / best_r / 1e6};
}

std::vector<uint64_t> Sizes(const Config& c) {
  std::vector<uint64_t> out;
  for (uint64_t s = c.min_size; s <= c.max_size; s *= 4) out.push_back(s);
  if (out.empty() || out.back() != c.max_size) out.push_back(c.max_size);
  return out;
}

template <typename T, typename F>
std::vector<T> ParseList(const std::string& flag, const std::string& text, F&& parse) {
  std::vector<T> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    if (end > start) out.push_back(parse(text.substr(start, end - start)));
    start = end + 1;
  }
  if (out.empty()) {
    fmt::print(stderr, "{}: empty list\n", flag);
    std::exit(2);
  }
  return out;
}

uint64_t Bytes(const std::string& flag, const std::string& v) {
  auto b = ParseBytes(v);
  if (!b.ok() || *b == 0) {
    fmt::print(stderr, "{} {}: {}\n", flag, v, b.ok() ? "must be positive" : b.status().ToString());
    std::exit(2);
  }
  return *b;
}

Config ParseArgs(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{} needs a value\n", k);
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--max-size") c.max_size = Bytes(k, value());
    else if (k == "--min-size") c.min_size = Bytes(k, value());
    else if (k == "--grid-size") c.grid_size = Bytes(k, value());
    else if (k == "--part-sizes")
      c.part_sizes = ParseList<uint64_t>(k, value(), [&](const std::string& s) { return Bytes(k, s); });
    else if (k == "--parallel")
      c.parallel = ParseList<uint64_t>(k, value(), [&](const std::string& s) { return Bytes(k, s); });  // plain counts
    else if (k == "--rates") c.rates = ParseList<double>(k, value(), [](const std::string& s) { return std::stod(s); });
    else if (k == "--repeat") c.repeat = std::max(1, std::stoi(value()));
    else if (k == "--after-each") c.after_each = value();
    else if (k == "--no-grid") c.grid = false;
    else if (k == "--no-overlap") c.overlap = false;
    else if (k.starts_with("--")) {
      fmt::print(stderr, "unknown option {}\n", k);
      std::exit(2);
    } else {
      c.urls.push_back(k);
    }
  }
  if (c.urls.empty()) {
    fmt::print(stderr,
               "usage: dcr_store_bench URL... [--max-size 256MiB] [--min-size 1MiB] [--grid-size SIZE]\n"
               "       [--part-sizes 5MiB,8MiB,...] [--parallel 1,2,4,...] [--rates 50,200] [--repeat 3]\n"
               "       [--no-grid] [--no-overlap] [--after-each SHELL-COMMAND]\n"
               "e.g.   dcr_store_bench file:///tmp/dcr-bench-store 's3://dcr-bench?addressing=path'\n");
    std::exit(2);
  }
  if (c.min_size > c.max_size) c.min_size = c.max_size;
  if (c.grid_size == 0) c.grid_size = c.max_size;
  return c;
}

std::string FileDir(const std::string& url) {
  if (url.starts_with("file://")) return url.substr(7);
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  const Config c = ParseArgs(argc, argv);
  g_config = &c;
  const std::vector<uint64_t> sizes = Sizes(c);
  const uint64_t largest = std::max(c.max_size, c.grid_size);

  // Steps, for the progress lines.
  size_t total = 0;
  for (const auto& url : c.urls) {
    const bool s3 = url.starts_with("s3://");
    total += sizes.size();
    if (s3 && c.grid) total += c.part_sizes.size() * c.parallel.size();
    if (c.overlap) total += c.rates.size() * (s3 ? 2 : 1);
  }
  Steps steps(total);

  std::string data(largest, '\0');
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(data.data() + i, &x, 8);
  }
  const double memcpy_mbs = MemcpySpeed(data, largest);
  ReadBuffer(largest);

  fmt::print("dcr_store_bench: sizes {}..{}, best of {}, {} cores, load average {:.2f} at start\n", Mib(c.min_size),
             Mib(c.max_size), c.repeat, std::thread::hardware_concurrency(), LoadAverage());
  fmt::print("baseline: memcpy of {}: {:.0f} MB/s\n", Mib(largest), memcpy_mbs);

  for (const auto& url : c.urls) {
    const bool s3 = url.starts_with("s3://");
    const std::string dir = FileDir(url);
    if (s3) {
      if (Status s = CreateS3Bucket(url); !s.ok()) Die("create bucket for " + url, s);
    }
    fmt::print("\n## {}\n", Open(url)->url());

    // 1. Sizes, default settings, next to the baseline of the same size.
    const char* base_name = s3 ? "one connection: parts_in_flight=1&threads=1 (puts send one request at a time; "
                                 "reads larger than a part use the caller and the one thread, so two GETs)"
                            : !dir.empty() ? "raw write+fsync of files in the same directory / pread into a buffer"
                                           : "memcpy";
    fmt::print(
        "\n| size | baseline put MB/s | put MB/s | put vs baseline | baseline get MB/s | get MB/s | "
        "get vs baseline | ReadRange MB/s | ReadRange vs baseline | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n");
    auto store = Open(url);
    std::unique_ptr<Store> single;
    if (s3) single = Open(WithQuery(url, {{"parts_in_flight", "1"}, {"threads", "1"}}));
    for (uint64_t size : sizes) {
      Speed base{memcpy_mbs, memcpy_mbs, 0, memcpy_mbs};
      if (s3) base = PutGet(*single, "single", data, size, c.repeat);
      else if (!dir.empty()) base = RawFile(dir, data, size, c.repeat);
      const Speed sp = PutGet(*store, "default", data, size, c.repeat);
      fmt::print("| {} | {:.0f} | {:.0f} | {:.2f}x | {:.0f} | {:.0f} | {:.2f}x | {:.0f} | {:.2f}x | {:.2f} |\n",
                 Mib(size), base.put, sp.put, sp.put / base.put, base.get, sp.get, sp.get / base.get, sp.read,
                 sp.read / (s3 ? base.read : base.get), sp.load);
      std::fflush(stdout);
      steps.Done(fmt::format("{} put/get {}: {:.0f} / {:.0f} MB/s", s3 ? "s3" : url, Mib(size), sp.put, sp.get));
    }
    fmt::print("(baseline: {}; ReadRange: the whole object into a buffer the caller already has)\n", base_name);

    // 2. s3: part size x parallel connections.
    if (s3 && c.grid) {
      fmt::print("\n{} objects, put MB/s / get MB/s (parallel N: parts_in_flight = threads = N):\n\n",
                 Mib(c.grid_size));
      std::string header = "| part size |", rule = "|---|";
      for (uint64_t p : c.parallel) {
        header += fmt::format(" {} |", p);
        rule += "---|";
      }
      fmt::print("{}\n{}\n", header, rule);
      double worst_load = 0;
      for (uint64_t part : c.part_sizes) {
        std::string row = fmt::format("| {} |", Mib(part));
        for (uint64_t p : c.parallel) {
          const std::string u = WithQuery(
              url,
              {{"part_size", PartArg(part)}, {"parts_in_flight", std::to_string(p)}, {"threads", std::to_string(p)}});
          auto st = Open(u);
          const Speed sp = PutGet(*st, "grid", data, c.grid_size, c.repeat);
          worst_load = std::max(worst_load, sp.load);
          row += fmt::format(" {:.0f} / {:.0f} |", sp.put, sp.get);
          steps.Done(fmt::format("s3 grid {} part {} x{}: {:.0f} / {:.0f} MB/s", Mib(c.grid_size), Mib(part), p, sp.put,
                                 sp.get));
        }
        fmt::print("{}\n", row);
        std::fflush(stdout);
      }
      fmt::print("(highest load average during the grid: {:.2f})\n", worst_load);
    }

    // 3. Streaming put against a paced producer.
    if (c.overlap) {
      fmt::print(
          "\nstreaming put of {} fed at a fixed rate (ratio = put time / producer time; 1.00 = perfect "
          "overlap):\n\n| producer | settings | producer s | put s | ratio | load |\n|---|---|---|---|---|---|\n",
          Mib(c.grid_size));
      for (double rate : c.rates) {
        std::vector<std::pair<std::string, Store*>> variants = {{s3 ? "defaults" : "store", store.get()}};
        if (s3) variants.insert(variants.begin(), {"one connection", single.get()});
        for (const auto& [name, st] : variants) {
          const Overlap o = StreamingPut(*st, "stream", data, c.grid_size, rate, c.repeat);
          fmt::print("| {:.0f} MB/s | {} | {:.3f} | {:.3f} | {:.2f} | {:.2f} |\n", rate, name, o.producer, o.put,
                     o.put / o.producer, o.load);
          std::fflush(stdout);
          steps.Done(fmt::format("{} streaming put at {:.0f} MB/s, {}: ratio {:.2f}", s3 ? "s3" : url, rate, name,
                                 o.put / o.producer));
        }
      }
    }
    std::fflush(stdout);
  }
  fmt::print("\nload average at the end: {:.2f}\n", LoadAverage());
  return 0;
}
