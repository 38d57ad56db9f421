// s3:// URLs, environment variables and AWS profile files -> S3Options.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "dcr/s3.h"
#include "testing/temp_dir.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class S3ConfigTest : public testing::TempDirTest {
 protected:
  GetEnvFunction Env() {
    return [this](const std::string& name) -> std::optional<std::string> {
      auto it = env_.find(name);
      if (it == env_.end()) return std::nullopt;
      return it->second;
    };
  }
  Result<S3Options> Parse(std::string_view url) { return ParseS3Url(url, Env()); }
  void Write(const std::string& name, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(Path(name)).parent_path());
    std::ofstream(Path(name)) << text;
  }

  std::map<std::string, std::string> env_;
};

TEST_F(S3ConfigTest, UrlParts) {
  auto o = Parse("s3://bkt/run%2042/sub/?endpoint=http://127.0.0.1:7480/&region=default&addressing=path");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->bucket, "bkt");
  EXPECT_EQ(o->prefix, "run 42/sub/");
  EXPECT_EQ(o->endpoint, "http://127.0.0.1:7480");
  EXPECT_EQ(o->region, "default");
  EXPECT_EQ(o->addressing, S3Addressing::kPath);
  EXPECT_TRUE(o->access_key_id.empty());  // anonymous
  EXPECT_THAT(o->credentials_source, HasSubstr("anonymous"));
  EXPECT_EQ(o->url, "s3://bkt/run%2042/sub/?endpoint=http://127.0.0.1:7480/&region=default&addressing=path");

  auto bare = Parse("s3://bkt");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->prefix, "");
  EXPECT_EQ(bare->endpoint, "");
  EXPECT_EQ(bare->region, "us-east-1");
  EXPECT_EQ(bare->addressing, S3Addressing::kAuto);
  EXPECT_EQ(bare->part_size, uint64_t{8} << 20);
}

TEST_F(S3ConfigTest, CredentialsInTheUrlNeverReachUrlOrMessages) {
  auto o = Parse("s3://bkt/p?access_key_id=AKID&secret_access_key=se%2Bcr/et&session_token=TOK&region=r1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->access_key_id, "AKID");
  EXPECT_EQ(o->secret_access_key, "se+cr/et");  // '+' only when escaped; '/' as is
  EXPECT_EQ(o->session_token, "TOK");
  EXPECT_EQ(o->credentials_source, "the URL");
  EXPECT_EQ(o->url, "s3://bkt/p?region=r1");

  auto bad = Parse("s3://bkt?access_key_id=AKID&secret_access_key=TOPSECRET&bogus=1");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("unknown parameter 'bogus'"));
  EXPECT_THAT(bad.status().message(), Not(HasSubstr("TOPSECRET")));

  EXPECT_EQ(Parse("s3://bkt?access_key_id=AKID").status().code(), Code::kInvalidArgument);
}

TEST_F(S3ConfigTest, EndpointPrecedence) {
  env_["AWS_ENDPOINT_URL"] = "https://generic.example";
  EXPECT_EQ(Parse("s3://b")->endpoint, "https://generic.example");
  env_["AWS_ENDPOINT_URL_S3"] = "https://s3-specific.example";
  EXPECT_EQ(Parse("s3://b")->endpoint, "https://s3-specific.example");
  env_["DCR_S3_ENDPOINT"] = "http://127.0.0.1:9000";
  EXPECT_EQ(Parse("s3://b")->endpoint, "http://127.0.0.1:9000");
  EXPECT_EQ(Parse("s3://b?endpoint=HTTP://Url.Example:1")->endpoint, "http://Url.Example:1");
  env_["DCR_S3_ENDPOINT"] = "127.0.0.1:9000";
  auto bad = Parse("s3://b");
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("$DCR_S3_ENDPOINT"));
  EXPECT_EQ(Parse("s3://b?endpoint=http://h/path").status().code(), Code::kInvalidArgument);
}

TEST_F(S3ConfigTest, RegionPrecedence) {
  env_["AWS_DEFAULT_REGION"] = "r-default";
  EXPECT_EQ(Parse("s3://b")->region, "r-default");
  env_["AWS_REGION"] = "r-region";
  EXPECT_EQ(Parse("s3://b")->region, "r-region");
  EXPECT_EQ(Parse("s3://b?region=r-url")->region, "r-url");
}

TEST_F(S3ConfigTest, EnvironmentCredentials) {
  env_["AWS_ACCESS_KEY_ID"] = "AKENV";
  env_["AWS_SECRET_ACCESS_KEY"] = "secret-env";
  env_["AWS_SESSION_TOKEN"] = "token-env";
  auto o = Parse("s3://b");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->access_key_id, "AKENV");
  EXPECT_EQ(o->secret_access_key, "secret-env");
  EXPECT_EQ(o->session_token, "token-env");
  EXPECT_EQ(o->credentials_source, "$AWS_ACCESS_KEY_ID");
}

