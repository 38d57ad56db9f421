// The few S3 XML documents the driver reads (ListBucketResult, Error,
// InitiateMultipartUploadResult, CompleteMultipartUploadResult), parsed by
// expat into a small element tree. Internal to the s3 driver.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "dcr/status.h"

namespace dcr::s3xml {

struct Element {
  std::string name;  // local name (S3's default namespace is not expanded)
  std::string text;  // character data directly inside this element
  std::vector<Element> children;

  // The first child named `name`, or nullptr.
  const Element* Child(std::string_view child) const;
  // The text of the first child named `name`, or "".
  const std::string& ChildText(std::string_view child) const;
};

// Parses a whole document (well-formed XML 1.0; no DTD, at most 64 levels
// deep). kDataLoss with expat's message and position when malformed.
Result<Element> Parse(std::string_view document);

// Escapes &, <, >, " and ' for element text.
std::string Escape(std::string_view text);

}  // namespace dcr::s3xml
