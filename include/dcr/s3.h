// The S3 driver: s3://bucket/prefix over SigV4, for AWS S3 and S3-compatible
// servers (Ceph radosgw, MinIO, ...). The interface and its guarantees are
// store.h's; this header adds how a URL becomes a connection, and what the
// driver does on the wire.
//
// URL:  s3://BUCKET[/PREFIX][?NAME=VALUE&...]   (values percent-decoded; '+' is literal)
//   endpoint=http[s]://host[:port]   the server (default: AWS, https://s3.REGION.amazonaws.com)
//   region=NAME                      SigV4 region (radosgw: its zonegroup, e.g. "default")
//   addressing=path|virtual|auto     bucket in the path, or in the host name (virtual-hosted)
//   profile=NAME                     AWS config/credentials profile
//   access_key_id=, secret_access_key=, session_token=   credentials (never shown in Store::url())
//   part_size=BYTES[k|m|g]           multipart part and ranged-GET size (default 8m)
//   parts_in_flight=N                parallel part uploads per writer (default 4)
//   threads=N                        background requests per store (default 16)
//   max_attempts=N                   tries per request, first included (default 10)
//   create_if_absent_limit=BYTES     see "Conditional create" below (default 1g)
//   verify_tls=0|1                   check the server's certificate (default 1)
//   create_bucket=0|1                create the bucket when opening (default 0; see CreateS3Bucket)
//   anonymous=0|1                    send unsigned requests on purpose (a public bucket), ignoring
//                                    credentials in the environment and profiles (default 0)
// An unknown name is kInvalidArgument. Keys map to object names PREFIX/KEY.
//
// Where settings come from, first match wins:
//   endpoint     URL > $DCR_S3_ENDPOINT > $AWS_ENDPOINT_URL_S3 > $AWS_ENDPOINT_URL > the profile's
//                endpoint_url > AWS. DCR_S3_ENDPOINT outranks the AWS variables so that a test
//                harness's local server is never traded for a real account by a stray variable.
//   region       URL > $AWS_REGION > $AWS_DEFAULT_REGION > the profile's region > us-east-1
//   credentials  URL (access_key_id + secret_access_key [+ session_token]) > the profile named by
//                the URL's profile= > $AWS_ACCESS_KEY_ID + $AWS_SECRET_ACCESS_KEY [+ $AWS_SESSION_TOKEN]
//                > the profile ($AWS_PROFILE, else "default") > none (unsigned, anonymous requests:
//                opening the store then warns on stderr, once, unless the URL says anonymous=1)
//   addressing   URL > the profile's "s3 =" / "addressing_style" > auto (virtual-hosted on
//                amazonaws.com for DNS-safe bucket names without dots, else path-style)
// Profiles: $AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials), sections [NAME], and
// $AWS_CONFIG_FILE (default ~/.aws/config), sections [default] and [profile NAME]; keys
// aws_access_key_id, aws_secret_access_key, aws_session_token, region, endpoint_url. A profile
// named explicitly (URL or $AWS_PROFILE) that neither file has is kInvalidArgument. Not
// supported: instance metadata, SSO, assume-role and credential_process.
//
// On the wire: every request carries x-amz-content-sha256 (bodies are signed), and
// x-amz-security-token with a session token. A writer buffers up to part_size; an object that
// fits is one PUT on Close. A larger one becomes a multipart upload started when the first
// part fills, with up to parts_in_flight parts uploading while the caller writes (memory is
// bounded by (parts_in_flight + 1) * part_size); Close completes it, Abort or any failure
// aborts it, so no part of it is ever visible. Part sizes double every 1000 parts, so a
// streamed object of any size S3 accepts (5 TiB) fits in its 10000 parts. Reads larger than
// part_size run as parallel ranged GETs of one version (matched by ETag). Connections are kept
// alive and reused (include/dcr/http.h).
//
// Conditional create (kCreateIfAbsent) is a PUT with "If-None-Match: *"; 412 is
// kAlreadyExists. The server must honour that header on PUT (AWS S3 since 2024, Ceph radosgw,
// MinIO do); one that ignores it overwrites, and no single write can tell. So before a store's
// first create-if-absent write, the driver probes: it creates an object under the reserved key
// .dcr-probe/<random> twice, expects the second to be refused, and deletes it; on a server that
// overwrote it, every create-if-absent write of that store fails with kFailedPrecondition
// (three requests, once per store opened). Servers do not reliably
// honour it on CompleteMultipartUpload (AWS only since 2024; Ceph radosgw 16 ignores it and
// replaces the object, tested in s3_radosgw_test.cc), so a kCreateIfAbsent writer never uses
// multipart: it buffers the whole object, up to create_if_absent_limit (beyond it Write fails
// with kInvalidArgument and nothing is written). Raise the limit up to S3's 5 GiB single-PUT
// maximum if needed.
//
// Retries: connection errors, timeouts, truncated bodies, 500/502/503/504, 429 and S3's
// SlowDown/RequestTimeout/InternalError are retried with exponential backoff and full jitter,
// up to max_attempts tries, then kUnavailable (kDeadlineExceeded when the last failure was a
// timeout). Every request is safe to repeat: PUT and UploadPart replace by key and part
// number. A try of our own may have landed unseen (a lost response, or libcurl resending on a
// stale kept-alive connection), so a conditional PUT answered 412 compares the object's ETag
// with the MD5 of its body (equal: its own write, OK; else kAlreadyExists), and a
// CompleteMultipartUpload that finds its upload gone, or runs out of retries, compares the
// object's ETag with the multipart ETag of its parts. An object written by another writer with
// byte-identical content is, for these checks, the same write. When even that check cannot be
// made (the server keeps failing), Close returns kUnavailable and the whole new object may or
// may not have been published; never a part of it. A CreateMultipartUpload whose response is
// lost leaves an empty, invisible upload behind (a bucket lifecycle rule with
// AbortIncompleteMultipartUpload removes those).
//
// Ceph radosgw: give its beast frontend tcp_nodelay=1, or every small GET on a reused
// connection waits ~40 ms (Nagle's algorithm against the client's delayed ACK).
//
// Errors name the store URL, the key and the cause ("HTTP 403 SignatureDoesNotMatch: ...").
// Codes beyond store.h's: a skewed local clock (RequestTimeTooSkewed) is kFailedPrecondition
// with "clock skew" in the message; TLS certificate failures are kFailedPrecondition; a
// missing bucket is kNotFound naming the bucket.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "dcr/http.h"
#include "dcr/store.h"

