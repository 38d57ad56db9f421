#include "dcr/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace dcr {
namespace {

using ::testing::HasSubstr;

// A file: the 8-byte little-endian length of `json`, `json`, then `data_bytes`
// bytes of data.
std::vector<uint8_t> MakeFile(const std::string& json, uint64_t data_bytes, uint64_t declared_len) {
  std::vector<uint8_t> f(8 + json.size() + data_bytes);
  for (size_t i = 0; i < 8; ++i) f[i] = static_cast<uint8_t>(declared_len >> (8 * i));
  for (size_t i = 0; i < json.size(); ++i) f[8 + i] = static_cast<uint8_t>(json[i]);
  for (uint64_t i = 0; i < data_bytes; ++i) f[8 + json.size() + i] = static_cast<uint8_t>(i);
  return f;
}
std::vector<uint8_t> MakeFile(const std::string& json, uint64_t data_bytes = 0) {
  return MakeFile(json, data_bytes, json.size());
}

Result<SafetensorsHeader> Parse(const std::vector<uint8_t>& file) { return ParseSafetensorsHeader(file, file.size()); }

TensorInfo MakeInfo(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  auto r = MakeTensorInfo(name, dtype, std::move(shape));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

// Encodes `tensors` and appends their data (filled with a byte pattern).
std::vector<uint8_t> Encode(const std::vector<TensorInfo>& tensors, const Metadata& metadata = {}) {
  const std::string header = EncodeSafetensorsHeader(tensors, metadata);
  std::vector<uint8_t> f(header.begin(), header.end());
  for (const auto& t : tensors)
    for (uint64_t i = 0; i < t.nbytes; ++i) f.push_back(static_cast<uint8_t>(i * 31 + 7));
  return f;
}

// Expects `r` to fail with `code` and a message containing each of `parts`.
template <typename T>
void ExpectError(const Result<T>& r, Code code, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  for (const char* p : parts) EXPECT_THAT(r.status().message(), HasSubstr(p));
}

// ----- MakeTensorInfo -----------------------------------------------------

TEST(MakeTensorInfoTest, ComputesNumelAndBytes) {
  const TensorInfo t = MakeInfo("w", DType::kBF16, {3, 4, 5});
  EXPECT_EQ(t.name, "w");
  EXPECT_EQ(t.dtype, DType::kBF16);
  EXPECT_EQ(t.shape, (std::vector<uint64_t>{3, 4, 5}));
  EXPECT_EQ(t.numel, 60u);
  EXPECT_EQ(t.nbytes, 120u);

  const TensorInfo scalar = MakeInfo("s", DType::kF64, {});
  EXPECT_EQ(scalar.numel, 1u);
  EXPECT_EQ(scalar.nbytes, 8u);

  const TensorInfo empty = MakeInfo("e", DType::kF32, {7, 0, 3});
  EXPECT_EQ(empty.numel, 0u);
  EXPECT_EQ(empty.nbytes, 0u);

  EXPECT_EQ(MakeInfo("f4", DType::kF4, {2, 3}).nbytes, 3u);
  EXPECT_EQ(MakeInfo("f6", DType::kF6_E3M2, {4}).nbytes, 3u);
}

TEST(MakeTensorInfoTest, Errors) {
  ExpectError(MakeTensorInfo("big", DType::kU8, {1ull << 32, 1ull << 32}), Code::kInvalidArgument,
              {"'big'", "overflows"});
  ExpectError(MakeTensorInfo("bytes", DType::kF64, {1ull << 61}), Code::kInvalidArgument, {"'bytes'"});
  ExpectError(MakeTensorInfo("odd", DType::kF4, {3}), Code::kInvalidArgument, {"'odd'", "whole bytes"});
  ExpectError(MakeTensorInfo("six", DType::kF6_E2M3, {2, 3}), Code::kInvalidArgument, {"'six'"});
}

// ----- Encode / parse round trip -------------------------------------------

TEST(SafetensorsTest, EncodeLayout) {
  const std::vector<TensorInfo> tensors = {MakeInfo("a", DType::kF32, {2}), MakeInfo("b", DType::kBF16, {3})};
  const std::string h = EncodeSafetensorsHeader(tensors, {});
  ASSERT_GE(h.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(h[static_cast<size_t>(i)]);
  EXPECT_EQ(n, h.size() - 8);
  EXPECT_EQ(n % 8, 0u) << "JSON header padded to a multiple of 8";
  EXPECT_EQ(h[8], '{');
  const std::string text = h.substr(8);
  const size_t close = text.rfind('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(text.find_first_not_of(' ', close + 1), std::string::npos) << "padding is spaces";
  EXPECT_LT(text.size() - close - 1, 8u);
  EXPECT_THAT(text, HasSubstr("\"data_offsets\":[0,8]"));
  EXPECT_THAT(text, HasSubstr("\"data_offsets\":[8,14]"));
  EXPECT_THAT(text, HasSubstr("\"dtype\":\"BF16\""));
  EXPECT_EQ(text.find("__metadata__"), std::string::npos) << "no metadata: no key";
  // Tensors in the given order.
  EXPECT_LT(text.find("\"a\""), text.find("\"b\""));
}

TEST(SafetensorsTest, PaddingForEveryRemainder) {
  for (int len = 0; len < 16; ++len) {
    const std::vector<TensorInfo> tensors = {MakeInfo(std::string(static_cast<size_t>(len + 1), 'x'), DType::kU8, {1})};
    const std::string h = EncodeSafetensorsHeader(tensors, {});
    EXPECT_EQ((h.size() - 8) % 8, 0u) << len;
    auto parsed = Parse(Encode(tensors));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(parsed->header_bytes, h.size() - 8);
  }
}

TEST(SafetensorsTest, RoundTripEveryDTypeWithMetadata) {
  std::vector<TensorInfo> tensors;
  for (int i = 0; i < kDTypeCount; ++i) {
    const DType d = static_cast<DType>(i);
    tensors.push_back(MakeInfo(std::string("t.") + std::string(Name(d)), d, {2, 4}));
  }
  tensors.push_back(MakeInfo("scalar", DType::kF32, {}));
  tensors.push_back(MakeInfo("empty", DType::kBF16, {0}));
  tensors.push_back(MakeInfo("empty2d", DType::kI64, {5, 0}));
  tensors.push_back(MakeInfo("4d", DType::kU16, {1, 2, 3, 4}));
  tensors.push_back(MakeInfo("empty.f4", DType::kF4, {0, 3}));
  const Metadata metadata = {{"format", "pt"},
                             {"zeta", "last? no, second"},
                             {"alpha", "q\"uo\\te\n"},
                             {"unicode", "\xc3\xa9t\xc3\xa9 \xe2\x9c\x93"},
                             {"empty", ""}};
  const auto file = Encode(tensors, metadata);
  auto parsed = Parse(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->metadata, metadata) << "metadata in file order";
  uint64_t data = 0;
  for (const auto& t : tensors) data += t.nbytes;
  EXPECT_EQ(parsed->data_bytes, data);
  EXPECT_EQ(8 + parsed->header_bytes + parsed->data_bytes, file.size());
  ASSERT_EQ(parsed->entries.size(), tensors.size());
  // Entries come back in data-offset order: the order given to the encoder
  // (empty tensors sort before a tensor at the same offset).
  uint64_t offset = 0;
  std::vector<TensorInfo> got;
  for (size_t i = 0; i < parsed->entries.size(); ++i) {
    const auto& e = parsed->entries[i];
    if (i > 0) {
      const auto& prev = parsed->entries[i - 1];
      EXPECT_EQ(e.offset, prev.offset + prev.info.nbytes);
    }
    EXPECT_GE(e.offset, offset);
    offset = e.offset;
    got.push_back(e.info);
  }
  for (const auto& t : tensors) {
    auto it = std::find_if(got.begin(), got.end(), [&](const TensorInfo& g) { return g.name == t.name; });
    ASSERT_NE(it, got.end()) << t.name;
    EXPECT_EQ(*it, t);
  }
  // Offsets of non-empty tensors follow the encoding order exactly.
  uint64_t expect_offset = 0;
  for (const auto& t : tensors) {
    auto it = std::find_if(parsed->entries.begin(), parsed->entries.end(),
                           [&](const SafetensorsEntry& e) { return e.info.name == t.name; });
    EXPECT_EQ(it->offset, expect_offset) << t.name;
    expect_offset += t.nbytes;
  }
}

TEST(SafetensorsTest, EmptyCheckpoint) {
  const auto file = Encode({});
  auto parsed = Parse(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_TRUE(parsed->entries.empty());
  EXPECT_TRUE(parsed->metadata.empty());
  EXPECT_EQ(parsed->data_bytes, 0u);
  // "{}" padded to 8.
  EXPECT_EQ(parsed->header_bytes, 8u);
}

TEST(SafetensorsTest, MetadataOnly) {
  auto parsed = Parse(Encode({}, {{"k", "v"}}));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->metadata, (Metadata{{"k", "v"}}));
}

TEST(SafetensorsTest, InvalidUtf8MetadataIsEncodedAsReplacement) {
  const Metadata metadata = {{"bad", std::string("a\xff"
                                                 "b")}};
  std::string header;
  ASSERT_NO_THROW(header = EncodeSafetensorsHeader({}, metadata));
  auto parsed = Parse(Encode({}, metadata));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->metadata.size(), 1u);
  EXPECT_EQ(parsed->metadata[0].second,
            "a\xef\xbf\xbd"
            "b");
}

TEST(SafetensorsTest, AcceptsHandWrittenFiles) {
  // Key order, whitespace and entry order differ from what we write.
  const std::string json = R"( {
    "b": {"shape": [2], "data_offsets": [4, 12], "dtype": "F32"},
    "__metadata__": {"format": "pt"},
    "a": {"data_offsets": [0, 4], "dtype": "BF16", "shape": [1, 2]}
  }  )";
  // Must start with '{': strip the leading space.
  const auto file = MakeFile(json.substr(1), 12);
  auto parsed = Parse(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->entries.size(), 2u);
  EXPECT_EQ(parsed->entries[0].info.name, "a");
  EXPECT_EQ(parsed->entries[0].offset, 0u);
  EXPECT_EQ(parsed->entries[1].info.name, "b");
  EXPECT_EQ(parsed->entries[1].offset, 4u);
  EXPECT_EQ(parsed->entries[1].info.shape, (std::vector<uint64_t>{2}));
  EXPECT_EQ(parsed->metadata, (Metadata{{"format", "pt"}}));
}

TEST(SafetensorsTest, EmptyTensorsMayShareOffsets) {
  const std::string json =
      R"({"e1":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("e0":{"dtype":"U8","shape":[0,2],"data_offsets":[0,0]},"e2":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}})";
  auto parsed = Parse(MakeFile(json, 4));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->entries.size(), 4u);
  EXPECT_EQ(parsed->entries[0].info.name, "e0");
  EXPECT_EQ(parsed->entries[1].info.name, "x");
}

