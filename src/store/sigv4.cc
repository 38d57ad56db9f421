#include "sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <ctime>

namespace dcr::sigv4 {
namespace {

bool Unreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
         c == '_' || c == '~';
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

// Header values are trimmed and inner runs of spaces collapse to one.
std::string TrimAll(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

template <size_t N>
std::string Hex(const std::array<uint8_t, N>& a) {
  return HexEncode(a.data(), a.size());
}

}  // namespace

std::string HexEncode(const uint8_t* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * size, '\0');
  for (size_t i = 0; i < size; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 15];
  }
  return out;
}

bool HexDecode(std::string_view hex, std::string* out) {
  if (hex.size() % 2 != 0) return false;
  out->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = HexDigit(hex[i]), lo = HexDigit(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    *out += static_cast<char>(hi * 16 + lo);
  }
  return true;
}

std::string Base64Encode(const uint8_t* data, size_t size) {
  std::string out(4 * ((size + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), data, static_cast<int>(size));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string Sha256Hex(std::string_view data) {
  std::array<uint8_t, 32> md;
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md.data(), &len, EVP_sha256(), nullptr);
  return Hex(md);
}

std::array<uint8_t, 16> Md5(std::string_view data) {
  std::array<uint8_t, 16> md;
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md.data(), &len, EVP_md5(), nullptr);
  return md;
}

std::array<uint8_t, 32> HmacSha256(std::string_view key, std::string_view data) {
  std::array<uint8_t, 32> md;
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
       data.size(), md.data(), &len);
  return md;
}

std::string UriEncode(std::string_view s, bool encode_slash) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (Unreserved(c) || (c == '/' && !encode_slash)) {
      out += ch;
    } else {
      out += '%';
      out += kDigits[c >> 4];
      out += kDigits[c & 15];
    }
  }
  return out;
}

bool UriDecode(std::string_view s, std::string* out) {
  out->clear();
  out->reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      *out += s[i];
      continue;
    }
    if (i + 2 >= s.size()) return false;
    const int hi = HexDigit(s[i + 1]), lo = HexDigit(s[i + 2]);
    if (hi < 0 || lo < 0) return false;
    *out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return true;
}

std::string AmzDate(std::chrono::system_clock::time_point t) {
  const std::time_t secs = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

std::string CanonicalQueryString(const Pairs& query) {
  std::vector<std::pair<std::string, std::string>> enc;
  enc.reserve(query.size());
  for (const auto& [k, v] : query) enc.emplace_back(UriEncode(k, true), UriEncode(v, true));
  std::sort(enc.begin(), enc.end());
  std::string out;
  for (const auto& [k, v] : enc) {
    if (!out.empty()) out += '&';
    out += k;
    out += '=';
    out += v;
  }
  return out;
}

std::string CanonicalRequest(const Request& r, std::string* signed_headers) {
  // Lowercase names, sorted; repeated names join their values with ','.
  std::vector<std::pair<std::string, std::string>> h;
  if (r.headers != nullptr)
    for (const auto& [k, v] : *r.headers) h.emplace_back(Lower(k), TrimAll(v));
  std::stable_sort(h.begin(), h.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string canon_headers, names;
  for (size_t i = 0; i < h.size(); ++i) {
    if (i > 0 && h[i].first == h[i - 1].first) {
      canon_headers.back() = ',';
      canon_headers += h[i].second;
      canon_headers += '\n';
      continue;
    }
    if (!names.empty()) names += ';';
    names += h[i].first;
    canon_headers += h[i].first;
    canon_headers += ':';
    canon_headers += h[i].second;
    canon_headers += '\n';
  }
  std::string out;
  out.reserve(256 + canon_headers.size());
  out.append(r.method).append("\n");
  out.append(r.canonical_path.empty() ? std::string_view("/") : r.canonical_path).append("\n");
  out.append(r.canonical_query).append("\n");
  out.append(canon_headers).append("\n");
  out.append(names).append("\n");
  out.append(r.payload_sha256);
  if (signed_headers != nullptr) *signed_headers = std::move(names);
  return out;
}

std::string Scope(std::string_view amz_date, std::string_view region, std::string_view service) {
  std::string s(amz_date.substr(0, 8));
  s.append("/").append(region).append("/").append(service).append("/aws4_request");
  return s;
}

std::string StringToSign(std::string_view amz_date, std::string_view scope, std::string_view canonical_request) {
  std::string s = "AWS4-HMAC-SHA256\n";
  s.append(amz_date).append("\n").append(scope).append("\n").append(Sha256Hex(canonical_request));
  return s;
}

std::array<uint8_t, 32> SigningKey(std::string_view secret_access_key, std::string_view yyyymmdd,
                                   std::string_view region, std::string_view service) {
  auto view = [](const std::array<uint8_t, 32>& a) {
    return std::string_view(reinterpret_cast<const char*>(a.data()), a.size());
  };
  const auto k_date = HmacSha256("AWS4" + std::string(secret_access_key), yyyymmdd);
  const auto k_region = HmacSha256(view(k_date), region);
  const auto k_service = HmacSha256(view(k_region), service);
  return HmacSha256(view(k_service), "aws4_request");
}

std::string Authorization(const Request& request, std::string_view access_key_id, std::string_view secret_access_key,
                          std::string_view region, std::string_view amz_date, std::string_view service,
                          std::string* signature) {
  std::string signed_headers;
  const std::string canonical = CanonicalRequest(request, &signed_headers);
  const std::string scope = Scope(amz_date, region, service);
  const std::string to_sign = StringToSign(amz_date, scope, canonical);
  const auto key = SigningKey(secret_access_key, amz_date.substr(0, 8), region, service);
  const std::string sig =
      Hex(HmacSha256(std::string_view(reinterpret_cast<const char*>(key.data()), key.size()), to_sign));
  if (signature != nullptr) *signature = sig;
  std::string out = "AWS4-HMAC-SHA256 Credential=";
  out.append(access_key_id).append("/").append(scope);
  out.append(", SignedHeaders=").append(signed_headers);
  out.append(", Signature=").append(sig);
  return out;
}

}  // namespace dcr::sigv4
