#include "sigv4.h"

#include <gtest/gtest.h>

namespace dcr::sigv4 {
namespace {

// The S3 examples of AWS's "Examples: Signature Calculations in AWS Signature
// Version 4" (Authenticating Requests: Using the Authorization Header).
constexpr std::string_view kAccessKey = "AKIAIOSFODNN7EXAMPLE";
constexpr std::string_view kSecret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
constexpr std::string_view kDate = "20130524T000000Z";
constexpr std::string_view kEmptySha = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr std::string_view kHost = "examplebucket.s3.amazonaws.com";

std::string Sign(std::string_view method, std::string_view path, const Pairs& query, const Pairs& headers,
                 std::string_view payload_sha, std::string* canonical = nullptr) {
  const std::string q = CanonicalQueryString(query);
  Request r{method, path, q, &headers, payload_sha};
  if (canonical != nullptr) *canonical = CanonicalRequest(r, nullptr);
  std::string sig;
  const std::string auth = Authorization(r, kAccessKey, kSecret, "us-east-1", kDate, "s3", &sig);
  EXPECT_EQ(auth.rfind("AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
                       "SignedHeaders=",
                       0),
            0u)
      << auth;
  EXPECT_NE(auth.find(", Signature=" + sig), std::string::npos);
  return sig;
}

TEST(SigV4, GetObjectWithRange) {
  const Pairs headers = {{"Host", std::string(kHost)},
                         {"Range", "bytes=0-9"},
                         {"x-amz-content-sha256", std::string(kEmptySha)},
                         {"x-amz-date", std::string(kDate)}};
  std::string canonical;
  const std::string sig = Sign("GET", "/test.txt", {}, headers, kEmptySha, &canonical);
  EXPECT_EQ(canonical,
            "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
            "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
            "x-amz-date:20130524T000000Z\n\nhost;range;x-amz-content-sha256;x-amz-date\n"
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex(StringToSign(kDate, Scope(kDate, "us-east-1", "s3"), canonical)).size(), 64u);
  EXPECT_EQ(StringToSign(kDate, Scope(kDate, "us-east-1", "s3"), canonical),
            "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
            "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
  EXPECT_EQ(sig, "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(SigV4, PutObject) {
  const std::string payload = "Welcome to Amazon S3.";
  const std::string sha = Sha256Hex(payload);
  EXPECT_EQ(sha, "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  const Pairs headers = {{"Host", std::string(kHost)},
                         {"Date", "Fri, 24 May 2013 00:00:00 GMT"},
                         {"x-amz-date", std::string(kDate)},
                         {"x-amz-storage-class", "REDUCED_REDUNDANCY"},
                         {"x-amz-content-sha256", sha}};
  // The key is "test$file.text": '$' is percent-encoded in the path.
  std::string path = "/";
  path += UriEncode("test$file.text", false);
  EXPECT_EQ(path, "/test%24file.text");
  EXPECT_EQ(Sign("PUT", path, {}, headers, sha), "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
}

TEST(SigV4, GetBucketLifecycle) {
  const Pairs headers = {{"Host", std::string(kHost)},
                         {"x-amz-date", std::string(kDate)},
                         {"x-amz-content-sha256", std::string(kEmptySha)}};
  std::string canonical;
  const std::string sig = Sign("GET", "/", {{"lifecycle", ""}}, headers, kEmptySha, &canonical);
  EXPECT_EQ(canonical.substr(0, 17), "GET\n/\nlifecycle=\n");
  EXPECT_EQ(sig, "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");
}

TEST(SigV4, ListObjects) {
  const Pairs headers = {{"Host", std::string(kHost)},
                         {"x-amz-date", std::string(kDate)},
                         {"x-amz-content-sha256", std::string(kEmptySha)}};
  std::string canonical;
  // Given out of order: the canonical query sorts by name.
  const std::string sig = Sign("GET", "/", {{"prefix", "J"}, {"max-keys", "2"}}, headers, kEmptySha, &canonical);
  EXPECT_EQ(canonical.substr(0, 26), "GET\n/\nmax-keys=2&prefix=J\n");
  EXPECT_EQ(sig, "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
}

// AWS's general SigV4 documentation: "Deriving the signing key".
TEST(SigV4, SigningKey) {
  const auto key = SigningKey("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "20150830", "us-east-1", "iam");
  EXPECT_EQ(HexEncode(key.data(), key.size()), "c4afb1cc5771d871763a393e44b703571b55cc28424d1a5e86da6ed3c154a4b9");
}

TEST(SigV4, HeaderCanonicalization) {
  // Names lowercased and sorted, values trimmed with inner runs collapsed,
  // repeated names joined with ','.
  const Pairs headers = {
      {"X-Amz-Meta-B", "  two   words "}, {"host", "h"}, {"x-amz-meta-a", "1"}, {"X-AMZ-META-A", "2"}};
  Request r{"GET", "/k", "", &headers, "UNSIGNED-PAYLOAD"};
  std::string names;
  EXPECT_EQ(CanonicalRequest(r, &names),
            "GET\n/k\n\nhost:h\nx-amz-meta-a:1,2\nx-amz-meta-b:two words\n\nhost;x-amz-meta-a;x-amz-meta-b\n"
            "UNSIGNED-PAYLOAD");
  EXPECT_EQ(names, "host;x-amz-meta-a;x-amz-meta-b");
}

TEST(SigV4, UriEncode) {
  EXPECT_EQ(UriEncode("AZaz09-._~", true), "AZaz09-._~");
  EXPECT_EQ(UriEncode("a/b c", false), "a/b%20c");
  EXPECT_EQ(UriEncode("a/b c", true), "a%2Fb%20c");
  EXPECT_EQ(UriEncode("+*=&?#%$!'()", true), "%2B%2A%3D%26%3F%23%25%24%21%27%28%29");
  EXPECT_EQ(UriEncode("\xc3\xa9\x01\xff", true), "%C3%A9%01%FF");  // bytes, uppercase hex
  std::string decoded;
  ASSERT_TRUE(UriDecode("a%2Fb%20c%c3%A9", &decoded));
  EXPECT_EQ(decoded, "a/b c\xc3\xa9");
  EXPECT_FALSE(UriDecode("a%2", &decoded));
  EXPECT_FALSE(UriDecode("a%zz", &decoded));
  EXPECT_FALSE(UriDecode("%", &decoded));
  ASSERT_TRUE(HexDecode("00ff7Fa0", &decoded));
  EXPECT_EQ(decoded, std::string("\x00\xff\x7f\xa0", 4));
  EXPECT_FALSE(HexDecode("abc", &decoded));
  EXPECT_FALSE(HexDecode("zz", &decoded));
}

TEST(SigV4, CanonicalQuerySortsEncodedNamesAndValues) {
  EXPECT_EQ(CanonicalQueryString({}), "");
  EXPECT_EQ(CanonicalQueryString({{"uploads", ""}}), "uploads=");
  EXPECT_EQ(CanonicalQueryString({{"prefix", "a b/c"}, {"list-type", "2"}, {"continuation-token", "x+y="}}),
            "continuation-token=x%2By%3D&list-type=2&prefix=a%20b%2Fc");
  // Same name twice: sorted by value.
  EXPECT_EQ(CanonicalQueryString({{"a", "2"}, {"a", "1"}}), "a=1&a=2");
}

TEST(SigV4, Digests) {
  EXPECT_EQ(Sha256Hex(""), kEmptySha);
  const auto md5 = Md5("");
  EXPECT_EQ(HexEncode(md5.data(), md5.size()), "d41d8cd98f00b204e9800998ecf8427e");
  EXPECT_EQ(Base64Encode(md5.data(), md5.size()), "1B2M2Y8AsgTpgAmY7PhCfg==");
  // RFC 4231 test case 2.
  const auto mac = HmacSha256("Jefe", "what do ya want for nothing?");
  EXPECT_EQ(HexEncode(mac.data(), mac.size()), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(AmzDate(std::chrono::system_clock::time_point(std::chrono::seconds(1369353600))), "20130524T000000Z");
}

}  // namespace
}  // namespace dcr::sigv4