namespace dcr {

enum class S3Addressing {
  kAuto,  // virtual-hosted on AWS endpoints when the bucket name allows it, else path
  kPath,  // http://host/bucket/key
  kVirtual,  // http://bucket.host/key
};

struct S3Options {
  // Where.
  std::string bucket;
  std::string prefix;  // object names are prefix + key; empty or ending in '/'
  std::string endpoint;  // "http[s]://host[:port]"; empty: https://s3.<region>.amazonaws.com
  std::string region = "us-east-1";
  S3Addressing addressing = S3Addressing::kAuto;
  // Who. An empty access_key_id sends unsigned (anonymous) requests; unless
  // `anonymous` says that is meant, opening the store warns.
  bool anonymous = false;
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  std::string credentials_source;  // where they came from, for messages ("$AWS_ACCESS_KEY_ID", "the URL", ...)
  // How.
  uint64_t part_size = uint64_t{8} << 20;
  size_t parts_in_flight = 4;
  size_t threads = 16;
  int max_attempts = 10;
  std::chrono::milliseconds initial_backoff{100};  // backoff before retry n: uniform in
  std::chrono::milliseconds max_backoff{10'000};  // [0, min(max_backoff, initial_backoff * 2^(n-1))]
  uint64_t create_if_absent_limit = uint64_t{1} << 30;
  bool create_bucket = false;  // OpenS3Store calls CreateS3Bucket first
  CurlTransportOptions http;
  // Store::url(): the URL without credentials. Empty: "s3://bucket/prefix".
  std::string url;
};

// Reads an environment variable; std::nullopt when unset.
using GetEnvFunction = std::function<std::optional<std::string>(const std::string& name)>;

// Resolves an s3:// URL, the environment and the AWS config files into
// options (precedence at the top of this file). `getenv` defaults to the
// process environment (also used for $HOME). kInvalidArgument for a malformed
// URL, an unknown query name, a bad value or a missing named profile.
Result<S3Options> ParseS3Url(std::string_view url, const GetEnvFunction& getenv = nullptr);

// Side effects the driver uses, injectable for tests. Null members get the
// real thing.
struct S3Runtime {
  std::shared_ptr<HttpTransport> transport;  // default: NewCurlTransport(options.http)
  std::function<std::chrono::system_clock::time_point()> now;  // request dates
  std::function<void(std::chrono::milliseconds)> sleep;  // retry backoff
  std::function<void(std::string_view line)> warn;  // one-line warnings; default: stderr
};

// Opens s3://... (ParseS3Url with the process environment). No request is
// made unless create_bucket=1. Without credentials (and without anonymous=1)
// it warns once, through S3Runtime::warn, that requests go unsigned.
Result<std::unique_ptr<Store>> OpenS3Store(std::string_view url);
Result<std::unique_ptr<Store>> OpenS3Store(const S3Options& options, S3Runtime runtime = {});

// Creates the options' bucket (with a LocationConstraint outside us-east-1).
// OK when it already exists and is ours; kAlreadyExists when someone else
// owns the name.
Status CreateS3Bucket(const S3Options& options, S3Runtime runtime = {});
Status CreateS3Bucket(std::string_view url);

}  // namespace dcr
