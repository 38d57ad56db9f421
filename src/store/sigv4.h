// AWS Signature Version 4 for S3 (the "Authorization: AWS4-HMAC-SHA256"
// header form), and the digests S3 requests carry. Pure functions over
// OpenSSL; thread-safe. Internal to the s3 driver.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dcr::sigv4 {

using Pairs = std::vector<std::pair<std::string, std::string>>;

// SHA-256 of `data`, lowercase hex (the x-amz-content-sha256 value).
std::string Sha256Hex(std::string_view data);
// HMAC-SHA256(key, data), raw.
std::array<uint8_t, 32> HmacSha256(std::string_view key, std::string_view data);
// MD5 of `data`, raw (S3 ETags of single-part objects are its hex form).
std::array<uint8_t, 16> Md5(std::string_view data);
std::string HexEncode(const uint8_t* data, size_t size);
// Lowercase or uppercase hex to bytes; false on odd length or a non-hex digit.
bool HexDecode(std::string_view hex, std::string* out);
std::string Base64Encode(const uint8_t* data, size_t size);

// AWS URI encoding: every byte except A-Z a-z 0-9 '-' '.' '_' '~' becomes
// %XY (uppercase hex); '/' is kept as is unless `encode_slash`.
std::string UriEncode(std::string_view s, bool encode_slash);
// Inverse of percent-encoding; false on a malformed escape.
bool UriDecode(std::string_view s, std::string* out);

// "20130524T000000Z" (UTC).
std::string AmzDate(std::chrono::system_clock::time_point t);

// `query` (raw names and values) encoded and sorted: "a=1&b=&c=x%2Fy". This
// is both the signed form and the query string the request must carry.
std::string CanonicalQueryString(const Pairs& query);

struct Request {
  std::string_view method;  // "GET"
  std::string_view canonical_path;  // the request path exactly as sent (already encoded): "/bucket/a%20b"
  std::string_view canonical_query;  // CanonicalQueryString(...)
  // Every header to sign, names in any case; must include host, x-amz-date
  // and x-amz-content-sha256 (and x-amz-security-token with a session token).
  const Pairs* headers = nullptr;
  std::string_view payload_sha256;  // hex SHA-256 of the body, or "UNSIGNED-PAYLOAD"
};

// The steps of the algorithm, exposed for tests against AWS's examples.
// `signed_headers` receives "host;range;x-amz-date" style names.
std::string CanonicalRequest(const Request& request, std::string* signed_headers);
std::string StringToSign(std::string_view amz_date, std::string_view scope, std::string_view canonical_request);
// "20130524/us-east-1/s3/aws4_request"
std::string Scope(std::string_view amz_date, std::string_view region, std::string_view service);
std::array<uint8_t, 32> SigningKey(std::string_view secret_access_key, std::string_view yyyymmdd,
                                   std::string_view region, std::string_view service);

// The Authorization header value for `request`, signed at `amz_date` (the
// request's x-amz-date). `signature` (optional) receives the hex signature.
std::string Authorization(const Request& request, std::string_view access_key_id, std::string_view secret_access_key,
                          std::string_view region, std::string_view amz_date, std::string_view service = "s3",
                          std::string* signature = nullptr);

}  // namespace dcr::sigv4
