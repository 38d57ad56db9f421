#include "s3_xml.h"

#include <expat.h>
#include <fmt/format.h>

#include <cstring>

namespace dcr::s3xml {
namespace {

constexpr size_t kMaxDepth = 64;

struct ParseState {
  XML_Parser parser = nullptr;
  Element root;
  std::vector<Element*> stack;
  bool seen_root = false;
  std::string error;

  void Fail(std::string why) {
    if (error.empty()) error = std::move(why);
    XML_StopParser(parser, XML_FALSE);
  }
};

void OnStart(void* user, const XML_Char* name, const XML_Char**) {
  auto* st = static_cast<ParseState*>(user);
  if (st->stack.empty()) {
    if (st->seen_root) return st->Fail("more than one root element");
    st->seen_root = true;
    st->root.name = name;
    st->stack.push_back(&st->root);
    return;
  }
  if (st->stack.size() >= kMaxDepth) return st->Fail("elements nested too deeply");
  Element* parent = st->stack.back();
  parent->children.push_back(Element{name, {}, {}});
  st->stack.push_back(&parent->children.back());
}

void OnEnd(void* user, const XML_Char*) {
  auto* st = static_cast<ParseState*>(user);
  if (!st->stack.empty()) st->stack.pop_back();
}

void OnText(void* user, const XML_Char* s, int len) {
  auto* st = static_cast<ParseState*>(user);
  if (!st->stack.empty()) st->stack.back()->text.append(s, static_cast<size_t>(len));
}

// Rejects DTDs: S3 never sends one, and they are where entity expansion
// attacks live.
void OnDoctype(void* user, const XML_Char*, const XML_Char*, const XML_Char*, int) {
  static_cast<ParseState*>(user)->Fail("document type declarations are not accepted");
}

}  // namespace

const Element* Element::Child(std::string_view child) const {
  for (const auto& c : children)
    if (c.name == child) return &c;
  return nullptr;
}

const std::string& Element::ChildText(std::string_view child) const {
  static const std::string kEmpty;
  const Element* c = Child(child);
  return c != nullptr ? c->text : kEmpty;
}

Result<Element> Parse(std::string_view document) {
  ParseState st;
  st.parser = XML_ParserCreate("UTF-8");
  if (st.parser == nullptr) return Internal("XML_ParserCreate failed");
  XML_SetUserData(st.parser, &st);
  XML_SetElementHandler(st.parser, &OnStart, &OnEnd);
  XML_SetCharacterDataHandler(st.parser, &OnText);
  XML_SetStartDoctypeDeclHandler(st.parser, &OnDoctype);
  // Element pointers in `stack` must stay valid while children are added:
  // a child vector only grows while its element is the innermost open one,
  // and then no deeper pointer exists, so reallocation cannot dangle.
  const XML_Status rc = XML_Parse(st.parser, document.data(), static_cast<int>(document.size()), XML_TRUE);
  std::string error = st.error;
  if (rc != XML_STATUS_OK && error.empty())
    error = fmt::format("{} at line {} column {}", XML_ErrorString(XML_GetErrorCode(st.parser)),
                        XML_GetCurrentLineNumber(st.parser), XML_GetCurrentColumnNumber(st.parser));
  XML_ParserFree(st.parser);
  if (!error.empty()) return DataLoss("malformed XML response: " + error);
  if (!st.seen_root) return DataLoss("malformed XML response: no root element");
  return std::move(st.root);
}

std::string Escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace dcr::s3xml
