#include "dcr/text.h"

#include <cstdint>

namespace dcr {

bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;  // no overlong forms
    else if (c >= 0xE1 && c <= 0xEC) len = 3;
    else if (c == 0xED) len = 3, hi = 0x9F;  // no surrogates
    else if (c >= 0xEE && c <= 0xEF) len = 3;
    else if (c == 0xF0) len = 4, lo = 0x90;  // no overlong forms
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) len = 4, hi = 0x8F;  // nothing above U+10FFFF
    else return false;  // a continuation byte, C0, C1, F5..FF
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// <0, 0, >0 as `a` sorts before, with, after `b` by numeric value of digit runs.
int CompareByNumbers(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (!IsDigit(a[i]) || !IsDigit(b[j])) {
      // A digit against a non-digit compares as bytes: no non-digit lies between '0' and '9'.
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]) ? -1 : 1;
      ++i, ++j;
      continue;
    }
    while (i + 1 < a.size() && a[i] == '0' && IsDigit(a[i + 1])) ++i;  // leading zeros
    while (j + 1 < b.size() && b[j] == '0' && IsDigit(b[j + 1])) ++j;
    size_t ei = i, ej = j;
    while (ei < a.size() && IsDigit(a[ei])) ++ei;
    while (ej < b.size() && IsDigit(b[ej])) ++ej;
    if (ei - i != ej - j) return ei - i < ej - j ? -1 : 1;  // fewer digits: smaller
    if (const int c = a.substr(i, ei - i).compare(b.substr(j, ej - j)); c != 0) return c;
    i = ei, j = ej;
  }
  return (i < a.size()) - (j < b.size());
}

}  // namespace

bool TensorNameLess(std::string_view a, std::string_view b) {
  const int c = CompareByNumbers(a, b);
  return c != 0 ? c < 0 : a < b;
}

}  // namespace dcr