TEST(SafetensorsTest, PrefixMayHoldMoreThanTheHeader) {
  auto file = Encode({MakeInfo("a", DType::kU8, {3})});
  auto parsed = ParseSafetensorsHeader(file, file.size());
  ASSERT_TRUE(parsed.ok());
  // Only the header bytes are needed.
  auto prefix_only =
      ParseSafetensorsHeader(std::span<const uint8_t>(file).first(8 + parsed->header_bytes), file.size());
  ASSERT_TRUE(prefix_only.ok()) << prefix_only.status().ToString();
  EXPECT_EQ(prefix_only->entries.size(), 1u);
  // A prefix shorter than the announced header is the caller's mistake.
  auto short_prefix = ParseSafetensorsHeader(std::span<const uint8_t>(file).first(10), file.size());
  EXPECT_EQ(short_prefix.status().code(), Code::kInternal);
}

// ----- Bad inputs --------------------------------------------------------

TEST(SafetensorsErrorsTest, FileShorterThanEightBytes) {
  for (size_t n = 0; n < 8; ++n) {
    std::vector<uint8_t> f(n, 0);
    ExpectError(Parse(f), Code::kDataLoss, {"truncated"});
  }
}

TEST(SafetensorsErrorsTest, HeaderLengthPastEndOfFile) {
  const std::string json = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  auto f = MakeFile(json, 1, json.size() + 100);
  ExpectError(Parse(f), Code::kDataLoss, {"truncated", "past the end"});
  // Only the 8 length bytes.
  ExpectError(Parse(MakeFile("", 0, 2)), Code::kDataLoss, {"truncated"});
  // Length near 2^64 must not wrap.
  ExpectError(Parse(MakeFile("{}", 0, std::numeric_limits<uint64_t>::max())), Code::kInvalidArgument, {"exceeds"});
}

