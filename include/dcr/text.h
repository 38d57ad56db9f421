// Checks on text that arrives from files, stores and peers.
#pragma once

#include <string_view>

namespace dcr {

// Whether `s` is well-formed UTF-8 (RFC 3629: shortest forms only, no
// surrogates, nothing above U+10FFFF).
bool IsValidUtf8(std::string_view s);

}  // namespace dcr
