#include "dcr/json.h"

#include <gtest/gtest.h>

namespace dcr {
namespace {

// A name, id or error message that is not UTF-8 is written, not thrown.
TEST(JsonTextTest, WritesStringsThatAreNotUtf8WithReplacementCharacters) {
  nlohmann::ordered_json doc = {{"receiver", "r\xff\xc3"}, {"n", 1}};
  std::string text;
  ASSERT_NO_THROW(text = JsonText(doc, 1));
  EXPECT_NE(text.find("\xef\xbf\xbd"), std::string::npos) << text;
  auto back = nlohmann::ordered_json::parse(text, nullptr, false);
  ASSERT_FALSE(back.is_discarded()) << text;
  EXPECT_EQ(back["n"], 1);
  nlohmann::json plain = {{"a", "ok"}};
  EXPECT_EQ(JsonText(plain), "{\"a\":\"ok\"}");
}

}  // namespace
}  // namespace dcr
