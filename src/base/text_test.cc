#include "dcr/text.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace dcr {
namespace {

TEST(TextTest, AcceptsWellFormedUtf8) {
  for (const std::string& s : std::vector<std::string>{
           "", "plain ascii", "receiver-1.example:42", "\xc3\xa9t\xc3\xa9", "\xe2\x82\xac", "\xed\x9f\xbf",
           "\xee\x80\x80", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf", std::string("nul\0inside", 10)})
    EXPECT_TRUE(IsValidUtf8(s)) << s;
}

TEST(TextTest, RefusesMalformedUtf8) {
  for (const std::string& s : std::vector<std::string>{
           "\x80",  // a lone continuation byte
           "\xc3",  // truncated
           "\xc3(",  // a bad continuation
           "\xc0\xaf",  // overlong '/'
           "\xc1\xbf",  // overlong
           "\xe0\x80\xaf",  // overlong
           "\xe0\x9f\xbf",  // overlong
           "\xed\xa0\x80",  // a surrogate (U+D800)
           "\xed\xbf\xbf",  // a surrogate (U+DFFF)
           "\xf0\x8f\xbf\xbf",  // overlong
           "\xf4\x90\x80\x80",  // above U+10FFFF
           "\xf5\x80\x80\x80",  // above U+10FFFF
           "\xff",  // never in UTF-8
           "ok\xe2\x82",  // truncated at the end
           "\xe2\x28\xa1",  // a bad second byte
           "\xe2\x82\x28",  // a bad third byte
       })
    EXPECT_FALSE(IsValidUtf8(s)) << testing::PrintToString(s);
}

// Every 1- and 2-byte sequence against a reference decoder.
TEST(TextTest, AgreesWithAReferenceOnEveryTwoByteInput) {
  auto reference = [](const std::string& s) {
    size_t i = 0;
    while (i < s.size()) {
      const unsigned c = static_cast<unsigned char>(s[i]);
      if (c < 0x80) {
        ++i;
        continue;
      }
      if (c < 0xC2 || c > 0xDF) return false;  // only 2-byte forms fit in 2 bytes
      if (i + 1 >= s.size() || (static_cast<unsigned char>(s[i + 1]) & 0xC0) != 0x80) return false;
      i += 2;
    }
    return true;
  };
  for (int a = 0; a < 256; ++a) {
    const std::string one(1, static_cast<char>(a));
    EXPECT_EQ(IsValidUtf8(one), reference(one)) << a;
    for (int b = 0; b < 256; ++b) {
      const std::string two{static_cast<char>(a), static_cast<char>(b)};
      EXPECT_EQ(IsValidUtf8(two), reference(two)) << a << " " << b;
    }
  }
}

TEST(TextTest, TensorNamesOrderNumbersByValue) {
  const std::vector<std::string> ordered = {"embed",
                                            "layers.1.mlp",
                                            "layers.2.mlp",
                                            "layers.10.mlp",
                                            "layers.10.mlp.experts.2",
                                            "layers.10.mlp.experts.10",
                                            "layers.10.mlp.experts.100",
                                            "layers.10.mlpx",
                                            "layers.010x",
                                            "layers.10x",
                                            "layers.a",
                                            "lm_head"};
  for (size_t i = 0; i < ordered.size(); ++i)
    for (size_t j = 0; j < ordered.size(); ++j)
      EXPECT_EQ(TensorNameLess(ordered[i], ordered[j]), i < j) << ordered[i] << " vs " << ordered[j];
  EXPECT_TRUE(TensorNameLess("a01", "a1"));  // numerically equal: byte order
  EXPECT_FALSE(TensorNameLess("a1", "a01"));
  EXPECT_TRUE(TensorNameLess("x99999999999999999999999", "x100000000000000000000000"));  // past 64 bits
}

// Against an independent definition: every digit run padded to one width,
// then byte order, ties broken by the names' bytes. Every name of up to four
// characters over digits, a letter and a dot.
TEST(TextTest, TensorNameOrderAgreesWithPaddedNumbersOnEveryShortName) {
  const std::string alphabet = "019a.";
  std::vector<std::string> names = {""};
  for (size_t begin = 0, len = 0; len < 4; ++len) {
    const size_t end = names.size();
    for (size_t i = begin; i < end; ++i)
      for (char c : alphabet) names.push_back(names[i] + c);
    begin = end;
  }
  const auto padded = [](const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size();) {
      if (s[i] < '0' || s[i] > '9') {
        out += s[i++];
        continue;
      }
      size_t e = i;
      while (e < s.size() && s[e] >= '0' && s[e] <= '9') ++e;
      out += std::string(8 - (e - i), '0') + s.substr(i, e - i);
      i = e;
    }
    return out;
  };
  ASSERT_EQ(names.size(), 781u);
  for (const std::string& a : names)
    for (const std::string& b : names) {
      const bool expected = std::pair(padded(a), a) < std::pair(padded(b), b);
      ASSERT_EQ(TensorNameLess(a, b), expected) << "'" << a << "' vs '" << b << "'";
    }
}

}  // namespace
}  // namespace dcr