TEST(SafetensorsErrorsTest, HeaderTooLarge) {
  ExpectError(Parse(MakeFile("{}", 0, kMaxSafetensorsHeaderBytes + 1)), Code::kInvalidArgument, {"100000000"});
}

TEST(SafetensorsErrorsTest, NotJson) {
  for (const char* bad : {"{", "{abc}", "{\"a\":}", "{\"a\":1,}", "{} trailing", "{}{}", "{'a':1}"}) {
    SCOPED_TRACE(bad);
    ExpectError(Parse(MakeFile(bad)), Code::kInvalidArgument, {"malformed"});
  }
  // Empty header, and headers not starting with '{'.
  ExpectError(Parse(MakeFile("")), Code::kInvalidArgument, {"'{'"});
  ExpectError(Parse(MakeFile(" {}")), Code::kInvalidArgument, {"'{'"});
  ExpectError(Parse(MakeFile("null")), Code::kInvalidArgument, {});
}

TEST(SafetensorsErrorsTest, InvalidUtf8) {
  // In a tensor name, in metadata, and outside any string.
  ExpectError(Parse(MakeFile("{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}")),
              Code::kInvalidArgument, {"UTF-8"});
  ExpectError(Parse(MakeFile("{\"__metadata__\":{\"k\":\"\xc3\x28\"}}")), Code::kInvalidArgument, {"UTF-8"});
  ExpectError(Parse(MakeFile("{\"__metadata__\":{\"k\":\"\xed\xa0\x80\"}}")), Code::kInvalidArgument,
              {"UTF-8"});  // an encoded surrogate
  ExpectError(Parse(MakeFile("{}\xff")), Code::kInvalidArgument, {});
}