TEST_F(S3ConfigTest, AnonymousIsAskedForExplicitly) {
  env_["AWS_ACCESS_KEY_ID"] = "AKENV";
  env_["AWS_SECRET_ACCESS_KEY"] = "secret-env";
  auto o = Parse("s3://b?anonymous=1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->anonymous);
  EXPECT_TRUE(o->access_key_id.empty() && o->secret_access_key.empty());  // the environment's are not used
  EXPECT_THAT(o->credentials_source, HasSubstr("anonymous=1"));
  EXPECT_EQ(o->url, "s3://b?anonymous=1");
  auto signed_ = Parse("s3://b?anonymous=0");
  ASSERT_TRUE(signed_.ok());
  EXPECT_FALSE(signed_->anonymous);
  EXPECT_EQ(signed_->access_key_id, "AKENV");
  for (const char* url : {"s3://b?anonymous=1&access_key_id=A&secret_access_key=S", "s3://b?anonymous=yes"})
    EXPECT_EQ(Parse(url).status().code(), Code::kInvalidArgument) << url;
}

TEST_F(S3ConfigTest, ProfilesFromHome) {
  env_["HOME"] = dir_;
  Write(".aws/credentials",
        "# comment\n[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = sdefault\n\n"
        "[work]\naws_access_key_id=AKWORK\naws_secret_access_key=swork\naws_session_token=twork\n");
  Write(".aws/config",
        "[default]\nregion = eu-central-1\n\n"
        "[profile  work]\nregion = us-west-2\nendpoint_url = https://work.example:8443\n"
        "s3 =\n  addressing_style = virtual\n  other = 1\nunrelated = x\n");
  auto def = Parse("s3://b");
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_EQ(def->access_key_id, "AKDEFAULT");
  EXPECT_EQ(def->region, "eu-central-1");
  EXPECT_EQ(def->endpoint, "");
  EXPECT_EQ(def->credentials_source, "AWS profile default");

  env_["AWS_PROFILE"] = "work";
  auto work = Parse("s3://b");
  ASSERT_TRUE(work.ok()) << work.status().ToString();
  EXPECT_EQ(work->access_key_id, "AKWORK");
  EXPECT_EQ(work->secret_access_key, "swork");
  EXPECT_EQ(work->session_token, "twork");
  EXPECT_EQ(work->region, "us-west-2");
  EXPECT_EQ(work->endpoint, "https://work.example:8443");
  EXPECT_EQ(work->addressing, S3Addressing::kVirtual);

  // Environment keys beat $AWS_PROFILE's; a profile named in the URL beats both.
  env_["AWS_ACCESS_KEY_ID"] = "AKENV";
  env_["AWS_SECRET_ACCESS_KEY"] = "senv";
  EXPECT_EQ(Parse("s3://b")->access_key_id, "AKENV");
  EXPECT_EQ(Parse("s3://b?profile=default")->access_key_id, "AKDEFAULT");
  // The URL's profile also picks region and endpoint from the config file.
  EXPECT_EQ(Parse("s3://b?profile=default")->region, "eu-central-1");

  auto missing = Parse("s3://b?profile=nope");
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("profile 'nope' not found"));
  env_["AWS_PROFILE"] = "nope2";
  EXPECT_EQ(Parse("s3://b").status().code(), Code::kInvalidArgument);
}

TEST_F(S3ConfigTest, ProfileFilesFromVariables) {
  env_["HOME"] = "/nonexistent-home";
  env_["AWS_SHARED_CREDENTIALS_FILE"] = Path("creds");
  env_["AWS_CONFIG_FILE"] = Path("conf");
  Write("creds", "[p]\naws_access_key_id = AKP\naws_secret_access_key = sp\n");
  Write("conf", "[profile p]\nregion = ap-south-1\n");
  auto o = Parse("s3://b?profile=p");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->access_key_id, "AKP");
  EXPECT_EQ(o->region, "ap-south-1");
  // No files and no profile named: anonymous, not an error.
  env_.erase("AWS_SHARED_CREDENTIALS_FILE");
  env_.erase("AWS_CONFIG_FILE");
  EXPECT_TRUE(Parse("s3://b").ok());
}

TEST_F(S3ConfigTest, Tuning) {
  auto o = Parse(
      "s3://b?part_size=16m&parts_in_flight=2&threads=32&max_attempts=3&create_if_absent_limit=1g"
      "&verify_tls=0&create_bucket=1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->part_size, uint64_t{16} << 20);
  EXPECT_EQ(o->parts_in_flight, 2u);
  EXPECT_EQ(o->threads, 32u);
  EXPECT_EQ(o->max_attempts, 3);
  EXPECT_EQ(o->create_if_absent_limit, uint64_t{1} << 30);
  EXPECT_FALSE(o->http.verify_tls);
  EXPECT_TRUE(o->create_bucket);
  EXPECT_EQ(Parse("s3://b?part_size=5242880")->part_size, 5242880u);
  EXPECT_EQ(Parse("s3://b?part_size=5g")->part_size, uint64_t{5} << 30);  // S3's largest part
}

TEST_F(S3ConfigTest, BadUrls) {
  for (const char* url :
       {"s3://", "s3:///prefix", "http://b/x", "s3://user:pw@bkt/x", "s3://b?part_size=0", "s3://b?part_size=8x",
        "s3://b?threads=abc", "s3://b?threads=0", "s3://b?region=a&region=b", "s3://b?addressing=sideways",
        "s3://b?verify_tls=maybe", "s3://b/a//c", "s3://b/%zz", "s3://b#frag", "s3://b?endpoint=ftp://h",
        // Accepted here once, then refused by OpenS3Store (store_config_fuzz).
        "s3://b?part_size=6g", "s3://b?part_size=5368709121"}) {
    auto o = Parse(url);
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument) << url;
  }
}

TEST_F(S3ConfigTest, OpenStoreDispatchesS3) {
  // No request is made at open; a bad URL is reported through OpenStore.
  EXPECT_EQ(OpenStore("s3://b?bogus=1").status().code(), Code::kInvalidArgument);
  auto store = OpenStore("s3://b/p?endpoint=http://127.0.0.1:9&access_key_id=AK&secret_access_key=SK");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->url(), "s3://b/p?endpoint=http://127.0.0.1:9");
}

}  // namespace
}  // namespace dcr
