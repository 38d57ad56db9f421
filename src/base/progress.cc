#include "dcr/progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace dcr {

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string FormatBytes(double b) {
  static const char* kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (b >= 1000.0 && u < 5) {
    b /= 1000.0;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f %s", b, kUnits[u]);
  else std::snprintf(buf, sizeof buf, b < 10 ? "%.2f %s" : b < 100 ? "%.1f %s" : "%.0f %s", b, kUnits[u]);
  return buf;
}

Result<uint64_t> ParseBytes(const std::string& text) {
  const char* begin = text.c_str();
  char* end = nullptr;
  const double value = std::strtod(begin, &end);
  if (end == begin) return InvalidArgument("'" + text + "' is not a size (try 64MB, 1.5GiB or 4096)");
  const std::string unit(end);
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"B", 1},
                                                          {"kB", 1e3},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1048576.0},
                                                          {"GiB", 1073741824.0},
                                                          {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : kUnits)
    if (unit == name) {
      const double bytes = value * scale;
      if (!(bytes >= 0) || bytes > 1.8e19) return InvalidArgument("size '" + text + "' is out of range");
      return static_cast<uint64_t>(bytes);
    }
  return InvalidArgument("unknown unit in '" + text + "' (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

bool Progress::Enabled() {
  if (const char* env = std::getenv("DCR_PROGRESS")) return std::strcmp(env, "0") != 0;
  return isatty(STDERR_FILENO) == 1;
}

Progress::Progress(std::string label, uint64_t total_bytes)
    : label_(std::move(label)), total_(total_bytes), start_(MonotonicSeconds()), enabled_(Enabled()) {
  if (enabled_) printer_ = std::thread([this] { Loop(); });
}

Progress::~Progress() { Finish(); }

void Progress::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!finished_) {
    cv_.wait_for(lock, std::chrono::milliseconds(500));
    if (!finished_) Print(false);
  }
}

void Progress::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = true;
  }
  cv_.notify_all();
  if (printer_.joinable()) printer_.join();
  if (enabled_) Print(true);
}

void Progress::Print(bool final) {
  const double elapsed = MonotonicSeconds() - start_;
  const double done = static_cast<double>(done_.load(std::memory_order_relaxed));
  const double rate = elapsed > 0 ? done / elapsed : 0;
  std::string line = "\r" + label_ + "  " + FormatBytes(done);
  if (total_ > 0) line += " / " + FormatBytes(static_cast<double>(total_));
  line += "  " + FormatBytes(rate) + "/s";
  if (final) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "  in %.1fs", elapsed);
    line += buf;
  } else if (total_ > 0 && rate > 0 && done < static_cast<double>(total_)) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "  ETA %.0fs", (static_cast<double>(total_) - done) / rate);
    line += buf;
  }
  line += final ? "\033[K\n" : "\033[K";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace dcr