TEST(SafetensorsErrorsTest, TopLevelNotAnObject) {
  ExpectError(Parse(MakeFile("[]")), Code::kInvalidArgument, {"malformed"});
  ExpectError(Parse(MakeFile("[{\"a\":1}]")), Code::kInvalidArgument, {"malformed"});
  ExpectError(Parse(MakeFile("\"str\"")), Code::kInvalidArgument, {"malformed"});
}

TEST(SafetensorsErrorsTest, EntryNotAnObject) {
  ExpectError(Parse(MakeFile(R"({"w":[1,2]})")), Code::kInvalidArgument, {"'w'", "object"});
  ExpectError(Parse(MakeFile(R"({"w":"F32"})")), Code::kInvalidArgument, {"'w'"});
}

TEST(SafetensorsErrorsTest, MissingFields) {
  for (const char* json :
       {R"({"w":{"shape":[1],"data_offsets":[0,1]}})", R"({"w":{"dtype":"U8","data_offsets":[0,1]}})",
        R"({"w":{"dtype":"U8","shape":[1]}})", R"({"w":{}})"}) {
    SCOPED_TRACE(json);
    ExpectError(Parse(MakeFile(json, 1)), Code::kInvalidArgument, {"'w'", "needs dtype, shape and data_offsets"});
  }
}

TEST(SafetensorsErrorsTest, WrongFieldTypes) {
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", 1)), Code::kInvalidArgument,
              {"'w'", "dtype"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"U8","shape":1,"data_offsets":[0,1]}})", 1)), Code::kInvalidArgument,
              {"'w'", "shape"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1)), Code::kInvalidArgument,
              {"'w'", "data_offsets"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 1)), Code::kInvalidArgument,
              {"'w'", "data_offsets"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":{"a":0}}})", 1)), Code::kInvalidArgument,
              {"'w'", "data_offsets"});
}

TEST(SafetensorsErrorsTest, BadShapeDims) {
  for (const char* dim : {"-1", "1.0", "1.5", "\"2\"", "null", "true", "[1]", "1e3", "18446744073709551616"}) {
    SCOPED_TRACE(dim);
    const std::string json = std::string(R"({"w":{"dtype":"U8","shape":[)") + dim + R"(],"data_offsets":[0,1]}})";
    ExpectError(Parse(MakeFile(json, 1)), Code::kInvalidArgument, {"'w'", "shape"});
  }
}

TEST(SafetensorsErrorsTest, BadDataOffsets) {
  for (const char* off : {"[-1,1]", "[0,-1]", "[0.0,1]", "[0,1.5]", "[\"0\",1]"}) {
    SCOPED_TRACE(off);
    const std::string json = std::string(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":)") + off + "}}";
    ExpectError(Parse(MakeFile(json, 1)), Code::kInvalidArgument, {"'w'", "data_offsets"});
  }
}

TEST(SafetensorsErrorsTest, UnknownDType) {
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16)),
              Code::kInvalidArgument, {"'w'", "F128"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"bf16","shape":[1],"data_offsets":[0,2]}})", 2)), Code::kInvalidArgument,
              {"'w'", "unknown dtype"});
}

TEST(SafetensorsErrorsTest, EndBeforeBegin) {
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 4)), Code::kInvalidArgument,
              {"'w'", "end before begin"});
}

TEST(SafetensorsErrorsTest, ByteCountMismatch) {
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,15]}})", 15)),
              Code::kInvalidArgument, {"'w'", "15 bytes", "16"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,3]}})", 3)), Code::kInvalidArgument,
              {"'w'"});
}

