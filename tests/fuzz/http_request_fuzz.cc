// Fuzzes the metrics endpoint's request parser (network input: anyone who
// can reach --metrics's port sends it): byte 0 picks the parser, 0 the
// request head, 1 a HOST:PORT address. Any input must be refused or parse
// into a method and a target that hold no byte the parser is meant to
// refuse (a space, a control character, a target not starting with '/').
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "dcr/metrics.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 1) {
    auto address = dcr::ParseHostPort(text);
    if (address.ok() && address->first.empty()) std::abort();
    return 0;
  }
  auto head = dcr::ParseHttpRequestHead(text);
  if (!head.ok()) return 0;
  if (head->method.empty() || head->target.empty() || head->target[0] != '/') std::abort();
  for (char c : head->method + head->target)
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) std::abort();
  return 0;
}
