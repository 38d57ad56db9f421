// Checks on text that arrives from files, stores and peers.
#pragma once

#include <string_view>

namespace dcr {

// Whether `s` is well-formed UTF-8 (RFC 3629: shortest forms only, no
// surrogates, nothing above U+10FFFF).
bool IsValidUtf8(std::string_view s);

// The order of tensor names in every tensor table: left to right, a run of
// ASCII digits against a run of digits by numeric value (any length, leading
// zeros aside), anything else byte by byte, a prefix first; so
// `layers.2.mlp` < `layers.10.mlp` and `experts.9` < `experts.10`. Names that
// differ only in leading zeros fall back to byte order: a strict total order.
bool TensorNameLess(std::string_view a, std::string_view b);

}  // namespace dcr
