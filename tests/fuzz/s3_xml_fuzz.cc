// Fuzzes the S3 XML reader (src/store/s3_xml.h) on the documents S3 servers
// send: ListBucketResult, Error, InitiateMultipartUploadResult,
// CompleteMultipartUploadResult. Any input must be rejected with kDataLoss or
// parse into a tree no deeper than the limit, from which the fields the
// driver reads can be taken. Never a crash, a leak or unbounded work; a
// document that opens with a DTD (entity expansion) is refused.
//
// When the first byte is '~' the rest is text for Escape instead: escaped
// and wrapped in an element, it must parse back to itself (text without
// bytes XML forbids or normalises).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "s3_xml.h"

namespace {

using dcr::s3xml::Element;

size_t Depth(const Element& e) {
  size_t d = 0;
  for (const auto& c : e.children) d = std::max(d, Depth(c));
  return d + 1;
}

// What the driver takes from each document it reads.
void ReadFields(const Element& doc) {
  size_t sink = 0;
  if (doc.name == "ListBucketResult") {
    for (const auto& el : doc.children) {
      if (el.name != "Contents") continue;
      sink += el.ChildText("Key").size() + el.ChildText("ETag").size() + el.ChildText("Size").size();
    }
    sink += doc.ChildText("IsTruncated").size() + doc.ChildText("NextContinuationToken").size();
  } else if (doc.name == "Error") {
    sink += doc.ChildText("Code").size() + doc.ChildText("Message").size() + doc.ChildText("Endpoint").size();
  } else {
    sink += doc.ChildText("UploadId").size() + doc.ChildText("ETag").size();
  }
  if (doc.Child("NoSuchChild") != nullptr || !doc.ChildText("NoSuchChild").empty()) std::abort();
  (void)sink;
}

bool EscapableText(std::string_view s) {
  for (unsigned char c : s) {
    // XML 1.0 forbids most control characters; '\r' is normalised to '\n';
    // stay in ASCII so there is no UTF-8 validity question.
    if (c >= 0x80 || c == '\r' || (c < 0x20 && c != '\n' && c != '\t')) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  if (!input.empty() && input[0] == '~') {
    const std::string_view text = input.substr(1);
    if (!EscapableText(text)) return 0;
    const std::string doc = "<Key>" + dcr::s3xml::Escape(text) + "</Key>";
    auto parsed = dcr::s3xml::Parse(doc);
    if (!parsed.ok() || parsed->name != "Key" || parsed->text != text || !parsed->children.empty()) std::abort();
    return 0;
  }
  auto doc = dcr::s3xml::Parse(input);
  if (doc.ok() && input.starts_with("<!DOCTYPE")) std::abort();  // DTDs are refused
  if (!doc.ok()) {
    if (doc.status().code() != dcr::Code::kDataLoss) std::abort();
    return 0;
  }
  if (Depth(*doc) > 64) std::abort();
  ReadFields(*doc);
  return 0;
}