TEST(SafetensorsErrorsTest, Overlap) {
  const std::string json =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})";
  ExpectError(Parse(MakeFile(json, 6)), Code::kInvalidArgument, {"'b'", "overlap"});
  const std::string same =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})";
  ExpectError(Parse(MakeFile(same, 4)), Code::kInvalidArgument, {"overlap"});
  // An empty tensor inside another one's range.
  const std::string inside =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"e":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})";
  ExpectError(Parse(MakeFile(inside, 4)), Code::kInvalidArgument, {"'e'", "overlap"});
}

TEST(SafetensorsErrorsTest, Hole) {
  const std::string json =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})";
  ExpectError(Parse(MakeFile(json, 10)), Code::kInvalidArgument, {"'b'", "hole"});
  // First tensor not at 0.
  ExpectError(Parse(MakeFile(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", 3)), Code::kInvalidArgument,
              {"'a'", "hole"});
  // An empty tensor beyond the end.
  const std::string beyond =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"e":{"dtype":"U8","shape":[0],"data_offsets":[9,9]}})";
  ExpectError(Parse(MakeFile(beyond, 4)), Code::kInvalidArgument, {"'e'", "hole"});
}

TEST(SafetensorsErrorsTest, TrailingBytes) {
  ExpectError(Parse(MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 5)), Code::kInvalidArgument,
              {"1 bytes after the last tensor"});
  ExpectError(Parse(MakeFile("{}", 3)), Code::kInvalidArgument, {"3 bytes after"});
}

TEST(SafetensorsErrorsTest, TruncatedData) {
  ExpectError(Parse(MakeFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 15)), Code::kDataLoss,
              {"truncated", "16"});
  // A whole file cut anywhere inside its data.
  const auto full = Encode({MakeInfo("x", DType::kF32, {10}), MakeInfo("y", DType::kBF16, {3})});
  auto parsed = Parse(full);
  ASSERT_TRUE(parsed.ok());
  for (size_t cut = 8 + parsed->header_bytes; cut < full.size(); ++cut)
    EXPECT_EQ(ParseSafetensorsHeader(full, cut).status().code(), Code::kDataLoss) << cut;
  // Cut inside the header.
  EXPECT_EQ(ParseSafetensorsHeader(full, 8 + parsed->header_bytes - 1).status().code(), Code::kDataLoss);
}

TEST(SafetensorsErrorsTest, DuplicateNames) {
  const std::string json =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  ExpectError(Parse(MakeFile(json, 2)), Code::kInvalidArgument, {"duplicate", "'a'"});
  const std::string meta = R"({"__metadata__":{},"__metadata__":{}})";
  ExpectError(Parse(MakeFile(meta)), Code::kInvalidArgument, {"duplicate"});
}

TEST(SafetensorsErrorsTest, ElementCountOverflow) {
  const std::string json = R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})";
  ExpectError(Parse(MakeFile(json)), Code::kInvalidArgument, {"'w'", "overflows"});
  // Element count fits but the bit count does not.
  const std::string bytes = R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})";
  ExpectError(Parse(MakeFile(bytes)), Code::kInvalidArgument, {"'w'"});
}

TEST(SafetensorsErrorsTest, F4OddElementCount) {
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2)), Code::kInvalidArgument,
              {"'w'", "whole bytes"});
  ExpectError(Parse(MakeFile(R"({"w":{"dtype":"F6_E3M2","shape":[3],"data_offsets":[0,3]}})", 3)),
              Code::kInvalidArgument, {"'w'", "whole bytes"});
  // An even count is fine.
  EXPECT_TRUE(Parse(MakeFile(R"({"w":{"dtype":"F4","shape":[3,2],"data_offsets":[0,3]}})", 3)).ok());
}

TEST(SafetensorsErrorsTest, MetadataMustBeStrings) {
  for (const char* value : {"1", "null", "true", "[\"a\"]", "{\"x\":\"y\"}", "1.5"}) {
    SCOPED_TRACE(value);
    const std::string json = std::string(R"({"__metadata__":{"ok":"fine","key1":)") + value + "}}";
    ExpectError(Parse(MakeFile(json)), Code::kInvalidArgument, {"__metadata__", "'key1'"});
  }
  ExpectError(Parse(MakeFile(R"({"__metadata__":["a"]})")), Code::kInvalidArgument, {"__metadata__"});
  ExpectError(Parse(MakeFile(R"({"__metadata__":"x"})")), Code::kInvalidArgument, {"__metadata__"});
}

}  // namespace
}  // namespace dcr
