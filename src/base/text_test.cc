#include "dcr/text.h"

#include <gtest/gtest.h>

#include <string>
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

}  // namespace
}  // namespace dcr
