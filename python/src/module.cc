// dcr._dcr: nanobind bindings over the public C++ API (include/dcr/).
//
// Thin by rule (DESIGN house rule 9): every function here parses its
// arguments, converts them to the C++ types, calls one C++ entry point with
// the GIL released, and converts the result back. Protocol, delta and layout
// logic stays in C++.
//
// Errors: a non-OK dcr::Status becomes a Python exception in exactly one
// place, Raise() (bindings.cc), which asks dcr.errors for the class of its
// code. Each API area binds itself from a file of its own (bindings.h).
//
// Memory: checkpoint tensors are returned as numpy arrays over the mapped
// files (no copy; the array keeps the Checkpoint alive). Buffers passed in
// (torch tensors, numpy arrays) are read through DLPack / the buffer protocol
// without copying; they must be CPU, C-contiguous, flat uint8 views (the
// pure-Python layer, dcr._tensors, makes those views and checks dtypes).
#include "bindings.h"

using namespace dcr_python;

NB_MODULE(_dcr, m) {
  m.doc() = "dcr's C++ core (private: use the dcr package)";

  m.def(
      "_raise_status",
      [](const std::string& code, const std::string& message) {
        for (int c = 1; c <= static_cast<int>(dcr::Code::kInternal); ++c)
          if (dcr::CodeName(static_cast<dcr::Code>(c)) == code) Raise(dcr::Status(static_cast<dcr::Code>(c), message));
        Raise(dcr::InvalidArgument("unknown code " + code));
      },
      "code"_a, "message"_a, "Raises the exception a C++ Status of this code becomes (for tests).");

  BindCheckpoints(m);
  BindFileDeltas(m);
  BindDeltas(m);
  BindLayouts(m);
  BindStores(m);
  BindStoreFunctions(m);
  BindPublishers(m);
  BindRankFollower(m);
  BindShardPublisher(m);
  BindMetrics(m);
}
